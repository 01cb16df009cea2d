"""The controller's agent client over real mTLS gRPC: queued calls go out as one batch with
per-call outcomes, and an agent without the batch RPCs (an older version) gets single calls."""

import threading
import time
from concurrent import futures

import grpc
import pytest

from fastshare.controller.agent_client import (
    BATCHED_KINDS,
    MAX_IN_FLIGHT,
    AgentClient,
    AgentError,
    AgentPool,
    AgentTarget,
)
from fastshare.security.tls import TlsPaths, server_credentials
from fastshare.v1 import agent_pb2, agent_pb2_grpc, common_pb2

from .conftest import Pki


class OldAgent(agent_pb2_grpc.NodeAgentServicer):
    """Knows PrepareShare only; the first calls wait for ``gate`` so that later ones queue."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.single: list[str] = []
        self.batches: list[list[str]] = []

    def PrepareShare(self, request, context):
        self.single.append(request.share.id)
        self.gate.wait(30)
        if request.share.id.startswith("bad"):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{request.share.id}: no room")
        return agent_pb2.PrepareShareReply(share=request.share, created=True)


class NewAgent(OldAgent):
    def PrepareShares(self, request, context):
        self.batches.append([c.share.id for c in request.calls])
        results = []
        for call in request.calls:
            if call.share.id.startswith("bad"):
                status = agent_pb2.CallStatus(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                              message=f"{call.share.id}: no room")
                results.append(agent_pb2.PrepareSharesReply.Result(status=status))
            else:
                results.append(agent_pb2.PrepareSharesReply.Result(
                    reply=agent_pb2.PrepareShareReply(share=call.share, created=True)))
        return agent_pb2.PrepareSharesReply(results=results)


@pytest.fixture
def serve(tmp_path):
    pki = Pki(tmp_path)
    pki.issue("node-x")
    servers = []

    def start(servicer) -> AgentClient:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
        port = server.add_secure_port("127.0.0.1:0", server_credentials(TlsPaths.in_dir(pki.dir, "node-x")))
        server.start()
        servers.append(server)
        return AgentClient(AgentTarget("node-x", f"127.0.0.1:{port}"), TlsPaths.in_dir(pki.dir, "controller"))

    yield start
    for server in servers:
        server.stop(None)


def _prepare(client: AgentClient, outcomes: dict, share_id: str,
             kind: int = common_pb2.SHARE_KIND_FASTPOD) -> None:
    """The share's id when prepared, or the AgentError, into ``outcomes``."""
    try:
        outcomes[share_id] = client.prepare(agent_pb2.Share(id=share_id, kind=kind)).share.id
    except AgentError as exc:
        outcomes[share_id] = exc


def _prepare_many(client: AgentClient, servicer: OldAgent, ids: list[str],
                  kind: int = common_pb2.SHARE_KIND_FASTPOD) -> dict:
    """The first MAX_IN_FLIGHT calls hold the agent; the rest queue, then all are let go.
    (The rest start once the first are at the agent: started together, any of them could be.)"""
    outcomes: dict = {}
    threads = [threading.Thread(target=_prepare, args=(client, outcomes, i, kind)) for i in ids]
    deadline = time.monotonic() + 30
    for t in threads[:MAX_IN_FLIGHT]:
        t.start()
    while len(servicer.single) < min(MAX_IN_FLIGHT, len(ids)):
        assert time.monotonic() < deadline, "the first calls did not reach the agent"
        time.sleep(0.005)
    for t in threads[MAX_IN_FLIGHT:]:
        t.start()
    queued = len(ids) - MAX_IN_FLIGHT if kind in BATCHED_KINDS else 0
    while len(servicer.single) < len(ids) - queued or len(client._prepares._waiting) < queued:
        assert time.monotonic() < deadline, "calls did not queue"
        time.sleep(0.005)
    servicer.gate.set()
    for t in threads:
        t.join(30)
    return outcomes


@pytest.mark.parametrize("servicer", [NewAgent, OldAgent])
def test_queued_calls_go_out_as_one_batch_with_their_own_outcomes(serve, servicer):
    """NewAgent: one batch RPC for the queued calls. OldAgent (no batch RPCs): single calls."""
    agent = servicer()
    client = serve(agent)
    held = [f"held-{i}" for i in range(MAX_IN_FLIGHT)]
    queued = ["q-1", "bad-2", "q-3"]
    outcomes = _prepare_many(client, agent, held + queued)
    if servicer is NewAgent:
        assert sorted(agent.single) == held and [sorted(b) for b in agent.batches] == [sorted(queued)]
    else:
        assert sorted(agent.single) == sorted(held + queued) and client._batching is False
    assert outcomes["q-1"] == "q-1" and outcomes["q-3"] == "q-3"
    error = outcomes["bad-2"]
    assert isinstance(error, AgentError) and error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not error.unreachable and "bad-2: no room" in str(error)


def test_calls_that_may_take_long_never_wait_for_a_batch(serve):
    agent = NewAgent()
    client = serve(agent)
    ids = [f"mig-{i}" for i in range(MAX_IN_FLIGHT + 3)]
    outcomes = _prepare_many(client, agent, ids, kind=common_pb2.SHARE_KIND_EXCLUSIVE)
    assert sorted(agent.single) == sorted(ids) and agent.batches == []   # all at once, each alone
    assert all(outcomes[i] == i for i in ids)


def test_a_call_queued_behind_a_hung_agent_fails_as_unreachable_without_being_sent(serve):
    agent = NewAgent()
    client = serve(agent)
    client._prepares._max_wait = 0.3      # the RPC deadline stays 10 s: the held calls outlive it
    outcomes: dict = {}
    held = [threading.Thread(target=_prepare, args=(client, outcomes, f"held-{i}"))
            for i in range(MAX_IN_FLIGHT)]
    for t in held:
        t.start()
    deadline = time.monotonic() + 30
    while len(agent.single) < MAX_IN_FLIGHT:
        assert time.monotonic() < deadline, "the first calls did not reach the agent"
        time.sleep(0.005)
    _prepare(client, outcomes, "queued")
    error = outcomes["queued"]
    assert isinstance(error, AgentError) and error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.unreachable and "not sent" in str(error)
    agent.gate.set()
    for t in held:
        t.join(30)
    assert sorted(agent.single) == ["held-0", "held-1"] and agent.batches == []


def test_once_an_agent_has_no_batch_rpcs_its_calls_never_wait(serve):
    agent = OldAgent()
    client = serve(agent)
    _prepare_many(client, agent, [f"first-{i}" for i in range(MAX_IN_FLIGHT + 2)])
    assert client._batching is False
    agent.gate.clear()
    agent.single.clear()
    ids, outcomes = [f"then-{i}" for i in range(MAX_IN_FLIGHT + 3)], {}
    threads = [threading.Thread(target=_prepare, args=(client, outcomes, i)) for i in ids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(agent.single) < len(ids):    # all reach the agent while the first ones hold it
        assert time.monotonic() < deadline, f"only {sorted(agent.single)} reached the agent"
        time.sleep(0.005)
    agent.gate.set()
    for t in threads:
        t.join(30)
    assert all(outcomes[i] == i for i in ids)


class PingAgent(agent_pb2_grpc.NodeAgentServicer):
    def Ping(self, request, context):
        return common_pb2.Empty()


def test_the_pool_presents_the_certificate_renewed_on_disk_after_the_old_one_expired(tmp_path):
    """Leaves are short-lived and renewed in place; a connection made after the old one's
    end (here: the agent restarted) must present the new one, without a controller restart."""
    from tests.security.handmade import issue_client_cert

    pki = Pki(tmp_path)
    pki.issue("node-x")
    issue_client_cert(pki.ca, "controller", pki.dir, ends_in_days=2 / 86400, role="controller")
    ends = time.monotonic() + 2

    def serve(address):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        agent_pb2_grpc.add_NodeAgentServicer_to_server(PingAgent(), server)
        port = server.add_secure_port(address, server_credentials(TlsPaths.in_dir(pki.dir, "node-x")))
        server.start()
        return server, f"127.0.0.1:{port}"

    server, address = serve("127.0.0.1:0")
    pool = AgentPool(TlsPaths.in_dir(pki.dir, "controller"))
    try:
        pool.get("node-x", address).ping()
        pki.issue("controller", role="controller")   # renewed before the old one ends
        time.sleep(max(0.0, ends - time.monotonic()) + 0.5)
        server.stop(None)                        # the agent restarts: a new handshake
        server, _ = serve(address)
        pool.get("node-x", address).ping()
    finally:
        pool.close()
        server.stop(None)


def test_the_pool_keeps_its_channels_while_a_renewal_has_replaced_only_the_key(tmp_path, monkeypatch):
    """A renewal writes the new key, then the new certificate. A pool that looked in between
    rebuilt its channels with the new key and the old certificate, and every call failed the
    handshake until its next look; it now keeps the old pair until the new one is whole."""
    from fastshare.controller import agent_client
    from fastshare.security import certs

    monkeypatch.setattr(agent_client, "TLS_CHECK_S", 0.0)   # look at the files on every call
    pki = Pki(tmp_path)
    pki.issue("node-x")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    agent_pb2_grpc.add_NodeAgentServicer_to_server(PingAgent(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(TlsPaths.in_dir(pki.dir, "node-x")))
    server.start()
    address = f"127.0.0.1:{port}"
    tls = TlsPaths.in_dir(pki.dir, "controller")
    pool = AgentPool(tls)
    try:
        first = pool.get("node-x", address)
        first.ping()
        certs.issue(pki.ca, "controller", tmp_path / "next", role="controller")
        certs.write_atomic(tls.key, (tmp_path / "next" / "controller.key").read_bytes(), 0o600)
        assert not tls.pair_matches()
        assert pool.get("node-x", address) is first
        pool.get("node-x", address).ping()
        certs.write_atomic(tls.cert, (tmp_path / "next" / "controller.crt").read_bytes(), 0o644)
        renewed = pool.get("node-x", address)
        assert renewed is not first
        renewed.ping()
    finally:
        pool.close()
        server.stop(None)


def test_a_call_on_a_client_the_pool_just_dropped_fails_as_unreachable(serve):
    """``AgentPool.drop`` (the node forgotten) can close a channel a concurrent call has just
    taken from the pool: that call fails as an unreachable agent (the caller's usual path), not
    with gRPC's ValueError and a traceback in the controller's log."""
    agent = NewAgent()
    agent.gate.set()
    client = serve(agent)
    client.close()
    with pytest.raises(AgentError) as single:
        client.inventory()
    assert single.value.unreachable and "closed" in single.value.details, single.value
    with pytest.raises(AgentError) as prepared:
        client.prepare(agent_pb2.Share(id="s-1", kind=common_pb2.SHARE_KIND_MPS))
    assert prepared.value.unreachable, prepared.value
    batch = client._sender("PrepareShare", agent_pb2.PrepareSharesRequest)   # queued calls, as one RPC
    outcomes = batch([(None, agent_pb2.PrepareShareRequest(share=agent_pb2.Share(id=f"s-{i}")))
                      for i in range(2)])
    assert all(isinstance(o, AgentError) and o.unreachable for o in outcomes), outcomes
    assert agent.single == [] and agent.batches == []


def test_a_call_on_a_client_replaced_for_a_new_address_does_not_say_the_node_was_forgotten(tmp_path):
    """The pool also closes a node's client when its agent registers at another address: a call
    that had just taken the old one failed saying "the node was forgotten" (it was not)."""
    pki = Pki(tmp_path)
    pool = AgentPool(TlsPaths.in_dir(pki.dir, "controller"))
    try:
        old = pool.get("node-x", "127.0.0.1:1")
        pool.get("node-x", "127.0.0.1:2")        # the agent moved
        with pytest.raises(AgentError) as moved:
            old.inventory()
        assert moved.value.unreachable and "forgotten" not in moved.value.details, moved.value
        assert "127.0.0.1:2" in moved.value.details, moved.value
        dropped = pool.get("node-x", "127.0.0.1:2")
        pool.drop("node-x")
        with pytest.raises(AgentError) as forgotten:
            dropped.inventory()
        assert "forgotten" in forgotten.value.details, forgotten.value
    finally:
        pool.close()


class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, *metadata: tuple[str, str]) -> None:
        self._code, self._metadata = code, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "refused"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


@pytest.mark.parametrize("code, metadata, refusal, seen", [
    (grpc.StatusCode.NOT_FOUND, [("fastshare-refusal", "REFUSAL_GPU_GONE")],
     agent_pb2.REFUSAL_GPU_GONE, None),
    (grpc.StatusCode.FAILED_PRECONDITION, [("fastshare-refusal", "REFUSAL_GPU_LOST")],
     agent_pb2.REFUSAL_GPU_LOST, None),
    (grpc.StatusCode.NOT_FOUND, [("fastshare-refusal", "REFUSAL_OF_A_NEWER_AGENT")],
     agent_pb2.REFUSAL_UNSPECIFIED, None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, [("fastshare-refusal", "REFUSAL_GPU_GONE")],
     agent_pb2.REFUSAL_UNSPECIFIED, None),
    (grpc.StatusCode.FAILED_PRECONDITION, [("fastshare-term-seen", "7")], agent_pb2.REFUSAL_UNSPECIFIED, 7),
    (grpc.StatusCode.NOT_FOUND, [("fastshare-term-seen", "7")], agent_pb2.REFUSAL_UNSPECIFIED, None),
])
def test_a_refusals_kind_is_read_with_the_code_the_agent_sends_it_with(code, metadata, refusal, seen):
    """A GPU gone from the node is refused NOT_FOUND: its kind was read only with FAILED_PRECONDITION,
    so the controller failed the allocation. A kind this controller does not know (a newer agent's)
    counts as none, and a leader term the agent saw only comes with FAILED_PRECONDITION (a stale term)."""
    error = AgentError.of("n1", "PrepareShare", _Refused(code, *metadata))
    assert (error.code, error.refusal, error.seen_term) == (code, refusal, seen)
