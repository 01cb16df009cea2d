"""Property-based fuzzing of the controller's external input: random, missing, huge and unicode
field values through the real gRPC API. Every answer is a result or a clear refusal (a status
with a message, never INTERNAL or UNKNOWN), and a refused request records nothing.

    FASTSHARE_FUZZ_EXAMPLES=2000 make pytest PYTEST_ARGS='tests/controller/test_fuzz.py -s'
"""

from __future__ import annotations

import math
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastshare.v1 import controller_pb2 as pb

EXAMPLES = int(os.environ.get("FASTSHARE_FUZZ_EXAMPLES", "300"))
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS}

texts = st.text(max_size=40) | st.sampled_from(["", "3g.20gb", "1g.5gb", "*A100*", "L4", "ü" * 300,
                                                "a" * 5000])
u32 = st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 7, 14, 30, 100, 101, 2**32 - 1])
u64 = st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2**30, 8 * 2**30, 2**63, 2**64 - 1])
fractions = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.1, 0.5, 1.0, -0.1, 1.5])
wild_specs = st.builds(
    pb.AllocationSpec, kind=st.integers(0, 6), sm_percent=u32, memory_bytes=u64, quota_request=fractions,
    quota_limit=fractions, mig_profile=texts, sm_count=u32, gpu_count=u32,
    models=st.lists(texts, max_size=3), node_selector=st.dictionaries(texts, texts, max_size=2),
    affinity=texts, anti_affinity=texts, exclusion=texts)
# Near-valid requests too, so that the fuzzing also reaches placement and the agents.
GiB = 2**30
models = st.lists(st.sampled_from(["*A100*", "L4", "H100*", "V100"]), max_size=2)
plausible_specs = st.one_of(
    st.builds(pb.AllocationSpec, kind=st.just(1), sm_percent=st.integers(1, 100),
              memory_bytes=st.integers(1, 20).map(lambda g: g * GiB),
              quota_request=st.sampled_from([0.0, 0.2]),
              quota_limit=st.sampled_from([0.0, 0.1, 0.5]), models=models),
    st.builds(pb.AllocationSpec, kind=st.just(2), memory_bytes=st.integers(1, 90).map(lambda g: g * GiB),
              models=models),
    st.builds(pb.AllocationSpec, kind=st.just(3),
              mig_profile=st.sampled_from(["1g.5gb", "3g.40gb", "7g.80gb"])),
    st.builds(pb.AllocationSpec, kind=st.just(3), sm_count=st.integers(1, 140)),
    st.builds(pb.AllocationSpec, kind=st.just(4), gpu_count=st.integers(1, 3), models=models))
requests = st.builds(pb.AllocateRequest, spec=st.one_of(wild_specs, plausible_specs, plausible_specs),
                     owner=st.just("fuzz") | texts, idempotency_key=st.just("") | texts,
                     lease_ttl_seconds=st.just(0) | u32)


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory):
    from .conftest import Cluster

    cluster = Cluster(tmp_path_factory.mktemp("fuzz"))
    cluster.add_machine("node-a", ["A100-SXM4-40GB"], mig_enabled=True)
    cluster.add_machine("node-b", ["H100-SXM5-80GB", "L4"])
    cluster.start_controller()
    cluster.start_agent("node-a")
    cluster.start_agent("node-b")
    yield cluster
    cluster.close()


def test_allocate_answers_every_input_clearly(fuzz_cluster, capsys) -> None:
    client = fuzz_cluster.client()
    seen = {"inputs": 0, "allocated": 0, "refused": 0}

    def recorded() -> set[str]:
        listed = client.call("List", pb.ListAllocationsRequest(include_finished=True))
        return {a.id for a in listed.allocations}

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=requests)
    def check(request: pb.AllocateRequest) -> None:
        seen["inputs"] += 1
        before = recorded()
        try:
            allocation = client.call("Allocate", request, timeout=60)
        except grpc.RpcError as exc:
            assert exc.code() in REFUSALS, (exc.code(), exc.details(), request)
            assert exc.details(), request
            after = recorded()
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:   # an idempotency key reused with another spec
                return
            assert after == before, f"a refused request left {after - before}"
            seen["refused"] += 1
            return
        if allocation.state == pb.ALLOCATION_STATE_RELEASED:
            assert request.idempotency_key, "a new allocation came back released"
            return   # the key named an allocation an earlier example made and released: same answer
        seen["allocated"] += 1
        assert allocation.state == pb.ALLOCATION_STATE_ACTIVE
        for value in (request.spec.quota_request, request.spec.quota_limit):
            assert math.isfinite(value) and 0 <= value <= 1
        client.call("Release", pb.ReleaseAllocationRequest(allocation_id=allocation.id), timeout=60)

    check()
    with capsys.disabled():
        print(f"\nfuzz Allocate: {seen['inputs']} inputs, {seen['allocated']} allocated, "
              f"{seen['refused']} refused clearly, 0 internal errors")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(allocation_id=texts, ttl=u32, node=texts, schedulable=st.booleans(), reason=texts)
def test_other_calls_refuse_clearly(fuzz_cluster, allocation_id, ttl, node, schedulable, reason) -> None:
    client = fuzz_cluster.client()
    calls = [("Release", pb.ReleaseAllocationRequest(allocation_id=allocation_id)),
             ("Get", pb.GetAllocationRequest(allocation_id=allocation_id)),
             ("RenewLease", pb.RenewLeaseRequest(allocation_id=allocation_id, ttl_seconds=ttl)),
             ("SetSchedulable", pb.SetSchedulableRequest(node=node, schedulable=schedulable, reason=reason))]
    try:
        for method, request in calls:
            try:
                client.call(method, request, timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() in REFUSALS and exc.details(), (method, exc.code(), exc.details())
    finally:
        client.close()
        for name in ("node-a", "node-b"):   # a fuzzed SetSchedulable may have hit a real node
            client = fuzz_cluster.client()
            client.call("SetSchedulable", pb.SetSchedulableRequest(node=name, schedulable=True), timeout=30)
            client.close()
