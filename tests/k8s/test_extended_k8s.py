"""Placement in-cluster counts what the kubelet admits a Pod by besides CPU and memory, on a real
API server with real node agents: extended resources (a device plugin's ``example.com/foo``)
against the node's allocatable less what bound Pods hold of them, and Pod-level resources
(``spec.resources``) as the Pod's request, of the replica and of Pods fastshare did not create;
a template asking the NVIDIA device plugin for a GPU is refused."""

from __future__ import annotations

from kubernetes import client

from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest

from . import test_placement_k8s as placement
from .conftest import wait_for
from .test_controller_agents import View
from .test_placement_k8s import ALLOCATABLE, MPS, _on, _refused

# the placement tests' nodes, agents and controller (fixtures, used by name)
agents, nodes, controller, other_namespace = (placement.agents, placement.nodes, placement.controller,
                                              placement.other_namespace)

FOO = "example.com/foo"


def _devices(core: client.CoreV1Api, node: str, amount: str | None) -> None:
    """Node ``node`` reports ``amount`` of FOO (None: none at all, as without its device plugin)."""
    status = {**ALLOCATABLE, FOO: amount}
    core.patch_node_status(node, {"status": {"allocatable": status, "capacity": status}})


def _container(resources: dict | None = None) -> dict:
    return {"name": "main", "image": "busybox", "command": ["sleep", "inf"], "resources": resources or {}}


def _foreign(core: client.CoreV1Api, namespace: str, node: str, resources: dict | None = None,
             pod_level: dict | None = None) -> None:
    spec = {"nodeName": node, "automountServiceAccountToken": False, "containers": [_container(resources)]}
    if pod_level:
        spec["resources"] = pod_level
    core.create_namespaced_pod(namespace, {"metadata": {"name": "foreign"}, "spec": spec})


def _create(view: View, name: str, replicas: int, spec: dict) -> None:
    template = {"metadata": {"labels": {"app": name}}, "spec": spec}
    view.objects.create_namespaced_custom_object(GROUP, VERSION, view.namespace, PLURAL,
                                                 fastpod_manifest(name, MPS, replicas, template))


def test_a_replica_asking_a_device_goes_only_where_one_is_free(api_client, namespace, other_namespace,
                                                               controller, agents, pki, nodes):
    """Node b has 2 example.com/foo, a none (a sorts first: without the check the replicas go
    there, where the kubelet refuses them). A Pod fastshare did not create holds one of b's:
    one replica goes to b, the second is Unschedulable naming the resource, also while the
    first one's Pod is not yet seen by the node watch; once the foreign Pod is gone it goes to b."""
    core = client.CoreV1Api(api_client)
    device = {"requests": {FOO: "1"}, "limits": {FOO: "1"}}
    _devices(core, nodes["b"], "2")
    try:
        controller.sync_nodes()
        assert dict(controller._nodes[nodes["b"]].extended)[FOO] == 2
        _foreign(core, other_namespace, nodes["b"], device)
        wait_for(lambda: controller.usage.count(nodes["b"]) == 1, "the foreign Pod seen", timeout=30)
        view = View(api_client, namespace, "dev", agents, pki[1])
        _create(view, "dev", 2, {"containers": [_container(device)]})
        message = _refused(view, "dev")
        assert f"1 node(s) have no {FOO} (status.allocatable) ({nodes['a']})" in message, message
        assert f"1 node(s) have 0 {FOO} free, the replica asks 1 ({nodes['b']})" in message, message
        wait_for(lambda: _on(view, "dev") == [nodes["b"]], "one replica on b", timeout=60)
        core.delete_namespaced_pod("foreign", other_namespace, grace_period_seconds=0)
        wait_for(lambda: view.settled(2), "2 replicas", timeout=120)
        assert _on(view, "dev") == [nodes["b"]] * 2
    finally:
        _devices(core, nodes["b"], None)


def test_pod_level_resources_count_for_the_replica_and_for_foreign_pods(api_client, namespace,
                                                                      other_namespace, controller, agents,
                                                                      pki, nodes):
    """A Pod fastshare did not create asks 3 of a's 4 CPUs at Pod level (its container asks
    nothing); each replica's template has a Pod-level CPU limit of 2 (the API server defaults
    the request to it): they go to b, two of them fill it, and a third is refused."""
    core = client.CoreV1Api(api_client)
    _foreign(core, other_namespace, nodes["a"], pod_level={"requests": {"cpu": "3"}})
    wait_for(lambda: controller.usage.count(nodes["a"]) == 1, "the foreign Pod seen", timeout=30)
    view = View(api_client, namespace, "podlevel", agents, pki[1])
    _create(view, "podlevel", 2, {"resources": {"limits": {"cpu": "2"}}, "containers": [_container()]})
    wait_for(lambda: view.settled(2), "2 replicas", timeout=120)
    assert _on(view, "podlevel") == [nodes["b"]] * 2
    assert view.pods()[0].spec.resources.requests == {"cpu": "2"}   # as the API server admitted it
    view.scale(3)
    message = _refused(view, "podlevel")
    assert "milli-CPU" in message, message
    assert len(view.pods()) == 2


def test_a_template_asking_the_device_plugin_for_a_gpu_is_invalid(api_client, namespace, controller, agents,
                                                                   pki, nodes):
    view = View(api_client, namespace, "plugin", agents, pki[1])
    gpu = {"limits": {"nvidia.com/gpu": "1"}}
    _create(view, "plugin", 1, {"containers": [_container(gpu)]})
    message = _refused(view, "plugin", "Invalid")
    assert message.startswith("spec.template.spec.containers[0].resources.limits[nvidia.com/gpu]: "), message
    assert "spec.gpu" in message
    assert _on(view, "plugin") == []
