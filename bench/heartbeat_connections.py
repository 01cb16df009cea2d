#!/usr/bin/env python3
"""What many separate agent connections cost the controller: its memory and its CPU per heartbeat.

``bench/heartbeats.py`` sends every heartbeat over one connection. A real cluster has one
connection per agent, each with its own TLS session and HTTP/2 state in the controller. This
starts a controller and two agents (as ``bench/controller.py`` does), then, for each count in
``--connections``, opens that many separate mTLS connections with node-1's certificate (one gRPC
channel each, none shared) and sends Heartbeat RPCs over all of them, each connection in turn,
at ``--rate`` a second in total (the controller asks a cluster for no more than 1,000 a second,
``HEARTBEATS_PER_SECOND``) for ``--seconds``. For each count it prints the controller's resident
memory (and what each connection added to it), its CPU for opening them (TLS handshakes), its
CPU per heartbeat and the latency (p50, p99). The first count is the baseline the others are
compared with, in the same run.

    python bench/heartbeat_connections.py [--connections 100,1000,10000] [--rate 1000] [--seconds 20]

Each connection takes a file descriptor in this process and in the controller: the bench raises
its own limit (the controller inherits it) and refuses counts it cannot open.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
from controller import Cluster, cpu_seconds, p99, rss_mib

from fastshare.security.tls import TlsPaths, mtls_channel
from fastshare.v1 import controller_pb2 as pb
from fastshare.v1 import controller_pb2_grpc as pb_grpc

# one connection per channel: a channel of its own subchannel pool shares no connection
SEPARATE = [("grpc.use_local_subchannel_pool", 1)]


def open_connections(address: str, paths: TlsPaths, count: int) -> list[tuple[grpc.Channel, object]]:
    """``count`` channels, each connected (one heartbeat each, up to 64 handshakes at a time)."""
    opened = []
    beat = pb.HeartbeatRequest(node="node-1")
    for first in range(0, count, 64):
        batch = []
        for _ in range(min(64, count - first)):
            channel = mtls_channel(address, paths, server_name="controller", options=SEPARATE)
            stub = pb_grpc.NodeRegistryStub(channel)
            batch.append((channel, stub, stub.Heartbeat.future(beat, timeout=60)))
        for channel, stub, answer in batch:
            if not answer.result().registered:
                raise SystemExit("node-1 is not registered with the controller")
            opened.append((channel, stub))
        if first and first % 2048 == 0:
            print(f"  {first} connections open", flush=True)
    return opened


def paced_heartbeats(stubs: list[object], rate: float, seconds: float) -> tuple[list[float], int]:
    """Heartbeats at ``rate`` a second in total, each stub in turn; their latencies and errors."""
    beat = pb.HeartbeatRequest(node="node-1")
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    began = time.monotonic()
    sent = 0
    while (now := time.monotonic()) - began < seconds:
        due = int((now - began) * rate)
        while sent < due:
            stub = stubs[sent % len(stubs)]
            sent_at = time.monotonic()

            def answered(future, sent_at=sent_at) -> None:
                with lock:
                    if future.exception() is None:
                        latencies.append(time.monotonic() - sent_at)
                    else:
                        errors[0] += 1

            stub.Heartbeat.future(beat, timeout=30).add_done_callback(answered)
            sent += 1
        time.sleep(0.001)
    deadline = time.monotonic() + 30
    while len(latencies) + errors[0] < sent and time.monotonic() < deadline:
        time.sleep(0.05)
    return latencies, errors[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", default="100,1000,10000",
                        help="counts of separate connections, the first the baseline [100,1000,10000]")
    parser.add_argument("--rate", type=float, default=1000.0, help="heartbeats a second in total [1000]")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="seconds of heartbeats at each count [20]")
    args = parser.parse_args()
    counts = [int(c) for c in args.connections.split(",")]
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if max(counts) + 500 > hard:
        raise SystemExit(f"--connections {max(counts)}: this machine allows {hard} open files a process; "
                         f"at most {hard - 500} connections")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fs-connections-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            cluster.start()
            client = cluster.client()
            cluster.wait_ready(client)
            client.close()
            pid = cluster.procs[0].pid
            paths = TlsPaths.in_dir(Path(tmp) / "pki", "node-1")
            for count in counts:
                rss_before, cpu_before = rss_mib(pid), cpu_seconds(pid)
                opened = open_connections(cluster.address, paths, count)
                opening_cpu = cpu_seconds(pid) - cpu_before
                time.sleep(1.0)
                cpu_before = cpu_seconds(pid)
                latencies, errors = paced_heartbeats([stub for _, stub in opened], args.rate, args.seconds)
                cpu = cpu_seconds(pid) - cpu_before
                rows.append({"connections": count, "rss_mib": rss_mib(pid), "rss_before": rss_before,
                             "open_ms": opening_cpu / count * 1e3, "calls": len(latencies), "errors": errors,
                             "cpu_ms": cpu / max(1, len(latencies)) * 1e3,
                             "p50_ms": statistics.median(latencies) * 1e3, "p99_ms": p99(latencies) * 1e3})
                for channel, _ in opened:
                    channel.close()
                del opened
                time.sleep(2.0)   # the controller sees the connections close
        finally:
            cluster.stop()
    base = rows[0]
    print(f"heartbeats at {args.rate:.0f}/s for {args.seconds:.0f} s over each count of separate connections")
    print(f"{'connections':>11} {'ctl RSS MiB':>11} {'KiB/conn':>8} {'open ms/conn':>12} {'CPU ms/beat':>11} "
          f"{'ratio':>5} {'p50 ms':>6} {'p99 ms':>6} {'errors':>6}")
    for r in rows:
        added = (r["rss_mib"] - r["rss_before"]) * 1024 / r["connections"]
        print(f"{r['connections']:>11,} {r['rss_mib']:>11.1f} {added:>8.1f} {r['open_ms']:>12.2f} "
              f"{r['cpu_ms']:>11.3f} {r['cpu_ms'] / base['cpu_ms']:>5.2f} {r['p50_ms']:>6.2f} "
              f"{r['p99_ms']:>6.2f} {r['errors']:>6}")


if __name__ == "__main__":
    main()
