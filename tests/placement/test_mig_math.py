"""MIG slice arithmetic (fastshare.placement.mig) on its own: which starts are free, which
profiles fit a request, and which start destroys the least future capacity."""

from __future__ import annotations

from fastshare.device.api import MigProfile
from fastshare.device.catalog import get_model
from fastshare.placement import mig

A100 = get_model("A100-SXM4-40GB").profiles
BY_NAME = {p.name: p for p in A100}


def test_free_starts_honour_instance_counts_memory_and_compute():
    me = BY_NAME["1g.5gb+me"]                                   # at most one per GPU
    assert mig.free_starts(me, A100, []) == list(range(7))
    assert mig.free_starts(me, A100, [(me.profile_id, 0, 1)]) == []
    assert mig.free_starts(BY_NAME["3g.20gb"], A100, [(9, 0, 4)]) == [4]     # at most two
    # an instance of a profile the GPU no longer lists counts its size as compute slices
    assert mig.free_starts(BY_NAME["1g.5gb"], A100, [(99, 0, 4)]) == [4, 5, 6]
    # compute slices bind before memory does: 4 compute slices, 8 memory slices
    small = MigProfile(1, "1c.1m", 1, 1, 1000, 10, 8, tuple(range(8)))
    whole = MigProfile(2, "4c.8m", 4, 8, 8000, 40, 1, (0,))
    used = [(1, s, 1) for s in range(3)]
    assert mig.free_starts(small, [small, whole], used) == [3, 4, 5, 6, 7]
    assert mig.free_starts(small, [small, whole], [*used, (1, 3, 1)]) == []


def test_smallest_profiles_fit_sms_and_memory_inclusively_smallest_first():
    assert [p.name for p in mig.smallest_profiles(A100, 14, 4864)][:3] == ["1g.5gb", "1g.5gb+me", "1g.10gb"]
    assert [p.name for p in mig.smallest_profiles(A100, 14, 4865)][:2] == ["1g.10gb", "2g.10gb"]
    assert [p.name for p in mig.smallest_profiles(A100, 43, 0)] == ["4g.20gb", "7g.40gb"]
    assert mig.smallest_profiles(A100, 99, 0) == []


def test_the_a30s_2g_12gb_plus_me_comes_after_its_2g_12gb_and_fits_once():
    a30 = get_model("A30-24GB").profiles
    by_name = {p.name: p for p in a30}
    assert [p.name for p in mig.smallest_profiles(a30, 15, 0)] == ["2g.12gb", "2g.12gb+me", "4g.24gb"]
    me = by_name["2g.12gb+me"]
    assert mig.free_starts(me, a30, []) == [0, 2]
    assert mig.free_starts(me, a30, [(me.profile_id, 0, 2)]) == []
    assert mig.free_starts(by_name["2g.12gb"], a30, [(me.profile_id, 0, 2)]) == [2]


def test_capacity_is_what_can_still_be_added_and_loss_prefers_starts_that_keep_big_shapes():
    assert mig.capacity_value(A100, [(0, 0, 8)]) == 0            # a full GPU takes nothing more
    empty = mig.capacity_value(A100, [])
    assert empty > mig.capacity_value(A100, [(19, 0, 1)]) > 0
    # a 3g.20gb at 4 keeps the 4g.20gb (only at 0) possible; at 0 it does not
    three = BY_NAME["3g.20gb"]
    assert mig.placement_loss(three, 4, A100, []) < mig.placement_loss(three, 0, A100, [])
    # at most one 1g.5gb+me: with it present, no combination has a second one
    me = BY_NAME["1g.5gb+me"].profile_id
    assert mig.capacity_value(A100, [(me, 0, 1)]) < mig.capacity_value(A100, [(19, 0, 1)])
    # compute slices bound the combinations too: 4 of 4 used, memory free, nothing fits
    small = MigProfile(1, "1c.1m", 1, 1, 1000, 10, 8, tuple(range(8)))
    whole = MigProfile(2, "4c.8m", 4, 8, 8000, 40, 1, (0,))
    assert mig.capacity_value([small, whole], [(1, s, 1) for s in range(4)]) == 0
    assert mig.capacity_value([small, whole], [(1, s, 1) for s in range(3)]) == 1


def _capacity_by_definition(profiles, instances) -> int:
    """capacity_value's docstring, written out: every distinct multiset of profiles that can
    still be added (free memory range, instance limits, compute slices), weighted by the
    compute slices of its largest member."""
    total = max(p.slices for p in profiles)
    slices = {p.profile_id: p.slices for p in profiles}
    mask = 0
    for _pid, start, size in instances:
        mask |= ((1 << size) - 1) << start
    combos: set[tuple[int, ...]] = set()
    seen: set[tuple] = set()

    def grow(mask: int, compute: int, counts: tuple[int, ...], added: tuple[int, ...]) -> None:
        if (mask, counts, added) in seen:
            return
        seen.add((mask, counts, added))
        combos.add(added)
        for i, p in enumerate(profiles):
            if counts[i] >= p.max_instances or compute + p.slices > total:
                continue
            for s in p.placements:
                m = ((1 << p.memory_slices) - 1) << s
                if not mask & m:
                    more = tuple(c + (j == i) for j, c in enumerate(counts))
                    grow(mask | m, compute + p.slices, more, tuple(sorted((*added, p.profile_id))))

    have = [sum(1 for pid, _s, _z in instances if pid == p.profile_id) for p in profiles]
    grow(mask, sum(slices.get(pid, size) for pid, _s, size in instances), tuple(have), ())
    return sum(max((slices[i] for i in c), default=0) for c in combos)


def test_capacity_value_matches_its_definition():
    small = MigProfile(1, "1c.1m", 1, 1, 1000, 10, 2, (0, 1, 2, 3))
    mid = MigProfile(2, "2c.2m", 2, 2, 2000, 20, 2, (0, 2))
    big = MigProfile(3, "3c.4m", 3, 4, 4000, 30, 1, (0,))
    # (), (1c), (1c,1c), (2c), (2c,1c), (3c): 0 + 1 + 1 + 2 + 2 + 3
    assert mig.capacity_value([small, mid, big], []) == 9 == _capacity_by_definition([small, mid, big], [])
    for layout in ([], [(9, 0, 4)], [(19, 0, 1)], [(14, 2, 2), (19, 6, 1)], [(15, 0, 2), (15, 4, 2)]):
        assert mig.capacity_value(A100, layout) == _capacity_by_definition(A100, layout), layout
