"""roles/controller with deploy_mode=kubernetes against a real kube-apiserver (envtest).

The role renders fastshare's manifests (k8s_manifests) and applies them with
kubernetes.core.k8s; the API server is the same throw-away one the k8s tests use. There is no
kubelet, so the test does not wait for Pods; the CRD must become Established.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fs_collection import COLLECTION, run_tasks
from kubernetes import client

from fastshare.k8s import envtest, manifests


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
