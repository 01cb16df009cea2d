"""A GPU whose MIG mode change waits for a GPU reset (Ampere) takes no new shares (real controller,
agent and CLI on a simulated A100 machine)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import grpc
import pytest

from fastshare.device import simnvml
from fastshare.v1 import agent_pb2
from fastshare.v1 import controller_pb2 as pb

from .conftest import GiB, allocate, assert_consistent, fastshare_bin, states, wait_for


def _pending(index: int) -> str:
    return (f"GPU {index} of n1: MIG mode change pending until the GPU is reset (nvidia-smi -r -i {index}) "
            "or the node rebooted; it takes no new shares")


def _cli(cluster, *args: str) -> str:
    out = subprocess.run([fastshare_bin(), *args, "--controller", cluster.address, "--tls-dir",
                          str(cluster.pki.dir)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "400"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_gpu_whose_mig_mode_change_is_pending_takes_no_new_share(cluster):
    """`fastshare mig enable` on an A100 leaves the change pending until a GPU reset. The controller
    went on placing there as if the mode were final: a whole, MPS or fastpod share placed on the GPU
    lost it at the reset. Now the GPU takes no new share of any kind and the refusal says why and what
    to do; a share it holds stays held (not over-committed: the operator drains it); `fastshare
    status` shows the pending change (not LOST); after the reset the GPU takes MIG slices."""
    cluster.add_machine("n1", ["A100-SXM4-40GB", "A100-SXM4-40GB"])
    cluster.start_controller()
    cluster.start_agent("n1")
    client = cluster.client()
    whole = allocate(client, "whole", gpu_count=1)
    held = whole.devices[0].gpu_index
    other = 1 - held
    machine = cluster.root / "n1.json"
    other_uuid = simnvml.load_machine(machine)["gpus"][other]["uuid"]
    agent = cluster.agents["n1"].stub(cluster.pki)
    mode = agent.SetMigMode(agent_pb2.SetMigModeRequest(gpu_uuid=other_uuid, enabled=True), timeout=60)
    assert mode.pending and mode.changed   # as `fastshare mig enable --gpu N` through the agent
    wait_for(lambda: cluster.node("n1").gpus[other].mig_change_pending, 30, "the controller sees it pending")

    for kind, kw in (("fastpod", dict(sm_percent=10, memory_bytes=GiB, quota_request=0.2, quota_limit=0.5)),
                     ("mps", dict(memory_bytes=GiB)), ("whole", dict(gpu_count=1)),
                     ("exclusive", dict(mig_profile="1g.5gb"))):
        with pytest.raises(grpc.RpcError) as refused:
            allocate(client, kind, **kw)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (kind, refused.value.details())
        assert _pending(other) in refused.value.details(), (kind, refused.value.details())

    # the same change made by hand (nvidia-smi -mig 1) under the whole share: it stays held as it was
    data = json.loads(machine.read_text())
    data["gpus"][held]["mig_pending"] = 1
    machine.write_text(json.dumps(data))
    wait_for(lambda: cluster.node("n1").gpus[held].mig_change_pending, 30, "the controller sees it pending")
    gpus = {g.index: g for g in cluster.node("n1").gpus}
    assert not gpus[held].over_committed and gpus[held].whole_held, gpus[held]
    assert states(cluster)[whole.id] == "active"
    assert client.call("Get", pb.GetAllocationRequest(allocation_id=whole.id)).reason == ""

    shown = {g["index"]: g for g in json.loads(_cli(cluster, "status", "--json"))["nodes"][0]["gpus"]}
    for index in (held, other):
        assert shown[index]["mig_change_pending"] is True and not shown[index].get("lost"), shown[index]
    table = _cli(cluster, "status")
    assert "LOST" not in table and "Lost GPUs" not in table, table
    rows = [line for line in table.splitlines() if "MIG enable pending" in line]
    assert len(rows) == 2, table
    assert f"nvidia-smi -r -i {held}" in table and f"nvidia-smi -r -i {other}" in table, table

    client.call("Release", pb.ReleaseAllocationRequest(allocation_id=whole.id))
    simnvml.reset_gpu(machine, other)   # the pending mode takes effect
    wait_for(lambda: not cluster.node("n1").gpus[other].mig_change_pending, 30, "the reset seen")
    assert cluster.node("n1").gpus[other].mig_enabled
    slice_ = allocate(client, "exclusive", mig_profile="1g.5gb")
    assert slice_.state == pb.ALLOCATION_STATE_ACTIVE and slice_.devices[0].gpu_index == other
    assert_consistent(cluster)


def test_an_exclusive_request_does_not_leave_an_ampere_gpu_with_a_pending_mig_enable(cluster):
    """An exclusive request placed on an A100 with MIG off made the controller turn MIG on, which
    waits for a GPU reset there: the allocation failed, and the GPU was left with a pending change,
    taking no new share; each retry did the same to the next idle GPU. Now such a request is refused
    up front, saying how to turn MIG on, and no GPU's mode changes."""
    cluster.add_machine("n1", ["A100-SXM4-40GB", "A100-SXM4-40GB"])
    cluster.start_controller()
    cluster.start_agent("n1")
    client = cluster.client()
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as refused:
            allocate(client, "exclusive", mig_profile="1g.5gb")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        for says in ("have MIG off", "waits for a GPU reset", "fastshare mig enable --gpu N"):
            assert says in refused.value.details(), refused.value.details()
    machine = simnvml.load_machine(cluster.root / "n1.json")
    assert [(g["mig_current"], g["mig_pending"]) for g in machine["gpus"]] == [(0, 0), (0, 0)], machine
    assert not any(g.mig_change_pending for g in cluster.node("n1").gpus)
    assert allocate(client, "mps", memory_bytes=GiB).state == pb.ALLOCATION_STATE_ACTIVE   # still open
    assert_consistent(cluster)


def _enable_mig(cluster, machine, uuid: str, index: int) -> None:
    request = agent_pb2.SetMigModeRequest(gpu_uuid=uuid, enabled=True)
    cluster.agents["n1"].stub(cluster.pki).SetMigMode(request, timeout=60)


def _disable_mig(cluster, machine, uuid: str, index: int) -> None:
    request = agent_pb2.SetMigModeRequest(gpu_uuid=uuid, enabled=False)
    cluster.agents["n1"].stub(cluster.pki).SetMigMode(request, timeout=60)


def _lose(cluster, machine, uuid: str, index: int) -> None:
    simnvml.lose_gpu(machine, index)
    cluster.agents["n1"].share_ids(cluster.pki)   # its inventory: the agent reads its GPUs again


_FASTPOD = dict(sm_percent=10, memory_bytes=GiB, quota_request=0.2, quota_limit=0.5)
# GPUs, MIG on at start, how the GPU changes behind the controller's back, the changed GPU's field
# in `fastshare status` that then says so, and the request
_BEHIND_ITS_BACK = {
    "A100 mig enable pending, fastpod": (["A100-SXM4-40GB"] * 2, False, _enable_mig, "mig_change_pending",
                                         "fastpod", _FASTPOD),
    "A100 mig enable pending, mps": (["A100-SXM4-40GB"] * 2, False, _enable_mig, "mig_change_pending", "mps",
                                     dict(memory_bytes=GiB)),
    "A100 mig enable pending, whole": (["A100-SXM4-40GB"] * 2, False, _enable_mig, "mig_change_pending",
                                       "whole", dict(gpu_count=1)),
    "A100 mig disable pending, exclusive": (["A100-SXM4-40GB"] * 2, True, _disable_mig, "mig_change_pending",
                                            "exclusive", dict(mig_profile="1g.5gb")),
    "H100 mig enabled at once, mps": (["H100-SXM5-80GB"] * 2, False, _enable_mig, "mig_enabled", "mps",
                                      dict(memory_bytes=GiB)),
    "H100 mig enabled at once, whole": (["H100-SXM5-80GB"] * 2, False, _enable_mig, "mig_enabled", "whole",
                                        dict(gpu_count=1)),
    "gpu lost, fastpod": (["V100-SXM2-32GB"] * 2, False, _lose, "lost", "fastpod", _FASTPOD),
    "gpu lost, whole": (["V100-SXM2-32GB"] * 2, False, _lose, "lost", "whole", dict(gpu_count=1)),
}


@pytest.mark.parametrize("case", list(_BEHIND_ITS_BACK))
def test_a_share_refused_because_its_gpu_closed_behind_the_controllers_back_is_placed_again(cluster, case):
    """The controller learns of a GPU's MIG mode change (pending or done) or of its loss from
    the agent's inventory, once per reconcile pass. An allocation placed there before it did was
    refused by the agent and ended FAILED, although the other GPU was free: the user got a failure
    from a race they cannot see. Now the agent says, in a structured field, that the refusal is about
    the GPU; the controller takes the node's view again, gives back the first GPU's reservation and
    places the allocation once more: it is active on the other GPU, the changed GPU holds nothing
    and `fastshare status` shows it changed."""
    models, mig_on, change, shown, kind, kw = _BEHIND_ITS_BACK[case]
    cluster.add_machine("n1", models, mig_enabled=mig_on)
    cluster.start_controller(extra=["--reconcile-interval", "3600"])   # no pass looks at the node meanwhile
    cluster.start_agent("n1")
    cluster.wait_taken_in("n1")
    client = cluster.client()
    # where the engine puts this request: there again while its view is the same
    first = allocate(client, kind, **kw)
    closing = first.devices[0].gpu_index
    client.call("Release", pb.ReleaseAllocationRequest(allocation_id=first.id))
    change(cluster, cluster.root / "n1.json", first.devices[0].gpu_uuid, closing)
    assert not any(getattr(g, shown) for g in cluster.node("n1").gpus), "the controller saw it already"

    placed = allocate(client, kind, **kw)
    assert placed.state == pb.ALLOCATION_STATE_ACTIVE, placed
    assert placed.devices[0].gpu_index == 1 - closing, placed
    gpus = {g.index: g for g in cluster.node("n1").gpus}
    assert getattr(gpus[closing], shown), gpus[closing]
    assert not gpus[closing].memory_bytes_used and not gpus[closing].whole_held, gpus[closing]
    assert cluster.agents["n1"].share_ids(cluster.pki) == {placed.id}
    assert_consistent(cluster)


def _remove(machine, index: int) -> str:
    """The GPU is taken out of the node (the others keep their bus ids, numbered again); its UUID."""
    return simnvml.remove_gpu(machine, index)


def _renumber(machine, index: int) -> str:
    """The GPU comes back from a reboot under another UUID; its old UUID."""
    data = json.loads(machine.read_text())
    old, data["gpus"][index]["uuid"] = data["gpus"][index]["uuid"], f"GPU-{uuid.uuid4()}"
    machine.write_text(json.dumps(data))
    return old


@pytest.mark.parametrize("kind, kw, change", [("whole", dict(gpu_count=1), _remove),
                                              ("mps", dict(memory_bytes=GiB), _remove),
                                              ("fastpod", _FASTPOD, _renumber)],
                         ids=["removed, whole", "removed, mps", "new uuid, fastpod"])
def test_a_share_whose_gpu_left_the_node_behind_the_controllers_back_is_placed_again(
        cluster, kind, kw, change):
    """A GPU taken out of the node (or renumbered under a new UUID) before the controller read the
    node again: the agent refused the share placed on it (NOT_FOUND, "GPU ... is not on node") with no
    refusal field, and the allocation ended FAILED although another GPU was free. Now the refusal says
    REFUSAL_GPU_GONE: the controller reads the node's inventory again (without that GPU) and places the
    allocation once more, on a GPU the node has."""
    cluster.add_machine("n1", ["V100-SXM2-32GB"] * 2)
    cluster.start_controller(extra=["--reconcile-interval", "3600"])   # no pass looks at the node meanwhile
    cluster.start_agent("n1")
    cluster.wait_taken_in("n1")
    client = cluster.client()
    # where the engine puts this request: there again while its view is the same
    first = allocate(client, kind, **kw)
    client.call("Release", pb.ReleaseAllocationRequest(allocation_id=first.id))
    machine = cluster.root / "n1.json"
    gone = change(machine, first.devices[0].gpu_index)
    assert gone == first.devices[0].gpu_uuid
    cluster.agents["n1"].share_ids(cluster.pki)   # its inventory: the agent reads its GPUs again
    assert gone in {g.uuid for g in cluster.node("n1").gpus}, "the controller saw it already"

    placed = allocate(client, kind, **kw)
    assert placed.state == pb.ALLOCATION_STATE_ACTIVE, placed
    on_node = [g["uuid"] for g in simnvml.load_machine(machine)["gpus"]]
    assert placed.devices[0].gpu_uuid in on_node and placed.devices[0].gpu_uuid != gone, (placed, on_node)
    assert placed.devices[0].gpu_index == on_node.index(placed.devices[0].gpu_uuid), placed
    assert [g.uuid for g in cluster.node("n1").gpus] == on_node   # the controller's view is the node's
    assert cluster.agents["n1"].share_ids(cluster.pki) == {placed.id}
    assert "cannot be counted" not in cluster.controller.output()   # no error for the one placed again
    assert_consistent(cluster)


def test_a_share_refused_for_its_gpu_where_no_other_gpu_takes_it_fails_saying_both(cluster):
    """Placed again, nothing else fits (the other GPU is held whole): the allocation ends failed as
    before, its reason the agent's refusal and why no other GPU takes it; nothing is left held."""
    cluster.add_machine("n1", ["A100-SXM4-40GB"] * 2)
    cluster.start_controller(extra=["--reconcile-interval", "3600"])
    cluster.start_agent("n1")
    client = cluster.client()
    held = allocate(client, "whole", gpu_count=1)
    other = 1 - held.devices[0].gpu_index
    _enable_mig(cluster, None, cluster.node("n1").gpus[other].uuid, other)
    with pytest.raises(grpc.RpcError) as refused:
        allocate(client, "whole", gpu_count=1)
    failed = next(a for a in cluster.status().allocations if a.id != held.id)
    assert failed.state == pb.ALLOCATION_STATE_FAILED, failed
    assert _pending(other) in failed.reason and "no other GPU takes it" in failed.reason, failed.reason
    assert _pending(other) in refused.value.details(), refused.value.details()
    gpus = {g.index: g for g in cluster.node("n1").gpus}
    assert gpus[other].mig_change_pending and not gpus[other].whole_held, gpus[other]
    assert cluster.agents["n1"].share_ids(cluster.pki) == {held.id}
    assert_consistent(cluster)


def test_a_controller_killed_after_placing_a_refused_share_again_completes_it_there(cluster):
    """Killed after recording the allocation on the other GPU, before its agent was asked: the
    restarted controller prepares it there (not on the GPU that refused it), and nothing is held twice."""
    cluster.add_machine("n1", ["A100-SXM4-40GB"] * 2)
    cluster.start_controller(extra=["--reconcile-interval", "3600"])
    cluster.start_agent("n1")
    client = cluster.client()
    first = allocate(client, "mps", memory_bytes=GiB)
    closing = first.devices[0].gpu_index
    client.call("Release", pb.ReleaseAllocationRequest(allocation_id=first.id))
    cluster.controller.stop()
    cluster.start_controller(env={"FASTSHARE_FAULT": "controller.after_place_again"},
                             extra=["--reconcile-interval", "3600"])
    cluster.wait_node("n1", available=True)
    _enable_mig(cluster, None, first.devices[0].gpu_uuid, closing)
    with pytest.raises(grpc.RpcError):
        allocate(cluster.client(), "mps", memory_bytes=GiB)
    cluster.controller.popen.wait(timeout=30)   # it killed itself there
    cluster.start_controller()
    wait_for(lambda: set(states(cluster).values()) == {"released", "active"}, 60, "the pending one completed")
    placed = next(a for a in cluster.status().allocations if a.state == pb.ALLOCATION_STATE_ACTIVE)
    assert placed.devices[0].gpu_index == 1 - closing, placed
    assert cluster.node("n1").gpus[closing].mig_change_pending
    assert cluster.agents["n1"].share_ids(cluster.pki) == {placed.id}
    assert_consistent(cluster)


def test_an_exclusive_request_turning_mig_on_a_gpu_lost_behind_the_controllers_back_is_placed_again(cluster):
    """An exclusive request on a Hopper GPU with MIG off first turns MIG on (SetMigMode), then
    prepares its slice. A GPU lost before the controller read the node again was refused there
    "is lost (fell off the bus?)" with no refusal field (only PrepareShare tagged GPU_LOST), so
    the allocation ended FAILED although the other GPU was idle. Now SetMigMode's refusal says
    REFUSAL_GPU_LOST too, and the allocation is placed again on the other GPU."""
    cluster.add_machine("n1", ["H100-SXM5-80GB"] * 2, mig_enabled=False)
    cluster.start_controller(extra=["--reconcile-interval", "3600"])   # no pass looks at the node meanwhile
    cluster.start_agent("n1")
    cluster.wait_taken_in("n1")
    client = cluster.client()
    _lose(cluster, cluster.root / "n1.json", "", 0)
    assert not any(g.lost for g in cluster.node("n1").gpus), "the controller saw it already"

    placed = allocate(client, "exclusive", mig_profile="1g.10gb")
    assert placed.state == pb.ALLOCATION_STATE_ACTIVE, placed
    assert placed.devices[0].gpu_index == 1, placed
    assert cluster.node("n1").gpus[0].lost
    assert cluster.agents["n1"].share_ids(cluster.pki) == {placed.id}
    assert_consistent(cluster)
