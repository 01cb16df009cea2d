"""The node agent's own certificate in Kubernetes mode: asked for, written, renewed.

``fastshare node serve --bootstrap-controller HOST:PORT --bootstrap-token FILE --bootstrap-ca
FILE`` makes a new ECDSA key, sends a CSR (CN = ``--node-name``) with the Pod's projected
ServiceAccount token to the controller's NodeBootstrap service (server-side TLS, verified
against ``--bootstrap-ca``, the cluster CA from a ConfigMap), and writes the certificate, the
key (mode 0600) and the CA it gets back to ``--tls-cert``/``--tls-key``/``--tls-ca``, each
atomically. The agent then serves mTLS with them, as with a certificate issued by hand; its
server credentials re-read re-issued files, so renewal (at 2/3 of the certificate's life,
with a new key each time) needs no restart.

The CA file written to ``--tls-ca`` (what the agent checks the controller's client
certificate with) holds the CA bundle of ``--bootstrap-ca`` plus the CA that signed the new
certificate. When that bundle changes (the operator rotates the CA: the ConfigMap, mounted,
gets the new CA next to the old one, later the new one alone), the agent asks for a new
certificate at once (within :data:`~fastshare.security.rotation.CHECK_INTERVAL_S`), rather than
at its next renewal, so that its certificate and its trust follow the rotation.

At start a certificate already in place (a restarted container keeps its emptyDir) that is
still valid for this node is used at once and renewed in the background; otherwise the agent
waits for one, retrying with backoff while the controller cannot be reached or is over its
rate limit (RESOURCE_EXHAUSTED: never sooner than the controller said). A definite refusal
(PERMISSION_DENIED, INVALID_ARGUMENT) stops the start with the controller's message.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fastshare.k8s.ratelimit import RETRY_AFTER_KEY
from fastshare.security import certs
from fastshare.security.rotation import (
    CHECK_INTERVAL_S,
    FIRST_BACKOFF_S,
    MAX_BACKOFF_S,
    backoff,
    remaining,
    renew_at,
    renew_forever,
)
from fastshare.v1 import bootstrap_pb2 as pb
from fastshare.v1 import bootstrap_pb2_grpc as pb_grpc

log = logging.getLogger("fastshare.node.bootstrap")

RPC_TIMEOUT_S = 30.0
# At least this long between two renewals, even if a certificate is due at once (a very short
# lifetime, a clock ahead of the controller's): never a tight loop against the controller.
MIN_RENEW_INTERVAL_S = 30.0
# Refusals: asking again with the same token and Pod gets the same answer.
_DEFINITE = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
             grpc.StatusCode.UNIMPLEMENTED}


class BootstrapError(RuntimeError):
    """The certificate cannot be had: the message says why and what to do."""


@dataclass(frozen=True)
class BootstrapConfig:
    controller: str       # HOST:PORT of the controller's NodeBootstrap service
    token_file: Path      # the projected ServiceAccount token (re-read on every request)
    ca_file: Path         # CA to verify the controller with
    node_name: str        # CN asked for
    cert: Path            # where the certificate, key and CA are written
    key: Path
    ca: Path
    # The name the controller's certificate must carry, when it is not the host in
    # ``controller`` (tests dial loopback and check the Service's DNS name, as a cluster does).
    server_name: str | None = None


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


def _explain(exc: BaseException) -> str:
    return f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)


def _retry_after(exc: BaseException) -> float:
    """The controller's "retry in" of a RESOURCE_EXHAUSTED refusal (0 if none)."""
    if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return 0.0
    for key, value in exc.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return min(max(float(value), 0.0), MAX_BACKOFF_S)
            except ValueError:
                return 0.0
    return 0.0


class Bootstrapper:
    def __init__(self, config: BootstrapConfig, timeout: float = RPC_TIMEOUT_S,
                 min_renew_interval: float = MIN_RENEW_INTERVAL_S,
                 check_interval: float = CHECK_INTERVAL_S) -> None:
        self.config = config
        self.timeout = timeout
        self.min_renew_interval = min_renew_interval
        self.check_interval = check_interval
        self._thread: threading.Thread | None = None
        self._bundle_seen: str | None = None   # fingerprint of --bootstrap-ca at the last request

    # --- one request --------------------------------------------------------------------

    def _token(self) -> str:
        try:
            token = self.config.token_file.read_text().strip()
        except OSError as exc:
            raise BootstrapError(f"--bootstrap-token {self.config.token_file}: cannot read it "
                                 f"({exc.strerror or exc})") from None
        if not token:
            raise BootstrapError(f"--bootstrap-token {self.config.token_file} is empty")
        return token

    def request(self) -> x509.Certificate:
        """Ask once; on success the three files are in place. Raises grpc.RpcError (the
        controller's answer) or BootstrapError (a local problem or a bad reply)."""
        c = self.config
        key = ec.generate_private_key(ec.SECP256R1())
        csr = (x509.CertificateSigningRequestBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, c.node_name)]))
               .sign(key, hashes.SHA256()))
        request = pb.IssueNodeCertificateRequest(csr_pem=csr.public_bytes(serialization.Encoding.PEM),
                                                 token=self._token())
        try:
            bundle = c.ca_file.read_bytes()
            trusted = x509.load_pem_x509_certificates(bundle)
        except OSError as exc:
            raise BootstrapError(f"--bootstrap-ca {c.ca_file}: cannot read it ({exc.strerror or exc})"
                                 ) from None
        except ValueError as exc:
            raise BootstrapError(f"--bootstrap-ca {c.ca_file}: not PEM CA certificates ({exc})") from None
        channel = grpc.secure_channel(c.controller, grpc.ssl_channel_credentials(bundle),
                                      options=[("grpc.ssl_target_name_override", c.server_name)]
                                      if c.server_name else [])
        try:
            reply = pb_grpc.NodeBootstrapStub(channel).IssueNodeCertificate(request, timeout=self.timeout)
        finally:
            channel.close()
        cert, signer = self._check_reply(reply, key)
        # Key first: a reader that sees the new certificate must also find the matching key.
        certs.write_atomic(c.key, certs.key_pem(key), 0o600)
        certs.write_atomic(c.cert, reply.certificate_pem, 0o644)
        trust = bundle if signer in trusted else bundle.rstrip(b"\n") + b"\n" + reply.ca_pem
        certs.write_atomic(c.ca, trust, 0o644)
        self._bundle_seen = certs.fingerprint(bundle)
        return cert

    def bundle_changed(self) -> str | None:
        """Why to ask for a new certificate now (the CA bundle of --bootstrap-ca is not the one
        of the last request), or None."""
        now = certs.files_fingerprint(self.config.ca_file)
        if now is None or self._bundle_seen is None or now == self._bundle_seen:
            return None
        return f"the CA bundle --bootstrap-ca {self.config.ca_file} changed (a rotated CA)"

    def _check_reply(self, reply: pb.IssueNodeCertificateReply, key: ec.EllipticCurvePrivateKey
                     ) -> tuple[x509.Certificate, x509.Certificate]:
        """The certificate and the CA that signed it, once both are what was asked for."""
        try:
            cert = x509.load_pem_x509_certificate(reply.certificate_pem)
            ca = x509.load_pem_x509_certificate(reply.ca_pem)
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise BootstrapError(f"the controller at {self.config.controller} sent an unusable certificate "
                                 f"({type(exc).__name__}: {exc})") from None
        problem = self.problem(cert, key.public_key())
        if problem:
            raise BootstrapError(f"the controller at {self.config.controller} sent a certificate {problem}")
        return cert, ca

    def problem(self, cert: x509.Certificate,
                public_key: ec.EllipticCurvePublicKey | None = None) -> str | None:
        """Why ``cert`` cannot be this agent's certificate, or None."""
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if [a.value for a in cns] != [self.config.node_name]:
            named = ", ".join(str(a.value) for a in cns) or "no name"
            return f"for {named}, not for node {self.config.node_name}"
        if certs.role_of(cert) != "node":
            return f"with role {certs.role_of(cert)}, not node"
        if public_key is not None and cert.public_key() != public_key:
            return "for another key than the one this agent made"
        return None

    # --- at start, and later ----------------------------------------------------------------

    def existing(self) -> x509.Certificate | None:
        """A certificate already in place for this node, with its key, unexpired, of a CA in the
        bundle; else None. The CA file the agent checks callers with becomes that bundle."""
        c = self.config
        try:
            cert = x509.load_pem_x509_certificate(c.cert.read_bytes())
            key = serialization.load_pem_private_key(c.key.read_bytes(), password=None)
            trust = c.ca.read_bytes()
            x509.load_pem_x509_certificate(trust)
            bundle = c.ca_file.read_bytes()
            trusted = x509.load_pem_x509_certificates(bundle)
        except (OSError, ValueError, TypeError):
            return None
        now = dt.datetime.now(dt.UTC)
        if self.problem(cert, key.public_key()) or remaining(cert, now) < dt.timedelta(minutes=1):
            return None
        if not any(_issued_by(cert, ca) for ca in trusted):
            return None   # signed by a CA the bundle no longer holds (rotated while the agent was away)
        if trust != bundle:
            # The trust written at the last request may hold a CA the bundle has dropped since
            # (rotated while the agent was away): the bundle holds the CA of this certificate.
            try:
                certs.write_atomic(c.ca, bundle, 0o644)
            except OSError:
                return None
        self._bundle_seen = certs.fingerprint(bundle)
        return cert

    def obtain(self, stop: threading.Event) -> x509.Certificate | None:
        """A certificate for this node: the one in place if still valid, else a new one, retried
        with backoff while the controller cannot answer. None if ``stop`` was set meanwhile."""
        cert = self.existing()
        if cert is not None:
            log.info("using the node certificate in %s (valid until %s); renewal due at %s",
                     self.config.cert, cert.not_valid_after_utc.isoformat(), renew_at(cert).isoformat())
            return cert
        delay = FIRST_BACKOFF_S
        while not stop.is_set():
            try:
                return self._request_logged()
            except grpc.RpcError as exc:
                if exc.code() in _DEFINITE:
                    raise BootstrapError(f"the controller at {self.config.controller} refused a certificate "
                                         f"for node {self.config.node_name}: {exc.code().name}: "
                                         f"{exc.details()}") from None
                wait = backoff(delay, _retry_after(exc))
                log.warning("waiting for a node certificate from the controller at %s (%s: %s); "
                            "retrying in %.1f s", self.config.controller, exc.code().name, exc.details(),
                            wait)
            stop.wait(wait)
            delay = min(delay * 2, MAX_BACKOFF_S)
        return None

    def _request_logged(self) -> x509.Certificate:
        cert = self.request()
        log.info("got node certificate for %s from %s (valid until %s); wrote %s, %s, %s",
                 self.config.node_name, self.config.controller, cert.not_valid_after_utc.isoformat(),
                 self.config.cert, self.config.key, self.config.ca)
        return cert

    def renew_forever(self, cert: x509.Certificate, stop: threading.Event) -> None:
        """Replace ``cert`` at 2/3 of its life, and each new one likewise, until ``stop``. A failed
        renewal is retried with backoff (the old certificate keeps serving until it expires)."""
        renew_forever(cert, self._request_logged, stop, what="the node certificate", log=log,
                      min_interval=self.min_renew_interval, errors=(grpc.RpcError, BootstrapError),
                      explain=_explain, retry_after=_retry_after, changed=self.bundle_changed,
                      check_interval=self.check_interval)

    def start_renewals(self, cert: x509.Certificate, stop: threading.Event) -> threading.Thread:
        self._thread = threading.Thread(target=self.renew_forever, args=(cert, stop),
                                        name="cert-renewal", daemon=True)
        self._thread.start()
        return self._thread
