"""A real, throw-away Kubernetes API server (kube-apiserver + etcd) on loopback for tests and benches.

No kubelet, scheduler or controller-manager: tests create Node objects themselves and check
what our controller writes. Binaries come from ``$KUBEBUILDER_ASSETS`` (envtest convention),
the build cache, or are built by ``scripts/envtest-assets.sh`` from the Go module proxy.

Security is set up the way a real cluster is: serving certificate from our own CA, an admin
user authenticated by a client certificate (``system:masters``), RBAC authorization, and a
service-account signing key so ServiceAccount tokens (TokenRequest) work for RBAC tests.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import datetime
import ipaddress
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CACHE_ROOT_ENV = "FASTSHARE_ENVTEST_CACHE"
ADMIN_USER = "fastshare-test-admin"


class AssetsUnavailable(RuntimeError):
    """kube-apiserver/etcd are neither provided, cached nor buildable here (message says why)."""


class ControlPlaneError(RuntimeError):
    """The API server or etcd did not come up; the message carries the tail of its log."""


def repo_root() -> Path | None:
    """The source checkout this package runs from, if any (the asset build script lives there)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "scripts" / "envtest-assets.sh").is_file() else None


def _has_assets(directory: Path) -> bool:
    return all(os.access(directory / name, os.X_OK) for name in ("kube-apiserver", "etcd"))


def find_assets(build: bool = True) -> Path:
    """Directory with ``kube-apiserver`` and ``etcd``; builds and caches them when allowed.

    The build (several minutes on 2 cores) is delegated to scripts/envtest-assets.sh so CI,
    developers and this module share one cache and one lock.
    """
    env = os.environ.get("KUBEBUILDER_ASSETS")
    if env:
        if _has_assets(Path(env)):
            return Path(env)
        raise AssetsUnavailable(f"KUBEBUILDER_ASSETS={env} has no executable kube-apiserver and etcd")
    root = repo_root()
    if root is None:
        raise AssetsUnavailable("set KUBEBUILDER_ASSETS to a directory with kube-apiserver and etcd")
    script = root / "scripts" / "envtest-assets.sh"
    if not build:
        # Same cache lookup as the script, without building.
        version = _pinned_version(root)
        cache = Path(os.environ.get(CACHE_ROOT_ENV, Path.home() / ".cache/fastshare/envtest")) / version
        if _has_assets(cache):
            return cache
        raise AssetsUnavailable(f"no cached kube-apiserver/etcd in {cache}; run {script}")
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise AssetsUnavailable(f"{script} failed: {done.stderr.strip()[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _pinned_version(root: Path) -> str:
    for line in (root / "tools" / "envtest" / "go.mod").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "k8s.io/kubernetes" and parts[1].startswith("v"):
            return parts[1]
    raise AssetsUnavailable("tools/envtest/go.mod does not pin k8s.io/kubernetes")


# --- certificates ---------------------------------------------------------------------------


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(subject: x509.Name, key, issuer: x509.Name, issuer_key, *, ca: bool, eku=None, sans=None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if eku:
        builder = builder.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _name(common_name: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


@dataclass
class _Pki:
    """Every key and certificate one control plane needs, written as PEM files into ``directory``."""

    directory: Path

    def __post_init__(self) -> None:
        d = self.directory
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = _name("fastshare-envtest-ca")
        self.ca_pem = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
        serving_key = ec.generate_private_key(ec.SECP256R1())
        sans = [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
            # The in-cluster service IP (first of --service-cluster-ip-range).
            x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
            x509.DNSName("kubernetes.default.svc"),
        ]
        serving = _cert(_name("kube-apiserver"), serving_key, ca_name, ca_key, ca=False,
                        eku=[ExtendedKeyUsageOID.SERVER_AUTH], sans=sans)
        admin_key = ec.generate_private_key(ec.SECP256R1())
        self.admin_cert_pem = _cert(_name(ADMIN_USER, "system:masters"), admin_key, ca_name, ca_key,
                                    ca=False, eku=[ExtendedKeyUsageOID.CLIENT_AUTH])
        self.admin_key_pem = _pem_key(admin_key)
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        files = {
            "ca.crt": self.ca_pem,
            "serving.crt": serving,
            "serving.key": _pem_key(serving_key),
            "admin.crt": self.admin_cert_pem,
            "admin.key": self.admin_key_pem,
            "sa.key": _pem_key(sa_key),
            "sa.pub": sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        }
        for filename, data in files.items():
            path = d / filename
            path.write_bytes(data)
            path.chmod(0o600)

    def path(self, filename: str) -> str:
        return str(self.directory / filename)


# --- processes ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Children get SIGTERM if the test process dies (even by SIGKILL): nothing is left running."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ControlPlane:
    """etcd + kube-apiserver on loopback ports in a temporary directory; use as a context manager."""

    assets: Path
    start_timeout: float = 180.0
    workdir: Path = field(init=False)
    url: str = field(init=False, default="")
    kubeconfig: Path = field(init=False)
    _procs: list[tuple[str, subprocess.Popen]] = field(init=False, default_factory=list)

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="fastshare-envtest-"))
        try:
            self._pki = _Pki(self.workdir)
            self._start_etcd()
            self._start_apiserver()
            self.kubeconfig = self.workdir / "kubeconfig"
            self.kubeconfig.write_text(yaml.safe_dump(self.kubeconfig_dict()))
            self.kubeconfig.chmod(0o600)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            cwd=self.workdir, preexec_fn=_die_with_parent,
        )
        log.close()
        self._procs.append((name, proc))
        return proc

    def _wait(self, name: str, proc: subprocess.Popen, ready, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        delay = 0.1
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log = _tail(self.workdir / f"{name}.log")
                raise ControlPlaneError(f"{name} exited with {proc.returncode} before {what}:\n{log}")
            if ready():
                return
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)
        raise ControlPlaneError(
            f"{name} not {what} after {self.start_timeout:.0f} s:\n{_tail(self.workdir / f'{name}.log')}"
        )

    def _start_etcd(self) -> None:
        client, peer = _free_port(), _free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        proc = self._spawn("etcd", [
            str(self.assets / "etcd"),
            "--name=envtest",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=envtest=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync=true",  # throw-away data: durability only costs time here
            "--log-level=warn",
        ])
        self._wait("etcd", proc, lambda: _http_ok(f"{self.etcd_url}/health"), "healthy")

    def _start_apiserver(self) -> None:
        port = _free_port()
        self.url = f"https://127.0.0.1:{port}"
        p = self._pki.path
        proc = self._spawn("kube-apiserver", [
            str(self.assets / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'certs'}",
            f"--tls-cert-file={p('serving.crt')}",
            f"--tls-private-key-file={p('serving.key')}",
            f"--client-ca-file={p('ca.crt')}",
            "--authorization-mode=RBAC",
            f"--service-account-key-file={p('sa.pub')}",
            f"--service-account-signing-key-file={p('sa.key')}",
            f"--service-account-issuer={self.url}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            "--v=1",
        ])
        context = self.ssl_context()
        self._wait("kube-apiserver", proc, lambda: _http_ok(f"{self.url}/readyz", context), "ready")

    def ssl_context(self) -> ssl.SSLContext:
        """TLS context that trusts our CA and presents the admin client certificate."""
        context = ssl.create_default_context(cafile=self._pki.path("ca.crt"))
        context.load_cert_chain(self._pki.path("admin.crt"), self._pki.path("admin.key"))
        return context

    def kubeconfig_dict(self, user: dict | None = None, name: str = ADMIN_USER) -> dict:
        """A kubeconfig for this server; ``user`` defaults to the admin client certificate."""
        if user is None:
            user = {
                "client-certificate-data": base64.b64encode(self._pki.admin_cert_pem).decode(),
                "client-key-data": base64.b64encode(self._pki.admin_key_pem).decode(),
            }
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "envtest", "cluster": {
                "server": self.url,
                "certificate-authority-data": base64.b64encode(self._pki.ca_pem).decode(),
            }}],
            "users": [{"name": name, "user": user}],
            "contexts": [{"name": name, "context": {"cluster": "envtest", "user": name}}],
            "current-context": name,
        }

    def api_client(self, user: dict | None = None):
        """A ``kubernetes.client.ApiClient`` (admin by default, or e.g. ``{"token": ...}``)."""
        from kubernetes import config

        return config.new_client_from_config_dict(self.kubeconfig_dict(user))

    def stop(self) -> None:
        """Stop the API server first, then etcd; remove every file. Safe to call twice."""
        for name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)
            self._procs.remove((name, proc))
        if getattr(self, "workdir", None) and self.workdir.exists():
            shutil.rmtree(self.workdir, ignore_errors=True)


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def install_crds(api, timeout: float = 60.0) -> list[dict]:
    """Create the rendered CustomResourceDefinitions and wait until each is Established and its
    resource can be listed (what tests and benches need before creating objects)."""
    from kubernetes import client

    from fastshare.k8s import manifests

    ext = client.ApiextensionsV1Api(api)
    objects = client.CustomObjectsApi(api)
    crds = manifests.crds()
    for crd in crds:
        ext.create_custom_resource_definition(crd)
    deadline = time.monotonic() + timeout
    for crd in crds:
        name, spec = crd["metadata"]["name"], crd["spec"]
        version = spec["versions"][0]["name"]
        while True:
            try:
                conditions = ext.read_custom_resource_definition(name).status.conditions or []
                if any(c.type == "Established" and c.status == "True" for c in conditions):
                    objects.list_cluster_custom_object(spec["group"], version, spec["names"]["plural"])
                    break
            except client.ApiException:
                pass
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"CRD {name} not served after {timeout:.0f} s")
            time.sleep(0.1)
    return crds
