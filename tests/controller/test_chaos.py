"""Chaos, standalone mode: a controller and three node agents (real processes on loopback,
simulated GPUs) serve a mixed stream of allocations and releases from 16 concurrent clients
while a seeded chaos thread SIGKILLs the controller and random agents and restarts them.

Checked while it runs (every status the observer sees): no GPU over its SM %, memory or MIG
capacity. Checked at the end, after every process is back and the reconciler has caught up:
every allocation is active on its agent or released and gone from it, no agent holds a share,
an MPS daemon or a MIG instance of its own that no allocation owns, and every request was
answered (allocated, rejected with a reason, or failed with a retryable error).

    FASTSHARE_CHAOS_REQUESTS=1000 make pytest PYTEST_ARGS='tests/controller/test_chaos.py -s'
(CI runs 200 requests; the seed is FASTSHARE_CHAOS_SEED, default 7.)
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from chaos_invariants import agent_holdings, leftovers, p50_p99, run_problems

from fastshare.v1 import agent_pb2
from fastshare.v1 import controller_pb2 as pb

from .conftest import KINDS, Cluster, GiB, assert_consistent, capacity_problems, wait_for

REQUESTS = int(os.environ.get("FASTSHARE_CHAOS_REQUESTS", "200"))
SEED = int(os.environ.get("FASTSHARE_CHAOS_SEED", "7"))
CLIENTS = 16
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
ANSWERS = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.FAILED_PRECONDITION}

pytestmark = [pytest.mark.timeout(1800)]


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    issued: int = 0
    allocate_requests: int = 0
    allocated: int = 0
    rejected: int = 0
    retryable_failures: int = 0
    released: int = 0
    unanswered: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    kills: int = 0
    recoveries: int = 0
    observations: int = 0
    violations: list[str] = field(default_factory=list)

    def take(self) -> int | None:
        with self.lock:
            if self.issued >= REQUESTS:
                return None
            self.issued += 1
            return self.issued


def random_spec(rng: random.Random) -> pb.AllocationSpec:
    kind = rng.choices(["fastpod", "mps", "exclusive", "whole"], weights=[45, 20, 25, 10])[0]
    if kind == "fastpod":
        q = rng.choice([0.1, 0.2, 0.3])
        return pb.AllocationSpec(kind=KINDS[kind], sm_percent=rng.choice([10, 20, 30]),
                                 memory_bytes=rng.choice([1, 2, 4]) * GiB, quota_request=q, quota_limit=q * 2)
    if kind == "mps":
        return pb.AllocationSpec(kind=KINDS[kind], memory_bytes=rng.choice([1, 2, 4, 8]) * GiB)
    if kind == "exclusive":
        return pb.AllocationSpec(kind=KINDS[kind], mig_profile=rng.choice(["1g.5gb", "2g.10gb", "3g.20gb"]))
    return pb.AllocationSpec(kind=KINDS[kind], gpu_count=rng.choice([1, 1, 2]))


def call_until_answered(cluster: Cluster, method: str, request, deadline: float):
    """Retry a retryable failure (the controller is down or restarting) with the same request
    (Allocate carries an idempotency key) until it answers or ``deadline`` passes."""
    client = cluster.client()
    try:
        while True:
            try:
                return client.call(method, request, timeout=30)
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
    finally:
        client.close()


def client_loop(cluster: Cluster, tally: Tally, n: int) -> None:
    rng = random.Random(SEED * 1000 + n)
    held: list[str] = []
    while (i := tally.take()) is not None:
        time.sleep(rng.uniform(0.3, 1.5))  # think time: the stream outlasts many kills
        if held and rng.random() < 0.45:
            victim = held.pop(rng.randrange(len(held)))
            try:
                call_until_answered(cluster, "Release", pb.ReleaseAllocationRequest(allocation_id=victim),
                                    time.monotonic() + 120)
                with tally.lock:
                    tally.released += 1
            except grpc.RpcError as exc:
                held.append(victim)  # released at the end
                if exc.code() not in RETRYABLE:
                    with tally.lock:
                        tally.unanswered.append(f"release {victim}: {exc.code().name}: {exc.details()}")
            continue
        with tally.lock:
            tally.allocate_requests += 1
        request = pb.AllocateRequest(spec=random_spec(rng), owner=f"client-{n}",
                                     idempotency_key=f"chaos-{n}-{i}")
        started = time.monotonic()
        try:
            a = call_until_answered(cluster, "Allocate", request, started + 120)
            with tally.lock:
                tally.allocated += 1
                tally.latencies.append(time.monotonic() - started)
            held.append(a.id)
        except grpc.RpcError as exc:
            with tally.lock:
                if exc.code() in ANSWERS and exc.details():
                    tally.rejected += 1
                    tally.latencies.append(time.monotonic() - started)
                elif exc.code() in RETRYABLE:
                    tally.retryable_failures += 1
                else:
                    tally.unanswered.append(f"{exc.code().name}: {exc.details()}")
    for victim in held:
        call_until_answered(cluster, "Release", pb.ReleaseAllocationRequest(allocation_id=victim),
                            time.monotonic() + 300)
        with tally.lock:
            tally.released += 1


def chaos_loop(cluster: Cluster, tally: Tally, stop: threading.Event) -> None:
    rng = random.Random(SEED)
    while not stop.wait(rng.uniform(0.5, 2.0)):
        victim = rng.choice(["controller", *sorted(cluster.agents)])
        if victim == "controller":
            cluster.controller.kill9()
        else:
            cluster.agents[victim].kill9()
        tally.kills += 1
        time.sleep(rng.uniform(0.2, 1.0))
        if victim == "controller":
            cluster.start_controller()
        else:
            cluster.start_agent(victim, wait=False)
        tally.recoveries += 1


def observe_loop(cluster: Cluster, tally: Tally, stop: threading.Event) -> None:
    client = cluster.client()
    while not stop.wait(0.5):
        try:
            status = client.call("Status", pb.ClusterStatusRequest(), timeout=10)
        except grpc.RpcError:
            continue  # the controller is down right now
        problems = capacity_problems(status)
        with tally.lock:
            tally.observations += 1
            tally.violations += problems


def agent_leftovers(cluster: Cluster) -> list[str]:
    """What agents hold that nobody owns once every allocation is released."""
    request = agent_pb2.GetInventoryRequest()
    return leftovers(agent_holdings(name, agent.stub(cluster.pki).GetInventory(request, timeout=30))
                     for name, agent in cluster.agents.items())


def settled(cluster: Cluster) -> bool:
    states = {a.state for a in cluster.status().allocations}
    return not states & {pb.ALLOCATION_STATE_PENDING, pb.ALLOCATION_STATE_PREPARED,
                         pb.ALLOCATION_STATE_RELEASING}


def test_chaos_kills_never_break_the_invariants(cluster: Cluster,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cluster.add_machine("node-a", ["A100-SXM4-40GB", "A100-SXM4-40GB"], mig_enabled=True)
    cluster.add_machine("node-b", ["H100-SXM5-80GB", "L4"])
    cluster.add_machine("node-c", ["A100-SXM4-80GB", "A100-SXM4-80GB"])
    cluster.start_controller()
    for name in ("node-a", "node-b", "node-c"):
        cluster.start_agent(name)

    tally, stop = Tally(), threading.Event()
    started = time.monotonic()
    chaos = threading.Thread(target=chaos_loop, args=(cluster, tally, stop), daemon=True)
    observer = threading.Thread(target=observe_loop, args=(cluster, tally, stop), daemon=True)
    clients = [threading.Thread(target=client_loop, args=(cluster, tally, n), daemon=True)
               for n in range(CLIENTS)]
    for t in (chaos, observer, *clients):
        t.start()
    for t in clients:
        t.join(timeout=1500)
    stop.set()
    chaos.join(timeout=120)
    observer.join(timeout=30)
    wall = time.monotonic() - started
    assert not any(t.is_alive() for t in clients), "clients still running after 25 minutes"

    # Everything back up; let the reconciler finish what the kills interrupted.
    if not cluster.controller.alive():
        cluster.start_controller()
    for name, agent in cluster.agents.items():
        if not agent.alive():
            cluster.start_agent(name, wait=False)
    for name, agent in cluster.agents.items():
        # The controller may still count a just-killed agent as available (heartbeat timeout):
        # wait for the new process itself to answer too.
        wait_for(lambda agent=agent: agent.share_ids(cluster.pki) is not None, 120, f"agent {name} answering")
        cluster.wait_node(name, available=True, timeout=120)
    wait_for(lambda: settled(cluster), 120, "allocations settled after the chaos")
    wait_for(lambda: assert_consistent(cluster) is None, 120, "the controller and agents agreeing")
    wait_for(lambda: not agent_leftovers(cluster), 120, "agents free of leftovers")
    final = cluster.status()
    for node in final.nodes:
        for gpu in node.gpus:
            assert not gpu.allocation_ids and gpu.memory_bytes_used == 0, f"{node.name} GPU {gpu.index}"

    p50, p99 = (seconds * 1000 for seconds in p50_p99(tally.latencies))
    with capsys.disabled():
        print(f"\nchaos (seed {SEED}): {REQUESTS} requests from {CLIENTS} clients in {wall:.0f}s: "
              f"{tally.allocated} allocated, {tally.rejected} rejected with a reason, "
              f"{tally.retryable_failures} retryable failures, {len(tally.unanswered)} unanswered; "
              f"{tally.released} releases; {tally.kills} kills, {tally.recoveries} recoveries; "
              f"{tally.observations} observations, {len(tally.violations)} violations; "
              f"answer latency p50 {p50:.0f} ms, p99 {p99:.0f} ms")
    problems = run_problems(tally.observations, tally.violations, tally.unanswered)
    assert not problems, problems
    assert tally.allocated + tally.rejected + tally.retryable_failures == tally.allocate_requests
    assert tally.kills >= 1 and tally.recoveries == tally.kills
