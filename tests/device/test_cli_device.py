"""`fastshare gpu|mig|sim-machine` through click (CliRunner) and as a real subprocess."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastshare.cli import main
from fastshare.device import simnvml
from fastshare.device.api import MigInstance


@pytest.fixture
def env(machine: Path) -> dict[str, str]:
    return {"FASTSHARE_GPU_BACKEND": "sim", "FASTSHARE_SIM_STATE": str(machine), "COLUMNS": "200"}


def run(args: list[str], env: dict[str, str] | None = None, ok: bool = True):
    result = CliRunner().invoke(main, args, env=env or {}, catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def test_gpu_list_json(env):
    data = json.loads(run(["gpu", "list", "--json"], env).output)
    assert [g["model"] for g in data["gpus"]] == ["A100-SXM4-40GB", "H100-SXM5-80GB", "A100-SXM4-40GB", "L4"]
    assert data["gpus"][0]["mig_current"] is True and data["gpus"][0]["mig_instances"] == []


def test_gpu_list_table_and_topology(env):
    out = run(["gpu", "list"], env).output
    assert "NVIDIA L4" in out and "23034" in out
    topo = json.loads(run(["gpu", "topology", "--json"], env).output)
    assert {"a": 0, "b": 1, "level": 10, "nvlink": False} in topo["pairs"]


def test_no_backend_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("FASTSHARE_GPU_BACKEND", raising=False)
    result = run(["gpu", "list"], {}, ok=False)
    assert result.exit_code != 0
    assert "no GPU backend configured" in result.output and "--gpu-backend" in result.output


def test_mig_plan_apply_and_list(env):
    plan = json.loads(run(["mig", "plan", "--gpu", "0", "--layout", "19,19,14,9", "--json"], env).output)
    assert plan["changed"] and len(plan["steps"]) == 4
    listed = json.loads(run(["gpu", "list", "--json"], env).output)
    assert listed["gpus"][0]["mig_instances"] == []  # plan changes nothing
    applied = json.loads(run(["mig", "apply", "--gpu", "0", "--layout", "3g.20gb=1,2g.10gb=1,1g.5gb=2",
                              "--json"], env).output)
    names = sorted(i["profile_name"] for i in applied["instances"])
    assert names == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
    # as through a node agent (tests/node/test_agent_ops.py): the same keys either way
    assert all(set(i) == {f.name for f in dataclasses.fields(MigInstance)} | {"share_id"}
               and i["share_id"] == "" for i in applied["instances"]), applied["instances"]
    out = run(["mig", "apply", "--gpu", "0", "--layout", "9,14,19,19"], env).output
    assert "nothing to do" in out
    assert out.startswith("GPU 0 (NVIDIA ") and "GPU 0 (GPU 0" not in out, out   # named once
    shown = json.loads(run(["gpu", "list", "--json"], env).output)["gpus"][0]["mig_instances"]
    assert len(shown) == 4 and all(i["uuid"].startswith("MIG-") for i in shown)


def test_mig_errors_name_the_problem(env):
    result = run(["mig", "plan", "--gpu", "0", "--layout", "19=8"], env, ok=False)
    assert result.exit_code == 1 and "8 x 1g.5gb requested but at most 7" in result.output
    result = run(["mig", "apply", "--gpu", "2", "--layout", "19"], env, ok=False)
    assert "MIG mode is disabled on GPU 2" in result.output
    result = run(["mig", "plan", "--gpu", "9", "--layout", "19"], env, ok=False)
    assert "GPU index 9 does not exist (valid: 0..3)" in result.output


@pytest.mark.parametrize("args, says", [
    (["profiles", "--gpu", "3"], "GPU 3 (NVIDIA L4) does not support MIG"),
    (["plan", "--gpu", "3", "--layout", "19"], "GPU 3 (NVIDIA L4) does not support MIG"),
    (["apply", "--gpu", "3", "--layout", "19"], "GPU 3 (NVIDIA L4) does not support MIG"),
    (["profiles", "--gpu", "2"], "MIG mode is disabled on GPU 2"),
    (["plan", "--gpu", "0", "--layout", "9g.9gb"], "unknown MIG profile '9g.9gb' on GPU 0 (NVIDIA A100"),
    (["plan", "--gpu", "0", "--layout", "19=8"], "at most 7 can exist on GPU 0 (NVIDIA A100"),
    (["plan", "--gpu", "0", "--layout", "19=x"], "GPU 0: layout item '19=x' is not PROFILE or PROFILE=COUNT"),
])
def test_mig_errors_say_the_gpu_once_with_its_name(env, args, says):
    # "GPU 3: GPU 3 (NVIDIA L4) does not support MIG": the CLI put the GPU before a message that
    # named it already
    result = run(["mig", *args], env, ok=False)
    assert result.exit_code == 1, result.output
    gpu = args[args.index("--gpu") + 1]
    assert says in result.output and len(re.findall(rf"\bGPU {gpu}\b", result.output)) == 1, result.output


def test_mig_enable_disable_and_in_use(env, machine: Path):
    assert "pending" in run(["mig", "enable", "--gpu", "2"], env).output          # Ampere
    run(["sim-machine", "reset", "--gpu", "2"], env)
    assert json.loads(run(["gpu", "list", "--json"], env).output)["gpus"][2]["mig_current"] is True
    run(["mig", "apply", "--gpu", "2", "--layout", "7g.40gb=1"], env)
    mig_uuid = json.loads(run(["gpu", "list", "--json"], env).output)["gpus"][2]["mig_instances"][0]["uuid"]
    pid = int(run(["sim-machine", "add-process", "--gpu", "2", "--mig", mig_uuid], env).output)
    result = run(["mig", "apply", "--gpu", "2", "--layout", ""], env, ok=False)
    assert "is in use" in result.output and mig_uuid in result.output
    result = run(["mig", "apply", "--gpu", "2", "--layout", "", "--force"], env, ok=False)
    assert "NVML cannot destroy it even with force" in result.output          # refused before any step
    result = run(["mig", "disable", "--gpu", "2"], env, ok=False)
    assert "IN_USE" in result.output
    run(["sim-machine", "remove-process", str(pid)], env)
    run(["mig", "apply", "--gpu", "2", "--layout", ""], env)
    assert "MIG disabled" in run(["mig", "disable", "--gpu", "1"], env).output   # Hopper: at once


def test_mig_profiles_json(env):
    data = json.loads(run(["mig", "profiles", "--gpu", "1", "--json"], env).output)
    assert {p["name"] for p in data["profiles"]} >= {"1g.10gb", "7g.80gb"}


def test_sim_machine_create_and_errors(tmp_path: Path):
    path = tmp_path / "new.json"
    out = run(["sim-machine", "create", str(path), "--gpus", "H200,A30,V100"]).output
    assert "3 GPU(s)" in out
    assert [g["model"] for g in simnvml.load_machine(path)["gpus"]] == ["H200-SXM5-141GB", "A30-24GB",
                                                                         "V100-SXM2-16GB"]
    again = run(["sim-machine", "create", str(path), "--gpus", "L4"], ok=False)
    assert "already exists" in again.output and "--force" in again.output
    assert "overwrite" not in again.output   # the library's keyword, beside the hint's --force
    bad = run(["sim-machine", "create", str(tmp_path / "b.json"), "--gpus", "GTX-480"], ok=False)
    assert "--gpus: unknown GPU model 'GTX-480'" in bad.output
    assert "H100-SXM5-80GB" in run(["sim-machine", "models"]).output


def test_sim_machine_errors_name_the_option(env, tmp_path: Path):
    # a GPU in MIG mode asked for "(mig_uuid)", the library's keyword; a missing machine file
    # said "Driver Not Loaded" (remove-process, reset, reboot, add-process)
    result = run(["sim-machine", "add-process", "--gpu", "0"], env, ok=False)
    assert result.exit_code == 1 and "name it with --mig" in result.output
    assert "mig_uuid" not in result.output
    for args in (["add-process", "--gpu", "0"], ["remove-process", "4"], ["reset", "--gpu", "0"], ["reboot"],
                 ["show"]):
        result = run(["sim-machine", *args, "--state", str(tmp_path / "none.json")], ok=False)
        assert result.exit_code == 2 and "'--state'" in result.output and "does not exist" in result.output


def test_real_subprocess_round_trip(machine: Path, tmp_path: Path):
    env = {**os.environ, "FASTSHARE_GPU_BACKEND": "sim", "FASTSHARE_SIM_STATE": str(machine)}
    exe = shutil.which("fastshare") or str(Path(sys.executable).with_name("fastshare"))
    subprocess.run([exe, "mig", "apply", "--gpu", "1", "--layout", "1g.10gb=7"], env=env,
                   check=True, capture_output=True, timeout=120)
    out = subprocess.run([exe, "gpu", "list", "--json"], env=env, check=True, capture_output=True,
                         text=True, timeout=120).stdout
    assert len(json.loads(out)["gpus"][1]["mig_instances"]) == 7


def test_mig_config_plan_apply_idempotent(env, tmp_path: Path):
    cfg = tmp_path / "mig.yaml"
    cfg.write_text("version: v1\nmig-configs:\n  small:\n    - devices: [0, 1]\n      mig-enabled: true\n"
                   "      mig-devices: {\"1g.5gb\": 3, \"1g.10gb\": 1}\n      device-filter: A100-SXM4-40GB\n"
                   "    - devices: [1]\n      mig-enabled: true\n      mig-devices: {\"1g.10gb\": 7}\n")
    plan = json.loads(run(["mig", "config", "--file", str(cfg), "--select", "small", "--json"], env).output)
    assert plan["changed"] and [g["gpu"] for g in plan["gpus"]] == [0, 1]
    run(["mig", "config", "--file", str(cfg), "--select", "small", "--apply"], env)
    again = json.loads(run(["mig", "config", "--file", str(cfg), "--select", "small", "--json"], env).output)
    assert again["changed"] is False
    bad = run(["mig", "config", "--file", str(cfg), "--select", "large"], env, ok=False)
    assert "config 'large' not found; available: small" in bad.output


def test_mig_config_keeps_devices_held_by_shares_unless_forced(env, machine: Path, tmp_path: Path):
    """--agent-journal: a MIG device a node agent share holds is in use, as for the Ansible module."""
    from fastshare.node.journal import Journal
    from fastshare.node.model import ShareSpec

    cfg = tmp_path / "mig.yaml"
    cfg.write_text("version: v1\nmig-configs:\n  halves: [{devices: [0], mig-enabled: true,"
                   " mig-devices: {\"3g.20gb\": 2}}]\n  whole: [{devices: [0], mig-enabled: true,"
                   " mig-devices: {\"7g.40gb\": 1}}]\n")
    base = ["mig", "config", "--file", str(cfg)]
    run([*base, "--select", "halves", "--apply"], env)
    held = simnvml.load_machine(machine)["gpus"][0]["gpu_instances"][0]["compute_instances"][0]["uuid"]
    journal = Journal(tmp_path / "journal.db")
    journal.begin_share(ShareSpec(id="share-1", kind="exclusive", device_uuids=(held,)), held, None)
    journal.close()
    with_journal = [*base, "--select", "whole", "--apply", "--agent-journal", str(tmp_path / "journal.db")]
    before = machine.read_bytes()
    refused = run(with_journal, env, ok=False)
    assert refused.exit_code != 0 and held in refused.output and "force" in refused.output
    assert machine.read_bytes() == before
    run([*with_journal, "--force"], env)
    assert [g["profile_id"] for g in simnvml.load_machine(machine)["gpus"][0]["gpu_instances"]] == [0]


@pytest.mark.parametrize("damage, says", [
    (lambda m: m["gpus"][0].pop("uuid"), "gpus[0].uuid: missing, expected str"),
    (lambda m: m["gpus"][2].update(index="2"), "gpus[2].index: '2', expected int"),
    (lambda m: m["gpus"][3].update(model="H9000"), "gpus[3].model: unknown GPU model 'H9000'"),
    (lambda m: m["gpus"][0]["gpu_instances"][0]["compute_instances"][0].update(slices=None),
     "gpus[0].gpu_instances[0].compute_instances[0].slices: None, expected int"),
    (lambda m: m["gpus"][0]["processes"][0].update(gi="x"),
     "gpus[0].processes[0].gi: 'x', expected int or null"),
    (lambda m: m.update(gpus=5), "machine.gpus: 5, expected list"),
    (lambda m: m.update(version=2), "machine.version: 2 (this fastshare reads 1)"),
])
def test_a_machine_file_of_the_wrong_shape_is_refused_naming_the_field(env, machine: Path, damage, says):
    """Valid JSON that the simulated NVML did not write (hand-edited, or another program's) used
    to fail inside the first NVML call that met it (`TypeError: object of type 'int' has no len()`)."""
    run(["mig", "apply", "--gpu", "0", "--layout", "3g.20gb=1"], env)
    held = simnvml.load_machine(machine)["gpus"][0]["gpu_instances"][0]["compute_instances"][0]["uuid"]
    simnvml.add_process(machine, 0, mig_uuid=held)
    assert "A100-SXM4-40GB" in run(["gpu", "list"], env).output   # everything it writes is accepted
    state = json.loads(machine.read_text())
    damage(state)
    machine.write_text(json.dumps(state))
    result = CliRunner().invoke(main, ["gpu", "list"], env=env)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "is not a simulated machine file" in result.output and says in result.output


@pytest.mark.parametrize("content, says", [("", "Expecting value"), ("[1]", "machine: expected an object"),
                                           ('{"version": 1}', "machine.driver_version: missing")])
@pytest.mark.parametrize("args", [["show"], ["add-process", "--gpu", "0"], ["remove-process", "4"],
                                  ["reset", "--gpu", "0"], ["reboot"]])
def test_sim_machine_commands_refuse_a_file_that_is_no_machine(tmp_path: Path, args, content, says):
    # an empty or foreign --state file crashed them (JSONDecodeError, TypeError, KeyError
    # tracebacks) or, for `show`, was printed as if it were a machine
    path = tmp_path / "m.json"
    path.write_text(content)
    result = CliRunner().invoke(main, ["sim-machine", *args, "--state", str(path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "'--state'" in result.output and "is not a simulated machine file" in result.output
    assert says in result.output
    assert path.read_text() == content


@pytest.mark.parametrize("content", [b"", b"[1]\n"])
def test_mig_config_refuses_an_agent_journal_that_is_no_journal(env, machine: Path, tmp_path: Path, content):
    # the library's StateFileError escaped as a traceback
    cfg = tmp_path / "mig.yaml"
    cfg.write_text("version: v1\nmig-configs:\n  whole: [{devices: [0], mig-enabled: true,"
                   " mig-devices: {\"7g.40gb\": 1}}]\n")
    journal = tmp_path / "journal.db"
    journal.write_bytes(content)
    before = machine.read_bytes()
    result = CliRunner().invoke(main, ["mig", "config", "--file", str(cfg), "--select", "whole", "--apply",
                                       "--agent-journal", str(journal)], env=env)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"--agent-journal: {journal} cannot be read as a node agent journal" in result.output
    assert machine.read_bytes() == before and journal.read_bytes() == content


def test_sim_machine_create_names_a_parent_that_is_a_file(tmp_path: Path):
    # "m.json/x already exists" (and "pass --force"), when it was m.json that is no directory;
    # an empty PATH said " already exists" (the current directory)
    (tmp_path / "m.json").write_text("{}")
    result = CliRunner().invoke(main, ["sim-machine", "create", str(tmp_path / "m.json" / "x"),
                                       "--gpus", "L4", "--force"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"{tmp_path / 'm.json'} is not a directory" in result.output and "--force" not in result.output
    result = CliRunner().invoke(main, ["sim-machine", "create", "", "--gpus", "L4"])
    assert result.exit_code == 2 and "PATH" in result.output and "already exists" not in result.output


@pytest.mark.parametrize("count", [0, 65, 10_000])
def test_sim_machine_create_refuses_a_gpu_count_no_machine_has(tmp_path: Path, count: int):
    """--gpus took any number of models: a list pasted or generated wrong made a machine of
    10,000 GPUs (PCI bus ids past FF, a file every command then reads). A machine has 1 to 64;
    outside that the option is refused naming it and the range, and no file is written."""
    path = tmp_path / "m.json"
    gpus = ",".join(["L4"] * count)
    result = CliRunner().invoke(main, ["sim-machine", "create", str(path), "--gpus", gpus])
    assert result.exit_code == 2, result.output
    assert "'--gpus'" in result.output and "1 to 64" in result.output and f"{count} GPU" in result.output
    assert not path.exists()


def test_sim_machine_create_takes_64_gpus(tmp_path: Path):
    path = tmp_path / "m.json"
    run(["sim-machine", "create", str(path), "--gpus", ",".join(["L4"] * 64)])
    assert len(simnvml.load_machine(path)["gpus"]) == 64


def test_mig_apply_never_sends_to_force_what_nvml_refuses_and_changes_nothing(env, machine: Path):
    # The refusal said "stop its processes or force it (`--force`)"; --force then destroyed the
    # GPU's idle instances one by one and failed with NVML's IN_USE on the busy one, half done.
    run(["mig", "apply", "--gpu", "0", "--layout", "1g.5gb=3"], env)
    before = json.loads(run(["gpu", "list", "--json"], env).output)["gpus"][0]["mig_instances"]
    busy = before[-1]["uuid"]
    run(["sim-machine", "add-process", "--gpu", "0", "--mig", busy], env)
    result = run(["mig", "apply", "--gpu", "0", "--layout", "7g.40gb=1"], env, ok=False)
    assert "is in use" in result.output and busy in result.output and "--force" not in result.output
    assert "stop its processes" in result.output
    result = run(["mig", "apply", "--gpu", "0", "--layout", "7g.40gb=1", "--force"], env, ok=False)
    assert busy in result.output and "even with force" in result.output
    assert "stop the processes" in result.output
    assert "IN_USE" not in result.output          # refused by the plan, not halfway by NVML
    after = json.loads(run(["gpu", "list", "--json"], env).output)["gpus"][0]["mig_instances"]
    assert [m["uuid"] for m in after] == [m["uuid"] for m in before]


def test_sim_machine_remove_gpu(env, machine: Path):
    before = simnvml.load_machine(machine)["gpus"]
    out = run(["sim-machine", "remove-gpu", "--gpu", "0"], env).output
    assert f"removed GPU 0 ({before[0]['uuid']})" in out and f"0={before[1]['uuid']}" in out
    assert [g["uuid"] for g in simnvml.load_machine(machine)["gpus"]] == [g["uuid"] for g in before[1:]]
    bad = run(["sim-machine", "remove-gpu", "--gpu", "7"], env, ok=False)
    assert bad.exit_code == 1 and "remove-gpu: gpu index 7 out of range" in bad.output


def _journal_holding(path: Path, *holds: tuple[str, str]) -> Path:
    """A real node agent journal whose shares (id, device UUID) hold those devices."""
    from fastshare.node.journal import Journal
    from fastshare.node.model import ShareSpec

    journal = Journal(path)
    for share_id, uuid in holds:
        journal.begin_share(ShareSpec(id=share_id, kind="exclusive", device_uuids=(uuid,)), uuid, None)
    journal.close()
    return path


def test_mig_plan_and_apply_keep_instances_agent_shares_hold_unless_forced(env, machine: Path,
                                                                            tmp_path: Path):
    """`mig plan/apply` ignored the agent journal: an instance a share holds (its workload has its
    environment but no process yet) was destroyed by a layout with no place for it."""
    run(["mig", "apply", "--gpu", "0", "--layout", "3g.20gb=2"], env)
    held = next(i["uuid"] for i in json.loads(run(["gpu", "list", "--json"], env).output)["gpus"][0]
                ["mig_instances"] if i["start"] == 0)
    journal = _journal_holding(tmp_path / "journal.db", ("alloc-7", held))
    before = machine.read_bytes()
    for command in ("plan", "apply"):
        refused = run(["mig", command, "--gpu", "0", "--layout", "7g.40gb=1",
                       "--agent-journal", str(journal)], env, ok=False)
        assert refused.exit_code == 1, refused.output
        for says in ("GPU 0", held, "alloc-7", "fastshare release alloc-7", "fastshare cordon", "--force"):
            assert says in refused.output, (says, refused.output)
        assert "processes" not in refused.output          # none run on it: the share is what holds it
        assert machine.read_bytes() == before
    # A layout with a place for it keeps it where it is.
    kept = json.loads(run(["mig", "apply", "--gpu", "0", "--layout", "3g.20gb=1,2g.10gb=1,1g.5gb=1",
                           "--agent-journal", str(journal), "--json"], env).output)
    assert held in {i["uuid"] for i in kept["instances"]}
    assert all(s["start"] != 0 for s in kept["steps"] if s["action"] == "destroy")
    # --force overrides the share (and only that: see test_mig_enable_disable_and_in_use).
    forced = json.loads(run(["mig", "apply", "--gpu", "0", "--layout", "7g.40gb=1", "--agent-journal",
                             str(journal), "--force", "--json"], env).output)
    assert [i["profile_name"] for i in forced["instances"]] == ["7g.40gb"]


def test_mig_commands_read_the_agents_journal_by_default():
    """Like `mig config`, the default is the node agent's own journal; its absence means no agent."""
    for command in ("plan", "apply", "config", "enable"):
        out = run(["mig", command, "--help"], {"COLUMNS": "200"}).output
        assert "--agent-journal" in out and "/var/lib/fastshare/node/journal.db" in out, (command, out)
        assert "--force" in out and "instances that are in use" not in out, (command, out)


def test_mig_commands_act_directly_when_no_agent_answers_its_socket(env, machine: Path):
    """A socket an agent that stopped left behind (nothing listens): no agent runs, so as without one."""
    import socket
    import tempfile

    stale = Path(tempfile.mkdtemp(prefix="fsm-", dir="/tmp")) / "node.sock"
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(stale))
    left.close()
    try:
        applied = json.loads(run(["mig", "apply", "--gpu", "0", "--layout", "19", "--unix-socket", str(stale),
                                  "--json"], env).output)
        assert [i["profile_name"] for i in applied["instances"]] == ["1g.5gb"]
        assert "pending" in run(["mig", "enable", "--gpu", "2", "--unix-socket", str(stale)], env).output
    finally:
        shutil.rmtree(stale.parent)


def test_mig_enable_refuses_a_gpu_an_agent_share_holds_whole_unless_forced(env, machine: Path,
                                                                            tmp_path: Path):
    """`mig enable` took a whole GPU from the share that holds it (at the next reset on Ampere)."""
    gpu = json.loads(run(["gpu", "list", "--json"], env).output)["gpus"][2]
    journal = _journal_holding(tmp_path / "journal.db", ("alloc-9", gpu["uuid"]))
    before = machine.read_bytes()
    refused = run(["mig", "enable", "--gpu", "2", "--agent-journal", str(journal)], env, ok=False)
    assert refused.exit_code == 1, refused.output
    for says in ("GPU 2", gpu["uuid"], "alloc-9", "fastshare release alloc-9", "--force"):
        assert says in refused.output, (says, refused.output)
    assert machine.read_bytes() == before
    assert "pending" in run(["mig", "enable", "--gpu", "2", "--agent-journal", str(journal), "--force"],
                            env).output


def test_mig_commands_wait_for_a_node_agent_that_is_starting(env, machine: Path, tmp_path: Path):
    """An agent holds its state directory from before it reconciles the journal with the MIG
    devices until it exits, and opens its socket only after that reconcile: a `mig` command that
    found no socket acted directly while the agent was changing the same GPUs. Now it waits for it."""
    state = tmp_path / "state"
    journal = str(state / "journal.db")
    hold = subprocess.Popen([sys.executable, "-c",
                             "import sys, time\nfrom fastshare.state_lock import StateDirLock\n"
                             "StateDirLock(sys.argv[1], 'node agent').acquire()\nprint('held', flush=True)\n"
                             "time.sleep(120)\n", str(state)], stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "held"
        absent = str(tmp_path / "node.sock")
        config = tmp_path / "mig.yaml"
        config.write_text('{"version": "v1", "mig-configs": {"c": [{"devices": [0], "mig-enabled": true, '
                          '"mig-devices": {"1g.5gb": 1}}]}}')
        for args in (["apply", "--gpu", "0", "--layout", "19"], ["plan", "--gpu", "0", "--layout", "19"],
                     ["enable", "--gpu", "2"], ["disable", "--gpu", "0"],
                     ["config", "--file", str(config), "--select", "c"],
                     ["config", "--file", str(config), "--select", "c", "--apply"]):
            refused = run(["mig", *args, "--unix-socket", absent, "--agent-journal", journal], env, ok=False)
            assert refused.exit_code != 0, refused.output
            said = refused.output
            assert f"a node agent (pid {hold.pid}) runs on this host ({state})" in said, said
            assert "it is starting" in said and "retry" in said, said
        assert json.loads(run(["gpu", "list", "--json"], env).output)["gpus"][0]["mig_instances"] == []
    finally:
        hold.kill()
        hold.wait()
    applied = json.loads(run(["mig", "apply", "--gpu", "0", "--layout", "19", "--unix-socket", absent,
                              "--agent-journal", journal, "--json"], env).output)   # the agent is gone
    assert [i["profile_name"] for i in applied["instances"]] == ["1g.5gb"]
