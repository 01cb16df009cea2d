"""Opening the SQLite files fastshare keeps its state in (controller store, agent journal).

Both must refuse to start on a damaged or unreadable file, with a message that names the file
and says what to do, rather than a traceback, and must never "repair" it by starting empty:
what is recorded there is the only record of what runs on the GPUs.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


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
    I/O error): the caller answers UNAVAILABLE with it, nothing half-written is kept."""
    if isinstance(exc, sqlite3.OperationalError) and any(
            text in str(exc) for text in ("disk is full", "readonly", "read-only", "disk I/O error")):
        return (f"the state file cannot be written ({exc}); free space in the state directory or make "
                "it writable, then retry")
    return None
