"""Operating the agent: watch, metrics, administrative MIG layouts, the CLI, the unit file."""

import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from importlib import resources

import grpc
import pytest

from fastshare.device import simnvml
from fastshare.device.api import MigInstance
from fastshare.v1 import agent_pb2

from .harness import BIN, GPU_A, GPU_B, GPU_MIG, fastpod, rpc_error, share, wait_for

INV = agent_pb2.GetInventoryRequest()


def test_watch_returns_at_once_on_change_and_waits_otherwise(agent):
    agent.start()
    stub = agent.unix()
    inv = stub.GetInventory(INV, timeout=30)
    start = time.monotonic()
    quiet = stub.Watch(agent_pb2.WatchRequest(since_generation=inv.generation, boot_id=inv.boot_id,
                                              wait_ms=300), timeout=30)
    assert not quiet.changed and quiet.generation == inv.generation
    assert time.monotonic() - start >= 0.25
    timer = threading.Timer(0.5, lambda: stub.PrepareShare(fastpod("w", inv.gpus[GPU_A].uuid), timeout=60))
    timer.start()
    woke = stub.Watch(agent_pb2.WatchRequest(since_generation=inv.generation, boot_id=inv.boot_id,
                                             wait_ms=30000), timeout=60)
    timer.join()
    assert woke.changed and woke.generation > inv.generation
    assert [s.id for s in woke.inventory.shares] == ["w"]
    other_boot = stub.Watch(agent_pb2.WatchRequest(since_generation=woke.generation, boot_id="old"),
                            timeout=30)
    assert other_boot.changed  # the agent restarted since the caller's view: resync


def test_metrics_count_shares_and_rpcs(agent):
    agent.start()
    gpu = agent.unix().GetInventory(INV, timeout=30).gpus[GPU_A].uuid
    agent.unix().PrepareShare(fastpod("m", gpu), timeout=60)
    rpc_error(agent.unix().PrepareShare, fastpod("bad", gpu, sm=0))
    url = f"http://127.0.0.1:{agent.ports['metrics_listen']}/metrics"
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    assert 'fastshare_node_shares{kind="fastpod"} 1.0' in text
    assert "fastshare_node_mps_daemons 1.0" in text
    assert 'fastshare_node_rpc_seconds_count{method="PrepareShare"} 2.0' in text
    assert 'fastshare_node_rpc_errors_total{code="INVALID_ARGUMENT",method="PrepareShare"} 1.0' in text


def test_mig_layout_plan_apply_and_shares_are_never_destroyed(agent, devices):
    agent.start()
    gpu = agent.unix().GetInventory(INV, timeout=30).gpus[GPU_MIG].uuid
    stub = agent.mtls()
    wanted = {"3g.40gb": 1, "1g.10gb": 2}
    plan = stub.PlanMigLayout(agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles=wanted), timeout=60)
    assert plan.changed and sorted(a.profile_name for a in plan.actions) == ["1g.10gb", "1g.10gb", "3g.40gb"]
    assert {a.op for a in plan.actions} == {"create"} and devices.mig_instances(GPU_MIG) == []
    anon = agent.no_client_cert("readonly_listen")
    assert anon.PlanMigLayout(agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles=wanted), timeout=60).changed
    err = rpc_error(anon.ApplyMigLayout, agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles=wanted))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED

    applied = stub.ApplyMigLayout(agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles=wanted), timeout=60)
    assert applied.changed and len(applied.mig_devices) == 3
    assert all(m.created_by_agent for m in applied.mig_devices)
    again = stub.ApplyMigLayout(agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles=wanted), timeout=60)
    assert not again.changed and list(again.actions) == []

    # An exclusive share binds the idle 3g instance at its placement; a layout without 3g must
    # not destroy it.
    three_g = next(m for m in applied.mig_devices if m.profile_name == "3g.40gb")
    held = stub.PrepareShare(share("ex", "exclusive", [gpu], mig_profile="3g.40gb", mig_start=three_g.start),
                             timeout=60)
    assert list(held.device_uuids) == [three_g.uuid]
    err = rpc_error(stub.ApplyMigLayout, agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles={"7g.80gb": 1}))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "in use" in err.details()
    err = rpc_error(stub.ApplyMigLayout, agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles={"9g.9gb": 1}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "profiles" in err.details()

    stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="ex"), timeout=60)
    agent.kill9()
    agent.start()  # layout instances are not orphans: the restart keeps all three
    assert len(devices.mig_instances(GPU_MIG)) == 3


def _held_slice(agent):
    """The running agent's stub, its MIG GPU laid out as two 3g.40gb, and the MIG device (at start
    0) an exclusive share "ex" holds."""
    stub = agent.unix()
    gpu = stub.GetInventory(INV, timeout=30).gpus[GPU_MIG].uuid
    stub.ApplyMigLayout(agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles={"3g.40gb": 2}), timeout=60)
    mig = stub.PrepareShare(share("ex", "exclusive", [gpu], mig_profile="3g.40gb", mig_start=0),
                            timeout=60).device_uuids[0]
    return stub, gpu, mig


def test_a_forced_layout_drops_the_shares_it_destroys_saying_so(agent):
    """A forced ApplyMigLayout destroyed a held slice; the next housekeeping then dropped the share as
    "destroyed outside fastshare (by hand, ...)", and the controller ended its allocation so."""
    agent.settings["reconcile_interval_s"] = 1     # a housekeeping that would find it first
    agent.start()
    stub, gpu, mig = _held_slice(agent)
    other = next(m.uuid for m in stub.GetInventory(INV, timeout=30).gpus[GPU_MIG].mig_devices if m.start == 4)
    stub.PrepareShare(fastpod("fp", other), timeout=60)
    stub.ApplyMigLayout(agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles={"7g.80gb": 1}, force=True),
                        timeout=60)
    lost = {s.id: s.reason for s in wait_for(lambda: stub.GetInventory(INV, timeout=30).lost_shares,
                                             what="the shares reported lost")}
    assert sorted(lost) == ["ex", "fp"], lost
    for reason in lost.values():
        assert "forced MIG layout change" in reason and "7g.80gb=1" in reason, reason
        assert "outside fastshare" not in reason and "by hand" not in reason, reason
    assert mig in lost["ex"] and "slice 0" in lost["ex"], lost["ex"]
    assert list(stub.GetInventory(INV, timeout=30).shares) == []


def _flock_waiters(path) -> int:
    """Processes (or threads) waiting for the flock on ``path`` (from /proc/locks)."""
    inode = f":{os.stat(path).st_ino} "
    with open("/proc/locks") as locks:
        return sum(1 for line in locks if "->" in line and inode in line)


def _cli(agent, *args: str, **env: str) -> subprocess.Popen:
    """`fastshare ARGS` as another process on the agent's host (the agent's socket in its env)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")}
    child_env.update(FASTSHARE_NODE_UNIX_SOCKET=agent.unix_socket, COLUMNS="200", **env)
    return subprocess.Popen([str(BIN / "fastshare"), *args], env=child_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("command", ["apply", "config"])
def test_cli_mig_change_waits_for_a_share_the_agent_is_preparing(agent, sim_machine, tmp_path, command):
    """`fastshare mig apply` and `mig config --apply` (also run at boot and by the Ansible module) read
    the agent's journal but acted beside the running agent: an exclusive share the agent was binding
    (not yet journaled as held) was destroyed under it, or the layout took its place and the share
    failed. Through the agent they wait for the GPU's lock and see it: the change is refused."""
    agent.start()
    stub = agent.unix()
    gpu = stub.GetInventory(INV, timeout=30).gpus[GPU_MIG].uuid
    stub.ApplyMigLayout(agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles={"3g.40gb": 2}), timeout=60)
    lock_path = f"{sim_machine}.lock"
    prepared: dict = {}

    def prepare() -> None:
        try:
            prepared["reply"] = stub.PrepareShare(
                share("ex", "exclusive", [gpu], mig_profile="3g.40gb", mig_start=0), timeout=120)
        except grpc.RpcError as exc:
            prepared["error"] = exc.details()

    change = (["mig", "apply", "--gpu", str(GPU_MIG), "--layout", "7g.80gb=1"] if command == "apply" else
              ["mig", "config", "--file", _mig_config(tmp_path, {"7g.80gb": 1}), "--select", "cfg",
               "--apply"])
    with open(lock_path, "a+") as held:      # NVML (the machine file) stalls while this is held
        fcntl.flock(held, fcntl.LOCK_EX)
        thread = threading.Thread(target=prepare)
        thread.start()                       # the agent takes the GPU's lock, then waits for NVML
        wait_for(lambda: _flock_waiters(lock_path) >= 1, what="the prepare waiting for NVML")
        cli = _cli(agent, *change, "--gpu-backend", "sim", "--sim-state", str(sim_machine),
                   "--agent-journal", str(agent.workdir / "state" / "journal.db"))
        wait_for(lambda: _flock_waiters(lock_path) >= 2, what="the CLI waiting for NVML")
        fcntl.flock(held, fcntl.LOCK_UN)
    thread.join(timeout=120)
    out = cli.communicate(timeout=120)[0]
    assert "error" not in prepared, prepared.get("error")
    mig = prepared["reply"].device_uuids[0]
    assert cli.returncode == 1, out
    for says in (f"GPU {GPU_MIG}", mig, "held by fastshare share ex", "fastshare release ex", "--force"):
        assert says in out, (says, out)
    inv = stub.GetInventory(INV, timeout=30)
    assert mig in {m.uuid for m in inv.gpus[GPU_MIG].mig_devices}
    assert [s.id for s in inv.shares] == ["ex"] and not inv.lost_shares


def _run_cli(agent, *args: str, ok: bool = True) -> str:
    cli = _cli(agent, *args)
    out = cli.communicate(timeout=120)[0]
    assert (cli.returncode == 0) == ok, (args, out)
    return out


def test_cli_mig_commands_go_through_a_running_agent(agent, devices):
    """With an agent answering on its socket, `mig plan/apply/enable/disable` are its calls (no GPU
    backend given: the agent's), with the output and refusals they have without one."""
    agent.start()
    stub = agent.unix()
    gpu = str(GPU_MIG)
    plan = json.loads(_run_cli(agent, "mig", "plan", "--gpu", gpu, "--layout", "3g.40gb=2", "--json"))
    assert plan["changed"] and [s["action"] for s in plan["steps"]] == ["create", "create"]
    assert plan["steps"][0]["description"] == "create 3g.40gb (id 9) at start 0 (memory slices 0..3)"
    assert plan["keep"] == [] and [p["start"] for p in plan["final"]] == [0, 4]
    out = _run_cli(agent, "mig", "apply", "--gpu", gpu, "--layout", "9=2")
    assert "applied on GPU 0" in out and "GPU 0 now: 3g.40gb=2" in out, out
    migs = stub.GetInventory(INV, timeout=30).gpus[GPU_MIG].mig_devices
    assert len(migs) == 2 and all(m.created_by_agent for m in migs)      # journaled: the agent made them
    out = _run_cli(agent, "mig", "apply", "--gpu", gpu, "--layout", "3g.40gb=2")
    assert out.startswith("GPU 0 (NVIDIA H100") and "nothing to do" in out, out

    held = stub.PrepareShare(share("ex", "exclusive", [migs[0].gpu_uuid], mig_profile="3g.40gb", mig_start=0),
                             timeout=60).device_uuids[0]
    for command in ("plan", "apply"):
        out = _run_cli(agent, "mig", command, "--gpu", gpu, "--layout", "7g.80gb=1", ok=False)
        for says in ("GPU 0: ", held, "held by fastshare share ex", "fastshare release ex", "--force"):
            assert says in out, (says, out)
    out = _run_cli(agent, "mig", "plan", "--gpu", gpu, "--layout", "9g.9gb=1", ok=False)
    assert "unknown MIG profile '9g.9gb' on GPU 0 (NVIDIA H100" in out and "GPU 0:" not in out, out
    out = _run_cli(agent, "mig", "plan", "--gpu", str(GPU_A), "--layout", "1g.10gb=1", ok=False)
    assert f"Error: GPU {GPU_A} (Tesla V100-SXM2-32GB) does not support MIG" in out, out   # said once
    assert "does not exist (valid: 0..2)" in _run_cli(agent, "mig", "plan", "--gpu", "9", "--layout", "",
                                                      ok=False)
    forced = json.loads(_run_cli(agent, "mig", "apply", "--gpu", gpu, "--layout", "7g.80gb=1", "--force",
                                 "--json"))
    assert [i["profile_name"] for i in forced["instances"]] == ["7g.80gb"]
    # the instances as `mig apply --json` without an agent lists them (a script reads either)
    made = forced["instances"][0]
    assert set(made) == {f.name for f in dataclasses.fields(MigInstance)} | {"share_id"}, made
    assert made["gpu_index"] == GPU_MIG and made["ci_id"] == 0 and made["uuid"].startswith("MIG-"), made
    assert made["gi_id"] == devices.mig_instances(GPU_MIG)[0].gi_id, made
    assert [s.id for s in stub.GetInventory(INV, timeout=30).lost_shares] == ["ex"]
    stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="ex"), timeout=60)

    assert "IN_USE" in _run_cli(agent, "mig", "disable", "--gpu", gpu, ok=False)   # an instance is left
    _run_cli(agent, "mig", "apply", "--gpu", gpu, "--layout", "")
    assert "GPU 0: MIG disabled" in _run_cli(agent, "mig", "disable", "--gpu", gpu)
    whole = stub.GetInventory(INV, timeout=30).gpus[GPU_MIG].uuid
    stub.PrepareShare(share("w", "whole", [whole]), timeout=60)
    out = _run_cli(agent, "mig", "enable", "--gpu", gpu, ok=False)     # as without an agent
    for says in ("GPU 0 (", "held whole by fastshare share w", "fastshare release w", "--force"):
        assert says in out, (says, out)
    assert not stub.GetInventory(INV, timeout=30).gpus[GPU_MIG].mig_enabled
    # --force was refused while the agent ran (SetMigMode had no force); now the share loses the GPU
    assert "GPU 0: MIG enabled" in _run_cli(agent, "mig", "enable", "--gpu", gpu, "--force")
    inv = stub.GetInventory(INV, timeout=30)
    assert inv.gpus[GPU_MIG].mig_enabled and list(inv.shares) == []
    (lost,) = inv.lost_shares
    assert lost.id == "w" and "forced MIG mode change" in lost.reason and whole in lost.reason, lost


def test_cli_mig_keep_and_in_use_through_the_agent_as_without_one(agent):
    """Through the agent `mig apply --json` listed the instances it had just created under "keep" (as
    kept from before), and `mig plan --json` showed a MIG device an MPS share holds as not in use,
    where without an agent "keep" has only the instances that were there and in use names the shares."""
    agent.start()
    stub = agent.unix()
    gpu = str(GPU_MIG)
    applied = json.loads(_run_cli(agent, "mig", "apply", "--gpu", gpu, "--layout", "3g.40gb=2", "--json"))
    assert applied["keep"] == [], applied["keep"]
    assert [p["start"] for p in applied["final"]] == [0, 4], applied["final"]
    other = next(m.uuid for m in stub.GetInventory(INV, timeout=30).gpus[GPU_MIG].mig_devices if m.start == 4)
    stub.PrepareShare(fastpod("fp", other), timeout=60)
    plan = json.loads(_run_cli(agent, "mig", "plan", "--gpu", gpu, "--layout", "3g.40gb=1,1g.10gb=2",
                               "--json"))
    kept = {p["start"]: p for p in plan["keep"]}
    assert kept[4]["in_use"] and kept[4]["shares"] == ["fp"], plan
    again = json.loads(_run_cli(agent, "mig", "apply", "--gpu", gpu, "--layout", "3g.40gb=2", "--json"))
    assert [(p["start"], p["in_use"], p["shares"]) for p in again["keep"]] == [(0, False, []),
                                                                               (4, True, ["fp"])]
    assert [i["share_id"] for i in again["instances"]] == ["", "fp"], again["instances"]   # as without one
    stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="fp"), timeout=60)


def test_cli_status_release_and_unit(agent):
    agent.start()
    gpu = agent.unix().GetInventory(INV, timeout=30).gpus[GPU_A].uuid
    agent.unix().PrepareShare(fastpod("cli", gpu), timeout=60)
    fastshare = str(BIN / "fastshare")
    out = subprocess.run([fastshare, "node", "status", "--unix-socket", agent.unix_socket, "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert [s["id"] for s in json.loads(out.stdout)["shares"]] == ["cli"]
    table = subprocess.run([fastshare, "node", "status", "--unix-socket", agent.unix_socket],
                           capture_output=True, text=True, timeout=120, check=True)
    assert "cli" in table.stdout and "fastpod" in table.stdout
    out = subprocess.run([fastshare, "node", "release", "--unix-socket", agent.unix_socket, "cli"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "released cli" in out.stdout
    assert agent.unix().GetInventory(INV, timeout=30).shares == []
    unit = subprocess.run([fastshare, "node", "unit"], capture_output=True, text=True, timeout=120,
                          check=True).stdout
    for line in ("Type=notify", "ProtectSystem=strict", "NoNewPrivileges=yes", "Restart=on-failure",
                 "KillMode=process", "StateDirectory=fastshare/node", "RuntimeDirectory=fastshare",
                 "DeviceAllow=char-nvidia-frontend rw", "DevicePolicy=closed"):
        assert line in unit.splitlines(), line


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_template_passes_systemd_analyze_verify(tmp_path):
    unit = resources.files("fastshare.node").joinpath("fastshare-node.service").read_text()
    path = tmp_path / "fastshare-node.service"
    path.write_text(unit.replace("/opt/fastshare/bin/fastshare", "/bin/true"))  # must exist to verify
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "fastshare-node.service" not in out.stderr, out.stderr


def test_cli_status_lists_a_share_lost_with_its_gpu_until_it_is_released(agent, sim_machine):
    """A whole-GPU share whose GPU fell off the bus while the agent ran: dropped by housekeeping,
    `fastshare node status` lists it with why, and `fastshare node release` forgets it."""
    agent.settings["reconcile_interval_s"] = 1
    agent.start()
    gpu = agent.unix().GetInventory(INV, timeout=30).gpus[GPU_B].uuid
    agent.unix().PrepareShare(share("gone", "whole", [gpu], owner="team/b"), timeout=60)
    simnvml.remove_gpu(sim_machine, GPU_B)
    wait_for(lambda: agent.unix().GetInventory(INV, timeout=30).lost_shares, what="the share dropped")
    inv = agent.unix().GetInventory(INV, timeout=30)
    assert not inv.shares
    assert [(s.id, s.device_uuid, s.owner) for s in inv.lost_shares] == [("gone", gpu, "team/b")]
    log = agent.log.read_text()
    assert "WARNING" in log and f"GPU {gpu} is no longer on this node" in log, log
    fastshare = str(BIN / "fastshare")
    table = subprocess.run([fastshare, "node", "status", "--unix-socket", agent.unix_socket],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert "lost shares" in table and "gone" in table and "team/b" in table, table
    out = subprocess.run([fastshare, "node", "release", "--unix-socket", agent.unix_socket, "gone"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "released gone" in out.stdout
    assert not agent.unix().GetInventory(INV, timeout=30).lost_shares


def test_cli_status_shows_a_lost_gpu_as_lost(agent, sim_machine):
    """`fastshare node status` listed a GPU fallen off the bus like a healthy one with MIG "off"
    (and, lost before the agent read it, with a blank UUID and name): nothing on the node said it
    was lost. Now its MIG cell says LOST and a table of lost GPUs names it, its NVML error and
    what to do."""
    agent.settings["reconcile_interval_s"] = 1
    agent.start()
    gpu = agent.unix().GetInventory(INV, timeout=30).gpus[GPU_B].uuid
    simnvml.lose_gpu(sim_machine, GPU_B)
    wait_for(lambda: agent.unix().GetInventory(INV, timeout=30).gpus[GPU_B].lost, what="the GPU lost")
    table = subprocess.run([str(BIN / "fastshare"), "node", "status", "--unix-socket", agent.unix_socket],
                           capture_output=True, text=True, timeout=120, check=True,
                           env={**os.environ, "COLUMNS": "250"}).stdout
    row, listed = [line for line in table.splitlines() if line.split()[:2] == [str(GPU_B), gpu]]
    assert "LOST" in row and "off" not in row.split(), table
    assert "NVML_ERROR_GPU_IS_LOST" in listed, table
    assert "lost GPUs" in table and "NVML_ERROR_GPU_IS_LOST" in table and "reboot" in table, table


def test_a_second_agent_on_the_same_state_directory_refuses_to_start(agent):
    """A second `fastshare node serve` on a running agent's state directory (run by hand while the
    unit runs) reconciled the journal and the GPUs under the first one's feet and took over its
    unix socket. It now refuses before touching anything, naming the running agent's pid."""
    agent.start()
    stub = agent.unix()
    gpu = stub.GetInventory(INV, timeout=30).gpus[GPU_A].uuid
    stub.PrepareShare(fastpod("kept", gpu), timeout=60)
    socket_inode = os.stat(agent.unix_socket).st_ino
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")}
    config = str(agent.workdir / "node.yaml")
    second = subprocess.run([str(BIN / "fastshare"), "node", "serve", "--config", config],
                            capture_output=True, text=True, timeout=120, env=env)
    assert second.returncode != 0, second.stdout + second.stderr
    said = second.stdout + second.stderr
    assert f"another node agent (pid {agent.proc.pid}) is already using the state directory" in said, said
    assert "state_dir (node.yaml)" in said, said
    assert os.stat(agent.unix_socket).st_ino == socket_inode      # the first agent's socket, untouched
    assert [s.id for s in stub.GetInventory(INV, timeout=30).shares] == ["kept"]
    agent.stop()
    agent.start()                                                  # the lock goes with the process
    assert [s.id for s in agent.unix().GetInventory(INV, timeout=30).shares] == ["kept"]


def _mig_config(tmp_path, layout: dict, gpu: int = GPU_MIG):
    """A mig-parted file with one config, "cfg", giving GPU ``gpu`` the MIG devices ``layout``."""
    path = tmp_path / "mig.yaml"
    path.write_text(json.dumps({"version": "v1", "mig-configs": {"cfg": [
        {"devices": [gpu], "mig-enabled": True, "mig-devices": layout}]}}))
    return str(path)


def test_cli_mig_config_goes_through_a_running_agent(agent, sim_machine, tmp_path):
    """With an agent answering, `mig config --apply` makes its changes by the agent's calls: the
    instances it creates are the agent's (journaled), and a share that a forced config destroys is
    reported lost to a forced MIG layout change, not to a MIG device destroyed outside fastshare."""
    agent.start()
    stub = agent.unix()
    backend = ["--gpu-backend", "sim", "--sim-state", str(sim_machine)]
    config = ["mig", "config", "--file", _mig_config(tmp_path, {"3g.40gb": 2}), "--select", "cfg", *backend]
    plan = json.loads(_run_cli(agent, *config, "--json"))
    assert plan["changed"] and not plan["applied"]
    assert not stub.GetInventory(INV, timeout=30).gpus[GPU_MIG].mig_devices
    applied = json.loads(_run_cli(agent, *config, "--apply", "--json"))
    assert [s["action"] for s in applied["gpus"][0]["steps"]] == ["create", "create"], applied
    assert applied["gpus"][0]["steps"][0]["description"] == \
        "create 3g.40gb (id 9) at start 0 (memory slices 0..3)"
    migs = stub.GetInventory(INV, timeout=30).gpus[GPU_MIG].mig_devices
    assert len(migs) == 2 and all(m.created_by_agent for m in migs)      # journaled: the agent made them
    assert json.loads(_run_cli(agent, *config, "--apply", "--json"))["changed"] is False

    mig = stub.PrepareShare(share("ex", "exclusive", [migs[0].gpu_uuid], mig_profile="3g.40gb", mig_start=0),
                            timeout=60).device_uuids[0]
    whole = ["mig", "config", "--file", _mig_config(tmp_path, {"7g.80gb": 1}), "--select", "cfg", *backend]
    for extra in ((), ("--apply",)):
        out = _run_cli(agent, *whole, *extra, ok=False)
        for says in (f"GPU {GPU_MIG}", mig, "held by fastshare share ex", "--force"):
            assert says in out, (says, out)
    forced = json.loads(_run_cli(agent, *whole, "--apply", "--force", "--json"))
    assert [s["action"] for s in forced["gpus"][0]["steps"]] == ["destroy", "destroy", "create"], forced
    lost = {s.id: s.reason for s in wait_for(lambda: stub.GetInventory(INV, timeout=30).lost_shares,
                                             what="the share reported lost")}
    assert list(lost) == ["ex"], lost
    assert "forced MIG layout change" in lost["ex"] and "outside fastshare" not in lost["ex"], lost


def test_cli_mig_config_force_enables_mig_under_a_whole_share_through_the_agent(agent, sim_machine, tmp_path):
    """`mig config --apply --force` on a GPU a share holds whole: through the agent its --force means
    what it means without one (SetMigMode with force): MIG comes on and the share is reported lost
    to the forced MIG mode change. Without --force it is refused, naming the share."""
    agent.start()
    stub = agent.unix()
    gpu = stub.GetInventory(INV, timeout=30).gpus[GPU_MIG].uuid
    stub.SetMigMode(agent_pb2.SetMigModeRequest(gpu_uuid=gpu, enabled=False), timeout=60)
    stub.PrepareShare(share("w", "whole", [gpu]), timeout=60)
    config = ["mig", "config", "--file", _mig_config(tmp_path, {"3g.40gb": 2}), "--select", "cfg", "--apply",
              "--gpu-backend", "sim", "--sim-state", str(sim_machine)]
    out = _run_cli(agent, *config, ok=False)
    for says in (f"GPU {GPU_MIG}", "held whole by fastshare share w", "--force"):
        assert says in out, (says, out)
    assert [s.id for s in stub.GetInventory(INV, timeout=30).shares] == ["w"]
    _run_cli(agent, *config, "--force")
    inv = stub.GetInventory(INV, timeout=30)
    assert inv.gpus[GPU_MIG].mig_enabled and list(inv.shares) == [], inv
    (lost,) = inv.lost_shares
    assert lost.id == "w" and "forced MIG mode change" in lost.reason, lost


@pytest.mark.parametrize("own_socket", [False, True])
def test_mig_commands_tell_an_agent_serving_elsewhere_from_one_starting(agent, sim_machine, tmp_path,
                                                                        own_socket):
    """An agent serving without a unix socket (TCP only), or on another one than the command was
    given, made every `fastshare mig` command say "it is starting ... retry once it answers" for
    good. The agent now says in its lock that it serves, and where: the refusal names that."""
    if not own_socket:
        agent.settings["unix_socket"] = ""
    agent.start()
    cli = _cli(agent, "mig", "plan", "--gpu", str(GPU_MIG), "--layout", "", "--gpu-backend", "sim",
               "--sim-state", str(sim_machine), "--unix-socket", str(tmp_path / "elsewhere.sock"),
               "--agent-journal", str(agent.workdir / "state" / "journal.db"))
    out = cli.communicate(timeout=120)[0]
    assert cli.returncode == 1, out
    assert f"a node agent (pid {agent.proc.pid}) serves on this host" in out, out
    assert "starting" not in out, out
    if own_socket:
        assert f"serving on {agent.unix_socket}" in out, out
        assert f"give its socket ({agent.unix_socket})" in out, out
    else:
        assert "serving on no unix socket" in out and "set unix_socket in its node.yaml" in out, out


def test_cli_mig_config_force_disables_mig_under_a_held_instance_through_the_agent(agent, sim_machine,
                                                                                   tmp_path):
    """`mig config --apply --force` with `mig-enabled: false` on a GPU whose MIG device a share holds:
    the plan was made with --force, but the agent was asked (PlanMigLayout, ApplyMigLayout) without
    it and refused, telling the user to use the --force just given. Now the instances go, MIG goes
    off and the share is reported lost to the forced change."""
    agent.start()
    stub, _, mig = _held_slice(agent)
    path = tmp_path / "off.yaml"
    path.write_text(json.dumps({"version": "v1", "mig-configs": {"off": [
        {"devices": [GPU_MIG], "mig-enabled": False}]}}))
    config = ["mig", "config", "--file", str(path), "--select", "off", "--apply",
              "--gpu-backend", "sim", "--sim-state", str(sim_machine)]
    out = _run_cli(agent, *config, ok=False)
    for says in (f"GPU {GPU_MIG}", mig, "held by fastshare share ex", "--force"):
        assert says in out, (says, out)
    forced = json.loads(_run_cli(agent, *config, "--force", "--json"))
    assert [s["action"] for s in forced["gpus"][0]["steps"]] == ["destroy", "destroy"], forced
    inv = stub.GetInventory(INV, timeout=30)
    assert not inv.gpus[GPU_MIG].mig_enabled and not inv.gpus[GPU_MIG].mig_devices, inv.gpus[GPU_MIG]
    lost = {s.id: s.reason for s in wait_for(lambda: stub.GetInventory(INV, timeout=30).lost_shares,
                                             what="the share reported lost")}
    assert list(lost) == ["ex"] and "forced MIG disable" in lost["ex"], lost   # one call: SetMigMode


def test_an_agent_waits_for_a_mig_change_made_without_it(agent, sim_machine, tmp_path):
    """`mig config --apply` with no agent running (the boot unit, the role with the agent stopped)
    holds the agent's state directory while it changes MIG: an agent started meanwhile waits for it
    (it failed after 2 s as if a second agent ran) and then reconciles what the change left."""
    from fastshare.node.config import MIG_CHANGE_NOTE

    state = agent.workdir / "state"
    hold = subprocess.Popen([str(BIN / "python"), "-c",
                             "import sys, time\nfrom fastshare.state_lock import StateDirLock\n"
                             "StateDirLock(sys.argv[1], 'node agent').acquire(note=sys.argv[2])\n"
                             "print('held', flush=True)\ntime.sleep(5)\n", str(state), MIG_CHANGE_NOTE],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "held"
        started = time.monotonic()
        agent.start()
        assert time.monotonic() - started >= 3, "the agent did not wait for the MIG change"
        assert hold.wait(timeout=30) == 0
    finally:
        hold.kill()
        hold.wait()
    assert "waiting up to" in agent.log.read_text() and MIG_CHANGE_NOTE in agent.log.read_text()
    assert agent.unix().GetInventory(INV, timeout=30).gpus
    # systemd's start timeout (180 s) must not run out during the wait (up to 150 s) and the reconcile
    extend = next(m for m in agent.notified if m.startswith("EXTEND_TIMEOUT_USEC="))
    assert int(extend.split("\n")[0].split("=")[1]) >= 300 * 10**6 and MIG_CHANGE_NOTE in extend, extend
