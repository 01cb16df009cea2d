"""The kube-scheduler's rules as fastshare applies them to the Pods it binds itself: quantities,
a Pod's effective request, required node affinity, taints and tolerations, node usage."""

from __future__ import annotations

import pytest
from kubernetes import client

from fastshare.k8s.nodeusage import NodeUsage, host_left
from fastshare.k8s.pods import ALLOCATION_ANNOTATION
from fastshare.k8s.scheduling import (
    Demand,
    NodeFacts,
    Taint,
    TemplateError,
    constraints,
    milli,
    node_facts,
    pod_demand,
    whole,
)

Gi, Mi = 1024**3, 1024**2


@pytest.mark.parametrize(("value", "expected"), [
    ("100m", 100), ("2", 2000), (2, 2000), (0.5, 500), ("0.5", 500), (".25", 250), ("1e3", 1_000_000),
    ("1k", 1_000_000), ("0.1m", 1), ("1500m", 1500),
])
def test_cpu_quantities_in_millicores_rounded_up(value, expected):
    assert milli(value, "cpu") == expected


@pytest.mark.parametrize(("value", "expected"), [(0.1, 100), (1.1, 1100), (0.3, 300), (2.2, 2200), (1e-3, 1)])
def test_a_json_number_counts_as_the_api_server_reads_it(value, expected):
    """``cpu: 0.1`` arrives as the float 0.1 (0.1000000000000000055...); the API server reads
    the number's text, 100m: ten such replicas fit one CPU, not nine."""
    assert milli(value, "cpu") == expected
    assert pod_demand({"containers": [_c({"cpu": 0.1})] * 10}).cpu_milli == 1000


@pytest.mark.parametrize(("value", "expected"), [
    ("1Gi", Gi), ("512Mi", 512 * Mi), ("500M", 500_000_000), ("1e3", 1000), ("1.5Ki", 1536), (1024, 1024),
    ("1k", 1000), ("0.5", 1),
])
def test_memory_quantities_in_bytes(value, expected):
    assert whole(value, "memory") == expected


@pytest.mark.parametrize("value", ["abc", "1x", "", "-1", "1 Gi", None, True, [], {"a": 1}, "nan", "inf"])
def test_malformed_quantities_are_refused_naming_the_field(value):
    with pytest.raises(TemplateError) as caught:
        milli(value, "spec.containers[0].resources.requests.cpu")
    assert caught.value.field == "spec.containers[0].resources.requests.cpu"
    assert str(caught.value).startswith("spec.containers[0].resources.requests.cpu: ")


def _c(requests=None, limits=None, **extra):
    resources = {}
    if requests is not None:
        resources["requests"] = requests
    if limits is not None:
        resources["limits"] = limits
    return {"name": "c", "resources": resources, **extra}


def test_the_effective_request_sums_containers_takes_the_largest_init_step_and_adds_overhead():
    spec = {
        "containers": [_c({"cpu": "500m", "memory": "1Gi"}), _c({"cpu": "250m"}), {"name": "none"}],
        "initContainers": [_c({"cpu": "2", "memory": "128Mi"}), _c({"memory": "3Gi"})],
        "overhead": {"cpu": "100m", "memory": "64Mi"},
    }
    assert pod_demand(spec) == Demand(2000 + 100, 3 * Gi + 64 * Mi)


def test_a_container_without_requests_asks_its_limits():
    assert pod_demand({"containers": [_c(limits={"cpu": "1", "memory": "2Gi"})]}) == Demand(1000, 2 * Gi)
    assert pod_demand({"containers": [_c({"cpu": "200m"}, {"cpu": "1", "memory": "1Gi"})]}) == Demand(200, Gi)


def test_sidecars_run_beside_the_containers_and_the_init_steps_after_them():
    spec = {"containers": [_c({"cpu": "1"})],
            "initContainers": [_c({"cpu": "500m"}, restartPolicy="Always"), _c({"cpu": "2"})]}
    # running: 1 + 0.5 sidecar; the init step after the sidecar: 2 + 0.5
    assert pod_demand(spec).cpu_milli == 2500


def test_a_malformed_request_names_its_container_and_resource():
    spec = {"containers": [_c()], "initContainers": [_c(), _c({"memory": "lots"})]}
    field = r"spec.template.spec.initContainers\[1\].resources.requests.memory"
    with pytest.raises(TemplateError, match=field):
        pod_demand(spec, "spec.template.spec")
    with pytest.raises(TemplateError, match=r"spec.overhead"):
        pod_demand({"containers": [_c()], "overhead": "1"})


NODE = NodeFacts(name="gpu-a", labels=(("tier", "gold"), ("zone", "z1"), ("cores", "64")))


def _affinity(*terms):
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}}


def _expr(key, operator, *values):
    return {"key": key, "operator": operator, **({"values": list(values)} if values else {})}


@pytest.mark.parametrize(("terms", "fits"), [
    ([{"matchExpressions": [_expr("zone", "In", "z1", "z2")]}], True),
    ([{"matchExpressions": [_expr("zone", "In", "z2")]}], False),
    ([{"matchExpressions": [_expr("zone", "NotIn", "z2")]}], True),
    ([{"matchExpressions": [_expr("missing", "NotIn", "x")]}], True),
    ([{"matchExpressions": [_expr("tier", "Exists")]}], True),
    ([{"matchExpressions": [_expr("tier", "DoesNotExist")]}], False),
    ([{"matchExpressions": [_expr("cores", "Gt", "32")]}], True),
    ([{"matchExpressions": [_expr("cores", "Lt", "32")]}], False),
    ([{"matchExpressions": [_expr("zone", "Gt", "1")]}], False),           # not a number: no match
    ([{"matchExpressions": [_expr("zone", "In", "z1"), _expr("tier", "In", "silver")]}], False),  # ANDed
    ([{"matchExpressions": [_expr("tier", "In", "silver")]},
      {"matchExpressions": [_expr("zone", "In", "z1")]}], True),                                   # ORed
    ([{"matchFields": [_expr("metadata.name", "In", "gpu-a")]}], True),
    ([{"matchFields": [_expr("metadata.name", "NotIn", "gpu-a")]}], False),
    ([{}], False),                                                          # an empty term: no node
])
def test_required_node_affinity(terms, fits):
    problem = constraints(_affinity(*terms), "spec.template.spec").problem(NODE, "spec.template.spec")
    assert (problem is None) == fits
    if not fits:
        assert "spec.template.spec.affinity.nodeAffinity.requiredDuringScheduling" in problem


@pytest.mark.parametrize(("spec", "field"), [
    (_affinity({"matchExpressions": [_expr("zone", "Near", "z1")]}), "matchExpressions[0].operator"),
    (_affinity({"matchExpressions": [_expr("zone", "In")]}), "matchExpressions[0].values"),
    (_affinity({"matchExpressions": [_expr("cores", "Gt", "many")]}), "matchExpressions[0].values"),
    (_affinity({"matchExpressions": [_expr("zone", "Exists", "z1")]}), "matchExpressions[0].values"),
    (_affinity({"matchFields": [_expr("metadata.labels", "In", "x")]}), "matchFields[0].key"),
    (_affinity({"matchFields": [_expr("metadata.name", "Exists")]}), "matchFields[0].operator"),
    (_affinity(), "nodeSelectorTerms"),
    ({"affinity": "near"}, "spec.affinity"),
    ({"tolerations": [{"key": "a", "operator": "Like"}]}, "tolerations[0].operator"),
    ({"tolerations": [{"operator": "Equal", "value": "x"}]}, "tolerations[0].operator"),
    ({"tolerations": [{"key": "a", "effect": "Sometimes"}]}, "tolerations[0].effect"),
    ({"tolerations": "all"}, "spec.tolerations"),
])
def test_malformed_affinity_or_tolerations_are_refused_naming_the_field(spec, field):
    with pytest.raises(TemplateError) as caught:
        constraints(spec)
    assert field in caught.value.field


def _tainted(*taints: Taint, unschedulable=False) -> NodeFacts:
    return NodeFacts(name="gpu-a", taints=taints, unschedulable=unschedulable)


DEDICATED = Taint("dedicated", "infer", "NoSchedule")


@pytest.mark.parametrize(("tolerations", "fits"), [
    ([], False),
    ([{"key": "dedicated", "operator": "Equal", "value": "infer", "effect": "NoSchedule"}], True),
    ([{"key": "dedicated", "value": "infer"}], True),                      # operator Equal, any effect
    ([{"key": "dedicated", "value": "train"}], False),
    ([{"key": "dedicated", "operator": "Exists"}], True),
    ([{"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}], False),
    ([{"operator": "Exists"}], True),                                      # empty key + Exists: all
    ([{"key": "other", "operator": "Exists"}], False),
])
def test_taints_against_tolerations(tolerations, fits):
    problem = constraints({"tolerations": tolerations}).problem(_tainted(DEDICATED))
    assert (problem is None) == fits
    if not fits:
        assert "dedicated=infer:NoSchedule" in problem


def test_prefer_no_schedule_taints_do_not_block_and_no_execute_ones_do():
    assert constraints({}).problem(_tainted(Taint("soft", "", "PreferNoSchedule"))) is None
    assert "hard:NoExecute" in constraints({}).problem(_tainted(Taint("hard", "", "NoExecute")))


def test_a_cordoned_node_is_avoided_unless_the_pod_tolerates_the_unschedulable_taint():
    assert "cordoned" in constraints({}).problem(_tainted(unschedulable=True))
    tolerant = {"tolerations": [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]}
    assert constraints(tolerant).problem(_tainted(unschedulable=True)) is None


def test_node_facts_from_a_node_object():
    node = client.V1Node(
        metadata=client.V1ObjectMeta(name="gpu-a", labels={"zone": "z1"}),
        spec=client.V1NodeSpec(unschedulable=True,
                               taints=[client.V1Taint(key="k", value="v", effect="NoSchedule")]),
        status=client.V1NodeStatus(allocatable={"cpu": "7800m", "memory": "31Gi"}))
    assert node_facts(node) == NodeFacts("gpu-a", (("zone", "z1"),), (Taint("k", "v", "NoSchedule"),), True,
                                         Demand(7800, 31 * Gi))
    bare = node_facts(client.V1Node(metadata=client.V1ObjectMeta(name="new")))  # no kubelet report yet
    assert bare.allocatable == Demand() and not bare.taints and not bare.unschedulable
    assert bare.max_pods == 0 and bare.pods_problem(500) is None      # no limit known: none applied
    full = node_facts(client.V1Node(metadata=client.V1ObjectMeta(name="full"),
                                    status=client.V1NodeStatus(allocatable={"pods": "110"})))
    assert full.max_pods == 110 and full.pods_problem(109) is None
    assert "status.allocatable.pods" in full.pods_problem(110)


def _pod(name, node, cpu, memory="0", phase="Running", allocation=None):
    annotations = {ALLOCATION_ANNOTATION: allocation} if allocation else {}
    return {"metadata": {"namespace": "ns", "name": name, "annotations": annotations},
            "spec": {"nodeName": node, "containers": [_c({"cpu": cpu, "memory": memory})]},
            "status": {"phase": phase}}


def test_node_usage_counts_bound_running_pods_per_node():
    usage = NodeUsage()
    usage.replace([_pod("a", "n1", "1"), _pod("b", "n1", "500m", allocation="fs-1"), _pod("c", "n2", "2"),
                   _pod("done", "n1", "8", phase="Succeeded"), _pod("unbound", "", "8")])
    assert usage.synced
    on_n1 = usage.on(["n1"])["n1"]
    assert sorted(on_n1, key=str) == sorted([(Demand(1000, 0), ""), (Demand(500, 0), "fs-1")], key=str)
    usage.put(_pod("a", "n1", "1", phase="Failed"))   # ended: no longer counted
    usage.remove(_pod("b", "n1", "500m"))
    assert usage.on(["n1", "n9"]) == {"n1": [], "n9": []}


def test_a_pod_whose_share_the_engine_holds_is_not_counted_twice():
    allocatable = Demand(4000, 8 * Gi)
    pods = [(Demand(1000, Gi), ""), (Demand(500, 512 * Mi), "fs-1"), (Demand(700, 0), "fs-gone")]
    # fs-1 counted by the engine at its full request; fs-gone (released) counts as any Pod
    assert host_left(allocatable, pods, {"fs-1": (500, 512)}) == Demand(4000 - 1000 - 700, 7 * Gi)
    # an allocation recorded before requests were counted (0): its Pod still counts in full
    assert host_left(allocatable, pods, {"fs-1": (0, 0)}) == Demand(4000 - 2200, 8 * Gi - Gi - 512 * Mi)
    assert host_left(Demand(1000, 0), [(Demand(3000, 0), "")], {}).cpu_milli == -2000   # over-committed


class _CountedName(str):
    """A node name that counts how often it is hashed (looked up)."""

    looked_at = 0

    def __hash__(self):
        type(self).looked_at += 1
        return str.__hash__(self)


def test_a_node_s_pods_are_found_without_going_through_every_pod_of_the_cluster():
    """Placement asks for the GPU nodes' Pods on every pass that creates replicas: that must not
    cost a walk over every Pod of a big cluster (most of them on other nodes)."""
    usage = NodeUsage()
    usage.replace([_pod(f"other-{i}", _CountedName(f"cpu-node-{i % 50}"), "100m") for i in range(2000)]
                  + [_pod("mine", "gpu-1", "1", allocation="fs-1")])
    usage.put(_pod("moved", _CountedName("cpu-node-1"), "1"))
    usage.put(_pod("moved", "gpu-1", "2"))              # re-bound (a new Pod of the same name)
    _CountedName.looked_at = 0
    found = usage.on(["gpu-1", "gpu-2"])
    assert _CountedName.looked_at == 0
    expected = [(Demand(1000, 0), "fs-1"), (Demand(2000, 0), "")]
    assert sorted(found["gpu-1"], key=str) == sorted(expected, key=str)
    assert found["gpu-2"] == []
    usage.remove(_pod("moved", "gpu-1", "2"))
    usage.put(_pod("mine", "gpu-1", "1", phase="Succeeded"))
    assert usage.on(["gpu-1", "cpu-node-1"]) == {"gpu-1": [], "cpu-node-1": [(Demand(100, 0), "")] * 40}


def test_a_copy_of_a_replica_pod_counts_in_full():
    """``kubectl debug --copy-to --same-node`` copies a replica Pod with its annotations: the
    kubelet counts both Pods, the engine holds one share; only one Pod is covered by it."""
    pods = [(Demand(1000, Gi), "fs-1"), (Demand(1000, Gi), "fs-1")]
    assert host_left(Demand(4000, 8 * Gi), pods, {"fs-1": (1000, 1024)}) == Demand(3000, 7 * Gi)


@pytest.mark.parametrize(("label", "fits"), [("64", True), ("+64", True), ("1_000", False), ("٦٤", False),
                                             ("64.0", False)])
def test_gt_compares_integers_as_kubernetes_reads_them(label, fits):
    """Gt/Lt parse both sides as Go's strconv.ParseInt(s, 10, 64) does: Python's int() also
    takes "1_000" or other scripts' digits, which on a node label match nothing in Kubernetes."""
    node = NodeFacts(name="gpu-a", labels=(("cores", label),))
    spec = _affinity({"matchExpressions": [_expr("cores", "Gt", "32")]})
    assert (constraints(spec).problem(node) is None) == fits
    with pytest.raises(TemplateError, match="needs an integer"):
        constraints(_affinity({"matchExpressions": [_expr("cores", "Gt", "3_2")]}))
