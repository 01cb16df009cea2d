"""RenewLease's ttl against the same range Allocate enforces, through the core with a real
SQLite store (the agents are not involved in renewing)."""

from __future__ import annotations

import pytest

from fastshare.controller.core import ControllerCore, NotFound
from fastshare.controller.model import State
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.controller.validation import MAX_LEASE_TTL, MIN_LEASE_TTL, ValidationError

from .test_store import _alloc


def _with_leased_allocation(store: SqliteStore) -> SqliteStore:
    """``store`` holding allocation fs-1 (pending) with a 30 s lease."""
    allocation = _alloc("fs-1")
    allocation.lease_ttl = 30
    store.create_allocation(allocation)
    return store


@pytest.fixture
def core(tmp_path):
    store = _with_leased_allocation(SqliteStore(tmp_path / "state.db"))
    store.transition("fs-1", [State.PENDING], State.ACTIVE)
    yield ControllerCore(store, agents=None)
    store.close()


@pytest.mark.parametrize("ttl", [1, MIN_LEASE_TTL - 1, MAX_LEASE_TTL + 1, 2**32 - 1])
def test_renew_refuses_a_ttl_allocate_would_refuse(core, ttl):
    """A 1 s lease is released by the next reconcile pass while its client still runs; a
    136-year one never expires. Both are refused, naming the field and the range."""
    before = core.get("fs-1")
    with pytest.raises(ValidationError, match=rf"{MIN_LEASE_TTL}\.\.{MAX_LEASE_TTL}, got {ttl}") as exc:
        core.renew("fs-1", ttl)
    assert exc.value.field == "ttl_seconds"
    after = core.get("fs-1")
    assert (after.lease_ttl, after.lease_expires_at) == (before.lease_ttl, before.lease_expires_at)


@pytest.mark.parametrize("ttl", [0, MIN_LEASE_TTL, 60, MAX_LEASE_TTL])
def test_renew_accepts_the_allowed_range(core, ttl):
    renewed = core.renew("fs-1", ttl)
    assert renewed.lease_ttl == (ttl or 30) and renewed.lease_expires_at > 0


class _ChangedAfterRead(SqliteStore):
    """Runs ``race`` once, right after the renewal has read the allocation: another call's
    change landing between the renewal's check and its write."""

    race = None

    def get_allocation(self, allocation_id):
        found = super().get_allocation(allocation_id)
        race, self.race = self.race, None
        if race is not None:
            race(self)
        return found


@pytest.fixture
def racy(tmp_path):
    store = _with_leased_allocation(_ChangedAfterRead(tmp_path / "state.db"))
    yield store
    store.close()


def _mark_releasing(store):
    store.transition("fs-1", [State.ACTIVE], State.RELEASING)


def _release(store):   # as Release does: the intent, then released with the lease cleared
    _mark_releasing(store)
    store.transition("fs-1", [State.RELEASING], State.RELEASED, lease_expires_at=0.0)


@pytest.mark.parametrize(("race", "final"), [(_mark_releasing, State.RELEASING), (_release, State.RELEASED)])
def test_renew_racing_a_release_is_refused_and_puts_no_lease_on_the_record(racy, race, final):
    """The renewal read 'active', then a Release went through before it wrote: it used to answer
    success and put a live lease on a released record. Now it is refused like a renewal of a
    finished allocation, and the record keeps what the release wrote."""
    racy.transition("fs-1", [State.PENDING], State.ACTIVE)
    racy.race = race
    core = ControllerCore(racy, agents=None)
    with pytest.raises(NotFound, match=f"fs-1 is {final.value}; its lease cannot be renewed"):
        core.renew("fs-1", 60)
    after = racy.get_allocation("fs-1")
    assert after.state is final and after.lease_ttl == 30
    if final is State.RELEASED:
        assert after.lease_expires_at == 0.0


def test_renew_goes_through_when_the_allocation_became_active_meanwhile(racy):
    """A pending allocation activated between the renewal's read and its write is still live."""
    racy.race = lambda store: store.transition("fs-1", [State.PENDING], State.ACTIVE)
    renewed = ControllerCore(racy, agents=None).renew("fs-1", 60)
    assert renewed.state is State.ACTIVE and renewed.lease_ttl == 60
