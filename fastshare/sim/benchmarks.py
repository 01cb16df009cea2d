"""Placement benchmarks: allocation quality over traces x policies x seeds, and decision time
against cluster size (the openb cluster and synthetic clusters up to 10,000 nodes), of the
trace replay and of the controller's ``Engine`` on the same clusters and arrivals."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from fastshare.placement import Engine, GpuView, NodeView, Request, make_policy
from fastshare.placement.policies import MILLI, Task, typical_shapes
from fastshare.sim.experiment import Experiment, load, published_mean, read_published
from fastshare.sim.trace import SimNode, SimPod, arrival_order, node_tie_order

NODES_FILE = "openb_node_list_gpu_node.csv"
SPEED_TRACE = "default"
# The engine checks GPU memory, which the published traces lack: every GPU gets 1 TiB and every
# share asks 1 MiB, so memory never binds (tests/sim/test_engine_replay.py maps them alike).
GPU_MEMORY_MIB = 1 << 20


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


def engine_request(k: int, pod: SimPod) -> Request:
    """Task ``k`` of a trace as the controller asks for it: a share of one GPU -> ``fastpod`` with
    that SM share (and time quota, which so never binds before the SM share), else ``whole``."""
    models = tuple(sorted(pod.gpu_spec))
    if pod.num_gpu == 1 and pod.gpu_milli < MILLI:
        share = pod.gpu_milli / MILLI
        return Request(f"t{k}", "fastpod", sm_percent=pod.gpu_milli / 10, gpu_memory_mib=1,
                       quota_request=share, quota_limit=share, cpu_milli=pod.cpu_milli,
                       memory_mib=pod.memory_mib, gpu_models=models)
    return Request(f"t{k}", "whole", gpus=pod.num_gpu, cpu_milli=pod.cpu_milli, memory_mib=pod.memory_mib,
                   gpu_models=models)


def engine_nodes(nodes: list[SimNode], ranks: list[int]) -> list[NodeView]:
    """The trace's nodes as the engine's view, in the replay's tie order (the engine breaks
    score ties by node order)."""
    by_rank = sorted(range(len(nodes)), key=lambda i: ranks[i])
    return [NodeView(n.name, n.cpu_milli, n.memory_mib,
                     tuple(GpuView(j, n.model, GPU_MEMORY_MIB, 80) for j in range(n.gpus)))
            for n in (nodes[i] for i in by_rank)]


def engine_speed(data_dir: Path, sizes: list[int], policy: str = "fastshare", seed: int = 42,
                 trace: str = SPEED_TRACE,
                 progress: Callable[[int], AbstractContextManager[Callable[[int, int], None]]] | None = None,
                 ) -> list[dict[str, Any]]:
    """Decision time of ``Engine.place`` on the clusters and arrivals ``speed`` replays: every
    GPU task in arrival order (the cluster fills, then about a quarter are rejected). CPU-only
    tasks are left out: the controller leaves them to the kube-scheduler (the engine sees their
    CPU only through ``set_capacity``). Placements and rejections are also timed apart: a
    rejection also says why."""
    base, pods, _name = load_trace(data_dir, trace)
    typical = typical_shapes([Task(p.cpu_milli, p.gpu_milli, p.num_gpu, p.gpu_spec) for p in pods])
    rows = []
    for n in sizes:
        nodes = base if n == len(base) else synthetic_nodes(base, n)
        capacity = sum(nd.gpus for nd in nodes) * MILLI
        tasks = [p for p in arrival_order(pods, seed, 1.3, capacity) if p.num_gpu]
        engine = Engine(engine_nodes(nodes, node_tie_order(nodes, seed)),
                        policy=make_policy(policy, typical, seed=seed))
        walls, cpus, placed = [], [], 0
        timed: dict[bool, list[float]] = {True: [], False: []}   # placed or rejected -> wall times
        t0 = time.perf_counter()
        with progress(n) if progress else nullcontext() as update:
            for k, pod in enumerate(tasks):
                request = engine_request(k, pod)
                start, cpu_start = time.perf_counter(), time.thread_time()
                got = engine.place(request)
                walls.append(time.perf_counter() - start)
                cpus.append(time.thread_time() - cpu_start)
                placed += pod.gpu_request if got else 0
                timed[bool(got)].append(walls[-1])
                if update and k % 64 == 0:
                    update(k, len(tasks))
        rows.append({"nodes": n, "gpus": capacity // MILLI, "tasks": len(tasks), "policy": policy,
                     "p50_ms": quantile_ms(walls, .5), "p99_ms": quantile_ms(walls, .99),
                     "max_ms": quantile_ms(walls, 1.0), "cpu_p99_ms": quantile_ms(cpus, .99),
                     "wall_s": round(time.perf_counter() - t0, 3), "rejected": len(timed[False]),
                     "placed_p99_ms": quantile_ms(timed[True], .99),
                     "rejected_p99_ms": quantile_ms(timed[False], .99),
                     "gpu_alloc_ratio": round(placed * 100 / capacity, 2)})
    return rows


def quantile_ms(values: list[float], p: float) -> float:
    """The ``p`` quantile of ``values`` (seconds) in ms, as the replay's figures are taken."""
    values = sorted(values)
    return round(values[min(len(values) - 1, int(p * len(values)))] * 1000, 3) if values else 0.0
