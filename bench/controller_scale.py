#!/usr/bin/env python3
"""What the controller's own steps cost as the cluster grows, against a small cluster's.

Builds two clusters in this process, one of ``--small`` nodes (the baseline) and one of
``--nodes``, each with the real controller core, ledger, placement engine, reconciler and SQLite
store, and stand-in agents that answer at once (bench/registration_storm.py's), 4 L4 GPUs a node.
For each it times:
  - registering every node for the first time (a new cluster, or new racks);
  - the first Allocate (the engine works out every node's state once);
  - Allocate and Release afterwards (fastpod shares of 10 % SMs and 1 GiB), CPU ms each;
  - Allocate right after a node registered again (what validation knows of the GPUs changes);
  - Allocate with ``--per-node`` allocations a node held and a Pod room set on every node,
    as the in-cluster controller sets it;
  - a full reconcile pass with ``--per-node`` allocations a node held;
  - building the cluster's status (what `fastshare status` gets), and its size;
  - a restart on the same state file: the start (its first pass), and the first Allocate after.
The process runs with the servers' interpreter settings (``fastshare/server_runtime.py``), its
heap settled where a server's periodic pass would have settled it; before 2026-11-28 it ran
with the interpreter's defaults, whose full collections took a third to a half of the pass and
status figures at 10,000 nodes. Then prints both and their ratio: a step whose cost grows with
the cluster shows a ratio near ``--nodes / --small``; one that does not, near 1. No gRPC here:
bench/controller.py and bench/heartbeats.py measure the RPCs.

    python bench/controller_scale.py [--nodes 10000] [--small 100] [--per-node 2]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
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
DEFAULT_THRESHOLDS = gc.get_threshold()
STEADY = 500   # allocations (and releases) timed after the first
AFTER_CHANGE = 20   # allocations timed, each right after a node registered again


def cpu_ms_each(count: int, step) -> float:
    began = time.process_time()
    for _ in range(count):
        step()
    return (time.process_time() - began) / count * 1e3


def measure(nodes: int, per_node: int, state: Path) -> dict[str, float]:
    store = SqliteStore(state)
    core = ControllerCore(store, _Agents())
    reconciler = Reconciler(core)
    reconciler.start()
    names = iter(f"gpu-node-{i:05d}" for i in range(nodes))
    out = {"register_ms": cpu_ms_each(nodes, lambda: core.register_node(next(names), "127.0.0.1:1", {}))}
    server_runtime.settle_after_pass()   # as a server's periodic pass would have by now
    began = time.process_time()
    core.allocate(Request(spec=SPEC, owner="bench"))
    out["first_allocate_ms"] = (time.process_time() - began) * 1e3
    held = []

    def allocate() -> None:
        held.append(core.allocate(Request(spec=SPEC, owner="bench")))

    out["allocate_ms"] = cpu_ms_each(STEADY, allocate)
    out["release_ms"] = cpu_ms_each(STEADY, lambda: core.release(held.pop().id))
    spent = 0.0
    for i in range(AFTER_CHANGE):   # a node registers again (an agent restart, an inventory change)
        core.register_node(f"gpu-node-{i:05d}", "127.0.0.1:1", {})
        spent += cpu_ms_each(1, allocate)
    out["after_change_ms"] = spent / AFTER_CHANGE
    for _ in range(nodes * per_node - 1):
        core.allocate(Request(spec=SPEC, owner="bench"))
    server_runtime.settle_after_pass()
    for i in range(nodes):   # as the in-cluster controller does: each node's Pod limit
        core.ledger.set_room(f"gpu-node-{i:05d}", 110)
    out["allocate_room_ms"] = cpu_ms_each(STEADY, allocate)
    for _ in range(STEADY):
        core.release(held.pop().id)
    for i in range(nodes):
        core.ledger.set_room(f"gpu-node-{i:05d}", None)
    began = time.process_time()
    reconciler.run_once()
    out["pass_ms"] = (time.process_time() - began) * 1e3
    server_runtime.settle_after_pass()
    began = time.process_time()
    status = convert.cluster_status(store.list_nodes(), store.list_allocations(HOLDING),
                                    core.ledger.overcommitted())
    out["status_ms"] = (time.process_time() - began) * 1e3
    out["status_mb"] = status.ByteSize() / 1e6
    store.close()
    # A restart: the state file opened again, the same agents, in a process that is a server
    # (as `fastshare controller serve` makes it before the start) with nothing of the cluster
    # frozen yet and the interpreter's thresholds; the start collects and freezes what it built.
    gc.unfreeze()
    gc.set_threshold(*DEFAULT_THRESHOLDS)
    server_runtime.settle_startup()
    began = time.process_time()
    store = SqliteStore(state)
    core = ControllerCore(store, core.agents)
    Reconciler(core).start()
    out["start_s"] = time.process_time() - began
    began = time.process_time()
    core.allocate(Request(spec=SPEC, owner="bench"))
    out["first_after_start_ms"] = (time.process_time() - began) * 1e3
    store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10000, help="nodes of the large cluster [10000]")
    parser.add_argument("--small", type=int, default=100, help="nodes of the baseline cluster [100]")
    parser.add_argument("--per-node", type=int, default=2, help="allocations a node holds for the pass [2]")
    args = parser.parse_args()
    server_runtime.settle_startup()   # the servers' interpreter settings, as they run
    with tempfile.TemporaryDirectory(prefix="fs-scale-") as tmp:
        small = measure(args.small, args.per_node, Path(tmp) / "small.db")
        large = measure(args.nodes, args.per_node, Path(tmp) / "large.db")
    rows = [("register a new node (mean over all), CPU ms", "register_ms"),
            ("first Allocate, CPU ms", "first_allocate_ms"),
            (f"Allocate (next {STEADY}), CPU ms each", "allocate_ms"),
            (f"Release ({STEADY}), CPU ms each", "release_ms"),
            (f"Allocate after a node registered again ({AFTER_CHANGE}), CPU ms", "after_change_ms"),
            ("Allocate, all held, Pod room set (k8s), CPU ms each", "allocate_room_ms"),
            (f"reconcile pass ({args.per_node} allocations a node), CPU ms", "pass_ms"),
            ("status built, CPU ms", "status_ms"),
            ("status size, MB", "status_mb"),
            ("a restart: the start (first pass), CPU s", "start_s"),
            ("a restart: the first Allocate after it, CPU ms", "first_after_start_ms")]
    print(f"{'':52} {f'{args.small:,} nodes':>12} {f'{args.nodes:,} nodes':>14} {'ratio':>7}")
    for label, key in rows:
        print(f"{label:52} {small[key]:>12.2f} {large[key]:>14.2f} {large[key] / small[key]:>7.1f}")
    print(f"(the clusters differ {args.nodes / args.small:.0f}x in size)")


if __name__ == "__main__":
    main()
