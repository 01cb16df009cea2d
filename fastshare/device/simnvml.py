"""Simulated NVML: the pynvml (nvidia-ml-py) calls fastshare uses, over a JSON machine file.

Why: there is no GPU on development and CI machines, yet the real NVML code path must be
tested. This module exposes the same function names, argument and return shapes, ctypes
structs, constants and exception classes as ``pynvml`` (the structs, constants and exception
classes ARE pynvml's), so ``NvmlDevices`` runs unmodified on it and code that catches
``pynvml.NVMLError_InUse`` catches ours.

The machine lives in one JSON file guarded by an ``fcntl`` lock next to it (``<file>.lock``):
every call re-reads the file, mutations are read-modify-write under an exclusive lock and
replace the file atomically, so separate processes (CLI, node agent, Ansible module) see one
machine. A failed call leaves the file untouched.

Two ways to use it:
- ``SimNvml(path)``: an object with the pynvml functions as methods (and pynvml's constants
  as attributes); several simulated machines can coexist in one process.
- the module itself: ``simnvml.nvmlInit()`` etc. act on the file named by
  ``FASTSHARE_SIM_STATE`` or by :func:`set_state_path`.

Handles are ctypes pointers of pynvml's handle types whose *address* encodes what they
point at (never dereferenced), so callers can store them in pynvml's ctypes arrays. The handle
of a GPU instance, compute instance or MIG device also carries its instance's serial, which no
later instance shares: NVML invalidates the handles of a destroyed instance, while its ids are
reused by the next one.

Test-only knobs (no NVML equivalent): :func:`create_machine`, :func:`add_process`,
:func:`remove_process`, :func:`reset_gpu`, :func:`reboot`, :func:`remove_gpu`, :func:`lose_gpu`.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml as _pynvml

from fastshare.device import catalog

# --- pynvml's own constants, structs and exception classes, re-exported -----------------------
for _name in dir(_pynvml):
    if _name.startswith(("NVML_", "NVMLError", "c_nvml", "nvmlPciInfo")) or _name in (
        "nvmlExceptionClass", "nvmlStructToFriendlyObject", "nvmlFriendlyObject",
    ):
        globals()[_name] = getattr(_pynvml, _name)

NVMLError = _pynvml.NVMLError
STATE_ENV = "FASTSHARE_SIM_STATE"
SCHEMA_VERSION = 1
DEFAULT_DRIVER = "550.54.15"
# GPUs in one simulated machine. The largest real nodes have 8 to 16 (HGX/DGX: 8; PCIe chassis
# up to ~20); 64 leaves room for any of them and keeps a pasted or generated list gone wrong
# from writing a machine file of thousands of GPUs.
MAX_GPUS = 64
_MIB = 1024 * 1024
_NA = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of a process outside MIG

# Handle kinds, encoded in the high bits of the fake pointer address.
_GPU, _MIG, _GI, _CI = 1, 2, 3, 4
_SERIAL_MASK = (1 << 28) - 1   # the serial bits a handle carries

# NVML_COMPUTE_INSTANCE_PROFILE_* index -> compute slices
_CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}


def _err(code: int) -> NVMLError:
    return NVMLError(code)


# --- handles --------------------------------------------------------------------------------
def _make(ptr_type: Any, kind: int, gpu: int, gi: int = 0, ci: int = 0, serial: int = 0) -> Any:
    address = (kind << 60) | ((serial & _SERIAL_MASK) << 32) | (gpu << 24) | (gi << 12) | ci
    return ctypes.cast(ctypes.c_void_p(address), ptr_type)


def _decode(handle: Any, *kinds: int) -> tuple[int, int, int, int, int]:
    """(kind, gpu, gi, ci, serial) of a handle; INVALID_ARGUMENT for anything else."""
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value or 0
    except (TypeError, ctypes.ArgumentError):
        raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
    kind = address >> 60
    if kind not in kinds:
        raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return (kind, (address >> 24) & 0xFF, (address >> 12) & 0xFFF, address & 0xFFF,
            (address >> 32) & _SERIAL_MASK)


def _serial(instance: dict[str, Any]) -> int:
    """An instance's serial as its handles carry it; 0 for one made before serials existed."""
    return instance.get("serial", 0) & _SERIAL_MASK


def _gi_handle(gpu: dict[str, Any], gi: dict[str, Any]) -> Any:
    return _make(_pynvml.c_nvmlGpuInstance_t, _GI, gpu["index"], gi["id"], serial=_serial(gi))


def _ci_handle(gpu: dict[str, Any], gi: dict[str, Any], ci: dict[str, Any]) -> Any:
    return _make(_pynvml.c_nvmlComputeInstance_t, _CI, gpu["index"], gi["id"], ci["id"], _serial(ci))


def _mig_handle(gpu: dict[str, Any], gi: dict[str, Any], ci: dict[str, Any]) -> Any:
    """A MIG device handle: its compute instance's, so it dies with that instance."""
    return _make(_pynvml.c_nvmlDevice_t, _MIG, gpu["index"], gi["id"], ci["id"], _serial(ci))


def _next_serial(state: dict[str, Any]) -> int:
    """A serial no instance of this machine had (a machine file from before serials starts at 1)."""
    serial = state.get("next_serial", 1)
    state["next_serial"] = serial + 1
    return serial


def _deref(ref: Any) -> Any:
    """The object behind byref(x), pointer(x) or x itself (pynvml passes all three)."""
    if ref is None:
        return None
    if hasattr(ref, "_obj"):
        return ref._obj
    if hasattr(ref, "contents"):
        return ref.contents
    return ref


def _fill(array_ref: Any, count_ref: Any, handles: list[Any]) -> int:
    """NVML's "array + count" out-parameters: too small an array is INSUFFICIENT_SIZE."""
    count, array = _deref(count_ref), _deref(array_ref)
    if count is None or array is None:
        raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if len(array) < len(handles):
        raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    for i, handle in enumerate(handles):
        array[i] = handle
    count.value = len(handles)
    return _pynvml.NVML_SUCCESS


def _shared(info: Any, engines: catalog.MigEngines) -> None:
    """The shared engine counts of a compute instance or MIG device: its GPU instance's."""
    info.sharedCopyEngineCount, info.sharedDecoderCount = engines.copy, engines.decoders
    info.sharedEncoderCount, info.sharedJpegCount, info.sharedOfaCount = 0, engines.jpeg, engines.ofa


def _ci_slices(profile_id: int, gi_profile: Any) -> int:
    """Compute slices of a compute-instance profile; NOT_SUPPORTED if it exceeds the GPU instance."""
    slices = _CI_SLICES.get(profile_id)
    if slices is None or slices > gi_profile.slices:
        raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
    return slices

# --- the machine file -------------------------------------------------------------------------
class _Store:
    """One JSON file plus an fcntl lock file: many readers or one writer at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:   # a reader in a read-only directory: the lock file exists already
            fd = os.open(self.lock_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _load(self) -> dict[str, Any]:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            raise _err(_pynvml.NVML_ERROR_DRIVER_NOT_LOADED) from None

    def _save(self, state: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(state, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def read(self) -> Iterator[dict[str, Any]]:
        with self._locked(fcntl.LOCK_SH):
            yield self._load()

    @contextlib.contextmanager
    def write(self) -> Iterator[dict[str, Any]]:
        """Read-modify-write; nothing is saved when the body raises."""
        with self._locked(fcntl.LOCK_EX):
            state = self._load()
            yield state
            self._save(state)


# --- helpers over the state dict --------------------------------------------------------------
def _gpu(state: dict[str, Any], index: int, *, handle: bool = False) -> dict[str, Any]:
    """GPU ``index``; a lost GPU (see :func:`lose_gpu`) answers NVML_ERROR_GPU_IS_LOST, and
    when ``handle`` (acquiring its handle) only if it was lost with its handle too."""
    gpus = state["gpus"]
    if not 0 <= index < len(gpus):
        raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
    lost = gpus[index].get("lost")
    if lost == "handle" or (lost and not handle):
        raise _err(_pynvml.NVML_ERROR_GPU_IS_LOST)
    return gpus[index]


def _model(gpu: dict[str, Any]) -> catalog.GpuModel:
    return catalog.get_model(gpu["model"])


def _require_mig(gpu: dict[str, Any]) -> catalog.GpuModel:
    model = _model(gpu)
    if not model.mig_capable or not gpu["mig_current"]:
        raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
    return model


def _gi(gpu: dict[str, Any], gi_id: int, serial: int | None = None) -> dict[str, Any]:
    """The GPU instance ``gi_id`` (of that ``serial`` when given); INVALID_ARGUMENT, NVML's
    answer to an invalid handle, when it was destroyed."""
    for gi in gpu["gpu_instances"]:
        if gi["id"] == gi_id and serial in (None, _serial(gi)):
            return gi
    raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)


def _ci(gi: dict[str, Any], ci_id: int, serial: int) -> dict[str, Any]:
    for ci in gi["compute_instances"]:
        if ci["id"] == ci_id and _serial(ci) == serial:
            return ci
    raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)


def _profile_by_id(model: catalog.GpuModel, profile_id: int) -> catalog.MigProfile:
    for p in model.profiles:
        if p.profile_id == profile_id:
            return p
    raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)


def _used_slices(gpu: dict[str, Any]) -> set[int]:
    return {s for gi in gpu["gpu_instances"] for s in range(gi["start"], gi["start"] + gi["size"])}


def _used_compute(gpu: dict[str, Any], model: catalog.GpuModel) -> int:
    return sum(_profile_by_id(model, gi["profile_id"]).slices for gi in gpu["gpu_instances"])


def _fits(gpu: dict[str, Any], model: catalog.GpuModel, profile: catalog.MigProfile,
          start: int) -> bool:
    wanted = set(range(start, start + profile.memory_slices))
    same = sum(1 for gi in gpu["gpu_instances"] if gi["profile_id"] == profile.profile_id)
    return (not wanted & _used_slices(gpu) and same < profile.max_instances
            and _used_compute(gpu, model) + profile.slices <= model.compute_slices)


def _mig_devices(gpu: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(GI, CI) pairs in the order NVML enumerates MIG devices."""
    pairs = [(gi, ci) for gi in gpu["gpu_instances"] for ci in gi["compute_instances"]]
    return sorted(pairs, key=lambda p: (p[0]["id"], p[1]["id"]))


def _procs(gpu: dict[str, Any], gi_id: int | None = None, ci_id: int | None = None) -> list[dict]:
    out = []
    for p in gpu["processes"]:
        if gi_id is not None and p.get("gi") != gi_id:
            continue
        if ci_id is not None and p.get("ci") != ci_id:
            continue
        out.append(p)
    return out


def _bus_id(gpu: dict[str, Any]) -> str:
    return gpu["pci_bus_id"]


class SimNvml:
    """The pynvml functions fastshare uses, acting on one simulated machine file.

    ``privileged=False`` is a caller without the rights NVML wants for the aggregate
    information of a MIG-enabled GPU's own handle (its memory and process list answer
    NO_PERMISSION; its MIG device handles still answer)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, privileged: bool = True) -> None:
        self._path = Path(path) if path is not None else None
        self._refcount = 0
        self._privileged = privileged

    def __getattr__(self, name: str) -> Any:
        # constants, structs and exception classes, exactly as pynvml names them
        if name.startswith(("NVML_", "NVMLError", "c_nvml", "nvmlPciInfo")):
            return getattr(_pynvml, name)
        raise AttributeError(name)

    def __dir__(self) -> list[str]:
        exported = [n for n in dir(_pynvml) if n.startswith(("NVML_", "NVMLError", "c_nvml", "nvmlPciInfo"))]
        return sorted({*super().__dir__(), *exported})

    @property
    def state_path(self) -> Path:
        if self._path is not None:
            return self._path
        env = os.environ.get(STATE_ENV)
        if not env:
            raise _err(_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        return Path(env)

    def set_state_path(self, path: str | os.PathLike[str] | None) -> None:
        self._path = Path(path) if path is not None else None

    def _store(self) -> _Store:
        if self._refcount <= 0:
            raise _err(_pynvml.NVML_ERROR_UNINITIALIZED)
        return _Store(self.state_path)

    # --- library ------------------------------------------------------------------------------
    def nvmlInitWithFlags(self, flags: int) -> None:
        path = self.state_path
        if not path.is_file():
            raise _err(_pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self._refcount += 1

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlShutdown(self) -> None:
        if self._refcount <= 0:
            raise _err(_pynvml.NVML_ERROR_UNINITIALIZED)
        self._refcount -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        with self._store().read() as st:
            return st.get("driver_version", DEFAULT_DRIVER)

    # --- devices ------------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        with self._store().read() as st:
            return len(st["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        with self._store().read() as st:
            _gpu(st, index, handle=True)
        return _make(_pynvml.c_nvmlDevice_t, _GPU, index)

    def nvmlDeviceGetHandleByUUID(self, device_uuid: str | bytes) -> Any:
        """A GPU or MIG device by UUID. A MIG device answers to its UUID ('MIG-<uuid>') and to
        the R450/R460 form 'MIG-<GPU uuid>/<GI id>/<CI id>', as NVML does since v465 (NVML API
        reference, change log)."""
        text = device_uuid.decode() if isinstance(device_uuid, bytes) else device_uuid
        with self._store().read() as st:
            for gpu in st["gpus"]:
                if gpu["uuid"] == text:
                    _gpu(st, gpu["index"], handle=True)
                    return _make(_pynvml.c_nvmlDevice_t, _GPU, gpu["index"])
                for gi, ci in _mig_devices(gpu):
                    if text in (ci["uuid"], f"MIG-{gpu['uuid']}/{gi['id']}/{ci['id']}"):
                        _gpu(st, gpu["index"], handle=True)   # a lost GPU's MIG devices too
                        return _mig_handle(gpu, gi, ci)
        raise _err(_pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str | bytes) -> Any:
        text = (bus_id.decode() if isinstance(bus_id, bytes) else bus_id).upper()
        with self._store().read() as st:
            for gpu in st["gpus"]:
                if _bus_id(gpu).upper() == text:
                    _gpu(st, gpu["index"], handle=True)
                    return _make(_pynvml.c_nvmlDevice_t, _GPU, gpu["index"])
        raise _err(_pynvml.NVML_ERROR_NOT_FOUND)

    def _device(self, st: dict[str, Any], handle: Any) -> tuple[dict, dict | None, dict | None]:
        """(gpu, gi, ci) for a GPU or MIG device handle (gi/ci None for a GPU)."""
        kind, index, gi_id, ci_id, serial = _decode(handle, _GPU, _MIG)
        gpu = _gpu(st, index)
        if kind == _GPU:
            return gpu, None, None
        gi = _gi(gpu, gi_id)
        return gpu, gi, _ci(gi, ci_id, serial)

    def _aggregate(self, st: dict[str, Any], handle: Any) -> tuple[dict, dict | None, dict | None]:
        """``_device`` for the calls NVML documents as: "In MIG mode, if device handle is
        provided, the API returns aggregate information, only if the caller has appropriate
        privileges" (nvmlDeviceGetMemoryInfo, nvmlDeviceGetComputeRunningProcesses)."""
        gpu, gi, ci = self._device(st, handle)
        if gi is None and gpu["mig_current"] and not self._privileged:
            raise _err(_pynvml.NVML_ERROR_NO_PERMISSION)
        return gpu, gi, ci

    def _whole_gpu(self, st: dict[str, Any], handle: Any,
                   refuse: int = _pynvml.NVML_ERROR_INVALID_ARGUMENT) -> dict:
        """The GPU of a GPU handle; a MIG device handle gets ``refuse``, the code NVML answers."""
        gpu, gi, _ = self._device(st, handle)
        if gi is not None:
            raise _err(refuse)
        return gpu

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        with self._store().read() as st:
            gpu = self._whole_gpu(st, handle, _pynvml.NVML_ERROR_NOT_SUPPORTED)
            return gpu["index"]

    def nvmlDeviceGetName(self, handle: Any) -> str:
        with self._store().read() as st:
            gpu, gi, ci = self._device(st, handle)
            model = _model(gpu)
            if gi is None:
                return model.name
            return f"{model.name} MIG {self._ci_name(model, gi, ci)}"

    @staticmethod
    def _ci_name(model: catalog.GpuModel, gi: dict, ci: dict) -> str:
        profile = _profile_by_id(model, gi["profile_id"])
        if ci["slices"] == profile.slices:
            return profile.name
        return f"{ci['slices']}c.{profile.name}"

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        with self._store().read() as st:
            gpu, _, ci = self._device(st, handle)
            return gpu["uuid"] if ci is None else ci["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        with self._store().read() as st:
            gpu, gi, _ = self._aggregate(st, handle)
            model = _model(gpu)
            if gi is None:
                total = model.memory_mib
                used = sum(p["used_mib"] for p in gpu["processes"])
            else:
                total = _profile_by_id(model, gi["profile_id"]).memory_mib
                used = sum(p["used_mib"] for p in _procs(gpu, gi["id"]))
        if version:
            mem = _pynvml.c_nvmlMemory_v2_t()
            mem.version = version
            mem.reserved = 0
        else:
            mem = _pynvml.c_nvmlMemory_t()
        mem.total, mem.used, mem.free = total * _MIB, used * _MIB, (total - used) * _MIB
        return mem

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        with self._store().read() as st:
            gpu = self._whole_gpu(st, handle, _pynvml.NVML_ERROR_NOT_SUPPORTED)
            bus_id = _bus_id(gpu)
            device_id = _model(gpu).pci_device_id
        info = _pynvml.nvmlPciInfo_t()
        domain, bus, rest = bus_id.split(":")
        dev = rest.split(".")[0]
        info.busId = bus_id.encode()
        info.busIdLegacy = bus_id[4:].encode()
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(dev, 16)
        info.pciDeviceId = device_id
        info.pciSubSystemId = 0x145F10DE
        return info

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    def nvmlDeviceGetAttributes(self, handle: Any) -> Any:
        """MIG device handles only, as the NVML documentation says."""
        with self._store().read() as st:
            gpu, gi, ci = self._device(st, handle)
            if gi is None or ci is None:
                raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
            profile = _profile_by_id(_model(gpu), gi["profile_id"])
            engines = _model(gpu).engines(profile.profile_id)
        attrs = _pynvml.c_nvmlDeviceAttributes()
        attrs.multiprocessorCount = profile.sm_count * ci["slices"] // profile.slices
        _shared(attrs, engines)
        attrs.gpuInstanceSliceCount = profile.slices
        attrs.computeInstanceSliceCount = ci["slices"]
        attrs.memorySizeMB = profile.memory_mib
        return attrs

    nvmlDeviceGetAttributes_v2 = nvmlDeviceGetAttributes

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        with self._store().read() as st:
            gpu, gi, ci = self._aggregate(st, handle)
            procs = gpu["processes"] if gi is None else _procs(gpu, gi["id"], ci["id"])
        out = []
        for p in procs:
            info = _pynvml.c_nvmlProcessInfo_t()
            info.pid = p["pid"]
            info.usedGpuMemory = p["used_mib"] * _MIB
            info.gpuInstanceId = _NA if p.get("gi") is None else p["gi"]
            info.computeInstanceId = _NA if p.get("ci") is None else p["ci"]
            out.append(_pynvml.nvmlStructToFriendlyObject(info))
        return out

    nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses
    nvmlDeviceGetComputeRunningProcesses_v2 = nvmlDeviceGetComputeRunningProcesses

    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        with self._store().read() as st:
            gpu, _, _ = self._device(st, handle)
            return gpu["compute_mode"]

    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None:
        if mode == _pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
            raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        if mode not in (_pynvml.NVML_COMPUTEMODE_DEFAULT, _pynvml.NVML_COMPUTEMODE_PROHIBITED,
                        _pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS):
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._store().write() as st:
            gpu = self._whole_gpu(st, handle, _pynvml.NVML_ERROR_NOT_SUPPORTED)
            gpu["compute_mode"] = mode

    # --- topology -----------------------------------------------------------------------------
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        with self._store().read() as st:
            a, _, _ = self._device(st, device1)
            b, _, _ = self._device(st, device2)
        if a["index"] == b["index"]:
            return _pynvml.NVML_TOPOLOGY_INTERNAL
        if a["pcie_switch"] == b["pcie_switch"]:
            return _pynvml.NVML_TOPOLOGY_SINGLE
        if a["numa_node"] == b["numa_node"]:
            return _pynvml.NVML_TOPOLOGY_NODE
        return _pynvml.NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2p_index: int) -> int:
        with self._store().read() as st:
            a, _, _ = self._device(st, device1)
            b, _, _ = self._device(st, device2)
        if p2p_index == _pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
            linked = a["nvlink_domain"] is not None and a["nvlink_domain"] == b["nvlink_domain"]
            return _pynvml.NVML_P2P_STATUS_OK if linked else _pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        return _pynvml.NVML_P2P_STATUS_OK

    # --- MIG mode -----------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        with self._store().read() as st:
            gpu, gi, _ = self._device(st, handle)
            if gi is not None or not _model(gpu).mig_capable:
                raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
            return [gpu["mig_current"], gpu["mig_pending"]]

    def nvmlDeviceSetMigMode(self, handle: Any, mode: int) -> int:
        """Returns the activation status, as NVML does: the mode is recorded as pending, and
        NVML_ERROR_IN_USE says the GPU was not idle (processes run: idle it and retry),
        NVML_ERROR_RESET_REQUIRED that it waits for a GPU reset (Ampere)."""
        if mode not in (_pynvml.NVML_DEVICE_MIG_DISABLE, _pynvml.NVML_DEVICE_MIG_ENABLE):
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._store().write() as st:
            gpu, gi, _ = self._device(st, handle)
            model = _model(gpu)
            if gi is not None or not model.mig_capable:
                raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
            if mode == _pynvml.NVML_DEVICE_MIG_DISABLE and gpu["gpu_instances"]:
                raise _err(_pynvml.NVML_ERROR_IN_USE)
            gpu["mig_pending"] = mode
            if gpu["mig_current"] == mode:
                return _pynvml.NVML_SUCCESS
            if gpu["processes"]:
                return _pynvml.NVML_ERROR_IN_USE
            if model.mig_pending_until_reset:
                return _pynvml.NVML_ERROR_RESET_REQUIRED
            gpu["mig_current"] = mode
            return _pynvml.NVML_SUCCESS

    # --- GPU instance profiles and placements ----------------------------------------------------
    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int, version: int = 2) -> Any:
        """NOT_SUPPORTED while MIG is off, as the NVML header up to 12.2 documents ("If device
        doesn't have MIG mode enabled or profile isn't supported"); later headers say only
        "doesn't support MIG" and do not say what MIG off answers, so callers must not need it
        (the backend takes the catalog's profiles then)."""
        if not 0 <= profile < _pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._store().read() as st:
            gpu = self._whole_gpu(st, handle)
            model = _require_mig(gpu)
        spec = model.profile_by_enum(profile)
        if spec is None:
            raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        if version == 2:
            info = _pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.name = f"MIG {spec.name}".encode()
        elif version == 1:
            info = _pynvml.c_nvmlGpuInstanceProfileInfo_t()
        else:
            raise _err(_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = spec.profile_id
        info.isP2pSupported = 0
        info.sliceCount = spec.slices
        info.instanceCount = spec.max_instances
        info.multiprocessorCount = spec.sm_count
        engines = model.engines(spec.profile_id)
        info.copyEngineCount, info.decoderCount, info.encoderCount = engines.copy, engines.decoders, 0
        info.jpegCount, info.ofaCount = engines.jpeg, engines.ofa
        info.memorySizeMB = spec.memory_mib
        return info

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: Any, profile_id: int,
                                                   placements_ref: Any, count_ref: Any) -> int:
        """Every allowed placement of the profile, occupied or not (like the _v2 C call), and
        "regardless of whether MIG is enabled or not" (NVML documentation): only a GPU without
        MIG support answers NOT_SUPPORTED."""
        with self._store().read() as st:
            gpu = self._whole_gpu(st, handle)
            model = _model(gpu)
            if not model.mig_capable:
                raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        spec = _profile_by_id(model, profile_id)
        count = _deref(count_ref)
        if count is None:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        array = _deref(placements_ref)
        if array is not None:
            if len(array) < len(spec.placements):
                raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, start in enumerate(spec.placements):
                array[i].start, array[i].size = start, spec.memory_slices
        count.value = len(spec.placements)
        return _pynvml.NVML_SUCCESS

    nvmlDeviceGetGpuInstancePossiblePlacements_v2 = nvmlDeviceGetGpuInstancePossiblePlacements

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, handle: Any, profile_id: int) -> int:
        with self._store().read() as st:
            gpu = self._whole_gpu(st, handle)
            model = _require_mig(gpu)
            spec = _profile_by_id(model, profile_id)
            return remaining_capacity(gpu, model, spec)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: int,
                                                 placement: Any) -> Any:
        want = _deref(placement)
        if want is None:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._store().write() as st:
            gpu = self._whole_gpu(st, handle)
            model = _require_mig(gpu)
            spec = _profile_by_id(model, profile_id)
            if want.start not in spec.placements or want.size != spec.memory_slices:
                raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if not _fits(gpu, model, spec, want.start):
                raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            new = self._add_gi(st, gpu, model, spec, want.start)
            return _gi_handle(gpu, new)

    def nvmlDeviceCreateGpuInstance(self, handle: Any, profile_id: int) -> Any:
        """NVML's own placer; like the driver, it fills from the top memory slice down, which
        is why creating 19,19,14,9 in that order fails on an A100 (MIG user guide)."""
        with self._store().write() as st:
            gpu = self._whole_gpu(st, handle)
            model = _require_mig(gpu)
            spec = _profile_by_id(model, profile_id)
            starts = [s for s in reversed(spec.placements) if _fits(gpu, model, spec, s)]
            if not starts:
                raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            new = self._add_gi(st, gpu, model, spec, starts[0])
            return _gi_handle(gpu, new)

    @staticmethod
    def _add_gi(st: dict, gpu: dict, model: catalog.GpuModel, spec: catalog.MigProfile,
                start: int) -> dict:
        taken = {gi["id"] for gi in gpu["gpu_instances"]}
        if spec.memory_slices == model.memory_slices:
            gi_id = 0
        else:
            gi_id = next(i for i in range(1, 4096) if i not in taken)
        new = {"id": gi_id, "serial": _next_serial(st), "profile_id": spec.profile_id,
               "start": start, "size": spec.memory_slices, "compute_instances": []}
        gpu["gpu_instances"].append(new)
        return new

    def nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int, instances_ref: Any,
                                  count_ref: Any) -> int:
        with self._store().read() as st:
            gpu = self._whole_gpu(st, handle)
            model = _require_mig(gpu)
            _profile_by_id(model, profile_id)
            found = sorted((g for g in gpu["gpu_instances"] if g["profile_id"] == profile_id),
                           key=lambda g: g["id"])
        return _fill(instances_ref, count_ref, [_gi_handle(gpu, g) for g in found])

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: int) -> Any:
        with self._store().read() as st:
            gpu = self._whole_gpu(st, handle)
            _require_mig(gpu)
            found = [g for g in gpu["gpu_instances"] if g["id"] == gi_id]
            if not found:
                raise _err(_pynvml.NVML_ERROR_NOT_FOUND)
            return _gi_handle(gpu, found[0])

    def _gpu_instance(self, st: dict, handle: Any) -> tuple[dict, dict]:
        """(gpu, gi) of a GPU instance handle: an invalid handle (its instance destroyed, whatever
        the MIG mode is since) answers INVALID_ARGUMENT before anything else is looked at."""
        _, index, gi_id, _, serial = _decode(handle, _GI)
        gpu = _gpu(st, index)
        return gpu, _gi(gpu, gi_id, serial)

    def nvmlGpuInstanceGetInfo(self, gpu_instance: Any) -> Any:
        with self._store().read() as st:
            gpu, gi = self._gpu_instance(st, gpu_instance)
        info = _pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = _make(_pynvml.c_nvmlDevice_t, _GPU, gpu["index"])
        info.id, info.profileId = gi["id"], gi["profile_id"]
        info.placement.start, info.placement.size = gi["start"], gi["size"]
        return info

    def nvmlGpuInstanceDestroy(self, gpu_instance: Any) -> int:
        with self._store().write() as st:
            gpu, gi = self._gpu_instance(st, gpu_instance)
            if gi["compute_instances"] or _procs(gpu, gi["id"]):
                raise _err(_pynvml.NVML_ERROR_IN_USE)
            gpu["gpu_instances"].remove(gi)
        return _pynvml.NVML_SUCCESS

    # --- compute instances --------------------------------------------------------------------
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gpu_instance: Any, profile: int,
                                                     eng_profile: int, version: int = 2) -> Any:
        if eng_profile != _pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= profile < _pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._store().read() as st:
            gpu, gi = self._gpu_instance(st, gpu_instance)
            spec = _profile_by_id(_model(gpu), gi["profile_id"])
            engines = _model(gpu).engines(spec.profile_id)
        slices = _ci_slices(profile, spec)
        if version == 2:
            info = _pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            name = spec.name if slices == spec.slices else f"{slices}c.{spec.name}"
            info.name = f"MIG {name}".encode()
        elif version == 1:
            info = _pynvml.c_nvmlComputeInstanceProfileInfo_t()
        else:
            raise _err(_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = spec.slices // slices
        info.multiprocessorCount = spec.sm_count * slices // spec.slices
        _shared(info, engines)
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpu_instance: Any,
                                                           profile_id: int) -> int:
        with self._store().read() as st:
            gpu, gi = self._gpu_instance(st, gpu_instance)
            spec = _profile_by_id(_model(gpu), gi["profile_id"])
        slices = _ci_slices(profile_id, spec)
        free = spec.slices - sum(c["slices"] for c in gi["compute_instances"])
        return free // slices

    def nvmlGpuInstanceCreateComputeInstance(self, gpu_instance: Any, profile_id: int) -> Any:
        with self._store().write() as st:
            gpu, gi = self._gpu_instance(st, gpu_instance)
            spec = _profile_by_id(_model(gpu), gi["profile_id"])
            slices = _ci_slices(profile_id, spec)
            used = sum(c["slices"] for c in gi["compute_instances"])
            if used + slices > spec.slices:
                raise _err(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            taken = {c["id"] for c in gi["compute_instances"]}
            ci_id = next(i for i in range(4096) if i not in taken)
            new = {"id": ci_id, "serial": _next_serial(st), "profile_id": profile_id,
                   "slices": slices, "start": used, "uuid": f"MIG-{uuid.uuid4()}"}
            gi["compute_instances"].append(new)
            return _ci_handle(gpu, gi, new)

    def nvmlGpuInstanceGetComputeInstances(self, gpu_instance: Any, profile_id: int,
                                           instances_ref: Any, count_ref: Any) -> int:
        with self._store().read() as st:
            gpu, gi = self._gpu_instance(st, gpu_instance)
            found = sorted((c for c in gi["compute_instances"] if c["profile_id"] == profile_id),
                           key=lambda c: c["id"])
        return _fill(instances_ref, count_ref, [_ci_handle(gpu, gi, c) for c in found])

    def _compute_instance(self, st: dict, handle: Any) -> tuple[dict, dict, dict]:
        _, index, gi_id, ci_id, serial = _decode(handle, _CI)
        gpu = _gpu(st, index)
        gi = _gi(gpu, gi_id)
        return gpu, gi, _ci(gi, ci_id, serial)

    def nvmlComputeInstanceGetInfo(self, compute_instance: Any) -> Any:
        with self._store().read() as st:
            gpu, gi, ci = self._compute_instance(st, compute_instance)
        info = _pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = _make(_pynvml.c_nvmlDevice_t, _GPU, gpu["index"])
        info.gpuInstance = _gi_handle(gpu, gi)
        info.id, info.profileId = ci["id"], ci["profile_id"]
        info.placement.start, info.placement.size = ci["start"], ci["slices"]
        return info

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, compute_instance: Any) -> int:
        with self._store().write() as st:
            gpu, gi, ci = self._compute_instance(st, compute_instance)
            if _procs(gpu, gi["id"], ci["id"]):
                raise _err(_pynvml.NVML_ERROR_IN_USE)
            gi["compute_instances"].remove(ci)
        return _pynvml.NVML_SUCCESS

    # --- MIG devices --------------------------------------------------------------------------
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        """NVML: "Returns zero if MIG is not supported or enabled" (success, not an error)."""
        with self._store().read() as st:
            gpu, gi, _ = self._device(st, handle)
            model = _model(gpu)
            if gi is not None:
                raise _err(_pynvml.NVML_ERROR_NOT_SUPPORTED)
            return model.compute_slices if model.mig_capable and gpu["mig_current"] else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any:
        with self._store().read() as st:
            gpu = self._whole_gpu(st, handle)
            model = _require_mig(gpu)
            if not 0 <= index < model.compute_slices:
                raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
            devices = _mig_devices(gpu)
            if index >= len(devices):
                raise _err(_pynvml.NVML_ERROR_NOT_FOUND)
            g, c = devices[index]
            return _mig_handle(gpu, g, c)

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> Any:
        kind, *_ = _decode(handle, _GPU, _MIG)
        return ctypes.c_uint(1 if kind == _MIG else 0)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, mig_device: Any) -> Any:
        _decode(mig_device, _MIG)
        with self._store().read() as st:
            gpu, _, _ = self._device(st, mig_device)
        return _make(_pynvml.c_nvmlDevice_t, _GPU, gpu["index"])

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        with self._store().read() as st:
            _, gi, _ = self._device(st, handle)
        if gi is None:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gi["id"]

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        with self._store().read() as st:
            _, _, ci = self._device(st, handle)
        if ci is None:
            raise _err(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ci["id"]


def remaining_capacity(gpu: dict[str, Any], model: catalog.GpuModel, spec: catalog.MigProfile) -> int:
    """How many more instances of one profile fit now: greedy earliest-start packing is
    optimal for equal-size intervals; also bounded by max instances and free compute slices."""
    used = _used_slices(gpu)
    count, end = 0, -1
    for start in spec.placements:
        span = set(range(start, start + spec.memory_slices))
        if start >= end and not span & used:
            count += 1
            end = start + spec.memory_slices
    same = sum(1 for gi in gpu["gpu_instances"] if gi["profile_id"] == spec.profile_id)
    free_compute = model.compute_slices - _used_compute(gpu, model)
    return max(0, min(count, spec.max_instances - same, free_compute // spec.slices))


# --- module-level pynvml-compatible functions over the default machine --------------------------
_default = SimNvml()


def set_state_path(path: str | os.PathLike[str] | None) -> None:
    """Point the module-level functions at a machine file (None: use $FASTSHARE_SIM_STATE)."""
    _default.set_state_path(path)


for _name in dir(SimNvml):
    if _name.startswith("nvml"):
        globals()[_name] = getattr(_default, _name)


# --- test knobs: things that have no NVML call -------------------------------------------------
def create_machine(path: str | os.PathLike[str], models: list[str], *, mig_enabled: bool = False,
                   driver_version: str = DEFAULT_DRIVER, overwrite: bool = False) -> dict[str, Any]:
    """Write a new machine file with GPUs of the given catalog models, in that order.

    SXM parts of one model share an NVLink domain; two GPUs per PCIe switch, four per NUMA node.
    """
    if not 1 <= len(models) <= MAX_GPUS:
        raise ValueError(f"a simulated machine has 1 to {MAX_GPUS} GPUs, not {len(models)}")
    resolved = [catalog.get_model(m) for m in models]
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists (pass overwrite to replace it)")
    gpus = []
    for i, model in enumerate(resolved):
        sxm = "SXM" in model.key
        gpus.append({
            "index": i, "model": model.key, "uuid": f"GPU-{uuid.uuid4()}",
            # the bus is 8 bits: 16 GPUs per PCI domain
            "pci_bus_id": f"{i // 16:08X}:{0x07 + 0x10 * (i % 16):02X}:00.0",
            "mig_current": int(mig_enabled and model.mig_capable),
            "mig_pending": int(mig_enabled and model.mig_capable),
            "compute_mode": _pynvml.NVML_COMPUTEMODE_DEFAULT,
            "pcie_switch": i // 2, "numa_node": i // 4,
            "nvlink_domain": model.key if sxm else None,
            "gpu_instances": [], "processes": [],
        })
    state = {"version": SCHEMA_VERSION, "driver_version": driver_version, "gpus": gpus,
             "next_pid": 40000}
    target.parent.mkdir(parents=True, exist_ok=True)
    store = _Store(target)
    with store._locked(fcntl.LOCK_EX):
        store._save(state)
    return state


# the machine file's records: field -> type (a tuple where null is allowed too)
_MACHINE_FIELDS = {"version": int, "driver_version": str, "gpus": list, "next_pid": int}
_GPU_FIELDS = {"index": int, "model": str, "uuid": str, "pci_bus_id": str, "mig_current": int,
               "mig_pending": int, "compute_mode": int, "pcie_switch": int, "numa_node": int,
               "nvlink_domain": (str, type(None)), "gpu_instances": list, "processes": list}
_GI_FIELDS = {"id": int, "profile_id": int, "start": int, "size": int, "compute_instances": list}
_CI_FIELDS = {"id": int, "profile_id": int, "slices": int, "start": int, "uuid": str}
# written since instances got serials: a machine file made before has none, so they are optional
_MACHINE_OPTIONAL = {"next_serial": int}
_INSTANCE_OPTIONAL = {"serial": int}
# optional "lost" of a GPU (see lose_gpu): absent or null while it works
_LOST = (None, "handle", "calls")
_PROCESS_FIELDS = {"pid": int, "used_mib": int, "gi": (int, type(None)), "ci": (int, type(None))}


def _check_record(where: str, record: Any, fields: dict[str, Any],
                  optional: dict[str, Any] | None = None) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object, got {type(record).__name__}")
    for key, kind in {**fields, **(optional or {})}.items():
        value = record.get(key, ...)
        if value is ... and key in (optional or {}):
            continue
        if value is ... or isinstance(value, bool) or not isinstance(value, kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"{where}.{key}: {'missing' if value is ... else repr(value)}, expected {names}")


def check_machine(state: Any) -> None:
    """Raise ValueError naming the first field of a machine file that `create_machine` and the
    NVML calls would not have written: a hand-edited or foreign JSON file is refused up front
    instead of failing later inside an NVML call."""
    _check_record("machine", state, _MACHINE_FIELDS, _MACHINE_OPTIONAL)
    if state["version"] != SCHEMA_VERSION:
        raise ValueError(f"machine.version: {state['version']} (this fastshare reads {SCHEMA_VERSION})")
    if not state["gpus"]:
        raise ValueError("machine.gpus: empty")
    for i, gpu in enumerate(state["gpus"]):
        _check_record(f"gpus[{i}]", gpu, _GPU_FIELDS)
        try:
            catalog.get_model(gpu["model"])
        except catalog.CatalogError as exc:
            raise ValueError(f"gpus[{i}].model: {exc}") from None
        for j, gi in enumerate(gpu["gpu_instances"]):
            _check_record(f"gpus[{i}].gpu_instances[{j}]", gi, _GI_FIELDS, _INSTANCE_OPTIONAL)
            for k, ci in enumerate(gi["compute_instances"]):
                _check_record(f"gpus[{i}].gpu_instances[{j}].compute_instances[{k}]", ci, _CI_FIELDS,
                              _INSTANCE_OPTIONAL)
        for j, proc in enumerate(gpu["processes"]):
            _check_record(f"gpus[{i}].processes[{j}]", proc, _PROCESS_FIELDS)
        if gpu.get("lost") not in _LOST:
            raise ValueError(f"gpus[{i}].lost: {gpu['lost']!r}, expected null, \"handle\" or \"calls\"")


def load_machine(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole machine state (for tests and `sim-machine show`)."""
    with _Store(Path(path)).read() as st:
        return st


def add_process(path: str | os.PathLike[str], gpu_index: int, *, mig_uuid: str | None = None,
                used_mib: int = 256, pid: int | None = None) -> int:
    """Pretend a CUDA process runs on a GPU (MIG disabled) or on a MIG device; returns its pid."""
    with _Store(Path(path)).write() as st:
        if not 0 <= gpu_index < len(st["gpus"]):
            raise ValueError(f"gpu index {gpu_index} out of range 0..{len(st['gpus']) - 1}")
        gpu = st["gpus"][gpu_index]
        gi_id = ci_id = None
        total, others = _model(gpu).memory_mib, gpu["processes"]
        if mig_uuid is not None:
            match = [(g, c) for g, c in _mig_devices(gpu) if c["uuid"] == mig_uuid]
            if not match:
                raise ValueError(f"no MIG device {mig_uuid} on GPU {gpu_index}")
            gi, ci = match[0]
            gi_id, ci_id = gi["id"], ci["id"]
            total, others = _profile_by_id(_model(gpu), gi["profile_id"]).memory_mib, _procs(gpu, gi_id)
        elif gpu["mig_current"]:
            raise ValueError(f"GPU {gpu_index} is in MIG mode: a process needs a MIG device (mig_uuid)")
        free = total - sum(p["used_mib"] for p in others)
        if used_mib > free:   # a real CUDA process could not have allocated it
            raise ValueError(f"{used_mib} MiB is more than the {free} MiB free on "
                             f"{mig_uuid or f'GPU {gpu_index}'}")
        if pid is None:
            pid = st["next_pid"]
            st["next_pid"] += 1
        gpu["processes"].append({"pid": pid, "used_mib": used_mib, "gi": gi_id, "ci": ci_id})
        return pid


def remove_process(path: str | os.PathLike[str], pid: int) -> None:
    with _Store(Path(path)).write() as st:
        for gpu in st["gpus"]:
            for p in list(gpu["processes"]):
                if p["pid"] == pid:
                    gpu["processes"].remove(p)
                    return
        raise ValueError(f"no simulated process with pid {pid}")


def reset_gpu(path: str | os.PathLike[str], gpu_index: int) -> None:
    """`nvidia-smi -r`: refuses while processes run; applies a pending MIG mode, drops instances."""
    with _Store(Path(path)).write() as st:
        if not 0 <= gpu_index < len(st["gpus"]):
            raise ValueError(f"gpu index {gpu_index} out of range 0..{len(st['gpus']) - 1}")
        gpu = st["gpus"][gpu_index]
        if gpu["processes"]:
            raise _err(_pynvml.NVML_ERROR_IN_USE)
        gpu["mig_current"] = gpu["mig_pending"]
        gpu["gpu_instances"] = []
        gpu.pop("lost", None)


def lose_gpu(path: str | os.PathLike[str], gpu_index: int, *, handle: bool = True) -> str:
    """GPU ``gpu_index`` falls off the bus (Xid 79), or is lost to a double-bit ECC error or a
    hang (Xid 48): it stays in NVML's device list (the count does not change), but calls on it
    raise ``NVMLError_GpuIsLost``, and with ``handle`` so does acquiring its handle by index,
    UUID or PCI bus id (nvidia-smi: "Unable to determine the device handle for GPU ...: GPU is
    lost"). A GPU reset or a reboot brings it back. Returns its UUID."""
    with _Store(Path(path)).write() as st:
        if not 0 <= gpu_index < len(st["gpus"]):
            raise ValueError(f"gpu index {gpu_index} out of range 0..{len(st['gpus']) - 1}")
        gpu = st["gpus"][gpu_index]
        gpu["lost"] = "handle" if handle else "calls"
        return gpu["uuid"]


def remove_gpu(path: str | os.PathLike[str], gpu_index: int) -> str:
    """GPU ``gpu_index`` is taken out of the host (or fell off the bus) and the host boots
    without it: as NVML then enumerates, the other GPUs keep their PCI bus ids and are
    numbered 0..n-1 again in bus order, so every GPU after it has a new index. The boot
    itself is :func:`reboot`'s. Returns the removed GPU's UUID."""
    with _Store(Path(path)).write() as st:
        if not 0 <= gpu_index < len(st["gpus"]):
            raise ValueError(f"gpu index {gpu_index} out of range 0..{len(st['gpus']) - 1}")
        if len(st["gpus"]) == 1:
            raise ValueError("the machine's only GPU cannot be removed (a machine has 1 or more GPUs)")
        gone = st["gpus"].pop(gpu_index)
        for i, gpu in enumerate(st["gpus"]):
            gpu["index"] = i
    reboot(path)
    return gone["uuid"]


def reboot(path: str | os.PathLike[str]) -> None:
    """A host reboot: processes and MIG instances vanish, the (pending) MIG mode sticks."""
    with _Store(Path(path)).write() as st:
        for gpu in st["gpus"]:
            gpu["processes"] = []
            gpu["gpu_instances"] = []
            gpu["mig_current"] = gpu["mig_pending"]
            gpu["compute_mode"] = _pynvml.NVML_COMPUTEMODE_DEFAULT
            gpu.pop("lost", None)
