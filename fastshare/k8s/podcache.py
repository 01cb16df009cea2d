"""The controller's replica Pods as a watch keeps them (an informer), so that a reconcile pass
does not list a FastPod's Pods again: for 50 replicas that list was ~240 KB of JSON per pass,
the biggest single cost of the controller's process.

A pass must never believe a Pod is gone when it exists (it would release the Pod's share), nor
that a Pod it just deleted is still live (it would delete another one on scale-down):

- Pods this process creates or deletes are put in from the API's reply at once, before the
  watch reports them;
- an event older than what is held (resourceVersion) is ignored, and a deleted Pod leaves a
  tombstone so that a late reply cannot bring it back;
- a relist replaces the contents but keeps what is newer than the list (written meanwhile);
- the watch is renewed from its last version, not by a relist (only after 410 Gone): what it
  has handled up to a version (``caught_up``) is as good as a listing for the tombstones and
  notes, which are forgotten up to it, so they do not pile up; a change of a Pod not held that
  is no newer than that is stale (the watch showed the Pod, or its deletion) and ignored;
- until the first list arrived the cache is not ``synced`` and passes wait.
"""

from __future__ import annotations

import threading
from typing import Any

from fastshare.k8s.pods import FASTPOD_LABEL

Key = tuple[str, str]


def resource_version(pod: dict[str, Any]) -> int:
    """resourceVersions are etcd revisions; compared only between versions of one Pod."""
    try:
        return int(pod["metadata"].get("resourceVersion") or 0)
    except ValueError:
        return 0


def _as_int(version: str) -> int:
    try:
        return int(version)
    except ValueError:
        return 0


def pod_key(pod: dict[str, Any]) -> Key:
    """A Pod's namespace and name; a Node's name (it has no namespace)."""
    return pod["metadata"].get("namespace", ""), pod["metadata"]["name"]


class WatchCache:
    """Something a watch fills: not ``synced`` until its first full listing arrived.

    What is held changes only forward (resourceVersion): a change older than the last one
    applied to its Pod, or than the last listing, is ignored, so that a create's reply applied
    after the watch reported the Pod ended or deleted does not count it again. A relist must
    not drop what was put or removed after its snapshot was taken (our own create's reply, or
    a watch event): subclasses note each change (:meth:`_note`, which also says whether it is
    stale) and merge those newer than the listing into it (:meth:`_newer_kept`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._synced = threading.Event()
        # put (entry) or removed (None) since the listing it is newer than, by version
        self._since: dict[Key, tuple[int, Any]] = {}
        self._as_of = 0   # the last listing's resourceVersion

    def _note(self, pod: dict[str, Any], entry: Any) -> bool:
        """Under the lock: ``pod`` is to be put (as ``entry``) or removed (None); False, and
        nothing noted, if that is older than what is known of it (apply nothing)."""
        key, version = pod_key(pod), resource_version(pod)
        noted = self._since.get(key)
        if version < max(self._as_of, noted[0] if noted is not None else 0):
            return False
        self._since[key] = (version, entry)
        return True

    def _newer_kept(self, fresh: dict[Key, Any], list_version: str) -> dict[Key, Any]:
        """Under the lock: ``fresh`` (a listing as of ``list_version``) with the changes noted
        after it applied; the notes it covers are then forgotten (the newer ones still guard
        against older changes arriving late)."""
        as_of = _as_int(list_version)
        for key, (version, entry) in self._since.items():
            if version > as_of:
                fresh.pop(key, None)
                if entry is not None:
                    fresh[key] = entry
        self._forget_through(as_of)
        return fresh

    def _forget_through(self, as_of: int) -> None:
        """Under the lock: every change up to ``as_of`` is known; what is noted up to it goes
        (a change that old is ignored from now on anyway)."""
        self._since = {k: noted for k, noted in self._since.items() if noted[0] > as_of}
        self._as_of = max(self._as_of, as_of)

    def caught_up(self, version: str) -> None:
        """The watch has handled every change up to ``version`` (it is renewed from there)."""
        with self._lock:
            self._forget_through(_as_int(version))

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)


class PodCache(WatchCache):
    def __init__(self) -> None:
        super().__init__()
        self._pods: dict[Key, dict[str, Any]] = {}
        self._gone: dict[Key, int] = {}   # tombstones: version at deletion

    def replace(self, pods: list[dict[str, Any]], list_version: str) -> None:
        """A fresh list (as of ``list_version``) replaces everything older than it."""
        as_of = _as_int(list_version)
        fresh = {pod_key(p): p for p in pods}
        with self._lock:
            for key, pod in self._pods.items():
                if resource_version(pod) > as_of:
                    fresh[key] = pod  # created or changed (our delete's reply) after the list was taken
            for key, version in self._gone.items():
                if version > as_of:
                    fresh.pop(key, None)
            self._pods = fresh
            self._forget_through(as_of)
        self._synced.set()

    def _forget_through(self, as_of: int) -> None:
        """Under the lock: the tombstones up to ``as_of`` go (see put)."""
        self._gone = {k: v for k, v in self._gone.items() if v > as_of}
        self._as_of = max(self._as_of, as_of)

    def put(self, pod: dict[str, Any]) -> None:
        """An added or changed Pod (watch event or our own create/delete reply)."""
        key, version = pod_key(pod), resource_version(pod)
        with self._lock:
            held = self._pods.get(key)
            if held is None and version <= self._as_of:
                return   # the watch (or a listing) went past it and holds no such Pod: it is gone
            if (held is not None and resource_version(held) > version) or self._gone.get(key, -1) >= version:
                return
            self._pods[key] = pod

    def remove(self, pod: dict[str, Any]) -> None:
        """A Pod that no longer exists."""
        key, version = pod_key(pod), resource_version(pod)
        with self._lock:
            held = self._pods.get(key)
            if held is not None and resource_version(held) > version:
                return
            self._pods.pop(key, None)
            self._gone[key] = max(version, self._gone.get(key, 0))

    def gone(self, namespace: str, name: str) -> None:
        """The API said this Pod does not exist (any more)."""
        with self._lock:
            held = self._pods.pop((namespace, name), None)
            if held is not None:
                key = (namespace, name)
                self._gone[key] = max(resource_version(held), self._gone.get(key, 0))

    def of(self, namespace: str, fastpod: str) -> list[dict[str, Any]]:
        """The Pods labelled as ``fastpod``'s (owner not checked here)."""
        with self._lock:
            return [p for (ns, _), p in self._pods.items()
                    if ns == namespace and (p["metadata"].get("labels") or {}).get(FASTPOD_LABEL) == fastpod]
