"""Changing MIG on a host where a node agent may run (`fastshare mig ...`, the mig_config module,
fastshare-mig-layout.service): through the agent when it answers on its unix socket (its calls
run under its lock of the GPU, so a share it is preparing counts), never beside an agent that is
starting (it holds its state directory but does not answer yet: it is reconciling the journal
with the GPUs' MIG devices), and directly only while holding that state directory's lock, so an
agent starting meanwhile waits until the change is done.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from fastshare.device.api import DeviceError, Devices, GpuInfo, MigInstance, MigProfile, Topology
from fastshare.device.catalog import find_model
from fastshare.node.config import AGENT_LOCK_OWNER, MIG_CHANGE_NOTE, SERVING
from fastshare.state_lock import Holder, LockedError, StateDirLock, held_by

_AS_ROOT = "run as root (the agent's state directory is 0700)"
# refuse_if_starting (another `fastshare mig ...` looking) takes the lock shared for an instant:
# taking it for a change waits that long, as a starting agent does (node/server.py), before
# taking whoever holds it for an agent.
_PATIENCE_S = 2.0


AGENT_TIMEOUT_S = 300     # a layout change on a real GPU takes seconds per instance
# the agent's answers that refuse the change (the rest are failures: say so, with the code)
_REFUSALS = ("FAILED_PRECONDITION", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND")


class AgentRefused(Exception):
    """The local agent refused a call (``refused``) or failed it; the message is what it said."""

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


def ask(method: Any, request: Any) -> Any:
    """One call to the local agent (a stub's ``method``); raises AgentRefused with its words (the
    code named for a failure; "profiles: ", its name for a layout, left out)."""
    import grpc

    try:
        return method(request, timeout=AGENT_TIMEOUT_S)
    except grpc.RpcError as exc:
        details = (exc.details() or "").removeprefix("profiles: ")
        refused = exc.code().name in _REFUSALS
        raise AgentRefused(details if refused else f"the node agent answered {exc.code().name}: {details}",
                           refused) from None


class LocalAgentError(Exception):
    """MIG must not be changed now (or whether it may cannot be told); ``hint`` says what to do."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def local_agent(unix_socket: str, state_dir: Path | str, socket_option: str = "--unix-socket",
                dir_option: str = "--agent-journal") -> Any | None:
    """A stub of the node agent on this host if it answers on ``unix_socket``; None when no agent
    runs. Raises LocalAgentError while an agent is starting or the socket cannot be used
    (``socket_option``/``dir_option``: how the caller's user names the socket and the state
    directory, for the messages)."""
    if not unix_socket:
        refuse_if_starting(state_dir, f"no {socket_option} given", dir_option)
        return None
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(unix_socket)
    except (FileNotFoundError, ConnectionRefusedError):
        # no socket, or the one an agent that no longer runs left
        refuse_if_starting(state_dir, f"it does not answer on {unix_socket} yet", dir_option)
        return None
    except OSError as exc:
        raise LocalAgentError(
            f"{socket_option} {unix_socket}: the node agent's socket cannot be used ({exc.strerror or exc}); "
            "MIG is not changed beside a running agent",
            "run as root or as a member of the socket's group (the agent's unix_socket_group)") from None
    finally:
        probe.close()
    from fastshare.node.client import channel, stub

    return stub(channel(unix_socket=unix_socket))


def refuse_if_starting(state_dir: Path | str, why: str, dir_option: str = "--agent-journal") -> None:
    """Raise LocalAgentError while a node agent holds ``state_dir`` without answering (``why``),
    or while another MIG change made without an agent holds it."""
    try:
        held = held_by(state_dir, AGENT_LOCK_OWNER)
    except OSError as exc:
        raise LocalAgentError(f"{dir_option}: cannot tell whether a node agent runs on {state_dir}: "
                              f"{exc.strerror or exc}", _AS_ROOT) from None
    if held is not None:
        raise _busy(state_dir, held, why)


def _busy(state_dir: Path | str, held: Holder, why: str) -> LocalAgentError:
    pid = held.pid
    if held.note == MIG_CHANGE_NOTE:
        return LocalAgentError(f"{held.note} (pid {pid}) is under way on this host ({state_dir}); MIG is not "
                               "changed beside it", "retry once it has finished")
    if held.status.startswith(SERVING):   # serving, on another unix socket or none
        socket_path = held.status.removeprefix(SERVING).strip()
        return LocalAgentError(
            f"a node agent (pid {pid}) serves on this host ({state_dir}) but {why}: it is {held.status}, "
            "and MIG is changed through its unix socket, never beside it",
            f"give its socket ({socket_path})" if socket_path.startswith("/") else
            "set unix_socket in its node.yaml and restart it, or stop it for the change")
    return LocalAgentError(f"a node agent (pid {pid}) runs on this host ({state_dir}) but {why}: it is "
                           "starting, and MIG is not changed beside it",
                           "retry once it answers (`fastshare node status`)")


@contextlib.contextmanager
def without_agent(state_dir: Path | str, dir_option: str = "--agent-journal") -> Iterator[None]:
    """Hold the node agent's lock of ``state_dir`` while MIG is changed directly (no agent answered):
    an agent starting meanwhile waits for the change (node/server.py) instead of reconciling
    beside it. Raises LocalAgentError when an agent (or another such change) holds it. No lock
    without the directory: no agent has run with it."""
    if not Path(state_dir).is_dir():
        yield
        return
    lock = StateDirLock(state_dir, AGENT_LOCK_OWNER, dir_option)
    try:
        lock.acquire(patience=_PATIENCE_S, note=MIG_CHANGE_NOTE)
    except LockedError as exc:
        raise _busy(state_dir, exc.holder, "it does not answer on its socket yet") from None
    except OSError as exc:
        raise LocalAgentError(f"{dir_option}: cannot lock the node agent's state directory {state_dir}: "
                              f"{exc.strerror or exc}", _AS_ROOT) from None
    try:
        yield
    finally:
        lock.release()


# Why the shares using a GPU whole lose it to a forced MIG enable made without the agent (the
# agent's own SetMigMode notes its cause the same way: node/agent.py _before_mig_enable).
FORCED_ENABLE_CAUSE = ("MIG was enabled on it by a forced MIG mode change made without the node agent "
                       "(`fastshare mig enable --force`, `fastshare mig config --force` or mig_config "
                       "with force)")


def note_forced_enable(agent_journal: Path | str | None, gpu_uuids: Iterable[str],
                       dir_option: str = "--agent-journal") -> None:
    """Under :func:`without_agent`, before MIG is enabled with force on ``gpu_uuids`` (GPUs shares
    of the journal use whole): journal why those shares lose their GPU (taken_devices), so the
    agent's next start drops them, reported lost with that cause, instead of keeping them ready on
    a MIG GPU. A change that does not happen (NVML refused it) leaves the mode as it was, and the
    start forgets the note. Raises LocalAgentError if the journal cannot be written."""
    from fastshare.node.journal import Journal, JournalError
    from fastshare.sqlite_file import StateFileError

    gpu_uuids = list(gpu_uuids)
    if not gpu_uuids or not agent_journal:
        return
    try:
        journal = Journal(Path(agent_journal))
    except (JournalError, StateFileError, OSError) as exc:
        raise LocalAgentError(f"{dir_option}: cannot note the forced MIG enable in {agent_journal}: {exc}",
                              _AS_ROOT) from None
    try:
        for uuid in gpu_uuids:
            journal.note_taken(uuid, FORCED_ENABLE_CAUSE)
    finally:
        journal.close()


def apply_directly(devices: Any, plans: Any, agent_journal: Path | str | None,
                   dir_option: str = "--agent-journal") -> list[dict[str, Any]]:
    """mig_parted.apply_host with no agent running (under :func:`without_agent`): a forced MIG
    enable under shares is journaled first (:func:`note_forced_enable`)."""
    from fastshare.device import mig_parted

    note_forced_enable(agent_journal, mig_parted.forced_enables(devices, plans), dir_option)
    return mig_parted.apply_host(devices, plans)


def held_by_agent(inventory: Any) -> dict[str, list[str]]:
    """The devices the agent's shares hold (UUID -> share ids), from its GetInventory reply, as
    :func:`fastshare.node.journal.held_device_uuids` reads them from its journal: a MIG device an
    exclusive share holds, and the device (GPU, held whole, or MIG device) any other share names."""
    held: dict[str, list[str]] = {}
    for gpu in inventory.gpus:
        for m in gpu.mig_devices:
            if m.share_id:
                held.setdefault(m.uuid, []).append(m.share_id)
    for s in inventory.shares:
        for uuid in s.device_uuids:
            mig_share = bool(s.mig_profile) and not uuid.startswith("MIG-")   # its GPU: where it was made
            if not mig_share and s.id not in held.get(uuid, []):
                held.setdefault(uuid, []).append(s.id)
    return {uuid: sorted(ids) for uuid, ids in held.items()}


class InventoryDevices(Devices):
    """The host's GPUs as the local node agent's inventory gives them, read again at each call: what
    `mig config` plans from while the agent makes the changes (its calls), so it needs no GPU backend
    of its own. Read-only: a change through it raises DeviceError."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def _inventory(self) -> Any:
        from fastshare.v1 import agent_pb2

        try:
            return ask(self._agent.GetInventory, agent_pb2.GetInventoryRequest())
        except AgentRefused as exc:
            raise DeviceError(f"node agent: {exc}") from None

    def driver_version(self) -> str:
        return self._inventory().driver_version

    def gpus(self) -> list[GpuInfo]:
        return [_gpu_info(g) for g in self._inventory().gpus]

    def mig_profiles(self, gpu_index: int) -> list[MigProfile]:
        """The agent's profiles of the GPU (with MIG off the catalog's, as NvmlDevices gives them)."""
        gpu = next((g for g in self._inventory().gpus if g.index == gpu_index), None)
        if gpu is None:
            self.gpu(gpu_index)   # raises, naming the valid indexes
        profiles = [MigProfile(p.profile_id, p.name, p.slices, p.memory_slices, p.memory_bytes >> 20,
                               p.sm_count, p.max_instances, tuple(p.placements)) for p in gpu.mig_profiles]
        model = find_model(gpu.name)
        return profiles or (list(model.profiles) if model and not gpu.mig_enabled else [])

    def mig_instances(self, gpu_index: int) -> list[MigInstance]:
        return list(self.gpu(gpu_index).mig_instances)

    def topology(self) -> Topology:
        raise DeviceError("the node agent's inventory gives no topology to `mig config`", "NOT_SUPPORTED")

    def _no_change(self, *args: Any) -> Any:
        raise DeviceError("MIG is changed by the node agent's calls, not through its inventory",
                          "NOT_SUPPORTED")

    set_mig_mode = create_mig_instance = destroy_mig_instance = set_compute_mode = _no_change


def lists_pci_ids(gpus: Iterable[Any]) -> bool:
    """Whether the agent that listed ``gpus`` (inventory protos or GpuInfo) is as new as
    Gpu.pci_device_id, and so as SetMigMode's destroy_instances (the same release): every GPU it
    could read has one (an older agent leaves it 0; a lost one may be listed blank)."""
    return all(g.lost or g.pci_device_id for g in gpus)


def inventory_devices(agent: Any) -> InventoryDevices | None:
    """:class:`InventoryDevices` of the local agent, or None if its inventory lacks what planning
    needs (an agent older than Gpu.pci_device_id, which a device-filter selects by): then the
    caller reads the GPUs itself, as before."""
    devices = InventoryDevices(agent)
    return devices if lists_pci_ids(devices.gpus()) else None


@contextlib.contextmanager
def planning_devices(agent: Any, open_backend: Callable[[], contextlib.AbstractContextManager[Devices]],
                     ) -> Iterator[Devices]:
    """The GPUs a MIG layout is planned from (`fastshare mig config`, the mig_config module): the
    running ``agent``'s inventory (it makes the changes, so no GPU backend is needed), else the
    devices ``open_backend()`` opens (no agent answered, or one too old: :func:`inventory_devices`)."""
    devices = inventory_devices(agent) if agent is not None else None
    with (devices if devices is not None else open_backend()) as opened:
        yield opened


def _gpu_info(g: Any) -> GpuInfo:
    model = find_model(g.name)
    instances = tuple(MigInstance(m.gpu_uuid, g.index, m.profile_id, m.profile_name, m.start, m.size, m.gi_id,
                                  m.ci_id if m.HasField("ci_id") else None, m.uuid or None, m.sm_count,
                                  m.memory_bytes >> 20, m.processes)
                      for m in sorted(g.mig_devices, key=lambda m: m.start))
    return GpuInfo(g.index, g.uuid, g.name, g.memory_bytes >> 20, g.sm_count, g.pci_bus_id, g.mig_capable,
                   g.mig_enabled, g.mig_pending, g.compute_mode, g.processes, instances,
                   model.key if model else None, g.pci_device_id, g.lost)
