"""The rendered RBAC on a real API server: the controller's service account (with a real token
from the TokenRequest API) can do exactly what the controller needs, and nothing else."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client, utils

from fastshare.controller.agent_client import AgentPool
from fastshare.controller.core import Settings as CoreSettings
from fastshare.k8s import manifests
from fastshare.k8s.controller import KubeController, KubeSettings
from fastshare.k8s.leader import LeaderElector
from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.security import certs
from fastshare.security.tls import TlsPaths

from .agents import Agent, kubelet_step, register_node
from .conftest import wait_for

NAMESPACE = "fastshare-system"


def _token(core: client.CoreV1Api, service_account: str) -> str:
    spec = client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
    request = client.AuthenticationV1TokenRequest(spec=spec)
    return core.create_namespaced_service_account_token(service_account, NAMESPACE, request).status.token


@pytest.fixture(scope="module")
def rbac_installed(api_client, fastpod_crd):
    docs = manifests.render({"namespace": NAMESPACE})
    wanted = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    for doc in docs:
        if doc["kind"] in wanted:
            utils.create_from_dict(api_client, doc)
    return manifests.default_values()


@pytest.fixture(scope="module")
def controller_api(control_plane, api_client, rbac_installed):
    token = _token(client.CoreV1Api(api_client), rbac_installed["controller"]["serviceAccount"])
    api = control_plane.api_client({"token": token})
    yield api
    api.close()


def _allowed(api, verb: str, resource: str, group: str = "", namespace: str = "", name: str = "",
             subresource: str = "") -> bool:
    review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
        resource_attributes=client.V1ResourceAttributes(
            verb=verb, resource=resource, group=group, namespace=namespace or None, name=name or None,
            subresource=subresource or None)))
    return client.AuthorizationV1Api(api).create_self_subject_access_review(review).status.allowed


def test_the_token_authenticates_as_the_controller_service_account(controller_api):
    review = client.AuthenticationV1Api(controller_api).create_self_subject_review(
        client.V1SelfSubjectReview())
    assert review.status.user_info.username == "system:serviceaccount:fastshare-system:fastshare-controller"


ALLOWED = [
    ("list", "fastpods", "fastshare.io", "", "", ""),
    ("watch", "fastpods", "fastshare.io", "", "", ""),
    ("patch", "fastpods", "fastshare.io", "team-a", "job", ""),
    ("patch", "fastpods", "fastshare.io", "team-a", "job", "status"),
    ("update", "fastpods", "fastshare.io", "team-a", "job", "finalizers"),
    ("create", "fastshareallocations", "fastshare.io", "team-a", "", ""),
    ("update", "fastshareallocations", "fastshare.io", "team-a", "job-0", ""),
    ("delete", "fastshareallocations", "fastshare.io", "team-a", "job-0", ""),
    ("list", "fastshareallocations", "fastshare.io", "", "", ""),
    ("create", "pods", "", "team-a", "", ""),
    ("delete", "pods", "", "team-a", "job-0", ""),
    ("watch", "pods", "", "", "", ""),
    ("list", "pods", "", "", "", ""),   # every namespace's bound Pods: what a node has left
    ("list", "nodes", "", "", "", ""),
    ("watch", "nodes", "", "", "", ""),   # the GPU nodes, for the Node syncs (see nodecache)
    ("list", "namespaces", "", "", "", ""),   # a podAffinity term's namespaceSelector
    # the node-certificate service: an agent's token is reviewed, its Pod read afresh
    ("create", "tokenreviews", "authentication.k8s.io", "", "", ""),
    ("get", "pods", "", NAMESPACE, "fastshare-node-agent-x1", ""),
    ("get", "daemonsets", "apps", NAMESPACE, "fastshare-node-agent", ""),   # its uid, against the Pod's owner
    ("create", "leases", "coordination.k8s.io", NAMESPACE, "", ""),
    ("update", "leases", "coordination.k8s.io", NAMESPACE, "fastshare-controller", ""),
]
DENIED = [
    ("get", "secrets", "", "team-a", "", ""),
    ("list", "secrets", "", NAMESPACE, "", ""),
    ("create", "configmaps", "", "team-a", "", ""),
    ("delete", "fastpods", "fastshare.io", "team-a", "job", ""),
    ("create", "fastpods", "fastshare.io", "team-a", "", ""),
    ("update", "pods", "", "team-a", "job-0", ""),
    ("patch", "nodes", "", "", "gpu-1", ""),
    ("delete", "nodes", "", "", "gpu-1", ""),
    ("create", "pods", "", "team-a", "job-0", "exec"),
    ("update", "leases", "coordination.k8s.io", NAMESPACE, "someone-else", ""),
    ("update", "leases", "coordination.k8s.io", "kube-system", "fastshare-controller", ""),
    ("create", "deployments", "apps", "team-a", "", ""),
    ("get", "daemonsets", "apps", NAMESPACE, "another", ""),
    ("get", "daemonsets", "apps", "team-a", "fastshare-node-agent", ""),
    ("list", "daemonsets", "apps", NAMESPACE, "", ""),
    ("update", "daemonsets", "apps", NAMESPACE, "fastshare-node-agent", ""),
    ("escalate", "clusterroles", "rbac.authorization.k8s.io", "", "", ""),
    ("patch", "fastpods", "fastshare.io", "team-a", "job", "scale"),
    ("patch", "fastshareallocations", "fastshare.io", "team-a", "job-0", ""),
    ("watch", "fastshareallocations", "fastshare.io", "", "", ""),
    ("deletecollection", "fastshareallocations", "fastshare.io", "team-a", "", ""),
    # what the controller never does: rewrite a user's FastPod, read Nodes one by one, write
    # Events, mint tokens (it only reviews the agents'), or use Kubernetes' CSR API
    ("update", "fastpods", "fastshare.io", "team-a", "job", ""),
    ("update", "fastpods", "fastshare.io", "team-a", "job", "status"),
    ("get", "nodes", "", "", "gpu-1", ""),
    ("create", "serviceaccounts", "", NAMESPACE, "fastshare-node-agent", "token"),
    ("create", "certificatesigningrequests", "certificates.k8s.io", "", "", ""),
    ("create", "subjectaccessreviews", "authorization.k8s.io", "", "", ""),
    ("watch", "namespaces", "", "", "", ""),
    ("get", "namespaces", "", "", "team-a", ""),
    ("update", "namespaces", "", "", "team-a", ""),
    ("create", "events", "", "team-a", "", ""),
]


@pytest.mark.parametrize("attrs", ALLOWED, ids=lambda a: "-".join(p for p in a if p))
def test_controller_may(controller_api, attrs):
    assert _allowed(controller_api, *attrs)


@pytest.mark.parametrize("attrs", DENIED, ids=lambda a: "-".join(p for p in a if p))
def test_controller_may_not(controller_api, attrs):
    assert not _allowed(controller_api, *attrs)


def test_real_requests_are_allowed_and_refused_accordingly(controller_api, api_client, namespace):
    core = client.CoreV1Api(controller_api)
    assert core.list_node().items == []
    pod = client.V1Pod(metadata=client.V1ObjectMeta(name="p"),
                       spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="busybox")]))
    assert core.create_namespaced_pod(namespace, pod).metadata.name == "p"
    core.delete_namespaced_pod("p", namespace)
    client.CoreV1Api(api_client).create_namespaced_secret(
        namespace, client.V1Secret(metadata=client.V1ObjectMeta(name="s"), string_data={"k": "v"}))
    with pytest.raises(client.ApiException) as info:
        core.read_namespaced_secret("s", namespace)
    assert info.value.status == 403
    objects = client.CustomObjectsApi(controller_api)
    assert objects.list_cluster_custom_object("fastshare.io", "v1alpha1", "fastpods")["items"] is not None
    with pytest.raises(client.ApiException) as info:
        objects.delete_namespaced_custom_object("fastshare.io", "v1alpha1", namespace, "fastpods", "x")
    assert info.value.status == 403


def test_the_node_agent_service_account_has_no_permissions(control_plane, api_client, rbac_installed):
    token = _token(client.CoreV1Api(api_client), rbac_installed["agent"]["serviceAccount"])
    api = control_plane.api_client({"token": token})
    try:
        for attrs in [("get", "nodes", "", "", "gpu-1", ""), ("list", "pods", "", "", "", ""),
                      ("list", "fastpods", "fastshare.io", "", "", "")]:
            assert not _allowed(api, *attrs), attrs
    finally:
        api.close()


def test_the_controller_does_its_whole_job_with_exactly_that_role(controller_api, api_client, namespace,
                                                                   rbac_installed, tmp_path):
    """Leader Lease, node watch, finalizer, replica Pod with nodeName (placed by an inter-pod
    rule: Nodes and Namespaces listed), status, Pod deletion and finalizer removal, all with the
    service account's token; the admin plays only user and kubelet."""
    certs.init_ca(tmp_path / "ca")
    certs.issue(tmp_path / "ca", "controller", tmp_path / "controller", role="controller", days=1)
    tls = TlsPaths.in_dir(tmp_path / "controller", "controller")
    admin = client.CoreV1Api(api_client)
    agent = Agent(tmp_path, tmp_path / "ca", f"rbac-{uuid.uuid4().hex[:4]}", ["V100-SXM2-32GB"], mig=False)
    agent.start(tls)
    register_node(admin, agent)
    elector = LeaderElector(controller_api, NAMESPACE, rbac_installed["controller"]["leaseName"], "rbac-test")
    controller = KubeController(controller_api, AgentPool(tls, deadline=10.0),
                                KubeSettings(namespace=namespace, workers=2, node_interval=0.5,
                                             resync_interval=3, watch_timeout=10),
                                CoreSettings(heartbeat_timeout=3.0, reconcile_interval=2.0, busy_wait=10.0))
    objects = client.CustomObjectsApi(api_client)
    try:
        assert elector.step() and elector.is_leader  # create + get/update of its own Lease
        controller.start()
        assert controller.usage.synced   # every namespace's Pods, for the nodes' CPU and memory
        # a term that selects namespaces by label: every Node and every Namespace are listed
        apart = {"labelSelector": {"matchLabels": {"app": "r"}}, "topologyKey": "kubernetes.io/hostname",
                 "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}
        template = {"spec": {"containers": [{"name": "main", "image": "busybox"}], "affinity": {
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [apart]}}}}
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                fastpod_manifest("r", {"kind": "mps", "memory": "2Gi"}, 1,
                                                                 template))

        def running():
            kubelet_step(admin, namespace)
            fastpod = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "r")
            nodes = [p.spec.node_name for p in admin.list_namespaced_pod(namespace).items]
            return (fastpod.get("status") or {}).get("readyReplicas") == 1 and nodes == [agent.name]

        wait_for(running, "replica running under the controller's role", timeout=120)
        objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "r")

        def gone():
            kubelet_step(admin, namespace)
            try:
                objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "r")
                return False
            except client.ApiException as exc:
                return exc.status == 404

        wait_for(gone, "FastPod released and its finalizer removed", timeout=120)
        assert agent.shares(tls) == [] and admin.list_namespaced_pod(namespace).items == []
        for forbidden in (lambda: client.CoreV1Api(controller_api).delete_node(agent.name),
                          lambda: client.CoreV1Api(controller_api).list_namespaced_secret(namespace)):
            with pytest.raises(client.ApiException) as info:
                forbidden()
            assert info.value.status == 403
    finally:
        controller.stop()
        controller.core.agents.close()
        elector.release()
        agent.stop()
        admin.delete_node(agent.name)
