"""Every RPC of the controller answers a failing state file (full disk, I/O error) with the
same clear UNAVAILABLE, and node registrations are bounded; the servicers in process, over
real mTLS gRPC and a real SQLite store whose writes (or reads) fail on demand."""

from __future__ import annotations

import sqlite3
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from fastshare.controller.core import ControllerCore
from fastshare.controller.server import Authenticator, ControllerServicer, RegistryServicer
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.security.tls import TlsPaths, mtls_channel, server_credentials
from fastshare.v1 import agent_pb2
from fastshare.v1 import controller_pb2 as pb
from fastshare.v1 import controller_pb2_grpc as pb_grpc

from .conftest import Pki
from .test_store import _alloc

FULL = "database or disk is full"   # what SQLite says when a write finds no room


class FailingStore(SqliteStore):
    """A real store; the methods named in ``failing`` raise SQLite's own error instead."""

    failing: dict[str, str] = {}

    def _fail(self, name: str) -> None:
        if name in self.failing:
            raise sqlite3.OperationalError(self.failing[name])

    def put_node(self, node):
        self._fail("put_node")
        super().put_node(node)

    def mark_node(self, name, **kw):
        self._fail("mark_node")
        super().mark_node(name, **kw)

    def get_allocation(self, allocation_id):
        self._fail("get_allocation")
        return super().get_allocation(allocation_id)


class _Agent:
    def inventory(self) -> agent_pb2.Inventory:
        return agent_pb2.Inventory(boot_id="b1", agent_version="test")


class _Agents:
    deadline = 10.0   # seconds, as AgentPool.deadline

    def get(self, node, address):
        return _Agent()


@pytest.fixture
def controller(tmp_path):
    pki = Pki(tmp_path)
    pki.issue("n1")
    store = FailingStore(tmp_path / "state.db")
    store.failing = {}
    core = ControllerCore(store, _Agents())
    registered = []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ControllerServicer_to_server(ControllerServicer(core, Authenticator("cert", ())), server)
    pb_grpc.add_NodeRegistryServicer_to_server(RegistryServicer(core, registered.append), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(TlsPaths.in_dir(pki.dir, "controller")))
    server.start()
    channels = []

    def channel(name: str) -> grpc.Channel:
        channels.append(mtls_channel(f"127.0.0.1:{port}", TlsPaths.in_dir(pki.dir, name),
                                     server_name="controller"))
        return channels[-1]

    yield SimpleNamespace(store=store, channel=channel, registered=registered)
    for c in channels:
        c.close()
    server.stop(None)
    store.close()


def _unavailable(exc: grpc.RpcError, what: str) -> None:
    assert exc.code() == grpc.StatusCode.UNAVAILABLE, (exc.code(), exc.details())
    assert "the state file cannot be written" in exc.details() and what in exc.details()
    assert "Traceback" not in exc.details() and "Exception" not in exc.details()


def test_register_node_on_a_full_disk_is_unavailable_with_the_reason(controller):
    store, channel, registered = controller.store, controller.channel, controller.registered
    store.failing = {"put_node": FULL}
    registry = pb_grpc.NodeRegistryStub(channel("n1"))
    with pytest.raises(grpc.RpcError) as exc:
        registry.RegisterNode(pb.RegisterNodeRequest(node="n1", address="127.0.0.1:1"), timeout=10)
    _unavailable(exc.value, FULL)
    assert registered == [] and store.list_nodes() == []
    store.failing = {}
    registry.RegisterNode(pb.RegisterNodeRequest(node="n1", address="127.0.0.1:1"), timeout=10)
    assert registered == ["n1"] and [n.name for n in store.list_nodes()] == ["n1"]


def test_heartbeat_on_a_full_disk_is_unavailable_with_the_reason(controller):
    store, channel = controller.store, controller.channel
    registry = pb_grpc.NodeRegistryStub(channel("n1"))
    registry.RegisterNode(pb.RegisterNodeRequest(node="n1", address="127.0.0.1:1"), timeout=10)
    store.failing = {"mark_node": FULL}
    with pytest.raises(grpc.RpcError) as exc:
        registry.Heartbeat(pb.HeartbeatRequest(node="n1"), timeout=10)
    _unavailable(exc.value, FULL)


def test_watch_on_a_failing_state_file_is_unavailable_with_the_reason(controller):
    store, channel = controller.store, controller.channel
    store.create_allocation(_alloc("fs-1"))
    store.failing = {"get_allocation": "disk I/O error"}
    stub = pb_grpc.ControllerStub(channel("client"))
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Watch(pb.WatchAllocationsRequest(allocation_id="fs-1"), timeout=10))
    _unavailable(exc.value, "disk I/O error")
    store.failing = {}   # the same call works again, and its other answers are unchanged
    first = next(stub.Watch(pb.WatchAllocationsRequest(allocation_id="fs-1"), timeout=10))
    assert first.allocation.id == "fs-1"
    for allocation_id, code, text in (("fs-2", grpc.StatusCode.NOT_FOUND, "fs-2 does not exist"),
                                      ("x" * 200, grpc.StatusCode.INVALID_ARGUMENT, "allocation_id")):
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Watch(pb.WatchAllocationsRequest(allocation_id=allocation_id), timeout=10))
        assert exc.value.code() == code and text in exc.value.details(), exc.value.details()


@pytest.mark.parametrize(("labels", "text"), [
    ({f"k{i}": "v" for i in range(65)}, "at most 64 labels, got 65"),
    ({"k" * 64: "v"}, "label key"),
    ({"a/" + "b" * 64: "v"}, "label key"),
    ({"x" * 254 + "/name": "v"}, "label key"),
    ({"": "v"}, "label key"),
    ({"bad key": "v"}, "label key"),
    ({"zone": "v" * 64}, "at most 63"),
    ({"zone": "a b"}, "label value"),
    ({"zone": "-a"}, "label value"),
    ({"zone": "a\n"}, "label value"),
])
def test_register_node_labels_are_bounded_and_name_the_field(controller, labels, text):
    store, channel, registered = controller.store, controller.channel, controller.registered
    registry = pb_grpc.NodeRegistryStub(channel("n1"))
    with pytest.raises(grpc.RpcError) as exc:
        registry.RegisterNode(pb.RegisterNodeRequest(node="n1", address="127.0.0.1:1", labels=labels),
                              timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
    assert exc.value.details().startswith("labels") and text in exc.value.details(), exc.value.details()
    assert registered == [] and store.list_nodes() == []


def test_register_node_accepts_kubernetes_style_labels(controller):
    store, channel = controller.store, controller.channel
    longest = "x" * 253 + "/" + "y" * 63
    labels = {f"k{i}": "v" for i in range(61)} | {"fastshare.io/zone": "a", longest: "z" * 63, "empty": ""}
    assert len(labels) == 64
    registry = pb_grpc.NodeRegistryStub(channel("n1"))
    registry.RegisterNode(pb.RegisterNodeRequest(node="n1", address="127.0.0.1:1", labels=labels), timeout=10)
    assert store.get_node("n1").labels == labels


def test_a_state_file_locked_by_another_process_is_unavailable_with_the_reason(controller):
    """An operator's sqlite3 shell (or a backup) holding a write transaction past the busy
    timeout: a real second connection holds the lock."""
    store, channel, registered = controller.store, controller.channel, controller.registered
    store._db.execute("PRAGMA busy_timeout=200")   # the store waits 30 s by default
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    registry = pb_grpc.NodeRegistryStub(channel("n1"))
    try:
        with pytest.raises(grpc.RpcError) as exc:
            registry.RegisterNode(pb.RegisterNodeRequest(node="n1", address="127.0.0.1:1"), timeout=10)
        _unavailable(exc.value, "another process holds its lock")
        assert registered == []
    finally:
        other.execute("ROLLBACK")
        other.close()
    registry.RegisterNode(pb.RegisterNodeRequest(node="n1", address="127.0.0.1:1"), timeout=10)
    assert registered == ["n1"]
