"""mig-parted style declarative MIG configs, resolved per GPU and planned with ``mig_layout``.

Format (NVIDIA mig-parted ``version: v1``)::

    version: v1
    mig-configs:
      balanced:
        - devices: all            # or a list of GPU indexes
          device-filter: ["0x20B010DE"]   # optional: PCI device ids (or catalog model names)
          mig-enabled: true
          mig-devices: {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}

Used by the Ansible ``mig_config`` module and anything else that wants "make the host look
like config X": :func:`parse_config` validates (errors name the field), :func:`resolve` maps
a named config to the host's GPUs, :func:`plan_host` diffs against what is there (nothing in
use is touched unless forced), :func:`apply_host` carries the plan out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from fastshare.device.api import DeviceError, Devices, GpuInfo
from fastshare.device.catalog import find_model
from fastshare.device.mig_layout import (
    GpuShape,
    LayoutError,
    Plan,
    Step,
    apply_plan,
    check_layout,
    format_layout,
    layout_counts,
    on_gpu,
    parse_layout,
    placed_instances,
    plan_layout,
    refuse_enable_under_share,
)


class ConfigError(ValueError):
    """The config is malformed or does not fit the host; the message names the field."""


@dataclass(frozen=True)
class DeviceSpec:
    """One entry of a named config."""

    devices: str | tuple[int, ...]        # "all" or GPU indexes
    mig_enabled: bool
    mig_devices: tuple[tuple[str, int], ...] = ()
    device_filter: tuple[str, ...] = ()
    where: str = ""                        # "mig-configs.NAME[i]", for messages

    def matches(self, gpu: GpuInfo) -> bool:
        if self.devices != "all" and gpu.index not in self.devices:
            return False
        if not self.device_filter:
            return True
        ids = {f"0X{gpu.pci_device_id:08X}", gpu.name.upper(), (gpu.model or "").upper()}
        return any(f.upper() in ids for f in self.device_filter)


@dataclass(frozen=True)
class GpuPlan:
    """What one GPU needs in this run: a MIG mode change and/or layout steps, or nothing.

    ``plan`` holds only the steps this run can carry out: none while a mode change waits for a
    GPU reset (Ampere), then the layout is created by the first run after the reset.
    ``force`` and ``held`` are the in-use rules the plan was made under; apply_host re-plans
    under the same rules when MIG comes on during the run."""

    gpu_index: int
    mig_enabled: bool
    mode_change: bool                      # MIG mode must be switched
    plan: Plan | None                      # steps of this run (None: no instance changes)
    shape: GpuShape | None = None          # the profile table the plan is written in
    layout: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    reset_required: bool = False           # after this run the mode change waits for a GPU reset
    force: bool = False
    held: frozenset[str] = frozenset()
    from_catalog: bool = False             # planned on the catalog's profiles: MIG was off

    @property
    def changed(self) -> bool:
        return self.mode_change or bool(self.plan and self.plan.changed)

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu_index, "mig_enabled": self.mig_enabled, "mode_change": self.mode_change,
                "layout": self.layout, "changed": self.changed, "notes": list(self.notes),
                "reset_required": self.reset_required,
                "steps": self.plan.to_dict()["steps"] if self.plan else []}


def parse_config(source: str | Mapping[str, Any]) -> dict[str, list[DeviceSpec]]:
    """Named configs from YAML text or an already-loaded mapping."""
    try:
        data = yaml.safe_load(source) if isinstance(source, str) else source
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}".replace("\n", " ")) from None
    if not isinstance(data, Mapping):
        raise ConfigError("config must be a mapping with 'version' and 'mig-configs'")
    if data.get("version") != "v1":
        raise ConfigError(f"version: must be 'v1', got {data.get('version')!r}")
    configs = data.get("mig-configs")
    if not isinstance(configs, Mapping) or not configs:
        raise ConfigError("mig-configs: must be a non-empty mapping of config name -> list of entries")
    unknown = set(data) - {"version", "mig-configs"}
    if unknown:
        raise ConfigError(f"unknown top-level key(s): {', '.join(sorted(map(str, unknown)))}")
    return {str(name): _entries(str(name), entries) for name, entries in configs.items()}


def _entries(name: str, entries: Any) -> list[DeviceSpec]:
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"mig-configs.{name}: must be a non-empty list of entries")
    return [_entry(f"mig-configs.{name}[{i}]", e) for i, e in enumerate(entries)]


def _entry(where: str, e: Any) -> DeviceSpec:
    if not isinstance(e, Mapping):
        raise ConfigError(f"{where}: must be a mapping")
    unknown = set(e) - {"devices", "mig-enabled", "mig-devices", "device-filter"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))} "
                          "(allowed: devices, device-filter, mig-enabled, mig-devices)")
    devices = e.get("devices")
    if devices == "all":
        parsed_devices: str | tuple[int, ...] = "all"
    elif isinstance(devices, list) and devices and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
        parsed_devices = tuple(devices)
    else:
        raise ConfigError(f"{where}.devices: must be 'all' or a non-empty list of GPU indexes >= 0, "
                          f"got {devices!r}")
    enabled = e.get("mig-enabled")
    if not isinstance(enabled, bool):
        raise ConfigError(f"{where}.mig-enabled: must be true or false, got {enabled!r}")
    mig_devices = e.get("mig-devices") or {}
    if not isinstance(mig_devices, Mapping):
        raise ConfigError(f"{where}.mig-devices: must be a mapping of profile name -> count")
    for profile, count in mig_devices.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConfigError(f"{where}.mig-devices.{profile}: count must be an integer >= 0, got {count!r}")
    if mig_devices and not enabled:
        raise ConfigError(f"{where}: mig-devices given but mig-enabled is false")
    filters = e.get("device-filter") or ()
    if isinstance(filters, str):
        filters = (filters,)
    if not isinstance(filters, list | tuple) or not all(isinstance(f, str) for f in filters):
        raise ConfigError(f"{where}.device-filter: must be a string or a list of strings "
                          "(PCI device ids like 0x20B010DE, or model names)")
    return DeviceSpec(parsed_devices, enabled, tuple((str(k), int(v)) for k, v in mig_devices.items()),
                      tuple(filters), where)


def resolve(configs: Mapping[str, list[DeviceSpec]], name: str,
            gpus: Sequence[GpuInfo]) -> dict[int, DeviceSpec]:
    """GPU index -> the entry that applies to it; GPUs no entry matches are left alone.

    A lost GPU (fallen off the bus) is resolved only by an entry that names its index, whatever the
    entry's device-filter (a GPU lost before it was read has no name nor PCI id to match): plan_host
    then refuses it. ``devices: all`` leaves it out (:func:`lost_left_out` says so): nothing can change
    on it until a reset, and the GPUs that work can still be configured."""
    if name not in configs:
        raise ConfigError(f"config {name!r} not found; available: {', '.join(sorted(configs))}")
    chosen: dict[int, DeviceSpec] = {}
    known = {g.index for g in gpus}
    for spec in configs[name]:
        if spec.devices != "all":
            missing = sorted(set(spec.devices) - known)
            if missing:
                raise ConfigError(f"{spec.where}.devices: GPU index(es) {missing} do not exist on this host "
                                  f"(valid: {sorted(known)})")
        for gpu in gpus:
            if (spec.devices != "all" and gpu.index in spec.devices) if gpu.lost else spec.matches(gpu):
                if gpu.index in chosen:
                    raise ConfigError(f"GPU {gpu.index} is matched by both {chosen[gpu.index].where} and "
                                      f"{spec.where}")
                chosen[gpu.index] = spec
    return chosen


def lost_left_out(configs: Mapping[str, list[DeviceSpec]], name: str, gpus: Sequence[GpuInfo],
                  chosen: Mapping[int, DeviceSpec]) -> list[dict[str, Any]]:
    """The lost GPUs config ``name`` leaves out (its ``devices: all``, as :func:`resolve` does), each
    as {"gpu", "lost", "reason"}: the reason is the warning to give."""
    everywhere = next((spec.where for spec in configs[name] if spec.devices == "all"), None)
    return [] if everywhere is None else left_out_lost(gpus, chosen, everywhere)


def left_out_lost(gpus: Sequence[GpuInfo], chosen: Collection[int], where: str) -> list[dict[str, Any]]:
    """The lost GPUs not in ``chosen``, left out of the ``devices: all`` of entry ``where``."""
    return [{"gpu": g.index, "lost": g.lost,
             "reason": f"{_lost_gpu(g)}; left out of `devices: all` ({where}): it takes no MIG change "
                       f"until it is reset. Reset it (nvidia-smi -r -i {g.index}) or reboot, then run again"}
            for g in gpus if g.lost and g.index not in chosen]


def _lost_gpu(gpu: GpuInfo) -> str:
    return (f"GPU {gpu.index} ({gpu.uuid or 'UUID unknown'}) is lost (fell off the bus?): NVML answers "
            f"NVML_ERROR_{gpu.lost}")


def _shape(devices: Devices, gpu: GpuInfo) -> GpuShape:
    """NVML's profiles when MIG is on; the catalog's while MIG is still off (or pending)."""
    if gpu.mig_current:
        return GpuShape.from_profiles(devices.mig_profiles(gpu.index), f"GPU {gpu.index} ({gpu.name})")
    model = find_model(gpu.name)
    if model is None or not model.mig_capable:
        raise ConfigError(f"GPU {gpu.index} ({gpu.name}): no MIG profile table for this model")
    return GpuShape.from_model(model)


def _waits_for_reset(gpu: GpuInfo) -> bool:
    """A mode change on this GPU stays pending until a reset (Ampere); unknown models: assume so."""
    model = find_model(gpu.name)
    return True if model is None else model.mig_pending_until_reset


def plan_host(devices: Devices, chosen: Mapping[int, DeviceSpec], *, force: bool = False,
              held: Collection[str] = frozenset()) -> list[GpuPlan]:
    """Per-GPU plans; nothing is changed here, so every refusal comes before any change.

    An instance is in use when processes run on it or its UUID is in ``held`` (devices that
    fastshare shares hold, from the node agent's journal or inventory): in-use instances are kept
    unless ``force``; ``force`` never covers running processes, because NVML refuses to destroy
    those. A lost GPU in ``chosen`` is refused."""
    gpus = {g.index: g for g in devices.gpus()}
    for index in sorted(chosen):   # NVML fails every call on a lost GPU: refused before any change
        if gpus[index].lost:
            raise ConfigError(f"{chosen[index].where}: {_lost_gpu(gpus[index])}; no GPU was changed. Reset "
                              f"it (nvidia-smi -r -i {index}) or reboot, then run again")
    return [_plan_gpu(devices, gpus[index], chosen[index], force, held) for index in sorted(chosen)]


def _plan_gpu(devices: Devices, gpu: GpuInfo, spec: DeviceSpec, force: bool,
              held: Collection[str]) -> GpuPlan:
    if not spec.mig_enabled:
        return _disable_plan(devices, gpu, spec, force, held)
    if not gpu.mig_capable:
        raise ConfigError(f"{spec.where}: GPU {gpu.index} ({gpu.name}) does not support MIG")
    shape = _shape(devices, gpu)
    mode_change = not gpu.mig_pending     # pending True while current False: enable already asked
    _refuse_mode_change_in_use(spec, gpu, mode_change)
    if reason := refuse_enable_under_share(gpu, held, force):
        # Cancelling a pending enable (the disable path) leaves such a share its GPU; this does not.
        raise ConfigError(f"{spec.where}: {reason}")
    reset_required = not gpu.mig_current and (not mode_change or _waits_for_reset(gpu))
    try:
        wanted = parse_layout(dict(spec.mig_devices), shape)
        plan = None if reset_required else _checked_plan(shape, gpu, wanted, force, held)
        if reset_required and (reason := check_layout(shape, wanted)):
            raise LayoutError(f"impossible layout: {reason}")
    except LayoutError as exc:
        raise ConfigError(_labelled(spec.where, gpu, exc)) from None
    notes = ("MIG mode change waits for a GPU reset; instances are created by the first run after it",) \
        if reset_required else ()
    return GpuPlan(gpu.index, True, mode_change, plan, shape, format_layout(wanted, shape), notes,
                   reset_required, force, frozenset(held), from_catalog=not gpu.mig_current)


def _disable_plan(devices: Devices, gpu: GpuInfo, spec: DeviceSpec, force: bool,
                  held: Collection[str]) -> GpuPlan:
    if not gpu.mig_capable:
        return GpuPlan(gpu.index, False, False, None, notes=("GPU has no MIG; nothing to do",))
    plan = shape = None
    if gpu.mig_current and gpu.mig_instances:
        shape = _shape(devices, gpu)
        try:
            plan = _checked_plan(shape, gpu, Counter(), force, held)
        except LayoutError as exc:
            raise ConfigError(_labelled(spec.where, gpu, exc)) from None
    mode_change = gpu.mig_pending
    _refuse_mode_change_in_use(spec, gpu, mode_change)
    reset_required = gpu.mig_current and (not mode_change or _waits_for_reset(gpu))
    notes = ("MIG mode change waits for a GPU reset",) if reset_required else ()
    return GpuPlan(gpu.index, False, mode_change, plan, shape, notes=notes, reset_required=reset_required,
                   force=force, held=frozenset(held))


def _refuse_mode_change_in_use(spec: DeviceSpec, gpu: GpuInfo, mode_change: bool) -> None:
    """NVML refuses a MIG mode change while processes run on the GPU: refuse it here, before
    any GPU of the host is changed, not halfway through apply_host."""
    if mode_change and gpu.processes:
        raise ConfigError(f"{spec.where}: GPU {gpu.index} ({gpu.name}) has {gpu.processes} running "
                          "process(es); NVML cannot change its MIG mode: stop the processes first")


def _checked_plan(shape: GpuShape, gpu: GpuInfo, wanted: Counter[int], force: bool,
                  held: Collection[str]) -> Plan:
    current = gpu.mig_instances if gpu.mig_current else ()
    placed = placed_instances(current, held)
    return plan_layout(shape, placed, wanted, force=force)   # refuses to destroy running instances


def _labelled(where: str, gpu: GpuInfo, exc: Exception) -> str:
    label = f"GPU {gpu.index} ({gpu.name})"
    text = str(exc)
    return f"{where}: {text}" if label in text else f"{where}: {label}: {text}"


def apply_host(devices: Devices, plans: Sequence[GpuPlan]) -> list[dict[str, Any]]:
    """Carry out the plans GPU by GPU; a DeviceError names the GPU and the failed step.

    Order per GPU: destroy instances, switch the mode, create instances. Each result is the
    plan's dict with the steps actually carried out and whether a reset is still required."""
    refuse_lost(devices, plans)
    results: list[dict[str, Any]] = []
    for gp in plans:
        try:
            steps = _apply_gpu(devices, gp)
            now = devices.gpu(gp.gpu_index)
        except DeviceError as exc:
            raise DeviceError(_stopped(f"GPU {gp.gpu_index}: {exc}", plans, results), exc.code) from exc
        except ConfigError as exc:
            raise ConfigError(_stopped(str(exc), plans, results)) from exc
        results.append(gp.to_dict() | {"steps": [s.to_dict() for s in steps],
                                       "reset_required": now.mig_current != now.mig_pending})
    return results


def refuse_lost(devices: Devices, plans: Sequence[GpuPlan]) -> None:
    """Right before the first change, every GPU of the plans is read again: one lost since it was
    planned (plan_host refuses one lost then) is refused here, before any GPU changes, not after the
    GPUs before it in the plans were changed."""
    lost = [g for g in devices.gpus() if g.lost and g.index in {gp.gpu_index for gp in plans}]
    if lost:
        raise ConfigError(f"{_lost_gpu(lost[0])}, since it was planned; no GPU was changed. Reset it "
                          f"(nvidia-smi -r -i {lost[0].index}) or reboot, then run the same command again")


def _stopped(error: str, plans: Sequence[GpuPlan], results: Sequence[Mapping[str, Any]]) -> str:
    """The error of the GPU that failed after the GPUs of ``results`` were done: what changed, what
    was not reached, and that the same command finishes the job (it plans from what the GPUs have,
    so what is done is kept and not done again)."""
    failed = plans[len(results)].gpu_index
    changed = [f"GPU {r['gpu']} ({_summary(r)})" for r in results if r["mode_change"] or r["steps"]]
    rest = [f"GPU {gp.gpu_index}" for gp in plans[len(results) + 1:] if gp.changed]
    return (f"{error}. Changed before it: {', '.join(changed) or 'no GPU'}; not reached: "
            f"{', '.join(rest) or 'no GPU'}. Nothing is undone: once GPU {failed} is put right, run the "
            "same command again; it makes only the changes still missing")


def _summary(result: Mapping[str, Any]) -> str:
    """What apply_host did to one GPU, from its result, in a few words."""
    parts = [f"MIG {'enabled' if result['mig_enabled'] else 'disabled'}"] if result["mode_change"] else []
    for action, past in (("destroy", "destroyed"), ("create", "created")):
        if n := sum(s["action"] == action for s in result["steps"]):
            parts.append(f"{n} MIG device{'s' if n > 1 else ''} {past}")
    return ", ".join(parts)


def forced_enables(devices: Devices, plans: Sequence[GpuPlan]) -> list[str]:
    """UUIDs of the GPUs the plans enable MIG on although shares use them whole (only with force:
    planning refuses it otherwise); carried out directly, the node agent's journal must say why
    those shares lose them (fastshare.node.local_agent.note_forced_enable)."""
    return [gpu.uuid for gp in plans if gp.mig_enabled and gp.mode_change
            if (gpu := devices.gpu(gp.gpu_index)).uuid in gp.held]


def _apply_gpu(devices: Devices, gp: GpuPlan) -> list[Step]:
    done: list[Step] = []
    if not gp.mig_enabled:
        if gp.plan and gp.plan.changed:
            apply_plan(devices, gp.gpu_index, gp.plan)
            done.extend(gp.plan.steps)
        if gp.mode_change:
            devices.set_mig_mode(gp.gpu_index, False)
        return done
    if gp.mode_change:
        devices.set_mig_mode(gp.gpu_index, True)
    gpu = devices.gpu(gp.gpu_index)
    if not gpu.mig_current:
        return done                       # the layout waits for the GPU reset
    plan = gp.plan
    if plan is None or gp.from_catalog:
        # MIG just came on: plan against NVML's own profiles (the plan used the catalog), with
        # the same in-use rules as the plan; a plan made on NVML's profiles is carried out as
        # planned (and as check mode reported it).
        shape = _shape(devices, gpu)
        try:
            plan = _checked_plan(shape, gpu, parse_layout(gp.layout, shape), gp.force, gp.held)
        except LayoutError as exc:
            raise ConfigError(f"GPU {gp.gpu_index} ({gpu.name}): after the MIG mode change: {exc}") from None
    if plan.changed:
        apply_plan(devices, gp.gpu_index, plan)
        done.extend(plan.steps)
    return done


# --- through the node agent ---------------------------------------------------------------------
# While a node agent runs, the plans are carried out by its calls (under its lock of each GPU, so a
# share it is preparing counts): SetMigMode for a mode change, ApplyMigLayout for the instances, each
# GPU first checked by PlanMigLayout, so that the agent's refusals come before any change too. A
# disable is one SetMigMode with destroy_instances: the instances go and MIG goes off under one hold
# of the lock, so no share the controller places meanwhile makes the mode change fail after the
# instances went. An agent older than that field refuses it while instances exist; it gets the two
# calls it took before (ApplyMigLayout to no instances, then SetMigMode).
# SetMigMode refuses a forced enable only if it is older than its force field (it ignores it)
# or for what force never covers (processes on the GPU).
_OLDER_AGENT = ("force does not override processes on the GPU; a node agent that asks to release its "
                "shares despite force is older than this fastshare and ignores force: upgrade and "
                "restart it, or release the shares")


def check_host_via_agent(agent: Any, devices: Devices, plans: Sequence[GpuPlan]) -> None:
    """The agent's PlanMigLayout for every GPU whose instances the plans change now (MIG on): its
    refusals (a share it holds or is preparing there) as ConfigError, before anything changes."""
    from fastshare.v1 import agent_pb2

    for gp in plans:
        if gp.plan is not None and gp.plan.changed and devices.gpu(gp.gpu_index).mig_current:
            request = agent_pb2.MigLayoutRequest(gpu_uuid=devices.gpu(gp.gpu_index).uuid,
                                                 profiles=_profiles(gp), force=gp.force)
            _call(agent.PlanMigLayout, request, gp)


def apply_host_via_agent(agent: Any, devices: Devices, plans: Sequence[GpuPlan]) -> list[dict[str, Any]]:
    """:func:`apply_host` by the node agent's calls: the same order per GPU and the same result
    (steps as the agent carried them out); a refusal or failure is a ConfigError naming the GPU."""
    check_host_via_agent(agent, devices, plans)
    refuse_lost(devices, plans)
    results: list[dict[str, Any]] = []
    for gp in plans:
        try:
            results.append(_apply_gpu_via_agent(agent, devices, gp))
        except DeviceError as exc:   # the agent's inventory could not be read
            raise ConfigError(_stopped(f"GPU {gp.gpu_index}: {exc}", plans, results)) from exc
        except ConfigError as exc:
            raise ConfigError(_stopped(str(exc), plans, results)) from exc
    return results


def _apply_gpu_via_agent(agent: Any, devices: Devices, gp: GpuPlan) -> dict[str, Any]:
    """One GPU of :func:`apply_host_via_agent`: its result."""
    from fastshare.v1 import agent_pb2

    uuid = devices.gpu(gp.gpu_index).uuid
    done: list[Step] = []
    if gp.mig_enabled and gp.mode_change:
        request = agent_pb2.SetMigModeRequest(gpu_uuid=uuid, enabled=True, force=gp.force)
        _call(agent.SetMigMode, request, gp)
    if not gp.mig_enabled and gp.mode_change:
        done = _disable_via_agent(agent, devices, gp, uuid)
    # the instances when MIG is on; the agent re-plans under its lock on NVML's own profiles
    # (also when MIG just came on and the plan used the catalog's)
    elif devices.gpu(gp.gpu_index).mig_current and (
            gp.plan is None or gp.plan.changed or gp.from_catalog):
        request = agent_pb2.MigLayoutRequest(gpu_uuid=uuid, profiles=_profiles(gp), force=gp.force)
        done = _steps(devices, gp, _call(agent.ApplyMigLayout, request, gp).actions)
    now = devices.gpu(gp.gpu_index)
    return gp.to_dict() | {"steps": [s.to_dict() for s in done],
                           "reset_required": now.mig_current != now.mig_pending}


def _disable_via_agent(agent: Any, devices: Devices, gp: GpuPlan, uuid: str) -> list[Step]:
    """MIG off, its instances destroyed first, in one SetMigMode (two calls for an older agent)."""
    from fastshare.node.local_agent import AgentRefused, ask
    from fastshare.v1 import agent_pb2

    request = agent_pb2.SetMigModeRequest(gpu_uuid=uuid, enabled=False, force=gp.force,
                                          destroy_instances=True)
    try:
        return _steps(devices, gp, ask(agent.SetMigMode, request).actions)
    except AgentRefused as exc:
        instances = devices.gpu(gp.gpu_index).mig_instances
        if not (exc.refused and instances) or _knows_destroy_instances(agent, uuid):
            raise ConfigError(on_gpu(gp.gpu_index, str(exc))) from None
    # refused with the instances there, as an older agent refuses: its two calls (what refuses them,
    # a share or processes on an instance, makes ApplyMigLayout refuse as well, before any change)
    request = agent_pb2.MigLayoutRequest(gpu_uuid=uuid, profiles={}, force=gp.force)
    done = _steps(devices, gp, _call(agent.ApplyMigLayout, request, gp).actions)
    _call(agent.SetMigMode, agent_pb2.SetMigModeRequest(gpu_uuid=uuid, enabled=False), gp)
    return done


def _knows_destroy_instances(agent: Any, uuid: str) -> bool:
    """Whether the agent knows SetMigMode's destroy_instances: its refusal of it then came before any
    change, for what the two calls of an older agent would meet only after the instances went (a
    share using the GPU whole). A GPU it does not list, or lists as lost: no change is the safe answer."""
    from fastshare.node.local_agent import AgentRefused, ask, lists_pci_ids
    from fastshare.v1 import agent_pb2

    try:
        inventory = ask(agent.GetInventory, agent_pb2.GetInventoryRequest())
    except AgentRefused:
        return True   # cannot be told: no change is the safe answer
    return lists_pci_ids(g for g in inventory.gpus if g.uuid == uuid)


def _steps(devices: Devices, gp: GpuPlan, actions: Any) -> list[Step]:
    """The agent's MigActions as Steps."""
    if not actions:
        return []
    size = {p.profile_id: p.memory_slices for p in devices.mig_profiles(gp.gpu_index)}
    return [Step(a.op, a.profile_id, a.profile_name, a.start, size.get(a.profile_id, 0)) for a in actions]


def _profiles(gp: GpuPlan) -> dict[str, int]:
    """The plan's layout as the agent's MigLayoutRequest takes it (profile name -> count)."""
    return layout_counts(gp.layout) if gp.mig_enabled else {}


def _call(method: Any, request: Any, gp: GpuPlan) -> Any:
    from fastshare.node.local_agent import AgentRefused, ask

    try:
        return ask(method, request)
    except AgentRefused as exc:
        forced_enable = type(request).__name__ == "SetMigModeRequest" and request.enabled and request.force
        older = f" ({_OLDER_AGENT})" if exc.refused and forced_enable else ""
        raise ConfigError(on_gpu(gp.gpu_index, f"{exc}{older}")) from None
