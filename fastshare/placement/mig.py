"""MIG slice arithmetic: which placements are free, and which choice keeps the most future shapes.

A GPU's MIG layout is a set of GPU instances, each ``(start, size)`` in memory slices. A
profile can be created at an allowed start when its memory range is free, its instance count
is below ``max_instances`` and enough compute slices remain. Because later requests need
particular starts (a 3g only at 0 or 4, a 7g only at 0), the position chosen now decides
what still fits later; ``placement_loss`` measures that so the engine can pick the start
(and the GPU) that destroys the least future capacity.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fastshare.device.api import MigProfile

Instance = tuple[int, int, int]  # (profile_id, start, size)


def _mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def used_mask(instances: Iterable[Instance]) -> int:
    m = 0
    for _pid, start, size in instances:
        m |= _mask(start, size)
    return m


def compute_slices_total(profiles: Sequence[MigProfile]) -> int:
    """Compute slices of the GPU: the largest profile's (7 on A100/H100, 4 on A30)."""
    return max((p.slices for p in profiles), default=0)


def free_starts(profile: MigProfile, profiles: Sequence[MigProfile], instances: Sequence[Instance]) -> list[int]:
    """Allowed starts where ``profile`` can be created now, lowest first."""
    if sum(1 for pid, _s, _z in instances if pid == profile.profile_id) >= profile.max_instances:
        return []
    by_id = {p.profile_id: p for p in profiles}
    used_compute = sum(by_id[pid].slices if pid in by_id else size for pid, _s, size in instances)
    if used_compute + profile.slices > compute_slices_total(profiles):
        return []
    mask = used_mask(instances)
    return [s for s in profile.placements if not mask & _mask(s, profile.memory_slices)]


def capacity_value(profiles: Sequence[MigProfile], instances: Sequence[Instance]) -> float:
    """How much future demand a layout can still absorb: for every profile, how many more
    instances of it could be created (greedily, lowest start first), as a fraction of how
    many an empty GPU takes. Profiles count equally so small and large shapes both matter."""
    total = 0.0
    for p in profiles:
        empty = _greedy_count(p, profiles, [])
        if empty:
            total += _greedy_count(p, profiles, list(instances)) / empty
    return total


def _greedy_count(p: MigProfile, profiles: Sequence[MigProfile], instances: list[Instance]) -> int:
    n = 0
    while True:
        starts = free_starts(p, profiles, instances)
        if not starts:
            return n
        instances.append((p.profile_id, starts[0], p.memory_slices))
        n += 1


def placement_loss(profile: MigProfile, start: int, profiles: Sequence[MigProfile],
                   instances: Sequence[Instance]) -> float:
    """Future capacity destroyed by creating ``profile`` at ``start`` (lower is better)."""
    after = [*instances, (profile.profile_id, start, profile.memory_slices)]
    return capacity_value(profiles, instances) - capacity_value(profiles, after)


def smallest_profiles(profiles: Sequence[MigProfile], sm_needed: int, memory_mib: int) -> list[MigProfile]:
    """Profiles that satisfy the request, smallest first (memory slices, then SMs, then memory).
    The ``+me`` media-extension variants are kept last because they are scarce (max 1)."""
    fit = [p for p in profiles if p.sm_count >= sm_needed and p.memory_mib >= memory_mib]
    return sorted(fit, key=lambda p: (p.memory_slices, p.slices, p.memory_mib, p.max_instances == 1 and
                                      "+me" in p.name, p.profile_id))
