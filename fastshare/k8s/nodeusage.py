"""What the Pods bound to each node request, kept from a watch of every namespace's bound,
non-terminated Pods (an informer), so that placement sees the CPU, memory and other resources
(extended resources, hugepages, ephemeral storage) and the host ports that Pods fastshare did
not create take, without listing Pods per pass. Only each Pod's node, effective request,
allocation id and host ports are kept, not the Pod."""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping
from typing import Any

from fastshare.k8s.podcache import Key, WatchCache, pod_key
from fastshare.k8s.pods import ALLOCATION_ANNOTATION
from fastshare.k8s.scheduling import Demand, HostPort, pod_running_demand, running_host_ports

# The Pods a kubelet counts: bound, not ended (a Pod that ends leaves the watch as DELETED).
FIELD_SELECTOR = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"

# node, request, allocation id ("" for Pods not ours), host ports
Entry = tuple[str, Demand, str, tuple[HostPort, ...]]


def _entry(pod: dict[str, Any]) -> Entry | None:
    node = (pod.get("spec") or {}).get("nodeName")
    if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    allocation = (pod["metadata"].get("annotations") or {}).get(ALLOCATION_ANNOTATION, "")
    return node, pod_running_demand(pod), allocation, running_host_ports(pod)


class NodeUsage(WatchCache):
    def __init__(self) -> None:
        super().__init__()
        self._pods: dict[Key, Entry] = {}
        # the same entries by node: a node's Pods without a walk over every Pod of the cluster
        self._by_node: dict[str, dict[Key, tuple[Demand, str]]] = {}
        # the host ports of the Pods that take some, by node (most Pods take none)
        self._ports: dict[str, dict[Key, tuple[HostPort, ...]]] = {}

    def replace(self, pods: Iterable[dict[str, Any]], list_version: str = "0") -> None:
        """A fresh listing (as of ``list_version``) replaces what is held, but for what was put
        or removed after it was taken (a replica's Pod just created keeps its host ports and
        devices counted until the watch reports it)."""
        fresh = {pod_key(p): e for p in pods if (e := _entry(p)) is not None}
        with self._lock:
            self._pods = self._newer_kept(fresh, list_version)
            self._by_node, self._ports = {}, {}
            for key, entry in self._pods.items():
                self._index(key, entry)
        self._synced.set()

    def _index(self, key: Key, entry: Entry) -> None:
        node, demand, allocation, taken = entry
        self._by_node.setdefault(node, {})[key] = (demand, allocation)
        if taken:
            self._ports.setdefault(node, {})[key] = taken

    def _drop(self, key: Key) -> None:
        old = self._pods.pop(key, None)
        if old is not None:
            for index in (self._by_node, self._ports):
                on_node = index.get(old[0], {})
                on_node.pop(key, None)
                if not on_node:
                    index.pop(old[0], None)

    def put(self, pod: dict[str, Any]) -> None:
        entry, key = _entry(pod), pod_key(pod)
        with self._lock:
            if not self._note(pod, entry):
                return
            self._drop(key)
            if entry is not None:
                self._pods[key] = entry
                self._index(key, entry)

    def remove(self, pod: dict[str, Any]) -> None:
        with self._lock:
            if self._note(pod, None):
                self._drop(pod_key(pod))

    def count(self, node: str) -> int:
        """How many bound, unfinished Pods the node runs."""
        with self._lock:
            return len(self._by_node.get(node, {}))

    def on(self, nodes: Iterable[str]) -> dict[str, list[tuple[Demand, str]]]:
        """Per node of ``nodes``: each bound Pod's request and allocation id."""
        with self._lock:
            return {n: list(self._by_node.get(n, {}).values()) for n in nodes}

    def ports(self, nodes: Iterable[str]) -> dict[str, list[HostPort]]:
        """Per node of ``nodes``: the host ports its bound Pods take."""
        with self._lock:
            return {n: [p for taken in self._ports.get(n, {}).values() for p in taken] for n in nodes}


def _engine_counted(pods: Iterable[tuple[Demand, str]], held: Container[str]
                    ) -> Iterator[tuple[Demand, str | None]]:
    """Each bound Pod with the allocation the engine counts for it on this node (``held``), or
    None: one Pod per allocation only (a copy of a replica Pod keeps its annotation, and the
    kubelet counts both)."""
    covered: set[str] = set()
    for demand, allocation in pods:
        if allocation and allocation not in covered and allocation in held:
            covered.add(allocation)
            yield demand, allocation
        else:
            yield demand, None


def host_left(allocatable: Demand, pods: Iterable[tuple[Demand, str]],
              held: dict[str, tuple[int, int]]) -> Demand:
    """What a node has left for the engine's assignments: its allocatable minus what bound Pods
    request, where a Pod whose allocation the engine holds on this node (``held``: id -> cpu
    milli, memory MiB) counts only beyond what the engine already counts for it, so it is not
    counted twice. May be negative (over-committed)."""
    cpu, memory = allocatable.cpu_milli, allocatable.memory_bytes
    for demand, mine in _engine_counted(pods, held):
        counted_cpu, counted_mib = held[mine] if mine else (0, 0)
        cpu -= max(0, demand.cpu_milli - counted_cpu)
        memory -= max(0, demand.memory_bytes - counted_mib * 1024**2)
    return Demand(cpu, memory)


def pods_left(max_pods: int, pods: Iterable[tuple[Demand, str]], held: Container[str]) -> int:
    """How many of the engine's assignments a node that allows ``max_pods`` Pods takes (held
    ones included): its bound Pods count, but for those the engine counts itself. May be
    negative."""
    return max_pods - sum(1 for _, mine in _engine_counted(pods, held) if mine is None)


def extended_used(pods: Iterable[tuple[Demand, str]], placing: Mapping[str, Demand]) -> dict[str, int]:
    """What a node's bound Pods request of each resource besides CPU and memory (the engine
    counts none of them), plus what replicas placed there ask whose Pod the watch has not shown
    yet (``placing``: allocation id -> request; one whose Pod is seen counts by its Pod)."""
    used: dict[str, int] = {}
    seen = set()
    for demand, allocation in pods:
        seen.add(allocation)
        for name, amount in demand.extended:
            used[name] = used.get(name, 0) + amount
    for allocation, demand in placing.items():
        if allocation not in seen:
            for name, amount in demand.extended:
                used[name] = used.get(name, 0) + amount
    return used
