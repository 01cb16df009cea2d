"""The controller's state store over the Kubernetes API: allocations live in FastPod status.

In-cluster, the Kubernetes API is the state of record. Each allocation is one entry of its
FastPod's ``status.assignments`` (keyed by the replica's pod name): a few readable fields for
``kubectl`` plus ``record``, the whole :class:`Allocation`. Every write is a compare-and-set on
the FastPod's resourceVersion, so two controllers (or a controller and its restarted self)
never overwrite each other: a lost race on the state raises :class:`Conflict`, a lost race on
an unrelated entry of the same FastPod is retried on fresh data.

Nodes are not recorded here: the controller rebuilds them from Node objects and the agents'
inventories on every start, so they are kept in memory.

Allocation owners are ``namespace/fastpod`` and idempotency keys ``namespace/fastpod/pod``
(see :func:`replica_key`), which is how an allocation finds its FastPod.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, replace
from typing import Any

from kubernetes import client

from fastshare.controller.model import Allocation, Device, Node, Spec, State
from fastshare.controller.store import Conflict, DuplicateKey, StateStore, StoreError
from fastshare.k8s.resources import GROUP, PLURAL, VERSION

_MUTABLE = {"state", "node", "devices", "env", "reason", "assignment", "updated_at", "lease_ttl",
            "lease_expires_at"}
_RETRIES = 20


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


def status_entry(pod: str, allocation: Allocation) -> dict[str, Any]:
    """One ``status.assignments`` item: readable fields, then the full record."""
    entry: dict[str, Any] = {
        "pod": pod,
        "node": allocation.node,
        "allocation": allocation.id,
        "state": allocation.state.value,
        "gpuUUIDs": [d.gpu_uuid for d in allocation.devices],
        "record": to_record(allocation),
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


class KubeStateStore(StateStore):
    """Allocations in FastPod status (compare-and-set on resourceVersion); nodes in memory."""

    def __init__(self, api: client.ApiClient, namespace: str | None = None, clock=time.time) -> None:
        """``namespace``: serve the FastPods of one namespace only (None: the whole cluster)."""
        self.objects = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, Node] = {}
        self._where: dict[str, tuple[str, str]] = {}  # allocation id -> (namespace, fastpod)

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

    def mark_node(self, name: str, *, available: bool, last_heartbeat: float | None = None) -> None:
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                return
            node.available = available
            if last_heartbeat is not None:
                node.last_heartbeat = last_heartbeat

    # -- FastPod access ----------------------------------------------------------------------------
    def _get(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _modify(self, namespace: str, name: str, change) -> Any:
        """Read the FastPod, let ``change(entries)`` edit its assignment list, write it back.

        ``change`` raises to abort (nothing is written) and returns the call's result. A write
        that lost to another writer is redone on the fresh object.
        """
        for _ in range(_RETRIES):
            fastpod = self._get(namespace, name)
            if fastpod is None:
                raise StoreError(f"FastPod {namespace}/{name} does not exist")
            status = fastpod.setdefault("status", {})
            entries = status.setdefault("assignments", [])
            result = change(entries)
            try:
                self.objects.replace_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, PLURAL, name, fastpod)
            except client.ApiException as exc:
                if exc.status == 409:  # resourceVersion moved on: redo on fresh data
                    continue
                if exc.status == 404:
                    raise StoreError(f"FastPod {namespace}/{name} does not exist") from None
                raise
            return result
        raise StoreError(f"FastPod {namespace}/{name}: gave up after {_RETRIES} write conflicts")

    @staticmethod
    def _entries(fastpod: dict[str, Any]) -> list[dict[str, Any]]:
        return [e for e in (fastpod.get("status") or {}).get("assignments") or [] if "record" in e]

    def _locate(self, allocation_id: str) -> tuple[str, str] | None:
        with self._lock:
            where = self._where.get(allocation_id)
        if where is None:
            self.list_allocations()  # another controller may have created it: refresh the index
            with self._lock:
                where = self._where.get(allocation_id)
        return where

    # -- allocations -------------------------------------------------------------------------------
    def create_allocation(self, allocation: Allocation) -> None:
        namespace, name, pod = parse_key(allocation.idempotency_key)
        if allocation.owner != f"{namespace}/{name}":
            raise StoreError(f"owner {allocation.owner!r} does not match key {allocation.idempotency_key!r}")

        def add(entries: list[dict[str, Any]]) -> None:
            for entry in entries:
                record = entry.get("record") or {}
                if record.get("idempotency_key") == allocation.idempotency_key:
                    raise DuplicateKey(from_record(record))
                if record.get("id") == allocation.id or entry["pod"] == pod:
                    raise StoreError(f"cannot store allocation {allocation.id}: its id or pod {pod} is taken")
            entries.append(status_entry(pod, allocation))

        self._modify(namespace, name, add)
        with self._lock:
            self._where[allocation.id] = (namespace, name)

    def _change(self, allocation_id: str, expected: list[State] | None,
                changes: dict[str, object]) -> Allocation:
        unknown = set(changes) - _MUTABLE
        if unknown:
            raise StoreError(f"cannot change {sorted(unknown)} of an allocation")
        where = self._locate(allocation_id)
        if where is None:
            raise Conflict(allocation_id, None, expected or [])
        changes = {**changes, "updated_at": changes.get("updated_at", self.clock())}

        def edit(entries: list[dict[str, Any]]) -> Allocation:
            for i, entry in enumerate(entries):
                record = entry.get("record") or {}
                if record.get("id") != allocation_id:
                    continue
                current = from_record(record)
                if expected is not None and current.state not in expected:
                    raise Conflict(allocation_id, current.state, expected)
                updated = replace(current, **changes)
                updated.state = State(updated.state)
                entries[i] = status_entry(entry["pod"], updated)
                return updated
            raise Conflict(allocation_id, None, expected or [])

        try:
            return self._modify(*where, edit)
        except StoreError as exc:
            if isinstance(exc, Conflict):
                raise
            raise Conflict(allocation_id, None, expected or []) from exc

    def transition(self, allocation_id: str, expected: Iterable[State], new_state: State,
                   **changes: object) -> Allocation:
        wanted = [State(s) for s in expected]
        return self._change(allocation_id, wanted, {**changes, "state": State(new_state)})

    def update(self, allocation_id: str, **changes: object) -> Allocation:
        return self._change(allocation_id, None, changes)

    def get_allocation(self, allocation_id: str) -> Allocation | None:
        where = self._locate(allocation_id)
        if where is None:
            return None
        fastpod = self._get(*where)
        for entry in self._entries(fastpod) if fastpod else []:
            if entry["record"].get("id") == allocation_id:
                return from_record(entry["record"])
        return None

    def find_by_key(self, idempotency_key: str) -> Allocation | None:
        try:
            namespace, name, _ = parse_key(idempotency_key)
        except StoreError:
            return None
        fastpod = self._get(namespace, name)
        for entry in self._entries(fastpod) if fastpod else []:
            if entry["record"].get("idempotency_key") == idempotency_key:
                with self._lock:
                    self._where[entry["record"]["id"]] = (namespace, name)
                return from_record(entry["record"])
        return None

    def list_fastpods(self) -> list[dict[str, Any]]:
        if self.namespace:
            listing = self.objects.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)
        else:
            listing = self.objects.list_cluster_custom_object(GROUP, VERSION, PLURAL)
        return listing.get("items", [])

    def allocations_of(self, fastpod: dict[str, Any]) -> dict[str, Allocation]:
        """The allocations recorded in one FastPod object, by pod name."""
        return {e["pod"]: from_record(e["record"]) for e in self._entries(fastpod)}

    def list_allocations(self, states: Iterable[State] | None = None,
                         node: str | None = None) -> list[Allocation]:
        wanted = None if states is None else {State(s) for s in states}
        found: list[Allocation] = []
        index: dict[str, tuple[str, str]] = {}
        for fastpod in self.list_fastpods():
            where = (fastpod["metadata"]["namespace"], fastpod["metadata"]["name"])
            for allocation in self.allocations_of(fastpod).values():
                index[allocation.id] = where
                if wanted is not None and allocation.state not in wanted:
                    continue
                if node is None or allocation.node == node:
                    found.append(allocation)
        with self._lock:
            self._where.update(index)
        return sorted(found, key=lambda a: (a.created_at, a.id))

    def forget(self, allocation_id: str) -> None:
        """Drop a finished (released/failed) allocation from its FastPod's status."""
        where = self._locate(allocation_id)
        if where is None:
            return

        def drop(entries: list[dict[str, Any]]) -> None:
            for i, entry in enumerate(entries):
                record = entry.get("record") or {}
                if record.get("id") == allocation_id:
                    if State(record["state"]) not in (State.RELEASED, State.FAILED):
                        raise StoreError(f"allocation {allocation_id} is {record['state']}; release it first")
                    del entries[i]
                    return

        try:
            self._modify(*where, drop)
        except StoreError:
            if self.get_allocation(allocation_id) is not None:
                raise
        with self._lock:
            self._where.pop(allocation_id, None)
