"""The controller's placement engine against itself at another git revision: decision time
on the same openb arrivals, alternating per round (the machine is noisy; compare the two
columns of one run, not runs on different days).

Each round places the GPU tasks of the default trace (tune 1.3, seed 42) through a fresh
``Engine`` of this tree and one of ``--rev`` (its whole ``fastshare`` package, from
``git archive``), each in a child process of its own, and checks that both place every task
alike and word every rejection alike. Times are the thread CPU time of each ``place`` call.

    .venv/bin/python bench/engine_revisions.py --rev 6376042 [--nodes 1213] [--tasks 3000]

``--mig``: instead, exclusive requests (MIG slices of 14, 28, 42 or 98 SMs, seed 1, three in
ten steps releasing a held one) on ``--nodes`` nodes of eight A100-SXM4-40GB each.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def tree_at(rev: str) -> Path:
    """A directory holding the ``fastshare`` package as it was at ``rev``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "fastshare"],
                             check=True, capture_output=True).stdout
    root = Path(tempfile.mkdtemp(prefix="fastshare-rev-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    return root


def mig_child(nodes: int, steps: int) -> None:
    """Place exclusive requests with the ``fastshare`` on sys.path; print times and placements."""
    import random

    from fastshare.device.catalog import get_model
    from fastshare.placement import Engine, GpuView, NodeView, Request

    m = get_model("A100-SXM4-40GB")
    gpus = tuple(GpuView(i, m.key, m.memory_mib, m.sm_count, m.mig_capable, False, m.profiles)
                 for i in range(8))
    engine = Engine([NodeView(f"n{i}", 96000, 512 * 1024, gpus, {}, {}) for i in range(nodes)])
    rng, held, times, got = random.Random(1), [], [], []
    for k in range(steps or 400):
        if held and rng.random() < 0.3:
            engine.release(held.pop(rng.randrange(len(held))))
            continue
        request = Request(f"e{k}", "exclusive", sm_count=rng.choice([14, 28, 42, 98]), cpu_milli=1000)
        start = time.thread_time()
        result = engine.place(request)
        times.append(time.thread_time() - start)
        got.append([result.node, list(result.gpus), result.mig.start] if result else result.reason)
        if result:
            held.append(request.id)
    json.dump({"nodes": nodes, "times": times, "placements": got}, sys.stdout)


def child(nodes: int, tasks: int) -> None:
    """Place the arrivals with the ``fastshare`` on sys.path; print times and placements."""
    from fastshare.placement import Engine, make_policy
    from fastshare.placement.policies import MILLI, Task, typical_shapes
    from fastshare.sim import benchmarks
    from fastshare.sim.trace import arrival_order, node_tie_order

    data = Path(os.environ["FASTSHARE_OPENB"])   # the parent's: another revision's tree is elsewhere
    base, pods, _name = benchmarks.load_trace(data, benchmarks.SPEED_TRACE)
    cluster = base if nodes == len(base) else benchmarks.synthetic_nodes(base, nodes)
    typical = typical_shapes([Task(p.cpu_milli, p.gpu_milli, p.num_gpu, p.gpu_spec) for p in pods])
    capacity = sum(n.gpus for n in cluster) * MILLI
    arrivals = [p for p in arrival_order(pods, 42, 1.3, capacity) if p.num_gpu][:tasks or None]
    engine = Engine(benchmarks.engine_nodes(cluster, node_tie_order(cluster, 42)),
                    policy=make_policy("fastshare", typical, seed=42))
    times, got = [], []
    for k, pod in enumerate(arrivals):
        request = benchmarks.engine_request(k, pod)
        start = time.thread_time()
        result = engine.place(request)
        times.append(time.thread_time() - start)
        got.append([result.node, list(result.gpus)] if result else result.reason)
    json.dump({"nodes": len(cluster), "times": times, "placements": got}, sys.stdout)


def run(tree: Path, nodes: int, tasks: int, mig: bool) -> dict:
    from fastshare.sim.experiment import default_data_dir

    data = default_data_dir()
    if data is None:
        sys.exit("openb data not found (../shared/data/openb)")
    env = dict(os.environ, PYTHONPATH=str(tree), FASTSHARE_OPENB=str(data))
    out = subprocess.run([sys.executable, __file__, "--child", "--nodes", str(nodes), "--tasks", str(tasks),
                          *(["--mig"] if mig else [])],
                         env=env, cwd=tree, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="the git revision to compare with, e.g. 6376042")
    ap.add_argument("--nodes", type=int, default=1213, help="cluster size (1213: the openb cluster)")
    ap.add_argument("--tasks", type=int, default=3000, help="GPU tasks placed per round (0: all)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mig", action="store_true", help="exclusive requests on 8-A100 nodes instead (--tasks: "
                    "steps, 0: 400)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        (mig_child if args.mig else child)(args.nodes, args.tasks)
        return
    if not args.rev:
        ap.error("--rev is required")
    from fastshare.sim.benchmarks import quantile_ms
    trees = {"this tree": REPO, args.rev: tree_at(args.rev)}
    what = (f"{args.tasks or 400} steps of exclusive requests" if args.mig
            else f"{args.tasks or 'all'} GPU tasks")
    print(f"this tree vs {args.rev}, {what} per round, {args.nodes} nodes")
    print(" ".join(f"{h:>{w}}" for h, w in (("round", 5), ("engine", 10), ("rejected", 8), ("p50 ms", 8),
                                             ("p99 ms", 8), ("max ms", 8), ("total s", 8))))
    for rnd in range(args.rounds):
        placements = []
        for label, tree in trees.items():
            result = run(tree, args.nodes, args.tasks, args.mig)
            times, got = result["times"], result["placements"]
            placements.append(got)
            p50, p99, most = (quantile_ms(times, p) for p in (.5, .99, 1.0))
            rejected = sum(isinstance(x, str) for x in got)
            print(f"{rnd + 1:>5} {label:>10} {rejected:>8} {p50:8.3f} {p99:8.3f} {most:8.1f} "
                  f"{sum(times):8.2f}")
        mine, theirs = placements
        differ = next((k for k, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        print("      same placements and rejection reasons" if differ is None else
              f"      placements or rejection reasons differ from task {differ}: {mine[differ]!r} against "
              f"{theirs[differ]!r}")


if __name__ == "__main__":
    main()
