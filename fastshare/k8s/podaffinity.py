"""Inter-pod affinity, anti-affinity and topology spread, as the kube-scheduler's InterPodAffinity
and PodTopologySpread filter plugins check them, for the Pods the controller binds itself:

- a required ``podAffinity`` term needs, in the node's domain (its value of ``topologyKey``),
  a Pod that the term selects (its ``labelSelector`` and namespaces); a node without the key
  fails. The first Pod of a series is let through: when no Pod anywhere matches all the terms
  and the Pod matches them itself;
- a required ``podAntiAffinity`` term forbids a domain holding a Pod that it selects; and an
  existing Pod's own required anti-affinity forbids its domain to every Pod its terms select
  (the symmetric rule);
- a ``topologySpreadConstraints`` entry with ``whenUnsatisfiable: DoNotSchedule`` allows a node
  whose domain, with this Pod, holds at most ``maxSkew`` more selected Pods (same namespace,
  not terminating) than the least-filled domain; domains are the values of the key among the
  nodes that have every constraint's key and pass its ``nodeAffinityPolicy`` (default Honor:
  the Pod's nodeSelector and required node affinity) and ``nodeTaintsPolicy`` (default Ignore);
  fewer domains than ``minDomains`` make the minimum 0.

Preferred terms and ``ScheduleAnyway`` only steer a scheduler's choice: they are checked for
form and otherwise not applied. Pure functions over plain dicts (the API's JSON); a template
that cannot be read raises :class:`TemplateError` naming the field.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastshare.k8s.pods import TEMPLATE_SPEC, replica_constraints, replica_labels
from fastshare.k8s.scheduling import Constraints, NodeFacts, Requirement, TemplateError, requirement

HOSTNAME = "kubernetes.io/hostname"
_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
_BLOCKING = ("NoSchedule", "NoExecute")

Labels = Mapping[str, str]


# -- label selectors -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Selector:
    """A ``metav1.LabelSelector``: every requirement holds (none: every set of labels)."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Labels) -> bool:
        return all(r.matches(labels.get(r.key)) for r in self.requirements)

    def plus(self, more: Iterable[Requirement]) -> Selector:
        return Selector(self.requirements + tuple(more))


def selector(raw: object, field: str) -> Selector | None:
    """A label selector (None when absent: it then selects nothing, as in the scheduler)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise TemplateError(field, "must be an object (matchLabels, matchExpressions)")
    out = []
    labels = raw.get("matchLabels") or {}
    if not isinstance(labels, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in labels.items()):
        raise TemplateError(f"{field}.matchLabels", "must be a map of strings")
    out += [Requirement(k, "In", (v,)) for k, v in sorted(labels.items())]
    expressions = raw.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise TemplateError(f"{field}.matchExpressions", "must be a list")
    out += [requirement(item, f"{field}.matchExpressions[{i}]", _SELECTOR_OPERATORS)
            for i, item in enumerate(expressions)]
    return Selector(tuple(out))


def _keys(raw: object, field: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(k, str) and k for k in raw):
        raise TemplateError(field, "must be a list of label keys (non-empty strings)")
    if len(set(raw)) != len(raw):
        raise TemplateError(field, "lists a key twice")
    return tuple(raw)


def _or_empty(value: object) -> object:
    """An absent (null) list as an empty one; anything else as it is, to be checked."""
    return [] if value is None else value


def _topology_key(raw: Mapping[str, Any], field: str) -> str:
    key = raw.get("topologyKey")
    if not isinstance(key, str) or not key:
        raise TemplateError(f"{field}.topologyKey", f"must be a non-empty label key (got {key!r})")
    return key


# -- inter-pod affinity terms ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PodTerm:
    """One required (anti-)affinity term, its namespaces resolved against its own Pod's."""

    selector: Selector | None          # None: selects no Pod
    namespaces: frozenset[str]
    namespace_selector: Selector | None  # None: no namespace beyond ``namespaces``
    topology_key: str
    field: str = ""                    # where it is written (for messages)

    def selects(self, namespace: str, labels: Labels, namespace_labels: Mapping[str, Labels]) -> bool:
        if self.selector is None or not self.selector.matches(labels):
            return False
        if namespace in self.namespaces:
            return True
        return self.namespace_selector is not None and self.namespace_selector.matches(
            namespace_labels.get(namespace, {}))

    @property
    def reads_namespaces(self) -> bool:
        """Whether it selects namespaces by their labels (an empty selector takes every one unread)."""
        return self.namespace_selector is not None and bool(self.namespace_selector.requirements)


def _term(raw: object, field: str, namespace: str, labels: Labels) -> PodTerm:
    if not isinstance(raw, Mapping):
        raise TemplateError(field, "must be an object")
    key = _topology_key(raw, field)
    chosen = selector(raw.get("labelSelector"), f"{field}.labelSelector")
    match = _keys(raw.get("matchLabelKeys"), f"{field}.matchLabelKeys")
    mismatch = _keys(raw.get("mismatchLabelKeys"), f"{field}.mismatchLabelKeys")
    if (match or mismatch) and chosen is None:
        raise TemplateError(f"{field}.{'matchLabelKeys' if match else 'mismatchLabelKeys'}",
                            "needs a labelSelector")
    if both := set(match) & set(mismatch):
        raise TemplateError(f"{field}.mismatchLabelKeys", f"{sorted(both)[0]!r} is in matchLabelKeys too")
    if chosen is not None:   # the API server's merge: this Pod's own values of those keys
        chosen = chosen.plus([Requirement(k, "In", (labels[k],)) for k in match if k in labels]
                             + [Requirement(k, "NotIn", (labels[k],)) for k in mismatch if k in labels])
    namespaces = _or_empty(raw.get("namespaces"))
    if not isinstance(namespaces, list) or not all(isinstance(n, str) and n for n in namespaces):
        raise TemplateError(f"{field}.namespaces", "must be a list of namespace names")
    by_labels = selector(raw.get("namespaceSelector"), f"{field}.namespaceSelector")
    if not namespaces and by_labels is None:
        namespaces = [namespace]   # neither given: this Pod's own namespace
    return PodTerm(chosen, frozenset(namespaces), by_labels, key, field)


def _terms(affinity: Mapping[str, Any], kind: str, prefix: str, namespace: str,
           labels: Labels) -> tuple[PodTerm, ...]:
    section = affinity.get(kind)
    if section is None:
        return ()
    at = f"{prefix}.affinity.{kind}"
    if not isinstance(section, Mapping):
        raise TemplateError(at, "must be an object")
    required = _or_empty(section.get(_REQUIRED))
    if not isinstance(required, list):
        raise TemplateError(f"{at}.{_REQUIRED}", "must be a list of terms")
    terms = tuple(_term(t, f"{at}.{_REQUIRED}[{i}]", namespace, labels) for i, t in enumerate(required))
    preferred = _or_empty(section.get(_PREFERRED))
    if not isinstance(preferred, list):
        raise TemplateError(f"{at}.{_PREFERRED}", "must be a list")
    for i, item in enumerate(preferred):   # read for form only: a preference steers, it does not forbid
        where = f"{at}.{_PREFERRED}[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("podAffinityTerm"), Mapping):
            raise TemplateError(where, "needs a podAffinityTerm (object) and a weight")
        weight = item.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 100:
            raise TemplateError(f"{where}.weight", f"must be an integer from 1 to 100 (got {weight!r})")
        _term(item["podAffinityTerm"], f"{where}.podAffinityTerm", namespace, labels)
    return terms


# -- topology spread --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """One ``whenUnsatisfiable: DoNotSchedule`` topology spread constraint."""

    max_skew: int
    topology_key: str
    selector: Selector | None   # None: selects no Pod
    min_domains: int = 1
    honor_affinity: bool = True   # nodeAffinityPolicy Honor (the default)
    honor_taints: bool = False    # nodeTaintsPolicy Ignore (the default)
    field: str = ""


def _positive(raw: Mapping[str, Any], key: str, field: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TemplateError(f"{field}.{key}", f"must be an integer >= 1 (got {value!r})")
    return value


def _policy(raw: Mapping[str, Any], key: str, field: str, default: str) -> bool:
    value = raw.get(key) or default
    if value not in ("Honor", "Ignore"):
        raise TemplateError(f"{field}.{key}", f"must be Honor or Ignore (got {value!r})")
    return value == "Honor"


def _spread(raw: object, field: str, labels: Labels) -> Spread | None:
    if not isinstance(raw, Mapping):
        raise TemplateError(field, "must be an object")
    skew = _positive(raw, "maxSkew", field)
    key = _topology_key(raw, field)
    when = raw.get("whenUnsatisfiable")
    if when not in ("DoNotSchedule", "ScheduleAnyway"):
        raise TemplateError(f"{field}.whenUnsatisfiable",
                            f"must be DoNotSchedule or ScheduleAnyway (got {when!r})")
    minimum = 1
    if raw.get("minDomains") is not None:
        if when != "DoNotSchedule":
            raise TemplateError(f"{field}.minDomains", "may be set only with whenUnsatisfiable DoNotSchedule")
        minimum = _positive(raw, "minDomains", field)
    chosen = selector(raw.get("labelSelector"), f"{field}.labelSelector")
    match = _keys(raw.get("matchLabelKeys"), f"{field}.matchLabelKeys")
    if match and chosen is None:
        raise TemplateError(f"{field}.matchLabelKeys", "needs a labelSelector")
    if chosen is not None:
        chosen = chosen.plus(Requirement(k, "In", (labels[k],)) for k in match if k in labels)
    honor_affinity = _policy(raw, "nodeAffinityPolicy", field, "Honor")
    honor_taints = _policy(raw, "nodeTaintsPolicy", field, "Ignore")
    if when != "DoNotSchedule":
        return None   # a preference: it steers a scheduler's choice, it forbids no node
    return Spread(skew, key, chosen, minimum, honor_affinity, honor_taints, field)


# -- a Pod's rules ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PodRules:
    """What a Pod requires of the Pods around it."""

    affinity: tuple[PodTerm, ...] = ()
    anti_affinity: tuple[PodTerm, ...] = ()
    spread: tuple[Spread, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.affinity or self.anti_affinity or self.spread)


def pod_rules(spec: Mapping[str, Any], namespace: str, labels: Labels, prefix: str = "spec") -> PodRules:
    """Read (and check) a Pod spec's inter-pod affinity and topology spread constraints, for a
    Pod in ``namespace`` with ``labels``."""
    affinity = spec.get("affinity") or {}
    if not isinstance(affinity, Mapping):
        raise TemplateError(f"{prefix}.affinity", "must be an object")
    with_affinity = _terms(affinity, "podAffinity", prefix, namespace, labels)
    against = _terms(affinity, "podAntiAffinity", prefix, namespace, labels)
    raw = _or_empty(spec.get("topologySpreadConstraints"))
    if not isinstance(raw, list):
        raise TemplateError(f"{prefix}.topologySpreadConstraints", "must be a list")
    spread, seen = [], set()
    for i, item in enumerate(raw):
        at = f"{prefix}.topologySpreadConstraints[{i}]"
        constraint = _spread(item, at, labels)
        pair = (item.get("topologyKey"), item.get("whenUnsatisfiable"))
        if pair in seen:   # as the API server refuses it
            raise TemplateError(at, f"duplicates another constraint's topologyKey {pair[0]} and "
                                    f"whenUnsatisfiable {pair[1]}")
        seen.add(pair)
        if constraint is not None:
            spread.append(constraint)
    return PodRules(with_affinity, against, tuple(spread))


# -- the Pods already bound --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """What placement needs of a bound Pod: where it runs, whom it is, what it forbids."""

    node: str
    namespace: str
    name: str
    labels: Labels = field(default_factory=dict)
    anti_affinity: tuple[PodTerm, ...] = ()
    terminating: bool = False


def peer(pod: Mapping[str, Any]) -> Peer | None:
    """A bound, unfinished Pod's facts; its anti-affinity terms when readable (a Pod the API
    server admitted is: a term that is not is left out rather than stopping the count)."""
    spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
    node = spec.get("nodeName")
    if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    namespace = meta.get("namespace") or ""
    labels = {sys.intern(k): v for k, v in (meta.get("labels") or {}).items()}
    against: tuple[PodTerm, ...] = ()
    required = (((spec.get("affinity") or {}).get("podAntiAffinity") or {}).get(_REQUIRED)) or []
    if isinstance(required, list):
        kept = []
        for i, raw in enumerate(required):
            try:
                kept.append(_term(raw, f"{_REQUIRED}[{i}]", namespace, labels))
            except TemplateError:
                continue
        against = tuple(kept)
    return Peer(sys.intern(node), sys.intern(namespace), meta.get("name") or "", labels, against,
                bool(meta.get("deletionTimestamp")))


# -- the filters --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Incoming:
    """The Pod to place: its namespace, labels and rules, and its node constraints (for the
    spread's node inclusion policies)."""

    namespace: str
    labels: Labels
    rules: PodRules
    node_rules: Constraints = field(default_factory=Constraints)
    node_selector: Labels = field(default_factory=dict)

    def affinity_admits(self, node: NodeFacts, labels: Labels) -> bool:
        if any(labels.get(k) != v for k, v in self.node_selector.items()):
            return False
        terms = self.node_rules.terms
        return terms is None or any(t.matches(node) for t in terms)

    def tolerates(self, node: NodeFacts) -> bool:
        return all(self.node_rules.tolerates(t) for t in node.taints if t.effect in _BLOCKING)


def symmetric(incoming: Incoming, peers: Iterable[Peer],
              namespace_labels: Mapping[str, Labels]) -> list[Peer]:
    """The bound Pods whose own required anti-affinity selects ``incoming``."""
    return [p for p in peers if any(t.selects(incoming.namespace, incoming.labels, namespace_labels)
                                    for t in p.anti_affinity)]


def _first_of_series(incoming: Incoming, namespace_labels: Mapping[str, Labels]) -> bool:
    return all(t.selects(incoming.namespace, incoming.labels, namespace_labels)
               for t in incoming.rules.affinity)


def ruled_out(incoming: Incoming, candidates: Iterable[str], nodes: Mapping[str, NodeFacts],
              peers: Iterable[Peer], namespace_labels: Mapping[str, Labels]) -> dict[str, str]:
    """The ``candidates`` (node names) where ``incoming`` may not run, each with why, worded to
    follow "N node(s)"; a candidate missing from ``nodes`` is ruled out (unchecked). ``nodes``:
    every Node of the cluster (domains come from all of them);
    ``peers``: every bound, unfinished Pod; ``namespace_labels``: each namespace's labels (only
    read by namespace selectors)."""
    rules = incoming.rules
    labels_of = {name: dict(n.labels) for name, n in nodes.items()}
    peers = [p for p in peers if p.node in nodes]
    forbidden: Counter[tuple[str, str]] = Counter()   # existing Pods' anti-affinity: pairs -> Pod
    forbidder: dict[tuple[str, str], Peer] = {}
    for p in symmetric(incoming, peers, namespace_labels):
        for t in p.anti_affinity:
            value = labels_of[p.node].get(t.topology_key)
            if value is not None and t.selects(incoming.namespace, incoming.labels, namespace_labels):
                forbidden[(t.topology_key, value)] += 1
                forbidder.setdefault((t.topology_key, value), p)
    against: list[Counter[str]] = [Counter() for _ in rules.anti_affinity]
    near: Counter[tuple[str, str]] = Counter()
    for p in peers if rules.affinity or rules.anti_affinity else ():
        node_labels = labels_of[p.node]
        for i, t in enumerate(rules.anti_affinity):
            if t.topology_key in node_labels and t.selects(p.namespace, p.labels, namespace_labels):
                against[i][node_labels[t.topology_key]] += 1
        if rules.affinity and all(t.selects(p.namespace, p.labels, namespace_labels) for t in rules.affinity):
            for t in rules.affinity:
                if t.topology_key in node_labels:
                    near[(t.topology_key, node_labels[t.topology_key])] += 1
    spread = [_spread_counts(incoming, c, nodes, labels_of, peers) for c in rules.spread]
    first = not near and _first_of_series(incoming, namespace_labels)

    out: dict[str, str] = {}
    for name in candidates:
        node = nodes.get(name)
        if node is None:   # its domains are unknown: no rule can be checked there
            out[name] = "are missing from the Node listing this placement read (joined since)"
            continue
        labels = labels_of[name]
        why = None   # in the scheduler's order: affinity, anti-affinity, existing Pods' anti-affinity
        for t in rules.affinity:
            if t.topology_key not in labels:
                why = f"lack label {t.topology_key} ({t.field})"
            elif not near[(t.topology_key, labels[t.topology_key])] and not first:
                why = f"run no Pod in their {t.topology_key} that {t.field} selects"
            if why is not None:
                break
        for i, t in enumerate(rules.anti_affinity):
            if why is None and t.topology_key in labels and against[i][labels[t.topology_key]]:
                why = f"run a Pod in their {t.topology_key} that {t.field} of podAntiAffinity selects"
        for key, value in labels.items() if why is None else ():
            if forbidden[(key, value)]:
                p = forbidder[(key, value)]
                why = (f'are in the {key} "{value}" of Pod {p.namespace}/{p.name}, whose required '
                       "podAntiAffinity selects this Pod")
                break
        for c, (counts, minimum) in zip(rules.spread, spread, strict=True):
            if why is not None:
                break
            if c.topology_key not in labels:
                why = f"lack label {c.topology_key} ({c.field})"
                break
            own = 1 if c.selector is not None and c.selector.matches(incoming.labels) else 0
            skew = counts.get(labels[c.topology_key], 0) + own - minimum
            if skew > c.max_skew:
                why = (f"would make the skew of {c.field} {skew} (maxSkew {c.max_skew}, "
                       f'{c.topology_key} "{labels[c.topology_key]}")')
        if why is not None:
            out[name] = why
    return out


def _spread_counts(incoming: Incoming, c: Spread, nodes: Mapping[str, NodeFacts],
                   labels_of: Mapping[str, dict[str, str]], peers: list[Peer]) -> tuple[dict[str, int], int]:
    """Per domain of ``c``, the selected Pods (same namespace, not terminating) on its eligible
    nodes; and the global minimum (0 with fewer domains than minDomains). An empty selector
    (``labelSelector: {}``) counts no Pod, as the scheduler's countPodsMatchSelector."""
    keys = {s.topology_key for s in incoming.rules.spread}
    counts: dict[str, int] = {}
    eligible = set()
    for name, node in nodes.items():
        labels = labels_of[name]
        if not keys <= labels.keys():
            continue
        if c.honor_affinity and not incoming.affinity_admits(node, labels):
            continue
        if c.honor_taints and not incoming.tolerates(node):
            continue
        eligible.add(name)
        counts.setdefault(labels[c.topology_key], 0)
    for p in peers:
        if (p.node in eligible and not p.terminating and p.namespace == incoming.namespace
                and c.selector is not None and c.selector.requirements and c.selector.matches(p.labels)):
            counts[labels_of[p.node][c.topology_key]] += 1
    minimum = min(counts.values()) if len(counts) >= c.min_domains and counts else 0
    return counts, minimum


def needs_namespaces(incoming: Incoming, peers: Iterable[Peer]) -> bool:
    """Whether a term in play selects namespaces by their labels (then they must be read): one
    of ``incoming``'s own, or a bound Pod's anti-affinity term whose labelSelector matches it
    (no other can select it)."""
    own = (*incoming.rules.affinity, *incoming.rules.anti_affinity)
    return any(t.reads_namespaces for t in own) or any(
        t.reads_namespaces and t.selector is not None and t.selector.matches(incoming.labels)
        for p in peers for t in p.anti_affinity)


def replica_incoming(fastpod: Mapping[str, Any], gpu_node_label: str) -> Incoming:
    """A FastPod's replica Pod as these filters see it (its labels as ``replica_pod`` makes
    them); TemplateError if the template's rules cannot be read."""
    meta, template = fastpod["metadata"], fastpod["spec"]["template"]
    labels = replica_labels(fastpod)
    spec = template.get("spec") or {}
    selected = spec.get("nodeSelector") or {}
    return Incoming(meta["namespace"], labels, pod_rules(spec, meta["namespace"], labels, TEMPLATE_SPEC),
                    replica_constraints(dict(fastpod), gpu_node_label),
                    dict(selected) if isinstance(selected, Mapping) else {})
