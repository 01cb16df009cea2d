"""The agent in process, where an interleaving or a failure is forced: housekeeping racing the
requests it must not undo, and a release that fails half-way."""

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastshare.device import simnvml
from fastshare.node import sharefiles
from fastshare.node.agent import Agent, AgentError, Deadline
from fastshare.node.journal import Journal
from fastshare.node.layout import apply_layout
from fastshare.node.model import ShareSpec

from .harness import GPU_A, GPU_MIG, in_process_agent


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    run = Path(tempfile.mkdtemp(prefix="fsh-", dir="/tmp"))
    machine = tmp_path / "m.json"
    simnvml.create_machine(machine, ["H100-SXM5-80GB", "V100-SXM2-32GB"], mig_enabled=True)
    agent = in_process_agent(tmp_path, run, machine)
    try:
        yield agent
    finally:
        for device in agent.mps.running_devices():
            agent.mps.stop(device)
        agent.journal.close()
        shutil.rmtree(run, ignore_errors=True)


def _fastpod(agent: Agent, share_id: str) -> ShareSpec:
    gpu = agent.devices.gpus()[GPU_A].uuid
    return ShareSpec(share_id, "fastpod", (gpu,), sm_percent=20, memory_bytes=1 << 30, quota_request=0.2,
                     quota_limit=0.5)


def test_a_daemon_stopped_by_the_last_release_is_not_restarted_by_housekeeping(agent):
    """Housekeeping saw the daemon not answering because the last share's release was stopping
    it, then started a new one: a daemon serving no share, and the GPU left in EXCLUSIVE_PROCESS."""
    agent.prepare(_fastpod(agent, "fp"), Deadline(60))
    answers = agent.mps.answers

    def release_while_checked(device_uuid, timeout=None):
        agent.mps.answers = answers            # once: the release runs right here
        agent.release("fp", Deadline(60))
        return answers(device_uuid, timeout)

    agent.mps.answers = release_while_checked
    agent.housekeeping()
    assert agent.mps.running_devices() == [] and agent.journal.mps_daemons() == []
    assert agent.devices.gpus()[GPU_A].compute_mode == "DEFAULT"


def test_a_release_that_fails_half_way_keeps_the_share_port(agent):
    """The share stays 'releasing' (retried later) and may still be served on its port: a new
    fastpod must not be handed the same port meanwhile."""
    old, _ = agent.prepare(_fastpod(agent, "fp-old"), Deadline(60))
    stop = agent._stop_mps_if_unused

    def failing_stop(*args, **kwargs):
        agent._stop_mps_if_unused = stop       # once
        raise AgentError("UNAVAILABLE", "MPS daemon does not stop")

    agent._stop_mps_if_unused = failing_stop
    with pytest.raises(AgentError):
        agent.release("fp-old", Deadline(60))
    assert agent.journal.share("fp-old").state == "releasing"
    new, _ = agent.prepare(_fastpod(agent, "fp-new"), Deadline(60))
    assert new.port != old.port
    agent.release("fp-old", Deadline(60))      # the retry frees it
    agent.release("fp-new", Deadline(60))
    again, _ = agent.prepare(_fastpod(agent, "fp-again"), Deadline(60))
    assert again.port == old.port              # freed once the release completed


def test_named_locks_exclude_across_comings_and_goings_and_are_forgotten_after():
    """Share-id locks come and go with their ids: a lock must never be dropped while someone
    waits for it (two requests on one id would run side by side), and must not outlive its users."""
    from fastshare.node.agent import _Locks

    locks = _Locks("share")
    inside: dict[str, int] = {}
    overlaps: list[str] = []
    guard = threading.Lock()

    def worker(seed: int) -> None:
        for i in range(300):
            name = f"s{(seed + i) % 3}"
            with locks.hold(name, Deadline(30)):
                with guard:
                    inside[name] = inside.get(name, 0) + 1
                    if inside[name] > 1:
                        overlaps.append(name)
                time.sleep(0)
                with guard:
                    inside[name] -= 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert overlaps == []
    assert locks._locks == {}
    with locks.hold("s0", Deadline(1)), pytest.raises(AgentError, match="stayed busy"):
        locks.hold("s0", Deadline(0.05))     # a waiter that gives up leaves nothing behind
    assert locks._locks == {}


def test_an_instance_destroyed_outside_the_agent_does_not_block_its_placement(agent):
    """An operator destroyed the agent's MIG instance by hand (nvidia-smi mig -dci/-dgi): the
    journal still names it. A new exclusive share at that placement must get a fresh instance,
    not an internal error that leaves the new share half-prepared."""
    gpu = agent.devices.gpus()[GPU_MIG]
    first, _ = agent.prepare(ShareSpec("ex-1", "exclusive", (gpu.uuid,), mig_profile="3g.40gb", mig_start=0),
                             Deadline(60))
    agent.devices.destroy_mig_instance(gpu.index, 0)        # behind the agent's back
    second, created = agent.prepare(ShareSpec("ex-2", "exclusive", (gpu.uuid,), mig_profile="3g.40gb",
                                              mig_start=0), Deadline(60))
    assert created and second.device_uuids != first.device_uuids
    assert [m.start for m in agent.devices.mig_instances(gpu.index)] == [0]
    assert agent.journal.share("ex-2").state == "ready"
    agent.release("ex-1", Deadline(60))                     # its instance is long gone: nothing to do
    assert [m.start for m in agent.devices.mig_instances(gpu.index)] == [0]
    agent.release("ex-2", Deadline(60))
    assert agent.devices.mig_instances(gpu.index) == [] and agent.journal.migs(gpu.uuid) == []


def test_a_layout_is_applied_over_an_instance_destroyed_outside_the_agent(agent):
    gpu = agent.devices.gpus()[GPU_MIG]
    spec = ShareSpec("ex-1", "exclusive", (gpu.uuid,), mig_profile="3g.40gb", mig_start=0)
    agent.prepare(spec, Deadline(60))
    agent.devices.destroy_mig_instance(gpu.index, 0)        # behind the agent's back
    apply_layout(agent, gpu.uuid, {"3g.40gb": 2}, force=False, apply=True, deadline=Deadline(60))
    assert sorted(m.start for m in agent.devices.mig_instances(gpu.index)) == [0, 4]
    journaled = sorted((m.start, m.purpose) for m in agent.journal.migs(gpu.uuid))
    assert journaled == [(0, "layout"), (4, "layout")]


def test_a_daemon_adopted_after_a_crash_is_uncapped_for_a_share_without_a_memory_limit(agent):
    """A crash left the daemon's row 'starting' while the daemon runs, capped for the earlier
    shares. The next share asks for no memory limit: adopting the daemon must lift its cap, as
    joining a running one does."""
    gpu = agent.devices.gpus()[GPU_A]
    agent.prepare(ShareSpec("capped", "mps", (gpu.uuid,), memory_bytes=2 << 30), Deadline(60))
    assert agent.mps.command(gpu.uuid, "get_default_device_pinned_mem_limit 0").strip() == "2048M"
    agent.journal.update_mps(gpu.uuid, state="starting")    # as a crash before 'running' leaves it
    agent.prepare(ShareSpec("unlimited", "mps", (gpu.uuid,)), Deadline(60))
    limit = agent.mps.command(gpu.uuid, "get_default_device_pinned_mem_limit 0").strip()
    assert limit == f"{gpu.memory_mib}M"
    assert agent.journal.mps(gpu.uuid).mem_ceiling is None


def test_a_new_mig_instance_is_not_handed_to_a_second_share_before_the_first_is_ready(agent):
    """The new instance was recorded 'ready' and the GPU's lock let go while its share still
    named the GPU (not the MIG device): a second exclusive share asking for that placement found
    an idle instance no share held and bound it too, two workloads on one MIG device."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    first = ShareSpec("ex-1", "exclusive", (gpu,), mig_profile="1g.10gb", mig_start=3)
    second = ShareSpec("ex-2", "exclusive", (gpu,), mig_profile="1g.10gb", mig_start=3)
    refresh = agent.refresh_devices
    errors = []

    def second_request_meanwhile():
        agent.refresh_devices = refresh        # once: the second request runs right here
        try:
            agent.prepare(second, Deadline(60))
        except AgentError as exc:
            errors.append(exc)
        return refresh()

    agent.refresh_devices = second_request_meanwhile
    prepared, _ = agent.prepare(first, Deadline(60))
    assert [e.code for e in errors] == ["RESOURCE_EXHAUSTED"], "the second share got the same MIG device"
    assert agent.journal.share("ex-2") is None
    assert agent.journal.share("ex-1").device_uuid == prepared.device_uuids[0]


def test_housekeeping_does_not_take_a_new_exclusive_share_for_an_orphan(agent):
    """Housekeeping read the live shares before the MIG rows: an exclusive share prepared in
    between had its instance counted as an orphan, 'kept because in use' and unlinked from the
    share, so the share's release no longer destroyed it."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    spec = ShareSpec("ex", "exclusive", (gpu,), mig_profile="1g.10gb")
    migs = agent.journal.migs

    def prepare_meanwhile(gpu_uuid=None):
        agent.journal.migs = migs              # once: the prepare runs right here
        agent.prepare(spec, Deadline(60))
        return migs(gpu_uuid)

    agent.journal.migs = prepare_meanwhile
    agent.housekeeping()
    assert [m.share_id for m in agent.journal.migs()] == ["ex"]
    result = agent.release("ex", Deadline(60))
    assert len(result.destroyed_mig_devices) == 1
    assert agent.devices.mig_instances(GPU_MIG) == []


def test_mig_profiles_are_read_again_once_mig_mode_changes(tmp_path, monkeypatch):
    """The agent read a GPU's MIG profiles once: with MIG disabled NVML has none and only the
    catalog knows the model's, so on a GPU the catalog does not know, enabling MIG through the
    agent left it with no profiles (every exclusive share: "profiles: none") until a restart."""
    from fastshare.device import nvml_backend

    monkeypatch.setattr(nvml_backend.catalog, "find_model", lambda name: None)  # a model the catalog lacks
    run = Path(tempfile.mkdtemp(prefix="fsh-", dir="/tmp"))
    machine = tmp_path / "m.json"
    simnvml.create_machine(machine, ["H100-SXM5-80GB"], mig_enabled=False)
    agent = in_process_agent(tmp_path, run, machine)
    try:
        gpu = agent.devices.gpus()[0].uuid
        assert agent.set_mig_mode(gpu, True, Deadline(60)) == (False, True, [])   # Hopper: at once
        spec = ShareSpec("ex", "exclusive", (gpu,), mig_profile="1g.10gb")
        prepared, _ = agent.prepare(spec, Deadline(60))
        assert prepared.device_uuids[0].startswith("MIG-")
    finally:
        agent.journal.close()
        shutil.rmtree(run, ignore_errors=True)


@pytest.mark.parametrize("field", ["id", "device"])
def test_a_trailing_newline_is_refused_as_invalid(agent, field):
    """The share id and device patterns ended in '$', which also matches before a final newline:
    on a GPU whose daemon already ran, a fastpod 'fp\\n' was journaled, then its share files
    could not be written (a key with whitespace): INTERNAL, and every later fastpod on that GPU
    was journaled without its files, failing the same way."""
    gpu = agent.devices.gpus()[GPU_A].uuid
    spec = _fastpod(agent, "fp\n" if field == "id" else "fp")
    if field == "device":
        spec = ShareSpec("fp", "fastpod", (gpu + "\n",), sm_percent=20, memory_bytes=1 << 30,
                         quota_request=0.2, quota_limit=0.5)
    with pytest.raises(AgentError) as refused:
        agent.prepare(spec, Deadline(60))
    assert refused.value.code == "INVALID_ARGUMENT"
    assert f"share.{'id' if field == 'id' else 'device_uuids'}" in str(refused.value)
    assert agent.journal.shares() == []
    agent.prepare(_fastpod(agent, "fp"), Deadline(60))    # the device still takes shares


def test_an_mps_share_is_not_prepared_on_a_mig_device_destroyed_meanwhile(agent):
    """An MPS share on a MIG device looked the device up, then locked only the MIG device: a
    layout change (or the destruction of an idle orphan) under the GPU's lock in between
    destroyed it, and the share was made ready, with its daemon, on a device that was gone."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    apply_layout(agent, gpu, {"3g.40gb": 1}, False, True, Deadline(60))
    (mig,) = [m.uuid for m in agent.devices.mig_instances(GPU_MIG)]
    device = agent._device

    def destroyed_meanwhile(device_uuid):
        agent._device = device                 # once: the layout change runs right here
        view = device(device_uuid)
        apply_layout(agent, gpu, {}, False, True, Deadline(60))
        return view

    agent._device = destroyed_meanwhile
    spec = ShareSpec("on-mig", "mps", (mig,), memory_bytes=1 << 30)
    with pytest.raises(AgentError) as refused:
        agent.prepare(spec, Deadline(60))
    assert refused.value.code == "NOT_FOUND" and mig in str(refused.value)
    assert agent.journal.shares() == [] and agent.mps.running_devices() == []


def test_an_mps_share_whose_mig_device_is_gone_is_dropped_at_start(agent, tmp_path):
    """MIG devices do not survive a reboot or a GPU reset. An exclusive share whose device was
    gone was dropped at start; an MPS or fastpod share on a MIG device stayed 'ready' forever
    (in the inventory, holding its port, its daemon failing to start at every start)."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    apply_layout(agent, gpu, {"3g.40gb": 1}, False, True, Deadline(60))
    (mig,) = [m.uuid for m in agent.devices.mig_instances(GPU_MIG)]
    agent.prepare(ShareSpec("fp", "fastpod", (mig,), sm_percent=50, memory_bytes=1 << 30,
                            quota_request=0.5, quota_limit=1.0), Deadline(60))
    agent.journal.close()
    simnvml.reboot(agent.config.sim_state)
    restarted = in_process_agent(tmp_path, Path(agent.config.run_dir), Path(agent.config.sim_state))
    agent.journal = restarted.journal           # the fixture closes this one
    assert restarted.journal.shares() == [] and restarted.journal.mps_daemons() == []
    assert restarted.mps.running_devices() == []
    assert sharefiles.devices(restarted.config.share_root) == []


def _lost(agent: Agent) -> dict[str, str]:
    return {x.id: x.reason for x in agent.journal.lost_shares()}


def test_a_fastpod_share_on_a_mig_device_destroyed_by_hand_is_dropped_while_the_agent_runs(agent):
    """Only a start noticed that a held share's device was gone: meanwhile the share stayed ready,
    its MPS daemon and share files stayed, and the controller was told nothing. Now housekeeping
    drops it, frees what it held and records it as lost with why, until its id is released."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    apply_layout(agent, gpu, {"3g.40gb": 1}, False, True, Deadline(60))
    (instance,) = agent.devices.mig_instances(GPU_MIG)
    mig = instance.uuid
    spec = ShareSpec("fp", "fastpod", (mig,), sm_percent=50, memory_bytes=1 << 30, quota_request=0.5,
                     quota_limit=1.0, owner="team/a")
    prepared, _ = agent.prepare(spec, Deadline(60))
    assert agent.mps.running_devices() == [mig] and sharefiles.devices(agent.config.share_root) == [mig]
    generation = agent.generation

    agent.devices.destroy_mig_instance(GPU_MIG, instance.start)   # nvidia-smi mig -dci/-dgi
    agent.housekeeping()
    assert agent.journal.shares() == [] and agent.journal.mps_daemons() == []
    assert agent.mps.running_devices() == [] and sharefiles.devices(agent.config.share_root) == []
    assert agent.generation > generation                    # Watch wakes up
    (lost,) = agent.snapshot().lost_shares
    assert (lost.id, lost.device_uuid, lost.owner) == ("fp", mig, "team/a")
    assert mig in lost.reason and "destroyed outside fastshare" in lost.reason, lost.reason
    # its port is free again, and a release of its id forgets it
    other = agent.devices.gpus()[GPU_A].uuid
    again, _ = agent.prepare(ShareSpec("fp-2", "fastpod", (other,), sm_percent=50, memory_bytes=1 << 30,
                                       quota_request=0.5, quota_limit=1.0), Deadline(60))
    assert again.port == prepared.port
    assert agent.release("fp", Deadline(60)).released and _lost(agent) == {}
    assert not agent.release("fp", Deadline(60)).released


def test_a_lost_exclusive_share_leaves_an_instance_laid_out_in_its_place_alone(agent):
    """The slice of an exclusive share destroyed by hand and one of the same profile created at the
    same place: the share is dropped and its journal rows forgotten, but the new instance, not the
    agent's, is not destroyed (a rollback destroyed whatever idle instance sat at the place)."""
    gpu = agent.devices.gpus()[GPU_MIG]
    spec = ShareSpec("ex", "exclusive", (gpu.uuid,), mig_profile="3g.40gb", mig_start=0)
    prepared, _ = agent.prepare(spec, Deadline(60))
    agent.devices.destroy_mig_instance(gpu.index, 0)
    foreign = agent.devices.create_mig_instance(gpu.index, prepared_profile(agent, gpu.uuid), 0)

    agent.housekeeping()
    assert agent.journal.shares() == [] and agent.journal.migs() == []
    assert [m.uuid for m in agent.devices.mig_instances(gpu.index)] == [foreign.uuid]
    reason = _lost(agent)["ex"]
    assert prepared.device_uuids[0] in reason and f"slice 0 of GPU {gpu.uuid}" in reason, reason
    # the controller prepares a pending record again: the lost record goes, a share is made
    again, created = agent.prepare(ShareSpec("ex", "exclusive", (gpu.uuid,), mig_profile="3g.40gb"),
                                   Deadline(60))
    assert created and _lost(agent) == {} and again.device_uuids != prepared.device_uuids


def prepared_profile(agent: Agent, gpu_uuid: str) -> int:
    return next(p.profile_id for p in agent._profiles[gpu_uuid] if p.name == "3g.40gb")


def test_housekeeping_does_not_drop_a_share_prepared_after_it_read_the_devices(agent):
    """An exclusive share whose instance was made after housekeeping read the devices: by that
    read its MIG device does not exist. It must be read again, not the share dropped."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    spec = ShareSpec("ex", "exclusive", (gpu,), mig_profile="1g.10gb")
    refresh = agent.refresh_devices

    def prepare_after_the_read():
        agent.refresh_devices = refresh        # once: the prepare runs right after this read
        before = refresh()
        agent.prepare(spec, Deadline(60))
        agent._gpus = before                   # as housekeeping read them
        return before

    agent.refresh_devices = prepare_after_the_read
    agent.housekeeping()
    assert agent.journal.share("ex").state == "ready" and _lost(agent) == {}
    assert len(agent.devices.mig_instances(GPU_MIG)) == 1


def test_a_share_lost_at_start_is_recorded_as_lost(agent, tmp_path):
    """The start drops a ready share whose device went away while the agent was down, as
    housekeeping does, and records why: the controller ends its allocation instead of preparing
    it again on another device than its workload was given."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    agent.prepare(ShareSpec("ex", "exclusive", (gpu,), mig_profile="1g.10gb"), Deadline(60))
    agent.journal.close()
    simnvml.reboot(agent.config.sim_state)
    restarted = in_process_agent(tmp_path, Path(agent.config.run_dir), Path(agent.config.sim_state))
    agent.journal = restarted.journal           # the fixture closes this one
    assert restarted.journal.shares() == [] and restarted.journal.migs() == []
    assert "destroyed outside fastshare" in _lost(restarted)["ex"]


def test_a_lost_gpu_drops_its_shares_only_and_is_logged_once(agent, tmp_path, caplog):
    """GPU 0 falls off the bus (NVML_ERROR_GPU_IS_LOST) with an MPS share on one of its MIG devices,
    while GPU 1 holds a fastpod share. The device read failed as a whole, so housekeeping failed
    every round and nothing was dropped. Now the share on the lost GPU is dropped as lost naming
    the GPU, GPU 1's stays and takes new shares, a prepare on the lost GPU is refused, the loss is
    logged once, and an agent started while the GPU is lost starts."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    apply_layout(agent, gpu, {"3g.40gb": 1}, False, True, Deadline(60))
    (mig,) = [m.uuid for m in agent.devices.mig_instances(GPU_MIG)]
    agent.prepare(ShareSpec("on-lost", "mps", (mig,), memory_bytes=1 << 30, owner="team/a"), Deadline(60))
    agent.prepare(_fastpod(agent, "kept"), Deadline(60))

    simnvml.lose_gpu(agent.config.sim_state, GPU_MIG)
    agent.housekeeping()
    agent.housekeeping()
    assert [r.spec.id for r in agent.journal.shares()] == ["kept"]
    reason = _lost(agent)["on-lost"]
    assert gpu in reason and "lost (fell off the bus?)" in reason and "GPU_IS_LOST" in reason, reason
    assert agent.mps.running_devices() == [agent.devices.gpus()[GPU_A].uuid]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and f"GPU 0 ({gpu}) is lost" in errors[0] and "reboot" in errors[0], errors
    snapshot = agent.snapshot()
    assert [g.lost for g in snapshot.gpus] == ["GPU_IS_LOST", ""]
    for spec in (ShareSpec("new", "mps", (mig,), memory_bytes=1 << 30),
                 ShareSpec("ex", "exclusive", (gpu,), mig_profile="1g.10gb")):
        with pytest.raises(AgentError) as refused:
            agent.prepare(spec, Deadline(60))
        assert refused.value.code == "FAILED_PRECONDITION" and "is lost" in str(refused.value), refused.value
    agent.prepare(_fastpod(agent, "more"), Deadline(60))

    agent.journal.close()
    restarted = in_process_agent(tmp_path, Path(agent.config.run_dir), Path(agent.config.sim_state))
    agent.journal = restarted.journal           # the fixture closes this one
    assert sorted(r.spec.id for r in restarted.journal.shares()) == ["kept", "more"]
    assert [g.lost for g in restarted.snapshot().gpus] == ["GPU_IS_LOST", ""]


def test_an_exclusive_share_released_while_its_gpu_is_lost_is_released(agent):
    """The release of an exclusive share whose GPU fell off the bus before housekeeping dropped it
    tried to list the GPU's MIG instances and failed (NVML_ERROR_GPU_IS_LOST) at every retry: the
    share stayed 'releasing' (never dropped by housekeeping, which takes ready shares only) and its
    allocation stuck releasing until the agent restarted. A lost GPU's instances go with it (only a
    reset or a reboot brings it back, and both end them): the release forgets them and completes."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    agent.prepare(ShareSpec("ex", "exclusive", (gpu,), mig_profile="1g.10gb"), Deadline(60))
    simnvml.lose_gpu(agent.config.sim_state, GPU_MIG)
    agent.refresh_devices()
    assert agent.release("ex", Deadline(60)).released
    assert agent.journal.shares() == [] and agent.journal.migs() == [] and _lost(agent) == {}


def test_a_busy_instance_kept_on_a_gpu_that_is_then_lost_does_not_stop_housekeeping(agent):
    """An instance kept because it was busy at its share's release, on a GPU that then fell off the
    bus: housekeeping failed every round trying to list the GPU's instances, so it never got to
    restart a dead MPS daemon on another GPU. Now the instance is forgotten with its GPU."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    prepared, _ = agent.prepare(ShareSpec("ex", "exclusive", (gpu,), mig_profile="1g.10gb"), Deadline(60))
    simnvml.add_process(agent.config.sim_state, GPU_MIG, mig_uuid=prepared.device_uuids[0])
    agent.release("ex", Deadline(60))
    assert [m.share_id for m in agent.journal.migs()] == [None]   # kept while busy
    fastpod = _fastpod(agent, "fp")
    agent.prepare(fastpod, Deadline(60))
    simnvml.lose_gpu(agent.config.sim_state, GPU_MIG)
    agent.mps.stop(fastpod.device_uuids[0])                      # the other GPU's daemon dies
    agent.housekeeping()
    assert agent.journal.migs() == []
    assert agent.mps.answers(fastpod.device_uuids[0])            # restarted


def _forced_layout_failing(agent, monkeypatch, device_call: str, code: str) -> str:
    """Share 'ex' holds slice 0 of two 3g.40gb; a forced layout to one 7g.80gb is refused because
    the device layer's ``device_call`` fails with ``code``. Returns the GPU's UUID."""
    from fastshare.device.api import DeviceError

    gpu = agent.devices.gpus()[GPU_MIG].uuid
    apply_layout(agent, gpu, {"3g.40gb": 2}, False, True, Deadline(60))
    agent.prepare(ShareSpec("ex", "exclusive", (gpu,), mig_profile="3g.40gb", mig_start=0), Deadline(60))

    def failing(*args, **kwargs):
        raise DeviceError(f"simulated {code}", code)

    with monkeypatch.context() as patched:
        patched.setattr(agent.devices, device_call, failing)
        with pytest.raises(AgentError):
            apply_layout(agent, gpu, {"7g.80gb": 1}, True, True, Deadline(60))
    return gpu


def test_a_forced_layout_that_fails_after_destroying_a_held_slice_still_drops_its_shares(agent, monkeypatch):
    """A forced ApplyMigLayout destroyed a slice a share held, then a later step failed: the error
    went back with the share still 'ready' in the journal (and the inventory) until the next
    housekeeping. Now its shares are dropped, as lost with the layout's cause, before the error."""
    _forced_layout_failing(agent, monkeypatch, "create_mig_instance", "UNKNOWN")
    assert agent.journal.shares() == []
    assert "forced MIG layout change to 7g.80gb=1" in _lost(agent)["ex"], _lost(agent)


def test_a_held_slice_a_forced_layout_failed_to_destroy_is_not_later_blamed_on_it(agent, monkeypatch):
    """The forced layout noted the held slice as destroyed by it before destroying it, and kept the note
    when NVML refused (a process had started on it): destroyed later by hand or a GPU reset, its share
    was reported lost as "destroyed by a forced MIG layout change"."""
    _forced_layout_failing(agent, monkeypatch, "destroy_mig_instance", "IN_USE")
    assert [r.spec.id for r in agent.journal.shares()] == ["ex"]
    agent.devices.destroy_mig_instance(GPU_MIG, 0)                         # by hand, later
    agent.housekeeping()
    assert "outside fastshare" in _lost(agent)["ex"] and "forced" not in _lost(agent)["ex"], _lost(agent)


def test_a_gpu_lost_before_the_agent_read_it_is_named_by_the_journal(agent, tmp_path, caplog):
    """A GPU that fell off the bus while the agent was down is listed without its UUID (NVML
    answers GPU_IS_LOST before the agent ever read it). The whole share on it was then dropped as
    "no longer on this node (removed, replaced ...)", the ERROR said "UUID unknown", and the
    controller, seeing no GPU with the share's UUID, took the GPU for gone. The journal's shares
    name the GPU: the only GPU UUID there that no GPU read has is the lost GPU's, when exactly one
    GPU is lost without a UUID. It is kept once the share is dropped, until the GPU answers."""
    gpu = agent.devices.gpus()[GPU_A].uuid
    agent.prepare(ShareSpec("w", "whole", (gpu,), owner="team/a"), Deadline(60))
    agent.journal.close()
    simnvml.lose_gpu(agent.config.sim_state, GPU_A)
    restarted = in_process_agent(tmp_path, Path(agent.config.run_dir), Path(agent.config.sim_state))
    agent.journal = restarted.journal           # the fixture closes this one
    assert [(g.uuid, g.lost) for g in restarted.snapshot().gpus][GPU_A] == (gpu, "GPU_IS_LOST")
    reason = _lost(restarted)["w"]
    assert f"GPU {gpu} (GPU {GPU_A}) is lost (fell off the bus?)" in reason, reason
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(f"GPU {GPU_A} ({gpu}) is lost" in e for e in errors), errors
    restarted.housekeeping()                    # the share is gone from the journal: still named
    assert restarted.snapshot().gpus[GPU_A].uuid == gpu
    simnvml.reboot(agent.config.sim_state)      # it answers again: as read
    assert [(g.uuid, g.lost) for g in restarted.refresh_devices()][GPU_A] == (gpu, "")


def test_two_gpus_lost_before_the_agent_read_them_stay_unnamed(tmp_path):
    """Which of two GPUs lost before the first read held which journaled UUID cannot be told
    (the journal has no indexes): both stay without a UUID rather than one named wrongly."""
    run = Path(tempfile.mkdtemp(prefix="fsh-", dir="/tmp"))
    machine = tmp_path / "m.json"
    simnvml.create_machine(machine, ["V100-SXM2-32GB"] * 3)
    agent = in_process_agent(tmp_path, run, machine)
    try:
        uuids = [g.uuid for g in agent.devices.gpus()]
        for i in (0, 1):
            agent.prepare(ShareSpec(f"w{i}", "whole", (uuids[i],)), Deadline(60))
        agent.journal.close()
        simnvml.lose_gpu(machine, 0)
        simnvml.lose_gpu(machine, 1)
        agent = in_process_agent(tmp_path, run, machine)
        assert [(g.uuid, g.lost) for g in agent.snapshot().gpus] == [
            ("", "GPU_IS_LOST"), ("", "GPU_IS_LOST"), (uuids[2], "")]
    finally:
        agent.journal.close()
        shutil.rmtree(run, ignore_errors=True)


@pytest.fixture
def gpu1_lost(tmp_path: Path) -> Iterator[tuple[Agent, Path]]:
    """An agent started on three NVLinked A100s, GPU 1 lost (fallen off the bus) when it started."""
    run = Path(tempfile.mkdtemp(prefix="fsh-", dir="/tmp"))
    machine = tmp_path / "m.json"
    simnvml.create_machine(machine, ["A100-SXM4-40GB"] * 3)
    simnvml.lose_gpu(machine, 1)
    agent = in_process_agent(tmp_path, run, machine)
    try:
        yield agent, machine
    finally:
        agent.journal.close()
        shutil.rmtree(run, ignore_errors=True)


NVLINKED = {(0, 1, -1), (0, 2, -1), (1, 2, -1)}
READ_WHILE_GPU1_LOST = {(0, 1, 50), (0, 2, -1), (1, 2, 50)}   # its links unknown: the farthest


def test_links_read_while_a_gpu_was_lost_are_read_again_once_it_answers(gpu1_lost):
    """The GPU links are read once: read while GPU 1 was lost (its links unknown, taken for the
    farthest), they stayed so after a GPU reset brought it back, and whole-GPU groups were placed
    as if it had no NVLink until the agent restarted. They are read again once it answers; a GPU
    lost later keeps the links as read (the wiring does not change, and it takes nothing)."""
    agent, machine = gpu1_lost
    assert set(agent.snapshot().links) == READ_WHILE_GPU1_LOST
    simnvml.reset_gpu(machine, 1)
    assert set(agent.snapshot().links) == NVLINKED
    simnvml.lose_gpu(machine, 2)
    assert set(agent.snapshot().links) == NVLINKED


def test_a_mig_layout_on_a_lost_gpu_is_refused_as_set_mig_mode_refuses_it(agent):
    """PlanMigLayout and ApplyMigLayout on a GPU the agent knows is lost answered INTERNAL ("reading
    the MIG layout of GPU ... failed"), as the agent's own fault; SetMigMode refused it saying it is
    lost and what to do. Now all three refuse it alike (FAILED_PRECONDITION, lost, reset or reboot)."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    simnvml.lose_gpu(agent.config.sim_state, GPU_MIG)
    agent.housekeeping()
    for apply in (False, True):
        with pytest.raises(AgentError) as refused:
            apply_layout(agent, gpu, {"3g.40gb": 1}, False, apply, Deadline(60))
        message = str(refused.value)
        assert refused.value.code == "FAILED_PRECONDITION", message
        assert f"GPU {GPU_MIG} ({gpu})" in message and "is lost" in message and "reboot" in message, message


def test_a_mig_change_for_a_gpu_lost_before_the_agent_read_it_is_refused_saying_so(agent, tmp_path):
    """`fastshare mig enable/apply --gpu N` sends the UUID the agent's inventory gives GPU N: none
    for a GPU lost before the agent read it. The agent took the empty UUID for the first GPU without
    one: refused as "GPU  () does not support MIG", and with two such GPUs it acted on the other one.
    Now an empty UUID is refused, saying which GPUs are lost and never read."""
    agent.journal.close()
    simnvml.lose_gpu(agent.config.sim_state, GPU_MIG)
    restarted = in_process_agent(tmp_path, Path(agent.config.run_dir), Path(agent.config.sim_state))
    agent.journal = restarted.journal           # the fixture closes this one
    assert restarted.snapshot().gpus[GPU_MIG].uuid == ""
    for change in (lambda: restarted.set_mig_mode("", False, Deadline(60)),
                   lambda: apply_layout(restarted, "", {"3g.40gb": 1}, False, True, Deadline(60))):
        with pytest.raises(AgentError) as refused:
            change()
        message = str(refused.value)
        assert refused.value.code == "INVALID_ARGUMENT", message
        assert f"GPU {GPU_MIG} of node p is lost" in message, message
        assert "does not support MIG" not in message, message


def test_a_forced_destroy_the_agent_died_before_is_not_later_blamed_on_it(agent):
    """The cause of a forced destroy is journaled before the destroy: an agent killed between the two
    must forget it at its restart (the slice is still there), or a slice destroyed later by hand or
    by a GPU reset would be reported lost as "destroyed by a forced MIG layout change"."""
    gpu = agent.devices.gpus()[GPU_MIG].uuid
    apply_layout(agent, gpu, {"3g.40gb": 2}, False, True, Deadline(60))
    prepared, _ = agent.prepare(ShareSpec("ex", "exclusive", (gpu,), mig_profile="3g.40gb", mig_start=0),
                                Deadline(60))
    mig = prepared.device_uuids[0]
    agent.journal.note_taken(mig, "destroyed by a forced MIG layout change to 7g.80gb=1")   # then killed
    agent.reconcile()                                                      # the restart
    assert agent.journal.taken() == {}
    agent.devices.destroy_mig_instance(GPU_MIG, 0)                         # by hand, later
    agent.housekeeping()
    assert "outside fastshare" in _lost(agent)["ex"] and "forced" not in _lost(agent)["ex"], _lost(agent)
    assert agent.journal.taken() == {}


@pytest.fixture
def mig_off(tmp_path: Path) -> Iterator[tuple[Agent, Path]]:
    """An agent on an H100 (MIG at once) and an A100 (MIG pending until a reset), MIG off."""
    run = Path(tempfile.mkdtemp(prefix="fsh-", dir="/tmp"))
    machine = tmp_path / "m.json"
    simnvml.create_machine(machine, ["H100-SXM5-80GB", "A100-SXM4-40GB"], mig_enabled=False)
    agent = in_process_agent(tmp_path, run, machine)
    try:
        yield agent, machine
    finally:
        for device in agent.mps.running_devices():
            agent.mps.stop(device)
        agent.journal.close()
        shutil.rmtree(run, ignore_errors=True)


def test_a_forced_mig_enable_drops_the_shares_that_lose_the_gpu_saying_so(mig_off):
    """SetMigMode had no force: `mig enable --force` was refused while the agent ran. Now the agent
    refuses as the direct path does (refuse_enable_under_share), and with force enables MIG and drops
    the shares using the GPU whole, as lost with the forced MIG mode change as cause."""
    agent, _ = mig_off
    h100, a100 = (g.uuid for g in agent.devices.gpus())
    agent.prepare(ShareSpec("w", "whole", (h100,)), Deadline(60))
    fp = ShareSpec("fp", "fastpod", (a100,), sm_percent=20, memory_bytes=1 << 30, quota_request=0.2,
                   quota_limit=0.5)
    agent.prepare(fp, Deadline(60))
    with pytest.raises(AgentError) as refused:
        agent.set_mig_mode(h100, True, Deadline(60))
    assert refused.value.code == "FAILED_PRECONDITION"
    for says in ("GPU 0 ", "held whole by fastshare share w", "fastshare release w", "--force"):
        assert says in str(refused.value), (says, str(refused.value))
    assert not agent.devices.gpus()[0].mig_current and agent.journal.share("w") is not None

    assert agent.set_mig_mode(h100, True, Deadline(60), force=True) == (False, True, [])   # Hopper: at once
    assert agent.devices.gpus()[0].mig_current
    assert agent.set_mig_mode(a100, True, Deadline(60), force=True) == (True, True, [])    # Ampere: pending
    assert agent.journal.shares() == [] and agent.mps.running_devices() == []
    lost = _lost(agent)
    for share_id, gpu in (("w", h100), ("fp", a100)):
        assert gpu in lost[share_id] and "forced MIG mode change" in lost[share_id], lost
        assert "fastshare mig enable --force" in lost[share_id], lost
    assert "next reset" in lost["fp"] and "next reset" not in lost["w"], lost
    assert agent.journal.taken() == {}
    agent.prepare(ShareSpec("ex", "exclusive", (h100,), mig_profile="1g.10gb"), Deadline(60))   # MIG GPU now


def test_a_forced_mig_enable_nvml_refuses_keeps_the_shares(mig_off):
    """NVML refuses to change the mode of a GPU processes run on, forced or not: the share keeps the
    GPU, and the cause noted before the change goes (it is not blamed for a later loss)."""
    agent, machine = mig_off
    h100 = agent.devices.gpus()[0].uuid
    agent.prepare(ShareSpec("w", "whole", (h100,)), Deadline(60))
    simnvml.add_process(machine, 0)                                          # the share's workload
    with pytest.raises(AgentError) as refused:
        agent.set_mig_mode(h100, True, Deadline(60), force=True)
    assert "IN_USE" in str(refused.value)
    assert not agent.devices.gpus()[0].mig_pending and agent.journal.share("w").state == "ready"
    assert _lost(agent) == {} and agent.journal.taken() == {}
    agent.housekeeping()
    assert _lost(agent) == {}


def test_a_mig_mode_change_already_pending_is_not_changed_again_forced_or_not(mig_off):
    """SetMigMode for the mode an Ampere GPU already waits for (the reset) answered `changed`,
    forced or not, though it changed nothing (`fastshare mig` without an agent says no mode change
    there). Now it answers pending and not changed. Force does nothing more there: a share using the
    GPU whole under an enable made by hand stays held (the call does not change the mode it loses
    the GPU to), as without force."""
    agent, machine = mig_off
    a100 = agent.devices.gpus()[1].uuid
    assert agent.set_mig_mode(a100, True, Deadline(60)) == (True, True, [])
    assert agent.set_mig_mode(a100, True, Deadline(60)) == (True, False, [])
    assert agent.set_mig_mode(a100, True, Deadline(60), force=True) == (True, False, [])
    assert agent.set_mig_mode(a100, False, Deadline(60)) == (False, True, [])   # cancelled: MIG stays off
    agent.prepare(ShareSpec("w", "whole", (a100,)), Deadline(60))
    data = simnvml.load_machine(machine)
    data["gpus"][1]["mig_pending"] = 1   # nvidia-smi -mig 1 by hand under w: pending until a reset
    machine.write_text(json.dumps(data))
    agent.refresh_devices()
    assert agent.set_mig_mode(a100, True, Deadline(60), force=True) == (True, False, [])
    assert [r.spec.id for r in agent.journal.shares()] == ["w"] and _lost(agent) == {}
    assert agent.journal.taken() == {}
    gpu = agent.devices.gpus()[1]
    assert (gpu.mig_current, gpu.mig_pending) == (False, True)


def test_cancelling_a_pending_mig_enable_leaves_the_shares_using_the_gpu_whole_their_gpu(mig_off):
    """An Ampere GPU's MIG enable waits for a reset; cancelling it (SetMigMode disabled, e.g. `mig config`
    with mig-enabled false through the agent) keeps MIG off, so a share using the GPU whole keeps it.
    The agent refused it ("has shares"), where the direct path allows it; a layout on a GPU whose MIG
    is on still counts its shares. (While the enable is pending the GPU takes no new share: the one
    cancelled here was enabled by hand under the share.)"""
    agent, machine = mig_off
    a100 = agent.devices.gpus()[1].uuid
    agent.prepare(ShareSpec("w", "whole", (a100,)), Deadline(60))
    assert agent.set_mig_mode(a100, True, Deadline(60), force=True) == (True, True, [])   # pending; w dropped
    with pytest.raises(AgentError, match="MIG mode change pending"):
        agent.prepare(ShareSpec("w2", "whole", (a100,)), Deadline(60))
    assert agent.set_mig_mode(a100, False, Deadline(60)) == (False, True, [])
    agent.prepare(ShareSpec("w2", "whole", (a100,)), Deadline(60))
    data = simnvml.load_machine(machine)
    data["gpus"][1]["mig_pending"] = 1   # nvidia-smi -mig 1 by hand under w2: pending until a reset
    machine.write_text(json.dumps(data))
    agent.refresh_devices()
    assert agent.set_mig_mode(a100, False, Deadline(60)) == (False, True, [])
    gpu = agent.devices.gpus()[1]
    assert not gpu.mig_current and not gpu.mig_pending
    assert [r.spec.id for r in agent.journal.shares()] == ["w2"]


def test_a_mig_mode_change_on_a_gpu_named_by_the_journal_says_it_is_lost(tmp_path):
    """A MIG-capable GPU lost before the agent read it, named from the journal: `fastshare mig
    enable --gpu N` sends the UUID the inventory now gives it, and the agent refused it as
    'GPU ... () does not support MIG' (the blank listing has no name and no MIG): the operator
    was told the wrong thing. Now the refusal says the GPU is lost and what to do."""
    run = Path(tempfile.mkdtemp(prefix="fsh-", dir="/tmp"))
    machine = tmp_path / "m.json"
    simnvml.create_machine(machine, ["H100-SXM5-80GB"] * 2)
    agent = in_process_agent(tmp_path, run, machine)
    try:
        gpu = agent.devices.gpus()[1].uuid
        agent.prepare(ShareSpec("w", "whole", (gpu,)), Deadline(60))
        agent.journal.close()
        simnvml.lose_gpu(machine, 1)
        agent = in_process_agent(tmp_path, run, machine)
        assert agent.snapshot().gpus[1].uuid == gpu
        with pytest.raises(AgentError) as exc:
            agent.set_mig_mode(gpu, True, Deadline(10))
        assert exc.value.code == "FAILED_PRECONDITION", exc.value
        assert "is lost" in str(exc.value) and "does not support MIG" not in str(exc.value), exc.value
    finally:
        agent.journal.close()
        shutil.rmtree(run, ignore_errors=True)


def test_links_kept_as_read_when_reading_them_again_fails(gpu1_lost, monkeypatch):
    """Links read while GPU 1 was lost are read again once it answers; when that read failed,
    the agent reported no links at all (the controller then placed every whole-GPU group without
    topology), where before it kept the links it had read. Now it keeps them and retries."""
    from fastshare.device.api import DeviceError

    agent, machine = gpu1_lost
    assert set(agent.snapshot().links) == READ_WHILE_GPU1_LOST
    simnvml.reset_gpu(machine, 1)
    real = agent.devices.topology

    def failing():
        raise DeviceError("reading the GPU topology failed: NVML_ERROR_UNKNOWN", "UNKNOWN")

    monkeypatch.setattr(agent.devices, "topology", failing)
    assert set(agent.snapshot().links) == READ_WHILE_GPU1_LOST
    monkeypatch.setattr(agent.devices, "topology", real)
    assert set(agent.snapshot().links) == NVLINKED


def test_a_forced_mig_enable_made_without_the_agent_drops_the_shares_at_its_start(mig_off, tmp_path):
    """`fastshare mig enable --force` with the agent stopped enabled MIG on a GPU a share used whole,
    but nothing told the agent: at its start the share stayed ready on a GPU that is now (or after
    its reset) a MIG GPU, and the controller kept the allocation active. Now the command notes the
    cause in the journal before the change (holding the agent's state directory), and the agent's
    start drops the share as lost to the forced MIG mode change."""
    from click.testing import CliRunner

    from fastshare.cli import main

    agent, machine = mig_off
    h100, a100 = (g.uuid for g in agent.devices.gpus())
    agent.prepare(ShareSpec("w", "whole", (a100,)), Deadline(60))
    agent.prepare(ShareSpec("kept", "whole", (h100,)), Deadline(60))
    journal = agent.config.journal_path
    agent.journal.close()                                                   # the agent stops
    env = {"FASTSHARE_GPU_BACKEND": "sim", "FASTSHARE_SIM_STATE": str(machine)}
    absent = str(tmp_path / "no.sock")
    refused = CliRunner().invoke(main, ["mig", "enable", "--gpu", "1", "--agent-journal", str(journal),
                                        "--unix-socket", absent], env=env)
    assert refused.exit_code == 1 and "held whole by fastshare share w" in refused.output, refused.output
    forced = CliRunner().invoke(main, ["mig", "enable", "--gpu", "1", "--force", "--agent-journal",
                                       str(journal), "--unix-socket", absent], env=env)
    assert forced.exit_code == 0 and "pending" in forced.output, forced.output
    agent.journal = Journal(journal)                                        # the agent starts again
    agent.reconcile()
    assert [r.spec.id for r in agent.journal.shares()] == ["kept"]
    lost = _lost(agent)
    assert list(lost) == ["w"] and a100 in lost["w"] and "forced MIG mode change" in lost["w"], lost
    assert "next reset" in lost["w"], lost
    assert agent.journal.taken() == {}

    agent.journal.close()                                                   # stopped again: `mig config`
    config = tmp_path / "mig.yaml"
    config.write_text('{"version": "v1", "mig-configs": {"c": [{"devices": [0], "mig-enabled": true}]}}')
    applied = CliRunner().invoke(main, ["mig", "config", "--file", str(config), "--select", "c", "--apply",
                                        "--force", "--agent-journal", str(journal), "--unix-socket", absent],
                                 env=env)
    assert applied.exit_code == 0, applied.output
    agent.journal = Journal(journal)
    agent.reconcile()
    assert agent.journal.shares() == [] and agent.journal.taken() == {}
    lost = _lost(agent)
    assert h100 in lost["kept"] and "forced MIG mode change" in lost["kept"], lost
    assert "next reset" not in lost["kept"], lost                          # Hopper: at once


def _pending_words(index: int) -> str:
    return (f"GPU {index} of p: MIG mode change pending until the GPU is reset (nvidia-smi -r -i {index}) "
            "or the node rebooted; it takes no new shares")


def test_prepare_on_a_gpu_whose_mig_mode_change_is_pending_is_refused_saying_so(mig_off):
    """An A100's MIG mode change waits for a GPU reset. The agent prepared whole, MPS and fastpod shares
    on a GPU whose MIG enable was pending (checking only the current mode): they lost the GPU at the
    reset; an exclusive share on one whose disable was pending would lose its slice. Now PrepareShare
    on such a GPU is refused FAILED_PRECONDITION with the controller's words (an older controller may
    still send one); a share it holds already is handed back as it is (idempotent prepare)."""
    agent, machine = mig_off
    a100 = agent.devices.gpus()[1].uuid
    fp = ShareSpec("fp", "fastpod", (a100,), sm_percent=20, memory_bytes=1 << 30, quota_request=0.2,
                   quota_limit=0.5)
    prepared, _ = agent.prepare(fp, Deadline(60))
    data = simnvml.load_machine(machine)
    data["gpus"][1]["mig_pending"] = 1   # MIG enabled by hand (nvidia-smi -mig 1): pending until a reset
    machine.write_text(json.dumps(data))
    agent.refresh_devices()
    assert agent.prepare(fp, Deadline(60)) == (prepared, False)   # held already: stays
    for spec in (ShareSpec("w", "whole", (a100,)), ShareSpec("m", "mps", (a100,), memory_bytes=1 << 30),
                 ShareSpec("fp2", "fastpod", (a100,), sm_percent=20, memory_bytes=1 << 30, quota_request=0.2,
                           quota_limit=0.5),
                 ShareSpec("ex", "exclusive", (a100,), mig_profile="1g.5gb")):
        with pytest.raises(AgentError) as refused:
            agent.prepare(spec, Deadline(60))
        assert refused.value.code == "FAILED_PRECONDITION", (spec.id, refused.value)
        assert _pending_words(1) in str(refused.value), (spec.id, refused.value)
        assert agent.journal.share(spec.id) is None

    agent.release("fp", Deadline(60))
    simnvml.reset_gpu(machine, 1)                          # MIG on now
    agent.refresh_devices()
    assert agent.set_mig_mode(a100, False, Deadline(60)) == (True, True, [])   # disable: pending till a reset
    with pytest.raises(AgentError) as refused:
        agent.prepare(ShareSpec("ex2", "exclusive", (a100,), mig_profile="1g.5gb"), Deadline(60))
    assert refused.value.code == "FAILED_PRECONDITION", refused.value
    assert _pending_words(1) in str(refused.value), refused.value
    assert agent.devices.mig_instances(1) == [] and agent.journal.share("ex2") is None



def test_a_mig_disable_with_destroy_instances_destroys_them_under_the_same_lock(agent):
    """`mig config` with mig-enabled false through the agent destroyed the instances (ApplyMigLayout)
    and then asked for the disable (SetMigMode): between the two the lock was free, and a share placed
    there made the disable fail after the instances went. With destroy_instances one call does both
    under the GPU's lock: refused before any change while a share holds an instance (force: the share
    is dropped, lost with the forced disable as cause), never over processes; without it, a disable is
    refused while instances exist, as before."""
    gpu = agent.devices.gpus()[GPU_MIG]
    apply_layout(agent, gpu.uuid, {"3g.40gb": 1, "1g.10gb": 1}, False, True, Deadline(60))
    agent.prepare(ShareSpec("ex", "exclusive", (gpu.uuid,), mig_profile="1g.10gb"), Deadline(60))
    held = agent.journal.share("ex").device_uuid
    idle = next(m for m in agent.devices.mig_instances(GPU_MIG) if m.uuid != held)
    pid = None
    for force, destroy, says in ((False, False, "ex"), (False, True, "held by fastshare share ex"),
                                 (True, True, "NVML cannot destroy it even with force")):
        if force:   # force never covers processes on an instance
            pid = simnvml.add_process(agent.config.sim_state, GPU_MIG, mig_uuid=idle.uuid)
        before = agent.devices.mig_instances(GPU_MIG)
        assert len(before) == 3
        with pytest.raises(AgentError) as refused:
            agent.set_mig_mode(gpu.uuid, False, Deadline(60), force=force, destroy_instances=destroy)
        assert refused.value.code == "FAILED_PRECONDITION" and says in str(refused.value), str(refused.value)
        assert agent.devices.mig_instances(GPU_MIG) == before and agent.devices.gpus()[GPU_MIG].mig_current
        assert agent.journal.share("ex") is not None and agent.journal.taken() == {}
    simnvml.remove_process(agent.config.sim_state, pid)

    pending, changed, actions = agent.set_mig_mode(gpu.uuid, False, Deadline(60), force=True,
                                                   destroy_instances=True)
    assert (pending, changed) == (False, True)                          # Hopper: at once
    assert sorted((a["op"], a["start"], a["mig_uuid"]) for a in actions) == \
        sorted(("destroy", m.start, m.uuid) for m in before)
    assert not agent.devices.gpus()[GPU_MIG].mig_current and agent.devices.mig_instances(GPU_MIG) == []
    assert agent.journal.shares() == [] and agent.journal.migs(gpu.uuid) == [] and agent.journal.taken() == {}
    lost = _lost(agent)
    assert list(lost) == ["ex"] and "forced MIG disable" in lost["ex"], lost
