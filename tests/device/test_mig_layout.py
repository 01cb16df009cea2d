"""MIG layout planning: acceptance layouts on A100-40GB, refusals, busy instances, properties."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastshare.device import DeviceError, open_devices, simnvml
from fastshare.device.api import MigInstance, MigProfile
from fastshare.device.catalog import MODELS, get_model
from fastshare.device.mig_layout import (
    GpuShape,
    LayoutError,
    Placed,
    apply_plan,
    best_placement,
    check_layout,
    format_layout,
    parse_layout,
    plan_for_gpu,
    plan_layout,
)

A100 = GpuShape.from_model(get_model("A100-SXM4-40GB"))

# Layouts `nvidia-smi mig -cgi` accepts on an A100-40GB in SOME order (GPU-FACTS.md).
ACCEPTED = ["9,19,14,19", "19,19,14,9", "14,14,14,19", "19,19,19,19,19,19,19", "15,15,15,15",
            "5,9", "0", "5,14,19", "9,9", "15,19,19,19,19,19,19", "3g.20gb=1,2g.10gb=1,1g.5gb=2",
            "20,19,14,9"]


def test_parse_layout_forms():
    assert parse_layout("3g.20gb=1,2g.10gb=1,1g.5gb=2", A100) == Counter({9: 1, 14: 1, 19: 2})
    assert parse_layout("9,19,14,19", A100) == Counter({9: 1, 14: 1, 19: 2})
    assert parse_layout("19=3, 1g.5gb", A100) == Counter({19: 4})
    assert parse_layout({"1g.5gb": 2, "7g.40gb": 0}, A100) == Counter({19: 2})
    assert parse_layout("", A100) == Counter()
    with pytest.raises(LayoutError, match=r"unknown MIG profile '5g.25gb'.*known: 1g.5gb"):
        parse_layout("5g.25gb=1", A100)
    with pytest.raises(LayoutError, match=r"count for '1g\.5gb' must be an integer >= 0"):
        parse_layout("1g.5gb=-1", A100)
    with pytest.raises(LayoutError, match="not PROFILE or PROFILE=COUNT"):
        parse_layout("1g.5gb=2=3", A100)
    assert format_layout(Counter({19: 2, 9: 1}), A100) == "3g.20gb=1,1g.5gb=2"


@pytest.mark.parametrize("layout", ACCEPTED)
def test_accepted_layouts_are_planned_and_applied(layout: str, devices):
    wanted = parse_layout(layout, A100)
    _, plan = plan_for_gpu(devices, 0, layout)
    assert [s.action for s in plan.steps] == ["create"] * sum(wanted.values())
    instances = apply_plan(devices, 0, plan)
    assert Counter(i.profile_id for i in instances) == wanted
    assert all(i.uuid and i.uuid.startswith("MIG-") for i in instances)
    # applying again changes nothing (idempotent)
    assert not plan_for_gpu(devices, 0, layout)[1].changed


@pytest.mark.parametrize(("layout", "reason"), [
    ("5,9,0", "needs 16 memory slices"),
    ("19,19,19,19,19,19,19,19", "8 x 1g.5gb requested but at most 7"),
    ("5,9,19", "needs 9 memory slices"),
    ("14,14,14,19,19", "needs 8 compute slices"),
    ("5,5", "at most 1"),
])
def test_impossible_layouts_are_rejected_with_a_reason(layout: str, reason: str):
    with pytest.raises(LayoutError, match=reason):
        plan_layout(A100, [], parse_layout(layout, A100))


def test_other_models_plan_their_full_layouts():
    a30 = GpuShape.from_model(get_model("A30-24GB"))
    assert check_layout(a30, parse_layout("2g.12gb=1,1g.6gb=2", a30)) is None
    assert "needs 5 memory slices" in check_layout(a30, parse_layout("4g.24gb=1,1g.6gb=1", a30))
    h100 = GpuShape.from_model(get_model("H100-SXM5-80GB"))
    plan = plan_layout(h100, [], parse_layout("3g.40gb=1,2g.20gb=1,1g.10gb=2", h100))
    assert {(s.profile_name, s.start) for s in plan.steps} == {
        ("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3)}


def test_plan_keeps_existing_instances_and_destroys_first():
    current = [Placed(9, 4), Placed(19, 0), Placed(19, 1)]
    plan = plan_layout(A100, current, parse_layout("9,14,19", A100))
    assert [s.describe().split(" (")[0] for s in plan.steps] == ["destroy 1g.5gb", "create 2g.10gb"]
    assert {(p.profile_id, p.start) for p in plan.keep} == {(9, 4), (19, 0)} or \
        {(p.profile_id, p.start) for p in plan.keep} == {(9, 4), (19, 1)}
    assert plan.steps[0].action == "destroy"


def test_plan_moves_idle_instances_when_needed_but_never_busy_ones():
    # default-placer style layout: 1g at 6 and 5, 2g at 2 -> 3g cannot be added without moving
    current = [Placed(19, 6), Placed(19, 5), Placed(14, 2)]
    plan = plan_layout(A100, current, parse_layout("19,19,14,9", A100))
    assert Counter(p.profile_id for p in plan.final) == Counter({19: 2, 14: 1, 9: 1})
    busy = [Placed(19, 6, in_use=True, label="MIG-busy"), Placed(19, 5), Placed(14, 2)]
    plan = plan_layout(A100, busy, parse_layout("19,14,9", A100))
    assert Placed(19, 6, True, "MIG-busy") in plan.final
    assert all(s.start != 6 for s in plan.steps)
    assert {(p.profile_id, p.start) for p in plan.final} == {(9, 0), (14, 4), (19, 6)}
    with pytest.raises(LayoutError, match="not around the instances in use"):
        plan_layout(A100, busy, parse_layout("19,19,14,9", A100))   # 2nd 1g would need slice 7
    with pytest.raises(LayoutError, match=r"1g.5gb at start 6 \(MIG-busy\) is in use"):
        plan_layout(A100, busy, parse_layout("9,9", A100))
    forced = plan_layout(A100, busy, parse_layout("9,9", A100), force=True)
    assert any(s.action == "destroy" and s.start == 6 for s in forced.steps)
    with pytest.raises(LayoutError, match="not around the instances in use"):
        plan_layout(A100, [Placed(19, 1, in_use=True)], parse_layout("19,5", A100))


def test_force_destroys_held_instances_but_never_plans_destroying_running_ones():
    # force covers instances a share holds; NVML refuses to destroy one that runs processes, so
    # a plan that did would fail halfway through its steps
    running = [Placed(19, 6, in_use=True, label="MIG-run", processes=2), Placed(19, 5)]
    with pytest.raises(LayoutError, match=r"1g.5gb at start 6 \(MIG-run\) is in use") as exc:
        plan_layout(A100, running, parse_layout("9,9", A100))
    assert "--force" not in str(exc.value) and "stop its processes" in str(exc.value)
    with pytest.raises(LayoutError, match=r"MIG-run\) has 2 running process.*NVML cannot destroy it even"):
        plan_layout(A100, running, parse_layout("9,9", A100), force=True)
    held = [Placed(19, 6, in_use=True, label="MIG-held"), Placed(19, 5)]
    with pytest.raises(LayoutError, match="force it"):
        plan_layout(A100, held, parse_layout("9,9", A100))
    forced = plan_layout(A100, held, parse_layout("9,9", A100), force=True)
    assert any(s.start == 6 and s.action == "destroy" for s in forced.steps)


def test_best_placement_keeps_big_shapes_free():
    assert best_placement(A100, [], "1g.5gb") == 6          # keeps 4g@0 and 3g@0 possible
    assert best_placement(A100, [], "3g.20gb") == 4         # keeps 4g@0 possible
    assert best_placement(A100, [Placed(19, 6)], 19) == 5
    assert best_placement(A100, [Placed(0, 0)], 19) is None
    assert best_placement(A100, [Placed(9, 4)], "2g.10gb") in (0, 2)


def test_mig_disabled_gpu_is_refused_with_the_fix(devices):
    with pytest.raises(LayoutError, match=r"MIG mode is disabled on GPU 2.*fastshare mig enable --gpu 2"):
        plan_for_gpu(devices, 2, "19")
    with pytest.raises(LayoutError, match="does not support MIG"):
        plan_for_gpu(devices, 3, "19")


def test_apply_reports_the_failing_step(devices, machine: Path):
    inst = devices.create_mig_instance(0, 19, 0)
    _, plan = plan_for_gpu(devices, 0, "0")
    simnvml.add_process(machine, 0, mig_uuid=inst.uuid)   # a process started after the plan was made
    with pytest.raises(DeviceError, match=r"step 'destroy 1g.5gb .*IN_USE.*already done: nothing"):
        apply_plan(devices, 0, plan)
    assert [i.start for i in devices.mig_instances(0)] == [0]


# --- properties -----------------------------------------------------------------------------------
_MIG_MODELS = sorted(k for k, m in MODELS.items() if m.mig_capable)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from(_MIG_MODELS), ops=st.lists(
    st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 7)), min_size=1, max_size=12))
def test_random_create_destroy_never_overlaps_and_capacity_adds_up(tmp_path_factory, model, ops):
    path = tmp_path_factory.mktemp("prop") / "m.json"
    simnvml.create_machine(path, [model], mig_enabled=True)
    shape = GpuShape.from_model(get_model(model))
    with open_devices("sim", path) as devices:
        for create, profile_index, start in ops:
            if create:
                prof = shape.profiles[profile_index % len(shape.profiles)]
                try:
                    devices.create_mig_instance(0, prof.profile_id, start)
                except DeviceError as exc:
                    assert exc.code in {"INSUFFICIENT_RESOURCES", "INVALID_ARGUMENT"}
            else:
                try:
                    devices.destroy_mig_instance(0, start)
                except DeviceError as exc:
                    assert exc.code == "NOT_FOUND"
            instances = devices.mig_instances(0)
            used = 0
            for inst in instances:                 # no two instances share a memory slice
                mask = ((1 << inst.size) - 1) << inst.start
                assert not used & mask
                used |= mask
            assert sum(shape.profile(i.profile_id).slices for i in instances) <= shape.compute_slices
            placed = [Placed(i.profile_id, i.start) for i in instances]
            for prof in shape.profiles:            # NVML's remaining capacity == brute-force maximum
                expected = _max_more(shape, placed, prof.profile_id)
                assert devices.remaining_capacity(0, prof.profile_id) == expected


def _max_more(shape: GpuShape, placed: list[Placed], profile_id: int) -> int:
    n = 0
    while _brute_force(shape, [profile_id] * (n + 1), placed):
        n += 1
    return n


def check_fits(shape: GpuShape, placed: list[Placed]) -> bool:
    used = compute = 0
    counts: Counter[int] = Counter()
    for p in placed:
        prof = shape.profile(p.profile_id)
        mask = ((1 << prof.memory_slices) - 1) << p.start
        if used & mask or p.start not in prof.placements:
            return False
        used |= mask
        compute += prof.slices
        counts[p.profile_id] += 1
    return compute <= shape.compute_slices and all(
        n <= shape.profile(pid).max_instances for pid, n in counts.items())


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(_MIG_MODELS), data=st.data())
def test_planner_agrees_with_brute_force(model, data):
    """A layout is planned iff some assignment of allowed starts fits; plans are valid."""
    shape = GpuShape.from_model(get_model(model))
    ids = [p.profile_id for p in shape.profiles]
    wanted = Counter(data.draw(st.lists(st.sampled_from(ids), max_size=8)))
    current = []
    for pid in data.draw(st.lists(st.sampled_from(ids), max_size=4)):
        start = best_placement(shape, current, pid)
        if start is not None:
            current.append(Placed(pid, start, in_use=data.draw(st.booleans())))
    possible = _brute_force(shape, sorted(wanted.elements()), [])
    try:
        plan = plan_layout(shape, current, wanted)
    except LayoutError as exc:
        busy = [p for p in current if p.in_use]
        assert not possible or busy, f"planner rejected a feasible layout: {exc}"
        return
    assert possible
    assert check_fits(shape, list(plan.final))
    assert Counter(p.profile_id for p in plan.final) == wanted
    assert all(p in plan.final for p in current if p.in_use)
    created = [s for s in plan.steps if s.action == "create"]
    destroyed = [s for s in plan.steps if s.action == "destroy"]
    assert len(created) == sum(wanted.values()) - len(plan.keep)
    assert len(destroyed) == len(current) - len(plan.keep)


def _brute_force(shape: GpuShape, todo: list[int], placed: list[Placed], after: int = -1) -> bool:
    """Does some choice of allowed starts fit ``todo`` (sorted ids) next to ``placed``?"""
    if not todo:
        return True
    prof = shape.profile(todo[0])
    same_next = len(todo) > 1 and todo[1] == todo[0]
    for s in prof.placements:
        if s <= after:
            continue   # identical instances: increasing starts only
        trial = [*placed, Placed(prof.profile_id, s)]
        if check_fits(shape, trial) and _brute_force(shape, todo[1:], trial, s if same_next else -1):
            return True
    return False


@pytest.mark.parametrize("model", ["A100-SXM4-40GB", "H100-SXM5-80GB", "A30-24GB"])
def test_planner_accepts_exactly_the_layouts_brute_force_can_place(model):
    """Every multiset of profiles (up to the compute slice count) is planned iff a brute-force
    search over allowed starts places it; naive strategies miss some on 8-slice GPUs."""
    from itertools import combinations_with_replacement

    from fastshare.device import layout_bench

    shape = GpuShape.from_model(get_model(model))
    ids = [p.profile_id for p in shape.profiles if "+me" not in p.name]
    accepted = 0
    for n in range(1, shape.compute_slices + 1):
        for combo in combinations_with_replacement(ids, n):
            wanted = Counter(combo)
            feasible = _brute_force(shape, sorted(combo), [])
            assert (check_layout(shape, wanted) is None) == feasible, combo
            if feasible:
                plan = plan_layout(shape, [], wanted)
                assert Counter(p.profile_id for p in plan.final) == wanted
                assert check_fits(shape, list(plan.final))
                accepted += 1
    assert accepted == len(layout_bench.feasible_layouts(shape)) > 0
    if shape.memory_slices == 8:
        assert not layout_bench.largest_first(shape, Counter({19: 2, 14: 1, 9: 1}))
        assert not layout_bench.nvml_default_order(shape, [19, 19, 14, 9])
        assert layout_bench.nvml_default_order(shape, [9, 19, 14, 19])


# --- behaviour pinned after mutation testing ---------------------------------------------------
def test_the_planner_places_new_instances_where_they_keep_the_largest_shapes_possible():
    """Among arrangements that keep as much, the plan takes the one with the best future shapes,
    not merely the lowest starts: a lone 1g goes to the top, a 3g.20gb to 4 (the 4g.20gb, only
    at 0, stays possible), and a second 1g next to the first one (a 3g.20gb at 4 stays possible)."""
    def final(current, layout):
        return [(p.profile_id, p.start) for p in plan_layout(A100, current, parse_layout(layout, A100)).final]
    assert final([], "1g.5gb") == [(19, 6)]
    assert final([], "3g.20gb") == [(9, 4)]
    assert final([], "3g.20gb,1g.5gb") == [(19, 0), (9, 4)]
    assert final([], "1g.5gb=2") == [(19, 4), (19, 5)]
    assert best_placement(A100, [Placed(19, 0)], "1g.5gb") == 1
    assert best_placement(A100, [Placed(14, 0)], "1g.10gb") == 2


@pytest.mark.parametrize(("current", "reason"), [
    ([Placed(9, 0), Placed(14, 2)], "2g.10gb at 2 overlaps another instance"),
    ([Placed(9, 2)], "3g.20gb cannot start at 2"),
    ([Placed(20, 0), Placed(20, 1)], "more than 1 x 1g.5gb+me"),
])
def test_an_inconsistent_current_layout_is_refused_before_any_step(current, reason):
    with pytest.raises(LayoutError, match=f"the current layout is inconsistent: {re.escape(reason)}"):
        plan_layout(A100, current, parse_layout("1g.5gb", A100))


def test_no_arrangement_reason_names_the_allowed_starts():
    """A GPU whose profiles fit by slice counts but not by their allowed starts (NVML reports
    the starts; the catalog's models happen to have no such layout)."""
    two = MigProfile(1, "2g.x", 2, 2, 1000, 10, 2, (0, 1))
    shape = GpuShape((two, MigProfile(2, "8g.x", 7, 8, 4000, 70, 1, (0,))), 8, 7, "GPU 9")
    assert check_layout(shape, Counter({1: 2})) == (
        "no arrangement of allowed placements fits 2 x 2g.x (2g.x can start only at 0, 1)")
    # compute slices bind before memory on such a GPU: a current layout beyond them is refused
    small = MigProfile(3, "1c.x", 1, 1, 500, 10, 8, tuple(range(8)))
    narrow = GpuShape((small, MigProfile(4, "4c.x", 4, 8, 4000, 40, 1, (0,))), 8, 4, "GPU 9")
    plan_layout(narrow, [Placed(3, s) for s in range(4)], Counter({3: 4}))
    with pytest.raises(LayoutError, match="inconsistent: 5 compute slices needed, 4 exist"):
        plan_layout(narrow, [Placed(3, s) for s in range(5)], Counter({3: 4}))


def test_layout_counts_must_be_whole_numbers_and_current_layouts_format_back():
    for bad in (1.5, "two", None):
        with pytest.raises(LayoutError, match=r"count for '1g.5gb' must be an integer >= 0, got "):
            parse_layout({"1g.5gb": bad}, A100)
    assert format_layout([Placed(19, 0), Placed(9, 4), Placed(19, 1)], A100) == "3g.20gb=1,1g.5gb=2"


def test_shapes_come_only_from_mig_capable_models_or_reported_profiles():
    with pytest.raises(LayoutError, match="L4 does not support MIG"):
        GpuShape.from_model(get_model("L4"))
    with pytest.raises(LayoutError, match="GPU 3 reports no MIG profiles"):
        GpuShape.from_profiles(iter(()), "GPU 3")
    shape = GpuShape.from_profiles(iter(A100.profiles))
    assert (shape.memory_slices, shape.compute_slices, len(shape.profiles)) == (8, 7, len(A100.profiles))
    with pytest.raises(LayoutError, match=r"unknown MIG profile '9g' on GPU; known: 1g\.5gb"):
        shape.profile("9g")


def test_an_instance_with_processes_is_in_use_and_labelled_by_its_uuid():
    def inst(processes: int) -> MigInstance:
        return MigInstance("GPU-0", 0, 19, "1g.5gb", 3, 1, 1, 0, "MIG-x", 14, 4864, processes)
    assert Placed.of(inst(2)) == Placed(19, 3, True, "MIG-x", 2)
    assert Placed.of(inst(0)) == Placed(19, 3, False, "MIG-x", 0)

    class Bare:
        profile_id, start = 9, 4
    assert Placed.of(Bare()) == Placed(9, 4)


def test_plan_to_dict_lists_steps_keep_and_final():
    plan = plan_layout(A100, [Placed(19, 0), Placed(19, 6)], parse_layout("1g.5gb,3g.20gb", A100))
    assert plan.to_dict() == {
        "changed": True,
        "steps": [{"action": "destroy", "profile_id": 19, "profile_name": "1g.5gb", "start": 6, "size": 1,
                   "description": "destroy 1g.5gb (id 19) at start 6 (memory slices 6..6)"},
                  {"action": "create", "profile_id": 9, "profile_name": "3g.20gb", "start": 4, "size": 4,
                   "description": "create 3g.20gb (id 9) at start 4 (memory slices 4..7)"}],
        "keep": [{"profile_id": 19, "start": 0, "in_use": False, "label": "", "processes": 0, "shares": ()}],
        "final": [{"profile_id": 19, "start": 0, "in_use": False, "label": "", "processes": 0, "shares": ()},
                  {"profile_id": 9, "start": 4, "in_use": False, "label": "", "processes": 0, "shares": ()}],
    }
    assert not plan_layout(A100, plan.final, parse_layout("1g.5gb,3g.20gb", A100)).to_dict()["changed"]


def test_plan_for_gpu_keeps_busy_instances_unless_forced(devices, machine: Path):
    inst = devices.create_mig_instance(0, 19, 6)
    simnvml.add_process(machine, 0, mig_uuid=inst.uuid)
    with pytest.raises(LayoutError, match=r"1g.5gb at start 6 \(MIG-.*\) is in use"):
        plan_for_gpu(devices, 0, "7g.40gb")


def test_apply_reports_the_steps_already_done(devices, machine: Path):
    devices.create_mig_instance(0, 19, 0)
    second = devices.create_mig_instance(0, 19, 1)
    _, plan = plan_for_gpu(devices, 0, "")
    simnvml.add_process(machine, 0, mig_uuid=second.uuid)
    with pytest.raises(DeviceError, match=r"step 'destroy 1g.5gb \(id 19\) at start 1 .*already done: "
                                          r"destroy 1g.5gb \(id 19\) at start 0 \(memory slices 0..0\)\)"):
        apply_plan(devices, 0, plan)


def test_force_keeps_an_instance_with_processes_where_another_plan_frees_only_held_ones():
    """--force frees instances that only shares hold; those with processes stay fixed. With both
    merely 'in use' the search kept the held 3g.20gb at 4 (it leaves a 1g.5gb free) and then refused
    the plan for the running one at 0 ("NVML cannot destroy it even with force"), though keeping the
    running one and destroying the held one fits the same layout."""
    held = Placed(9, 4, in_use=True, label="MIG-held", shares=("alloc-1",))
    running = Placed(9, 0, in_use=True, label="MIG-run", processes=1)
    wanted = parse_layout("3g.20gb=1,1g.5gb=3", A100)
    # Without force, the share is what is in the way: named, with force as the way out.
    with pytest.raises(LayoutError, match=r"MIG-held, held by fastshare share alloc-1\) is in use.*force it"):
        plan_layout(A100, [held, running], wanted)
    plan = plan_layout(A100, [held, running], wanted, force=True)
    assert [(s.action, s.start) for s in plan.steps] == [("destroy", 4), ("create", 4), ("create", 5),
                                                        ("create", 6)]
    assert running in plan.keep
    # With no place for the running one, force is refused as before, naming its processes.
    with pytest.raises(LayoutError, match=r"MIG-run.*NVML cannot destroy it even with force"):
        plan_layout(A100, [held, running], parse_layout("7g.40gb=1", A100), force=True)


def test_a_gpu_whose_mig_enable_waits_for_a_reset_is_refused_with_that_fix(devices):
    """GPU 2 (A100) with MIG enabled but not yet in effect: 'enable it first' sent the user to run
    the command they had already run; the fix is a reset."""
    assert devices.set_mig_mode(2, True)   # pending on an Ampere GPU
    with pytest.raises(LayoutError) as refused:
        plan_for_gpu(devices, 2, "19")
    assert "enable it first" not in str(refused.value)
    assert "nvidia-smi -r -i 2" in str(refused.value), refused.value
