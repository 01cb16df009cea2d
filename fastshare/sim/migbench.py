"""MIG fragmentation benchmark: exclusive requests that come and go on a MIG cluster.

Generator (seeded, documented in BENCHMARKS.md): a cluster of ``gpus`` MIG-capable GPUs
(A100-40GB profiles by default, 4 per node). Time advances in steps; at each step a
Poisson(``rate``) number of requests arrives. A request asks for the SMs of one profile,
drawn with weights 1g 40 %, 2g 25 %, 3g 20 %, 4g 10 %, 7g 5 % (expressed as ``sm_count``,
so the engine picks the profile itself), and lives for a geometric number of steps with mean
``lifetime``. Departures are processed before arrivals. ``rate`` is set so the offered load
is about ``load`` x the cluster's compute slices, which keeps the cluster near full so that
placement order matters.

A rejection is a *fragmentation rejection* when the cluster had, in total, at least as many
free compute slices as the requested profile needs (so only the layout was in the way).

Strategies compared on the very same stream:
- ``fastshare``: the placement engine (``Engine.place`` with kind ``exclusive``);
- ``largest-first``: NVIDIA's default order, which takes the highest allowed start first on
  the first GPU with room (that is what puts a 1g in the upper half);
- ``first-fit``: the lowest allowed start on the first GPU with room.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastshare.device.api import MigProfile
from fastshare.placement import Engine, GpuView, NodeView, Request
from fastshare.placement import mig as migmath

PROFILE_MIX = ((1, 0.40), (2, 0.25), (3, 0.20), (4, 0.10), (7, 0.05))  # compute slices, weight


@dataclass
class MigStats:
    strategy: str
    requests: int = 0
    rejected: int = 0
    frag_rejected: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "requests": self.requests, "rejected": self.rejected,
            "frag_rejected": self.frag_rejected,
            "frag_rejection_ratio": _pct(self.frag_rejected, self.requests),
            "rejection_ratio": _pct(self.rejected, self.requests),
        }


def _pct(a: int, b: int) -> float:
    return round(a / b * 100, 3) if b else 0.0


def _profiles(model_key: str) -> tuple[str, int, int, tuple[MigProfile, ...]]:
    from fastshare.device.catalog import get_model

    m = get_model(model_key)
    return m.key, m.memory_mib, m.sm_count, m.profiles


def generate(seed: int, steps: int, gpus: int, load: float = 1.1, lifetime: float = 40.0,
             profiles: tuple[MigProfile, ...] = ()) -> list[tuple[int, str, int, int]]:
    """Events (step, request id, sm_count, departure step), arrivals in order."""
    rng = random.Random(seed)
    by_slices: dict[int, MigProfile] = {}
    for p in sorted(profiles, key=lambda p: (p.media, p.memory_slices)):
        by_slices.setdefault(p.slices, p)
    mix = [(by_slices[s], w) for s, w in PROFILE_MIX if s in by_slices]
    mean_slices = sum(p.slices * w for p, w in mix) / sum(w for _p, w in mix)
    total = gpus * migmath.compute_slices_total(profiles)
    rate = load * total / (mean_slices * lifetime)
    events = []
    k = 0
    for step in range(steps):
        # Poisson arrivals by inversion (small rates, exact enough and seedable)
        n, p, u = 0, math.exp(-rate), rng.random()
        acc = p
        while u > acc and n < 10 * rate + 20:
            n += 1
            p *= rate / n
            acc += p
        for _ in range(n):
            prof = rng.choices([p for p, _w in mix], weights=[w for _p, w in mix])[0]
            life = 1 + int(rng.expovariate(1.0 / lifetime))
            events.append((step, f"m{k}", prof.sm_count, step + life))
            k += 1
    return events


def run(strategy: str, events: list[tuple[int, str, int, int]], gpus: int, model_key: str = "A100-SXM4-40GB",
        per_node: int = 4) -> MigStats:
    key, mem, sms, profiles = _profiles(model_key)
    by_sm = sorted(profiles, key=lambda p: (p.memory_slices, p.slices, p.media))
    total_slices = migmath.compute_slices_total(profiles)
    nodes = [NodeView(f"node-{n}", 10**6, 10**7,
                      tuple(GpuView(i, key, mem, sms, True, False, profiles)
                            for i in range(min(per_node, gpus - n * per_node))))
             for n in range(math.ceil(gpus / per_node))]
    engine = Engine(nodes) if strategy == "fastshare" else None
    layout: list[list[tuple[int, int, int]]] = [[] for _ in range(gpus)]   # baselines' own ledger
    holder: dict[str, tuple[int, tuple[int, int, int]]] = {}
    stats = MigStats(strategy)
    departures: dict[int, list[str]] = {}
    used_slices = 0
    slices_of: dict[str, int] = {}
    for step, rid, sm_count, leave in events:
        for s in sorted(x for x in departures if x <= step):
            for gone in departures.pop(s):
                used_slices -= slices_of.pop(gone)
                if engine is not None:
                    engine.release(gone)
                else:
                    g, inst = holder.pop(gone)
                    layout[g].remove(inst)
        prof = next(p for p in by_sm if p.sm_count >= sm_count)
        stats.requests += 1
        placed = False
        if engine is not None:
            res = engine.place(Request(rid, "exclusive", sm_count=sm_count))
            placed = bool(res)
        else:
            for g in range(gpus):
                starts = migmath.free_starts(prof, profiles, layout[g])
                if starts:
                    start = starts[-1] if strategy == "largest-first" else starts[0]
                    inst = (prof.profile_id, start, prof.memory_slices)
                    layout[g].append(inst)
                    holder[rid] = (g, inst)
                    placed = True
                    break
        if placed:
            used_slices += prof.slices
            slices_of[rid] = prof.slices
            departures.setdefault(leave, []).append(rid)
        else:
            stats.rejected += 1
            if gpus * total_slices - used_slices >= prof.slices:
                stats.frag_rejected += 1
    return stats


def benchmark(seeds: list[int], steps: int = 2000, gpus: int = 32, load: float = 1.1,
              progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """One row per strategy; ``progress(done, total)`` before and after each stream replayed."""
    _key, _mem, _sms, profiles = _profiles("A100-SXM4-40GB")
    rows = []
    strategies = ("fastshare", "largest-first", "first-fit")
    done, total = 0, len(strategies) * len(seeds)
    for strategy in strategies:
        agg = MigStats(strategy)
        for seed in seeds:
            if progress:
                progress(done, total)
            st = run(strategy, generate(seed, steps, gpus, load, profiles=profiles), gpus)
            done += 1
            if progress:
                progress(done, total)
            agg.requests += st.requests
            agg.rejected += st.rejected
            agg.frag_rejected += st.frag_rejected
        rows.append(agg.as_dict())
    return rows
