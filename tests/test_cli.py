"""The installed `fastshare` entry point works and the generated protobuf code imports."""

import os
import signal
import subprocess

import pytest
from click.testing import CliRunner

from fastshare import __version__
from fastshare.cli import main


def test_version_option_reports_package_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_console_script_is_installed():
    out = subprocess.run(["fastshare", "--help"], capture_output=True, text=True, check=True)
    assert "Usage: fastshare" in out.stdout


def test_generated_protos_import():
    from fastshare.v1 import common_pb2

    assert common_pb2.SHARE_KIND_EXCLUSIVE == 3


def _commands(command, path=("fastshare",)):
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


def test_help_describes_every_option():
    # `--help` is the reference a user reads: an option listed with no words says nothing of
    # what it does (e.g. `bench mig --steps`, `run --kind`, `k8s controller --agent-port`)
    import click

    bare = [f"{' '.join(path)} {param.opts[0]}" for path, command in _commands(main)
            for param in command.params
            if isinstance(param, click.Option) and param.opts[0] != "--help" and not param.help]
    assert not bare, f"options without help text: {', '.join(bare)}"


@pytest.mark.parametrize("unbuffered", ["1", None])
def test_a_reader_that_closed_the_pipe_ends_the_command_quietly(tmp_path, unbuffered):
    """`fastshare ... | head -1`: once the reader is gone, the command stops as `yes | head -1`
    does, without a word on stderr, with the status of a process SIGPIPE ended (128 + 13), so
    `set -o pipefail` sees it as it sees any other writer cut short. It exited 1 (click's own
    EPIPE handling, as a failure) or 0 with a write error at exit, by how stdout was buffered."""
    (tmp_path / "n.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,65536,2,T4\n")
    (tmp_path / "p.csv").write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1024,1,500\n")
    sim = ["sim", "--pods", str(tmp_path / "p.csv"), "--nodes", str(tmp_path / "n.csv"), "--tune", "0"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    for args in (["--help"], sim, [*sim, "--json"]):
        read, write = os.pipe()
        os.close(read)   # the reader has gone before the first write
        try:
            out = subprocess.run(["fastshare", *args], stdout=write, stderr=subprocess.PIPE, env=env,
                                 text=True, timeout=120)
        finally:
            os.close(write)
        assert (out.returncode, out.stderr) == (128 + signal.SIGPIPE, ""), args


def test_run_help_says_what_lease_ttl_0_does():
    # --lease-ttl takes 0..604800, and 0 is no lease at all: an allocation `fastshare run` held is
    # then kept for good if the run is killed with SIGKILL; the help said only "covers kill -9"
    from click.testing import CliRunner

    out = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    line = " ".join(out.split("--lease-ttl", 1)[1].split("--key", 1)[0].split())
    assert "0 = no lease" in line and "5" in line, line


def test_status_says_node_down_only_of_allocations_still_held(capsys):
    # after `fastshare forget-node`, `status --all` listed the ended allocations as
    # "released (node down)": the node was forgotten, not down, and a finished allocation holds
    # nothing there; an allocation still held on an unreachable node keeps the note
    from fastshare.cli.status import render
    from fastshare.v1 import controller_pb2 as pb

    st = pb.ClusterStatus(allocations=[
        pb.Allocation(id="fs-1", node="n1", state=pb.ALLOCATION_STATE_RELEASED, node_available=False),
        pb.Allocation(id="fs-2", node="n1", state=pb.ALLOCATION_STATE_FAILED, node_available=False),
        pb.Allocation(id="fs-3", node="n2", state=pb.ALLOCATION_STATE_ACTIVE, node_available=False)])
    render(st)
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("fs-")}
    assert "node down" not in rows["fs-1"] + rows["fs-2"], rows
    assert "active (node down)" in rows["fs-3"], rows


def test_status_all_marks_only_held_mig_slices(capsys):
    # `status --all` gave finished allocations a MIG map letter too: a released one showed a
    # letter found on no map, and one listed after the active holder of its old slot took the
    # slot's letter from it (the map named the released allocation, the holder's letter nowhere)
    from fastshare.cli.status import render
    from fastshare.v1 import controller_pb2 as pb

    slot = pb.AssignedDevice(gpu_index=0, gpu_uuid="GPU-0", mig_profile="3g.40gb", mig_start=4, mig_size=4)
    gpu = pb.GpuUsage(index=0, uuid="GPU-0", model="H100-SXM5-80GB", mig_enabled=True, memory_slices=8,
                      mig_slices=[slot], allocation_ids=["fs-2"])
    st = pb.ClusterStatus(nodes=[pb.NodeStatus(name="n1", available=True, gpus=[gpu])], allocations=[
        pb.Allocation(id="fs-2", node="n1", state=pb.ALLOCATION_STATE_ACTIVE, node_available=True,
                      devices=[slot]),
        pb.Allocation(id="fs-1", node="n1", state=pb.ALLOCATION_STATE_RELEASED, devices=[slot])])
    render(st)
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("fs-", "n1 "))}
    assert "[A]" in rows["fs-2"] and "[" not in rows["fs-1"], out
    assert "MIG [····AAAA]" in rows["n1"], out


def test_status_shows_a_lost_gpu(capsys):
    # a GPU fallen off the bus (the agent reports NVML_ERROR_GPU_IS_LOST) took no work, but
    # `fastshare status` showed it as "idle" like a healthy one: only the agent's node status said
    from fastshare.cli.status import render
    from fastshare.controller.convert import cluster_status
    from fastshare.controller.model import Gpu, Node

    gpus = [Gpu(index=i, uuid=f"GPU-{i}", model="V100-SXM2-32GB", memory_bytes=32 << 30, sm_count=80,
                mig_capable=False, mig_enabled=False, lost="GPU_IS_LOST" if i else "") for i in (0, 1)]
    st = cluster_status([Node(name="n1", address="a:1", labels={}, gpus=gpus)], [])
    assert [g.lost for g in st.nodes[0].gpus] == ["", "GPU_IS_LOST"]
    render(st)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("n1 ")]
    assert [r[-2] for r in rows if "V100-SXM2-32GB" in r] == ["idle", "LOST"], out
    assert ["n1", "1", "GPU-1", "NVML_ERROR_GPU_IS_LOST"] in rows and "Lost GPUs" in out, out


def test_run_says_its_allocation_failed_while_it_is_still_being_ended():
    # the controller ends an allocation whose device went away under it: 'releasing' with the
    # reason "device gone: ..." until its agent answers, then 'failed'. `fastshare run` stopped
    # its command saying "the allocation was released" when it looked in between (the agent down)
    from fastshare.cli.run import _how_it_ended
    from fastshare.controller.core import DEVICE_GONE
    from fastshare.v1 import controller_pb2 as pb

    assert DEVICE_GONE == "device gone: "   # run.py spells it out (the CLI does not import the core)

    class Client:
        def __init__(self, state):
            self.state = state

        def call(self, method, request, timeout=None):
            return pb.Allocation(id=request.allocation_id, state=self.state,
                                 reason="device gone: GPU GPU-1 (GPU 1) is lost (fell off the bus?)")

    for state in (pb.ALLOCATION_STATE_RELEASING, pb.ALLOCATION_STATE_FAILED):
        said = _how_it_ended(Client(state), "fs-1")
        assert said.startswith("the allocation failed: device gone: GPU GPU-1"), (state, said)


@pytest.mark.parametrize("current, pending, shown", [(False, False, "off"), (True, True, "on"),
                                                     (False, True, "off (on after a GPU reset)"),
                                                     (True, False, "on (off after a GPU reset)")])
def test_node_status_shows_a_mig_mode_change_waiting_for_a_reset(current, pending, shown):
    """`fastshare node status` showed "pending" for an enable waiting for a reset but "on" for a
    disable waiting for one (an Ampere GPU about to lose its MIG slices looked settled)."""
    from fastshare.cli.node import _mig_mode

    assert _mig_mode(current, pending) == shown
