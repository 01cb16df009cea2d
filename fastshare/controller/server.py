"""The controller's gRPC servicers, authentication, and the serve loop.

Authentication:
- NodeRegistry: mTLS only, with the node's own certificate: the node role and the node's name
  as common name (see :mod:`fastshare.security.certs`); any other certificate of the cluster
  CA, however it is named, is refused.
- Controller (clients): ``client_auth`` = ``cert`` (a client certificate signed by the cluster
  CA), ``token`` (``authorization: Bearer <token>`` metadata), or ``any`` (either). The main
  port always requires a client certificate at the TLS layer; ``token_listen`` adds a
  server-TLS-only port for token clients without certificates. A node certificate is a GPU
  node's, not a user's: it may only read, and cordon or uncordon its own node.
"""

from __future__ import annotations

import functools
import hmac
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc

from fastshare.controller import convert
from fastshare.controller.agent_client import AgentError, AgentPool
from fastshare.controller.core import (
    AgentFailed,
    Busy,
    ControllerCore,
    KeyConflict,
    NodeInUse,
    NotFound,
    Rejected,
    Settings,
)
from fastshare.controller.ledger import Ledger
from fastshare.controller.model import FINISHED, HOLDING
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.registration_passes import RegistrationPasses
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.controller.store import Conflict
from fastshare.controller.validation import (
    Request,
    ValidationError,
    check_allocation_id,
    check_node_labels,
    check_node_name,
)
from fastshare.security.certs import reissue_command
from fastshare.security.rotation import watch_expiry
from fastshare.security.tls import TlsPaths, peer_identity, server_credentials
from fastshare.server_runtime import collection_paused
from fastshare.sqlite_file import write_failure
from fastshare.state_lock import StateDirLock
from fastshare.stop_signal import stop_on_signals
from fastshare.v1 import common_pb2
from fastshare.v1 import controller_pb2 as pb
from fastshare.v1 import controller_pb2_grpc as pb_grpc

log = logging.getLogger("fastshare.controller")
CLIENT_AUTH = ("cert", "token", "any")
MAX_STATUS_NODES = 1000   # nodes one Status may name (none: the whole cluster)
# What a node certificate may call on the client API (playbooks/mig_reconfigure.yml cordons a
# node with its own certificate); SetSchedulable only for its own node.
NODE_METHODS = frozenset({"Ping", "Get", "List", "Watch", "Status", "SetSchedulable"})


@dataclass(frozen=True)
class Config:
    state_dir: Path
    tls: TlsPaths
    listen: str = "127.0.0.1:7070"
    token_listen: str = ""
    client_auth: str = "cert"
    tokens: tuple[str, ...] = ()
    settings: Settings = field(default_factory=Settings)
    agent_deadline: float = 10.0
    mps_oversubscription: float = 1.0
    workers: int = 32


class FellBehind(Exception):
    """A watcher did not take its events as fast as they came."""


class TooManyWatches(Exception):
    """As many Watch streams are open as the controller serves at once."""


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    codes = [(ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
             (Rejected, grpc.StatusCode.RESOURCE_EXHAUSTED), (NotFound, grpc.StatusCode.NOT_FOUND),
             (KeyConflict, grpc.StatusCode.ALREADY_EXISTS), (Busy, grpc.StatusCode.ABORTED),
             (Conflict, grpc.StatusCode.ABORTED), (FellBehind, grpc.StatusCode.RESOURCE_EXHAUSTED),
             (NodeInUse, grpc.StatusCode.FAILED_PRECONDITION),
             (TooManyWatches, grpc.StatusCode.RESOURCE_EXHAUSTED)]
    for kind, code in codes:
        if isinstance(exc, kind):
            context.abort(code, str(exc))
    if isinstance(exc, AgentFailed):
        code = grpc.StatusCode.UNAVAILABLE if exc.unreachable else grpc.StatusCode.FAILED_PRECONDITION
        context.abort(code, f"allocation {exc.allocation.id} is {exc.allocation.state.value}: {exc}")
    if isinstance(exc, AgentError):
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    raise exc


class Authenticator:
    def __init__(self, mode: str, tokens: tuple[str, ...]) -> None:
        if mode not in CLIENT_AUTH:
            raise ValueError(f"client_auth must be one of {', '.join(CLIENT_AUTH)}, got {mode!r}")
        if mode in ("token", "any") and not tokens:
            raise ValueError(f"client_auth {mode} needs a token file (token_file) with at least one token")
        self.mode = mode
        self._tokens = [t.encode() for t in tokens]

    def _token(self, context: grpc.ServicerContext) -> bool | None:
        """Whether the call's bearer token is one of ours; None when it brings none."""
        for key, value in context.invocation_metadata():
            if key == "authorization" and value.startswith("Bearer "):
                given = value[len("Bearer "):].encode()
                return any(hmac.compare_digest(given, t) for t in self._tokens)
        return None

    def check(self, context: grpc.ServicerContext, method: str, request: Any = None) -> None:
        token = self._token(context) if self.mode in ("token", "any") else None
        if token:
            return
        peer = peer_identity(context)
        if self.mode in ("cert", "any") and peer is not None:
            if peer.role == "node" and (method not in NODE_METHODS or (
                    method == "SetSchedulable" and getattr(request, "node", "") != peer.common_name)):
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"{method}: {peer.common_name!r} presents a node certificate, which may only "
                              "read, and cordon or uncordon its own node; use a client certificate "
                              f"(`{reissue_command('client', 'NAME')}`)")
            return
        need = {"cert": "a client certificate signed by the cluster CA",
                "token": "a bearer token (authorization metadata)",
                "any": "a client certificate or a bearer token"}[self.mode]
        if token is False:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not one this controller "
                                                           "accepts (see its token_file)")
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"this controller requires {need}")


def _guard(method: Callable[..., Any], *, durable_by_core: bool = False) -> Callable[..., Any]:
    """Authenticate, then turn domain errors into status codes. A reply leaves only after the
    store's durability barrier, so what a client was told survives a power loss (one
    fdatasync shared by concurrent calls; free when nothing was written). Allocate and
    Release wait for their own intent record instead (``durable_by_core``, see
    ``ControllerCore.allocate``); their errors take the full barrier."""

    def wrapper(self: ControllerServicer, request: Any, context: grpc.ServicerContext) -> Any:
        self.auth.check(context, method.__name__, request)
        try:
            try:
                reply = method(self, request, context)
            except Exception:
                self.core.store.sync()
                raise
            if not durable_by_core:
                self.core.store.sync()
            return reply
        except grpc.RpcError:
            raise
        except Exception as exc:
            _fail(context, method.__name__, exc)

    wrapper.__name__ = method.__name__
    return wrapper


def _guard_stream(method: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """``_guard`` for a server-streaming method: its errors are raised while it is iterated,
    after the wrapper returned, so each step is guarded. Replies that follow a change wait
    for the store's barrier in the method itself."""

    def wrapper(self: ControllerServicer, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self.auth.check(context, method.__name__, request)
        replies = method(self, request, context)
        try:
            while True:
                try:
                    reply = next(replies)
                except StopIteration:
                    return
                except grpc.RpcError:
                    raise
                except Exception as exc:
                    _fail(context, method.__name__, exc)
                yield reply
        finally:
            replies.close()

    wrapper.__name__ = method.__name__
    return wrapper


def _fail(context: grpc.ServicerContext, method: str, exc: Exception) -> NoReturn:
    """Answer a call that raised ``exc`` (called in its ``except`` block): a state file that
    cannot be written is UNAVAILABLE with the reason, domain errors get their status codes,
    anything else is INTERNAL, logged with its traceback."""
    if reason := write_failure(exc):
        log.error("%s: %s", method, reason)
        context.abort(grpc.StatusCode.UNAVAILABLE, reason)
    if isinstance(exc, ValidationError | Rejected | NotFound | KeyConflict | Busy | Conflict
                  | AgentFailed | AgentError | FellBehind | NodeInUse | TooManyWatches):
        _abort(context, exc)
    log.exception("internal error in %s", method)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
    raise AssertionError("context.abort returned")   # it raises; for the type checker


def _check_node_and_reason(node: str, reason: str, action: str) -> None:
    """The node an operator's call names, and the reason it records (shown in status)."""
    if not node:
        raise ValidationError("node", f"name the node to {action}")
    check_node_name(node)
    if len(reason) > 256:
        raise ValidationError("reason", f"at most 256 characters, got {len(reason)}")


class ControllerServicer(pb_grpc.ControllerServicer):
    def __init__(self, core: ControllerCore, auth: Authenticator, max_watches: int = 16) -> None:
        self.core = core
        self.auth = auth
        # A Watch stream holds a worker thread for as long as it is open: without a bound, open
        # streams (any client's, even a node certificate's) could take every worker, and no
        # Allocate, RegisterNode or Heartbeat would be served.
        self.max_watches = max_watches
        self._watch_slots = threading.BoundedSemaphore(max_watches)

    def _pb(self, allocation) -> pb.Allocation:
        return convert.allocation_to_pb(allocation, self.core.is_available(allocation.node))

    @functools.partial(_guard, durable_by_core=True)
    def Allocate(self, request: pb.AllocateRequest, context) -> pb.Allocation:
        req = Request(spec=convert.spec_from_pb(request.spec), owner=request.owner,
                      idempotency_key=request.idempotency_key, lease_ttl=request.lease_ttl_seconds)
        return self._pb(self.core.allocate(req))

    @functools.partial(_guard, durable_by_core=True)
    def Release(self, request: pb.ReleaseAllocationRequest, context) -> pb.Allocation:
        check_allocation_id(request.allocation_id)
        return self._pb(self.core.release(request.allocation_id))

    @_guard
    def Get(self, request: pb.GetAllocationRequest, context) -> pb.Allocation:
        check_allocation_id(request.allocation_id)
        return self._pb(self.core.get(request.allocation_id))

    @_guard
    def List(self, request: pb.ListAllocationsRequest, context) -> pb.ListAllocationsResponse:
        states = None if request.include_finished else HOLDING
        found = self.core.store.list_allocations(states, node=request.node or None)
        return pb.ListAllocationsResponse(allocations=[self._pb(a) for a in found])

    @_guard_stream
    def Watch(self, request: pb.WatchAllocationsRequest, context) -> Iterator[pb.AllocationEvent]:
        if request.allocation_id:   # none: every allocation's events
            check_allocation_id(request.allocation_id)
        if not self._watch_slots.acquire(blocking=False):
            raise TooManyWatches(f"{self.max_watches} watches are open, as many as this controller serves "
                                 "at once (each holds one of its worker threads); close one, or watch "
                                 "again later")
        sub = self.core.events.subscribe(request.allocation_id)
        try:
            if request.allocation_id:
                current = self.core.get(request.allocation_id)
                self.core.store.sync()
                yield pb.AllocationEvent(allocation=self._pb(current))
                if current.state in FINISHED:
                    return
            while context.is_active():
                event = sub.get(timeout=1.0)
                if sub.overflowed:
                    raise FellBehind("watch fell behind; watch again")
                if event is not None:
                    self.core.store.sync()
                    yield pb.AllocationEvent(allocation=self._pb(event))
                    if request.allocation_id and event.state in FINISHED:
                        return
        finally:
            self.core.events.unsubscribe(sub)
            self._watch_slots.release()

    @_guard
    def RenewLease(self, request: pb.RenewLeaseRequest, context) -> pb.Allocation:
        check_allocation_id(request.allocation_id)
        return self._pb(self.core.renew(request.allocation_id, request.ttl_seconds))

    @_guard
    def Status(self, request: pb.ClusterStatusRequest, context) -> pb.ClusterStatus:
        states = None if request.include_finished else HOLDING
        if not request.nodes:
            nodes, allocations = self.core.store.list_nodes(), self.core.store.list_allocations(states)
        else:
            names = list(dict.fromkeys(request.nodes))
            if len(names) > MAX_STATUS_NODES:
                raise ValidationError("nodes", f"at most {MAX_STATUS_NODES} nodes, got {len(names)}; "
                                               "name none for the whole cluster")
            for name in names:
                check_node_name(name)
            nodes = [self.core.stored_node(name) for name in names]
            allocations = [a for name in names for a in self.core.store.list_allocations(states, node=name)]
        for n in nodes:
            n.available = self.core.is_available(n.name)
        return convert.cluster_status(nodes, allocations, self.core.ledger.overcommitted())

    @_guard
    def SetSchedulable(self, request: pb.SetSchedulableRequest, context) -> pb.NodeStatus:
        _check_node_and_reason(request.node, request.reason, "cordon or uncordon")
        node = self.core.set_schedulable(request.node, request.schedulable, request.reason)
        node.available = self.core.is_available(node.name)
        held = self.core.store.list_allocations(HOLDING, node=node.name)
        return convert.cluster_status([node], held, self.core.ledger.overcommitted(node.name)).nodes[0]

    @_guard
    def ForgetNode(self, request: pb.ForgetNodeRequest, context) -> pb.ForgetNodeResponse:
        _check_node_and_reason(request.node, request.reason, "forget")
        ended = self.core.forget_node(request.node, request.reason)
        return pb.ForgetNodeResponse(ended=[self._pb(a) for a in ended])

    @_guard
    def Ping(self, request: common_pb2.Empty, context) -> common_pb2.Empty:
        return common_pb2.Empty()


class RegistryServicer(pb_grpc.NodeRegistryServicer):
    # Refusals logged, so each is logged once (an agent retries every few seconds) until that
    # node gets through; bounded, since any certificate of the CA may ask for any node name.
    MAX_REFUSALS_REMEMBERED = 1024

    def __init__(self, core: ControllerCore, on_registered: Callable[[str], None]) -> None:
        self.core = core
        self._on_registered = on_registered
        self._refused: dict[str, str] = {}
        self._refused_lock = threading.Lock()

    def _node_identity(self, context: grpc.ServicerContext, node: str) -> None:
        peer = peer_identity(context)
        if peer is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "node agents must use mTLS (a certificate "
                                                           "signed by the cluster CA)")
        problem = peer.why_not_node(node)
        with self._refused_lock:
            if problem is None:
                self._refused.pop(node, None)
                return
            new = self._refused.get(node) != problem
            if new and len(self._refused) < self.MAX_REFUSALS_REMEMBERED:
                self._refused[node] = problem
        if new:
            # Without this line the controller's log only said the node missed its heartbeats
            # (e.g. while an upgrade has not re-issued the nodes' certificates with their role).
            log.warning("node %s refused: %s", node, problem)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)

    def RegisterNode(self, request: pb.RegisterNodeRequest, context) -> pb.RegisterNodeResponse:
        self._node_identity(context, request.node)
        try:
            if not request.address:
                raise ValidationError("address", "the agent's host:port is required")
            labels = dict(request.labels)
            check_node_labels(labels)
            self.core.register_node(request.node, request.address, labels)
            self._on_registered(request.node)
            self.core.store.sync()
        except AgentError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach the agent back at {request.address}: "
                                                       f"{exc}")
        except Exception as exc:
            _fail(context, "RegisterNode", exc)
        return pb.RegisterNodeResponse(heartbeat_interval_seconds=self.core.heartbeat_interval())

    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        self._node_identity(context, request.node)
        try:
            return pb.HeartbeatResponse(registered=self.core.heartbeat(request.node),
                                        heartbeat_interval_seconds=self.core.heartbeat_interval())
        except Exception as exc:
            _fail(context, "Heartbeat", exc)


class ControllerServer:
    """Lock, store, core, reconciler (and the registrations' passes), gRPC server, and the
    liveness and reconcile threads, started in that order."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.lock = StateDirLock(config.state_dir)
        self._stop = threading.Event()
        self.server: grpc.Server | None = None

    def start(self) -> None:
        cfg = self.config
        if cfg.client_auth == "cert" and (cfg.token_listen or cfg.tokens):
            # cert mode ignores tokens: a token port would refuse every client it is meant for
            given = "token_listen (--token-listen)" if cfg.token_listen else "token_file (--token-file)"
            raise ValueError(f"{given} is for bearer-token clients, but client_auth (--client-auth) is cert, "
                             "which accepts client certificates only; set --client-auth token or any")
        auth = Authenticator(cfg.client_auth, cfg.tokens)   # config errors before anything starts
        cfg.tls.check()
        self.lock.acquire()
        try:
            self.store = SqliteStore(Path(cfg.state_dir) / "state.db")
            self.agents = AgentPool(cfg.tls, cfg.agent_deadline)
            self.core = ControllerCore(self.store, self.agents, cfg.settings,
                                       Ledger(cfg.mps_oversubscription))
            self.reconciler = Reconciler(self.core)
            report = self.reconciler.start()
            log.info("state rebuilt: %s", report)
            self._passes = RegistrationPasses(self.reconciler)
            self._workers = ThreadPoolExecutor(max_workers=cfg.workers)
            server = grpc.server(self._workers, options=[("grpc.so_reuseport", 0)])
            pb_grpc.add_ControllerServicer_to_server(
                ControllerServicer(self.core, auth, max_watches=max(1, cfg.workers // 2)), server)
            pb_grpc.add_NodeRegistryServicer_to_server(RegistryServicer(self.core, self._passes.add),
                                                       server)
            self.port = server.add_secure_port(cfg.listen, server_credentials(cfg.tls, True))
            if cfg.token_listen:
                self.token_port = server.add_secure_port(cfg.token_listen, server_credentials(cfg.tls, False))
            server.start()
            self.server = server
            self._threads = [threading.Thread(target=self._check_liveness, name="liveness", daemon=True),
                             threading.Thread(target=self._reconcile, name="reconcile", daemon=True)]
            for thread in self._threads:
                thread.start()
            watch_expiry(cfg.tls.cert, "controller", Path(cfg.tls.cert).stem, log, self._stop)
        except BaseException:
            self.lock.release()
            raise

    @staticmethod
    def _safe(fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:
            log.exception("background step failed")

    def _check_liveness(self) -> None:
        """In a thread of its own: a reconcile pass waits a whole agent deadline on a hung agent,
        and while the checks came after it, a dead node was offered work that much longer past
        its heartbeat timeout."""
        while not self._stop.wait(min(1.0, self.config.settings.heartbeat_interval / 2)):
            self._safe(self.core.check_liveness)

    def _reconcile(self) -> None:
        while not self._stop.wait(self.core.pass_interval()):
            with collection_paused():   # then what the pass left is collected, the rest frozen
                self._safe(self.reconciler.run_once)

    def stop(self, grace: float = 5.0) -> None:
        """Calls get ``grace`` seconds to end; then the agent calls still waiting are cancelled
        (and later ones refused), and the store and the lock are let go only once every call's
        thread has written what it did: a controller started next (the lock is free) never works
        beside this one, nor after it writes to the store."""
        self._stop.set()
        if self.server is not None:
            self.server.stop(grace).wait()
        self.agents.close()
        if self.server is not None:
            self._passes.stop()
            self._workers.shutdown(wait=True)
            for thread in self._threads:
                thread.join()
        self.store.close()
        self.lock.release()

    def serve_forever(self) -> None:
        """Until SIGTERM or SIGINT."""
        done = threading.Event()
        stop_on_signals(done)
        done.wait()
        log.info("stopping")
        self.stop()
