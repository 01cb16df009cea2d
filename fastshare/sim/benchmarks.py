"""Placement benchmarks: allocation quality over traces x policies x seeds, and decision time
against cluster size (the openb cluster and synthetic clusters up to 10,000 nodes)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from fastshare.sim.experiment import Experiment, load, published_mean, read_published
from fastshare.sim.trace import SimNode, SimPod

NODES_FILE = "openb_node_list_gpu_node.csv"
SPEED_TRACE = "default"


def traces_in(data_dir: Path) -> list[str]:
    return sorted(p.stem.removeprefix("openb_pod_list_") for p in data_dir.glob("openb_pod_list_*.csv"))


def load_trace(data_dir: Path, trace: str) -> tuple[list[SimNode], list[SimPod], str]:
    return load(data_dir / f"openb_pod_list_{trace}.csv", data_dir / NODES_FILE)


def quality(data_dir: Path, traces: list[str], policies: list[str], seeds: list[int],
            on_run: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Mean final allocation per (trace, policy) over ``seeds``, beside the published mean."""
    # every file read before the first replay: a bad one fails at once, not hours in
    published = read_published(data_dir)
    loaded = [load_trace(data_dir, trace) for trace in traces]
    rows = []
    for nodes, pods, name in loaded:
        fgd_pub = published_mean(published, name, "fgd")
        for policy in policies:
            finals, walls = [], []
            for seed in seeds:
                _res, s = Experiment(nodes, pods, policy, seed, 1.3, name).run()
                finals.append(s["gpu_alloc_ratio"])
                walls.append(s["wall_s"])
                if on_run:
                    on_run(s)
            pub = published_mean(published, name, policy)
            mean = round(statistics.fmean(finals), 2)
            rows.append({
                "trace": name, "policy": policy, "seeds": len(seeds), "mean": mean,
                "min": min(finals), "max": max(finals),
                "published_mean": pub, "diff_vs_published": None if pub is None else round(mean - pub, 2),
                "published_fgd": fgd_pub,
                "diff_vs_published_fgd": None if fgd_pub is None else round(mean - fgd_pub, 2),
                "wall_s_mean": round(statistics.fmean(walls), 2),
            })
    return rows


def synthetic_nodes(nodes: list[SimNode], count: int) -> list[SimNode]:
    """``count`` nodes cycling through the openb node mix (same model and size proportions)."""
    return [SimNode(f"{nodes[i % len(nodes)].name}-s{i // len(nodes)}", nodes[i % len(nodes)].cpu_milli,
                    nodes[i % len(nodes)].memory_mib, nodes[i % len(nodes)].gpus, nodes[i % len(nodes)].model)
            for i in range(count)]


def speed(data_dir: Path, sizes: list[int], policy: str = "fastshare", seed: int = 42,
          trace: str = SPEED_TRACE,
          progress: Callable[[int], AbstractContextManager[Callable[[int, int], None]]] | None = None,
          ) -> list[dict[str, Any]]:
    """Decision time percentiles for the default trace (tune 1.3, so the task count grows with
    the cluster) on clusters of the given node counts; the first size should be 1,213.
    ``progress(nodes)``, if given, makes the ``update(done, total)`` of each size's replay."""
    base, pods, name = load_trace(data_dir, trace)
    rows = []
    for n in sizes:
        nodes = base if n == len(base) else synthetic_nodes(base, n)
        with progress(n) if progress else nullcontext() as update:
            _res, s = Experiment(nodes, pods, policy, seed, 1.3, name).run(update)
        rows.append({"nodes": n, "gpus": s["gpus"], "tasks": s["pods_total"], "policy": policy,
                     "p50_ms": s["decision_ms"]["p50"], "p99_ms": s["decision_ms"]["p99"],
                     "max_ms": s["decision_ms"]["max"], "cpu_p99_ms": s["decision_cpu_ms"]["p99"],
                     "wall_s": s["wall_s"],
                     "gpu_alloc_ratio": s["gpu_alloc_ratio"]})
    return rows
