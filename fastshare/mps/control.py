"""Start, query and stop one MPS control daemon per GPU or MIG device.

Everything goes through the configured ``nvidia-cuda-mps-control`` binary (the real one or
the stand-in): ``BINARY -d`` to start, commands on the stdin of ``BINARY`` to talk. Each
device gets its own directories under the root, ``ROOT/<uuid>/pipe`` and ``ROOT/<uuid>/log``,
and the daemon sees only that device (``CUDA_VISIBLE_DEVICES=<uuid>``).

Start is verified (the control pipe answers ``get_server_list``), stop is verified (``quit``,
the daemon process is gone, the directories are removed): no fixed sleeps.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PID_FILE = "nvidia-cuda-mps-control.pid"
_UUID_RE = re.compile(r"^(GPU|MIG)-[A-Za-z0-9-]{1,80}\Z")  # \Z: "$" also matches before a final newline


class MpsError(RuntimeError):
    """An MPS daemon did not start, did not answer or did not stop in time."""


@dataclass(frozen=True)
class DaemonPaths:
    device_uuid: str
    root: Path

    @property
    def base(self) -> Path:
        return self.root / self.device_uuid

    @property
    def pipe_dir(self) -> Path:
        return self.base / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.base / "log"


def _mem_arg(memory_bytes: int) -> str:
    """MPS takes sizes with a unit suffix; whole MiB (rounded down, at least 1) is exact enough."""
    return f"{max(1, memory_bytes // (1 << 20))}M"


def _words(*words: object) -> str:
    """One control command from its words, the empty ones left out."""
    return " ".join(str(w) for w in words if w != "")


_LIMIT_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?$", re.IGNORECASE)
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _same_limit(answer: str, expected: str) -> bool:
    """Whether a read-back equals what was set: numbers compared as numbers, sizes in bytes
    (``4096M`` and ``4G`` are the same limit), within half a MiB for rounding in the answer.

    A size may also come back in a larger unit, in whole units (rounded down): NVIDIA's GPU
    Operator documentation shows ``get_default_device_pinned_mem_limit`` answering ``3G`` on a
    T4 shared by 4 replicas, where its device plugin sets ``3840M``. Such an answer is taken
    when it is exactly the set value rounded down to its unit."""
    got, want = _LIMIT_RE.match(answer), _LIMIT_RE.match(expected)
    if got is None or want is None:
        return False
    if not want.group(2):   # a percentage
        return abs(float(got.group(1)) - float(want.group(1))) < 0.01
    got_unit, want_unit = _UNIT[got.group(2).upper()], _UNIT[want.group(2).upper()]
    got_bytes, want_bytes = float(got.group(1)) * got_unit, float(want.group(1)) * want_unit
    if abs(got_bytes - want_bytes) < (1 << 19):
        return True
    whole = got.group(1).isdigit() and int(got.group(1)) >= 1
    return whole and got_unit > want_unit and int(got.group(1)) == int(want_bytes // got_unit)


class MpsControl:
    """Talks to the MPS control daemons of one host."""

    def __init__(self, binary: str | Path, root: Path, timeout: float = 10.0) -> None:
        self.binary = str(binary)
        self.root = Path(root)
        self.timeout = timeout

    def unavailable(self) -> str:
        """Why no daemon can be started here ("" when one can): the binary comes with the NVIDIA
        driver, and a node without it must not be offered MPS shares it would fail."""
        path = shutil.which(self.binary)
        if path is None or not os.path.isfile(path):
            return (f"MPS control binary {self.binary} not found: install the NVIDIA driver's "
                    "nvidia-cuda-mps-control or set mps_control_binary")
        return ""

    def paths(self, device_uuid: str) -> DaemonPaths:
        if not _UUID_RE.match(device_uuid):
            raise ValueError(f"device uuid {device_uuid!r} is not a GPU-/MIG- UUID")
        return DaemonPaths(device_uuid, self.root)

    def _env(self, paths: DaemonPaths) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
        env.update(CUDA_MPS_PIPE_DIRECTORY=str(paths.pipe_dir), CUDA_MPS_LOG_DIRECTORY=str(paths.log_dir),
                   CUDA_VISIBLE_DEVICES=paths.device_uuid)
        return env

    def command(self, device_uuid: str, *commands: str, timeout: float | None = None) -> str:
        """Send commands to a device's daemon; raises MpsError when it does not answer."""
        paths = self.paths(device_uuid)
        try:
            out = subprocess.run([self.binary], input="".join(c + "\n" for c in commands),
                                 env=self._env(paths), capture_output=True, text=True,
                                 timeout=timeout or self.timeout, cwd="/")
        except subprocess.TimeoutExpired as exc:
            raise MpsError(f"MPS control for {device_uuid} did not answer within {exc.timeout:g}s") from exc
        except OSError as exc:
            raise MpsError(f"cannot run MPS control binary {self.binary}: {exc}") from exc
        if out.returncode != 0:
            raise MpsError(f"MPS control for {device_uuid} failed (exit {out.returncode}): "
                           f"{(out.stderr or out.stdout).strip()[:300]}")
        return out.stdout

    def answers(self, device_uuid: str, timeout: float | None = None) -> bool:
        """True when the device's control pipe answers ``get_server_list``."""
        if not (self.paths(device_uuid).pipe_dir).is_dir():
            return False
        try:
            self.command(device_uuid, "get_server_list", timeout=timeout)
        except MpsError:
            return False
        return True

    def server_pids(self, device_uuid: str) -> list[int]:
        out = self.command(device_uuid, "get_server_list")
        return [int(w) for w in out.split() if w.isdigit()]

    def daemon_pid(self, device_uuid: str) -> int | None:
        """The control daemon's pid: from its pid file, else by scanning /proc for a process of
        our binary whose environment names this pipe directory. The pid file's pid must pass
        the same check: a crashed daemon leaves the file behind and its pid may be reused.
        Workloads name the pipe directory in their environment too: only a ``-d`` process of
        the control binary, owned by our uid, is the daemon."""
        paths = self.paths(device_uuid)
        needle = f"CUDA_MPS_PIPE_DIRECTORY={paths.pipe_dir}"
        name = os.path.basename(self.binary)
        with contextlib.suppress(OSError, ValueError):
            pid = int((paths.pipe_dir / PID_FILE).read_text().split()[0])
            if _alive(pid) and _is_daemon(pid, needle, name):
                return pid
        return _find_by_env(needle, name)

    def start(self, device_uuid: str, active_thread_percentage: float | None = None,
              pinned_mem_limit: int | None = None) -> int | None:
        """Start the device's daemon (no-op when it already answers); returns its pid. A daemon
        of this device that is alive but does not answer is ended first: never two at once.

        The limits become the daemon's defaults, i.e. the ceiling for every client of the
        next server (clients can only tighten them through their environment).
        """
        paths = self.paths(device_uuid)
        if not self.answers(device_uuid):
            stale = self.daemon_pid(device_uuid)
            if stale is not None:  # alive but unreachable (pipe directory deleted, or hung)
                self._end(stale, device_uuid, quit_sent=False)
            for d in (paths.pipe_dir, paths.log_dir):
                d.mkdir(parents=True, exist_ok=True)
                os.chmod(d, 0o755)  # workloads (any uid) must reach the pipe directory
            try:
                launch = subprocess.run([self.binary, "-d"], env=self._env(paths), capture_output=True,
                                        text=True, timeout=self.timeout, cwd="/")
            except (subprocess.TimeoutExpired, OSError) as exc:
                raise MpsError(f"cannot start MPS daemon for {device_uuid}: {exc}") from exc
            if launch.returncode != 0 and not self.answers(device_uuid):
                raise MpsError(f"MPS daemon for {device_uuid} did not start (exit {launch.returncode}): "
                               f"{(launch.stderr or launch.stdout).strip()[:300]}")
            deadline = time.monotonic() + self.timeout
            while not self.answers(device_uuid, timeout=max(0.5, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise MpsError(f"MPS daemon for {device_uuid} started but its control pipe "
                                   f"{paths.pipe_dir} did not answer within {self.timeout:g}s; "
                                   f"see {paths.log_dir}/control.log")
                time.sleep(0.05)
        self.set_limits(device_uuid, active_thread_percentage, pinned_mem_limit)
        return self.daemon_pid(device_uuid)

    def set_limits(self, device_uuid: str, active_thread_percentage: float | None,
                   pinned_mem_limit: int | None) -> None:
        """Daemon defaults (next server) and the same limits on servers already running.

        Defaults first, then the server list: a server that starts in between gets the new
        defaults, one that started before is in the list (listed first, it could get neither).
        The control binary exits 0 even when it rejects a ``set_*`` command, so every limit is
        read back; a limit the daemon did not take raises MpsError."""
        # (limit, device, value): memory limits are per device of the daemon (it sees one:
        # ordinal 0), SM shares are not
        wanted: list[tuple[str, str, str]] = []
        if active_thread_percentage is not None:
            wanted.append(("active_thread_percentage", "", f"{active_thread_percentage:g}"))
        if pinned_mem_limit:
            wanted.append(("device_pinned_mem_limit", "0", _mem_arg(pinned_mem_limit)))
        if not wanted:
            return
        self.command(device_uuid, *(_words(f"set_default_{n}", dev, v) for n, dev, v in wanted))
        pids = self.server_pids(device_uuid)
        commands = [_words(f"set_{n}", pid, dev, v) for pid in pids for n, dev, v in wanted]
        if commands:
            self.command(device_uuid, *commands)
        for n, dev, v in wanted:
            self._check_reads_back(device_uuid, _words(f"get_default_{n}", dev), v)
        for pid in pids:
            for n, dev, v in wanted:
                try:
                    self._check_reads_back(device_uuid, _words(f"get_{n}", pid, dev), v)
                except MpsError:
                    # A server that exited since the listing has no limits to check.
                    if pid in self.server_pids(device_uuid):
                        raise
                    break

    def _check_reads_back(self, device_uuid: str, query: str, expected: str) -> None:
        answer = self.command(device_uuid, query).strip()
        if not _same_limit(answer, expected):
            log = self.paths(device_uuid).log_dir / "control.log"
            raise MpsError(f"MPS daemon for {device_uuid} did not take the limit {expected}: "
                           f"'{query}' answers {answer[:200]!r}; see {log}")

    def stop(self, device_uuid: str) -> None:
        """Stop the device's daemon and remove its directories; verified, idempotent.

        The daemon is looked for even when its pipe directory is gone (an operator deleted it):
        the real daemon outlives it, unreachable, and a daemon started next would be a second
        one. Such a daemon cannot be told to quit: it is terminated at once."""
        paths = self.paths(device_uuid)
        pid = self.daemon_pid(device_uuid)
        quit_sent = False
        if self.answers(device_uuid):
            quit_sent = True
            with contextlib.suppress(MpsError):
                self.command(device_uuid, "quit")
        if pid is not None:
            self._end(pid, device_uuid, quit_sent)
        if self.answers(device_uuid, timeout=2):
            raise MpsError(f"MPS daemon for {device_uuid} still answers after quit")
        shutil.rmtree(paths.base, ignore_errors=True)
        if paths.base.exists():
            raise MpsError(f"cannot remove {paths.base}")

    def _end(self, pid: int, device_uuid: str, quit_sent: bool) -> None:
        """Wait for a daemon told to quit; one that does not obey (or could not be told) is
        terminated, then killed. Its servers die with it."""
        if _wait_gone(pid, self.timeout if quit_sent else 0):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not _wait_gone(pid, self.timeout / 2):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if not _wait_gone(pid, self.timeout / 2):
                raise MpsError(f"MPS daemon {pid} for {device_uuid} does not exit")

    def running_devices(self) -> list[str]:
        """Device UUIDs that have a directory under the root (daemon running or left over)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _UUID_RE.match(p.name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes (our own child not yet reaped).
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _is_daemon(pid: int, needle: str, binary_name: str) -> bool:
    """Is ``pid`` our uid's ``BINARY -d`` process whose environment holds ``needle`` (NAME=VALUE)?

    The binary is the program (``argv[0]``) or, for a script, its interpreter's first argument."""
    entry = Path(f"/proc/{pid}")
    try:
        if entry.stat().st_uid != os.getuid():
            return False
        environ = (entry / "environ").read_bytes()
        argv = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return False
    if argv[-1:] != [b"-d"] or binary_name.encode() not in {os.path.basename(a) for a in argv[:2]}:
        return False
    return (b"\0" + needle.encode() + b"\0") in (b"\0" + environ + b"\0")


def _find_by_env(needle: str, binary_name: str) -> int | None:
    for entry in Path("/proc").iterdir():
        pid = int(entry.name) if entry.name.isdigit() else 0
        if pid and _is_daemon(pid, needle, binary_name) and _alive(pid):
            return pid
    return None
