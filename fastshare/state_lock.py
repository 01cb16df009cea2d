"""One live process per state directory (the controller's, a node agent's): an fcntl lock held
for the process's life.

The kernel drops the lock when the process dies (also on kill -9), so a crashed process never
blocks its successor, and a second live one refuses to start: a second node agent on one state
directory reconciled the journal and the GPUs under the first one's feet (rolled back its
shares in flight, stopped their MPS daemons) and took over its unix socket.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import NamedTuple


class Holder(NamedTuple):
    """The live process holding a state directory, as it wrote itself into the lock file: its pid,
    its ``note`` (what holds it, when not the owner itself: see :meth:`StateDirLock.acquire`) and
    its ``status`` (see :meth:`StateDirLock.status`)."""

    pid: str
    note: str = ""
    status: str = ""


class LockedError(RuntimeError):
    """Another live process holds the state directory: ``holder``."""

    def __init__(self, message: str, holder: Holder) -> None:
        super().__init__(message)
        self.holder = holder


class StateDirLock:
    """``owner``: "controller" or "node agent" (the lock file is named after it); ``where``: how
    the user gives another state directory, for the refusal."""

    def __init__(self, state_dir: Path | str, owner: str = "controller",
                 where: str = "--state-dir") -> None:
        self.path = Path(state_dir) / lock_name(owner)
        self.owner, self.where = owner, where
        self._fd: int | None = None
        self._note = ""

    def acquire(self, patience: float = 0.0, note: str = "") -> None:
        """``patience``: seconds to keep trying (``holder`` takes the lock for an instant);
        ``note``: what holds it, when that is not the owner itself (e.g. a MIG change made while
        no node agent runs), written after the pid for whoever finds it held."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            held = self._take(fd, patience)
        except BaseException:   # the file is not left open (nor the lock held) by a failed acquire
            os.close(fd)
            raise
        if held is not None:
            os.close(fd)
            who = (f"{held.note} (pid {held.pid})" if held.note else
                   f"another {self.owner} (pid {held.pid})")
            raise LockedError(
                f"{who} is already using the state directory "
                f"{self.path.parent}; stop it first or give this one a different {self.where}",
                held)
        self._fd, self._note = fd, note
        try:
            self.status("")
        except BaseException:
            self.release()
            raise

    @staticmethod
    def _take(fd: int, patience: float) -> Holder | None:
        """Lock ``fd`` within ``patience`` seconds: None, or (the fd not locked) who holds it."""
        deadline = time.monotonic() + patience
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return None
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                return _read(fd)

    def status(self, status: str) -> None:
        """Say, for whoever finds the lock held, what the holder is doing (e.g. a node agent: that
        it serves, and on which unix socket)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n{self._note}\n{status}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StateDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_name(owner: str) -> str:
    return owner.replace(" ", "-") + ".lock"


def holder(state_dir: Path | str, owner: str) -> str | None:
    """The pid of the live process holding ``state_dir`` for ``owner`` (None: none does). Only
    looks: the lock is taken shared for an instant (an owner starting meanwhile waits for it)."""
    held = held_by(state_dir, owner)
    return held and held.pid


def held_by(state_dir: Path | str, owner: str) -> Holder | None:
    """The live process holding ``state_dir`` for ``owner``; as :func:`holder`."""
    try:
        fd = os.open(Path(state_dir) / lock_name(owner), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd)
    finally:
        os.close(fd)
    return None


def _read(fd: int) -> Holder:
    """The holder as it wrote itself: pid, note and status, one a line."""
    lines = [line.strip() for line in os.pread(fd, 1024, 0).decode(errors="replace").splitlines()]
    lines += [""] * (3 - len(lines))
    return Holder(lines[0] or "unknown", lines[1], lines[2])
