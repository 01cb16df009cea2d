"""Group commit (fastshare.sqlite_file.GroupSync) on the real controller store and agent journal:
a barrier flushes what was committed before it, concurrent barriers share flushes, and the
background flush started by ``flush_soon`` is what a later ``sync(ticket)`` waits for."""

import threading
import time

import pytest

from fastshare import sqlite_file
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.node.journal import Journal
from fastshare.node.model import ShareSpec

from .test_store import _alloc


@pytest.fixture
def store(tmp_path):
    s = SqliteStore(tmp_path / "state.db")
    yield s
    s.close()


@pytest.fixture
def slow_flush(monkeypatch):
    """Every fdatasync of a file takes 50 ms (a slow disk), so concurrent barriers overlap."""
    real = sqlite_file._fsync_path

    def flush(path, *, directory):
        if not directory:
            time.sleep(0.05)
        real(path, directory=directory)

    monkeypatch.setattr(sqlite_file, "_fsync_path", flush)


def test_barrier_flushes_once_per_new_commit(store):
    group = store._group
    store.create_allocation(_alloc("a"))
    before = group.syncs
    store.sync()
    assert group.syncs == before + 1
    store.sync()                      # nothing committed since: no flush
    assert group.syncs == before + 1
    store.transition("a", ["pending"], "prepared")
    store.sync()
    assert group.syncs == before + 2


def test_concurrent_barriers_share_flushes(store, slow_flush):
    store.sync()
    group, before = store._group, store._group.syncs
    gate = threading.Barrier(8)
    done: list[tuple[int, int]] = []   # (commits counted after my commit, commits synced on return)

    def client(i: int) -> None:
        gate.wait()
        store.create_allocation(_alloc(f"c{i}"))
        mine = group._committed
        store.sync()
        done.append((mine, group._synced))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(done) == 8
    assert all(synced >= mine for mine, synced in done)   # nobody returned before its commit was flushed
    assert group.syncs - before <= 4                        # 8 barriers, shared flushes


def test_flush_soon_runs_in_background_and_sync_waits_for_it(store, slow_flush):
    store.create_allocation(_alloc("a"))
    group, before = store._group, store._group.syncs
    ticket = store.flush_soon()
    deadline = time.monotonic() + 5
    while group.syncs == before and time.monotonic() < deadline:   # nobody waits: it flushes anyway
        time.sleep(0.01)
    assert group.syncs == before + 1
    store.create_allocation(_alloc("b"))    # after the ticket: not needed for it
    started = time.monotonic()
    store.sync(ticket)
    assert time.monotonic() - started < 0.04 and group.syncs == before + 1
    store.sync()
    assert group.syncs == before + 2


def test_journal_barrier_covers_its_commits(tmp_path):
    journal = Journal(tmp_path / "journal.db")
    try:
        spec = ShareSpec(id="s1", kind="fastpod", device_uuids=("GPU-1",), sm_percent=10,
                         memory_bytes=1 << 20, quota_request=0.1, quota_limit=0.5)
        journal.begin_share(spec, "GPU-1", 30000)
        before = journal._group.syncs
        journal.sync()
        assert journal._group.syncs == before + 1 and journal._group._synced == journal._group._committed
        journal.sync()
        assert journal._group.syncs == before + 1
    finally:
        journal.close()


def test_slow_flushes_are_counted_and_named_in_one_warning(store, slow_flush, caplog, monkeypatch):
    """A stalling disk slows every answer: the log says which file, without a line per flush."""
    group = store._group
    for i in range(3):
        store.create_allocation(_alloc(f"s{i}"))
        store.sync()
    assert group.slow_flushes == 3
    warnings = [r.getMessage() for r in caplog.records if "slow disk" in r.getMessage()]
    assert len(warnings) == 1 and f"{store.path}-wal" in warnings[0]

    monkeypatch.setattr(sqlite_file, "SLOW_FLUSH_S", 10.0)   # the same flushes, now fast enough
    store.create_allocation(_alloc("fast"))
    store.sync()
    assert group.slow_flushes == 3
