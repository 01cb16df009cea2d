"""Hand-made certificates of the cluster CA that `fastshare certs` refuses to issue (expired ones,
ones without a role as issued before roles existed), shared by the TLS tests of the bare
credentials, the node agent and the controller."""

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fastshare.security import certs as pki


def _write(out_dir: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out_dir / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def issue_client_cert(ca_dir: Path, name: str, out_dir: Path, ends_in_days: int,
                      role: str | None = None) -> None:
    """A client certificate of the cluster CA, valid until ``ends_in_days`` from now, with
    ``role`` (none by default)."""
    ca_cert, ca_key = pki.load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = (pki.leaf_subject(name, role) if role
               else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
    cert = (x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=10))
            .not_valid_after(now + dt.timedelta(days=ends_in_days))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(out_dir, name, cert, key)


def issue_roleless_cert(ca_dir: Path, name: str, out_dir: Path, sans: tuple[str, ...] = (),
                        days: int = 30) -> None:
    """What `fastshare certs issue` wrote before certificates had roles (its default usage
    "both"): O=fastshare, CN=name, DNS/IP SANs name + ``sans``, server and client auth."""
    ca_cert, ca_key = pki.load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    entries = []
    for value in (name, *sans):
        entry = pki._san_entry(value)
        if entry not in entries:
            entries.append(entry)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fastshare"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(entries), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(out_dir, name, cert, key)
    (out_dir / pki.CA_CERT).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))


def served_certificate(target: str, ca: Path, server_name: str,
                       client: tuple[Path, Path] | None = None) -> x509.Certificate:
    """The certificate a TLS server at ``target`` (HOST:PORT) presents to a new connection,
    verified against ``ca`` (chain and expiry) for ``server_name``; ``client`` = (cert, key) if
    the server asks for one."""
    import socket
    import ssl

    host, _, port = target.rpartition(":")
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])   # gRPC's
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    with socket.create_connection((host, int(port)), timeout=10) as sock, \
            context.wrap_socket(sock, server_hostname=server_name) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


def issue_unchecked(ca_dir: Path, name: str, out_dir: Path, sans: tuple[str, ...] = (), role: str = "node",
                    days: int = 1) -> None:
    """A certificate with ``role`` that `fastshare certs issue` now refuses (a node or client
    certificate listing "controller"), as it issued them before: what a peer must still see
    through."""
    ca_cert, ca_key = pki.load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = pki.sign_leaf(ca_cert, ca_key, name, key.public_key(), pki.san_entries((name, *sans)), role,
                         dt.timedelta(days=days))
    _write(out_dir, name, cert, key)
    (out_dir / pki.CA_CERT).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
