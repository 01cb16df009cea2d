"""Which of a node's idle GPUs a whole-GPU request gets: the group whose links are closest
(NVLink before PCIe switch before host bridge), gpu-manager style."""

from __future__ import annotations

import itertools
import math

from fastshare.placement.model import FARTHEST_LINK, NodeView


def group_cost(view: NodeView, group: tuple[int, ...]) -> tuple[int, int]:
    """How far apart a group's GPUs are: its farthest link level, then the sum over its pairs."""
    levels = [view.link_level(a, b) for a, b in itertools.combinations(group, 2)]
    return max(levels, default=0), sum(levels)


def tightest_group(view: NodeView, idle: list[int], k: int) -> tuple[int, ...]:
    """The ``k`` idle GPUs with the closest links (max level, then sum), lowest indexes on ties."""
    if k == len(idle) or not view.links:   # without links every group is as far apart
        return tuple(sorted(idle)[:k])
    level = {(i, j): lv for i, j, lv in view.links}

    def link(a: int, b: int) -> int:
        return level.get((min(a, b), max(a, b)), FARTHEST_LINK)

    def cost(group: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
        levels = [link(a, b) for a, b in itertools.combinations(group, 2)]
        return (max(levels, default=0), sum(levels), group)

    if math.comb(len(idle), k) <= 5000:
        return min(itertools.combinations(idle, k), key=cost)

    # Large nodes: grow a group from idle GPUs (always adding the GPU closest to the group so
    # far), from each not in a group grown already, and keep the closest group. Growing from
    # one seed only left a free island unused (6 of 32 GPUs across two NVLink islands while a
    # whole island was idle).
    def grow(seed: int) -> tuple[int, ...]:
        group = [seed]
        reach = {i: link(i, seed) for i in idle if i != seed}   # a candidate's farthest link to the group
        while len(group) < k:
            best = min(reach, key=lambda i: (reach[i], i))
            group.append(best)
            del reach[best]
            for i in reach:
                reach[i] = max(reach[i], link(i, best))
        return tuple(sorted(group))

    groups: list[tuple[int, ...]] = []
    for seed in idle:
        if not any(seed in g for g in groups):   # a seed inside a group found grows much the same one
            groups.append(grow(seed))
    return min(groups, key=cost)
