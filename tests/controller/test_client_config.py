"""The client's TLS files are checked before dialling: a damaged or mismatched file is named,
instead of the controller being reported UNAVAILABLE ('Failed to create security handshaker')."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastshare.cli import main
from fastshare.security import certs

from .conftest import free_port


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    certs.init_ca(tmp_path / "ca")
    certs.issue(tmp_path / "ca", "client", tmp_path / "pki", role="client")
    certs.issue(tmp_path / "ca", "other", tmp_path / "pki", role="client")
    return tmp_path / "pki"


@pytest.mark.parametrize(("damage", "says"), [
    (lambda d: (d / "ca.crt").write_text("garbage"), "ca.crt is not a PEM certificate"),
    (lambda d: (d / "client.crt").write_text("garbage"), "client.crt is not a PEM certificate"),
    (lambda d: (d / "client.key").write_text("garbage"), "client.key is not a PEM private key"),
    (lambda d: shutil.copy(d / "other.key", d / "client.key"), "client.key is not the key of"),
])
@pytest.mark.parametrize("command", [["status", "--json"], ["cordon", "n1"],
                                     ["run", "--mem", "1GiB"]], ids=["status", "cordon", "run"])
def test_damaged_client_tls_files_are_named(pki, damage, says, command):
    damage(pki)
    args = [*command[:1], "--controller", f"127.0.0.1:{free_port()}", "--tls-dir", str(pki), *command[1:]]
    if command[0] == "run":
        args += ["--", "true"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert says in result.output and "UNAVAILABLE" not in result.output, result.output
    assert "Traceback" not in result.output and result.stdout == ""


@pytest.mark.parametrize(("content", "says"), [(b"", "is empty"), (b" \n\n", "is empty"),
                                               (b"\xff\xfe\x00", "is not a text file")])
@pytest.mark.parametrize("command", [["status", "--json"], ["cordon", "n1"],
                                     ["run", "--mem", "1GiB"]], ids=["status", "cordon", "run"])
def test_a_token_file_without_a_token_is_named(pki, tmp_path, content, says, command):
    # an empty one said 'list index out of range'; a binary one crashed (UnicodeDecodeError)
    token = tmp_path / "token"
    token.write_bytes(content)
    token.chmod(0o600)
    args = [*command[:1], "--controller", f"127.0.0.1:{free_port()}", "--tls-dir", str(pki),
            "--tls-name", "none", "--token-file", str(token), *command[1:]]
    if command[0] == "run":
        args += ["--", "true"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"token-file: {token} {says}" in result.output and result.stdout == ""


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
@pytest.mark.parametrize("command", [["status", "--json"], ["cordon", "n1"],
                                     ["run", "--mem", "1GiB"]], ids=["status", "cordon", "run"])
def test_a_token_file_others_can_read_is_refused(pki, tmp_path, mode, command):
    # the controller refuses a token file readable by group or others; the client sent one as it was
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(mode)
    args = [*command[:1], "--controller", f"127.0.0.1:{free_port()}", "--tls-dir", str(pki),
            "--tls-name", "none", "--token-file", str(token), *command[1:]]
    if command[0] == "run":
        args += ["--", "true"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"token-file: {token} has mode {mode:04o}; allowed: 0600 or 0400 (owner only)" in result.output
    assert f"chmod 600 {token}" in result.output and "s3cret" not in result.output
    assert "UNAVAILABLE" not in result.output and result.stdout == ""


def test_a_controller_the_client_cannot_reach_or_trust_says_what_to_check(cluster, tmp_path):
    """gRPC said only 'UNAVAILABLE: failed to connect to all addresses; ...' with a TLS library
    error at the end ('Hostname Verification Check failed', 'CERTIFICATE_VERIFY_FAILED',
    'Socket closed'); each now comes with the setting to check."""
    cluster.start_controller()
    good = cluster.pki.dir

    def status(*args: str) -> str:
        result = CliRunner().invoke(main, ["status", "--tls-dir", str(good), *args])
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit)
        return result.output

    out = status("--controller", f"127.0.0.1:{free_port()}")
    assert "hint:" in out and "is the controller running" in out and "--controller" in out, out
    out = status("--controller", cluster.address, "--server-name", "ctl-9")
    assert "hint:" in out and "'ctl-9'" in out and "--server-name" in out and "certs show" in out, out
    # a ca.crt of another CA: the client cannot verify the controller
    certs.init_ca(tmp_path / "other-ca")
    certs.issue(tmp_path / "other-ca", "client", tmp_path / "foreign", role="client")
    good = tmp_path / "mixed"
    good.mkdir()
    shutil.copy(tmp_path / "foreign" / "ca.crt", good / "ca.crt")
    for name in ("client.crt", "client.key"):
        shutil.copy(cluster.pki.dir / name, good / name)
    out = status("--controller", cluster.address)
    assert "hint:" in out and f"{good / 'ca.crt'}" in out and "cluster CA" in out, out
    # a client certificate of another CA: the controller closes the handshake
    shutil.copy(cluster.pki.dir / "ca.crt", good / "ca.crt")
    for name in ("client.crt", "client.key"):
        shutil.copy(tmp_path / "foreign" / name, good / name)
    out = status("--controller", cluster.address)
    assert "hint:" in out and "client certificate" in out and "fastshare certs issue" in out, out


@pytest.mark.parametrize("command", [["status", "--json"], ["cordon", "n1"],
                                     ["run", "--mem", "1GiB"]], ids=["status", "cordon", "run"])
def test_an_expired_client_certificate_is_named_with_its_end(pki, tmp_path, command):
    """An expired client certificate was found only by the controller, which closes the
    handshake: the client said UNAVAILABLE, with the hint that the cluster CA did not sign it."""
    from tests.security.handmade import issue_client_cert

    issue_client_cert(tmp_path / "ca", "client", pki, ends_in_days=-1, role="client")
    args = [*command[:1], "--controller", f"127.0.0.1:{free_port()}", "--tls-dir", str(pki), *command[1:]]
    if command[0] == "run":
        args += ["--", "true"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert f"tls-name: {pki / 'client.crt'} expired on" in result.output, result.output
    assert "fastshare certs issue --role client --name client" in result.output, result.output
    assert "UNAVAILABLE" not in result.output and "did not sign" not in result.output, result.output


def test_a_client_certificate_not_yet_valid_names_the_clock(pki, tmp_path):
    import datetime as dt

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_cert, ca_key = certs.load_ca(tmp_path / "ca")
    key = ec.generate_private_key(ec.SECP256R1())
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=2)
    cert = certs.sign_leaf(ca_cert, ca_key, "client", key.public_key(), certs.san_entries(["client"]),
                           "client", dt.timedelta(days=5), now=later)
    (pki / "client.key").write_bytes(certs.key_pem(key))
    (pki / "client.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    result = CliRunner().invoke(main, ["status", "--controller", f"127.0.0.1:{free_port()}",
                                       "--tls-dir", str(pki)])
    assert result.exit_code == 1, result.output
    assert f"tls-name: {pki / 'client.crt'} is not valid before" in result.output, result.output
    assert "clock" in result.output and "UNAVAILABLE" not in result.output, result.output


def test_an_expired_ca_certificate_is_named(pki, tmp_path):
    """Every certificate of ca.crt expired: the controller's certificate cannot verify, and the
    hint blamed a CA that did not sign it."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old-ca")])
    now = dt.datetime.now(dt.UTC)
    old = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
           .serial_number(1).not_valid_before(now - dt.timedelta(days=20))
           .not_valid_after(now - dt.timedelta(days=1))
           .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
           .sign(key, hashes.SHA256()))
    (pki / "ca.crt").write_bytes(old.public_bytes(serialization.Encoding.PEM))
    result = CliRunner().invoke(main, ["status", "--controller", f"127.0.0.1:{free_port()}",
                                       "--tls-dir", str(pki)])
    assert result.exit_code == 1, result.output
    assert f"tls-dir: {pki / 'ca.crt'}" in result.output and "expired on" in result.output, result.output
    assert "UNAVAILABLE" not in result.output, result.output


def test_a_controller_with_an_expired_certificate_is_named_as_such(cluster):
    """The TLS library says 'certificate has expired', but the hint blamed ca.crt: 'the
    controller's certificate is not signed by a CA in ca.crt: put the cluster CA's ca.crt there'."""
    import datetime as dt

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_cert, ca_key = certs.load_ca(cluster.pki.ca)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = certs.sign_leaf(ca_cert, ca_key, "controller", key.public_key(),
                           certs.san_entries(["controller", "127.0.0.1"]), "controller", dt.timedelta(days=1),
                           now=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
    (cluster.pki.dir / "controller.key").write_bytes(certs.key_pem(key))
    (cluster.pki.dir / "controller.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    proc = cluster.start_controller(wait=False)

    def refused() -> str | None:
        assert proc.alive(), proc.output()
        result = CliRunner().invoke(main, ["status", "--tls-dir", str(cluster.pki.dir),
                                           "--controller", cluster.address])
        assert result.exit_code == 1, result.output
        return None if "Connection refused" in result.output else result.output

    from .conftest import wait_for

    out = wait_for(refused, 60, "the controller listening")
    assert "hint: the controller's certificate has expired" in out, out
    assert "fastshare certs issue --role controller --name controller" in out, out
    assert "put the cluster CA's ca.crt there" not in out, out


def test_a_cli_call_that_fails_tls_prints_only_fastshares_message(cluster, tmp_path):
    """A CLI call whose TLS handshake failed printed gRPC's own C-core log line first
    ("I1126 ... ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL ..."),
    then fastshare's error and hint. Now the CLI's stderr holds only fastshare's message; a
    GRPC_VERBOSITY the user set is left as it is."""
    import os
    import subprocess

    from .conftest import fastshare_bin, wait_for

    cluster.start_controller()
    certs.init_ca(tmp_path / "other-ca")
    mixed = tmp_path / "mixed"   # a ca.crt of another CA: the client cannot verify the controller
    mixed.mkdir()
    shutil.copy(tmp_path / "other-ca" / "ca.crt", mixed / "ca.crt")
    for name in ("client.crt", "client.key"):
        shutil.copy(cluster.pki.dir / name, mixed / name)
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}

    def status(env: dict[str, str]) -> str:
        out = subprocess.run([fastshare_bin(), "status", "--controller", cluster.address, "--tls-dir",
                              str(mixed)], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 1, out
        return out.stderr

    lines = status(env).splitlines()
    assert lines[0].startswith("Error: controller at ") and "CERTIFICATE_VERIFY_FAILED" in lines[0], lines
    assert [line.split(":")[0] for line in lines[1:]] == ["hint"], lines
    assert "Handshake failed" in status({**env, "GRPC_VERBOSITY": "INFO"})
    # a client certificate of another CA: the controller refuses it, and (a server) logs gRPC's line
    certs.issue(tmp_path / "other-ca", "client", tmp_path / "foreign", role="client")
    shutil.copy(cluster.pki.dir / "ca.crt", mixed / "ca.crt")
    for name in ("client.crt", "client.key"):
        shutil.copy(tmp_path / "foreign" / name, mixed / name)
    lines = status(env).splitlines()
    assert lines[0].startswith("Error: controller at ") and "Socket closed" in lines[0], lines
    assert [line.split(":")[0] for line in lines[1:]] == ["hint"], lines
    wait_for(lambda: "Handshake failed" in cluster.controller.output(), 10, "the controller's gRPC log line")


def test_a_client_on_the_wrong_port_is_told_which_port_takes_its_credential(cluster, tmp_path):
    """The main port takes client certificates, --token-listen bearer tokens (README, Auth). A
    token client given the main port got 'UNAVAILABLE: ... Socket closed' and no hint; a
    certificate client given the token port was told the controller 'requires a client
    certificate or a bearer token' although it had presented one. Each now names the port to use."""
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    tokens.chmod(0o600)
    token_port = free_port()
    cluster.start_controller(extra=["--client-auth", "any", "--token-file", str(tokens), "--token-listen",
                                    f"127.0.0.1:{token_port}"])
    ca_only = tmp_path / "ca-only"
    ca_only.mkdir()
    shutil.copy(cluster.pki.dir / "ca.crt", ca_only / "ca.crt")

    def status(*args: str) -> str:
        result = CliRunner().invoke(main, ["status", *args])
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit)
        return result.output

    out = status("--controller", cluster.address, "--tls-dir", str(ca_only), "--token-file", str(tokens))
    assert "Socket closed" in out and "hint:" in out and "--token-listen" in out, out
    assert "s3cret" not in out
    out = status("--controller", f"127.0.0.1:{token_port}", "--tls-dir", str(cluster.pki.dir))
    assert "UNAUTHENTICATED" in out and "hint:" in out and "--listen" in out and "--token-file" in out, out
