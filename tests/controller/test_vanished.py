"""A held device that vanishes while its node agent runs (real controller, real agent, simulated
machine): a MIG slice destroyed by hand (nvidia-smi mig -dci/-dgi), a GPU taken out or fallen off
the bus. The agent noticed only at its next start; meanwhile the share stayed ready, the
allocation active on a device that no longer existed, and its owner was told nothing."""

from __future__ import annotations

import grpc
import pytest

from fastshare.device import open_devices, simnvml
from fastshare.v1 import agent_pb2
from fastshare.v1 import controller_pb2 as pb

from .conftest import GiB, allocate, assert_consistent, states, wait_for

FAST = {"reconcile_interval_s": 1}   # the agent's housekeeping period


def _get(client, allocation_id: str) -> pb.Allocation:
    return client.call("Get", pb.GetAllocationRequest(allocation_id=allocation_id))


def _inventory(cluster, node: str) -> agent_pb2.Inventory:
    return cluster.agents[node].stub(cluster.pki).GetInventory(agent_pb2.GetInventoryRequest(), timeout=30)


def _ended_failed(cluster, allocation_id: str) -> None:
    wait_for(lambda: states(cluster)[allocation_id] == "failed", 30, f"{allocation_id} ended failed")


def test_a_held_mig_slice_destroyed_by_hand_ends_its_allocation(cluster):
    """Both 3g.20gb slices of an A100 held; one is destroyed by hand. The allocation ends failed
    naming the slice (not prepared again onto a new slice with another UUID than the workload
    was given), the agent holds nothing of it any more and the space takes a new request."""
    cluster.add_machine("n1", ["A100-SXM4-40GB"], mig_enabled=True)
    cluster.start_controller()
    cluster.start_agent("n1", config=FAST)
    client = cluster.client()
    kept = allocate(client, "exclusive", mig_profile="3g.20gb")
    lost = allocate(client, "exclusive", mig_profile="3g.20gb")
    slice_uuid = lost.devices[0].mig_uuid
    assert slice_uuid.startswith("MIG-") and lost.env["CUDA_VISIBLE_DEVICES"] == slice_uuid
    with pytest.raises(grpc.RpcError) as full:
        allocate(client, "exclusive", mig_profile="3g.20gb")
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    with open_devices("sim", cluster.root / "n1.json") as devices:   # nvidia-smi mig -dci/-dgi
        devices.destroy_mig_instance(0, lost.devices[0].mig_start)

    _ended_failed(cluster, lost.id)
    ended = _get(client, lost.id)
    assert slice_uuid in ended.reason and "destroyed outside fastshare" in ended.reason, ended.reason
    assert states(cluster)[kept.id] == "active"
    inventory = _inventory(cluster, "n1")
    assert {s.id for s in inventory.shares} == {kept.id}
    assert not inventory.lost_shares, inventory.lost_shares
    assert "destroyed outside fastshare" in cluster.agents["n1"].output()
    again = allocate(client, "exclusive", mig_profile="3g.20gb")
    assert again.devices[0].mig_start == lost.devices[0].mig_start
    assert again.devices[0].mig_uuid != slice_uuid
    assert_consistent(cluster)


def test_a_gpu_removed_under_whole_and_fastpod_shares_ends_their_allocations(cluster):
    """GPU 1 (a whole-GPU share) and GPU 2 (a fastpod share) taken out while the agent runs: both
    allocations end failed naming their GPU, the agent drops both shares (the fastpod's MPS daemon
    and share files too), GPU 0's allocation stays, and new work fits on what is left."""
    cluster.add_machine("n1", ["V100-SXM2-32GB"] * 4)
    cluster.start_controller()
    cluster.start_agent("n1", config=FAST)
    client = cluster.client()
    first = allocate(client, "whole", gpu_count=1)
    whole = allocate(client, "whole", gpu_count=1)
    share = allocate(client, "fastpod", sm_percent=60, memory_bytes=4 * GiB)
    assert [a.devices[0].gpu_index for a in (first, whole, share)] == [0, 1, 2]
    uuid = {a.id: a.devices[0].gpu_uuid for a in (first, whole, share)}

    simnvml.remove_gpu(cluster.root / "n1.json", 2)
    simnvml.remove_gpu(cluster.root / "n1.json", 1)

    for gone in (whole, share):
        _ended_failed(cluster, gone.id)
        reason = _get(client, gone.id).reason
        assert uuid[gone.id] in reason and "no longer on" in reason, reason
    assert states(cluster)[first.id] == "active"
    inventory = _inventory(cluster, "n1")
    assert {s.id for s in inventory.shares} == {first.id} and not inventory.lost_shares
    assert not inventory.mps_daemons and not inventory.share_files
    assert allocate(client, "fastpod", sm_percent=100, memory_bytes=GiB).devices[0].gpu_index == 1
    assert_consistent(cluster)


def test_fastshare_run_stops_its_command_saying_why_when_its_slice_is_destroyed(cluster):
    """`fastshare run` on an exclusive slice destroyed by hand: the command is stopped with why
    (it said "the allocation was released", and before that nothing ended it at all)."""
    import os
    import signal
    import subprocess

    from .conftest import fastshare_bin

    cluster.add_machine("n1", ["A100-SXM4-40GB"], mig_enabled=True)
    cluster.start_controller()
    cluster.start_agent("n1", config=FAST)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")},
           "FASTSHARE_CONTROLLER": cluster.address, "FASTSHARE_TLS_DIR": str(cluster.pki.dir)}
    args = [fastshare_bin(), "run", "--kind", "exclusive", "--mig-profile", "3g.20gb", "--lease-ttl", "6",
            "--", "sleep", "300"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        (held,) = wait_for(lambda: [a for a in cluster.status().allocations
                                    if a.state == pb.ALLOCATION_STATE_ACTIVE], 60, "the allocation")
        with open_devices("sim", cluster.root / "n1.json") as devices:
            devices.destroy_mig_instance(0, held.devices[0].mig_start)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert f"the allocation failed: device gone: its MIG device {held.devices[0].mig_uuid}" in stderr, stderr
    assert "stopping the command" in stderr, stderr


def test_a_gpu_lost_while_shares_are_held_on_both_gpus_ends_only_its_share(cluster):
    """GPU 1 of two falls off the bus (NVML keeps counting it, calls on it raise GPU_IS_LOST) while
    a fastpod share is held on each. The whole inventory failed: the node's housekeeping and
    inventory failed every round, so the controller saw the node broken and the share on the lost
    GPU stayed active. Now the share on GPU 1 ends failed naming the GPU, GPU 0's stays active,
    new requests go to GPU 0 only, and the agent logs the loss once, saying what to do."""
    cluster.add_machine("n1", ["V100-SXM2-32GB"] * 2)
    cluster.start_controller()
    cluster.start_agent("n1", config=FAST)
    client = cluster.client()
    kept = allocate(client, "fastpod", sm_percent=60, memory_bytes=4 * GiB)
    lost = allocate(client, "fastpod", sm_percent=60, memory_bytes=4 * GiB)
    assert [a.devices[0].gpu_index for a in (kept, lost)] == [0, 1]
    lost_uuid = lost.devices[0].gpu_uuid

    simnvml.lose_gpu(cluster.root / "n1.json", 1)

    _ended_failed(cluster, lost.id)
    reason = _get(client, lost.id).reason
    assert lost_uuid in reason and "lost (fell off the bus?)" in reason, reason
    assert states(cluster)[kept.id] == "active"
    inventory = _inventory(cluster, "n1")
    assert [(g.index, g.lost) for g in inventory.gpus] == [(0, ""), (1, "GPU_IS_LOST")]
    assert {s.id for s in inventory.shares} == {kept.id}
    # new work goes to the healthy GPU only
    assert allocate(client, "fastpod", sm_percent=40, memory_bytes=GiB).devices[0].gpu_index == 0
    for kind, args in (("fastpod", {"sm_percent": 60, "memory_bytes": GiB}), ("whole", {"gpu_count": 1})):
        with pytest.raises(grpc.RpcError) as refused:
            allocate(client, kind, **args)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert states(cluster)[kept.id] == "active"
    output = cluster.agents["n1"].output()
    assert output.count(f"GPU 1 ({lost_uuid}) is lost (fell off the bus?)") == 1, output
    assert "Drain the node" in output and "reboot" in output
    assert_consistent(cluster)


def test_a_gpu_lost_while_its_agent_was_down_is_reported_lost_with_its_uuid(cluster):
    """GPU 1 falls off the bus while its node agent is stopped, under a whole-GPU allocation. The
    restarted agent cannot read it (no UUID): the controller saw no GPU with the allocation's UUID
    and ended it as "no longer on node n1 (removed, replaced ...)", and `fastshare status` listed
    the lost GPU without UUID. Now the agent names it from its journal (the share on it): the
    allocation ends failed as lost, naming the GPU, and the controller's view has its UUID."""
    cluster.add_machine("n1", ["V100-SXM2-32GB"] * 2)
    cluster.start_controller()
    agent = cluster.start_agent("n1", config=FAST)
    client = cluster.client()
    kept = allocate(client, "whole", gpu_count=1)
    held = allocate(client, "whole", gpu_count=1)
    assert [a.devices[0].gpu_index for a in (kept, held)] == [0, 1]
    lost_uuid = held.devices[0].gpu_uuid
    agent.stop()
    simnvml.lose_gpu(cluster.root / "n1.json", 1)
    cluster.start_agent("n1", config=FAST)

    _ended_failed(cluster, held.id)
    reason = _get(client, held.id).reason
    assert f"GPU {lost_uuid} (GPU 1) is lost (fell off the bus?)" in reason, reason
    assert states(cluster)[kept.id] == "active"
    gpus = cluster.node("n1").gpus
    assert [(g.uuid, g.lost) for g in gpus][1] == (lost_uuid, "GPU_IS_LOST")
    assert_consistent(cluster)
