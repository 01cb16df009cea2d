"""gRPC credentials from certificate paths, and the caller's identity inside a servicer.

Two server modes exist because gRPC Python cannot *request* a client certificate without
*requiring* it: ``require_client_cert=True`` (mTLS; a peer without a certificate signed by the
cluster CA fails the TLS handshake) or ``False`` (server-only TLS; no client certificate is
even asked for, so every caller is anonymous). A service that wants anonymous read-only
access next to mTLS mutations therefore listens on two ports (see the node agent).

Server certificates are re-read from disk when their files change, so short-lived
certificates can be rotated by re-issuing them in place, without a restart.
"""

from __future__ import annotations

import functools
import os
import socket
import ssl
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fastshare.security.certs import reissue_command, role_of


@dataclass(frozen=True)
class TlsPaths:
    """Where a process finds its certificate, its key and the cluster CA certificate."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def in_dir(cls, directory: Path, name: str) -> TlsPaths:
        """The layout `fastshare certs issue --out DIR --name NAME` writes."""
        directory = Path(directory)
        return cls(directory / f"{name}.crt", directory / f"{name}.key", directory / "ca.crt")

    def check(self) -> None:
        """Fail early, naming the file, instead of an opaque error later (gRPC only says it cannot
        bind the port): each file present and readable (OSError), the certificate, key and CA in
        PEM and the key the certificate's (ValueError)."""
        for field, path in (("cert", self.cert), ("key", self.key), ("ca", self.ca)):
            if not Path(path).is_file():
                raise FileNotFoundError(f"tls.{field}: {path} does not exist or is not a file")
            if not os.access(path, os.R_OK):
                raise PermissionError(f"tls.{field}: {path} is not readable by this process")
        cert_pem, key_pem, ca_pem = self.read()
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
        except ValueError as exc:
            raise ValueError(f"tls.cert: {self.cert} is not a PEM certificate ({exc})") from None
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as exc:   # TypeError: encrypted
            raise ValueError(f"tls.key: {self.key} is not a PEM private key without a password ({exc})"
                             ) from None
        try:
            x509.load_pem_x509_certificates(ca_pem)
        except ValueError as exc:
            raise ValueError(f"tls.ca: {self.ca} is not a PEM certificate ({exc})") from None
        if cert.public_key() != key.public_key():
            raise ValueError(f"tls.key: {self.key} is not the key of {self.cert}; put the key issued with it "
                             "there, or issue the pair again")

    def stamp(self) -> tuple[tuple[int, int], ...]:
        """Changes when any of the three files is replaced (as `fastshare certs issue` does);
        raises OSError while one is missing."""
        out = []
        for p in (self.cert, self.key, self.ca):
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_ino))
        return tuple(out)

    def read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()

    def pair_matches(self) -> bool:
        """Whether the key file holds the certificate's key. A renewal replaces the key, then
        the certificate (each atomically): between the two renames, and if either is unreadable,
        this is False and a reader keeps what it has until the pair is whole again. (The server
        credentials need no such check: gRPC itself keeps the old pair when a reloaded one does
        not match.)"""
        try:
            return _pair_matches(Path(self.cert).read_bytes(), Path(self.key).read_bytes())
        except OSError:
            return False


def _pair_matches(cert_pem: bytes, key_pem: bytes) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        return cert.public_key() == key.public_key()
    except (ValueError, TypeError):
        return False


class _Reloader:
    """gRPC certificate fetcher: returns a new configuration only when a file changed."""

    def __init__(self, paths: TlsPaths, require_client_cert: bool) -> None:
        self._paths = paths
        self._require = require_client_cert
        self._lock = threading.Lock()
        self._stamp = paths.stamp()

    def config(self) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = self._paths.read()
        return grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=ca if self._require else None)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            stamp = self._paths.stamp()
        except OSError:
            return None  # mid-rotation (file replaced): keep serving with the old pair
        with self._lock:
            if stamp == self._stamp:
                return None
            try:
                cfg = self.config()
            except (OSError, ValueError):
                return None
            self._stamp = stamp
            return cfg


def server_credentials(paths: TlsPaths, require_client_cert: bool = True) -> grpc.ServerCredentials:
    """TLS server credentials that follow certificate rotation on disk."""
    paths.check()
    reloader = _Reloader(paths, require_client_cert)
    return grpc.dynamic_ssl_server_credentials(reloader.config(), reloader,
                                               require_client_authentication=require_client_cert)


def channel_credentials(ca: Path, cert: Path | None = None,
                        key: Path | None = None) -> grpc.ChannelCredentials:
    """Client credentials: verify the server against ``ca``; present ``cert``/``key`` if given."""
    if (cert is None) != (key is None):
        raise ValueError("cert and key must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None)


def secure_channel(target: str, ca: Path, cert: Path | None = None, key: Path | None = None,
                   server_name: str | None = None,
                   options: Iterable[tuple[str, object]] = ()) -> grpc.Channel:
    """A TLS channel; ``server_name`` checks the server certificate for that name instead of
    the host in ``target`` (useful when dialling an IP the certificate does not list)."""
    opts = list(options)
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(target, channel_credentials(ca, cert, key), options=opts)


def mtls_channel(target: str, paths: TlsPaths, server_name: str | None = None,
                 options: Iterable[tuple[str, object]] = ()) -> grpc.Channel:
    return secure_channel(target, paths.ca, paths.cert, paths.key, server_name, options)


def server_certificate(target: str, paths: TlsPaths, server_name: str | None = None,
                       timeout: float = 10.0) -> x509.Certificate:
    """The certificate the server at ``target`` (HOST:PORT, [IPv6]:PORT) presents, from a TLS
    handshake of its own, verified as a gRPC channel does it (the CA of ``paths``, the name
    ``server_name`` or the host, ``paths``' certificate presented). gRPC Python shows a client
    nothing of the server's certificate, so a client that needs the server's role (not only a
    name, which another role's certificate may list) asks with this. OSError if it cannot."""
    host, _, port = target.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # verifies the chain and the name
    context.load_verify_locations(cafile=str(paths.ca))
    context.load_cert_chain(str(paths.cert), str(paths.key))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=timeout) as raw, \
            context.wrap_socket(raw, server_hostname=server_name or host) as tls:
        der = tls.getpeercert(binary_form=True)
    if not der:
        raise ssl.SSLError(f"{target} presented no certificate")
    return x509.load_der_x509_certificate(der)


@dataclass(frozen=True)
class PeerIdentity:
    """Who is calling, from the verified client certificate. ``role`` (see
    :mod:`fastshare.security.certs`) is None for a certificate issued without one."""

    common_name: str
    sans: tuple[str, ...]
    role: str | None = None

    def names(self) -> set[str]:
        return {self.common_name, *self.sans}

    def describe_role(self) -> str:
        return f"the {self.role} role" if self.role else "no role (issued before certificates had roles)"

    def why_not_node(self, node: str) -> str | None:
        """None if this is node ``node``'s own certificate, else what is wrong and what to do."""
        if self.role != "node":
            return (f"certificate {self.common_name!r} has {self.describe_role()}, not the node role, so it "
                    f"cannot act as node {node!r}; re-issue it with `{reissue_command('node', node)}`")
        if self.common_name != node:
            return (f"the node certificate of {self.common_name!r} cannot act as node {node!r}: a node "
                    "certificate acts only for the node in its common name (the agent's node_name must "
                    f"be that name, or give it a certificate from `{reissue_command('node', node)}`)")
        return None


@functools.lru_cache(maxsize=256)
def _role_of_pem(pem: bytes) -> str | None:
    try:
        return role_of(x509.load_pem_x509_certificate(pem))
    except ValueError:
        return None


def peer_identity(context: grpc.ServicerContext) -> PeerIdentity | None:
    """The verified client certificate's CN, SANs and role, or None (no TLS or no client cert).

    gRPC only fills these keys after it verified the chain against the server's CA.
    """
    auth = context.auth_context() or {}
    cns = auth.get("x509_common_name") or []
    sans = auth.get("x509_subject_alternative_name") or []
    if not cns and not sans:
        return None
    cn = cns[0].decode() if cns else ""
    pem = (auth.get("x509_pem_cert") or [b""])[0]
    return PeerIdentity(cn, tuple(s.decode() for s in sans), _role_of_pem(pem) if pem else None)


def require_peer(context: grpc.ServicerContext, allowed: Iterable[str] = ()) -> PeerIdentity:
    """Abort with UNAUTHENTICATED unless the caller has a verified client certificate, and
    PERMISSION_DENIED if ``allowed`` is non-empty and none of its names is in it."""
    peer = peer_identity(context)
    if peer is None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "this call needs a client certificate signed by the cluster CA (mTLS)")
    allowed_set = set(allowed)
    if allowed_set and not (peer.names() & allowed_set):
        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                      f"client {peer.common_name!r} is not in the allowed client names")
    return peer
