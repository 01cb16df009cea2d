"""Inter-pod affinity, anti-affinity and topology spread in-cluster, on a real API server with
real node agents: the controller binds replicas itself, so no scheduler and no kubelet would
catch a replica placed against its template's rules (or against an existing Pod's)."""

from __future__ import annotations

import collections
import threading
import time
import uuid

import pytest
from kubernetes import client

from fastshare.k8s.podaffinity import HOSTNAME

from . import test_placement_k8s as placement
from .agents import Agent, register_node
from .conftest import wait_for
from .test_controller_agents import View
from .test_placement_k8s import _create, _on, _refused

ANTI = "spec.template.spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution"
ZONES = {"a": "z1", "b": "z1", "c": "z2"}


@pytest.fixture(scope="module")
def agents(api_client, pki):
    """Three GPU nodes of one V100 each: a and b in zone z1, c in z2; a sorts first, so that it
    is where every replica goes when nothing rules it out (the engine packs)."""
    root, tls = pki
    suffix = uuid.uuid4().hex[:4]
    started = {key: Agent(root, root / "ca", f"aff-{key}-{suffix}", ["V100-SXM2-32GB"], mig=False)
               for key in ZONES}
    core = client.CoreV1Api(api_client)
    for key, agent in started.items():
        agent.start(tls)
        register_node(core, agent)
        core.patch_node(agent.name, {"metadata": {"labels": {"zone": ZONES[key], HOSTNAME: agent.name}}})
    yield started
    for agent in started.values():
        agent.stop()
        core.delete_node(agent.name)


@pytest.fixture
def nodes(agents):
    return {key: agent.name for key, agent in agents.items()}


# the placement tests' controller (default window of 16 parallel creations) and second namespace,
# over this module's agents and nodes (fixtures, used by name)
controller, other_namespace = placement.controller, placement.other_namespace


def _foreign(api_client, controller, namespace, node, labels, **spec):
    """A Pod fastshare did not create, bound to ``node``, once the controller has seen it."""
    client.CoreV1Api(api_client).create_namespaced_pod(namespace, {
        "metadata": {"name": "foreign", "labels": labels},
        "spec": {"nodeName": node, "automountServiceAccountToken": False,
                 "containers": [{"name": "c", "image": "busybox"}], **spec}})
    wait_for(lambda: (namespace, "foreign") in controller.peers.all(), "the foreign Pod seen", timeout=30)


def _required(kind, *terms):
    return {"affinity": {kind: {"requiredDuringSchedulingIgnoredDuringExecution": list(terms)}}}


def test_hostname_anti_affinity_puts_each_replica_on_its_own_node(api_client, namespace, controller, agents,
                                                                  pki, nodes):
    """Four replicas that may not share a node, created in one pass (a window of up to 16): three
    land, one per node, and the fourth is refused naming the rule and the nodes."""
    view = View(api_client, namespace, "apart", agents, pki[1])
    _create(view, "apart", 4, **_required("podAntiAffinity", {
        "labelSelector": {"matchLabels": {"app": "apart"}}, "topologyKey": HOSTNAME}))
    wait_for(lambda: view.settled(3), "3 replicas", timeout=120)
    assert _on(view, "apart") == sorted(nodes.values())
    message = _refused(view, "apart")
    rule = f"3 node(s) run a Pod in their {HOSTNAME} that {ANTI}[0] of podAntiAffinity selects"
    assert rule in message, message
    view.scale(5)   # later passes too
    wait_for(lambda: view.fastpod()["status"]["conditions"][0]["observedGeneration"] > 1, "a later pass",
             timeout=30)
    assert len(view.pods()) == 3
    assert _on(view, "apart") == sorted(nodes.values())


def test_an_existing_pods_anti_affinity_keeps_replicas_out_of_its_zone(api_client, namespace, other_namespace,
                                                                       controller, agents, pki, nodes):
    """A Pod of another namespace on node a will have no Pod labelled app=shy in its zone (z1,
    with b): the replicas (which have no rule of their own) go to c."""
    _foreign(api_client, controller, other_namespace, nodes["a"], {"app": "loner"}, **_required(
        "podAntiAffinity", {"labelSelector": {"matchLabels": {"app": "shy"}}, "topologyKey": "zone",
                            "namespaceSelector": {}}))
    view = View(api_client, namespace, "shy", agents, pki[1])
    _create(view, "shy", 2)
    wait_for(lambda: view.settled(2), "2 replicas", timeout=120)
    assert _on(view, "shy") == [nodes["c"]] * 2
    _create(view, "other", nodeSelector={"zone": "z1"})   # labelled app=other: not meant
    wait_for(lambda: len(_on(view, "other")) == 1, "other placed", timeout=60)
    assert _on(view, "other")[0] in (nodes["a"], nodes["b"])


def test_pod_affinity_follows_a_labelled_pod_to_its_zone(api_client, namespace, other_namespace, controller,
                                                         agents, pki, nodes):
    """A cache Pod runs on a node without GPUs in zone z2 (a namespace chosen by its labels):
    replicas that need it in their zone go to c, the only GPU node there."""
    core = client.CoreV1Api(api_client)
    core.patch_namespace(other_namespace, {"metadata": {"labels": {"team": "infra"}}})
    cpu_node = f"cpu-{uuid.uuid4().hex[:6]}"
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=cpu_node, labels={"zone": "z2"})))
    try:
        _foreign(api_client, controller, other_namespace, cpu_node, {"role": "cache"})
        view = View(api_client, namespace, "near", agents, pki[1])
        _create(view, "near", 2, **_required("podAffinity", {
            "labelSelector": {"matchLabels": {"role": "cache"}}, "topologyKey": "zone",
            "namespaceSelector": {"matchLabels": {"team": "infra"}}}))
        wait_for(lambda: view.settled(2), "2 replicas", timeout=120)
        assert _on(view, "near") == [nodes["c"]] * 2
        # the same without the cache Pod's namespace: nothing to be near, and no first of a series
        _create(view, "far", 1, **_required("podAffinity", {
            "labelSelector": {"matchLabels": {"role": "cache"}}, "topologyKey": "zone"}))
        message = _refused(view, "far")
        rule = "3 node(s) run no Pod in their zone that spec.template.spec.affinity.podAffinity"
        assert rule in message, message
    finally:
        core.delete_node(cpu_node)


def test_topology_spread_keeps_zones_within_max_skew(api_client, namespace, controller, agents, pki, nodes):
    """maxSkew 1 over zones (z1: a and b, z2: c): four replicas, two in each zone."""
    view = View(api_client, namespace, "even", agents, pki[1])
    _create(view, "even", 4, topologySpreadConstraints=[{
        "maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"app": "even"}}}])
    wait_for(lambda: view.settled(4), "4 replicas", timeout=120)
    zone_of = {name: ZONES[key] for key, name in nodes.items()}
    zones = collections.Counter(zone_of[node] for node in _on(view, "even"))
    assert zones == {"z1": 2, "z2": 2}


def test_an_unreadable_rule_is_refused_naming_the_field(api_client, namespace, controller, agents, pki,
                                                        nodes):
    view = View(api_client, namespace, "", agents, pki[1])
    _create(view, "keyless", 2, **_required("podAntiAffinity", {
        "labelSelector": {"matchLabels": {"app": "keyless"}}, "topologyKey": ""}))
    message = _refused(view, "keyless", "Invalid")
    assert message.startswith(f"{ANTI}[0].topologyKey: "), message
    assert _on(view, "keyless") == []


def _slow_allocation(controller, owner: str, seconds: float) -> threading.Event:
    """Hold each allocation of FastPod ``owner`` for ``seconds`` after the engine chose its node
    (as a slow agent does); the event is set when the first one got there."""
    entered = threading.Event()
    allocate = controller.core.allocate

    def slow(request, *args, **kwargs):
        allocation = allocate(request, *args, **kwargs)
        if request.owner.endswith(f"/{owner}"):
            entered.set()
            time.sleep(seconds)
        return allocation

    controller.core.allocate = slow
    return entered


APART_FROM_PLAIN = _required("podAntiAffinity", {"labelSelector": {"matchLabels": {"app": "plain"}},
                                                 "topologyKey": HOSTNAME})


@pytest.mark.parametrize("first", ["plain", "picky"])
def test_two_fastpods_placed_at_once_do_not_break_an_anti_affinity(api_client, namespace, controller, agents,
                                                                   pki, nodes, first):
    """``picky`` may not share a node with a Pod of ``plain`` (which has no rule). Whichever is
    placed first, its replica's allocation is slow, and the other FastPod's pass (another
    worker) runs meanwhile: it must not be placed blind to the replica on its way."""
    view = View(api_client, namespace, "", agents, pki[1])
    entered = _slow_allocation(controller, first, 3.0)
    templates = {"plain": {}, "picky": APART_FROM_PLAIN}
    second = "picky" if first == "plain" else "plain"
    _create(view, first, **templates[first])
    assert entered.wait(30)
    _create(view, second, **templates[second])
    wait_for(lambda: len(_on(view, "plain")) == 1 and len(_on(view, "picky")) == 1, "both placed", timeout=60)
    assert _on(view, "plain") != _on(view, "picky")
