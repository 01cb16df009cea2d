"""kill -9 of the controller at every step of allocate and release (deterministic fault points),
then restart: every allocation is active on its agent or fully released, no GPU over capacity."""

from __future__ import annotations

import grpc
import pytest

from fastshare.controller import faults
from fastshare.v1 import controller_pb2 as pb

from .conftest import GiB, allocate, assert_consistent, states, wait_for

ALLOCATE_POINTS = [p for p in faults.POINTS if "release" not in p]
RELEASE_POINTS = [p for p in faults.POINTS if "release" in p]
SPECS = {
    "fastpod": dict(kind="fastpod", sm_percent=60, memory_bytes=2 * GiB, models=["L4"]),
    "exclusive": dict(kind="exclusive", mig_profile="3g.20gb"),
}


@pytest.fixture
def node(cluster):
    cluster.add_machine("node-a", ["A100-SXM4-40GB", "L4"], mig_enabled=True)
    return cluster


def _crash(cluster, point: str, call) -> None:
    """Run ``call`` against a controller armed with ``point``; it must die with SIGKILL there."""
    controller = cluster.controller
    with pytest.raises(grpc.RpcError) as exc:
        call()
    assert exc.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                                grpc.StatusCode.CANCELLED), exc.value
    controller.popen.wait(timeout=60)
    assert controller.popen.returncode == -9, controller.output()
    controller.stop()


def _restart(cluster) -> None:
    cluster.start_controller()
    cluster.wait_node("node-a", available=True)


@pytest.mark.parametrize("point", ALLOCATE_POINTS)
@pytest.mark.parametrize("kind", ["fastpod", "exclusive"])
def test_crash_during_allocate(node, point, kind):
    cluster = node
    cluster.start_controller(env={faults.ENV: point})
    cluster.start_agent("node-a")
    spec = dict(SPECS[kind])
    kind_name = spec.pop("kind")
    _crash(cluster, point, lambda: allocate(cluster.client(), kind_name, key="job-1", ttl=0, **spec))
    _restart(cluster)
    assert_consistent(cluster)
    # Rolled forward: the half-done allocation is active and prepared on the agent.
    (alloc_id, state), = states(cluster).items()
    assert state == "active"
    # The client's retry with the same key finds it.
    again = allocate(cluster.client(), kind_name, key="job-1", **spec)
    assert again.id == alloc_id and again.state == pb.ALLOCATION_STATE_ACTIVE
    # The rebuilt ledger counts it: the same amount again does not fit on the same GPU.
    if kind == "fastpod":
        with pytest.raises(grpc.RpcError) as exc:
            allocate(cluster.client(), kind_name, **spec)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    cluster.client().call("Release", pb.ReleaseAllocationRequest(allocation_id=alloc_id))
    assert_consistent(cluster)


@pytest.mark.parametrize("point", RELEASE_POINTS)
def test_crash_during_release(node, point):
    cluster = node
    cluster.start_controller(env={faults.ENV: point})
    cluster.start_agent("node-a")
    spec = dict(SPECS["fastpod"])
    a = allocate(cluster.client(), spec.pop("kind"), **spec)
    _crash(cluster, point, lambda: cluster.client().call(
        "Release", pb.ReleaseAllocationRequest(allocation_id=a.id)))
    _restart(cluster)
    assert states(cluster) == {a.id: "released"}
    assert_consistent(cluster)
    # Capacity came back: the full GPU fits again.
    whole = allocate(cluster.client(), "fastpod", sm_percent=100, memory_bytes=GiB, models=["L4"])
    cluster.client().call("Release", pb.ReleaseAllocationRequest(allocation_id=whole.id))


def test_expired_lease_is_released(node):
    """A client that vanished (kill -9 of `fastshare run`) stops renewing: the reconciler frees it."""
    cluster = node
    cluster.start_controller()
    cluster.start_agent("node-a")
    a = allocate(cluster.client(), "mps", ttl=5, memory_bytes=GiB, models=["L4"])
    renewed = cluster.client().call("RenewLease", pb.RenewLeaseRequest(allocation_id=a.id))
    assert renewed.lease_expires_at >= a.lease_expires_at
    wait_for(lambda: states(cluster)[a.id] == "released", 60, "lease expiry")
    assert_consistent(cluster)


def test_controller_downtime_does_not_expire_leases(node):
    """Clients cannot renew while the controller is down; after a restart a lease gets a full
    ttl again, and only then expires if nobody renews it."""
    import time

    cluster = node
    cluster.start_controller()
    cluster.start_agent("node-a")
    a = allocate(cluster.client(), "mps", ttl=5, memory_bytes=GiB, models=["L4"])
    cluster.controller.kill9()
    time.sleep(7)   # longer than the ttl
    _restart(cluster)
    assert states(cluster)[a.id] == "active"
    assert_consistent(cluster)
    wait_for(lambda: states(cluster)[a.id] == "released", 60, "the lease to expire after the grace")
    assert_consistent(cluster)
