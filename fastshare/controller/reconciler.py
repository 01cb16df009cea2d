"""Finishes or compensates every half-done step, at start and periodically.

Order matters: agents' inventories are read BEFORE the store, so a share an agent reports
always has its record committed already (records are committed before prepare); a share
without a holding record is therefore a true orphan (prepare without record) and is freed,
unless its id carries a sequence number the store never issued (see ``model.sequence_of``):
then the store went back in time (restored from an older backup), the share may well be in
use, and it is adopted instead (``ControllerCore.take_over``).

Per allocation, by state (skipping allocations another thread is working on):
- pending   -> prepare again (idempotent by share id) and activate; refused -> compensate;
- prepared  -> activate (written by earlier versions only);
- active    -> its agent dropped the share because the device went away under it (the
               inventory's lost_shares): end it failed with the agent's reason (prepared again,
               it would sit on another device than the one its workload was given); lease
               expired: release; agent lost the share otherwise: prepare again (roll forward) -
               only if the record is older than the inventory (a share prepared after the agent
               answered is not in it);
- releasing -> release on the agent again, then mark released/failed.
Nodes that cannot be reached are left alone: their allocations keep their capacity and
their state until the node is back.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from fastshare.controller.agent_client import AgentError
from fastshare.controller.core import (
    ID_PREFIX,
    AgentFailed,
    ControllerCore,
    assignment_of,
    node_from_inventory,
    node_view,
)
from fastshare.controller.model import FINISHED, HOLDING, Allocation, Node, State, sequence_of
from fastshare.server_runtime import collection_paused
from fastshare.v1 import agent_pb2

log = logging.getLogger("fastshare.controller.reconciler")
# Agents asked for their inventories at once. Each one that does not answer (a host cut off with
# its connection open) holds a thread for a whole deadline, and the controller's start waits for
# the pass before it serves: with 8 at a time, 12 such agents held the start for two deadlines.
INVENTORY_THREADS = 64
# A pass waits for the inventories one agent deadline and this much more, however many agents
# hang: those not in by then (not asked yet, behind INVENTORY_THREADS hung ones) are taken as
# unreachable. With 65 or more hung agents a start waited a deadline per 64 of them.
INVENTORY_SLACK_S = 2.0


@dataclass
class Report:
    """What one pass did (for logs and tests)."""

    completed: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    compensated: list[str] = field(default_factory=list)
    orphans_freed: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)   # shares newer than the store, recorded now
    lost: list[str] = field(default_factory=list)   # ended failed: their device went away under them
    unreachable: list[str] = field(default_factory=list)
    pruned: int = 0   # finished records forgotten (past the retention)


class Reconciler:
    PRUNE_EVERY = 600.0   # seconds between clean-ups of finished records (each one scans them)

    def __init__(self, core: ControllerCore) -> None:
        self.core = core
        self._lock = threading.Lock()   # one pass at a time
        self._pruned_at: float | None = None   # monotonic time of the last clean-up

    def _nodes(self, names: set[str] | None) -> list[Node]:
        """The stored nodes a pass is for: all, or the ones named, read singly (a registration's
        pass must not read the whole cluster)."""
        if names is None:
            return self.core.store.list_nodes()
        return [n for n in map(self.core.store.get_node, sorted(names)) if n is not None]

    def _holding(self, names: set[str] | None) -> list[Allocation]:
        """A read per node named: SQLite finds a node's records by index. (The Kubernetes store
        lists every record for each read, but its controller runs whole passes only.)"""
        if names is None:
            return self.core.store.list_allocations(HOLDING)
        return [a for n in sorted(names) for a in self.core.store.list_allocations(HOLDING, node=n)]

    def _inventories(self, nodes: list[Node],
                     unavailable_too: bool = False) -> dict[str, agent_pb2.Inventory | None]:
        """The inventories of the nodes' agents (None: unreachable). A node that missed its
        heartbeats is not asked unless ``unavailable_too`` (the start, which has heard none yet):
        an agent that does not answer (hung, or its host cut off with its connection open) held
        every pass a whole deadline, and the registrations' passes waited behind it. Its records
        are left as an unreachable agent's; the first pass after it is back reconciles it."""
        nodes = [n for n in nodes if unavailable_too or self.core.is_available(n.name)]

        def fetch(node):
            try:
                return node.name, self.core.agents.get(node.name, node.address).inventory()
            except AgentError as exc:
                log.info("node %s unreachable during reconciliation: %s", node.name, exc)
                return node.name, None

        if not nodes:
            return {}
        waited = self.core.agents.deadline + INVENTORY_SLACK_S
        pool = ThreadPoolExecutor(max_workers=min(INVENTORY_THREADS, len(nodes)))
        asked = {pool.submit(fetch, node): node.name for node in nodes}
        done, late = wait(asked, timeout=waited)
        pool.shutdown(wait=False, cancel_futures=True)   # a late fetch ends with its deadline
        inventories = dict(future.result() for future in done)
        if late:
            log.warning("%d node(s) taken as unreachable this pass, their agents not asked or not answering "
                        "within %.0f s (e.g. more than the %d asked at once hang): %s", len(late), waited,
                        INVENTORY_THREADS, ", ".join(sorted(asked[f] for f in late)))
        return {**dict.fromkeys(asked.values()), **inventories}

    def start(self) -> Report:
        """Controller start: rebuild the ledger from the store + agents, then reconcile."""
        with self._lock, collection_paused():
            asked_at = self.core.clock()
            listed = self.core.store.list_nodes()
            self.core.note_cluster_size(len(listed))
            inventories = self._inventories(listed, unavailable_too=True)
            stored = [self.core.adopt_node(node, inventories.get(node.name)) for node in listed]
            for n in stored:
                self.core.ledger.set_cordoned(n.name, n.cordoned, n.cordon_reason)
            nodes = [(node_view(n), n.available) for n in stored]
            holding = self.core.store.list_allocations(HOLDING)
            self._grace_leases(holding)
            for assignment, why in self.core.ledger.reset(
                    nodes, [assignment_of(a) for a in holding]):
                log.error("allocation %s cannot be restored into the ledger: %s", assignment.request.id, why)
            report = self._pass(inventories, asked_at=asked_at)
            self.core.warm()
            return report

    def _grace_leases(self, holding: list[Allocation]) -> None:
        """Clients cannot renew while the controller is down: a lease gets at least one full
        ttl from this start (a client that is really gone still expires after that). Also a
        pending (or prepared) one: it is rolled forward below, and its client, answered before
        a lost commit or retrying its key, was as unable to renew.

        The record keeps its ``updated_at``: the first pass takes a record changed after the
        inventories were asked for as too new to judge, and would leave a share its agent lost
        (e.g. a reboot while the controller was down) unprepared until the next pass."""
        now = self.core.clock()
        for a in holding:
            if a.state is not State.RELEASING and a.lease_ttl and a.lease_expires_at < now + a.lease_ttl:
                self.core.store.update(a.id, lease_expires_at=now + a.lease_ttl, updated_at=a.updated_at)

    def run_once(self, nodes: list[str] | None = None) -> Report:
        only = None if nodes is None else set(nodes)
        with self._lock:
            asked_at = self.core.clock()
            listed = self._nodes(only)
            inventories = self._inventories(listed)
            for node in listed:
                inventory = inventories.get(node.name)
                if inventory is None or node_from_inventory(node.name, node.address, node.labels, inventory,
                                                            node.last_heartbeat).gpus == node.gpus:
                    continue
                # read again: a registration since the listing may have changed its address or labels
                if (current := self.core.store.get_node(node.name)) is not None:
                    self.core.refresh_node(current, inventory)
            report = self._pass(inventories, only, asked_at)
            if nodes is None and (self._pruned_at is None
                                  or time.monotonic() - self._pruned_at >= self.PRUNE_EVERY):
                self._pruned_at = time.monotonic()
                report.pruned = self.core.prune_finished()
            return report

    def _pass(self, inventories: dict[str, agent_pb2.Inventory | None],
              only: set[str] | None = None, asked_at: float = 0.0) -> Report:
        """``asked_at``: when the inventories were asked for; a record changed since then may hold
        a share they do not show yet."""
        report = Report(unreachable=sorted(n for n, inv in inventories.items() if inv is None))
        for name, inventory in inventories.items():
            if inventory is not None:
                self.core.saw(name, inventory)
        holding = self._holding(only)
        reached = {n: inv for n, inv in inventories.items() if inv is not None}
        shares = {n: {s.id for s in inv.shares} for n, inv in reached.items()}
        lost = {n: {s.id: s.reason for s in inv.lost_shares} for n, inv in reached.items()}
        for allocation in holding:
            why_lost = lost.get(allocation.node, {}).get(allocation.id, "")
            if why_lost or not self._settled(allocation, shares.get(allocation.node), asked_at):
                self._allocation(allocation, shares.get(allocation.node), report, asked_at, why_lost)
        # Orphans: shares on a reachable agent that no holding record explains. The listing
        # above was read after the inventories, so it holds every record of these nodes a share
        # in them can have (records are committed before prepare); a share not in it is looked
        # up singly below (released since, an orphan, or, rarely, recorded on another node).
        records = {a.id for a in holding}
        busy = self.core.busy()
        for node, inventory in inventories.items():
            if inventory is None:
                continue
            newer = []
            # a lost share (dropped with its device) no record holds is forgotten the same way
            for share in [*inventory.shares, *inventory.lost_shares]:
                if not share.id.startswith(ID_PREFIX) or share.id in records or share.id in busy:
                    continue
                record = self.core.store.get_allocation(share.id)
                if record is not None and (record.state not in FINISHED or record.updated_at >= asked_at):
                    continue   # still held, or released since the inventory was taken (not an orphan)
                sequence = sequence_of(share.id)
                if (record is None and sequence is not None and isinstance(share, agent_pb2.Share)
                        and self.core.store.never_issued(sequence)):
                    newer.append(share)   # newer than the store: adopted below, never freed
                    continue
                stored = self.core.store.get_node(node)
                if stored is None:
                    continue   # forgotten since the inventories were read
                try:
                    self.core.agents.get(node, stored.address).release(share.id)
                    report.orphans_freed.append(share.id)
                    log.warning("freed orphan share %s on %s (no allocation holds it)", share.id, node)
                except AgentError as exc:
                    log.warning("could not free orphan share %s on %s: %s", share.id, node, exc)
            if (newer or self.core.held_out(node)) and self.core.store.get_node(node) is not None:
                report.adopted += self.core.take_over(node, newer, inventory)
        return report

    def _settled(self, allocation: Allocation, shares: set[str] | None, asked_at: float) -> bool:
        """Nothing to do for the record as listed (active, lease alive, its share on its agent, or
        the agent unreachable, or the record too new to tell): it is not read again. With
        hundreds of records a fresh read of each was most of a pass."""
        if allocation.state is not State.ACTIVE or not self.core.on_its_gpus(allocation):
            return False
        if self.core.overcommit_note(allocation) is not None:
            return False
        if allocation.lease_expires_at and self.core.clock() > allocation.lease_expires_at:
            return False
        return shares is None or allocation.id in shares or allocation.updated_at >= asked_at

    def _allocation(self, allocation: Allocation, shares: set[str] | None,
                    report: Report, asked_at: float = 0.0, why_lost: str = "") -> None:
        """``shares``: what the allocation's agent holds (None: unreachable); ``why_lost``: why its
        agent dropped its share with its device ("": it did not)."""
        core = self.core
        with core.claim(allocation.id) as got:
            if not got:
                return
            current = core.store.get_allocation(allocation.id)
            if current is None or current.state in FINISHED:
                return
            expired = bool(current.lease_expires_at) and core.clock() > current.lease_expires_at
            try:
                if current.state is not State.RELEASING and not core.on_its_gpus(current):
                    current = core.follow_gpus(current)   # renumbered, or released if a GPU is gone
                    if current.state in FINISHED:
                        report.released.append(current.id)
                    if current.state in FINISHED or current.state is State.RELEASING:
                        return   # releasing still: its agent is unreachable, a later pass finishes
                current = core.note_overcommit(current)
                if current.state is State.RELEASING:
                    if shares is not None:
                        done = core.finish_release(current)
                        if done.state in FINISHED:
                            report.released.append(done.id)
                elif why_lost and current.state in (State.ACTIVE, State.PREPARED):
                    done = core.end_lost(current, why_lost)
                    if done.state in FINISHED:
                        report.lost.append(done.id)
                elif expired:
                    log.info("allocation %s: lease expired, releasing", current.id)
                    done = core.release_claimed(current, reason="lease expired")
                    report.released.append(done.id)
                elif shares is None:
                    return
                elif current.state in (State.PENDING, State.PREPARED):
                    core.complete(current, agent_holds=current.id in shares)
                    report.completed.append(current.id)
                elif (current.state is State.ACTIVE and current.updated_at < asked_at
                      and current.id not in shares):
                    log.warning("allocation %s is active but node %s lost its share; preparing it again",
                                current.id, current.node)
                    core.complete(core.store.transition(current.id, [State.ACTIVE], State.PENDING))
                    report.completed.append(current.id)
            except AgentFailed as exc:
                report.compensated.append(current.id)
                log.warning("allocation %s compensated: %s", current.id, exc)
