"""The controller's life cycle logic, independent of the transport and of the state store.

An allocation is committed to the store (with the engine's reservation) BEFORE the node agent
is asked to prepare it; each later step is one compare-and-set transition. Whatever point a
crash interrupts, the record says what is left to do and :mod:`reconciler` finishes it:

    pending --prepare on agent--> active --release--> releasing --agent--> released
       \\__________ agent refused / unreachable: compensate __________/        (or failed)

(``prepared``, between the agent's answer and activation, was a commit of its own in earlier
versions; such records are still completed.)

Agent RPCs (with deadlines) never run under the ledger lock; an allocation is worked on by
one thread at a time (``claim``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, replace

from fastshare.controller import faults
from fastshare.controller.agent_client import AgentClient, AgentError, AgentPool
from fastshare.controller.events import EventHub
from fastshare.controller.gpu_kinds import GpuKinds
from fastshare.controller.ledger import LOST, Ledger, gpu_view, gpus_gone
from fastshare.controller.model import (
    FINISHED,
    HOLDING,
    ID_PREFIX,
    Allocation,
    Device,
    Gpu,
    Kind,
    Node,
    Spec,
    State,
    sequence_of,
)
from fastshare.controller.store import Conflict, DuplicateKey, StateStore
from fastshare.controller.validation import (
    MAX_LEASE_TTL,
    MIN_LEASE_TTL,
    Request,
    ValidationError,
    normalise,
    validate,
)
from fastshare.device import catalog
from fastshare.placement.model import Assignment, MigSlot, NodeView, Rejection
from fastshare.placement.model import Request as EngineRequest
from fastshare.v1 import agent_pb2, common_pb2

log = logging.getLogger("fastshare.controller")

_KINDS = {Kind.FASTPOD: common_pb2.SHARE_KIND_FASTPOD, Kind.MPS: common_pb2.SHARE_KIND_MPS,
          Kind.EXCLUSIVE: common_pb2.SHARE_KIND_EXCLUSIVE, Kind.WHOLE: common_pb2.SHARE_KIND_WHOLE}


_RENEWABLE = (State.PENDING, State.PREPARED, State.ACTIVE)
# The most heartbeats a second a controller asks its agents for: at 0.25-0.5 CPU ms each
# (bench/heartbeats.py, bench/heartbeat_connections.py) a quarter to half of a core; past it
# the interval grows with the cluster.
HEARTBEATS_PER_SECOND = 1000
MAX_NAMED_NODES = 20   # an error about an unknown node names the known ones up to this many
# how an active allocation's reason starts while its GPU no longer takes it
OVER_COMMITTED = "over-committed: "


# how the reason of an allocation starts when it ended because its device went away under it (a
# MIG slice destroyed outside fastshare, a GPU gone from its node): it ends failed, not released
DEVICE_GONE = "device gone: "


def overcommit_reason(why: str) -> str:
    """An active allocation's reason while the GPU it holds no longer takes it (``why``: the ledger's)."""
    if LOST in why:   # ("n1 GPU 0: lost ..."): releasing others does not help there, the share is gone
        return (f"{OVER_COMMITTED}{why}; nothing can use the share any more: its node agent drops it at "
                "its next housekeeping, and the allocation then ends failed")
    return (f"{OVER_COMMITTED}{why}; the share stays held, and its GPU takes no new work until enough "
            "is released there")


def new_id(sequence: int | None) -> str:
    """An allocation id (= the agent's share id; the reconciler only frees shares it made)."""
    if sequence is None:
        return ID_PREFIX + secrets.token_hex(8)
    return f"{ID_PREFIX}{sequence:x}-{secrets.token_hex(4)}"


# how an allocation's reason starts when it was rebuilt from a share its agent held but the state
# store had no record of (see ``ControllerCore.adopt``)
ADOPTED = "adopted: "
# why a node holding such shares takes nothing new meanwhile (worded after "N node(s)")
HELD_OUT = ("hold shares the controller's state database has no record of (newer than the database: restored "
            "from an older backup?); see the controller's log")


class AdoptFailed(Exception):
    """A share newer than the state store could not be adopted; the message says why."""


class Rejected(Exception):
    """Nothing fits; the message is the engine's reason."""


class NotFound(Exception):
    pass


class KeyConflict(Exception):
    """The idempotency key belongs to an allocation with a different request."""


class Busy(Exception):
    """Another operation on the same allocation did not finish in time."""


class NodeInUse(Exception):
    """The node's agent still heartbeats: it cannot be forgotten."""


# Refusals of a share for its GPU's state, not for what it asks (see the proto's Refusal): a new
# allocation so refused is placed again, elsewhere, at most this many times (each time its agent
# refuses it so); a GPU that closed or left the node behind the controller's back then costs the
# user nothing.
GPU_REFUSALS = frozenset({agent_pb2.REFUSAL_MIG_CHANGE_PENDING, agent_pb2.REFUSAL_GPU_LOST,
                          agent_pb2.REFUSAL_MIG_MODE, agent_pb2.REFUSAL_GPU_GONE})
PLACE_AGAIN = 2


class _GpuRefused(Exception):
    """The agent refused a new share for its GPU's state (``error.refusal`` in GPU_REFUSALS)."""

    def __init__(self, error: AgentError) -> None:
        super().__init__(str(error))
        self.error = error


class AgentFailed(Exception):
    """The node agent refused or could not be reached; ``allocation`` is the (failed) record."""

    def __init__(self, message: str, allocation: Allocation, unreachable: bool) -> None:
        super().__init__(message)
        self.allocation = allocation
        self.unreachable = unreachable


@dataclass(frozen=True)
class Settings:
    heartbeat_interval: float = 2.0      # what agents are told to use (longer in a large cluster)
    heartbeat_timeout: float = 8.0       # silence after which a node is unavailable (as much longer)
    reconcile_interval: float = 5.0
    busy_wait: float = 30.0              # how long Release waits for an in-flight Allocate
    # How long released and failed allocations stay readable (Get, `status --all`, a retried
    # idempotency key); without a limit the state file and those answers grew for good.
    finished_retention: float = 7 * 86400.0


def model_name(nvml_name: str) -> str:
    """The catalog key for an NVML product name when known (users write 'H100*', not 'NVIDIA ...')."""
    known = catalog.find_model(nvml_name)
    return known.key if known else nvml_name


def node_from_inventory(name: str, address: str, labels: dict[str, str],
                        inventory: agent_pb2.Inventory, now: float) -> Node:
    gpus = [Gpu(index=g.index, uuid=g.uuid, model=model_name(g.name), memory_bytes=g.memory_bytes,
                sm_count=g.sm_count, mig_capable=g.mig_capable, mig_enabled=g.mig_enabled,
                mig_unheld=tuple(sorted((d.profile_id, d.start, d.size) for d in g.mig_devices
                                        if not d.share_id)), lost=g.lost,
                mig_change_pending=g.mig_capable and not g.lost and g.mig_pending != g.mig_enabled)
            for g in sorted(inventory.gpus, key=lambda g: g.index)]
    count = len(gpus)
    links = [[link.gpu_a, link.gpu_b, link_rank(link.level)] for link in inventory.links
             if link.gpu_a < link.gpu_b < count]
    return Node(name=name, address=address, labels=dict(labels), gpus=gpus, available=True,
                last_heartbeat=now, registered_at=now,
                inventory={"boot_id": inventory.boot_id, "agent_version": inventory.agent_version,
                           "driver_version": inventory.driver_version, "links": links,
                           "mps_unavailable": inventory.mps_unavailable})


# NVML topology levels (NVLink -1) as the engine's link levels, lower is closer; the engine
# takes a pair it is not told about as the farthest (9), so every level known here ranks below.
_LINK_RANKS = {-1: 0, 0: 1, 10: 2, 20: 3, 30: 4, 40: 5, 50: 6}


def link_rank(nvml_level: int) -> int:
    return _LINK_RANKS.get(nvml_level, 8)


def node_view(node: Node) -> NodeView:
    return NodeView(name=node.name, cpu_milli=0, memory_mib=0, labels=dict(node.labels),
                    gpus=tuple(gpu_view(g.index, g.uuid, g.model, g.memory_bytes, g.sm_count,
                                        g.mig_capable, g.mig_enabled, g.mig_unheld,
                                        node.inventory.get("mps_unavailable", ""), g.lost,
                                        g.mig_change_pending)
                                for g in node.gpus),
                    links=tuple(tuple(link) for link in node.inventory.get("links", ())))


class ControllerCore:
    """Allocate / release / renew / register / heartbeat over a :class:`StateStore`."""

    def __init__(self, store: StateStore, agents: AgentPool, settings: Settings | None = None,
                 ledger: Ledger | None = None, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.agents = agents
        self.settings = settings or Settings()
        self.ledger = ledger or Ledger()
        self.clock = clock
        self.events = EventHub()
        self._busy: set[str] = set()
        self._busy_cond = threading.Condition()
        self._registered: set[str] = set()    # nodes that registered with THIS process
        self._last_seen: dict[str, float] = {}
        self._size_interval = 0   # see interval_for_size
        self._nodes_lock = threading.Lock()
        # Orders the changes to a node (register, heartbeat, liveness check, refresh, cordon) with
        # their writes to the store and the ledger: otherwise a heartbeat landing while a node is
        # being marked lost can be overwritten, leaving a heartbeating node without new work for
        # good, and a cordon set during a registration can be lost from the store.
        self._node_changes = threading.Lock()
        self._gpu_kinds: GpuKinds | None = None   # read from the store when first asked
        self._gpu_kinds_lock = threading.Lock()
        self._node_cache: dict[str, Node] = {}   # address and GPUs; every node write goes through put_node
        self._unadopted: dict[str, dict[str, str]] = {}   # node -> share -> why it could not be adopted
        self._sighted: set[str] = set()   # nodes whose inventory this process read (see ``saw``)
        self._sight_lock = threading.Lock()
        # node -> the agent's MPS oversubscription factor last warned about (it differs from ours)
        self._oversub_warned: dict[str, float] = {}

    # -- per-allocation exclusion ----------------------------------------------------------------
    @contextlib.contextmanager
    def claim(self, allocation_id: str, wait: float = 0.0) -> Iterator[bool]:
        """Yields True when this thread may work on the allocation (nobody else is)."""
        deadline = time.monotonic() + wait
        with self._busy_cond:
            while allocation_id in self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._busy_cond.wait(left)
            got = allocation_id not in self._busy
            if got:
                self._busy.add(allocation_id)
        try:
            yield got
        finally:
            if got:
                with self._busy_cond:
                    self._busy.discard(allocation_id)
                    self._busy_cond.notify_all()

    def busy(self) -> set[str]:
        with self._busy_cond:
            return set(self._busy)

    def _publish(self, allocation: Allocation) -> Allocation:
        self.events.publish(allocation)
        return allocation

    # -- queries ---------------------------------------------------------------------------------
    def known_gpu_kinds(self) -> tuple[list[Gpu], int]:
        """One GPU of each model and memory size the controller knows, and the most GPUs on one
        node (see ``GpuKinds.summary``). Validation needs no more, and ran over every GPU for
        each request: 8 ms of each Allocate at 10,000 nodes."""
        with self._gpu_kinds_lock:
            if self._gpu_kinds is None:
                self._gpu_kinds = GpuKinds(self.store.list_nodes())
            return self._gpu_kinds.summary()

    def warm(self) -> None:
        """Work out now what the first Allocate would have to (0.7 s at 10,000 nodes): the GPU
        kinds validation needs, every node's state in the engine. A controller's start does it,
        so that the first request after it is as quick as the others."""
        self.known_gpu_kinds()
        self.ledger.work_out_states()

    def node_facts(self, name: str) -> Node | None:
        """A node's address and GPUs without a store read per request (they change only when
        the core itself writes the node; liveness fields of the copy may be stale)."""
        node = self._node_cache.get(name)
        if node is None:
            node = self.store.get_node(name)
            if node is not None:
                self._node_cache[name] = node
        return node

    def put_node(self, node: Node) -> None:
        """Record a node; every node write goes through here so the cached views stay true."""
        self.store.put_node(node)
        self._node_cache[node.name] = node
        with self._gpu_kinds_lock:
            if self._gpu_kinds is not None:
                self._gpu_kinds.put(node)

    def get(self, allocation_id: str) -> Allocation:
        found = self.store.get_allocation(allocation_id)
        if found is None:
            raise NotFound(f"allocation {allocation_id} does not exist")
        return found

    def is_available(self, node: str) -> bool:
        with self._nodes_lock:
            return node in self._registered and node in self._last_seen

    def interval_for_size(self) -> int:
        """The shortest heartbeat interval, in whole seconds, at which the nodes registered with
        this process send no more than ``HEARTBEATS_PER_SECOND`` (10 s at 10,000 nodes); 0 while
        the settings' interval keeps them under it. It never shortens in a process, so no agent
        waits longer between two heartbeats than the timeout allows (an agent takes a new
        interval at its next heartbeat)."""
        with self._nodes_lock:
            return self._size_for(len(self._registered))

    def note_cluster_size(self, nodes: int) -> None:
        """At a start: the stored nodes, reachable or not. The process before told their agents
        an interval for that many; judged by the timeout of the few reachable at the start, they
        would be taken for unavailable between two heartbeats."""
        with self._nodes_lock:
            self._size_for(nodes)

    def _size_for(self, nodes: int) -> int:
        needed = nodes / HEARTBEATS_PER_SECOND
        if needed > self.settings.heartbeat_interval:
            self._size_interval = max(self._size_interval, math.ceil(needed))
        return self._size_interval

    def heartbeat_interval(self) -> int:
        """Whole seconds agents are told to heartbeat at: the settings' interval, or longer in a
        large cluster (older agents keep the one given at registration, never longer)."""
        return max(1, round(self.settings.heartbeat_interval), self.interval_for_size())

    def pass_interval(self) -> float:
        """Seconds between two reconcile passes: the settings' interval, or in a large cluster
        that of the heartbeats (a pass asks every available agent for its inventory: at most
        ``HEARTBEATS_PER_SECOND`` of those asks too)."""
        return max(self.settings.reconcile_interval, self.interval_for_size())

    def heartbeat_timeout(self) -> float:
        """The settings' timeout, stretched as the interval is (4 intervals by default)."""
        stretch = self.interval_for_size() / self.settings.heartbeat_interval
        return self.settings.heartbeat_timeout * max(1.0, stretch)

    # -- allocate --------------------------------------------------------------------------------
    def allocate(self, request: Request, lookup: bool = True, excluded: dict[str, str] | None = None,
                 checked: Collection[str] | None = None) -> Allocation:
        """Place, record, prepare, activate; returns once the answer survives a power loss.

        What must be on disk before the answer is the ``pending`` record (the intent), not the
        later steps: if a power loss takes the ``active`` step, the reconciler prepares
        the pending record again, and the agent (which made its share durable before it
        answered) hands back the same share: the same active allocation the caller was told
        about. So the intent's fdatasync starts right after its commit and runs while the
        agent prepares, instead of after the last commit (a power loss before it completes
        leaves the agent a share without a record: an orphan the reconciler frees, and
        nobody was answered). A failure (compensated, refused) goes through the API's full
        barrier (see ``server._guard``).

        ``lookup=False``: the caller made the key just now, so looking it up first is a wasted
        read; a duplicate is still caught, by the store's create (DuplicateKey). ``excluded``:
        nodes the caller rules out, with why (in-cluster: the Pod's node affinity and taints);
        ``checked``: the nodes it judged them on, no other is offered (see ``Ledger.place``)."""
        allocation, intent = self._allocate(request, lookup, excluded, checked)
        self.store.sync(intent)
        return allocation

    def _allocate(self, request: Request, lookup: bool, excluded: dict[str, str] | None = None,
                  checked: Collection[str] | None = None) -> tuple[Allocation, object | None]:
        """The allocation, and the durability ticket that covers it (None: everything so far)."""
        gpus, most = self.known_gpu_kinds()
        validate(request, gpus, most)
        request = replace(request, spec=normalise(request.spec))
        if request.idempotency_key and lookup:
            existing = self.store.find_by_key(request.idempotency_key)
            if existing is not None:
                return self._same_request(existing, request), None
        allocation_id = new_id(self.store.next_sequence())
        engine_request = self.ledger.to_request(allocation_id, request.spec)
        if isinstance(engine_request, Rejection):
            raise Rejected(engine_request.reason)
        with self.claim(allocation_id):
            placed = self.ledger.place(engine_request, excluded, checked)
            if isinstance(placed, Rejection):
                raise Rejected(placed.reason)
            try:   # until the record is stored, the reservation lives in memory only: undo it on failure
                now = self.clock()
                record = Allocation(
                    id=allocation_id, spec=request.spec, owner=request.owner, state=State.PENDING,
                    node=placed.node, idempotency_key=request.idempotency_key,
                    devices=_devices(placed, self.node_facts(placed.node)), assignment=placed.to_dict(),
                    created_at=now, updated_at=now, lease_ttl=request.lease_ttl,
                    lease_expires_at=now + request.lease_ttl if request.lease_ttl else 0.0)
                self.store.create_allocation(record)
            except DuplicateKey as dup:   # a concurrent call with the same key won
                self.ledger.release(allocation_id)
                return self._same_request(dup.existing, request), None
            except BaseException:
                self.ledger.release(allocation_id)
                raise
            intent = self.store.flush_soon()
            self._publish(record)
            faults.point("controller.after_commit")
            tries = PLACE_AGAIN
            while True:
                try:
                    return self.complete(record, place_again=tries > 0), intent
                except _GpuRefused as refused:
                    tries -= 1
                    record = self._place_again(record, engine_request, refused.error, excluded, checked)
                    intent = self.store.flush_soon()   # the answer names the new placement: it is the intent

    def _place_again(self, allocation: Allocation, request: EngineRequest, error: AgentError,
                     excluded: dict[str, str] | None, checked: Collection[str] | None) -> Allocation:
        """A new (pending) allocation its agent refused for its GPU's state: take the node's view
        again from its agent (the GPU now shows closed, lost or in the other MIG mode), give back
        the reservation and place the request anew, recorded in one commit (a crash before it
        leaves the pending record as it was, which the reconciler prepares, and which is then
        refused and ends failed as before; after it, the reconciler prepares the new one). Where
        that cannot be done (the agent does not answer, nothing else fits, the fresh view still
        puts it on the same GPU) it is compensated, as any refusal. The caller holds the claim."""
        why = f"prepare on {allocation.node} failed: {error.code.name}: {error.details}"
        node = self.node_facts(allocation.node)
        try:
            inventory = self.agents.get(node.name, node.address).inventory()
        except AgentError as exc:
            raise AgentFailed(str(error), self.compensate(allocation, f"{why} (and its inventory: {exc})"),
                              unreachable=False) from None
        self.refresh_node(self.store.get_node(node.name) or node, inventory, moving=allocation.id)
        before = assignment_of(allocation)
        self.ledger.release(allocation.id)
        placed = self.ledger.place(request, excluded, checked)
        if isinstance(placed, Rejection):
            self._reserve(before)   # as the record still says, until it is compensated
            raise AgentFailed(str(error), self.compensate(allocation, f"{why}; no other GPU takes it: "
                                                                      f"{placed.reason}"), unreachable=False)
        if _where(placed) == _where(before):   # the agent's inventory says otherwise than its refusal
            raise AgentFailed(str(error), self.compensate(allocation, why), unreachable=False)
        try:
            moved = self.store.transition(allocation.id, [State.PENDING], State.PENDING, node=placed.node,
                                          devices=_devices(placed, self.node_facts(placed.node)),
                                          assignment=placed.to_dict())
        except BaseException:
            self.ledger.release(allocation.id)
            self._reserve(before)
            raise
        log.warning("allocation %s: %s; placed again on node %s GPU(s) %s", allocation.id, why, placed.node,
                    list(placed.gpus))
        faults.point(faults.AFTER_PLACE_AGAIN)
        return self._publish(moved)

    def _reserve(self, assignment: Assignment) -> None:
        """Count ``assignment`` again (its record still names it); one whose GPU is gone cannot be."""
        with contextlib.suppress(ValueError):
            self.ledger.adopt(assignment)

    def _same_request(self, existing: Allocation, request: Request) -> Allocation:
        """A retry: the same allocation, driven to active if a crash left it half-done."""
        same = (_carried(existing.spec) == _carried(request.spec) if existing.reason.startswith(ADOPTED)
                else existing.spec == request.spec)
        if not same or existing.owner != request.owner:
            raise KeyConflict(f"idempotency key {request.idempotency_key!r} was used by allocation "
                              f"{existing.id} with a different request")
        if existing.state not in (State.PENDING, State.PREPARED):
            return existing
        with self.claim(existing.id, wait=self.settings.busy_wait) as got:
            current = self.get(existing.id)
            if got and current.state in (State.PENDING, State.PREPARED) and self.is_available(current.node):
                return self.complete(current)
            return current

    def share_for(self, allocation: Allocation) -> agent_pb2.Share:
        spec = allocation.spec
        share = agent_pb2.Share(id=allocation.id, kind=_KINDS[spec.kind], owner=allocation.owner,
                                device_uuids=[d.gpu_uuid for d in allocation.devices],
                                idempotency_key=allocation.idempotency_key,
                                # a ttl an older RenewLease stored out of range is left out: the
                                # agent would refuse the share over the controller's bookkeeping
                                lease_ttl_seconds=allocation.lease_ttl
                                if MIN_LEASE_TTL <= allocation.lease_ttl <= MAX_LEASE_TTL else 0)
        if spec.kind is Kind.FASTPOD:
            share.sm_percent = spec.sm_percent
            share.memory_bytes = spec.memory_bytes
            share.quota_request = spec.quota_request or 1.0
            share.quota_limit = spec.quota_limit or 1.0
        elif spec.kind is Kind.MPS:
            share.memory_bytes = spec.memory_bytes
        elif spec.kind is Kind.EXCLUSIVE:
            mig = allocation.assignment["mig"]
            share.mig_profile = mig["profile_name"]
            share.mig_start = mig["start"]
        return share

    def complete(self, allocation: Allocation, agent_holds: bool = False,
                 place_again: bool = False) -> Allocation:
        """Drive a pending (or prepared) allocation to active; compensate if the agent refuses.

        A share its agent does not hold (``agent_holds`` False: a new one, or one the agent
        lost) is not prepared where its GPU no longer takes it (the view changed under it, see
        ``Ledger.overcommitted``): the agent must not be given more than the GPU has. It is
        compensated with the reason instead. ``place_again``: a refusal for the GPU's state
        (GPU_REFUSALS) raises _GpuRefused instead, the allocation left pending and reserved.
        The caller holds the claim on the allocation.
        """
        if allocation.state is State.PENDING:
            node = self.node_facts(allocation.node)
            why = "" if agent_holds else self.ledger.misfit(allocation.id)
            if why:
                where = allocation.node
                reason = (f"its share is gone from node {where} and cannot be prepared again there: "
                          if allocation.env else f"not prepared on node {where}: ") + \
                    f"its GPU no longer takes it ({why})"
                raise AgentFailed(reason, self.compensate(allocation, reason), unreachable=False)
            client = self.agents.get(node.name, node.address)
            try:
                if allocation.assignment.get("enable_mig"):
                    gpu_uuid = allocation.devices[0].gpu_uuid
                    mode = client.set_mig_mode(gpu_uuid, True)
                    if mode.changed:   # the GPU is a MIG GPU now, also after this allocation ends
                        self.refresh_node(self.store.get_node(node.name), client.inventory())
                    if mode.pending:
                        raise AgentFailed(f"MIG mode on {node.name} {gpu_uuid} waits for a GPU reset",
                                          allocation, unreachable=False)
                reply = client.prepare(self.share_for(allocation))
            except AgentError as exc:
                if place_again and exc.refusal in GPU_REFUSALS:
                    raise _GpuRefused(exc) from None
                failed = self.compensate(allocation, f"prepare on {node.name} failed: "
                                                     f"{exc.code.name}: {exc.details}")
                raise AgentFailed(str(exc), failed, exc.unreachable) from None
            except AgentFailed as exc:
                exc.allocation = self.compensate(allocation, str(exc))
                raise
            faults.point("controller.after_prepare")
            # One commit records the agent's answer and activates (a separate 'prepared'
            # commit in between bought nothing: the reconciler treats both alike).
            allocation = self._publish(self.store.transition(
                allocation.id, [State.PENDING], State.ACTIVE, env=_env(allocation, reply),
                devices=_prepared_devices(allocation, reply)))
            faults.point("controller.after_activate")
        if allocation.state is State.PREPARED:   # written by earlier versions
            allocation = self._publish(self.store.transition(allocation.id, [State.PREPARED], State.ACTIVE))
        return allocation

    def compensate(self, allocation: Allocation, reason: str) -> Allocation:
        """Undo a half-done allocation: mark it releasing (with the reason), free it on the agent."""
        log.warning("allocation %s: %s; releasing it", allocation.id, reason)
        allocation = self._publish(self.store.transition(
            allocation.id, [State.PENDING, State.PREPARED, State.ACTIVE], State.RELEASING, reason=reason))
        return self.finish_release(allocation)

    # -- release ---------------------------------------------------------------------------------
    def release(self, allocation_id: str, reason: str = "") -> Allocation:
        """Release; returns once the answer survives a power loss. As for :meth:`allocate`,
        the ``releasing`` record (the intent) is what must be on disk: a lost ``released``
        step is redone by the reconciler (release is idempotent on the agent)."""
        allocation = self.get(allocation_id)
        if allocation.state in FINISHED:
            self.store.sync()
            return allocation
        with self.claim(allocation_id, wait=self.settings.busy_wait) as got:
            if not got:
                raise Busy(f"allocation {allocation_id} is being changed by another call; retry")
            allocation = self._mark_releasing(self.get(allocation_id), reason)
            intent = self.store.flush_soon()
            if allocation.state is State.RELEASING:
                allocation = self.finish_release(allocation)
        self.store.sync(intent)
        return allocation

    def release_claimed(self, allocation: Allocation, reason: str = "") -> Allocation:
        allocation = self._mark_releasing(allocation, reason)
        return self.finish_release(allocation) if allocation.state is State.RELEASING else allocation

    def _mark_releasing(self, allocation: Allocation, reason: str) -> Allocation:
        """The release intent: record ``releasing`` (unless finished or releasing already)."""
        if allocation.state in FINISHED or allocation.state is State.RELEASING:
            return allocation
        # an over-commit note is no reason for the release: cleared unless one is given
        changes = {"reason": reason} if reason or allocation.reason.startswith(OVER_COMMITTED) else {}
        allocation = self._publish(self.store.transition(
            allocation.id, [State.PENDING, State.PREPARED, State.ACTIVE], State.RELEASING, **changes))
        faults.point("controller.after_release_commit")
        return allocation

    def _on_gpus(self, allocation: Allocation) -> tuple[str, list[Device]]:
        """Where the allocation's GPUs are on its node now, found by UUID (indexes shift when a
        GPU leaves the node): why it cannot be held (a GPU is gone; "" if none is), and its
        devices with their GPUs' current indexes. While the node's GPUs are unknown, as recorded."""
        node = self.node_facts(allocation.node)
        where = {g.uuid: g.index for g in node.gpus} if node is not None else {}
        if not where:
            return "", allocation.devices
        gone = [(d.gpu_uuid, d.gpu_index) for d in allocation.devices
                if d.gpu_uuid and d.gpu_uuid not in where]
        if gone:
            return gpus_gone(allocation.node, gone), allocation.devices
        return "", [replace(d, gpu_index=where[d.gpu_uuid]) if d.gpu_uuid else d for d in allocation.devices]

    def on_its_gpus(self, allocation: Allocation) -> bool:
        """The record names its GPUs as the node has them now (nothing for :meth:`follow_gpus` to do)."""
        why, devices = self._on_gpus(allocation)
        return not why and devices == allocation.devices

    def follow_gpus(self, allocation: Allocation) -> Allocation:
        """After a node's GPU set changed: an allocation whose GPU is gone ends failed with the
        reason (nothing can use it; its share is dropped by the agent); one whose GPUs were
        renumbered gets their new indexes recorded. The caller holds the claim."""
        why, devices = self._on_gpus(allocation)
        if why:
            if allocation.state in FINISHED or allocation.state is State.RELEASING:
                return allocation
            log.warning("allocation %s: %s; ending it", allocation.id, why)
            return self.release_claimed(allocation, reason=DEVICE_GONE + why)
        if devices == allocation.devices:
            return allocation
        assignment = dict(allocation.assignment, gpus=[d.gpu_index for d in devices])
        if all(d.gpu_uuid for d in devices):
            assignment["gpu_uuids"] = [d.gpu_uuid for d in devices]
        log.info("allocation %s: its GPU(s) %s on node %s are GPU(s) %s now", allocation.id,
                 [d.gpu_index for d in allocation.devices], allocation.node, [d.gpu_index for d in devices])
        # updated_at kept: a changed index says nothing about the share (see Reconciler._settled)
        return self._publish(self.store.update(allocation.id, devices=devices, assignment=assignment,
                                               updated_at=allocation.updated_at))

    def end_lost(self, allocation: Allocation, why: str) -> Allocation:
        """An allocation whose share its agent dropped because the device went away under it
        (``why``: the agent's words, naming the device) ends failed with that reason: preparing it
        again would hand the holder another device than the one its workload was given. The
        release makes the agent forget the lost share. The caller holds the claim."""
        reason = f"{DEVICE_GONE}{why}; node {allocation.node}'s agent dropped its share"
        log.warning("allocation %s: %s; ending it", allocation.id, reason)
        return self.release_claimed(allocation, reason=reason)

    def overcommit_note(self, allocation: Allocation) -> str | None:
        """The reason an active allocation's record should carry about its GPU being
        over-committed (see ``Ledger.overcommitted``), or None when the record says it already."""
        if allocation.state is not State.ACTIVE:
            return None
        why = self.ledger.over(allocation.id)
        want = overcommit_reason(why) if why else ""
        if allocation.reason.startswith(ADOPTED):
            # the note follows the adoption's reason, which stays first: `fastshare status` lists the
            # allocation under Adopted, and a retry of its Allocate is judged as an adopted one's
            base = allocation.reason.split(f"; {OVER_COMMITTED}")[0]
            want = f"{base}; {want}" if want else base
            return None if allocation.reason == want else want
        if allocation.reason == want or (not why and not allocation.reason.startswith(OVER_COMMITTED)):
            return None
        return want

    def note_overcommit(self, allocation: Allocation) -> Allocation:
        """Record on an active allocation that its GPU no longer takes it and why (or that it
        does again): `fastshare status`, Get and the FastPod's status show it. The caller holds
        the claim."""
        want = self.overcommit_note(allocation)
        if want is None:
            return allocation
        if self.ledger.over(allocation.id):
            log.warning("allocation %s: %s", allocation.id, want)
        else:
            log.info("allocation %s: its GPU on node %s takes it again (no longer over-committed)",
                     allocation.id, allocation.node)
        try:   # updated_at kept: the note says nothing about the share (see Reconciler._settled)
            return self._publish(self.store.transition(allocation.id, [State.ACTIVE], State.ACTIVE,
                                                       reason=want, updated_at=allocation.updated_at))
        except Conflict:
            return self.get(allocation.id)

    def finish_release(self, allocation: Allocation) -> Allocation:
        """Free a releasing allocation on its agent, then in the store and the ledger.

        If the agent cannot be reached it stays releasing (its capacity stays held) and the
        reconciler finishes when the node is back.
        """
        node = self.node_facts(allocation.node)
        if node is None:   # in-cluster: its Node is not (any more) labelled, this process never met it
            log.warning("allocation %s stays releasing: node %s is not known to this controller (no address "
                        "to reach its agent)", allocation.id, allocation.node)
            return allocation
        client = self.agents.get(node.name, node.address)
        try:
            client.release(allocation.id, _KINDS[allocation.spec.kind])
        except AgentError as exc:
            log.warning("allocation %s stays releasing: %s", allocation.id, exc)
            return allocation
        faults.point("controller.after_agent_release")
        # failed = it never became usable (never prepared, so no environment was handed out), or
        # its device went away under it.
        failed = not allocation.env or allocation.reason.startswith(DEVICE_GONE)
        final = State.FAILED if failed else State.RELEASED
        try:
            allocation = self.store.transition(allocation.id, [State.RELEASING], final,
                                               lease_expires_at=0.0)
        except Conflict:
            return self.get(allocation.id)
        self.ledger.release(allocation.id)
        if allocation.spec.kind is Kind.EXCLUSIVE:
            self._refresh_mig(node.name, client)
        return self._publish(allocation)

    def _refresh_mig(self, name: str, client: AgentClient) -> None:
        """After an exclusive release: a slice taken from a static MIG layout stays on the GPU,
        unheld now, which the view shows only from the next inventory on. Without one the
        placement would not see it at all meanwhile, and could try to create over it."""
        try:
            inventory = client.inventory()
        except AgentError as exc:
            log.info("node %s: MIG view not refreshed after a release (%s); the next pass will", name, exc)
            return
        node = self.store.get_node(name)
        if node is not None:
            self.refresh_node(node, inventory)

    def prune_finished(self) -> int:
        """Forget finished allocations older than the retention (their ids and idempotency keys
        are then unknown: a retry with such a key allocates anew)."""
        pruned = self.store.prune_finished(self.clock() - self.settings.finished_retention)
        if pruned:
            log.info("forgot %d allocation(s) released or failed over %.0f s ago", pruned,
                     self.settings.finished_retention)
        return pruned

    def renew(self, allocation_id: str, ttl: int = 0) -> Allocation:
        """Push the lease forward by ``ttl`` (0: the allocation's own). The range is Allocate's:
        a shorter lease is released under a live client, a longer one never expires."""
        if ttl and not MIN_LEASE_TTL <= ttl <= MAX_LEASE_TTL:
            raise ValidationError("ttl_seconds", f"must be 0 (the allocation's own ttl) or in "
                                                 f"{MIN_LEASE_TTL}..{MAX_LEASE_TTL}, got {ttl}")
        for _ in range(len(_RENEWABLE) + 1):   # each retry follows a forward step of the state
            allocation = self.get(allocation_id)
            if allocation.state not in _RENEWABLE:
                raise NotFound(f"allocation {allocation_id} is {allocation.state.value}; its lease "
                               "cannot be renewed")
            lease = ttl or allocation.lease_ttl
            if not lease:
                raise ValidationError("ttl_seconds", "the allocation has no lease; give ttl_seconds > 0")
            # Compare-and-set on the state just checked: a Release that went through meanwhile
            # must not get a live lease put on its record (and the caller told it was renewed).
            try:
                return self.store.transition(allocation_id, [allocation.state], allocation.state,
                                             lease_expires_at=self.clock() + lease, lease_ttl=lease)
            except Conflict:
                continue   # the state moved on: decide again on the fresh record
        raise Busy(f"allocation {allocation_id} is being changed by another call; retry")

    # -- shares newer than the state store ----------------------------------------------------------
    def saw(self, node: str, inventory: agent_pb2.Inventory) -> None:
        """Before a node's inventory is judged: this process numbers above every share in it, and
        its first inventory of the node is judged as at this process's start, or as at the earlier
        start since which no process reached it (see ``StateStore.saw``). A node stays sighted when
        forgotten: this process's records of its shares say what they are."""
        sequences = [seq for s in (*inventory.shares, *inventory.lost_shares)
                     if (seq := sequence_of(s.id)) is not None]
        with self._sight_lock:
            self.store.saw(sequences, first_of="" if node in self._sighted else node)
            self._sighted.add(node)

    def newer_than_store(self, inventory: agent_pb2.Inventory) -> list[agent_pb2.Share]:
        """The shares an agent holds that this store never numbered and has no record of: made
        by a controller whose records the store lost (restored from an older backup, or its
        last commits lost to a power loss). Not orphans: workloads may run on them."""
        return [s for s in inventory.shares if (seq := sequence_of(s.id)) is not None
                and self.store.never_issued(seq) and self.store.get_allocation(s.id) is None]

    def take_over(self, node: str, shares: list[agent_pb2.Share],
                  inventory: agent_pb2.Inventory) -> list[str]:
        """Adopt a node's shares that are newer than the store (see ``adopt``); returns the ids
        adopted. One that cannot be is kept (never freed), said once in the log, and keeps its node
        from new work until it is adopted or gone; an empty ``shares`` lets the node take work again."""
        adopted, failed = [], {}
        for share in shares:
            try:
                adopted.append(self.adopt(node, share, inventory).id)
            except AdoptFailed as exc:
                failed[share.id] = str(exc)
                if self._unadopted.get(node, {}).get(share.id) != str(exc):
                    log.error("node %s holds share %s (owner %r) that the state database has no record of "
                              "and never issued: the database went back in time (restored from an older "
                              "backup, or its last commits lost). It is not freed, and the node takes no new "
                              "work meanwhile, but it cannot be adopted: %s. Fix that (adoption is retried "
                              "every pass), or if nothing uses the share, free it on the node with "
                              "`fastshare node release %s`", node, share.id, share.owner, exc, share.id)
        if failed:
            self._unadopted[node] = failed
        else:
            self._unadopted.pop(node, None)
        self._hold_out(node, bool(failed))
        return adopted

    def held_out(self, node: str) -> bool:
        """The node takes no new work until its shares newer than the store are adopted."""
        return self.ledger.held_out(node)

    def _hold_out(self, node: str, hold: bool) -> None:
        self.ledger.set_held_out(node, HELD_OUT if hold else "")

    def adopt(self, node_name: str, share: agent_pb2.Share, inventory: agent_pb2.Inventory) -> Allocation:
        """Record an active allocation for a share its agent holds that the store has no record
        of (see ``newer_than_store``), rebuilt from the share: kind, sizes, GPUs, MIG slice, owner;
        the env from the agent (PrepareShare again, with the share as the agent holds it, hands
        back what it gave out, changing nothing), and the idempotency key and lease ttl the
        controller gave the share: the client's retry with the same key gets this allocation
        (see ``_same_request``), and its lease runs from now (a live client renews it, an
        abandoned one expires). Placement constraints are not in the share: the record has none.
        `fastshare release` ends it as usual.

        Crash-safe: nothing is written before the record, in one commit; until then the next pass
        finds the share unrecorded again. Raises AdoptFailed."""
        node = self.node_facts(node_name)
        if node is None:
            raise AdoptFailed(f"node {node_name} is not known to this controller")
        with self.claim(share.id) as got:
            if not got or self.store.get_allocation(share.id) is not None:
                raise AdoptFailed("another call is working on it")
            spec, assignment = self._rebuild(node, share, inventory)
            try:
                reply = self.agents.get(node.name, node.address).prepare(share)
            except AgentError as exc:
                raise AdoptFailed(f"its agent did not confirm it: {exc.code.name}: {exc.details}") from None
            try:
                over = self.ledger.adopt(assignment)
            except ValueError as exc:
                raise AdoptFailed(f"its capacity cannot be counted: {exc}") from None
            try:
                now, ttl = self.clock(), share.lease_ttl_seconds
                draft = Allocation(id=share.id, spec=spec, owner=share.owner, state=State.ACTIVE,
                                   node=node.name, devices=_devices(assignment, node),
                                   assignment=assignment.to_dict(), created_at=now, updated_at=now,
                                   idempotency_key=share.idempotency_key, lease_ttl=ttl,
                                   lease_expires_at=now + ttl if ttl else 0.0)
                record = replace(draft, env=_env(draft, reply), devices=_prepared_devices(draft, reply),
                                 reason=f"{ADOPTED}the state database had no record of this share "
                                        f"on node {node.name} (restored from an older backup, or its "
                                        "last commits lost); rebuilt from the share (no placement "
                                        "constraints). Release it if nothing uses it")
                try:
                    self.store.create_allocation(record)
                except DuplicateKey as dup:   # a retry of its Allocate came first and made another
                    record = replace(record, idempotency_key="",
                                     reason=f"{record.reason}; its idempotency key is held by "
                                            f"allocation {dup.existing.id}")
                    self.store.create_allocation(record)
            except BaseException:
                self.ledger.release(share.id)
                raise
        log.error("node %s holds share %s (owner %r) that the state database has no record of and never "
                  "issued: the database went back in time (restored from an older backup, or its last "
                  "commits lost). Not freed: adopted as an active %s allocation%s. Check it with `fastshare "
                  "status`; if nothing uses it, end it with `fastshare release %s`", node.name, share.id,
                  share.owner, spec.kind.value, f" (its GPU is over-committed: {over})" if over else "",
                  share.id)
        return self._publish(record)

    def _rebuild(self, node: Node, share: agent_pb2.Share,
                 inventory: agent_pb2.Inventory) -> tuple[Spec, Assignment]:
        """The spec and the engine's reservation of a share as its agent holds it."""
        kind = next((k for k, v in _KINDS.items() if v == share.kind), None)
        if kind is None:
            raise AdoptFailed(f"its kind {share.kind} is not one this controller makes")
        spec = {Kind.FASTPOD: Spec(kind, sm_percent=share.sm_percent, memory_bytes=share.memory_bytes,
                                   quota_request=share.quota_request, quota_limit=share.quota_limit),
                Kind.MPS: Spec(kind, memory_bytes=share.memory_bytes),
                Kind.EXCLUSIVE: Spec(kind, mig_profile=share.mig_profile),
                Kind.WHOLE: Spec(kind, gpu_count=len(share.device_uuids))}[kind]
        gpus = {g.uuid: g for g in node.gpus}
        missing = [u for u in share.device_uuids if u not in gpus]
        if missing or not share.device_uuids:
            raise AdoptFailed(f"its device(s) {missing or list(share.device_uuids)} are not GPUs of node "
                              f"{node.name}")
        mig = None
        if kind is Kind.EXCLUSIVE:
            gpu = gpus[share.device_uuids[0]]
            held = next((d for g in inventory.gpus for d in g.mig_devices if d.share_id == share.id), None)
            known = catalog.find_model(gpu.model)
            profile = next((p for p in (known.profiles if known else ())
                            if held and p.profile_id == held.profile_id), None)
            if held is None or profile is None:
                raise AdoptFailed(f"its MIG slice on GPU {gpu.uuid} is not in the agent's inventory")
            mig = MigSlot(profile.profile_id, profile.name, held.start, profile.memory_slices,
                          profile.sm_count, profile.memory_mib)
        request = self.ledger.to_request(share.id, spec)
        if isinstance(request, Rejection):
            raise AdoptFailed(request.reason)
        assignment = Assignment(request, node.name, tuple(gpus[u].index for u in share.device_uuids), mig=mig,
                                gpu_uuids=tuple(share.device_uuids))
        return spec, assignment

    # -- nodes -----------------------------------------------------------------------------------
    def register_node(self, name: str, address: str, labels: dict[str, str]) -> None:
        """An agent (re)announced itself: pull its inventory, refresh the ledger, reconcile it.
        A node holding shares newer than the store takes no new work until they are adopted
        (the reconciler pass the registration starts does it)."""
        inventory = self.agents.get(name, address).inventory()
        self.saw(name, inventory)
        if self.newer_than_store(inventory):
            self._hold_out(name, True)
        now = self.clock()
        with self._node_changes:
            node = _keep_cordon(node_from_inventory(name, address, labels, inventory, now),
                                self.store.get_node(name))
            self.put_node(node)
            with self._nodes_lock:
                self._registered.add(name)
                self._last_seen[name] = now
            misfits = self.ledger.set_node(node_view(node), True)
        self._log_misfits(name, misfits)
        self._check_oversubscription(name, inventory.mps_memory_oversubscription)
        log.info("node %s registered at %s with %d GPU(s)", name, address, len(node.gpus))

    def _check_oversubscription(self, name: str, agent: float) -> None:
        """Warn (once per node and value) when the node's agent lets MPS shares promise another
        multiple of a GPU's memory than this controller places: the lower factor governs. An
        agent that does not report its factor (0) is not judged."""
        ours = self.ledger.mps_oversubscription
        if not agent or agent == ours:
            self._oversub_warned.pop(name, None)
            return
        if self._oversub_warned.get(name) == agent:
            return
        self._oversub_warned[name] = agent
        if agent < ours:
            effect = (f"the agent's ({agent:g}) governs: the controller places MPS shares up to {ours:g} x a "
                      f"GPU's memory there and the agent refuses those beyond {agent:g} x at prepare")
        else:
            effect = (f"the controller's ({ours:g}) governs: it places MPS shares only up to {ours:g} x a "
                      "GPU's memory there")
        log.warning("node %s: its agent's MPS memory oversubscription factor (%g, its config's "
                    "mps_memory_oversubscription) differs from the controller's (%g); %s. Make them equal "
                    "(the agent's config, or the standalone controller's --mps-oversubscription)",
                    name, agent, ours, effect)

    def heartbeat(self, name: str) -> bool:
        """False tells the agent to register again (unknown to this controller process)."""
        now = self.clock()
        with self._node_changes:
            with self._nodes_lock:
                if name not in self._registered:
                    return False
                was_down = name not in self._last_seen
                self._last_seen[name] = now
            self.store.mark_node(name, available=True, last_heartbeat=now)
            if was_down:
                self.ledger.set_available(name, True)
        if was_down:
            log.info("node %s is back", name)
        return True

    def check_liveness(self) -> list[str]:
        """Mark nodes that missed their heartbeats unavailable; returns their names."""
        now = self.clock()
        timeout = self.heartbeat_timeout()
        lost = []
        with self._node_changes:
            with self._nodes_lock:
                for name, seen in list(self._last_seen.items()):
                    if now - seen > timeout:
                        del self._last_seen[name]
                        lost.append(name)
            for name in lost:
                self.store.mark_node(name, available=False)
                self.ledger.set_available(name, False)
        for name in lost:
            log.warning("node %s missed its heartbeats: unavailable, no new work", name)
        return lost

    def refresh_node(self, node: Node, inventory: agent_pb2.Inventory, moving: str = "") -> None:
        """Take over GPU facts that changed on the node (e.g. MIG mode) without re-registration.
        ``moving``: an allocation being placed again because its GPU left the node: that it cannot
        be counted there any more is no error."""
        fresh = node_from_inventory(node.name, node.address, node.labels, inventory, node.last_heartbeat)
        if fresh.gpus == node.gpus:
            return
        with self._node_changes:
            fresh = _keep_cordon(replace(fresh, available=node.available, registered_at=node.registered_at),
                                 self.store.get_node(node.name) or node)
            self.put_node(fresh)
            misfits = self.ledger.set_node(node_view(fresh), self.is_available(node.name))
        log.info("node %s: GPU facts changed (e.g. MIG mode); view refreshed", node.name)
        self._log_misfits(node.name, [(a, why) for a, why in misfits if a.request.id != moving])

    @staticmethod
    def _log_misfits(name: str, misfits: list[tuple[Assignment, str]]) -> None:
        """After a node's view changed: what cannot be counted at all (its GPU is gone: the
        reconciler ends it). What is counted beyond what its GPU takes now is noted on the
        allocation (and logged) by the reconciler's next pass, see ``note_overcommit``."""
        for assignment, why in misfits:
            log.error("allocation %s cannot be counted on node %s: %s", assignment.request.id, name, why)

    def _unknown_node(self, name: str) -> NotFound:
        """The nodes known, when few; else how many and the likeliest meant. At 10,000 nodes the
        error named every one (150 kB) from a listing of them all, read under the node lock
        while heartbeats waited."""
        names = self.ledger.node_names()
        if len(names) <= MAX_NAMED_NODES:
            known = ", ".join(sorted(names)) or "none registered yet"
        else:
            close = _likeliest(name, names)
            known = (f"{len(names):,} nodes, `fastshare status` lists them"
                     + (f"; did you mean {', '.join(close)}?" if close else ""))
        return NotFound(f"node {name!r} is not known to this controller (known: {known})")

    def stored_node(self, name: str) -> Node:
        """The node as stored; NotFound saying which are known."""
        node = self.store.get_node(name)
        if node is None:
            raise self._unknown_node(name)
        return node

    def set_schedulable(self, name: str, schedulable: bool, reason: str = "") -> Node:
        """Cordon or uncordon a node: recorded first, then the engine stops (or resumes)
        placing there; existing allocations are not touched."""
        with self._node_changes:
            node = self.store.get_node(name)
            if node is not None:
                node = replace(node, cordoned=not schedulable, cordon_reason="" if schedulable else reason)
                self.put_node(node)
                self.ledger.set_cordoned(name, node.cordoned, node.cordon_reason)
        if node is None:   # worked out without the lock, which heartbeats wait for
            raise self._unknown_node(name)
        log.info("node %s %s%s", name, "cordoned: no new work" if node.cordoned else "uncordoned",
                 f" ({reason})" if node.cordoned and reason else "")
        return node

    def forget_node(self, name: str, reason: str = "", by: str = "an operator") -> list[Allocation]:
        """A node taken out for good: end its held allocations (``failed`` if never handed out,
        else ``released``; nothing is asked of its agent, which is gone) and forget the node.
        Returns the allocations it ended. ``by``: who decided, for the records' reason."""
        why = f"node {name} was forgotten by {by}" + (f": {reason}" if reason else "")
        self.stored_node(name)   # an unknown one's error is worked out outside the lock heartbeats wait for
        with self._node_changes:
            if self.store.get_node(name) is None:
                raise NotFound(f"node {name!r} was forgotten meanwhile")
            if self.is_available(name):
                raise NodeInUse(f"node {name}'s agent still heartbeats; stop it for good first (e.g. "
                                "`systemctl disable --now fastshare-node` there), then retry once "
                                "`fastshare status` shows the node unavailable")
            ended = []
            for allocation in self.store.list_allocations(HOLDING, node=name):
                with self.claim(allocation.id, wait=2.0) as got:   # short: heartbeats wait for the node lock
                    if not got:
                        raise Busy(f"allocation {allocation.id} is being changed by another call; retry")
                    current = self.get(allocation.id)
                    if current.state in FINISHED:
                        continue
                    final = State.RELEASED if current.env else State.FAILED
                    done = self.store.transition(current.id, [current.state], final, reason=why,
                                                 lease_expires_at=0.0)
                    self.ledger.release(current.id)
                    ended.append(self._publish(done))
            self.store.delete_node(name)
            self._node_cache.pop(name, None)
            with self._gpu_kinds_lock:
                if self._gpu_kinds is not None:
                    self._gpu_kinds.remove(name)
            with self._nodes_lock:
                self._registered.discard(name)
                self._last_seen.pop(name, None)
            self.ledger.remove_node(name)
            self.agents.drop(name)   # its channel, kept (and its connection retried) for good otherwise
        log.warning("node %s forgotten (%s); %d allocation(s) ended: %s", name, reason or "no reason given",
                    len(ended), ", ".join(a.id for a in ended) or "none")
        return ended

    def adopt_node(self, node: Node, inventory: agent_pb2.Inventory | None) -> Node:
        """At start: a node from the store, reachable (inventory) or not; returns it as recorded."""
        now = self.clock()
        if inventory is not None:
            fresh = node_from_inventory(node.name, node.address, node.labels, inventory, now)
            node = _keep_cordon(replace(fresh, registered_at=node.registered_at), node)
            with self._nodes_lock:
                self._registered.add(node.name)
                self._last_seen[node.name] = now
        node = replace(node, available=inventory is not None)
        self.put_node(node)
        return node


def _likeliest(typed: str, names: Collection[str], count: int = 3) -> list[str]:
    """The names that share most of ``typed``'s start and end together (a mistyped letter or
    digit, one left out or put in), at least 60 % of it; 20 ms among 10,000 names."""
    def shared_ends(name: str) -> int:
        start = _same_start(typed, name)
        return start + _same_start(typed[start:][::-1], name[start:][::-1])

    scored = [(shared_ends(n), n) for n in names]
    fitting = [(-shared, abs(len(n) - len(typed)), n) for shared, n in scored if shared >= 0.6 * len(typed)]
    return [n for *_, n in sorted(fitting)[:count]]


def _same_start(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _keep_cordon(fresh: Node, stored: Node | None) -> Node:
    """A node rebuilt from its agent's inventory keeps the operator's cordon."""
    if stored is None:
        return fresh
    return replace(fresh, cordoned=stored.cordoned, cordon_reason=stored.cordon_reason)


def _where(assignment: Assignment) -> tuple[str, tuple[object, ...], bool]:
    """Which GPUs an assignment takes, and whether it turns MIG on there first."""
    return assignment.node, assignment.gpu_uuids or assignment.gpus, assignment.enable_mig


def assignment_of(allocation: Allocation) -> Assignment:
    """The engine's reservation an allocation records. One recorded by an earlier version names
    its GPUs by index only: their UUIDs come from the record's devices (same order)."""
    assignment = Assignment.from_dict(allocation.assignment)
    uuids = tuple(d.gpu_uuid for d in allocation.devices)
    if not assignment.gpu_uuids and all(uuids) and len(uuids) == len(assignment.gpus):
        assignment = replace(assignment, gpu_uuids=uuids)
    return assignment


def _carried(spec: Spec) -> Spec:
    """What of a (normalised) spec its share carries, so what an adopted record's spec was rebuilt
    from (``ControllerCore._rebuild``): a retry of an adopted allocation's Allocate is the same
    request when these agree. Placement constraints and host resources are not in the share, and
    an exclusive slice may have been asked for by profile name or id, sm_count or sm_percent."""
    if spec.kind is Kind.FASTPOD:
        return Spec(spec.kind, sm_percent=spec.sm_percent, memory_bytes=spec.memory_bytes,
                    quota_request=spec.quota_request or 1.0, quota_limit=spec.quota_limit or 1.0)
    if spec.kind is Kind.MPS:
        return Spec(spec.kind, memory_bytes=spec.memory_bytes)
    if spec.kind is Kind.WHOLE:
        return Spec(spec.kind, gpu_count=spec.gpu_count)
    return Spec(spec.kind)


def _devices(assignment: Assignment, node: Node | None) -> list[Device]:
    """The devices of a placement; its GPUs by UUID where the engine named them (the node's
    record may have been renumbered since the engine placed it)."""
    by_index = {g.index: g for g in (node.gpus if node else [])}
    by_uuid = {g.uuid: g for g in (node.gpus if node else [])}
    out = []
    for n, index in enumerate(assignment.gpus):
        uuid = assignment.gpu_uuids[n] if assignment.gpu_uuids else ""
        gpu = by_uuid.get(uuid) if uuid else by_index.get(index)
        device = Device(gpu_index=index, gpu_uuid=uuid or (gpu.uuid if gpu else ""),
                        model=gpu.model if gpu else "")
        if assignment.mig is not None:
            device = replace(device, mig_profile=assignment.mig.profile_name, mig_start=assignment.mig.start,
                             mig_size=assignment.mig.size)
        out.append(device)
    return out


def _prepared_devices(allocation: Allocation, reply: agent_pb2.PrepareShareReply) -> list[Device]:
    if allocation.spec.kind is not Kind.EXCLUSIVE or not reply.device_uuids:
        return allocation.devices
    device = allocation.devices[0]
    start = reply.share.mig_start if reply.share.HasField("mig_start") else device.mig_start
    return [replace(device, mig_uuid=reply.device_uuids[0], mig_start=start)]


def _env(allocation: Allocation, reply: agent_pb2.PrepareShareReply) -> dict[str, str]:
    env = dict(reply.env)
    visible = ",".join(reply.device_uuids) or ",".join(d.gpu_uuid for d in allocation.devices)
    env.setdefault("CUDA_VISIBLE_DEVICES", visible)
    env.setdefault("NVIDIA_VISIBLE_DEVICES", visible)
    env["FASTSHARE_ALLOCATION_ID"] = allocation.id
    env["FASTSHARE_NODE"] = allocation.node
    return env

