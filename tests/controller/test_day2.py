"""Day-2 operations across the controller and the agents (real processes, simulated GPUs):
hardware replaced under live allocations, nodes taken out for good, long runs."""

from __future__ import annotations

import json
import sqlite3

import grpc
import pytest

from fastshare.device import simnvml
from fastshare.v1 import controller_pb2 as pb

from .conftest import GiB, allocate, assert_consistent, states, wait_for


@pytest.fixture
def one_node(cluster):
    cluster.add_machine("n1", ["V100-SXM2-32GB", "V100-SXM2-32GB"])
    cluster.start_controller()
    cluster.start_agent("n1")
    return cluster


def _replace_gpu(machine, index: int) -> str:
    """The host goes down, GPU ``index`` is swapped for a new board (same slot, new UUID), it
    boots again: what NVML then reports. Returns the new UUID."""
    simnvml.reboot(machine)
    data = json.loads(machine.read_text())
    new = "GPU-00000000-1111-2222-3333-444444444444"
    data["gpus"][index]["uuid"] = new
    machine.write_text(json.dumps(data))
    return new


def test_a_gpu_replaced_under_its_shares_ends_their_allocations(one_node):
    """A GPU swapped (same index, new UUID) while a fastpod share and a whole GPU were on it:
    the allocations named a GPU the node no longer has. The agent kept their shares as ready
    forever (its daemon failing at every start), so the controller took the allocations for
    healthy and kept the new GPU's capacity held by them. Now the agent drops a share whose
    GPU is gone at start, the controller cannot prepare it again and ends the allocation with
    the reason, and the new GPU is free."""
    cluster = one_node
    client = cluster.client()
    share = allocate(client, "fastpod", sm_percent=50, memory_bytes=4 * GiB)
    whole = allocate(client, "whole", gpu_count=1)
    assert {share.devices[0].gpu_index, whole.devices[0].gpu_index} == {0, 1}
    old = {a.id: a.devices[0].gpu_uuid for a in (share, whole)}

    cluster.agents["n1"].stop()
    new_uuid = _replace_gpu(cluster.root / "n1.json", share.devices[0].gpu_index)
    cluster.start_agent("n1")

    def settled() -> bool:
        s = states(cluster)
        return s[share.id] in ("released", "failed") and s[whole.id] == "active"
    wait_for(settled, 60, f"the allocation on the replaced GPU ended: {states(cluster)}")
    ended = client.call("Get", pb.GetAllocationRequest(allocation_id=share.id))
    assert old[share.id] in ended.reason, ended.reason
    assert_consistent(cluster)
    # the new board takes work: a whole GPU fits on it
    again = allocate(client, "whole", gpu_count=1)
    assert again.devices[0].gpu_uuid == new_uuid


@pytest.mark.parametrize("controller_down", [False, True], ids=["agent-restarts", "controller-down-too"])
def test_a_gpu_removed_from_a_node_leaves_the_others_held_where_they_are(cluster, controller_down):
    """A node's GPU 1 is taken out (or fell off the bus) and the host boots without it: NVML
    numbers the GPUs after it anew, so the one that was GPU 2 is GPU 1 now. The controller kept
    allocations by GPU index: on re-registration the fastpod share on old GPU 2 was dropped
    from the placement engine (GPU 2 no longer existed; only an error was logged) while its
    record stayed active, and once the allocation on the removed GPU ended, new work went onto
    the fastpod's GPU as if it were free (SM shares over 100 %); `fastshare status` counted
    shares on the wrong GPUs. Now an allocation follows its GPU by UUID (the record is
    rewritten with the new index) and one whose GPU is gone is ended naming that GPU. With
    the controller down too, the records are an earlier version's (no UUIDs in the assignment)."""
    cluster.add_machine("n1", ["V100-SXM2-32GB"] * 3)
    cluster.start_controller()
    cluster.start_agent("n1")
    client = cluster.client()
    first = allocate(client, "whole", gpu_count=1)
    removed = allocate(client, "whole", gpu_count=1)
    share = allocate(client, "fastpod", sm_percent=60, memory_bytes=4 * GiB)
    assert [a.devices[0].gpu_index for a in (first, removed, share)] == [0, 1, 2]
    uuid = {a.id: a.devices[0].gpu_uuid for a in (first, removed, share)}

    cluster.agents["n1"].stop()
    if controller_down:
        cluster.controller.stop()
        with sqlite3.connect(cluster.state_dir / "state.db") as db:   # as an earlier version wrote them
            for rid, text in db.execute("SELECT id, assignment FROM allocations").fetchall():
                old = {k: v for k, v in json.loads(text).items() if k != "gpu_uuids"}
                db.execute("UPDATE allocations SET assignment = ? WHERE id = ?", (json.dumps(old), rid))
    assert simnvml.remove_gpu(cluster.root / "n1.json", 1) == uuid[removed.id]
    if controller_down:   # the agent is up first: the controller starts on its new inventory
        agent = cluster.start_agent("n1", wait=False)
        wait_for(lambda: agent.share_ids(cluster.pki) == {share.id, first.id}, 60, "the agent serves")
        cluster.start_controller()
        cluster.wait_node("n1", available=True)
    else:
        cluster.start_agent("n1")

    wait_for(lambda: states(cluster)[removed.id] in ("released", "failed"), 60,
             f"the allocation on the removed GPU ended: {states(cluster)}")
    ended = client.call("Get", pb.GetAllocationRequest(allocation_id=removed.id))
    assert uuid[removed.id] in ended.reason and "no longer on node n1" in ended.reason, ended.reason
    wait_for(lambda: client.call("Get", pb.GetAllocationRequest(allocation_id=share.id)).devices[0].gpu_index
             == 1, 30, "the fastpod's record names its GPU's new index")
    held = [client.call("Get", pb.GetAllocationRequest(allocation_id=i)) for i in (first.id, share.id)]
    assert {a.id: (pb.AllocationState.Name(a.state), [(d.gpu_index, d.gpu_uuid) for d in a.devices])
            for a in held} == {first.id: ("ALLOCATION_STATE_ACTIVE", [(0, uuid[first.id])]),
            share.id: ("ALLOCATION_STATE_ACTIVE", [(1, uuid[share.id])])}
    gpus = {g.uuid: g for g in cluster.node("n1").gpus}
    assert sorted(gpus) == sorted([uuid[first.id], uuid[share.id]])
    assert list(gpus[uuid[first.id]].allocation_ids) == [first.id] and gpus[uuid[first.id]].whole_held
    assert list(gpus[uuid[share.id]].allocation_ids) == [share.id]
    assert (gpus[uuid[share.id]].index, gpus[uuid[share.id]].sm_percent_used) == (1, 60)
    # what is held stays held: no idle GPU, and the fastpod's GPU has 40 % of its SMs left
    for kind, kw in (("whole", {"gpu_count": 1}), ("fastpod", {"sm_percent": 50, "memory_bytes": GiB})):
        with pytest.raises(grpc.RpcError) as refused:
            allocate(client, kind, **kw)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert allocate(client, "fastpod", sm_percent=40, memory_bytes=GiB).devices[0].gpu_uuid == uuid[share.id]
    assert_consistent(cluster)


def test_a_node_taken_out_for_good_can_be_forgotten(cluster):
    """A node decommissioned with allocations on it: its agent is gone for good, so a release
    stayed `releasing` forever, the records (and the node in `fastshare status`) stayed for good
    and nothing could clean them up. `fastshare forget-node NODE` now ends its allocations with
    the reason and forgets the node; it is refused while the agent still heartbeats. An agent
    that comes back under that name later registers as a new node, and the share it still holds
    is freed as an orphan."""
    import subprocess

    from .conftest import fastshare_bin

    cluster.add_machine("gone", ["L4"])
    cluster.add_machine("stays", ["V100-SXM2-32GB"])
    cluster.start_controller()
    cluster.start_agent("gone")
    cluster.start_agent("stays")
    client = cluster.client()
    share = allocate(client, "fastpod", sm_percent=20, memory_bytes=GiB, models=["L4"])
    releasing = allocate(client, "whole", gpu_count=1, models=["V100*"])
    assert share.node == "gone" and releasing.node == "stays"

    def forget(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([fastshare_bin(), "forget-node", "gone", "--yes", "--reason", "host retired",
                               *extra, "--controller", cluster.address, "--tls-dir", str(cluster.pki.dir)],
                              capture_output=True, text=True, timeout=60)

    refused = forget()
    assert refused.returncode == 1 and "still heartbeats" in refused.stderr, refused
    assert states(cluster)[share.id] == "active"

    cluster.agents["gone"].stop()
    cluster.wait_node("gone", available=False)
    done = forget("--json")
    assert done.returncode == 0, done.stderr
    assert [a["id"] for a in json.loads(done.stdout)["ended"]] == [share.id]
    status = cluster.status()
    assert [n.name for n in status.nodes] == ["stays"]
    ended = client.call("Get", pb.GetAllocationRequest(allocation_id=share.id))
    assert ended.state == pb.ALLOCATION_STATE_RELEASED and "host retired" in ended.reason
    assert states(cluster)[releasing.id] == "active"   # other nodes untouched

    # the host comes back under the same name, its journal still holding the share
    cluster.start_agent("gone")
    wait_for(lambda: share.id not in cluster.agents["gone"].share_ids(cluster.pki), 60,
             "the forgotten allocation's share freed as an orphan")
    assert_consistent(cluster)
    assert allocate(client, "fastpod", sm_percent=100, memory_bytes=GiB, models=["L4"]).node == "gone"
