#!/usr/bin/env python3
"""A registration storm: every agent registers again after a controller restart, each
registration asking for a reconcile pass of its node. Coalesced passes (the controller's
``RegistrationPasses``) against one pass per registration (what it did before, the baseline),
on the same store, in the same process.

The controller core, the reconciler and the SQLite store are the real ones; the agents are
stand-ins that answer at once (an agent's round trip is not what grows here: each pass reads
every node and every holding record, whatever nodes it is for). The registrations arrive
uniformly over ``--spread`` seconds (agents heartbeat every 2 s by default; the first
heartbeat after the restart tells each to register) from 8 threads, as the gRPC workers.

    .venv/bin/python bench/registration_storm.py [--nodes 300] [--per-node 4] [--spread 2]

Prints, for both: the time from the first registration until the last one was answered and
until every node's pass has ended, the passes run, the CPU seconds the process spent, and the
longest periodic full pass (every 5 s, as the controller's reconcile thread runs it), which waits
for the reconciler's lock among the registrations' passes. Until 2026-11-28 the controller's
liveness checks ran in the same thread, after that pass.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastshare.controller.core import ControllerCore
from fastshare.controller.model import Kind, Spec
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.registration_passes import RegistrationPasses
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.controller.validation import Request
from fastshare.v1 import agent_pb2

GiB = 1024**3
GPUS_PER_NODE = 4


class _Agent:
    """Holds what it is given, answers at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.shares: dict[str, agent_pb2.Share] = {}

    def inventory(self) -> agent_pb2.Inventory:
        gpus = [agent_pb2.Gpu(index=i, uuid=f"GPU-{self.name}-{i}", name="NVIDIA L4",
                              memory_bytes=22 * GiB, sm_count=58) for i in range(GPUS_PER_NODE)]
        return agent_pb2.Inventory(boot_id="boot", agent_version="bench", gpus=gpus,
                                   shares=list(self.shares.values()))

    def prepare(self, share: agent_pb2.Share) -> agent_pb2.PrepareShareReply:
        self.shares[share.id] = share
        return agent_pb2.PrepareShareReply(share=share, device_uuids=list(share.device_uuids))

    def release(self, share_id: str, kind: int = 0) -> agent_pb2.ReleaseShareReply:
        self.shares.pop(share_id, None)
        return agent_pb2.ReleaseShareReply(released=True)


class _Agents:
    deadline = 10.0   # seconds, as AgentPool.deadline

    def __init__(self) -> None:
        self.agents: dict[str, _Agent] = {}

    def get(self, node: str, address: str) -> _Agent:
        return self.agents.setdefault(node, _Agent(node))


class _Counting:
    """The real reconciler, counting the nodes whose pass has ended."""

    def __init__(self, reconciler: Reconciler, nodes: int) -> None:
        self._reconciler = reconciler
        self._left = nodes
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.passes = 0

    def run_once(self, nodes: list[str] | None = None) -> object:
        report = self._reconciler.run_once(nodes)
        with self._lock:
            self.passes += 1
            self._left -= len(nodes or ())
            if self._left <= 0:
                self.done.set()
        return report


def build(state: Path, nodes: list[str], per_node: int, agents: _Agents) -> None:
    store = SqliteStore(state)
    core = ControllerCore(store, agents)
    Reconciler(core).start()
    for name in nodes:
        core.register_node(name, "127.0.0.1:1", {})
    spec = Spec(kind=Kind.FASTPOD, sm_percent=10, memory_bytes=GiB, quota_request=0.5, quota_limit=1.0)
    for _ in range(len(nodes) * per_node):
        core.allocate(Request(spec=spec, owner="bench"))
    store.close()


def storm(state: Path, nodes: list[str], agents: _Agents, spread: float, coalesced: bool) -> dict[str, float]:
    """A restarted controller on ``state``; every node registers again."""
    store = SqliteStore(state)
    core = ControllerCore(store, agents)
    reconciler = Reconciler(core)
    reconciler.start()
    counting = _Counting(reconciler, len(nodes))
    passes = RegistrationPasses(counting) if coalesced else None

    def on_registered(name: str) -> None:
        if passes is not None:
            passes.add(name)
        else:   # the baseline: a thread per registration, each running its own pass
            threading.Thread(target=counting.run_once, args=([name],), daemon=True).start()

    def register(i: int, name: str) -> None:
        time.sleep(max(0.0, began + spread * i / len(nodes) - time.monotonic()))
        core.register_node(name, "127.0.0.1:1", {})
        on_registered(name)

    periodic: list[float] = []

    def reconcile_periodically() -> None:
        """As the controller's reconcile thread: a full pass every 5 s (its default), which
        takes the reconciler's lock among the registrations' passes."""
        while not counting.done.is_set():
            asked = time.monotonic()
            reconciler.run_once()
            periodic.append(time.monotonic() - asked)
            counting.done.wait(5.0)

    cpu = time.process_time()
    began = time.monotonic()
    keeper = threading.Thread(target=reconcile_periodically)
    keeper.start()
    with ThreadPoolExecutor(max_workers=8) as workers:
        list(workers.map(register, range(len(nodes)), nodes))
    registered = time.monotonic() - began
    counting.done.wait()
    took = time.monotonic() - began
    keeper.join()
    cpu = time.process_time() - cpu
    if passes is not None:
        passes.stop()
    store.close()
    return {"registered_s": registered, "s": took, "passes": counting.passes, "cpu_s": cpu,
            "periodic_s": max(periodic)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=300)
    parser.add_argument("--per-node", type=int, default=4, help="allocations per node (4 GPUs each)")
    parser.add_argument("--spread", type=float, default=2.0, help="seconds the registrations arrive over")
    args = parser.parse_args()
    logging.getLogger("fastshare").setLevel(logging.ERROR)   # a line per registration and pass
    nodes = [f"node-{i:05d}" for i in range(args.nodes)]
    agents = _Agents()
    with tempfile.TemporaryDirectory() as work:
        state = Path(work) / "state.db"
        build(state, nodes, args.per_node, agents)
        print(f"{args.nodes} nodes, {args.nodes * args.per_node} allocations, "
              f"registrations over {args.spread:g} s")
        print(f"{'':28} {'all registered':>15} {'all passed':>11} {'passes':>7} {'CPU s':>7} "
              f"{'longest periodic pass':>22}")
        results = {}
        for label, coalesced in (("one pass per registration", False), ("coalesced", True)):
            results[label] = r = storm(state, nodes, agents, args.spread, coalesced)
            print(f"{label:28} {r['registered_s']:>13.2f} s {r['s']:>9.2f} s {r['passes']:>7} "
                  f"{r['cpu_s']:>7.2f} {r['periodic_s']:>20.2f} s")
        old, new = results["one pass per registration"], results["coalesced"]
        print(f"coalesced: {old['s'] / new['s']:.1f}x sooner, {old['cpu_s'] / new['cpu_s']:.1f}x less CPU")


if __name__ == "__main__":
    main()
