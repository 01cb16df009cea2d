"""NvmlDevices (the real pynvml code path) running on the simulated NVML."""

from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

import pytest

from fastshare.device import DeviceError, open_devices, simnvml
from fastshare.device.nvml_backend import NvmlDevices


def test_inventory(devices):
    gpus = devices.gpus()
    assert [g.model for g in gpus] == ["A100-SXM4-40GB", "H100-SXM5-80GB", "A100-SXM4-40GB", "L4"]
    a100, h100, a100_off, l4 = gpus
    assert (a100.name, a100.memory_mib, a100.sm_count, a100.mig_capable, a100.mig_current) == (
        "NVIDIA A100-SXM4-40GB", 40960, 108, True, True)
    assert h100.sm_count == 132 and h100.mig_current
    assert not a100_off.mig_current and a100_off.mig_capable
    assert not l4.mig_capable and l4.compute_mode == "DEFAULT"
    assert len({g.uuid for g in gpus}) == 4
    assert devices.driver_version() == simnvml.DEFAULT_DRIVER


def test_topology_levels_and_nvlink(tmp_path: Path):
    path = tmp_path / "m.json"
    simnvml.create_machine(path, ["H100-SXM5-80GB"] * 4 + ["H100-SXM5-80GB"] * 2 + ["L4"])
    with open_devices("sim", path) as d:
        topo = d.topology()
    assert topo.levels[(0, 1)] == 10 and topo.levels[(0, 2)] == 40 and topo.levels[(0, 4)] == 50
    assert (0, 5) in topo.nvlink and (0, 6) not in topo.nvlink
    assert topo.level(5, 0) == -1 and topo.level(6, 0) == 50


def test_profiles_from_nvml_match_catalog(devices):
    profiles = {p.name: p for p in devices.mig_profiles(0)}
    assert profiles["3g.20gb"].placements == (0, 4) and profiles["3g.20gb"].memory_slices == 4
    assert profiles["1g.10gb"].profile_id == 15 and profiles["1g.10gb"].memory_slices == 2
    assert {p.name for p in devices.mig_profiles(1)} >= {"1g.10gb", "3g.40gb", "7g.80gb"}
    assert devices.mig_profiles(3) == []                          # L4: no MIG
    assert {p.profile_id for p in devices.mig_profiles(2)} == {19, 20, 15, 14, 9, 5, 0}  # catalog, MIG off


def test_create_list_destroy(devices, machine: Path):
    inst = devices.create_mig_instance(0, 9, 4)
    assert (inst.profile_name, inst.start, inst.size, inst.sm_count, inst.memory_mib) == (
        "3g.20gb", 4, 4, 42, 19968)
    assert inst.uuid.startswith("MIG-") and inst.gpu_uuid == devices.gpu(0).uuid
    devices.create_mig_instance(0, 19, 0)
    assert [(i.profile_id, i.start) for i in devices.mig_instances(0)] == [(19, 0), (9, 4)]
    assert [i.start for i in devices.gpu(0).mig_instances] == [0, 4]
    assert devices.remaining_capacity(0, 19) == 3
    devices.destroy_mig_instance(0, 4)
    assert [i.start for i in devices.mig_instances(0)] == [0]
    with pytest.raises(DeviceError) as err:
        devices.destroy_mig_instance(0, 4)
    assert err.value.code == "NOT_FOUND"


def test_errors_say_what_failed(devices):
    devices.create_mig_instance(0, 9, 4)
    with pytest.raises(DeviceError, match=r"INSUFFICIENT_RESOURCES .*occupied: 3g.20gb at 4..7") as err:
        devices.create_mig_instance(0, 19, 5)
    assert err.value.code == "INSUFFICIENT_RESOURCES"
    with pytest.raises(DeviceError, match="not an allowed placement") as err:
        devices.create_mig_instance(0, 9, 2)
    assert err.value.code == "INVALID_ARGUMENT"
    with pytest.raises(DeviceError, match="no MIG profile id 42"):
        devices.create_mig_instance(0, 42, 0)
    with pytest.raises(DeviceError, match="MIG mode is not enabled") as err:
        devices.create_mig_instance(2, 19, 0)
    assert err.value.code == "NOT_SUPPORTED"
    with pytest.raises(DeviceError, match=r"GPU index 7 does not exist \(valid: 0..3\)"):
        devices.create_mig_instance(7, 19, 0)
    with pytest.raises(DeviceError, match="compute mode 'TURBO'"):
        devices.set_compute_mode(3, "TURBO")


def test_in_use_instance_is_not_destroyed(devices, machine: Path):
    inst = devices.create_mig_instance(0, 14, 0)
    pid = simnvml.add_process(machine, 0, mig_uuid=inst.uuid)
    assert devices.mig_instances(0)[0].processes == 1
    with pytest.raises(DeviceError, match=f"IN_USE .*{inst.uuid}") as err:
        devices.destroy_mig_instance(0, 0)
    assert err.value.code == "IN_USE"
    assert devices.mig_instances(0)[0].uuid == inst.uuid        # still whole: GI and CI
    with pytest.raises(DeviceError, match="IN_USE") as err:
        devices.set_mig_mode(0, False)
    simnvml.remove_process(machine, pid)
    devices.destroy_mig_instance(0, 0)
    assert devices.set_mig_mode(0, False) is True                # Ampere: pending until reset
    assert devices.gpu(0).mig_pending is False and devices.gpu(0).mig_current is True
    simnvml.reset_gpu(machine, 0)
    assert devices.gpu(0).mig_current is False


def test_mig_mode_on_hopper_applies_at_once_and_non_mig_gpu_refuses(devices):
    assert devices.set_mig_mode(1, False) is False
    assert devices.gpu(1).mig_current is False
    with pytest.raises(DeviceError, match="does not support MIG") as err:
        devices.set_mig_mode(3, True)
    assert err.value.code == "NOT_SUPPORTED"


def test_compute_mode_round_trip(devices):
    devices.set_compute_mode(3, "EXCLUSIVE_PROCESS")
    assert devices.gpu(3).compute_mode == "EXCLUSIVE_PROCESS"
    devices.set_compute_mode(3, "DEFAULT")
    assert devices.gpu(3).compute_mode == "DEFAULT"


def test_failed_compute_instance_creation_leaves_no_gpu_instance(devices, machine: Path):
    """Compensation: if the CI cannot be created the GI is destroyed again."""
    class NoComputeInstances(simnvml.SimNvml):
        def nvmlGpuInstanceCreateComputeInstance(self, gpu_instance, profile_id):
            raise simnvml.NVMLError(simnvml.NVML_ERROR_INSUFFICIENT_RESOURCES)

    broken = NvmlDevices(NoComputeInstances(machine))
    with pytest.raises(DeviceError, match="INSUFFICIENT_RESOURCES"):
        broken.create_mig_instance(0, 19, 0)
    assert devices.mig_instances(0) == []


def test_factory_requires_explicit_configuration(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("FASTSHARE_GPU_BACKEND", raising=False)
    monkeypatch.delenv("FASTSHARE_SIM_STATE", raising=False)
    with pytest.raises(DeviceError, match="no GPU backend configured") as err:
        open_devices()
    assert err.value.code == "NOT_CONFIGURED"
    with pytest.raises(DeviceError, match="needs a machine file"):
        open_devices("sim")
    with pytest.raises(DeviceError, match="does not exist; create it with"):
        open_devices("sim", tmp_path / "nope.json")
    with pytest.raises(DeviceError, match="not one of nvml, sim"):
        open_devices("cuda")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(DeviceError, match="is not a simulated machine file"):
        open_devices("sim", garbage)
    path = tmp_path / "m.json"
    simnvml.create_machine(path, ["L4"])
    monkeypatch.setenv("FASTSHARE_GPU_BACKEND", "sim")
    monkeypatch.setenv("FASTSHARE_SIM_STATE", str(path))
    with open_devices() as d:
        assert d.gpu(0).name == "NVIDIA L4"


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None or os.path.exists("/dev/nvidiactl"),
                    reason="a real NVIDIA driver is present")
def test_real_nvml_without_driver_fails_loudly_without_fallback():
    with pytest.raises(DeviceError, match="does not fall back to simulated GPUs") as err:
        open_devices("nvml")
    assert err.value.code in {"LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED"}


_HAS_GPU = ctypes.util.find_library("nvidia-ml") is not None and os.path.exists("/dev/nvidiactl")


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_GPU, reason="needs a real NVIDIA GPU and driver")
def test_real_nvml_inventory_is_read_only_and_consistent():
    """On a GPU host the same backend reads real NVML (read-only: changes nothing)."""
    with open_devices("nvml") as d:
        gpus = d.gpus()
        assert gpus and all(g.uuid.startswith("GPU-") and g.memory_mib > 0 for g in gpus)
        topo = d.topology()
        assert set(topo.levels) == {(i, j) for i in range(len(gpus)) for j in range(i + 1, len(gpus))}
        for g in gpus:
            if g.mig_current:
                shape_profiles = d.mig_profiles(g.index)
                assert all(p.memory_slices > 0 and p.placements for p in shape_profiles)
                assert all(i.size > 0 for i in d.mig_instances(g.index))


def test_processes_on_a_mig_device_count_without_the_aggregate_list(devices, machine: Path):
    inst = devices.create_mig_instance(0, 14, 0)
    simnvml.add_process(machine, 0, mig_uuid=inst.uuid)
    with NvmlDevices(simnvml.SimNvml(machine, privileged=False)) as unprivileged:
        assert unprivileged.mig_instances(0)[0].processes == 1
        with pytest.raises(DeviceError, match=f"IN_USE .*{inst.uuid}"):
            unprivileged.destroy_mig_instance(0, 0)


def test_an_unprivileged_caller_lists_a_mig_gpu_with_its_memory(devices, machine: Path):
    """NVML gives the aggregate memory of a MIG-enabled GPU's own handle only to a caller with
    the privileges for it (NO_PERMISSION otherwise, as for its aggregate process list): the
    listing must not fail for a user without them, and the GPU keeps its memory size."""
    inst = devices.create_mig_instance(0, 14, 0)
    simnvml.add_process(machine, 0, mig_uuid=inst.uuid)
    expected = [(g.index, g.memory_mib) for g in devices.gpus()]
    with NvmlDevices(simnvml.SimNvml(machine, privileged=False)) as unprivileged:
        gpus = unprivileged.gpus()
        assert [(g.index, g.memory_mib) for g in gpus] == expected
        assert gpus[0].mig_instances[0].processes == 1
        assert unprivileged.gpu(0).memory_mib == expected[0][1]


def test_a_mig_device_destroyed_while_the_gpus_are_read_is_not_an_error(devices, machine: Path):
    """A release destroys a MIG device (here through a second handle, as another thread or
    process would) between the listing of the GPU's MIG devices and the queries of its
    handle. The inventory must come back without it, not fail with INVALID_ARGUMENT (the
    agent's GetInventory failed with INTERNAL under load this way)."""
    devices.create_mig_instance(0, 19, 0)
    devices.create_mig_instance(0, 19, 1)
    nvml = devices._nvml
    real = nvml.nvmlDeviceGetAttributes
    calls, destroyed = [], []

    def attributes_after_a_release(handle):
        calls.append(handle)
        if len(calls) == 2 and not destroyed:   # the second device's handle is already listed
            with open_devices("sim", machine) as other:
                other.destroy_mig_instance(0, 1)
            destroyed.append(1)
        return real(handle)

    nvml.nvmlDeviceGetAttributes = attributes_after_a_release
    try:
        starts = [m.start for m in devices.gpus()[0].mig_instances]
    finally:
        nvml.nvmlDeviceGetAttributes = real
    assert destroyed and starts == [0]


def test_mig_mode_change_refused_on_a_busy_gpu_leaves_nothing_pending(devices, machine: Path):
    """NVML records the mode as pending and answers IN_USE in the activation status when
    processes run: the backend reports IN_USE and withdraws the pending change, so the GPU
    does not switch at the next reset behind the operator's back."""
    pid = simnvml.add_process(machine, 2)                       # A100, MIG off
    with pytest.raises(DeviceError, match="IN_USE") as err:
        devices.set_mig_mode(2, True)
    assert err.value.code == "IN_USE"
    gpu = devices.gpu(2)
    assert (gpu.mig_current, gpu.mig_pending) == (False, False)
    simnvml.remove_process(machine, pid)
    assert devices.set_mig_mode(2, True) is True                # Ampere: pending until reset


def test_a_destroy_racing_another_process_does_not_destroy_the_instance_it_made(machine: Path, monkeypatch):
    """Two processes (two agents, or an agent and `fastshare mig`) on one GPU: while one finds the
    instance at start 4 and checks it is idle, the other destroys it and makes a new one there,
    with the same GI and CI ids. NVML has invalidated the first one's handles by then; its
    destroy must fail, not destroy the other's new instance."""
    with open_devices("sim", machine) as mine, open_devices("sim", machine) as other:
        mine.create_mig_instance(0, 9, 4)
        checked = NvmlDevices._instances

        def meanwhile(self, *args, **kwargs):
            if self is mine:
                other.destroy_mig_instance(0, 4)
                made = other.create_mig_instance(0, 9, 4)
                meanwhile.made = made.uuid
            return checked(self, *args, **kwargs)

        monkeypatch.setattr(NvmlDevices, "_instances", meanwhile)
        with pytest.raises(DeviceError) as err:
            mine.destroy_mig_instance(0, 4)
        monkeypatch.undo()
        assert err.value.code == "INVALID_ARGUMENT" and "replaced it meanwhile" in str(err.value)
        assert [i.uuid for i in other.mig_instances(0)] == [meanwhile.made]
