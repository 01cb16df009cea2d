"""Long runs: released and failed allocations are forgotten after the retention, so the state
file, `fastshare status --all` and List(include_finished) stop growing. Real SQLite store and
ledger; the agent is the recording stand-in of test_restart_leases."""

from __future__ import annotations

import time

import pytest

from fastshare.controller.core import ControllerCore, NotFound, Settings
from fastshare.controller.model import Kind, Spec, State
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.controller.validation import Request

from .recording_agent import GiB, RecordingAgent

DAY = 86400.0


def test_finished_allocations_are_forgotten_after_the_retention(tmp_path):
    """Every released or failed allocation used to stay in state.db for good: after some
    thousands, `fastshare status --all` (one gRPC answer, 4 MiB at most) failed, and the file
    grew with every job. Now a record finished longer ago than the retention is deleted by
    the reconciler; held ones stay whatever their age, and so do recent finished ones."""
    store = SqliteStore(tmp_path / "state.db")
    core = ControllerCore(store, RecordingAgent(), Settings(finished_retention=7 * DAY))
    core.register_node("n1", "127.0.0.1:1", {})
    spec = Spec(Kind.MPS, memory_bytes=GiB)
    old = [core.allocate(Request(spec=spec, owner="me", idempotency_key=f"k{i}")) for i in range(3)]
    recent = core.allocate(Request(spec=spec, owner="me"))
    held = core.allocate(Request(spec=spec, owner="me"))
    for a, age in [*((a, 8 * DAY) for a in old), (recent, 2 * DAY), (held, 30 * DAY)]:
        if a is not held:
            core.release(a.id)
        store.update(a.id, updated_at=time.time() - age)   # as if it happened that long ago

    report = Reconciler(core).run_once()

    assert report.pruned == 3
    for a in old:
        with pytest.raises(NotFound):
            core.get(a.id)
    assert {a.id for a in store.list_allocations()} == {held.id, recent.id}
    assert core.get(held.id).state is State.ACTIVE
    # a forgotten key allocates anew
    again = core.allocate(Request(spec=spec, owner="me", idempotency_key="k0"))
    assert again.id != old[0].id and again.state is State.ACTIVE
    store.close()
