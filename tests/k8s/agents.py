"""Real node agents (`fastshare node serve`) on simulated GPU machines for the k8s tests, each with a
Node object that points at it (endpoint annotation), and a stand-in for the kubelet, which this
test cluster does not have: it marks Pods Ready and finishes their deletion."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml
from kubernetes import client

from fastshare.controller.agent_client import AgentClient, AgentError, AgentTarget
from fastshare.device import simnvml
from fastshare.k8s.controller import ENDPOINT_ANNOTATION
from fastshare.security import certs
from fastshare.security.tls import TlsPaths

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    def __init__(self, root: Path, ca: Path, name: str, models: list[str], mig: bool) -> None:
        self.name, self.root = name, root / name
        self.root.mkdir(parents=True)
        certs.issue(ca, name, self.root / "pki", sans=["127.0.0.1", "localhost"], role="node", days=1)
        self.machine = self.root / "machine.json"
        simnvml.create_machine(self.machine, models, mig_enabled=mig)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.settings: dict = {}   # node.yaml settings over the defaults below

    def start(self, controller_tls: TlsPaths) -> None:
        config = self.root / "node.yaml"
        config.write_text(yaml.safe_dump({
            "node_name": self.name, "listen": self.address, "unix_socket": str(self.root / "node.sock"),
            "state_dir": str(self.root / "state"), "run_dir": str(self.root / "run"), "device_backend": "sim",
            "sim_state": str(self.machine), "mps_control_binary": str(BIN / "fastshare-mps-standin"),
            "metrics_listen": "127.0.0.1:0", "mps_timeout_s": 30, "reconcile_interval_s": 3600,
            "tls": {"cert": str(self.root / "pki" / f"{self.name}.crt"),
                    "key": str(self.root / "pki" / f"{self.name}.key"),
                    "ca": str(self.root / "pki" / "ca.crt")},
            **self.settings,
        }))
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")}
        env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
        with open(self.root / "agent.log", "ab") as log:
            args = [str(BIN / "fastshare"), "node", "serve", "--config", str(config)]
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        probe = AgentClient(AgentTarget(self.name, self.address), controller_tls, deadline=5)
        deadline = time.monotonic() + 90
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"agent {self.name} exited:\n{(self.root / 'agent.log').read_text()}")
                try:
                    probe.ping()
                    return
                except AgentError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"agent {self.name} not ready:\n"
                                           f"{(self.root / 'agent.log').read_text()}") from None
                    time.sleep(0.3)
        finally:
            probe.close()

    def shares(self, controller_tls: TlsPaths) -> list[str]:
        probe = AgentClient(AgentTarget(self.name, self.address), controller_tls, deadline=10)
        try:
            return sorted(s.id for s in probe.inventory().shares)
        finally:
            probe.close()

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def start_controller(kubeconfig: Path, namespace: str, tls_dir: Path, identity: str, log: Path,
                     *extra: str) -> subprocess.Popen:
    """`fastshare k8s controller` as a real process (its own session, for kill -9), serving and
    electing its leader in ``namespace``, with a short Lease so that take-overs are quick. The
    node-certificate service is off (several controllers share this host's ports; the agents
    here have certificates issued by hand; tests/k8s/test_node_bootstrap.py covers it)."""
    args = [str(BIN / "fastshare"), "k8s", "controller", "--kubeconfig", str(kubeconfig), "--namespace",
            namespace, "--lease-namespace", namespace, "--identity", identity, "--tls-dir", str(tls_dir),
            "--lease-duration", "3", "--node-interval", "0.5", "--api-port", "0", *extra]
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


NODE_ALLOCATABLE = {"cpu": "64", "memory": "256Gi", "pods": "110"}


def register_node(core: client.CoreV1Api, agent: Agent) -> None:
    """A Node for ``agent``, as a kubelet and the node lifecycle controller would leave it: Ready,
    its allocatable reported, and without the not-ready taint the API server puts on a new Node
    (the controller, like the scheduler, keeps replicas off not-ready nodes)."""
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(
        name=agent.name, labels={"fastshare.io/gpu": "true"},
        annotations={ENDPOINT_ANNOTATION: agent.address})))
    core.patch_node(agent.name, {"spec": {"taints": []}})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_node_status(agent.name, {"status": {
        "allocatable": NODE_ALLOCATABLE, "capacity": NODE_ALLOCATABLE,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}]}})


def kubelet_step(core: client.CoreV1Api, namespace: str) -> None:
    """What kubelets would do: report bound Pods Running+Ready, finish deletions (grace 0)."""
    for pod in core.list_namespaced_pod(namespace).items:
        if pod.metadata.deletion_timestamp:
            try:
                core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        elif pod.spec.node_name and (pod.status.phase != "Running"):
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}})


def started_agent(core: client.CoreV1Api, pki: tuple[Path, TlsPaths], prefix: str, models: list[str],
                  mig: bool = False, settings: dict | None = None) -> Agent:
    """A node agent on a simulated machine of its own (named ``prefix-XXXX``), started and
    registered as a Ready GPU Node; ``settings``: node.yaml settings over the defaults."""
    root, tls = pki
    agent = Agent(root, root / "ca", f"{prefix}-{uuid.uuid4().hex[:4]}", models, mig=mig)
    agent.settings.update(settings or {})
    agent.start(tls)
    register_node(core, agent)
    return agent
