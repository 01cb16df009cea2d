"""fastshare's default placement policy: expected final fill, learned online.

When requests outnumber the cluster (the normal state of a busy GPU cluster, and of the
published experiments, which offer 130 % of capacity), what a placement decides is not
whether a task runs but how full its GPU ends up: an 810-milli share alone on a fresh GPU
leaves a 190-milli hole that the rare small tasks seldom fill, while two 470-milli shares
leave 60; a GPU whose node has run out of CPU ends wherever it is.

So the policy values a GPU with ``f`` milli free by ``V(f)``, the milli that later arrivals
are expected to add to it: the next task to land is drawn from the request mix among the
sizes that fit, and a hole whose fitting sizes are rare may stay empty for good. With
``P = P(m <= f)`` the chance that the hole gets another task is ``P^2 / (P^2 + KAPPA)``
(one constant for every workload): rare fitting sizes are few, and the holes only they fit
are many, so that chance falls faster than ``P``::

    V(f) = sum_{m <= f} p(m) * (m + V(f - m)) / (P + KAPPA / P)

except that an entirely free GPU is valued by the sharing requests alone (``fresh_value``):
whole-GPU requests take some free GPU whatever the shares do, and when requests outnumber
the cluster the free GPUs run out either way, so they do not make keeping this GPU free
worth more; counted in, they made a free GPU look nearly full already (942 of 1000 milli
on the openb default mix), which sent shares into holes that fit them badly (a 320 beside
a 470, leaving 210 that only the rare small shares fit) instead of onto a free GPU that a
later 650 completes.

The next task to land is not quite any size that fits, though: every task goes where it
fits best, so a hole that a common size nearly completes tends to get that size. The best
fill by the common sizes (``best_fill``; common: among the sharing requests, frequent enough
that the formula above gives a hole only that size fits an even chance) errs the other way,
as if the best size always came first, so the policy scores with the mean of the two
(``hole_values``). On the openb default mix a 680-milli hole is worth 533 by ``V``, 650 by
the best fill (a 650), 591 as scored; a free GPU 902, 970 (650 + 320), 936; the 190 beside
an 810 24, 0 (no common size fits), 12.

A node is worth the sum of its GPUs' values, scaled down when its CPU cannot feed them (the
CPU the request mix needs per GPU milli, ``rho``, times the free milli). A task goes where
``taken + value(after) - value(before)`` is highest: where it adds the most to the final
allocation. Scores are truncated to ``QUANTUM`` milli so near-equal choices tie; ties go to
nodes already in use, then to the caller's node order (first fit), which keeps idle nodes
whole for large requests.

``p`` and ``rho`` are learned from the requests the policy is shown (``observe``), never
from a trace file: the table is re-derived after every doubling of the request count and
adopted (``generation`` + 1, so cached scores are dropped) only when it moved by more than
a quantum. Until it has seen a request, every free milli counts as fillable. ``rho`` is the
CPU the GPU requests ask per GPU milli; when the whole mix (CPU-only requests included)
asks more CPU than the cluster has (``cluster``), CPU-only requests compete for the CPU that
GPUs need, and their CPU is added to ``rho``.

When CPU is that short, CPU will run out before the GPUs do, and from then on every CPU
milli that a CPU-only request takes is ``1 / rho`` GPU milli that no GPU request gets
(``rho`` of the GPU requests alone). Every request that fits must be placed, so the policy
cannot turn CPU-only requests away, but it can leave them nothing to fit in. A node's free
CPU is *exposed* in proportion to the share of CPU-only requests it fits (``exposed``). A
placement that leaves the node less exposed CPU gains ``1 / rho`` GPU milli per CPU milli
(``guard``). So GPU requests go where they leave free CPU that only small GPU requests fit:
on cpu300 (the mix asks 14 % more CPU than the cluster has) fastshare ends at 92.0 % instead
of 86.2 %. The guard waits until the CPU asked per GPU milli exceeds the cluster's by two
standard errors of its estimate (``RunningRatio``): a few hundred requests can suggest a
shortage that is not there (on cpu235, which asks 1 % less than the cluster has), and
guarding CPU then costs pairings.

Requests bound to a GPU model that alone will fill it keep it: a placement there pays what
the bound requests lose (``ModelReserve``).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping

from fastshare.placement.estimates import SURE, RunningRatio, excess
from fastshare.placement.model_reserve import ModelReserve
from fastshare.placement.policies import MILLI, Policy, Task, default_gpus

STEP = 10         # milli resolution of the value table (openb sizes are multiples of 10)
BINS = MILLI // STEP
KAPPA = 0.001     # how fast a hole's chance of being filled falls with the share of sizes that fit
QUANTUM = 10      # score resolution in milli: closer choices tie
CPU_STEP = 500    # CPU resolution in milli (keeps scores cacheable per node state)


def value_table(counts: list[float], kappa: float = KAPPA) -> list[float]:
    """``V[b]``: expected milli later added to a GPU with ``b * STEP`` milli free, given
    arrival counts per size bin (``counts[b]`` = tasks asking ``b * STEP`` milli per GPU)."""
    total = sum(counts[1:])
    if total <= 0:
        return [float(b * STEP) for b in range(BINS + 1)]
    p = [c / total for c in counts]
    v = [0.0] * (BINS + 1)
    fit = 0.0
    for f in range(1, BINS + 1):
        fit += p[f]
        if fit > 0:
            v[f] = sum(p[m] * (m * STEP + v[f - m]) for m in range(1, f + 1) if p[m]) / (fit + kappa / fit)
    return v


def fresh_value(counts: list[float], kappa: float = KAPPA) -> list[float]:
    """``value_table`` with the entry of an entirely free GPU taken from the sharing sizes
    only (``counts[BINS]`` holds whole-GPU requests); unchanged when there are no shares."""
    v = value_table(counts, kappa)
    shares = [*counts[:BINS], 0.0]
    if sum(shares[1:]) > 0:
        v[BINS] = value_table(shares, kappa)[BINS]
    return v


def best_fill(counts: list[float], kappa: float = KAPPA) -> list[float] | None:
    """``W[b]``: the most milli the *common* sharing sizes can put into ``b * STEP`` free milli
    (an unbounded knapsack). A size is common when its share ``p`` of the sharing requests
    (the only ones a hole fits) has ``p^2 >= kappa``: counting those alone, ``value_table``
    gives a hole only that size fits at least an even chance of being filled. None when no
    size is common (or nothing was seen)."""
    shares = sum(counts[1:BINS])
    common = [m for m in range(1, BINS) if shares and (counts[m] / shares) ** 2 >= kappa]
    if not common:
        return None
    w = [0.0] * (BINS + 1)
    for f in range(1, BINS + 1):
        w[f] = max((m * STEP + w[f - m] for m in common if m <= f), default=0.0)
    return w


def hole_values(counts: list[float], kappa: float = KAPPA) -> list[float]:
    """The table the policy scores with: the mean of ``fresh_value`` (the next task to land is
    any size that fits) and ``best_fill`` (it is the best-fitting common size)."""
    v = fresh_value(counts, kappa)
    w = best_fill(counts, kappa)
    return v if w is None else [(a + b) / 2 for a, b in zip(v, w, strict=True)]


def _bin_up(milli: int) -> int:
    return min(BINS, -(-milli // STEP))


def _cumulative_shares(counts: Counter[int]) -> tuple[list[int], list[float]]:
    """The sizes in ``counts`` ascending, and the share of the count up to each."""
    sizes = sorted(counts)
    total = sum(counts.values())
    shares, upto = [], 0
    for size in sizes:
        upto += counts[size]
        shares.append(upto / total)
    return sizes, shares


class FastsharePolicy(Policy):
    """Expected-final-fill scoring with a CPU-aware node value; learns the request mix online."""

    name = "fastshare"

    def __init__(self) -> None:
        self.counts = [0.0] * (BINS + 1)
        self.cpu_of_gpu_tasks = 0      # CPU milli asked by the GPU tasks seen
        self.supply = 0.0              # the cluster's CPU milli per GPU milli (0 = not told)
        self.seen = 0
        self._refresh_at = 1
        self.generation = 0
        self.values = hole_values(self.counts)
        self.rho = 0.0                 # CPU milli to keep per free GPU milli (0 = unknown)
        self.demand = RunningRatio()   # CPU milli asked per GPU milli asked, over every request
        self.cpu_only_sizes: Counter[int] = Counter()   # CPU-only requests by CPU milli
        self.guard = 0.0               # GPU milli per exposed CPU milli (0 = CPU is not short)
        self._fit_cpu: list[int] = []  # CPU-only sizes, ascending ...
        self._fit_share: list[float] = []  # ... and the share of CPU-only requests up to each
        self.model_reserve = ModelReserve()   # GPUs of a model kept for the requests bound to it

    # ---- learning ------------------------------------------------------------------------------
    def cluster(self, cpu_milli: int, gpu_milli: Mapping[str, int]) -> None:
        total = sum(gpu_milli.values())
        self.supply = cpu_milli / total if total > 0 else 0.0
        self.model_reserve.cluster(gpu_milli)
        self._refresh_at = min(self._refresh_at, self.seen + 1)

    def observe(self, task: Task) -> None:
        if task.num_gpu <= 0 or task.milli <= 0:
            self.cpu_only_sizes[task.cpu] += 1
            self.demand.add(task.cpu, 0)
            return
        per_gpu = task.milli if task.sharing else MILLI
        self.demand.add(task.cpu, per_gpu * task.num_gpu)
        self.model_reserve.observe(per_gpu * task.num_gpu, task.models)
        self.counts[_bin_up(per_gpu)] += task.num_gpu
        self.cpu_of_gpu_tasks += task.cpu
        self.seen += 1
        if self.seen >= self._refresh_at:
            self._refresh_at = self.seen * 2
            self._refresh()

    def _refresh(self) -> None:
        values = hole_values(self.counts)
        milli = self.demand.sy         # GPU milli asked by the GPU tasks seen
        rho = gpu_rho = self.cpu_of_gpu_tasks / milli
        guard = 0.0
        if self.supply > 0:
            # When the mix asks more CPU than the cluster has, CPU-only tasks compete for the
            # CPU that GPUs need, so keep CPU for them too (fully from 10 % over on).
            cpu_only = (self.demand.sx - self.cpu_of_gpu_tasks) / milli
            rho += excess(self.demand.ratio() / self.supply) * cpu_only
            if gpu_rho > 0:
                guard = excess(self.demand.lower(SURE) / self.supply) / gpu_rho
        moved = max(abs(a - b) for a, b in zip(values, self.values, strict=True))
        reserve_moved = self.model_reserve.refresh()
        if (reserve_moved or moved > QUANTUM or abs(rho - self.rho) > 0.02 * max(rho, self.rho)
                or guard or self.guard):
            self.values, self.rho, self.guard = values, rho, guard
            self._fit_cpu, self._fit_share = _cumulative_shares(self.cpu_only_sizes)
            self.generation += 1

    # ---- scoring -------------------------------------------------------------------------------
    def _cpu_factor(self, cpu_left: int, free: int) -> float:
        """Share of ``free`` GPU milli that ``cpu_left`` can feed at the learned CPU per milli."""
        if self.rho <= 0 or free <= 0:
            return 1.0
        return min(1.0, max(0, cpu_left) // CPU_STEP * CPU_STEP / (self.rho * free))

    def exposed(self, cpu_left: int) -> float:
        """CPU milli of ``cpu_left`` that CPU-only requests can take: the free CPU times the
        share of CPU-only requests that fit in it."""
        cpu = max(0, cpu_left) // CPU_STEP * CPU_STEP
        i = bisect.bisect_right(self._fit_cpu, cpu)
        return cpu * self._fit_share[i - 1] if i else 0.0

    def score(self, model, cpu_left, gpus, task, tags=frozenset()):
        v = self.values
        held = [v[g // STEP] for g in gpus]
        total = sum(held)
        free = sum(gpus)
        before = total * self._cpu_factor(cpu_left, free)
        if task.sharing:
            m = task.milli
            # the GPU whose value drops least (lowest index on ties); the CPU factor after
            # placement is the same whichever GPU takes the share
            best, idx = None, -1
            for i, g in enumerate(gpus):
                if g >= m:
                    d = v[(g - m) // STEP] - held[i]
                    if best is None or d > best:
                        best, idx = d, i
            chosen: tuple[int, ...] = (idx,)
            taken = m
            total += best
        else:
            chosen = default_gpus(gpus, task)
            taken = MILLI * len(chosen)
            total += sum(v[0] - held[i] for i in chosen)
        gain = taken + total * self._cpu_factor(cpu_left - task.cpu, free - taken) - before
        if self.guard:
            gain -= self.guard * (self.exposed(cpu_left - task.cpu) - self.exposed(cpu_left))
        gain -= self.model_reserve.cost(model, taken)
        in_use = free < MILLI * len(gpus)
        return (int(gain // QUANTUM), in_use), chosen

    def state_key(self, model, cpu_left, gpus, task):
        return (self.generation, self.model_reserve.reserve.get(model, 0.0), cpu_left // CPU_STEP,
                (cpu_left - task.cpu) // CPU_STEP, tuple(sorted(gpus)))

