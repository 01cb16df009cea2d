"""The cluster CA and issued certificates: files, permissions, names, chain, validation errors."""

import datetime as dt
import ipaddress
import json
import os
import stat
import subprocess

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fastshare.security import certs as pki

from .handmade import issue_roleless_cert


def _load(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_init_then_issue_gives_a_chain_the_ca_verifies(tmp_path):
    ca_cert_path = pki.init_ca(tmp_path / "ca")
    assert stat.S_IMODE((tmp_path / "ca" / "ca.key").stat().st_mode) == 0o600
    issued = pki.issue(tmp_path / "ca", "node-1", tmp_path / "out", sans=["127.0.0.1", "node-1.lan"],
                       role="node")
    assert stat.S_IMODE(issued.key_path.stat().st_mode) == 0o600
    ca, leaf = _load(ca_cert_path), _load(issued.cert_path)
    leaf.verify_directly_issued_by(ca)
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node-1", "node-1.lan", "node-1.agent.fastshare.invalid"]
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


def test_client_role_has_only_client_auth_and_is_the_default(tmp_path):
    pki.init_ca(tmp_path / "ca")
    for issued in (pki.issue(tmp_path / "ca", "cli", tmp_path / "out", role="client", days=1),
                   pki.issue(tmp_path / "ca", "dflt", tmp_path / "out", days=1)):
        leaf = _load(issued.cert_path)
        eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        assert pki.role_of(leaf) == "client"


@pytest.mark.parametrize("role", pki.ROLES)
def test_the_role_is_in_the_subject_and_read_back(tmp_path, role):
    pki.init_ca(tmp_path / "ca")
    issued = pki.issue(tmp_path / "ca", "n1", tmp_path / "out", sans=["10.0.0.1"], role=role, days=1)
    leaf = _load(issued.cert_path)
    assert pki.role_of(leaf) == role
    ous = leaf.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    assert [a.value for a in ous] == [f"fastshare:{role}"]
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "n1"
    assert pki.describe(issued.cert_path)["role"] == role


def test_a_certificate_from_before_roles_has_none(tmp_path):
    pki.init_ca(tmp_path / "ca")
    issue_roleless_cert(tmp_path / "ca", "n1", tmp_path / "out")
    assert pki.role_of(_load(tmp_path / "out" / "n1.crt")) is None
    assert pki.describe(tmp_path / "out" / "n1.crt")["role"] is None


def test_init_refuses_to_replace_a_ca(tmp_path):
    pki.init_ca(tmp_path / "ca")
    before = (tmp_path / "ca" / "ca.key").read_bytes()
    with pytest.raises(pki.CertError, match="already exists"):
        pki.init_ca(tmp_path / "ca")
    assert (tmp_path / "ca" / "ca.key").read_bytes() == before
    pki.init_ca(tmp_path / "ca", force=True)
    assert (tmp_path / "ca" / "ca.key").read_bytes() != before


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "bad name"}, "--name 'bad name' is invalid"),
    ({"days": 0}, "--days must be between 1 and 36500 days, got 0"),
])
def test_init_rejects_bad_input_naming_the_option_and_writes_nothing(tmp_path, kwargs, message):
    # `fastshare certs init --days 0` said "days must be ...", unlike `certs issue`
    with pytest.raises(pki.CertError, match=message):
        pki.init_ca(tmp_path / "ca", **kwargs)
    assert not (tmp_path / "ca").exists()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "bad name"}, "--name"),
    ({"name": "x", "days": 0}, "--days must be between 1 and"),
    ({"name": "x", "days": 5000}, "--days must be between 1 and"),
    ({"name": "x", "sans": ["not a name!"]}, "--san"),
    ({"name": "x", "role": "admin"}, "--role must be one of node, controller, client"),
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
    out = subprocess.run(["fastshare", "certs", "issue", "--ca", str(ca), "--name", "agent-a", "--role",
                          "node", "--san", "::1", "--out", str(tmp_path / "o"), "--days", "2", "--json"],
                         check=True, capture_output=True, text=True)
    info = json.loads(out.stdout)
    assert info["common_name"] == "agent-a" and info["role"] == "node"
    assert set(info["sans"]) == {"agent-a", "agent-a.agent.fastshare.invalid", "::1"}
    shown = subprocess.run(["fastshare", "certs", "show", "--json", str(tmp_path / "o" / "agent-a.crt")],
                           check=True, capture_output=True, text=True)
    assert json.loads(shown.stdout)["serial"] == info["serial"]
    assert json.loads(shown.stdout)["role"] == "node"
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


def test_no_signer_signs_with_an_expired_ca(tmp_path, monkeypatch):
    """The check lives in sign_leaf, the one signer: the node bootstrap (a key from a CSR) and
    the controller's own certificate go through it too, and used to get a certificate that had
    already expired (its end capped at the CA's)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    pki.init_ca(tmp_path / "ca", days=1)
    ca_cert, ca_key = pki.load_ca(tmp_path / "ca")
    key = ec.generate_private_key(ec.SECP256R1())
    later = pki._now() + dt.timedelta(days=2)
    with pytest.raises(pki.CertError, match="the CA certificate expired on"):
        pki.sign_leaf(ca_cert, ca_key, "gpu-1", key.public_key(), pki.san_entries(["gpu-1"]), "node",
                      dt.timedelta(hours=24), now=later)
    fresh = pki.sign_leaf(ca_cert, ca_key, "gpu-1", key.public_key(), pki.san_entries(["gpu-1"]), "node",
                          dt.timedelta(hours=24))
    assert fresh.not_valid_after_utc > pki._now()


@pytest.mark.parametrize("out", ["ca", "out"])
def test_issue_refuses_the_name_of_the_ca_files(tmp_path, out):
    """NAME.crt/NAME.key would be ca.crt/ca.key: into the CA directory that replaced the CA's
    key (lost for good), elsewhere the leaf certificate was overwritten by the CA copy."""
    pki.init_ca(tmp_path / "ca")
    ca_key = (tmp_path / "ca" / "ca.key").read_bytes()
    with pytest.raises(pki.CertError, match="--name"):
        pki.issue(tmp_path / "ca", "ca", tmp_path / out)
    assert (tmp_path / "ca" / "ca.key").read_bytes() == ca_key


def test_cli_issue_role_defaults_to_client_and_show_displays_roles(tmp_path):
    """Without --role a certificate gets the least authority; `certs show` names the role, and
    says so when a certificate (from before roles) has none."""
    ca, out = tmp_path / "ca", tmp_path / "o"
    pki.init_ca(ca)
    wide = {**os.environ, "COLUMNS": "400"}  # one table row per line
    issued = subprocess.run(["fastshare", "certs", "issue", "--ca", str(ca), "--name", "alice", "--out",
                             str(out)], check=True, capture_output=True, text=True, env=wide)
    assert "client" in issued.stdout.splitlines()[-1].split()
    assert pki.describe(out / "alice.crt")["role"] == "client"
    subprocess.run(["fastshare", "certs", "issue", "--ca", str(ca), "--name", "ctl", "--role", "controller",
                    "--out", str(out)], check=True, capture_output=True)
    shown = subprocess.run(["fastshare", "certs", "show", str(out / "ctl.crt")], check=True,
                           capture_output=True, text=True, env=wide)
    assert shown.stdout.splitlines()[-1].split()[:2] == ["ctl", "controller"]
    issue_roleless_cert(ca, "old-node", out)
    shown = subprocess.run(["fastshare", "certs", "show", str(out / "old-node.crt")], check=True,
                           capture_output=True, text=True, env=wide)
    assert shown.stdout.splitlines()[-1].startswith("old-node     none (re-issue it with --role)")
    bad = subprocess.run(["fastshare", "certs", "issue", "--ca", str(ca), "--name", "x", "--role", "admin",
                          "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and "--role" in bad.stderr
    gone = subprocess.run(["fastshare", "certs", "issue", "--ca", str(ca), "--name", "x", "--usage", "both",
                           "--out", str(out)], capture_output=True, text=True)
    assert gone.returncode == 2 and "--usage" in gone.stderr, "the role replaced --usage"


def test_a_ca_bundle_signs_with_the_certificate_of_the_key_in_any_order(tmp_path):
    """A CA rotation puts the new CA next to the old one in ca.crt: the one of ca.key signs."""
    pki.init_ca(tmp_path / "old")
    pki.init_ca(tmp_path / "new")
    old, new = ((tmp_path / d / "ca.crt").read_bytes() for d in ("old", "new"))
    for bundle in (new + old, old + new):
        (tmp_path / "new" / "ca.crt").write_bytes(bundle)
        cert, key = pki.load_ca(tmp_path / "new")
        assert cert == x509.load_pem_x509_certificate(new) and cert.public_key() == key.public_key()
        issued = pki.issue(tmp_path / "new", "n1", tmp_path / "out", role="node")
        x509.load_pem_x509_certificate(issued.cert_path.read_bytes()).verify_directly_issued_by(cert)
    (tmp_path / "new" / "ca.crt").write_bytes(old)
    with pytest.raises(pki.CertError, match=r"ca\.key is the key of none of the 1 certificate"):
        pki.load_ca(tmp_path / "new")


def test_issue_hands_out_the_whole_bundle_and_show_tells_whether_the_signer_signed(tmp_path):
    """Mid-rotation the CA directory's ca.crt holds the old and the new CA: an issued
    certificate's peers get both, and `certs show --ca` tells a certificate of the old signer
    (to be issued again) from one of the current."""
    pki.init_ca(tmp_path / "ca")
    pki.init_ca(tmp_path / "new")
    old_issued = pki.issue(tmp_path / "ca", "n1", tmp_path / "before", role="node")
    old, new = ((tmp_path / d / "ca.crt").read_bytes() for d in ("ca", "new"))
    (tmp_path / "ca" / "ca.crt").write_bytes(old + new)
    issued = pki.issue(tmp_path / "ca", "n2", tmp_path / "out", role="node")
    handed = x509.load_pem_x509_certificates(issued.ca_path.read_bytes())
    assert handed == [_load(tmp_path / "ca" / "ca.crt"), x509.load_pem_x509_certificate(new)]
    assert pki.signed_by(old_issued.cert_path, tmp_path / "ca")   # the old key still signs

    # the switch: the new CA's key signs; the bundle still trusts both
    (tmp_path / "ca" / "ca.key").write_bytes((tmp_path / "new" / "ca.key").read_bytes())
    assert not pki.signed_by(old_issued.cert_path, tmp_path / "ca")

    def show(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["fastshare", "certs", "show", *extra, str(old_issued.cert_path)],
                              capture_output=True, text=True, env={**os.environ, "COLUMNS": "250"})

    shown = show("--json", "--ca", str(tmp_path / "ca"))
    assert shown.returncode == 0 and json.loads(shown.stdout)["signed_by_ca"] is False
    assert "no: issue again" in show("--ca", str(tmp_path / "ca")).stdout
    assert "signed_by_ca" not in json.loads(show("--json").stdout)
    renewed = pki.issue(tmp_path / "ca", "n1", tmp_path / "before", role="node")
    assert json.loads(show("--json", "--ca", str(tmp_path / "ca")).stdout)["signed_by_ca"] is True
    assert renewed.cert_path == old_issued.cert_path
    (tmp_path / "empty").mkdir()
    missing = show("--ca", str(tmp_path / "empty"))
    assert missing.returncode != 0 and "ca.crt not found" in missing.stderr


@pytest.mark.parametrize(("kwargs", "field"), [({"name": "agent\n"}, "--name"),
                                               ({"name": "agent", "sans": ("host.example\n",)}, "--san")])
def test_a_trailing_newline_is_no_part_of_a_name(tmp_path, kwargs, field):
    """'$' also matches before a final newline: 'agent\\n' would have become 'agent\\n.crt'."""
    pki.init_ca(tmp_path / "ca")
    with pytest.raises(pki.CertError, match=field):
        pki.issue(tmp_path / "ca", out_dir=tmp_path / "out", **{"name": "agent", **kwargs})
    assert not (tmp_path / "out").exists()


def test_a_directory_in_place_of_a_file_is_refused_before_anything_is_written(tmp_path):
    # `certs init --force` wrote the new ca.key, then crashed (IsADirectoryError traceback) on a
    # directory named ca.crt: the old CA key was gone and the directory held a key without its
    # certificate; `certs issue` likewise left a NAME.key without NAME.crt, and a directory
    # named ca.key crashed it on reading
    from click.testing import CliRunner

    from fastshare.cli import main

    ca = tmp_path / "ca"
    pki.init_ca(ca)
    key_before = (ca / pki.CA_KEY).read_bytes()
    (ca / pki.CA_CERT).unlink()
    (ca / pki.CA_CERT).mkdir()
    result = CliRunner().invoke(main, ["certs", "init", str(ca), "--force"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"{ca / pki.CA_CERT} is a directory" in result.output
    assert (ca / pki.CA_KEY).read_bytes() == key_before

    good = tmp_path / "good"
    pki.init_ca(good)
    out = tmp_path / "out"
    (out / "n1.crt").mkdir(parents=True)
    result = CliRunner().invoke(main, ["certs", "issue", "--ca", str(good), "--name", "n1",
                                       "--out", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"{out / 'n1.crt'} is a directory" in result.output
    assert not (out / "n1.key").exists()

    (good / pki.CA_KEY).unlink()
    (good / pki.CA_KEY).mkdir()
    result = CliRunner().invoke(main, ["certs", "issue", "--ca", str(good), "--name", "n2",
                                       "--out", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"--ca {good}: cannot read {good / pki.CA_KEY}" in result.output


@pytest.mark.parametrize("role", ["node", "client"])
@pytest.mark.parametrize(("kwargs", "field"), [
    ({"name": "gpu-1", "sans": ["10.0.0.5", "controller"]}, "--san 'controller'"),
    ({"name": "gpu-1", "sans": ["Controller"]}, "--san 'Controller'"),
    ({"name": "controller"}, "--name 'controller'"),
])
def test_only_the_controller_certificate_may_list_the_name_agents_check_the_controller_by(
        tmp_path, role, kwargs, field):
    """Node agents dial the controller by the name "controller"; a node or client certificate
    listing it could pose as the controller to them (the Kubernetes bootstrap already refuses the
    controller's names): refused, naming the field and why, and nothing written."""
    pki.init_ca(tmp_path / "ca")
    with pytest.raises(pki.CertError) as caught:
        pki.issue(tmp_path / "ca", out_dir=tmp_path / "out", role=role, **kwargs)
    message = str(caught.value)
    assert message.startswith(field), message
    assert f"a {role} certificate" in message and "pose as the controller" in message, message
    assert "--role controller --name controller" in message, message
    assert not (tmp_path / "out").exists()


def test_the_controller_certificate_lists_its_name(tmp_path):
    pki.init_ca(tmp_path / "ca")
    issued = pki.issue(tmp_path / "ca", "controller", tmp_path / "out", sans=["ctl.example"],
                       role="controller")
    assert pki.describe(issued.cert_path)["sans"] == ["controller", "ctl.example"]


def test_cli_refuses_a_node_certificate_listing_controller(tmp_path):
    ca = tmp_path / "ca"
    subprocess.run(["fastshare", "certs", "init", str(ca)], check=True, capture_output=True)
    done = subprocess.run(["fastshare", "certs", "issue", "--ca", str(ca), "--name", "gpu-1", "--role",
                           "node", "--san", "controller", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "--san 'controller'" in done.stderr, done.stderr
    assert not (tmp_path / "o").exists()


def test_a_node_certificate_lists_the_agent_name_the_controller_dials_it_by(tmp_path):
    """The controller checks a node agent by a name only that node's certificate lists (gRPC checks
    names, not roles): every node certificate gets it, from the CLI too; other roles do not."""
    pki.init_ca(tmp_path / "ca")
    issued = pki.issue(tmp_path / "ca", "gpu-1", tmp_path / "out", sans=["10.0.0.5"], role="node")
    assert pki.describe(issued.cert_path)["sans"] == ["gpu-1", "gpu-1.agent.fastshare.invalid", "10.0.0.5"]
    assert pki.agent_name("gpu-1") == "gpu-1.agent.fastshare.invalid"
    client = pki.issue(tmp_path / "ca", "gpu-2", tmp_path / "out", role="client")
    assert pki.describe(client.cert_path)["sans"] == ["gpu-2"]
    done = subprocess.run(["fastshare", "certs", "issue", "--ca", str(tmp_path / "ca"), "--name", "gpu-3",
                           "--role", "node", "--out", str(tmp_path / "o"), "--json"],
                          check=True, capture_output=True, text=True)
    assert json.loads(done.stdout)["sans"] == ["gpu-3", "gpu-3.agent.fastshare.invalid"]


@pytest.mark.parametrize(("role", "kwargs", "field"), [
    ("client", {"name": "ops", "sans": ["node-3.agent.fastshare.invalid"]},
     "--san 'node-3.agent.fastshare.invalid'"),
    ("controller", {"name": "controller", "sans": ["*.agent.fastshare.invalid"]},
     "--san '*.agent.fastshare.invalid'"),
    ("node", {"name": "gpu-1", "sans": ["GPU-2.Agent.Fastshare.Invalid"]},
     "--san 'GPU-2.Agent.Fastshare.Invalid'"),
    ("node", {"name": "gpu-1", "sans": ["*.agent.fastshare.invalid"]}, "--san '*.agent.fastshare.invalid'"),
    ("client", {"name": "gpu-1.agent.fastshare.invalid"}, "--name 'gpu-1.agent.fastshare.invalid'"),
    ("node", {"name": "x.agent.fastshare.invalid"}, "--name 'x.agent.fastshare.invalid'"),
])
def test_only_a_node_certificate_lists_its_own_agent_name(tmp_path, role, kwargs, field):
    """A certificate listing node N's agent name (another node's, an operator's, the controller's;
    any case, or a wildcard that covers it) could pose as N's agent to the controller: refused,
    naming the field and why, and nothing written; the Kubernetes signer refuses it too."""
    pki.init_ca(tmp_path / "ca")
    with pytest.raises(pki.CertError) as caught:
        pki.issue(tmp_path / "ca", out_dir=tmp_path / "out", role=role, **kwargs)
    message = str(caught.value)
    assert message.startswith(field), message
    assert "pose as a node's agent" in message and "fastshare certs issue --role node" in message, message
    assert not (tmp_path / "out").exists()
    ca_cert, ca_key = pki.load_ca(tmp_path / "ca")
    key = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(pki.CertError, match="pose as a node's agent"):
        pki.sign_leaf(ca_cert, ca_key, kwargs["name"], key.public_key(),
                      pki.san_entries([kwargs["name"], *kwargs.get("sans", [])]), role, dt.timedelta(days=1))
