"""The in-cluster controller's own certificate: signed by itself with the cluster CA, renewed.

The controller holds ``ca.key`` (it signs the node agents' certificates, see
:mod:`fastshare.k8s.bootstrap`), so it also signs its own: role controller, CN ``controller``,
SANs = the Service's DNS names ``<service>.<namespace>.svc`` and
``<service>.<namespace>.svc.cluster.local`` (what the agents dial and check), valid for
:data:`DEFAULT_LIFETIME`. It writes the key (0600, a new one each time) and then the
certificate, each atomically, to a writable directory (in the Deployment a memory-backed
emptyDir; the root filesystem and the Secret stay read-only) and replaces them at 2/3 of the
certificate's life (:mod:`fastshare.security.rotation`, the same loop as the agents'). The
NodeBootstrap server's credentials and the agent pool re-read the files when they change.

When the operator replaces the CA in the Secret (the kubelet swaps the mounted files in
place), the loop sees ``ca.crt``/``ca.key`` change within :data:`CHECK_INTERVAL_S` and signs a
new certificate with the new CA at once, instead of serving the old CA's until its renewal
(up to 16 h) to agents that may trust only the new one. ``ca.crt`` may be a bundle (the new CA
and the old): the controller signs with the one of ``ca.key`` and trusts all of them.

An operator-issued certificate in the Secret would expire after its ``--days`` (30 by default)
with nothing renewing it, after which every agent refuses the controller.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fastshare.security import certs
from fastshare.security.rotation import CHECK_INTERVAL_S, renew_at, renew_forever
from fastshare.security.tls import TlsPaths

log = logging.getLogger("fastshare.k8s.controller_cert")

NAME = "controller"
ROLE = "controller"
DEFAULT_LIFETIME = dt.timedelta(hours=24)
# At least this long between two renewals (a lifetime shorter than the clock-drift backdating
# makes every certificate due at once): never a tight loop.
MIN_RENEW_INTERVAL_S = 30.0


def service_names(service: str, namespace: str) -> list[str]:
    """The DNS names of a Service, as a client in the cluster may dial it."""
    return [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


class ControllerCert:
    """Issues and renews ``controller.crt``/``controller.key`` in ``out_dir`` with the CA in
    ``ca_dir`` (``ca.crt``, ``ca.key``); :attr:`tls` is where the controller finds them."""

    def __init__(self, ca_dir: Path, out_dir: Path, sans: list[str],
                 lifetime: dt.timedelta = DEFAULT_LIFETIME, min_renew_interval: float | None = None,
                 check_interval: float = CHECK_INTERVAL_S) -> None:
        self.ca_dir = Path(ca_dir)
        self.out_dir = Path(out_dir)
        self.sans = certs.san_entries(sans)
        self.lifetime = lifetime
        self.min_renew_interval = (min(MIN_RENEW_INTERVAL_S, lifetime.total_seconds() / 3)
                                   if min_renew_interval is None else min_renew_interval)
        self.tls = TlsPaths(self.out_dir / f"{NAME}.crt", self.out_dir / f"{NAME}.key",
                            self.ca_dir / certs.CA_CERT)
        self._names = ", ".join(sans)
        self.check_interval = check_interval
        self._ca_signed_with: str | None = None   # fingerprint of the CA files of the last issue

    def _ca_fingerprint(self) -> str | None:
        return certs.files_fingerprint(self.ca_dir / certs.CA_CERT, self.ca_dir / certs.CA_KEY)

    def ca_changed(self) -> str | None:
        """Why to re-issue now (the CA files are not those of the last issue), or None."""
        now = self._ca_fingerprint()
        if now is None or now == self._ca_signed_with:
            return None   # unreadable (mid-update): asked again at the next check
        return f"{certs.CA_CERT} or {certs.CA_KEY} in --tls-dir {self.ca_dir} changed (a rotated CA)"

    def issue(self) -> x509.Certificate:
        """Sign a new certificate for a new key and put both in place. Raises CertError naming
        the file or option (the CA in --tls-dir, or --cert-dir) and what to do."""
        # Before reading: a CA replaced while it is read is then seen changed at the next check.
        fingerprint = self._ca_fingerprint()
        try:
            ca_cert, ca_key = certs.load_ca(self.ca_dir)
        except certs.CertError as exc:
            raise certs.CertError(f"--tls-dir: {exc}") from None
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            cert = certs.sign_leaf(ca_cert, ca_key, NAME, key.public_key(), self.sans, ROLE, self.lifetime)
        except certs.CertError as exc:   # an expired CA: a new one goes into the controller's Secret
            raise certs.CertError(f"--tls-dir {self.ca_dir}: {exc}, then put it in the controller's "
                                  "Secret") from None
        # Key first: a reader that sees the new certificate must also find the matching key.
        try:
            certs.write_atomic(self.tls.key, certs.key_pem(key), 0o600)
            certs.write_atomic(self.tls.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        except OSError as exc:
            raise certs.CertError(f"--cert-dir {self.out_dir}: cannot write the controller's certificate "
                                  f"there ({exc.strerror or exc}); it must be a writable directory (in "
                                  "the Deployment a memory-backed emptyDir)") from None
        self._ca_signed_with = fingerprint
        log.info("issued the controller's own certificate (role %s, SANs %s), serial %x, valid until %s, "
                 "renewal due at %s; wrote %s and %s", ROLE, self._names, cert.serial_number,
                 cert.not_valid_after_utc.isoformat(), renew_at(cert).isoformat(), self.tls.cert,
                 self.tls.key)
        return cert

    def renew_forever(self, cert: x509.Certificate, stop: threading.Event) -> None:
        renew_forever(cert, self.issue, stop, what="the controller's own certificate", log=log,
                      min_interval=self.min_renew_interval, errors=(certs.CertError, OSError),
                      changed=self.ca_changed, check_interval=self.check_interval)

    def start_renewals(self, cert: x509.Certificate, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.renew_forever, args=(cert, stop),
                                  name="controller-cert-renewal", daemon=True)
        thread.start()
        return thread
