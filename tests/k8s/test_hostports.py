"""Host ports (the kube-scheduler's NodePorts filter) and ResourceClaims, for the Pods fastshare
binds itself: which ports a Pod takes, when two conflict, what the node-usage watch keeps of
them, and a template with claims refused naming the field."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastshare.k8s.nodeusage import NodeUsage
from fastshare.k8s.pods import replica_host_ports, spec_of
from fastshare.k8s.resources import fastpod_manifest
from fastshare.k8s.scheduling import (
    ANY_IP,
    HostPort,
    TemplateError,
    host_ports,
    port_taken,
    refuse_resource_claims,
    running_host_ports,
)

MPS = {"kind": "mps", "memory": "1Gi"}


def _c(*ports: dict, **extra) -> dict:
    return {"name": "c", "image": "busybox", "ports": list(ports), **extra}


def test_host_ports_with_the_api_server_defaults():
    spec = {"containers": [_c({"containerPort": 80}, {"containerPort": 80, "hostPort": 8080}),
                           _c({"containerPort": 53, "hostPort": 53, "protocol": "UDP", "hostIP": "10.0.0.1"},
                              {"containerPort": 9, "hostPort": 0})]}
    assert host_ports(spec) == (HostPort(ANY_IP, "TCP", 8080), HostPort("10.0.0.1", "UDP", 53))
    assert str(HostPort(ANY_IP, "TCP", 8080)) == "8080/TCP"
    assert str(HostPort("10.0.0.1", "UDP", 53)) == "53/UDP on 10.0.0.1"


def test_sidecars_hold_their_ports_and_init_steps_do_not():
    spec = {"initContainers": [_c({"containerPort": 1, "hostPort": 1000}),
                               _c({"containerPort": 2, "hostPort": 2000}, restartPolicy="Always")],
            "containers": [_c({"containerPort": 3, "hostPort": 3000})]}
    assert [p.port for p in host_ports(spec)] == [2000, 3000]


def test_under_host_network_the_container_port_is_the_host_port():
    spec = {"hostNetwork": True,
            "containers": [_c({"containerPort": 8080}, {"containerPort": 9, "hostPort": 9})]}
    assert [p.port for p in host_ports(spec)] == [8080, 9]
    # hostPort 0 is unset to the API server: defaulted to the container port as well
    assert host_ports({"hostNetwork": True, "containers": [_c({"containerPort": 7, "hostPort": 0})]}) == (
        HostPort(ANY_IP, "TCP", 7),)
    with pytest.raises(TemplateError) as caught:
        host_ports({"hostNetwork": True, "containers": [_c({"containerPort": "x", "hostPort": 0})]})
    assert caught.value.field == "spec.containers[0].ports[0].containerPort"


@pytest.mark.parametrize(("port", "field", "words"), [
    ({"containerPort": 1, "hostPort": 70000}, "spec.containers[0].ports[1].hostPort", "1 to 65535"),
    ({"containerPort": 1, "hostPort": -1}, "spec.containers[0].ports[1].hostPort", "1 to 65535"),
    ({"containerPort": 1, "hostPort": "8080"}, "spec.containers[0].ports[1].hostPort", "integer"),
    ({"containerPort": 1, "hostPort": True}, "spec.containers[0].ports[1].hostPort", "integer"),
    ({"containerPort": 1, "hostPort": 1.5}, "spec.containers[0].ports[1].hostPort", "integer"),
    ({"containerPort": 1, "hostPort": 80, "protocol": "HTTP"}, "spec.containers[0].ports[1].protocol",
     "TCP, UDP, SCTP"),
    ({"containerPort": 1, "hostPort": 80, "hostIP": 7}, "spec.containers[0].ports[1].hostIP", "IP address"),
    ("80", "spec.containers[0].ports[1]", "object"),
])
def test_a_malformed_port_is_refused_naming_the_field(port, field, words):
    with pytest.raises(TemplateError) as caught:
        host_ports({"containers": [_c({"containerPort": 1}, port)]})
    assert caught.value.field == field
    assert words in caught.value.detail
    assert running_host_ports({"spec": {"containers": [_c(port)]}}) == ()   # a bound Pod: counts none


def test_a_fastpod_s_ports_are_named_as_the_user_wrote_them():
    template = {"spec": {"containers": [_c({"containerPort": 1}, {"containerPort": 1, "hostPort": 0.5})]}}
    with pytest.raises(TemplateError) as caught:
        replica_host_ports(fastpod_manifest("p", MPS, template=template))
    assert caught.value.field == "spec.template.spec.containers[0].ports[1].hostPort"


@pytest.mark.parametrize(("wanted", "used", "taken"), [
    (HostPort(ANY_IP, "TCP", 80), HostPort(ANY_IP, "TCP", 80), True),
    (HostPort(ANY_IP, "TCP", 80), HostPort("10.0.0.1", "TCP", 80), True),      # every address has it
    (HostPort("10.0.0.1", "TCP", 80), HostPort(ANY_IP, "TCP", 80), True),
    (HostPort("10.0.0.1", "TCP", 80), HostPort("10.0.0.2", "TCP", 80), False),
    (HostPort(ANY_IP, "TCP", 80), HostPort(ANY_IP, "UDP", 80), False),
    (HostPort(ANY_IP, "TCP", 80), HostPort(ANY_IP, "TCP", 81), False),
])
def test_when_two_host_ports_conflict(wanted, used, taken):
    assert (port_taken([wanted], [used]) == wanted) is taken
    assert (port_taken([used], [wanted]) == used) is taken   # symmetric


ips = st.sampled_from([ANY_IP, "10.0.0.1", "10.0.0.2"])
ports = st.builds(HostPort, ips, st.sampled_from(["TCP", "UDP", "SCTP"]), st.integers(1, 4))


@given(st.lists(ports, max_size=6), st.lists(ports, max_size=6))
def test_a_port_is_taken_as_the_scheduler_s_check_says(wanted, used):
    """The scheduler's HostPortInfo.CheckConflict, written out: a specific address conflicts
    with itself and with every address; every address conflicts with any."""
    def conflicts(p: HostPort) -> bool:
        same = [u for u in used if (u.protocol, u.port) == (p.protocol, p.port)]
        return bool(same) if p.ip == ANY_IP else any(u.ip in (p.ip, ANY_IP) for u in same)
    expected = next((p for p in wanted if conflicts(p)), None)
    assert port_taken(wanted, used) == expected


def _pod(name: str, node: str, *ports: dict, phase: str = "Running") -> dict:
    return {"metadata": {"namespace": "ns", "name": name},
            "spec": {"nodeName": node, "containers": [_c(*ports)]}, "status": {"phase": phase}}


def test_node_usage_keeps_each_bound_pod_s_host_ports():
    usage = NodeUsage()
    usage.replace([_pod("a", "n1", {"containerPort": 80, "hostPort": 80}),
                   _pod("b", "n1", {"containerPort": 1}),
                   _pod("c", "n2", {"containerPort": 53, "hostPort": 53, "protocol": "UDP"})])
    assert usage.ports(["n1", "n2", "n3"]) == {"n1": [HostPort(ANY_IP, "TCP", 80)],
                                                "n2": [HostPort(ANY_IP, "UDP", 53)], "n3": []}
    usage.put(_pod("a", "n1", {"containerPort": 80, "hostPort": 80}, phase="Succeeded"))   # ended: port free
    usage.put(_pod("b", "n1", {"containerPort": 1, "hostPort": 81}))
    usage.remove(_pod("c", "n2"))
    assert usage.ports(["n1", "n2"]) == {"n1": [HostPort(ANY_IP, "TCP", 81)], "n2": []}
    assert usage.count("n1") == 1 and usage.count("n2") == 0


# -- ResourceClaims ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "field"), [
    ({"resourceClaims": [{"name": "gpu", "resourceClaimName": "x"}], "containers": [_c()]},
     "spec.template.spec.resourceClaims"),
    ({"containers": [_c(), _c(resources={"claims": [{"name": "gpu"}]})]},
     "spec.template.spec.containers[1].resources.claims"),
    ({"initContainers": [_c(resources={"claims": [{"name": "gpu"}]})], "containers": [_c()]},
     "spec.template.spec.initContainers[0].resources.claims"),
])
def test_a_template_with_resource_claims_is_refused_naming_the_field(spec, field):
    with pytest.raises(TemplateError) as caught:
        spec_of(fastpod_manifest("d", MPS, template={"spec": spec}))
    assert caught.value.field == field
    assert "ResourceClaims" in caught.value.detail and "spec.gpu" in caught.value.detail


def test_empty_claims_are_no_claims():
    refuse_resource_claims({"resourceClaims": [], "containers": [_c(resources={"claims": []})]})
