"""Node scoring policies for GPU-sharing placement (the FGD paper's baselines and fastshare's own).

A policy sees one node as ``(model, cpu_left, gpus)`` where ``gpus`` is the free share of
every GPU in thousandths (index order), plus the task (:class:`Task`), and returns
``(score, gpu_indexes)`` for a node the task fits on: higher scores win, equal scores go to
the earlier node in the caller's tie order. Policies never see GPU memory, exactly like the
published experiments (memory only filters). They are pure functions of their inputs, which
is what lets the simulator and the engine cache scores per node state.

Baselines follow the public artifact of "Beware of Fragmentation" (Weng et al., ATC'23,
hkust-adsl/kubernetes-scheduler-simulator) as described in ../shared/data/openb/README.md:
integer scores, least-free-fitting GPU for shares, lowest-index free GPUs for whole GPUs.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

MILLI = 1000
MAX_SPEC_CPU = 128_000  # the artifact's normalisers (BestFit, DotProd)
MAX_SPEC_GPU = 8_000


class Task(NamedTuple):
    """A placement request as policies see it. ``milli`` is per GPU; ``num_gpu`` > 1 or
    ``milli`` == 1000 means whole GPUs. ``models`` empty = any GPU model."""

    cpu: int
    milli: int
    num_gpu: int
    models: frozenset[str] = frozenset()

    @property
    def sharing(self) -> bool:
        return self.num_gpu == 1 and self.milli < MILLI


class Typical(NamedTuple):
    cpu: int
    milli: int
    num_gpu: int
    models: frozenset[str]
    weight: float


Choice = tuple[object, tuple[int, ...]]


def gpu_fits(gpus: Sequence[int], task: Task) -> bool:
    """Whether the GPUs alone can take the task (no CPU, model or memory check)."""
    if task.num_gpu == 0:
        return True
    need = MILLI if not task.sharing else task.milli
    return sum(1 for g in gpus if g >= need) >= task.num_gpu


def least_free_fit(gpus: Sequence[int], milli: int) -> int:
    """The fitting GPU with the least free share (lowest index on ties): keeps big holes whole."""
    best = -1
    for i, g in enumerate(gpus):
        if g >= milli and (best < 0 or g < gpus[best]):
            best = i
    return best


def lowest_free(gpus: Sequence[int], n: int) -> tuple[int, ...]:
    return tuple([i for i, g in enumerate(gpus) if g >= MILLI][:n])


def default_gpus(gpus: Sequence[int], task: Task) -> tuple[int, ...]:
    if task.num_gpu == 0:
        return ()
    if task.sharing:
        return (least_free_fit(gpus, task.milli),)
    return lowest_free(gpus, task.num_gpu)


def after(gpus: Sequence[int], chosen: Iterable[int], task: Task) -> tuple[int, ...]:
    take = MILLI if not task.sharing else task.milli
    out = list(gpus)
    for i in chosen:
        out[i] -= take
    return tuple(out)


def best_first(score: object) -> object:
    """A policy's score turned so that the best sorts first (for heaps: scores are numbers or
    tuples of them, higher wins)."""
    return tuple(-x for x in score) if isinstance(score, tuple) else -score


class Policy:
    """Base class: ``score`` is only called for nodes the task fits on."""

    name = "base"
    uses_tags = False  # GpuClustering also looks at which task shapes a node already holds
    randomized = False
    generation = 0  # a policy that learns bumps this when its scores change (callers drop caches)

    def observe(self, task: Task) -> None:
        """Called once per arriving request, before it is placed (learning policies override)."""

    def cluster(self, cpu_milli: int, gpu_milli: Mapping[str, int]) -> None:
        """Called with the cluster's CPU and its GPU milli per model whenever they change."""

    def score(self, model: str, cpu_left: int, gpus: tuple[int, ...], task: Task,
              tags: frozenset = frozenset()) -> Choice:
        raise NotImplementedError

    def state_key(self, model: str, cpu_left: int, gpus: tuple[int, ...], task: Task) -> tuple | None:
        """A key such that equal keys give equal scores (the chosen GPUs may differ; callers
        that cache by this key ask ``score`` again for the node they pick), or None to key on
        the raw state."""
        return None


class RandomPolicy(Policy):
    """Uniformly random feasible node and fitting GPU (seeded)."""

    name = "random"
    randomized = True

    def __init__(self, seed: int = 42) -> None:
        self.rng = random.Random(seed)

    def score(self, model, cpu_left, gpus, task, tags=frozenset()):
        if task.sharing:
            fit = [i for i, g in enumerate(gpus) if g >= task.milli]
            return self.rng.random(), (self.rng.choice(fit),)
        return self.rng.random(), default_gpus(gpus, task)


class BestFitPolicy(Policy):
    """The artifact's BestFit: least leftover CPU and GPU after placement (weights 0.5/0.5)."""

    name = "bestfit"

    def score(self, model, cpu_left, gpus, task, tags=frozenset()):
        left = (0.5 * (cpu_left - task.cpu) / MAX_SPEC_CPU
                + 0.5 * (sum(gpus) - task.milli * task.num_gpu) / MAX_SPEC_GPU)
        return int((1.0 - left) * 100), default_gpus(gpus, task)


class GpuPackingPolicy(Policy):
    """The artifact's GpuPacking: shared GPUs first, then free GPUs of used nodes, then idle nodes."""

    name = "gpupacking"

    def score(self, model, cpu_left, gpus, task, tags=frozenset()):
        chosen = default_gpus(gpus, task)
        if task.num_gpu == 0 or task.milli <= 0:
            return 0, chosen
        free = sum(1 for g in gpus if g >= MILLI)
        if free == len(gpus):
            return max(100 // 3 - free, free), chosen
        need, used_free, to_use = task.num_gpu, 0, []
        for i in sorted(range(len(gpus)), key=lambda i: gpus[i]):
            if need == 0:
                break
            if task.milli <= gpus[i]:
                need -= 1
                to_use.append(i)
                used_free += gpus[i] == MILLI
        if used_free:
            return max(100 // 2 - used_free, 100 // 3), chosen
        ratio = sum(gpus[i] * 100 // MILLI for i in to_use)
        return max(100 - ratio // 10, 100 // 2), chosen


def clustering_tag(task: Task) -> str:
    """GpuClustering's affinity of a GPU task: "share" for a fraction, "N-gpu" for whole GPUs."""
    return "share" if task.sharing else f"{task.num_gpu}-gpu"


class GpuClusteringPolicy(Policy):
    """The artifact's GpuClustering: put tasks of the same GPU affinity together (tags = the
    affinities already on the node), fuller nodes first within each band."""

    name = "gpuclustering"
    uses_tags = True

    def score(self, model, cpu_left, gpus, task, tags=frozenset()):
        chosen = default_gpus(gpus, task)
        if task.num_gpu == 0:
            return 0, chosen
        fill = 25 * (MAX_SPEC_GPU - sum(gpus)) // MAX_SPEC_GPU
        tag = clustering_tag(task)
        if tag in tags:
            return fill + (75 if len(tags) == 1 else 50), chosen
        return fill + (25 if not tags else 0), chosen


class DotProductPolicy(Policy):
    """Tetris's alignment of a node's free and a task's requested (CPU, GPU) vectors, as the
    artifact's published DotProd runs configure it (GPU dimensions merged: the node's free GPU
    milli summed; both vectors normalised by the largest node spec; best-fit GPU): a node scores
    ``100 x (1 - dot / 2)``, truncated, and the task takes its least-free fitting GPU (whole
    GPUs: the lowest-index free ones)."""

    name = "dotprod"

    def score(self, model, cpu_left, gpus, task, tags=frozenset()):
        dot = ((cpu_left / MAX_SPEC_CPU) * (task.cpu / MAX_SPEC_CPU)
               + (sum(gpus) / MAX_SPEC_GPU) * (task.milli * task.num_gpu / MAX_SPEC_GPU))
        return int(100 * (1 - dot / 2)), default_gpus(gpus, task)


# --- Fragmentation (FGD) ---------------------------------------------------------------------

def typical_shapes(tasks: Iterable[Task], coverage: float = 0.95) -> list[Typical]:
    """The most frequent task shapes covering ``coverage`` of the tasks (FGD's view of the
    future). Weights are count / total of the kept shapes. Shape = (cpu, per-GPU milli,
    num_gpu, models); ties in frequency keep first-seen order."""
    counts = Counter(tasks)
    total = sum(counts.values())
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    kept, acc = [], 0
    for shape, n in ranked:
        kept.append((shape, n))
        acc += n
        if acc >= coverage * total:
            break
    kept_total = sum(n for _s, n in kept)
    return [Typical(s.cpu, s.milli, s.num_gpu, s.models, n / kept_total) for s, n in kept]


class Fragmentation:
    """F(node): expected GPU milli that typical tasks could not use (FGD's measure), cached.

    CPU only matters through thresholds (is there enough CPU for typical shape k?), so the
    cache key uses the rank of ``cpu_left`` among those thresholds, and sorted GPUs, which
    makes most evaluations dictionary hits even when every node's CPU is different."""

    def __init__(self, typical: Sequence[Typical]) -> None:
        self.typical = list(typical)
        self.thresholds = sorted({t.cpu for t in self.typical if t.num_gpu > 0})
        self.model_dependent = any(t.models for t in self.typical)
        self.cache: dict[tuple, float] = {}

    def __call__(self, model: str, cpu_left: int, gpus: Sequence[int]) -> float:
        key = (model if self.model_dependent else "", bisect.bisect_right(self.thresholds, cpu_left),
               tuple(sorted(gpus)))
        f = self.cache.get(key)
        if f is None:
            f = self.cache[key] = self._compute(model, cpu_left, key[2])
        return f

    def _compute(self, model: str, cpu_left: int, gpus: tuple[int, ...]) -> float:
        total = sum(gpus)
        frag = 0.0
        for t in self.typical:
            if (t.num_gpu == 0 or (t.models and model not in t.models) or cpu_left < t.cpu
                    or sum(1 for g in gpus if g >= t.milli) < t.num_gpu):
                frag += t.weight * total
            else:
                frag += t.weight * sum(g for g in gpus if g < t.milli)
        return frag


def _sigmoid_score(delta: float) -> int:
    return int(100.0 / (1.0 + math.exp(-delta / 1000.0)))


class _FragKeyed(Policy):
    """Policies whose score depends on CPU only through the typical shapes' thresholds."""

    frag: Fragmentation

    def state_key(self, model, cpu_left, gpus, task):
        th = self.frag.thresholds
        return (model if self.frag.model_dependent or task.models else "", bisect.bisect_right(th, cpu_left),
                bisect.bisect_right(th, cpu_left - task.cpu), tuple(sorted(gpus)))


class FGDPolicy(_FragKeyed):
    """Fragmentation Gradient Descent as in the artifact: score = int(100*sigmoid(dF/1000)),
    dF = F(before) - F(after); for shares the GPU with the best integer score (lowest index
    on ties) is used."""

    name = "fgd"

    def __init__(self, typical: Sequence[Typical]) -> None:
        self.frag = Fragmentation(typical)

    def score(self, model, cpu_left, gpus, task, tags=frozenset()):
        frag = self.frag
        before = frag(model, cpu_left, gpus)
        left = cpu_left - task.cpu
        if task.sharing:
            best, idx = -1, -1
            for i, g in enumerate(gpus):
                if g >= task.milli:
                    s = _sigmoid_score(before - frag(model, left, after(gpus, (i,), task)))
                    if s > best:
                        best, idx = s, i
            return best, (idx,)
        chosen = default_gpus(gpus, task)
        return _sigmoid_score(before - frag(model, left, after(gpus, chosen, task))), chosen


POLICY_NAMES = ("random", "dotprod", "gpuclustering", "gpupacking", "bestfit", "fgd", "fastshare")
