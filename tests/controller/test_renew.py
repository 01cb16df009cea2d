"""RenewLease's ttl against the same range Allocate enforces, through the core with a real
SQLite store (the agents are not involved in renewing)."""

from __future__ import annotations

import pytest

from fastshare.controller.core import ControllerCore
from fastshare.controller.model import State
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.controller.validation import MAX_LEASE_TTL, MIN_LEASE_TTL, ValidationError

from .test_store import _alloc


@pytest.fixture
def core(tmp_path):
    store = SqliteStore(tmp_path / "state.db")
    allocation = _alloc("fs-1")
    allocation.lease_ttl = 30
    store.create_allocation(allocation)
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
