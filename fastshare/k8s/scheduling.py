"""What the kube-scheduler and the kubelet check before a Pod may run on a node, for the Pods
the controller binds itself (``nodeName``, so no scheduler looks at them): the Pod's effective
request (pod-level ``spec.resources`` where set) of CPU, memory, ephemeral storage, hugepages and
extended resources against the node's allocatable minus what bound Pods request, its host ports
against theirs, its required node affinity, and the node's taints (and cordon) against its
tolerations; a template with ResourceClaims is refused (nothing would allocate them).

Pure functions over plain dicts (the API's JSON); a template that cannot be read raises
:class:`TemplateError` naming the field, so that the FastPod gets a condition, not a crashed pass.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, NamedTuple

from kubernetes.utils import parse_quantity

MiB = 1024**2
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
_BLOCKING = ("NoSchedule", "NoExecute")   # PreferNoSchedule only steers the scheduler
# Kubernetes' quantity grammar (parse_quantity alone also takes e.g. "1 Gi" or "nan")
_QUANTITY = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?[0-9]+)?$")
_AFFINITY = "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"


class TemplateError(ValueError):
    """A field of the Pod template cannot be read; ``field`` is where the user wrote it."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field, self.detail = field, detail


def quantity(value: object, field: str) -> Decimal:
    """A Kubernetes quantity (``100m``, ``2``, ``1Gi``, ``500M``, ``1e3``) as a non-negative Decimal."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TemplateError(field, f"must be a quantity such as 500m, 2 or 1Gi (got {value!r})")
    text = str(value)   # a JSON number as its text, as the API server reads it (0.1 is 100m)
    if not _QUANTITY.fullmatch(text):
        raise TemplateError(field, f"{value!r} is not a quantity (such as 500m, 2 or 1Gi)")
    try:
        parsed = parse_quantity(text)
    except (ValueError, InvalidOperation, TypeError):
        raise TemplateError(field, f"{value!r} is not a quantity (such as 500m, 2 or 1Gi)") from None
    if not parsed.is_finite() or parsed < 0:
        raise TemplateError(field, f"must be a finite quantity >= 0 (got {value!r})")
    return parsed


def milli(value: object, field: str) -> int:
    """A CPU quantity in millicores, rounded up (as Kubernetes' MilliValue)."""
    return math.ceil(quantity(value, field) * 1000)


def whole(value: object, field: str) -> int:
    """A memory quantity in bytes, rounded up."""
    return math.ceil(quantity(value, field))


def _merged(a: tuple[tuple[str, int], ...], b: tuple[tuple[str, int], ...],
            how: Callable[[int, int], int]) -> tuple[tuple[str, int], ...]:
    names = {n for n, _ in a} | {n for n, _ in b}
    left, right = dict(a), dict(b)
    return tuple((n, v) for n in sorted(names) if (v := how(left.get(n, 0), right.get(n, 0))))


@dataclass(frozen=True)
class Demand:
    """A Pod's effective request: what the scheduler and the kubelet count on a node."""

    cpu_milli: int = 0
    memory_bytes: int = 0
    # every other resource, by name, sorted, none of zero: ephemeral-storage and hugepages-<size>
    # in bytes, extended resources (example.com/foo) as counts
    extended: tuple[tuple[str, int], ...] = ()

    def __add__(self, other: Demand) -> Demand:
        return Demand(self.cpu_milli + other.cpu_milli, self.memory_bytes + other.memory_bytes,
                      _merged(self.extended, other.extended, operator.add))

    def most(self, other: Demand) -> Demand:
        return Demand(max(self.cpu_milli, other.cpu_milli), max(self.memory_bytes, other.memory_bytes),
                      _merged(self.extended, other.extended, max))

    @property
    def memory_mib(self) -> int:
        return -(-self.memory_bytes // MiB)


_STANDARD = ("cpu", "memory", "ephemeral-storage")
HUGEPAGES = "hugepages-"
_PLAIN_KEY = re.compile(r"[A-Za-z0-9-]+")


def key_field(field: str, name: str) -> str:
    """``field.cpu``, or ``field[example.com/foo]`` for a name a dot would not delimit."""
    return f"{field}.{name}" if _PLAIN_KEY.fullmatch(name) else f"{field}[{name}]"


def is_extended(name: str) -> bool:
    """A resource counted as a whole number of devices (not a quantity of bytes or CPU): a
    fully qualified name outside kubernetes.io (what a device plugin advertises)."""
    return "/" in name and "kubernetes.io/" not in name


def _amount(name: str, value: object, field: str) -> int:
    if name == "cpu":
        return milli(value, field)
    if is_extended(name):
        exact = quantity(value, field)
        if exact != exact.to_integral_value():
            raise TemplateError(field, f"{name} counts whole devices: must be an integer (got {value!r})")
        return int(exact)
    if name in _STANDARD or name.startswith(HUGEPAGES) or "kubernetes.io/" in name:
        return whole(value, field)
    raise TemplateError(field, "must be cpu, memory, ephemeral-storage, hugepages-<size> or a fully "
                               f"qualified extended resource such as example.com/device (got {name!r})")


def _amounts(amounts: object, field: str) -> dict[str, int]:
    if amounts is None:
        return {}
    if not isinstance(amounts, Mapping):
        raise TemplateError(field, f"must be a map of resource quantities (got {type(amounts).__name__})")
    out = {}
    for name, value in amounts.items():
        if not isinstance(name, str) or not name:
            raise TemplateError(field, f"resource names must be non-empty strings (got {name!r})")
        if value is not None:
            out[name] = _amount(name, value, key_field(field, name))
    return out


def _demand(amounts: Mapping[str, int]) -> Demand:
    return Demand(amounts.get("cpu", 0), amounts.get("memory", 0),
                  tuple(sorted((n, v) for n, v in amounts.items() if n not in ("cpu", "memory") and v)))


def _resources(amounts: object, field: str) -> Demand:
    return _demand(_amounts(amounts, field))


def _requirements_of(holder: Mapping[str, Any], field: str) -> tuple[dict[str, int], dict[str, int]]:
    """(requests, limits) of a ``resources`` object, each request defaulting to its limit (the
    API server's defaulting); a device (extended resource) must ask exactly its limit."""
    resources = holder.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise TemplateError(field, "must be an object")
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    if not isinstance(requests, Mapping) or not isinstance(limits, Mapping):
        raise TemplateError(field, "requests and limits must be maps of quantities")
    asked, capped = _amounts(requests, f"{field}.requests"), _amounts(limits, f"{field}.limits")
    for name, limit in capped.items():
        if name not in asked:
            asked[name] = limit
        elif (is_extended(name) or name.startswith(HUGEPAGES)) and asked[name] != limit:
            raise TemplateError(key_field(f"{field}.requests", name),
                                f"must equal its limit ({limits[name]}): {name} cannot be overcommitted")
    for name in asked:
        if (is_extended(name) or name.startswith(HUGEPAGES)) and name not in capped:
            raise TemplateError(key_field(f"{field}.limits", name),
                                f"must be set: {name} cannot be overcommitted, its request is its limit")
    return asked, capped


def _container(container: object, field: str) -> Demand:
    if not isinstance(container, Mapping):
        raise TemplateError(field, "must be an object")
    return _demand(_requirements_of(container, f"{field}.resources")[0])


def _list(spec: Mapping[str, Any], key: str, prefix: str) -> list[Any]:
    items = spec.get(key) or []
    if not isinstance(items, list):
        raise TemplateError(f"{prefix}.{key}", "must be a list")
    return items


def _pod_level(spec: Mapping[str, Any], prefix: str) -> dict[str, int] | None:
    """The Pod-level requests (``spec.resources``, PodLevelResources) that replace the
    containers' sum, with the API server's defaulting (KEP 2837): a resource with a pod-level
    limit but no pod-level request asks the containers' sum if a container asks it (CPU and
    memory), else the limit. None: no pod-level resources."""
    if spec.get("resources") is None:
        return None
    field = f"{prefix}.resources"
    if not isinstance(spec["resources"], Mapping):
        raise TemplateError(field, "must be an object")
    requests = _amounts(spec["resources"].get("requests"), f"{field}.requests")
    limits = _amounts(spec["resources"].get("limits"), f"{field}.limits")
    for name, kind in (*((n, "requests") for n in requests), *((n, "limits") for n in limits)):
        if name not in ("cpu", "memory") and not name.startswith(HUGEPAGES):
            raise TemplateError(key_field(f"{field}.{kind}", name),
                                "pod-level resources take only cpu, memory and hugepages-<size>")
    asked = dict(requests)
    for name, limit in limits.items():
        if name not in asked and not (name in ("cpu", "memory") and _containers_ask(spec, name)):
            asked[name] = limit
    return asked


def _containers_ask(spec: Mapping[str, Any], name: str) -> bool:
    """Whether any container, init container or sidecar requests ``name`` (or limits it)."""
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            resources = (c.get("resources") or {}) if isinstance(c, Mapping) else {}
            if any(name in (resources.get(kind) or {}) for kind in ("requests", "limits")):
                return True
    return False


def pod_demand(spec: Mapping[str, Any], prefix: str = "spec") -> Demand:
    """The Kubernetes rule: max(sum of the containers, the largest init step) + overhead, where
    sidecars (init containers with restartPolicy Always) run on beside what starts after them;
    pod-level requests (``spec.resources``), where set, replace that for CPU, memory and hugepages."""
    containers = Demand()
    for i, c in enumerate(_list(spec, "containers", prefix)):
        containers = containers + _container(c, f"{prefix}.containers[{i}]")
    sidecars, init = Demand(), Demand()
    for i, c in enumerate(_list(spec, "initContainers", prefix)):
        own = _container(c, f"{prefix}.initContainers[{i}]")
        if c.get("restartPolicy") == "Always":
            sidecars = sidecars + own
            init = init.most(sidecars)
        else:
            init = init.most(own + sidecars)
    total = (containers + sidecars).most(init)
    pod_level = _pod_level(spec, prefix)
    if pod_level:
        summed = {"cpu": total.cpu_milli, "memory": total.memory_bytes, **dict(total.extended)}
        total = _demand({**summed, **pod_level})
    return total + _resources(spec.get("overhead"), f"{prefix}.overhead")


GPU_DOMAIN = "nvidia.com/"


def refuse_gpu_resources(spec: Mapping[str, Any], prefix: str = "spec") -> None:
    """TemplateError for a template that asks the NVIDIA device plugin for a GPU (nvidia.com/gpu,
    nvidia.com/mig-*): fastshare owns the GPUs of its nodes (no device plugin runs there) and
    gives them out by the FastPod's ``spec.gpu``; the Pod would find none there, or take a GPU
    beside its share."""
    for key in ("containers", "initContainers"):
        for i, c in enumerate(_list(spec, key, prefix)):
            resources = c.get("resources") if isinstance(c, Mapping) else None
            for kind in ("limits", "requests"):
                amounts = resources.get(kind) if isinstance(resources, Mapping) else None
                for name in amounts if isinstance(amounts, Mapping) else ():
                    if isinstance(name, str) and name.startswith(GPU_DOMAIN):
                        raise TemplateError(key_field(f"{prefix}.{key}[{i}].resources.{kind}", name),
                                             "fastshare gives out the GPUs of its nodes: ask for a GPU "
                                             "share in the FastPod's spec.gpu (kind, count, memory, ...) "
                                             "instead of the device plugin's resource")


def refuse_resource_claims(spec: Mapping[str, Any], prefix: str = "spec") -> None:
    """TemplateError for a template with ResourceClaims (dynamic resource allocation: the Pod's
    ``resourceClaims``, a container's ``resources.claims``): the scheduler allocates a claim
    while it places the Pod, and fastshare binds its Pods itself, so the claim would stay
    unallocated and the Pod would never start."""
    claims = spec.get("resourceClaims")
    if claims:
        raise TemplateError(f"{prefix}.resourceClaims", _CLAIMS)
    for key in ("containers", "initContainers"):
        for i, c in enumerate(_list(spec, key, prefix)):
            resources = c.get("resources") if isinstance(c, Mapping) else None
            if isinstance(resources, Mapping) and resources.get("claims"):
                raise TemplateError(f"{prefix}.{key}[{i}].resources.claims", _CLAIMS)


_CLAIMS = ("fastshare places its Pods itself and cannot allocate ResourceClaims (dynamic resource "
           "allocation), so the Pod would never start: remove the claims (ask for GPU shares in the "
           "FastPod's spec.gpu)")


def pod_running_demand(pod: Mapping[str, Any]) -> Demand:
    """A bound Pod's request as a node counts it; a Pod the API server accepted is readable, so
    a field that is not counts as nothing rather than stopping the count of a whole node."""
    try:
        return pod_demand(pod.get("spec") or {})
    except TemplateError:
        return Demand()


# -- host ports -------------------------------------------------------------------------------------
ANY_IP = "0.0.0.0"
PROTOCOLS = ("TCP", "UDP", "SCTP")


class HostPort(NamedTuple):
    """A port a Pod takes on its node (the NodePorts filter's triple); ``ip`` ANY_IP: every address."""

    ip: str
    protocol: str
    port: int

    def __str__(self) -> str:
        return f"{self.port}/{self.protocol}" + ("" if self.ip == ANY_IP else f" on {self.ip}")

    def conflicts(self, other: HostPort) -> bool:
        """Same port and protocol, and an address in common (ANY_IP has every one)."""
        return (self.port, self.protocol) == (other.port, other.protocol) and (
            self.ip == other.ip or ANY_IP in (self.ip, other.ip))


def _port_containers(spec: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """The containers whose ports a node holds while the Pod runs: init containers only as
    sidecars (restartPolicy Always), as the scheduler's GetHostPorts."""
    out = [(f"{prefix}.initContainers[{i}]", c) for i, c in enumerate(_list(spec, "initContainers", prefix))
           if isinstance(c, Mapping) and c.get("restartPolicy") == "Always"]
    return out + [(f"{prefix}.containers[{i}]", c) for i, c in enumerate(_list(spec, "containers", prefix))]


def host_ports(spec: Mapping[str, Any], prefix: str = "spec") -> tuple[HostPort, ...]:
    """The host ports a Pod spec takes (TemplateError naming the field if one cannot be read),
    with the API server's defaults: protocol TCP, every address, and under ``hostNetwork`` the
    container port as the host port."""
    out = []
    host_network = spec.get("hostNetwork") is True
    for at, container in _port_containers(spec, prefix):
        if not isinstance(container, Mapping):
            raise TemplateError(at, "must be an object")
        for j, item in enumerate(_list(container, "ports", at)):
            field = f"{at}.ports[{j}]"
            if not isinstance(item, Mapping):
                raise TemplateError(field, "must be an object")
            key, port = "hostPort", item.get("hostPort")
            if host_network and (port is None or (type(port) is int and port == 0)):   # 0 is unset too
                key, port = "containerPort", item.get("containerPort")
            if port is None or (type(port) is int and port == 0):   # 0: no host port
                continue
            if type(port) is not int or not 1 <= port <= 65535:
                raise TemplateError(f"{field}.{key}", f"must be an integer from 1 to 65535 (got {port!r})")
            protocol = item.get("protocol") or "TCP"
            if protocol not in PROTOCOLS:
                raise TemplateError(f"{field}.protocol",
                                    f"must be one of {', '.join(PROTOCOLS)} (got {protocol!r})")
            ip = item.get("hostIP") or ANY_IP
            if not isinstance(ip, str):
                raise TemplateError(f"{field}.hostIP", f"must be an IP address (got {ip!r})")
            out.append(HostPort(ip, protocol, port))
    return tuple(out)


def running_host_ports(pod: Mapping[str, Any]) -> tuple[HostPort, ...]:
    """A bound Pod's host ports; one the API server accepted is readable, so an entry that is
    not counts as none rather than stopping the count of a whole node."""
    try:
        return host_ports(pod.get("spec") or {})
    except TemplateError:
        return ()


def port_taken(wanted: Iterable[HostPort], used: Iterable[HostPort]) -> HostPort | None:
    """The first of ``wanted`` that one of ``used`` (a node's bound Pods') conflicts with."""
    held = list(used)
    return next((p for p in wanted if any(p.conflicts(u) for u in held)), None)


# -- nodes -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str

    def __str__(self) -> str:
        return f"{self.key}{'=' + self.value if self.value else ''}:{self.effect}"


@dataclass(frozen=True)
class NodeFacts:
    """What placement needs of a Node object."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[Taint, ...] = ()
    unschedulable: bool = False
    allocatable: Demand = Demand()
    max_pods: int = 0   # status.allocatable.pods; 0: not reported, no limit known
    # status.allocatable's other resources (see Demand.extended), zeros kept: "have 0" is not "have no"
    extended: tuple[tuple[str, int], ...] = ()

    def extended_problem(self, asked: Demand, used: Mapping[str, int]) -> str | None:
        """Why a Pod asking ``asked`` does not fit beside bound Pods that request ``used`` of the
        resources besides CPU and memory (the kubelet refuses: OutOf<resource>)."""
        have = dict(self.extended)
        for name, amount in asked.extended:
            if name not in have:
                return f"have no {name} (status.allocatable)"
            free = have[name] - used.get(name, 0)
            if amount > free:
                return f"have {_amount_text(name, max(0, free))} {name} free, the replica asks " \
                       f"{_amount_text(name, amount)}"
        return None


def _amount_text(name: str, amount: int) -> str:
    """A count as it is, bytes in the largest binary unit that divides them (1Gi, 512Mi)."""
    if is_extended(name):
        return str(amount)
    for power, unit in ((60, "Ei"), (50, "Pi"), (40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")):
        if amount and amount % 2**power == 0:
            return f"{amount >> power}{unit}"
    return str(amount)


def node_facts(node: Mapping[str, Any]) -> NodeFacts:
    """From a Node object's JSON; a missing allocatable (no kubelet reported yet) counts as none."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    allocatable = status.get("allocatable") or {}
    try:
        capacity = Demand(milli(allocatable.get("cpu", 0), "cpu"),
                          whole(allocatable.get("memory", 0), "memory"))
    except TemplateError:
        capacity = Demand()
    try:
        max_pods = whole(allocatable.get("pods", 0), "pods")
    except TemplateError:
        max_pods = 0
    extended = []
    for name, value in sorted(allocatable.items()):
        if name not in ("cpu", "memory", "pods"):
            try:
                extended.append((name, _amount(name, value, name)))
            except TemplateError:
                continue   # not a resource a Pod can ask for: nothing to count
    taints = tuple(Taint(t.get("key") or "", t.get("value") or "", t.get("effect") or "")
                   for t in spec.get("taints") or [])
    labels = tuple(sorted((meta.get("labels") or {}).items()))
    return NodeFacts(name=meta["name"], labels=labels, taints=taints,
                     unschedulable=bool(spec.get("unschedulable")), allocatable=capacity,
                     max_pods=max_pods, extended=tuple(extended))


# -- a Pod's constraints on nodes -----------------------------------------------------------------------
_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str
    values: tuple[str, ...]

    def matches(self, value: str | None) -> bool:
        op = self.operator
        if op == "In":
            return value is not None and value in self.values
        if op == "NotIn":
            return value is None or value not in self.values
        if op == "Exists":
            return value is not None
        if op == "DoesNotExist":
            return value is None
        have, bound = _integer(value), _integer(self.values[0])   # Gt / Lt: both integers, else no match
        if have is None or bound is None:
            return False
        return have > bound if op == "Gt" else have < bound


_INTEGER = re.compile(r"[+-]?[0-9]+")


def _integer(text: str | None) -> int | None:
    """An integer as Go's strconv.ParseInt(text, 10, 64) reads it (int() also takes "1_000",
    " 7" or other scripts' digits), None if it does not."""
    if text is None or not _INTEGER.fullmatch(text) or not -2**63 <= (value := int(text)) < 2**63:
        return None
    return value


def requirement(item: object, at: str, allowed: tuple[str, ...]) -> Requirement:
    """One ``{key, operator, values}`` of a node or label selector, checked as the API server
    does (``allowed``: the operators of that kind of selector); the error names ``at``."""
    if not isinstance(item, Mapping) or not isinstance(item.get("key"), str) or not item["key"]:
        raise TemplateError(at, "needs a key (non-empty string) and an operator")
    op, values = item.get("operator"), item.get("values") or []
    if op not in allowed:
        raise TemplateError(f"{at}.operator", f"must be one of {', '.join(allowed)} (got {op!r})")
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise TemplateError(f"{at}.values", "must be a list of strings")
    if op in ("In", "NotIn") and not values:
        raise TemplateError(f"{at}.values", f"operator {op} needs at least one value")
    if op in ("Exists", "DoesNotExist") and values:
        raise TemplateError(f"{at}.values", f"operator {op} takes no values")
    if op in ("Gt", "Lt"):
        if len(values) != 1:
            raise TemplateError(f"{at}.values", f"operator {op} needs exactly one value")
        if _integer(values[0]) is None:
            raise TemplateError(f"{at}.values", f"operator {op} needs an integer (got {values[0]!r})")
    return Requirement(item["key"], op, tuple(values))


def _requirements(items: object, field: str, fields: bool) -> tuple[Requirement, ...]:
    if items is None:
        return ()
    if not isinstance(items, list):
        raise TemplateError(field, "must be a list")
    out = []
    for i, item in enumerate(items):
        at = f"{field}[{i}]"
        out.append(requirement(item, at, ("In", "NotIn") if fields else _OPERATORS))
        if fields and out[-1].key != "metadata.name":
            raise TemplateError(f"{at}.key", f"only metadata.name is supported (got {out[-1].key!r})")
    return tuple(out)


@dataclass(frozen=True)
class _Term:
    expressions: tuple[Requirement, ...]
    fields: tuple[Requirement, ...]

    def matches(self, node: NodeFacts) -> bool:
        if not self.expressions and not self.fields:
            return False   # an empty term selects no node (as in the scheduler)
        labels = dict(node.labels)
        return (all(r.matches(labels.get(r.key)) for r in self.expressions)
                and all(r.matches(node.name) for r in self.fields))


@dataclass(frozen=True)
class _Toleration:
    key: str
    operator: str
    value: str
    effect: str

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if not self.key:
            return self.operator == "Exists"   # empty key with Exists: every taint
        if self.key != taint.key:
            return False
        return self.operator == "Exists" or self.value == taint.value


@dataclass(frozen=True)
class Constraints:
    """A Pod's required node affinity (None: any node) and its tolerations."""

    terms: tuple[_Term, ...] | None = None
    tolerations: tuple[_Toleration, ...] = ()

    def tolerates(self, taint: Taint) -> bool:
        return any(t.tolerates(taint) for t in self.tolerations)

    def problem(self, node: NodeFacts, prefix: str = "spec") -> str | None:
        """Why a Pod with these constraints may not run on ``node`` (None: it may)."""
        if node.unschedulable and not self.tolerates(Taint(UNSCHEDULABLE_TAINT, "", "NoSchedule")):
            return "are cordoned (spec.unschedulable)"
        for taint in node.taints:
            if taint.effect in _BLOCKING and not self.tolerates(taint):
                return f"have taint {taint} that {prefix}.tolerations does not tolerate"
        if self.terms is not None and not any(t.matches(node) for t in self.terms):
            return f"do not match {prefix}.{_AFFINITY}"
        return None


def constraints(spec: Mapping[str, Any], prefix: str = "spec") -> Constraints:
    """Read (and check) a Pod spec's required node affinity and tolerations."""
    terms = None
    affinity = spec.get("affinity") or {}
    if not isinstance(affinity, Mapping):
        raise TemplateError(f"{prefix}.affinity", "must be an object")
    node_affinity = affinity.get("nodeAffinity") or {}
    if not isinstance(node_affinity, Mapping):
        raise TemplateError(f"{prefix}.affinity.nodeAffinity", "must be an object")
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None:
        field = f"{prefix}.{_AFFINITY}.nodeSelectorTerms"
        raw = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
        if not isinstance(raw, list) or not raw:
            raise TemplateError(field, "must be a non-empty list of terms")
        parsed = []
        for i, term in enumerate(raw):
            if not isinstance(term, Mapping):
                raise TemplateError(f"{field}[{i}]", "must be an object")
            at = f"{field}[{i}]"
            parsed.append(_Term(_requirements(term.get("matchExpressions"), f"{at}.matchExpressions", False),
                                _requirements(term.get("matchFields"), f"{at}.matchFields", True)))
        terms = tuple(parsed)
    tolerations = []
    for i, t in enumerate(_list(spec, "tolerations", prefix)):
        at = f"{prefix}.tolerations[{i}]"
        if not isinstance(t, Mapping):
            raise TemplateError(at, "must be an object")
        key, op, value, effect = t.get("key") or "", t.get("operator") or "Equal", t.get("value") or "", \
            t.get("effect") or ""
        if not all(isinstance(x, str) for x in (key, op, value, effect)):
            raise TemplateError(at, "key, operator, value and effect must be strings")
        if op not in ("Equal", "Exists"):
            raise TemplateError(f"{at}.operator", f"must be Equal or Exists (got {op!r})")
        if not key and op != "Exists":
            raise TemplateError(f"{at}.operator", "an empty key needs operator Exists")
        if op == "Exists" and value:
            raise TemplateError(f"{at}.value", "operator Exists takes no value")
        if effect not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise TemplateError(f"{at}.effect",
                                f"must be NoSchedule, PreferNoSchedule or NoExecute (got {effect!r})")
        tolerations.append(_Toleration(key, op, value, effect))
    return Constraints(terms, tuple(tolerations))
