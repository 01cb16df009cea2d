# Copyright: (c) 2026, fastshare developers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Declarative MIG layouts for the mig_config module: plan every GPU first, then act.

The placement planning is fastshare's (``fastshare.device.mig_layout``, the planner behind
``fastshare mig plan``); this file only decides, per GPU, which mode change and which plan
the requested layout needs, so that every refusal happens before anything is changed.
"""

from __future__ import annotations

from collections import Counter

try:
    from fastshare.device import catalog, mig_layout, mig_parted
except ImportError:  # the module fails with missing_required_lib before using any of this
    catalog = mig_layout = mig_parted = None


class MigConfigError(Exception):
    """A request that cannot be carried out; nothing has been changed when it is raised."""


def layout_targets(layout, gpus):
    """{gpu index: (mig_enabled, {profile: count})} from the module's ``layout`` option."""
    by_index = {g.index: g for g in gpus}
    valid = f"0..{len(gpus) - 1}" if gpus else "none: the host has no GPU"
    targets = {}
    for n, entry in enumerate(layout):
        where = f"layout[{n}]"
        devices = entry["devices"]
        if devices == "all":
            indexes = sorted(by_index)
        elif isinstance(devices, list) and devices and all(_is_index(d) for d in devices):
            indexes = [int(d) for d in devices]
        else:
            raise MigConfigError(f"{where}.devices must be 'all' or a non-empty list of GPU indexes, "
                                 f"got {devices!r}")
        for index in indexes:
            if index not in by_index:
                raise MigConfigError(f"{where}.devices: GPU {index} does not exist (valid: {valid})")
            if index in targets:
                raise MigConfigError(f"{where}.devices: GPU {index} is already configured by an "
                                     "earlier layout entry")
            gpu = by_index[index]
            if entry["mig_enabled"] and not gpu.mig_capable:
                raise MigConfigError(f"{where}.devices: GPU {index} ({gpu.name}) does not support MIG; "
                                     "leave it out of devices or set mig_enabled: false")
            wanted = entry["mig_devices"] or {}
            if not entry["mig_enabled"] and any(int(_count(where, k, v)) for k, v in wanted.items()):
                raise MigConfigError(f"{where}: mig_devices requires mig_enabled=true")
            targets[index] = (entry["mig_enabled"], {str(k): _count(where, k, v) for k, v in wanted.items()})
    return targets


def _is_index(value):
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, str) and value.isdigit())


def _count(where, profile, value):
    if isinstance(value, bool) or not str(value).strip().isdigit():
        raise MigConfigError(f"{where}.mig_devices[{profile!r}] must be an integer >= 0, got {value!r}")
    return int(value)


def config_file_targets(path, name, gpus):
    """{gpu index: (mig_enabled, {profile: count})} from a mig-parted config file.

    Parsing, ``device-filter`` matching and the one-entry-per-GPU rule are fastshare's
    (``fastshare.device.mig_parted``), as for every other consumer of these files.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise MigConfigError(f"config_file: cannot read {path}: {exc.strerror}") from None
    try:
        chosen = mig_parted.resolve(mig_parted.parse_config(text), name, gpus)
    except (mig_parted.ConfigError, ValueError) as exc:
        raise MigConfigError(f"config_file {path}: {exc}") from None
    return {index: (spec.mig_enabled, dict(spec.mig_devices)) for index, spec in chosen.items()}


class GpuChange:
    """What one GPU needs: a mode change, a placement plan, or nothing."""

    def __init__(self, gpu, mig_enabled, wanted):
        self.gpu = gpu
        self.mig_enabled = mig_enabled
        self.wanted = wanted            # {profile name: count}
        self.mode_change = None         # None | True (enable) | False (disable)
        self.expect_pending = False     # the mode change waits for a GPU reset (Ampere)
        self.shape = None
        self.plan = None                # mig_layout.Plan of destroys/creates, when known
        self.pending = False            # after apply: mode change waiting for a reset
        self.steps_done = []

    @property
    def changed(self):
        return self.mode_change is not None or bool(self.plan and self.plan.steps)


def plan_gpu(devices, gpu, mig_enabled, wanted, held, force):
    """Decide what ``gpu`` needs; raises MigConfigError (naming the instance) when refused."""
    change = GpuChange(gpu, mig_enabled, wanted)
    label = f"GPU {gpu.index} ({gpu.name})"
    if not gpu.mig_capable:
        if mig_enabled:
            raise MigConfigError(f"{label} does not support MIG")
        return change
    instances = devices.mig_instances(gpu.index) if gpu.mig_current else []
    placed = [_placed(m, held) for m in instances]
    model = catalog.find_model(gpu.name)
    if not mig_enabled:
        if gpu.mig_current:
            change.shape = mig_layout.shape_of(devices, gpu.index)
            change.plan = _plan(change.shape, placed, Counter(), force, label)
            _refuse_busy_destroys(change, instances, label)
        if gpu.mig_current or gpu.mig_pending:
            change.mode_change = False
            change.expect_pending = gpu.mig_current and _pending_until_reset(model)
        return change
    if gpu.mig_current:
        change.shape = mig_layout.shape_of(devices, gpu.index)
        try:
            counts = mig_layout.parse_layout(wanted, change.shape)
        except mig_layout.LayoutError as exc:
            raise MigConfigError(_labelled(label, exc)) from None
        change.plan = _plan(change.shape, placed, counts, force, label)
        _refuse_busy_destroys(change, instances, label)
        if not gpu.mig_pending:   # a disable is pending: enabling again cancels it
            change.mode_change = True
        return change
    # MIG is off now: check the layout against the model's table, then enable.
    change.mode_change = None if gpu.mig_pending else True
    change.expect_pending = gpu.mig_pending or _pending_until_reset(model)
    if model is not None and model.mig_capable:
        change.shape = mig_layout.GpuShape.from_model(model)
        try:
            counts = mig_layout.parse_layout(wanted, change.shape)
        except mig_layout.LayoutError as exc:
            raise MigConfigError(_labelled(label, exc)) from None
        if not change.expect_pending:
            change.plan = _plan(change.shape, [], counts, force, label)
        elif reason := mig_layout.check_layout(change.shape, counts):
            raise MigConfigError(f"{label}: impossible layout: {reason}")
    return change


def _labelled(label, exc):
    text = str(exc)
    return text if label in text else f"{label}: {text}"


def _pending_until_reset(model):
    """Unknown models are assumed to need a reset (the safe assumption for reporting)."""
    return True if model is None else model.mig_pending_until_reset


def _placed(instance, held):
    busy = instance.processes > 0 or (instance.uuid is not None and instance.uuid in held)
    return mig_layout.Placed(instance.profile_id, instance.start, busy, instance.uuid or "")


def _plan(shape, placed, counts, force, label):
    try:
        return mig_layout.plan_layout(shape, placed, counts, force=force)
    except mig_layout.LayoutError as exc:
        raise MigConfigError(_labelled(label, exc)) from None


def _refuse_busy_destroys(change, instances, label):
    """force overrides fastshare's own shares, never running processes: NVML refuses those."""
    for step in change.plan.steps:
        if step.action != "destroy":
            continue
        for inst in instances:
            if inst.start == step.start and inst.processes:
                raise MigConfigError(
                    f"{label}: {inst.profile_name} at start {inst.start} ({inst.uuid}) has "
                    f"{inst.processes} running process(es); NVML cannot destroy it even with force: "
                    "stop the processes first")


def apply_change(devices, change):
    """Carry out a planned change; DeviceError names the step that failed and what was done."""
    gpu = change.gpu
    if change.mode_change is False:
        if change.plan and change.plan.steps:
            mig_layout.apply_plan(devices, gpu.index, change.plan)
            change.steps_done.extend(change.plan.steps)
        change.pending = devices.set_mig_mode(gpu.index, False)
        return
    if change.mode_change is True:
        change.pending = devices.set_mig_mode(gpu.index, True)
        if change.pending:
            return
        if not gpu.mig_current:
            # MIG was just switched on: plan again against what NVML now reports.
            change.shape, change.plan = mig_layout.plan_for_gpu(devices, gpu.index, change.wanted)
    elif change.expect_pending:
        change.pending = True
        return
    if change.plan is not None and change.plan.steps:
        mig_layout.apply_plan(devices, gpu.index, change.plan)
        change.steps_done.extend(change.plan.steps)


def step_dict(gpu_index, step):
    return dict(gpu=gpu_index, action=step.action, profile=step.profile_name, profile_id=step.profile_id,
                start=step.start, size=step.size, description=f"GPU {gpu_index}: {step.describe()}")


def describe_layout(gpu, mig_on, pending, placed_devices):
    """One GPU as text for diff mode: mode line, then one line per MIG device by start."""
    mode = "enabled" if mig_on else "disabled"
    if pending is not None and pending != mig_on:
        mode += f" ({'enabled' if pending else 'disabled'} after GPU reset)"
    lines = [f"GPU {gpu.index} ({gpu.name}, {gpu.uuid}): MIG {mode}"]
    for profile, start, size, uuid in sorted(placed_devices, key=lambda d: d[1]):
        suffix = f" {uuid}" if uuid else ""
        lines.append(f"  {profile} at start {start} (memory slices {start}..{start + size - 1}){suffix}")
    return "\n".join(lines) + "\n"


def predicted_devices(change, instances):
    """(profile, start, size, uuid) of the MIG devices the GPU will have once the change is done."""
    if change.plan is None or change.pending or change.expect_pending or not change.mig_enabled:
        return []
    by_start = {d[1]: d for d in instances}
    result = []
    for p in change.plan.final:
        prof = change.shape.profile(p.profile_id)
        kept = by_start.get(p.start)
        uuid = kept[3] if kept and kept[0] == prof.name else None
        result.append((prof.name, p.start, prof.memory_slices, uuid))
    return result
