"""The GPU kinds validation checks requests against, kept as nodes are written and forgotten."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastshare.controller.core import ControllerCore, Settings
from fastshare.controller.gpu_kinds import GpuKinds
from fastshare.controller.model import Gpu, Kind, Node, Spec
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.controller.validation import Request, ValidationError
from fastshare.v1 import agent_pb2

from .recording_agent import RecordingAgent

GiB = 2**30
_GPUS = {"l4": ("NVIDIA L4", 22 * GiB), "a100": ("NVIDIA A100-SXM4-40GB", 40 * GiB),
         "a100-80": ("NVIDIA A100-SXM4-80GB", 80 * GiB)}


def _node(name: str, kinds: list[str]) -> Node:
    return Node(name=name, address="127.0.0.1:1", labels={}, available=True, last_heartbeat=0.0,
                registered_at=0.0, inventory={},
                gpus=[Gpu(i, f"GPU-{name}-{i}", *_GPUS[k], 58) for i, k in enumerate(kinds)])


def _from_scratch(nodes: dict[str, Node]) -> tuple[set[tuple[str, int]], int]:
    """What the controller worked out from every stored node before each request."""
    if any(not n.gpus for n in nodes.values()):
        return set(), 0
    return ({(g.model, g.memory_bytes) for n in nodes.values() for g in n.gpus},
            max((len(n.gpus) for n in nodes.values()), default=0))


def test_a_node_not_reporting_its_gpus_makes_the_cluster_unknown_until_it_does():
    kinds = GpuKinds([_node("a", ["l4", "l4"])])
    assert [(g.model, g.memory_bytes) for g in kinds.summary()[0]] == [_GPUS["l4"]]
    assert kinds.summary()[1] == 2
    kinds.put(_node("b", []))
    assert kinds.summary() == ([], 0)
    kinds.put(_node("b", ["a100", "a100", "a100"]))
    gpus, most = kinds.summary()
    assert {(g.model, g.memory_bytes) for g in gpus} == {_GPUS["l4"], _GPUS["a100"]} and most == 3
    kinds.remove("b")
    assert kinds.summary()[1] == 2 and len(kinds.summary()[0]) == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from("abcd"), st.lists(st.sampled_from(sorted(_GPUS)), max_size=4)),
    st.tuples(st.just("remove"), st.sampled_from("abcde"))), max_size=30))
def test_kept_node_by_node_it_says_what_the_nodes_now_have(steps):
    """Property: after any nodes written, rewritten with other GPUs and forgotten, the kinds
    and the most GPUs on a node are those of the nodes left, as worked out from all of them."""
    kinds, nodes = GpuKinds(), {}
    for step in steps:
        if step[0] == "put":
            nodes[step[1]] = _node(step[1], step[2])
            kinds.put(nodes[step[1]])
        else:
            nodes.pop(step[1], None)
            kinds.remove(step[1])
        gpus, most = kinds.summary()
        assert len(gpus) == len({(g.model, g.memory_bytes) for g in gpus})   # one of each kind
        assert ({(g.model, g.memory_bytes) for g in gpus}, most) == _from_scratch(nodes)


class _Agents:
    """Stand-in agents: each node's inventory is one GPU of the kind named for it."""

    deadline = 10.0

    def __init__(self) -> None:
        self.kind: dict[str, str] = {}

    def get(self, node: str, address: str) -> _Agent:
        return _Agent(_GPUS[self.kind[node]])

    def drop(self, node: str) -> None:
        pass


class _Agent(RecordingAgent):
    def __init__(self, gpu: tuple[str, int]) -> None:
        super().__init__()
        self.gpu = gpu

    def inventory(self) -> agent_pb2.Inventory:
        return agent_pb2.Inventory(gpus=[agent_pb2.Gpu(index=0, uuid=f"GPU-{self.gpu[0]}", name=self.gpu[0],
                                                       memory_bytes=self.gpu[1], sm_count=108)])


def test_requests_are_judged_against_the_nodes_as_they_come_and_go_without_reading_them_all(tmp_path):
    """The cluster's GPU kinds follow each node write and deletion; reading every stored node
    after each (0.7 s at 10,000 nodes) happens once, when first asked."""
    listings = []

    class Store(SqliteStore):
        def list_nodes(self):
            listings.append(1)
            return super().list_nodes()

    agents, now = _Agents(), [1000.0]
    core = ControllerCore(Store(tmp_path / "state.db"), agents, Settings(heartbeat_timeout=8.0),
                          clock=lambda: now[0])
    big = Request(spec=Spec(Kind.MPS, memory_bytes=30 * GiB), owner="t")
    try:
        agents.kind["a"] = "l4"
        core.register_node("a", "127.0.0.1:1", {})
        with pytest.raises(ValidationError, match=r"spec\.memory_bytes"):
            core.allocate(big)
        agents.kind["b"] = "a100-80"
        core.register_node("b", "127.0.0.1:2", {})
        held = core.allocate(big)
        assert held.node == "b"
        now[0] += 60   # b's agent is gone for good (and a's silent): b is forgotten
        core.check_liveness()
        core.forget_node("b")
        with pytest.raises(ValidationError, match=r"spec\.memory_bytes"):
            core.allocate(big)
        agents.kind["a"] = "a100"   # its GPU replaced by a larger one
        core.register_node("a", "127.0.0.1:1", {})
        assert core.allocate(big).node == "a"
        assert len(listings) <= 1
    finally:
        core.store.close()


def test_the_first_allocate_after_a_start_finds_the_gpu_kinds_worked_out(tmp_path):
    """The start works out what the first Allocate would (0.7 s at 10,000 nodes)."""
    listings = []

    class Store(SqliteStore):
        def list_nodes(self):
            listings.append(1)
            return super().list_nodes()

    agents = _Agents()
    agents.kind.update(a="l4", b="a100")
    store = Store(tmp_path / "state.db")
    core = ControllerCore(store, agents)
    for name in ("a", "b"):
        core.register_node(name, f"127.0.0.1:{len(name)}", {})
    try:
        restarted = ControllerCore(store, agents)
        Reconciler(restarted).start()
        listings.clear()
        assert restarted.allocate(Request(spec=Spec(Kind.MPS, memory_bytes=30 * GiB), owner="t")).node == "b"
        assert listings == []
    finally:
        store.close()
