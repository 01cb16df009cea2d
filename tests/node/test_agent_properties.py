"""Invariants of the agent core under random prepare/release sequences (in process, simulated
NVML, real MPS stand-in daemons, real SQLite journal), and after a restart on the same journal:

- capacity is never over-committed (SM %, quota request, whole GPUs exclusive);
- share files list exactly the fastpod shares of each device;
- an MPS daemon runs exactly for the devices with MPS shares;
- the MIG instances on the GPU are exactly those of the exclusive shares, all journaled;
- a refused request changes nothing;
- reconciling a consistent node changes nothing.
"""

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastshare.device import simnvml
from fastshare.node import sharefiles
from fastshare.node.agent import Agent, AgentError, Deadline
from fastshare.node.model import ShareSpec

from .harness import in_process_agent

_op = st.one_of(
    st.tuples(st.just("fastpod"), st.integers(0, 5), st.sampled_from([1, 2]), st.sampled_from([20, 40, 60]),
              st.sampled_from([0.2, 0.4, 0.7])),
    st.tuples(st.just("mps"), st.integers(0, 5), st.sampled_from([1, 2]), st.just(0), st.just(0.0)),
    st.tuples(st.just("exclusive"), st.integers(0, 5), st.just(0),
              st.sampled_from(["1g.10gb", "3g.40gb", "4g.40gb"]), st.just(0.0)),
    st.tuples(st.just("whole"), st.integers(0, 5), st.sampled_from([1, 2]), st.just(0), st.just(0.0)),
    st.tuples(st.just("release"), st.integers(0, 5), st.just(0), st.just(0), st.just(0.0)),
)


def _spec(op, uuids) -> ShareSpec:
    kind, n, gpu, x, q = op
    sid = f"s{n}"
    if kind == "fastpod":
        return ShareSpec(sid, kind, (uuids[gpu],), sm_percent=x, memory_bytes=1 << 30, quota_request=q,
                         quota_limit=1.0)
    if kind == "mps":
        return ShareSpec(sid, kind, (uuids[gpu],), memory_bytes=2 << 30)
    if kind == "exclusive":
        return ShareSpec(sid, kind, (uuids[0],), mig_profile=x)
    return ShareSpec(sid, kind, (uuids[gpu],))


def _state(agent: Agent, root: Path):
    devices = agent.devices
    return (tuple(sorted((r.spec.id, r.state, r.device_uuid) for r in agent.journal.shares())),
            tuple(sorted((m.uuid, m.start) for m in devices.mig_instances(0))),
            tuple(agent.mps.running_devices()),
            tuple((d, tuple(sharefiles.read(root, d))) for d in sharefiles.devices(root)))


def _check(agent: Agent, root: Path) -> None:
    shares = [r for r in agent.journal.shares()]
    assert all(r.state == "ready" for r in shares)
    by_device: dict[str, list] = {}
    for r in shares:
        for d in (r.spec.device_uuids if r.spec.kind == "whole" else (r.device_uuid,)):
            by_device.setdefault(d, []).append(r.spec)
    for d, specs in by_device.items():
        assert sum(s.sm_percent for s in specs) <= 100
        assert sum(s.quota_request for s in specs) <= 1.0 + 1e-9
        if any(s.kind in ("whole", "exclusive") for s in specs):
            assert len(specs) == 1, specs
        files = {e.key for e in sharefiles.read(root, d)}
        assert files == {s.id for s in specs if s.kind == "fastpod"}
    assert set(sharefiles.devices(root)) <= set(by_device)
    mps_devices = {d for d, specs in by_device.items() if any(s.kind in ("fastpod", "mps") for s in specs)}
    assert set(agent.mps.running_devices()) == mps_devices
    assert {r.device_uuid for r in agent.journal.mps_daemons()} == mps_devices
    instances = {m.uuid for m in agent.devices.mig_instances(0)}
    assert instances == {r.device_uuid for r in shares if r.spec.kind == "exclusive"}
    assert {m.mig_uuid for m in agent.journal.migs()} == instances


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, min_size=1, max_size=10))
def test_random_sequences_keep_the_node_consistent_across_a_restart(ops):
    work = Path(tempfile.mkdtemp(prefix="fsp-"))
    run = Path(tempfile.mkdtemp(prefix="fsp-", dir="/tmp"))
    machine = work / "m.json"
    simnvml.create_machine(machine, ["H100-SXM5-80GB", "V100-SXM2-32GB", "V100-SXM2-32GB"], mig_enabled=True)
    agent = in_process_agent(work, run, machine)
    try:
        uuids = [g.uuid for g in agent.devices.gpus()]
        root = agent.config.share_root
        for op in ops:
            before = _state(agent, root)
            try:
                if op[0] == "release":
                    agent.release(f"s{op[1]}", Deadline(60))
                else:
                    agent.prepare(_spec(op, uuids), Deadline(60))
            except AgentError as exc:
                assert exc.code in ("RESOURCE_EXHAUSTED", "ALREADY_EXISTS", "FAILED_PRECONDITION"), exc
                assert _state(agent, root) == before
            _check(agent, root)
        settled = _state(agent, root)
        agent.journal.close()
        agent = in_process_agent(work, run, machine)  # restart on the same journal: nothing to repair
        assert _state(agent, root) == settled
        _check(agent, root)
    finally:
        for device in agent.mps.running_devices():
            agent.mps.stop(device)
        agent.journal.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)
