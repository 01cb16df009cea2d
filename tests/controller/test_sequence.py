"""The allocation sequence against a real SQLite store: which share numbers a state database
never issued (a share with one is newer than the database: adopted, not freed), also after a
restore from a backup once new allocations have moved the high-water mark past the lost ones;
and a node the restored database does not know takes no new work until its newer shares are
adopted. The agent is a recording stand-in: the decisions are the controller's."""

from __future__ import annotations

import shutil
import sqlite3
import time

from fastshare.controller.core import ControllerCore, new_id
from fastshare.controller.model import Allocation, Kind, Spec, State, sequence_of
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.v1 import agent_pb2, common_pb2

from .recording_agent import RecordingAgent

GiB = 1024**3


def _record(store: SqliteStore) -> str:
    allocation_id = new_id(store.next_sequence())
    store.create_allocation(Allocation(id=allocation_id, spec=Spec(Kind.MPS, memory_bytes=GiB), owner="me",
                                       state=State.RELEASED, node="n1", created_at=time.time()))
    return allocation_id


def _copy(store_path, to) -> None:
    source, copy = sqlite3.connect(store_path), sqlite3.connect(to)
    source.backup(copy)
    source.close()
    copy.close()


def test_ids_carry_a_growing_sequence_and_old_ids_none():
    assert sequence_of(new_id(0x1234)) == 0x1234 and new_id(0x1234).startswith("fs-1234-")
    assert sequence_of("fs-0123456789abcdef") is None      # made before the sequence
    assert sequence_of("fs-1234-0000000g") is None and sequence_of("other-1234-00000000") is None
    assert sequence_of(new_id(None)) is None


def test_a_restored_database_still_knows_what_it_never_issued(tmp_path):
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    kept = sequence_of(_record(store))
    _copy(path, tmp_path / "backup.db")                       # the backup
    lost = [sequence_of(_record(store)) for _ in range(2)]    # allocated after it
    assert not store.never_issued(kept) and not any(store.never_issued(s) for s in lost)
    store.close()

    shutil.copy(tmp_path / "backup.db", path)                 # restored
    (tmp_path / "state.db-wal").unlink(missing_ok=True)
    (tmp_path / "state.db-shm").unlink(missing_ok=True)
    restored = SqliteStore(path)
    assert all(restored.never_issued(s) for s in lost) and not restored.never_issued(kept)
    fresh = sequence_of(_record(restored))                    # new work moves the mark past them
    assert fresh > max(lost)
    assert all(restored.never_issued(s) for s in lost), "the gap of the restored start is remembered"
    assert not restored.never_issued(fresh) and not restored.never_issued(kept)
    restored.close()
    again = SqliteStore(path)                                 # and survives another restart
    assert all(again.never_issued(s) for s in lost) and not again.never_issued(fresh)
    assert not again.never_issued(kept)
    again.close()




def test_a_node_the_restored_database_does_not_know_takes_no_work_until_its_shares_are_adopted(tmp_path):
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    _record(store)
    store.close()
    _copy(path, tmp_path / "backup.db")
    store = SqliteStore(path)                                 # a later run registered n1 and allocated
    lost = new_id(store.next_sequence())
    store.close()
    shutil.copy(tmp_path / "backup.db", path)                 # restored: n1 and `lost` unknown

    agent = RecordingAgent()
    agent.prepare(agent_pb2.Share(id=lost, kind=common_pb2.SHARE_KIND_FASTPOD, device_uuids=["GPU-0"],
                                  sm_percent=100, memory_bytes=20 * GiB, quota_request=1.0, quota_limit=1.0,
                                  owner="team/lost"))
    store = SqliteStore(path)
    try:
        core = ControllerCore(store, agent)
        reconciler = Reconciler(core)
        reconciler.start()
        _record(store)                                        # the restored controller works on
        core.register_node("n1", "127.0.0.1:1", {})
        placed = core.ledger.place(core.ledger.to_request("fs-x", Spec(Kind.MPS, memory_bytes=GiB)))
        assert not placed and "no record of" in placed.reason, placed   # held out until adopted

        report = reconciler.run_once(["n1"])
        assert report.adopted == [lost] and not report.orphans_freed, report
        adopted = core.get(lost)
        assert adopted.state is State.ACTIVE and adopted.owner == "team/lost"
        assert adopted.spec == Spec(Kind.FASTPOD, sm_percent=100, memory_bytes=20 * GiB, quota_request=1.0,
                                    quota_limit=1.0)
        assert adopted.env["FASTSHARE_ALLOCATION_ID"] == lost and adopted.env["X"] == "1"
        placed = core.ledger.place(core.ledger.to_request("fs-x", Spec(Kind.FASTPOD, sm_percent=10,
                                                                       memory_bytes=GiB)))
        assert not placed and "no record of" not in placed.reason, placed   # the GPU is full, as it is
        assert lost in agent.shares
        core.release(lost)
        assert lost not in agent.shares and core.get(lost).state is State.RELEASED
    finally:
        store.close()


def test_an_adopted_allocation_on_an_over_committed_gpu_is_still_found_by_its_key(tmp_path):
    """The over-commit note the reconciler writes over an adopted record's reason must not make
    the client's retry with the same key a conflict (nor drop it from status's Adopted list)."""
    from fastshare.controller.core import ADOPTED, KeyConflict
    from fastshare.controller.validation import Request

    store = SqliteStore(tmp_path / "state.db")
    agent = RecordingAgent()
    try:
        core = ControllerCore(store, agent)
        reconciler = Reconciler(core)
        reconciler.start()
        core.register_node("n1", "127.0.0.1:1", {})
        reconciler.run_once()
        kept = core.allocate(Request(Spec(Kind.FASTPOD, sm_percent=100, memory_bytes=20 * GiB), owner="old"))
        lost = new_id(store.next_sequence())   # its pending record lost (power loss, or a restored backup)
        agent.prepare(agent_pb2.Share(id=lost, kind=common_pb2.SHARE_KIND_FASTPOD, device_uuids=["GPU-0"],
                                      sm_percent=50, memory_bytes=GiB, quota_request=0.5, quota_limit=1.0,
                                      owner="team/lost", idempotency_key="k-lost"))
        assert reconciler.run_once().adopted == [lost]
        reconciler.run_once()   # the GPU holds 150 % of its SMs: the adopted record is noted over-committed
        adopted = core.get(lost)
        assert core.ledger.over(lost) and adopted.state is State.ACTIVE, adopted
        assert adopted.reason.startswith(ADOPTED), adopted.reason   # status lists it under Adopted
        try:
            again = core.allocate(Request(Spec(Kind.FASTPOD, sm_percent=50, memory_bytes=GiB, models=("L4",)),
                                          owner="team/lost", idempotency_key="k-lost"))
        except KeyConflict as exc:
            raise AssertionError(f"the retry of the adopted allocation was refused: {exc}") from None
        assert again.id == lost and kept.id != lost
        assert "over-committed: " in adopted.reason
        core.release(kept.id)
        reconciler.run_once()   # the GPU takes it again: the note goes, the adoption's reason stays
        assert not core.ledger.over(lost) and core.get(lost).reason.startswith(ADOPTED)
        assert "over-committed" not in core.get(lost).reason
    finally:
        store.close()
