"""Measure the MIG layout planner against simple baselines, in one run.

    python -m fastshare.device.layout_bench [--model A100-SXM4-40GB] [--pairs 300] [--seed 1]

1. Acceptance: over every layout (multiset of profiles) that fits the GPU in SOME arrangement,
   how many each strategy realises: NVML's own placer in a random creation order, largest
   first at the lowest free start, and the planner's search.
2. Churn: for random (current, wanted) layout pairs, how many create/destroy steps the
   planner needs versus "destroy everything, create the new layout" (what an all-or-nothing
   reconfiguration does), i.e. how many running instances survive a change.
3. Planning time per layout, versus the largest-first baseline.
Figures are printed as ratios to the baselines measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from itertools import combinations_with_replacement

from fastshare.device.catalog import get_model
from fastshare.device.mig_layout import GpuShape, LayoutError, Placed, check_layout, plan_layout


def _fits(shape: GpuShape, placed: list[Placed], pid: int, start: int) -> bool:
    prof = shape.profile(pid)
    mask = shape.mask(prof, start)
    used = 0
    compute = prof.slices
    count = 1
    for p in placed:
        q = shape.profile(p.profile_id)
        used |= shape.mask(q, p.start)
        compute += q.slices
        count += p.profile_id == pid
    return not used & mask and compute <= shape.compute_slices and count <= prof.max_instances


def nvml_default_order(shape: GpuShape, order: list[int]) -> bool:
    """NVML's placer without explicit placements: highest free allowed start, in this order."""
    placed: list[Placed] = []
    for pid in order:
        starts = [s for s in reversed(shape.profile(pid).placements) if _fits(shape, placed, pid, s)]
        if not starts:
            return False
        placed.append(Placed(pid, starts[0]))
    return True


def largest_first(shape: GpuShape, wanted: Counter[int]) -> bool:
    placed: list[Placed] = []
    order = sorted(wanted.elements(),
                   key=lambda p: (-shape.profile(p).memory_slices, -shape.profile(p).slices))
    for pid in order:
        starts = [s for s in shape.profile(pid).placements if _fits(shape, placed, pid, s)]
        if not starts:
            return False
        placed.append(Placed(pid, starts[0]))
    return True


def feasible_layouts(shape: GpuShape) -> list[Counter[int]]:
    ids = [p.profile_id for p in shape.profiles if not p.media]
    found = []
    for n in range(1, shape.compute_slices + 1):
        for combo in combinations_with_replacement(ids, n):
            wanted = Counter(combo)
            if check_layout(shape, wanted) is None:
                found.append(wanted)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="A100-SXM4-40GB")
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    shape = GpuShape.from_model(get_model(args.model))
    layouts = feasible_layouts(shape)

    nvml_ok = sum(nvml_default_order(shape, rng.sample(list(w.elements()), sum(w.values()))) for w in layouts)
    lf_ok = 0
    lf_times, plan_times = [], []
    plan_ok = 0
    for w in layouts:
        t = time.perf_counter()
        lf_ok += largest_first(shape, w)
        lf_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        try:
            plan_layout(shape, [], w)
            plan_ok += 1
        except LayoutError:
            pass
        plan_times.append(time.perf_counter() - t)
    n = len(layouts)
    print(f"model {shape.label}: {n} layouts fit in some arrangement")
    print(f"  accepted  NVML placer, random order : {nvml_ok:4d} ({nvml_ok / n:.0%})")
    print(f"  accepted  largest-first, lowest start: {lf_ok:4d} ({lf_ok / n:.0%})")
    print(f"  accepted  planner search             : {plan_ok:4d} ({plan_ok / n:.0%}); "
          f"x{plan_ok / max(1, nvml_ok):.2f} vs NVML placer, x{plan_ok / max(1, lf_ok):.2f} vs largest-first")

    steps_plan = steps_naive = kept = before = 0
    for _ in range(args.pairs):
        current_w, wanted = rng.choice(layouts), rng.choice(layouts)
        current = plan_layout(shape, [], current_w).final
        plan = plan_layout(shape, list(current), wanted)
        steps_plan += len(plan.steps)
        steps_naive += len(current) + sum(wanted.values())
        kept += len(plan.keep)
        before += len(current)
    print(f"churn over {args.pairs} random layout changes: planner {steps_plan} steps vs destroy-all "
          f"{steps_naive} (ratio {steps_plan / steps_naive:.2f}); {kept} of {before} existing instances "
          f"kept ({kept / before:.0%})")
    mean_plan, mean_lf = statistics.mean(plan_times), statistics.mean(lf_times)
    print(f"planning time per layout: mean {mean_plan * 1e3:.2f} ms, max {max(plan_times) * 1e3:.2f} ms "
          f"(x{mean_plan / mean_lf:.0f} the largest-first baseline's {mean_lf * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
