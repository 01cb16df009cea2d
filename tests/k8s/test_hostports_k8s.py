"""Placement in-cluster counts host ports as the kube-scheduler's NodePorts filter does, on a
real API server with real node agents: two replicas taking one host port never share a node,
also when created in the same pass, and a Pod fastshare did not create holding the port keeps
them off its node; a template with ResourceClaims (which nothing would allocate) is refused."""

from __future__ import annotations

from kubernetes import client

from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest

from . import test_placement_k8s as placement
from .conftest import wait_for
from .test_controller_agents import View
from .test_placement_k8s import MPS, _by_name, _on, _refused

# the placement tests' nodes, agents and controller (fixtures, used by name)
agents, nodes, controller, other_namespace = (placement.agents, placement.nodes, placement.controller,
                                              placement.other_namespace)

PORT = {"containerPort": 80, "hostPort": 8080}


def _container(**extra) -> dict:
    return {"name": "main", "image": "busybox", "command": ["sleep", "inf"], **extra}


def _create(view: View, name: str, replicas: int, spec: dict) -> None:
    template = {"metadata": {"labels": {"app": name}}, "spec": spec}
    view.objects.create_namespaced_custom_object(GROUP, VERSION, view.namespace, PLURAL,
                                                 fastpod_manifest(name, MPS, replicas, template))


def test_replicas_taking_a_host_port_go_to_different_nodes(api_client, namespace, controller, agents, pki,
                                                          nodes):
    """Three replicas with hostPort 8080 on two nodes (created in one pass, in parallel without
    the check, and all fit otherwise): one on each, the third Unschedulable naming the port."""
    view = View(api_client, namespace, "web", agents, pki[1])
    _create(view, "web", 3, {"containers": [_container(ports=[PORT])]})
    message = _refused(view, "web")
    assert "2 node(s) have host port 8080/TCP in use" in message, message
    wait_for(lambda: _on(view, "web") == sorted(nodes.values()), "one replica on each node", timeout=60)
    assert len(view.pods()) == 2


def test_a_foreign_pod_holding_the_port_keeps_replicas_off_its_node(api_client, namespace, other_namespace,
                                                                    controller, agents, pki, nodes):
    """A Pod fastshare did not create holds 8080/TCP on a (where a replica would go first): the
    replica goes to b; a UDP port of the same number takes nothing from it."""
    core = client.CoreV1Api(api_client)
    spec = {"nodeName": nodes["a"], "automountServiceAccountToken": False,
            "containers": [_container(ports=[PORT])]}
    core.create_namespaced_pod(other_namespace, {"metadata": {"name": "holder"}, "spec": spec})
    wait_for(lambda: controller.usage.count(nodes["a"]) == 1, "the foreign Pod seen", timeout=30)
    view = View(api_client, namespace, "port", agents, pki[1])
    _create(view, "port", 1, {"containers": [_container(ports=[PORT])]})
    wait_for(lambda: view.settled(1), "1 replica", timeout=120)
    assert _on(view, "port") == [nodes["b"]]
    udp = View(api_client, namespace, "udp", agents, pki[1])
    _create(udp, "udp", 1, {"containers": [_container(ports=[{**PORT, "protocol": "UDP"}])],
                            **_by_name(nodes["a"])})
    wait_for(lambda: _on(udp, "udp") == [nodes["a"]], "the UDP replica on a", timeout=60)


def test_a_template_with_resource_claims_is_invalid(api_client, namespace, controller, agents, pki, nodes):
    view = View(api_client, namespace, "claims", agents, pki[1])
    _create(view, "claims", 1, {"resourceClaims": [{"name": "dev", "resourceClaimName": "dev"}],
                                "containers": [_container(resources={"claims": [{"name": "dev"}]})]})
    message = _refused(view, "claims", "Invalid")
    assert message.startswith("spec.template.spec.resourceClaims: "), message
    assert "spec.gpu" in message
    assert _on(view, "claims") == []


def test_two_fastpods_taking_one_port_do_not_share_a_node(api_client, namespace, controller, agents, pki,
                                                          nodes):
    """Two FastPods whose replicas take 8080/TCP on 127.0.0.1 and on every address, both held to
    node a, created at once (reconciled by different workers): one goes there, the other is
    Unschedulable naming the port, whichever comes first."""
    on_a = _by_name(nodes["a"])
    local = View(api_client, namespace, "local", agents, pki[1])
    _create(local, "local", 1, {"containers": [_container(ports=[{**PORT, "hostIP": "127.0.0.1"}])], **on_a})
    _create(local, "every", 1, {"containers": [_container(ports=[PORT])], **on_a})
    wait_for(lambda: len(_on(local, "local") + _on(local, "every")) == 1, "one of them placed", timeout=60)
    refused = "every" if _on(local, "local") else "local"
    message = _refused(local, refused)
    assert "have host port 8080/TCP" in message, message
    assert len(_on(local, "local") + _on(local, "every")) == 1
