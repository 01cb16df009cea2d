"""The cluster's Node objects as a watch keeps them (an informer): the GPU nodes for the Node
sync that pings every agent (the agents' heartbeats) every ``--node-interval``, and every node for
the topology domains of inter-pod rules.

The sync listed every GPU Node each time, each as a typed object: a real Node carries its
images and conditions (some 12 KB of JSON), so at 10,000 nodes that was 117 MB from the API
server and about 6 CPU s of the controller per sync; now 0.1 s (``bench/k8s_nodes.py``). A
replica with inter-pod rules listed every Node of the cluster the same way. A watch sends only
what changes (with node leases, a kubelet writes its Node on a change or every few minutes).
Only what the controller reads of a Node is kept: its name, labels and annotations, spec, and
the allocatable and addresses of its status.

Changes go forward only, by resourceVersion, and a relist keeps what was put or removed after
its snapshot (see WatchCache)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastshare.k8s.podcache import Key, WatchCache, pod_key


def slim(node: dict[str, Any]) -> dict[str, Any]:
    """What the controller reads of a Node object."""
    meta, status = node.get("metadata") or {}, node.get("status") or {}
    kept = ("name", "labels", "annotations", "resourceVersion")
    return {"metadata": {k: meta[k] for k in kept if k in meta},
            "spec": node.get("spec") or {},
            "status": {k: status[k] for k in ("allocatable", "addresses") if k in status}}


class NodeCache(WatchCache):
    def __init__(self) -> None:
        super().__init__()
        self._nodes: dict[Key, dict[str, Any]] = {}

    def replace(self, nodes: Iterable[dict[str, Any]], list_version: str = "0") -> None:
        """A fresh listing (as of ``list_version``) replaces what is held, but for what was put
        or removed after it was taken."""
        fresh = {pod_key(n): slim(n) for n in nodes}
        with self._lock:
            self._nodes = self._newer_kept(fresh, list_version)
        self._synced.set()

    def put(self, node: dict[str, Any]) -> None:
        """An added or changed Node (a watch event)."""
        entry = slim(node)
        with self._lock:
            if self._note(node, entry):
                self._nodes[pod_key(node)] = entry

    def remove(self, node: dict[str, Any]) -> None:
        """A deleted Node."""
        with self._lock:
            if self._note(node, None):
                self._nodes.pop(pod_key(node), None)

    def nodes(self) -> list[dict[str, Any]]:
        """The Nodes held, by name (each is the cache's own: read, do not change)."""
        with self._lock:
            return [self._nodes[k] for k in sorted(self._nodes)]
