"""Opening the SQLite files fastshare keeps its state in (controller store, agent journal).

Both must refuse to start on a damaged or unreadable file, with a message that names the file
and says what to do, rather than a traceback, and must never "repair" it by starting empty:
what is recorded there is the only record of what runs on the GPUs.

Durability: both run WAL with ``synchronous=NORMAL`` plus :class:`GroupSync`, a durability
barrier that the code calls before it acknowledges anything (an RPC reply). A commit is in
the WAL file (the OS page cache) when COMMIT returns, so it survives a kill -9 of the
process; a power loss or OS crash can only take commits made after the last barrier, and
nobody was told about those. One fdatasync covers every commit made before it started, so
concurrent requests share it instead of queueing one fsync each behind the connection lock
(what ``synchronous=FULL`` does).

Every acknowledged change waits for such a flush, so a disk whose flushes stall makes every
answer slow, whatever the program does; :class:`GroupSync` says so in the log (like etcd's
"slow fdatasync"), naming the file, instead of leaving an operator to guess.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)
SLOW_FLUSH_S = 0.05       # one flush this long spends a whole request's latency budget
SLOW_FLUSH_WARN_EVERY_S = 10.0


class StateFileError(RuntimeError):
    """The state file cannot be opened or is damaged; nothing was changed."""


def open_state_file(path: Path, *, synchronous: str, what: str, recovery: str) -> sqlite3.Connection:
    """WAL-mode connection to ``path`` after an integrity check (``quick_check``).

    ``what`` names the file for the user ("controller state"), ``recovery`` says what moving
    it away would lose."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
    except (OSError, sqlite3.Error) as exc:
        raise StateFileError(f"{what} {path}: cannot open it ({exc}); check that the directory "
                             "exists, is writable and has free space") from None
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous}")
        db.execute("PRAGMA foreign_keys=ON")
        problems = [row[0] for row in db.execute("PRAGMA quick_check")]
    except sqlite3.OperationalError as exc:  # locked, read-only, full: the file itself may be fine
        db.close()
        raise StateFileError(f"{what} {path}: cannot use it ({exc}); another process may hold it, or "
                             "the directory is not writable or has no free space") from None
    except sqlite3.DatabaseError as exc:      # e.g. "file is not a database"
        problems = [str(exc)]
    if problems != ["ok"]:
        db.close()
        raise StateFileError(
            f"{what} {path} is damaged ({'; '.join(problems[:3])}); nothing was changed. Restore it "
            f"from a backup, or move it away to start empty ({recovery})")
    return db


def write_failure(exc: BaseException) -> str | None:
    """A user-facing reason when ``exc`` is SQLite failing to write (disk full, read-only,
    I/O error, another process holding the file's lock past the busy timeout): the caller
    answers UNAVAILABLE with it, nothing half-written is kept."""
    if not isinstance(exc, sqlite3.OperationalError):
        return None
    if any(text in str(exc) for text in ("disk is full", "readonly", "read-only", "disk I/O error")):
        return (f"the state file cannot be written ({exc}); free space in the state directory or make "
                "it writable, then retry")
    if "database is locked" in str(exc):
        return (f"the state file cannot be written ({exc}): another process holds its lock (an sqlite3 "
                "shell or a backup tool with a transaction open?); let it go, then retry")
    return None


class GroupSync:
    """Group commit and background checkpoints for one WAL-mode, ``synchronous=NORMAL``
    connection (this process is the file's only writer).

    The writer calls :meth:`committed` right after each COMMIT (still under its own lock).
    :meth:`sync` returns once every commit counted before the call (or up to a ticket) is on
    disk; :meth:`flush_soon` starts that fdatasync in the background and returns the ticket,
    so a caller can overlap it with other work (an RPC) and wait for it later. One flush runs
    at a time, outside the connection lock; callers that arrive meanwhile wait for the next
    one, which covers them all.

    Checkpoints (copying the WAL into the main file, with an fsync of each) run here too, on
    a connection of their own, every ``CHECKPOINT_EVERY`` commits: SQLite's automatic
    checkpoint would run them inside a COMMIT, under the writer's lock, and stall every
    request for two fsyncs (1 % of commits took 5-25 ms). The writer's own automatic
    checkpoint stays as a safety net at ``SAFETY_PAGES``; it then only copies what arrived
    since the last background one. A checkpoint syncs both files itself (NORMAL), and
    SQLite keeps the WAL file while the connection is open, so a flush of the WAL file is
    always enough.
    """

    CHECKPOINT_EVERY = 200
    SAFETY_PAGES = 8000

    def __init__(self, path: Path, db: sqlite3.Connection) -> None:
        self._path = Path(path)
        self._wal = Path(f"{path}-wal")
        self._cond = threading.Condition()
        self._committed = 0
        self._synced = 0
        self._wanted = 0          # highest ticket a background flush was asked for
        self._checkpointed = 0    # commits covered by the last background checkpoint
        self._syncing = False
        self._directory_synced = False
        self._worker: threading.Thread | None = None
        self._closed = False
        self.syncs = 0            # fdatasync calls made (tests, benchmarks)
        self.checkpoints = 0
        self.slow_flushes = 0     # of them, those of SLOW_FLUSH_S or more
        self._slow_unreported = 0
        self._slowest_unreported = 0.0
        self._warned_at = -SLOW_FLUSH_WARN_EVERY_S
        db.execute(f"PRAGMA wal_autocheckpoint={self.SAFETY_PAGES}")

    def committed(self) -> None:
        with self._cond:
            self._committed += 1
            if self._committed - self._checkpointed >= self.CHECKPOINT_EVERY:
                self._wake()

    def sync(self, ticket: int | None = None) -> None:
        """Durability barrier: every commit made before this call (or counted in ``ticket``)
        is on disk on return."""
        with self._cond:
            target = self._committed if ticket is None else ticket
            while self._synced < target:
                if self._syncing:
                    self._cond.wait()
                else:
                    self._flush_locked()

    def flush_soon(self) -> int:
        """Start making every commit so far durable without waiting; ``sync(ticket)`` waits."""
        with self._cond:
            ticket = self._committed
            if self._synced < ticket:
                self._wanted = max(self._wanted, ticket)
                self._wake()
            return ticket

    def close(self) -> None:
        """Stop the background thread (the connection is closing)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None:
            worker.join(timeout=30)

    def _wake(self) -> None:
        """With the condition held: get the background thread going."""
        if self._closed:
            return
        if self._worker is None:
            self._worker = threading.Thread(target=self._background, name="group-sync", daemon=True)
            self._worker.start()
        self._cond.notify_all()

    def _background(self) -> None:
        checkpointer: sqlite3.Connection | None = None
        try:
            with self._cond:
                while not self._closed:
                    if self._wanted > self._synced and not self._syncing:
                        try:
                            self._flush_locked()
                        except OSError:   # a waiting sync() flushes again itself and reports the error
                            self._wanted = self._synced
                    elif self._committed - self._checkpointed >= self.CHECKPOINT_EVERY:
                        self._checkpointed = self._committed
                        self._cond.release()
                        try:
                            if checkpointer is None:
                                checkpointer = sqlite3.connect(self._path, timeout=30, isolation_level=None)
                                checkpointer.execute("PRAGMA synchronous=NORMAL")
                            checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
                            self.checkpoints += 1
                        except sqlite3.Error:   # busy or failing: the writer's safety net remains
                            pass
                        finally:
                            self._cond.acquire()
                    else:
                        self._cond.wait()
        finally:
            if checkpointer is not None:
                checkpointer.close()

    def _flush_locked(self) -> None:
        """One fdatasync; called and returns with the condition held, releases it meanwhile."""
        self._syncing = True
        covers = self._committed
        self._cond.release()
        try:
            if not self._directory_synced:     # the WAL file's own directory entry, once
                _fsync_path(self._wal.parent, directory=True)
                self._directory_synced = True
            started = time.monotonic()
            _fsync_path(self._wal, directory=False)
            took = time.monotonic() - started
        finally:
            self._cond.acquire()
            self._syncing = False
            self._cond.notify_all()
        self._synced = max(self._synced, covers)
        self.syncs += 1
        if took >= SLOW_FLUSH_S:
            self._slow_flush(took)

    def _slow_flush(self, took: float) -> None:
        """Count it; warn at once, then at most every SLOW_FLUSH_WARN_EVERY_S with what came
        meanwhile (a stalling disk would otherwise fill the log)."""
        self.slow_flushes += 1
        self._slow_unreported += 1
        self._slowest_unreported = max(self._slowest_unreported, took)
        now = time.monotonic()
        if now - self._warned_at < SLOW_FLUSH_WARN_EVERY_S:
            return
        log.warning("slow disk: %d fdatasync(s) of %s took %.0f ms or more since the last such "
                    "warning, the slowest %.0f ms; every acknowledged change waits for them. Keep "
                    "%s on a disk that flushes in a few ms.", self._slow_unreported, self._wal,
                    1000 * SLOW_FLUSH_S, 1000 * self._slowest_unreported, self._wal.parent)
        self._slow_unreported, self._slowest_unreported, self._warned_at = 0, 0.0, now


def _fsync_path(path: Path, *, directory: bool) -> None:
    """fdatasync a file (a missing WAL file means a checkpoint took everything: nothing to do),
    or fsync a directory."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    except FileNotFoundError:
        if directory:
            raise
        return
    try:
        if directory:
            os.fsync(fd)
        else:
            os.fdatasync(fd)
    finally:
        os.close(fd)
