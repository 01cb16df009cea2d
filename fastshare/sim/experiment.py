"""One published-style experiment: trace + cluster + policy + seed + tune -> figures.

Shared by ``fastshare sim``, ``fastshare bench placement`` and the tests, so that every
figure in BENCHMARKS.md comes from the same code path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastshare.placement import make_policy
from fastshare.placement.policies import MILLI, Task, typical_shapes
from fastshare.sim.replay import SimResult, simulate
from fastshare.sim.trace import (
    PublishedCurves,
    SimNode,
    SimPod,
    TraceError,
    arrival_order,
    check_some_task_fits,
    node_tie_order,
    read_nodes,
    read_pods,
    read_published_curves,
)

CURVES_FILE = "published_alloc_curves.csv"
PUBLISHED_POLICY = {"random": "01-Random", "dotprod": "02-DotProd", "gpuclustering": "03-GpuClustering",
                    "gpupacking": "04-GpuPacking", "bestfit": "05-BestFit", "fgd": "06-FGD"}


def default_data_dir() -> Path | None:
    """../shared/data/openb relative to the repository, when it is there."""
    here = Path(__file__).resolve().parents[2]
    for cand in (here.parent / "shared" / "data" / "openb", here.parent.parent / "shared" / "data" / "openb"):
        if (cand / "openb_node_list_gpu_node.csv").is_file():
            return cand
    return None


@dataclass
class Experiment:
    nodes: list[SimNode]
    pods: list[SimPod]
    policy: str
    seed: int = 42
    tune: float = 1.3
    trace_name: str = ""

    def run(self, progress: Callable[[int, int], None] | None = None, order: list[SimPod] | None = None,
            ranks: list[int] | None = None) -> tuple[SimResult, dict[str, Any]]:
        t0 = time.perf_counter()
        capacity = sum(n.gpus for n in self.nodes) * MILLI
        if capacity == 0:
            raise TraceError("the node list has no GPUs")
        typical = typical_shapes([Task(p.cpu_milli, p.gpu_milli, p.num_gpu, p.gpu_spec) for p in self.pods])
        if order is None:
            order = arrival_order(self.pods, self.seed, self.tune, capacity)
        if ranks is None:
            ranks = node_tie_order(self.nodes, self.seed)
        policy = make_policy(self.policy, typical, seed=self.seed)
        cb = None if progress is None else (lambda k: progress(k, len(order)))
        res = simulate(self.nodes, order, policy, ranks, typical, progress=cb)
        res.wall_s = time.perf_counter() - t0
        def pct(values: list[float], p: float) -> float:
            values = sorted(values)
            return round(values[min(len(values) - 1, int(p * len(values)))] * 1000, 3) if values else 0.0

        summary = {
            "policy": self.policy,
            "trace": self.trace_name,
            "seed": self.seed,
            "tune": self.tune,
            "nodes": len(self.nodes),
            "gpus": capacity // MILLI,
            "gpu_alloc_ratio": res.gpu_alloc_ratio,
            "curve": [[x, y] for x, y in res.curve],
            "pods_total": len(order),
            "pods_failed": res.pods_failed,
            "gpu_pods_failed": res.gpu_pods_failed,
            "frag_ratio": None if math.isnan(res.frag_ratio) else round(res.frag_ratio, 2),
            # wall time includes waiting for the CPU on a loaded machine; CPU time is the work itself
            "decision_ms": {q: pct(res.decision_s, p) for q, p in (("p50", .5), ("p99", .99), ("max", 1.0))},
            "decision_cpu_ms": {q: pct(res.decision_cpu_s, p) for q, p in (("p50", .5), ("p99", .99),
                                                                           ("max", 1.0))},
            "wall_s": round(res.wall_s, 3),
        }
        return res, summary


def load(pods_path: str | Path, nodes_path: str | Path) -> tuple[list[SimNode], list[SimPod], str]:
    pods_path = Path(pods_path)
    name = pods_path.stem.removeprefix("openb_pod_list_")
    nodes, pods = read_nodes(nodes_path), read_pods(pods_path)
    if any(n.gpus for n in nodes):   # without GPUs the caller has its own message
        check_some_task_fits(pods, nodes, pods_path, nodes_path)
    return nodes, pods, name


def read_published(data_dir: Path) -> PublishedCurves:
    """published_alloc_curves.csv beside the traces, read and checked whole; {} without one."""
    path = data_dir / CURVES_FILE
    return read_published_curves(path) if path.is_file() else {}


def published_curves(published: PublishedCurves, trace: str, policy: str) -> dict[int, list[float]]:
    """seed -> published curve (y values for x = 0..130) of ``trace`` and ``policy`` at tune 1.3."""
    label = PUBLISHED_POLICY.get(policy)
    return {seed: curve for (workload, sc_policy, tune, seed), curve in published.items()
            if workload == f"openb_pod_list_{trace}" and sc_policy == label and tune == 1.3}


def published_mean(published: PublishedCurves, trace: str, policy: str) -> float | None:
    curves = published_curves(published, trace, policy)
    if not curves:
        return None
    return round(sum(c[-1] for c in curves.values()) / len(curves), 2)
