"""Controller start (Reconciler.start) against a real SQLite store and the real ledger: an
allocation a crash left pending is rolled forward, not released because its lease ran out
while the controller was down. The agent is a recording stand-in."""

from __future__ import annotations

import time

import pytest

from fastshare.controller.core import ControllerCore
from fastshare.controller.model import Allocation, Kind, Spec, State
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.sqlite_store import SqliteStore

from .recording_agent import RecordingAgent

GiB = 1024**3




@pytest.fixture
def before_crash(tmp_path):
    """The recording agent, a real store, and the controller core that ran before a crash two
    minutes ago (node n1 registered); the spec and creation time of the allocations it made."""
    agent = RecordingAgent()
    store = SqliteStore(tmp_path / "state.db")
    before = ControllerCore(store, agent)
    before.register_node("n1", "127.0.0.1:1", {})
    yield agent, store, before, Spec(Kind.MPS, memory_bytes=GiB), time.time() - 120
    store.close()


def test_pending_allocation_is_not_expired_by_controller_downtime(before_crash):
    """kill -9 after the agent prepared (record still pending), controller down longer than the
    lease: the client (`fastshare run`, ttl 30 s by default) could not renew, and its retry with
    the same key must find the allocation active, as for an active one (see _grace_leases)."""
    agent, store, before, spec, created = before_crash
    placed = before.ledger.place(before.ledger.to_request("fs-1", spec))
    record = Allocation(id="fs-1", spec=spec, owner="me", state=State.PENDING, node="n1",
                        idempotency_key="run-1", assignment=placed.to_dict(), created_at=created,
                        updated_at=created, lease_ttl=30, lease_expires_at=created + 30)
    store.create_allocation(record)
    agent.prepare(before.share_for(record))   # the agent prepared it before the crash

    restarted = ControllerCore(store, agent)
    report = Reconciler(restarted).start()
    after = restarted.get("fs-1")
    assert after.state is State.ACTIVE, (after.state, after.reason, report)
    assert after.lease_expires_at >= time.time() + 20
    assert "fs-1" in agent.shares


def test_first_pass_after_a_restart_prepares_a_lost_share_of_a_leased_allocation(before_crash):
    """The agent lost an active allocation's share while the controller was down (say its
    machine rebooted). Start's grace for the lease used to stamp the record as changed after
    the inventories were read, so the first pass took it for too new to judge and left it
    without its share until the next pass; a record without a lease was prepared at once."""
    agent, store, before, spec, created = before_crash
    for allocation_id, ttl in (("fs-leased", 30), ("fs-unleased", 0)):
        placed = before.ledger.place(before.ledger.to_request(allocation_id, spec))
        store.create_allocation(Allocation(
            id=allocation_id, spec=spec, owner="me", state=State.PENDING, node="n1",
            assignment=placed.to_dict(), created_at=created, updated_at=created, lease_ttl=ttl,
            lease_expires_at=created + 100 if ttl else 0.0))
        before.complete(store.get_allocation(allocation_id))
        store.update(allocation_id, updated_at=created)
    agent.shares.clear()                      # the node lost both shares meanwhile

    restarted = ControllerCore(store, agent)
    report = Reconciler(restarted).start()
    assert sorted(report.completed) == ["fs-leased", "fs-unleased"], report
    assert set(agent.shares) == {"fs-leased", "fs-unleased"}
    leased = restarted.get("fs-leased")
    assert leased.state is State.ACTIVE and leased.lease_expires_at >= time.time() + 20

