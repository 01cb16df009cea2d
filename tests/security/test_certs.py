"""The cluster CA and issued certificates: files, permissions, names, chain, validation errors."""

import datetime as dt
import ipaddress
import json
import stat
import subprocess

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from fastshare.security import certs as pki


def _load(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_init_then_issue_gives_a_chain_the_ca_verifies(tmp_path):
    ca_cert_path = pki.init_ca(tmp_path / "ca")
    assert stat.S_IMODE((tmp_path / "ca" / "ca.key").stat().st_mode) == 0o600
    issued = pki.issue(tmp_path / "ca", "node-1", tmp_path / "out", sans=["127.0.0.1", "node-1.lan"])
    assert stat.S_IMODE(issued.key_path.stat().st_mode) == 0o600
    ca, leaf = _load(ca_cert_path), _load(issued.cert_path)
    leaf.verify_directly_issued_by(ca)
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node-1", "node-1.lan"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert (tmp_path / "out" / "ca.crt").read_bytes() == ca_cert_path.read_bytes()


def test_leaf_is_short_lived_by_default(tmp_path):
    pki.init_ca(tmp_path / "ca")
    issued = pki.issue(tmp_path / "ca", "c", tmp_path / "out")
    life = _load(issued.cert_path).not_valid_after_utc - dt.datetime.now(dt.UTC)
    assert dt.timedelta(days=pki.DEFAULT_LEAF_DAYS - 1) < life <= dt.timedelta(days=pki.DEFAULT_LEAF_DAYS)


def test_client_usage_has_only_client_auth(tmp_path):
    pki.init_ca(tmp_path / "ca")
    issued = pki.issue(tmp_path / "ca", "cli", tmp_path / "out", usage="client", days=1)
    eku = _load(issued.cert_path).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_init_refuses_to_replace_a_ca(tmp_path):
    pki.init_ca(tmp_path / "ca")
    before = (tmp_path / "ca" / "ca.key").read_bytes()
    with pytest.raises(pki.CertError, match="already exists"):
        pki.init_ca(tmp_path / "ca")
    assert (tmp_path / "ca" / "ca.key").read_bytes() == before
    pki.init_ca(tmp_path / "ca", force=True)
    assert (tmp_path / "ca" / "ca.key").read_bytes() != before


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "bad name"}, "--name"),
    ({"name": "x", "days": 0}, "--days must be between 1 and"),
    ({"name": "x", "days": 5000}, "--days must be between 1 and"),
    ({"name": "x", "sans": ["not a name!"]}, "--san"),
    ({"name": "x", "usage": "everything"}, "--usage"),
])
def test_issue_rejects_bad_input_naming_the_field_and_writes_nothing(tmp_path, kwargs, message):
    pki.init_ca(tmp_path / "ca")
    with pytest.raises(pki.CertError, match=message):
        pki.issue(tmp_path / "ca", out_dir=tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_issue_without_a_ca_says_how_to_make_one(tmp_path):
    with pytest.raises(pki.CertError, match="fastshare certs init"):
        pki.issue(tmp_path / "nope", "x", tmp_path / "out")


def test_cli_init_issue_show(tmp_path):
    ca = tmp_path / "ca"
    subprocess.run(["fastshare", "certs", "init", str(ca)], check=True, capture_output=True)
    out = subprocess.run(["fastshare", "certs", "issue", "--ca", str(ca), "--name", "agent-a",
                          "--san", "::1", "--out", str(tmp_path / "o"), "--days", "2", "--json"],
                         check=True, capture_output=True, text=True)
    info = json.loads(out.stdout)
    assert info["common_name"] == "agent-a"
    assert set(info["sans"]) == {"agent-a", "::1"}
    shown = subprocess.run(["fastshare", "certs", "show", "--json", str(tmp_path / "o" / "agent-a.crt")],
                           check=True, capture_output=True, text=True)
    assert json.loads(shown.stdout)["serial"] == info["serial"]
    again = subprocess.run(["fastshare", "certs", "init", str(ca)], capture_output=True, text=True)
    assert again.returncode != 0 and "already exists" in again.stderr


@pytest.mark.parametrize("later", [dt.timedelta(days=2), dt.timedelta(days=1, minutes=2)])
def test_issue_with_an_expired_ca_says_so_and_writes_nothing(tmp_path, monkeypatch, later):
    """Long after the CA's end, and within the few minutes leaves are backdated by."""
    pki.init_ca(tmp_path / "ca", days=1)
    now = pki._now()
    monkeypatch.setattr(pki, "_now", lambda: now + later)
    with pytest.raises(pki.CertError, match="expired"):
        pki.issue(tmp_path / "ca", "x", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out", ["ca", "out"])
def test_issue_refuses_the_name_of_the_ca_files(tmp_path, out):
    """NAME.crt/NAME.key would be ca.crt/ca.key: into the CA directory that replaced the CA's
    key (lost for good), elsewhere the leaf certificate was overwritten by the CA copy."""
    pki.init_ca(tmp_path / "ca")
    ca_key = (tmp_path / "ca" / "ca.key").read_bytes()
    with pytest.raises(pki.CertError, match="--name"):
        pki.issue(tmp_path / "ca", "ca", tmp_path / out)
    assert (tmp_path / "ca" / "ca.key").read_bytes() == ca_key
