"""mig-parted style configs: validation, resolution per GPU, idempotent apply on simulated NVML."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastshare.device import DeviceError, simnvml
from fastshare.device.mig_parted import ConfigError, DeviceSpec, apply_host, parse_config, plan_host, resolve

CONFIG = """
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  balanced:
    - devices: all
      device-filter: ["0x20B010DE"]
      mig-enabled: true
      mig-devices: {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}
    - devices: all
      device-filter: H100-SXM5-80GB
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  custom:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"7g.40gb": 1}
    - devices: [2]
      mig-enabled: true
      mig-devices: {}
"""


def test_parse_errors_name_the_field():
    with pytest.raises(ConfigError, match="version: must be 'v1'"):
        parse_config("version: v2\nmig-configs: {a: [{devices: all, mig-enabled: false}]}")
    with pytest.raises(ConfigError, match=r"mig-configs.a\[0\].devices: must be 'all' or a non-empty list"):
        parse_config("version: v1\nmig-configs: {a: [{devices: some, mig-enabled: false}]}")
    with pytest.raises(ConfigError, match=r"mig-configs.a\[0\].mig-enabled: must be true or false"):
        parse_config("version: v1\nmig-configs: {a: [{devices: all, mig-enabled: yes please}]}")
    with pytest.raises(ConfigError, match=r"mig-devices.1g.5gb: count must be an integer >= 0"):
        parse_config('version: v1\nmig-configs: {a: [{devices: all, mig-enabled: true,'
                     ' mig-devices: {"1g.5gb": -2}}]}')
    with pytest.raises(ConfigError, match="mig-devices given but mig-enabled is false"):
        parse_config('version: v1\nmig-configs: {a: [{devices: all, mig-enabled: false,'
                     ' mig-devices: {"1g.5gb": 1}}]}')
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config("version: v1\nmig-configs: {a: [{devices: all, mig-enabled: false, colour: red}]}")


def test_resolve_uses_indexes_and_filters(devices):
    configs = parse_config(CONFIG)
    gpus = devices.gpus()
    chosen = resolve(configs, "balanced", gpus)
    assert sorted(chosen) == [0, 1, 2]            # two A100s by PCI id, the H100 by model; not the L4
    assert chosen[1].mig_devices == (("1g.10gb", 7),)
    with pytest.raises(ConfigError, match="config 'nope' not found; available: all-disabled, balanced"):
        resolve(configs, "nope", gpus)
    bad = parse_config("version: v1\nmig-configs: {x: [{devices: [9], mig-enabled: false}]}")
    with pytest.raises(ConfigError, match=r"GPU index\(es\) \[9\] do not exist"):
        resolve(bad, "x", gpus)
    twice = parse_config("version: v1\nmig-configs: {x: [{devices: all, mig-enabled: false},"
                         " {devices: [1], mig-enabled: true}]}")
    with pytest.raises(ConfigError, match=r"GPU 1 is matched by both mig-configs.x\[0\] and .*x\[1\]"):
        resolve(twice, "x", gpus)


def test_apply_is_idempotent_and_reports_pending_reset(devices, machine: Path):
    configs = parse_config(CONFIG)
    plans = plan_host(devices, resolve(configs, "balanced", devices.gpus()))
    assert [p.changed for p in plans] == [True, True, True]
    results = apply_host(devices, plans)
    assert [r["reset_required"] for r in results] == [False, False, True]   # GPU 2: Ampere, MIG was off
    assert {i.profile_name for i in devices.mig_instances(0)} == {"3g.20gb", "2g.10gb", "1g.5gb"}
    assert len(devices.mig_instances(1)) == 7
    again = plan_host(devices, resolve(configs, "balanced", devices.gpus()))
    assert [p.changed for p in again] == [False, False, False]            # pending reset: nothing to redo
    simnvml.reset_gpu(machine, 2)
    after_reset = plan_host(devices, resolve(configs, "balanced", devices.gpus()))
    assert [p.changed for p in after_reset] == [False, False, True]
    apply_host(devices, after_reset)
    assert len(devices.mig_instances(2)) == 4
    assert not any(p.changed for p in plan_host(devices, resolve(configs, "balanced", devices.gpus())))


def test_instances_with_processes_are_refused_at_planning_even_with_force(devices, machine: Path):
    """NVML refuses to destroy an instance with processes: say so before changing anything."""
    configs = parse_config(CONFIG)
    apply_host(devices, plan_host(devices, resolve(configs, "custom", devices.gpus())))
    inst = devices.mig_instances(0)[0]
    simnvml.add_process(machine, 0, mig_uuid=inst.uuid)
    before = machine.read_bytes()
    with pytest.raises(ConfigError, match=f"7g.40gb at start 0 .{inst.uuid}. is in use"):
        plan_host(devices, resolve(configs, "all-disabled", devices.gpus()))
    with pytest.raises(ConfigError, match=f"{inst.uuid}. has 1 running process.*stop the processes"):
        plan_host(devices, resolve(configs, "all-disabled", devices.gpus()), force=True)
    assert machine.read_bytes() == before


def test_instances_held_by_shares_need_force(devices, machine: Path):
    """A MIG device a fastshare share holds counts as in use even without processes."""
    configs = parse_config(CONFIG)
    apply_host(devices, plan_host(devices, resolve(configs, "custom", devices.gpus())))
    held = {devices.mig_instances(0)[0].uuid}
    chosen = resolve(configs, "all-disabled", devices.gpus())
    with pytest.raises(ConfigError, match="is in use"):
        plan_host(devices, chosen, held=held)
    apply_host(devices, plan_host(devices, chosen, held=held, force=True))
    assert devices.gpu(0).mig_instances == ()


def test_mode_change_keeps_the_planned_steps_and_the_held_instances(devices):
    """GPU 0 (A100): MIG on with a disable pending, two instances made meanwhile, one held.
    Enabling again changes the mode and the layout in one run: apply_host carries out the
    plan (which kept the held instance), not a re-plan that ignores ``held``."""
    devices.set_mig_mode(0, False)                           # Ampere: pending until a reset
    devices.create_mig_instance(0, 9, 0)
    devices.create_mig_instance(0, 9, 4)
    held = {next(m.uuid for m in devices.mig_instances(0) if m.start == 0)}
    spec = DeviceSpec((0,), True, (("3g.20gb", 1), ("2g.10gb", 1), ("1g.5gb", 1)))
    plans = plan_host(devices, {0: spec}, held=held)
    assert plans[0].mode_change
    results = apply_host(devices, plans)
    assert results[0]["steps"] == [s.to_dict() for s in plans[0].plan.steps]
    assert held <= {m.uuid for m in devices.mig_instances(0)}
    assert (devices.gpu(0).mig_current, devices.gpu(0).mig_pending) == (True, True)


def test_apply_failure_names_the_gpu_and_the_step(devices, machine: Path):
    configs = parse_config(CONFIG)
    apply_host(devices, plan_host(devices, resolve(configs, "custom", devices.gpus())))
    plans = plan_host(devices, resolve(configs, "all-disabled", devices.gpus()))
    inst = devices.mig_instances(0)[0]
    simnvml.add_process(machine, 0, mig_uuid=inst.uuid)   # appears between plan and apply
    with pytest.raises(DeviceError, match=r"GPU 0: step 'destroy 7g.40gb .*IN_USE"):
        apply_host(devices, plans)
