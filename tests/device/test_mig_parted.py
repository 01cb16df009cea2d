"""mig-parted style configs: validation, resolution per GPU, idempotent apply on simulated NVML."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from fastshare.cli import main
from fastshare.device import DeviceError, mig_parted, open_devices, simnvml
from fastshare.device.api import GpuInfo
from fastshare.device.mig_parted import (
    ConfigError,
    DeviceSpec,
    apply_host,
    apply_host_via_agent,
    check_host_via_agent,
    parse_config,
    plan_host,
    resolve,
)
from fastshare.node.client import channel, stub
from fastshare.node.local_agent import held_by_agent
from fastshare.node.service import Metrics, NodeAgentService
from fastshare.v1 import agent_pb2, agent_pb2_grpc
from tests.node.harness import in_process_agent, share

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
    with pytest.raises(ConfigError) as caught:
        resolve(bad, "x", gpus)
    assert str(caught.value) == ("mig-configs.x[0].devices: GPU index(es) [9] do not exist on this host "
                                 "(valid: [0, 1, 2, 3])")
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


def _one(entry: str) -> str:
    return f"version: v1\nmig-configs: {{a: [{entry}]}}"


@pytest.mark.parametrize(("source", "says"), [
    ("version: v1\nmig-configs: [", "not valid YAML: "),
    ("version: v2\nmig-configs: {a: [{devices: all, mig-enabled: false}]}",
     "version: must be 'v1', got 'v2'"),
    ("- version\n- v1", "config must be a mapping with 'version' and 'mig-configs'"),
    ("version: v1", "mig-configs: must be a non-empty mapping"),
    ("version: v1\nmig-configs: {}", "mig-configs: must be a non-empty mapping"),
    ("version: v1\nmig-configs: [a]", "mig-configs: must be a non-empty mapping"),
    ("version: v1\nmig-configs: {a: [{devices: all, mig-enabled: false}]}\ncolour: red\nsize: 1",
     "unknown top-level key(s): colour, size"),
    ("version: v1\nmig-configs: {a: null}", "mig-configs.a: must be a non-empty list of entries"),
    ("version: v1\nmig-configs: {a: []}", "mig-configs.a: must be a non-empty list of entries"),
    ("version: v1\nmig-configs: {a: {devices: all, mig-enabled: false}}",
     "mig-configs.a: must be a non-empty list of entries"),
    ("version: v1\nmig-configs: {a: [{devices: all, mig-enabled: false}, all]}",
     "mig-configs.a[1]: must be a mapping"),
    (_one("{devices: all, mig-enabled: false, colour: red, size: 1}"),
     "mig-configs.a[0]: unknown key(s) colour, size "
     "(allowed: devices, device-filter, mig-enabled, mig-devices)"),
    (_one("{mig-enabled: false}"), "mig-configs.a[0].devices: must be 'all' or a non-empty list"),
    (_one("{devices: [], mig-enabled: false}"), "mig-configs.a[0].devices: must be 'all'"),
    (_one("{devices: [0, -1], mig-enabled: false}"), "mig-configs.a[0].devices: must be 'all'"),
    (_one("{devices: [true], mig-enabled: false}"), "mig-configs.a[0].devices: must be 'all'"),
    (_one("{devices: ['0'], mig-enabled: false}"), "mig-configs.a[0].devices: must be 'all'"),
    (_one("{devices: 0, mig-enabled: false}"), "mig-configs.a[0].devices: must be 'all'"),
    (_one("{devices: {0: 1}, mig-enabled: false}"), "mig-configs.a[0].devices: must be 'all'"),
    (_one("{devices: all}"), "mig-configs.a[0].mig-enabled: must be true or false, got None"),
    (_one("{devices: all, mig-enabled: 1}"), "mig-configs.a[0].mig-enabled: must be true or false, got 1"),
    (_one("{devices: all, mig-enabled: true, mig-devices: [1g.5gb]}"),
     "mig-configs.a[0].mig-devices: must be a mapping of profile name -> count"),
    (_one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: true}}"),
     "mig-configs.a[0].mig-devices.1g.5gb: count must be an integer >= 0, got True"),
    (_one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: '2'}}"),
     "mig-configs.a[0].mig-devices.1g.5gb: count must be an integer >= 0, got '2'"),
    (_one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: 1.5}}"), "count must be an integer >= 0"),
    (_one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: -1}}"),
     "count must be an integer >= 0, got -1"),
    (_one("{devices: all, mig-enabled: true, device-filter: [0x20B010DE]}"),   # YAML reads a number
     "mig-configs.a[0].device-filter: must be a string or a list of strings"),
    (_one("{devices: all, mig-enabled: true, device-filter: {A100: 1}}"),
     "mig-configs.a[0].device-filter: must be a string or a list of strings"),
])
def test_every_malformed_part_is_refused_naming_it(source: str, says: str):
    with pytest.raises(ConfigError) as caught:
        parse_config(source)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_parse_gives_each_entry_as_written_and_where_it_is():
    configs = parse_config({"version": "v1", "mig-configs": {
        "a": [{"devices": [0, 2], "mig-enabled": True, "mig-devices": {"3g.20gb": 2, "1g.5gb": 0},
               "device-filter": "0x20b010de"}],
        7: [{"devices": "all", "mig-enabled": False, "mig-devices": None},
            {"devices": [3], "mig-enabled": True, "device-filter": ["L4", "T4"]}]}})
    assert configs == {
        "a": [DeviceSpec((0, 2), True, (("3g.20gb", 2), ("1g.5gb", 0)), ("0x20b010de",), "mig-configs.a[0]")],
        "7": [DeviceSpec("all", False, (), (), "mig-configs.7[0]"),
              DeviceSpec((3,), True, (), ("L4", "T4"), "mig-configs.7[1]")]}


def _descriptions(steps: list[dict]) -> list[str]:
    return [s["description"] for s in steps]


def test_enabling_mig_plans_each_gpu_as_its_architecture_takes_it(devices):
    """MIG off: an Ampere GPU's enable waits for a GPU reset (the layout is checked now and created
    by the first run after it); a Hopper's takes effect at once, its instances made in the same run."""
    devices.set_mig_mode(1, False)                                 # Hopper: off at once
    specs = {1: DeviceSpec((1,), True, (("3g.40gb", 2),), where="w[0]"),
             2: DeviceSpec((2,), True, (("1g.5gb", 1), ("3g.20gb", 1), ("2g.10gb", 1)), where="w[1]")}
    h100, a100 = plan_host(devices, specs)
    assert a100.to_dict() == {
        "gpu": 2, "mig_enabled": True, "mode_change": True, "layout": "3g.20gb=1,2g.10gb=1,1g.5gb=1",
        "changed": True,
        "notes": ["MIG mode change waits for a GPU reset; instances are created by the first run after it"],
        "reset_required": True, "steps": []}
    assert h100.to_dict() | {"steps": _descriptions(h100.to_dict()["steps"])} == {
        "gpu": 1, "mig_enabled": True, "mode_change": True, "layout": "3g.40gb=2", "changed": True,
        "notes": [], "reset_required": False,
        "steps": ["create 3g.40gb (id 9) at start 0 (memory slices 0..3)",
                  "create 3g.40gb (id 9) at start 4 (memory slices 4..7)"]}
    h100_done, a100_done = apply_host(devices, [h100, a100])
    assert (h100_done["reset_required"], h100_done["steps"]) == (False, h100.to_dict()["steps"])
    assert sorted(m.profile_name for m in devices.mig_instances(1)) == ["3g.40gb", "3g.40gb"]
    assert (a100_done["reset_required"], a100_done["steps"]) == (True, [])
    gpu2 = devices.gpu(2)
    assert (gpu2.mig_current, gpu2.mig_pending, gpu2.mig_instances) == (False, True, ())


def test_a_layout_that_cannot_fit_is_refused_also_while_mig_waits_for_a_reset(devices):
    """A GPU whose instances are made only after the reset: the layout is still checked now."""
    spec = DeviceSpec((2,), True, (("7g.40gb", 1), ("1g.5gb", 1)), where="w[0]")
    with pytest.raises(ConfigError, match=r"^w\[0\]: GPU 2 \(NVIDIA A100-SXM4-40GB\): impossible layout"):
        plan_host(devices, {2: spec})
    assert not devices.gpu(2).mig_pending


def test_layout_errors_name_the_entry_and_the_gpu_once(devices):
    spec = DeviceSpec((0,), True, (("9g.99gb", 1),), where="w[0]")
    with pytest.raises(ConfigError) as caught:
        plan_host(devices, {0: spec})                              # MIG on: NVML's profile table
    assert str(caught.value).startswith(
        "w[0]: unknown MIG profile '9g.99gb' on GPU 0 (NVIDIA A100-SXM4-40GB)")
    assert str(caught.value).count("GPU 0") == 1
    with pytest.raises(ConfigError) as caught:
        plan_host(devices, {2: DeviceSpec((2,), True, (("9g.99gb", 1),), where="w[1]")})   # MIG off: catalog
    assert str(caught.value).startswith("w[1]: GPU 2 (NVIDIA A100-SXM4-40GB): unknown MIG profile '9g.99gb'")


A30_MEDIA = """
version: v1
mig-configs:
  media:
    - devices: all
      device-filter: ["0x20B710DE"]
      mig-enabled: true
      mig-devices: {"2g.12gb+me": 1, "2g.12gb": 1}
"""


def test_an_a30_layout_takes_its_2g_12gb_plus_me_and_other_models_refuse_it(tmp_path: Path):
    """mig-parted's own config-default.yaml has `all-2g.12gb.me` for the A30 (R525 and later):
    planned from the catalog while MIG is off, from NVML once it is on; made at its placement;
    at most one per GPU; a model without it refuses it, naming the profiles it has."""
    path = tmp_path / "a30.json"
    simnvml.create_machine(path, ["A30-24GB", "A30-24GB", "A100-SXM4-40GB"])
    simnvml.SimNvml(path).nvmlInit()
    with open_devices("sim", path) as devs:
        configs = parse_config(A30_MEDIA)
        plans = plan_host(devs, resolve(configs, "media", devs.gpus()))   # MIG off: the catalog
        assert [(p.gpu_index, p.reset_required, p.from_catalog) for p in plans] == [(0, True, True),
                                                                                    (1, True, True)]
        apply_host(devs, plans)
        simnvml.reboot(path)
        apply_host(devs, plan_host(devs, resolve(configs, "media", devs.gpus())))  # MIG on: NVML
        for gpu in (0, 1):
            made = devs.mig_instances(gpu)
            assert sorted((i.profile_id, i.profile_name, i.sm_count) for i in made) == [
                (5, "2g.12gb", 28), (6, "2g.12gb+me", 28)]
            assert sorted(i.start for i in made) == [0, 2]
        assert not any(p.changed for p in plan_host(devs, resolve(configs, "media", devs.gpus())))
        with pytest.raises(ConfigError, match=r"^w\[0\]: impossible layout: 2 x 2g.12gb\+me requested "
                                              r"but at most 1 can exist on GPU 0 \(NVIDIA A30\)$"):
            plan_host(devs, {0: DeviceSpec((0,), True, (("2g.12gb+me", 2),), where="w[0]")})
        with pytest.raises(ConfigError) as caught:
            plan_host(devs, {2: DeviceSpec((2,), True, (("2g.12gb+me", 1),), where="w[1]")})
        assert str(caught.value).startswith(
            "w[1]: GPU 2 (NVIDIA A100-SXM4-40GB): unknown MIG profile '2g.12gb+me' on A100-SXM4-40GB; "
            "known: 1g.5gb (id 19), 1g.5gb+me (id 20)"), caught.value


def test_disabling_mig_plans_and_applies_per_architecture(devices, machine: Path):
    """all-disabled: instances destroyed first, then the mode; Ampere keeps MIG until a reset, Hopper
    drops it at once, an enable still pending (GPU 2) is cancelled; a GPU without MIG needs nothing."""
    configs = parse_config(CONFIG)
    apply_host(devices, plan_host(devices, resolve(configs, "custom", devices.gpus())))
    plans = plan_host(devices, resolve(configs, "all-disabled", devices.gpus()))
    dicts = [p.to_dict() for p in plans]
    assert [(d["gpu"], d["mig_enabled"], d["mode_change"], d["layout"], d["changed"], d["reset_required"])
            for d in dicts] == [(0, False, True, "", True, True), (1, False, True, "", True, False),
                                (2, False, True, "", True, False), (3, False, False, "", False, False)]
    assert [d["notes"] for d in dicts] == [["MIG mode change waits for a GPU reset"], [], [],
                                           ["GPU has no MIG; nothing to do"]]
    assert _descriptions(dicts[0]["steps"]) == ["destroy 7g.40gb (id 0) at start 0 (memory slices 0..7)"]
    results = apply_host(devices, plans)
    assert [r["steps"] for r in results] == [d["steps"] for d in dicts]
    assert [r["reset_required"] for r in results] == [True, False, False, False]
    assert [(g.mig_current, g.mig_pending, g.mig_instances) for g in devices.gpus()] == [
        (True, False, ()), (False, False, ()), (False, False, ()), (False, False, ())]
    again = plan_host(devices, resolve(configs, "all-disabled", devices.gpus()))
    assert [(p.mode_change, p.changed, p.reset_required) for p in again] == [
        (False, False, True), (False, False, False), (False, False, False), (False, False, False)]
    simnvml.reset_gpu(machine, 0)
    assert not any(p.changed or p.reset_required
                   for p in plan_host(devices, resolve(configs, "all-disabled", devices.gpus())))


def test_mig_on_a_gpu_without_mig_is_refused_naming_the_entry(devices, machine: Path):
    before = machine.read_bytes()
    with pytest.raises(ConfigError, match=r"^w\[0\]: GPU 3 \(NVIDIA L4\) does not support MIG$"):
        plan_host(devices, {0: DeviceSpec((0,), True, where="w[1]"),
                            3: DeviceSpec((3,), True, where="w[0]")})
    assert machine.read_bytes() == before


def test_a_mode_change_under_running_processes_is_refused_before_any_change(devices, machine: Path):
    """NVML refuses it; refused at planning, naming the GPU, so no other GPU is changed first."""
    simnvml.add_process(machine, 2)
    enable = DeviceSpec((2,), True, (("3g.20gb", 1),), where="w[0]")
    with pytest.raises(ConfigError, match=r"^w\[0\]: GPU 2 \(NVIDIA A100-SXM4-40GB\) has 1 running "
                                          r"process\(es\); NVML cannot change its MIG mode"):
        plan_host(devices, {2: enable})
    off = DeviceSpec((2,), False, where="w[0]")
    assert not plan_host(devices, {2: off})[0].changed              # MIG already off: no mode change
    simnvml.remove_process(machine, simnvml.load_machine(machine)["gpus"][2]["processes"][0]["pid"])
    devices.set_mig_mode(2, True)                                    # Ampere: enable pending
    simnvml.add_process(machine, 2)
    assert not plan_host(devices, {2: enable})[0].mode_change        # already asked: fine
    apply_host(devices, plan_host(devices, {2: enable}))            # and the run leaves the mode alone
    with pytest.raises(ConfigError, match=r"^w\[0\]: GPU 2 .* has 1 running process\(es\)"):
        plan_host(devices, {2: off})                                 # cancelling it is a mode change


def test_enabling_mig_on_a_gpu_a_share_holds_whole_needs_force(devices):
    gpu = devices.gpu(2)
    spec = DeviceSpec((2,), True, (("3g.20gb", 1),), where="w[0]")
    with pytest.raises(ConfigError, match=rf"^w\[0\]: GPU 2 .*{gpu.uuid} is held whole by"):
        plan_host(devices, {2: spec}, held={gpu.uuid})
    assert plan_host(devices, {2: spec}, held={gpu.uuid}, force=True)[0].mode_change
    devices.set_mig_mode(2, True)                                    # already asked: no change of mode
    assert plan_host(devices, {2: spec}, held={gpu.uuid})[0].reset_required


# --- through a node agent (served in this process, real gRPC on a unix socket) --------------------
@pytest.fixture
def agent(tmp_path: Path, machine: Path):
    """(stub, server) of a node agent on ``machine``; the test may stop the server."""
    yield from _served(tmp_path, machine, NodeAgentService)


class _OlderService(NodeAgentService):
    def SetMigMode(self, request, context):   # as an agent without destroy_instances answered
        request.ClearField("destroy_instances")
        return super().SetMigMode(request, context)

    def GetInventory(self, request, context):   # nor Gpu.pci_device_id (the same release)
        reply = super().GetInventory(request, context)
        for gpu in reply.gpus:
            gpu.ClearField("pci_device_id")
        return reply


@pytest.fixture
def older_agent(tmp_path: Path, machine: Path):
    """(stub, server) of a node agent older than SetMigMode's destroy_instances."""
    yield from _served(tmp_path, machine, _OlderService)


@pytest.fixture
def agent_socket(tmp_path: Path, machine: Path):
    """The unix socket of a node agent on ``machine``."""
    for _, _, sock in _served(tmp_path, machine, NodeAgentService, with_socket=True):
        yield sock


def _served(tmp_path: Path, machine: Path, service: type[NodeAgentService], with_socket: bool = False):
    run = Path(tempfile.mkdtemp(prefix="fsm-", dir="/tmp"))     # a unix socket path must stay short
    node = in_process_agent(tmp_path, run, machine)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    agent_pb2_grpc.add_NodeAgentServicer_to_server(service(node, Metrics(node)), server)
    server.add_insecure_port(f"unix:{run / 'agent.sock'}")
    server.start()
    ch = channel(unix_socket=run / "agent.sock")
    yield (stub(ch), server, str(run / "agent.sock")) if with_socket else (stub(ch), server)
    ch.close()
    server.stop(None)
    shutil.rmtree(run, ignore_errors=True)


def _held(agent_stub) -> dict[str, list[str]]:
    return held_by_agent(agent_stub.GetInventory(agent_pb2.GetInventoryRequest(), timeout=30))


def test_the_agents_calls_do_what_apply_host_does(agent, devices, machine: Path, tmp_path: Path):
    """Same plans, same results and the same GPUs, directly or by the agent's calls: Ampere's enable
    waits for its reset, Hopper's (MIG off, planned on the catalog) gets its instances in the run,
    a disable destroys the instances first, an enable still pending is cancelled."""
    agent_stub, _ = agent
    devices.set_mig_mode(1, False)
    twin = tmp_path / "twin.json"
    shutil.copy(machine, twin)
    configs = parse_config(CONFIG)
    with open_devices("sim", twin) as direct:
        for name in ("all-disabled", "balanced", "all-disabled"):   # first: MIG on, no instances
            by_agent = apply_host_via_agent(agent_stub, devices,
                                            plan_host(devices, resolve(configs, name, devices.gpus())))
            alone = apply_host(direct, plan_host(direct, resolve(configs, name, direct.gpus())))
            assert by_agent == alone
            assert [(g.mig_current, g.mig_pending, [(m.profile_name, m.start) for m in g.mig_instances])
                    for g in devices.gpus()] == \
                   [(g.mig_current, g.mig_pending, [(m.profile_name, m.start) for m in g.mig_instances])
                    for g in direct.gpus()]
        assert [r["reset_required"] for r in by_agent] == [True, False, False, False]
        assert [len(r["steps"]) for r in alone] == [4, 7, 0, 0]


def _balanced_with_a_held_slice(agent_stub, devices) -> GpuInfo:
    """The "balanced" config applied through the agent, then share "ex" prepared on the H100's first
    slice (the agent holds it; the plans below are not told). Returns the H100 as it is then."""
    balanced = plan_host(devices, resolve(parse_config(CONFIG), "balanced", devices.gpus()))
    apply_host_via_agent(agent_stub, devices, balanced)
    h100 = devices.gpu(1)
    agent_stub.PrepareShare(share("ex", "exclusive", [h100.uuid], mig_profile="1g.10gb",
                                  mig_start=h100.mig_instances[0].start), timeout=60)
    return devices.gpu(1)


def test_the_agent_checks_every_gpu_before_any_changes(agent, devices, machine: Path):
    """An instance a share holds (here one the plan was not told of, as one the agent is preparing)
    is refused by the agent's PlanMigLayout before any GPU changes, naming the GPU and the share."""
    agent_stub, _ = agent
    _balanced_with_a_held_slice(agent_stub, devices)
    configs = parse_config(CONFIG)
    plans = plan_host(devices, resolve(configs, "all-disabled", devices.gpus()))     # held not given
    before = machine.read_bytes()
    for call in (check_host_via_agent, apply_host_via_agent):
        with pytest.raises(ConfigError, match=r"^GPU 1: .*held by fastshare share ex") as caught:
            call(agent_stub, devices, plans)
        assert "answered" not in str(caught.value)
        assert machine.read_bytes() == before                       # GPU 0 first in order: untouched too
    held = _held(agent_stub)
    with pytest.raises(ConfigError, match="held by fastshare share ex"):
        plan_host(devices, resolve(configs, "all-disabled", devices.gpus()), held=held)
    forced = plan_host(devices, resolve(configs, "all-disabled", devices.gpus()), held=held, force=True)
    check_host_via_agent(agent_stub, devices, forced)
    apply_host_via_agent(agent_stub, devices, forced)
    assert [g.mig_instances for g in devices.gpus()] == [(), (), (), ()]
    assert not devices.gpu(1).mig_current


def test_an_agent_that_stopped_answering_is_named_with_its_status(agent, devices):
    agent_stub, server = agent
    server.stop(None)
    plans = plan_host(devices, {0: DeviceSpec((0,), True, (("1g.5gb", 1),), where="w[0]")})
    for call in (check_host_via_agent, apply_host_via_agent):
        with pytest.raises(ConfigError, match=r"^GPU 0: the node agent answered UNAVAILABLE: "):
            call(agent_stub, devices, plans)
    assert devices.gpu(0).mig_instances == ()



def test_a_plan_made_while_mig_waited_for_its_reset_is_carried_out_after_it(devices, machine: Path):
    """Planned while the enable was pending (no steps known yet), applied after the GPU reset: the
    instances are laid out then, on NVML's own profiles."""
    devices.set_mig_mode(2, True)
    plans = plan_host(devices, {2: DeviceSpec((2,), True, (("3g.20gb", 2),), where="w[0]")})
    assert plans[0].plan is None and plans[0].reset_required
    simnvml.reset_gpu(machine, 2)
    (result,) = apply_host(devices, plans)
    assert [s["action"] for s in result["steps"]] == ["create", "create"] and not result["reset_required"]
    assert [m.profile_name for m in devices.mig_instances(2)] == ["3g.20gb", "3g.20gb"]


def test_an_agent_that_does_not_know_the_gpu_says_so_as_a_refusal(agent, tmp_path: Path):
    """The devices read (another machine file: other UUIDs) and the agent's GPUs differ: its
    NOT_FOUND is passed on as its own words, naming the GPU, not as a failure of the agent."""
    other = tmp_path / "other.json"
    simnvml.create_machine(other, ["A100-SXM4-40GB"], mig_enabled=True)
    agent_stub, _ = agent
    with open_devices("sim", other) as elsewhere:
        plans = plan_host(elsewhere, {0: DeviceSpec((0,), True, (("1g.5gb", 1),), where="w[0]")})
        with pytest.raises(ConfigError, match=rf"^GPU 0: .*{elsewhere.gpu(0).uuid}") as caught:
            check_host_via_agent(agent_stub, elsewhere, plans)
    assert "answered" not in str(caught.value)


class _PlacesBetweenCalls:
    """The agent's stub as the command sees it, while the controller places an exclusive share on
    GPU ``gpu`` (the agent makes its MIG instance on demand) right after the command's first
    change returns: wherever the agent's lock of the GPU is free between two calls."""

    def __init__(self, agent_stub, gpu: str) -> None:
        self._stub, self._gpu, self.placed = agent_stub, gpu, None

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)
        if name not in ("ApplyMigLayout", "SetMigMode"):
            return method

        def call(request, **kwargs):
            reply = method(request, **kwargs)
            if self.placed is None:
                try:
                    self._stub.PrepareShare(share("ex", "exclusive", [self._gpu], mig_profile="1g.10gb"),
                                            timeout=60)
                    self.placed = True
                except grpc.RpcError as exc:   # MIG already off: nothing to place it on
                    self.placed = exc.details()
            return reply
        return call


def test_a_disable_through_the_agent_is_one_step_a_share_placed_meanwhile_cannot_split(agent, devices):
    """`mig-enabled: false` on a GPU with instances: destroyed and MIG off in one call under the agent's
    lock of the GPU. A share the controller places between two calls would find the instances gone
    and MIG still on, and make the mode change fail halfway; here it comes after: MIG is off."""
    agent_stub, _ = agent
    configs = parse_config(CONFIG)
    balanced = plan_host(devices, resolve(configs, "balanced", devices.gpus()))
    apply_host_via_agent(agent_stub, devices, balanced)
    h100 = devices.gpu(1)
    assert len(h100.mig_instances) == 7
    placing = _PlacesBetweenCalls(agent_stub, h100.uuid)
    off = plan_host(devices, {1: DeviceSpec((1,), False, where="w")})
    (result,) = apply_host_via_agent(placing, devices, off)
    assert "MIG is disabled" in placing.placed
    assert [s["action"] for s in result["steps"]] == ["destroy"] * 7 and not result["reset_required"]
    assert (devices.gpu(1).mig_current, devices.gpu(1).mig_instances) == (False, ())


def test_an_agent_older_than_destroy_instances_gets_the_two_calls(older_agent, devices):
    """Such an agent refuses the one-call disable while instances exist (NVML refuses, or its shares
    hold them): the command makes the two calls it made before, and what refuses those refuses before
    any change, as before."""
    agent_stub, _ = older_agent
    h100 = _balanced_with_a_held_slice(agent_stub, devices)
    off = {1: DeviceSpec((1,), False, where="w")}
    with pytest.raises(ConfigError, match=r"^GPU 1: .*held by fastshare share ex"):
        apply_host_via_agent(agent_stub, devices, plan_host(devices, off))     # the share not told
    assert devices.gpu(1) == h100
    agent_stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="ex"), timeout=60)
    (result,) = apply_host_via_agent(agent_stub, devices, plan_host(devices, off))
    assert [s["action"] for s in result["steps"]] == ["destroy"] * 7
    assert (devices.gpu(1).mig_current, devices.gpu(1).mig_instances) == (False, ())


def test_mig_config_through_the_agent_needs_no_gpu_backend(agent_socket, machine: Path, tmp_path: Path):
    """While the node agent answers, `mig config` reads the GPUs from its inventory (the PCI device
    ids a device-filter selects by included): it opened NVML itself, and without --gpu-backend it
    failed ("choose a backend") although the agent makes every change."""
    config = tmp_path / "mig.yaml"
    config.write_text(CONFIG)
    args = ["mig", "config", "--file", str(config), "--select", "balanced", "--unix-socket", agent_socket,
            "--agent-journal", str(tmp_path / "none" / "journal.db"), "--json"]
    env = {"FASTSHARE_GPU_BACKEND": "", "FASTSHARE_SIM_STATE": ""}
    plan = CliRunner().invoke(main, args, env=env)
    assert plan.exit_code == 0, plan.output
    assert [(g["gpu"], g["layout"]) for g in json.loads(plan.output)["gpus"]] == [
        (0, "3g.20gb=1,2g.10gb=1,1g.5gb=2"), (1, "1g.10gb=7"), (2, "3g.20gb=1,2g.10gb=1,1g.5gb=2")]
    applied = CliRunner().invoke(main, [*args, "--apply"], env=env)
    assert applied.exit_code == 0, applied.output
    with open_devices("sim", machine) as devices:
        assert [len(g.mig_instances) for g in devices.gpus()] == [4, 7, 0, 0]   # GPU 2: waits for a reset


def test_an_agents_refusal_that_names_the_gpu_says_it_once(agent, devices):
    """The agent's words already name the GPU with its model here ("the layout fits an empty GPU 1
    (NVIDIA H100 ...)"); they were led by "GPU 1: " all the same."""
    agent_stub, _ = agent
    assert _balanced_with_a_held_slice(agent_stub, devices).mig_instances[0].start == 0
    layout = (("4g.40gb", 1), ("2g.20gb", 1), ("1g.10gb", 1))    # a 4g.40gb starts only at 0
    plans = plan_host(devices, {1: DeviceSpec((1,), True, layout, where="w")})     # held not given
    for call in (check_host_via_agent, apply_host_via_agent):
        with pytest.raises(ConfigError) as caught:
            call(agent_stub, devices, plans)
        assert str(caught.value).startswith("the layout fits an empty GPU 1 (NVIDIA H100"), caught.value
        assert "held by fastshare share ex" in str(caught.value)


class _RefusesEveryDisable:
    """A node agent that knows destroy_instances (its inventory says the PCI device id, as this one
    does) and refuses a disable for what ApplyMigLayout does not check (as it refuses while a share
    uses the GPU whole under a MIG enable made by hand): with or without destroy_instances."""

    def __init__(self, agent_stub) -> None:
        self._stub, self.asked = agent_stub, []

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    def SetMigMode(self, request, **kwargs):
        self.asked.append(request.destroy_instances)
        if request.enabled:
            return self._stub.SetMigMode(request, **kwargs)

        class Refused(grpc.RpcError):
            def code(self):
                return grpc.StatusCode.FAILED_PRECONDITION

            def details(self):
                return "GPU has shares (whole); release them before changing its MIG mode"
        raise Refused()


def test_an_agent_that_knows_destroy_instances_refusing_the_disable_leaves_the_instances(agent, devices):
    """Its refusal came before any change: the command does not go on with the two calls an older
    agent gets (they destroyed the instances, then the mode change was refused: part of it done)."""
    agent_stub, _ = agent
    balanced = plan_host(devices, resolve(parse_config(CONFIG), "balanced", devices.gpus()))
    apply_host_via_agent(agent_stub, devices, balanced)
    before = devices.gpu(1)
    assert len(before.mig_instances) == 7
    refusing = _RefusesEveryDisable(agent_stub)
    with pytest.raises(ConfigError, match=r"^GPU 1: GPU has shares"):
        apply_host_via_agent(refusing, devices, plan_host(devices, {1: DeviceSpec((1,), False, where="w")}))
    assert refusing.asked == [True]
    assert devices.gpu(1) == before


# --- a lost GPU (fallen off the bus): listed with `lost` set, by the backend or the agent's inventory --
LOST_CONFIG = CONFIG + """
  named:
    - devices: [0, 1]
      mig-enabled: false
  named-on:
    - devices: [2]
      mig-enabled: true
      mig-devices: {"3g.20gb": 2}
    - devices: [1]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  halves:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.5gb": 7}
    - devices: [1]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [2]
      mig-enabled: true
"""


def _mig_config(via: str, request, machine: Path, tmp_path: Path, name: str, *more: str,
                sock: str | None = None):
    """`fastshare mig config --select NAME` directly (sim backend) or through a node agent (the
    agent_socket fixture's, or ``sock``)."""
    config = tmp_path / "mig.yaml"
    config.write_text(LOST_CONFIG)
    if via == "agent" and sock is None:
        sock = request.getfixturevalue("agent_socket")
    sock = sock or ""
    env = ({"FASTSHARE_GPU_BACKEND": "", "FASTSHARE_SIM_STATE": ""} if via == "agent" else
           {"FASTSHARE_GPU_BACKEND": "sim", "FASTSHARE_SIM_STATE": str(machine)})
    args = ["mig", "config", "--file", str(config), "--select", name, "--unix-socket", sock,
            "--agent-journal", str(tmp_path / "none" / "journal.db"), *more]
    return CliRunner().invoke(main, args, env=env)


@pytest.mark.parametrize("via", ["direct", "agent"])
@pytest.mark.parametrize("name", ["named", "named-on"])
@pytest.mark.parametrize("apply", [[], ["--apply"]])
def test_a_lost_gpu_a_config_names_is_refused_before_any_change(via, name, apply, request, machine: Path,
                                                                 tmp_path: Path):
    """GPU 1 fell off the bus (the agent read it before). Directly it was listed blank: an enable was
    refused as "GPU 1 () does not support MIG", a disable planned as nothing to do and applied until
    NVML failed on it, GPU 0 already changed; through the agent it was planned as last read and the
    agent answered INTERNAL, or the disable changed GPU 0 first. Now: refused before any change on any
    GPU, naming the entry, the GPU, that it is lost and what to do; the same on both paths."""
    if via == "agent":
        request.getfixturevalue("agent_socket")     # reads the GPUs while GPU 1 still works
    simnvml.lose_gpu(machine, 1)
    before = machine.read_bytes()
    result = _mig_config(via, request, machine, tmp_path, name, *apply)
    assert result.exit_code == 1, result.output
    assert machine.read_bytes() == before
    entry = "named[0]" if name == "named" else "named-on[1]"
    message = result.output.replace("\n", " ")
    lost = rf"mig-configs\.{re.escape(entry)}: GPU 1 .*is lost \(fell off the bus"
    assert re.search(lost, message), message
    assert "NVML_ERROR_GPU_IS_LOST" in message and "nvidia-smi -r -i 1" in message and "reboot" in message
    assert "no GPU was changed" in message and "answered" not in message, message


@pytest.mark.parametrize("via", ["direct", "agent"])
@pytest.mark.parametrize("name", ["balanced", "all-disabled"])
def test_a_lost_gpu_under_devices_all_is_left_out_with_a_warning(via, name, request, machine: Path,
                                                                  tmp_path: Path):
    """`devices: all` means the GPUs there are: a lost one is left out (nothing can change on it until
    a reset, and the agent gives it no shares), with a warning saying so and what to do, and the others
    are configured. Directly it was left out of `balanced` without a word (blank, no filter matched)
    and planned as "MIG off, nothing to do" under `all-disabled`, whose --apply then failed on it after
    GPU 0 changed; through the agent `balanced` failed (INTERNAL) and `all-disabled` failed halfway."""
    if via == "agent":
        request.getfixturevalue("agent_socket")
    simnvml.lose_gpu(machine, 1)
    plan = _mig_config(via, request, machine, tmp_path, name, "--json")
    assert plan.exit_code == 0, plan.output
    warning = plan.stderr.replace("\n", " ")
    assert re.search(r"Warning: GPU 1 .*is lost \(fell off the bus.*NVML_ERROR_GPU_IS_LOST.* left out",
                     warning), warning
    assert "devices: all" in warning and "nvidia-smi -r -i 1" in warning and "run again" in warning, warning
    planned = json.loads(plan.stdout)
    assert 1 not in [g["gpu"] for g in planned["gpus"]]
    (skipped,) = planned["skipped"]
    assert (skipped["gpu"], skipped["lost"]) == (1, "GPU_IS_LOST") and "left out" in skipped["reason"]
    applied = _mig_config(via, request, machine, tmp_path, name, "--apply", "--json")
    assert applied.exit_code == 0, applied.output
    assert "Warning: GPU 1" in applied.stderr
    assert [g["gpu"] for g in json.loads(applied.stdout)["gpus"]] == [g["gpu"] for g in planned["gpus"]]
    with open_devices("sim", machine) as devices:
        gpus = devices.gpus()
    if name == "balanced":
        assert len(gpus[0].mig_instances) == 4 and gpus[2].mig_pending
    else:
        assert not gpus[0].mig_pending
    simnvml.reboot(machine)   # back after a reboot, as it was
    with open_devices("sim", machine) as devices:
        assert devices.gpu(1).mig_current


def test_plan_host_refuses_a_lost_gpu_it_is_given(devices, machine: Path):
    """What the Ansible mig_config module (its `layout` option names GPUs) and other callers give
    plan_host directly: a lost GPU is refused, naming it, whatever the entry asks."""
    simnvml.lose_gpu(machine, 1)
    for spec in (DeviceSpec((1,), False, where="w[0]"),
                 DeviceSpec((1,), True, (("1g.10gb", 7),), where="w[0]")):
        with pytest.raises(ConfigError, match=r"^w\[0\]: GPU 1 \(UUID unknown\) is lost \(fell off the bus"):
            plan_host(devices, {0: DeviceSpec((0,), False, where="w[1]"), 1: spec})


# --- a GPU lost between the plan and the apply, or during it -------------------------------------
def _losing_gpu_1_after_gpu_0(machine: Path) -> type[NodeAgentService]:
    """A node agent whose GPU 1 falls off the bus right after it changed GPU 0's instances."""
    gpu0 = simnvml.load_machine(machine)["gpus"][0]["uuid"]

    class _Loses(NodeAgentService):
        def ApplyMigLayout(self, request, context):
            reply = super().ApplyMigLayout(request, context)
            if request.gpu_uuid == gpu0:
                simnvml.lose_gpu(machine, 1)
            return reply

    return _Loses


@pytest.mark.parametrize("via", ["direct", "agent"])
def test_a_gpu_lost_after_the_plan_is_refused_before_any_change(via, request, machine: Path, tmp_path: Path,
                                                                monkeypatch):
    """GPU 1 falls off the bus after `halves` was planned (and, through the agent, checked by its
    PlanMigLayout). GPU 0 was changed, then the apply failed on GPU 1 ("reading GPU 1 failed"),
    without a word about GPU 0. Now every GPU of the plan is read again right before the first change:
    refused, naming GPU 1 and saying no GPU was changed; after its reset the same command does it all."""
    if via == "agent":
        request.getfixturevalue("agent_socket")
    planned = "check_host_via_agent" if via == "agent" else "plan_host"
    real = getattr(mig_parted, planned)

    def then_lost(*args, **kwargs):
        result = real(*args, **kwargs)
        simnvml.lose_gpu(machine, 1)
        return result

    monkeypatch.setattr(mig_parted, planned, then_lost)
    refused = _mig_config(via, request, machine, tmp_path, "halves", "--apply")
    assert refused.exit_code == 1, refused.output
    message = refused.output.replace("\n", " ")
    assert re.search(r"GPU 1 \(GPU-[0-9a-f-]+\) is lost .*NVML_ERROR_GPU_IS_LOST", message), message
    assert "no GPU was changed" in message and "nvidia-smi -r -i 1" in message, message
    gpus = simnvml.load_machine(machine)["gpus"]
    assert [len(g["gpu_instances"]) for g in gpus] == [0, 0, 0, 0] and not gpus[2]["mig_pending"]
    monkeypatch.undo()
    simnvml.reset_gpu(machine, 1)
    again = _mig_config(via, request, machine, tmp_path, "halves", "--apply", "--json")
    assert again.exit_code == 0, again.output
    gpus = simnvml.load_machine(machine)["gpus"]
    assert [len(g["gpu_instances"]) for g in gpus] == [7, 7, 0, 0] and gpus[2]["mig_pending"]


@pytest.mark.parametrize("via", ["direct", "agent"])
def test_a_gpu_lost_midway_says_what_was_changed_and_the_same_command_finishes(via, request, machine: Path,
                                                                                tmp_path: Path, monkeypatch):
    """GPU 1 falls off the bus after GPU 0 got its instances: the error named GPU 1 only (directly
    "reading GPU 1 failed"), not that GPU 0 had changed nor what to do. Now it lists what was
    changed (GPU 0) and what was not reached (GPU 2), and says that the same command, run again once
    GPU 1 is back, finishes the job; it does, leaving GPU 0 as it is."""
    sock = None
    if via == "agent":
        served = _served(tmp_path, machine, _losing_gpu_1_after_gpu_0(machine), with_socket=True)
        _, _, sock = next(served)
        request.addfinalizer(lambda: next(served, None))
    else:
        real = mig_parted.apply_plan

        def then_lost(devices, gpu_index, plan):
            done = real(devices, gpu_index, plan)
            if gpu_index == 0:
                simnvml.lose_gpu(machine, 1)
            return done

        monkeypatch.setattr(mig_parted, "apply_plan", then_lost)
    failed = _mig_config(via, request, machine, tmp_path, "halves", "--apply", sock=sock)
    assert failed.exit_code == 1, failed.output
    message = failed.output.replace("\n", " ")
    assert re.search(r"GPU 1\b.*NVML_ERROR_GPU_IS_LOST", message), message
    assert "Changed before it: GPU 0 (7 MIG devices created); not reached: GPU 2." in message, message
    assert "once GPU 1 is put right, run the same command again" in message, message
    gpus = simnvml.load_machine(machine)["gpus"]
    assert [len(g["gpu_instances"]) for g in gpus] == [7, 0, 0, 0] and not gpus[2]["mig_pending"]
    gpu0 = gpus[0]["gpu_instances"]
    monkeypatch.undo()
    simnvml.reset_gpu(machine, 1)
    again = _mig_config(via, request, machine, tmp_path, "halves", "--apply", "--json", sock=sock)
    assert again.exit_code == 0, again.output
    assert [g["changed"] for g in json.loads(again.stdout)["gpus"]] == [False, True, True]
    gpus = simnvml.load_machine(machine)["gpus"]
    assert [len(g["gpu_instances"]) for g in gpus] == [7, 7, 0, 0] and gpus[2]["mig_pending"]
    assert gpus[0]["gpu_instances"] == gpu0
