"""Day-2 operations across the controller and the agents (real processes, simulated GPUs):
hardware replaced under live allocations, nodes taken out for good, long runs."""

from __future__ import annotations

import json
import sqlite3
import subprocess

import grpc
import pytest

from fastshare.device import simnvml
from fastshare.v1 import controller_pb2 as pb

from .conftest import GiB, allocate, assert_consistent, fastshare_bin, states, wait_for


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


OVER = "over-committed"


def _wide() -> dict[str, str]:
    """A terminal wide enough that `fastshare status` does not fold a reason."""
    import os

    return {**os.environ, "COLUMNS": "400"}


def _reasons(client, ids) -> dict[str, str]:
    return {i: client.call("Get", pb.GetAllocationRequest(allocation_id=i)).reason for i in ids}


def test_mps_shares_over_a_lowered_oversubscription_stay_held_and_the_gpu_takes_nothing_new(cluster):
    """The controller restarted with a lower MPS oversubscription factor (2 -> 1) under three
    20 GiB mps shares on a 32 GiB GPU: the two that no longer fitted were only logged and left
    out of the placement engine, which then saw 12 GiB free and promised it again (the agent,
    with its own factor 2, accepted: more over-commit). Now all stay counted, the GPU takes
    nothing new until enough is released, and the allocations' reason says they are
    over-committed and why; a share the agent lost is not prepared again over the GPU but ended
    with the reason."""
    from fastshare.v1 import agent_pb2

    cluster.add_machine("n1", ["V100-SXM2-32GB"])
    cluster.start_controller(extra=["--mps-oversubscription", "2"])
    cluster.start_agent("n1", config={"mps_memory_oversubscription": 2.0})
    client = cluster.client()
    held = [allocate(client, "mps", memory_bytes=20 * GiB).id for _ in range(3)]

    cluster.controller.stop()
    cluster.start_controller()   # the default factor, 1
    cluster.wait_node("n1", available=True)

    with pytest.raises(grpc.RpcError) as refused:
        allocate(client, "mps", memory_bytes=4 * GiB)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    wait_for(lambda: sum(OVER in r for r in _reasons(client, held).values()) == 2, 30,
             f"two allocations say they are over-committed: {_reasons(client, held)}")
    over = [i for i, r in _reasons(client, held).items() if OVER in r]
    reason = _reasons(client, over)[over[0]]
    assert "n1 GPU 0" in reason and "MPS shares may promise 1 x its 32 GiB" in reason, reason
    assert all(s == "active" for i, s in states(cluster).items() if i in held)

    # a share the agent lost (dropped behind the controller's back) is not prepared again
    lost = over[0]
    agent = cluster.agents["n1"].stub(cluster.pki)
    agent.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id=lost), timeout=30)
    wait_for(lambda: states(cluster)[lost] == "released", 30, f"the lost share ended: {states(cluster)}")
    ended = _reasons(client, [lost])[lost]
    assert "cannot be prepared again" in ended and "n1 GPU 0" in ended, ended
    assert lost not in cluster.agents["n1"].share_ids(cluster.pki)
    with pytest.raises(grpc.RpcError):   # 40 GiB held on 32: still nothing new
        allocate(client, "mps", memory_bytes=4 * GiB)

    # drained: one more released, the other fits again and says so, and the GPU takes work
    client.call("Release", pb.ReleaseAllocationRequest(allocation_id=next(i for i in held if i != lost)))
    left = [i for i in held if states(cluster)[i] == "active"]
    assert len(left) == 1
    wait_for(lambda: _reasons(client, left)[left[0]] == "", 30, "the over-commit reason cleared")
    assert allocate(client, "mps", memory_bytes=4 * GiB).state == pb.ALLOCATION_STATE_ACTIVE
    assert_consistent(cluster)


def test_mig_mode_turned_on_by_hand_under_a_fastpod_share_keeps_the_gpu_held(cluster):
    """`nvidia-smi -mig 1` on a GPU holding a fastpod share: the controller's next view of the
    node dropped the share from the placement engine (an error logged, the record still
    active), so the GPU looked like an empty MIG GPU and an exclusive request was placed on
    it. Now the share stays counted, the GPU takes nothing new while it is held, the
    allocation says it is over-committed and why, and once it is released the GPU takes a
    MIG slice."""
    cluster.add_machine("n1", ["H100-SXM5-80GB"])
    cluster.start_controller()
    cluster.start_agent("n1")
    client = cluster.client()
    share = allocate(client, "fastpod", sm_percent=50, memory_bytes=4 * GiB)

    machine = cluster.root / "n1.json"
    data = json.loads(machine.read_text())
    data["gpus"][0]["mig_current"] = data["gpus"][0]["mig_pending"] = 1   # as nvidia-smi -mig 1 leaves it
    machine.write_text(json.dumps(data))
    wait_for(lambda: cluster.node("n1").gpus[0].mig_enabled, 30, "the controller sees MIG mode on")
    with pytest.raises(grpc.RpcError) as refused:   # the view the controller sees now
        allocate(client, "exclusive", mig_profile="1g.10gb")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    wait_for(lambda: OVER in _reasons(client, [share.id])[share.id], 30,
             f"the share says it is over-committed: {_reasons(client, [share.id])}")
    reason = _reasons(client, [share.id])[share.id]
    assert "n1 GPU 0" in reason and "in MIG mode" in reason, reason
    assert states(cluster)[share.id] == "active"
    table = subprocess.run([fastshare_bin(), "status", "--controller", cluster.address, "--tls-dir",
                            str(cluster.pki.dir)], capture_output=True, text=True, timeout=60, env=_wide())
    assert table.returncode == 0, table.stderr
    assert "active, over-committed" in table.stdout and "in MIG mode" in table.stdout, table.stdout

    client.call("Release", pb.ReleaseAllocationRequest(allocation_id=share.id))
    assert allocate(client, "exclusive", mig_profile="1g.10gb").state == pb.ALLOCATION_STATE_ACTIVE
    assert_consistent(cluster)


def test_status_says_which_gpu_is_over_committed_in_its_usage(cluster):
    """The status API's per-GPU usage had no over-commit mark: `fastshare status` guessed it by
    parsing the allocations' reasons (and saw nothing until the reconciler wrote them). Now each
    GPU's usage says whether it is over-committed and why, from the controller's ledger, and
    `fastshare status` (table and --json) shows that."""
    cluster.add_machine("n1", ["H100-SXM5-80GB", "H100-SXM5-80GB"])
    cluster.start_controller()
    cluster.start_agent("n1")
    client = cluster.client()
    share = allocate(client, "fastpod", sm_percent=50, memory_bytes=4 * GiB)
    over_gpu = share.devices[0].gpu_index

    machine = cluster.root / "n1.json"
    data = json.loads(machine.read_text())
    data["gpus"][over_gpu]["mig_current"] = data["gpus"][over_gpu]["mig_pending"] = 1   # nvidia-smi -mig 1
    machine.write_text(json.dumps(data))
    wait_for(lambda: cluster.node("n1").gpus[over_gpu].over_committed, 30, "the GPU's usage says so")
    gpus = {g.index: g for g in cluster.node("n1").gpus}
    why = gpus[over_gpu].over_commit_reason
    assert f"n1 GPU {over_gpu}" in why and "in MIG mode" in why, why
    assert (gpus[1 - over_gpu].over_committed, gpus[1 - over_gpu].over_commit_reason) == (False, "")

    def cli(*args: str) -> str:
        out = subprocess.run([fastshare_bin(), "status", *args, "--controller", cluster.address, "--tls-dir",
                              str(cluster.pki.dir)], capture_output=True, text=True, timeout=60, env=_wide())
        assert out.returncode == 0, out.stderr
        return out.stdout

    shown = {g["index"]: g for g in json.loads(cli("--json"))["nodes"][0]["gpus"]}
    assert shown[over_gpu]["over_committed"] is True and shown[over_gpu]["over_commit_reason"] == why
    assert shown[1 - over_gpu]["over_committed"] is False
    table = cli()
    [row] = [line for line in table.splitlines() if "OVER-COMMITTED" in line]
    assert f" {over_gpu} " in row, table
    assert "in MIG mode" in table.split("Over-committed")[-1], table

    client.call("Release", pb.ReleaseAllocationRequest(allocation_id=share.id))
    wait_for(lambda: not cluster.node("n1").gpus[over_gpu].over_committed, 30, "the mark gone once released")


def test_an_agent_with_another_mps_oversubscription_factor_is_warned_about_once(cluster):
    """The controller (--mps-oversubscription 2) and an agent (mps_memory_oversubscription 1, the
    default) disagreed without a word: the controller placed MPS shares up to twice a GPU's
    memory and the agent refused those beyond once it at prepare. Now the agent reports its
    factor with its inventory and the controller logs a WARNING once per node naming both and
    the one that governs; a node whose agent agrees gets none."""
    cluster.add_machine("n1", ["V100-SXM2-32GB"])
    cluster.add_machine("n2", ["V100-SXM2-32GB"])
    cluster.start_controller(extra=["--mps-oversubscription", "2"])
    cluster.start_agent("n1")
    cluster.start_agent("n2", config={"mps_memory_oversubscription": 2.0})

    def warnings() -> list[str]:
        return [line for line in cluster.controller.output().splitlines()
                if "WARNING" in line and "oversubscription" in line]
    wait_for(warnings, 30, "a warning about n1's factor")
    [line] = warnings()
    assert "node n1" in line and "1" in line and "2" in line and "the agent's (1) governs" in line, line
    cluster.agents["n1"].stop()   # the agent starts again and registers again: no second warning
    cluster.start_agent("n1")
    wait_for(lambda: cluster.controller.output().count("node n1 registered") == 2, 30, "n1 registered again")
    assert len(warnings()) == 1, warnings()


def test_a_mig_slice_replaced_by_hand_with_an_overlapping_one_is_over_committed(cluster):
    """An exclusive allocation's MIG slice destroyed by hand (nvidia-smi mig -dci/-dgi) and a
    smaller one laid out over its memory slices: the controller saw the new instance in the
    agent's inventory but judged the held slice by the other held ones only, so the allocation
    stayed active as if nothing had happened, and once the agent dropped the share (its device
    gone) it was prepared again and ended with the agent's raw NVML error. Now the allocation
    is over-committed with a reason naming the foreign slice and what to do, and once the agent
    drops the share (its device gone) it is not prepared again over it but ended failed naming
    the destroyed slice (test_vanished: the agent notices while it runs)."""
    from fastshare.device import open_devices

    cluster.add_machine("n1", ["A100-SXM4-40GB"], mig_enabled=True)
    cluster.start_controller()
    cluster.start_agent("n1", config={"reconcile_interval_s": 3600})   # its start notices, not housekeeping
    client = cluster.client()
    held = allocate(client, "exclusive", mig_profile="3g.20gb")
    start = held.devices[0].mig_start
    with open_devices("sim", cluster.root / "n1.json") as devices:
        devices.destroy_mig_instance(0, start)
        foreign = devices.create_mig_instance(0, 19, start + 1)   # a 1g.5gb inside the 3g's slices
    wait_for(lambda: OVER in _reasons(client, [held.id])[held.id], 30,
             f"the allocation says it is over-committed: {_reasons(client, [held.id])}")
    reason = _reasons(client, [held.id])[held.id]
    assert f"1g.5gb at memory slice {start + 1}" in reason and "n1 GPU 0" in reason, reason
    assert "destroy" in reason, reason
    assert states(cluster)[held.id] == "active"
    assert cluster.node("n1").gpus[0].over_committed

    cluster.agents["n1"].stop()   # its start drops the share (its MIG device is gone)
    cluster.start_agent("n1")
    wait_for(lambda: states(cluster)[held.id] == "failed", 60, "the lost share ended")
    ended = _reasons(client, [held.id])[held.id]
    assert held.devices[0].mig_uuid in ended and "destroyed outside fastshare" in ended, ended
    assert "RESOURCE_EXHAUSTED" not in ended, ended
    with open_devices("sim", cluster.root / "n1.json") as devices:   # the foreign slice left alone
        assert [m.uuid for m in devices.mig_instances(0)] == [foreign.uuid]
    assert_consistent(cluster)
