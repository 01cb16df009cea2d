"""SQLite state store: durability across reopen, CAS transitions, idempotency keys, schema."""

import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastshare.controller.model import Allocation, Device, Gpu, Kind, Node, Spec, State
from fastshare.controller.sqlite_store import SCHEMA_VERSION, SqliteStore
from fastshare.controller.store import Conflict, DuplicateKey, StoreError


def _alloc(i: str, key: str = "", state: State = State.PENDING, node: str = "n1") -> Allocation:
    now = time.time()
    return Allocation(id=i, spec=Spec(kind=Kind.FASTPOD, sm_percent=30, memory_bytes=2**30,
                                      models=("*A100*",), node_selector=(("zone", "a"),)),
                      owner="alice", state=state, node=node, idempotency_key=key,
                      devices=[Device(gpu_index=0, gpu_uuid="GPU-1", model="A100")],
                      assignment={"gpu": 0, "sm": 30}, created_at=now, updated_at=now)


@pytest.fixture
def store(tmp_path):
    s = SqliteStore(tmp_path / "state.db")
    yield s
    s.close()


def test_wal_mode_and_schema_version(store):
    assert store.schema_version() == SCHEMA_VERSION
    db = sqlite3.connect(store.path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_newer_schema_is_refused(tmp_path):
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="schema version"):
        SqliteStore(tmp_path / "state.db")


def test_allocation_round_trip_survives_reopen(tmp_path):
    s = SqliteStore(tmp_path / "state.db")
    a = _alloc("a1", key="k1")
    s.create_allocation(a)
    s.close()
    s = SqliteStore(tmp_path / "state.db")
    got = s.get_allocation("a1")
    assert got == a
    assert s.find_by_key("k1").id == "a1"


def test_commit_survives_kill_9_of_the_writer(tmp_path):
    code = (f"from fastshare.controller.sqlite_store import SqliteStore\n"
            f"from tests.controller.test_store import _alloc\n"
            f"s = SqliteStore({str(tmp_path / 'state.db')!r})\n"
            f"s.create_allocation(_alloc('a1'))\n"
            f"s.transition('a1', ['pending'], 'active')\n"
            f"import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(__import__("pathlib").Path(__file__)
                                                                 .parents[2]))
    assert proc.returncode == -9
    s = SqliteStore(tmp_path / "state.db")
    assert s.get_allocation("a1").state is State.ACTIVE


def test_duplicate_idempotency_key_returns_existing(store):
    store.create_allocation(_alloc("a1", key="same"))
    with pytest.raises(DuplicateKey) as exc:
        store.create_allocation(_alloc("a2", key="same"))
    assert exc.value.existing.id == "a1"
    assert store.get_allocation("a2") is None


def test_empty_keys_do_not_collide(store):
    store.create_allocation(_alloc("a1"))
    store.create_allocation(_alloc("a2"))
    assert len(store.list_allocations()) == 2


def test_transition_is_compare_and_set(store):
    store.create_allocation(_alloc("a1"))
    got = store.transition("a1", [State.PENDING], State.PREPARED, env={"X": "1"})
    assert got.state is State.PREPARED and got.env == {"X": "1"}
    with pytest.raises(Conflict, match="is prepared"):
        store.transition("a1", [State.PENDING], State.ACTIVE)
    with pytest.raises(Conflict, match="missing"):
        store.transition("nope", [State.PENDING], State.ACTIVE)
    assert store.get_allocation("a1").state is State.PREPARED


def test_immutable_fields_cannot_change(store):
    store.create_allocation(_alloc("a1"))
    with pytest.raises(StoreError, match="owner"):
        store.update("a1", owner="mallory")


def test_list_filters_by_state_and_node(store):
    store.create_allocation(_alloc("a1", node="n1"))
    store.create_allocation(_alloc("a2", node="n2", state=State.ACTIVE))
    store.create_allocation(_alloc("a3", node="n2", state=State.RELEASED))
    assert [a.id for a in store.list_allocations([State.ACTIVE, State.PENDING])] == ["a1", "a2"]
    assert [a.id for a in store.list_allocations(node="n2")] == ["a2", "a3"]


def test_a_version_1_state_file_is_migrated_keeping_its_rows(tmp_path):
    from fastshare.controller.sqlite_store import _MIGRATIONS

    db = sqlite3.connect(tmp_path / "state.db")
    db.executescript(_MIGRATIONS[1])
    db.execute("INSERT INTO nodes VALUES ('n1', 'h:1', '{}', '{}', 1, 2.0, 1.0)")
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    s = SqliteStore(tmp_path / "state.db")
    assert s.schema_version() == SCHEMA_VERSION
    node = s.get_node("n1")
    assert (node.address, node.cordoned, node.cordon_reason) == ("h:1", False, "")
    s.close()


def test_cordon_survives_reopen(tmp_path):
    s = SqliteStore(tmp_path / "state.db")
    s.put_node(Node(name="n1", address="h:1", cordoned=True, cordon_reason="MIG change"))
    s.close()
    s = SqliteStore(tmp_path / "state.db")
    assert (s.get_node("n1").cordoned, s.get_node("n1").cordon_reason) == (True, "MIG change")
    s.close()


def test_nodes_with_gpus(store):
    node = Node(name="n1", address="127.0.0.1:1", labels={"zone": "a"},
                gpus=[Gpu(0, "GPU-a", "NVIDIA A100-SXM4-40GB", 40 * 2**30, 108, True, True,
                          mig_unheld=((9, 0, 4), (19, 6, 1)), mig_change_pending=True),
                      Gpu(1, "GPU-b", "NVIDIA L4", 22 * 2**30, 58, lost="GPU_IS_LOST")],
                available=True, last_heartbeat=5.0, registered_at=4.0, inventory={"x": [1]})
    store.put_node(node)
    assert store.get_node("n1") == node
    node.gpus = node.gpus[:1]
    store.put_node(node)
    assert len(store.get_node("n1").gpus) == 1
    store.mark_node("n1", available=False)
    got = store.get_node("n1")
    assert not got.available and got.last_heartbeat == 5.0
    assert [n.name for n in store.list_nodes()] == ["n1"]


class _PausedBeforeGpus:
    """The listing connection, paused once the nodes are read and before their GPUs are."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection, self.reading, self.go_on = connection, threading.Event(), threading.Event()

    def execute(self, query: str, *params):
        if "FROM gpus" in query:
            self.reading.set()
            assert self.go_on.wait(10)
        return self.connection.execute(query, *params)

    def close(self) -> None:
        self.connection.close()


def test_a_listing_holds_up_no_write_and_reads_one_snapshot(store):
    """A listing of a large cluster takes a while (up to a second at 10,000 nodes under load):
    writes (every Allocate, every heartbeat) must not wait for it, and it must still be the
    cluster at one moment, each node with its own GPUs."""
    def node(name: str) -> Node:
        return Node(name=name, address="127.0.0.1:1", labels={}, available=True, last_heartbeat=1.0,
                    registered_at=1.0, inventory={},
                    gpus=[Gpu(i, f"GPU-{name}-{i}", "NVIDIA L4", 22 * 2**30, 58) for i in range(2)])

    for name in ("n0", "n1", "n2"):
        store.put_node(node(name))
    store._reader = paused = _PausedBeforeGpus(store._reader)
    listed: dict[str, list[Node]] = {}
    listing = threading.Thread(target=lambda: listed.update(nodes=store.list_nodes()))
    listing.start()
    assert paused.reading.wait(10)
    began = time.monotonic()
    store.delete_node("n1")
    store.put_node(node("n9"))
    store.mark_node("n0", available=False)
    store.create_allocation(_alloc("a1", node="n0"))
    assert time.monotonic() - began < 5, "the writes waited for the listing"
    paused.go_on.set()
    listing.join(10)
    assert [(n.name, len(n.gpus), n.available) for n in listed["nodes"]] == [
        ("n0", 2, True), ("n1", 2, True), ("n2", 2, True)]
    assert [(n.name, len(n.gpus), n.available) for n in store.list_nodes()] == [
        ("n0", 2, False), ("n2", 2, True), ("n9", 2, True)]
    assert [a.id for a in store.list_allocations()] == ["a1"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(list(State)), min_size=1, max_size=12))
def test_cas_follows_only_expected_states(tmp_path_factory, moves):
    """Any sequence of CAS attempts leaves the row in the state of the last successful one."""
    s = SqliteStore(tmp_path_factory.mktemp("s") / "state.db")
    s.create_allocation(_alloc("a1"))
    current = State.PENDING
    for target in moves:
        expected = [current] if target != current else [State.RELEASED]
        try:
            s.transition("a1", expected, target)
            current = target
        except Conflict:
            assert expected == [State.RELEASED] and current != State.RELEASED
    assert s.get_allocation("a1").state is current
    s.close()


def test_serve_refuses_a_newer_state_file_without_a_traceback(tmp_path, monkeypatch):
    """After a downgrade: StoreError is none of the errors `controller serve` turned into a
    message, so the operator got a traceback."""
    import sqlite3

    # run in this process: it must not take the servers' interpreter settings for the session
    monkeypatch.setattr("fastshare.server_runtime.settle_startup", lambda: None)

    from click.testing import CliRunner

    from fastshare.cli import main
    from fastshare.security import certs

    certs.init_ca(tmp_path / "ca")
    certs.issue(tmp_path / "ca", "controller", tmp_path / "pki", role="controller")
    (tmp_path / "state").mkdir()
    db = sqlite3.connect(tmp_path / "state" / "state.db")
    db.execute("PRAGMA user_version = 99")
    db.close()
    result = CliRunner().invoke(main, ["controller", "serve", "--state-dir", str(tmp_path / "state"),
                                       "--tls-dir", str(tmp_path / "pki"), "--listen", "127.0.0.1:0"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "has schema version 99, this fastshare knows up to" in result.output


def test_a_version_5_state_file_is_migrated_and_its_away_nodes_judged_from_then_on(tmp_path):
    """A state.db from before the nodes' start marks were kept opens; its nodes not reached since
    are judged as at that first start, also after a restart."""
    from fastshare.controller.core import new_id
    from fastshare.controller.sqlite_store import _MIGRATIONS

    db = sqlite3.connect(tmp_path / "state.db")
    for version in range(1, 6):
        db.executescript(_MIGRATIONS[version])
    db.execute("INSERT INTO nodes (name, address, labels, inventory, available, last_heartbeat, "
               "registered_at) VALUES ('n1', 'h:1', '{}', '{}', 1, 2.0, 1.0)")
    db.execute("PRAGMA user_version = 5")
    db.commit()
    db.close()
    lost = (time.time_ns() // 1000) + 3600 * 10**6
    s = SqliteStore(tmp_path / "state.db")
    assert s.schema_version() == SCHEMA_VERSION and s.get_node("n1").address == "h:1"
    s.create_allocation(_alloc(new_id(lost + 10)))   # numbering passed the share n1 holds
    s.close()
    s = SqliteStore(tmp_path / "state.db")
    try:
        assert not s.never_issued(lost)
        s.saw([lost], first_of="n1")
        assert s.never_issued(lost)
    finally:
        s.close()


def test_a_version_6_state_file_is_migrated_its_gpus_without_a_pending_mig_change(tmp_path):
    """A state.db from before GPUs kept whether a MIG mode change waits for a reset opens, its GPUs
    read as without one (the agent's next inventory says), and the mark is kept from then on."""
    from fastshare.controller.sqlite_store import _MIGRATIONS

    db = sqlite3.connect(tmp_path / "state.db")
    for version in range(1, 7):
        db.executescript(_MIGRATIONS[version])
    db.execute("INSERT INTO nodes (name, address, labels, inventory, available, last_heartbeat, "
               "registered_at) VALUES ('n1', 'h:1', '{}', '{}', 1, 2.0, 1.0)")
    db.execute("INSERT INTO gpus (node, idx, uuid, model, memory_bytes, sm_count, mig_capable, mig_enabled, "
               "mig_unheld) VALUES ('n1', 0, 'GPU-a', 'A100-SXM4-40GB', 42949672960, 108, 1, 0, '[]')")
    db.execute("PRAGMA user_version = 6")
    db.commit()
    db.close()
    s = SqliteStore(tmp_path / "state.db")
    try:
        assert s.schema_version() == SCHEMA_VERSION
        node = s.get_node("n1")
        assert [(g.uuid, g.mig_change_pending) for g in node.gpus] == [("GPU-a", False)]
        node.gpus = [replace(node.gpus[0], mig_change_pending=True)]
        s.put_node(node)
        assert s.get_node("n1").gpus[0].mig_change_pending
    finally:
        s.close()
