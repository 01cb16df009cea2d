"""Real processes on loopback: a CA, a controller (`fastshare controller serve`), node agents on
simulated machines, and clients over mTLS. No mocks."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from chaos_invariants import AgentHoldings, GpuLoad, Records, ownership_problems
from chaos_invariants import capacity_problems as check_capacity

from fastshare.controller.client import Client, ClientConfig
from fastshare.device import simnvml
from fastshare.security import certs
from fastshare.security.tls import TlsPaths, mtls_channel
from fastshare.v1 import agent_pb2, agent_pb2_grpc, common_pb2
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
        self.issue("controller", role="controller")
        self.issue("client", role="client")

    def issue(self, name: str, role: str = "node") -> Path:
        """A certificate in the shared directory; node agents' by default."""
        certs.issue(self.ca, name, self.dir, sans=["127.0.0.1", "localhost"], role=role)
        return self.dir


class Proc:
    """A child process with its log file; stopped (and reaped) at teardown."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log = log
        self._log = open(log, "ab")  # noqa: SIM115 - lives as long as the process
        # PYTHONFAULTHANDLER: a child that does not stop in time dumps its threads' stacks (SIGABRT)
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},
                                      start_new_session=True)

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
            except subprocess.TimeoutExpired:   # its stacks into its log first, for the failure
                self.popen.send_signal(signal.SIGABRT)
                try:
                    self.popen.wait(timeout=5)
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
                "10", "--reconcile-interval", "2", "--agent-deadline", "10", "--log-level", "info", *extra]
        super().__init__(args, root / f"controller-{port}-{time.monotonic_ns()}.log", env)


class AgentProc(Proc):
    """`fastshare node serve` on a simulated machine, registering with the cluster's controller."""

    def __init__(self, cluster: Cluster, name: str, port: int, env: dict[str, str] | None = None,
                 extra: dict[str, object] | None = None) -> None:
        self.name = name
        self.port = port
        self.address = f"127.0.0.1:{port}"
        short = cluster.short / name
        # The same port range on every restart of this agent, a different one per agent.
        slot = list(cluster.agents).index(name) if name in cluster.agents else len(cluster.agents)
        config = {
            "node_name": name, "listen": self.address, "unix_socket": str(short / "node.sock"),
            "state_dir": str(cluster.root / f"{name}-state"), "run_dir": str(short / "run"),
            "device_backend": "sim", "sim_state": str(cluster.root / f"{name}.json"),
            "mps_control_binary": str(Path(fastshare_bin()).parent / "fastshare-mps-standin"),
            "metrics_listen": "", "mps_timeout_s": 30, "controller_address": cluster.address,
            "share_ports": f"{20000 + 100 * slot}-{20099 + 100 * slot}",
            "tls": {"cert": str(cluster.pki.dir / f"{name}.crt"), "key": str(cluster.pki.dir / f"{name}.key"),
                    "ca": str(cluster.pki.dir / "ca.crt")}}
        path = cluster.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**config, **(extra or {})}))
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")}
        super().__init__([fastshare_bin(), "node", "serve", "--config", str(path)],
                         cluster.root / f"{name}.log", {**child_env, **(env or {})})

    def stub(self, pki: Pki) -> agent_pb2_grpc.NodeAgentStub:
        """Direct mTLS access to the agent (as the controller), to look behind the controller's back."""
        channel = mtls_channel(self.address, TlsPaths.in_dir(pki.dir, "controller"), server_name=self.name)
        return agent_pb2_grpc.NodeAgentStub(channel)

    def share_ids(self, pki: Pki) -> set[str]:
        inventory = self.stub(pki).GetInventory(agent_pb2.GetInventoryRequest(), timeout=30)
        return {s.id for s in inventory.shares}


class Cluster:
    """What a test needs: PKI, one controller (restartable), agents, clients."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.short = Path(tempfile.mkdtemp(prefix="fsc-", dir="/tmp"))  # unix sockets need short paths
        self.pki = Pki(root)
        self.port = free_port()
        self.state_dir = root / "controller-state"
        self.controller: ControllerProc | None = None
        self.procs: list[Proc] = []
        self.clients: list[Client] = []
        self.agents: dict[str, AgentProc] = {}

    def add_machine(self, name: str, models: list[str], mig_enabled: bool = False) -> None:
        simnvml.create_machine(self.root / f"{name}.json", models, mig_enabled=mig_enabled)
        self.pki.issue(name)

    def start_agent(self, name: str, port: int | None = None, wait: bool = True,
                    env: dict[str, str] | None = None, config: dict[str, object] | None = None) -> AgentProc:
        """``config``: node.yaml settings over the test defaults."""
        old = self.agents.get(name)
        agent = AgentProc(self, name, port or (old.port if old else free_port()), env, config)
        self.procs.append(agent)
        self.agents[name] = agent
        if wait:
            self.wait_node(name, available=True)
        return agent

    def status(self) -> pb.ClusterStatus:
        return self.client().call("Status", pb.ClusterStatusRequest(include_finished=True))

    def node(self, name: str) -> pb.NodeStatus | None:
        return next((n for n in self.status().nodes if n.name == name), None)

    def wait_node(self, name: str, available: bool, timeout: float = 90) -> None:
        def check() -> bool:
            agent = self.agents.get(name)
            if available and agent is not None and not agent.alive():
                raise AssertionError(f"agent {name} exited:\n{agent.output()}")
            node = self.node(name)
            return node is not None and node.available == available
        wait_for(check, timeout, f"node {name} available={available}")

    def wait_taken_in(self, name: str, timeout: float = 60) -> None:
        """Until the pass the node's registration started has ended: a test changing the node
        behind the controller's back must not race that pass's read of the node."""
        wait_for(lambda: self.registration_passes(name) > 0, timeout,
                 f"the pass node {name}'s registration started")

    def registration_passes(self, name: str) -> int:
        """How many passes of registrations took node ``name`` in (from the controller's log)."""
        count = 0
        for line in self.controller.output().splitlines():
            before, found, _ = line.partition(" reconciled after registering")
            count += bool(found) and name in re.sub(r"^.*\bnodes? ", "", before).split(", ")
        return count

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
        _stop_mps_standins(self.short)
        shutil.rmtree(self.short, ignore_errors=True)


def _stop_mps_standins(root: Path) -> None:
    """A failed test must not leave MPS stand-in daemons behind (agents stop theirs on release)."""
    from fastshare.mps.control import MpsControl

    standin = str(Path(fastshare_bin()).parent / "fastshare-mps-standin")
    for mps_root in root.glob("*/run/mps"):
        control = MpsControl(standin, mps_root, timeout=10)
        for uuid in control.running_devices():
            control.stop(uuid)


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


def assert_consistent(cluster: Cluster) -> None:
    """The crash-safety invariant, checked against the agents themselves:
    every allocation is active AND present on its agent, or finished AND absent from it;
    no agent holds a controller share nobody records; no GPU is over capacity."""
    status = cluster.status()
    records = Records()
    for a in status.allocations:
        if a.state == pb.ALLOCATION_STATE_ACTIVE:
            records.active[a.id] = a.node
        else:
            assert a.state in (pb.ALLOCATION_STATE_RELEASED, pb.ALLOCATION_STATE_FAILED), \
                f"{a.id} is stuck in {pb.AllocationState.Name(a.state)}"
            records.finished[a.id] = a.node
    holdings = [AgentHoldings(name, frozenset(agent.share_ids(cluster.pki)))
                for name, agent in cluster.agents.items()]
    problems = ownership_problems(records, holdings, prefix="fs-") + capacity_problems(status)
    assert not problems, problems


def capacity_problems(status: pb.ClusterStatus) -> list[str]:
    """The shared capacity invariant on the controller's own view of every GPU."""
    return check_capacity(
        GpuLoad(where=f"{node.name} GPU {gpu.index}", memory_capacity=gpu.memory_bytes,
                sm_percent=gpu.sm_percent_used, memory_bytes=gpu.memory_bytes_used,
                quota_request=gpu.quota_request_used, memory_slices=gpu.memory_slices,
                mig_slices=tuple((s.mig_start, s.mig_size) for s in gpu.mig_slices))
        for node in status.nodes for gpu in node.gpus)


def states(cluster: Cluster) -> dict[str, str]:
    return {a.id: pb.AllocationState.Name(a.state).removeprefix("ALLOCATION_STATE_").lower()
            for a in cluster.status().allocations}
