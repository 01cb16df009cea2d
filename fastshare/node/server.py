"""Running the agent: open the device, reconcile, serve gRPC (mTLS TCP, read-only TCP, unix
socket), expose metrics, tell systemd we are ready, housekeep, stop cleanly on SIGTERM.

Order matters: the journal is reconciled against the device BEFORE any port opens, so no
request ever sees half-done work from a previous run.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import socket
import stat
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from prometheus_client import start_http_server

from fastshare.device import open_devices
from fastshare.mps.control import MpsControl
from fastshare.node.agent import Agent
from fastshare.node.config import (
    AGENT_LOCK_OWNER,
    MIG_CHANGE_NOTE,
    MIG_CHANGE_WAIT_S,
    SERVING,
    NodeConfig,
)
from fastshare.node.journal import Journal
from fastshare.node.service import Metrics, NodeAgentService
from fastshare.security.rotation import watch_expiry
from fastshare.security.tls import TlsPaths, server_credentials
from fastshare.server_runtime import settle_startup
from fastshare.state_lock import LockedError, StateDirLock
from fastshare.stop_signal import stop_on_signals
from fastshare.v1 import agent_pb2_grpc

log = logging.getLogger("fastshare.node")


_UNIT_START_TIMEOUT_S = 180   # fastshare-node.service's TimeoutStartSec


def sd_notify(message: str) -> bool:
    """systemd's readiness protocol (sd_notify(3)) without libsystemd: one datagram to
    $NOTIFY_SOCKET. Returns False when not started by systemd with Type=notify."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(message.encode())
    return True


@dataclass
class Running:
    """A started agent; ``stop()`` shuts it down."""

    config: NodeConfig
    agent: Agent
    server: grpc.Server
    workers: futures.ThreadPoolExecutor   # the server's: a call under way runs in one
    ports: dict[str, int]
    stop_event: threading.Event
    threads: list[threading.Thread]
    lock: StateDirLock
    metrics_server: object | None = None

    def stop(self, grace: float = 5.0) -> None:
        self.stop_event.set()
        with contextlib.suppress(Exception):
            sd_notify("STOPPING=1")
        self.agent.stop_waits()
        self.server.stop(grace).wait(grace + 1)
        # a call past its grace is cancelled for its caller but goes on in its thread: the
        # journal and the lock are let go once it has journaled what it did
        self.workers.shutdown(wait=True)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()  # type: ignore[attr-defined]
        for t in self.threads:
            t.join(timeout=grace)
        self.agent.journal.close()
        with contextlib.suppress(Exception):
            self.agent.devices.close()
        if self.config.unix_socket:
            with contextlib.suppress(FileNotFoundError):
                Path(self.config.unix_socket).unlink()
        self.lock.release()


def _bind_unix(server: grpc.Server, config: NodeConfig) -> None:
    path = Path(config.unix_socket)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise RuntimeError(f"unix_socket {path} exists and is not a socket; refusing to replace it")
        path.unlink()  # stale socket of a previous run
    # Until the chmod below the socket carries the umask's mode (0755 with the usual 022),
    # which already denies connect() (it needs write permission) to everyone but the owner.
    server.add_insecure_port(f"unix:{path}")


def _secure_unix(config: NodeConfig) -> None:
    path = Path(config.unix_socket)
    if config.unix_socket_group:
        os.chown(path, -1, grp.getgrnam(config.unix_socket_group).gr_gid)
    os.chmod(path, config.unix_socket_mode)


T = TypeVar("T")


def _bound(config: NodeConfig, setting: str, bind: Callable[[str], T]) -> T:
    """``bind(address)``, or an error naming the setting and its address (a port in use said
    only "[Errno 98] Address already in use", and gRPC only "Failed to bind to address")."""
    address = getattr(config, setting)
    try:
        return bind(address)
    except (OSError, RuntimeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "in use, or not of this host"
        flag = "--" + setting.replace("_", "-")
        raise RuntimeError(f"{setting} {address}: cannot listen there ({why}); set {setting} (or {flag}) to "
                           "a free HOST:PORT, or '' for none") from exc


def start(config: NodeConfig, cert_renewed: bool = False) -> Running:
    """Open everything, reconcile, then open the ports. Raises on any configuration problem.
    ``cert_renewed``: something renews the certificate (the Kubernetes bootstrap); otherwise
    its end is announced from a week before (:func:`watch_expiry`)."""
    tls = TlsPaths(Path(config.tls.cert), Path(config.tls.key), Path(config.tls.ca))
    if config.listen or config.readonly_listen:
        try:   # before the ports: gRPC reports a bad file as a port it cannot bind
            tls.check()
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None
    lock = StateDirLock(config.state_dir, AGENT_LOCK_OWNER, "state_dir (node.yaml)")
    try:
        lock.acquire(patience=2.0)   # before the journal and the GPUs: one agent per state directory
    except LockedError as exc:
        if exc.holder.note != MIG_CHANGE_NOTE:
            raise RuntimeError(str(exc)) from None
        log.info("waiting up to %.0f s for %s (pid %s) to finish", MIG_CHANGE_WAIT_S, exc.holder.note,
                 exc.holder.pid)
        # the wait is not start-up work: systemd's start timeout begins again after it
        sd_notify(f"EXTEND_TIMEOUT_USEC={int((MIG_CHANGE_WAIT_S + _UNIT_START_TIMEOUT_S) * 1e6)}\n"
                  f"STATUS=waiting for {exc.holder.note} (pid {exc.holder.pid}) to finish")
        try:
            lock.acquire(patience=MIG_CHANGE_WAIT_S)
        except LockedError as again:
            raise RuntimeError(str(again)) from None
    try:
        return _start(config, cert_renewed, tls, lock)
    except BaseException:
        lock.release()
        raise


def _start(config: NodeConfig, cert_renewed: bool, tls: TlsPaths, lock: StateDirLock) -> Running:
    devices = open_devices(config.device_backend, config.sim_state or None)
    journal = Journal(config.journal_path)
    os.chmod(config.journal_path.parent, 0o700)
    mps = MpsControl(config.mps_control_binary, config.mps_root, timeout=config.mps_timeout_s)
    agent = Agent(config, devices, mps, journal)
    for action in agent.reconcile():
        log.info("reconcile: %s", action)

    metrics = Metrics(agent)
    workers = futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="rpc")
    server = grpc.server(workers, options=[("grpc.so_reuseport", 0)])
    agent_pb2_grpc.add_NodeAgentServicer_to_server(NodeAgentService(agent, metrics), server)
    ports: dict[str, int] = {}
    if config.listen:
        ports["listen"] = _bound(config, "listen", lambda address: server.add_secure_port(
            address, server_credentials(tls, require_client_cert=True)))
    if config.readonly_listen:
        ports["readonly_listen"] = _bound(config, "readonly_listen", lambda address: server.add_secure_port(
            address, server_credentials(tls, require_client_cert=False)))
    if config.unix_socket:
        _bind_unix(server, config)
    server.start()
    if config.unix_socket:
        _secure_unix(config)

    metrics_server = None
    if config.metrics_listen:
        host, _, port = config.metrics_listen.rpartition(":")
        try:
            metrics_server, _thread = _bound(config, "metrics_listen", lambda _address: start_http_server(
                int(port), host.strip("[]"), registry=metrics.registry))
        except RuntimeError:
            server.stop(None)
            raise
        ports["metrics_listen"] = metrics_server.server_port

    stop_event = threading.Event()
    threads = [threading.Thread(target=_housekeeping, args=(agent, stop_event), name="housekeeping",
                                daemon=True)]
    threads += _controller_hook(config, agent, stop_event)
    for t in threads:
        t.start()
    if (config.listen or config.readonly_listen or config.controller_address) and not cert_renewed:
        threads.append(watch_expiry(tls.cert, "node", config.node_name, log, stop_event))
    # for `fastshare mig ...`, which tells an agent still starting from one serving elsewhere
    lock.status(f"{SERVING} {config.unix_socket or 'no unix socket'}")
    return Running(config, agent, server, workers, ports, stop_event, threads, lock, metrics_server)


def _housekeeping(agent: Agent, stop: threading.Event) -> None:
    while not stop.wait(agent.config.reconcile_interval_s):
        try:
            agent.housekeeping()
        except Exception:
            log.exception("housekeeping failed; retrying in %ss", agent.config.reconcile_interval_s)


def _controller_hook(config: NodeConfig, agent: Agent, stop: threading.Event) -> list[threading.Thread]:
    """Registration with the controller (``controller_address``).

    The registration client belongs to the controller's API (controller.proto); it plugs in
    as ``fastshare.node.registration.run(config, agent, stop_event)``, called in its own
    thread. Until that module exists a configured address is reported, not silently ignored.
    """
    if not config.controller_address:
        return []
    try:
        from fastshare.node import registration  # type: ignore[attr-defined]
    except ImportError:
        log.error("controller_address %s is set but this build has no controller registration client "
                  "(fastshare.node.registration); the controller must add this node itself",
                  config.controller_address)
        return []
    return [threading.Thread(target=registration.run, args=(config, agent, stop), name="registration",
                             daemon=True)]


def serve(config: NodeConfig, cert_renewed: bool = False) -> None:
    """Run until SIGTERM/SIGINT (the systemd unit's main process)."""
    stop = threading.Event()
    stop_on_signals(stop)
    running = start(config, cert_renewed)
    where = ", ".join(f"{k}={v}" for k, v in running.ports.items())
    log.info("fastshare node agent %s serving (%s%s)", config.node_name, where,
             f", unix={config.unix_socket}" if config.unix_socket else "")
    sd_notify(f"READY=1\nSTATUS=serving {where}")
    settle_startup()
    stop.wait()
    log.info("stopping")
    running.stop()
