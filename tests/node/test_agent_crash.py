"""kill -9 at every step, then restart: the journal and the device are reconciled.

The agent dies through its own fault points (FASTSHARE_FAULT=<point> makes it SIGKILL itself
there), so every step boundary is hit deterministically."""

import signal

import grpc
import pytest

from fastshare.device import simnvml
from fastshare.mps.control import MpsControl
from fastshare.node import sharefiles
from fastshare.v1 import agent_pb2

from .harness import GPU_A, GPU_MIG, STANDIN, fastpod, rpc_error, share, wait_for

INV = agent_pb2.GetInventoryRequest()


def _inv(agent):
    return agent.unix().GetInventory(INV, timeout=30)


def _request(kind, uuids):
    if kind == "exclusive":
        return share("job", "exclusive", [uuids[GPU_MIG]], mig_profile="3g.40gb")
    return fastpod("job", uuids[GPU_A])


def _assert_clean(agent, devices, uuids):
    inv = _inv(agent)
    assert inv.shares == [] and inv.mps_daemons == [] and inv.share_files == []
    assert devices.mig_instances(GPU_MIG) == []
    assert MpsControl(STANDIN, agent.rundir / "mps").running_devices() == []
    assert sharefiles.read(agent.rundir / "shares", uuids[GPU_A]) == []


@pytest.mark.parametrize(("kind", "point"), [
    ("exclusive", "agent.after_share_journaled"),
    ("exclusive", "agent.after_mig_create"),
    ("fastpod", "agent.after_share_journaled"),
    ("fastpod", "agent.after_mps_start"),
    ("fastpod", "agent.after_share_files"),
])
def test_kill9_during_prepare_rolls_back_then_retry_succeeds(agent, devices, kind, point):
    agent.start(env={"FASTSHARE_FAULT": point})
    uuids = [g.uuid for g in _inv(agent).gpus]
    err = rpc_error(agent.unix().PrepareShare, _request(kind, uuids))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert agent.wait_exit() == -9
    agent.start()
    _assert_clean(agent, devices, uuids)
    reply = agent.unix().PrepareShare(_request(kind, uuids), timeout=60)
    assert reply.created and [s.id for s in _inv(agent).shares] == ["job"]


@pytest.mark.parametrize(("kind", "point"), [
    ("exclusive", "agent.after_release_journaled"),
    ("exclusive", "agent.after_mig_destroy"),
    ("fastpod", "agent.after_release_journaled"),
])
def test_kill9_during_release_is_finished_by_the_restart(agent, devices, kind, point):
    agent.start(env={"FASTSHARE_FAULT": point})
    uuids = [g.uuid for g in _inv(agent).gpus]
    agent.unix().PrepareShare(_request(kind, uuids), timeout=60)
    err = rpc_error(agent.unix().ReleaseShare, agent_pb2.ReleaseShareRequest(share_id="job"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert agent.wait_exit() == -9
    agent.start()
    _assert_clean(agent, devices, uuids)


@pytest.mark.parametrize("phase", ["prepare", "release"])
def test_kill9_on_the_one_commit_fast_path_rewrites_share_files(agent, phase):
    """With a daemon already serving the GPU, prepare/release of a fastpod is one journal
    commit then the share files; a crash between the two is repaired from the journal."""
    agent.start(env={"FASTSHARE_FAULT": "agent.after_share_committed"})
    gpu = _inv(agent).gpus[GPU_A].uuid
    agent.unix().PrepareShare(fastpod("resident", gpu), timeout=60)  # slow path: starts the daemon
    if phase == "release":
        agent.kill9()
        agent.start()
        agent.unix().PrepareShare(fastpod("job", gpu), timeout=60)  # fast path without the fault
        agent.kill9()
        agent.start(env={"FASTSHARE_FAULT": "agent.after_share_committed"})
        rpc_error(agent.unix().ReleaseShare, agent_pb2.ReleaseShareRequest(share_id="job"))
    else:
        rpc_error(agent.unix().PrepareShare, fastpod("job", gpu))
    assert agent.wait_exit() == -9
    agent.start()
    expected = ["resident", "job"] if phase == "prepare" else ["resident"]
    assert sorted(s.id for s in _inv(agent).shares) == sorted(expected)
    assert sorted(e.key for e in sharefiles.read(agent.rundir / "shares", gpu)) == sorted(expected)
    if phase == "prepare":  # the committed share is the answer to the retry
        assert not agent.unix().PrepareShare(fastpod("job", gpu), timeout=60).created


def test_orphan_destroyed_in_use_adopted_foreign_untouched(agent, devices, sim_machine):
    """Crash right after creating a MIG instance, twice: once while it is idle (orphan: destroyed),
    once after a process started on it (in use: adopted). An instance the agent did not create
    is never touched."""
    profiles = {p.name: p.profile_id for p in devices.mig_profiles(GPU_MIG)}
    foreign = devices.create_mig_instance(GPU_MIG, profiles["1g.10gb"], 0)
    agent.start(env={"FASTSHARE_FAULT": "agent.after_mig_create"})
    uuids = [g.uuid for g in _inv(agent).gpus]
    rpc_error(agent.unix().PrepareShare, share("idle", "exclusive", [uuids[GPU_MIG]], mig_profile="3g.40gb",
                                               mig_start=4))
    assert agent.wait_exit() == -9
    assert {m.start for m in devices.mig_instances(GPU_MIG)} == {0, 4}

    agent.start(env={"FASTSHARE_FAULT": "agent.after_mig_create"})  # reconciles, then crashes again
    assert {m.start for m in devices.mig_instances(GPU_MIG)} == {0}  # orphan destroyed, foreign kept
    rpc_error(agent.unix().PrepareShare, share("busy", "exclusive", [uuids[GPU_MIG]], mig_profile="2g.20gb",
                                               mig_start=2))
    assert agent.wait_exit() == -9
    (busy,) = [m for m in devices.mig_instances(GPU_MIG) if m.start == 2]
    simnvml.add_process(sim_machine, GPU_MIG, mig_uuid=busy.uuid)  # the workload started anyway

    agent.start()
    by_start = {m.start: m for m in _inv(agent).gpus[GPU_MIG].mig_devices}
    assert set(by_start) == {0, 2}
    assert by_start[0].uuid == foreign.uuid and not by_start[0].created_by_agent
    assert by_start[2].uuid == busy.uuid and by_start[2].created_by_agent and by_start[2].share_id == "busy"
    retry = agent.unix().PrepareShare(share("busy", "exclusive", [uuids[GPU_MIG]], mig_profile="2g.20gb",
                                            mig_start=2), timeout=60)
    assert not retry.created and list(retry.device_uuids) == [busy.uuid]


def test_prepared_shares_survive_kill9_and_busy_instances_outlive_their_release(agent, devices, sim_machine):
    agent.settings["reconcile_interval_s"] = 1
    agent.start()
    uuids = [g.uuid for g in _inv(agent).gpus]
    ex = agent.unix().PrepareShare(share("ex", "exclusive", [uuids[GPU_MIG]], mig_profile="3g.40gb"),
                                   timeout=60)
    fp = agent.unix().PrepareShare(fastpod("fp", uuids[GPU_A]), timeout=60)
    mps = MpsControl(STANDIN, agent.rundir / "mps")
    daemon_pid = mps.daemon_pid(uuids[GPU_A])
    pid = simnvml.add_process(sim_machine, GPU_MIG, mig_uuid=ex.device_uuids[0])
    agent.kill9()

    agent.start()
    inv = _inv(agent)
    assert {s.id for s in inv.shares} == {"ex", "fp"}
    assert [m.uuid for m in devices.mig_instances(GPU_MIG)] == list(ex.device_uuids)
    assert mps.daemon_pid(uuids[GPU_A]) == daemon_pid  # adopted, not restarted
    assert [e.key for e in sharefiles.read(agent.rundir / "shares", uuids[GPU_A])] == ["fp"]
    again = agent.unix().PrepareShare(fastpod("fp", uuids[GPU_A]), timeout=60)
    assert not again.created and again.port == fp.port

    reply = agent.unix().ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="ex"), timeout=60)
    assert reply.released and list(reply.destroyed_mig_devices) == []  # busy: kept until idle
    (kept,) = _inv(agent).gpus[GPU_MIG].mig_devices
    assert kept.created_by_agent and kept.share_id == ""
    simnvml.remove_process(sim_machine, pid)
    wait_for(lambda: devices.mig_instances(GPU_MIG) == [], what="idle orphan destroyed by housekeeping")


def test_sigterm_keeps_mps_daemons_and_restart_adopts_them(agent):
    agent.start()
    gpu = _inv(agent).gpus[GPU_A].uuid
    agent.unix().PrepareShare(fastpod("fp", gpu), timeout=60)
    mps = MpsControl(STANDIN, agent.rundir / "mps")
    pid = mps.daemon_pid(gpu)
    agent.stop()
    assert mps.answers(gpu)  # workloads keep their MPS daemon while the agent restarts
    agent.start()
    assert mps.daemon_pid(gpu) == pid
    assert _inv(agent).mps_daemons[0].healthy


def test_sigterm_during_a_prepare_lets_it_journal_before_the_journal_closes(agent, tmp_path):
    """SIGTERM while a prepare starts an MPS daemon (here a slow one): the call, cancelled for
    its caller after the grace, goes on in its thread. The journal closed under it (the daemon
    started, "Cannot operate on a closed database" when it was written down); now the agent waits
    for it, and the restart finds the share and its daemon as the journal says."""
    slow, started = tmp_path / "slow-mps-control", tmp_path / "daemon-starting"
    slow.write_text(f'#!/bin/sh\n[ "$1" = -d ] && touch {started} && sleep 8\nexec {STANDIN} "$@"\n')
    slow.chmod(0o755)
    agent.settings["mps_control_binary"] = str(slow)
    agent.start()
    gpu = _inv(agent).gpus[GPU_A].uuid
    call = agent.unix().PrepareShare.future(fastpod("fp", gpu), timeout=60)
    wait_for(started.exists, what="the prepare starting the MPS daemon")
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait_exit(timeout=60) == 0
    assert call.exception() is not None and call.code() == grpc.StatusCode.UNAVAILABLE
    assert "Traceback" not in agent.log.read_text(), agent.log.read_text()[-5000:]
    agent.settings["mps_control_binary"] = STANDIN
    agent.start()
    inv = _inv(agent)
    assert [s.id for s in inv.shares] == ["fp"]
    assert [d.healthy for d in inv.mps_daemons] == [True]


def test_dead_mps_daemon_is_restarted_by_housekeeping(agent):
    agent.settings["reconcile_interval_s"] = 1
    agent.start()
    gpu = _inv(agent).gpus[GPU_A].uuid
    agent.unix().PrepareShare(fastpod("fp", gpu), timeout=60)
    mps = MpsControl(STANDIN, agent.rundir / "mps")
    old = mps.daemon_pid(gpu)
    mps.command(gpu, "quit")  # the daemon dies behind the agent's back
    wait_for(lambda: mps.answers(gpu) and mps.daemon_pid(gpu) != old, what="MPS daemon restarted")


def test_damaged_journal_is_refused_and_left_as_it_was(agent):
    """The journal is the only record of what the agent made: never start over silently."""
    agent.start()
    agent.stop()
    journal = agent.workdir / "state" / "journal.db"
    journal.write_bytes(b"\x00garbage" * 512)
    for extra in ("-wal", "-shm"):
        journal.with_name(journal.name + extra).unlink(missing_ok=True)
    before = journal.read_bytes()
    agent.start(wait_ready=False)
    assert agent.wait_exit() != 0
    log = agent.log.read_text().split("---- start")[-1]
    assert "node agent journal" in log and "is damaged" in log and "Traceback" not in log
    assert journal.read_bytes() == before


@pytest.mark.parametrize("restarted_by", ["housekeeping", "agent start"])
def test_compute_mode_is_restored_after_the_daemon_was_restarted(agent, devices, restarted_by):
    """MPS switches a GPU to EXCLUSIVE_PROCESS and its last release switches it back. A daemon
    that died and was started again must not forget that the switch was the agent's: the GPU
    stayed in EXCLUSIVE_PROCESS (one process at a time) after every share had left."""
    agent.settings["reconcile_interval_s"] = 1 if restarted_by == "housekeeping" else 3600
    agent.start()
    gpu = _inv(agent).gpus[GPU_A].uuid
    agent.unix().PrepareShare(fastpod("fp", gpu), timeout=60)
    assert devices.gpus()[GPU_A].compute_mode == "EXCLUSIVE_PROCESS"
    mps = MpsControl(STANDIN, agent.rundir / "mps")
    old = mps.daemon_pid(gpu)
    if restarted_by == "agent start":
        agent.kill9()
    mps.command(gpu, "quit")  # the daemon dies
    if restarted_by == "agent start":
        agent.start()
    wait_for(lambda: mps.answers(gpu) and mps.daemon_pid(gpu) != old, what="MPS daemon restarted")
    reply = agent.unix().ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="fp"), timeout=60)
    assert list(reply.stopped_mps_daemons) == [gpu]
    assert devices.gpus()[GPU_A].compute_mode == "DEFAULT"


def test_an_idle_agent_instance_is_not_destroyed_under_the_share_that_took_it(agent, devices, sim_machine):
    """An instance kept after a busy release (destroyed once idle) can be taken by a new share at
    its placement, or an MPS share on its MIG device; the next reconcile destroyed it under that
    live share (its workload lost its GPU) because only running processes counted as use."""
    agent.start()
    gpu = _inv(agent).gpus[GPU_MIG].uuid
    stub = agent.unix()

    def exclusive(share_id):
        return share(share_id, "exclusive", [gpu], mig_profile="3g.40gb", mig_start=4)

    first = stub.PrepareShare(exclusive("first"), timeout=60)
    (mig,) = first.device_uuids
    pid = simnvml.add_process(sim_machine, GPU_MIG, mig_uuid=mig)
    assert list(stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="first"),
                                  timeout=60).destroyed_mig_devices) == []
    simnvml.remove_process(sim_machine, pid)
    second = stub.PrepareShare(exclusive("second"), timeout=60)
    assert list(second.device_uuids) == [mig]  # the idle instance at that placement, taken

    agent.stop()
    agent.start()  # reconcile
    assert [m.uuid for m in devices.mig_instances(GPU_MIG)] == [mig]
    assert [(s.id, list(s.device_uuids)) for s in _inv(agent).shares] == [("second", [gpu])]

    agent.unix().ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="second"), timeout=60)
    agent.unix().PrepareShare(fastpod("on-mig", mig, sm=50, mem_gib=8), timeout=60)
    agent.stop()
    agent.start()
    assert [m.uuid for m in devices.mig_instances(GPU_MIG)] == [mig]

    agent.unix().ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="on-mig"), timeout=60)
    agent.stop()
    agent.start()  # nothing holds it any more: the idle orphan goes
    assert devices.mig_instances(GPU_MIG) == []


def test_kill9_right_after_the_compute_mode_switch_still_switches_it_back(agent, devices):
    """The agent switched the GPU to EXCLUSIVE_PROCESS before its journal said so: killed in
    between, the restart saw EXCLUSIVE_PROCESS, took it for the GPU's own mode, and left the GPU
    (one process at a time) in it once the share was rolled back."""
    agent.start(env={"FASTSHARE_FAULT": "agent.after_compute_mode"})
    uuids = [g.uuid for g in _inv(agent).gpus]
    err = rpc_error(agent.unix().PrepareShare, fastpod("job", uuids[GPU_A]))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert agent.wait_exit() == -9
    assert devices.gpus()[GPU_A].compute_mode == "EXCLUSIVE_PROCESS"
    agent.start()
    _assert_clean(agent, devices, uuids)
    assert devices.gpus()[GPU_A].compute_mode == "DEFAULT"


def test_shares_on_a_gpu_swapped_while_the_agent_was_down_are_dropped(agent, devices, sim_machine):
    """Two GPUs replaced while the host was down (same slots, new UUIDs): an exclusive share's
    GPU (the MIG one, with its instance) and a fastpod's. The agent kept both shares ready for
    good (the exclusive one failed its reconcile step at every start, the fastpod's daemon could
    never start), so the controller saw healthy allocations on GPUs that no longer exist. Now
    they are dropped with the journal rows of their GPUs, and the node ends up clean."""
    import json

    agent.start()
    uuids = [g.uuid for g in _inv(agent).gpus]
    agent.unix().PrepareShare(share("ex", "exclusive", [uuids[GPU_MIG]], mig_profile="3g.40gb"), timeout=60)
    agent.unix().PrepareShare(fastpod("fp", uuids[GPU_A]), timeout=60)
    agent.stop()
    simnvml.reboot(sim_machine)
    data = json.loads(sim_machine.read_text())
    for index in (GPU_MIG, GPU_A):
        data["gpus"][index]["uuid"] = f"GPU-0000000{index}-1111-2222-3333-444444444444"
    sim_machine.write_text(json.dumps(data))

    agent.start()
    new = [g.uuid for g in _inv(agent).gpus]
    _assert_clean(agent, devices, new)
    assert "FAILED" not in agent.log.read_text().split("---- start")[-1]


def test_kill9_between_a_forced_destroy_and_the_drop_still_reports_the_forced_layout(agent, devices):
    """A forced layout destroyed a slice a share held, and the agent was killed before it dropped
    the share: the cause was only in the agent's memory, so the restart reported the share lost as
    "destroyed outside fastshare (by hand ...)". The cause is journaled before the destroy."""
    agent.start(env={"FASTSHARE_FAULT": "agent.after_layout_destroy"})
    stub = agent.unix()
    gpu = _inv(agent).gpus[GPU_MIG].uuid
    stub.ApplyMigLayout(agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles={"3g.40gb": 2}), timeout=60)
    mig = stub.PrepareShare(share("ex", "exclusive", [gpu], mig_profile="3g.40gb", mig_start=0),
                            timeout=60).device_uuids[0]
    err = rpc_error(stub.ApplyMigLayout, agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles={"7g.80gb": 1},
                                                                    force=True))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert agent.wait_exit() == -9
    assert mig not in {m.uuid for m in devices.mig_instances(GPU_MIG)}   # destroyed, share not dropped

    agent.start()
    inv = _inv(agent)
    lost = {s.id: s.reason for s in inv.lost_shares}
    assert list(lost) == ["ex"] and list(inv.shares) == [], inv
    assert "forced MIG layout change to 7g.80gb=1" in lost["ex"], lost
    assert "outside fastshare" not in lost["ex"] and mig in lost["ex"], lost


def test_kill9_between_a_forced_mig_enable_and_the_drop_still_drops_the_share_saying_so(agent, devices):
    """MIG enabled by force under a share that held the GPU whole, the agent killed before it dropped
    the share: nothing else notices a whole share on a MIG GPU, so it stayed ready for good. The
    cause is journaled before the change; the restart drops the share with it."""
    devices.set_mig_mode(GPU_MIG, False)                                   # H100: at once
    agent.start(env={"FASTSHARE_FAULT": "agent.after_mig_mode"})
    stub = agent.unix()
    gpu = _inv(agent).gpus[GPU_MIG].uuid
    stub.PrepareShare(share("w", "whole", [gpu]), timeout=60)
    err = rpc_error(stub.SetMigMode, agent_pb2.SetMigModeRequest(gpu_uuid=gpu, enabled=True, force=True))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert agent.wait_exit() == -9
    assert devices.gpus()[GPU_MIG].mig_current

    agent.start()
    inv = _inv(agent)
    lost = {s.id: s.reason for s in inv.lost_shares}
    assert list(lost) == ["w"] and list(inv.shares) == [], inv
    assert "forced MIG mode change" in lost["w"] and gpu in lost["w"], lost
