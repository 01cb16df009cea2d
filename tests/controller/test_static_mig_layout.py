"""A MIG layout laid out before fastshare (the Ansible mig_config module, or by hand) is part of
the GPU: exclusive requests take its slices as they are and new slices go around them."""

from __future__ import annotations

import time

import grpc
import pytest

from fastshare.device import open_devices
from fastshare.v1 import controller_pb2 as pb

from .conftest import allocate, assert_consistent

THREE_G = 9   # A100-40GB 3g.20gb: 4 memory slices, starts 0 and 4


@pytest.fixture
def laid_out(cluster):
    cluster.add_machine("node-a", ["A100-SXM4-40GB"], mig_enabled=True)
    with open_devices("sim", cluster.root / "node-a.json") as devices:
        layout = {devices.create_mig_instance(0, THREE_G, start).uuid for start in (0, 4)}
    cluster.start_controller()
    cluster.start_agent("node-a")
    return cluster, layout


def test_exclusive_requests_take_the_layout_slices_and_create_nothing_over_them(laid_out):
    cluster, layout = laid_out
    c = cluster.client()
    first = allocate(c, "exclusive", mig_profile="3g.20gb")
    assert first.state == pb.ALLOCATION_STATE_ACTIVE and first.devices[0].mig_uuid in layout
    small = allocate(c, "exclusive", sm_count=14)       # no 1g fits beside the layout: the other 3g
    assert small.state == pb.ALLOCATION_STATE_ACTIVE and small.devices[0].mig_uuid in layout - {
        first.devices[0].mig_uuid}
    with pytest.raises(grpc.RpcError) as exc:             # refused up front, not failed on the node
        allocate(c, "exclusive", sm_count=14)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "free placement" in exc.value.details()
    time.sleep(5)   # reconcile passes (every 2 s) refresh the view: both layout slices are held
    c.call("Release", pb.ReleaseAllocationRequest(allocation_id=first.id))
    # The layout's slice stays (the agent did not make it), and the view shows it unheld at
    # once: a small request takes it rather than trying to create a 1g over it.
    retaken = allocate(c, "exclusive", sm_count=14)
    assert retaken.state == pb.ALLOCATION_STATE_ACTIVE
    assert retaken.devices[0].mig_uuid == first.devices[0].mig_uuid
    with open_devices("sim", cluster.root / "node-a.json") as devices:
        assert {m.uuid for m in devices.mig_instances(0)} == layout
    assert_consistent(cluster)
