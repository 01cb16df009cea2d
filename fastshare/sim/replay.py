"""Trace replay: offer every task once, in order, to a policy over the openb cluster.

Speed comes from three facts of the published setting: there are no departures, so a node a
task shape does not fit never fits it again; a decision changes exactly one node; and traces
repeat a few dozen task shapes. So every shape keeps a max-heap of (score, tie rank) over the
nodes it fits, and before a decision only the nodes changed since that shape was last seen
are re-scored (stale heap entries are dropped lazily by version). Scores are cached per
(node state, shape), and FGD's fragmentation per canonical node state.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastshare.placement.policies import (
    MILLI,
    Fragmentation,
    Policy,
    Task,
    Typical,
    best_first,
    clustering_tag,
    gpu_fits,
)
from fastshare.sim.trace import SimNode, SimPod


@dataclass
class Placement:
    pod: SimPod
    node: int | None          # node index, None = failed
    gpus: tuple[int, ...] = ()


@dataclass
class SimResult:
    placements: list[Placement]
    curve: list[tuple[int, float]]
    gpu_alloc_ratio: float
    pods_failed: int
    gpu_pods_failed: int
    frag_ratio: float
    decision_s: list[float] = field(default_factory=list)      # wall time per decision
    decision_cpu_s: list[float] = field(default_factory=list)  # this thread's CPU time per decision
    wall_s: float = 0.0


def simulate(nodes: Sequence[SimNode], order: Sequence[SimPod], policy: Policy, ranks: Sequence[int],
             typical: Sequence[Typical] = (), progress: Callable[[int], None] | None = None,
             curve_points: int = 130) -> SimResult:
    """Replay ``order`` over ``nodes``. ``ranks`` break score ties (lower wins)."""
    t0 = time.perf_counter()
    n = len(nodes)
    model = [nd.model for nd in nodes]
    cpu = [nd.cpu_milli for nd in nodes]
    mem = [nd.memory_mib for nd in nodes]
    gpus = [tuple([MILLI] * nd.gpus) for nd in nodes]
    tags: list[Counter] = [Counter() for _ in nodes]
    version = [0] * n
    changes: list[int] = []
    heaps: dict[tuple, list] = {}
    seen: dict[tuple, int] = {}
    score_cache: dict[tuple, tuple] = {}
    capacity = sum(nd.gpus for nd in nodes) * MILLI
    arrived = allocated = 0
    curve: list[tuple[int, float]] = []
    next_x = 0
    placements: list[Placement] = []
    times: list[float] = []
    cpu_times: list[float] = []
    uses_tags = policy.uses_tags
    randomized = policy.randomized
    gpu_milli: Counter[str] = Counter()
    for nd in nodes:
        gpu_milli[nd.model] += nd.gpus * MILLI
    policy.cluster(sum(cpu), gpu_milli)
    generation = policy.generation
    # Nodes in the same state (all that `fits` and `score` read of one) fit and score alike:
    # a heap build works each state out once (early in a trace nearly every node is in one state).
    state_ids: dict[tuple, int] = {}

    def state_of(i: int) -> int:
        key = (model[i], cpu[i], gpus[i], frozenset(tags[i]) if uses_tags else None)
        return state_ids.setdefault(key, len(state_ids))

    state = [state_of(i) for i in range(n)]

    def fits(i: int, task: Task) -> bool:
        if cpu[i] < task.cpu or (task.num_gpu and not gpus[i]):
            return False
        if task.models and model[i] not in task.models:
            return False
        return gpu_fits(gpus[i], task)

    state_key = policy.state_key

    def score(i: int, task: Task):
        tg = frozenset(tags[i]) if uses_tags else frozenset()
        key = state_key(model[i], cpu[i], gpus[i], task)
        key = (model[i], cpu[i], gpus[i], tg, task) if key is None else (key, task)
        s = score_cache.get(key)
        if s is None:
            if len(score_cache) > 2_000_000:  # bound memory on very long replays
                score_cache.clear()
            s = score_cache[key] = best_first(policy.score(model[i], cpu[i], gpus[i], task, tg)[0])
        return s

    def choose(i: int, task: Task) -> tuple[int, ...]:
        tg = frozenset(tags[i]) if uses_tags else frozenset()
        return policy.score(model[i], cpu[i], gpus[i], task, tg)[1]

    def push(h: list, i: int, task: Task) -> None:
        if fits(i, task):
            heapq.heappush(h, (score(i, task), ranks[i], version[i], i))

    def build(task: Task) -> list:
        scored: dict[int, tuple | None] = {}   # by node state: its score, None if it does not fit
        h = heaps[task] = []
        for i in range(n):
            st = state[i]
            if st in scored:
                s = scored[st]
            else:
                s = scored[st] = score(i, task) if fits(i, task) else None
            if s is not None:
                h.append((s, ranks[i], version[i], i))
        heapq.heapify(h)
        seen[task] = len(changes)
        return h

    gc_was_enabled = gc.isenabled()
    gc.disable()  # the replay makes no reference cycles; collector pauses would only add jitter
    try:
        for k, pod in enumerate(order):
            start = time.perf_counter()
            cpu_start = time.thread_time()
            task = Task(pod.cpu_milli, pod.gpu_milli if pod.num_gpu else 0, pod.num_gpu, pod.gpu_spec)
            policy.observe(task)
            if policy.generation != generation:
                # A learning policy changed its scores: rescore every shape now, inside this
                # decision's time (rescoring lazily would make the next arrival of every shape
                # slow instead of this one decision).
                generation = policy.generation
                score_cache.clear()
                for t in list(heaps):
                    build(t)
            chosen = None
            if randomized:
                feasible = [i for i in range(n) if fits(i, task) and mem[i] >= pod.memory_mib]
                if feasible:
                    i = feasible[policy.rng.randrange(len(feasible))]
                    chosen = (i, policy.score(model[i], cpu[i], gpus[i], task)[1])
            else:
                h = heaps.get(task)
                if h is None:
                    h = build(task)
                else:
                    for i in set(changes[seen[task]:]):
                        push(h, i, task)
                    seen[task] = len(changes)
                skipped = []
                while h:
                    entry = h[0]
                    i = entry[3]
                    if entry[2] != version[i]:
                        heapq.heappop(h)
                        continue
                    if mem[i] < pod.memory_mib:  # memory filters but never scores: look further
                        skipped.append(heapq.heappop(h))
                        continue
                    chosen = (i, choose(i, task))
                    break
                for e in skipped:
                    heapq.heappush(h, e)
            if chosen is None:
                placements.append(Placement(pod, None))
            else:
                i, gi = chosen
                cpu[i] -= pod.cpu_milli
                mem[i] -= pod.memory_mib
                if gi:
                    take = task.milli if task.sharing else MILLI
                    g = list(gpus[i])
                    for j in gi:
                        g[j] -= take
                    gpus[i] = tuple(g)
                    if uses_tags:
                        tags[i][clustering_tag(task)] += 1
                version[i] += 1
                state[i] = state_of(i)
                changes.append(i)
                allocated += pod.gpu_request
                placements.append(Placement(pod, i, tuple(gi)))
            times.append(time.perf_counter() - start)
            cpu_times.append(time.thread_time() - cpu_start)
            arrived += pod.gpu_request
            while next_x < curve_points and arrived * 100 >= next_x * capacity:
                curve.append((next_x, round(allocated * 100 / capacity, 2)))
                next_x += 1
            if progress is not None and k % 256 == 0:
                progress(k)
    finally:
        if gc_was_enabled:
            gc.enable()
    # The last point is the end of the trace (tuning stops arrivals at ~130 %): the final ratio.
    while next_x <= curve_points:
        curve.append((next_x, round(allocated * 100 / capacity, 2)))
        next_x += 1
    frag = Fragmentation(typical) if typical else None
    free = sum(sum(g) for g in gpus)
    frag_ratio = (sum(frag(model[i], cpu[i], gpus[i]) for i in range(n)) / free * 100
                  if frag and free else math.nan)
    failed = [p for p in placements if p.node is None]
    return SimResult(
        placements=placements,
        curve=curve,
        gpu_alloc_ratio=round(allocated * 100 / capacity, 2),
        pods_failed=len(failed),
        gpu_pods_failed=sum(1 for p in failed if p.pod.num_gpu),
        frag_ratio=frag_ratio,
        decision_s=times,
        decision_cpu_s=cpu_times,
        wall_s=time.perf_counter() - t0,
    )
