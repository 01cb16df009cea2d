"""A small cluster CA: ECDSA P-256 keys, a self-signed CA and short-lived leaf certificates.

Leaf certificates are short-lived on purpose (rotation is the revocation mechanism); the
servers reload them from disk when they change (see ``tls``), so re-issuing is enough.

Directory layout (stable, the Ansible roles and the CLI rely on it):
  CA dir:   ca.crt, ca.key (0600)
  out dir:  NAME.crt, NAME.key (0600), ca.crt (copy of the CA dir's ca.crt, for peers: during
            a CA rotation a bundle of the old and the new CA, so peers trust both)

Roles. Every leaf certificate carries exactly one role, and the servers decide on it, not on
the names a certificate lists:
  node        a node agent: registers and heartbeats as the node in its Common Name, serves
              the agent API;
  controller  the controller: the only caller an agent takes GPU-changing orders from;
  client      a user or operator: the controller's client API, nothing else (the default).

The role is the Subject Organizational Unit ``fastshare:ROLE`` (the idea of Kubernetes'
``O=system:nodes`` / ``CN=system:node:NAME``): a certificate has one subject, so it carries
one role, bound to its one Common Name, which is the name the role acts for. The DNS and IP
SANs stay what they are for, host name verification; a node certificate may list any host
name there without becoming that node. A SAN URI (SPIFFE style) would do too, but it would
land in the same SAN list as the host names (gRPC reports them together, and
``allowed_clients`` matches names there), and mixing "which host" with "who" is the confusion
this replaces: a certificate that merely *named* a node could act as it. Only `issue` (the CA
key's holder) writes the OU, exactly one per certificate. Certificates issued before roles
existed have none: :func:`role_of` gives None, and no server grants them a node's or the
controller's authority (they keep what any client certificate may do).

Names bound to a role. gRPC clients check a server by a name its certificate lists, not by its
role; so the names clients dial by are reserved at issuance. The controller's name,
:data:`CONTROLLER_NAME`, only the controller's certificate may list. A node agent's,
:func:`agent_name` (``NODE.agent.fastshare.invalid``, under a suffix that never resolves), only
that node's certificate lists: every node certificate gets it, and no other certificate may
list a name under that suffix. The controller dials each agent by it, so a certificate that
merely lists the node's host name (another node's, the controller's, one from before roles)
cannot pose as that node's agent.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
DEFAULT_CA_DAYS = 3650
DEFAULT_LEAF_DAYS = 30
MAX_LEAF_DAYS = 825  # browsers' historic cap; longer leaves defeat rotation
ROLES = ("node", "controller", "client")
DEFAULT_ROLE = "client"   # least authority: what a certificate gets unless a role is asked for
_ROLE_PREFIX = "fastshare:"
# Node agents and the controller both serve and call; users only call.
_ROLE_EKUS = {"node": [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
              "controller": [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
              "client": [ExtendedKeyUsageOID.CLIENT_AUTH]}
# The name node agents dial and check the controller by (bare metal: the registrar's server name).
CONTROLLER_NAME = "controller"
# Node agents' names (see agent_name): .invalid never resolves (RFC 2606), so no host has one.
AGENT_NAME_SUFFIX = "agent.fastshare.invalid"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# Clocks on a cluster drift; a certificate valid "from now" fails on a node a few seconds behind.
_BACKDATE = dt.timedelta(minutes=5)


class CertError(ValueError):
    """Bad input or an unusable CA directory; the message names the field."""


@dataclass(frozen=True)
class IssuedCert:
    cert_path: Path
    key_path: Path
    ca_path: Path
    not_after: dt.datetime


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write via temp + fsync + rename so a crash never leaves a half-written key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _refuse_directories(*paths: Path) -> None:
    """Before writing a set of files: a directory in place of one would fail its rename after
    the others were written (a new key beside an old certificate)."""
    for path in paths:
        if path.is_dir():
            raise CertError(f"{path} is a directory, not a file; move it away and run again")


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def validate_name(field: str, name: str) -> None:
    """A certificate name: also a file name in a TLS directory, so no path separators."""
    if not _NAME_RE.fullmatch(name):
        raise CertError(f"{field} {name!r} is invalid: use 1-63 characters of letters, digits, '.', '_', '-'"
                        " starting with a letter or digit")


def _validate_days(field: str, days: int, maximum: int) -> None:
    if not 1 <= days <= maximum:
        raise CertError(f"{field} must be between 1 and {maximum} days, got {days}")


def init_ca(ca_dir: Path, name: str = "fastshare-ca", days: int = DEFAULT_CA_DAYS,
            force: bool = False) -> Path:
    """Create a CA in ``ca_dir``; refuses to overwrite an existing one unless ``force``."""
    validate_name("--name", name)
    _validate_days("--days", days, 36500)
    ca_dir = Path(ca_dir)
    if (ca_dir / CA_KEY).exists() and not force:
        raise CertError(f"{ca_dir / CA_KEY} already exists; refusing to replace the cluster CA"
                        " (every issued certificate would stop working); pass --force to do it anyway")
    _refuse_directories(ca_dir / CA_KEY, ca_dir / CA_CERT)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fastshare"),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    ca_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(ca_dir, 0o700)
    write_atomic(ca_dir / CA_KEY, key_pem(key), 0o600)
    write_atomic(ca_dir / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return ca_dir / CA_CERT


def load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA certificate and key that sign. ``ca.crt`` may be a bundle of several CA
    certificates (during a CA rotation: the new one and the old one, every peer trusting both);
    the one of ``ca.key`` signs, in whatever order they are."""
    cert, key, _ = _load_ca_bundle(ca_dir)
    return cert, key


def _load_ca_bundle(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey,
                                           list[x509.Certificate]]:
    """:func:`load_ca`, plus every certificate of ``ca.crt`` (what peers trust), from one read."""
    ca_dir = Path(ca_dir)
    try:
        bundle = x509.load_pem_x509_certificates((ca_dir / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise CertError(f"--ca {ca_dir}: {exc.filename} not found; create a CA with"
                        " `fastshare certs init DIR` first") from exc
    except OSError as exc:   # a directory in its place, no permission to read it
        raise CertError(f"--ca {ca_dir}: cannot read {exc.filename}: {exc.strerror}") from exc
    except ValueError as exc:
        raise CertError(f"--ca {ca_dir}: cannot parse the CA files: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"--ca {ca_dir}: {CA_KEY} is not an ECDSA key")
    for cert in bundle:
        if cert.public_key() == key.public_key():
            return cert, key, bundle
    raise CertError(f"--ca {ca_dir}: {CA_KEY} is the key of none of the {len(bundle)} certificate(s) in "
                    f"{CA_CERT} (half-way through a replacement of the two? both must come from the same "
                    "`fastshare certs init`)")


def files_fingerprint(*paths: Path) -> str | None:
    """A SHA-256 over the files' contents, or None while one cannot be read (e.g. a mounted
    Secret in the middle of its update): what tells a replaced CA or CA bundle."""
    try:
        return fingerprint(*(Path(path).read_bytes() for path in paths))
    except OSError:
        return None


def fingerprint(*contents: bytes) -> str:
    """A SHA-256 over ``contents``, each length-prefixed."""
    digest = hashes.Hash(hashes.SHA256())
    for data in contents:
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.finalize().hex()


def leaf_subject(name: str, role: str) -> x509.Name:
    """O=fastshare, OU=fastshare:ROLE, CN=NAME (see the module docstring)."""
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fastshare"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, _ROLE_PREFIX + role),
                      x509.NameAttribute(NameOID.COMMON_NAME, name)])


def role_of(cert: x509.Certificate) -> str | None:
    """The certificate's role, or None: issued before roles existed, or not by `fastshare certs`."""
    marks = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
             if isinstance(a.value, str) and a.value.startswith(_ROLE_PREFIX)]
    if len(marks) != 1:
        return None
    role = marks[0][len(_ROLE_PREFIX):]
    return role if role in ROLES else None


def reissue_command(role: str, name: str) -> str:
    """What to run to get a certificate with ``role`` for ``name`` (for error messages)."""
    return f"fastshare certs issue --role {role} --name {name}"


def _san_entry(value: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(value))
    except ValueError:
        pass
    if not re.fullmatch(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$", value):
        raise CertError(f"--san {value!r} is neither an IP address nor a DNS name")
    return x509.DNSName(value)


def san_entries(values: tuple[str, ...] | list[str]) -> list[x509.GeneralName]:
    """DNS names and IP addresses as SAN entries, in order, without repeats."""
    entries: list[x509.GeneralName] = []
    for value in values:
        entry = _san_entry(value)
        if entry not in entries:
            entries.append(entry)
    return entries


def _refuse_controller_name(role: str, name: str, sans: tuple[str, ...] | list[str]) -> None:
    """Only the controller's certificate may list :data:`CONTROLLER_NAME` (the name agents check
    the controller by; DNS names match regardless of case): in any other's, its holder could
    pose as the controller to the agents that dial it (their role check aside)."""
    if role == "controller":
        return
    for field, value in (("--name", name), *(("--san", san) for san in sans)):
        if value.lower() == CONTROLLER_NAME:
            raise CertError(
                f"{field} {value!r} is refused for a {role} certificate: node agents dial and check the "
                f"controller by the name {CONTROLLER_NAME!r}, so a {role} certificate listing it could pose "
                "as the controller to them; only the controller's own certificate lists it "
                f"(`{reissue_command('controller', CONTROLLER_NAME)}`)")


def agent_name(node: str) -> str:
    """The name the controller dials node ``node``'s agent by: only that node's certificate lists it."""
    return f"{node}.{AGENT_NAME_SUFFIX}"


def agent_name_problem(role: str, name: str, value: str) -> str | None:
    """Why a certificate with ``role`` and common name ``name`` may not list ``value`` (a name
    under :data:`AGENT_NAME_SUFFIX` other than its own node's agent name), or None. gRPC matches
    DNS names regardless of case and ``*.`` one label deep, so both are taken into account."""
    lowered = value.lower()
    reserved = lowered.removeprefix("*.")
    if reserved != AGENT_NAME_SUFFIX and not reserved.endswith("." + AGENT_NAME_SUFFIX):
        return None
    if role == "node" and lowered == agent_name(name).lower():
        return None
    whose = f"the node certificate of {name!r}" if role == "node" else f"a {role} certificate"
    return (f"{value!r} is refused for {whose}: the controller dials and checks node agents by the names "
            f"under {AGENT_NAME_SUFFIX!r}, each only in its own node's certificate (which "
            f"`{reissue_command('node', 'NODE')}` adds), so {whose} listing it could pose as a node's agent")


def _refuse_agent_names(role: str, name: str, sans: tuple[str, ...] | list[str]) -> None:
    for field, value in (("--name", name), *(("--san", san) for san in sans)):
        if problem := agent_name_problem(role, name, value):
            raise CertError(f"{field} {problem}")


def sign_leaf(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str,
              public_key: ec.EllipticCurvePublicKey, sans: list[x509.GeneralName], role: str,
              lifetime: dt.timedelta, now: dt.datetime | None = None) -> x509.Certificate:
    """The one place a leaf certificate is made: CN = ``name`` with ``role`` (subject OU, and
    the extended key usage it implies), ``sans``, valid from a few minutes ago (clock drift)
    for ``lifetime`` but never past the CA. Used by :func:`issue` (the CLI, a key made here)
    and by the Kubernetes node bootstrap (a key from a CSR)."""
    if role not in ROLES:
        raise CertError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    _refuse_agent_names(role, name, [str(entry.value) for entry in sans if isinstance(entry, x509.DNSName)])
    now = now or _now()
    if ca_cert.not_valid_after_utc <= now:
        raise CertError(f"the CA certificate expired on {ca_cert.not_valid_after_utc.isoformat()}; every "
                        "certificate it signs is refused; create a new CA with "
                        "`fastshare certs init DIR --force`")
    not_after = min(now + lifetime, ca_cert.not_valid_after_utc)
    return (
        x509.CertificateBuilder()
        .subject_name(leaf_subject(name, role))
        .issuer_name(ca_cert.subject).public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(_ROLE_EKUS[role]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def issue(ca_dir: Path, name: str, out_dir: Path, sans: tuple[str, ...] | list[str] = (),
          role: str = DEFAULT_ROLE, days: int = DEFAULT_LEAF_DAYS) -> IssuedCert:
    """Issue ``NAME.crt``/``NAME.key`` signed by the CA; CN = name, SAN = name + ``sans`` (+ the
    node's :func:`agent_name` for a node certificate), with ``role`` (see the module docstring).
    The role also sets the extended key usage: node and controller certificates serve and call
    (server and client auth), client certificates only call."""
    validate_name("--name", name)
    if f"{name}.crt" == CA_CERT:
        raise CertError(f"--name {name!r} is reserved: {name}.crt and {name}.key are the CA's file names")
    _validate_days("--days", days, MAX_LEAF_DAYS)
    if role not in ROLES:
        raise CertError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    _refuse_controller_name(role, name, sans)
    _refuse_agent_names(role, name, sans)
    entries = san_entries((name, *sans, *([agent_name(name)] if role == "node" else [])))
    ca_cert, ca_key, bundle = _load_ca_bundle(ca_dir)   # one read: the bundle handed out holds the signer
    key = ec.generate_private_key(ec.SECP256R1())
    try:
        cert = sign_leaf(ca_cert, ca_key, name, key.public_key(), entries, role, dt.timedelta(days=days))
    except CertError as exc:
        raise CertError(f"--ca {ca_dir}: {exc}") from None
    not_after = cert.not_valid_after_utc
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key_path, cert_path, ca_path = out_dir / f"{name}.key", out_dir / f"{name}.crt", out_dir / CA_CERT
    _refuse_directories(key_path, cert_path, ca_path)
    # Key first: a reader that sees the new certificate must also find the matching key.
    write_atomic(key_path, key_pem(key), 0o600)
    write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    # what peers trust: every CA certificate of ca.crt (during a rotation the old and the new)
    write_atomic(ca_path, b"".join(c.public_bytes(serialization.Encoding.PEM) for c in bundle), 0o644)
    return IssuedCert(cert_path, key_path, ca_path, not_after)


def signed_by(cert_path: Path, ca_dir: Path) -> bool:
    """Whether the certificate was signed by the CA that signs now (the one of ``ca.key``):
    after a rotation's switch of signer, certificates of the old CA are issued again."""
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    ca_cert, _ = load_ca(ca_dir)
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def describe(cert_path: Path) -> dict[str, object]:
    """Subject, role, SANs and validity of a certificate (for `fastshare certs show`); role is
    None for a certificate without one."""
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        sans = [str(v) for v in san.get_values_for_type(x509.DNSName)] + \
               [str(v) for v in san.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        sans = []
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return {"path": str(cert_path), "common_name": cn[0].value if cn else "", "role": role_of(cert),
            "issuer": cert.issuer.rfc4514_string(), "sans": sans,
            "not_before": cert.not_valid_before_utc.isoformat(),
            "not_after": cert.not_valid_after_utc.isoformat(),
            "serial": format(cert.serial_number, "x")}
