#!/usr/bin/env python3
"""How many nodes' heartbeats one controller core keeps up with, against a no-op RPC baseline.

Starts (on loopback, in a temporary directory) a controller and two node agents on simulated
machines, as bench/controller.py does, then sends, for ``--seconds`` each from ``--threads``
threads in a closed loop:
  - Heartbeat RPCs with node-1's certificate (the agents' call: the node identity checked
    against the certificate, the liveness map, the node's row written to SQLite);
  - Ping RPCs with the client's certificate (the baseline: the same TLS, gRPC and
    authentication, no work).
For each it prints the rate, the latency (p50, p99) and the controller's CPU per call, read from
/proc; then the heartbeats of how many nodes one core of the controller could take at the given
``--interval`` (the controller's default is 2 s). The cost of a heartbeat does not grow with
the number of nodes (a lookup and one row by its key), so two nodes measure it.

In Kubernetes mode the controller sends the heartbeats itself: a Ping to each agent, with no
thread waiting for it (``AgentClient.ping_unwaited``). The last row sends those to node-1's
agent, ``--threads`` in flight, and reads this process's CPU per ping (the caller's side, as the
in-cluster controller pays it).

    python bench/heartbeats.py [--seconds 10] [--threads 8] [--interval 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from controller import Cluster, cpu_seconds, p99

from fastshare.controller.agent_client import AgentClient, AgentError, AgentPool
from fastshare.security.tls import TlsPaths, mtls_channel
from fastshare.v1 import common_pb2
from fastshare.v1 import controller_pb2 as pb
from fastshare.v1 import controller_pb2_grpc as pb_grpc


def closed_loop(call: Callable[[], object], threads: int, seconds: float) -> list[float]:
    """Latencies of every call made by ``threads`` threads, each calling again once answered."""
    latencies: list[list[float]] = [[] for _ in range(threads)]
    end = time.monotonic() + seconds

    def worker(mine: list[float]) -> None:
        while (began := time.monotonic()) < end:
            call()
            mine.append(time.monotonic() - began)

    workers = [threading.Thread(target=worker, args=(mine,)) for mine in latencies]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return [latency for mine in latencies for latency in mine]


def measure(name: str, call: Callable[[], object], pid: int, threads: int,
            seconds: float) -> dict[str, float]:
    closed_loop(call, threads, 1.0)   # warm-up: connections, caches
    cpu, began = cpu_seconds(pid), time.monotonic()
    latencies = closed_loop(call, threads, seconds)
    wall, cpu = time.monotonic() - began, cpu_seconds(pid) - cpu
    return {"name": name, "rate": len(latencies) / wall, "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": p99(latencies) * 1e3, "cpu_ms": cpu / len(latencies) * 1e3}


def unwaited_pings(agent: AgentClient, in_flight: int, seconds: float) -> dict[str, float]:
    """Pings kept ``in_flight`` at once for ``seconds``; this process's CPU per ping."""
    slots, latencies, errors = threading.Semaphore(in_flight), [], []

    def send() -> None:
        began = time.monotonic()

        def answered(error: AgentError | None) -> None:
            latencies.append(time.monotonic() - began)
            if error is not None:
                errors.append(error)
            slots.release()

        agent.ping_unwaited(answered)

    cpu, began = time.process_time(), time.monotonic()
    while time.monotonic() - began < seconds:
        slots.acquire()
        send()
    for _ in range(in_flight):
        slots.acquire()
    wall, cpu = time.monotonic() - began, time.process_time() - cpu
    if errors:
        raise SystemExit(f"{len(errors)} pings failed, e.g. {errors[0]}")
    return {"name": "agent Ping, k8s", "rate": len(latencies) / wall,
            "p50_ms": statistics.median(latencies) * 1e3, "p99_ms": p99(latencies) * 1e3,
            "cpu_ms": cpu / len(latencies) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of each closed loop [10]")
    parser.add_argument("--threads", type=int, default=8, help="callers at once [8]")
    parser.add_argument("--interval", type=float, default=2.0, help="heartbeat interval to size for, s [2]")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fs-heartbeats-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            cluster.start()
            client = cluster.client()
            cluster.wait_ready(client)
            pid = cluster.procs[0].pid
            node = mtls_channel(cluster.address, TlsPaths.in_dir(Path(tmp) / "pki", "node-1"),
                                server_name="controller")
            registry = pb_grpc.NodeRegistryStub(node)
            beat = pb.HeartbeatRequest(node="node-1")
            if not registry.Heartbeat(beat, timeout=10).registered:
                raise SystemExit("node-1 is not registered with the controller")
            rows = [measure("Heartbeat", lambda: registry.Heartbeat(beat, timeout=10), pid, args.threads,
                            args.seconds),
                    measure("Ping (baseline)", lambda: client.call("Ping", common_pb2.Empty()), pid,
                            args.threads, args.seconds)]
            node.close()
            client.close()
            agents = AgentPool(TlsPaths.in_dir(Path(tmp) / "pki", "controller"))
            listen = yaml.safe_load((Path(tmp) / "node-1.yaml").read_text())["listen"]
            agent = agents.get("node-1", listen)
            agent.ping()   # looks at its certificate: the unwaited pings need a checked agent
            unwaited_pings(agent, args.threads, 1.0)
            rows.append(unwaited_pings(agent, args.threads, args.seconds))
            agents.close()
        finally:
            cluster.stop()
    print(f"{args.threads} callers, {args.seconds:.0f} s each, closed loop")
    print(f"{'':16} {'calls/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'controller CPU ms/call':>23}")
    for r in rows:
        print(f"{r['name']:16} {r['rate']:>8.0f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} "
              f"{r['cpu_ms']:>23.3f}")
    heartbeat, ping, k8s = rows
    standalone, in_cluster = (args.interval / (r["cpu_ms"] / 1e3) for r in (heartbeat, k8s))
    print(f"a heartbeat costs the controller {heartbeat['cpu_ms'] / ping['cpu_ms']:.2f}x a Ping's CPU; "
          f"one core takes the heartbeats of about {standalone:,.0f} nodes at a {args.interval:g} s "
          f"interval (heartbeats alone); in Kubernetes mode, its pings of about {in_cluster:,.0f} nodes")


if __name__ == "__main__":
    main()
