#!/usr/bin/env python3
"""How long an Allocate stalls while a large controller's background work runs: the
interpreter's defaults (the baseline) against the servers' settings (fastshare.server_runtime:
each reconcile pass run with the collector paused and the heap frozen after it, the collector's
full passes rarer, a 1 ms GIL switch interval), on the same cluster in the same process.

Builds one cluster of ``--nodes`` nodes (4 L4 GPUs each, two fastpod shares a node) with the
real controller core, ledger, engine, reconciler and SQLite store, and stand-in agents that
answer at once (bench/registration_storm.py's). Then, for ``--seconds`` in each setting: a full
reconcile pass every 5 s and a cluster status every 10 s (each in its own thread, as the
controller runs them), and one Allocate and its Release every 10 ms in the main thread, each
timed. Prints the Allocate+Release latency (p50, p99, max), the collector's full collections
(count, longest, total) and the CPU seconds of the process.

    python bench/controller_pauses.py [--nodes 10000] [--seconds 60]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import threading
import time
from pathlib import Path

from registration_storm import GiB, _Agents

from fastshare import server_runtime
from fastshare.controller import convert
from fastshare.controller.core import ControllerCore
from fastshare.controller.model import HOLDING, Kind, Spec
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.controller.validation import Request

SPEC = Spec(kind=Kind.FASTPOD, sm_percent=10, memory_bytes=GiB, quota_request=0.5, quota_limit=1.0)
PASS_EVERY_S = 5.0     # the controller's default --reconcile-interval
STATUS_EVERY_S = 10.0


class FullCollections:
    """The collector's generation-2 collections, timed (gc.callbacks)."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._began = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif info["generation"] == 2:
            self.pauses.append(time.perf_counter() - self._began)


def build(nodes: int, state: Path) -> tuple[ControllerCore, Reconciler, SqliteStore]:
    store = SqliteStore(state)
    core = ControllerCore(store, _Agents())
    reconciler = Reconciler(core)
    reconciler.start()
    for i in range(nodes):
        core.register_node(f"gpu-node-{i:05d}", "127.0.0.1:1", {})
        if i % 1000 == 999:
            print(f"  {i + 1:,} nodes registered", file=sys.stderr)
    for _ in range(nodes * 2):
        core.allocate(Request(spec=SPEC, owner="bench"))
    return core, reconciler, store


def run(core: ControllerCore, reconciler: Reconciler, store: SqliteStore, seconds: float,
        settled: bool, collections: FullCollections) -> dict[str, float]:
    stop = threading.Event()

    def passes() -> None:
        while not stop.wait(PASS_EVERY_S):
            if settled:   # as the servers run it
                with server_runtime.collection_paused():
                    reconciler.run_once()
            else:
                reconciler.run_once()

    def statuses() -> None:
        while not stop.wait(STATUS_EVERY_S):
            convert.cluster_status(store.list_nodes(), store.list_allocations(HOLDING),
                                   core.ledger.overcommitted())

    threads = [threading.Thread(target=passes), threading.Thread(target=statuses)]
    for thread in threads:
        thread.start()
    collections.pauses.clear()
    latencies: list[float] = []
    cpu, began = time.process_time(), time.monotonic()
    while time.monotonic() - began < seconds:
        t = time.perf_counter()
        core.release(core.allocate(Request(spec=SPEC, owner="bench")).id)
        latencies.append(time.perf_counter() - t)
        time.sleep(0.01)
    stop.set()
    for thread in threads:
        thread.join()
    latencies.sort()
    pauses = collections.pauses
    return {"p50_ms": latencies[len(latencies) // 2] * 1e3,
            "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3, "max_ms": latencies[-1] * 1e3,
            "allocations": len(latencies), "full_gcs": len(pauses),
            "full_gc_max_ms": max(pauses, default=0.0) * 1e3, "full_gc_total_ms": sum(pauses) * 1e3,
            "cpu_s": time.process_time() - cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10000, help="nodes of the cluster [10000]")
    parser.add_argument("--seconds", type=float, default=60.0, help="time in each setting [60]")
    args = parser.parse_args()
    collections = FullCollections()
    with tempfile.TemporaryDirectory(prefix="fs-pauses-") as tmp:
        gc.collect()
        gc.freeze()   # what the servers did at their start before: the cluster grew since
        core, reconciler, store = build(args.nodes, Path(tmp) / "state.db")
        print(f"  defaults, {args.seconds:.0f} s", file=sys.stderr)
        before = run(core, reconciler, store, args.seconds, False, collections)
        server_runtime.settle_startup()
        print(f"  servers' settings, {args.seconds:.0f} s", file=sys.stderr)
        after = run(core, reconciler, store, args.seconds, True, collections)
        store.close()
    rows = [("Allocate+Release p50, ms", "p50_ms"), ("Allocate+Release p99, ms", "p99_ms"),
            ("Allocate+Release max, ms", "max_ms"), ("Allocate+Release done", "allocations"),
            ("full collections", "full_gcs"), ("longest full collection, ms", "full_gc_max_ms"),
            ("full collections in all, ms", "full_gc_total_ms"), ("CPU of the process, s", "cpu_s")]
    print(f"{args.nodes:,} nodes, {args.seconds:.0f} s each")
    print(f"{'':32} {'defaults':>10} {'settled':>10} {'ratio':>7}")
    for label, key in rows:
        ratio = f"{after[key] / before[key]:.2f}" if before[key] else "-"
        print(f"{label:32} {before[key]:>10.1f} {after[key]:>10.1f} {ratio:>7}")


if __name__ == "__main__":
    main()
