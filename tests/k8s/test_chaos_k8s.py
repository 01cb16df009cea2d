"""Chaos, Kubernetes mode: two `fastshare k8s controller` processes (Lease leader election) and
two node agents (real processes, simulated GPUs) serve a seeded stream of FastPod creates,
scales and deletes from 4 concurrent clients against a real API server, while a chaos thread
SIGKILLs the leader, the standby or an agent and restarts it (a new identity each time, so
every leader kill is a real leader change).

Checked with the same plain-data invariants as the standalone chaos test
(tests/chaos_invariants.py), on what is observable only (so that it holds whatever the
controller's storage): every observation of the agents' own inventories (twice a second)
has no GPU over its SM %, memory or quota, no overlapping MIG slices and no whole GPU that
is also shared, and no allocation is held by two live Pods; every request is answered (a
create or scale gets a Scheduled condition for its generation, a delete completes); at the
end, with everything back, the live Pods' allocations are exactly the agents' shares (none
both active and released, no orphan), no MIG instance or MPS daemon without an owner, and
after every FastPod is deleted the agents hold nothing.

    FASTSHARE_K8S_CHAOS_OPS=300 make pytest PYTEST_ARGS='tests/k8s/test_chaos_k8s.py -s'
(CI runs 40 operations; the seed is FASTSHARE_CHAOS_SEED, default 7.)
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest
from chaos_invariants import (
    Records,
    agent_gpu_loads,
    agent_holdings,
    capacity_problems,
    leftovers,
    ownership_problems,
    p50_p99,
    run_problems,
)
from kubernetes import client

from fastshare.controller.agent_client import AgentClient, AgentError, AgentTarget
from fastshare.k8s.pods import ALLOCATION_ANNOTATION, FASTPOD_LABEL
from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.security import certs
from fastshare.security.tls import TlsPaths

from .agents import Agent, kubelet_step, register_node, start_controller
from .conftest import wait_for

OPS = int(os.environ.get("FASTSHARE_K8S_CHAOS_OPS", "40"))
SEED = int(os.environ.get("FASTSHARE_CHAOS_SEED", "7"))
CLIENTS = 4
ANSWER_TIMEOUT = 120.0
LEASE = "fastshare-controller"

pytestmark = [pytest.mark.timeout(2400)]


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    issued: int = 0
    ops: dict[str, int] = field(default_factory=lambda: {"create": 0, "scale": 0, "delete": 0})
    answers: dict[str, int] = field(default_factory=dict)
    unanswered: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    kills: dict[str, int] = field(default_factory=lambda: {"leader": 0, "standby": 0, "agent": 0})
    recoveries: int = 0
    leaders: list[str] = field(default_factory=list)
    observations: int = 0
    violations: list[str] = field(default_factory=list)

    def take(self) -> bool:
        with self.lock:
            if self.issued >= OPS:
                return False
            self.issued += 1
            return True


class Cluster:
    """The processes under test and what the test looks at."""

    def __init__(self, control_plane, api_client, namespace: str, root, agents: dict[str, Agent], tls_dir,
                 tls: TlsPaths) -> None:
        self.plane, self.namespace, self.root = control_plane, namespace, root
        self.agents, self.tls_dir, self.tls = agents, tls_dir, tls
        self.core = client.CoreV1Api(api_client)
        self.objects = client.CustomObjectsApi(api_client)
        self.leases = client.CoordinationV1Api(api_client)
        self.controllers: dict[str, object] = {}   # identity -> Popen
        self.starts = 0
        self.lock = threading.Lock()

    def start_controller(self) -> str:
        with self.lock:
            self.starts += 1
            identity = f"ctl-{self.starts}"
        self.controllers[identity] = start_controller(self.plane.kubeconfig, self.namespace, self.tls_dir,
                                                      identity, self.root / f"{identity}.log")
        return identity

    def kill_controller(self, identity: str) -> None:
        proc = self.controllers.pop(identity)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def holder(self) -> str | None:
        try:
            return self.leases.read_namespaced_lease(LEASE, self.namespace).spec.holder_identity
        except client.ApiException:
            return None

    def inventory(self, agent: Agent):
        probe = AgentClient(AgentTarget(agent.name, agent.address), self.tls, deadline=5)
        try:
            return probe.inventory()
        finally:
            probe.close()

    def holdings(self) -> list:
        return [agent_holdings(a.name, self.inventory(a)) for a in self.agents.values()]

    def fastpods(self) -> list[dict]:
        return self.objects.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)["items"]

    def live_pods(self) -> list:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=FASTPOD_LABEL).items
        return [p for p in pods if not p.metadata.deletion_timestamp]

    def fastpod(self, name: str) -> dict | None:
        try:
            return self.objects.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def answer(self, name: str, generation: int) -> dict | None:
        """The Scheduled condition written for ``generation`` (or a later one), if any yet."""
        fp = self.fastpod(name)
        status = (fp or {}).get("status") or {}
        if fp is None or status.get("observedGeneration", 0) < generation:
            return None
        return next((c for c in status.get("conditions") or [] if c["type"] == "Scheduled"), None)


def random_gpu(rng: random.Random) -> dict:
    kind = rng.choices(["fastpod", "mps", "exclusive", "whole"], weights=[40, 25, 25, 10])[0]
    if kind == "fastpod":
        q = rng.choice([0.1, 0.2, 0.3])
        return {"kind": kind, "smPercent": rng.choice([10, 20, 30]), "memory": f"{rng.choice([1, 2, 4])}Gi",
                "quotaRequest": q, "quotaLimit": q * 2}
    if kind == "mps":
        return {"kind": kind, "memory": f"{rng.choice([1, 2, 4, 8])}Gi"}
    if kind == "exclusive":
        return {"kind": kind, "migProfile": rng.choice(["1g.10gb", "2g.20gb", "3g.40gb"])}
    return {"kind": kind, "count": 1}


def _wait_answer(cluster: Cluster, tally: Tally, what: str, check) -> None:
    started = time.monotonic()
    deadline = started + ANSWER_TIMEOUT
    while time.monotonic() < deadline:
        try:
            result = check()
        except client.ApiException:
            result = None
        if result:
            with tally.lock:
                tally.latencies.append(time.monotonic() - started)
                key = result if isinstance(result, str) else "answered"
                tally.answers[key] = tally.answers.get(key, 0) + 1
            return
        time.sleep(0.2)
    with tally.lock:
        tally.unanswered.append(what)


def client_loop(cluster: Cluster, tally: Tally, n: int) -> None:
    rng = random.Random(SEED * 1000 + n)
    mine: list[str] = []
    count = 0
    while tally.take():
        time.sleep(rng.uniform(0.2, 1.0))
        op = "create" if not mine else rng.choices(["create", "scale", "delete"], weights=[3, 3, 4])[0]
        if op == "create" and len(mine) >= 3:
            op = "delete"
        with tally.lock:
            tally.ops[op] += 1
        if op == "create":
            count += 1
            name = f"c{n}-{count}"
            cluster.objects.create_namespaced_custom_object(
                GROUP, VERSION, cluster.namespace, PLURAL,
                fastpod_manifest(name, random_gpu(rng), replicas=rng.choice([1, 1, 2])))
            mine.append(name)
            _wait_answer(cluster, tally, f"create {name}", lambda name=name: _reason(cluster.answer(name, 1)))
        elif op == "scale":
            name = rng.choice(mine)
            body = {"spec": {"replicas": rng.choice([0, 1, 2, 3])}}
            patched = cluster.objects.patch_namespaced_custom_object(GROUP, VERSION, cluster.namespace,
                                                                     PLURAL, name, body)
            generation = patched["metadata"]["generation"]
            _wait_answer(cluster, tally, f"scale {name} (generation {generation})",
                         lambda name=name, g=generation: _reason(cluster.answer(name, g)))
        else:
            name = mine.pop(rng.randrange(len(mine)))
            cluster.objects.delete_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL, name)
            _wait_answer(cluster, tally, f"delete {name}", lambda name=name: cluster.fastpod(name) is None and
                         "deleted")


def _reason(condition: dict | None) -> str | None:
    if condition is None or not condition.get("message"):
        return None
    return "placed" if condition["status"] == "True" else f"not placed: {condition['reason']}"


def chaos_loop(cluster: Cluster, tally: Tally, stop: threading.Event) -> None:
    rng = random.Random(SEED)
    while not stop.wait(rng.uniform(2.0, 5.0)):
        victim = rng.choices(["leader", "standby", "agent"], weights=[5, 2, 3])[0]
        if victim == "agent":
            agent = cluster.agents[rng.choice(sorted(cluster.agents))]
            agent.stop(kill=True)
            time.sleep(rng.uniform(0.5, 2.0))
            agent.start(cluster.tls)
        else:
            leader = cluster.holder()
            names = sorted(cluster.controllers)
            chosen = leader if victim == "leader" and leader in names else next(
                (i for i in names if i != leader), None)
            if chosen is None:
                continue
            cluster.kill_controller(chosen)
            time.sleep(rng.uniform(0.5, 2.0))
            cluster.start_controller()
        tally.kills[victim] += 1
        tally.recoveries += 1


def observe_loop(cluster: Cluster, tally: Tally, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        problems: list[str] = []
        seen = 0
        for agent in list(cluster.agents.values()):
            try:
                problems += capacity_problems(agent_gpu_loads(agent.name, cluster.inventory(agent)))
                seen += 1
            except AgentError:
                continue   # being restarted right now
        try:
            held: dict[str, str] = {}
            for pod in cluster.live_pods():
                allocation = (pod.metadata.annotations or {}).get(ALLOCATION_ANNOTATION)
                if allocation in held:
                    problems.append(f"{allocation} is held by pods {held[allocation]} and "
                                    f"{pod.metadata.name}")
                held[allocation] = pod.metadata.name
            holder = cluster.holder()
        except client.ApiException:
            continue
        with tally.lock:
            tally.observations += seen > 0
            tally.violations += problems
            if holder and (not tally.leaders or tally.leaders[-1] != holder):
                tally.leaders.append(holder)


def kubelet_loop(cluster: Cluster, stop: threading.Event) -> None:
    while not stop.wait(0.3):
        with contextlib.suppress(client.ApiException):
            kubelet_step(cluster.core, cluster.namespace)


def consistent(cluster: Cluster) -> list[str]:
    """The end-state invariants: every FastPod answered for its generation, its live Pods as
    placed, and the live Pods' allocations exactly the agents' shares."""
    kubelet_step(cluster.core, cluster.namespace)
    problems = []
    fastpods = cluster.fastpods()
    pods = cluster.live_pods()
    for fp in fastpods:
        name = fp["metadata"]["name"]
        condition = cluster.answer(name, fp["metadata"]["generation"])
        mine = [p for p in pods if p.metadata.labels.get(FASTPOD_LABEL) == name]
        if condition is None:
            problems.append(f"{name}: no Scheduled condition for generation {fp['metadata']['generation']}")
        elif condition["status"] == "True" and len(mine) != fp["spec"]["replicas"]:
            problems.append(f"{name}: placed but {len(mine)} of {fp['spec']['replicas']} pods")
    records = Records(active={p.metadata.annotations[ALLOCATION_ANNOTATION]: p.spec.node_name for p in pods})
    return problems + ownership_problems(records, cluster.holdings())


@pytest.fixture
def chaos_cluster(control_plane, api_client, fastpod_crd, namespace, tmp_path):
    root = tmp_path
    certs.init_ca(root / "ca")
    certs.issue(root / "ca", "controller", root / "pki", sans=["127.0.0.1"], role="controller", days=1)
    tls = TlsPaths.in_dir(root / "pki", "controller")
    suffix = uuid.uuid4().hex[:4]
    agents = {
        "mig": Agent(root, root / "ca", f"mig-{suffix}", ["H100-SXM5-80GB"], mig=True),
        "v100": Agent(root, root / "ca", f"v100-{suffix}", ["V100-SXM2-32GB"] * 2, mig=False),
    }
    core = client.CoreV1Api(api_client)
    for agent in agents.values():
        agent.start(tls)
        register_node(core, agent)
    cluster = Cluster(control_plane, api_client, namespace, root, {a.name: a for a in agents.values()},
                      root / "pki", tls)
    yield cluster
    for identity in list(cluster.controllers):
        cluster.kill_controller(identity)
    for agent in agents.values():
        agent.stop()
        core.delete_node(agent.name)


def test_kubernetes_chaos_never_breaks_the_invariants(chaos_cluster: Cluster, capsys) -> None:
    cluster = chaos_cluster
    first = cluster.start_controller()
    wait_for(lambda: cluster.holder() == first, "the first controller leads", timeout=90)
    cluster.start_controller()

    tally, stop, chaos_stop = Tally(), threading.Event(), threading.Event()
    started = time.monotonic()
    helpers = [threading.Thread(target=observe_loop, args=(cluster, tally, stop), daemon=True),
               threading.Thread(target=kubelet_loop, args=(cluster, stop), daemon=True),
               threading.Thread(target=chaos_loop, args=(cluster, tally, chaos_stop), daemon=True)]
    clients = [threading.Thread(target=client_loop, args=(cluster, tally, n), daemon=True)
               for n in range(CLIENTS)]
    for t in (*helpers, *clients):
        t.start()
    for t in clients:
        t.join(timeout=2000)
    chaos_stop.set()
    helpers[2].join(timeout=120)
    wall = time.monotonic() - started
    assert not any(t.is_alive() for t in clients), "clients still running"

    # Everything back (two controllers, every agent), then the end-state invariants.
    while len(cluster.controllers) < 2:
        cluster.start_controller()
    for agent in cluster.agents.values():
        if agent.proc is None or agent.proc.poll() is not None:
            agent.start(cluster.tls)
    wait_for(lambda: not consistent(cluster), "controllers, Pods and agents agreeing", timeout=180)
    # Delete everything: the agents end with nothing of their own.
    for fp in cluster.fastpods():
        cluster.objects.delete_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL,
                                                        fp["metadata"]["name"])
    wait_for(lambda: not cluster.fastpods(), "every FastPod deleted", timeout=180)
    wait_for(lambda: not leftovers(cluster.holdings()), "agents free of leftovers", timeout=120)
    stop.set()
    for t in helpers[:2]:
        t.join(timeout=30)

    p50, p99 = p50_p99(tally.latencies)
    with capsys.disabled():
        print(f"\nk8s chaos (seed {SEED}): {OPS} operations {tally.ops} from {CLIENTS} clients in "
              f"{wall:.0f}s; "
              f"answers {tally.answers}, {len(tally.unanswered)} unanswered; kills {tally.kills}, "
              f"{tally.recoveries} recoveries; {len(tally.leaders)} leaders in turn; {tally.observations} "
              f"observations, {len(tally.violations)} violations; answer p50 {p50:.1f} s, p99 {p99:.1f} s")
    problems = run_problems(tally.observations, tally.violations, tally.unanswered)
    assert not problems, problems
    assert sum(tally.kills.values()) >= 1 and tally.recoveries == sum(tally.kills.values())


def test_a_controller_started_while_the_mig_agent_is_down_does_not_call_exclusive_invalid(
        chaos_cluster: Cluster) -> None:
    """Found by the chaos test: with the only MIG-capable agent unreachable since it started, the
    controller knew no MIG GPU and answered a valid exclusive FastPod 'Invalid'. It is not
    placeable yet, and says so; once the agent is back it is placed."""
    cluster = chaos_cluster
    mig = next(a for a in cluster.agents.values() if a.name.startswith("mig-"))
    mig.stop(kill=True)
    cluster.start_controller()
    cluster.objects.create_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, PLURAL, fastpod_manifest("slice", {"kind": "exclusive",
                                                                             "migProfile": "1g.10gb"}))
    condition = wait_for(lambda: cluster.answer("slice", 1), "slice answered", timeout=90)
    assert condition["status"] == "False" and condition["reason"] != "Invalid", condition
    mig.start(cluster.tls)
    wait_for(lambda: (cluster.answer("slice", 1) or {}).get("status") == "True", "slice placed", timeout=90)
