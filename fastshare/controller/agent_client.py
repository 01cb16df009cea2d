"""Calls from the controller to node agents: mTLS, a deadline on every RPC, one channel per node.

Errors come back as :class:`AgentError` with ``unreachable`` telling the caller whether the
agent may simply be down (retry later, keep the state) or answered with a definite refusal
(compensate now).

PrepareShare and ReleaseShare calls for MPS-backed shares (fastpod, mps) that queue up behind
others to the same agent go out together as one PrepareShares / ReleaseShares RPC
(:mod:`coalesce`); each caller still gets its own reply or error. The agent runs a batch's
calls one after another, so calls that can take long (creating or destroying a MIG slice,
whole GPUs) always go alone. An agent without the batch RPCs (an older version) gets single
calls, each sent at once when it is made, once that is known. A call that waits in the queue
for as long as the RPC deadline fails as DEADLINE_EXCEEDED without being sent.

Who answers. gRPC checks only that the agent's certificate lists the name dialled; the
controller dials node NODE's agent by :func:`certs.agent_name` (``NODE.agent.fastshare.invalid``),
which only NODE's own node certificate may list, so gRPC's own check on every connection is a
check of the role too. Before a client's first call (and after one that could not reach the agent)
it looks at the agent's certificate with a TLS handshake of its own: one that lists that name is
dialled by it; a node certificate of NODE issued before node certificates had it (the upgrade) is
dialled by NODE, as before, with this role check repeated before each new connection is used (a
connection of its own, not the calls') and a warning to issue it again;
any other (another node's certificate listing NODE as a host name, the controller's, one without
a role) gets nothing: PERMISSION_DENIED, naming the certificate's role and the command to run.
A look that cannot reach the agent, or finds another's certificate, is not made again for a
backoff (BACKOFF_FIRST_S, doubling): the calls meanwhile fail at once with its error, as gRPC's own
fail between its connection attempts.

``term``: the leader term of a Kubernetes-mode controller (its fencing token), sent as call
metadata with the calls that change a GPU; an agent that has seen a newer term refuses the
call (:attr:`AgentError.seen_term`, see :mod:`fastshare.node.terms`). None (the standalone
controller): no term is sent.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from cryptography import x509

from fastshare.controller.coalesce import Coalescer, QueueTimeout
from fastshare.security.certs import agent_name, reissue_command, role_of
from fastshare.security.tls import PeerIdentity, TlsPaths, mtls_channel, server_certificate
from fastshare.v1 import agent_pb2, agent_pb2_grpc, common_pb2

log = logging.getLogger("fastshare.controller.agents")
DEFAULT_DEADLINE = 10.0
# Codes that say "could not get an answer", not "the agent said no".
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
_CODES = {code.value[0]: code for code in grpc.StatusCode}
BATCHED_KINDS = frozenset({common_pb2.SHARE_KIND_FASTPOD, common_pb2.SHARE_KIND_MPS})
# Calls to one agent sent at once before further ones wait to go out as a batch. More than one,
# so that a slow call (the first share on a GPU starts its MPS daemon) does not hold up the rest.
MAX_IN_FLIGHT = 2
MAX_BATCH = 64
# An agent whose certificate could not be looked at (it does not answer), or was another's, is not
# looked at again for this long, doubling up to the most: each look can cost a whole deadline (a
# thread of the in-cluster controller's node sync, which pings every node every 2 s) and a refusal
# a log line.
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 20.0


TERM_KEY, SEEN_KEY = "fastshare-term", "fastshare-term-seen"   # see fastshare.node.terms
REFUSAL_KEY = "fastshare-refusal"   # see the proto's Refusal


class AgentError(Exception):
    """``seen_term``: set when the agent refused the call's leader term as older than one it has
    seen (a newer controller leads). ``refusal``: the proto's Refusal, set when the agent refused a
    share for its GPU's state rather than for what it asks (REFUSAL_UNSPECIFIED otherwise, and
    from an agent that does not say)."""

    def __init__(self, node: str, method: str, code: grpc.StatusCode, details: str,
                 seen_term: int | None = None, refusal: int = agent_pb2.REFUSAL_UNSPECIFIED) -> None:
        super().__init__(f"node {node}: {method} failed: {code.name}: {details}")
        self.node = node
        self.code = code
        self.details = details
        self.seen_term = seen_term
        self.refusal = refusal

    @classmethod
    def of(cls, node: str, method: str, exc: grpc.RpcError) -> AgentError:
        seen, refusal = None, agent_pb2.REFUSAL_UNSPECIFIED
        stale = exc.code() is grpc.StatusCode.FAILED_PRECONDITION   # a term refused, or a refusal
        if stale or exc.code() is grpc.StatusCode.NOT_FOUND:        # REFUSAL_GPU_GONE's code
            for key, value in exc.trailing_metadata() or ():
                if key == SEEN_KEY and value.isdigit() and stale:
                    seen = int(value)
                elif key == REFUSAL_KEY and value in agent_pb2.Refusal.keys():  # noqa: SIM118 - not a dict; a newer agent's: unknown
                    refusal = agent_pb2.Refusal.Value(value)
        return cls(node, method, exc.code(), exc.details() or "", seen, refusal)

    @property
    def unreachable(self) -> bool:
        return self.code in _UNREACHABLE


@dataclass(frozen=True)
class AgentTarget:
    node: str
    address: str


class AgentClient:
    """One node agent. Its certificate must be the node's own (see the module docstring)."""

    def __init__(self, target: AgentTarget, tls: TlsPaths, deadline: float = DEFAULT_DEADLINE) -> None:
        self.target = target
        self.deadline = deadline
        self._tls = tls
        self._checked = threading.Event()   # the agent's certificate was looked at, for this connection
        self._check_lock = threading.Lock()
        self._is_closed = False
        # after a look at the certificate that could not reach the agent: none again before this
        self._look_after, self._backoff = 0.0, BACKOFF_FIRST_S
        self._last_look = grpc.StatusCode.UNAVAILABLE, ""
        self._dial(agent_name(target.node))
        self._batching = True    # until an agent without the batch RPCs says UNIMPLEMENTED
        self._closed_why = "the node was forgotten"   # said to a call made after ``close``
        self._prepares = Coalescer(self._sender("PrepareShare", agent_pb2.PrepareSharesRequest),
                                   MAX_IN_FLIGHT, MAX_BATCH, max_wait=deadline)
        self._releases = Coalescer(self._sender("ReleaseShare", agent_pb2.ReleaseSharesRequest),
                                   MAX_IN_FLIGHT, MAX_BATCH, max_wait=deadline)

    def close(self, why: str = "") -> None:
        """``why``: what a call made on this client from now on is told."""
        with self._check_lock:   # a check under way dials no new channel after this
            self._closed_why = why or self._closed_why
            self._is_closed = True
            self._channel.close()

    def _dial(self, server_name: str) -> None:
        """A channel that checks the agent by ``server_name``. One replaced here is not closed:
        calls in flight on it finish (it closes once nothing refers to it). A channel dialled by
        the node's name is watched for new connections; the watch (gRPC polls for it in a thread
        until the channel goes) refers to it and to this client only weakly, or neither would go."""
        channel = mtls_channel(self.target.address, self._tls, server_name=server_name)
        if server_name != agent_name(self.target.node):
            connected = False
            client, dialled = weakref.ref(self), weakref.ref(channel)

            def on_state(state: grpc.ChannelConnectivity) -> None:
                nonlocal connected
                me = client()
                if state is grpc.ChannelConnectivity.READY:
                    connected = True
                elif connected and me is not None and me._channel is dialled():   # the checked one is gone
                    connected = False
                    me._checked.clear()

            channel.subscribe(on_state)
        self._server_name, self._channel = server_name, channel
        self._stub = agent_pb2_grpc.NodeAgentStub(channel)

    def _checked_stub(self, method: str) -> agent_pb2_grpc.NodeAgentStub:
        """The stub to call the agent with, once its certificate is known to be the node's;
        AgentError (PERMISSION_DENIED) if it is not, UNAVAILABLE if it cannot be looked at."""
        if not self._checked.is_set():
            self._check(method)
        return self._stub

    def _check(self, method: str) -> None:
        """Callers that find the client unchecked each look (no lock while they do: an agent that
        does not answer would hold the others up one deadline each); what they find is applied
        under the lock."""
        node, address = self.target.node, self.target.address
        self._refuse_if_closed(method)
        wait = self._look_after - time.monotonic()
        if wait > 0:   # the last look failed: fail at once, as gRPC does between connection attempts
            code, message = self._last_look
            raise AgentError(node, method, code, f"{message} (looked at again in {wait:.0f}s)")
        try:
            cert = server_certificate(address, self._tls, node, self.deadline)
        except (OSError, ValueError) as exc:
            unreached = f"cannot look at the certificate of the agent at {address}: {exc}"
            raise self._look_failed(method, grpc.StatusCode.UNAVAILABLE, unreached) from None
        try:
            names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
                .get_values_for_type(x509.DNSName)
        except x509.ExtensionNotFound:
            names = []
        cns = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        peer = PeerIdentity(str(cns[0].value) if cns else "", (), role_of(cert))
        if agent_name(node).lower() in {name.lower() for name in names}:
            with self._check_lock:
                self._refuse_if_closed(method)
                self._backoff = BACKOFF_FIRST_S
                if self._server_name != agent_name(node):   # issued again since: gRPC checks the name
                    self._dial(agent_name(node))
                self._checked.set()   # gRPC checks the name on each connection (see _failed)
            return
        why = peer.why_not_node(node)
        if why:
            message = f"the agent at {address} is not node {node}'s, sending it nothing: {why}"
            log.error("node %s: %s", node, message)
            raise self._look_failed(method, grpc.StatusCode.PERMISSION_DENIED, message)
        # Node NODE's certificate from before agent names: dialled by NODE, checked again on each
        # new connection (between this handshake and gRPC's, a relay could still swap the server).
        with self._check_lock:
            self._refuse_if_closed(method)
            self._backoff = BACKOFF_FIRST_S
            if self._server_name == node:
                self._checked.set()
                return
            log.warning("node %s: the agent's certificate lacks the name %s that only node %s's certificate "
                        "may list, so the controller must check its role with a handshake of its own; issue "
                        "it again with `%s` (fastshare.gpu.pki does at its next run; in Kubernetes mode the "
                        "agent gets it with its next certificate: at 2/3 of the current one's life, or when "
                        "its Pod is replaced)", node, agent_name(node), node,
                        reissue_command("node", node))
            self._dial(node)
            self._checked.set()

    def _look_failed(self, method: str, code: grpc.StatusCode, message: str) -> AgentError:
        """The error of a look that found no agent of this node (unreachable, or another's
        certificate); the calls of the next backoff get it at once, without a look (each may cost a
        deadline) or another log line."""
        with self._check_lock:
            self._last_look = code, message
            self._look_after = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        return AgentError(self.target.node, method, code, message)

    def _refuse_if_closed(self, method: str) -> None:
        """A closed client dials nothing (a new channel would reopen it)."""
        if self._is_closed:
            raise AgentError(self.target.node, method, grpc.StatusCode.UNAVAILABLE,
                             f"the channel to this node was closed (none is sent); {self._closed_why}")

    def _call(self, method: str, request: object, deadline: float | None = None,
              term: int | None = None) -> object:
        try:
            return getattr(self._checked_stub(method), method)(request, timeout=deadline or self.deadline,
                                                               metadata=_metadata(term))
        except grpc.RpcError as exc:
            raise self._failed(method, exc) from None
        except ValueError as exc:
            raise self._closed(method, exc) from None

    def _failed(self, method: str, exc: grpc.RpcError) -> AgentError:
        """The call's error. Not reached (UNAVAILABLE): the next call looks at the agent's
        certificate again, for it may be one gRPC's check now refuses (issued again without the
        agent name, by an older version) that this client would otherwise never look at."""
        if exc.code() is grpc.StatusCode.UNAVAILABLE:
            self._checked.clear()
        return AgentError.of(self.target.node, method, exc)

    def _closed(self, method: str, exc: ValueError) -> AgentError:
        """gRPC raises ValueError for a call on a closed channel: the pool closed it (the node was
        forgotten, its agent moved to another address, the controller is stopping) while this
        call, which had just taken the client, was on its way. Any other ValueError is raised again."""
        if "closed channel" not in str(exc):
            raise exc
        return AgentError(self.target.node, method, grpc.StatusCode.UNAVAILABLE,
                          f"the channel to this node was closed ({exc}); {self._closed_why}")

    def ping(self) -> None:
        self._call("Ping", common_pb2.Empty())

    def ping_unwaited(self, done: Callable[[AgentError | None], None]) -> bool:
        """Ping with no thread waiting for the answer: ``done`` gets None (answered) or the error,
        from a gRPC thread, so it must not block. The in-cluster controller's heartbeats: with a
        thread per ping, as many hung agents as threads left none for the others' pings. False,
        and nothing sent, while the agent's certificate must be looked at first (a look blocks:
        ``ping`` it in a thread instead)."""
        if not self._checked.is_set():
            return False
        try:
            call = self._stub.Ping.future(common_pb2.Empty(), timeout=self.deadline)
        except ValueError as exc:
            done(self._closed("Ping", exc))
            return True

        def answered(call: grpc.Future) -> None:
            error = call.exception()
            done(None if error is None else self._failed("Ping", error))

        call.add_done_callback(answered)
        return True

    def inventory(self) -> agent_pb2.Inventory:
        return self._call("GetInventory", agent_pb2.GetInventoryRequest())

    def prepare(self, share: agent_pb2.Share, term: int | None = None) -> agent_pb2.PrepareShareReply:
        request = agent_pb2.PrepareShareRequest(share=share)
        if share.kind in BATCHED_KINDS and self._batching:
            return self._queued(self._prepares, "PrepareShare", request, term)
        return self._call("PrepareShare", request, term=term)

    def release(self, share_id: str, kind: int = common_pb2.SHARE_KIND_UNSPECIFIED,
                term: int | None = None) -> agent_pb2.ReleaseShareReply:
        """``kind``: the share's, when known (only MPS-backed shares may wait for a batch)."""
        request = agent_pb2.ReleaseShareRequest(share_id=share_id)
        if kind in BATCHED_KINDS and self._batching:
            return self._queued(self._releases, "ReleaseShare", request, term)
        return self._call("ReleaseShare", request, term=term)

    def _queued(self, coalescer: Coalescer, method: str, request: object, term: int | None) -> object:
        try:
            return coalescer.call((term, request))
        except QueueTimeout as exc:   # the agent may be hung: as unreachable as a timed-out RPC
            raise AgentError(self.target.node, method, grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None

    def _sender(self, method: str, batch_type: type) -> Callable[[list], list]:
        """Sends (term, request) pairs for ``method``: one alone as itself, several of one term
        as one batch RPC (the term is the RPC's; calls of mixed terms, met only while a process
        changes its term of office, go one by one)."""
        batch_method = method + "s"

        def send(calls: list[tuple[int | None, object]]) -> list:
            terms = {term for term, _ in calls}
            if len(calls) > 1 and len(terms) == 1 and self._batching:
                requests = [request for _, request in calls]
                try:
                    reply = getattr(self._checked_stub(batch_method), batch_method)(
                        batch_type(calls=requests), timeout=self.deadline, metadata=_metadata(terms.pop()))
                except AgentError as exc:   # not the node's agent, or it cannot be looked at
                    return [exc for _ in requests]
                except grpc.RpcError as exc:
                    if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                        return [self._failed(batch_method, exc) for _ in requests]
                    self._batching = False
                except ValueError as exc:
                    return [self._closed(batch_method, exc) for _ in requests]   # raises if not that
                else:
                    return [r.reply if r.status.code == 0 else AgentError(
                        self.target.node, method, _CODES.get(r.status.code, grpc.StatusCode.UNKNOWN),
                        r.status.message, refusal=r.status.refusal) for r in reply.results]
            return [self._outcome(method, request, term) for term, request in calls]

        return send

    def _outcome(self, method: str, request: object, term: int | None) -> object:
        try:
            return self._call(method, request, term=term)
        except AgentError as exc:
            return exc

    def set_mig_mode(self, gpu_uuid: str, enabled: bool,
                     term: int | None = None) -> agent_pb2.SetMigModeReply:
        return self._call("SetMigMode", agent_pb2.SetMigModeRequest(gpu_uuid=gpu_uuid, enabled=enabled),
                          term=term)


def _metadata(term: int | None) -> tuple[tuple[str, str], ...] | None:
    return None if term is None else ((TERM_KEY, str(term)),)


TLS_CHECK_S = 1.0   # how often the pool looks whether its certificate files were renewed


class AgentPool:
    """Clients by node name; a new address (agent moved or restarted elsewhere) gets a new channel."""

    def __init__(self, tls: TlsPaths, deadline: float = DEFAULT_DEADLINE) -> None:
        self._tls = tls
        self._deadline = deadline
        self._clients: dict[str, AgentClient] = {}
        self._lock = threading.Lock()
        self._stamp = self._tls_stamp()
        self._stamp_checked = time.monotonic()
        self._closed = False   # see close

    @property
    def deadline(self) -> float:
        """Seconds a call (or a look at an agent's certificate) waits for its agent."""
        return self._deadline

    def _tls_stamp(self) -> tuple[tuple[int, int], ...] | None:
        try:
            return self._tls.stamp()
        except OSError:
            return None   # mid-rotation: decided at the next call

    def get(self, node: str, address: str) -> AgentClient:
        # Every agent call comes here; certificates are renewed days before they end, so the
        # files are looked at (three stats) at most once per TLS_CHECK_S, not on every call.
        now = time.monotonic()
        stamp = None
        if now - self._stamp_checked >= TLS_CHECK_S:
            self._stamp_checked = now
            stamp = self._tls_stamp()
            if stamp is not None and stamp != self._stamp and not self._tls.pair_matches():
                stamp = None   # mid-rotation (new key, old certificate): decided at the next check
        with self._lock:
            if self._closed:
                return self._clients.get(node) or self._closed_client(node, address)
            if stamp is not None and stamp != self._stamp:
                # Renewed certificate files: a channel presents the certificate it was built
                # with, which expires. New clients from now on; calls in flight on the old
                # ones finish (their channels close once nothing refers to them).
                self._stamp = stamp
                self._clients.clear()
            client = self._clients.get(node)
            if client is None or client.target.address != address:
                if client is not None:
                    client.close(f"its agent moved to {address}")
                client = AgentClient(AgentTarget(node, address), self._tls, self._deadline)
                self._clients[node] = client
            return client

    def drop(self, node: str) -> None:
        """Close and forget ``node``'s channel (the node was forgotten for good); a later
        ``get`` for it makes a new one."""
        with self._lock:
            client = self._clients.pop(node, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        """Cancel the calls in flight; a call made from now on is refused at once (a stopping
        controller must not dial an agent again and wait out its deadline)."""
        with self._lock:
            self._closed = True
            for client in self._clients.values():
                client.close("the controller is stopping")

    def _closed_client(self, node: str, address: str) -> AgentClient:
        client = AgentClient(AgentTarget(node, address), self._tls, self._deadline)
        client.close("the controller is stopping")
        return client
