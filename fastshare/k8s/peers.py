"""The Pods bound to each node as inter-pod affinity and topology spread read them, kept from
the same watch of every namespace's bound, unfinished Pods as the node usage (see nodeusage):
each Pod's node, namespace, name, labels, its own required anti-affinity terms (the symmetric
rule) and whether it is terminating, not the Pod.

A relist must not drop a Pod put in after its snapshot was taken (our own create's reply, or a
watch event): such a Pod is kept until the watch reports it, as in podcache; it is what the
next replica of another FastPod's pass is checked against. Nor may an older change undo a
newer one (a create's reply applied after the watch saw the Pod end): see WatchCache."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from fastshare.k8s.podaffinity import Peer, peer
from fastshare.k8s.podcache import Key, WatchCache, pod_key


class PodPeers(WatchCache):
    def __init__(self) -> None:
        super().__init__()
        self._pods: dict[Key, Peer] = {}
        self._forbidding: dict[Key, Peer] = {}   # those with required anti-affinity terms

    def replacing(self, pods: Iterable[dict[str, Any]], list_version: str = "0") -> Iterator[dict[str, Any]]:
        """Pass a fresh listing (as of ``list_version``) on, to another cache reading it page by
        page, so that it is read once; read to its end, it replaces what is held, but for what
        was put or removed after it was taken."""
        fresh: dict[Key, Peer] = {}
        for pod in pods:
            if (entry := peer(pod)) is not None:
                fresh[pod_key(pod)] = entry
            yield pod
        with self._lock:
            self._pods = self._newer_kept(fresh, list_version)
            self._forbidding = {k: p for k, p in self._pods.items() if p.anti_affinity}
        self._synced.set()

    def put(self, pod: dict[str, Any]) -> None:
        """An added or changed Pod (a watch event, or the reply to our own create)."""
        entry, key = peer(pod), pod_key(pod)
        with self._lock:
            if not self._note(pod, entry):
                return
            self._pods.pop(key, None)
            self._forbidding.pop(key, None)
            if entry is not None:
                self._pods[key] = entry
                if entry.anti_affinity:
                    self._forbidding[key] = entry

    def remove(self, pod: dict[str, Any]) -> None:
        key = pod_key(pod)
        with self._lock:
            if self._note(pod, None):
                self._pods.pop(key, None)
                self._forbidding.pop(key, None)

    def all(self) -> dict[Key, Peer]:
        with self._lock:
            return dict(self._pods)

    def forbidding(self) -> list[Peer]:
        """The bound Pods that have required anti-affinity terms of their own."""
        with self._lock:
            return list(self._forbidding.values())
