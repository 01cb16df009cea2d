"""A CA replaced under the running controller (as the kubelet updates a mounted Secret: new
files in a new directory, then one symlink swapped): the controller's own certificate is signed
by the new CA within seconds, not at its next renewal. The agent's side (its CA bundle from the
ConfigMap) is in tests/k8s/test_node_bootstrap.py."""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fastshare.k8s.controller_cert import ControllerCert
from fastshare.security import certs
from fastshare.security.tls import server_credentials
from tests.security.handmade import served_certificate

NAME = "fastshare-controller.fastshare-system.svc"


def mount_secret(mount: Path, files: dict[str, bytes], version: str) -> None:
    """Write ``files`` as the kubelet's atomic writer does: ``..<version>/`` holds them,
    ``..data`` points at it (swapped with one rename), each name points into ``..data``."""
    mount.mkdir(exist_ok=True)
    (mount / f"..{version}").mkdir()
    for name, data in files.items():
        (mount / f"..{version}" / name).write_bytes(data)
    os.symlink(f"..{version}", mount / "..data_tmp")
    os.rename(mount / "..data_tmp", mount / "..data")
    for name in files:
        if not (mount / name).is_symlink():
            os.symlink(f"..data/{name}", mount / name)


def _ca(where: Path) -> tuple[bytes, bytes]:
    certs.init_ca(where)
    return (where / "ca.crt").read_bytes(), (where / "ca.key").read_bytes()


def _issuer(cert: x509.Certificate) -> str:
    return cert.issuer.rfc4514_string()


def test_a_rotated_ca_in_the_secret_is_used_within_seconds(tmp_path):
    old_crt, old_key = _ca(tmp_path / "old")
    new_crt, new_key = _ca(tmp_path / "new")
    mount = tmp_path / "secret"
    mount_secret(mount, {"ca.crt": old_crt, "ca.key": old_key}, "1")
    own = ControllerCert(mount, tmp_path / "out", [NAME], check_interval=0.2, min_renew_interval=0.2)
    first = own.issue()
    stop = threading.Event()
    thread = own.start_renewals(first, stop)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(own.tls, require_client_cert=False))
    server.start()
    target = f"127.0.0.1:{port}"
    try:
        served = served_certificate(target, tmp_path / "old" / "ca.crt", NAME)
        assert served.serial_number == first.serial_number
        time.sleep(0.5)   # the loop has looked at least twice: nothing changed, nothing re-issued
        assert x509.load_pem_x509_certificate(own.tls.cert.read_bytes()).serial_number == first.serial_number

        # step 2 of the rotation (README): the new CA signs, ca.crt is the bundle of the new and the old
        mount_secret(mount, {"ca.crt": new_crt + old_crt, "ca.key": new_key}, "2")
        started = time.monotonic()
        while True:
            try:   # verified against the NEW CA alone: chain and expiry
                served = served_certificate(target, tmp_path / "new" / "ca.crt", NAME)
                break
            except OSError:
                assert time.monotonic() - started < 10, "still serving the old CA's certificate after 10 s"
                time.sleep(0.1)
        assert _issuer(served) == x509.load_pem_x509_certificate(new_crt).subject.rfc4514_string()
        assert own.tls.ca.read_bytes() == new_crt + old_crt   # the controller trusts both meanwhile

        # step 4: the old CA leaves the bundle; ca.key is the same: a new certificate all the same
        before = served.serial_number
        mount_secret(mount, {"ca.crt": new_crt, "ca.key": new_key}, "3")
        while x509.load_pem_x509_certificate(own.tls.cert.read_bytes()).serial_number == before:
            assert time.monotonic() - started < 20
            time.sleep(0.1)
    finally:
        stop.set()
        server.stop(None)
        thread.join(5)


def test_a_half_replaced_ca_is_not_signed_with_and_is_picked_up_once_whole(tmp_path):
    """ca.crt of one CA, ca.key of another (an operator replacing the two files one by one):
    nothing is signed (the key of no certificate in ca.crt), the old certificate keeps serving,
    and the new CA is used once both are there."""
    old_crt, old_key = _ca(tmp_path / "old")
    new_crt, new_key = _ca(tmp_path / "new")
    ca_dir = tmp_path / "ca"
    ca_dir.mkdir()
    (ca_dir / "ca.crt").write_bytes(old_crt)
    (ca_dir / "ca.key").write_bytes(old_key)
    own = ControllerCert(ca_dir, tmp_path / "out", [NAME], check_interval=0.1, min_renew_interval=0.1)
    first = own.issue()
    stop = threading.Event()
    thread = own.start_renewals(first, stop)
    try:
        certs.write_atomic(ca_dir / "ca.key", new_key, 0o600)
        time.sleep(1.5)
        assert x509.load_pem_x509_certificate(own.tls.cert.read_bytes()).serial_number == first.serial_number
        certs.write_atomic(ca_dir / "ca.crt", new_crt, 0o644)
        deadline = time.monotonic() + 70   # the failed tries back off (1, 2, 4 ... s)
        while _issuer(x509.load_pem_x509_certificate(own.tls.cert.read_bytes())) != \
                x509.load_pem_x509_certificate(new_crt).subject.rfc4514_string():
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(5)


def test_an_agent_restarted_after_the_old_ca_left_its_bundle_no_longer_trusts_the_old_ca(tmp_path):
    """An agent whose certificate came from the new CA while its bundle held both (steps 2 and 3
    of the README's rotation), restarted after the old CA left the ConfigMap: it keeps the
    certificate in its emptyDir, and the CA file it checks the controller's client certificate
    with is the bundle now, without the old CA (whose key may be why the CA was rotated)."""
    from fastshare.node.bootstrap import BootstrapConfig, Bootstrapper

    old_crt, _ = _ca(tmp_path / "old")
    new_crt, _ = _ca(tmp_path / "new")
    tls = tmp_path / "tls"
    certs.issue(tmp_path / "new", "gpu-1", tls, role="node", days=1)
    (tls / "ca.crt").write_bytes(old_crt + new_crt)   # what the last request wrote, at step 2
    bundle = tmp_path / "configmap-ca.crt"
    bundle.write_bytes(new_crt)                       # step 3, while the agent was not running
    (tmp_path / "token").write_text("unused")
    agent = Bootstrapper(BootstrapConfig(
        controller="127.0.0.1:1", token_file=tmp_path / "token", ca_file=bundle, node_name="gpu-1",
        cert=tls / "gpu-1.crt", key=tls / "gpu-1.key", ca=tls / "ca.crt"))
    kept = agent.existing()
    assert kept is not None
    assert kept.public_bytes(serialization.Encoding.PEM) == (tls / "gpu-1.crt").read_bytes()
    assert x509.load_pem_x509_certificates((tls / "ca.crt").read_bytes()) == \
        x509.load_pem_x509_certificates(new_crt)
    assert agent.bundle_changed() is None
