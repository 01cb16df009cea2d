"""fastshare.gpu.gpu_info and fastshare.gpu.mig_config, run the way Ansible runs them.

Each test runs the installed collection ad hoc against localhost (`ansible localhost -m ...`)
with the virtualenv's interpreter, on a simulated machine file made by fastshare's simulated
NVML. The state file is the ground truth: tests read it back to check what really changed.
"""

from __future__ import annotations

import ast
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fs_collection import COLLECTION, REPO, run_module, run_tasks

from fastshare.device import open_devices, simnvml

MIG_CONFIG = f"{COLLECTION}.mig_config"
GPU_INFO = f"{COLLECTION}.gpu_info"


@pytest.fixture
def machine(tmp_path: Path) -> Path:
    """GPU 0: A100 (mode changes pending until reset), GPU 1: H100 (immediate), GPU 2: T4 (no MIG)."""
    path = tmp_path / "gpus.json"
    simnvml.create_machine(path, ["A100-SXM4-40GB", "H100-SXM5-80GB", "T4"], mig_enabled=True)
    return path


@pytest.fixture
def mig(collections_path: Path, machine: Path):
    """Run mig_config on the machine; returns the module result."""

    def call(layout: list[dict] | None, *, check: bool = False, diff: bool = False, **extra) -> dict:
        args = {"gpu_backend": "sim", "sim_state": str(machine), **extra}
        if layout is not None:
            args["layout"] = layout
        return run_module(collections_path, MIG_CONFIG, args, check=check, diff=diff)

    return call


def layout_on_disk(machine: Path, gpu: int) -> list[tuple[int, int]]:
    """(profile id, start) of the GPU instances recorded in the simulated machine."""
    state = simnvml.load_machine(machine)
    return sorted((gi["profile_id"], gi["start"]) for gi in state["gpus"][gpu]["gpu_instances"])


MIXED_A100 = {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}   # 4 + 2 + 1 + 1 memory slices


# --- gpu_info ---------------------------------------------------------------------------------
def test_gpu_info_reports_the_simulated_machine(collections_path: Path, machine: Path, mig):
    mig([{"devices": [1], "mig_devices": {"3g.40gb": 2}}])
    info = run_module(collections_path, GPU_INFO, {"gpu_backend": "sim", "sim_state": str(machine)})
    assert info["changed"] is False and info["nvml_reachable"] is True
    assert info["driver_version"]
    a100, h100, t4 = info["gpus"]
    assert (a100["name"], a100["sm_count"], a100["mig_capable"]) == ("NVIDIA A100-SXM4-40GB", 108, True)
    assert a100["mig_mode"] == {"current": True, "pending": True}
    assert t4["mig_capable"] is False and t4["mig_devices"] == []
    assert [(d["profile"], d["start"], d["size"]) for d in h100["mig_devices"]] == [
        ("3g.40gb", 0, 4), ("3g.40gb", 4, 4)]
    assert all(d["uuid"].startswith("MIG-") and d["processes"] == 0 for d in h100["mig_devices"])


def _attributes(module: str) -> dict:
    """The DOCUMENTATION attributes of a module of the collection (plugins/modules/NAME.py)."""
    tree = ast.parse((REPO / "plugins" / "modules" / f"{module.rsplit('.', 1)[1]}.py").read_text())
    doc = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and getattr(node.targets[0], "id", None) == "DOCUMENTATION")
    return {name: value["support"] for name, value in yaml.safe_load(doc)["attributes"].items()}


def test_read_only_modules_say_so_and_answer_alike_in_check_and_diff_mode(collections_path: Path,
                                                                        machine: Path):
    """gpu_info and k8s_manifests only read (or render): their documentation says check mode is
    fully supported and there is never a diff, and under --check --diff they answer what they
    answer without it, unchanged, with no diff, and the machine file is left as it was."""
    before = machine.read_bytes()
    for module, args in ((GPU_INFO, {"gpu_backend": "sim", "sim_state": str(machine)}),
                         (f"{COLLECTION}.k8s_manifests", {"values": {"namespace": "gpu-sharing"}})):
        assert _attributes(module) == {"check_mode": "full", "diff_mode": "none", "platform": "full"}, module
        plain = run_module(collections_path, module, args)
        checked = run_module(collections_path, module, args, check=True, diff=True)
        assert checked["changed"] is False and "diff" not in checked and not checked.get("failed"), checked
        assert checked == plain, module
    assert _attributes(MIG_CONFIG) == {"check_mode": "full", "diff_mode": "full", "platform": "full"}
    assert machine.read_bytes() == before


def test_gpu_info_without_a_driver_says_nvml_is_unreachable(collections_path: Path):
    """No NVIDIA driver on this machine: the info module succeeds and says so."""
    info = run_module(collections_path, GPU_INFO, {})
    assert "nvml_reachable" in info, {k: v for k, v in info.items() if k != "invocation"}
    if info["nvml_reachable"]:
        pytest.skip("this host has a working NVIDIA driver")
    assert info["gpus"] == [] and info["nvml_error"] and not info.get("failed")


def test_gpu_info_refuses_a_sim_state_that_is_no_machine_file(collections_path: Path, tmp_path: Path):
    """A wrong sim_state is the task's mistake, not an unreachable NVML: the module fails naming
    sim_state and saying why, as mig_config does, instead of reporting an empty host."""
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    for path, why in ((tmp_path / "missing.json", "does not exist"), (tmp_path, "is not a file"),
                      (garbage, "is not a simulated machine file")):
        info = run_module(collections_path, GPU_INFO, {"gpu_backend": "sim", "sim_state": str(path)})
        assert info.get("failed") and f"sim_state={path}" in info["msg"] and why in info["msg"], info


def test_modules_fail_cleanly_without_the_fastshare_package(collections_path: Path, machine: Path,
                                                           tmp_path: Path):
    bare = tmp_path / "bare"
    subprocess.run(["python3.11", "-m", "venv", "--without-pip", str(bare)], check=True)
    for module in (GPU_INFO, MIG_CONFIG):
        result = run_module(collections_path, module, {"gpu_backend": "sim", "sim_state": str(machine),
                                                       "layout": []}
                            if module == MIG_CONFIG else {}, python=str(bare / "bin" / "python"),
                            env={"PYTHONPATH": ""})
        assert result["failed"]
        assert "Failed to import the required Python library (fastshare)" in result["msg"]


# --- argument errors --------------------------------------------------------------------------
BAD_ARGS = [
    # no node agent answers on the default unix_socket here: the GPUs are read through the backend
    ({"sim_state": "DROP", "layout": []},
     "gpu_backend is sim but sim_state is missing (needed while no node agent answers on unix_socket"),
    ({"gpu_backend": "cuda", "layout": []}, "gpu_backend"),
    ({"layout": [{"devices": "some"}]}, "layout[0].devices must be 'all' or a non-empty list"),
    ({"layout": [{"devices": [7]}]}, "GPU 7 does not exist (valid: 0..2)"),
    ({"layout": [{"devices": [0]}, {"devices": [0, 1]}]}, "GPU 0 is already configured"),
    ({"layout": [{"devices": [0, 1, 0]}]}, "layout[0].devices: GPU 0 is listed twice"),
    ({"layout": [{"devices": [0], "mig_devices": {"3g.20gb": -1}}]}, "must be an integer >= 0"),
    # str.isdigit() is true for digits int() cannot read: a clear refusal, not a traceback.
    ({"layout": [{"devices": ["\u00b2"]}]}, "layout[0].devices must be 'all' or a non-empty list"),
    ({"layout": [{"devices": [0], "mig_devices": {"1g.5gb": "\u00b2"}}]}, "must be an integer >= 0"),
    ({"layout": [{"devices": [0], "mig_devices": {"5g.25gb": 1}}]}, "unknown MIG profile '5g.25gb'"),
    ({"layout": [{"devices": [0], "mig_devices": {"7g.40gb": 1, "1g.5gb": 1}}]}, "impossible layout"),
    ({"layout": [{"devices": [0], "mig_devices": {"1g.5gb": 8}}]}, "at most 7 can exist"),
    ({"layout": [{"devices": [2], "mig_devices": {"1g.5gb": 1}}]}, "GPU 2 (Tesla T4) does not support MIG"),
    ({"layout": [{"devices": [0], "mig_enabled": False, "mig_devices": {"1g.5gb": 1}}]},
     "mig_devices requires mig_enabled=true"),
    ({"layout": [], "colour": "blue"}, "Unsupported parameters"),
    ({"config_file": "", "config_name": "balanced"}, "config_file must be the path of a mig-parted file"),
]


def test_argument_errors_name_the_field_and_change_nothing(collections_path, machine, tmp_path):
    before = machine.read_bytes()
    tasks = []
    for args, _ in BAD_ARGS:
        merged = {"gpu_backend": "sim", "sim_state": str(machine)} | args
        tasks.append({MIG_CONFIG: {k: v for k, v in merged.items() if v != "DROP"}})
    results = run_tasks(collections_path, tasks, tmp_path)
    for (args, message), result in zip(BAD_ARGS, results, strict=True):
        assert result.get("failed") and message in result["msg"], (args, result.get("msg"))
    assert machine.read_bytes() == before


# --- check mode, apply, idempotency, diff -----------------------------------------------------
def test_check_mode_reports_the_plan_and_changes_nothing(mig, machine):
    before = machine.read_bytes()
    result = mig([{"devices": [0], "mig_devices": MIXED_A100}], check=True)
    assert result["changed"] is True
    assert [(s["action"], s["profile"], s["start"]) for s in result["steps"]] == [
        ("create", "3g.20gb", 4), ("create", "2g.10gb", 0), ("create", "1g.5gb", 2), ("create", "1g.5gb", 3)]
    assert machine.read_bytes() == before


def test_apply_creates_explicit_placements_then_second_run_changes_nothing(mig, machine):
    layout = [{"devices": [0], "mig_devices": MIXED_A100}, {"devices": [1], "mig_devices": {"7g.80gb": 1}}]
    first = mig(layout)
    assert first["changed"] is True and len(first["steps"]) == 5
    # The order 19,19,14,9 fails on NVML's default placer; explicit placements make it fit.
    assert layout_on_disk(machine, 0) == [(9, 4), (14, 0), (19, 2), (19, 3)]
    assert layout_on_disk(machine, 1) == [(0, 0)]
    assert all(d["uuid"].startswith("MIG-") for g in first["gpus"] for d in g["mig_devices"])
    second = mig(layout)
    assert second["changed"] is False and second["steps"] == []
    assert not any(g["changed"] for g in second["gpus"])
    assert [d["uuid"] for d in second["gpus"][0]["mig_devices"]] == \
           [d["uuid"] for d in first["gpus"][0]["mig_devices"]]


def test_changes_only_what_must_change(mig, machine):
    mig([{"devices": [0], "mig_devices": {"3g.20gb": 2}}])
    kept_uuid = {d["start"]: d["uuid"] for d in mig([{"devices": [0], "mig_devices": {"3g.20gb": 2}}])
                 ["gpus"][0]["mig_devices"]}
    result = mig([{"devices": [0], "mig_devices": {"3g.20gb": 1, "2g.10gb": 2}}])
    assert result["changed"] is True
    steps = [(s["action"], s["start"]) for s in result["steps"]]
    assert steps == [("destroy", 0), ("create", 0), ("create", 2)]
    after = {d["start"]: d["uuid"] for d in result["gpus"][0]["mig_devices"]}
    assert after[4] == kept_uuid[4], "the 3g.20gb at start 4 must be kept, not re-created"


def test_diff_mode_shows_before_and_after(mig):
    mig([{"devices": [0], "mig_devices": {"3g.20gb": 2}}])
    result = mig([{"devices": [0], "mig_devices": {"7g.40gb": 1}}], check=True, diff=True)
    diff = result["diff"]
    assert "3g.20gb at start 0" in diff["before"] and "3g.20gb at start 4" in diff["before"]
    assert "7g.40gb at start 0 (memory slices 0..7)" in diff["after"] and "3g.20gb" not in diff["after"]


# --- in use, force ----------------------------------------------------------------------------
def test_refuses_to_destroy_an_instance_with_processes_even_with_force(mig, machine):
    created = mig([{"devices": [0], "mig_devices": {"3g.20gb": 2}}])
    busy = next(d for d in created["gpus"][0]["mig_devices"] if d["start"] == 0)
    simnvml.add_process(machine, 0, mig_uuid=busy["uuid"])
    before = machine.read_bytes()
    for force in (False, True):
        result = mig([{"devices": [0], "mig_devices": {"7g.40gb": 1}}], force=force)
        assert result["failed"] and busy["uuid"] in result["msg"], result["msg"]
        assert machine.read_bytes() == before, "a refused change must leave the machine as it was"
    # A layout that keeps the busy instance is fine: the planner works around it.
    ok = mig([{"devices": [0], "mig_devices": {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 1}}])
    assert ok["changed"] is True and layout_on_disk(machine, 0) == [(9, 0), (14, 4), (19, 6)]


def test_mode_change_under_running_processes_is_refused_before_any_gpu_changes(mig, machine):
    """NVML refuses a MIG mode change while processes run on the GPU: the plan must say so,
    in check mode too, instead of GPU 0 being changed before GPU 1 fails with IN_USE."""
    mig([{"devices": [1], "mig_enabled": False}])              # H100: MIG off at once
    simnvml.add_process(machine, 1)
    before = machine.read_bytes()
    layout = [{"devices": [0], "mig_devices": {"3g.20gb": 2}},
              {"devices": [1], "mig_devices": {"7g.80gb": 1}}]
    for check in (True, False):
        result = mig(layout, check=check)
        assert result.get("failed") and "GPU 1" in result["msg"] and "process" in result["msg"], result
        assert result["changed"] is False
        assert machine.read_bytes() == before, "GPU 0 was changed although GPU 1's plan cannot run"


def test_share_held_instance_needs_force(mig, machine, tmp_path):
    """A MIG device a fastshare share holds (node agent journal) counts as in use."""
    created = mig([{"devices": [1], "mig_devices": {"3g.40gb": 2}}])
    held = created["gpus"][0]["mig_devices"][0]["uuid"]
    journal = tmp_path / "journal.db"
    _journal_with_share(journal, held)
    refused = mig([{"devices": [1], "mig_devices": {"7g.80gb": 1}}], agent_journal=str(journal))
    assert refused["failed"] and held in refused["msg"] and "force" in refused["msg"]
    # No process runs on it: the message names the share, not processes to stop.
    assert "share holds it" in refused["msg"] and "processes" not in refused["msg"], refused["msg"]
    forced = mig([{"devices": [1], "mig_devices": {"7g.80gb": 1}}], agent_journal=str(journal), force=True)
    assert forced["changed"] is True and layout_on_disk(machine, 1) == [(0, 0)]


def test_share_held_instance_is_kept_when_the_mig_mode_changes_too(mig, machine, tmp_path):
    """The A100's MIG mode is on with a disable pending (until a reset) and instances were made
    meanwhile; asking for MIG on again changes the mode and the layout in one run. The layout
    steps must be the planned ones (the held instance kept, as check mode says), not a re-plan
    that ignores the shares and destroys the held instance without force."""
    assert mig([{"devices": [0], "mig_enabled": False}])["reset_required"] is True
    with open_devices("sim", machine) as devices:
        devices.create_mig_instance(0, 9, 0)                  # 3g.20gb at 0 and at 4
        devices.create_mig_instance(0, 9, 4)
        held = next(m.uuid for m in devices.mig_instances(0) if m.start == 0)
    journal = tmp_path / "journal.db"
    _journal_with_share(journal, held)
    layout = [{"devices": [0], "mig_devices": {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 1}}]
    check = mig(layout, check=True, agent_journal=str(journal))
    applied = mig(layout, agent_journal=str(journal))
    assert applied["changed"] is True and applied["steps"] == check["steps"], (check, applied)
    assert all(s["start"] != 0 for s in applied["steps"] if s["action"] == "destroy")
    assert layout_on_disk(machine, 0) == [(9, 0), (14, 4), (19, 6)]
    assert held in {d["uuid"] for d in applied["gpus"][0]["mig_devices"]}
    # No place for the held instance: refused before the mode is touched; force overrides.
    before = machine.read_bytes()
    whole = [{"devices": [0], "mig_devices": {"7g.40gb": 1}}]
    for check in (True, False):
        refused = mig(whole, check=check, agent_journal=str(journal))
        assert refused["failed"] and held in refused["msg"] and refused["changed"] is False, refused
        assert machine.read_bytes() == before
    forced = mig(whole, agent_journal=str(journal), force=True)
    assert forced["changed"] is True and layout_on_disk(machine, 0) == [(0, 0)]


def test_mig_mode_change_of_a_gpu_a_share_holds_whole_needs_force(tmp_path, collections_path):
    """A share holding the whole GPU (its GPU UUID in the agent journal) is lost when MIG comes
    on under it: the node agent refuses that mode change, and so must the module (check mode
    too), unless forced."""
    machine = tmp_path / "h100.json"
    simnvml.create_machine(machine, ["H100-SXM5-80GB"], mig_enabled=False)
    with open_devices("sim", machine) as devices:
        gpu_uuid = devices.gpus()[0].uuid
    journal = tmp_path / "journal.db"
    _journal_with_share(journal, gpu_uuid)
    args = {"gpu_backend": "sim", "sim_state": str(machine), "agent_journal": str(journal),
            "layout": [{"devices": [0], "mig_devices": {"7g.80gb": 1}}]}
    before = machine.read_bytes()
    for check in (True, False):
        refused = run_module(collections_path, MIG_CONFIG, args, check=check)
        assert refused.get("failed") and gpu_uuid in refused["msg"] and "force" in refused["msg"], refused
        assert refused["changed"] is False and machine.read_bytes() == before
    forced = run_module(collections_path, MIG_CONFIG, args | {"force": True})
    assert forced["changed"] is True and layout_on_disk(machine, 0) == [(0, 0)]
    with sqlite3.connect(journal) as db:   # the agent's start drops the share saying why (it kept it)
        ((noted, cause),) = db.execute("select device_uuid, cause from taken_devices").fetchall()
    assert noted == gpu_uuid and "forced MIG mode change made without the node agent" in cause, cause
    # Cancelling a pending enable (Ampere) leaves the share its GPU: no force needed for that.
    a100 = tmp_path / "a100.json"
    simnvml.create_machine(a100, ["A100-SXM4-40GB"], mig_enabled=False)
    with open_devices("sim", a100) as devices:
        devices.set_mig_mode(0, True)
    journal.unlink()
    _journal_with_share(journal, simnvml.load_machine(a100)["gpus"][0]["uuid"])
    off = {"sim_state": str(a100), "layout": [{"devices": [0], "mig_enabled": False}]}
    cancel = run_module(collections_path, MIG_CONFIG, args | off)
    assert cancel["changed"] is True and cancel["gpus"][0]["mig_mode"] == {"current": False, "pending": False}


def _journal_with_share(path: Path, device_uuid: str) -> None:
    """A node agent journal holding one exclusive share on ``device_uuid`` (the agent's API)."""
    from fastshare.node.journal import Journal
    from fastshare.node.model import ShareSpec

    journal = Journal(path)
    try:
        spec = ShareSpec(id="share-1", kind="exclusive", device_uuids=(device_uuid,))
        journal.begin_share(spec, device_uuid, None)
    finally:
        journal.close()
    with sqlite3.connect(path) as db:
        assert db.execute("select count(*) from shares").fetchone() == (1,)


# --- MIG mode ---------------------------------------------------------------------------------
def test_ampere_enable_is_pending_until_reset(tmp_path, collections_path):
    machine = tmp_path / "a100.json"
    simnvml.create_machine(machine, ["A100-SXM4-40GB"], mig_enabled=False)
    args = {"gpu_backend": "sim", "sim_state": str(machine),
            "layout": [{"devices": "all", "mig_devices": {"1g.5gb": 7}}]}
    first = run_module(collections_path, MIG_CONFIG, args)
    assert first["changed"] is True and first["reset_required"] and first["reboot_required"]
    assert first["reset_gpus"] == [0] and first["steps"] == []
    assert first["gpus"][0]["mig_mode"] == {"current": False, "pending": True}
    again = run_module(collections_path, MIG_CONFIG, args)
    assert again["changed"] is False and again["reset_required"] is True
    simnvml.reboot(machine)
    after_reset = run_module(collections_path, MIG_CONFIG, args)
    assert after_reset["changed"] is True and not after_reset["reset_required"]
    assert layout_on_disk(machine, 0) == [(19, s) for s in range(7)]


def test_hopper_enable_and_layout_in_one_run_then_disable(tmp_path, collections_path):
    machine = tmp_path / "h100.json"
    simnvml.create_machine(machine, ["H100-SXM5-80GB"], mig_enabled=False)
    base = {"gpu_backend": "sim", "sim_state": str(machine)}
    layout = [{"devices": [0], "mig_devices": {"4g.40gb": 1, "3g.40gb": 1}}]
    check = run_module(collections_path, MIG_CONFIG, base | {"layout": layout}, check=True)
    assert check["changed"] and not check["reset_required"] and len(check["steps"]) == 2
    result = run_module(collections_path, MIG_CONFIG, base | {"layout": layout})
    assert result["changed"] and not result["reset_required"]
    assert layout_on_disk(machine, 0) == [(5, 0), (9, 4)]
    disable = base | {"layout": [{"devices": [0], "mig_enabled": False}]}
    off = run_module(collections_path, MIG_CONFIG, disable)
    assert off["changed"] and [s["action"] for s in off["steps"]] == ["destroy", "destroy"]
    assert simnvml.load_machine(machine)["gpus"][0]["mig_current"] == 0
    assert run_module(collections_path, MIG_CONFIG, disable)["changed"] is False


def test_an_a30_layout_with_its_2g_12gb_plus_me_and_the_same_elsewhere_refused(tmp_path, collections_path):
    """`2g.12gb+me` (A30, driver R525 and later) is made on an A30; on an A100, which has no
    such profile, the run fails naming the profile, the GPU and what it has, and changes nothing."""
    machine = tmp_path / "a30.json"
    simnvml.create_machine(machine, ["A30-24GB", "A100-SXM4-40GB"], mig_enabled=True)
    base = {"gpu_backend": "sim", "sim_state": str(machine)}
    layout = [{"devices": [0], "mig_devices": {"2g.12gb+me": 1, "1g.6gb": 2}}]
    result = run_module(collections_path, MIG_CONFIG, base | {"layout": layout})
    assert result["changed"] and not result.get("failed"), result
    made = layout_on_disk(machine, 0)
    media = made[0][1]
    assert made == [(6, media), *((14, s) for s in range(4) if s not in (media, media + 1))], made
    assert {d["profile"] for d in result["gpus"][0]["mig_devices"]} == {"2g.12gb+me", "1g.6gb"}
    before = machine.read_bytes()
    refused = run_module(collections_path, MIG_CONFIG,
                         base | {"layout": [{"devices": [1], "mig_devices": {"2g.12gb+me": 1}}]})
    assert refused.get("failed") and ("unknown MIG profile '2g.12gb+me' on GPU 1 (NVIDIA A100-SXM4-40GB); "
                                      "known: 1g.5gb (id 19)") in refused["msg"], refused.get("msg")
    assert machine.read_bytes() == before


# --- mig-parted config files ------------------------------------------------------------------
MIG_PARTED = """\
version: v1
mig-configs:
  balanced:
    - devices: all
      device-filter: ["0x20B010DE"]      # A100-SXM4-40GB only
      mig-enabled: true
      mig-devices: {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}
    - devices: [1]
      mig-enabled: true
      mig-devices: {"7g.80gb": 1}
"""


def test_mig_parted_config_file_with_device_filter(mig, machine, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(MIG_PARTED)
    result = mig(None, config_file=str(config), config_name="balanced")
    assert result["changed"] is True, result.get("msg")
    assert [g["index"] for g in result["gpus"]] == [0, 1], "the filter must leave the T4 alone"
    assert layout_on_disk(machine, 0) == [(9, 4), (14, 0), (19, 2), (19, 3)]
    assert layout_on_disk(machine, 1) == [(0, 0)]
    assert mig(None, config_file=str(config), config_name="balanced")["changed"] is False
    unknown = mig(None, config_file=str(config), config_name="nope")
    assert unknown["failed"] and "config 'nope' not found" in unknown["msg"]
    config.write_text(MIG_PARTED.replace("mig-enabled: true", "mig-enabled: maybe", 1))
    broken = mig(None, config_file=str(config), config_name="balanced")
    assert broken["failed"] and "mig-configs.balanced[0].mig-enabled" in broken["msg"]
    both = mig([], config_file=str(config), config_name="balanced")
    assert both["failed"] and "mutually exclusive" in both["msg"]


def test_a_lost_gpu_is_refused_when_named_and_left_out_of_all_with_a_warning(mig, machine, tmp_path):
    """GPU 1 (H100) fell off the bus: listed blank, as not MIG-capable. A layout naming it was refused
    as "does not support MIG; leave it out of devices", `devices: all` planned it as "nothing to do"
    and a config file's device-filter left it out, without a word. Now, as `fastshare mig config`: a
    GPU named by index is refused before any change, saying it is lost and to reset it or reboot;
    `devices: all` leaves it out with a warning and configures the others."""
    simnvml.lose_gpu(machine, 1)
    before = machine.read_bytes()
    for layout in ([{"devices": [0, 1], "mig_enabled": False}],
                   [{"devices": [1], "mig_devices": {"1g.10gb": 7}}]):
        named = mig(layout)
        assert named["failed"] and named["changed"] is False, named
        assert "GPU 1 (UUID unknown) is lost (fell off the bus?)" in named["msg"], named["msg"]
        assert "nvidia-smi -r -i 1" in named["msg"] and "reboot" in named["msg"], named["msg"]
    assert machine.read_bytes() == before
    config = tmp_path / "config.yaml"
    config.write_text(MIG_PARTED.split("    - devices: [1]")[0])   # devices: all only
    for result in (mig([{"devices": "all", "mig_enabled": False}]),
                   mig(None, config_file=str(config), config_name="balanced")):
        assert not result.get("failed"), result.get("msg")
        assert 1 not in [g["index"] for g in result["gpus"]]
        (warning,) = [w for w in result.get("warnings", []) if "GPU 1" in w]
        assert "is lost" in warning and "left out" in warning and "nvidia-smi -r -i 1" in warning, warning
    assert layout_on_disk(machine, 0) == [(9, 4), (14, 0), (19, 2), (19, 3)]


# --- beside a node agent ----------------------------------------------------------------------
# The node agent tests' harness: a real `fastshare node serve` on a simulated machine.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from node.harness import GPU_MIG, agent, pki_dir, share, sim_machine  # noqa: E402, F401  (fixtures)

from fastshare.v1 import agent_pb2  # noqa: E402


def test_changes_are_the_running_node_agents_calls(collections_path, agent, sim_machine):  # noqa: F811
    """The role re-runs mig_config on a host whose agent runs: it changed MIG beside the agent,
    without its lock of the GPU (a share being prepared there lost its MIG device) and by a journal
    read. With the agent answering on unix_socket, the agent makes the changes: its instances, its
    shares counted (check mode too), and a forced change's victims reported as the layout's."""
    agent.start()
    stub = agent.unix()
    inventory = agent_pb2.GetInventoryRequest()
    args = {"gpu_backend": "sim", "sim_state": str(sim_machine), "unix_socket": agent.unix_socket,
            "layout": [{"devices": [GPU_MIG], "mig_devices": {"3g.40gb": 2}}]}
    made = run_module(collections_path, MIG_CONFIG, args)
    assert made["changed"] and [s["action"] for s in made["steps"]] == ["create", "create"], made
    migs = stub.GetInventory(inventory, timeout=30).gpus[GPU_MIG].mig_devices
    assert len(migs) == 2 and all(m.created_by_agent for m in migs), migs    # journaled: the agent's
    assert [d["uuid"] for d in made["gpus"][0]["mig_devices"]] == [m.uuid for m in migs]
    gpu = migs[0].gpu_uuid
    held = stub.PrepareShare(share("ex", "exclusive", [gpu], mig_profile="3g.40gb", mig_start=0),
                             timeout=60).device_uuids[0]
    whole = args | {"layout": [{"devices": [GPU_MIG], "mig_devices": {"7g.80gb": 1}}]}
    before = sim_machine.read_bytes()
    for check in (True, False):
        refused = run_module(collections_path, MIG_CONFIG, whole, check=check)
        assert refused.get("failed") and held in refused["msg"] and "ex" in refused["msg"], refused
        assert refused["changed"] is False and sim_machine.read_bytes() == before
    forced = run_module(collections_path, MIG_CONFIG, whole | {"force": True})
    assert forced["changed"] and [s["action"] for s in forced["steps"]] == ["destroy", "destroy", "create"]
    lost = {s.id: s.reason for s in stub.GetInventory(inventory, timeout=30).lost_shares}
    assert list(lost) == ["ex"] and "forced MIG layout change" in lost["ex"], lost
    # MIG off through the agent: its instances destroyed first, then the mode (SetMigMode)
    stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="ex"), timeout=60)
    off = run_module(collections_path, MIG_CONFIG,
                     args | {"layout": [{"devices": [GPU_MIG], "mig_enabled": False}]})
    assert off["changed"] and off["gpus"][0]["mig_mode"] == {"current": False, "pending": False}, off
    assert not stub.GetInventory(inventory, timeout=30).gpus[GPU_MIG].mig_enabled


def test_refused_while_a_node_agent_is_starting(mig, machine, tmp_path):
    """An agent holds its state directory from before it reconciles the journal with the MIG
    devices, and opens its socket after that: the module acted beside it. Now it refuses."""
    state = tmp_path / "state"
    hold = subprocess.Popen([sys.executable, "-c",
                             "import sys, time\nfrom fastshare.state_lock import StateDirLock\n"
                             "StateDirLock(sys.argv[1], 'node agent').acquire()\nprint('held', flush=True)\n"
                             "time.sleep(120)\n", str(state)], stdout=subprocess.PIPE, text=True)
    layout = [{"devices": [1], "mig_devices": {"3g.40gb": 2}}]
    extra = {"agent_journal": str(state / "journal.db"), "unix_socket": str(tmp_path / "node.sock")}
    try:
        assert hold.stdout.readline().strip() == "held"
        before = machine.read_bytes()
        for check in (True, False):
            refused = mig(layout, check=check, **extra)
            assert refused.get("failed") and f"a node agent (pid {hold.pid})" in refused["msg"], refused
            assert "it is starting" in refused["msg"] and refused["changed"] is False
            assert machine.read_bytes() == before
    finally:
        hold.kill()
        hold.wait()
    assert mig(layout, **extra)["changed"] is True          # the agent is gone: directly, as before


def test_plans_from_the_running_agents_inventory_without_a_backend(collections_path, agent,  # noqa: F811
                                                                   sim_machine, tmp_path):  # noqa: F811
    """`fastshare mig config` plans from the node agent's inventory while it answers; the module
    opened its GPU backend first and required its options (gpu_backend=sim without sim_state was
    refused, nvml failed on a host without a driver) although the agent reads the GPUs and makes
    the changes. Now plan, check mode, diff mode and apply need no backend beside the agent."""
    agent.start()
    stub = agent.unix()
    layout = [{"devices": [GPU_MIG], "mig_devices": {"3g.40gb": 2}}]
    before = sim_machine.read_bytes()
    for backend in ({}, {"gpu_backend": "sim"}):   # nvml (no driver here), sim without sim_state
        args = {"unix_socket": agent.unix_socket, "layout": layout, **backend}
        preview = run_module(collections_path, MIG_CONFIG, args, check=True, diff=True)
        assert preview.get("changed") and [s["action"] for s in preview["steps"]] == ["create", "create"], \
            preview
        assert "3g.40gb at start 4 (memory slices 4..7)" in preview["diff"]["after"], preview["diff"]
        assert sim_machine.read_bytes() == before
    made = run_module(collections_path, MIG_CONFIG, args, diff=True)
    migs = stub.GetInventory(agent_pb2.GetInventoryRequest(), timeout=30).gpus[GPU_MIG].mig_devices
    assert made["changed"] and len(migs) == 2 and all(m.created_by_agent for m in migs), made
    assert [d["uuid"] for d in made["gpus"][0]["mig_devices"]] == [m.uuid for m in migs]
    assert run_module(collections_path, MIG_CONFIG, args)["changed"] is False
    # a mig-parted file's device-filter selects by the PCI device id the agent's inventory gives
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nmig-configs:\n  h100:\n    - devices: all\n"
                      "      device-filter: ['0x233010DE']\n      mig-enabled: true\n"
                      "      mig-devices: {'7g.80gb': 1}\n")
    planned = run_module(collections_path, MIG_CONFIG, {"unix_socket": agent.unix_socket,
                                                        "config_file": str(config), "config_name": "h100"},
                         check=True)
    assert [g["index"] for g in planned["gpus"]] == [GPU_MIG], planned
    assert [s["action"] for s in planned["steps"]] == ["destroy", "destroy", "create"], planned


def test_without_an_agent_the_backend_is_needed_and_named(collections_path, machine, tmp_path):
    """No agent answers on unix_socket: the GPUs are read through the backend, and a missing one
    is named together with the socket nobody answered on."""
    where = {"unix_socket": str(tmp_path / "node.sock"),
             "agent_journal": str(tmp_path / "state" / "journal.db"),
             "layout": [{"devices": "all", "mig_enabled": False}]}
    tasks = [{MIG_CONFIG: where | {"gpu_backend": "sim"}}, {MIG_CONFIG: where}]
    sim, nvml = run_tasks(collections_path, tasks, tmp_path)
    assert sim.get("failed") and sim["changed"] is False, sim
    assert sim["msg"] == (f"gpu_backend is sim but sim_state is missing (needed while no node agent answers "
                          f"on unix_socket {tmp_path / 'node.sock'})"), sim["msg"]
    if nvml.get("failed"):   # a host with a working NVIDIA driver has GPUs to read
        assert "cannot open the nvml GPU backend (gpu_backend=nvml)" in nvml["msg"], nvml["msg"]
        assert f"no node agent answers on unix_socket {tmp_path / 'node.sock'}" in nvml["msg"], nvml["msg"]


# A sitecustomize for the run that fails: GPU 1 falls off the bus as soon as GPU 0 gets its first MIG
# device (in whichever process changes the GPUs: the module's, or the node agent's).
_GPU_1_LOST_DURING_GPU_0 = '''
import os

from fastshare.device import simnvml

_create = simnvml.SimNvml.nvmlDeviceCreateGpuInstanceWithPlacement
_lost = []


def _then_gpu_1_lost(self, handle, *args):
    made = _create(self, handle, *args)
    if self.nvmlDeviceGetIndex(handle) == 0 and not _lost:
        _lost.append(simnvml.lose_gpu(self.state_path, 1))
    return made


if os.environ.get("FS_TEST_GPU_1_LOST"):
    simnvml.SimNvml.nvmlDeviceCreateGpuInstanceWithPlacement = _then_gpu_1_lost
'''


@pytest.mark.parametrize("via", ["direct", "agent"])
def test_a_gpu_lost_midway_says_what_changed_and_the_same_run_finishes(via, mig, machine, request,
                                                                      collections_path, tmp_path):
    """GPU 1 falls off the bus while GPU 0 is being changed: the module failed naming GPU 1 only. Now
    its msg says GPU 0 changed (changed: true) and that the same run finishes the job, once GPU 1 is
    back; it does, leaving GPU 0 as it is. Directly and through a running node agent."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_GPU_1_LOST_DURING_GPU_0)
    lose = {"PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}", "FS_TEST_GPU_1_LOST": "1"}
    args = {"layout": [{"devices": [0], "mig_devices": {"1g.5gb": 7}},
                       {"devices": [1], "mig_devices": {"1g.10gb": 7}}]}
    if via == "agent":
        agent = request.getfixturevalue("agent")
        simnvml.create_machine(agent.sim_state, ["A100-SXM4-40GB", "H100-SXM5-80GB", "T4"], mig_enabled=True,
                               overwrite=True)
        agent.start(env=lose)
        machine, args = agent.sim_state, args | {"unix_socket": agent.unix_socket}
        lose = {}
    args |= {"gpu_backend": "sim", "sim_state": str(machine)}
    failed = run_module(collections_path, MIG_CONFIG, args, env=lose)
    assert failed["failed"] and failed["changed"] is True, failed
    assert "GPU 1" in failed["msg"] and "NVML_ERROR_GPU_IS_LOST" in failed["msg"], failed["msg"]
    assert "Changed before it: GPU 0 (7 MIG devices created)" in failed["msg"], failed["msg"]
    assert "once GPU 1 is put right, run the same command again" in failed["msg"], failed["msg"]
    gpu0 = layout_on_disk(machine, 0)
    assert len(gpu0) == 7 and layout_on_disk(machine, 1) == []
    simnvml.reset_gpu(machine, 1)
    again = run_module(collections_path, MIG_CONFIG, args)
    assert again["changed"] and not again.get("failed"), again
    assert {s["gpu"] for s in again["steps"]} == {1}
    assert layout_on_disk(machine, 0) == gpu0 and len(layout_on_disk(machine, 1)) == 7
