"""A stand-in for ``nvidia-cuda-mps-control`` on machines without a GPU.

It speaks the same command-line contract as the real program, so the node agent runs it by
path without knowing which one it got:

- ``standin -d``: daemonise (the launching process returns at once, like the real one),
  listen on ``$CUDA_MPS_PIPE_DIRECTORY/control``, write the daemon's pid to
  ``nvidia-cuda-mps-control.pid`` there and log to ``$CUDA_MPS_LOG_DIRECTORY/control.log``.
- ``standin`` (client mode): read commands from stdin, one per line, send them to the daemon
  of ``$CUDA_MPS_PIPE_DIRECTORY`` and print the answers; exit 1 when no daemon is running.

Commands: ``get_server_list``, ``start_server -uid U`` (forks a real, idle "server" child),
``get_client_list PID``, ``quit``, ``set/get_default_active_thread_percentage``,
``set/get_default_device_pinned_mem_limit DEV [VALUE]``, ``set/get_active_thread_percentage
PID [P]``, ``set/get_device_pinned_mem_limit PID DEV [VALUE]``.

It deliberately imports nothing from fastshare: it starts fast and stays standalone.

Unlike the real daemon, it exits once its pipe directory is deleted: nothing can reach it any
more, and tests and benchmarks that throw their directories away (or kill the agent) must not
leave stand-in daemons behind. With ``FASTSHARE_STANDIN_OUTLIVE_PIPE_DIR=1`` in its environment
it keeps running like the real one (for tests of an operator deleting the pipe directory).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import time

PID_FILE = "nvidia-cuda-mps-control.pid"
_ORPHAN_CHECK_S = 2.0
CONTROL = "control"
OUTLIVE_ENV = "FASTSHARE_STANDIN_OUTLIVE_PIPE_DIR"
_MEM_RE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)B?$", re.IGNORECASE)


def _dirs() -> tuple[str, str]:
    return (os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
            os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))


class _Daemon:
    """The control daemon's state: defaults for the next server and the running servers."""

    def __init__(self, log_dir: str) -> None:
        self.default_percentage = 100.0
        self.default_mem: dict[str, str] = {}
        self.servers: dict[int, dict[str, object]] = {}
        self.log = open(os.path.join(log_dir, "control.log"), "a", buffering=1)  # noqa: SIM115

    def note(self, text: str) -> None:
        self.log.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")

    def _server(self, pid: str) -> dict[str, object] | None:
        return self.servers.get(int(pid)) if pid.isdigit() else None

    def handle(self, line: str) -> tuple[str, bool]:
        """Returns (answer, quit?)."""
        words = line.split()
        if not words:
            return "", False
        self.note(f"Control: command {line}")
        cmd, args = words[0], words[1:]
        if cmd == "quit":
            return "", True
        if cmd == "get_server_list":
            return "\n".join(str(p) for p in sorted(self.servers)), False
        if cmd == "start_server" and len(args) == 2 and args[0] == "-uid" and args[1].isdigit():
            return self._start_server(), False
        if cmd == "get_client_list" and len(args) == 1:
            return ("" if self._server(args[0]) is not None else "Server not found"), False
        if cmd == "set_default_active_thread_percentage" and len(args) == 1:
            value = _percentage(args[0])
            if value is None:
                return "Invalid percentage", False
            self.default_percentage = value
            return f"{value:g}", False
        if cmd == "get_default_active_thread_percentage" and not args:
            return f"{self.default_percentage:g}", False
        if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
            if not args[0].isdigit() or not _MEM_RE.match(args[1]):
                return "Invalid device or memory limit", False
            self.default_mem[args[0]] = args[1].upper()
            return "", False
        if cmd == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.default_mem.get(args[0], "0"), False
        if cmd in ("set_active_thread_percentage", "set_device_pinned_mem_limit",
                   "get_active_thread_percentage", "get_device_pinned_mem_limit") and args:
            server = self._server(args[0])
            if server is None:
                return "Server not found", False
            return self._server_setting(server, cmd, args[1:]), False
        return "Unknown command", False

    def _start_server(self) -> str:
        pid = os.fork()
        if pid == 0:  # an idle server: real process, so "server gone" is observable
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                signal.pause()
        self.servers[pid] = {"percentage": self.default_percentage, "mem": dict(self.default_mem)}
        self.note(f"Control: starting server {pid}")
        return ""

    @staticmethod
    def _server_setting(server: dict[str, object], cmd: str, args: list[str]) -> str:
        mem = server["mem"]
        assert isinstance(mem, dict)
        if cmd == "get_active_thread_percentage" and not args:
            return f"{server['percentage']:g}"
        if cmd == "set_active_thread_percentage" and len(args) == 1:
            value = _percentage(args[0])
            if value is None:
                return "Invalid percentage"
            server["percentage"] = value
            return f"{value:g}"
        if cmd == "get_device_pinned_mem_limit" and len(args) == 1:
            return str(mem.get(args[0], "0"))
        if cmd == "set_device_pinned_mem_limit" and len(args) == 2 and _MEM_RE.match(args[1]):
            mem[args[0]] = args[1].upper()
            return ""
        return "Invalid arguments"

    def stop_servers(self) -> None:
        for pid in list(self.servers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.servers.clear()


def _percentage(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value <= 100 else None


def _exit_on_signal(_signum: int, _frame: object) -> None:
    raise SystemExit(0)  # unwinds through _serve's cleanup


def _serve(pipe_dir: str, log_dir: str) -> None:
    pipe_dir = os.path.abspath(pipe_dir)
    daemon = _Daemon(log_dir)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Relative path: pipe directories may be deeper than the 108-byte sun_path limit.
    os.chdir(pipe_dir)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(CONTROL)
    listener.bind(CONTROL)
    listener.listen(16)
    tmp = f".{PID_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, PID_FILE)
    daemon.note(f"Control: daemon started, pid {os.getpid()}")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    listener.settimeout(_ORPHAN_CHECK_S)
    outlive = os.environ.get(OUTLIVE_ENV) == "1"
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                if not outlive and not os.path.isdir(pipe_dir):
                    break          # orphaned: its directory (and control socket) are gone
                continue
            conn.settimeout(None)
            with conn, conn.makefile("rw") as stream:
                stop = False
                for line in stream:
                    answer, stop = daemon.handle(line.strip())
                    stream.write(answer + "\n\0\n")  # \0 line: end of one answer
                    stream.flush()
                    if stop:
                        break
            if stop:
                break
    finally:
        daemon.stop_servers()
        daemon.note("Control: exiting")
        for name in (CONTROL, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(pipe_dir, name))


def _connect(pipe_dir: str) -> socket.socket | None:
    try:
        os.chdir(pipe_dir)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(CONTROL)
        return sock
    except OSError:
        return None


def _daemonise(pipe_dir: str, log_dir: str) -> int:
    for path in (pipe_dir, log_dir):
        if not os.path.isdir(path):
            print(f"{path} does not exist", file=sys.stderr)
            return 1
    probe = _connect(pipe_dir)
    if probe is not None:
        probe.close()
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    if os.fork() > 0:
        return 0  # like the real -d: return before the daemon is ready
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        _serve(pipe_dir, log_dir)
    finally:
        os._exit(0)


def _client(pipe_dir: str) -> int:
    sock = _connect(pipe_dir)
    if sock is None:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    with sock, sock.makefile("rw") as stream:
        for line in sys.stdin:
            if not line.strip():
                continue
            stream.write(line.strip() + "\n")
            stream.flush()
            answer = []
            for reply in stream:
                if reply == "\0\n":
                    break
                answer.append(reply)
            text = "".join(answer).rstrip("\n")
            if text:
                print(text)
            if line.strip() == "quit":
                break
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pipe_dir, log_dir = _dirs()
    if argv == ["-d"]:
        return _daemonise(pipe_dir, log_dir)
    if argv:
        print(f"usage: nvidia-cuda-mps-control [-d]; unknown argument {argv[0]!r}", file=sys.stderr)
        return 1
    return _client(pipe_dir)


if __name__ == "__main__":
    sys.exit(main())
