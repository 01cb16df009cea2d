"""roles/controller with deploy_mode=kubernetes against a real kube-apiserver (envtest).

The role renders fastshare's manifests (k8s_manifests) and applies them with
kubernetes.core.k8s, after creating the cluster CA's Secret and ConfigMap; the API server is
the same throw-away one the k8s tests use. There is no
kubelet, so the test does not wait for Pods; the CRD must become Established.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from fs_collection import COLLECTION, run, run_tasks, tool
from kubernetes import client
from kubernetes.client.rest import ApiException

from fastshare.k8s import envtest, manifests
from fastshare.security import certs as pki


@pytest.fixture(scope="module")
def plane():
    try:
        assets = envtest.find_assets(build=False)
    except envtest.AssetsUnavailable as exc:
        pytest.skip(f"no Kubernetes API server binaries ({exc}); tests/k8s builds them")
    with envtest.ControlPlane(assets) as control_plane:
        yield control_plane


def test_kubernetes_mode_applies_fastshares_manifests_idempotently(plane, collections_path: Path,
                                                                   tmp_path: Path):
    values = {"namespace": "gpu-sharing", "controller": {"replicas": 1}}
    task = {"ansible.builtin.include_role": {"name": f"{COLLECTION}.controller"},
            "vars": {"controller_deploy_mode": "kubernetes", "controller_k8s_values": values,
                     "controller_k8s_kubeconfig": str(plane.kubeconfig),
                     "controller_k8s_python": sys.executable, "controller_k8s_wait": False}}
    first = run_tasks(collections_path, [task], tmp_path)
    assert not any(r.get("failed") for r in first), [r.get("msg") for r in first if r.get("failed")]
    assert any(r.get("changed") for r in first)

    api = plane.api_client()
    crd = client.ApiextensionsV1Api(api).read_custom_resource_definition("fastpods.fastshare.io")
    assert any(c.type == "Established" and c.status == "True" for c in crd.status.conditions)
    wanted = {(r["kind"], r["metadata"]["name"]) for r in manifests.render(values)}
    deployment = next(name for kind, name in wanted if kind == "Deployment")
    dep = client.AppsV1Api(api).read_namespaced_deployment(deployment, "gpu-sharing")
    assert dep.spec.replicas == 1
    assert client.AppsV1Api(api).list_namespaced_daemon_set("gpu-sharing").items

    second = run_tasks(collections_path, [task], tmp_path)
    changed = [item.get("item", {}).get("kind") for r in second for item in r.get("results", [r])
               if item.get("changed")]
    assert not changed, f"a second apply changed {changed}"


# ---- the cluster CA: Secret controller.tlsSecret (ca.crt, ca.key), ConfigMap agent.caConfigMap ----

SECRET, CONFIGMAP = "fastshare-controller-tls", "fastshare-ca"
KEY_HEADER = "PRIVATE KEY-----"


def _ca_task(plane, namespace: str, **extra) -> dict:
    return {"ansible.builtin.include_role": {"name": f"{COLLECTION}.controller"},
            "vars": {"controller_deploy_mode": "kubernetes",
                     "controller_k8s_values": {"namespace": namespace},
                     "controller_k8s_kubeconfig": str(plane.kubeconfig),
                     "controller_k8s_python": sys.executable, "controller_k8s_wait": False, **extra}}


def _run_role(plane, collections_path: Path, tmp_path: Path, namespace: str, *, check: bool = False,
              fails: bool = False, **extra) -> tuple[list[dict], str]:
    """The role in its own playbook run; its per-task results and the whole JSON output.

    TMPDIR is tmp_path/tmp, where the role makes the new CA's temporary directory.
    """
    (tmp_path / "tmp").mkdir(parents=True, exist_ok=True)
    playbook = tmp_path / "play.yml"
    play = [{"name": "controller role", "hosts": "localhost", "connection": "local", "gather_facts": False,
             "vars": {"ansible_python_interpreter": sys.executable},
             "tasks": [_ca_task(plane, namespace, **extra)]}]
    playbook.write_text(json.dumps(play))
    check_args = ["--check", "--diff"] if check else []
    proc = run([tool("ansible-playbook"), "-i", "localhost,", str(playbook), *check_args], check=False,
               env={"TMPDIR": str(tmp_path / "tmp"), "ANSIBLE_COLLECTIONS_PATH": str(collections_path),
                    "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json",
                    "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"})
    output = proc.stdout + proc.stderr
    assert (proc.returncode != 0) == fails, output[-6000:]
    tasks = json.loads(proc.stdout)["plays"][0]["tasks"]
    return [t["hosts"]["localhost"] | {"task": t["task"]["name"].split(" : ")[-1]} for t in tasks], output


def _changed(results: list[dict]) -> list[str]:
    return [f"{r['task']}: {item['item'].get('kind', '') if isinstance(item.get('item'), dict) else ''}"
            for r in results for item in r.get("results", [r]) if item.get("changed")]


def _secret(plane, namespace: str) -> dict[str, bytes] | None:
    try:
        secret = client.CoreV1Api(plane.api_client()).read_namespaced_secret(SECRET, namespace)
    except ApiException as exc:
        assert exc.status == 404, exc
        return None
    assert secret.type == "Opaque"
    return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}


def _configmap(plane, namespace: str) -> dict[str, str] | None:
    try:
        return client.CoreV1Api(plane.api_client()).read_namespaced_config_map(CONFIGMAP, namespace).data
    except ApiException as exc:
        assert exc.status == 404, exc
        return None


def _assert_ca(crt: bytes, key: bytes) -> None:
    cert = x509.load_pem_x509_certificate(crt)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    private = serialization.load_pem_private_key(key, password=None)
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    assert (private.public_key().public_bytes(serialization.Encoding.PEM, pub)
            == cert.public_key().public_bytes(serialization.Encoding.PEM, pub))


def test_role_creates_the_cluster_ca_once_and_never_logs_its_key(plane, collections_path: Path,
                                                                  tmp_path: Path):
    namespace = "ca-fresh"
    first, output = _run_role(plane, collections_path, tmp_path / "1", namespace)
    assert _changed(first)
    secret = _secret(plane, namespace)
    assert secret is not None and set(secret) == {"ca.crt", "ca.key"}
    _assert_ca(secret["ca.crt"], secret["ca.key"])
    assert _configmap(plane, namespace) == {"ca.crt": secret["ca.crt"].decode()}
    assert KEY_HEADER not in output and secret["ca.key"].decode() not in output
    assert base64.b64encode(secret["ca.key"]).decode() not in output
    assert not list((tmp_path / "1" / "tmp").glob("fastshare-ca.*")), "the CA's temporary directory is left"

    second, output = _run_role(plane, collections_path, tmp_path / "2", namespace)
    assert not _changed(second), f"a second run changed {_changed(second)}"
    assert _secret(plane, namespace) == secret, "the CA key changed on a second run"
    assert KEY_HEADER not in output


def test_role_keeps_an_operators_ca_and_the_configmap_follows_it(plane, collections_path: Path,
                                                                  tmp_path: Path):
    namespace = "ca-operator"
    pki.init_ca(tmp_path / "ours")
    pki.init_ca(tmp_path / "stale")
    ours = {name: (tmp_path / "ours" / name).read_bytes() for name in ("ca.crt", "ca.key")}
    core = client.CoreV1Api(plane.api_client())
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    core.create_namespaced_secret(namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name=SECRET), type="Opaque",
        data={k: base64.b64encode(v).decode() for k, v in ours.items()}))
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=CONFIGMAP),
        data={"ca.crt": (tmp_path / "stale" / "ca.crt").read_text()}))
    version = core.read_namespaced_secret(SECRET, namespace).metadata.resource_version

    results, output = _run_role(plane, collections_path, tmp_path / "1", namespace)
    assert _secret(plane, namespace) == ours
    assert core.read_namespaced_secret(SECRET, namespace).metadata.resource_version == version
    assert _configmap(plane, namespace) == {"ca.crt": ours["ca.crt"].decode()}
    assert KEY_HEADER not in output
    made = [r for r in results if r["task"] == "Create the CA with fastshare"]
    assert made and all(r.get("skipped") for r in made), made

    again, _ = _run_role(plane, collections_path, tmp_path / "2", namespace)
    assert not _changed(again), f"a second run changed {_changed(again)}"


def test_role_leaves_the_ca_to_the_operator_when_told(plane, collections_path: Path, tmp_path: Path):
    namespace = "ca-unmanaged"
    _run_role(plane, collections_path, tmp_path / "1", namespace, controller_k8s_manage_ca=False)
    assert client.CoreV1Api(plane.api_client()).read_namespace(namespace)   # the manifests were applied
    assert _secret(plane, namespace) is None and _configmap(plane, namespace) is None

    # Managed again, in check mode, in the namespace that exists now: both dry-run, nothing made.
    results, output = _run_role(plane, collections_path, tmp_path / "2", namespace, check=True)
    assert {"Create the CA Secret", "Put the CA certificate into the agents' ConfigMap"} <= set(
        r["task"] for r in results if r.get("changed"))
    assert _secret(plane, namespace) is None and _configmap(plane, namespace) is None
    assert KEY_HEADER not in output


def test_check_mode_on_a_fresh_namespace_creates_nothing(plane, collections_path: Path, tmp_path: Path):
    namespace = "ca-check"
    results, output = _run_role(plane, collections_path, tmp_path, namespace, check=True)
    assert _changed(results)
    listed = next(r["msg"] for r in results if r["task"].startswith("List what check mode"))
    assert f"Secret/{SECRET}" in listed and f"ConfigMap/{CONFIGMAP}" in listed, listed
    core = client.CoreV1Api(plane.api_client())
    with pytest.raises(ApiException) as missing:
        core.read_namespace(namespace)
    assert missing.value.status == 404
    assert _secret(plane, namespace) is None and _configmap(plane, namespace) is None
    assert KEY_HEADER not in output


def _limited_kubeconfig(plane, tmp_path: Path, namespace: str, secret_verbs: list[str]) -> Path:
    """A kubeconfig of a ServiceAccount that may get and patch Namespaces and do only
    ``secret_verbs`` on Secrets in ``namespace`` (an operator's credentials missing a right)."""
    api = plane.api_client()
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    who = f"deployer-{namespace}"
    core.create_namespaced_service_account("default", client.V1ServiceAccount(
        metadata=client.V1ObjectMeta(name=who)))
    subject = [client.RbacV1Subject(kind="ServiceAccount", name=who, namespace="default")]
    rbac.create_cluster_role(client.V1ClusterRole(metadata=client.V1ObjectMeta(name=who), rules=[
        client.V1PolicyRule(api_groups=[""], resources=["namespaces"], verbs=["get", "list", "patch"])]))
    rbac.create_cluster_role_binding(client.V1ClusterRoleBinding(
        metadata=client.V1ObjectMeta(name=who), subjects=subject,
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=who)))
    if secret_verbs:
        rbac.create_namespaced_role(namespace, client.V1Role(metadata=client.V1ObjectMeta(name=who), rules=[
            client.V1PolicyRule(api_groups=[""], resources=["secrets"], verbs=secret_verbs)]))
        rbac.create_namespaced_role_binding(namespace, client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name=who), subjects=subject,
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=who)))
    token = core.create_namespaced_service_account_token(who, "default", client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))).status.token
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(plane.kubeconfig_dict({"token": token}, name=who)))
    return path


@pytest.mark.parametrize(("namespace", "secret_verbs", "says"), [
    ("ca-no-get", [], "cannot look up Secret ca-no-get/fastshare-controller-tls: "),
    ("ca-no-create", ["get"], "cannot create Secret ca-no-create/fastshare-controller-tls: ")])
def test_a_failing_ca_task_says_what_failed_and_still_shows_no_key(plane, collections_path: Path,
                                                                   tmp_path: Path, namespace: str,
                                                                   secret_verbs: list[str], says: str):
    """Not "censored": the task that stops names the Secret, the API server's reason and its
    status; the key (made, in the second case, and read before the Secret was refused) is in no
    output, and its temporary directory is gone."""
    kubeconfig = _limited_kubeconfig(plane, tmp_path, namespace, secret_verbs)
    results, output = _run_role(plane, collections_path, tmp_path / "run", namespace, fails=True,
                                controller_k8s_kubeconfig=str(kubeconfig))
    failed = [r for r in results if r.get("failed")]
    assert len(failed) == 1, failed
    message = failed[0]["msg"]
    assert message.startswith(says), message
    assert "is forbidden: User" in message and "(Forbidden, HTTP 403)" in message, message
    assert "HTTP response headers" not in message and "traceback" not in message
    assert "censored" not in message and "no_log" not in message
    assert KEY_HEADER not in output
    assert base64.b64encode(b"-----BEGIN PRIVATE KEY-----").decode()[:32] not in output
    assert not list((tmp_path / "run" / "tmp").glob("fastshare-ca.*")), "the CA's temporary directory is left"
    assert _secret(plane, namespace) is None


def test_check_diff_shows_what_the_manifests_would_change_and_changes_nothing(plane, collections_path: Path,
                                                                           tmp_path: Path):
    """`--check --diff` after a values change: the apply task's diff shows the field each object
    would get (server-side dry run), and the cluster keeps what it had."""
    namespace = "check-diff"
    _run_role(plane, collections_path, tmp_path / "1", namespace,
              controller_k8s_values={"namespace": namespace, "controller": {"replicas": 1}})
    results, _ = _run_role(plane, collections_path, tmp_path / "2", namespace, check=True,
                           controller_k8s_values={"namespace": namespace, "controller": {"replicas": 2}})
    apply = next(r for r in results if r["task"] == "Apply the manifests and wait for them")
    changed = [item for item in apply["results"] if item.get("changed")]
    assert [item["item"]["kind"] for item in changed] == ["Deployment"], changed
    diff = changed[0]["diff"]
    assert diff["before"]["spec"]["replicas"] == 1 and diff["after"]["spec"]["replicas"] == 2, diff
    name = changed[0]["item"]["metadata"]["name"]
    assert client.AppsV1Api(plane.api_client()).read_namespaced_deployment(name, namespace).spec.replicas == 1
