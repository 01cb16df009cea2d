"""The kube-scheduler's rules as fastshare applies them to the Pods it binds itself: quantities,
a Pod's effective request (extended resources, Pod-level resources), required node affinity,
taints and tolerations, node usage."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastshare.k8s.nodeusage import NodeUsage, extended_used, host_left, pods_left
from fastshare.k8s.pods import ALLOCATION_ANNOTATION, spec_of
from fastshare.k8s.resources import fastpod_manifest
from fastshare.k8s.scheduling import (
    Demand,
    NodeFacts,
    Taint,
    TemplateError,
    constraints,
    milli,
    node_facts,
    pod_demand,
    pod_running_demand,
    refuse_gpu_resources,
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


@pytest.mark.parametrize("value", ["abc", "1x", "", "-1", "1 Gi", "1Gi\n", None, True, [], {"a": 1},
                                   "nan", "inf"])
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
    (_affinity({"matchExpressions": [_expr("", "Exists")]}), "matchExpressions[0]"),   # no key
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
    node = {"metadata": {"name": "gpu-a", "labels": {"zone": "z1"}},
            "spec": {"unschedulable": True, "taints": [{"key": "k", "value": "v", "effect": "NoSchedule"},
                                                       {"key": "j", "effect": "NoExecute"}]},
            "status": {"allocatable": {"cpu": "7800m", "memory": "31Gi"}}}
    taints = (Taint("k", "v", "NoSchedule"), Taint("j", "", "NoExecute"))
    assert node_facts(node) == NodeFacts("gpu-a", (("zone", "z1"),), taints, True, Demand(7800, 31 * Gi))
    bare = node_facts({"metadata": {"name": "new"}})  # no kubelet report yet
    assert bare.allocatable == Demand() and not bare.taints and not bare.unschedulable
    assert bare.max_pods == 0                                          # no limit known
    full = node_facts({"metadata": {"name": "full"}, "status": {"allocatable": {"pods": "110"}}})
    assert full.max_pods == 110


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


def test_a_node_usage_relist_keeps_what_was_put_or_removed_after_its_snapshot():
    """The controller puts a replica's Pod in from its create's reply, before the watch reports
    it; a listing taken earlier must not drop it (its host ports and devices would look free to
    the next replica), nor bring back a Pod removed after it."""
    def versioned(pod, version):
        pod["metadata"]["resourceVersion"] = str(version)
        return pod

    usage = NodeUsage()
    usage.replace([versioned(_pod("old", "n1", "1"), 3), versioned(_pod("gone", "n1", "2"), 4)], "5")
    usage.put(versioned(_pod("created", "n2", "500m", allocation="fs-1"), 10))
    usage.remove(versioned(_pod("gone", "n1", "2"), 11))
    usage.replace([versioned(_pod("old", "n1", "1"), 3), versioned(_pod("gone", "n1", "2"), 4)], "8")
    assert usage.on(["n1", "n2"]) == {"n1": [(Demand(1000, 0), "")], "n2": [(Demand(500, 0), "fs-1")]}
    usage.replace([versioned(_pod("old", "n1", "1"), 3)], "12")   # newer than both: it is the truth
    assert usage.on(["n1", "n2"]) == {"n1": [(Demand(1000, 0), "")], "n2": []}


def test_a_pod_whose_share_the_engine_holds_is_not_counted_twice():
    allocatable = Demand(4000, 8 * Gi)
    pods = [(Demand(1000, Gi), ""), (Demand(500, 512 * Mi), "fs-1"), (Demand(700, 0), "fs-gone")]
    # fs-1 counted by the engine at its full request; fs-gone (released) counts as any Pod
    assert host_left(allocatable, pods, {"fs-1": (500, 512)}) == Demand(4000 - 1000 - 700, 7 * Gi)
    # an allocation recorded before requests were counted (0): its Pod still counts in full
    assert host_left(allocatable, pods, {"fs-1": (0, 0)}) == Demand(4000 - 2200, 8 * Gi - Gi - 512 * Mi)
    assert host_left(Demand(1000, 0), [(Demand(3000, 0), "")], {}).cpu_milli == -2000   # over-committed


def test_a_nodes_room_for_shares_counts_every_pod_but_those_the_engine_holds():
    """The engine counts its own assignments against the room (set_room): a Pod of one it holds
    there counts once (a copy with the same annotation counts as any Pod), every other Pod
    (another's, or of a released share) takes a place."""
    pods = [(Demand(), ""), (Demand(), "fs-1"), (Demand(), "fs-1"), (Demand(), "fs-gone")]
    assert pods_left(110, pods, {"fs-1": (0, 0)}) == 110 - 3
    assert pods_left(3, pods, {}) == -1   # over-committed


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


# -- extended resources, hugepages, ephemeral storage ------------------------------------------------
FOO = "example.com/foo"


def _x(amount, name=FOO, **extra):
    """A container asking ``amount`` of ``name`` (request = limit, as the API server wants it)."""
    return _c({name: amount}, {name: amount}, **extra)


def test_extended_resources_follow_the_same_rule_as_cpu():
    spec = {"containers": [_x("1"), _x(2), _c(limits={FOO: "1", "hugepages-2Mi": "4Mi"})],
            "initContainers": [_x("2", restartPolicy="Always"), _x("5", name="rdma/hca"), _x("3")],
            "overhead": {"rdma/hca": "1"}}
    # running: 1 + 2 + 1 + the sidecar's 2; init steps: sidecar 2 + 3 = 5 foo, rdma/hca 5
    assert pod_demand(spec).extended == ((FOO, 6), ("hugepages-2Mi", 4 * Mi), ("rdma/hca", 5 + 1))
    disk = {"containers": [_c({"ephemeral-storage": "1Gi"})]}
    assert pod_demand(disk).extended == (("ephemeral-storage", Gi),)
    assert pod_demand({"containers": [_c({"cpu": "1"})]}) == Demand(1000, 0)   # none asked: none counted


@pytest.mark.parametrize(("container", "field", "words"), [
    (_x("1.5"), "requests[example.com/foo]", "must be an integer"),
    (_x("500m"), "requests[example.com/foo]", "must be an integer"),
    (_x("lots"), "requests[example.com/foo]", "is not a quantity"),
    (_c({FOO: "1"}, {FOO: "2"}), "requests[example.com/foo]", "must equal its limit"),
    (_c({FOO: "1"}), "limits[example.com/foo]", "must be set"),
    (_c({"hugepages-2Mi": "2Mi"}, {"hugepages-2Mi": "4Mi"}), "requests.hugepages-2Mi", "equal"),
    (_c({"gpus": "1"}), "requests.gpus", "fully qualified extended resource"),
])
def test_a_malformed_extended_request_is_refused_naming_the_field(container, field, words):
    with pytest.raises(TemplateError) as caught:
        pod_demand({"containers": [_c(), container]}, "spec.template.spec")
    assert caught.value.field == f"spec.template.spec.containers[1].resources.{field}"
    assert words in caught.value.detail


def test_a_node_s_other_resources_and_what_they_leave():
    node = node_facts({"metadata": {"name": "n"}, "status": {"allocatable": {
        "cpu": "4", "memory": "8Gi", "pods": "110", FOO: "2", "hugepages-2Mi": "0",
        "ephemeral-storage": "100Gi", "example.com/odd": "x"}}})
    assert node.extended == (("ephemeral-storage", 100 * Gi), (FOO, 2), ("hugepages-2Mi", 0))
    one = Demand(extended=((FOO, 1),))
    assert node.extended_problem(one, {}) is None
    assert node.extended_problem(one, {FOO: 1}) is None
    assert node.extended_problem(one, {FOO: 2}) == "have 0 example.com/foo free, the replica asks 1"
    assert node.extended_problem(Demand(extended=((FOO, 2),)), {FOO: 1}) == \
        "have 1 example.com/foo free, the replica asks 2"
    assert node.extended_problem(Demand(extended=(("rdma/hca", 1),)), {}) == \
        "have no rdma/hca (status.allocatable)"
    assert node.extended_problem(Demand(extended=(("hugepages-2Mi", 4 * Mi),)), {}) == \
        "have 0 hugepages-2Mi free, the replica asks 4Mi"
    assert node.extended_problem(Demand(extended=(("ephemeral-storage", 60 * Gi),)),
                                 {"ephemeral-storage": 50 * Gi}) == \
        "have 50Gi ephemeral-storage free, the replica asks 60Gi"
    assert node_facts({"metadata": {"name": "bare"}}).extended_problem(one, {}) == \
        "have no example.com/foo (status.allocatable)"


def test_bound_pods_and_replicas_not_yet_seen_use_a_node_s_devices():
    usage = NodeUsage()
    foreign = {"metadata": {"namespace": "o", "name": "f"},
               "spec": {"nodeName": "n1", "containers": [_x("1"), _x("2", name="rdma/hca")]},
               "status": {"phase": "Running"}}
    mine = {"metadata": {"namespace": "ns", "name": "r", "annotations": {ALLOCATION_ANNOTATION: "fs-1"}},
            "spec": {"nodeName": "n1", "containers": [_x("1")]}, "status": {"phase": "Pending"}}
    usage.replace([foreign, mine])
    pods = usage.on(["n1"])["n1"]
    asked = Demand(extended=((FOO, 1),))
    # fs-1's Pod is seen: counted once, by its Pod; fs-2's is not yet: counted by its request
    assert extended_used(pods, {"fs-1": asked, "fs-2": asked}) == {FOO: 3, "rdma/hca": 2}
    assert extended_used([], {}) == {}


# -- Pod-level resources (spec.resources, KEP 2837) ---------------------------------------------------
def test_pod_level_requests_replace_the_containers_sum_and_overhead_adds():
    spec = {"resources": {"requests": {"cpu": "2", "memory": "1Gi"}},
            "containers": [_c({"cpu": "500m", "memory": "256Mi"}), _x("1")],
            "overhead": {"cpu": "100m", "memory": "10Mi"}}
    assert pod_demand(spec) == Demand(2100, Gi + 10 * Mi, ((FOO, 1),))
    only_cpu = {"resources": {"requests": {"cpu": "2"}}, "containers": [_c({"cpu": "1", "memory": "1Gi"})]}
    assert pod_demand(only_cpu) == Demand(2000, Gi)      # memory: the containers' sum


def test_pod_level_limits_default_the_request_as_the_api_server_does():
    # no container asks: the pod-level limit
    assert pod_demand({"resources": {"limits": {"cpu": "3", "memory": "2Gi"}},
                       "containers": [_c()]}) == Demand(3000, 2 * Gi)
    # a container asks CPU: the containers' sum; none asks memory: the limit
    spec = {"resources": {"limits": {"cpu": "3", "memory": "2Gi"}},
            "containers": [_c({"cpu": "1"}), _c({"cpu": "500m"})]}
    assert pod_demand(spec) == Demand(1500, 2 * Gi)
    # an explicit pod-level request wins over both
    spec["resources"]["requests"] = {"cpu": "2"}
    assert pod_demand(spec) == Demand(2000, 2 * Gi)
    hugepages = {"resources": {"limits": {"memory": "1Gi", "hugepages-2Mi": "8Mi"}}, "containers": [_c()]}
    assert pod_demand(hugepages) == Demand(0, Gi, (("hugepages-2Mi", 8 * Mi),))


@pytest.mark.parametrize(("resources", "field"), [
    ({"requests": {"cpu": "a lot"}}, "spec.resources.requests.cpu"),
    ({"limits": {"memory": "-1"}}, "spec.resources.limits.memory"),
    ({"requests": {FOO: "1"}}, "spec.resources.requests[example.com/foo]"),
    ({"limits": {"ephemeral-storage": "1Gi"}}, "spec.resources.limits.ephemeral-storage"),
    ("2", "spec.resources"),
])
def test_malformed_pod_level_resources_are_refused_naming_the_field(resources, field):
    with pytest.raises(TemplateError) as caught:
        pod_demand({"resources": resources, "containers": [_c()]})
    assert caught.value.field == field


def test_a_bound_pod_with_pod_level_resources_counts_by_them():
    usage = NodeUsage()
    usage.replace([{"metadata": {"namespace": "o", "name": "p"}, "status": {"phase": "Running"},
                    "spec": {"nodeName": "n1", "resources": {"requests": {"cpu": "2", "memory": "1Gi"}},
                             "containers": [_c()]}}])
    assert usage.on(["n1"])["n1"] == [(Demand(2000, Gi), "")]


@given(st.lists(st.integers(0, 4), min_size=1, max_size=4), st.lists(st.integers(0, 4), max_size=3),
       st.integers(0, 8000), st.integers(0, 2000))
def test_pod_level_cpu_is_the_pod_s_whatever_its_containers_ask(containers, inits, pod_cpu, overhead):
    """The containers' devices add as CPU does; the pod-level CPU request replaces their sum."""
    spec = {"containers": [_c({"cpu": f"{n}00m", FOO: n}, {FOO: n}) for n in containers],
            "initContainers": [_x(n) for n in inits], "overhead": {"cpu": f"{overhead}m"}}
    plain = pod_demand(spec)
    expected_foo = max(sum(containers), max(inits, default=0))
    assert plain.cpu_milli == 100 * sum(containers) + overhead
    assert dict(plain.extended).get(FOO, 0) == expected_foo
    pod_level = pod_demand({**spec, "resources": {"requests": {"cpu": f"{pod_cpu}m"}}})
    assert pod_level == Demand(pod_cpu + overhead, 0, plain.extended)
    bound = {"spec": {**spec, "resources": {"requests": {"cpu": f"{pod_cpu}m"}}}}
    assert pod_running_demand(bound) == pod_level


# -- GPUs are fastshare's --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"])
def test_a_template_asking_the_device_plugin_for_a_gpu_is_refused(name):
    template = {"spec": {"containers": [_c(), _c(limits={name: "1"})]}}
    with pytest.raises(TemplateError) as caught:
        spec_of(fastpod_manifest("g", {"kind": "mps", "memory": "1Gi"}, template=template))
    assert caught.value.field == f"spec.template.spec.containers[1].resources.limits[{name}]"
    assert "spec.gpu" in caught.value.detail
    refuse_gpu_resources({"containers": [_x("1")]})    # other devices are the template's to ask
    # a foreign Pod using the device plugin elsewhere is counted as any other
    assert pod_demand({"containers": [_x("1", name="nvidia.com/gpu")]}).extended == (("nvidia.com/gpu", 1),)
