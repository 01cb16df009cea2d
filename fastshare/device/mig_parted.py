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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from fastshare.device.api import DeviceError, Devices, GpuInfo
from fastshare.device.catalog import find_model
from fastshare.device.mig_layout import (
    GpuShape,
    LayoutError,
    Plan,
    apply_plan,
    format_layout,
    parse_layout,
    plan_layout,
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
    """What one GPU needs: a MIG mode change and/or layout steps, or nothing."""

    gpu_index: int
    mig_enabled: bool
    mode_change: bool                      # MIG mode must be switched first
    plan: Plan | None                      # None when MIG ends up disabled
    layout: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    reset_pending: bool = False            # mode already requested, waits for a GPU reset

    @property
    def changed(self) -> bool:
        return self.mode_change or (bool(self.plan and self.plan.changed) and not self.reset_pending)

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu_index, "mig_enabled": self.mig_enabled, "mode_change": self.mode_change,
                "layout": self.layout, "changed": self.changed, "notes": list(self.notes),
                "reset_pending": self.reset_pending,
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
    """GPU index -> the entry that applies to it; GPUs no entry matches are left alone."""
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
            if spec.matches(gpu):
                if gpu.index in chosen:
                    raise ConfigError(f"GPU {gpu.index} is matched by both {chosen[gpu.index].where} and "
                                      f"{spec.where}")
                chosen[gpu.index] = spec
    return chosen


def _shape(devices: Devices, gpu: GpuInfo) -> GpuShape:
    """NVML's profiles when MIG is on; the catalog's while MIG is still off (or pending)."""
    if gpu.mig_current:
        return GpuShape.from_profiles(devices.mig_profiles(gpu.index), f"GPU {gpu.index} ({gpu.name})")
    model = find_model(gpu.name)
    if model is None or not model.mig_capable:
        raise ConfigError(f"GPU {gpu.index} ({gpu.name}): no MIG profile table for this model")
    return GpuShape.from_model(model)


def plan_host(devices: Devices, chosen: Mapping[int, DeviceSpec], *, force: bool = False) -> list[GpuPlan]:
    """Per-GPU plans (check mode shows these; nothing is changed here)."""
    plans = []
    gpus = {g.index: g for g in devices.gpus()}
    for index in sorted(chosen):
        spec, gpu = chosen[index], gpus[index]
        if not spec.mig_enabled:
            plans.append(_disable_plan(devices, gpu, spec, force))
            continue
        if not gpu.mig_capable:
            raise ConfigError(f"{spec.where}: GPU {index} ({gpu.name}) does not support MIG")
        shape = _shape(devices, gpu)
        try:
            wanted = parse_layout(dict(spec.mig_devices), shape)
            current = list(gpu.mig_instances) if gpu.mig_current else []
            plan = plan_layout(shape, current, wanted, force=force)
        except LayoutError as exc:
            raise ConfigError(f"{spec.where}: GPU {index}: {exc}") from exc
        pending = not gpu.mig_current and gpu.mig_pending
        notes = ("MIG mode is enabled but pending a GPU reset; instances are created after it",) if pending \
            else ()
        plans.append(GpuPlan(index, True, not gpu.mig_pending, plan, format_layout(wanted, shape), notes,
                             reset_pending=pending))
    return plans


def _disable_plan(devices: Devices, gpu: GpuInfo, spec: DeviceSpec, force: bool) -> GpuPlan:
    if not gpu.mig_capable:
        return GpuPlan(gpu.index, False, False, None, notes=("GPU has no MIG; nothing to do",))
    plan = None
    if gpu.mig_current and gpu.mig_instances:
        shape = _shape(devices, gpu)
        try:
            plan = plan_layout(shape, list(gpu.mig_instances), Counter(), force=force)
        except LayoutError as exc:
            raise ConfigError(f"{spec.where}: GPU {gpu.index}: {exc}") from exc
    pending = gpu.mig_current and not gpu.mig_pending
    notes = ("MIG mode is disabled but pending a GPU reset",) if pending else ()
    return GpuPlan(gpu.index, False, bool(gpu.mig_pending), plan, notes=notes, reset_pending=pending)


def apply_host(devices: Devices, plans: Sequence[GpuPlan]) -> list[dict[str, Any]]:
    """Carry out the plans GPU by GPU; a DeviceError names the GPU and the failed step.

    Order per GPU: destroy instances, switch the mode, create instances. When enabling MIG on
    Ampere stays pending until a reset, creation is skipped and reported (``reset_required``)."""
    results = []
    for gp in plans:
        result = gp.to_dict() | {"reset_required": gp.reset_pending}
        try:
            if not gp.mig_enabled:
                if gp.plan and gp.plan.changed:
                    apply_plan(devices, gp.gpu_index, gp.plan)
                if gp.mode_change:
                    result["reset_required"] = devices.set_mig_mode(gp.gpu_index, False)
            else:
                if gp.mode_change:
                    devices.set_mig_mode(gp.gpu_index, True)
                gpu = devices.gpu(gp.gpu_index)
                if not gpu.mig_current:
                    result["reset_required"] = True
                elif gp.mode_change:
                    # MIG just came on: plan against NVML's own profiles (the plan used the catalog).
                    shape = _shape(devices, gpu)
                    fresh = plan_layout(shape, devices.mig_instances(gp.gpu_index),
                                        parse_layout(gp.layout, shape))
                    apply_plan(devices, gp.gpu_index, fresh)
                elif gp.plan and gp.plan.changed:
                    apply_plan(devices, gp.gpu_index, gp.plan)
        except DeviceError as exc:
            raise DeviceError(f"GPU {gp.gpu_index}: {exc}", exc.code) from exc
        results.append(result)
    return results
