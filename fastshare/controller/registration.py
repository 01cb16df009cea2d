"""Runs inside the node agent: register with the controller, then heartbeat.

The agent starts one :class:`Registrar` when its configuration names ``controller_address``.
The controller answers a heartbeat with ``registered = false`` when it does not know the node
in its current process (it restarted, or declared the node lost); the registrar then
registers again, which makes the controller pull the inventory and reconcile the node.

gRPC checks only that the controller's certificate lists the name dialled, which a node
certificate may list too; before it sends anything on a new connection the registrar checks,
with a TLS handshake of its own (:func:`server_certificate`), that the server there has the
controller role.
"""

from __future__ import annotations

import logging
import socket
import threading

import grpc
from cryptography import x509

from fastshare.security.certs import CONTROLLER_NAME, reissue_command, role_of
from fastshare.security.tls import PeerIdentity, TlsPaths, mtls_channel, server_certificate
from fastshare.v1 import controller_pb2 as pb
from fastshare.v1 import controller_pb2_grpc as pb_grpc

log = logging.getLogger("fastshare.node.registration")
DEADLINE = 10.0
MAX_BACKOFF = 10.0


class Registrar:
    def __init__(self, controller_address: str, node_name: str, agent_address: str, tls: TlsPaths,
                 labels: dict[str, str] | None = None, controller_name: str = CONTROLLER_NAME) -> None:
        self.node_name = node_name
        self.agent_address = agent_address
        self.labels = dict(labels or {})
        self._address, self._server_name = controller_address, controller_name
        self._tls = tls
        self._stamp = tls.stamp()
        # set until the server's role is checked, and again whenever the channel's connection drops
        self._unchecked = threading.Event()
        self._channel = self._dial()
        self._stub = pb_grpc.NodeRegistryStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="registrar", daemon=True)
        self.registered = threading.Event()
        self.interval = 2.0

    def start(self) -> Registrar:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=DEADLINE + 1)
        self._channel.close()

    def run(self, stop: threading.Event) -> None:
        """Register and heartbeat in the calling thread until ``stop`` is set."""
        self._stop = stop
        try:
            self._loop()
        finally:
            self._channel.close()

    def _dial(self) -> grpc.Channel:
        channel = mtls_channel(self._address, self._tls, server_name=self._server_name)
        self._unchecked.set()
        ready = False

        def on_state(state: grpc.ChannelConnectivity) -> None:
            nonlocal ready
            if state is grpc.ChannelConnectivity.READY:
                ready = True
            elif ready:          # the connection the check was for is gone: check the next one
                ready = False
                self._unchecked.set()

        channel.subscribe(on_state)
        return channel

    def _is_controller(self) -> bool:
        """Whether the server at the controller's address has the controller role. A node
        certificate that lists the controller's name would otherwise get every RegisterNode and
        Heartbeat (the server's names, not its role, is what gRPC checks)."""
        try:
            cert = server_certificate(self._address, self._tls, self._server_name, DEADLINE)
        except (OSError, ValueError) as exc:
            log.warning("controller at %s: cannot check its certificate: %s", self._address, exc)
            return False
        role = role_of(cert)
        if role == "controller":
            return True
        names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        peer = PeerIdentity(str(names[0].value) if names else "", (), role)
        log.error("controller at %s: the certificate there, %r, has %s, not the controller role: sending it "
                  "nothing (the controller's certificate is issued with `%s`)", self._address,
                  peer.common_name, peer.describe_role(), reissue_command("controller", self._server_name))
        return False

    def _register(self) -> None:
        reply = self._stub.RegisterNode(pb.RegisterNodeRequest(
            node=self.node_name, address=self.agent_address, labels=self.labels), timeout=DEADLINE)
        self.interval = float(reply.heartbeat_interval_seconds or 2)
        self.registered.set()
        log.info("registered with the controller as %s (%s)", self.node_name, self.agent_address)

    def _follow_renewal(self) -> None:
        """A channel presents the certificate it was built with; after the files were renewed
        on disk, build a new one (the old certificate expires)."""
        try:
            stamp = self._tls.stamp()
        except OSError:
            return   # mid-rotation
        if stamp != self._stamp:
            self._stamp = stamp
            self._channel.close()
            self._channel = self._dial()
            self._stub = pb_grpc.NodeRegistryStub(self._channel)

    def _loop(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            self._follow_renewal()
            if self._unchecked.is_set():
                self._unchecked.clear()   # before the check: a drop meanwhile sets it again
                if not self._is_controller():
                    self._unchecked.set()
                    wait, backoff = backoff, min(MAX_BACKOFF, backoff * 2)
                    self._stop.wait(wait)
                    continue
            try:
                if not self.registered.is_set():
                    self._register()
                else:
                    reply = self._stub.Heartbeat(pb.HeartbeatRequest(node=self.node_name), timeout=DEADLINE)
                    if not reply.registered:
                        self.registered.clear()
                        continue           # register again at once
                    self.interval = float(reply.heartbeat_interval_seconds or self.interval)
                backoff = 0.5
                wait = self.interval
            except grpc.RpcError as exc:
                log.warning("controller: %s: %s", exc.code().name, exc.details())
                if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                    self.registered.clear()
                wait, backoff = backoff, min(MAX_BACKOFF, backoff * 2)
            self._stop.wait(wait)


def advertised_address(listen: str, node_name: str) -> str:
    """What the controller should dial: the listen address, with a wildcard host replaced by
    the node's name (its certificate names it; DNS must resolve it)."""
    host, _, port = listen.rpartition(":")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        host = node_name or socket.getfqdn()
    return f"{host}:{port}"
