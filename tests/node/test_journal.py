"""The node agent's journal on a real SQLite file: every write is what a restarted agent reads
back, the rows kept in memory say the same as the file, and the per-device index that capacity
checks read follows every change of a share."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fastshare.node.journal import SCHEMA_VERSION, Journal, JournalError, LostShare, MigRow, MpsRow
from fastshare.node.model import Prepared, ShareSpec
from fastshare.sqlite_file import StateFileError


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "journal.db"


@pytest.fixture
def journal(path: Path):
    j = Journal(path)
    yield j
    j.close()


def _spec(share_id: str, *devices: str, kind: str = "mps") -> ShareSpec:
    return ShareSpec(id=share_id, kind=kind, device_uuids=devices or ("GPU-a",), memory_bytes=1 << 30,
                     owner="ns/pod")


def _prepared(device: str, port: int = 0) -> Prepared:
    return Prepared(env={"CUDA_VISIBLE_DEVICES": device}, host_paths={"/run/x": "/x"},
                    device_uuids=(device,), port=port)


def _reopened(path: Path) -> Journal:
    """What an agent restarted on the same file reads."""
    return Journal(path)


def _same_on_disk(journal: Journal, path: Path) -> None:
    again = _reopened(path)
    try:
        assert again.shares() == journal.shares()
        assert again.lost_shares() == journal.lost_shares()
        assert again.mps_daemons() == journal.mps_daemons()
        assert again.migs() == journal.migs()
        assert again.leader_term() == journal.leader_term()
        for row in journal.shares():
            for device in {row.device_uuid, *row.spec.device_uuids}:
                assert again.shares_on(device) == journal.shares_on(device)
    finally:
        again.close()


# shares ---------------------------------------------------------------------------------------

def test_a_share_goes_through_its_states_and_every_step_is_on_disk(journal, path):
    spec = _spec("s1", "GPU-a", kind="exclusive")
    journal.begin_share(spec, "GPU-a", None)
    row = journal.share("s1")
    assert (row.spec, row.state, row.device_uuid, row.port, row.prepared) == (spec, "preparing", "GPU-a",
                                                                               None, None)
    _same_on_disk(journal, path)

    journal.share_ready("s1", "MIG-x", _prepared("MIG-x"))       # lives on the instance made for it
    row = journal.share("s1")
    assert (row.state, row.device_uuid, row.prepared) == ("ready", "MIG-x", _prepared("MIG-x"))
    assert row.spec == spec
    _same_on_disk(journal, path)

    journal.set_share_state("s1", "releasing")
    assert journal.share("s1").state == "releasing" and journal.share("s1").prepared == _prepared("MIG-x")
    _same_on_disk(journal, path)

    journal.set_share_device("s1", "MIG-y")
    assert (journal.share("s1").device_uuid, journal.share("s1").state) == ("MIG-y", "releasing")
    _same_on_disk(journal, path)

    journal.delete_share("s1")
    assert journal.share("s1") is None and journal.shares() == []
    _same_on_disk(journal, path)


def test_a_share_prepared_in_one_commit_is_ready_with_its_port(journal, path):
    spec = _spec("fp", "GPU-a", kind="fastpod")
    journal.insert_ready_share(spec, "GPU-a", 30001, _prepared("GPU-a", 30001))
    row = journal.share("fp")
    assert (row.spec, row.state, row.device_uuid, row.port, row.prepared) == (
        spec, "ready", "GPU-a", 30001, _prepared("GPU-a", 30001))
    journal.begin_share(_spec("mp", "GPU-a"), "GPU-a", 30002)
    assert journal.share("mp").port == 30002
    _same_on_disk(journal, path)


def test_a_share_id_is_journaled_once(journal):
    journal.begin_share(_spec("s1"), "GPU-a", None)
    with pytest.raises(sqlite3.IntegrityError):
        journal.insert_ready_share(_spec("s1"), "GPU-a", None, _prepared("GPU-a"))
    assert [r.state for r in journal.shares()] == ["preparing"]


def test_updating_a_share_that_is_not_journaled_changes_nothing(journal, path):
    journal.share_ready("ghost", "GPU-a", _prepared("GPU-a"))
    journal.set_share_state("ghost", "releasing")
    journal.set_share_device("ghost", "GPU-b")
    journal.delete_share("ghost")
    assert journal.share("ghost") is None and journal.shares() == [] and journal.shares_on("GPU-a") == []
    _same_on_disk(journal, path)


def test_shares_come_sorted_by_id(journal, path):
    for share_id in ("c", "a", "b"):
        journal.begin_share(_spec(share_id), "GPU-a", None)
    assert [r.spec.id for r in journal.shares()] == ["a", "b", "c"]
    assert [r.spec.id for r in journal.shares_on("GPU-a")] == ["a", "b", "c"]
    journal.close()
    again = _reopened(path)
    assert [r.spec.id for r in again.shares()] == ["a", "b", "c"]
    assert [r.spec.id for r in again.shares_on("GPU-a")] == ["a", "b", "c"]
    again.close()


def test_the_device_index_follows_every_change(journal, path):
    """shares_on: the shares that hold a device, where they live or among the devices they asked for."""
    journal.begin_share(_spec("x", "GPU-a", "GPU-b"), "GPU-a", None)
    journal.begin_share(_spec("y", "GPU-a"), "GPU-a", None)
    assert [r.spec.id for r in journal.shares_on("GPU-a")] == ["x", "y"]
    assert [r.spec.id for r in journal.shares_on("GPU-b")] == ["x"]
    assert journal.shares_on("GPU-c") == []

    journal.share_ready("y", "MIG-1", _prepared("MIG-1"))   # y now also holds its MIG device
    assert [r.spec.id for r in journal.shares_on("MIG-1")] == ["y"]
    assert [r.spec.id for r in journal.shares_on("GPU-a")] == ["x", "y"]   # asked for
    assert journal.shares_on("MIG-1")[0].state == "ready"

    journal.set_share_device("y", "MIG-2")
    assert journal.shares_on("MIG-1") == [] and [r.spec.id for r in journal.shares_on("MIG-2")] == ["y"]
    _same_on_disk(journal, path)

    journal.delete_share("x")                  # y still holds GPU-a
    assert [r.spec.id for r in journal.shares_on("GPU-a")] == ["y"] and journal.shares_on("GPU-b") == []
    journal.delete_share("y")
    assert journal.shares_on("GPU-a") == [] and journal.shares_on("MIG-2") == []
    assert journal.shares() == []


def test_the_device_index_is_rebuilt_at_start(journal, path):
    journal.begin_share(_spec("x", "GPU-a", "GPU-b"), "MIG-1", None)
    journal.close()
    again = _reopened(path)
    try:
        for device in ("GPU-a", "GPU-b", "MIG-1"):
            assert [r.spec.id for r in again.shares_on(device)] == ["x"], device
        again.delete_share("x")
        assert all(again.shares_on(d) == [] for d in ("GPU-a", "GPU-b", "MIG-1"))
    finally:
        again.close()


# lost shares ---------------------------------------------------------------------------------

def test_a_lost_share_is_kept_until_forgotten(journal, path):
    assert journal.forget_lost("s1") is False
    journal.lose_share(LostShare("s2", "GPU-b", "GPU fell off the bus", "ns/b"))
    journal.lose_share(LostShare("s1", "MIG-a", "MIG device destroyed", "ns/a"))
    assert journal.lost_shares() == [LostShare("s1", "MIG-a", "MIG device destroyed", "ns/a"),
                                     LostShare("s2", "GPU-b", "GPU fell off the bus", "ns/b")]
    _same_on_disk(journal, path)

    journal.lose_share(LostShare("s1", "GPU-a", "GPU swapped", "ns/a2"))   # lost again: the latest
    assert journal.lost_shares()[0] == LostShare("s1", "GPU-a", "GPU swapped", "ns/a2")
    assert len(journal.lost_shares()) == 2
    _same_on_disk(journal, path)

    assert journal.forget_lost("s1") is True
    assert journal.forget_lost("s1") is False
    assert [lost.id for lost in journal.lost_shares()] == ["s2"]
    _same_on_disk(journal, path)
    journal.close()

    again = _reopened(path)   # a restarted agent still knows it by its id, until released
    assert again.forget_lost("s2") is True and again.lost_shares() == []
    again.close()


# MIG instances -------------------------------------------------------------------------------

def test_mig_instances_through_their_states(journal, path):
    journal.begin_mig("GPU-b", 4, 9, "s1", "share")
    journal.begin_mig("GPU-a", 0, 19, None, "layout")
    journal.begin_mig("GPU-b", 0, 19, None, "layout")
    assert journal.migs() == [MigRow("GPU-a", 0, 19, None, "creating", None, "layout"),
                              MigRow("GPU-b", 0, 19, None, "creating", None, "layout"),
                              MigRow("GPU-b", 4, 9, None, "creating", "s1", "share")]
    assert journal.migs("GPU-a") == [MigRow("GPU-a", 0, 19, None, "creating", None, "layout")]
    assert journal.migs("GPU-c") == []

    journal.mig_ready("GPU-b", 4, "MIG-4")
    journal.set_mig_state("GPU-b", 0, "destroying")
    journal.set_mig_share("GPU-a", 0, "s2")
    assert journal.migs() == [MigRow("GPU-a", 0, 19, None, "creating", "s2", "layout"),
                              MigRow("GPU-b", 0, 19, None, "destroying", None, "layout"),
                              MigRow("GPU-b", 4, 9, "MIG-4", "ready", "s1", "share")]
    journal.set_mig_share("GPU-a", 0, None)
    assert journal.migs("GPU-a")[0].share_id is None
    _same_on_disk(journal, path)

    journal.delete_mig("GPU-b", 0)
    assert [(m.gpu_uuid, m.start) for m in journal.migs()] == [("GPU-a", 0), ("GPU-b", 4)]
    _same_on_disk(journal, path)


# MPS daemons ---------------------------------------------------------------------------------

def test_an_mps_daemon_row_through_its_states(journal, path):
    journal.begin_mps("MIG-1", "GPU-a")
    journal.begin_mps("GPU-b", "GPU-b")
    assert journal.mps("MIG-1") == MpsRow("MIG-1", "GPU-a", "starting", None, False, None, None)
    assert [r.device_uuid for r in journal.mps_daemons()] == ["GPU-b", "MIG-1"]

    journal.update_mps("MIG-1", state="running", pid=77, sm_ceiling=30.5, mem_ceiling=1 << 20)
    assert journal.mps("MIG-1") == MpsRow("MIG-1", "GPU-a", "running", 77, False, 30.5, 1 << 20)
    journal.update_mps("GPU-b", compute_mode_set=1)
    journal.update_mps("GPU-b", state="running", pid=4242, sm_ceiling=50, mem_ceiling=1 << 30)
    row = journal.mps("GPU-b")
    assert row == MpsRow("GPU-b", "GPU-b", "running", 4242, True, 50.0, 1 << 30)
    assert isinstance(row.sm_ceiling, float) and row.compute_mode_set is True   # as a restart reads them
    _same_on_disk(journal, path)

    # Started again (after a crash): the switched compute mode is still remembered, to be undone.
    journal.begin_mps("GPU-b", "GPU-b")
    assert journal.mps("GPU-b") == MpsRow("GPU-b", "GPU-b", "starting", 4242, True, 50.0, 1 << 30)
    _same_on_disk(journal, path)

    journal.update_mps("GPU-b", compute_mode_set=0)   # switched back
    assert journal.mps("GPU-b").compute_mode_set is False
    _same_on_disk(journal, path)

    journal.delete_mps("GPU-b")
    assert journal.mps("GPU-b") is None and [r.device_uuid for r in journal.mps_daemons()] == ["MIG-1"]
    _same_on_disk(journal, path)


@pytest.mark.parametrize("fields", [{}, {"gpu_uuid": "GPU-x"}, {"state": "running", "updated": 0}])
def test_update_mps_takes_only_the_daemon_fields(journal, fields):
    journal.begin_mps("GPU-b", "GPU-b")
    with pytest.raises(ValueError) as caught:
        journal.update_mps("GPU-b", **fields)
    assert str(caught.value) == ("update_mps fields must be among ['compute_mode_set', 'mem_ceiling', "
                                 "'pid', 'sm_ceiling', 'state']")
    assert journal.mps("GPU-b").state == "starting"


# leader term and schema -----------------------------------------------------------------------

def test_the_leader_term_only_rises_and_survives_a_restart(journal, path):
    assert journal.leader_term() is None
    journal.raise_leader_term(5)
    journal.raise_leader_term(3)
    assert journal.leader_term() == 5
    journal.raise_leader_term(6)
    assert journal.leader_term() == 6
    journal.close()
    again = _reopened(path)
    assert again.leader_term() == 6
    again.close()


def test_the_schema_version_is_written_and_a_newer_one_refused(journal, path):
    journal.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 1   # what older agents read
    db.execute("PRAGMA user_version=2")
    db.close()
    with pytest.raises(JournalError) as caught:
        Journal(path)
    assert str(caught.value) == (f"{path} has schema version 2, newer than this agent (1); upgrade the "
                                 "agent or move the journal away")


def test_a_path_given_as_text_is_the_same_journal(journal, path):
    journal.begin_share(_spec("s1"), "GPU-a", None)
    journal.close()
    again = Journal(str(path))
    assert [r.spec.id for r in again.shares()] == ["s1"]
    again.close()


def test_a_closed_journal_is_whole_in_its_one_file(journal, path, tmp_path):
    """After close nothing is left in the WAL file: a copy of journal.db alone (a backup of a
    stopped agent's state) holds every row."""
    journal.begin_share(_spec("s1"), "GPU-a", None)
    journal.raise_leader_term(3)
    journal.close()
    assert not Path(f"{path}-wal").exists()
    copy = tmp_path / "copy" / "journal.db"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    again = Journal(copy)
    assert [r.spec.id for r in again.shares()] == ["s1"] and again.leader_term() == 3
    again.close()


def test_a_damaged_journal_is_refused_naming_it_and_what_moving_it_away_loses(path):
    path.write_bytes(b"not a database at all" * 200)
    with pytest.raises(StateFileError) as caught:
        Journal(path)
    assert str(caught.value).startswith(f"node agent journal {path} is damaged (")
    assert str(caught.value).endswith("or move it away to start empty (the agent forgets which shares, MIG "
                                      "instances and MPS daemons it made and never cleans them up)")
    assert path.read_bytes() == b"not a database at all" * 200


def test_every_write_is_covered_by_the_next_barrier(journal):
    """sync() flushes once for whatever was committed since the last one (the new file's schema
    too), and not at all when nothing was."""
    flushes = journal._group.syncs
    journal.sync()
    assert journal._group.syncs == flushes + 1
    writes = (lambda: journal.begin_share(_spec("s1"), "GPU-a", None),
              lambda: journal.lose_share(LostShare("s0", "GPU-a", "gone", "")),
              lambda: journal.begin_mig("GPU-a", 0, 19, None, "layout"),
              lambda: journal.begin_mps("GPU-a", "GPU-a"),
              lambda: journal.raise_leader_term(1))
    for write in writes:
        flushes = journal._group.syncs
        write()
        journal.sync()
        journal.sync()
        assert journal._group.syncs == flushes + 1


def test_rows_handed_out_cannot_be_altered(journal):
    """The rows are the journal's cached ones, shared with every caller."""
    journal.begin_share(_spec("s1"), "GPU-a", None)
    journal.begin_mps("GPU-a", "GPU-a")
    journal.lose_share(LostShare("s0", "GPU-a", "gone", ""))
    journal.begin_mig("GPU-a", 0, 19, None, "layout")
    for row in (journal.share("s1"), journal.mps("GPU-a"), journal.lost_shares()[0], journal.migs()[0]):
        with pytest.raises(AttributeError):
            row.state = "ready"   # type: ignore[misc]
