"""Placement in-cluster respects what the kubelet and the kube-scheduler check, on a real API
server with real node agents: node CPU/memory (allocatable minus every bound Pod's request,
also of Pods fastshare did not create, the replicas' own counted once), required node affinity,
taints against tolerations, cordons; and a template fastshare cannot read is refused by name."""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client

from fastshare.controller.agent_client import AgentPool
from fastshare.controller.core import Settings as CoreSettings
from fastshare.k8s.controller import KubeController, KubeSettings
from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.k8s.scheduling import Demand

from .agents import Agent, kubelet_step, register_node
from .conftest import new_namespace, wait_for
from .test_controller_agents import View

MPS = {"kind": "mps", "memory": "1Gi"}
ALLOCATABLE = {"cpu": "4", "memory": "8Gi", "pods": "110"}


@pytest.fixture(scope="module")
def agents(api_client, pki):
    """Two GPU nodes of one V100 each, 4 CPUs and 8 GiB; ``a`` sorts first, so that it is where
    a replica goes when nothing rules it out (the engine takes the first of equals)."""
    root, tls = pki
    suffix = uuid.uuid4().hex[:4]
    started = {key: Agent(root, root / "ca", f"cap-{key}-{suffix}", ["V100-SXM2-32GB"], mig=False)
               for key in ("a", "b")}
    core = client.CoreV1Api(api_client)
    for key, agent in started.items():
        agent.start(tls)
        register_node(core, agent)
        core.patch_node(agent.name, {"metadata": {"labels": {"zone": f"z{key}"}}})
    yield started
    for agent in started.values():
        agent.stop()
        core.delete_node(agent.name)


@pytest.fixture
def nodes(api_client, agents):
    """The two nodes' names; each test starts with them untainted, schedulable, full allocatable."""
    core = client.CoreV1Api(api_client)

    def reset():
        for agent in agents.values():
            core.patch_node(agent.name, {"spec": {"taints": [], "unschedulable": False}})
            status = {"allocatable": ALLOCATABLE, "capacity": ALLOCATABLE}
            core.patch_node_status(agent.name, {"status": status})

    reset()
    yield {key: agent.name for key, agent in agents.items()}
    reset()


@contextlib.contextmanager
def _running(api_client, namespace, pki, agents, node_interval: float = 0.5,
             heartbeat_timeout: float = 3.0) -> Iterator[KubeController]:
    """A started controller; on the way out its FastPods are deleted and their shares released."""
    c = KubeController(api_client, AgentPool(pki[1], deadline=10.0),
                       KubeSettings(namespace=namespace, workers=3, node_interval=node_interval,
                                    resync_interval=3, watch_timeout=10),
                       CoreSettings(heartbeat_timeout=heartbeat_timeout, reconcile_interval=2.0,
                                    busy_wait=10.0))
    c.start()
    try:
        yield c
    finally:
        _clean_up(c, api_client, namespace, pki, agents)


def _clean_up(c: KubeController, api_client, namespace, pki, agents) -> None:
    # leave the module's agents without shares and its nodes without Pods
    objects, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    for fp in objects.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]:
        objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fp["metadata"]["name"])
    view = View(api_client, namespace, "", agents, pki[1])
    wait_for(lambda: (kubelet_step(core, namespace), view.shares() == [] and not
                      core.list_namespaced_pod(namespace).items)[1], "released", timeout=120)
    c.stop()
    c.core.agents.close()


@pytest.fixture
def controller(api_client, fastpod_crd, namespace, pki, nodes, agents):
    with _running(api_client, namespace, pki, agents) as c:
        yield c


@pytest.fixture
def other_namespace(api_client):
    name = new_namespace(api_client, "o")
    core = client.CoreV1Api(api_client)
    yield name
    for pod in core.list_namespaced_pod(name).items:
        core.delete_namespaced_pod(pod.metadata.name, name, grace_period_seconds=0)


def _template(name: str, requests: dict | None = None, **spec) -> dict:
    container = {"name": "main", "image": "busybox", "command": ["sleep", "inf"]}
    if requests:
        container["resources"] = {"requests": requests}
    return {"metadata": {"labels": {"app": name}}, "spec": {"containers": [container], **spec}}


def _create(view: View, name: str, replicas: int = 1, **template) -> None:
    view.objects.create_namespaced_custom_object(GROUP, VERSION, view.namespace, PLURAL, fastpod_manifest(
        name, MPS, replicas, _template(name, **template)))


def _scheduled(view: View, name: str) -> dict | None:
    fp = view.objects.get_namespaced_custom_object(GROUP, VERSION, view.namespace, PLURAL, name)
    conditions = (fp.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Scheduled"), None)


def _refused(view: View, name: str, reason: str = "Unschedulable") -> str:
    condition = wait_for(lambda: (c := _scheduled(view, name)) and c["status"] == "False" and c,
                         f"{name} not scheduled", timeout=60)
    assert condition["reason"] == reason, condition
    return condition["message"]


def _on(view: View, name: str) -> list[str]:
    view.name = name
    return sorted(p.spec.node_name for p in view.pods())


def _by_name(node: str) -> dict:
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}}


@pytest.mark.parametrize(("resource", "foreign", "each", "short"), [
    ("cpu", "3500m", "1", "lack 1000 milli-CPU"),
    ("memory", "7Gi", "2Gi", "lack 2 GiB host memory"),
])
def test_replicas_go_where_the_node_has_the_cpu_or_memory_left(api_client, namespace, other_namespace,
                                                                 controller, agents, pki, nodes, resource,
                                                                 foreign, each, short):
    """A Pod fastshare did not create (another namespace) takes node a's CPU or memory: the
    replicas go to b, exactly as many as b has room for (a replica's own Pod counts once, not
    again beside its share), and the next one is refused with the reason."""
    core = client.CoreV1Api(api_client)
    core.create_namespaced_pod(other_namespace, {
        "metadata": {"name": "foreign"},
        "spec": {"nodeName": nodes["a"], "automountServiceAccountToken": False, "containers": [
            {"name": "c", "image": "busybox", "resources": {"requests": {resource: foreign}}}]}})
    view = View(api_client, namespace, "cap", agents, pki[1])
    _create(view, "cap", 3, requests={resource: each})
    wait_for(lambda: view.settled(3), "3 replicas", timeout=120)
    assert _on(view, "cap") == [nodes["b"]] * 3
    view.scale(4)    # b's last room: its 3 Pods (seen by now) must not count twice
    wait_for(lambda: view.settled(4), "4 replicas", timeout=60)
    assert _on(view, "cap") == [nodes["b"]] * 4
    view.scale(5)
    message = _refused(view, "cap")
    assert f"2 node(s) {short}" in message, message   # a: the foreign Pod's, b: the replicas'
    assert len(view.pods()) == 4


def test_a_node_running_as_many_pods_as_it_allows_is_avoided(api_client, namespace, other_namespace,
                                                            controller, agents, pki, nodes):
    """Node a allows 2 Pods (status.allocatable.pods) and runs 2 that fastshare did not create:
    its kubelet would refuse a third (OutOfpods), so the replica goes to b; with b full too, the
    rejection says why."""
    core = client.CoreV1Api(api_client)
    for node, allowed in ((nodes["a"], "2"), (nodes["b"], "3")):
        limited = {**ALLOCATABLE, "pods": allowed}
        core.patch_node_status(node, {"status": {"allocatable": limited, "capacity": limited}})
    for i in range(2):
        core.create_namespaced_pod(other_namespace, {
            "metadata": {"name": f"foreign-{i}"},
            "spec": {"nodeName": nodes["a"], "automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "busybox"}]}})
    wait_for(lambda: controller._nodes[nodes["a"]].max_pods == 2 and controller.usage.count(nodes["a"]) == 2,
             "a's Pod limit and its 2 Pods seen by the controller", timeout=30)
    view = View(api_client, namespace, "few", agents, pki[1])
    _create(view, "few", 3)
    wait_for(lambda: view.settled(3), "3 replicas", timeout=120)
    assert _on(view, "few") == [nodes["b"]] * 3
    wait_for(lambda: controller.usage.count(nodes["b"]) == 3, "b's 3 Pods in the usage cache", timeout=30)
    view.scale(4)
    message = _refused(view, "few")
    assert "2 node(s) run as many Pods as they allow" in message, message


def test_replicas_placed_in_one_pass_count_against_the_pod_limit(api_client, namespace, other_namespace,
                                                                   controller, agents, pki, nodes):
    """Node b allows 3 Pods and runs 1 that fastshare did not create; a is full. Of 3 replicas
    created in one pass (in parallel) only 2 fit b: each placement counts the replicas placed
    before it, not only the Pods bound when the pass began (the kubelet would refuse the third)."""
    core = client.CoreV1Api(api_client)
    for node, allowed, foreign in ((nodes["a"], "2", 2), (nodes["b"], "3", 1)):
        limited = {**ALLOCATABLE, "pods": allowed}
        core.patch_node_status(node, {"status": {"allocatable": limited, "capacity": limited}})
        for i in range(foreign):
            core.create_namespaced_pod(other_namespace, {
                "metadata": {"name": f"foreign-{node[-6:]}-{i}"},
                "spec": {"nodeName": node, "automountServiceAccountToken": False,
                         "containers": [{"name": "c", "image": "busybox"}]}})
    wait_for(lambda: controller._nodes[nodes["b"]].max_pods == 3 and controller.usage.count(nodes["a"]) == 2
             and controller.usage.count(nodes["b"]) == 1, "the Pod limits and Pods seen", timeout=30)
    view = View(api_client, namespace, "few", agents, pki[1])
    _create(view, "few", 3)
    condition = wait_for(lambda: _scheduled(view, "few"), "the first pass's status", timeout=60)
    assert condition["status"] == "False", condition
    assert "2 node(s) run as many Pods as they allow" in condition["message"], condition
    assert _on(view, "few") == [nodes["b"]] * 2


def test_the_namespace_limit_range_default_request_counts(api_client, namespace, other_namespace, controller,
                                                          agents, pki, nodes):
    """A template without requests in a namespace whose LimitRange gives every container 3 CPUs:
    the replica asks 3 CPUs (as its Pod will be admitted), which a (2 CPUs left) has not."""
    core = client.CoreV1Api(api_client)
    core.create_namespaced_limit_range(namespace, {"metadata": {"name": "defaults"}, "spec": {"limits": [
        {"type": "Container", "defaultRequest": {"cpu": "3"}, "default": {"cpu": "3"}}]}})
    core.create_namespaced_pod(other_namespace, {
        "metadata": {"name": "foreign"},
        "spec": {"nodeName": nodes["a"], "automountServiceAccountToken": False, "containers": [
            {"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "2"}}}]}})
    view = View(api_client, namespace, "", agents, pki[1])
    _create(view, "defaulted")
    wait_for(lambda: _on(view, "defaulted") == [nodes["b"]], "defaulted on b", timeout=60)
    assert view.pods()[0].spec.containers[0].resources.requests == {"cpu": "3"}


def test_required_node_affinity_picks_the_node_or_the_rejection_names_it(api_client, namespace, controller,
                                                                         agents, pki, nodes):
    view = View(api_client, namespace, "", agents, pki[1])
    zone_b = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["zb"]}]}]}}}}
    _create(view, "picky", **zone_b)
    wait_for(lambda: _on(view, "picky") == [nodes["b"]], "picky on b", timeout=60)
    nowhere = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["zc"]}]}]}}}}
    _create(view, "nowhere", **nowhere)
    message = _refused(view, "nowhere")
    assert "2 node(s) do not match spec.template.spec.affinity.nodeAffinity" in message, message
    assert _on(view, "nowhere") == []


def test_tainted_and_cordoned_nodes_are_avoided_unless_tolerated(api_client, namespace, controller, agents,
                                                                  pki, nodes):
    core = client.CoreV1Api(api_client)
    core.patch_node(nodes["a"], {"spec": {"taints": [{"key": "dedicated", "value": "infer",
                                                      "effect": "NoSchedule"}]}})
    view = View(api_client, namespace, "", agents, pki[1])
    controller.sync_nodes()   # now, not on its next round
    _create(view, "plain")
    wait_for(lambda: _on(view, "plain") == [nodes["b"]], "plain on b", timeout=60)

    _create(view, "intolerant", **_by_name(nodes["a"]))
    message = _refused(view, "intolerant")
    assert "taint dedicated=infer:NoSchedule that spec.template.spec.tolerations does not tolerate" in message

    tolerations = [{"key": "dedicated", "operator": "Equal", "value": "infer", "effect": "NoSchedule"}]
    _create(view, "tolerant", tolerations=tolerations, **_by_name(nodes["a"]))
    wait_for(lambda: _on(view, "tolerant") == [nodes["a"]], "tolerant on a", timeout=60)

    core.patch_node(nodes["b"], {"spec": {"unschedulable": True}})
    controller.sync_nodes()
    _create(view, "cordoned", **_by_name(nodes["b"]))
    assert "cordoned (spec.unschedulable)" in _refused(view, "cordoned")


def test_a_template_the_controller_cannot_read_is_refused_naming_the_field(api_client, namespace, controller,
                                                                            agents, pki, nodes):
    view = View(api_client, namespace, "", agents, pki[1])
    _create(view, "lots", requests={"cpu": "lots"})
    message = _refused(view, "lots", "Invalid")
    assert message.startswith("spec.template.spec.containers[0].resources.requests.cpu: "), message
    assert _on(view, "lots") == []
    # what the schema types is refused at once, naming the field
    body = fastpod_manifest("near", MPS, 1, _template("near", tolerations=[{"key": "k", "operator": "Like"}]))
    with pytest.raises(client.ApiException) as refused:
        view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    assert refused.value.status == 422
    assert "spec.template.spec.tolerations[0].operator" in json.loads(refused.value.body)["message"]


def test_node_selector_follows_the_node_labels_of_now(api_client, namespace, controller, agents, pki, nodes):
    """An operator moves the zone label from node a to node b after both agents registered: a
    replica selecting it goes to b (the kubelet on a would refuse it: NodeAffinity), not where
    the label was when the agent registered."""
    core = client.CoreV1Api(api_client)
    view = View(api_client, namespace, "", agents, pki[1])
    try:
        core.patch_node(nodes["a"], {"metadata": {"labels": {"zone": "moved"}}})
        core.patch_node(nodes["b"], {"metadata": {"labels": {"zone": "za"}}})
        controller.sync_nodes()
        _create(view, "follows", nodeSelector={"zone": "za"})
        wait_for(lambda: _on(view, "follows") == [nodes["b"]], "follows on b", timeout=60)
    finally:
        for key, agent in agents.items():
            core.patch_node(agent.name, {"metadata": {"labels": {"zone": f"z{key}"}}})


def test_every_bound_pod_is_listed_a_page_at_a_time(api_client, other_namespace, pki):
    """The node-usage listing covers every Pod of the cluster: read whole, a cluster of some ten
    thousand Pods is gigabytes of JSON objects at once (the controller's memory limit is 512Mi).
    It comes in pages, and every bound Pod is counted all the same."""
    core = client.CoreV1Api(api_client)
    node = f"paged-{uuid.uuid4().hex[:6]}"
    for i in range(5):
        core.create_namespaced_pod(other_namespace, {
            "metadata": {"name": f"p{i}"},
            "spec": {"nodeName": node, "automountServiceAccountToken": False, "containers": [
                {"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "100m"}}}]}})
    c = KubeController(api_client, AgentPool(pki[1], deadline=5.0),
                       KubeSettings(list_page=2, watch_timeout=5))
    calls = []
    listing = c.pods.list_pod_for_all_namespaces

    @functools.wraps(listing)
    def spy(**kwargs):
        calls.append(kwargs)
        return listing(**kwargs)

    c.pods.list_pod_for_all_namespaces = spy
    watcher = threading.Thread(target=c._watch_node_pods, daemon=True)
    watcher.start()
    try:
        assert c.usage.wait_synced(30)
        assert c.usage.on([node])[node] == [(Demand(100, 0), "")] * 5
        lists = [k for k in calls if not k.get("watch")]
        assert lists and all(k.get("limit") == 2 for k in lists), lists
        assert any(k.get("_continue") for k in lists)
    finally:
        c._stop.set()
        watcher.join(15)


TAINT = {"key": "dedicated", "value": "infer", "effect": "NoSchedule"}


def _first_condition(controller: KubeController) -> Callable[[], dict | None]:
    """Records the Scheduled condition of each pass (a later pass may overwrite the status
    before a poll reads it); returns what the first pass said, once there is one."""
    seen: list[dict] = []
    write = controller._write_status

    def recording(fastpod, live, allocations, scheduled):
        seen.append(scheduled)
        return write(fastpod, live, allocations, scheduled)

    controller._write_status = recording   # type: ignore[method-assign]
    return lambda: seen[0] if seen else None


def test_a_gpu_node_that_joins_during_a_pass_is_left_to_the_next(api_client, namespace, fastpod_crd,
                                                                  agents, pki, nodes):
    """Node b becomes a GPU node (labelled; tainted, which the replica does not tolerate) while a
    pass is under way: after it worked out which nodes the replica's taints and affinity rule
    out, before it placed. The node sync registers b's agent in between. The pass must not bind
    the replica to b, which it never checked (a is tainted: b was the only node the ledger could
    offer); it is refused naming b, and the next pass checks b (its taint)."""
    core = client.CoreV1Api(api_client)
    label = "fastshare.io/gpu"
    core.patch_node(nodes["a"], {"spec": {"taints": [TAINT]}})
    core.patch_node(nodes["b"], {"metadata": {"labels": {label: "false"}}, "spec": {"taints": [TAINT]}})
    try:
        # node syncs only where this test makes them
        with _running(api_client, namespace, pki, agents, node_interval=3600) as controller:
            assert nodes["b"] not in controller._nodes and controller.core.store.get_node(nodes["b"]) is None
            refresh = controller.refresh_host

            def joined() -> None:   # the pass calls it right after its checks, before placing
                controller.refresh_host = refresh   # type: ignore[method-assign]
                core.patch_node(nodes["b"], {"metadata": {"labels": {label: "true"}}})
                controller.sync_nodes()
                refresh()

            controller.refresh_host = joined   # type: ignore[method-assign]
            first = _first_condition(controller)
            view = View(api_client, namespace, "", agents, pki[1])
            _create(view, "late")
            condition = wait_for(first, "the first pass's status", timeout=60)
            assert controller.refresh_host == refresh, "the pass did not go through the node sync"
            assert condition["status"] == "False", (condition, _on(view, "late"))
            assert f"1 node(s) joined after this placement began (checked on the next pass) ({nodes['b']})" \
                in condition["message"], condition
            wait_for(lambda: "2 node(s) have taint dedicated=infer:NoSchedule" in _refused(view, "late"),
                     "the next pass checks b", timeout=30)
            assert _on(view, "late") == []
    finally:
        core.patch_node(nodes["b"], {"metadata": {"labels": {label: "true"}}})


def test_a_gpu_node_deleted_from_the_cluster_takes_no_replica(api_client, namespace, fastpod_crd, agents,
                                                               pki, nodes):
    """Node b's Node object is deleted while its agent still answers: the ledger keeps b (it is
    marked unavailable only once its heartbeats are missed, here not for long). A replica bound
    to b would never run (the Pod GC deletes it); a is tainted, so b is the only node the ledger
    could offer. The replica is refused, naming b and why."""
    core = client.CoreV1Api(api_client)
    core.patch_node(nodes["a"], {"spec": {"taints": [TAINT]}})
    with _running(api_client, namespace, pki, agents, heartbeat_timeout=600) as controller:
        core.delete_node(nodes["b"])
        try:
            wait_for(lambda: nodes["b"] not in controller._nodes, "b gone from the node sync", timeout=30)
            assert controller.core.is_available(nodes["b"])
            first = _first_condition(controller)
            view = View(api_client, namespace, "", agents, pki[1])
            _create(view, "homeless")
            condition = wait_for(first, "the first pass's status", timeout=60)
            assert condition["status"] == "False", (condition, _on(view, "homeless"))
            assert (f"1 node(s) have no Node object labelled fastshare.io/gpu=true ({nodes['b']})"
                    in condition["message"]), condition
            assert _on(view, "homeless") == []
        finally:
            register_node(core, agents["b"])
            core.patch_node(nodes["b"], {"metadata": {"labels": {"zone": "zb"}}})
