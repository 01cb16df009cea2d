"""``Devices`` over a pynvml-like module: the real ``pynvml`` or ``fastshare.device.simnvml``.

The module is injected so the very same code runs on GPUs and in tests. Only calls listed in
GPU-FACTS.md are used, with pynvml's calling conventions (ctypes arrays and ``byref`` counts
for the enumeration calls, ``byref(placement)`` for creation).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Iterator
from typing import Any

from fastshare.device import catalog
from fastshare.device.api import (
    COMPUTE_MODES,
    DeviceError,
    Devices,
    GpuInfo,
    MigInstance,
    MigProfile,
    Topology,
)

_MIB = 1024 * 1024
_MIG_READ_ATTEMPTS = 5   # MIG devices read again when one vanished mid-read (see _settled_instances)
# What the calls on a GPU raise once it is lost (fallen off the bus, Xid 79; double-bit ECC or a
# hang, Xid 48). NVML still counts the GPU. Not UNKNOWN, which some drivers give for a lost GPU
# too (nvidia-smi: "Unable to determine the device handle for GPU ...: Unknown Error"): it is
# also what a passing driver failure, the caller's device access lost to a cgroup reload (the
# GPU and its workloads fine) and any error value this module cannot name read as, even when
# read again, and a GPU taken for lost has its shares dropped for good. Such a GPU fails the
# listing instead, naming the GPU and what to check (_unreadable).
LOST_CODES = ("GPU_IS_LOST",)


def error_names(nvml: Any) -> dict[int, str]:
    """NVML error value -> name ("IN_USE"), from the module's own constants."""
    return {getattr(nvml, n): n[len("NVML_ERROR_"):] for n in dir(nvml) if n.startswith("NVML_ERROR_")}


def error_code(nvml: Any, exc: BaseException, names: dict[int, str] | None = None) -> str:
    """NVML error name of an NVMLError ("IN_USE")."""
    return (names or error_names(nvml)).get(getattr(exc, "value", None), "UNKNOWN")  # type: ignore[arg-type]


def _unreadable(index: int, last: GpuInfo | None, code: str) -> str:
    """Why the GPUs cannot be listed: GPU ``index`` (as ``last`` read) answers NVML_ERROR_``code``."""
    gpu = f"GPU {index}" + (f" ({last.uuid})" if last is not None else "")
    hint = (f" (some drivers answer so for a GPU fallen off the bus: check the kernel log for Xid 79 "
            f"naming it, then reset it (nvidia-smi -r -i {index}) or reboot; it is not taken for lost, "
            "its shares are kept, as a passing driver failure or lost device access answer the same)"
            if code == "UNKNOWN" else "")
    return f"listing GPUs failed: {gpu} answers NVML_ERROR_{code}{hint}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlDevices(Devices):
    """The one ``Devices`` implementation; ``nvml`` is ``pynvml`` or a ``SimNvml``."""

    def __init__(self, nvml: Any, *, label: str = "NVML") -> None:
        self._nvml = nvml
        self._label = label
        self._profiles: dict[str, list[MigProfile]] = {}
        self._ci_profiles: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        self._errors = error_names(nvml)
        self._last_read: dict[int, GpuInfo] = {}   # index -> the GPU as last read (for a lost one)
        with self._nvml_errors(f"initialising {label}"):
            nvml.nvmlInit()
        self._open = True

    # --- plumbing -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _nvml_errors(self, what: str) -> Iterator[None]:
        """Turn an NVMLError into a DeviceError that says what was being done."""
        try:
            yield
        except self._nvml.NVMLError as exc:
            code = error_code(self._nvml, exc, self._errors)
            hint = " (the GPU fell off the bus or is otherwise lost: reset it or reboot)" \
                if code == "GPU_IS_LOST" else ""
            raise DeviceError(f"{what} failed: NVML_ERROR_{code}{hint}", code) from exc

    def _is(self, exc: BaseException, *codes: str) -> bool:
        return isinstance(exc, self._nvml.NVMLError) and error_code(self._nvml, exc, self._errors) in codes

    def close(self) -> None:
        if self._open:
            self._open = False
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()

    def _handle(self, gpu_index: int) -> Any:
        nvml = self._nvml
        count = nvml.nvmlDeviceGetCount()
        if not 0 <= gpu_index < count:
            raise DeviceError(f"GPU index {gpu_index} does not exist (valid: 0..{count - 1})",
                              "INVALID_ARGUMENT")
        return nvml.nvmlDeviceGetHandleByIndex(gpu_index)

    # --- inventory ----------------------------------------------------------------------------
    def driver_version(self) -> str:
        with self._nvml_errors("reading the driver version"):
            return _text(self._nvml.nvmlSystemGetDriverVersion())

    def gpus(self) -> list[GpuInfo]:
        """One lost GPU does not fail the listing: it is listed as lost, the others as read."""
        with self._nvml_errors("listing GPUs"):
            out = []
            for i in range(self._nvml.nvmlDeviceGetCount()):
                try:
                    info = self._gpu_info(i)
                except self._nvml.NVMLError as exc:
                    code = error_code(self._nvml, exc, self._errors)
                    last = self._last_read.get(i)
                    if code not in LOST_CODES:
                        raise DeviceError(_unreadable(i, last, code), code) from exc
                    info = (dataclasses.replace(last, lost=code, processes=0) if last is not None else
                            GpuInfo(index=i, uuid="", name="", memory_mib=0, sm_count=0, pci_bus_id="",
                                    mig_capable=False, mig_current=False, mig_pending=False,
                                    compute_mode="DEFAULT", lost=code))
                else:
                    self._last_read[i] = info
                out.append(info)
            return out

    def gpu(self, gpu_index: int) -> GpuInfo:
        with self._nvml_errors(f"reading GPU {gpu_index}"):
            self._handle(gpu_index)
            return self._gpu_info(gpu_index)

    def _gpu_info(self, index: int) -> GpuInfo:
        nvml = self._nvml
        h = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(nvml.nvmlDeviceGetName(h))
        model = catalog.find_model(name)
        current = pending = False
        capable = True
        try:
            current, pending = (bool(v) for v in nvml.nvmlDeviceGetMigMode(h))
        except nvml.NVMLError as exc:
            if not self._is(exc, "NOT_SUPPORTED"):
                raise
            capable = False
        uuid = _text(nvml.nvmlDeviceGetUUID(h))
        pci = nvml.nvmlDeviceGetPciInfo(h)
        instances = self._settled_instances(index, h, uuid) if current else ()
        return GpuInfo(
            index=index, uuid=uuid, name=name,
            memory_mib=self._memory_mib(h, model),
            sm_count=self._sm_count(h, model),
            pci_bus_id=_text(pci.busId), pci_device_id=int(pci.pciDeviceId),
            mig_capable=capable, mig_current=current, mig_pending=pending,
            compute_mode=COMPUTE_MODES[[0, 2, 3].index(nvml.nvmlDeviceGetComputeMode(h))],
            processes=len(self._processes(h)), mig_instances=instances,
            model=model.key if model else None,
        )

    def _memory_mib(self, h: Any, model: catalog.GpuModel | None) -> int:
        """NVML gives a MIG-enabled GPU's own handle its memory only with the privileges for
        aggregate information (NO_PERMISSION otherwise): then the catalog's; 0 means unknown."""
        try:
            return self._nvml.nvmlDeviceGetMemoryInfo(h).total // _MIB
        except self._nvml.NVMLError as exc:
            if not self._is(exc, "NO_PERMISSION"):
                raise
            return model.memory_mib if model is not None else 0

    def _sm_count(self, h: Any, model: catalog.GpuModel | None) -> int:
        """NVML has no SM count for a whole GPU (GetAttributes is MIG-only): use the catalog,
        then try GetAttributes; 0 means unknown."""
        if model is not None:
            return model.sm_count
        try:
            return int(self._nvml.nvmlDeviceGetAttributes(h).multiprocessorCount)
        except self._nvml.NVMLError:
            return 0

    def _processes(self, h: Any) -> list[Any]:
        try:
            return list(self._nvml.nvmlDeviceGetComputeRunningProcesses(h))
        except self._nvml.NVMLError as exc:
            if self._is(exc, "NOT_SUPPORTED", "NO_PERMISSION"):
                return []
            raise

    def topology(self) -> Topology:
        nvml = self._nvml
        levels: dict[tuple[int, int], int] = {}
        nvlink = set()
        with self._nvml_errors("reading the GPU topology"):
            handles = [self._handle_or_lost(i) for i in range(nvml.nvmlDeviceGetCount())]
            for i, a in enumerate(handles):
                for j in range(i + 1, len(handles)):
                    b = handles[j]
                    if a is None or b is None:   # a lost GPU: its links cannot be read
                        levels[(i, j)] = nvml.NVML_TOPOLOGY_SYSTEM
                        continue
                    try:
                        levels[(i, j)] = int(nvml.nvmlDeviceGetTopologyCommonAncestor(a, b))
                    except nvml.NVMLError as exc:
                        if not self._is(exc, "NOT_SUPPORTED", *LOST_CODES):
                            raise
                        levels[(i, j)] = nvml.NVML_TOPOLOGY_SYSTEM
                    try:
                        status = nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
                    except nvml.NVMLError:
                        status = None
                    if status == nvml.NVML_P2P_STATUS_OK:
                        nvlink.add((i, j))
        return Topology(levels=levels, nvlink=frozenset(nvlink))

    def _handle_or_lost(self, index: int) -> Any:
        """GPU ``index``'s handle; None when it is lost (acquiring the handle raises that too)."""
        try:
            return self._nvml.nvmlDeviceGetHandleByIndex(index)
        except self._nvml.NVMLError as exc:
            if self._is(exc, *LOST_CODES):
                return None
            raise

    # --- MIG mode -----------------------------------------------------------------------------
    def set_mig_mode(self, gpu_index: int, enabled: bool) -> bool:
        nvml = self._nvml
        what = f"{'enabling' if enabled else 'disabling'} MIG on GPU {gpu_index}"
        with self._nvml_errors(what):
            h = self._handle(gpu_index)
            try:
                _, pending_before = nvml.nvmlDeviceGetMigMode(h)
                status = nvml.nvmlDeviceSetMigMode(
                    h, nvml.NVML_DEVICE_MIG_ENABLE if enabled else nvml.NVML_DEVICE_MIG_DISABLE)
                if status == nvml.NVML_ERROR_IN_USE:
                    # NVML recorded the mode as pending but could not apply it: the GPU is not
                    # idle. Withdraw it, or the GPU would switch at its next reset unasked.
                    if bool(pending_before) != enabled:
                        with contextlib.suppress(nvml.NVMLError):
                            nvml.nvmlDeviceSetMigMode(h, pending_before)
                    raise DeviceError(
                        f"{what} failed: NVML_ERROR_IN_USE (processes run on the GPU; stop them "
                        "and retry)", "IN_USE")
            except nvml.NVMLError as exc:
                if self._is(exc, "IN_USE"):
                    raise DeviceError(
                        f"{what} failed: NVML_ERROR_IN_USE (processes or MIG instances exist on the "
                        "GPU; stop them / destroy the instances first)", "IN_USE") from exc
                if self._is(exc, "NOT_SUPPORTED"):
                    raise DeviceError(f"{what} failed: GPU {gpu_index} does not support MIG",
                                      "NOT_SUPPORTED") from exc
                raise
            current, pending = nvml.nvmlDeviceGetMigMode(h)
        self._profiles.clear()
        return bool(current) != bool(pending)

    # --- MIG profiles -------------------------------------------------------------------------
    def mig_profiles(self, gpu_index: int) -> list[MigProfile]:
        """Profiles as NVML reports them. With MIG disabled NVML reports none; then the
        catalog's table for the model is returned (empty for an unknown model)."""
        with self._nvml_errors(f"reading MIG profiles of GPU {gpu_index}"):
            h = self._handle(gpu_index)
            try:
                current, _ = self._nvml.nvmlDeviceGetMigMode(h)
            except self._nvml.NVMLError as exc:
                if self._is(exc, "NOT_SUPPORTED"):
                    return []
                raise
            if not current:
                model = catalog.find_model(_text(self._nvml.nvmlDeviceGetName(h)))
                return list(model.profiles) if model else []
            return list(self._gpu_profiles(h, _text(self._nvml.nvmlDeviceGetUUID(h))))

    def _gpu_profiles(self, h: Any, uuid: str) -> list[MigProfile]:
        if uuid in self._profiles:
            return self._profiles[uuid]
        nvml = self._nvml
        profiles = []
        for enum_index in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, enum_index)
            except nvml.NVMLError as exc:
                if self._is(exc, "NOT_SUPPORTED", "INVALID_ARGUMENT"):
                    continue
                raise
            count = ctypes.c_uint(0)
            nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, None, ctypes.byref(count))
            array = (nvml.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
            nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, array, ctypes.byref(count))
            placements = [array[i] for i in range(count.value)]
            name = _text(getattr(info, "name", b"")).removeprefix("MIG ")
            profiles.append(MigProfile(
                profile_id=int(info.id), name=name or f"profile-{info.id}",
                slices=int(info.sliceCount),
                memory_slices=int(placements[0].size) if placements else 0,
                memory_mib=int(info.memorySizeMB), sm_count=int(info.multiprocessorCount),
                max_instances=int(info.instanceCount),
                placements=tuple(int(p.start) for p in placements),
            ))
        profiles.sort(key=lambda p: (p.memory_slices, p.slices, p.profile_id))
        self._profiles[uuid] = profiles
        return profiles

    def remaining_capacity(self, gpu_index: int, profile_id: int) -> int:
        """NVML's count of how many more instances of a profile fit right now."""
        with self._nvml_errors(f"reading remaining capacity of profile {profile_id} on GPU {gpu_index}"):
            return int(self._nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(
                self._handle(gpu_index), profile_id))

    # --- MIG instances ------------------------------------------------------------------------
    def mig_instances(self, gpu_index: int) -> list[MigInstance]:
        with self._nvml_errors(f"listing MIG instances of GPU {gpu_index}"):
            h = self._handle(gpu_index)
            current, _ = self._nvml.nvmlDeviceGetMigMode(h)
            if not current:
                return []
            return list(self._instances(gpu_index, h, _text(self._nvml.nvmlDeviceGetUUID(h))))

    def _gpu_instances(self, h: Any, uuid: str) -> Iterator[tuple[MigProfile, Any, Any]]:
        """(profile, GI handle, GI info) of every GPU instance."""
        nvml = self._nvml
        for profile in self._gpu_profiles(h, uuid):
            array = (nvml.c_nvmlGpuInstance_t * max(1, profile.max_instances))()
            count = ctypes.c_uint(0)
            nvml.nvmlDeviceGetGpuInstances(h, profile.profile_id, array, ctypes.byref(count))
            for i in range(count.value):
                yield profile, array[i], nvml.nvmlGpuInstanceGetInfo(array[i])

    def _ci_profiles_of(self, gi: Any, key: tuple[str, int]) -> list[tuple[int, int, int]]:
        """(CI profile id, slice count, max instances) a GI of this profile offers (cached:
        they depend only on the GPU and the GI profile)."""
        if key in self._ci_profiles:
            return self._ci_profiles[key]
        nvml = self._nvml
        found = []
        for enum_index in range(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, enum_index, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            except nvml.NVMLError as exc:
                if self._is(exc, "NOT_SUPPORTED", "INVALID_ARGUMENT"):
                    continue
                raise
            found.append((int(info.id), int(info.sliceCount), int(info.instanceCount)))
        self._ci_profiles[key] = found
        return found

    def _compute_instances(self, gi: Any, key: tuple[str, int]) -> list[Any]:
        nvml = self._nvml
        found = []
        for ci_profile_id, _, max_instances in self._ci_profiles_of(gi, key):
            array = (nvml.c_nvmlComputeInstance_t * max(1, max_instances))()
            count = ctypes.c_uint(0)
            nvml.nvmlGpuInstanceGetComputeInstances(gi, ci_profile_id, array, ctypes.byref(count))
            found.extend(array[i] for i in range(count.value))
        return found

    def _mig_devices(self, h: Any) -> dict[tuple[int, int], tuple[str, int, int]]:
        """(GI id, CI id) -> (MIG UUID, processes, SMs) of every MIG device."""
        nvml = self._nvml
        out = {}
        for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except nvml.NVMLError as exc:
                if self._is(exc, "NOT_FOUND"):
                    continue
                raise
            key = (nvml.nvmlDeviceGetGpuInstanceId(mig), nvml.nvmlDeviceGetComputeInstanceId(mig))
            sms = int(nvml.nvmlDeviceGetAttributes(mig).multiprocessorCount)
            out[key] = (_text(nvml.nvmlDeviceGetUUID(mig)), len(self._processes(mig)), sms)
        return out

    def _settled_instances(self, gpu_index: int, h: Any, uuid: str) -> tuple[MigInstance, ...]:
        """The GPU's MIG devices, read again when one vanished while they were being read: a
        release in another thread or process destroys it between the listing and the queries
        of its handle, which NVML then answers with INVALID_ARGUMENT or NOT_FOUND. The next
        listing no longer has it; an error that outlasts the retries is real and is raised."""
        for _ in range(_MIG_READ_ATTEMPTS - 1):
            try:
                return tuple(self._instances(gpu_index, h, uuid))
            except self._nvml.NVMLError as exc:
                if not self._is(exc, "INVALID_ARGUMENT", "NOT_FOUND"):
                    raise
        return tuple(self._instances(gpu_index, h, uuid))

    def _instances(self, gpu_index: int, h: Any, uuid: str) -> Iterator[MigInstance]:
        nvml = self._nvml
        devices = self._mig_devices(h)
        # The GPU handle lists the processes of its MIG devices only for privileged callers
        # (NVML documentation); the MIG device handles always do: count both, keep the larger.
        gi_processes: dict[int, int] = {}
        for p in self._processes(h):
            gi_processes[p.gpuInstanceId] = gi_processes.get(p.gpuInstanceId, 0) + 1
        per_device: dict[int, int] = {}
        for (gi_id, _), (_, count, _) in devices.items():
            per_device[gi_id] = per_device.get(gi_id, 0) + count
        rows = []
        for profile, gi, info in self._gpu_instances(h, uuid):
            try:
                cis = [nvml.nvmlComputeInstanceGetInfo(c)
                       for c in self._compute_instances(gi, (uuid, profile.profile_id))]
            except nvml.NVMLError as exc:
                # Destroyed between the listing and this query (another thread released it):
                # it is gone, which is what the caller should see, not an error.
                if self._is(exc, "INVALID_ARGUMENT", "NOT_FOUND"):
                    continue
                raise
            ci_id = min((c.id for c in cis), default=None)
            mig_uuid, _, sms = devices.get((info.id, ci_id), (None, 0, profile.sm_count))
            rows.append(MigInstance(
                gpu_uuid=uuid, gpu_index=gpu_index, profile_id=profile.profile_id,
                profile_name=profile.name, start=int(info.placement.start),
                size=int(info.placement.size), gi_id=int(info.id), ci_id=ci_id, uuid=mig_uuid,
                sm_count=sms, memory_mib=profile.memory_mib,
                processes=max(gi_processes.get(info.id, 0), per_device.get(info.id, 0)),
            ))
        yield from sorted(rows, key=lambda r: r.start)

    def _find(self, gpu_index: int, h: Any, uuid: str, start: int) -> tuple[Any, MigProfile, Any]:
        for profile, gi, info in self._gpu_instances(h, uuid):
            if info.placement.start == start:
                return gi, profile, info
        raise DeviceError(f"GPU {gpu_index} has no MIG instance at start {start}", "NOT_FOUND")

    def create_mig_instance(self, gpu_index: int, profile_id: int, start: int) -> MigInstance:
        nvml = self._nvml
        what = f"creating MIG profile {profile_id} at start {start} on GPU {gpu_index}"
        with self._nvml_errors(what):
            h = self._handle(gpu_index)
            current, _ = nvml.nvmlDeviceGetMigMode(h)
            if not current:
                raise DeviceError(f"{what} failed: MIG mode is not enabled on GPU {gpu_index}",
                                  "NOT_SUPPORTED")
            uuid = _text(nvml.nvmlDeviceGetUUID(h))
            profile = self._profile(gpu_index, h, uuid, profile_id)
            if start not in profile.placements:
                raise DeviceError(
                    f"{what} failed: start {start} is not an allowed placement of {profile.name} "
                    f"(allowed: {', '.join(map(str, profile.placements))})", "INVALID_ARGUMENT")
            placement = nvml.c_nvmlGpuInstancePlacement_t()
            placement.start, placement.size = start, profile.memory_slices
            try:
                gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                    h, profile_id, ctypes.byref(placement))
            except nvml.NVMLError as exc:
                if self._is(exc, "INSUFFICIENT_RESOURCES"):
                    raise DeviceError(
                        f"{what} failed: NVML_ERROR_INSUFFICIENT_RESOURCES ({profile.name} needs memory "
                        f"slices {start}..{start + profile.memory_slices - 1}; "
                        f"{self._occupancy(gpu_index, h, uuid)})", "INSUFFICIENT_RESOURCES") from exc
                raise
            try:
                self._create_full_ci(gi, profile, uuid)
            except BaseException:
                with contextlib.suppress(nvml.NVMLError):
                    nvml.nvmlGpuInstanceDestroy(gi)   # compensate: no half-made instance
                raise
            for inst in self._instances(gpu_index, h, uuid):
                if inst.start == start:
                    return inst
        raise DeviceError(f"{what}: instance vanished right after creation", "UNKNOWN")

    def _profile(self, gpu_index: int, h: Any, uuid: str, profile_id: int) -> MigProfile:
        profiles = self._gpu_profiles(h, uuid)
        for p in profiles:
            if p.profile_id == profile_id:
                return p
        known = ", ".join(f"{p.name} (id {p.profile_id})" for p in profiles)
        raise DeviceError(f"GPU {gpu_index} has no MIG profile id {profile_id}; known: {known}",
                          "INVALID_ARGUMENT")

    def _occupancy(self, gpu_index: int, h: Any, uuid: str) -> str:
        taken = [f"{i.profile_name} at {i.start}..{i.start + i.size - 1}"
                 for i in self._instances(gpu_index, h, uuid)]
        return "occupied: " + (", ".join(taken) if taken else "nothing")

    def _create_full_ci(self, gi: Any, profile: MigProfile, uuid: str) -> None:
        """One compute instance spanning the whole GPU instance (what a MIG device user gets)."""
        for ci_profile_id, slices, _ in self._ci_profiles_of(gi, (uuid, profile.profile_id)):
            if slices == profile.slices:
                self._nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile_id)
                return
        raise DeviceError(f"no compute-instance profile spans all {profile.slices} slices of "
                          f"{profile.name}", "NOT_SUPPORTED")

    def destroy_mig_instance(self, gpu_index: int, start: int) -> None:
        nvml = self._nvml
        what = f"destroying the MIG instance at start {start} on GPU {gpu_index}"
        with self._nvml_errors(what):
            h = self._handle(gpu_index)
            uuid = _text(nvml.nvmlDeviceGetUUID(h))
            gi, profile, _ = self._find(gpu_index, h, uuid, start)
            busy = [i for i in self._instances(gpu_index, h, uuid) if i.start == start and i.processes]
            if busy:
                raise DeviceError(
                    f"{what} failed: NVML_ERROR_IN_USE ({profile.name} {busy[0].uuid} has "
                    f"{busy[0].processes} running process(es))", "IN_USE")
            try:
                for ci in self._compute_instances(gi, (uuid, profile.profile_id)):
                    nvml.nvmlComputeInstanceDestroy(ci)
                nvml.nvmlGpuInstanceDestroy(gi)
            except nvml.NVMLError as exc:
                if not self._is(exc, "INVALID_ARGUMENT"):
                    raise
                # NVML invalidated the handle: another process destroyed the instance since
                # _find, and may have made a new one there, which must not be destroyed blind.
                raise DeviceError(f"{what} failed: NVML_ERROR_INVALID_ARGUMENT (another process "
                                  "destroyed or replaced it meanwhile; list the instances again)",
                                  "INVALID_ARGUMENT") from exc

    # --- compute mode -------------------------------------------------------------------------
    def set_compute_mode(self, gpu_index: int, mode: str) -> None:
        nvml = self._nvml
        values = {"DEFAULT": nvml.NVML_COMPUTEMODE_DEFAULT,
                  "PROHIBITED": nvml.NVML_COMPUTEMODE_PROHIBITED,
                  "EXCLUSIVE_PROCESS": nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS}
        if mode not in values:
            raise DeviceError(f"compute mode {mode!r} is not one of {', '.join(values)}",
                              "INVALID_ARGUMENT")
        with self._nvml_errors(f"setting compute mode {mode} on GPU {gpu_index}"):
            nvml.nvmlDeviceSetComputeMode(self._handle(gpu_index), values[mode])
