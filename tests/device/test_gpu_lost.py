"""A GPU that falls off the bus (Xid 79) or is otherwise lost: NVML keeps counting it, calls on it
raise NVML_ERROR_GPU_IS_LOST. The simulated NVML models it; the device layer lists the other GPUs
and reports that one as lost instead of failing the whole listing."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest
from click.testing import CliRunner

from fastshare.cli import main as cli
from fastshare.device import DeviceError, open_devices, simnvml


@pytest.mark.parametrize("handle", [True, False])
def test_simnvml_a_lost_gpu_stays_counted_and_raises_gpu_is_lost(machine: Path, handle: bool):
    lost_uuid = simnvml.lose_gpu(machine, 1, handle=handle)
    nvml = simnvml.SimNvml(machine)
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 4
    if handle:
        for acquire in (lambda: nvml.nvmlDeviceGetHandleByIndex(1),
                        lambda: nvml.nvmlDeviceGetHandleByUUID(lost_uuid)):
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                acquire()
    else:
        h = nvml.nvmlDeviceGetHandleByIndex(1)
        for call in (nvml.nvmlDeviceGetName, nvml.nvmlDeviceGetUUID, nvml.nvmlDeviceGetMigMode,
                     nvml.nvmlDeviceGetMemoryInfo, nvml.nvmlDeviceGetComputeRunningProcesses):
            with pytest.raises(pynvml.NVMLError_GpuIsLost) as exc:
                call(h)
            assert exc.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA A100-SXM4-40GB"
    simnvml.reboot(machine)   # a reboot (or a GPU reset) brings it back
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(1)) == lost_uuid
    nvml.nvmlShutdown()


@pytest.mark.parametrize("handle", [True, False])
def test_gpus_lists_the_healthy_gpus_and_reports_the_lost_one(machine: Path, handle: bool):
    with open_devices("sim", machine) as devices:
        before = devices.gpus()
        simnvml.lose_gpu(machine, 1, handle=handle)
        gpus = devices.gpus()
        assert [g.index for g in gpus] == [0, 1, 2, 3]
        assert [g.lost for g in gpus] == ["", "GPU_IS_LOST", "", ""]
        assert [g.uuid for g in gpus] == [g.uuid for g in before]   # the lost one as last read
        assert gpus[0] == before[0] and gpus[2:] == before[2:]
        # single-GPU calls on it say so
        for call in (lambda: devices.gpu(1), lambda: devices.mig_instances(1),
                     lambda: devices.mig_profiles(1), lambda: devices.set_compute_mode(1, "DEFAULT")):
            with pytest.raises(DeviceError) as exc:
                call()
            assert exc.value.code == "GPU_IS_LOST" and "GPU 1" in str(exc.value), exc.value
        topology = devices.topology()   # the others' links are still known
        assert topology.levels[(0, 2)] == 40 and topology.levels[(0, 1)] == pynvml.NVML_TOPOLOGY_SYSTEM


def test_a_gpu_lost_before_the_first_read_is_listed_without_identity(machine: Path):
    simnvml.lose_gpu(machine, 2)
    with open_devices("sim", machine) as devices:
        gpus = devices.gpus()
    assert [g.lost for g in gpus] == ["", "", "GPU_IS_LOST", ""]
    assert gpus[2].uuid == "" and gpus[2].index == 2 and gpus[3].model == "L4"


def test_cli_lose_gpu(machine: Path):
    result = CliRunner().invoke(cli, ["sim-machine", "lose-gpu", "--state", str(machine), "--gpu", "3"])
    assert result.exit_code == 0, result.output
    assert "NVML_ERROR_GPU_IS_LOST" in result.output
    assert simnvml.load_machine(machine)["gpus"][3]["lost"] == "handle"
    bad = CliRunner().invoke(cli, ["sim-machine", "lose-gpu", "--state", str(machine), "--gpu", "4"])
    assert bad.exit_code != 0 and "out of range 0..3" in bad.output


def test_gpu_list_shows_a_lost_gpu_and_the_others(machine: Path):
    simnvml.lose_gpu(machine, 1)
    env = {"FASTSHARE_GPU_BACKEND": "sim", "FASTSHARE_SIM_STATE": str(machine)}
    result = CliRunner().invoke(cli, ["gpu", "list"], env=env)
    assert result.exit_code == 0, result.output
    assert "LOST" in result.output and "NVIDIA L4" in result.output   # the table wraps long cells
    listed = json.loads(CliRunner().invoke(cli, ["gpu", "list", "--json"], env=env).output)["gpus"]
    assert [g["lost"] for g in listed] == ["", "GPU_IS_LOST", "", ""]


@pytest.mark.parametrize("call", ["nvmlDeviceGetUUID", "nvmlDeviceGetMigMode"])
@pytest.mark.parametrize("read_before", [True, False])
def test_an_unknown_error_on_one_gpu_names_the_gpu_and_what_it_may_be(machine: Path, monkeypatch,
                                                                      read_before: bool, call: str):
    """Some drivers answer NVML_ERROR_UNKNOWN for a GPU fallen off the bus; it is not taken for
    lost (a passing driver failure, or the agent's device access lost to a cgroup reload, answer
    the same, and the shares of a lost GPU are dropped for good). The listing failed with
    "listing GPUs failed: NVML_ERROR_UNKNOWN", naming no GPU: the operator could not tell which
    GPU, nor that it may have fallen off the bus. Now it names the GPU and says what to check."""
    with open_devices("sim", machine) as devices:
        uuid = devices.gpus()[1].uuid if read_before else None
        nvml = devices._nvml
        real = getattr(nvml, call)

        def failing(handle):
            if nvml.nvmlDeviceGetIndex(handle) == 1:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
            return real(handle)

        monkeypatch.setattr(nvml, call, failing)
        with pytest.raises(DeviceError) as exc:
            devices.gpus()
    message = str(exc.value)
    assert exc.value.code == "UNKNOWN" and "GPU 1" in message and "NVML_ERROR_UNKNOWN" in message, message
    assert "Xid 79" in message and "not taken for lost" in message, message
    assert (uuid in message) if uuid else "GPU-" not in message, message
