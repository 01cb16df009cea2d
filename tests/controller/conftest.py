"""Real processes on loopback: a CA, a controller (`fastshare controller serve`), node agents on
simulated machines, and clients over mTLS. No mocks."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from fastshare.controller.client import Client, ClientConfig
from fastshare.security import certs
from fastshare.v1 import common_pb2
from fastshare.v1 import controller_pb2 as pb

GiB = 1024**3
KINDS = {"fastpod": common_pb2.SHARE_KIND_FASTPOD, "mps": common_pb2.SHARE_KIND_MPS,
         "exclusive": common_pb2.SHARE_KIND_EXCLUSIVE, "whole": common_pb2.SHARE_KIND_WHOLE}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> object:
    """Poll until ``condition()`` is truthy (generous: the CI machine is slow and shared)."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:   # the thing we wait for may raise until it is ready
            last_exc = exc
        time.sleep(0.2)
    detail = f": {last_exc}" if last_exc else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{detail}")


def fastshare_bin() -> str:
    found = shutil.which("fastshare") or str(Path(sys.executable).parent / "fastshare")
    return found


class Pki:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = root / "ca"
        self.dir = root / "pki"
        certs.init_ca(self.ca)
        for name in ("controller", "client"):
            self.issue(name)

    def issue(self, name: str) -> Path:
        certs.issue(self.ca, name, self.dir, sans=["127.0.0.1", "localhost"])
        return self.dir


class Proc:
    """A child process with its log file; stopped (and reaped) at teardown."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log = log
        self._log = open(log, "ab")  # noqa: SIM115 - lives as long as the process
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                      env={**os.environ, **(env or {})}, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self._log.close()
        return self.popen.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class ControllerProc(Proc):
    def __init__(self, root: Path, pki: Pki, port: int, state_dir: Path, extra: list[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.state_dir = state_dir
        args = [fastshare_bin(), "controller", "serve", "--state-dir", str(state_dir), "--tls-dir",
                str(pki.dir), "--listen", self.address, "--heartbeat-interval", "1", "--heartbeat-timeout",
                "4", "--reconcile-interval", "2", "--agent-deadline", "10", "--log-level", "info", *extra]
        super().__init__(args, root / f"controller-{port}-{time.monotonic_ns()}.log", env)


class Cluster:
    """What a test needs: PKI, one controller (restartable), agents, clients."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pki = Pki(root)
        self.port = free_port()
        self.state_dir = root / "controller-state"
        self.controller: ControllerProc | None = None
        self.procs: list[Proc] = []
        self.clients: list[Client] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_controller(self, env: dict[str, str] | None = None, extra: list[str] = (),
                         wait: bool = True) -> ControllerProc:
        proc = ControllerProc(self.root, self.pki, self.port, self.state_dir, list(extra), env)
        self.procs.append(proc)
        self.controller = proc
        if wait:
            wait_for(lambda: self._pings(proc), 60, f"controller on {self.address}\n{proc.output()}")
        return proc

    def _pings(self, proc: Proc) -> bool:
        if not proc.alive():
            raise AssertionError(f"controller exited: {proc.output()}")
        try:
            self.client().call("Ping", common_pb2.Empty(), timeout=2)
            return True
        except grpc.RpcError:
            return False

    def client(self, **kw) -> Client:
        config = ClientConfig(address=self.address, tls_dir=self.pki.dir, **kw)
        client = Client(config)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


def spec(kind: str, **kw) -> pb.AllocationSpec:
    return pb.AllocationSpec(kind=KINDS[kind], **kw)


def allocate(client: Client, kind: str, key: str = "", owner: str = "test", ttl: int = 0,
             **kw) -> pb.Allocation:
    return client.call("Allocate", pb.AllocateRequest(spec=spec(kind, **kw), owner=owner,
                                                      idempotency_key=key, lease_ttl_seconds=ttl))
