"""Housekeeping racing the requests it must not undo (in process: the interleaving is forced)."""

import shutil
import tempfile
from pathlib import Path

from fastshare.device import open_devices, simnvml
from fastshare.mps.control import MpsControl
from fastshare.node.agent import Agent, Deadline
from fastshare.node.config import NodeConfig
from fastshare.node.journal import Journal
from fastshare.node.model import ShareSpec

from .harness import GPU_A, STANDIN


def test_a_daemon_stopped_by_the_last_release_is_not_restarted_by_housekeeping(tmp_path):
    """Housekeeping saw the daemon not answering because the last share's release was stopping
    it, then started a new one: a daemon serving no share, and the GPU left in EXCLUSIVE_PROCESS."""
    run = Path(tempfile.mkdtemp(prefix="fsh-", dir="/tmp"))
    machine = tmp_path / "m.json"
    simnvml.create_machine(machine, ["H100-SXM5-80GB", "V100-SXM2-32GB"], mig_enabled=True)
    cfg = NodeConfig(node_name="h", unix_socket="", state_dir=str(tmp_path / "state"), run_dir=str(run),
                     device_backend="sim", sim_state=str(machine), mps_control_binary=STANDIN,
                     mps_timeout_s=30)
    agent = Agent(cfg, open_devices("sim", machine), MpsControl(STANDIN, cfg.mps_root, timeout=30),
                  Journal(cfg.journal_path))
    try:
        agent.reconcile()
        gpu = agent.devices.gpus()[GPU_A].uuid
        agent.prepare(ShareSpec("fp", "fastpod", (gpu,), sm_percent=20, memory_bytes=1 << 30,
                                quota_request=0.2, quota_limit=0.5), Deadline(60))
        answers = agent.mps.answers

        def release_while_checked(device_uuid, timeout=None):
            agent.mps.answers = answers            # once: the release runs right here
            agent.release("fp", Deadline(60))
            return answers(device_uuid, timeout)

        agent.mps.answers = release_while_checked
        agent.housekeeping()
        assert agent.mps.running_devices() == [] and agent.journal.mps_daemons() == []
        assert agent.devices.gpus()[GPU_A].compute_mode == "DEFAULT"
    finally:
        for device in agent.mps.running_devices():
            agent.mps.stop(device)
        agent.journal.close()
        shutil.rmtree(run, ignore_errors=True)
