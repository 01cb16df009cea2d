"""An operator's call naming a node the controller does not know (a typo): the error says which
are known, or in a large cluster how many and the likeliest meant, without reading them all."""

from __future__ import annotations

import pytest

from fastshare.controller.core import MAX_NAMED_NODES, ControllerCore, NotFound
from fastshare.controller.sqlite_store import SqliteStore

from .test_liveness import _Agents


class _NoListing(SqliteStore):
    def list_nodes(self):
        raise AssertionError("every node read for an error message")


@pytest.fixture
def core(tmp_path):
    core = ControllerCore(_NoListing(tmp_path / "state.db"), _Agents())
    yield core
    core.store.close()


def test_a_small_cluster_names_its_nodes(core):
    with pytest.raises(NotFound, match=r"known: none registered yet"):
        core.set_schedulable("gpu-1", False)
    for name in ("gpu-2", "gpu-1"):
        core.register_node(name, "127.0.0.1:1", {})
    unknown = r"^node 'gpu-3' is not known to this controller \(known: gpu-1, gpu-2\)$"
    with pytest.raises(NotFound, match=unknown):
        core.forget_node("gpu-3")


def test_a_large_cluster_says_how_many_and_the_likeliest_meant(core):
    for i in range(MAX_NAMED_NODES + 5):
        core.register_node(f"gpu-node-{i:03d}", "127.0.0.1:1", {})
    with pytest.raises(NotFound) as refused:
        core.set_schedulable("gpu-node-O12", False)   # a letter O for a zero
    message = str(refused.value)
    assert f"{MAX_NAMED_NODES + 5:,} nodes, `fastshare status` lists them" in message
    assert "did you mean gpu-node-012, " in message   # first: it differs by the one letter alone
    assert "gpu-node-020" not in message and len(message) < 200
    with pytest.raises(NotFound) as refused:
        core.forget_node("rack7-host3")
    assert "did you mean" not in str(refused.value)
