"""SQLite state of record for the standalone controller.

WAL mode, one connection used by one writer at a time (a lock), schema versioned through
``PRAGMA user_version`` with forward-only migrations.

Durability: ``synchronous=NORMAL`` plus a group-commit barrier (:meth:`SqliteStore.sync`,
:class:`fastshare.sqlite_file.GroupSync`) that the API runs before it answers.
- kill -9 of the controller: every commit survives as soon as COMMIT returns (it is in the
  WAL file); the crash tests cover each step of allocate and release.
- power loss / OS crash: only commits made after the last barrier can be lost. A lost
  commit leaves what a kill -9 just before it leaves, which the reconciler finishes: a lost
  ``pending`` record leaves the agent a share whose number this database never issued: it is
  adopted, not freed (it cannot be told from a share a restored backup lost, see
  ``ControllerCore.adopt``), with the idempotency key and lease the share carries: the
  client, never answered, retries with its key and gets that allocation; an abandoned one's
  lease expires (one without a lease is held until released); a
  lost ``active`` step leaves ``pending``, prepared again (idempotent by share id: the
  agent, which syncs before it answers, hands back the same share); a lost ``released``
  step leaves ``releasing``, released again (idempotent); a lost ``releasing`` leaves the
  allocation ``active`` with its share gone, prepared again.
- what was acknowledged is never lost: an answer waits for the barrier, except that
  Allocate and Release wait only for their first commit (``pending``, ``releasing``: the
  intent, flushed while the agent works), because losing the later step only makes the
  reconciler redo it to the same end (see ``ControllerCore.allocate``). An Allocate
  answered ``active`` cannot come back as released or vanish; a released one cannot come
  back as active.
The barrier replaces one fsync per commit under the connection lock (``synchronous=FULL``)
with one fdatasync shared by every request that committed meanwhile.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fastshare.controller.model import Allocation, Device, Gpu, Node, Spec, State, sequence_of
from fastshare.controller.store import Conflict, DuplicateKey, StateStore, StoreError
from fastshare.sqlite_file import GroupSync, open_state_file

log = logging.getLogger("fastshare.controller")

SCHEMA_VERSION = 7

_MIGRATIONS: dict[int, str] = {
    1: """
    CREATE TABLE nodes (
        name TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        labels TEXT NOT NULL,
        inventory TEXT NOT NULL,
        available INTEGER NOT NULL,
        last_heartbeat REAL NOT NULL,
        registered_at REAL NOT NULL
    );
    CREATE TABLE gpus (
        node TEXT NOT NULL REFERENCES nodes(name) ON DELETE CASCADE,
        idx INTEGER NOT NULL,
        uuid TEXT NOT NULL,
        model TEXT NOT NULL,
        memory_bytes INTEGER NOT NULL,
        sm_count INTEGER NOT NULL,
        mig_capable INTEGER NOT NULL,
        mig_enabled INTEGER NOT NULL,
        PRIMARY KEY (node, idx)
    );
    CREATE TABLE allocations (
        id TEXT PRIMARY KEY,
        idempotency_key TEXT UNIQUE,
        owner TEXT NOT NULL,
        kind TEXT NOT NULL,
        spec TEXT NOT NULL,
        state TEXT NOT NULL,
        node TEXT NOT NULL,
        devices TEXT NOT NULL,
        env TEXT NOT NULL,
        reason TEXT NOT NULL,
        assignment TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        lease_ttl INTEGER NOT NULL,
        lease_expires_at REAL NOT NULL
    );
    CREATE INDEX allocations_state ON allocations(state);
    CREATE INDEX allocations_node ON allocations(node);
    """,
    2: """
    ALTER TABLE nodes ADD COLUMN cordoned INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE nodes ADD COLUMN cordon_reason TEXT NOT NULL DEFAULT ''
    """,
    3: """
    ALTER TABLE gpus ADD COLUMN mig_unheld TEXT NOT NULL DEFAULT '[]'
    """,
    # The allocation sequence's high-water mark (the highest number a recorded allocation had),
    # and the numbers no controller issued: each process numbers from the clock on, skipping
    # (mark, its first number) and up to the numbers it sees on agents. See ``SqliteStore.never_issued``.
    4: """
    CREATE TABLE sequence (id INTEGER PRIMARY KEY CHECK (id = 1), mark INTEGER NOT NULL);
    INSERT INTO sequence (id, mark) VALUES (1, 0);
    CREATE TABLE sequence_gaps (after INTEGER NOT NULL, before INTEGER NOT NULL)
    """,
    5: """
    ALTER TABLE gpus ADD COLUMN lost TEXT NOT NULL DEFAULT ''
    """,
    # The nodes not reached since a start, with the mark of the earliest such start: what their
    # first inventory is judged against (see ``SqliteStore.saw``), also after restarts meanwhile.
    6: """
    CREATE TABLE unreached_nodes (node TEXT PRIMARY KEY, mark INTEGER NOT NULL)
    """,
    # A GPU's MIG mode change waiting for a GPU reset (it takes no new shares until then).
    7: """
    ALTER TABLE gpus ADD COLUMN mig_change_pending INTEGER NOT NULL DEFAULT 0
    """,
}

_JSON_FIELDS = {"devices", "env", "assignment", "spec"}
_COLUMNS = ("id", "idempotency_key", "owner", "kind", "spec", "state", "node", "devices", "env",
            "reason", "assignment", "created_at", "updated_at", "lease_ttl", "lease_expires_at")
_MUTABLE = set(_COLUMNS) - {"id", "idempotency_key", "owner", "kind", "spec", "created_at"}


def _when(sequence: int) -> str:
    """A sequence number (the clock in microseconds) as a UTC time."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(sequence / 1e6))


def _encode(name: str, value: Any) -> Any:
    if name == "spec":
        return json.dumps(value.to_json(), sort_keys=True)
    if name == "devices":
        return json.dumps([d.to_json() for d in value])
    if name in _JSON_FIELDS:
        return json.dumps(value, sort_keys=True)
    if name == "state":
        return State(value).value
    if name == "idempotency_key":
        return value or None
    return value


def _allocation(row: sqlite3.Row) -> Allocation:
    return Allocation(
        id=row["id"], spec=Spec.from_json(json.loads(row["spec"])), owner=row["owner"],
        state=State(row["state"]), node=row["node"], idempotency_key=row["idempotency_key"] or "",
        devices=[Device(**d) for d in json.loads(row["devices"])], env=json.loads(row["env"]),
        reason=row["reason"], assignment=json.loads(row["assignment"]),
        created_at=row["created_at"], updated_at=row["updated_at"], lease_ttl=row["lease_ttl"],
        lease_expires_at=row["lease_expires_at"])


def _mig_unheld(text: str) -> tuple[tuple[int, ...], ...]:
    """Nearly every GPU has none: a listing of 10,000 nodes decoded 40,000 empty lists (0.1 s)."""
    return () if text == "[]" else tuple(tuple(i) for i in json.loads(text))


def _node(row: sqlite3.Row, gpu_rows: list[sqlite3.Row]) -> Node:
    gpus = [Gpu(index=g["idx"], uuid=g["uuid"], model=g["model"], memory_bytes=g["memory_bytes"],
                sm_count=g["sm_count"], mig_capable=bool(g["mig_capable"]),
                mig_enabled=bool(g["mig_enabled"]),
                mig_unheld=_mig_unheld(g["mig_unheld"]), lost=g["lost"],
                mig_change_pending=bool(g["mig_change_pending"]))
            for g in gpu_rows]
    return Node(name=row["name"], address=row["address"], labels=json.loads(row["labels"]),
                gpus=gpus, available=bool(row["available"]), last_heartbeat=row["last_heartbeat"],
                registered_at=row["registered_at"], inventory=json.loads(row["inventory"]),
                cordoned=bool(row["cordoned"]), cordon_reason=row["cordon_reason"])


class SqliteStore(StateStore):
    """The standalone controller's state of record (one file in the state directory)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = open_state_file(self.path, synchronous="NORMAL", what="controller state",
                                   recovery="the controller forgets every allocation and node")
        self._db.row_factory = sqlite3.Row
        self._group = GroupSync(self.path, self._db)
        self._migrate()
        self._mark: int = self._db.execute("SELECT mark FROM sequence").fetchone()[0]
        self._gaps = [tuple(r) for r in self._db.execute("SELECT after, before FROM sequence_gaps")]
        self._start_mark = self._mark   # what this database had issued when this process started
        # Every known node is judged, when first reached, against the mark of the earliest start
        # since which it was not reached: this one's, unless one before it left it unreached.
        self._db.execute("INSERT OR IGNORE INTO unreached_nodes (node, mark) SELECT name, ? FROM nodes",
                         (self._mark,))
        self._group.committed()
        self._unreached: dict[str, int] = dict(self._db.execute("SELECT node, mark FROM unreached_nodes"))
        # Listings read on a connection of their own. SQLite hands a query's rows over one at a
        # time, letting go of the GIL between them, so under load a listing of 10,000 nodes took
        # up to a second; on the writer's connection every Allocate and heartbeat waited behind
        # it. In WAL mode a read on another connection sees one committed snapshot and never
        # holds up the writer, which commits every change before it lets go of its lock.
        self._reader = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._reader.execute("PRAGMA query_only=ON")
        self._reader.row_factory = sqlite3.Row
        self._read_lock = threading.Lock()
        # This process numbers from the clock on; the numbers it skips (from the mark to its first
        # one, and past the shares it sees, see ``saw``) are gaps, written with the next record.
        clock = time.time_ns() // 1000
        self._issued = max(self._mark, clock - 1)   # the last number issued (or skipped)
        self._pending: list[tuple[int, int]] = []
        if self._issued > self._mark:
            self._pending.append((self._mark, self._issued + 1))
        if clock <= self._mark:
            log.warning("%s: the clock (%s) is behind the highest allocation number this database "
                        "recorded (%d, from the clock at %s): new numbers go on from it. If the clock was "
                        "stepped back, or this database restored onto a host whose clock is behind, "
                        "shares allocated after the backup may carry numbers this controller issues too: "
                        "one on a node it knows but cannot reach now is still adopted when the node is "
                        "back (also after a restart), but one on a node this database does not know "
                        "(registered after the backup) is taken for an orphan and freed under its workload "
                        "if the controller restarts before that node is back. Set the clock right (NTP), "
                        "and do not restart the controller until every node is back",
                        self.path, _when(clock), self._mark, _when(self._mark))

    def _migrate(self) -> None:
        with self._lock:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema version {version}, this fastshare knows up to "
                                 f"{SCHEMA_VERSION}; upgrade fastshare or use another --state-dir")
            for target in range(version + 1, SCHEMA_VERSION + 1):
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for statement in filter(str.strip, _MIGRATIONS[target].split(";")):
                        self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version = {target}")
                    self._db.execute("COMMIT")
                    self._group.committed()
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise

    def schema_version(self) -> int:
        with self._lock:
            return self._db.execute("PRAGMA user_version").fetchone()[0]

    def sync(self, ticket: object | None = None) -> None:
        self._group.sync(ticket if isinstance(ticket, int) else None)

    def flush_soon(self) -> object | None:
        return self._group.flush_soon()

    def close(self) -> None:
        self._group.close()
        with self._read_lock:
            self._reader.close()
        with self._lock:
            self._db.close()

    def _read(self, *queries: tuple[str, Sequence[object]]) -> list[list[sqlite3.Row]]:
        """The rows of each query, all from one snapshot, read without the writer's lock."""
        with self._read_lock:
            self._reader.execute("BEGIN")
            try:
                return [self._reader.execute(query, params).fetchall() for query, params in queries]
            finally:
                self._reader.execute("COMMIT")

    # -- nodes -------------------------------------------------------------------------------
    def put_node(self, node: Node) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT INTO nodes (name, address, labels, inventory, available, last_heartbeat, "
                    "registered_at, cordoned, cordon_reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(name) DO UPDATE SET "
                    "address=excluded.address, labels=excluded.labels, inventory=excluded.inventory, "
                    "available=excluded.available, last_heartbeat=excluded.last_heartbeat, "
                    "registered_at=excluded.registered_at, cordoned=excluded.cordoned, "
                    "cordon_reason=excluded.cordon_reason",
                    (node.name, node.address, json.dumps(node.labels, sort_keys=True),
                     json.dumps(node.inventory, sort_keys=True), int(node.available),
                     node.last_heartbeat, node.registered_at, int(node.cordoned), node.cordon_reason))
                self._db.execute("DELETE FROM gpus WHERE node = ?", (node.name,))
                self._db.executemany(
                    "INSERT INTO gpus (node, idx, uuid, model, memory_bytes, sm_count, mig_capable, "
                    "mig_enabled, mig_unheld, lost, mig_change_pending) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [(node.name, g.index, g.uuid, g.model, g.memory_bytes, g.sm_count,
                      int(g.mig_capable), int(g.mig_enabled), json.dumps(g.mig_unheld), g.lost,
                      int(g.mig_change_pending))
                     for g in node.gpus])
                self._db.execute("COMMIT")
                self._group.committed()
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get_node(self, name: str) -> Node | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM nodes WHERE name = ?", (name,)).fetchone()
            gpus = self._db.execute("SELECT * FROM gpus WHERE node = ? ORDER BY idx", (name,)).fetchall()
        return _node(row, gpus) if row else None

    def list_nodes(self) -> list[Node]:
        rows, gpu_rows = self._read(("SELECT * FROM nodes ORDER BY name", ()),
                                    ("SELECT * FROM gpus ORDER BY node, idx", ()))
        gpus: dict[str, list[sqlite3.Row]] = {}
        for g in gpu_rows:
            gpus.setdefault(g["node"], []).append(g)
        return [_node(r, gpus.get(r["name"], [])) for r in rows]

    def delete_node(self, name: str) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM gpus WHERE node = ?", (name,))
                self._db.execute("DELETE FROM nodes WHERE name = ?", (name,))
                self._db.execute("DELETE FROM unreached_nodes WHERE node = ?", (name,))
                self._db.execute("COMMIT")
                self._group.committed()
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._unreached.pop(name, None)   # back one day, it is a new node: judged as at this start

    def mark_node(self, name: str, *, available: bool, last_heartbeat: float | None = None) -> None:
        with self._lock:
            if last_heartbeat is None:
                self._db.execute("UPDATE nodes SET available = ? WHERE name = ?", (int(available), name))
            else:
                self._db.execute("UPDATE nodes SET available = ?, last_heartbeat = ? WHERE name = ?",
                                 (int(available), last_heartbeat, name))
            self._group.committed()

    # -- allocations ---------------------------------------------------------------------------
    def next_sequence(self) -> int:
        with self._lock:
            self._issued = max(self._issued + 1, time.time_ns() // 1000)
            return self._issued

    def _in_gap(self, sequence: int) -> bool:
        """A number skipped (written or still pending), never issued."""
        return any(a < sequence < b for a, b in (*self._gaps, *self._pending))

    def never_issued(self, sequence: int) -> bool:
        with self._lock:
            return sequence > self._mark or self._in_gap(sequence)

    def saw(self, sequences: Iterable[int], first_of: str = "") -> None:
        """Numbers go on above every one seen (the skipped ones are a gap, written with the next
        record: until a record above them is, they are above the mark anyway). ``first_of``: the
        node whose first inventory this process read. A number this database had not issued at
        the start the node is judged against (this process's; for a known node no process reached
        since an earlier start, that start's, kept in ``unreached_nodes``) and that numbering
        passed since (its node was away, the clock behind it) is remembered as never issued, and
        the node's entry dropped, in a commit of its own, made durable (when it kept a number)
        before this returns."""
        keep = []
        with self._lock:
            seen = list(sequences)   # each below 16**14 (see ``sequence_of``): no overflow numbering on
            since = self._unreached.get(first_of, self._start_mark)
            for sequence in seen if first_of else ():
                # above the mark is not enough: a number issued without a record (a refused
                # allocation, one still in flight) has passed it, and the next record's mark will
                if since < sequence <= self._issued and not self._in_gap(sequence):
                    keep.append((sequence - 1, sequence + 1))
            highest = max(seen, default=0)
            if highest > self._issued:
                if self._pending and self._pending[-1][1] == self._issued + 1:
                    self._pending[-1] = (self._pending[-1][0], highest + 1)
                else:
                    self._pending.append((self._issued, highest + 1))
                self._issued = highest
            judged = bool(keep) or first_of in self._unreached
            if judged:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._db.executemany("INSERT INTO sequence_gaps (after, before) VALUES (?, ?)", keep)
                    self._db.execute("DELETE FROM unreached_nodes WHERE node = ?", (first_of,))
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
                self._gaps += keep
                self._unreached.pop(first_of, None)
                self._group.committed()
        if keep:   # a drop alone need not be: lost to a power loss (with all after it), it is judged again
            self.sync()

    def create_allocation(self, allocation: Allocation) -> None:
        """One commit: the record and the high-water mark (and the gaps not written yet)."""
        values = [_encode(c, getattr(allocation, c)) if c != "kind" else allocation.spec.kind.value
                  for c in _COLUMNS]
        sequence = sequence_of(allocation.id)
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._db.execute(f"INSERT INTO allocations ({', '.join(_COLUMNS)}) "
                                     f"VALUES ({', '.join('?' * len(_COLUMNS))})", values)
                    gaps = self._pending if sequence is not None else []
                    self._db.executemany("INSERT INTO sequence_gaps (after, before) VALUES (?, ?)", gaps)
                    if sequence is not None and sequence > self._mark:
                        self._db.execute("UPDATE sequence SET mark = ?", (sequence,))
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:   # a failed COMMIT (disk full) may have rolled back
                        self._db.execute("ROLLBACK")
                    raise
                self._gaps += gaps
                self._pending = self._pending[len(gaps):]
                if sequence is not None:
                    self._mark = max(self._mark, sequence)
                self._group.committed()
            except sqlite3.IntegrityError as exc:
                existing = self._by_key(allocation.idempotency_key) if allocation.idempotency_key else None
                if existing is None:
                    raise StoreError(f"cannot store allocation {allocation.id}: {exc}") from exc
                raise DuplicateKey(existing) from exc

    def _set(self, allocation_id: str, where: str, params: list[Any], changes: dict[str, object]) -> int:
        unknown = set(changes) - _MUTABLE
        if unknown:
            raise StoreError(f"cannot change {sorted(unknown)} of an allocation")
        changes = {**changes, "updated_at": changes.get("updated_at", time.time())}
        assignments = ", ".join(f"{c} = ?" for c in changes)
        values = [_encode(c, v) for c, v in changes.items()]
        count = self._db.execute(f"UPDATE allocations SET {assignments} WHERE id = ?{where}",
                                 [*values, allocation_id, *params]).rowcount
        self._group.committed()
        return count

    def transition(self, allocation_id: str, expected: Iterable[State], new_state: State,
                   **changes: object) -> Allocation:
        expected = [State(s) for s in expected]
        with self._lock:
            marks = ", ".join("?" * len(expected))
            count = self._set(allocation_id, f" AND state IN ({marks})", [s.value for s in expected],
                              {**changes, "state": new_state})
            row = self._db.execute("SELECT * FROM allocations WHERE id = ?", (allocation_id,)).fetchone()
        if count != 1:
            raise Conflict(allocation_id, State(row["state"]) if row else None, expected)
        return _allocation(row)

    def update(self, allocation_id: str, **changes: object) -> Allocation:
        with self._lock:
            count = self._set(allocation_id, "", [], changes)
            row = self._db.execute("SELECT * FROM allocations WHERE id = ?", (allocation_id,)).fetchone()
        if count != 1 or row is None:
            raise Conflict(allocation_id, None, [])
        return _allocation(row)

    def get_allocation(self, allocation_id: str) -> Allocation | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM allocations WHERE id = ?", (allocation_id,)).fetchone()
        return _allocation(row) if row else None

    def _by_key(self, key: str) -> Allocation | None:
        row = self._db.execute("SELECT * FROM allocations WHERE idempotency_key = ?", (key,)).fetchone()
        return _allocation(row) if row else None

    def find_by_key(self, idempotency_key: str) -> Allocation | None:
        with self._lock:
            return self._by_key(idempotency_key)

    def prune_finished(self, before: float, batch: int = 500) -> int:
        """In batches, so that the writer lock is never held for long (a week of records may be
        tens of thousands)."""
        done = 0
        while True:
            with self._lock:
                count = self._db.execute(
                    "DELETE FROM allocations WHERE id IN (SELECT id FROM allocations WHERE state IN (?, ?) "
                    "AND updated_at < ? LIMIT ?)",
                    (State.RELEASED.value, State.FAILED.value, before, batch)).rowcount
                self._group.committed()
            done += count
            if count < batch:
                return done

    def list_allocations(self, states: Iterable[State] | None = None,
                         node: str | None = None) -> list[Allocation]:
        query, params = "SELECT * FROM allocations WHERE 1=1", []
        if states is not None:
            states = [State(s).value for s in states]
            query += f" AND state IN ({', '.join('?' * len(states))})"
            params += states
        if node is not None:
            query += " AND node = ?"
            params.append(node)
        [rows] = self._read((query + " ORDER BY created_at, id", params))
        return [_allocation(r) for r in rows]
