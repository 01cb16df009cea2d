"""What a controller's start and its reconcile passes read and how they build, against a real
SQLite store, the real ledger and stand-in agents: at 10,000 nodes each listing of the nodes
takes 0.4-0.7 s (bench/controller_scale.py)."""

from __future__ import annotations

import gc

from fastshare.controller.core import ControllerCore
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.sqlite_store import SqliteStore

from .recording_agent import RecordingAgent
from .test_gpu_kinds import _Agents


class _CountingStore(SqliteStore):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.listings, self.node_writes, self.collecting = 0, 0, []

    def list_nodes(self):
        self.listings += 1
        return super().list_nodes()

    def put_node(self, node):
        self.node_writes += 1
        return super().put_node(node)

    def list_allocations(self, *args, **kwargs):
        self.collecting.append(gc.isenabled())
        return super().list_allocations(*args, **kwargs)


def test_a_start_reads_the_stored_nodes_once_for_itself_and_builds_with_the_collector_paused(tmp_path):
    """At 10,000 nodes each listing of the nodes took 0.7 s of the start, which read them four
    times (two for itself), and the collector's full collections over what it built 3.7 s."""
    agent = RecordingAgent()
    store = _CountingStore(tmp_path / "state.db")
    try:
        before = ControllerCore(store, agent)
        for i in range(3):
            before.register_node(f"n{i}", f"127.0.0.1:{i + 1}", {})
        store.listings, store.collecting = 0, []
        assert Reconciler(ControllerCore(store, agent)).start().unreachable == []
        assert store.listings == 2, "the start's own, and the GPU kinds validation needs"
        assert store.collecting and not any(store.collecting)
        assert gc.isenabled()
    finally:
        store.close()


def test_a_pass_reads_the_nodes_once_and_rewrites_only_a_node_whose_gpus_changed(tmp_path):
    """A pass took over GPU facts that changed (a GPU swapped, MIG mode) from a second listing
    of every node; it now reads again only a node whose inventory differs from the listing."""
    agents = _Agents()
    agents.kind.update(a="l4", b="l4", c="l4")
    store = _CountingStore(tmp_path / "state.db")
    try:
        core = ControllerCore(store, agents)
        for i, name in enumerate("abc"):
            core.register_node(name, f"127.0.0.1:{i + 1}", {})
        reconciler = Reconciler(core)
        store.listings = store.node_writes = 0
        reconciler.run_once()
        assert (store.listings, store.node_writes) == (1, 0)
        agents.kind["b"] = "a100"   # its GPU replaced, the agent not restarted
        reconciler.run_once()
        assert store.listings == 2 and store.node_writes == 1
        assert store.get_node("b").gpus[0].model == "A100-SXM4-40GB"
        assert [g.model for g in store.get_node("a").gpus] == ["L4"]
    finally:
        store.close()
