"""The controller talks to node N's agent, not to whatever certificate lists N's name: it dials
N's agent by N's agent name (``N.agent.fastshare.invalid``, only N's node certificate lists it), and
refuses, before it sends anything, a server whose certificate is not N's own. Real mTLS gRPC
servers on loopback with certificates from `fastshare certs`."""

from __future__ import annotations

import gc
import logging
import re
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from fastshare.controller.agent_client import BACKOFF_FIRST_S, AgentClient, AgentError, AgentPool, AgentTarget
from fastshare.controller.core import AgentFailed, ControllerCore, Request
from fastshare.controller.model import Kind, Spec, State
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.security import certs
from fastshare.security.tls import TlsPaths, server_credentials
from fastshare.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from tests.security.handmade import issue_roleless_cert, issue_unchecked

from .conftest import Pki, wait_for
from .recording_agent import GiB, RecordingAgent

REISSUE = "fastshare certs issue --role node --name node-x"


class Agent(agent_pb2_grpc.NodeAgentServicer):
    """Records every call that reaches it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def Ping(self, request, context):
        self.calls.append("Ping")
        return common_pb2.Empty()

    def PrepareShare(self, request, context):
        self.calls.append(request.share.id)
        return agent_pb2.PrepareShareReply(share=request.share, created=True)

    def SetMigMode(self, request, context):
        self.calls.append(f"SetMigMode {request.gpu_uuid}")
        return agent_pb2.SetMigModeReply(changed=True)

    def GetInventory(self, request, context):
        self.calls.append("GetInventory")
        return RecordingAgent().inventory()

    def ReleaseShare(self, request, context):
        self.calls.append(f"ReleaseShare {request.share_id}")
        return agent_pb2.ReleaseShareReply(released=True)


def _serve(pki: Pki, name: str, port: int = 0) -> tuple[grpc.Server, Agent, int]:
    agent = Agent()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    agent_pb2_grpc.add_NodeAgentServicer_to_server(agent, server)
    port = server.add_secure_port(f"127.0.0.1:{port}", server_credentials(TlsPaths.in_dir(pki.dir, name)))
    server.start()
    return server, agent, port


def _client(pki: Pki, port: int) -> AgentClient:
    return AgentClient(AgentTarget("node-x", f"127.0.0.1:{port}"), TlsPaths.in_dir(pki.dir, "controller"),
                       deadline=5)


def _share(share_id: str, kind: int = common_pb2.SHARE_KIND_WHOLE) -> agent_pb2.Share:
    return agent_pb2.Share(id=share_id, kind=kind)


IMPOSTORS = {
    # another node's certificate that lists node-x as one of its host names
    "another node": ("gpu-9", lambda pki: certs.issue(pki.ca, "gpu-9", pki.dir, sans=["node-x", "127.0.0.1"],
                                                      role="node"),
                     "the node certificate of 'gpu-9' cannot act as node 'node-x'"),
    "the controller role": ("ctl-2", lambda pki: certs.issue(pki.ca, "ctl-2", pki.dir,
                                                             sans=["node-x", "127.0.0.1"], role="controller"),
                            "'ctl-2' has the controller role"),
    "no role": ("node-x", lambda pki: issue_roleless_cert(pki.ca, "node-x", pki.dir, sans=("127.0.0.1",)),
                "'node-x' has no role"),
}


@pytest.mark.parametrize("impostor", list(IMPOSTORS))
def test_the_controller_sends_nothing_to_a_server_whose_certificate_only_lists_the_node(
        tmp_path, caplog, impostor):
    """gRPC checked only that the agent's certificate lists the node's name, which another node's
    certificate, the controller's or one from before roles may list too: that server got
    PrepareShare, SetMigMode, every call for node-x (and the controller took its answers for the
    node's). Now every call is refused before it is sent, as a definite refusal (not 'unreachable'),
    naming the certificate's role and the command that issues node-x's certificate."""
    caplog.set_level(logging.INFO)
    pki = Pki(tmp_path)
    name, issue, says = IMPOSTORS[impostor]
    issue(pki)
    server, agent, port = _serve(pki, name)
    client = _client(pki, port)
    try:
        calls = {"PrepareShare": lambda: client.prepare(_share("s1")), "Ping": client.ping,
                 "SetMigMode": lambda: client.set_mig_mode("GPU-0", True),
                 "PrepareShares": lambda: client.prepare(_share("s2", common_pb2.SHARE_KIND_FASTPOD))}
        with futures.ThreadPoolExecutor(4) as pool:   # batched ones too
            outcomes = list(pool.map(lambda call: _outcome(call), [*calls.values(), *calls.values()]))
        for outcome in outcomes:
            assert isinstance(outcome, AgentError), outcome
            assert outcome.code is grpc.StatusCode.PERMISSION_DENIED and not outcome.unreachable, outcome
            message = str(outcome)
            assert "is not node node-x's, sending it nothing" in message and says in message, message
            assert REISSUE in message, message
        assert agent.calls == []
        assert says in caplog.text and REISSUE in caplog.text, caplog.text
    finally:
        client.close()
        server.stop(None)


def _outcome(call):
    try:
        return call()
    except AgentError as exc:
        return exc


def test_a_node_certificate_with_the_agent_name_is_dialled_by_it_without_warnings(tmp_path, caplog):
    """The certificate `fastshare certs issue --role node` writes now: calls go through; a server
    later at the same address with a certificate that only lists the node's name gets nothing
    (gRPC's own check of the agent name, on the new connection)."""
    caplog.set_level(logging.INFO)
    pki = Pki(tmp_path)
    pki.issue("node-x")
    certs.issue(pki.ca, "gpu-9", pki.dir, sans=["node-x", "127.0.0.1"], role="node")
    server, agent, port = _serve(pki, "node-x")
    client = _client(pki, port)
    try:
        assert client.prepare(_share("s1")).created and agent.calls == ["s1"]
        assert "lacks the name" not in caplog.text
        server.stop(None)
        server, impostor, _ = _serve(pki, "gpu-9", port)
        with pytest.raises(AgentError):
            client.prepare(_share("s2"))
        assert impostor.calls == []
    finally:
        client.close()
        server.stop(None)


def test_a_node_certificate_from_before_agent_names_works_with_a_warning_and_a_check_per_connection(
        tmp_path, caplog):
    """The upgrade: node-x's own certificate as issued before node certificates listed the agent
    name. The controller still talks to it (dialled by the node's name, its role checked), warns
    with the command that issues it again, and checks again on every new connection: a server put
    at that address later with another node's certificate listing node-x gets nothing."""
    caplog.set_level(logging.INFO)
    pki = Pki(tmp_path)
    issue_unchecked(pki.ca, "node-x", pki.dir, sans=("127.0.0.1",), role="node")
    assert certs.agent_name("node-x") not in certs.describe(pki.dir / "node-x.crt")["sans"]
    certs.issue(pki.ca, "gpu-9", pki.dir, sans=["node-x", "127.0.0.1"], role="node")
    server, agent, port = _serve(pki, "node-x")
    client = _client(pki, port)
    try:
        assert client.prepare(_share("s1")).created and client.ping() is None
        assert agent.calls == ["s1", "Ping"]
        assert "lacks the name node-x.agent.fastshare.invalid" in caplog.text and REISSUE in caplog.text
        assert "in Kubernetes mode the agent gets it with its next certificate" in caplog.text
        server.stop(None)
        with pytest.raises(AgentError) as gone:    # nobody there: the connection is gone
            client.ping()
        assert gone.value.unreachable
        time.sleep(BACKOFF_FIRST_S + 0.1)   # the failed look's backoff passes (it doubles: 2 s next)
        server, impostor, _ = _serve(pki, "gpu-9", port)
        with pytest.raises(AgentError) as refused:
            client.prepare(_share("s2"))
        assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED, refused.value
        assert "the node certificate of 'gpu-9'" in str(refused.value)
        assert impostor.calls == []
        # node-x's certificate issued again (with the agent name): talked to by that name again
        server.stop(None)
        pki.issue("node-x")
        server, agent, _ = _serve(pki, "node-x", port)
        time.sleep(2 * BACKOFF_FIRST_S + 0.1)
        assert client.prepare(_share("s3")).created and agent.calls == ["s3"]
    finally:
        client.close()
        server.stop(None)


class Relay:
    """A TCP relay on loopback: each new connection goes to the port in ``to`` at the time."""

    def __init__(self, to: int) -> None:
        self.to = to
        self.gate: threading.Event | None = None   # when set: each connection waits for it
        self.waiting = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
            except OSError:
                return
            if self.gate is not None:
                self.waiting = True
                self.gate.wait()
            far = socket.create_connection(("127.0.0.1", self.to))
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self._listener.close()


def test_an_allocation_for_the_node_fails_with_the_reason_when_another_certificate_answers(tmp_path):
    """The controller core with its real agent pool: node-x registered with its own agent; then
    its address leads to a server with another node's certificate that lists node-x, and the
    controller renews its certificate (new connections). The allocation for node-x is not sent
    there: it fails, and its reason says whose certificate answered and what to run."""
    pki = Pki(tmp_path)
    pki.issue("node-x")
    certs.issue(pki.ca, "gpu-9", pki.dir, sans=["node-x", "127.0.0.1"], role="node")
    genuine, agent, genuine_port = _serve(pki, "node-x")
    other, impostor, other_port = _serve(pki, "gpu-9")
    relay = Relay(genuine_port)
    store = SqliteStore(tmp_path / "state.db")
    pool = AgentPool(TlsPaths.in_dir(pki.dir, "controller"), deadline=5)
    core = ControllerCore(store, pool)
    try:
        core.register_node("node-x", relay.address, {})
        assert agent.calls == ["GetInventory"]
        relay.to = other_port
        time.sleep(0.1)
        certs.issue(pki.ca, "controller", pki.dir, sans=["127.0.0.1", "localhost"], role="controller")
        time.sleep(1.2)   # the pool looks at its certificate files once a second
        with pytest.raises(AgentFailed) as failed:
            core.allocate(Request(Spec(Kind.MPS, memory_bytes=GiB), owner="me"))
        assert not failed.value.unreachable
        allocation = store.get_allocation(failed.value.allocation.id)
        assert allocation.state is State.RELEASING, allocation   # released once node-x's agent answers
        assert "PERMISSION_DENIED" in allocation.reason and "is not node node-x's" in allocation.reason
        assert "the node certificate of 'gpu-9'" in allocation.reason and REISSUE in allocation.reason
        assert impostor.calls == [] and agent.calls == ["GetInventory"]
    finally:
        pool.close()
        store.close()
        relay.close()
        genuine.stop(None)
        other.stop(None)


def test_calls_to_an_agent_that_does_not_answer_wait_one_deadline_not_one_each(tmp_path):
    """The look at the agent's certificate before the first call is made by each waiting call at
    once, not one after another: calls to a hung agent (the TCP connection is taken, the TLS
    handshake never answered) each fail after one deadline, as unreachable."""
    pki = Pki(tmp_path)
    hung = socket.create_server(("127.0.0.1", 0), backlog=16)   # never accepts, never answers
    client = AgentClient(AgentTarget("node-x", f"127.0.0.1:{hung.getsockname()[1]}"),
                         TlsPaths.in_dir(pki.dir, "controller"), deadline=1.5)
    try:
        started = time.monotonic()
        with futures.ThreadPoolExecutor(4) as pool:
            outcomes = list(pool.map(lambda i: _outcome(lambda: client.prepare(_share(f"s{i}"))), range(4)))
        took = time.monotonic() - started
        assert all(isinstance(o, AgentError) and o.unreachable for o in outcomes), outcomes
        assert took < 4, f"4 calls took {took:.1f}s: they waited for each other's deadline"
    finally:
        client.close()
        hung.close()


def _threads_settle_at(most: int) -> int:
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        count = threading.active_count()
        if count <= most or time.monotonic() > deadline:
            return count
        time.sleep(0.2)


def test_channels_to_an_agent_from_before_agent_names_leave_no_thread_behind_once_replaced(tmp_path):
    """A channel that checks an agent by its node's name (its certificate predates agent names)
    is watched for new connections. The watch kept the channel, and the client, alive: each client
    the pool dropped at a renewal of the controller's certificate, and each channel replaced once the
    agent's certificate was issued again, left a thread polling a channel nobody used (and its
    connection open) for as long as the controller ran. Now they go once no call uses them."""
    pki = Pki(tmp_path)
    issue_unchecked(pki.ca, "node-x", pki.dir, sans=("127.0.0.1",), role="node")
    server, _, port = _serve(pki, "node-x")
    pool = AgentPool(TlsPaths.in_dir(pki.dir, "controller"), deadline=5)
    address = f"127.0.0.1:{port}"
    try:
        pool.get("node-x", address).ping()
        watched = threading.active_count()
        for _ in range(3):   # the controller's certificate renewed: the pool makes new clients
            certs.issue(pki.ca, "controller", pki.dir, sans=["127.0.0.1", "localhost"], role="controller")
            time.sleep(1.1)   # the pool looks at its certificate files once a second
            pool.get("node-x", address).ping()
        assert _threads_settle_at(watched) <= watched, [t.name for t in threading.enumerate()]
        # node-x's certificate issued again: its client dials it by the agent name, unwatched
        server.stop(None)
        pki.issue("node-x")
        server, agent, _ = _serve(pki, "node-x", port)
        time.sleep(0.5)
        client = pool.get("node-x", address)
        wait_for(lambda: _outcome(client.ping) is None, 10, "a ping through the reissued certificate")
        assert agent.calls[-1:] == ["Ping"] and client._server_name == certs.agent_name("node-x")
        assert _threads_settle_at(watched - 1) <= watched - 1, [t.name for t in threading.enumerate()]
    finally:
        pool.close()
        server.stop(None)


def test_a_call_whose_check_was_under_way_when_the_client_was_closed_is_not_sent(tmp_path):
    """The pool closes a client (the node forgotten, its agent moved) while a call on it is looking
    at the agent's certificate (node-x's from before agent names). That call dialled a new channel
    on the closed client and sent itself to the old address; the channel was never closed. Now
    it fails as the calls on a closed client do, and nothing is sent."""
    pki = Pki(tmp_path)
    issue_unchecked(pki.ca, "node-x", pki.dir, sans=("127.0.0.1",), role="node")
    server, agent, port = _serve(pki, "node-x")
    relay = Relay(port)
    gate = threading.Event()
    relay.gate = gate
    client = AgentClient(AgentTarget("node-x", relay.address), TlsPaths.in_dir(pki.dir, "controller"),
                         deadline=5)
    try:
        with futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(_outcome, client.ping)
            wait_for(lambda: relay.waiting, 5, "the certificate check to reach the relay")
            client.close("its agent moved to 10.0.0.9:50051")
            gate.set()
            outcome = call.result(10)
        assert isinstance(outcome, AgentError) and outcome.unreachable, outcome
        assert "its agent moved to 10.0.0.9:50051" in str(outcome), outcome
        assert agent.calls == []
    finally:
        gate.set()
        relay.close()
        server.stop(None)


def test_an_agent_whose_certificate_no_longer_lists_the_agent_name_is_looked_at_again(tmp_path, caplog):
    """node-x's agent was checked by its agent name, then its certificate was issued again without it
    (an older controller replica signed its renewal during a rolling upgrade, a CA host with an older
    fastshare): every new connection failed gRPC's check of the agent name, and the client, checked
    "for good", never looked again: node-x stayed unreachable until the pool was rebuilt. Now a call
    the agent could not be reached for has the next one look at its certificate again."""
    caplog.set_level(logging.INFO)
    pki = Pki(tmp_path)
    pki.issue("node-x")
    server, agent, port = _serve(pki, "node-x")
    client = _client(pki, port)
    try:
        client.ping()
        server.stop(None)
        issue_unchecked(pki.ca, "node-x", pki.dir, sans=("127.0.0.1",), role="node")
        server, agent, _ = _serve(pki, "node-x", port)
        wait_for(lambda: _outcome(client.ping) is None, 10, "a ping to node-x's agent")
        assert agent.calls[-1:] == ["Ping"]
        assert "lacks the name node-x.agent.fastshare.invalid" in caplog.text
    finally:
        client.close()
        server.stop(None)


def test_an_agent_that_cannot_be_looked_at_is_not_looked_at_again_until_a_backoff_passes(tmp_path):
    """A node that does not answer costs one deadline per look at its certificate. The in-cluster
    controller pings its nodes one after another each pass: without a pause between looks every dead
    node added a deadline to every pass. After a failed look the calls fail at once, as unreachable,
    naming what the look met, until a backoff passes (doubling, from BACKOFF_FIRST_S); then one looks
    again."""
    pki = Pki(tmp_path)
    hung = socket.create_server(("127.0.0.1", 0), backlog=16)   # never accepts, never answers
    client = AgentClient(AgentTarget("node-x", f"127.0.0.1:{hung.getsockname()[1]}"),
                         TlsPaths.in_dir(pki.dir, "controller"), deadline=0.6)
    try:
        def timed_ping() -> tuple[float, AgentError]:
            started = time.monotonic()
            outcome = _outcome(client.ping)
            assert isinstance(outcome, AgentError) and outcome.unreachable, outcome
            return time.monotonic() - started, outcome

        took, _ = timed_ping()
        assert took >= 0.5
        took, again = timed_ping()
        assert took < 0.3, f"looked again at once ({took:.1f}s)"
        assert "timed out" in again.details and "looked at again in" in again.details, again.details
        time.sleep(BACKOFF_FIRST_S + 0.1)
        took, _ = timed_ping()
        assert took >= 0.5, "the backoff passed: one looks again"
        took, _ = timed_ping()
        assert took < 0.3
    finally:
        client.close()
        hung.close()


def test_calls_to_an_impostor_are_refused_at_once_and_logged_once_per_look(tmp_path, caplog):
    """Each call to a server with another's certificate made a handshake of its own and logged an
    ERROR: a controller calling it in a loop flooded its log. Now the refusal holds for a backoff:
    the calls meanwhile are refused at once, with the same reason, and nothing more is logged."""
    caplog.set_level(logging.ERROR)
    pki = Pki(tmp_path)
    name, issue, says = IMPOSTORS["another node"]
    issue(pki)
    server, agent, port = _serve(pki, name)
    client = _client(pki, port)
    try:
        outcomes = [_outcome(client.ping) for _ in range(5)]
        assert all(isinstance(o, AgentError) and o.code is grpc.StatusCode.PERMISSION_DENIED
                   and says in str(o) for o in outcomes), outcomes
        assert caplog.text.count("sending it nothing") == 1, caplog.text
        time.sleep(BACKOFF_FIRST_S + 0.1)
        assert isinstance(_outcome(client.ping), AgentError)
        assert caplog.text.count("sending it nothing") == 2, "the backoff passed: looked at again"
        assert agent.calls == []
    finally:
        client.close()
        server.stop(None)


def test_the_backoff_starts_again_from_the_first_after_a_look_that_found_the_node(tmp_path):
    """The backoff doubles while looks fail; once a look finds the node's certificate, the next
    outage starts again from BACKOFF_FIRST_S (the agent-name path kept the doubled one)."""
    pki = Pki(tmp_path)
    pki.issue("node-x")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = _client(pki, port)
    server = None
    try:
        for _ in range(3):   # nobody there: three looks, the backoff doubled twice (4 s next)
            assert isinstance(_outcome(client.ping), AgentError)
            time.sleep(max(0.0, client._look_after - time.monotonic()) + 0.05)
        server, agent, _ = _serve(pki, "node-x", port)
        assert client.ping() is None and agent.calls == ["Ping"]
        server.stop(None)
        server = None
        assert isinstance(_outcome(client.ping), AgentError)       # gone: the next call looks again
        assert isinstance(_outcome(client.ping), AgentError)       # that look fails
        again = _outcome(client.ping)                              # within its backoff: the first one
        assert isinstance(again, AgentError) and re.search(r"looked at again in [01]s", again.details), again
    finally:
        client.close()
        if server is not None:
            server.stop(None)
