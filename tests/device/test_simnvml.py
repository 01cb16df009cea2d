"""The simulated NVML behaves like pynvml where fastshare depends on it."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from fastshare.device import catalog, simnvml


@pytest.fixture
def nvml(machine: Path):
    n = simnvml.SimNvml(machine)
    n.nvmlInit()
    yield n
    n.nvmlShutdown()


def _placement(start: int, size: int) -> pynvml.c_nvmlGpuInstancePlacement_t:
    p = pynvml.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return p


def test_exports_pynvml_errors_constants_and_structs():
    assert simnvml.NVMLError_InsufficientResources is pynvml.NVMLError_InsufficientResources
    assert simnvml.NVML_ERROR_IN_USE == 19
    assert simnvml.c_nvmlGpuInstancePlacement_t is pynvml.c_nvmlGpuInstancePlacement_t
    n = simnvml.SimNvml("/nonexistent")
    assert n.NVMLError_InUse is pynvml.NVMLError_InUse
    assert "NVML_ERROR_IN_USE" in dir(n)


def test_calls_before_init_and_without_machine_fail_like_nvml(machine: Path, tmp_path: Path):
    n = simnvml.SimNvml(machine)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        n.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        simnvml.SimNvml(tmp_path / "missing.json").nvmlInit()


def test_inventory_shapes(nvml):
    assert nvml.nvmlDeviceGetCount() == 4
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(h, pynvml.c_nvmlDevice_t)
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA A100-SXM4-40GB"
    assert nvml.nvmlDeviceGetUUID(h).startswith("GPU-")
    assert nvml.nvmlDeviceGetMemoryInfo(h).total == 40960 * 1024 * 1024
    assert nvml.nvmlDeviceGetPciInfo(h).busId == "00000000:07:00.0"   # pynvml's struct decodes
    assert nvml.nvmlDeviceGetMigMode(h) == [1, 1]
    assert nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(nvml.nvmlDeviceGetUUID(h))) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMigMode(nvml.nvmlDeviceGetHandleByIndex(3))   # L4 has no MIG
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetAttributes(h)                                  # MIG device handles only
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(9)


def test_profile_info_takes_the_enum_index_and_reports_the_id(nvml):
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    assert (info.id, info.sliceCount, info.instanceCount, info.multiprocessorCount, info.memorySizeMB) == (
        9, 3, 2, 42, 19968)
    assert info.name == "MIG 3g.20gb"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE)
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 14, None, ctypes.byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 14, array, ctypes.byref(count))
    assert [(p.start, p.size) for p in array] == [(0, 2), (2, 2), (4, 2)]


def test_mig_guide_example_default_placer_fails_on_19_19_14_9(nvml):
    """GPU-FACTS.md: 19,19,14,9 in that order fails with INSUFFICIENT_RESOURCES; 9,19,14,19 works."""
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    for pid in (19, 19, 14):
        nvml.nvmlDeviceCreateGpuInstance(h, pid)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(h, 9)
    h1 = nvml.nvmlDeviceGetHandleByIndex(1)   # H100: same placement rules
    for pid in (9, 19, 14, 19):
        nvml.nvmlDeviceCreateGpuInstance(h1, pid)
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h1, 19) == 0


def test_explicit_placement_rules(nvml):
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, ctypes.byref(_placement(4, 4)))
    info = nvml.nvmlGpuInstanceGetInfo(gi)
    assert (info.profileId, info.placement.start, info.placement.size) == (9, 4, 4)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):     # overlaps slices 4..7
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, ctypes.byref(_placement(5, 1)))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):           # 3g cannot start at 2
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, ctypes.byref(_placement(2, 4)))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):           # wrong size
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, ctypes.byref(_placement(0, 2)))
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 20, _placement(0, 1))   # struct by value works too
    with pytest.raises(pynvml.NVMLError_InsufficientResources):     # 1g+me: max one instance
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 20, ctypes.byref(_placement(1, 1)))
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 3
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 9) == 0
    array = (pynvml.c_nvmlGpuInstance_t * 2)()
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstances(h, 9, array, ctypes.byref(count))
    assert count.value == 1 and nvml.nvmlGpuInstanceGetInfo(array[0]).id == info.id


def test_mig_ops_with_mig_disabled_are_refused(nvml):
    h = nvml.nvmlDeviceGetHandleByIndex(2)   # A100, MIG off
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, ctypes.byref(_placement(0, 1)))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, 0)


def _full_mig_device(nvml, gpu: int, profile_id: int, start: int, size: int):
    h = nvml.nvmlDeviceGetHandleByIndex(gpu)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, ctypes.byref(_placement(start, size)))
    slices = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, {19: 0, 14: 1, 9: 2}[profile_id]).sliceCount
    ci_enum = {1: 0, 2: 1, 3: 2}[slices]
    ci_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, ci_enum, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    return h, gi, ci


def test_mig_devices_and_in_use_refusals(nvml, machine: Path):
    h, gi, ci = _full_mig_device(nvml, 0, 9, 0, 4)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)
    mig_uuid = nvml.nvmlDeviceGetUUID(mig)
    assert mig_uuid.startswith("MIG-")
    assert nvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
    assert nvml.nvmlDeviceGetAttributes(mig).multiprocessorCount == 42
    assert nvml.nvmlDeviceGetName(mig) == "NVIDIA A100-SXM4-40GB MIG 3g.20gb"
    assert nvml.nvmlDeviceGetMemoryInfo(mig).total == 19968 * 1024 * 1024
    with pytest.raises(pynvml.NVMLError_InUse):          # a GI with a CI cannot go
        nvml.nvmlGpuInstanceDestroy(gi)

    pid = simnvml.add_process(machine, 0, mig_uuid=mig_uuid, used_mib=1000)
    procs = nvml.nvmlDeviceGetComputeRunningProcesses(mig)
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(pid, 1000 * 1024 * 1024)]
    assert nvml.nvmlDeviceGetComputeRunningProcesses(h)[0].gpuInstanceId == nvml.nvmlGpuInstanceGetInfo(gi).id
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.nvmlComputeInstanceDestroy(ci)
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.nvmlDeviceSetMigMode(h, 0)
    simnvml.remove_process(machine, pid)
    with pytest.raises(pynvml.NVMLError_InUse):          # instances still exist
        nvml.nvmlDeviceSetMigMode(h, 0)
    nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(gi)
    assert nvml.nvmlDeviceSetMigMode(h, 0) == pynvml.NVML_ERROR_RESET_REQUIRED


def test_ampere_mode_change_is_pending_until_reset_hopper_is_immediate(nvml, machine: Path):
    a100 = nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml.nvmlDeviceSetMigMode(a100, 1) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert nvml.nvmlDeviceGetMigMode(a100) == [0, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(a100, 19, ctypes.byref(_placement(0, 1)))
    simnvml.add_process(machine, 2)
    with pytest.raises(pynvml.NVMLError_InUse):
        simnvml.reset_gpu(machine, 2)
    simnvml.reboot(machine)
    assert nvml.nvmlDeviceGetMigMode(a100) == [1, 1]

    h100 = nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceSetMigMode(h100, 0) == pynvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(h100) == [0, 0]


def test_non_mig_gpu_process_and_compute_mode(nvml, machine: Path):
    l4 = nvml.nvmlDeviceGetHandleByIndex(3)
    pid = simnvml.add_process(machine, 3, used_mib=512)
    assert nvml.nvmlDeviceGetMemoryInfo(l4).used == 512 * 1024 * 1024
    assert nvml.nvmlDeviceGetComputeRunningProcesses(l4)[0].pid == pid
    with pytest.raises(ValueError, match="MIG mode"):
        simnvml.add_process(machine, 0)        # GPU 0 is in MIG mode: needs a MIG device
    nvml.nvmlDeviceSetComputeMode(l4, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert nvml.nvmlDeviceGetComputeMode(l4) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceSetComputeMode(l4, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD)


def test_a_process_cannot_use_more_memory_than_its_device_has_free(nvml, machine: Path):
    """Memory info never reports more used than total (a CUDA allocation would have failed):
    a simulated process larger than what is free is refused and nothing is recorded."""
    l4 = nvml.nvmlDeviceGetHandleByIndex(3)
    total = nvml.nvmlDeviceGetMemoryInfo(l4).total // (1024 * 1024)
    simnvml.add_process(machine, 3, used_mib=total - 100)
    before = machine.read_bytes()
    with pytest.raises(ValueError, match="101 MiB is more than the 100 MiB free on GPU 3"):
        simnvml.add_process(machine, 3, used_mib=101)
    assert machine.read_bytes() == before
    simnvml.add_process(machine, 3, used_mib=100)
    info = nvml.nvmlDeviceGetMemoryInfo(l4)
    assert info.used == info.total and info.free == 0


def test_failed_call_leaves_the_file_untouched(nvml, machine: Path):
    before = machine.read_bytes()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 0, ctypes.byref(_placement(0, 8)))
    middle = machine.read_bytes()
    assert middle != before
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, ctypes.byref(_placement(0, 1)))
    assert machine.read_bytes() == middle


_CHILD = """
import ctypes, sys, pynvml
from fastshare.device import simnvml
simnvml.set_state_path(sys.argv[1])
simnvml.nvmlInit()
h = simnvml.nvmlDeviceGetHandleByIndex(0)
p = pynvml.c_nvmlGpuInstancePlacement_t(); p.start, p.size = int(sys.argv[2]), 1
try:
    simnvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, ctypes.byref(p))
    print("created")
except pynvml.NVMLError_InsufficientResources:
    print("insufficient")
"""


def test_separate_processes_see_one_machine(nvml, machine: Path):
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(machine), str(start)],
                                 stdout=subprocess.PIPE, text=True) for start in (3, 3, 5)]
    outputs = sorted(c.communicate(timeout=120)[0].strip() for c in children)
    assert outputs == ["created", "created", "insufficient"]   # exactly one child won slice 3
    array = (pynvml.c_nvmlGpuInstance_t * 7)()
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstances(h, 19, array, ctypes.byref(count))
    starts = sorted(nvml.nvmlGpuInstanceGetInfo(array[i]).placement.start for i in range(count.value))
    assert starts == [3, 5]


def _records(value):
    """Every object in a machine file (the file, its GPUs, instances and processes)."""
    if isinstance(value, dict):
        yield value
        values = value.values()
    else:
        values = value if isinstance(value, list) else ()
    for item in values:
        yield from _records(item)


def test_every_field_the_simulator_writes_is_checked_when_a_machine_is_opened(nvml, machine: Path):
    """A field added to the machine file but not to `check_machine` would let a damaged file
    through to fail inside an NVML call; so deleting any written field must be refused, by name.
    The instance serials came later: a file without them (made before) is still a machine, but
    one of the wrong type is refused by name too."""
    h, _, _ = _full_mig_device(nvml, 0, 9, 0, 4)
    mig_uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
    simnvml.add_process(machine, 0, mig_uuid=mig_uuid, used_mib=100)
    simnvml.add_process(machine, 3, used_mib=100)
    state = simnvml.load_machine(machine)
    simnvml.check_machine(state)
    kinds = set()
    for record in _records(state):
        for key in list(record):
            kinds.add(key)
            value = record.pop(key)
            if key in ("serial", "next_serial"):
                simnvml.check_machine(state)
                record[key] = "7"
                with pytest.raises(ValueError, match=rf"\.{key}: '7', expected int"):
                    simnvml.check_machine(state)
            else:
                with pytest.raises(ValueError, match=rf"\.{key}: missing"):
                    simnvml.check_machine(state)
            record[key] = value
    # the walk met every kind of record: machine, GPU, GPU instance, compute instance, process
    assert {"next_pid", "mig_current", "compute_instances", "slices", "used_mib", "serial",
            "next_serial"} <= kinds


def test_possible_placements_do_not_need_mig_enabled(nvml):
    """NVML: the call returns every possible placement of the profile "regardless of whether MIG
    is enabled or not"; only a GPU without MIG support answers NOT_SUPPORTED."""
    off = nvml.nvmlDeviceGetHandleByIndex(2)   # A100-40GB, MIG disabled
    assert nvml.nvmlDeviceGetMigMode(off) == [0, 0]
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(off, 9, None, ctypes.byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(off, 9, array, ctypes.byref(count))
    assert [(p.start, p.size) for p in array] == [(0, 4), (4, 4)]
    with pytest.raises(pynvml.NVMLError_NotSupported):   # L4: no MIG at all
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            nvml.nvmlDeviceGetHandleByIndex(3), 9, None, ctypes.byref(count))


def test_max_mig_device_count_is_zero_without_mig(nvml):
    """NVML: "Returns zero if MIG is not supported or enabled" (a success, not an error)."""
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(nvml.nvmlDeviceGetHandleByIndex(0)) == 7   # MIG on
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(nvml.nvmlDeviceGetHandleByIndex(2)) == 0   # MIG off
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(nvml.nvmlDeviceGetHandleByIndex(3)) == 0   # L4: no MIG



@pytest.mark.parametrize("model", ["A100-SXM4-40GB", "H100-SXM5-80GB"])
def test_mode_change_on_a_busy_gpu_is_pending_with_in_use_activation_status(tmp_path: Path, model):
    """NVML: the call succeeds and its activation status says IN_USE when the GPU is not idle;
    the new mode is recorded as pending (nvidia-smi: "MIG mode is in pending enable state ...
    In use by another client"). The caller idles the GPU and retries, or asks for the old mode."""
    path = tmp_path / "m.json"
    simnvml.create_machine(path, [model])
    nvml = simnvml.SimNvml(path)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    pid = simnvml.add_process(path, 0)
    assert nvml.nvmlDeviceSetMigMode(h, 1) == pynvml.NVML_ERROR_IN_USE
    assert nvml.nvmlDeviceGetMigMode(h) == [0, 1]
    assert nvml.nvmlDeviceSetMigMode(h, 0) == pynvml.NVML_SUCCESS   # withdrawn
    assert nvml.nvmlDeviceGetMigMode(h) == [0, 0]
    simnvml.remove_process(path, pid)
    expected = pynvml.NVML_ERROR_RESET_REQUIRED if model.startswith("A100") else pynvml.NVML_SUCCESS
    assert nvml.nvmlDeviceSetMigMode(h, 1) == expected
    nvml.nvmlShutdown()


def test_every_gpu_of_a_large_machine_has_a_valid_distinct_pci_bus_id(tmp_path):
    """NVML's bus id is DOMAIN:BUS:DEVICE.FUNCTION with an 8-bit bus. The 17th GPU got bus 0x107
    ("00000000:107:00.0"), which no PCI address has; past 16 GPUs the next PCI domain is used."""
    import re

    state = simnvml.create_machine(tmp_path / "m.json", ["L4"] * simnvml.MAX_GPUS)
    ids = [g["pci_bus_id"] for g in state["gpus"]]
    assert all(re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]", i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    assert ids[:2] == ["00000000:07:00.0", "00000000:17:00.0"]


def test_a_removed_gpu_is_gone_and_the_gpus_after_it_are_numbered_anew(nvml, machine: Path):
    """As NVML enumerates after a host boots without a GPU: the count drops, the GPUs after it
    keep their UUID and PCI bus id under the next lower index, the removed UUID is not found."""
    before = simnvml.load_machine(machine)["gpus"]
    simnvml.add_process(machine, 3)
    gone = simnvml.remove_gpu(machine, 1)
    assert gone == before[1]["uuid"]
    assert nvml.nvmlDeviceGetCount() == len(before) - 1
    for i, old in enumerate(before[:1] + before[2:]):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        assert nvml.nvmlDeviceGetUUID(h) == old["uuid"] and nvml.nvmlDeviceGetIndex(h) == i
        assert nvml.nvmlDeviceGetPciInfo(h).busId == old["pci_bus_id"]
        assert nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(old["uuid"])) == i
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID(gone)
    assert nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(2)) == []  # booted
    simnvml.check_machine(simnvml.load_machine(machine))
    with pytest.raises(ValueError, match=r"gpu index 3 out of range 0\.\.2"):
        simnvml.remove_gpu(machine, 3)


def test_an_unprivileged_caller_gets_no_aggregate_memory_or_processes_of_a_mig_gpu(machine: Path):
    """NVML (nvmlDeviceGetMemoryInfo, nvmlDeviceGetComputeRunningProcesses): "In MIG mode, if
    device handle is provided, the API returns aggregate information, only if the caller has
    appropriate privileges. Per-instance information can be queried by using specific MIG
    device handles." A GPU without MIG answers anyone."""
    nvml = simnvml.SimNvml(machine, privileged=False)
    nvml.nvmlInit()
    h, _, _ = _full_mig_device(nvml, 0, 9, 0, 4)
    for call in (nvml.nvmlDeviceGetMemoryInfo, nvml.nvmlDeviceGetComputeRunningProcesses):
        with pytest.raises(pynvml.NVMLError_NoPermission):
            call(h)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert nvml.nvmlDeviceGetMemoryInfo(mig).total == 19968 * 1024 * 1024
    assert nvml.nvmlDeviceGetComputeRunningProcesses(mig) == []
    whole = nvml.nvmlDeviceGetHandleByIndex(2)                      # A100, MIG off
    assert nvml.nvmlDeviceGetMemoryInfo(whole).total == 40960 * 1024 * 1024
    assert nvml.nvmlDeviceGetComputeRunningProcesses(whole) == []


def test_a_destroyed_instances_handles_fail_even_once_its_ids_are_reused(nvml):
    """NVML: once a GPU or compute instance is destroyed its handle "would become invalid"
    (nvml.h, nvmlDeviceCreateGpuInstance / nvmlGpuInstanceCreateComputeInstance), and a call
    on an invalid handle answers INVALID_ARGUMENT. The ids are reused by the next create, so a
    handle kept across the destroy must not answer for (or destroy) the new instance."""
    h, old_gi, old_ci = _full_mig_device(nvml, 0, 9, 0, 4)
    old_mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    old_ids = (nvml.nvmlGpuInstanceGetInfo(old_gi).id, nvml.nvmlComputeInstanceGetInfo(old_ci).id)
    nvml.nvmlComputeInstanceDestroy(old_ci)
    nvml.nvmlGpuInstanceDestroy(old_gi)
    _, new_gi, new_ci = _full_mig_device(nvml, 0, 9, 0, 4)
    assert (nvml.nvmlGpuInstanceGetInfo(new_gi).id, nvml.nvmlComputeInstanceGetInfo(new_ci).id) == old_ids
    stale = [
        lambda: nvml.nvmlGpuInstanceGetInfo(old_gi),
        lambda: nvml.nvmlComputeInstanceGetInfo(old_ci),
        lambda: nvml.nvmlDeviceGetUUID(old_mig),
        lambda: nvml.nvmlDeviceGetGpuInstanceId(old_mig),
        lambda: nvml.nvmlComputeInstanceDestroy(old_ci),
        lambda: nvml.nvmlGpuInstanceDestroy(old_gi),
    ]
    for call in stale:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            call()
    # the new instance is untouched, and its own handles answer
    assert nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0) is not None
    assert nvml.nvmlGpuInstanceGetInfo(new_gi).placement.start == 0
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)).startswith("MIG-")
    info = nvml.nvmlComputeInstanceGetInfo(new_ci)
    assert nvml.nvmlGpuInstanceGetInfo(info.gpuInstance).id == old_ids[0]


def test_a_destroyed_gpu_instances_handle_is_invalid_after_mig_is_disabled_too(nvml):
    """Invalid handle first (INVALID_ARGUMENT), not NOT_SUPPORTED for the MIG mode it no longer has."""
    h = nvml.nvmlDeviceGetHandleByIndex(1)    # H100: the mode change applies at once
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, ctypes.byref(_placement(0, 1)))
    nvml.nvmlGpuInstanceDestroy(gi)
    assert nvml.nvmlDeviceSetMigMode(h, 0) == pynvml.NVML_SUCCESS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpuInstanceGetInfo(gi)


def test_instances_of_a_machine_file_from_before_serials_still_answer(nvml, machine: Path):
    """A machine file written before instances had serials (an upgraded node keeps its file)."""
    h, _, _ = _full_mig_device(nvml, 0, 9, 0, 4)
    state = simnvml.load_machine(machine)
    del state["next_serial"]
    for gi in state["gpus"][0]["gpu_instances"]:
        del gi["serial"]
        for ci in gi["compute_instances"]:
            del ci["serial"]
    machine.write_text(json.dumps(state))
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert nvml.nvmlDeviceGetUUID(mig).startswith("MIG-")
    array = (pynvml.c_nvmlGpuInstance_t * 2)()
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstances(h, 9, array, ctypes.byref(count))
    cis = (pynvml.c_nvmlComputeInstance_t * 1)()
    nvml.nvmlGpuInstanceGetComputeInstances(array[0], 2, cis, ctypes.byref(count))
    nvml.nvmlComputeInstanceDestroy(cis[0])
    nvml.nvmlGpuInstanceDestroy(array[0])
    _, gi, _ = _full_mig_device(nvml, 0, 9, 0, 4)
    assert nvml.nvmlGpuInstanceGetInfo(gi).placement.start == 0


def test_a_mig_device_is_found_by_its_older_uuid_form_too(nvml):
    """NVML API reference change log, "Changes between v460 and v465": nvmlDeviceGetHandleByUUID
    accepts both 'MIG-UUID' and 'MIG-GPU UUID/GID/CID' (the R450/R460 name of a MIG device,
    which CUDA_VISIBLE_DEVICES takes as well); nvmlDeviceGetUUID returns the first."""
    h, gi, ci = _full_mig_device(nvml, 0, 9, 4, 4)
    gpu_uuid = nvml.nvmlDeviceGetUUID(h)
    gi_id, ci_id = nvml.nvmlGpuInstanceGetInfo(gi).id, nvml.nvmlComputeInstanceGetInfo(ci).id
    mig_uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
    old = nvml.nvmlDeviceGetHandleByUUID(f"MIG-{gpu_uuid}/{gi_id}/{ci_id}".encode())
    assert nvml.nvmlDeviceGetUUID(old) == mig_uuid
    assert (nvml.nvmlDeviceGetGpuInstanceId(old), nvml.nvmlDeviceGetComputeInstanceId(old)) == (gi_id, ci_id)
    for missing in (f"MIG-{gpu_uuid}/{gi_id}/{ci_id + 1}", f"MIG-{gpu_uuid}/{gi_id + 1}/{ci_id}",
                    f"MIG-{gpu_uuid}/{gi_id}", f"MIG-{gpu_uuid}/x/{ci_id}",
                    f"MIG-{nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(2))}/{gi_id}/{ci_id}"):
        with pytest.raises(pynvml.NVMLError_NotFound):
            nvml.nvmlDeviceGetHandleByUUID(missing)


@pytest.mark.parametrize("handle", [True, False])
def test_a_mig_device_of_a_lost_gpu_answers_gpu_is_lost(nvml, machine: Path, handle: bool):
    """A GPU lost with its handle cannot be acquired by any name, its MIG devices' UUIDs (both
    forms) included; lost for calls only, its MIG device's handle comes but every call on it
    raises NVML_ERROR_GPU_IS_LOST."""
    h, gi, ci = _full_mig_device(nvml, 0, 9, 4, 4)
    gpu_uuid = nvml.nvmlDeviceGetUUID(h)
    names = (nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)),
             f"MIG-{gpu_uuid}/{nvml.nvmlGpuInstanceGetInfo(gi).id}/{nvml.nvmlComputeInstanceGetInfo(ci).id}")
    simnvml.lose_gpu(machine, 0, handle=handle)
    for name in names:
        if handle:
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                nvml.nvmlDeviceGetHandleByUUID(name)
        else:
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByUUID(name))


# (copy engines, decoders, encoders, JPEG, OFA) of each GPU-instance profile: the MIG user guide,
# "Supported MIG Profiles" (A100-SXM4-40GB, and the -80GB names; H100 80GB "PCIe and SXM5"; H200
# 141GB), and for the A30 `nvidia-smi mig -lgip` on A30s (R535): its 1g.6gb has one decoder
# (DEC 1), where the guide's table says 0; its 2g.12gb+me (R525 and later) has 2 CE, 2 DEC,
# 1 JPEG, 1 OFA in both. None of these GPUs has a video encoder (NVENC).
_A100_ENGINES = ((1, 0, 0, 0, 0), (1, 1, 0, 1, 1), (1, 1, 0, 0, 0), (2, 1, 0, 0, 0),   # 1g, 1g+me, 1g 2 mem
                 (3, 2, 0, 0, 0), (4, 2, 0, 0, 0), (7, 5, 0, 1, 1))                    # 2g, 3g, 4g, 7g
_HOPPER_ENGINES = ((1, 1, 0, 1, 0), (1, 1, 0, 1, 1), (1, 1, 0, 1, 0), (2, 2, 0, 2, 0),
                   (3, 3, 0, 3, 0), (4, 4, 0, 4, 0), (8, 7, 0, 7, 1))


def _named(sizes: str, engines: tuple) -> dict[str, tuple]:
    """Profile names from the memory of 1g, 1g with two memory slices, 2g, 3g/4g and 7g."""
    m1, m2, m4, m8 = sizes.split()
    names = [f"1g.{m1}gb", f"1g.{m1}gb+me", f"1g.{m2}gb", f"2g.{m2}gb", f"3g.{m4}gb", f"4g.{m4}gb",
             f"7g.{m8}gb"]
    return dict(zip(names, engines, strict=True))


_GUIDE_ENGINES = {
    "A100-SXM4-40GB": _named("5 10 20 40", _A100_ENGINES),
    "A100-SXM4-80GB": _named("10 20 40 80", _A100_ENGINES),
    "H100-SXM5-80GB": _named("10 20 40 80", _HOPPER_ENGINES),
    "H100-PCIE-80GB": _named("10 20 40 80", _HOPPER_ENGINES),
    "H200-SXM5-141GB": _named("18 35 71 141", _HOPPER_ENGINES),
    "A30-24GB": {"1g.6gb": (1, 1, 0, 0, 0), "1g.6gb+me": (1, 1, 0, 1, 1), "2g.12gb": (2, 2, 0, 0, 0),
                 "2g.12gb+me": (2, 2, 0, 1, 1), "4g.24gb": (4, 4, 0, 1, 1)},
}


@pytest.mark.parametrize("model", sorted(_GUIDE_ENGINES))
def test_engine_counts_of_every_mig_profile_match_the_mig_user_guide(tmp_path: Path, model):
    """GPU-instance profiles, their compute-instance profiles and their MIG devices report the
    engines a real GPU of the model does (a MIG device shares its GPU instance's engines)."""
    path = tmp_path / "m.json"
    simnvml.create_machine(path, [model], mig_enabled=True)
    n = simnvml.SimNvml(path)
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    found = {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = n.nvmlDeviceGetGpuInstanceProfileInfo(h, enum)
        except pynvml.NVMLError_NotSupported:
            continue
        engines = (info.copyEngineCount, info.decoderCount, info.encoderCount, info.jpegCount, info.ofaCount)
        found[info.name.removeprefix("MIG ")] = engines
        gi = n.nvmlDeviceCreateGpuInstance(h, info.id)
        shared = []
        for ci_enum in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                ci_info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, ci_enum, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            except pynvml.NVMLError_NotSupported:
                continue
            shared.append((ci_info.sharedCopyEngineCount, ci_info.sharedDecoderCount,
                           ci_info.sharedEncoderCount, ci_info.sharedJpegCount, ci_info.sharedOfaCount))
            if ci_info.sliceCount == info.sliceCount:
                ci = n.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
        assert shared and set(shared) == {engines}
        attrs = n.nvmlDeviceGetAttributes(n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
        assert (attrs.sharedCopyEngineCount, attrs.sharedDecoderCount, attrs.sharedEncoderCount,
                attrs.sharedJpegCount, attrs.sharedOfaCount) == engines
        n.nvmlComputeInstanceDestroy(ci)
        n.nvmlGpuInstanceDestroy(gi)
    assert found == _GUIDE_ENGINES[model]     # every profile of the table, none other


def test_every_mig_capable_model_has_its_engine_counts_checked():
    assert set(_GUIDE_ENGINES) == {m.key for m in catalog.MODELS.values() if m.mig_capable}


def test_a30_answers_the_2_slice_rev1_index_with_its_2g_12gb_plus_me(tmp_path: Path):
    """NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 (8) is the A30's 2g.12gb+me, profile id 6 (MIG
    user guide; `nvidia-smi mig -lgip`/-lgipp on an A30, R535): 28 SMs, the memory of a 2g.12gb,
    one instance at most, at 0 or 2. Models without it answer NOT_SUPPORTED, as for every index
    a model lacks (the A30's 3-slice, the A100's 6-slice)."""
    path = tmp_path / "m.json"
    simnvml.create_machine(path, ["A30-24GB", "A100-SXM4-40GB", "H100-SXM5-80GB", "H200-SXM5-141GB"],
                           mig_enabled=True)
    n = simnvml.SimNvml(path)
    n.nvmlInit()
    a30 = n.nvmlDeviceGetHandleByIndex(0)
    info = n.nvmlDeviceGetGpuInstanceProfileInfo(a30, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1)
    plain = n.nvmlDeviceGetGpuInstanceProfileInfo(a30, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE)
    assert (info.name, info.id, info.sliceCount, info.instanceCount, info.multiprocessorCount) == (
        "MIG 2g.12gb+me", 6, 2, 1, 28)
    assert (plain.name, plain.id, plain.instanceCount) == ("MIG 2g.12gb", 5, 2)
    assert info.memorySizeMB == plain.memorySizeMB
    count = ctypes.c_uint(0)
    array = (pynvml.c_nvmlGpuInstancePlacement_t * 2)()
    n.nvmlDeviceGetGpuInstancePossiblePlacements(a30, 6, array, ctypes.byref(count))
    assert [(p.start, p.size) for p in array[:count.value]] == [(0, 2), (2, 2)]
    for index in (1, 2, 3):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            n.nvmlDeviceGetGpuInstanceProfileInfo(n.nvmlDeviceGetHandleByIndex(index),
                                                  pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):    # not a profile id of these models
            n.nvmlDeviceCreateGpuInstance(n.nvmlDeviceGetHandleByIndex(index), 6)
    # at most one: a second is refused though half the GPU is free, where a plain 2g fits
    n.nvmlDeviceCreateGpuInstanceWithPlacement(a30, 6, ctypes.byref(_placement(0, 2)))
    assert n.nvmlDeviceGetGpuInstanceRemainingCapacity(a30, 6) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        n.nvmlDeviceCreateGpuInstanceWithPlacement(a30, 6, ctypes.byref(_placement(2, 2)))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        n.nvmlDeviceCreateGpuInstance(a30, 6)
    assert n.nvmlDeviceGetGpuInstanceRemainingCapacity(a30, 5) == 1
    n.nvmlDeviceCreateGpuInstance(a30, 5)
    made = simnvml.load_machine(path)["gpus"][0]["gpu_instances"]
    assert sorted((g["profile_id"], g["start"]) for g in made) == [(5, 2), (6, 0)]


def test_an_a30_machine_file_written_before_the_2g_12gb_plus_me_still_loads(tmp_path: Path):
    """A machine file of an earlier version (no serials, a 2g.12gb made): it
    loads, its instances keep their profiles, and a 2g.12gb+me fits in the free half."""
    path = tmp_path / "old.json"
    gpu = {"index": 0, "model": "A30-24GB", "uuid": "GPU-00000000-0000-0000-0000-000000000030",
           "pci_bus_id": "00000000:07:00.0", "mig_current": 1, "mig_pending": 1, "compute_mode": 0,
           "pcie_switch": 0, "numa_node": 0, "nvlink_domain": None, "processes": [],
           "gpu_instances": [
               {"id": 1, "profile_id": 5, "start": 0, "size": 2, "compute_instances": [
                   {"id": 0, "profile_id": 1, "slices": 2, "start": 0,
                    "uuid": "MIG-00000000-0000-0000-0000-000000000001"}]}]}
    path.write_text(json.dumps({"version": 1, "driver_version": "535.183.01", "gpus": [gpu],
                                "next_pid": 40000}))
    simnvml.check_machine(json.loads(path.read_text()))
    n = simnvml.SimNvml(path)
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    assert n.nvmlDeviceGetName(n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)) == "NVIDIA A30 MIG 2g.12gb"
    assert n.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 6) == 1
    gi = n.nvmlDeviceCreateGpuInstance(h, 6)
    assert (n.nvmlGpuInstanceGetInfo(gi).profileId, n.nvmlGpuInstanceGetInfo(gi).placement.start) == (6, 2)
