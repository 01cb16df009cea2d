"""End to end on loopback: a controller, two node agents on simulated machines, real gRPC + mTLS."""

from __future__ import annotations

import grpc
import pytest
from click.testing import CliRunner

from fastshare.cli import main
from fastshare.v1 import agent_pb2
from fastshare.v1 import controller_pb2 as pb

from .conftest import GiB, allocate, assert_consistent, states, wait_for


@pytest.fixture
def two_nodes(cluster):
    cluster.add_machine("node-a", ["A100-SXM4-40GB", "A100-SXM4-40GB"], mig_enabled=True)
    cluster.add_machine("node-b", ["H100-SXM5-80GB", "L4"])
    cluster.start_controller()
    cluster.start_agent("node-a")
    cluster.start_agent("node-b")
    return cluster


def test_every_kind_end_to_end(two_nodes):
    c = two_nodes.client()
    fp = allocate(c, "fastpod", sm_percent=30, memory_bytes=4 * GiB, quota_request=0.3, quota_limit=0.6,
                  models=["L4"])
    assert (fp.state, fp.node, fp.devices[0].gpu_index) == (pb.ALLOCATION_STATE_ACTIVE, "node-b", 1)
    assert fp.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert fp.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].startswith("0=")
    assert fp.env["CUDA_MPS_PIPE_DIRECTORY"]
    assert fp.env["CUDA_VISIBLE_DEVICES"] == fp.devices[0].gpu_uuid == fp.env["NVIDIA_VISIBLE_DEVICES"]
    mps = allocate(c, "mps", memory_bytes=8 * GiB, models=["H100*"])
    assert (mps.node, mps.devices[0].gpu_index) == ("node-b", 0)
    ex = allocate(c, "exclusive", mig_profile="3g.20gb")
    assert ex.node == "node-a" and ex.devices[0].mig_profile == "3g.20gb"
    assert ex.devices[0].mig_uuid.startswith("MIG-")
    assert ex.env["CUDA_VISIBLE_DEVICES"] == ex.devices[0].mig_uuid
    # Whole GPUs need idle GPUs without MIG mode: none left on node-a (MIG) or node-b (shared).
    with pytest.raises(grpc.RpcError) as exc:
        allocate(c, "whole", gpu_count=1)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "idle" in exc.value.details()
    c.call("Release", pb.ReleaseAllocationRequest(allocation_id=mps.id))
    whole = allocate(c, "whole", gpu_count=1, models=["H100*"])
    assert whole.node == "node-b" and whole.env["CUDA_VISIBLE_DEVICES"] == whole.devices[0].gpu_uuid
    assert {fp.id, whole.id} <= two_nodes.agents["node-b"].share_ids(two_nodes.pki)
    assert ex.id in two_nodes.agents["node-a"].share_ids(two_nodes.pki)
    assert_consistent(two_nodes)
    for a in (fp, ex, whole):
        done = c.call("Release", pb.ReleaseAllocationRequest(allocation_id=a.id))
        assert done.state == pb.ALLOCATION_STATE_RELEASED
        # Release is idempotent.
        assert c.call("Release", pb.ReleaseAllocationRequest(allocation_id=a.id)).state == done.state
    assert all(not agent.share_ids(two_nodes.pki) for agent in two_nodes.agents.values())
    assert all(s == "released" for s in states(two_nodes).values())
    for node in two_nodes.status().nodes:
        assert all(g.memory_bytes_used == 0 and not g.allocation_ids for g in node.gpus)


def test_rejection_reasons(two_nodes):
    c = two_nodes.client()
    cases = [
        (dict(kind="whole", gpu_count=2, models=["H100*"]), "no node has 2 idle"),
        (dict(kind="fastpod", sm_percent=30, memory_bytes=GiB, models=["V100*"]), "no GPU model present"),
        (dict(kind="fastpod", sm_percent=10, memory_bytes=GiB, node_selector={"zone": "x"}), "node_selector"),
    ]
    for kw, reason in cases:
        with pytest.raises(grpc.RpcError) as exc:
            allocate(c, kw.pop("kind"), **kw)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value.details()
        assert reason in exc.value.details()
    first = allocate(c, "fastpod", sm_percent=80, memory_bytes=GiB, models=["L4"])
    with pytest.raises(grpc.RpcError) as exc:
        allocate(c, "fastpod", sm_percent=30, memory_bytes=GiB, models=["L4"])
    assert "20 % SMs" in exc.value.details() or "largest free SM share is 20" in exc.value.details()
    c.call("Release", pb.ReleaseAllocationRequest(allocation_id=first.id))
    assert list(c.call("List", pb.ListAllocationsRequest()).allocations) == []


def test_idempotent_allocate_with_the_same_key(two_nodes):
    c = two_nodes.client()
    first = allocate(c, "mps", key="job-42", memory_bytes=2 * GiB)
    again = allocate(c, "mps", key="job-42", memory_bytes=2 * GiB)
    assert again.id == first.id and again.state == pb.ALLOCATION_STATE_ACTIVE
    with pytest.raises(grpc.RpcError) as exc:
        allocate(c, "mps", key="job-42", memory_bytes=3 * GiB)
    assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS and first.id in exc.value.details()
    assert [a.id for a in c.call("List", pb.ListAllocationsRequest()).allocations] == [first.id]


def test_watch_streams_state_changes(two_nodes):
    c = two_nodes.client()
    a = allocate(c, "mps", memory_bytes=GiB)
    stream = c.stream("Watch", pb.WatchAllocationsRequest(allocation_id=a.id), timeout=60)
    first = next(stream)
    assert first.allocation.state == pb.ALLOCATION_STATE_ACTIVE
    c.call("Release", pb.ReleaseAllocationRequest(allocation_id=a.id))
    seen = [e.allocation.state for e in stream]
    assert seen[-1] == pb.ALLOCATION_STATE_RELEASED and pb.ALLOCATION_STATE_RELEASING in seen


def test_node_loss_and_agent_restart(two_nodes):
    cluster = two_nodes
    c = cluster.client()
    on_b = allocate(c, "fastpod", sm_percent=40, memory_bytes=2 * GiB, models=["L4"])
    cluster.agents["node-b"].kill9()
    cluster.wait_node("node-b", available=False)
    # Its allocation is still reported (not forgotten), with the node marked down.
    kept = c.call("Get", pb.GetAllocationRequest(allocation_id=on_b.id))
    assert kept.state == pb.ALLOCATION_STATE_ACTIVE and not kept.node_available
    # Nothing new goes there; the rejection says why.
    with pytest.raises(grpc.RpcError) as exc:
        allocate(c, "fastpod", sm_percent=10, memory_bytes=GiB, models=["L4"])
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "node-b" in exc.value.details()
    elsewhere = allocate(c, "exclusive", sm_count=14)
    assert elsewhere.node == "node-a"
    # Agent comes back: it registers again and the controller reconciles it.
    cluster.start_agent("node-b")
    assert on_b.id in cluster.agents["node-b"].share_ids(cluster.pki)   # the agent's journal kept it
    again = allocate(c, "fastpod", sm_percent=10, memory_bytes=GiB, models=["L4"])
    assert again.node == "node-b"
    assert_consistent(cluster)
    for a in (on_b, elsewhere, again):
        c.call("Release", pb.ReleaseAllocationRequest(allocation_id=a.id))
    assert_consistent(cluster)


def test_reconciler_repairs_what_happened_behind_its_back(two_nodes):
    """prepare without record -> freed; record without prepare -> prepared again."""
    from fastshare.v1 import agent_pb2, common_pb2

    cluster = two_nodes
    c = cluster.client()
    a = allocate(c, "mps", memory_bytes=GiB, models=["H100*"])
    stub = cluster.agents["node-b"].stub(cluster.pki)
    stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id=a.id), timeout=30)
    orphan = agent_pb2.Share(id="fs-orphan0000000", kind=common_pb2.SHARE_KIND_MPS, memory_bytes=GiB,
                             device_uuids=[a.devices[0].gpu_uuid])
    stub.PrepareShare(agent_pb2.PrepareShareRequest(share=orphan), timeout=30)
    wait_for(lambda: cluster.agents["node-b"].share_ids(cluster.pki) == {a.id}, 60,
             "reconciler to free the orphan and re-prepare the lost share")
    assert_consistent(cluster)
    c.call("Release", pb.ReleaseAllocationRequest(allocation_id=a.id))


def test_concurrent_allocations_never_overcommit(two_nodes):
    """16 clients race for 30 % shares of one L4: exactly 3 win, the rest are rejected cleanly."""
    from concurrent.futures import ThreadPoolExecutor

    clients = [two_nodes.client() for _ in range(8)]

    def attempt(i: int) -> str:
        try:
            allocate(clients[i % 8], "fastpod", sm_percent=30, memory_bytes=GiB, models=["L4"])
            return "ok"
        except grpc.RpcError as exc:
            return exc.code().name

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(attempt, range(16)))
    assert results.count("ok") == 3, results
    assert set(results) == {"ok", "RESOURCE_EXHAUSTED"}
    l4 = next(g for n in two_nodes.status().nodes for g in n.gpus if g.model == "L4")
    assert l4.sm_percent_used == 90 and len(l4.allocation_ids) == 3
    assert_consistent(two_nodes)


def test_mig_mode_enabled_on_demand_is_remembered(two_nodes):
    """An exclusive slice on an H100 without MIG switches it to MIG mode (Hopper: at once); after
    the slice is gone the GPU is still in MIG mode, so it is no whole GPU any more."""
    c = two_nodes.client()
    ex = allocate(c, "exclusive", mig_profile="1g.10gb", models=["H100*"])
    assert ex.node == "node-b" and ex.devices[0].mig_uuid.startswith("MIG-")
    h100 = next(g for g in two_nodes.node("node-b").gpus if g.model.startswith("H100"))
    assert h100.mig_enabled
    c.call("Release", pb.ReleaseAllocationRequest(allocation_id=ex.id))
    with pytest.raises(grpc.RpcError) as exc:
        allocate(c, "whole", gpu_count=1, models=["H100*"])
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_consistent(two_nodes)


def test_whole_gpus_go_to_the_closest_pair_the_agent_reports(cluster):
    """Four PCIe GPUs, two per PCIe switch (the simulated machine's wiring): with GPU 0 taken,
    two whole GPUs go to the pair behind one switch (2, 3), not to the lowest free indexes
    (1, 2), which meet only at the host's NUMA node. The topology comes from the agent's
    inventory (NVML's common ancestor and NVLink status)."""
    cluster.add_machine("pcie", ["L4"] * 4)
    cluster.start_controller()
    cluster.start_agent("pcie")
    c = cluster.client()
    first = allocate(c, "whole", gpu_count=1)
    assert [d.gpu_index for d in first.devices] == [0]
    pair = allocate(c, "whole", gpu_count=2)
    assert sorted(d.gpu_index for d in pair.devices) == [2, 3]


def test_mps_shares_avoid_a_node_that_cannot_run_mps(cluster):
    """A node whose agent has no MPS control binary (driver without it, a wrong mps_control_binary)
    was offered fastpod and mps shares like any other, and every one placed there failed at the
    agent. Its inventory now says why it cannot run MPS: shares go elsewhere, and when no other
    GPU is left the rejection names the node and the missing binary. MIG slices and whole GPUs,
    which need no MPS, still go there."""
    cluster.add_machine("no-mps", ["L4"])
    cluster.add_machine("mps", ["L4"])
    cluster.start_controller()
    cluster.start_agent("no-mps", config={"mps_control_binary": "/nonexistent/nvidia-cuda-mps-control"})
    cluster.start_agent("mps")
    c = cluster.client()
    agent = cluster.agents["no-mps"].stub(cluster.pki)
    inventory = agent.GetInventory(agent_pb2.GetInventoryRequest(), timeout=30)
    assert "/nonexistent/nvidia-cuda-mps-control" in inventory.mps_unavailable
    shares = [allocate(c, "fastpod", sm_percent=20, memory_bytes=GiB, quota_request=0.2, quota_limit=0.2)
              for _ in range(2)]
    assert {a.node for a in shares} == {"mps"}
    with pytest.raises(grpc.RpcError) as exc:
        allocate(c, "mps", memory_bytes=GiB)      # the mps node's GPU holds fastpod shares
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "node no-mps cannot run MPS" in exc.value.details()
    assert "/nonexistent/nvidia-cuda-mps-control" in exc.value.details()
    nodes = {n.name: n for n in cluster.status().nodes}
    assert "/nonexistent" in nodes["no-mps"].mps_unavailable and not nodes["mps"].mps_unavailable
    table = CliRunner().invoke(main, ["status", "--controller", cluster.address, "--tls-dir",
                                      str(cluster.pki.dir), "--tls-name", "client"], env={"COLUMNS": "250"})
    assert "no MPS shares: MPS control binary /nonexistent" in table.output, table.output
    whole = allocate(c, "whole", gpu_count=1)     # needs no MPS: the idle GPU of no-mps
    assert whole.node == "no-mps"
    for a in (*shares, whole):
        c.call("Release", pb.ReleaseAllocationRequest(allocation_id=a.id))
    assert_consistent(cluster)
