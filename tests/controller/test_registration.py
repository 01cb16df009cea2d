"""The agent's registrar over real mTLS gRPC against a stand-in NodeRegistry."""

import threading
import time
from concurrent import futures

import grpc

from fastshare.controller.registration import Registrar
from fastshare.security import certs
from fastshare.security.tls import TlsPaths, server_credentials
from fastshare.v1 import controller_pb2 as pb
from fastshare.v1 import controller_pb2_grpc as pb_grpc
from tests.security.handmade import issue_client_cert, issue_roleless_cert, issue_unchecked

from .conftest import Pki, wait_for


class Registry(pb_grpc.NodeRegistryServicer):
    def __init__(self) -> None:
        self.heartbeats = threading.Semaphore(0)
        self.registrations = threading.Semaphore(0)

    def RegisterNode(self, request, context):
        self.registrations.release()
        return pb.RegisterNodeResponse(heartbeat_interval_seconds=1)

    def Heartbeat(self, request, context):
        self.heartbeats.release()
        return pb.HeartbeatResponse(registered=True)


def test_the_registrar_presents_the_certificate_renewed_on_disk_after_the_old_one_expired(tmp_path):
    """After the agent's first certificate ended (renewed in place meanwhile), a reconnection
    (here: the controller restarted) must use the new one, without an agent restart."""
    pki = Pki(tmp_path)
    issue_client_cert(pki.ca, "node-x", pki.dir, ends_in_days=2 / 86400, role="node")
    ends = time.monotonic() + 2

    def serve(address):
        registry = Registry()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_NodeRegistryServicer_to_server(registry, server)
        port = server.add_secure_port(address, server_credentials(TlsPaths.in_dir(pki.dir, "controller")))
        server.start()
        return server, registry, f"127.0.0.1:{port}"

    server, registry, address = serve("127.0.0.1:0")
    registrar = Registrar(address, "node-x", "127.0.0.1:1", TlsPaths.in_dir(pki.dir, "node-x"),
                          controller_name="controller").start()
    try:
        assert registry.heartbeats.acquire(timeout=10)
        pki.issue("node-x")                      # renewed before the old one ends
        time.sleep(max(0.0, ends - time.monotonic()) + 0.5)
        server.stop(None)                        # the controller restarts: a new handshake
        server, registry, _ = serve(address)
        assert registry.heartbeats.acquire(timeout=15), "the registrar never got through again"
    finally:
        registrar.stop()
        server.stop(None)


def _serve(pki: Pki, name: str) -> tuple[grpc.Server, Registry, str]:
    registry = Registry()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_NodeRegistryServicer_to_server(registry, server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(TlsPaths.in_dir(pki.dir, name)))
    server.start()
    return server, registry, f"127.0.0.1:{port}"


def test_the_registrar_sends_nothing_to_a_server_without_the_controller_role(tmp_path, caplog):
    """gRPC checks only that the server's certificate lists the name dialled ("controller"): a
    node certificate that lists it too (here another node's, at the controller's address) got
    every RegisterNode and Heartbeat. The registrar now checks the server's role first."""
    pki = Pki(tmp_path)
    issue_unchecked(pki.ca, "gpu-9", pki.dir, sans=("controller", "127.0.0.1"), role="node")
    pki.issue("node-x")
    server, registry, address = _serve(pki, "gpu-9")
    registrar = Registrar(address, "node-x", "127.0.0.1:1", TlsPaths.in_dir(pki.dir, "node-x"),
                          controller_name="controller").start()
    try:
        assert not registry.registrations.acquire(timeout=4), "the registrar registered with a node"
        assert not registry.heartbeats.acquire(timeout=0)
        assert not registrar.registered.is_set()
    finally:
        registrar.stop()
        server.stop(None)
    said = caplog.text
    assert f"controller at {address}" in said and "'gpu-9'" in said and "the node role" in said, said
    assert "not the controller role" in said, said
    # the real controller's certificate: registered at once
    server, registry, address = _serve(pki, "controller")
    registrar = Registrar(address, "node-x", "127.0.0.1:1", TlsPaths.in_dir(pki.dir, "node-x"),
                          controller_name="controller").start()
    try:
        assert registry.registrations.acquire(timeout=10) and registry.heartbeats.acquire(timeout=10)
    finally:
        registrar.stop()
        server.stop(None)


def test_an_agent_with_a_certificate_from_before_roles_registers_once_it_is_reissued(cluster):
    """The upgrade: the controller refuses the node's old role-less certificate, and says how to
    fix it; once the certificate is issued again with the node role in place (what the Ansible
    role does), the running agent picks it up and registers, without a restart."""
    cluster.start_controller()
    cluster.add_machine("n1", ["A100-SXM4-40GB"])
    issue_roleless_cert(cluster.pki.ca, "n1", cluster.pki.dir, sans=("127.0.0.1", "localhost"))
    agent = cluster.start_agent("n1", wait=False)
    wait_for(lambda: "fastshare certs issue --role node --name n1" in agent.output(), 60,
             "the agent logging the controller's refusal")
    assert "has no role" in agent.output()
    assert cluster.node("n1") is None
    cluster.pki.issue("n1")                      # renewed in place, now with the node role
    cluster.wait_node("n1", available=True)
    assert agent.alive()


def test_the_controller_and_the_agent_warn_at_start_of_their_certificate_ending_soon(cluster):
    """Bare-metal certificates last 30 days and only a new playbook run renewed them: both
    servers now say, at start and daily, that theirs ends within 7 days, and how to renew it."""
    certs.issue(cluster.pki.ca, "controller", cluster.pki.dir, sans=["127.0.0.1", "localhost"],
                role="controller", days=3)
    controller = cluster.start_controller()
    wait_for(lambda: "WARNING" in controller.output() and "controller.crt expires on" in controller.output(),
             30, "the controller's warning")
    assert "fastshare certs issue --role controller --name controller" in controller.output()
    cluster.add_machine("n1", ["A100-SXM4-40GB"])
    certs.issue(cluster.pki.ca, "n1", cluster.pki.dir, sans=["127.0.0.1", "localhost"], role="node", days=2)
    agent = cluster.start_agent("n1")
    wait_for(lambda: "n1.crt expires on" in agent.output(), 30, "the agent's warning")
    assert "WARNING" in agent.output() and "fastshare certs issue --role node --name n1" in agent.output()


def test_the_registrar_heartbeats_at_the_interval_each_heartbeat_reply_gives(tmp_path):
    """A controller of a large cluster asks for longer intervals in its replies; a reply
    without one (0: a controller from before) keeps the interval the agent has."""
    pki = Pki(tmp_path)
    pki.issue("node-x")

    class Stretching(Registry):
        def __init__(self) -> None:
            super().__init__()
            self.beats = 0

        def Heartbeat(self, request, context):
            self.beats += 1
            self.heartbeats.release()
            return pb.HeartbeatResponse(registered=True,
                                        heartbeat_interval_seconds=3 if self.beats == 2 else 0)

    registry = Stretching()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_NodeRegistryServicer_to_server(registry, server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(TlsPaths.in_dir(pki.dir, "controller")))
    server.start()
    registrar = Registrar(f"127.0.0.1:{port}", "node-x", "127.0.0.1:1", TlsPaths.in_dir(pki.dir, "node-x"),
                          controller_name="controller").start()
    try:
        for _ in range(2):
            assert registry.heartbeats.acquire(timeout=10)
        wait_for(lambda: registrar.interval == 3.0, timeout=5, what="the interval of the reply")
        began = time.monotonic()
        assert registry.heartbeats.acquire(timeout=10)   # the third: 3 s after the second
        assert registrar.interval == 3.0, "a reply without an interval keeps the one given"
        assert time.monotonic() - began > 2.0
    finally:
        registrar.stop()
        server.stop(None)
