"""The agent's write-ahead journal (SQLite, WAL, synchronous=NORMAL plus a group-commit barrier).

Every share, and every MIG instance and MPS daemon the agent creates, gets a row BEFORE the
agent acts, and the row is completed after. After a crash the rows in an intermediate state
('preparing', 'creating', 'starting', 'releasing', 'destroying', 'stopping') tell the
reconciler exactly which step might be half done. Rows are small and every transaction is
short: no device or process work ever happens while the database lock is held.

Share rows and MPS daemon rows are also kept parsed in memory (this process is the journal's
only writer): every capacity check reads all shares of a device, and parsing every row's JSON
on every request made prepare O(shares on the node); every prepare reads its daemon's row.

Every change is ONE statement, which SQLite runs as its own transaction (the connection is in
autocommit mode): atomic like BEGIN ... COMMIT, without the two extra statements (each one a
GIL release and locking system calls).

Durability (:class:`fastshare.sqlite_file.GroupSync`): every commit survives a kill -9 of the
agent as soon as COMMIT returns (it is in the WAL file), which is all the write-ahead order
needs after a process crash. A power loss or OS crash may drop commits made after the last
:meth:`Journal.sync`; the service calls it before replying to any mutating RPC, so nothing
the agent acknowledged is lost. An unacknowledged row that is lost only ever described
something a power loss undoes as well: MPS daemons (processes), MIG instances and compute
mode (reset with the GPU at boot) and share files (under the run directory, rewritten from
the journal at every start).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fastshare.node.model import Prepared, ShareSpec
from fastshare.sqlite_file import GroupSync, StateFileError, open_state_file

SCHEMA_VERSION = 1   # an older agent ignores tables added since (leader_term, lost_shares, taken_devices)
_SHARE_COLUMNS = "spec, state, device_uuid, port, prepared"
_MPS_COLUMNS = "device_uuid, gpu_uuid, state, pid, compute_mode_set, sm_ceiling, mem_ceiling"
_SELECT = object()   # Journal._write: read the share's row back
_SCHEMA = """
CREATE TABLE IF NOT EXISTS shares (
    id TEXT PRIMARY KEY,
    spec TEXT NOT NULL,            -- ShareSpec JSON, as requested
    state TEXT NOT NULL CHECK (state IN ('preparing', 'ready', 'releasing')),
    device_uuid TEXT NOT NULL,     -- the device the share lives on (MIG UUID once created)
    port INTEGER,                  -- fastpod: pod manager port
    prepared TEXT,                 -- Prepared JSON once ready
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS mig_instances (
    gpu_uuid TEXT NOT NULL,
    start INTEGER NOT NULL,
    profile_id INTEGER NOT NULL,
    mig_uuid TEXT,
    state TEXT NOT NULL CHECK (state IN ('creating', 'ready', 'destroying')),
    share_id TEXT,                 -- exclusive share it was made for (NULL: layout / adopted)
    purpose TEXT NOT NULL CHECK (purpose IN ('share', 'layout')),
    updated REAL NOT NULL,
    PRIMARY KEY (gpu_uuid, start)
);
CREATE TABLE IF NOT EXISTS mps_daemons (
    device_uuid TEXT PRIMARY KEY,
    gpu_uuid TEXT NOT NULL,        -- parent GPU (same as device_uuid for a whole GPU)
    state TEXT NOT NULL CHECK (state IN ('starting', 'running', 'stopping')),
    pid INTEGER,
    compute_mode_set INTEGER NOT NULL DEFAULT 0,  -- we switched the GPU to EXCLUSIVE_PROCESS
    sm_ceiling REAL,               -- limits currently applied as daemon defaults
    mem_ceiling INTEGER,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS lost_shares (
    id TEXT PRIMARY KEY,           -- a share dropped because its device went away while held
    device_uuid TEXT NOT NULL,     -- the GPU or MIG device that is gone
    reason TEXT NOT NULL,
    owner TEXT NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS taken_devices (
    device_uuid TEXT PRIMARY KEY,  -- a MIG device a forced layout destroys, a GPU a forced MIG enable takes
    cause TEXT NOT NULL,           -- why its shares lose it: written before the change, so that a
                                   -- restart drops them with it; gone once they are (or if it failed)
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS leader_term (
    id INTEGER PRIMARY KEY CHECK (id = 0),   -- one row
    term INTEGER NOT NULL,         -- highest controller leader term seen (fencing token)
    updated REAL NOT NULL
);
"""


@dataclass(frozen=True)
class ShareRow:
    spec: ShareSpec
    state: str
    device_uuid: str
    port: int | None
    prepared: Prepared | None


@dataclass(frozen=True)
class LostShare:
    """A share dropped because its device went away while it was held (see ``Agent``)."""

    id: str
    device_uuid: str
    reason: str
    owner: str


@dataclass(frozen=True)
class MigRow:
    gpu_uuid: str
    start: int
    profile_id: int
    mig_uuid: str | None
    state: str
    share_id: str | None
    purpose: str


@dataclass(frozen=True)
class MpsRow:
    device_uuid: str
    gpu_uuid: str
    state: str
    pid: int | None
    compute_mode_set: bool
    sm_ceiling: float | None
    mem_ceiling: int | None


class JournalError(RuntimeError):
    pass


class Journal:
    """Thread-safe; one connection guarded by a lock, each method one short transaction.

    The cached rows have a lock of their own, never held across I/O: a reader (every capacity
    check) does not wait behind a commit, nor behind a writer that holds the connection while
    it waits for the GIL after its SQLite call."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        self._lock = threading.Lock()    # the connection
        self._view = threading.Lock()    # the cached rows (taken inside _lock, never the reverse)
        self._db = open_state_file(path, synchronous="NORMAL", what="node agent journal",
                                   recovery="the agent forgets which shares, MIG instances and MPS "
                                            "daemons it made and never cleans them up")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise JournalError(f"{path} has schema version {version}, newer than this agent "
                               f"({SCHEMA_VERSION}); upgrade the agent or move the journal away")
        with self._lock:
            self._db.executescript(_SCHEMA)  # idempotent (IF NOT EXISTS)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._group = GroupSync(path, self._db)
            self._group.committed()
            self._shares: dict[str, ShareRow] = {}
            self._on_device: dict[str, set[str]] = {}   # device UUID -> ids of the shares that touch it
            for r in self._db.execute(f"SELECT id, {_SHARE_COLUMNS} FROM shares").fetchall():
                self._cache(r[0], _share_row(r[1:]))
            self._lost: dict[str, LostShare] = {
                r[0]: LostShare(*r) for r in self._db.execute(
                    "SELECT id, device_uuid, reason, owner FROM lost_shares")}
            self._taken: dict[str, str] = dict(
                self._db.execute("SELECT device_uuid, cause FROM taken_devices").fetchall())
            self._mps: dict[str, MpsRow] = {
                r[0]: _mps_row(r) for r in self._db.execute(f"SELECT {_MPS_COLUMNS} FROM mps_daemons")}

    def close(self) -> None:
        self._group.close()
        with self._lock:
            self._db.close()

    def sync(self) -> None:
        """Durability barrier: every commit made before this call is on disk on return (one
        fdatasync shared by concurrent callers). Call it before acknowledging a change."""
        self._group.sync()

    def _write(self, sql: str, args: tuple, share_id: str | None = None,
               row: ShareRow | object | None = _SELECT, mps_device: str | None = None) -> None:
        """One statement, committed on return (autocommit: a statement is its own transaction,
        rolled back whole if it fails). With ``share_id``, that share's cached row follows the
        commit: ``row`` as written when the caller knows it (None: deleted), else read back;
        with ``mps_device``, that daemon's cached row is read back."""
        with self._lock:
            self._db.execute(sql, args)
            self._group.committed()
            if share_id is not None:
                if row is _SELECT:
                    found = self._db.execute(f"SELECT {_SHARE_COLUMNS} FROM shares WHERE id=?",
                                             (share_id,)).fetchone()
                    row = _share_row(found) if found is not None else None
                with self._view:
                    self._cache(share_id, row)  # type: ignore[arg-type]
            if mps_device is not None:
                self._cache_mps(mps_device)

    def _cache_mps(self, device_uuid: str) -> None:
        """With the connection's lock held: re-read one daemon's row (SQLite's types, e.g. REAL
        ceilings)."""
        found = self._db.execute(f"SELECT {_MPS_COLUMNS} FROM mps_daemons WHERE device_uuid=?",
                                 (device_uuid,)).fetchone()
        with self._view:
            if found is None:
                self._mps.pop(device_uuid, None)
            else:
                self._mps[device_uuid] = _mps_row(found)

    def _cache(self, share_id: str, row: ShareRow | None) -> None:
        """With the view's lock held (or alone, at start): the parsed row (None: gone) and the
        per-device index."""
        old = self._shares.pop(share_id, None)
        if old is not None:
            for device in _devices_of(old):
                ids = self._on_device[device]
                ids.discard(share_id)
                if not ids:
                    del self._on_device[device]
        if row is not None:
            self._shares[share_id] = row
            for device in _devices_of(row):
                self._on_device.setdefault(device, set()).add(share_id)

    # shares -------------------------------------------------------------------------------

    def begin_share(self, spec: ShareSpec, device_uuid: str, port: int | None) -> None:
        spec_json = spec.to_json()
        self._write("INSERT INTO shares (id, spec, state, device_uuid, port, updated) "
                    "VALUES (?, ?, 'preparing', ?, ?, ?)",
                    (spec.id, spec_json, device_uuid, port, time.time()),
                    spec.id, _share_row((spec_json, "preparing", device_uuid, port, None)))

    def insert_ready_share(self, spec: ShareSpec, device_uuid: str, port: int | None,
                           prepared: Prepared) -> None:
        """One-commit prepare, for shares whose only side effect is derived (share files)."""
        spec_json, prepared_json = spec.to_json(), prepared.to_json()
        self._write("INSERT INTO shares (id, spec, state, device_uuid, port, prepared, updated) "
                    "VALUES (?, ?, 'ready', ?, ?, ?, ?)",
                    (spec.id, spec_json, device_uuid, port, prepared_json, time.time()),
                    spec.id, _share_row((spec_json, "ready", device_uuid, port, prepared_json)))

    def share_ready(self, share_id: str, device_uuid: str, prepared: Prepared) -> None:
        self._write("UPDATE shares SET state='ready', device_uuid=?, prepared=?, updated=? WHERE id=?",
                    (device_uuid, prepared.to_json(), time.time(), share_id), share_id)

    def set_share_state(self, share_id: str, state: str) -> None:
        self._write("UPDATE shares SET state=?, updated=? WHERE id=?", (state, time.time(), share_id),
                    share_id)

    def set_share_device(self, share_id: str, device_uuid: str) -> None:
        self._write("UPDATE shares SET device_uuid=?, updated=? WHERE id=?",
                    (device_uuid, time.time(), share_id), share_id)

    def delete_share(self, share_id: str) -> None:
        self._write("DELETE FROM shares WHERE id=?", (share_id,), share_id, None)

    def share(self, share_id: str) -> ShareRow | None:
        with self._view:
            return self._shares.get(share_id)

    def shares(self) -> list[ShareRow]:
        with self._view:
            return [self._shares[k] for k in sorted(self._shares)]

    def shares_on(self, device_uuid: str) -> list[ShareRow]:
        """Shares that hold ``device_uuid`` (where they live, or one of the devices they asked
        for), from an index: capacity checks must not scan every share of the node."""
        with self._view:
            return [self._shares[k] for k in sorted(self._on_device.get(device_uuid, ()))]

    # shares lost with their device ---------------------------------------------------------

    def lose_share(self, lost: LostShare) -> None:
        """Record why a share is being dropped, before it is (kept until its id is released)."""
        self._write("INSERT INTO lost_shares (id, device_uuid, reason, owner, updated) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET device_uuid=excluded.device_uuid, "
                    "reason=excluded.reason, owner=excluded.owner, updated=excluded.updated",
                    (lost.id, lost.device_uuid, lost.reason, lost.owner, time.time()))
        with self._view:
            self._lost[lost.id] = lost

    def forget_lost(self, share_id: str) -> bool:
        """Forget a lost share (its id was released or prepared again); False if none was (no
        commit then: every prepare asks)."""
        with self._view:
            if share_id not in self._lost:
                return False
        self._write("DELETE FROM lost_shares WHERE id=?", (share_id,))
        with self._view:
            self._lost.pop(share_id, None)
        return True

    def lost_shares(self) -> list[LostShare]:
        with self._view:
            return [self._lost[k] for k in sorted(self._lost)]

    # devices a forced MIG change takes from the shares on them ----------------------------

    def note_taken(self, device_uuid: str, cause: str) -> None:
        """Record why the shares on ``device_uuid`` lose it, before a forced change takes it."""
        self._write("INSERT INTO taken_devices (device_uuid, cause, updated) VALUES (?, ?, ?) "
                    "ON CONFLICT (device_uuid) DO UPDATE SET cause=excluded.cause, updated=excluded.updated",
                    (device_uuid, cause, time.time()))
        with self._view:
            self._taken[device_uuid] = cause

    def forget_taken(self, device_uuid: str) -> None:
        with self._view:
            if device_uuid not in self._taken:
                return
        self._write("DELETE FROM taken_devices WHERE device_uuid=?", (device_uuid,))
        with self._view:
            self._taken.pop(device_uuid, None)

    def taken(self) -> dict[str, str]:
        """Device UUID -> why a forced change took it from its shares (see :meth:`note_taken`)."""
        with self._view:
            return dict(self._taken)

    # MIG instances ------------------------------------------------------------------------

    def begin_mig(self, gpu_uuid: str, start: int, profile_id: int, share_id: str | None,
                  purpose: str) -> None:
        self._write("INSERT INTO mig_instances (gpu_uuid, start, profile_id, state, share_id, purpose, "
                    "updated) VALUES (?, ?, ?, 'creating', ?, ?, ?)",
                    (gpu_uuid, start, profile_id, share_id, purpose, time.time()))

    def mig_ready(self, gpu_uuid: str, start: int, mig_uuid: str | None) -> None:
        self._write("UPDATE mig_instances SET state='ready', mig_uuid=?, updated=? "
                    "WHERE gpu_uuid=? AND start=?", (mig_uuid, time.time(), gpu_uuid, start))

    def set_mig_state(self, gpu_uuid: str, start: int, state: str) -> None:
        self._write("UPDATE mig_instances SET state=?, updated=? WHERE gpu_uuid=? AND start=?",
                    (state, time.time(), gpu_uuid, start))

    def set_mig_share(self, gpu_uuid: str, start: int, share_id: str | None) -> None:
        self._write("UPDATE mig_instances SET share_id=?, updated=? WHERE gpu_uuid=? AND start=?",
                    (share_id, time.time(), gpu_uuid, start))

    def delete_mig(self, gpu_uuid: str, start: int) -> None:
        self._write("DELETE FROM mig_instances WHERE gpu_uuid=? AND start=?", (gpu_uuid, start))

    def migs(self, gpu_uuid: str | None = None) -> list[MigRow]:
        query = "SELECT gpu_uuid, start, profile_id, mig_uuid, state, share_id, purpose FROM mig_instances"
        args: tuple = ()
        if gpu_uuid is not None:
            query, args = query + " WHERE gpu_uuid=?", (gpu_uuid,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY gpu_uuid, start", args).fetchall()
        return [MigRow(*r) for r in rows]

    # MPS daemons --------------------------------------------------------------------------

    def begin_mps(self, device_uuid: str, gpu_uuid: str) -> None:
        self._write("INSERT INTO mps_daemons (device_uuid, gpu_uuid, state, updated) "
                    "VALUES (?, ?, 'starting', ?) ON CONFLICT (device_uuid) DO UPDATE SET "
                    "state='starting', updated=excluded.updated", (device_uuid, gpu_uuid, time.time()),
                    mps_device=device_uuid)

    def update_mps(self, device_uuid: str, **fields: object) -> None:
        allowed = {"state", "pid", "compute_mode_set", "sm_ceiling", "mem_ceiling"}
        if not fields or set(fields) - allowed:
            raise ValueError(f"update_mps fields must be among {sorted(allowed)}")
        assignments = ", ".join(f"{k}=?" for k in fields)
        self._write(f"UPDATE mps_daemons SET {assignments}, updated=? WHERE device_uuid=?",
                    (*fields.values(), time.time(), device_uuid), mps_device=device_uuid)

    def delete_mps(self, device_uuid: str) -> None:
        self._write("DELETE FROM mps_daemons WHERE device_uuid=?", (device_uuid,), mps_device=device_uuid)

    def mps(self, device_uuid: str) -> MpsRow | None:
        with self._view:
            return self._mps.get(device_uuid)

    def mps_daemons(self) -> list[MpsRow]:
        with self._view:
            return [self._mps[k] for k in sorted(self._mps)]

    # leader term (see :mod:`fastshare.node.terms`) ------------------------------------------

    def leader_term(self) -> int | None:
        """The highest controller leader term recorded; None: no call ever carried one."""
        with self._lock:
            found = self._db.execute("SELECT term FROM leader_term WHERE id=0").fetchone()
        return found[0] if found else None

    def raise_leader_term(self, term: int) -> None:
        """Record ``term`` as the highest seen (never lowers it), before the call that carried
        it acts: committed first, like every write-ahead row."""
        self._write("INSERT INTO leader_term (id, term, updated) VALUES (0, ?, ?) ON CONFLICT (id) "
                    "DO UPDATE SET term=excluded.term, updated=excluded.updated "
                    "WHERE excluded.term > leader_term.term",
                    (term, time.time()))


def _devices_of(row: ShareRow) -> set[str]:
    return {row.device_uuid, *row.spec.device_uuids}


def _mps_row(r: tuple) -> MpsRow:
    return MpsRow(r[0], r[1], r[2], r[3], bool(r[4]), r[5], r[6])


def _share_row(row: tuple) -> ShareRow:
    spec, state, device_uuid, port, prepared = row
    return ShareRow(ShareSpec.from_json(spec), state, device_uuid, port,
                    Prepared.from_json(prepared) if prepared else None)


def held_device_uuids(path: Path | str | None) -> dict[str, list[str]]:
    """The devices fastshare shares hold, from a node agent's journal (none if absent): each
    device's UUID (a MIG device's, or a GPU's held whole) -> the ids of the shares on it.

    MIG reconfiguration (``fastshare mig``, the mig_config module) treats these as in use.
    The journal is only read (SQLite read-only mode): a file that is not a journal is reported,
    never turned into one, and a running agent is not disturbed."""
    if not path or not Path(path).exists():
        return {}
    try:
        db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
        try:
            held: dict[str, list[str]] = {}
            for share_id, uuid, text in db.execute("SELECT id, device_uuid, spec FROM shares ORDER BY id"):
                # a whole share's row names its first GPU; an exclusive one's spec, its MIG device's GPU
                spec = ShareSpec.from_json(text)
                named = () if spec.kind == "exclusive" else spec.device_uuids
                for device in dict.fromkeys((uuid, *named)):
                    held.setdefault(device, []).append(share_id)
            return held
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise StateFileError(f"{path} cannot be read as a node agent journal ({exc}); give the agent's "
                             "journal (e.g. /var/lib/fastshare/node/journal.db) or none") from None
