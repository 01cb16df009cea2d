#!/usr/bin/env python3
"""Upper bound on the final GPU allocation that ANY placement policy can reach on an openb
trace under the published rules (every task that fits at its arrival is placed, no
departures), even one that knows the whole arrival order in advance.

    pip install scipy        # one of the dev tools (make test installs it), not a runtime dependency
    python bench/openb_bound.py --trace default --seeds 42-51
    python bench/openb_bound.py --trace default --seeds 42 --policy fastshare

Argument. Take any run and let ``tau`` be the first arrival after which no GPU is entirely
free. Before ``tau`` a free GPU exists, so every single-GPU task arriving before it fits and
is placed; at ``tau`` every GPU holds at least one task; after ``tau`` nothing frees up, so
later tasks can only go into the holes left at ``tau`` (whole-GPU tasks nowhere). For a
given ``tau`` a linear programme over GPU *contents* (multisets of per-GPU shares) bounds the
allocation: pre-``tau`` contents must use exactly the pre-``tau`` sharing tasks and 1-GPU
whole tasks and cover all GPUs (multi-GPU tasks may be dropped); each hole left at ``tau``
may then take any multiset of later sharing tasks that fits it, within their counts.

Node CPU is kept per group of nodes with similar CPU per GPU (``CPU_GROUPS``): every task
placed in a group, with its own CPU request, counts against the group's total CPU. Merging
nodes into groups relaxes per-node CPU, so this stays an upper bound. The LP also relaxes
integrality, the order inside each phase, the obligation to place later tasks that fit,
memory and co-location of multi-GPU tasks, and leaves out CPU-only tasks (as if they had
failed); so its optimum is at least what a real policy reaches with that ``tau``. The bound
is the best ``tau`` (coarse-to-fine search). ``--dead`` also lets GPUs be "used up" before
``tau`` with nothing on them (a node whose CPU a policy starved on purpose), later fillable by
shares, and 1-GPU whole tasks fail.

``--policy NAME`` also runs that policy on the same order and prints the bound (with
``--dead``) at the policy's own ``tau`` (``saturation``): how far the policy is from the best
any policy could do with the same saturation point, apart from how far that point is from
the best one.

Assumption to keep in mind: CPU and memory never make a single-GPU task fail while a GPU is
entirely free (true in the fastshare and FGD runs: their first failures come when fewer
than a handful of free GPUs are left, on CPU-exhausted nodes; ``--dead`` drops it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastshare.sim.experiment import Experiment, default_data_dir, load
from fastshare.sim.replay import SimResult
from fastshare.sim.trace import SimNode, SimPod, arrival_order

try:
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix
except ImportError:  # pragma: no cover - optional tool
    sys.exit("openb_bound.py needs scipy: pip install scipy")

MILLI = 1000
CPU_GROUPS = (8000, 12000, 16000)  # node groups by CPU milli per GPU: <= 8, <= 12, <= 16 cores, more


def _sharing(p: SimPod) -> bool:
    return p.num_gpu == 1 and p.gpu_milli < MILLI


def _group(node: SimNode) -> int:
    per_gpu = node.cpu_milli / node.gpus
    return next((i for i, edge in enumerate(CPU_GROUPS) if per_gpu <= edge), len(CPU_GROUPS))


class _Rows:
    """Named LP rows with their right-hand sides, equalities and upper bounds apart."""

    def __init__(self) -> None:
        self.eq: dict[tuple, int] = {}
        self.ub: dict[tuple, int] = {}

    def matrices(self, cols: list[tuple[float, dict[tuple, int], float | None]]) -> list:
        """``[A_ub, b_ub, A_eq, b_eq]`` for scipy's ``linprog``; a column's coefficients in rows
        not declared here are dropped."""
        out: list = []
        for rhs in (self.ub, self.eq):
            index = {name: i for i, name in enumerate(rhs)}
            r, c, v = [], [], []
            for j, (_, rows, _) in enumerate(cols):
                for name, coef in rows.items():
                    if name in index:
                        r.append(index[name])
                        c.append(j)
                        v.append(coef)
            out += [coo_matrix((v, (r, c)), shape=(len(rhs), len(cols))).tocsr(), list(rhs.values())]
        return out


class Bound:
    """LP bound for one arrival order over ``nodes``."""

    def __init__(self, order: list[SimPod], nodes: list[SimNode], dead: bool = False) -> None:
        self.order, self.dead = order, dead
        self.gpus = sum(nd.gpus for nd in nodes)
        groups = len(CPU_GROUPS) + 1
        self.group_gpus, self.group_cpu = [0] * groups, [0] * groups
        for nd in nodes:
            if nd.gpus:
                self.group_gpus[_group(nd)] += nd.gpus
                self.group_cpu[_group(nd)] += nd.cpu_milli
        self.sizes = sorted({p.gpu_milli for p in order if _sharing(p)})
        self.index = {s: i for i, s in enumerate(self.sizes)}
        self.contents = [m for m in self._multisets(MILLI) if self._sum(m) > 0]
        self.holes = sorted({MILLI - self._sum(m) for m in self.contents if self._sum(m) < MILLI})
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

    def at(self, tau: int, dead: bool | None = None) -> float | None:
        """Bound (percent of capacity) for runs whose last entirely free GPU goes at ``tau``;
        None if no run can have that ``tau``.

        Columns per node group: pre-``tau`` contents (each leaves a hole), fills of holes by
        later shares, and the assignment of tasks of each (size, CPU) to the group, which is
        where CPU is counted; sizes link contents and assignments. ``dead`` (default: as given
        to the constructor) allows GPUs used up with nothing on them, as ``--dead``."""
        dead = self.dead if dead is None else dead
        holes = [*self.holes, MILLI] if dead else self.holes
        pre, post = self.order[:tau], self.order[tau:]
        pre_shares = Counter((self.index[p.gpu_milli], p.cpu_milli) for p in pre if _sharing(p))
        post_shares = Counter((self.index[p.gpu_milli], p.cpu_milli) for p in post if _sharing(p))
        whole1 = Counter(p.cpu_milli for p in pre if p.num_gpu == 1 and not _sharing(p))
        multi = Counter((p.num_gpu, p.cpu_milli) for p in pre if p.num_gpu >= 2)
        rows = _Rows()
        cols: list[tuple[float, dict[tuple, int], float | None]] = []
        for g, (gpus, cpu) in enumerate(zip(self.group_gpus, self.group_cpu, strict=True)):
            rows.eq[("cover", g)] = gpus
            rows.ub[("cpu", g)] = cpu
            for i in range(len(self.sizes)):
                rows.eq[("pre", g, i)] = rows.eq[("post", g, i)] = 0
            for h in holes:
                rows.ub[("hole", g, h)] = 0
            for m in self.contents:
                r = {("cover", g): 1} | {("pre", g, i): k for i, k in enumerate(m) if k}
                if self._sum(m) < MILLI:
                    r[("hole", g, MILLI - self._sum(m))] = -1
                cols.append((self._sum(m), r, None))
            if dead:  # a GPU used up with nothing on it, whose hole later shares may fill
                cols.append((0, {("cover", g): 1, ("hole", g, MILLI): -1}, None))
            for h in holes:
                for m in self._fits(h):
                    fill = {("post", g, i): k for i, k in enumerate(m) if k}
                    cols.append((self._sum(m), {("hole", g, h): 1} | fill, None))
            for phase, counts in (("pre", pre_shares), ("post", post_shares)):
                for i, c in counts:
                    cols.append((0, {(phase, g, i): -1, (phase + " tasks", i, c): 1, ("cpu", g): c}, None))
            for c in whole1:
                cols.append((MILLI, {("cover", g): 1, ("whole1", c): 1, ("cpu", g): c}, None))
            for k, c in multi:                    # multi-GPU tasks may fail: at most their count
                cols.append((MILLI * k, {("cover", g): k, ("multi", k, c): 1, ("cpu", g): c}, None))
        for (i, c), n in pre_shares.items():
            rows.eq[("pre tasks", i, c)] = n
        for (i, c), n in post_shares.items():
            rows.ub[("post tasks", i, c)] = n
        for c, n in whole1.items():               # with --dead, 1-GPU whole tasks may fail too
            (rows.ub if dead else rows.eq)[("whole1", c)] = n
        for key, n in multi.items():
            rows.ub[("multi", *key)] = n
        if not cols:  # nothing could be on the GPUs at ``tau``, so none can be covered
            return None
        a_ub, b_ub, a_eq, b_eq = rows.matrices(cols)
        res = linprog(-np.array([o for o, _, _ in cols], dtype=float), A_ub=a_ub, b_ub=b_ub,
                      A_eq=a_eq, b_eq=b_eq, bounds=[(0, u) for _, _, u in cols], method="highs")
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
        tau = max(range(lo, top + 1, 200), key=val)
        for step in (50, 10, 2, 1):
            tau = max(range(max(lo, tau - 2 * step), min(top, tau + 2 * step) + 1, step), key=val)
        return tau, memo[tau], len(memo)


def saturation(nodes: list[SimNode], result: SimResult) -> int | None:
    """A run's ``tau``: the number of arrivals before its first single-GPU task failed or up
    to the one that took its last entirely free GPU, whichever comes first (a few GPUs on
    CPU-exhausted nodes can stay free long after the cluster is full for everything else;
    the bound at this ``tau`` needs ``dead`` for them). None if neither happened."""
    free = {(i, j) for i, nd in enumerate(nodes) for j in range(nd.gpus)}
    for k, placed in enumerate(result.placements):
        if placed.node is None:
            if placed.pod.num_gpu == 1:
                return k
            continue
        free -= {(placed.node, j) for j in placed.gpus}
        if not free:
            return k + 1
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="default")
    ap.add_argument("--seeds", default="42-51", help="A-B or a comma list")
    ap.add_argument("--tune", type=float, default=1.3)
    ap.add_argument("--dead", action="store_true", help="allow GPUs starved of CPU before tau")
    ap.add_argument("--policy", help="also run this policy and bound the runs with its own tau")
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
        bound = Bound(order, nodes, args.dead)
        tau, b, lps = bound.best()
        arrived = sum(p.gpu_request for p in order[:tau]) * 100 / (gpus * MILLI)
        bounds.append(b)
        print(f"{args.trace} seed {seed}: bound {b:.2f} % (tau {tau}, arrived {arrived:.1f} %, "
              f"{lps} LPs, {time.perf_counter() - t0:.0f} s)", flush=True)
        if args.policy:
            res, _ = Experiment(nodes, pods, args.policy, seed, args.tune).run(order=order)
            own = saturation(nodes, res)
            at_own = bound.at(own, dead=True) if own is not None else None
            print(f"  {args.policy}: {res.gpu_alloc_ratio:.2f} %, its tau {own}; bound at its tau "
                  + (f"{at_own:.2f} %" if at_own is not None else "n/a"), flush=True)
    print(f"{args.trace} mean bound over {len(seeds)} seeds: {statistics.fmean(bounds):.2f} %")


if __name__ == "__main__":
    main()
