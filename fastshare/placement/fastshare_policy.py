"""fastshare's default placement policy.

``FastsharePolicy`` scores like FGD (expected fragmentation against the typical task shapes,
quantised so that near-equal choices tie) and breaks those ties towards nodes that are
already in use, which keeps idle nodes whole for large requests. ``AdaptivePolicy`` is the
engine's default: it learns the typical shapes from the requests it is asked to place, so
a controller needs no trace; until it has seen any it behaves like BestFit.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from fastshare.placement.policies import (
    MILLI,
    BestFitPolicy,
    Fragmentation,
    Policy,
    Task,
    Typical,
    _FragKeyed,
    after,
    default_gpus,
    typical_shapes,
)


def _quantised(delta: float) -> int:
    return int(100.0 / (1.0 + math.exp(-delta / 1000.0)))


class FastsharePolicy(_FragKeyed):
    """FGD-style fragmentation score with packing-aware tie-breaking (one policy, no knobs)."""

    name = "fastshare"

    def __init__(self, typical: Sequence[Typical]) -> None:
        self.frag = Fragmentation(typical)

    def score(self, model, cpu_left, gpus, task, tags=frozenset()):
        frag = self.frag
        before = frag(model, cpu_left, gpus)
        left = cpu_left - task.cpu
        if task.sharing:
            best, idx = None, -1
            for i, g in enumerate(gpus):
                if g >= task.milli:
                    s = _quantised(before - frag(model, left, after(gpus, (i,), task)))
                    if best is None or s > best:
                        best, idx = s, i
            chosen: tuple[int, ...] = (idx,)
        else:
            chosen = default_gpus(gpus, task)
            best = _quantised(before - frag(model, left, after(gpus, chosen, task)))
        in_use = sum(gpus) < MILLI * len(gpus)
        return (best, in_use), chosen


class AdaptivePolicy(Policy):
    """The engine's default: FastsharePolicy over the shapes of the requests seen so far
    (re-derived after every doubling of the request count, so the cost stays logarithmic)."""

    name = "fastshare"

    def __init__(self) -> None:
        self.seen: Counter[Task] = Counter()
        self._inner: Policy = BestFitPolicy()
        self._next_refresh = 1

    def observe(self, request) -> None:
        if request.kind == "fastpod":
            task = Task(request.cpu_milli, request.sm_milli, 1)
        elif request.kind == "whole":
            task = Task(request.cpu_milli, MILLI, request.gpus)
        else:
            return
        self.seen[task] += 1
        total = sum(self.seen.values())
        if total >= self._next_refresh:
            self._inner = FastsharePolicy(typical_shapes(self.seen.elements()))
            self._next_refresh = total * 2

    def score(self, model, cpu_left, gpus, task, tags=frozenset()):
        s, chosen = self._inner.score(model, cpu_left, gpus, task, tags)
        return (s if isinstance(s, tuple) else (s,)), chosen
