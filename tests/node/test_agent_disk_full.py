"""The agent's journal runs out of space while the agent runs (root: a real 4 MiB tmpfs as the
state directory, filled with a ballast file): requests that must be journaled answer
UNAVAILABLE saying so and change nothing on the GPUs, what was recorded before stays, the
agent keeps serving, and once space returns it works again and a restart finds everything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
import pytest

from fastshare.device import simnvml
from fastshare.v1 import agent_pb2

from .harness import GPU_A, GPU_B, GPU_MIG, fastpod, share

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small file system")
INV = agent_pb2.GetInventoryRequest()


@pytest.fixture
def small_state(agent):
    """The agent's state directory on a 4 MiB tmpfs."""
    state = agent.workdir / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(state)], check=True)
    yield state
    agent.stop()
    subprocess.run(["umount", "-l", str(state)], check=False)


def _fill(directory: Path) -> Path:
    ballast = directory / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        for size in (65536, 4096, 512, 1):   # to the last byte: SQLite gets no page from it
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    return ballast


def _requests(uuids: list[str]):
    """Every kind of share, over and over (small ones: capacity is not what runs out)."""
    n = 0
    while True:
        n += 1
        if n % 3 == 0:
            yield share(f"mig-{n}", "exclusive", [uuids[GPU_MIG]], mig_profile="1g.10gb")
        else:
            yield fastpod(f"fp-{n}", uuids[GPU_A if n % 3 == 1 else GPU_B], sm=1, mem_gib=0.01, req=0.01,
                          lim=0.01)


def test_full_journal_disk_at_run_time_answers_unavailable_and_loses_nothing(agent, small_state, sim_machine,
                                                                             capsys):
    agent.start()
    stub = agent.unix()
    uuids = [g.uuid for g in stub.GetInventory(INV, timeout=30).gpus]
    kept = [fastpod("kept", uuids[GPU_A]), share("kept-mig", "exclusive", [uuids[GPU_MIG]],
                                                  mig_profile="1g.10gb")]
    for request in kept:
        stub.PrepareShare(request, timeout=60)

    ballast = _fill(small_state)
    prepared, failure = [], None
    for request in _requests(uuids):   # the WAL may still have room for a few commits
        machine = simnvml.load_machine(sim_machine)
        before = {s.id for s in stub.GetInventory(INV, timeout=30).shares}
        try:
            stub.PrepareShare(request, timeout=60)
            prepared.append(request.share.id)
        except grpc.RpcError as exc:
            failure = exc
            break
        assert len(prepared) < 200, "every PrepareShare succeeded on a full disk"
    assert failure.code() == grpc.StatusCode.UNAVAILABLE, (failure.code(), failure.details())
    assert "cannot be written" in failure.details() and "free space" in failure.details()
    # Nothing of the refused share exists: not in the journal, not on the (simulated) GPUs.
    inventory = stub.GetInventory(INV, timeout=30)
    assert {s.id for s in inventory.shares} == before
    assert simnvml.load_machine(sim_machine)["gpus"] == machine["gpus"]
    # A release cannot be journaled either: refused the same way, and the share stays.
    refused = None
    try:
        stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="kept"), timeout=60)
    except grpc.RpcError as exc:
        refused = exc
    if refused is not None:
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "free space" in refused.details()
        assert "kept" in {s.id for s in stub.GetInventory(INV, timeout=30).shares}
    assert agent.proc.poll() is None, "the agent exited on a full disk"

    # Space returns: the refused request now succeeds, and a restart finds every share.
    ballast.unlink()
    stub.PrepareShare(request, timeout=60)
    recorded = {s.id for s in stub.GetInventory(INV, timeout=30).shares}
    expected = {r.share.id for r in kept} | set(prepared) | {request.share.id}
    if refused is None:
        expected.discard("kept")
    assert recorded == expected
    agent.stop()
    agent.start()
    assert {s.id for s in agent.unix().GetInventory(INV, timeout=30).shares} == expected
    for share_id in sorted(expected):
        agent.unix().ReleaseShare(agent_pb2.ReleaseShareRequest(share_id=share_id), timeout=60)
    inventory = agent.unix().GetInventory(INV, timeout=30)
    assert not inventory.shares and not inventory.mps_daemons
    with capsys.disabled():
        print(f"\njournal disk full: {len(prepared)} PrepareShare still fit in the WAL, then "
              f"{failure.code().name}: {failure.details()!r}; ReleaseShare "
              f"{'refused: ' + refused.details() if refused else 'still fit'}; {len(expected)} shares kept "
              "across the refusal, the space coming back and a restart")
