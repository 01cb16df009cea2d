"""Hand-made certificates of the cluster CA that `fastshare certs` refuses to issue (expired ones),
shared by the TLS tests of the bare credentials, the node agent and the controller."""

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fastshare.security import certs as pki


def issue_client_cert(ca_dir: Path, name: str, out_dir: Path, ends_in_days: int) -> None:
    """A client certificate of the cluster CA, valid until ``ends_in_days`` from now."""
    ca_cert, ca_key = pki.load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=10))
            .not_valid_after(now + dt.timedelta(days=ends_in_days))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out_dir / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
