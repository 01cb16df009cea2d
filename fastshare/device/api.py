"""The device layer's contract: what every other component may ask of a GPU host.

Only this module's types cross the boundary; callers never see pynvml handles. The one
implementation (``NvmlDevices`` in ``nvml_backend``) runs against the real ``pynvml`` module
or against ``fastshare.device.simnvml``, which exposes the same calls and errors.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


class DeviceError(Exception):
    """A device operation failed; ``code`` is the NVML error name (e.g. ``IN_USE``)."""

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class MigProfile:
    """A GPU-instance profile as NVML reports it for one GPU."""

    profile_id: int          # the id create calls take (19, 14, 9, ...), not the enum index
    name: str                # e.g. "3g.20gb"
    slices: int              # compute slices
    memory_slices: int       # placement size
    memory_mib: int
    sm_count: int
    max_instances: int
    placements: tuple[int, ...]  # allowed start memory slices

    @property
    def media(self) -> bool:
        """A ``+me`` media-extension variant (1g.5gb+me, 2g.12gb+me): at most one per GPU, so
        chosen only by name and kept for the requests that name it."""
        return "+me" in self.name


@dataclass(frozen=True)
class MigInstance:
    """A MIG device: identified by (parent GPU UUID, profile id, placement start)."""

    gpu_uuid: str
    gpu_index: int
    profile_id: int
    profile_name: str
    start: int
    size: int
    gi_id: int
    ci_id: int | None
    uuid: str | None         # MIG-... once a compute instance exists
    sm_count: int
    memory_mib: int
    processes: int = 0       # compute processes running on it


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str                # NVML product name, e.g. "NVIDIA A100-SXM4-40GB"
    memory_mib: int
    sm_count: int
    pci_bus_id: str
    mig_capable: bool
    mig_current: bool
    mig_pending: bool        # NVML "pending": the mode after the next reset (= mig_current if none waits)
    compute_mode: str        # "DEFAULT" | "EXCLUSIVE_PROCESS" | "PROHIBITED"
    processes: int = 0
    mig_instances: tuple[MigInstance, ...] = field(default_factory=tuple)
    model: str | None = None  # catalog key ("A100-SXM4-40GB") when the catalog knows the GPU
    pci_device_id: int = 0    # e.g. 0x20B010DE (device id << 16 | vendor id), mig-parted filters on it
    # "" while it works; else the NVML error its calls raise ("GPU_IS_LOST": fallen off the bus,
    # Xid 79 / 48). A lost GPU keeps its place (index) and, once read, its identity; the rest is
    # as last read (or empty) and must not be relied on.
    lost: str = ""


@dataclass(frozen=True)
class Topology:
    """Pairwise link level between GPU indexes (lower is closer), NVML topology levels."""

    levels: dict[tuple[int, int], int]
    nvlink: frozenset[tuple[int, int]] = frozenset()  # (i, j), i < j, joined by NVLink

    def level(self, a: int, b: int) -> int:
        """Link level between two GPUs; NVLink counts as closer than any PCIe level (-1)."""
        if a == b:
            return 0
        pair = (min(a, b), max(a, b))
        return -1 if pair in self.nvlink else self.levels[pair]


COMPUTE_MODES = ("DEFAULT", "PROHIBITED", "EXCLUSIVE_PROCESS")


class Devices(abc.ABC):
    """Everything fastshare does to the GPUs of one host.

    Instances are context managers; ``close()`` releases the NVML library handle.
    """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the underlying library (NVML shutdown)."""

    def __enter__(self) -> Devices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def gpu(self, gpu_index: int) -> GpuInfo:
        """One GPU by index; DeviceError(INVALID_ARGUMENT) naming the valid range otherwise."""
        gpus = self.gpus()
        for info in gpus:
            if info.index == gpu_index:
                return info
        raise DeviceError(f"GPU index {gpu_index} does not exist (valid: 0..{len(gpus) - 1})",
                          "INVALID_ARGUMENT")

    @abc.abstractmethod
    def driver_version(self) -> str: ...

    @abc.abstractmethod
    def gpus(self) -> list[GpuInfo]:
        """Every GPU NVML counts, in index order; a lost one is listed with ``lost`` set."""

    @abc.abstractmethod
    def topology(self) -> Topology: ...

    @abc.abstractmethod
    def set_mig_mode(self, gpu_index: int, enabled: bool) -> bool:
        """Request a MIG mode; returns True when the change is still pending a GPU reset."""

    @abc.abstractmethod
    def mig_profiles(self, gpu_index: int) -> list[MigProfile]: ...

    @abc.abstractmethod
    def mig_instances(self, gpu_index: int) -> list[MigInstance]: ...

    @abc.abstractmethod
    def create_mig_instance(self, gpu_index: int, profile_id: int, start: int) -> MigInstance:
        """Create a GPU instance at an explicit placement plus its full compute instance."""

    @abc.abstractmethod
    def destroy_mig_instance(self, gpu_index: int, start: int) -> None:
        """Destroy the GPU instance at ``start`` (and its compute instances).

        Raises DeviceError(IN_USE) and changes nothing while processes run on it."""

    @abc.abstractmethod
    def set_compute_mode(self, gpu_index: int, mode: str) -> None: ...
