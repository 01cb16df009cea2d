"""The node agent's logic: prepare and release shares, journaled, and reconcile after a crash.

Locking (no global lock is ever held across slow work):
- one lock per share id: a retry of the same id waits for the first attempt, then sees it;
- one lock per device UUID (GPU or MIG device) around capacity checks and journal inserts,
  and, for a GPU, around MIG changes (per-GPU serialisation of MIG create/destroy);
- one lock per device UUID around its MPS daemon (start/stop/limits) and one around its
  share files; the journal has its own short internal lock.
Every wait is bounded by the RPC's deadline.

Write-ahead order: a journal row is written BEFORE each device/process action and completed
after it, so ``reconcile`` can finish or undo any step a kill -9 interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from fastshare import __version__
from fastshare.device import mig_layout
from fastshare.device.api import DeviceError, Devices, GpuInfo, MigInstance, MigProfile
from fastshare.mps.control import MpsControl, MpsError
from fastshare.node import faults, sharefiles
from fastshare.node.config import NodeConfig
from fastshare.node.journal import Journal, LostShare, MpsRow, ShareRow
from fastshare.node.model import InvalidShare, Prepared, ShareSpec

log = logging.getLogger("fastshare.node")
_MIB = 1 << 20


# Why a share is refused when it is its GPU's state, not the request (the proto's Refusal, without
# its REFUSAL_ prefix): another GPU may take it, and the controller places it again. GPU_GONE: the
# GPU UUID is not on the node (taken out, or a new UUID after a reboot); the controller's view of
# the node is older than that.
MIG_CHANGE_PENDING, GPU_LOST, MIG_MODE, GPU_GONE = "MIG_CHANGE_PENDING", "GPU_LOST", "MIG_MODE", "GPU_GONE"


class AgentError(Exception):
    """A request the agent refuses or cannot complete; ``code`` is a gRPC status code name,
    ``refusal`` one of the names above when the GPU's state is why ("" otherwise)."""

    def __init__(self, code: str, message: str, refusal: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.refusal = refusal


def _device_error(exc: DeviceError, what: str) -> AgentError:
    mapping = {"INSUFFICIENT_RESOURCES": "RESOURCE_EXHAUSTED", "IN_USE": "FAILED_PRECONDITION",
               "RESET_REQUIRED": "FAILED_PRECONDITION", "NOT_SUPPORTED": "FAILED_PRECONDITION",
               "INVALID_ARGUMENT": "INVALID_ARGUMENT", "NOT_FOUND": "NOT_FOUND",
               "NO_PERMISSION": "PERMISSION_DENIED"}
    return AgentError(mapping.get(exc.code, "INTERNAL"), f"{what}: {exc} (NVML {exc.code})")


class Deadline:
    """Absolute time budget of one request; lock waits and device timeouts take from it."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())


class _Locks:
    """Named locks (device uuids, share ids) that exist while someone holds or waits for one:
    share ids come and go, and a lock forgotten while a request still waited for it would let
    the next request on that id run beside the waiter."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._guard = threading.Lock()
        self._locks: dict[str, _Named] = {}

    def hold(self, name: str, deadline: Deadline) -> _Named:
        """``with locks.hold(name, deadline):`` - the lock is taken here, released on exit."""
        with self._guard:
            named = self._locks.get(name)
            if named is None:
                named = self._locks[name] = _Named(self, name)
            named.users += 1
        if not named.lock.acquire(timeout=deadline.remaining()):
            self._leave(named)
            raise AgentError("DEADLINE_EXCEEDED", f"{self._what} {name} stayed busy past the deadline")
        return named

    def _leave(self, named: _Named) -> None:
        with self._guard:
            named.users -= 1
            if not named.users:
                del self._locks[named.name]


class _Named:
    """One named lock, held as a context manager (a class: a generator-based one cost 5 us)."""

    __slots__ = ("lock", "name", "owner", "users")

    def __init__(self, owner: _Locks, name: str) -> None:
        self.owner, self.name, self.lock, self.users = owner, name, threading.Lock(), 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        self.owner._leave(self)


@dataclass(frozen=True)
class ReleaseResult:
    released: bool
    destroyed_mig_devices: tuple[str, ...] = ()
    stopped_mps_daemons: tuple[str, ...] = ()


@dataclass
class _DeviceView:
    """One shareable device as capacity checks see it."""

    uuid: str
    gpu: GpuInfo
    mig: MigInstance | None
    memory_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.memory_bytes = (self.mig.memory_mib if self.mig else self.gpu.memory_mib) * _MIB


class Agent:
    """Everything the NodeAgent RPCs do, without gRPC types."""

    def __init__(self, config: NodeConfig, devices: Devices, mps: MpsControl, journal: Journal) -> None:
        self.config = config
        self.devices = devices
        self.mps = mps
        self.journal = journal
        self.boot_id = uuidlib.uuid4().hex
        self._share_locks = _Locks("share")
        self._device_locks = _Locks("device")
        self._mps_locks = _Locks("MPS daemon of")
        self._file_locks = _Locks("share files of")
        self._state = threading.Condition()
        self._generation = 1
        self._stopping = False   # see stop_waits
        self._gpus: list[GpuInfo] = []
        self._lost_logged: set[int] = set()   # indexes of the lost GPUs already logged
        self._named_by_journal: dict[int, str] = {}   # see _name_lost
        self._profiles: dict[str, list[MigProfile]] = {}
        self._topology: tuple[tuple[int, int, int], ...] | None = None   # see _links
        self._topology_lost: set[int] = set()   # the GPUs lost when it was read (links unknown)
        self._mps_health: dict[str, bool] = {}
        self._ports_in_use: set[int] = set()
        self._refresh_lock = threading.Lock()
        # Share-file write coalescing: changes requested / covered by a finished write, per device.
        self._files_wanted: dict[str, int] = {}
        self._files_written: dict[str, int] = {}
        # Names per device, built once (path objects were a tenth of the CPU of a prepare).
        self._device_paths: dict[str, tuple[str, str, str]] = {}

    # --- bookkeeping -------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        with self._state:
            return self._generation

    def _changed(self) -> None:
        with self._state:
            self._generation += 1
            self._state.notify_all()

    def wait_for_change(self, since: int, timeout: float, gone: Callable[[], bool] = lambda: False) -> int:
        """Block until the generation differs from ``since``, ``timeout`` passes, the agent
        stops (``stop_waits``) or ``gone()`` says the waiter left (``wake`` makes it look)."""
        with self._state:
            self._state.wait_for(lambda: self._generation != since or self._stopping or gone(),
                                 timeout=timeout)
            return self._generation

    def wake(self) -> None:
        """Make every waiter look again (a caller of ``wait_for_change`` may have left)."""
        with self._state:
            self._state.notify_all()

    def stop_waits(self) -> None:
        """End every wait now and let none begin: a stopping agent does not sit out its callers'
        long polls (up to 30 s each, in threads the process waits for before it exits)."""
        with self._state:
            self._stopping = True
            self._state.notify_all()

    def refresh_devices(self) -> list[GpuInfo]:
        """Re-read GPUs and MIG devices (after MIG changes and periodically)."""
        with self._refresh_lock:
            gpus = self._name_lost(self.devices.gpus())
            self._log_lost(gpus)
            mode = {g.uuid: g.mig_current for g in self._gpus}
            for gpu in gpus:
                if gpu.lost:
                    continue
                # Read again when the MIG mode changed: with MIG off NVML reports no profiles
                # (the catalog's stand in, none for a model it lacks); with MIG on, NVML's own.
                if gpu.mig_capable and (gpu.uuid not in self._profiles
                                        or mode.get(gpu.uuid, gpu.mig_current) != gpu.mig_current):
                    self._profiles[gpu.uuid] = self.devices.mig_profiles(gpu.index)
            self._gpus = gpus
            return gpus

    def _name_lost(self, gpus: list[GpuInfo]) -> list[GpuInfo]:
        """A GPU lost before this agent first read it is listed without its UUID (NVML answers
        nothing about it). The journal names the GPUs its shares, MIG instances and MPS daemons
        are on: when exactly one GPU is lost unnamed and exactly one GPU UUID of the journal is on
        no GPU read, that is its UUID, kept until the GPU answers again (also once its shares are
        dropped). With more of either, which is which cannot be told: they stay unnamed."""
        unnamed = [g.index for g in gpus if g.lost and not g.uuid]
        self._named_by_journal = {i: u for i, u in self._named_by_journal.items() if i in unnamed}
        if len(unnamed) == 1 and not self._named_by_journal:
            journaled = {u for r in self.journal.shares() for u in (*r.spec.device_uuids, r.device_uuid)}
            journaled |= {m.gpu_uuid for m in self.journal.migs()}
            journaled |= {d.gpu_uuid for d in self.journal.mps_daemons()}
            missing = [u for u in journaled - {g.uuid for g in gpus} if u.startswith("GPU-")]
            if len(missing) == 1:
                self._named_by_journal[unnamed[0]] = missing[0]
                log.warning("GPU %d, lost before the agent read it, is taken for %s: the only GPU the "
                            "journal names that no GPU read is", unnamed[0], missing[0])
        return [replace(g, uuid=self._named_by_journal[g.index]) if g.index in self._named_by_journal
                else g for g in gpus]

    def _log_lost(self, gpus: list[GpuInfo]) -> None:
        """Once per GPU that became lost: an ERROR saying what happened and what to do."""
        for gpu in gpus:
            if gpu.lost and gpu.index not in self._lost_logged:
                log.error("GPU %d (%s) is lost (fell off the bus?): NVML answers NVML_ERROR_%s. It takes no "
                          "new shares and the shares on it are dropped; the other GPUs keep working. Drain "
                          "the node (`fastshare cordon %s`), then reset the GPU (nvidia-smi -r -i %d) or "
                          "reboot; check the kernel log for its Xid (79: fallen off the bus, 48: "
                          "double-bit ECC)", gpu.index, gpu.uuid or "UUID unknown", gpu.lost,
                          self.config.node_name, gpu.index)
            elif not gpu.lost and gpu.index in self._lost_logged:
                log.warning("GPU %d (%s) answers again", gpu.index, gpu.uuid)
        self._lost_logged = {g.index for g in gpus if g.lost}

    def _lost_gpu(self, device_uuids: Iterable[str]) -> GpuInfo | None:
        """The lost GPU one of ``device_uuids`` (GPUs or MIG devices, by the last read) is on."""
        wanted = set(device_uuids)
        for gpu in self._gpus:
            if gpu.lost and gpu.uuid and (gpu.uuid in wanted or any(m.uuid in wanted
                                                                      for m in gpu.mig_instances)):
                return gpu
        return None

    def _gpu(self, gpu_uuid: str) -> GpuInfo:
        if not gpu_uuid:   # not a GPU lost before it was read (listed without a UUID)
            unnamed = [str(g.index) for g in self._gpus if g.lost and not g.uuid]
            why = (f"; GPU {', '.join(unnamed)} of node {self.config.node_name} is lost (fell off the bus?) "
                   "and was never read: it has none, and takes no shares or changes" if unnamed else "")
            raise AgentError("INVALID_ARGUMENT", f"no GPU UUID given{why}")
        for attempt in range(2):
            for gpu in self._gpus:
                if gpu.uuid == gpu_uuid:
                    return gpu
            if attempt == 0:
                self.refresh_devices()
        known = ", ".join(g.uuid for g in self._gpus) or "none"
        raise AgentError("NOT_FOUND", f"GPU {gpu_uuid} is not on node {self.config.node_name}; GPUs: {known}",
                         GPU_GONE)

    def _device(self, device_uuid: str) -> _DeviceView:
        """A GPU or an existing MIG device by UUID."""
        if device_uuid.startswith("MIG-"):
            for attempt in range(2):
                for gpu in self._gpus:
                    for mig in gpu.mig_instances:
                        if mig.uuid == device_uuid:
                            return _DeviceView(device_uuid, gpu, mig)
                if attempt == 0:
                    self.refresh_devices()
            raise AgentError("NOT_FOUND", f"MIG device {device_uuid} does not exist on node "
                                          f"{self.config.node_name}")
        return _DeviceView(device_uuid, self._gpu(device_uuid), None)

    def _live_shares(self, device_uuid: str, exclude: str | None = None) -> list[ShareRow]:
        """Shares (not being released) that hold ``device_uuid``."""
        return [r for r in self.journal.shares_on(device_uuid)
                if r.state != "releasing" and r.spec.id != exclude]

    def _allocate_port(self) -> int:
        low, high = self.config.port_range
        with self._state:
            for port in range(low, high + 1):
                if port not in self._ports_in_use:
                    self._ports_in_use.add(port)
                    return port
        raise AgentError("RESOURCE_EXHAUSTED", f"all pod manager ports {self.config.share_ports} are in use")

    def _free_port(self, port: int | None) -> None:
        if port:
            with self._state:
                self._ports_in_use.discard(port)

    # --- prepare -----------------------------------------------------------------------------

    def prepare(self, spec: ShareSpec, deadline: Deadline) -> tuple[Prepared, bool]:
        """Make ``spec`` real; returns (what the workload needs, created by this call)."""
        try:
            spec.validate()
        except InvalidShare as exc:
            raise AgentError("INVALID_ARGUMENT", str(exc)) from None
        lost = self._lost_gpu(spec.device_uuids)
        if lost is not None:
            raise AgentError("FAILED_PRECONDITION", f"GPU {lost.index} ({lost.uuid}) of node "
                                                    f"{self.config.node_name} is lost (fell off the bus?): "
                                                    f"NVML_ERROR_{lost.lost}; it takes no shares", GPU_LOST)
        with self._share_locks.hold(spec.id, deadline):
            if self.journal.forget_lost(spec.id):   # the controller prepares a pending record again
                log.info("share %s was lost with its device; preparing it anew", spec.id)
            row = self.journal.share(spec.id)
            if row is not None:
                if not row.spec.same_share(spec):
                    raise AgentError("ALREADY_EXISTS", f"share {spec.id} already exists with a different "
                                                       "spec; release it first or use another id")
                if row.state == "ready" and row.prepared is not None:
                    return row.prepared, False
                if row.state == "releasing":
                    raise AgentError("FAILED_PRECONDITION", f"share {spec.id} is being released; retry")
                self._undo(row, deadline)  # 'preparing' left by a failed attempt: start over
                self.journal.delete_share(spec.id)
            prepare = {"exclusive": self._prepare_exclusive, "whole": self._prepare_whole}.get(
                spec.kind, self._prepare_mps)
            prepared = prepare(spec, deadline)
        self._changed()
        return prepared, True

    def _refuse_mode_change_pending(self, gpu: GpuInfo) -> None:
        """A new share on a GPU whose MIG mode change waits for a GPU reset would lose its device at
        the reset (a whole or MPS share after a MIG enable, a MIG slice after a disable): refused, as
        the controller does (an older one may still send it). Checked under the GPU's lock."""
        if gpu.mig_capable and gpu.mig_current != gpu.mig_pending:
            raise AgentError("FAILED_PRECONDITION", f"GPU {gpu.index} of {self.config.node_name}: "
                                                    f"{mig_layout.mode_change_pending(gpu.index)}",
                             MIG_CHANGE_PENDING)

    def _prepare_whole(self, spec: ShareSpec, deadline: Deadline) -> Prepared:
        for u in spec.device_uuids:
            self._gpu(u)  # NOT_FOUND before waiting for any lock
        with contextlib.ExitStack() as stack:
            for u in sorted(spec.device_uuids):  # one order everywhere: no lock cycles
                stack.enter_context(self._device_locks.hold(u, deadline))
            for u in spec.device_uuids:  # MIG mode only changes under this lock: check it here
                self._refuse_mode_change_pending(self._gpu(u))
                if self._gpu(u).mig_current:
                    raise AgentError("FAILED_PRECONDITION", f"GPU {u} is in MIG mode; a whole GPU needs MIG "
                                                            "disabled (or ask for kind exclusive)", MIG_MODE)
                holders = self._live_shares(u)
                if holders:
                    raise AgentError("RESOURCE_EXHAUSTED", f"GPU {u} is not free: {len(holders)} share(s) "
                                                           f"use it ({_kinds(holders)}); free: nothing")
            visible = ",".join(spec.device_uuids)
            prepared = Prepared(env={"NVIDIA_VISIBLE_DEVICES": visible, "CUDA_VISIBLE_DEVICES": visible},
                                device_uuids=spec.device_uuids)
            self.journal.insert_ready_share(spec, spec.device_uuids[0], None, prepared)  # nothing to create
        return prepared

    def _mig_profile(self, gpu: GpuInfo, name: str) -> MigProfile:
        profiles = self._profiles.get(gpu.uuid) or []
        for p in profiles:
            if p.name.lower() == name.lower():
                return p
        known = ", ".join(p.name for p in profiles) or "none"
        raise AgentError("NOT_FOUND", f"share.mig_profile {name!r} does not exist on GPU {gpu.uuid} "
                                      f"({gpu.name}); profiles: {known}")

    def _free_text(self, gpu: GpuInfo, instances: list[MigInstance]) -> str:
        used = {s for m in instances for s in range(m.start, m.start + m.size)}
        fits = []
        for p in self._profiles.get(gpu.uuid) or []:
            starts = [s for s in p.placements
                      if not used & set(range(s, s + p.memory_slices)) and s + p.memory_slices <= 8]
            if starts:
                fits.append(f"{p.name}@{','.join(map(str, starts))}")
        return "free placements: " + ("; ".join(fits) if fits else "none")

    def _choose_start(self, gpu: GpuInfo, profile: MigProfile, instances: list[MigInstance]) -> int:
        used = {s for m in instances for s in range(m.start, m.start + m.size)}
        candidates = [s for s in profile.placements if not used & set(range(s, s + profile.memory_slices))]
        if not candidates:
            raise AgentError("RESOURCE_EXHAUSTED", f"no free placement for {profile.name} on GPU {gpu.uuid}; "
                                                   + self._free_text(gpu, instances))
        return best_start(gpu, profile, instances, candidates, self._profiles[gpu.uuid])

    def _prepare_exclusive(self, spec: ShareSpec, deadline: Deadline) -> Prepared:
        gpu = self._gpu(spec.device_uuids[0])
        if not gpu.mig_capable:
            raise AgentError("FAILED_PRECONDITION", f"GPU {gpu.uuid} ({gpu.name}) does not support MIG; "
                                                    "use kind fastpod, mps or whole")
        self._refuse_mode_change_pending(gpu)
        if not gpu.mig_current:
            hint = " (enabled, waiting for a GPU reset)" if gpu.mig_pending else ""
            raise AgentError("FAILED_PRECONDITION", f"MIG is disabled on GPU {gpu.uuid}{hint}; enable it "
                                                    "with SetMigMode / `fastshare mig` first", MIG_MODE)
        profile = self._mig_profile(gpu, spec.mig_profile)
        if spec.mig_start is not None and spec.mig_start not in profile.placements:
            raise AgentError("INVALID_ARGUMENT", f"share.mig_start {spec.mig_start} is not a placement of "
                                                 f"{profile.name}; allowed: {list(profile.placements)}")
        with self._device_locks.hold(gpu.uuid, deadline):
            self._refuse_mode_change_pending(self._gpu(gpu.uuid))   # MIG mode only changes under this lock
            try:
                instances = self.devices.mig_instances(gpu.index)
            except DeviceError as exc:
                raise _device_error(exc, f"listing MIG instances of GPU {gpu.uuid}") from None
            existing = next((m for m in instances if m.start == spec.mig_start), None)
            if existing is not None:
                return self._bind_existing(spec, gpu, profile, existing, instances)
            start = spec.mig_start
            if start is None:
                start = self._choose_start(gpu, profile, instances)
            self._forget_vanished_mig(gpu.uuid, start)
            self.journal.begin_share(spec, gpu.uuid, None)
            faults.point("agent.after_share_journaled")
            self.journal.begin_mig(gpu.uuid, start, profile.profile_id, spec.id, "share")
            try:
                mig = self.devices.create_mig_instance(gpu.index, profile.profile_id, start)
            except DeviceError as exc:
                self.journal.delete_mig(gpu.uuid, start)
                self.journal.delete_share(spec.id)
                err = _device_error(exc, f"creating {profile.name} at slice {start} on GPU {gpu.uuid}")
                if err.code == "RESOURCE_EXHAUSTED":
                    err = AgentError(err.code, f"{err}; {self._free_text(gpu, instances)}")
                raise err from None
            faults.point("agent.after_mig_create")
            self.journal.mig_ready(gpu.uuid, start, mig.uuid)
            # Still under the GPU's lock: until the share names the new MIG device, an idle
            # instance no share holds sits there, which another request would bind.
            prepared = _exclusive_prepared(mig)
            self.journal.share_ready(spec.id, mig.uuid or gpu.uuid, prepared)
        self.refresh_devices()
        return prepared

    def _forget_vanished_mig(self, gpu_uuid: str, start: int) -> None:
        """Called under the GPU's lock with no instance at ``start``: a journal row there names
        an instance destroyed outside the agent (by hand, or by a GPU reset). It holds nothing,
        and left in place it would make the new instance's record fail."""
        for m in self.journal.migs(gpu_uuid):
            if m.start == start:
                log.warning("MIG %s at slice %d of %s (share %s) was destroyed outside the agent; "
                            "forgotten", m.mig_uuid or "?", start, gpu_uuid, m.share_id or "none")
                self.journal.delete_mig(gpu_uuid, start)

    def _bind_existing(self, spec: ShareSpec, gpu: GpuInfo, profile: MigProfile, mig: MigInstance,
                       instances: list[MigInstance]) -> Prepared:
        """An instance already sits at the requested start: use it if it is idle and unclaimed."""
        if mig.profile_id != profile.profile_id:
            raise AgentError("RESOURCE_EXHAUSTED", f"slice {mig.start} of GPU {gpu.uuid} holds a "
                                                   f"{mig.profile_name}, not a {profile.name}; "
                                                   + self._free_text(gpu, instances))
        if mig.uuid is None or mig.processes or self._live_shares(mig.uuid):
            raise AgentError("RESOURCE_EXHAUSTED", f"the {profile.name} at slice {mig.start} of GPU "
                                                   f"{gpu.uuid} is in use; {self._free_text(gpu, instances)}")
        self.journal.begin_share(spec, mig.uuid, None)
        prepared = _exclusive_prepared(mig)
        self.journal.share_ready(spec.id, mig.uuid, prepared)
        return prepared

    def _prepare_mps(self, spec: ShareSpec, deadline: Deadline) -> Prepared:
        """fastpod / mps. Fast path (daemon already running, its limits already cover the new
        share): ONE journal commit of the finished share, then the share files, which the
        reconciler rewrites from the journal anyway. Otherwise write-ahead in two phases."""
        dev = self._device(spec.device_uuids[0])
        with contextlib.ExitStack() as stack:
            if dev.mig is not None:
                # A MIG device is destroyed under its GPU's lock (layouts, idle orphans): look it
                # up again under that lock, and journal the share before it goes.
                stack.enter_context(self._device_locks.hold(dev.gpu.uuid, deadline))
                dev = self._device(dev.uuid)
            stack.enter_context(self._device_locks.hold(dev.uuid, deadline))
            self._refuse_mode_change_pending(self._gpu(dev.gpu.uuid))   # under the GPU's lock
            if dev.mig is None and self._gpu(dev.uuid).mig_current:  # checked under the GPU's lock
                raise AgentError("FAILED_PRECONDITION", f"GPU {dev.uuid} is in MIG mode: MPS runs per MIG "
                                                        "device; name a MIG device UUID (MIG-…) instead",
                                 MIG_MODE)
            holders = self._check_mps_capacity(spec, dev)
            port = self._allocate_port() if spec.kind == "fastpod" else None
            prepared = self._mps_prepared(spec, dev.uuid, port)
            try:
                with self._mps_locks.hold(dev.uuid, deadline):
                    daemon = self.journal.mps(dev.uuid)
                    sm, mem = self._ceilings([*(r.spec for r in holders), spec])
                    fast = daemon is not None and daemon.state == "running" and not _raises(daemon, sm, mem)
                    if fast:
                        self.journal.insert_ready_share(spec, dev.uuid, port, prepared)
                if not fast:
                    self.journal.begin_share(spec, dev.uuid, port)
            except BaseException:
                self._free_port(port)
                raise
        if fast:
            faults.point("agent.after_share_committed")
            if spec.kind == "fastpod":
                self._write_share_files(dev.uuid, deadline)
            return prepared
        try:
            faults.point("agent.after_share_journaled")
            self._ensure_mps(dev, deadline)
            if spec.kind == "fastpod":
                self._write_share_files(dev.uuid, deadline)
                faults.point("agent.after_share_files")
        except BaseException:
            with contextlib.suppress(Exception):
                row = self.journal.share(spec.id)
                if row is not None:
                    self._undo(row, Deadline(self.config.mps_timeout_s * 2))
                    self.journal.delete_share(spec.id)
            raise
        self.journal.share_ready(spec.id, dev.uuid, prepared)
        return prepared

    def _paths(self, device_uuid: str) -> tuple[str, str, str]:
        """(MPS pipe directory, share config file, share port file) of a device."""
        paths = self._device_paths.get(device_uuid)
        if paths is None:
            paths = self._device_paths[device_uuid] = (
                str(self.mps.paths(device_uuid).pipe_dir),
                *sharefiles.names(self.config.share_root, device_uuid))
        return paths

    def _mps_prepared(self, spec: ShareSpec, device_uuid: str, port: int | None) -> Prepared:
        pipe_dir, share_config, share_ports = self._paths(device_uuid)
        env = {"NVIDIA_VISIBLE_DEVICES": device_uuid, "CUDA_VISIBLE_DEVICES": device_uuid,
               "CUDA_MPS_PIPE_DIRECTORY": pipe_dir}
        host_paths = {"mps_pipe_dir": pipe_dir}
        if spec.memory_bytes:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={max(1, spec.memory_bytes // _MIB)}M"
        if spec.kind == "fastpod":
            env.update(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(spec.sm_percent), FASTSHARE_SHARE_ID=spec.id,
                       FASTSHARE_POD_MANAGER_PORT=str(port), FASTSHARE_QUOTA_REQUEST=repr(spec.quota_request),
                       FASTSHARE_QUOTA_LIMIT=repr(spec.quota_limit))
            host_paths.update(share_config=share_config, share_ports=share_ports)
        return Prepared(env=env, host_paths=host_paths, device_uuids=(device_uuid,), port=port or 0)

    def _check_mps_capacity(self, spec: ShareSpec, dev: _DeviceView) -> list[ShareRow]:
        """Raise RESOURCE_EXHAUSTED (saying what is free) unless ``spec`` fits; returns the
        shares already on the device."""
        holders = self._live_shares(dev.uuid)
        blocking = [r for r in holders if r.spec.kind in ("whole", "exclusive")]
        if blocking:
            raise AgentError("RESOURCE_EXHAUSTED", f"device {dev.uuid} is held whole by share(s) of kind "
                                                   f"{_kinds(blocking)}; free: nothing")
        fastpods = [r.spec for r in holders if r.spec.kind == "fastpod"]
        sm_free = 100 - sum(s.sm_percent for s in fastpods)
        quota_free = 1.0 - sum(s.quota_request for s in fastpods)
        mem_total = dev.memory_bytes
        mem_hard_free = mem_total - sum(s.memory_bytes for s in fastpods)
        mem_soft_free = int(mem_total * self.config.mps_memory_oversubscription) - sum(
            r.spec.memory_bytes for r in holders)
        if spec.kind == "fastpod":
            checks = [("sm_percent", spec.sm_percent, spec.sm_percent > sm_free),
                      ("quota_request", spec.quota_request, spec.quota_request > quota_free + 1e-9),
                      ("memory_bytes", spec.memory_bytes,
                       spec.memory_bytes > min(mem_hard_free, mem_soft_free))]
        else:
            checks = [("memory_bytes", spec.memory_bytes, spec.memory_bytes > mem_soft_free)]
        for name, value, too_big in checks:
            if too_big:   # what is free, said only when refusing (formatting it cost ~5 us a call)
                free = (f"free on {dev.uuid}: {max(sm_free, 0)}% SM, quota request {max(quota_free, 0):.3g}, "
                        f"{max(min(mem_hard_free, mem_soft_free), 0) // _MIB} MiB for fastpod, "
                        f"{max(mem_soft_free, 0) // _MIB} MiB for mps")
                raise AgentError("RESOURCE_EXHAUSTED", f"share.{name} {value} does not fit; {free}")
        return holders

    @staticmethod
    def _ceilings(shares: list[ShareSpec]) -> tuple[float, int | None]:
        """Daemon-wide limits: the largest share on the device (a client that ignores its env
        still cannot exceed them); memory-only shares without a limit lift the memory cap."""
        sm = max((s.sm_percent for s in shares if s.kind == "fastpod"), default=0)
        if any(s.kind == "mps" for s in shares) or not sm:
            sm = 100
        mems = [s.memory_bytes for s in shares]
        return float(sm), (None if not mems or 0 in mems else max(mems))

    def _ensure_mps(self, dev: _DeviceView, deadline: Deadline) -> None:
        with self._mps_locks.hold(dev.uuid, deadline):
            row = self.journal.mps(dev.uuid)
            live = [r.spec for r in self._live_shares(dev.uuid)]
            if not any(s.kind in ("fastpod", "mps") for s in live):
                return  # the last MPS share left meanwhile (housekeeping raced its release)
            sm, mem = self._ceilings(live)
            # No cap (None) cannot be sent: the device's whole memory is the same cap (and a
            # daemon adopted after a crash may still carry an earlier share's cap).
            mem_limit = dev.memory_bytes if mem is None else mem
            if row is not None and row.state == "running":
                raise_sm = row.sm_ceiling is None or sm > row.sm_ceiling
                raise_mem = _raises_mem(row.mem_ceiling, mem)
                if raise_sm or raise_mem:
                    try:
                        self.mps.set_limits(dev.uuid, sm if raise_sm else None,
                                            mem_limit if raise_mem else None)
                    except MpsError as exc:
                        raise AgentError("UNAVAILABLE", str(exc)) from None
                    self.journal.update_mps(dev.uuid, sm_ceiling=max(sm, row.sm_ceiling or 0),
                                            mem_ceiling=mem if raise_mem else row.mem_ceiling)
                return
            # A row left by an earlier daemon (dead, or 'starting'/'stopping' after a crash) keeps
            # its word that the agent switched the compute mode: by now the GPU already shows
            # EXCLUSIVE_PROCESS, and the last release must still switch it back to DEFAULT.
            compute_mode_set = row is not None and row.compute_mode_set
            self.journal.begin_mps(dev.uuid, dev.gpu.uuid)
            if not compute_mode_set and dev.mig is None and dev.gpu.compute_mode != "EXCLUSIVE_PROCESS":
                # Written ahead: after a crash right after the switch the GPU already shows
                # EXCLUSIVE_PROCESS, and only this row says that switching it back is ours to do.
                self.journal.update_mps(dev.uuid, compute_mode_set=1)
                try:
                    self.devices.set_compute_mode(dev.gpu.index, "EXCLUSIVE_PROCESS")
                    compute_mode_set = True
                except DeviceError as exc:
                    log.warning("cannot set EXCLUSIVE_PROCESS on %s (%s); MPS runs anyway", dev.uuid, exc)
                faults.point("agent.after_compute_mode")
            self.journal.update_mps(dev.uuid, compute_mode_set=int(compute_mode_set))
            try:
                pid = self.mps.start(dev.uuid, sm, mem_limit)
            except MpsError as exc:
                raise AgentError("UNAVAILABLE", f"MPS daemon for {dev.uuid}: {exc}") from None
            faults.point("agent.after_mps_start")
            self.journal.update_mps(dev.uuid, state="running", pid=pid, sm_ceiling=sm, mem_ceiling=mem)
            self._mps_health[dev.uuid] = True

    def _write_share_files(self, device_uuid: str, deadline: Deadline, exclude: str | None = None) -> None:
        """Rewrite the device's files from the journal (the one source), under its file lock.

        Called after the caller's journal commit. Concurrent callers on one device coalesce: a
        write that read the journal after our commit already says what we would write, so we
        return as soon as one has finished (the number is taken before the journal is read)."""
        with self._state:
            wanted = self._files_wanted[device_uuid] = self._files_wanted.get(device_uuid, 0) + 1
        with self._file_locks.hold(device_uuid, deadline):
            if exclude is None and self._files_written.get(device_uuid, 0) >= wanted:
                return
            with self._state:
                covers = self._files_wanted[device_uuid]
            entries = [sharefiles.ShareEntry(r.spec.id, r.spec.quota_request, r.spec.quota_limit,
                                             r.spec.memory_bytes, r.port or 0)
                       for r in self._live_shares(device_uuid, exclude) if r.spec.kind == "fastpod"]
            sharefiles.write(self.config.share_root, device_uuid, entries)
            if exclude is None:
                self._files_written[device_uuid] = covers

    # --- release -----------------------------------------------------------------------------

    def release(self, share_id: str, deadline: Deadline) -> ReleaseResult:
        if not share_id:
            raise AgentError("INVALID_ARGUMENT", "share_id is required")
        with self._share_locks.hold(share_id, deadline):
            row = self.journal.share(share_id)
            if row is None:
                lost = self.journal.forget_lost(share_id)   # dropped with its device: now forgotten
                if lost:
                    self._changed()
                return ReleaseResult(lost)
            if row.state == "ready" and self._release_fast(row, deadline):
                destroyed, stopped = [], []
            else:
                destroyed, stopped = self._release_slow(row, deadline)
            self.journal.forget_lost(share_id)   # a drop a crash interrupted
        self._changed()
        return ReleaseResult(True, tuple(destroyed), tuple(stopped))

    def _release_fast(self, row: ShareRow, deadline: Deadline) -> bool:
        """An MPS share whose daemon stays (other shares use it): ONE commit, then the share
        files (derived from the journal, rewritten by the reconciler after a crash)."""
        if row.spec.kind not in ("fastpod", "mps"):
            return False
        with self._mps_locks.hold(row.device_uuid, deadline):
            if not any(r.spec.kind in ("fastpod", "mps")
                       for r in self._live_shares(row.device_uuid, exclude=row.spec.id)):
                return False
            self.journal.delete_share(row.spec.id)
        faults.point("agent.after_share_committed")
        self._free_port(row.port)
        if row.spec.kind == "fastpod":
            self._write_share_files(row.device_uuid, deadline)
        return True

    def _release_slow(self, row: ShareRow, deadline: Deadline) -> tuple[list[str], list[str]]:
        """Write-ahead release: mark 'releasing', free each resource, then forget the share."""
        self.journal.set_share_state(row.spec.id, "releasing")
        faults.point("agent.after_release_journaled")
        destroyed, stopped = self._undo(row, deadline)
        self.journal.delete_share(row.spec.id)
        return destroyed, stopped

    def _undo(self, row: ShareRow, deadline: Deadline) -> tuple[list[str], list[str]]:
        """Free what ``row`` holds (idempotent: safe to repeat after a crash at any step). The
        port goes last: while a step fails the share stays 'releasing' and keeps its port, so
        no new fastpod is handed a port the old one may still serve."""
        spec, destroyed, stopped = row.spec, [], []
        if spec.kind == "exclusive":
            for m in self.journal.migs(spec.device_uuids[0]):
                if m.share_id == spec.id and self._destroy_agent_mig(m.gpu_uuid, m.start, m.profile_id,
                                                                     deadline):
                    destroyed.append(m.mig_uuid or f"{m.gpu_uuid}@{m.start}")
        elif spec.kind in ("fastpod", "mps"):
            if spec.kind == "fastpod":
                self._write_share_files(row.device_uuid, deadline, exclude=spec.id)
            if self._stop_mps_if_unused(row.device_uuid, deadline, exclude=spec.id):
                stopped.append(row.device_uuid)
        self._free_port(row.port)
        return destroyed, stopped

    def _destroy_agent_mig(self, gpu_uuid: str, start: int, profile_id: int, deadline: Deadline) -> bool:
        """Destroy a MIG instance the journal says we created; keep (adopt) it if busy.

        Returns True when it is gone. Only the instance at the journaled placement AND of the
        journaled profile is touched, so a foreign instance is never destroyed."""
        gpu = self._gpu(gpu_uuid)
        with self._device_locks.hold(gpu_uuid, deadline):
            try:
                current = next((m for m in self.devices.mig_instances(gpu.index) if m.start == start), None)
            except DeviceError as exc:
                if exc.code != "GPU_IS_LOST":
                    raise _device_error(exc, f"listing MIG instances of GPU {gpu_uuid}") from None
                # A lost GPU's instances go with it: only a reset or a reboot brings it back,
                # and both end them. Kept, the row failed every release and housekeeping.
                self.journal.delete_mig(gpu_uuid, start)
                return True
            if current is None or current.profile_id != profile_id:
                self.journal.delete_mig(gpu_uuid, start)  # already gone (or never created)
                return current is None
            # In use: processes run on it, or a live share holds it (an exclusive share that took
            # this idle instance at its placement, an MPS share on its MIG device) before its
            # workload has started or between two of its processes.
            holders = self._live_shares(current.uuid) if current.uuid else []
            if current.processes or holders:
                log.warning("MIG %s at slice %d of %s is in use (%d process(es), share(s) %s): kept, "
                            "destroyed once idle", current.uuid, start, gpu_uuid, current.processes,
                            ", ".join(r.spec.id for r in holders) or "none")
                self.journal.set_mig_share(gpu_uuid, start, None)
                self.journal.set_mig_state(gpu_uuid, start, "ready")
                return False
            self.journal.set_mig_state(gpu_uuid, start, "destroying")
            try:
                self.devices.destroy_mig_instance(gpu.index, start)
            except DeviceError as exc:
                if exc.code == "IN_USE":
                    self.journal.set_mig_share(gpu_uuid, start, None)
                    self.journal.set_mig_state(gpu_uuid, start, "ready")
                    return False
                raise _device_error(exc, f"destroying MIG at slice {start} of GPU {gpu_uuid}") from None
            faults.point("agent.after_mig_destroy")
            self.journal.delete_mig(gpu_uuid, start)
            self.refresh_devices()  # before the lock goes: an MPS prepare looks its device up under it
        return True

    def _stop_mps_if_unused(self, device_uuid: str, deadline: Deadline, exclude: str | None = None) -> bool:
        with self._mps_locks.hold(device_uuid, deadline):
            if any(r.spec.kind in ("fastpod", "mps") for r in self._live_shares(device_uuid, exclude)):
                return False
            row = self.journal.mps(device_uuid)
            if row is None and device_uuid not in self.mps.running_devices():
                return False
            if row is not None:
                self.journal.update_mps(device_uuid, state="stopping")
            try:
                self.mps.stop(device_uuid)
            except MpsError as exc:
                raise AgentError("UNAVAILABLE", f"stopping MPS daemon for {device_uuid}: {exc}") from None
            if row is not None and row.compute_mode_set:
                with contextlib.suppress(DeviceError, AgentError):
                    self.devices.set_compute_mode(self._gpu(row.gpu_uuid).index, "DEFAULT")
            self.journal.delete_mps(device_uuid)
            self._mps_health.pop(device_uuid, None)
            return True

    # --- reconcile ---------------------------------------------------------------------------

    def reconcile(self) -> list[str]:
        """Bring journal and host back in line after a start (crash, kill -9, reboot).

        Runs before the agent serves. Returns what it did, for the log."""
        deadline = Deadline(max(60.0, self.config.mps_timeout_s * 4))
        actions: list[str] = []
        self.refresh_devices()
        for row in self.journal.shares():
            if row.port:
                with self._state:
                    self._ports_in_use.add(row.port)
        for row in self.journal.shares():
            with _step(actions, f"share {row.spec.id}"):
                actions += self._reconcile_share(row, deadline)
        self._settle_taken(self.journal.taken())   # a forced change the agent died before (or after)
        live = {r.spec.id for r in self.journal.shares()}
        present = {g.uuid for g in self._gpus}
        for m in self.journal.migs():
            with _step(actions, f"MIG at slice {m.start} of {m.gpu_uuid}"):
                if m.gpu_uuid not in present:   # its GPU was replaced or removed: nothing to undo
                    self.journal.delete_mig(m.gpu_uuid, m.start)
                    actions.append(f"MIG at slice {m.start} of {m.gpu_uuid}: its GPU is gone; forgotten")
                elif m.purpose == "layout":
                    actions += self._reconcile_layout_mig(m, deadline)
                elif m.share_id not in live:
                    gone = self._destroy_agent_mig(m.gpu_uuid, m.start, m.profile_id, deadline)
                    fate = "destroyed" if gone else "in use, adopted until idle"
                    actions.append(f"MIG {m.mig_uuid or m.gpu_uuid + '@' + str(m.start)} created by the "
                                   f"agent without a share: {fate}")
        actions += self._reconcile_mps(deadline)
        devices_with_files = set(sharefiles.devices(self.config.share_root))
        for row in self.journal.shares():
            if row.spec.kind == "fastpod":
                devices_with_files.add(row.device_uuid)
        for device_uuid in sorted(devices_with_files):
            self._write_share_files(device_uuid, deadline)
        self.refresh_devices()
        self._changed()
        return actions

    def _reconcile_share(self, row: ShareRow, deadline: Deadline) -> list[str]:
        why = self._vanished(row)
        if why is not None:
            # Its GPU was replaced (same slot, new UUID) or removed, or its MIG device ended
            # (a reboot or a GPU reset ends them; new ones get new UUIDs) while the agent was
            # down: the share can never be used again. Kept, it looked ready to the controller
            # for good (holding the new board's capacity there).
            self._drop(row, why, deadline)
            return [f"share {row.spec.id}: {why}; dropped"]
        if row.state == "ready":
            return []
        if row.state == "preparing" and row.spec.kind == "exclusive" and self._adopt_preparing(row):
            return [f"share {row.spec.id}: MIG device in use, adopted as prepared"]
        destroyed, stopped = self._undo(row, deadline)
        self.journal.delete_share(row.spec.id)
        return [f"share {row.spec.id}: {row.state} when the agent stopped; rolled back"
                + (f", destroyed {destroyed}" if destroyed else "")
                + (f", stopped MPS {stopped}" if stopped else "")]

    def _vanished(self, row: ShareRow) -> str | None:
        """Why the device ``row`` lives on is gone, naming it (None: it is there), by the last
        read of the devices. A 'preparing' exclusive share lives on its GPU until its instance
        is made."""
        lost = self._lost_gpu((*row.spec.device_uuids, row.device_uuid))
        if lost is not None:
            return (f"GPU {lost.uuid} (GPU {lost.index}) is lost (fell off the bus?): NVML answers "
                    f"NVML_ERROR_{lost.lost}")
        present = {g.uuid for g in self._gpus}
        gone = [u for u in row.spec.device_uuids if not u.startswith("MIG-") and u not in present]
        if gone:
            return ("; ".join(f"GPU {u} is no longer on this node" for u in gone)
                    + " (removed, replaced or fallen off the bus)")
        if row.device_uuid.startswith("MIG-") and not any(
                m.uuid == row.device_uuid for g in self._gpus for m in g.mig_instances):
            start = row.prepared.mig_start if row.spec.kind == "exclusive" and row.prepared else None
            where = f" (slice {start} of GPU {row.spec.device_uuids[0]})" if start is not None else ""
            cause = self.journal.taken().get(row.device_uuid) or (   # a forced layout's (node.layout)
                "destroyed outside fastshare (by hand, e.g. nvidia-smi mig -dci/-dgi, or by a GPU reset or a "
                "reboot)")
            return f"its MIG device {row.device_uuid}{where} is gone: {cause}"
        if row.spec.kind != "exclusive":   # on a GPU whole: taken by a forced MIG enable?
            for gpu in self._gpus:
                if gpu.mig_pending and gpu.uuid in row.spec.device_uuids and (
                        cause := self.journal.taken().get(gpu.uuid)):
                    when = "" if gpu.mig_current else " (in effect at the GPU's next reset)"
                    return f"its GPU {gpu.uuid} (GPU {gpu.index}) is no longer usable whole: {cause}{when}"
        return None

    def _drop(self, row: ShareRow, why: str, deadline: Deadline) -> None:
        """Forget a share whose device is gone and free what it still holds (its MPS daemon, its
        entries in the share files, its port). A ready one is recorded as lost first, with why,
        until its id is released: the controller then ends its allocation with that reason
        instead of preparing it again on another device (see the Inventory's lost_shares)."""
        if row.state == "ready":
            self.journal.lose_share(LostShare(row.spec.id, row.device_uuid, why, row.spec.owner))
        if row.spec.kind == "exclusive":
            # Its instance is gone: the journal rows of it are forgotten, never destroyed (an
            # instance laid out there since, even of the same profile, is not ours). Under the
            # GPU's lock, under which a prepare records an instance at the same place.
            gpu_uuid = row.spec.device_uuids[0]
            with self._device_locks.hold(gpu_uuid, deadline):
                for m in self.journal.migs(gpu_uuid):
                    if m.share_id == row.spec.id:
                        self.journal.delete_mig(gpu_uuid, m.start)
            self._free_port(row.port)
        else:
            self._undo(row, deadline)
        self.journal.delete_share(row.spec.id)
        self._settle_taken({row.device_uuid, *row.spec.device_uuids})

    def _settle_taken(self, devices: Iterable[str]) -> None:
        """Forget why a forced change took each of ``devices`` (journaled before the change: see
        node.layout and set_mig_mode) once no share is left to drop with that cause, or if the
        change did not happen (NVML refused it, or the agent died before it): the device is still
        there (a GPU: MIG not enabled)."""
        noted = self.journal.taken()
        for device_uuid in devices:
            if device_uuid not in noted:
                continue
            gpu = next((g for g in self._gpus if g.uuid == device_uuid), None)
            if gpu is not None:   # a GPU a forced MIG enable takes from the shares using it whole
                there = not gpu.mig_pending
                left = [r for r in self.journal.shares_on(device_uuid) if r.spec.kind != "exclusive"]
            else:                 # a MIG device a forced layout destroys
                there = any(m.uuid == device_uuid for g in self._gpus for m in g.mig_instances)
                left = self.journal.shares_on(device_uuid)
            if there or not left:
                self.journal.forget_taken(device_uuid)

    def _drop_vanished(self) -> bool:
        """Housekeeping: drop the ready shares whose device went away while the agent ran (a MIG
        device destroyed by hand, a GPU fallen off the bus), as the start does. True if any was."""
        suspects = [r for r in self.journal.shares() if r.state == "ready" and self._vanished(r)]
        if not suspects:
            return False
        # Read the devices again, after those rows: the last read may predate the device of a
        # share prepared since (a device of a ready share existed when it became ready).
        self.refresh_devices()
        dropped = False
        for suspect in suspects:
            share_id = suspect.spec.id
            try:
                with self._share_locks.hold(share_id, Deadline(1.0)):   # busy: the next round
                    if self.journal.share(share_id) != suspect:
                        continue   # released (or released and prepared again) meanwhile
                    why = self._vanished(suspect)
                    if why is None:
                        continue
                    log.warning("share %s (owner %r): %s; dropped (reported as lost until its id is "
                                "released)", share_id, suspect.spec.owner, why)
                    self._drop(suspect, why, Deadline(self.config.mps_timeout_s * 4))
                    dropped = True
            except (AgentError, DeviceError, MpsError, OSError) as exc:
                log.error("share %s: its device is gone, but dropping it failed (%s); retried by the next "
                          "housekeeping", share_id, exc)
        return dropped

    def _adopt_preparing(self, row: ShareRow) -> bool:
        """A half-prepared exclusive share whose new MIG device already runs work: keep it."""
        gpu = self._gpu(row.spec.device_uuids[0])
        for m in self.journal.migs(gpu.uuid):
            if m.share_id != row.spec.id:
                continue
            current = next((i for i in gpu.mig_instances if i.start == m.start), None)
            if current is not None and current.profile_id == m.profile_id and current.processes:
                self.journal.mig_ready(gpu.uuid, m.start, current.uuid)
                self.journal.share_ready(row.spec.id, current.uuid or gpu.uuid, _exclusive_prepared(current))
                return True
        return False

    def _reconcile_layout_mig(self, m, deadline: Deadline) -> list[str]:
        gpu = self._gpu(m.gpu_uuid)
        current = next((i for i in gpu.mig_instances if i.start == m.start), None)
        if m.state == "creating":
            if current is not None and current.profile_id == m.profile_id:
                self.journal.mig_ready(m.gpu_uuid, m.start, current.uuid)
                return [f"layout MIG at slice {m.start} of {m.gpu_uuid}: creation completed"]
            self.journal.delete_mig(m.gpu_uuid, m.start)
            return [f"layout MIG at slice {m.start} of {m.gpu_uuid}: never created, forgotten"]
        if m.state == "destroying":
            self._destroy_agent_mig(m.gpu_uuid, m.start, m.profile_id, deadline)
            return [f"layout MIG at slice {m.start} of {m.gpu_uuid}: destruction completed"]
        if current is None or current.profile_id != m.profile_id:
            self.journal.delete_mig(m.gpu_uuid, m.start)
            return [f"layout MIG at slice {m.start} of {m.gpu_uuid}: gone, forgotten"]
        return []

    def _reconcile_mps(self, deadline: Deadline) -> list[str]:
        actions = []
        needed = {r.device_uuid for r in self.journal.shares() if r.spec.kind in ("fastpod", "mps")}
        known = {r.device_uuid for r in self.journal.mps_daemons()} | set(self.mps.running_devices())
        for device_uuid in sorted(known - needed):
            with _step(actions, f"MPS daemon for {device_uuid}"):
                if self._stop_mps_if_unused(device_uuid, deadline):
                    actions.append(f"MPS daemon for {device_uuid}: no share left, stopped")
        for device_uuid in sorted(needed):
            row = self.journal.mps(device_uuid)
            if row is not None and row.state == "running" and self.mps.answers(device_uuid):
                self.journal.update_mps(device_uuid, pid=self.mps.daemon_pid(device_uuid))
                self._mps_health[device_uuid] = True
                actions.append(f"MPS daemon for {device_uuid}: running, adopted")
                continue
            if row is not None and row.state == "running":  # dead: started again below; the row
                self.journal.update_mps(device_uuid, state="starting")  # keeps compute_mode_set
            try:
                self._ensure_mps(self._device(device_uuid), deadline)
                actions.append(f"MPS daemon for {device_uuid}: (re)started for its shares")
            except AgentError as exc:
                actions.append(f"MPS daemon for {device_uuid}: cannot start: {exc}")
        return actions

    def housekeeping(self) -> None:
        """Periodic: refresh devices, drop shares whose device went away, destroy idle orphan MIG
        instances, restart dead MPS daemons."""
        deadline = Deadline(self.config.mps_timeout_s * 4)
        before = self._gpus
        self.refresh_devices()
        dropped = self._drop_vanished()
        # MIG rows first: a share is journaled before its instance, so a row read here whose
        # share is missing from the shares read next is a real orphan, not one just prepared.
        migs = self.journal.migs()
        live = {r.spec.id for r in self.journal.shares()}
        changed = dropped or before != self._gpus
        for m in migs:
            if m.purpose == "share" and m.state == "ready" and m.share_id not in live:
                changed |= self._destroy_agent_mig(m.gpu_uuid, m.start, m.profile_id, deadline)
        for row in self.journal.mps_daemons():
            if row.state != "running":
                continue
            healthy = self.mps.answers(row.device_uuid)
            if self._mps_health.get(row.device_uuid) != healthy:
                changed = True
            self._mps_health[row.device_uuid] = healthy
            if not healthy:
                log.warning("MPS daemon for %s does not answer; restarting it", row.device_uuid)
                with self._mps_locks.hold(row.device_uuid, deadline):
                    if self.journal.mps(row.device_uuid) != row:
                        continue  # stopped by a release, or restarted, while we looked
                    with contextlib.suppress(MpsError):
                        self.mps.stop(row.device_uuid)
                    # Not deleted: the row keeps compute_mode_set for the daemon started next.
                    self.journal.update_mps(row.device_uuid, state="starting")
                with contextlib.suppress(AgentError):
                    self._ensure_mps(self._device(row.device_uuid), deadline)
        if changed:
            self._changed()

    # --- MIG mode -----------------------------------------------------------------------------

    def set_mig_mode(self, gpu_uuid: str, enabled: bool, deadline: Deadline, force: bool = False,
                     destroy_instances: bool = False) -> tuple[bool, bool, list[dict]]:
        """Returns (pending reset, changed, instances destroyed as ApplyMigLayout's actions); a change
        already pending is not made again (not changed, forced or not). Enabling MIG under shares
        that use the GPU whole is refused as without an agent (``refuse_enable_under_share``) unless
        ``force``: they are then dropped before the reply, as lost with that cause (journaled before
        the change, so that a restart after a crash in between drops them so too). A disable with
        ``destroy_instances`` first destroys the GPU's MIG instances under the same lock, as
        ApplyMigLayout to no profiles does (those shares hold only with ``force``, their shares
        dropped so too; never those processes run on); without it, it is refused while shares hold
        them (and NVML refuses it while any exists)."""
        gpu = self._gpu(gpu_uuid)
        self.refuse_mig_change_if_lost(gpu)
        if not gpu.mig_capable:
            raise AgentError("FAILED_PRECONDITION", f"GPU {gpu_uuid} ({gpu.name}) does not support MIG")
        taken: list[str] = []          # devices whose shares a forced change takes, noted before it
        actions: list[dict] = []
        destroying = switched = False
        try:
            with self._device_locks.hold(gpu_uuid, deadline):
                gpu = self._gpu(gpu_uuid)   # as the last mode change (under this lock) left it
                if gpu.mig_current == enabled and gpu.mig_pending == enabled:
                    return False, False, []
                if gpu.mig_pending == enabled:   # asked for already, waits for a GPU reset: nothing to
                    return True, False, []       # change (nor, forced, any share to drop for it)
                if enabled:
                    if self._before_mig_enable(gpu, force):
                        taken.append(gpu_uuid)
                else:
                    self._refuse_disable_under_shares(gpu, destroy_instances)
                    if destroy_instances and gpu.mig_current:
                        from fastshare.node.layout import destroy_all  # it builds on this module

                        destroying = True
                        actions = destroy_all(self, gpu, force, taken)
                try:
                    pending = self.devices.set_mig_mode(gpu.index, enabled)
                except DeviceError as exc:
                    raise _device_error(exc, f"setting MIG mode of GPU {gpu_uuid}") from None
                switched = True
                faults.point("agent.after_mig_mode")
                self.refresh_devices()  # before the lock goes: prepares re-check the mode under it
        finally:
            if taken:   # also after a failure: then what a note names is still there, and the note goes
                self._drop_vanished()
                self._settle_taken(taken)
            if switched or destroying:   # also when instances went and then the mode change failed
                self._changed()
        return pending, True, actions

    def refuse_mig_change_if_lost(self, gpu: GpuInfo) -> None:
        """A MIG mode or layout change on a lost GPU (also one named from the journal, listed blank:
        no name, no MIG) is refused saying so, not as a failed NVML read; tagged GPU_LOST, as the
        controller's SetMigMode for an exclusive share that turns MIG on places the share again."""
        if gpu.lost:
            raise AgentError("FAILED_PRECONDITION",
                             f"GPU {gpu.index} ({gpu.uuid}) of node {self.config.node_name} is lost (fell "
                             f"off the bus?): NVML_ERROR_{gpu.lost}; it takes no changes until a GPU reset "
                             f"(nvidia-smi -r -i {gpu.index}) or a reboot", GPU_LOST)

    def _refuse_disable_under_shares(self, gpu: GpuInfo, destroy_instances: bool) -> None:
        """Under the GPU's lock, before MIG is disabled: refused while shares use the GPU whole with MIG
        on (cancelling an enable still pending leaves them be), and without ``destroy_instances`` while
        shares hold its MIG instances (with it, node.layout refuses them unless forced)."""
        holders = [r for r in self._live_shares(gpu.uuid) if r.spec.kind != "exclusive"] if gpu.mig_current \
            else []
        if not destroy_instances:
            holders += [r for m in gpu.mig_instances for r in self._live_shares(m.uuid or "")]
        if holders:
            raise AgentError("FAILED_PRECONDITION", f"GPU {gpu.uuid} has shares "
                                                    f"({', '.join(sorted({r.spec.id for r in holders}))}); "
                                                    "release them before changing its MIG mode")

    def _before_mig_enable(self, gpu: GpuInfo, force: bool) -> bool:
        """Under the GPU's lock, before MIG is enabled: refuse if shares use the GPU whole (they
        would lose it), unless ``force``; then note why they lose it. True if it was noted."""
        whole = [r for r in self._live_shares(gpu.uuid) if r.spec.kind != "exclusive"]
        held = {gpu.uuid: [r.spec.id for r in whole]} if whole else {}
        if reason := mig_layout.refuse_enable_under_share(gpu, held, force):
            raise AgentError("FAILED_PRECONDITION", reason)
        if not whole or gpu.mig_pending:   # MIG already asked for: no change of mode
            return False
        self.journal.note_taken(gpu.uuid, "MIG was enabled on it by a forced MIG mode change (SetMigMode "
                                          "with force, e.g. `fastshare mig enable --force`)")
        return True

    # --- inventory ---------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        gpus = self.refresh_devices()
        shares = self.journal.shares()
        lost = self.journal.lost_shares()   # after the shares: one dropped between is in one or both
        migs = {(m.gpu_uuid, m.start): m for m in self.journal.migs()}
        share_of_device = {r.device_uuid: r.spec.id for r in shares if r.spec.kind == "exclusive"}
        files = []
        for device_uuid in sharefiles.devices(self.config.share_root):
            try:
                n = len(sharefiles.read(self.config.share_root, device_uuid))
            except (OSError, ValueError):
                n = 0
            files.append((device_uuid, *sharefiles.names(self.config.share_root, device_uuid), n))
        daemons = []
        for row in self.journal.mps_daemons():
            paths = self.mps.paths(row.device_uuid)
            ids = [r.spec.id for r in shares if r.device_uuid == row.device_uuid]
            daemons.append((row, str(paths.pipe_dir), str(paths.log_dir), ids,
                            self._mps_health.get(row.device_uuid, False)))
        return Snapshot(node_name=self.config.node_name, agent_version=__version__,
                        driver_version=self.devices.driver_version(), generation=self.generation,
                        boot_id=self.boot_id, gpus=gpus, profiles=dict(self._profiles),
                        agent_migs=migs, share_of_device=share_of_device, mps_daemons=daemons,
                        shares=shares, lost_shares=lost, share_files=files, links=self._links(gpus),
                        mps_unavailable=self.mps.unavailable(),
                        mps_memory_oversubscription=self.config.mps_memory_oversubscription)

    def _links(self, gpus: list[GpuInfo]) -> tuple[tuple[int, int, int], ...]:
        """Every GPU pair's link (read once: the wiring does not change while the agent runs; but
        the links of a GPU lost at the time cannot be read, and are read again once it answers);
        none when NVML cannot say, and the controller then places whole GPUs without topology."""
        gpu_count, lost = len(gpus), {g.index for g in gpus if g.lost}
        counted = self._topology is not None and len(self._topology) == gpu_count * (gpu_count - 1) // 2
        if not counted or self._topology_lost - lost:
            try:
                topology = self.devices.topology()
            except DeviceError as exc:
                if counted:   # read again for a GPU that answers again: keep the links as read
                    return self._topology or ()
                log.warning("cannot read the GPU topology (%s): whole GPUs are placed without it", exc)
                return ()
            self._topology = tuple((a, b, topology.level(a, b))
                                   for a in range(gpu_count) for b in range(a + 1, gpu_count))
            self._topology_lost = lost
        return self._topology


@dataclass(frozen=True)
class Snapshot:
    """Inventory in agent terms; the service turns it into the proto."""

    node_name: str
    agent_version: str
    driver_version: str
    generation: int
    boot_id: str
    gpus: list[GpuInfo]
    profiles: dict[str, list[MigProfile]]
    agent_migs: dict
    share_of_device: dict[str, str]
    mps_daemons: list
    shares: list[ShareRow]
    lost_shares: list[LostShare]
    share_files: list[tuple[str, str, str, int]]
    links: tuple[tuple[int, int, int], ...] = ()   # (gpu a, gpu b, NVML level; -1 NVLink)
    mps_unavailable: str = ""   # why MPS shares cannot run here; "" when they can
    mps_memory_oversubscription: float = 1.0   # the memory factor MPS shares of a GPU may promise here


@contextlib.contextmanager
def _step(actions: list[str], what: str) -> Iterator[None]:
    """One reconcile step: a failure (a GPU gone, a daemon that will not stop) is reported and
    the journal row kept for the next start, instead of keeping the whole node down."""
    try:
        yield
    except (AgentError, DeviceError, MpsError, OSError) as exc:
        log.error("reconcile: %s failed: %s", what, exc)
        actions.append(f"{what}: FAILED ({exc}); left in the journal for the next start")


def _raises(daemon: MpsRow, sm: float, mem: int | None) -> bool:
    """Would these ceilings raise the daemon's current limits (which needs the control pipe)?"""
    if daemon.sm_ceiling is None or sm > daemon.sm_ceiling:
        return True
    return _raises_mem(daemon.mem_ceiling, mem)


def _raises_mem(ceiling: int | None, mem: int | None) -> bool:
    """Would memory ceiling ``mem`` raise the daemon's ``ceiling``? None is no cap, so a share
    without a memory limit (``mem`` None) lifts any cap: its clients get the daemon's default."""
    return ceiling is not None and (mem is None or mem > ceiling)


def _kinds(rows: list[ShareRow]) -> str:
    return ", ".join(sorted({r.spec.kind for r in rows}))


def _exclusive_prepared(mig: MigInstance) -> Prepared:
    device = mig.uuid or ""
    return Prepared(env={"NVIDIA_VISIBLE_DEVICES": device, "CUDA_VISIBLE_DEVICES": device},
                    device_uuids=(device,), mig_start=mig.start)


def best_start(gpu: GpuInfo, profile: MigProfile, instances: list[MigInstance],
               candidates: list[int], profiles: list[MigProfile]) -> int:
    """Placement for one new instance: the device layer's planner keeps the largest future
    shapes free; ``candidates`` (free starts) is the fallback if it has no answer."""
    shape = mig_layout.GpuShape.from_profiles(profiles, f"GPU {gpu.uuid}")
    start = mig_layout.best_placement(shape, instances, profile.profile_id)
    return start if start in candidates else candidates[-1]
