#!/usr/bin/env python3
"""Upper bound on the final GPU allocation that ANY placement policy can reach on an openb
trace under the published rules (every task that fits at its arrival is placed, no
departures), even one that knows the whole arrival order in advance.

    pip install scipy        # not a dependency of fastshare; only this script needs it
    python bench/openb_bound.py --trace default --seeds 42-51

Argument. Take any run and let ``tau`` be the first arrival after which no GPU is entirely
free. Before ``tau`` a free GPU exists, so every single-GPU task arriving before it fits and
is placed; at ``tau`` every GPU holds at least one task; after ``tau`` nothing frees up, so
later tasks can only go into the holes left at ``tau`` (whole-GPU tasks nowhere). For a
given ``tau`` a linear programme over GPU *contents* (multisets of per-GPU shares) bounds the
allocation: pre-``tau`` contents must use exactly the pre-``tau`` sharing tasks and 1-GPU
whole tasks and cover all G GPUs (multi-GPU tasks may be dropped); each hole left at ``tau``
may then take any multiset of later sharing tasks that fits it, within their counts. The LP
relaxes integrality, the order inside each phase, the obligation to place later tasks that
fit, and node CPU, memory and co-location of multi-GPU tasks, so its optimum is at least
what a real policy reaches with that ``tau``; the bound is the best ``tau`` (coarse-to-fine
search). ``--dead`` also lets GPUs be "used up" before ``tau`` with nothing on them (a node
whose CPU a policy starved on purpose), later fillable by shares: it did not raise the bound
on default.

Assumption to keep in mind: CPU and memory never make a single-GPU task fail while a GPU is
entirely free (true in the fastshare and FGD runs: their first failures come when fewer
than a handful of free GPUs are left, on CPU-exhausted nodes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastshare.sim.experiment import default_data_dir, load
from fastshare.sim.trace import SimPod, arrival_order

try:
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix
except ImportError:  # pragma: no cover - optional tool
    sys.exit("openb_bound.py needs scipy: pip install scipy")

MILLI = 1000


def _sharing(p: SimPod) -> bool:
    return p.num_gpu == 1 and p.gpu_milli < MILLI


class Bound:
    """LP bound for one arrival order over ``gpus`` GPUs."""

    def __init__(self, order: list[SimPod], gpus: int, dead: bool = False) -> None:
        self.order, self.gpus, self.dead = order, gpus, dead
        self.sizes = sorted({p.gpu_milli for p in order if _sharing(p)})
        self.index = {s: i for i, s in enumerate(self.sizes)}
        self.contents = [m for m in self._multisets(MILLI) if self._sum(m) > 0]
        self._fills: dict[int, list[tuple[int, ...]]] = {}

    def _multisets(self, limit: int) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []

        def rec(i: int, rem: int, cur: list[int]) -> None:
            if i == len(self.sizes):
                out.append(tuple(cur))
                return
            k = 0
            while k * self.sizes[i] <= rem:
                cur.append(k)
                rec(i + 1, rem - k * self.sizes[i], cur)
                cur.pop()
                k += 1

        rec(0, limit, [])
        return out

    def _sum(self, m: tuple[int, ...]) -> int:
        return sum(k * s for k, s in zip(m, self.sizes, strict=True))

    def _fits(self, hole: int) -> list[tuple[int, ...]]:
        if hole not in self._fills:
            self._fills[hole] = [m for m in self.contents if self._sum(m) <= hole]
        return self._fills[hole]

    def at(self, tau: int) -> float | None:
        """Bound (percent of capacity) for runs whose last entirely free GPU goes at ``tau``;
        None if no run can have that ``tau``."""
        pre, post = self.order[:tau], self.order[tau:]
        n = len(self.sizes)
        before = Counter(self.index[p.gpu_milli] for p in pre if _sharing(p))
        after = Counter(self.index[p.gpu_milli] for p in post if _sharing(p))
        whole1 = sum(1 for p in pre if p.num_gpu == 1 and not _sharing(p))
        multi = Counter(p.num_gpu for p in pre if p.num_gpu >= 2)
        holes = sorted({MILLI - self._sum(m) for m in self.contents if self._sum(m) < MILLI}
                       | ({MILLI} if self.dead else set()))
        # rows: 0 = GPUs used at tau; 1..n = pre-tau shares of each size; n+1 = whole-GPU units;
        # then one row per hole size (fills <= holes) and n rows of post-tau shares (<= counts)
        hole_row = {h: n + 2 + i for i, h in enumerate(holes)}
        post_row = n + 2 + len(holes)
        cols: list[tuple[int, dict[int, int], float | None]] = []
        for m in self.contents:
            rows = {0: 1} | {1 + i: k for i, k in enumerate(m) if k}
            if self._sum(m) < MILLI:
                rows[hole_row[MILLI - self._sum(m)]] = -1
            cols.append((self._sum(m), rows, None))
        cols.append((MILLI, {0: 1, n + 1: 1}, None))
        for k, count in multi.items():           # multi-GPU tasks may fail: at most `count`
            cols.append((0, {n + 1: -k}, count))
        if self.dead:                            # so may 1-GPU ones, for want of CPU
            cols.append((0, {n + 1: 1}, whole1))
        if self.dead:
            cols.append((0, {0: 1, hole_row[MILLI]: -1}, None))
        for h in holes:
            for m in self._fits(h):
                cols.append((self._sum(m), {hole_row[h]: 1} | {post_row + i: k for i, k in enumerate(m) if k},
                             None))
        r, c, v = [], [], []
        for j, (_, rows, _) in enumerate(cols):
            for i, coef in rows.items():
                r.append(i)
                c.append(j)
                v.append(coef)
        a = coo_matrix((v, (r, c)), shape=(post_row + n, len(cols))).tocsr()
        eq, ub = list(range(n + 2)), list(range(n + 2, post_row + n))
        res = linprog(-np.array([o for o, _, _ in cols], dtype=float),
                      A_ub=a[ub], b_ub=[0] * len(holes) + [after.get(i, 0) for i in range(n)],
                      A_eq=a[eq], b_eq=[self.gpus] + [before.get(i, 0) for i in range(n)] + [whole1],
                      bounds=[(0, u) for _, _, u in cols], method="highs")
        return None if res.status != 0 else -res.fun * 100 / (self.gpus * MILLI)

    def best(self) -> tuple[int, float, int]:
        """(tau, bound, LPs solved): coarse scan of the feasible taus, then refinement."""
        memo: dict[int, float] = {}

        def val(t: int) -> float:
            if t not in memo:
                b = self.at(t)
                memo[t] = -1.0 if b is None else b
            return memo[t]

        units, lo = 0, 0
        for lo, p in enumerate(self.order):  # noqa: B007 - lo is used after the loop
            units += p.num_gpu
            if units >= self.gpus * 0.9:
                break
        top = len(self.order)
        tau = max(range(lo, top + 1, 100), key=val)
        for step in (20, 5, 1):
            tau = max(range(max(lo, tau - 4 * step), min(top, tau + 4 * step) + 1, step), key=val)
        return tau, memo[tau], len(memo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="default")
    ap.add_argument("--seeds", default="42-51", help="A-B or a comma list")
    ap.add_argument("--tune", type=float, default=1.3)
    ap.add_argument("--dead", action="store_true", help="allow GPUs starved of CPU before tau")
    ap.add_argument("--data", type=Path, default=default_data_dir())
    args = ap.parse_args()
    if args.data is None:
        sys.exit("--data: no openb data directory found; pass the folder holding the CSVs")
    seeds = (list(range(int(args.seeds.split("-")[0]), int(args.seeds.split("-")[1]) + 1))
             if "-" in args.seeds else [int(s) for s in args.seeds.split(",")])
    nodes, pods, _ = load(args.data / f"openb_pod_list_{args.trace}.csv",
                          args.data / "openb_node_list_gpu_node.csv")
    gpus = sum(nd.gpus for nd in nodes)
    bounds = []
    for seed in seeds:
        t0 = time.perf_counter()
        order = arrival_order(pods, seed, args.tune, gpus * MILLI)
        tau, b, lps = Bound(order, gpus, args.dead).best()
        arrived = sum(p.gpu_request for p in order[:tau]) * 100 / (gpus * MILLI)
        bounds.append(b)
        print(f"{args.trace} seed {seed}: bound {b:.2f} % (tau {tau}, arrived {arrived:.1f} %, "
              f"{lps} LPs, {time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"{args.trace} mean bound over {len(seeds)} seeds: {statistics.fmean(bounds):.2f} %")


if __name__ == "__main__":
    main()
