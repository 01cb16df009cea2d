"""A real Kubernetes API server (kube-apiserver + etcd) for the tests in this directory.

The binaries are found or built (scripts/envtest-assets.sh, several minutes the first time on
2 cores, cached afterwards) while pytest collects, so the build does not count against any
test's timeout. If they cannot be had, every test here is skipped with the reason.
"""

from __future__ import annotations

import time
import uuid

import pytest
from kubernetes import client

from fastshare.k8s import envtest
from fastshare.security import certs
from fastshare.security.tls import TlsPaths

_ASSETS = pytest.StashKey[object]()


def _wants_control_plane(item: pytest.Item) -> bool:
    return "control_plane" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    if config.stash.get(_ASSETS, None) is not None or not any(_wants_control_plane(i) for i in items):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    started = time.monotonic()
    try:
        assets = envtest.find_assets(build=False)
    except envtest.AssetsUnavailable:
        if reporter:
            reporter.write_line("tests/k8s: building kube-apiserver and etcd (cached afterwards) ...")
        try:
            assets = envtest.find_assets(build=True)
        except envtest.AssetsUnavailable as exc:
            assets = exc
        if reporter:
            reporter.write_line(f"tests/k8s: assets ready after {time.monotonic() - started:.0f} s")
    config.stash[_ASSETS] = assets


@pytest.fixture(scope="session")
def control_plane(request):
    assets = request.config.stash.get(_ASSETS, None)
    if assets is None:  # fixture requested in a way collection did not see
        try:
            assets = envtest.find_assets()
        except envtest.AssetsUnavailable as exc:
            assets = exc
    if isinstance(assets, Exception):
        pytest.skip(f"no Kubernetes API server: {assets}")
    with envtest.ControlPlane(assets) as plane:
        yield plane


@pytest.fixture(scope="session")
def api_client(control_plane):
    api = control_plane.api_client()
    yield api
    api.close()


@pytest.fixture(scope="session")
def fastpod_crd(api_client):
    """The rendered CRDs (FastPod, FastShareAllocation), installed and served; returns FastPod's."""
    return envtest.install_crds(api_client)[0]


def wait_for(predicate, what: str, timeout: float = 60.0):
    """Poll ``predicate`` until it returns something truthy (API errors count as not yet)."""
    deadline = time.monotonic() + timeout
    last_error = None
    delay = 0.05
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except client.ApiException as exc:
            last_error = exc
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
    suffix = f" (last error: {last_error})" if last_error else ""
    raise AssertionError(f"timed out waiting for {what}{suffix}")


def new_namespace(api_client, prefix: str = "t") -> str:
    """A fresh namespace with its `default` ServiceAccount (no controller-manager creates it here)."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    core = client.CoreV1Api(api_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    account = client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="default"))
    core.create_namespaced_service_account(name, account)
    return name


@pytest.fixture
def namespace(api_client):
    return new_namespace(api_client)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A cluster CA and the controller's certificate (controller role: agents take orders only
    from it); (root, the controller's TlsPaths)."""
    root = tmp_path_factory.mktemp("k8s-pki")
    certs.init_ca(root / "ca")
    certs.issue(root / "ca", "controller", root / "controller", role="controller", days=1)
    return root, TlsPaths.in_dir(root / "controller", "controller")
