"""Property-based fuzzing of the node agent's external input (PrepareShare / ReleaseShare over
the real unix socket): every answer is a result or a clear refusal, never INTERNAL, and a
refused request changes nothing on the node.

    FASTSHARE_FUZZ_EXAMPLES=2000 make pytest PYTEST_ARGS='tests/node/test_fuzz.py -s'
"""

from __future__ import annotations

import os

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastshare.v1 import agent_pb2

EXAMPLES = int(os.environ.get("FASTSHARE_FUZZ_EXAMPLES", "300"))
INV = agent_pb2.GetInventoryRequest()
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS}

texts = st.text(max_size=40) | st.sampled_from(["", "x", "a" * 129, "ü" * 200, "1g.10gb", "3g.40gb"])


def node_state(stub) -> tuple:
    inv = stub.GetInventory(INV, timeout=30)
    return (sorted(s.id for s in inv.shares), sorted(d.device_uuid for d in inv.mps_daemons),
            sorted(m.uuid for g in inv.gpus for m in g.mig_devices))


def test_prepare_share_answers_every_input_clearly(agent, capsys) -> None:
    agent.start()
    stub = agent.unix()
    uuids = [g.uuid for g in stub.GetInventory(INV, timeout=30).gpus]
    mig_devices = [m.uuid for g in stub.GetInventory(INV, timeout=30).gpus for m in g.mig_devices]
    devices = st.lists(st.sampled_from(uuids + mig_devices) | texts, max_size=3)
    shares = st.builds(
        agent_pb2.Share, id=st.sampled_from(["s1", "s2", "s3"]) | texts, kind=st.integers(0, 6),
        device_uuids=devices, mig_profile=texts,
        sm_percent=st.integers(0, 2**32 - 1) | st.integers(0, 101), memory_bytes=st.integers(0, 2**64 - 1),
        quota_request=st.floats(allow_nan=True, allow_infinity=True),
        quota_limit=st.floats(allow_nan=True, allow_infinity=True), owner=texts)
    gpu = st.sampled_from(uuids)
    plausible = st.one_of(
        st.builds(agent_pb2.Share, id=st.just("p1"), kind=st.just(1), device_uuids=gpu.map(lambda u: [u]),
                  sm_percent=st.integers(1, 100), memory_bytes=st.integers(1, 30).map(lambda g: g << 30),
                  quota_request=st.sampled_from([0.1, 0.3]), quota_limit=st.sampled_from([0.3, 1.0])),
        st.builds(agent_pb2.Share, id=st.just("p2"), kind=st.just(2), device_uuids=gpu.map(lambda u: [u]),
                  memory_bytes=st.integers(0, 30).map(lambda g: g << 30)),
        st.builds(agent_pb2.Share, id=st.just("p3"), kind=st.just(3), device_uuids=gpu.map(lambda u: [u]),
                  mig_profile=st.sampled_from(["1g.10gb", "3g.40gb", "1g.5gb"])),
        st.builds(agent_pb2.Share, id=st.just("p4"), kind=st.just(4),
                  device_uuids=st.lists(gpu, min_size=1, max_size=2, unique=True)))
    shares = shares | plausible
    seen = {"inputs": 0, "prepared": 0, "refused": 0}

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(share=shares, mig_start=st.none() | st.integers(0, 2**32 - 1))
    def check(share: agent_pb2.Share, mig_start: int | None) -> None:
        if mig_start is not None:
            share.mig_start = mig_start
        seen["inputs"] += 1
        before = node_state(stub)
        try:
            stub.PrepareShare(agent_pb2.PrepareShareRequest(share=share), timeout=60)
        except grpc.RpcError as exc:
            assert exc.code() in REFUSALS and exc.details(), (exc.code(), exc.details(), share)
            assert node_state(stub) == before, "a refused request changed the node"
            seen["refused"] += 1
            return
        seen["prepared"] += 1
        stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id=share.id), timeout=60)

    check()
    assert node_state(stub) == ([], [], [])
    with capsys.disabled():
        print(f"\nfuzz PrepareShare: {seen['inputs']} inputs, {seen['prepared']} prepared and released, "
              f"{seen['refused']} refused clearly, 0 internal errors")
