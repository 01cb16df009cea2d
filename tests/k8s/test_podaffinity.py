"""Inter-pod affinity, anti-affinity and topology spread as fastshare applies them to the Pods it
binds itself (the kube-scheduler's InterPodAffinity and PodTopologySpread filters): reading the
template's fields, and which nodes each rule leaves."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastshare.k8s.controller import PlacementLock
from fastshare.k8s.peers import PodPeers
from fastshare.k8s.podaffinity import (
    HOSTNAME,
    Incoming,
    Peer,
    needs_namespaces,
    peer,
    pod_rules,
    replica_incoming,
    ruled_out,
)
from fastshare.k8s.pods import TEMPLATE_HASH_LABEL, template_hash
from fastshare.k8s.scheduling import NodeFacts, Taint, TemplateError, constraints

ANTI = "spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution"
AFF = "spec.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution"
SPREAD = "spec.topologySpreadConstraints"


def _node(name, zone=None, taints=(), **labels):
    if zone is not None:
        labels["zone"] = zone
    return NodeFacts(name, tuple(sorted({HOSTNAME: name, **labels}.items())), tuple(taints))


def _nodes(*nodes):
    return {n.name: n for n in nodes}


def _term(key=HOSTNAME, **selector):
    return {"labelSelector": {"matchLabels": selector}, "topologyKey": key}


def _incoming(spec, labels=None, namespace="ns"):
    labels = {"app": "web"} if labels is None else labels
    return Incoming(namespace, labels, pod_rules(spec, namespace, labels), constraints(spec),
                    spec.get("nodeSelector") or {})


def _pod(node, labels=None, namespace="ns", name=None, spec=None, terminating=False):
    meta = {"name": name or f"p-{node}-{id(labels)}", "namespace": namespace, "labels": labels or {}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return peer({"metadata": meta, "spec": {"nodeName": node, **(spec or {})},
                 "status": {"phase": "Running"}})


def _ts(**constraint):
    return {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                           "whenUnsatisfiable": "DoNotSchedule", **constraint}]}


def _anti(*terms):
    return {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": list(terms)}}}


def _aff(*terms):
    return {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": list(terms)}}}


# -- reading ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "field"), [
    (_anti({"labelSelector": {}, "topologyKey": ""}), f"{ANTI}[0].topologyKey"),
    (_anti(_term(), {"labelSelector": {}}), f"{ANTI}[1].topologyKey"),
    (_anti("x"), f"{ANTI}[0]"),
    (_aff({"topologyKey": "zone", "labelSelector": {"matchExpressions": [{"key": "a", "operator": "Gt",
                                                                          "values": ["1"]}]}}),
     f"{AFF}[0].labelSelector.matchExpressions[0].operator"),
    (_aff({"topologyKey": "zone", "labelSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}),
     f"{AFF}[0].labelSelector.matchExpressions[0].values"),
    (_aff({"topologyKey": "zone", "labelSelector": {"matchLabels": {"a": 1}}}),
     f"{AFF}[0].labelSelector.matchLabels"),
    (_aff({"topologyKey": "zone", "matchLabelKeys": ["app"]}), f"{AFF}[0].matchLabelKeys"),
    (_aff({"topologyKey": "zone", "labelSelector": {}, "matchLabelKeys": ["a"], "mismatchLabelKeys": ["a"]}),
     f"{AFF}[0].mismatchLabelKeys"),
    (_aff({"topologyKey": "zone", "labelSelector": {}, "namespaces": "ns"}), f"{AFF}[0].namespaces"),
    (_aff({"topologyKey": "zone", "labelSelector": {}, "namespaceSelector": []}),
     f"{AFF}[0].namespaceSelector"),
    ({"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}}, AFF),
    ({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 0, "podAffinityTerm": _term()}]}}},
     "spec.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight"),
    ({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 5, "podAffinityTerm": {"labelSelector": {}}}]}}},
     "spec.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].podAffinityTerm"
     ".topologyKey"),
    ({"topologySpreadConstraints": {}}, SPREAD),
    (_ts(maxSkew=0), f"{SPREAD}[0].maxSkew"),
    (_ts(topologyKey=None), f"{SPREAD}[0].topologyKey"),
    (_ts(whenUnsatisfiable="Never"), f"{SPREAD}[0].whenUnsatisfiable"),
    (_ts(whenUnsatisfiable="ScheduleAnyway", minDomains=2), f"{SPREAD}[0].minDomains"),
    (_ts(minDomains=0), f"{SPREAD}[0].minDomains"),
    (_ts(nodeAffinityPolicy="Sometimes"), f"{SPREAD}[0].nodeAffinityPolicy"),
    (_ts(nodeTaintsPolicy="honor"), f"{SPREAD}[0].nodeTaintsPolicy"),
    (_ts(matchLabelKeys=["app"]), f"{SPREAD}[0].matchLabelKeys"),
    ({"topologySpreadConstraints": _ts()["topologySpreadConstraints"] * 2}, f"{SPREAD}[1]"),
    ({"affinity": "x"}, "spec.affinity"),
    ({"affinity": {"podAffinity": []}}, "spec.affinity.podAffinity"),
    (_anti({"labelSelector": {}, "topologyKey": 5}), f"{ANTI}[0].topologyKey"),
    (_aff({"topologyKey": "zone", "labelSelector": {"matchLabels": ["a"]}}),
     f"{AFF}[0].labelSelector.matchLabels"),
    (_aff({"topologyKey": "zone", "labelSelector": {"matchExpressions": {"key": "a", "operator": "Exists"}}}),
     f"{AFF}[0].labelSelector.matchExpressions"),
    (_aff({"topologyKey": "zone", "labelSelector": {}, "matchLabelKeys": "version"}),
     f"{AFF}[0].matchLabelKeys"),
    (_aff({"topologyKey": "zone", "labelSelector": {}, "matchLabelKeys": [""]}), f"{AFF}[0].matchLabelKeys"),
    (_aff({"topologyKey": "zone", "labelSelector": {}, "mismatchLabelKeys": ["a", "a"]}),
     f"{AFF}[0].mismatchLabelKeys"),
    (_aff({"topologyKey": "zone", "labelSelector": {}, "namespaces": [""]}), f"{AFF}[0].namespaces"),
    (_aff({"topologyKey": "zone", "labelSelector": {}, "namespaces": [5]}), f"{AFF}[0].namespaces"),
    (_aff({"topologyKey": "zone", "labelSelector": {}, "matchLabelKeys": [5]}), f"{AFF}[0].matchLabelKeys"),
    ({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 101, "podAffinityTerm": _term()}]}}},
     "spec.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight"),
    ({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": {}}}},
     "spec.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution"),
    ({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 5}]}}},
     "spec.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"),
    ({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": ["x"]}}},
     "spec.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"),
    ({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": True, "podAffinityTerm": _term()}]}}},
     "spec.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight"),
    ({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": "5", "podAffinityTerm": _term()}]}}},
     "spec.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight"),
    (_aff({"topologyKey": "zone", "mismatchLabelKeys": ["app"]}), f"{AFF}[0].mismatchLabelKeys"),
    ({"topologySpreadConstraints": ["x"]}, f"{SPREAD}[0]"),
    (_ts(labelSelector={"matchLabels": {"a": 1}}), f"{SPREAD}[0].labelSelector.matchLabels"),
    (_ts(labelSelector={}, matchLabelKeys=["a", "a"]), f"{SPREAD}[0].matchLabelKeys"),
    (_ts(maxSkew=True), f"{SPREAD}[0].maxSkew"),
    (_ts(maxSkew="2"), f"{SPREAD}[0].maxSkew"),
])
def test_unreadable_rules_are_refused_naming_the_field(spec, field):
    with pytest.raises(TemplateError) as caught:
        pod_rules(spec, "ns", {"app": "web"})
    assert caught.value.field == field, caught.value


def test_any_one_kind_of_rule_makes_a_pod_ruled():
    """A Pod with rules is placed alone and checked; one kind of rule is enough."""
    assert pod_rules(_aff(_term(app="web")), "ns", {})
    assert pod_rules(_anti(_term(app="web")), "ns", {})
    assert pod_rules(_ts(labelSelector={}), "ns", {})
    assert not pod_rules({}, "ns", {})


def test_preferences_and_schedule_anyway_are_read_but_forbid_nothing():
    spec = {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": weight, "podAffinityTerm": _term(app="web")} for weight in (1, 10, 100)]}},
        **_ts(whenUnsatisfiable="ScheduleAnyway", labelSelector={})}
    assert not pod_rules(spec, "ns", {"app": "web"})


def test_one_constraint_per_topology_key_and_when_unsatisfiable():
    """Only the same pair twice is refused (as by the API server): one key may have a
    DoNotSchedule and a ScheduleAnyway constraint, and two keys one DoNotSchedule each."""
    zone, = _ts(labelSelector={})["topologySpreadConstraints"]
    both = [zone, {**zone, "whenUnsatisfiable": "ScheduleAnyway"}, {**zone, "topologyKey": HOSTNAME}]
    rules = pod_rules({"topologySpreadConstraints": both}, "ns", {})
    assert [c.topology_key for c in rules.spread] == ["zone", HOSTNAME]


def test_a_term_selects_its_own_pods_namespace_unless_told_otherwise():
    own = pod_rules(_anti(_term(app="web")), "ns", {}).anti_affinity[0]
    assert own.selects("ns", {"app": "web"}, {}) and not own.selects("other", {"app": "web"}, {})
    listed = pod_rules(_anti({**_term(app="web"), "namespaces": ["a", "b"]}), "ns", {}).anti_affinity[0]
    assert listed.selects("b", {"app": "web"}, {}) and not listed.selects("ns", {"app": "web"}, {})
    every = pod_rules(_anti({**_term(app="web"), "namespaceSelector": {}}), "ns", {}).anti_affinity[0]
    assert every.selects("anything", {"app": "web"}, {})
    labelled = pod_rules(_anti({**_term(app="web"), "namespaceSelector": {"matchLabels": {"team": "x"}}}),
                         "ns", {}).anti_affinity[0]
    teams = {"a": {"team": "x"}, "b": {"team": "y"}}
    assert labelled.selects("a", {"app": "web"}, teams) and not labelled.selects("b", {"app": "web"}, teams)
    assert not labelled.selects("ns", {"app": "web"}, teams)   # a selector given: not its own by default


def test_no_label_selector_selects_no_pod_and_an_empty_one_every_pod():
    none = pod_rules(_anti({"topologyKey": HOSTNAME}), "ns", {}).anti_affinity[0]
    assert not none.selects("ns", {}, {}) and not none.selects("ns", {"app": "web"}, {})
    empty = pod_rules(_anti({"topologyKey": HOSTNAME, "labelSelector": {}}), "ns", {}).anti_affinity[0]
    assert empty.selects("ns", {}, {}) and empty.selects("ns", {"x": "y"}, {})


def test_selector_expressions_take_every_label_selector_operator():
    term = {"topologyKey": HOSTNAME, "labelSelector": {"matchExpressions": [
        {"key": "app", "operator": "NotIn", "values": ["db"]}, {"key": "tier", "operator": "Exists"},
        {"key": "canary", "operator": "DoesNotExist"}]}}
    selects = pod_rules(_anti(term), "ns", {}).anti_affinity[0].selects
    assert selects("ns", {"app": "web", "tier": "hot"}, {}) and selects("ns", {"tier": "hot"}, {})
    assert not selects("ns", {"app": "db", "tier": "hot"}, {})
    assert not selects("ns", {"app": "web"}, {})
    assert not selects("ns", {"app": "web", "tier": "hot", "canary": "yes"}, {})


def test_match_and_mismatch_label_keys_take_the_pods_own_values():
    term = {"topologyKey": HOSTNAME, "labelSelector": {"matchLabels": {"app": "web"}},
            "matchLabelKeys": ["version"], "mismatchLabelKeys": ["team"]}
    rules = pod_rules(_anti(term), "ns", {"app": "web", "version": "v2", "team": "a"}).anti_affinity[0]
    assert rules.selects("ns", {"app": "web", "version": "v2", "team": "b"}, {})
    assert not rules.selects("ns", {"app": "web", "version": "v1", "team": "b"}, {})
    assert not rules.selects("ns", {"app": "web", "version": "v2", "team": "a"}, {})
    # keys the Pod does not carry are left out, as by the API server
    plain = pod_rules(_anti(term), "ns", {"app": "web"}).anti_affinity[0]
    assert plain.selects("ns", {"app": "web", "version": "v1", "team": "a"}, {})


# -- anti-affinity -----------------------------------------------------------------------------------------
def test_hostname_anti_affinity_rules_out_nodes_running_a_selected_pod_and_names_the_term():
    nodes = _nodes(_node("a"), _node("b"), _node("c"))
    web = _incoming(_anti(_term(app="web")))
    peers = [_pod("a", {"app": "web"}), _pod("b", {"app": "db"}),
             _pod("c", {"app": "web"}, namespace="other")]
    out = ruled_out(web, nodes, nodes, peers, {})
    assert out == {"a": f"run a Pod in their {HOSTNAME} that {ANTI}[0] of podAntiAffinity selects"}


def test_zone_anti_affinity_rules_out_the_whole_zone_and_nodes_without_the_key_are_free():
    nodes = _nodes(_node("a", "z1"), _node("b", "z1"), _node("c", "z2"), _node("d"))
    web = _incoming(_anti(_term("zone", app="web")))
    assert set(ruled_out(web, nodes, nodes, [_pod("a", {"app": "web"})], {})) == {"a", "b"}


def test_an_existing_pods_anti_affinity_keeps_a_pod_it_selects_out_of_its_domain():
    nodes = _nodes(_node("a", "z1"), _node("b", "z1"), _node("c", "z2"))
    lonely = _pod("a", {"app": "lonely"}, namespace="other", name="lonely",
                  spec=_anti({**_term("zone", app="web"), "namespaceSelector": {}}))
    out = ruled_out(_incoming({}), nodes, nodes, [lonely], {})
    assert set(out) == {"a", "b"}
    assert out["b"] == ('are in the zone "z1" of Pod other/lonely, whose required podAntiAffinity '
                        "selects this Pod")
    assert ruled_out(_incoming({}, {"app": "db"}), nodes, nodes, [lonely], {}) == {}
    # each message names the Pod whose term forbids that node's zone
    guard = _pod("c", {}, namespace="other", name="guard",
                 spec=_anti({**_term("zone", app="web"), "namespaceSelector": {}}))
    both = ruled_out(_incoming({}), nodes, nodes, [lonely, guard], {})
    assert both["b"] == out["b"] and "Pod other/guard" in both["c"]
    # its term without namespaces: only its own namespace's Pods
    shy = _pod("a", {}, namespace="other", spec=_anti(_term("zone", app="web")))
    assert ruled_out(_incoming({}), nodes, nodes, [shy], {}) == {}


def test_an_existing_pods_term_that_does_not_select_the_pod_forbids_nothing_beside_one_that_does():
    nodes = _nodes(_node("a", "z1"), _node("b", "z1"), _node("c", "z2"))
    picky = _pod("a", {}, name="picky", spec=_anti(_term(app="web"), _term("zone", app="db")))
    assert set(ruled_out(_incoming({}), nodes, nodes, [picky], {})) == {"a"}


def test_namespaces_are_read_only_when_a_term_that_can_select_the_pod_selects_them_by_label():
    """Listing every Namespace is a cluster-wide read per pass: not for a term that cannot
    select the replica, nor for an empty namespaceSelector (every namespace, whatever its labels)."""
    teams = {"namespaceSelector": {"matchLabels": {"team": "x"}}}
    web = _incoming({})
    for_web = _pod("a", {}, namespace="other", spec=_anti({**_term(app="web"), **teams}))
    for_db = _pod("a", {}, namespace="other", spec=_anti({**_term(app="db"), **teams}))
    everywhere = _pod("a", {}, namespace="other", spec=_anti({**_term(app="web"), "namespaceSelector": {}}))
    assert needs_namespaces(web, [for_web])
    assert not needs_namespaces(web, [for_db, everywhere])
    assert needs_namespaces(_incoming(_anti({**_term(app="db"), **teams})), [])
    assert not needs_namespaces(_incoming(_aff({**_term(app="db"), "namespaceSelector": {}})), [for_db])
    no_pod = _pod("a", {}, namespace="other", spec=_anti({"topologyKey": HOSTNAME, **teams}))
    assert not needs_namespaces(web, [no_pod])   # no labelSelector: it selects no Pod


def test_pods_on_a_node_missing_from_the_node_listing_count_nowhere():
    """A Node deleted while its Pods are still listed (garbage collection runs later): its Pods
    are in no domain, as in the scheduler's snapshot, rather than stopping the placement."""
    nodes = _nodes(_node("a", "z1"), _node("b", "z2"))
    on_gone = [_pod("gone", {"app": "web"}), _pod("gone", {}, name="lonely", spec=_anti(_term("zone")))]
    assert ruled_out(_incoming(_anti(_term("zone", app="web"))), nodes, nodes, on_gone, {}) == {}
    assert ruled_out(_incoming(_spread()), nodes, nodes, on_gone, {}) == {}


def test_a_candidate_missing_from_the_node_listing_is_ruled_out():
    """A GPU node that joined after the Node listing was read: its labels (domains) are unknown,
    so no rule can be checked there; it waits for the next placement rather than escaping them."""
    listed = _nodes(_node("a", "z1"))
    web = _incoming(_anti(_term("zone", app="web")))
    out = ruled_out(web, ["a", "new"], listed, [], {})
    assert out == {"new": "are missing from the Node listing this placement read (joined since)"}


def test_an_empty_topology_value_is_named_quoted():
    """A node may carry the topology key with an empty value: the messages show it as ""."""
    nodes = _nodes(_node("a", ""), _node("b", "z2"))
    lonely = _pod("a", {}, name="lonely", spec=_anti(_term("zone", app="web")))
    out = ruled_out(_incoming({}), nodes, nodes, [lonely], {})
    assert out == {"a": 'are in the zone "" of Pod ns/lonely, whose required podAntiAffinity '
                        "selects this Pod"}
    spread = _incoming(_ts(labelSelector={"matchLabels": {"app": "web"}}))
    out = ruled_out(spread, nodes, nodes, [_pod("a", {"app": "web"})], {})
    assert out == {"a": f'would make the skew of {SPREAD}[0] 2 (maxSkew 1, zone "")'}


# -- affinity ----------------------------------------------------------------------------------------------
def test_affinity_needs_a_selected_pod_in_the_nodes_zone():
    nodes = _nodes(_node("a", "z1"), _node("b", "z2"), _node("c", "z2"), _node("d"), _node("cpu", "z2"))
    web = _incoming(_aff({**_term("zone", role="cache"), "namespaces": ["infra"]}))
    cache = _pod("cpu", {"role": "cache"}, namespace="infra")
    out = ruled_out(web, ["a", "b", "c", "d"], nodes, [cache], {})
    assert out == {"a": f"run no Pod in their zone that {AFF}[0] selects", "d": f"lack label zone ({AFF}[0])"}


def test_a_pod_on_a_node_without_the_topology_key_satisfies_no_affinity():
    nodes = _nodes(_node("a", "z1"), _node("d"))
    web = _incoming(_aff(_term("zone", role="cache")))
    out = ruled_out(web, ["a"], nodes, [_pod("d", {"role": "cache"})], {})
    assert out == {"a": f"run no Pod in their zone that {AFF}[0] selects"}


def test_the_first_pod_of_a_series_with_affinity_to_itself_goes_anywhere_with_the_key():
    nodes = _nodes(_node("a", "z1"), _node("b", "z2"), _node("d"))
    web = _incoming(_aff(_term("zone", app="web")))
    assert ruled_out(web, nodes, nodes, [], {}) == {"d": f"lack label zone ({AFF}[0])"}
    # the next one follows the first
    assert set(ruled_out(web, nodes, nodes, [_pod("b", {"app": "web"})], {})) == {"a", "d"}
    # a Pod that does not match its own terms is no first of a series
    other = _incoming(_aff(_term("zone", app="web")), {"app": "db"})
    assert set(ruled_out(other, nodes, nodes, [], {})) == {"a", "b", "d"}


def test_every_affinity_term_is_checked_and_the_first_failing_one_is_named():
    nodes = _nodes(_node("a", "z1"), _node("b", "z1"), _node("c"))
    web = _incoming(_aff(_term("zone", role="cache"), _term(HOSTNAME, role="cache")))
    out = ruled_out(web, nodes, nodes, [_pod("b", {"role": "cache"})], {})
    assert out == {"a": f"run no Pod in their {HOSTNAME} that {AFF}[1] selects",
                   "c": f"lack label zone ({AFF}[0])"}


def test_an_existing_pod_must_match_every_affinity_term_to_count():
    nodes = _nodes(_node("a", "z1"), _node("b", "z2"))
    web = _incoming(_aff(_term("zone", role="cache"), _term("zone", tier="hot")))
    peers = [_pod("a", {"role": "cache"}), _pod("b", {"role": "cache", "tier": "hot"})]
    assert set(ruled_out(web, nodes, nodes, peers, {})) == {"a"}


# -- topology spread ---------------------------------------------------------------------------------------
def _spread(skew=1, key="zone", **extra):
    return {"topologySpreadConstraints": [{"maxSkew": skew, "topologyKey": key,
                                           "whenUnsatisfiable": "DoNotSchedule",
                                           "labelSelector": {"matchLabels": {"app": "web"}}, **extra}]}


def test_spread_allows_a_domain_up_to_max_skew_above_the_least_filled():
    nodes = _nodes(_node("a", "z1"), _node("b", "z1"), _node("c", "z2"), _node("d"))
    web = _incoming(_spread())
    one_in_z1 = [_pod("a", {"app": "web"})]
    out = ruled_out(web, nodes, nodes, one_in_z1, {})
    assert set(out) == {"a", "b", "d"}
    assert out["a"] == f'would make the skew of {SPREAD}[0] 2 (maxSkew 1, zone "z1")'
    assert out["d"] == f"lack label zone ({SPREAD}[0])"
    assert set(ruled_out(_incoming(_spread(2)), nodes, nodes, one_in_z1, {})) == {"d"}
    # other namespaces, other labels, terminating Pods do not count
    ignored = [_pod("a", {"app": "web"}, namespace="x"), _pod("a", {"app": "db"}),
               _pod("a", {"app": "web"}, terminating=True)]
    assert set(ruled_out(web, nodes, nodes, ignored, {})) == {"d"}


def test_spread_counts_domains_only_among_eligible_nodes():
    nodes = _nodes(_node("a", "z1"), _node("c", "z2", gpu="no"),
                   _node("e", "z3", taints=[Taint("k", "", "NoSchedule")]))
    one_in_z1 = [_pod("a", {"app": "web"})]
    # z2 fails the node selector (nodeAffinityPolicy Honor): not a domain, so z1 is not above it
    selective = _incoming({**_spread(), "nodeSelector": {"zone": "z1"}})
    assert set(ruled_out(selective, ["a"], nodes, one_in_z1, {})) == set()
    # Ignore: z2 and z3 count, both empty
    ignoring = _incoming({**_spread(nodeAffinityPolicy="Ignore"), "nodeSelector": {"zone": "z1"}})
    assert set(ruled_out(ignoring, ["a"], nodes, one_in_z1, {})) == {"a"}
    # the tainted z3 counts by default (nodeTaintsPolicy Ignore), not under Honor
    only_taint = _nodes(_node("a", "z1"), _node("e", "z3", taints=[Taint("k", "", "NoSchedule")]))
    assert set(ruled_out(_incoming(_spread()), ["a"], only_taint, one_in_z1, {})) == {"a"}
    honoring = _incoming(_spread(nodeTaintsPolicy="Honor"))
    assert set(ruled_out(honoring, ["a"], only_taint, one_in_z1, {})) == set()
    evicting = _nodes(_node("a", "z1"), _node("e", "z3", taints=[Taint("k", "", "NoExecute")]))
    assert set(ruled_out(honoring, ["a"], evicting, one_in_z1, {})) == set()
    # a taint that only steers (PreferNoSchedule) keeps the node a domain under Honor too
    steering = _nodes(_node("a", "z1"), _node("e", "z3", taints=[Taint("k", "", "PreferNoSchedule")]))
    assert set(ruled_out(honoring, ["a"], steering, one_in_z1, {})) == {"a"}


def test_fewer_domains_than_min_domains_make_the_minimum_zero():
    nodes = _nodes(_node("a", "z1"), _node("c", "z2"))
    peers = [_pod("a", {"app": "web"}), _pod("c", {"app": "web"})]
    assert ruled_out(_incoming(_spread()), nodes, nodes, peers, {}) == {}
    assert set(ruled_out(_incoming(_spread(minDomains=3)), nodes, nodes, peers, {})) == {"a", "c"}
    # zero, not less: one more in z1 makes a skew of 2, which maxSkew 2 allows
    assert ruled_out(_incoming(_spread(2, minDomains=3)), nodes, nodes, peers[:1], {}) == {}


def test_spread_counts_only_the_pods_on_eligible_nodes_and_honors_required_node_affinity():
    """Domains and their counts come from the nodes the Pod could run on: a Pod on a node its
    nodeSelector or required node affinity excludes counts in no domain (as the scheduler's)."""
    nodes = _nodes(_node("a", "z1", gpu="yes"), _node("b", "z1"), _node("c", "z2", gpu="yes"),
                   _node("d", "z3"))
    on_b = [_pod("b", {"app": "web"}, name=f"b{i}") for i in range(2)]
    gpu_only = _incoming({**_spread(), "nodeSelector": {"gpu": "yes"}})
    assert ruled_out(gpu_only, ["a", "c"], nodes, on_b, {}) == {}
    required = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1", "z2"]}]}]}}}
    one_each = [_pod("a", {"app": "web"}), _pod("c", {"app": "web"})]
    in_two_zones = _incoming({**_spread(), "affinity": required})
    assert ruled_out(in_two_zones, ["a", "c"], nodes, one_each, {}) == {}   # the empty z3 is no domain
    assert set(ruled_out(in_two_zones, ["a", "c"], nodes, one_each[:1], {})) == {"a"}
    ignoring = _incoming({**_spread(nodeAffinityPolicy="Ignore"), "affinity": required})
    assert set(ruled_out(ignoring, ["a", "c"], nodes, one_each, {})) == {"a", "c"}


def test_spread_by_hostname_over_nodes_labelled_with_it_alone():
    nodes = _nodes(_node("a"), _node("b"))
    web = _incoming(_spread(key=HOSTNAME))
    assert set(ruled_out(web, nodes, nodes, [_pod("a", {"app": "web"})], {})) == {"a"}


def test_spread_without_a_label_selector_counts_no_pod():
    nodes = _nodes(_node("a", "z1"), _node("c", "z2"))
    crowded = [_pod("a", {"app": "web"})] * 3
    assert ruled_out(_incoming(_ts()), nodes, nodes, crowded, {}) == {}


def test_spread_match_label_keys_count_only_the_same_revision():
    nodes = _nodes(_node("a", "z1"), _node("c", "z2"))
    web = _incoming(_spread(matchLabelKeys=["rev"]), {"app": "web", "rev": "2"})
    assert ruled_out(web, nodes, nodes, [_pod("a", {"app": "web", "rev": "1"})] * 3, {}) == {}
    assert set(ruled_out(web, nodes, nodes, [_pod("a", {"app": "web", "rev": "2"})], {})) == {"a"}
    # a Pod without the key: the key is left out, every revision counts
    unversioned = _incoming(_spread(matchLabelKeys=["rev"]), {"app": "web"})
    assert set(ruled_out(unversioned, nodes, nodes, [_pod("a", {"app": "web", "rev": "1"})], {})) == {"a"}


def test_the_incoming_pod_counts_in_the_skew_only_when_the_constraint_selects_it():
    nodes = _nodes(_node("a", "z1"), _node("c", "z2"))
    db = _incoming(_spread(), {"app": "db"})
    assert ruled_out(db, nodes, nodes, [_pod("a", {"app": "web"})], {}) == {}
    assert set(ruled_out(db, nodes, nodes, [_pod("a", {"app": "web"}, name=f"w{i}") for i in range(2)],
                         {})) == {"a"}


def test_spread_with_an_empty_label_selector_counts_no_existing_pod():
    """As the scheduler's countPodsMatchSelector: an empty selector counts 0 Pods (the incoming
    one still matches it, so the skew is 1 at most and the constraint never refuses a node)."""
    nodes = _nodes(_node("a", "z1"), _node("c", "z2"))
    crowded = [_pod("a", {"app": "web"})] * 3
    assert ruled_out(_incoming(_spread(labelSelector={})), nodes, nodes, crowded, {}) == {}
    # with matchLabelKeys merged in it is not empty any more: those Pods count
    keyed = _incoming(_spread(labelSelector={}, matchLabelKeys=["app"]))
    assert set(ruled_out(keyed, nodes, nodes, crowded, {})) == {"a"}


# -- never violated ---------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(zones=st.lists(st.sampled_from(["z1", "z2", "z3", None]), min_size=1, max_size=6),
       placements=st.lists(st.tuples(st.sampled_from(["web", "db"]),
                                     st.sampled_from([HOSTNAME, "zone", None]), st.integers(0, 5)),
                           max_size=14))
def test_anti_affinity_is_never_violated_in_either_direction(zones, placements):
    """Pods of two apps, some with anti-affinity (by hostname or zone) to their own app, are
    placed one by one on any node not ruled out: no two Pods end up in one domain where either
    Pod's term selects the other."""
    nodes = _nodes(*(_node(f"n{i}", z) for i, z in enumerate(zones)))
    placed: list[Peer] = []
    for i, (app, key, pick) in enumerate(placements):
        spec = _anti(_term(key, app=app)) if key else {}
        out = ruled_out(_incoming(spec, {"app": app}), nodes, nodes, placed, {})
        free = [n for n in nodes if n not in out]
        if free:
            placed.append(_pod(free[pick % len(free)], {"app": app}, name=f"p{i}", spec=spec))
    for x in placed:
        for y in placed:
            for t in x.anti_affinity:
                if x is not y and t.selects(y.namespace, y.labels, {}):
                    value = dict(nodes[x.node].labels).get(t.topology_key)
                    assert value is None or dict(nodes[y.node].labels).get(t.topology_key) != value


@settings(max_examples=100, deadline=None)
@given(zones=st.lists(st.sampled_from(["z1", "z2", "z3"]), min_size=1, max_size=6),
       skew=st.integers(1, 2), picks=st.lists(st.integers(0, 5), max_size=12))
def test_spread_never_exceeds_max_skew(zones, skew, picks):
    nodes = _nodes(*(_node(f"n{i}", z) for i, z in enumerate(zones)))
    web = _incoming(_spread(skew))
    placed: list[Peer] = []
    for i, pick in enumerate(picks):
        free = [n for n in nodes if n not in ruled_out(web, nodes, nodes, placed, {})]
        assert free   # some domain is always at the minimum
        placed.append(_pod(free[pick % len(free)], {"app": "web"}, name=f"p{i}"))
        per_zone = {z: sum(1 for p in placed if dict(nodes[p.node].labels)["zone"] == z) for z in set(zones)}
        assert max(per_zone.values()) - min(per_zone.values()) <= skew


# -- the rest --------------------------------------------------------------------------------------------
def test_a_replica_has_the_templates_labels_and_its_fastpods():
    fastpod = {"metadata": {"name": "fp", "namespace": "ns"}, "spec": {"template": {
        "metadata": {"labels": {"app": "web"}}, "spec": {"containers": [], **_anti(_term(app="web"))}}}}
    incoming = replica_incoming(fastpod, "fastshare.io/gpu")
    assert incoming.labels == {"app": "web", "fastshare.io/fastpod": "fp",
                               TEMPLATE_HASH_LABEL: template_hash(fastpod)}
    assert incoming.rules.anti_affinity[0].field == f"spec.template.{ANTI}[0]"
    assert incoming.node_rules.tolerates(Taint("fastshare.io/gpu", "true", "NoSchedule"))
    # the template's nodeSelector limits the spread's domains (nodeAffinityPolicy Honor)
    fastpod["spec"]["template"]["spec"] = {"containers": [], "nodeSelector": {"gpu": "yes"}, **_spread()}
    nodes = _nodes(_node("a", "z1", gpu="yes"), _node("b", "z2"))
    crowded = [_pod("a", {"app": "web"}, name="fp-0")]
    assert ruled_out(replica_incoming(fastpod, "fastshare.io/gpu"), ["a"], nodes, crowded, {}) == {}
    # a template without a spec has no rules
    del fastpod["spec"]["template"]["spec"]
    assert not replica_incoming(fastpod, "fastshare.io/gpu").rules


def test_a_replica_spread_by_its_template_hash_counts_only_replicas_of_its_template():
    """``matchLabelKeys: [fastshare.io/template-hash]`` (as Deployments' pod-template-hash): the
    replica Pod carries its template's hash, so only the replicas of the same template count. The
    incoming replica was read without that label: every older replica counted and a zone crowded
    by them was refused, where the kube-scheduler would have allowed it."""
    def fastpod(image):
        return {"metadata": {"name": "fp", "namespace": "ns"}, "spec": {"template": {
            "metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": image}],
                                                             **_spread(matchLabelKeys=[TEMPLATE_HASH_LABEL])}}}}
    old, new = fastpod("v1"), fastpod("v2")
    nodes = _nodes(_node("a", "z1"), _node("c", "z2"))
    older = [_pod("a", {"app": "web", "fastshare.io/fastpod": "fp", TEMPLATE_HASH_LABEL: template_hash(old)},
                  name=f"fp-{i}") for i in range(3)]
    assert ruled_out(replica_incoming(new, "fastshare.io/gpu"), nodes, nodes, older, {}) == {}
    assert set(ruled_out(replica_incoming(old, "fastshare.io/gpu"), nodes, nodes, older, {})) == {"a"}


def test_an_ended_or_unbound_pod_is_no_peer():
    def pod(phase, node="n1"):
        return peer({"metadata": {"name": "p", "namespace": "ns"}, "spec": {"nodeName": node},
                     "status": {"phase": phase}})

    assert pod("Succeeded") is None and pod("Failed") is None and pod("Pending", node=None) is None
    assert pod("Running") is not None and pod("Pending") is not None


def test_the_peer_cache_keeps_bound_pods_and_passes_a_listing_on():
    cache = PodPeers()
    pods = [{"metadata": {"name": "a", "namespace": "ns", "labels": {"app": "web"}},
             "spec": {"nodeName": "n1", **_anti(_term(app="web"))}, "status": {}},
            {"metadata": {"name": "b", "namespace": "ns"}, "spec": {}, "status": {}},
            {"metadata": {"name": "c", "namespace": "ns"}, "spec": {"nodeName": "n2"},
             "status": {"phase": "Failed"}}]
    assert not cache.synced
    assert list(cache.replacing(pods)) == pods
    assert cache.synced and list(cache.all()) == [("ns", "a")]
    assert [p.name for p in cache.forbidding()] == ["a"]
    cache.put({"metadata": {"name": "a", "namespace": "ns"}, "spec": {"nodeName": "n1"}, "status": {}})
    assert cache.forbidding() == [] and list(cache.all()) == [("ns", "a")]
    cache.remove({"metadata": {"name": "a", "namespace": "ns"}})
    assert cache.all() == {}


def test_a_bound_pods_unreadable_anti_affinity_terms_are_left_out_not_its_pod():
    """The watch of every bound Pod must not stop at one whose terms this reader cannot take."""
    def bound(required):
        return peer({"metadata": {"name": "p", "namespace": "ns", "labels": {"app": "web"}},
                     "spec": {"nodeName": "n1", "affinity": {"podAntiAffinity": {
                         "requiredDuringSchedulingIgnoredDuringExecution": required}}}, "status": {}})

    kept = bound([{"labelSelector": {}}, _term("zone", app="web")])
    assert kept is not None and [t.topology_key for t in kept.anti_affinity] == ["zone"]
    for unreadable in ({"topologyKey": "zone"}, 5, None):
        odd = bound(unreadable)
        assert odd is not None and odd.node == "n1" and odd.anti_affinity == ()


def test_a_relist_keeps_what_was_put_or_removed_after_its_snapshot():
    """Our own create's reply goes in before the watch reports it: a listing taken earlier (the
    watch relists every few tens of seconds) must not drop it, or the next replica placed with
    an anti-affinity to it would not see it."""
    def pod(name, version, node="n1"):
        return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": str(version)},
                "spec": {"nodeName": node}, "status": {}}

    cache = PodPeers()
    list(cache.replacing([pod("old", 3), pod("gone", 4)], "5"))
    cache.put(pod("created", 10))
    cache.remove(pod("gone", 11))
    list(cache.replacing([pod("old", 3), pod("gone", 4)], "8"))   # taken before both
    assert sorted(cache.all()) == [("ns", "created"), ("ns", "old")]
    list(cache.replacing([pod("old", 3)], "12"))   # newer: it is the truth
    assert sorted(cache.all()) == [("ns", "old")]


def test_the_placement_lock_runs_shared_holders_together_and_an_exclusive_one_alone():
    lock = PlacementLock()
    events: list[str] = []
    first_in, release_first = threading.Event(), threading.Event()

    def shared(name, hold=None):
        with lock.shared():
            events.append(f"{name} in")
            if hold is not None:
                first_in.set()
                hold.wait(10)
            events.append(f"{name} out")

    def exclusive():
        with lock.exclusive():
            events.append("x in")
            events.append("x out")

    one = threading.Thread(target=shared, args=("s1", release_first))
    one.start()
    assert first_in.wait(10)
    with lock.shared():   # shared beside shared
        events.append("s2 in")
    alone = threading.Thread(target=exclusive)
    alone.start()
    deadline = time.monotonic() + 10
    while not lock._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    late = threading.Thread(target=shared, args=("s3",))   # behind the waiting exclusive one
    late.start()
    time.sleep(0.2)
    assert "x in" not in events and "s3 in" not in events
    release_first.set()
    for thread in (one, alone, late):
        thread.join(10)
    assert events.index("s1 out") < events.index("x in") < events.index("x out") < events.index("s3 in")
