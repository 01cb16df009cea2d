"""The controller's placement engine against itself at another git revision: decision time
on the same openb arrivals, in one process, alternating per round (the machine is noisy;
compare the two columns, not runs on different days).

Each round places the GPU tasks of the default trace (tune 1.3, seed 42) through a fresh
``Engine`` of this tree and one built from ``fastshare/placement/engine.py`` at ``--rev``
(the rest of the package is this tree's), and checks that both place every task alike.

    .venv/bin/python bench/engine_revisions.py --rev 6376042 [--nodes 1213] [--tasks 3000]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from fastshare.placement import Engine, make_policy
from fastshare.placement.policies import MILLI, Task, typical_shapes
from fastshare.sim import benchmarks
from fastshare.sim.experiment import default_data_dir
from fastshare.sim.trace import arrival_order, node_tie_order

REPO = Path(__file__).resolve().parent.parent


def engine_at(rev: str) -> ModuleType:
    """``fastshare.placement.engine`` as it was at ``rev``."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:fastshare/placement/engine.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "engine_at_rev.py"
    path.write_text(source)
    name = "fastshare.placement.engine_at_rev"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] * 1000 if values else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare with, e.g. 6376042")
    ap.add_argument("--nodes", type=int, default=1213, help="cluster size (1213: the openb cluster)")
    ap.add_argument("--tasks", type=int, default=3000, help="GPU tasks placed per round (0: all)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    data = default_data_dir()
    if data is None:
        sys.exit("openb data not found (../shared/data/openb)")
    other = engine_at(args.rev)
    base, pods, _name = benchmarks.load_trace(data, benchmarks.SPEED_TRACE)
    nodes = base if args.nodes == len(base) else benchmarks.synthetic_nodes(base, args.nodes)
    typical = typical_shapes([Task(p.cpu_milli, p.gpu_milli, p.num_gpu, p.gpu_spec) for p in pods])
    capacity = sum(n.gpus for n in nodes) * MILLI
    tasks = [p for p in arrival_order(pods, 42, 1.3, capacity) if p.num_gpu][:args.tasks or None]
    views = benchmarks.engine_nodes(nodes, node_tie_order(nodes, 42))
    print(f"{len(views)} nodes, {len(tasks)} GPU tasks per round; this tree vs {args.rev}")
    print(" ".join(f"{h:>{w}}" for h, w in (("round", 5), ("engine", 10), ("rejected", 8), ("p50 ms", 8),
                                             ("p99 ms", 8), ("max ms", 8), ("total s", 8))))
    for rnd in range(args.rounds):
        placements = {}
        for label, cls in (("this tree", Engine), (args.rev, other.Engine)):
            engine = cls(views, policy=make_policy("fastshare", typical, seed=42))
            times, got = [], []
            for k, pod in enumerate(tasks):
                request = benchmarks.engine_request(k, pod)
                start = time.thread_time()
                result = engine.place(request)
                times.append(time.thread_time() - start)
                got.append((result.node, result.gpus) if result else None)
            placements[label] = got
            print(f"{rnd + 1:>5} {label:>10} {got.count(None):>8} {percentile(times, .5):8.3f} "
                  f"{percentile(times, .99):8.3f} {percentile(times, 1.0):8.1f} {sum(times):8.2f}")
        mine, theirs = placements.values()
        differ = next((k for k, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        print("      same placements" if differ is None else f"      placements differ from task {differ}")


if __name__ == "__main__":
    main()
