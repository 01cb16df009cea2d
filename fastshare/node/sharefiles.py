"""Per-device files for a time-slicing interception library (KubeShare/Gemini format).

For each GPU or MIG device UUID with fastpod shares:

  ROOT/config/<uuid>          N, then one line per share: ``key request limit memory_bytes``
  ROOT/podmanagerport/<uuid>  N, then one line per share: ``key port``

Request comes BEFORE limit (KubeShare v2 once wrote them swapped; this module is the one
writer and ``read`` is the reader the tests check it against). Files are replaced atomically
(temp + rename: a reader sees the old or the new file, never a mix), left alone when they
already say exactly that, and removed when the last share leaves.

They are not fsynced: they are derived state. They live under the run directory (tmpfs,
``/run/fastshare/shares`` by default) and the agent rewrites every one of them from its
journal at each start, before it serves, so after a power loss they are rebuilt, never
trusted. (The fsyncs were a third of the agent's time per prepare under load.)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from pathlib import Path
from typing import NamedTuple


class ShareEntry(NamedTuple):
    """One share's line; a tuple (not a dataclass) so that building one per share for every
    write and sorting them runs at C speed (the dataclass was a fifth of a write's CPU)."""

    key: str
    request: float
    limit: float
    memory_bytes: int
    port: int


class ShareFileError(ValueError):
    """A share file that does not follow the format."""


def config_path(root: Path, device_uuid: str) -> Path:
    return Path(root) / "config" / device_uuid


def port_path(root: Path, device_uuid: str) -> Path:
    return Path(root) / "podmanagerport" / device_uuid


class _File:
    """One share file's names, built once (path objects were a fifth of a write's CPU), and
    what this process last put there: a write whose text differs from that needs no read to
    know the file must change. Unknown (None) or equal, the file itself is compared."""

    __slots__ = ("directory", "last", "path", "path_bytes", "tmp", "tmp_bytes")

    def __init__(self, path: Path) -> None:
        self.directory = str(path.parent)
        self.path = str(path)
        self.tmp = str(path.parent / f".{path.name}.new")   # one writer per device (the agent's file lock)
        self.path_bytes, self.tmp_bytes = os.fsencode(self.path), os.fsencode(self.tmp)
        self.last: bytes | None = None


@functools.lru_cache(maxsize=4096)
def _files(root: str, device_uuid: str) -> tuple[_File, _File]:
    """(config, ports) of a device; an entry evicted only forgets ``last``."""
    return _File(config_path(root, device_uuid)), _File(port_path(root, device_uuid))


def names(root: Path | str, device_uuid: str) -> tuple[str, str]:
    """The device's (config, ports) file names, built once (what ``config_path`` and
    ``port_path`` say, as strings for the hot path)."""
    cfg, ports = _files(os.fspath(root), device_uuid)
    return cfg.path, ports.path


_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


def _replace(file: _File, data: bytes) -> None:
    """Atomically make the file contain ``data``; no write at all when it already does.

    Raw os calls on precomputed names: six system calls for a changed file (Path.write_text
    and friends made eighteen, each a GIL release and often a context switch under load)."""
    if (file.last is None or file.last == data) and _holds(file.path, data):
        file.last = data
        return
    file.last = None
    try:
        fd = os.open(file.tmp, _NEW_FLAGS, 0o644)
    except FileNotFoundError:             # first file of its kind: create the directory once
        os.makedirs(file.directory, exist_ok=True)
        fd = os.open(file.tmp, _NEW_FLAGS, 0o644)
    try:
        try:
            os.fchmod(fd, 0o644)          # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        if _exchange(file):
            os.unlink(file.tmp)           # now the old file
        else:
            os.replace(file.tmp, file.path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file.tmp)
        raise
    file.last = data


def _holds(path: str, data: bytes) -> bool:
    """Does the file at ``path`` contain exactly ``data``? (one read: a longer file differs)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return os.read(fd, len(data) + 1) == data
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(file: _File) -> bool:
    """Atomically swap the new file and the existing one (renameat2 RENAME_EXCHANGE); False
    when that is not possible (no file there yet, old kernel or libc, filesystem without it),
    and the caller renames over instead. Why: on ext4 a rename over an existing file forces
    writeback of the new file first (auto_da_alloc), 0.2-5 ms per file on a busy disk, which
    these derived, never-fsynced files do not need; the swap costs ~20 us."""
    if _renameat2 is None:
        return False
    return _renameat2(_AT_FDCWD, file.tmp_bytes, _AT_FDCWD, file.path_bytes, _RENAME_EXCHANGE) == 0


def _check(entry: ShareEntry) -> None:
    if entry.key.split() != [entry.key]:   # empty, or whitespace inside (C speed: 100 keys a write)
        raise ShareFileError(f"share key {entry.key!r} must be non-empty without whitespace")
    if not 0 < entry.request <= entry.limit <= 1:
        raise ShareFileError(f"share {entry.key}: need 0 < request ({entry.request}) <= limit "
                             f"({entry.limit}) <= 1")
    if entry.memory_bytes < 0 or not 0 < entry.port < 65536:
        raise ShareFileError(f"share {entry.key}: memory_bytes must be >= 0 and port in 1..65535")


def write(root: Path, device_uuid: str, entries: list[ShareEntry]) -> None:
    """THE writer: make the device's files say exactly ``entries`` (none: remove them)."""
    cfg, ports = _files(os.fspath(root), device_uuid)
    if not entries:
        for file in (cfg, ports):
            file.last = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file.path)
        return
    ordered = sorted(entries)
    for entry in ordered:
        _check(entry)
    if len({e.key for e in ordered}) != len(ordered):
        raise ShareFileError(f"duplicate share keys for {device_uuid}")
    _replace(cfg, (f"{len(ordered)}\n" + "".join(
        [f"{e.key} {e.request!r} {e.limit!r} {e.memory_bytes}\n" for e in ordered])).encode())
    _replace(ports, (f"{len(ordered)}\n" + "".join([f"{e.key} {e.port}\n" for e in ordered])).encode())


def read(root: Path, device_uuid: str) -> list[ShareEntry]:
    """Parse both files back (what an interception library sees); [] when absent."""
    cfg, ports = config_path(root, device_uuid), port_path(root, device_uuid)
    if not cfg.exists() and not ports.exists():
        return []
    config_rows = _rows(cfg, 4)
    port_rows = dict(_rows(ports, 2))
    if set(port_rows) != {row[0] for row in config_rows}:
        raise ShareFileError(f"{cfg} and {ports} list different shares")
    return [ShareEntry(key, float(req), float(lim), int(mem), int(port_rows[key]))
            for key, req, lim, mem in config_rows]


def _rows(path: Path, width: int) -> list[list[str]]:
    lines = path.read_text().splitlines()
    if not lines or not lines[0].strip().isdigit():
        raise ShareFileError(f"{path}: first line must be the number of entries")
    count = int(lines[0])
    rows = [line.split() for line in lines[1:] if line.strip()]
    if len(rows) != count or any(len(r) != width for r in rows):
        raise ShareFileError(f"{path}: header says {count} entries of {width} fields, found {rows!r}")
    return rows


def devices(root: Path) -> list[str]:
    """Device UUIDs that currently have a config or a port file (a crash between the two
    renames or unlinks can leave one alone; the agent's start rewrites or removes both)."""
    found = set()
    for directory in (Path(root) / "config", Path(root) / "podmanagerport"):
        if directory.is_dir():
            found.update(p.name for p in directory.iterdir() if not p.name.startswith("."))
    return sorted(found)
