"""A real node agent process for the tests: simulated NVML machine, MPS stand-in, real gRPC on
loopback (mTLS + read-only TLS) and a unix socket, readiness through $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import yaml

from fastshare.device import open_devices, simnvml
from fastshare.mps.control import MpsControl
from fastshare.node.agent import Agent
from fastshare.node.client import channel
from fastshare.node.config import NodeConfig
from fastshare.node.journal import Journal
from fastshare.security import certs as pki
from fastshare.security.tls import TlsPaths
from fastshare.v1 import agent_pb2, agent_pb2_grpc, common_pb2

BIN = Path(sys.executable).parent
STANDIN = str(BIN / "fastshare-mps-standin")
START_TIMEOUT = 90  # slow, shared CPU: generous, but a hung start still fails
GPU_MIG, GPU_A, GPU_B = 0, 1, 2  # H100 (MIG on), two V100 (no MIG)


@pytest.fixture(scope="session")
def pki_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root / "ca")
    pki.init_ca(root / "other-ca")
    pki.issue(root / "ca", "node-1", root / "server", sans=["127.0.0.1", "localhost"], role="node", days=1)
    pki.issue(root / "ca", "controller", root / "controller", role="controller", days=1)
    pki.issue(root / "ca", "stranger", root / "stranger", role="client", days=1)
    pki.issue(root / "other-ca", "controller", root / "intruder", role="controller", days=1)
    return root


class AgentProcess:
    """`fastshare node serve` as a child process, restartable on the same state."""

    def __init__(self, workdir: Path, rundir: Path, pki_root: Path, sim_state: Path) -> None:
        self.workdir, self.rundir, self.pki, self.sim_state = workdir, rundir, pki_root, sim_state
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.settings: dict = {"reconcile_interval_s": 3600}
        self.log = workdir / "agent.log"

    @property
    def unix_socket(self) -> str:
        return str(self.rundir / "node.sock")

    def start(self, env: dict[str, str] | None = None, wait_ready: bool = True) -> AgentProcess:
        config = self.workdir / "node.yaml"
        config.write_text(yaml.safe_dump({
            "node_name": "node-1", "listen": "127.0.0.1:0", "readonly_listen": "127.0.0.1:0",
            "unix_socket": self.unix_socket, "state_dir": str(self.workdir / "state"),
            "run_dir": str(self.rundir), "device_backend": "sim", "sim_state": str(self.sim_state),
            "mps_control_binary": STANDIN, "metrics_listen": "127.0.0.1:0", "mps_timeout_s": 30,
            "tls": {"cert": str(self.pki / "server/node-1.crt"), "key": str(self.pki / "server/node-1.key"),
                    "ca": str(self.pki / "server/ca.crt")},
            **self.settings}))
        self.notified: list[str] = []   # what the agent told systemd ($NOTIFY_SOCKET) until ready
        notify_path = str(self.rundir / "notify")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if os.path.exists(notify_path):
            os.unlink(notify_path)
        notify.bind(notify_path)
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")}
        child_env.update(PATH=f"{BIN}:{os.environ.get('PATH', '')}", NOTIFY_SOCKET=notify_path,
                         FASTSHARE_LOG_LEVEL="DEBUG", **(env or {}))
        with open(self.log, "a") as log:
            log.write(f"---- start {time.strftime('%H:%M:%S')} env={env}\n")
            log.flush()
            self.proc = subprocess.Popen([str(BIN / "fastshare"), "node", "serve", "--config", str(config)],
                                         env=child_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if wait_ready:
                self.ports = self._wait_ready(notify)
        finally:
            notify.close()
        return self

    def _wait_ready(self, notify: socket.socket) -> dict[str, int]:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            notify.settimeout(0.5)
            try:
                message = notify.recv(4096).decode()
            except TimeoutError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"agent exited with {self.proc.returncode}:\n"
                                       f"{self.log.read_text()}") from None
                continue
            self.notified.append(message)
            fields = dict(line.split("=", 1) for line in message.splitlines() if "=" in line)
            if fields.get("READY") == "1":
                status = fields["STATUS"].removeprefix("serving ")
                return {k: int(v) for k, v in (item.split("=") for item in status.split(", "))}
        raise RuntimeError(f"agent not ready after {START_TIMEOUT}s:\n{self.log.read_text()}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def wait_exit(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    # clients -------------------------------------------------------------------------------

    def unix(self) -> agent_pb2_grpc.NodeAgentStub:
        return agent_pb2_grpc.NodeAgentStub(channel(unix_socket=self.unix_socket))

    def mtls(self, who: str = "controller") -> agent_pb2_grpc.NodeAgentStub:
        paths = TlsPaths.in_dir(self.pki / who, "controller" if who == "intruder" else who)
        if who == "intruder":  # trusts our CA (to reach the handshake) but its cert is foreign
            paths = TlsPaths(paths.cert, paths.key, self.pki / "ca" / "ca.crt")
        return agent_pb2_grpc.NodeAgentStub(channel(f"127.0.0.1:{self.ports['listen']}", tls=paths))

    def no_client_cert(self, port: str = "listen") -> agent_pb2_grpc.NodeAgentStub:
        return agent_pb2_grpc.NodeAgentStub(channel(f"127.0.0.1:{self.ports[port]}",
                                                    ca=self.pki / "ca" / "ca.crt"))


@pytest.fixture
def sim_machine(tmp_path):
    path = tmp_path / "machine.json"
    simnvml.create_machine(path, ["H100-SXM5-80GB", "V100-SXM2-32GB", "V100-SXM2-32GB"], mig_enabled=True)
    return path


@pytest.fixture
def devices(sim_machine):
    devs = open_devices("sim", sim_machine)
    yield devs
    devs.close()


@pytest.fixture
def agent(tmp_path, pki_dir, sim_machine):
    # Short run dir: a unix socket path must fit in 108 bytes.
    rundir = Path(tempfile.mkdtemp(prefix="fsn-", dir="/tmp"))
    proc = AgentProcess(tmp_path, rundir, pki_dir, sim_machine)
    yield proc
    proc.stop()
    _stop_leftover_daemons(rundir / "mps")
    shutil.rmtree(rundir, ignore_errors=True)


def _stop_leftover_daemons(mps_root: Path) -> None:
    """A test that fails midway must not leave MPS stand-in daemons behind."""
    from fastshare.mps.control import MpsControl

    control = MpsControl(STANDIN, mps_root, timeout=10)
    for uuid in control.running_devices():
        control.stop(uuid)


def share(share_id: str, kind: str, devices: list[str], **fields) -> agent_pb2.PrepareShareRequest:
    kinds = {"fastpod": common_pb2.SHARE_KIND_FASTPOD, "mps": common_pb2.SHARE_KIND_MPS,
             "exclusive": common_pb2.SHARE_KIND_EXCLUSIVE, "whole": common_pb2.SHARE_KIND_WHOLE}
    return agent_pb2.PrepareShareRequest(share=agent_pb2.Share(id=share_id, kind=kinds[kind],
                                                               device_uuids=devices, **fields))


def fastpod(share_id: str, device: str, sm: int = 20, mem_gib: float = 2, req: float = 0.2,
            lim: float = 0.5) -> agent_pb2.PrepareShareRequest:
    return share(share_id, "fastpod", [device], sm_percent=sm, memory_bytes=int(mem_gib * (1 << 30)),
                 quota_request=req, quota_limit=lim)


def rpc_error(fn, *args) -> grpc.RpcError:
    try:
        fn(*args, timeout=60)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"{fn} succeeded; expected an error")


def wait_for(predicate, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout}s")


def in_process_agent(work: Path, run: Path, machine: Path) -> Agent:
    """An agent object without its gRPC service, on ``machine``, reconciled as at start: for tests
    that force an interleaving or a failure between its own steps."""
    cfg = NodeConfig(node_name="p", unix_socket="", state_dir=str(work / "state"), run_dir=str(run),
                     device_backend="sim", sim_state=str(machine), mps_control_binary=STANDIN,
                     mps_timeout_s=30)
    agent = Agent(cfg, open_devices("sim", machine), MpsControl(STANDIN, cfg.mps_root, timeout=30),
                  Journal(cfg.journal_path))
    agent.reconcile()
    return agent
