"""Cordon/uncordon: a cordoned node keeps its allocations, gets no new ones, and stays cordoned
across controller restarts and agent re-registration (real controller, agents, CLI)."""

from __future__ import annotations

import json
import subprocess

import grpc
import pytest

from fastshare.v1 import controller_pb2 as pb

from .conftest import GiB, allocate, assert_consistent, fastshare_bin


@pytest.fixture
def two_nodes(cluster):
    cluster.add_machine("node-a", ["A100-SXM4-40GB"], mig_enabled=True)
    cluster.add_machine("node-b", ["L4"])
    cluster.start_controller()
    cluster.start_agent("node-a")
    cluster.start_agent("node-b")
    return cluster


def cli(cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([fastshare_bin(), *args, "--controller", cluster.address, "--tls-dir",
                           str(cluster.pki.dir)], capture_output=True, text=True, timeout=60)


def test_cordoned_node_keeps_its_allocations_and_gets_no_new_ones(two_nodes):
    cluster = two_nodes
    c = cluster.client()
    held = allocate(c, "fastpod", sm_percent=20, memory_bytes=GiB, models=["L4"])
    assert held.node == "node-b"

    done = cli(cluster, "cordon", "node-b", "--reason", "MIG change", "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["cordoned"] and shown["cordon_reason"] == "MIG change"
    assert held.id in shown["gpus"][0]["allocation_ids"]

    with pytest.raises(grpc.RpcError) as exc:
        allocate(c, "fastpod", sm_percent=10, memory_bytes=GiB, models=["L4"])
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "1 node(s) are cordoned: MIG change (node-b)" in exc.value.details(), exc.value.details()
    assert allocate(c, "exclusive", mig_profile="1g.5gb").node == "node-a"   # the rest still works
    assert c.call("Get", pb.GetAllocationRequest(allocation_id=held.id)).state == pb.ALLOCATION_STATE_ACTIVE

    # A restarted controller (the agents register again) keeps the cordon.
    cluster.controller.stop()
    cluster.start_controller()
    c = cluster.client()
    cluster.wait_node("node-b", available=True)
    assert cluster.node("node-b").cordoned
    with pytest.raises(grpc.RpcError):
        allocate(c, "fastpod", sm_percent=10, memory_bytes=GiB, models=["L4"])
    table = cli(cluster, "status")
    assert "cordoned" in table.stdout   # the table wraps the reason to the column width

    done = cli(cluster, "uncordon", "node-b")
    assert done.returncode == 0 and "uncordoned" in done.stdout
    assert allocate(c, "fastpod", sm_percent=10, memory_bytes=GiB, models=["L4"]).node == "node-b"
    c.call("Release", pb.ReleaseAllocationRequest(allocation_id=held.id))
    assert_consistent(cluster)


def test_cordon_names_what_is_wrong(two_nodes):
    unknown = cli(two_nodes, "cordon", "node-z")
    assert unknown.returncode != 0
    assert "NOT_FOUND" in unknown.stderr and "node-a" in unknown.stderr and "node-b" in unknown.stderr
    c = two_nodes.client()
    with pytest.raises(grpc.RpcError) as exc:
        c.call("SetSchedulable", pb.SetSchedulableRequest(node="", schedulable=False))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "node" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        c.call("SetSchedulable", pb.SetSchedulableRequest(node="node-a", reason="x" * 300))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reason" in exc.value.details()
    assert not two_nodes.node("node-a").cordoned
    for request, field in ((pb.ForgetNodeRequest(node=""), "node"),
                           (pb.ForgetNodeRequest(node="n" * 300), "node"),
                           (pb.ForgetNodeRequest(node="node-a", reason="x" * 257), "reason")):
        with pytest.raises(grpc.RpcError) as exc:
            c.call("ForgetNode", request)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:   # its agent heartbeats
        c.call("ForgetNode", pb.ForgetNodeRequest(node="node-a"))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.value.details()
    assert two_nodes.node("node-a") is not None
