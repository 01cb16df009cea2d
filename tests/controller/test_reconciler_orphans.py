"""Orphan detection against a real SQLite store: a share whose record was released AFTER the
agent's inventory was taken is not an orphan (the inventory is stale for it); one released
before is, and is freed. The agents are a recording stand-in: the decision is the reconciler's."""

import time

from fastshare.controller.core import ControllerCore
from fastshare.controller.model import Node, State
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.v1 import agent_pb2

from .test_store import _alloc


class _Agents:
    deadline = 10.0   # seconds, as AgentPool.deadline

    def __init__(self) -> None:
        self.released: list[str] = []

    def get(self, node: str, address: str) -> "_Agents":
        return self

    def release(self, share_id: str) -> agent_pb2.ReleaseShareReply:
        self.released.append(share_id)
        return agent_pb2.ReleaseShareReply(released=True)


def test_only_shares_released_before_the_inventory_are_orphans(tmp_path):
    store = SqliteStore(tmp_path / "state.db")
    try:
        store.put_node(Node(name="n1", address="127.0.0.1:1", labels={}, gpus=[], available=True,
                            last_heartbeat=time.time(), registered_at=time.time()))
        for i in ("fs-old", "fs-new"):
            store.create_allocation(_alloc(i))
            store.transition(i, [State.PENDING], State.RELEASING)
        store.transition("fs-old", [State.RELEASING], State.RELEASED)
        asked_at = time.time()
        time.sleep(0.01)
        store.transition("fs-new", [State.RELEASING], State.RELEASED)   # released after the inventory
        agents = _Agents()
        reconciler = Reconciler(ControllerCore(store, agents))
        inventory = agent_pb2.Inventory(shares=[agent_pb2.Share(id="fs-old"), agent_pb2.Share(id="fs-new")])
        report = reconciler._pass({"n1": inventory}, asked_at=asked_at)
        assert agents.released == ["fs-old"] and report.orphans_freed == ["fs-old"]
    finally:
        store.close()


def test_a_pass_for_some_nodes_frees_their_orphans_and_no_share_another_node_records(tmp_path):
    """A registration's pass reads only its nodes' records; a share whose holding record names
    another node (the record moved on) is still not an orphan, and one with no record is."""
    store = SqliteStore(tmp_path / "state.db")
    try:
        for name in ("n1", "n2"):
            store.put_node(Node(name=name, address="127.0.0.1:1", labels={}, gpus=[], available=True,
                                last_heartbeat=time.time(), registered_at=time.time()))
        store.create_allocation(_alloc("fs-moved", node="n2"))
        store.create_allocation(_alloc("fs-gone"))
        store.transition("fs-gone", [State.PENDING], State.RELEASING)
        store.transition("fs-gone", [State.RELEASING], State.RELEASED)
        time.sleep(0.01)
        agents = _Agents()
        reconciler = Reconciler(ControllerCore(store, agents))
        held = agent_pb2.Inventory(shares=[agent_pb2.Share(id="fs-moved"), agent_pb2.Share(id="fs-gone")])
        report = reconciler._pass({"n1": held}, only={"n1"}, asked_at=time.time())
        assert agents.released == ["fs-gone"] and report.orphans_freed == ["fs-gone"]
    finally:
        store.close()
