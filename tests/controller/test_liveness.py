"""Node liveness in the controller core against a real SQLite store and the real ledger: a
heartbeat that races with the liveness check must leave the node usable. The agents are a
stand-in: the decisions are the core's."""

from __future__ import annotations

import threading

import grpc

from fastshare.controller import core as core_module
from fastshare.controller.agent_client import AgentError
from fastshare.controller.core import ControllerCore, Settings
from fastshare.controller.model import Kind, Spec
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.placement.model import Assignment
from fastshare.v1 import agent_pb2

GiB = 1024**3


class _Agents:
    deadline = 10.0   # seconds, as AgentPool.deadline

    def get(self, node: str, address: str) -> _Agents:
        return self

    def drop(self, node: str) -> None:
        pass

    def inventory(self) -> agent_pb2.Inventory:
        return agent_pb2.Inventory(gpus=[agent_pb2.Gpu(index=0, uuid="GPU-0", name="NVIDIA L4",
                                                       memory_bytes=22 * GiB, sm_count=58)])


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fits(core: ControllerCore, allocation_id: str) -> bool:
    request = core.ledger.to_request(allocation_id, Spec(Kind.MPS, memory_bytes=GiB))
    placed = core.ledger.place(request)
    return isinstance(placed, Assignment)


def test_heartbeat_during_the_liveness_check_leaves_the_node_usable(tmp_path):
    """The node's first heartbeat after a silence lands while check_liveness is recording the
    node as lost: whichever order they finish in, the node ends up available in the ledger."""
    hook: list[threading.Thread] = []

    class Store(SqliteStore):
        def mark_node(self, name: str, *, available: bool, last_heartbeat: float | None = None) -> None:
            if not available and not hook:   # the heartbeat arrives right now, from another thread
                beat = threading.Thread(target=core.heartbeat, args=(name,))
                hook.append(beat)
                beat.start()
                beat.join(timeout=0.5)
            super().mark_node(name, available=available, last_heartbeat=last_heartbeat)

    store = Store(tmp_path / "state.db")
    clock = _Clock()
    core = ControllerCore(store, _Agents(), Settings(heartbeat_timeout=8.0), clock=clock)
    try:
        core.register_node("n1", "127.0.0.1:1", {})
        assert _fits(core, "fs-1")
        clock.now += 60
        assert core.check_liveness() == ["n1"]
        hook[0].join(timeout=10)
        assert core.heartbeat("n1")   # and the agent keeps heartbeating
        assert core.is_available("n1")
        assert _fits(core, "fs-2"), "the node is alive and heartbeating but gets no new work"
    finally:
        store.close()


def test_a_cordon_set_during_a_registration_is_kept_in_the_store(tmp_path):
    """An operator cordons a node while its agent re-registers: the registration must not
    write back the node it read before the cordon, or the cordon is gone after a restart."""
    hook: list[threading.Thread] = []
    registering = False

    class Store(SqliteStore):
        def get_node(self, name: str):
            node = super().get_node(name)
            if node is not None and registering and not hook:   # the cordon arrives right now
                cordon = threading.Thread(target=core.set_schedulable, args=(name, False, "disk"))
                hook.append(cordon)
                cordon.start()
                cordon.join(timeout=0.5)
            return node

    store = Store(tmp_path / "state.db")
    core = ControllerCore(store, _Agents(), Settings(heartbeat_timeout=8.0), clock=_Clock())
    try:
        core.register_node("n1", "127.0.0.1:1", {})
        registering = True
        core.register_node("n1", "127.0.0.1:1", {})   # the agent restarted
        hook[0].join(timeout=10)
        assert store.get_node("n1").cordoned, "the cordon was lost from the store"
        assert not _fits(core, "fs-1")                 # and the ledger agrees
    finally:
        store.close()


def test_a_large_cluster_is_told_a_longer_interval_and_judged_by_a_longer_timeout(tmp_path, monkeypatch):
    """Past HEARTBEATS_PER_SECOND (here 2 a second, for 5 nodes: 3 s) the agents are told a
    longer interval, the timeout stretches with it (8 s for 2 s: 12 s), and reconcile passes
    come no oftener. Forgetting nodes does not shorten the interval: agents told the longer one
    still wait it before their next heartbeat."""
    monkeypatch.setattr(core_module, "HEARTBEATS_PER_SECOND", 2)
    clock = _Clock()
    core = ControllerCore(SqliteStore(tmp_path / "state.db"), _Agents(),
                          Settings(heartbeat_interval=2.0, heartbeat_timeout=8.0, reconcile_interval=2.5),
                          clock=clock)
    try:
        core.register_node("n0", "127.0.0.1:1", {})
        assert core.heartbeat_interval() == 2 and core.heartbeat_timeout() == 8.0   # the settings'
        assert core.pass_interval() == 2.5
        for i in range(1, 5):
            core.register_node(f"n{i}", "127.0.0.1:1", {})
        assert core.heartbeat_interval() == 3 and core.heartbeat_timeout() == 12.0
        assert core.pass_interval() == 3, "a pass asks every agent too: no oftener than their heartbeats"
        clock.now += 11   # past the settings' timeout, within the stretched one
        assert core.check_liveness() == []
        assert all(core.is_available(f"n{i}") for i in range(5))
        clock.now += 2
        assert sorted(core.check_liveness()) == [f"n{i}" for i in range(5)]
        for i in range(4):
            core.forget_node(f"n{i}")
        assert core.heartbeat_interval() == 3 and core.heartbeat_timeout() == 12.0
    finally:
        core.store.close()


def test_a_small_cluster_keeps_its_settings_even_below_one_second(tmp_path):
    """The in-cluster controller pings every --node-interval (down to 0.1 s), its core's
    heartbeat interval: a few nodes change nothing of it, nor of the timeout or the passes."""
    core = ControllerCore(SqliteStore(tmp_path / "state.db"), _Agents(),
                          Settings(heartbeat_interval=0.5, heartbeat_timeout=3.0, reconcile_interval=0.5))
    try:
        for i in range(3):
            core.register_node(f"n{i}", "127.0.0.1:1", {})
        assert core.interval_for_size() == 0
        assert core.heartbeat_timeout() == 3.0 and core.pass_interval() == 0.5
    finally:
        core.store.close()


def test_a_restart_with_few_agents_reachable_keeps_the_interval_of_the_cluster_stored(tmp_path, monkeypatch):
    """The process before told 5 nodes' agents 3 s (2 heartbeats a second here); restarted with
    none of them reachable, the timeout is still the stretched one, not 8 s."""
    from fastshare.controller.reconciler import Reconciler

    monkeypatch.setattr(core_module, "HEARTBEATS_PER_SECOND", 2)
    settings = Settings(heartbeat_interval=2.0, heartbeat_timeout=8.0)
    store = SqliteStore(tmp_path / "state.db")
    try:
        before = ControllerCore(store, _Agents(), settings)
        for i in range(5):
            before.register_node(f"n{i}", "127.0.0.1:1", {})
        assert before.heartbeat_interval() == 3

        class Unreachable(_Agents):
            def inventory(self):
                raise AgentError("n0", "GetInventory", grpc.StatusCode.UNAVAILABLE, "connection refused")

        restarted = ControllerCore(store, Unreachable(), settings)
        Reconciler(restarted).start()
        assert restarted.heartbeat_interval() == 3 and restarted.heartbeat_timeout() == 12.0
    finally:
        store.close()
