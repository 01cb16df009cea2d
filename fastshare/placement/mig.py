"""MIG slice arithmetic: which placements are free, and which choice keeps the most future shapes.

A GPU's MIG layout is a set of GPU instances, each ``(start, size)`` in memory slices. A
profile can be created at an allowed start when its memory range is free, its instance count
is below ``max_instances`` and enough compute slices remain. Because later requests need
particular starts (a 3g only at 0 or 4, a 7g only at 0), the position chosen now decides
what still fits later; ``placement_loss`` measures that so the engine can pick the start
(and the GPU) that destroys the least future capacity; ``request_profiles`` and ``best_slice``
turn an exclusive request into the profiles that hold it and the best slice of one GPU.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache

from fastshare.device.api import MigProfile
from fastshare.device.catalog import find_profile
from fastshare.placement.model import GpuView, Request

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


def free_starts(profile: MigProfile, profiles: Sequence[MigProfile],
                instances: Sequence[Instance]) -> list[int]:
    """Allowed starts where ``profile`` can be created now, lowest first."""
    if sum(1 for pid, _s, _z in instances if pid == profile.profile_id) >= profile.max_instances:
        return []
    by_id = {p.profile_id: p for p in profiles}
    used_compute = sum(by_id[pid].slices if pid in by_id else size for pid, _s, size in instances)
    if used_compute + profile.slices > compute_slices_total(profiles):
        return []
    mask = used_mask(instances)
    return [s for s in profile.placements if not mask & _mask(s, profile.memory_slices)]


def capacity_value(profiles: Sequence[MigProfile], instances: Sequence[Instance]) -> int:
    """How much future demand a layout can still absorb: over every distinct combination
    (multiset of profiles) that could still be added to it, the compute slices of its largest
    member. Counting combinations rather than free slices is what tells a harmless start from
    one that rules out a 3g or a 4g later; weighting by the largest member keeps big shapes
    (the ones that fail first) possible."""
    counts = Counter(pid for pid, _s, _z in instances)
    slices = {p.profile_id: p.slices for p in profiles}
    # an instance of a profile not offered (a newer driver's, made by hand): its size stands in
    # for its compute slices, as in free_starts
    taken = sum(slices.get(pid, size) for pid, _s, size in instances)
    return _value(tuple(profiles), used_mask(instances), tuple(sorted(counts.items())), taken)


@lru_cache(maxsize=8192)
def _value(profiles: tuple[MigProfile, ...], mask: int, counts: tuple[tuple[int, int], ...],
           taken: int) -> int:
    """``capacity_value`` of a layout as ``_reachable`` keys it: summing over its combinations
    (thousands for an empty GPU) is what costs, and every empty GPU of a model asks the same."""
    slices = {p.profile_id: p.slices for p in profiles}
    return sum(max((slices[i] for i in c), default=0) for c in _reachable(profiles, mask, counts, taken))


@lru_cache(maxsize=8192)
def _reachable(profiles: tuple[MigProfile, ...], mask: int, counts: tuple[tuple[int, int], ...],
               taken: int) -> frozenset[tuple[int, ...]]:
    """The combinations of profiles that can still be added to a layout (memory slices
    ``mask``, instances per profile ``counts``, ``taken`` compute slices)."""
    have = dict(counts)
    compute_left = compute_slices_total(profiles) - taken
    out = {()}
    for p in profiles:
        if have.get(p.profile_id, 0) >= p.max_instances or p.slices > compute_left:
            continue
        for s in p.placements:
            m = _mask(s, p.memory_slices)
            if mask & m:
                continue
            more = dict(have)
            more[p.profile_id] = more.get(p.profile_id, 0) + 1
            sub = _reachable(profiles, mask | m, tuple(sorted(more.items())), taken + p.slices)
            out.update(tuple(sorted((*c, p.profile_id))) for c in sub)
    return frozenset(out)


def placement_loss(profile: MigProfile, start: int, profiles: Sequence[MigProfile],
                   instances: Sequence[Instance]) -> int:
    """Future combinations destroyed by creating ``profile`` at ``start`` (lower is better)."""
    after = [*instances, (profile.profile_id, start, profile.memory_slices)]
    return capacity_value(profiles, instances) - capacity_value(profiles, after)


def smallest_profiles(profiles: Sequence[MigProfile], sm_needed: int, memory_mib: int) -> list[MigProfile]:
    """Profiles that satisfy the request, smallest first (memory slices, then SMs, then memory).
    The ``+me`` media-extension variants are kept last because they are scarce (max 1)."""
    fit = [p for p in profiles if p.sm_count >= sm_needed and p.memory_mib >= memory_mib]
    return sorted(fit, key=lambda p: (p.memory_slices, p.slices, p.memory_mib, p.media, p.profile_id))


def request_sms(r: Request, v: GpuView) -> int:
    """The SMs exclusive request ``r`` needs of a GPU like ``v``."""
    return r.sm_count or (math.ceil(r.sm_percent / 100 * v.sm_count) if r.sm_percent else 0)


def request_profiles(r: Request, v: GpuView) -> list[MigProfile]:
    """The MIG profiles of a GPU like ``v`` that hold exclusive request ``r``, smallest first
    (empty: none is that large, or has the profile it names)."""
    named = find_profile(v.mig_profiles, r.mig_profile) if r.mig_profile else None
    return [p for p in smallest_profiles(v.mig_profiles, request_sms(r, v), r.gpu_memory_mib)
            if r.mig_profile is None or p == named]


def best_slice(profiles: Sequence[MigProfile], held: Sequence[Instance], unheld: Sequence[Instance],
               fitting: Sequence[MigProfile]) -> tuple[tuple, int, MigProfile] | None:
    """The best slice among ``fitting`` (the profiles that fit a request, smallest first) on a
    GPU offering ``profiles`` whose assignments hold instances ``held``, beside instances
    ``unheld`` that none holds: its rank (lower first), start and profile; None when none of
    them has a free placement."""
    inst = [*held, *unheld]
    held_mask = used_mask(held)   # an unheld instance on a held slice is not offered
    by_id = {p.profile_id: p for p in profiles}
    free_slices = compute_slices_total(profiles) - sum(
        by_id[pid].slices for pid, _s, _z in inst if pid in by_id)
    for p in fitting:
        # an instance of this profile that is already there costs no MIG change and no
        # future shape: taken first (then the lowest start)
        ready = [s for pid, s, z in unheld
                 if pid == p.profile_id and not held_mask & used_mask([(pid, s, z)])]
        starts = ready or free_starts(p, profiles, inst)
        if not starts:
            continue
        # best fit across GPUs (fullest GPU that takes it), then the start that rules out
        # the fewest later combinations on that GPU; a +me slice (one per GPU, laid out for
        # its media engines) only where no plain one can be had
        rank, start = min(((p.memory_slices, p.slices, p.media, not ready, free_slices - p.slices,
                            0 if ready else placement_loss(p, s, profiles, inst)), s)
                          for s in starts)
        return rank, start, p
    return None
