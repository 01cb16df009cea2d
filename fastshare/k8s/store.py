"""The controller's state store over the Kubernetes API: one FastShareAllocation per allocation.

In-cluster, the Kubernetes API is the state of record. Each allocation is one small custom
object (``fastshareallocations.fastshare.io``) in its FastPod's namespace, named after the
replica's Pod, so that creating it IS the idempotency check: AlreadyExists with the same key is
:class:`DuplicateKey`. Its ``spec`` holds a few readable fields for ``kubectl`` (the same
summary the FastPod status shows, :func:`summary`) plus ``record``, the whole
:class:`Allocation`.

Why not the FastPod's status, where the records lived first: every allocation step rewrote the
whole list of a FastPod's records, so a write cost grew with the number of replicas
(bench/k8s_status_size.py: 5.6 ms empty, 291 ms with 200) and a FastPod's replicas queued
behind each other. A write of one of these objects costs the same for any replica count.

- Every update is a compare-and-set on the object's resourceVersion: the write that lost a race
  re-reads the object and re-checks the expected state, so two controllers (or a controller and
  its restarted self) never both win a transition (:class:`Conflict`).
- The last object seen per allocation is kept in memory for its resourceVersion, so a write
  needs no read first; a stale copy only costs one 409 and a re-read.
- The FastPod owns it (ownerReference: leftovers are garbage-collected with the FastPod), and
  while it holds a share it carries a finalizer, so no deletion (garbage collector in
  foreground mode, a user's ``kubectl delete``) can drop a record whose share is not released:
  it is only marked, and the controller releases the share first (:meth:`allocations_of`
  reports such marks). The step to released/failed removes the finalizer in the same write.

Nodes are not recorded here: the controller rebuilds them from Node objects and the agents'
inventories on every start, so they are kept in memory.

Allocation owners are ``namespace/fastpod`` and idempotency keys ``namespace/fastpod/pod``
(see :func:`replica_key`), which is how an allocation finds its FastPod and its object.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, replace
from typing import Any

from kubernetes import client

from fastshare.controller.model import HOLDING, Allocation, Device, Node, Spec, State
from fastshare.controller.store import Conflict, DuplicateKey, StateStore, StoreError
from fastshare.k8s.leader import Fence
from fastshare.k8s.pods import FASTPOD_LABEL
from fastshare.k8s.resources import (
    ALLOCATION_FINALIZER,
    ALLOCATION_KIND,
    ALLOCATION_LABEL,
    ALLOCATION_PLURAL,
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    clip,
)

_MUTABLE = {"state", "node", "devices", "env", "reason", "assignment", "updated_at", "lease_ttl",
            "lease_expires_at"}
_RETRIES = 20
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def replica_key(namespace: str, fastpod: str, pod: str) -> str:
    """The idempotency key of one replica's allocation."""
    return f"{namespace}/{fastpod}/{pod}"


def parse_key(key: str) -> tuple[str, str, str]:
    parts = key.split("/")
    if len(parts) != 3 or not all(parts):
        raise StoreError(f"idempotency key {key!r} is not namespace/fastpod/pod")
    return parts[0], parts[1], parts[2]


def to_record(allocation: Allocation) -> dict[str, Any]:
    data = asdict(allocation)
    data["spec"] = allocation.spec.to_json()
    data["state"] = allocation.state.value
    return data


def from_record(data: dict[str, Any]) -> Allocation:
    data = dict(data)
    data["spec"] = Spec.from_json(data["spec"])
    data["state"] = State(data["state"])
    data["devices"] = [Device(**d) for d in data.get("devices") or []]
    data["env"] = dict(data.get("env") or {})
    data["assignment"] = dict(data.get("assignment") or {})
    return Allocation(**data)


def summary(pod: str, allocation: Allocation) -> dict[str, Any]:
    """Where one replica runs and what it holds: a FastPod ``status.assignments`` item, and the
    readable part of its allocation object."""
    entry: dict[str, Any] = {
        "pod": pod,
        "node": allocation.node,
        "allocation": allocation.id,
        "state": allocation.state.value,
        "gpuUUIDs": [d.gpu_uuid for d in allocation.devices],
    }
    mig = next((d for d in allocation.devices if d.mig_profile), None)
    if mig is not None:
        if mig.mig_uuid:
            entry["migUUID"] = mig.mig_uuid
        entry["placement"] = {"gpuIndex": mig.gpu_index, "profile": mig.mig_profile,
                              "start": mig.mig_start, "size": mig.mig_size}
    if allocation.reason:
        entry["reason"] = allocation.reason
    return entry


def _allocation(obj: dict[str, Any]) -> Allocation:
    return from_record(obj["spec"]["record"])


def _deleting(obj: dict[str, Any]) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


def _slim(obj: dict[str, Any]) -> dict[str, Any]:
    """What is worth keeping of an object: managedFields are big and an update that omits them
    leaves them as they are."""
    obj["metadata"].pop("managedFields", None)
    return obj


class KubeStateStore(StateStore):
    """Allocations as FastShareAllocation objects (compare-and-set on resourceVersion); nodes in memory."""

    def __init__(self, api: client.ApiClient, namespace: str | None = None, clock=time.time,
                 fence: Fence | None = None) -> None:
        """``namespace``: serve the FastPods of one namespace only (None: the whole cluster);
        ``fence``: passed before every write (raises :class:`Deposed` once not leading)."""
        self.objects = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.clock = clock
        self.fence = fence or Fence()
        self._lock = threading.Lock()
        self._nodes: dict[str, Node] = {}
        self._known: dict[str, dict[str, Any]] = {}        # allocation id -> last object seen
        self._owners: dict[tuple[str, str], str] = {}      # (namespace, FastPod) -> its uid

    # -- nodes (rebuilt from Node objects and agents on start) ---------------------------------
    def put_node(self, node: Node) -> None:
        with self._lock:
            self._nodes[node.name] = copy.deepcopy(node)

    def get_node(self, name: str) -> Node | None:
        with self._lock:
            node = self._nodes.get(name)
            return copy.deepcopy(node) if node else None

    def list_nodes(self) -> list[Node]:
        with self._lock:
            return [copy.deepcopy(self._nodes[n]) for n in sorted(self._nodes)]

    def delete_node(self, name: str) -> None:
        with self._lock:
            self._nodes.pop(name, None)

    def mark_node(self, name: str, *, available: bool, last_heartbeat: float | None = None) -> None:
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                return
            node.available = available
            if last_heartbeat is not None:
                node.last_heartbeat = last_heartbeat

    # -- FastPods ----------------------------------------------------------------------------------
    def list_fastpods(self) -> list[dict[str, Any]]:
        if self.namespace:
            listing = self.objects.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)
        else:
            listing = self.objects.list_cluster_custom_object(GROUP, VERSION, PLURAL)
        return listing.get("items", [])

    def remember_owner(self, fastpod: dict[str, Any]) -> None:
        """The controller read this FastPod: its uid goes into the owner reference of new records."""
        meta = fastpod["metadata"]
        with self._lock:
            self._owners[(meta["namespace"], meta["name"])] = meta["uid"]

    def _owner_uid(self, namespace: str, name: str) -> str:
        with self._lock:
            uid = self._owners.get((namespace, name))
        if uid is None:
            try:
                fastpod = self.objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            except client.ApiException as exc:
                if exc.status == 404:
                    raise StoreError(f"FastPod {namespace}/{name} does not exist") from None
                raise
            self.remember_owner(fastpod)
            uid = fastpod["metadata"]["uid"]
        return uid

    # -- allocation objects ------------------------------------------------------------------------
    def _remember(self, obj: dict[str, Any]) -> Allocation:
        allocation = _allocation(obj)
        with self._lock:
            self._known[allocation.id] = _slim(obj)
        return allocation

    def _drop(self, allocation_id: str) -> None:
        with self._lock:
            self._known.pop(allocation_id, None)

    def _read(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.objects.get_namespaced_custom_object(GROUP, VERSION, namespace, ALLOCATION_PLURAL,
                                                             name)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _list(self, selector: str, namespace: str | None = None) -> list[dict[str, Any]]:
        namespace = namespace or self.namespace
        if namespace:
            listing = self.objects.list_namespaced_custom_object(GROUP, VERSION, namespace, ALLOCATION_PLURAL,
                                                                 label_selector=selector)
        else:
            listing = self.objects.list_cluster_custom_object(GROUP, VERSION, ALLOCATION_PLURAL,
                                                              label_selector=selector)
        return listing.get("items", [])

    def _object(self, allocation_id: str, fresh: bool = False) -> dict[str, Any] | None:
        """The allocation's object: the copy last seen, or (``fresh``) as the API server has it now."""
        with self._lock:
            obj = self._known.get(allocation_id)
        if obj is not None and not fresh:
            return obj
        if obj is not None:
            obj = self._read(obj["metadata"]["namespace"], obj["metadata"]["name"])
            if obj is not None and _allocation(obj).id == allocation_id:
                self._remember(obj)
                return obj
            self._drop(allocation_id)
        if not _LABEL_VALUE.fullmatch(allocation_id):
            return None  # never a stored id: ids are label values
        # Not seen yet (e.g. another controller made it): find it by its id label.
        found = self._list(f"{ALLOCATION_LABEL}={allocation_id}")
        if not found:
            return None
        self._remember(found[0])
        return found[0]

    def _body(self, obj: dict[str, Any], pod: str, allocation: Allocation) -> dict[str, Any]:
        """``obj`` with ``allocation`` as its record; the finalizer stays while it holds a share.
        A reason (an agent's error, the API server's refusal of a Pod) is kept clipped to what
        the schema allows."""
        allocation = replace(allocation, reason=clip(allocation.reason))
        meta = dict(obj["metadata"])
        finalizers = [f for f in meta.get("finalizers") or [] if f != ALLOCATION_FINALIZER]
        had = ALLOCATION_FINALIZER in (meta.get("finalizers") or [])
        # A marked object may lose finalizers but never gain one.
        if allocation.state in HOLDING and (had or not _deleting(obj)):
            finalizers.append(ALLOCATION_FINALIZER)
        meta["finalizers"] = finalizers
        return {"apiVersion": API_VERSION, "kind": ALLOCATION_KIND, "metadata": meta,
                "spec": {**summary(pod, allocation), "record": to_record(allocation)}}

    # -- the StateStore contract ---------------------------------------------------------------------
    def create_allocation(self, allocation: Allocation) -> None:
        namespace, name, pod = parse_key(allocation.idempotency_key)
        if allocation.owner != f"{namespace}/{name}":
            raise StoreError(f"owner {allocation.owner!r} does not match key {allocation.idempotency_key!r}")
        if not _LABEL_VALUE.fullmatch(allocation.id):
            raise StoreError(f"allocation id {allocation.id!r} must be a Kubernetes label value")
        metadata = {
            "name": pod, "namespace": namespace,
            "labels": {FASTPOD_LABEL: name, ALLOCATION_LABEL: allocation.id},
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": KIND, "name": name,
                                 "uid": self._owner_uid(namespace, name), "controller": True,
                                 "blockOwnerDeletion": True}],
        }
        body = self._body({"metadata": metadata}, pod, allocation)
        self.fence.check()
        try:
            created = self.objects.create_namespaced_custom_object(GROUP, VERSION, namespace,
                                                                   ALLOCATION_PLURAL, body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise StoreError(f"cannot store allocation {allocation.id}: {exc.status} {exc.reason}: "
                                 f"{exc.body}") from None
            existing = self._read(namespace, pod)
            if existing is None:
                raise StoreError(f"allocation object {namespace}/{pod} went away while it was "
                                 "created; retry") from None
            found = self._remember(existing)
            if found.idempotency_key == allocation.idempotency_key:
                raise DuplicateKey(found) from None
            raise StoreError(f"cannot store allocation {allocation.id}: pod name {pod} is taken by "
                             f"{found.id} ({found.idempotency_key})") from None
        self._remember(created)

    def _change(self, allocation_id: str, expected: list[State] | None,
                changes: dict[str, object]) -> Allocation:
        unknown = set(changes) - _MUTABLE
        if unknown:
            raise StoreError(f"cannot change {sorted(unknown)} of an allocation")
        changes = {**changes, "updated_at": changes.get("updated_at", self.clock())}
        fresh = False
        for _ in range(_RETRIES):
            obj = self._object(allocation_id, fresh)
            if obj is None:
                raise Conflict(allocation_id, None, expected or [])
            current = _allocation(obj)
            if expected is not None and current.state not in expected:
                if not fresh:  # the copy in memory may be behind: decide on the real one
                    fresh = True
                    continue
                raise Conflict(allocation_id, current.state, expected)
            updated = replace(current, **changes)
            updated.state = State(updated.state)
            meta = obj["metadata"]
            self.fence.check()
            try:
                stored = self.objects.replace_namespaced_custom_object(
                    GROUP, VERSION, meta["namespace"], ALLOCATION_PLURAL, meta["name"],
                    self._body(obj, obj["spec"]["pod"], updated))
            except client.ApiException as exc:
                if exc.status == 409:  # resourceVersion moved on: decide again on fresh data
                    fresh = True
                    continue
                if exc.status == 404:
                    self._drop(allocation_id)
                    raise Conflict(allocation_id, None, expected or []) from None
                raise
            return self._remember(stored)
        raise StoreError(f"allocation {allocation_id}: gave up after {_RETRIES} write conflicts")

    def transition(self, allocation_id: str, expected: Iterable[State], new_state: State,
                   **changes: object) -> Allocation:
        wanted = [State(s) for s in expected]
        return self._change(allocation_id, wanted, {**changes, "state": State(new_state)})

    def update(self, allocation_id: str, **changes: object) -> Allocation:
        return self._change(allocation_id, None, changes)

    def get_allocation(self, allocation_id: str) -> Allocation | None:
        obj = self._object(allocation_id, fresh=True)
        return _allocation(obj) if obj is not None else None

    def find_by_key(self, idempotency_key: str) -> Allocation | None:
        try:
            namespace, _, pod = parse_key(idempotency_key)
        except StoreError:
            return None
        obj = self._read(namespace, pod)
        if obj is None or _allocation(obj).idempotency_key != idempotency_key:
            return None
        return self._remember(obj)

    def allocations_of(self, namespace: str, fastpod: str) -> tuple[dict[str, Allocation], set[str]]:
        """One FastPod's allocations by pod name, and the pods whose record is marked for deletion
        (their share must be released, then the record goes)."""
        found: dict[str, Allocation] = {}
        marked: set[str] = set()
        for obj in self._list(f"{FASTPOD_LABEL}={fastpod}", namespace):
            pod = obj["spec"]["pod"]
            found[pod] = self._remember(obj)
            if _deleting(obj):
                marked.add(pod)
        return found, marked

    def list_allocations(self, states: Iterable[State] | None = None,
                         node: str | None = None) -> list[Allocation]:
        wanted = None if states is None else {State(s) for s in states}
        found: list[Allocation] = []
        for obj in self._list(ALLOCATION_LABEL):
            allocation = self._remember(obj)
            if wanted is not None and allocation.state not in wanted:
                continue
            if node is None or allocation.node == node:
                found.append(allocation)
        return sorted(found, key=lambda a: (a.created_at, a.id))

    def forget(self, allocation_id: str) -> None:
        """Delete a finished (released/failed) allocation's object."""
        fresh = False
        for _ in range(_RETRIES):
            obj = self._object(allocation_id, fresh)
            if obj is None:
                return
            state = _allocation(obj).state
            if state not in (State.RELEASED, State.FAILED):
                if not fresh:
                    fresh = True
                    continue
                raise StoreError(f"allocation {allocation_id} is {state.value}; release it first")
            meta = obj["metadata"]
            options = client.V1DeleteOptions(preconditions=client.V1Preconditions(
                resource_version=meta["resourceVersion"]))
            self.fence.check()
            try:
                self.objects.delete_namespaced_custom_object(GROUP, VERSION, meta["namespace"],
                                                             ALLOCATION_PLURAL, meta["name"], body=options)
            except client.ApiException as exc:
                if exc.status == 409:  # changed since it was read: look again
                    fresh = True
                    continue
                if exc.status != 404:
                    raise
            self._drop(allocation_id)
            return
        raise StoreError(f"allocation {allocation_id}: gave up after {_RETRIES} write conflicts")
