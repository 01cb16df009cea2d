# Copyright: (c) 2026, fastshare developers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The mig_config module's side of declarative MIG layouts: its options in, its results out.

Planning and carrying out are fastshare's (``fastshare.device.mig_parted``, also behind
``fastshare mig config``): every GPU is planned before anything changes. This file turns the
module's ``layout`` option into the same per-GPU entries a mig-parted file gives, and renders
plans and results the way the module reports them (steps, predicted devices, diff text).
"""

from __future__ import annotations

import contextlib
import os

try:
    from fastshare.device import mig_parted
    from fastshare.node import local_agent as node_agent
    from fastshare.node.config import NodeConfig
except ImportError:  # the module fails with missing_required_lib before using any of this
    mig_parted = node_agent = NodeConfig = None


class MigConfigError(Exception):
    """A request that cannot be carried out; nothing has been changed when planning raises it
    (apply_plans may raise it after an earlier change)."""


def layout_targets(layout, gpus):
    """({gpu index: mig_parted.DeviceSpec}, the lost GPUs left out) from the module's ``layout`` option.

    A lost GPU (fallen off the bus) is left out of ``devices: all`` (each left out as
    mig_parted.left_out_lost gives it: the reason is the warning to give); one named by index is
    kept, for mig_parted.plan_host to refuse before any change."""
    by_index = {g.index: g for g in gpus}
    valid = f"0..{len(gpus) - 1}" if gpus else "none: the host has no GPU"
    targets = {}
    everywhere = None
    for n, entry in enumerate(layout):
        where = f"layout[{n}]"
        devices = entry["devices"]
        if devices == "all":
            indexes = sorted(i for i, g in by_index.items() if not g.lost)
            everywhere = everywhere or where
        elif isinstance(devices, list) and devices and all(_is_index(d) for d in devices):
            indexes = [int(d) for d in devices]
        else:
            raise MigConfigError(f"{where}.devices must be 'all' or a non-empty list of GPU indexes, "
                                 f"got {devices!r}")
        for index in indexes:
            if index not in by_index:
                raise MigConfigError(f"{where}.devices: GPU {index} does not exist (valid: {valid})")
            if indexes.count(index) > 1:
                raise MigConfigError(f"{where}.devices: GPU {index} is listed twice")
            if index in targets:
                raise MigConfigError(f"{where}.devices: GPU {index} is already configured by an "
                                     "earlier layout entry")
            gpu = by_index[index]
            if entry["mig_enabled"] and not gpu.mig_capable and not gpu.lost:
                raise MigConfigError(f"{where}.devices: GPU {index} ({gpu.name}) does not support MIG; "
                                     "leave it out of devices or set mig_enabled: false")
            wanted = entry["mig_devices"] or {}
            if not entry["mig_enabled"] and any(int(_count(where, k, v)) for k, v in wanted.items()):
                raise MigConfigError(f"{where}: mig_devices requires mig_enabled=true")
            counts = tuple((str(k), _count(where, k, v)) for k, v in wanted.items())
            targets[index] = mig_parted.DeviceSpec((index,), entry["mig_enabled"], counts, where=where)
    return targets, (mig_parted.left_out_lost(gpus, targets, everywhere) if everywhere else [])


def _is_index(value):
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, str) and value.isdecimal())


def _count(where, profile, value):
    if isinstance(value, bool) or not str(value).strip().isdecimal():
        raise MigConfigError(f"{where}.mig_devices[{profile!r}] must be an integer >= 0, got {value!r}")
    return int(value)


def config_file_targets(path, name, gpus):
    """({gpu index: mig_parted.DeviceSpec}, the lost GPUs left out) from a mig-parted config file.

    Parsing, ``device-filter`` matching and the one-entry-per-GPU rule are fastshare's
    (``fastshare.device.mig_parted``), as for every other consumer of these files.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise MigConfigError(f"config_file: cannot read {path}: {exc.strerror}") from None
    try:
        configs = mig_parted.parse_config(text)
        targets = mig_parted.resolve(configs, name, gpus)
        return targets, mig_parted.lost_left_out(configs, name, gpus, targets)
    except (mig_parted.ConfigError, ValueError) as exc:
        raise MigConfigError(f"config_file {path}: {exc}") from None


def _state_dir(agent_journal):
    """The node agent's state directory: where its journal is, or the agent's default one."""
    return os.path.dirname(agent_journal) if agent_journal else NodeConfig.state_dir


def _refused(exc):
    return MigConfigError(f"{exc} ({exc.hint})" if exc.hint else str(exc))


def local_agent(unix_socket, agent_journal):
    """The node agent answering on ``unix_socket`` (None: none runs); MigConfigError while one is
    starting (fastshare.node.local_agent, as for `fastshare mig config`)."""
    try:
        return node_agent.local_agent(unix_socket, _state_dir(agent_journal), "unix_socket", "agent_journal")
    except node_agent.LocalAgentError as exc:
        raise _refused(exc) from None


def planning_devices(agent, open_backend):
    """The GPUs to plan from: the running ``agent``'s inventory, else ``open_backend()``'s
    (fastshare.node.local_agent, as for `fastshare mig config`)."""
    return node_agent.planning_devices(agent, open_backend)


@contextlib.contextmanager
def without_agent(agent_journal):
    """Hold the node agent's state directory while MIG is changed directly (no agent answered)."""
    try:
        with node_agent.without_agent(_state_dir(agent_journal), "agent_journal"):
            yield
    except node_agent.LocalAgentError as exc:   # only taking the lock raises it
        raise _refused(exc) from None


def agent_held(agent):
    """The devices the running agent's shares hold (UUID -> share ids), from its inventory."""
    from fastshare.v1 import agent_pb2

    try:
        inventory = node_agent.ask(agent.GetInventory, agent_pb2.GetInventoryRequest())
    except node_agent.AgentRefused as exc:
        raise MigConfigError(f"node agent: {exc}") from None
    return node_agent.held_by_agent(inventory)


def plan_targets(devices, targets, force, held, agent=None):
    """mig_parted plans for every targeted GPU; MigConfigError names the entry and the GPU. With a
    running ``agent``, it checks every GPU the plans change (its refusals, under its GPU lock)."""
    try:
        plans = mig_parted.plan_host(devices, targets, force=force, held=held)
        if agent is not None:
            mig_parted.check_host_via_agent(agent, devices, plans)
        return plans
    except mig_parted.ConfigError as exc:
        raise MigConfigError(str(exc)) from None


def apply_plans(devices, plans, agent=None, agent_journal=None):
    """Carry the plans out (mig_parted.apply_host, or by the running ``agent``'s calls): per GPU
    the steps done and the reset state. Directly, a forced MIG enable under shares is noted in
    ``agent_journal`` first, so that the agent's start drops them saying why.

    A refusal while carrying out (a re-plan after MIG came on) is a MigConfigError too."""
    try:
        if agent is not None:
            return mig_parted.apply_host_via_agent(agent, devices, plans)
        return node_agent.apply_directly(devices, plans, agent_journal, "agent_journal")
    except node_agent.LocalAgentError as exc:
        raise _refused(exc) from None
    except mig_parted.ConfigError as exc:
        raise MigConfigError(str(exc)) from None


def step_dict(gpu_index, step):
    """A step (``Step.to_dict()`` form) as the module returns it."""
    return dict(gpu=gpu_index, action=step["action"], profile=step["profile_name"],
                profile_id=step["profile_id"], start=step["start"], size=step["size"],
                description=f"GPU {gpu_index}: {step['description']}")


def predicted_mode(gpu_plan, gpu):
    """MIG mode (current, pending) the GPU will report once the plan has run."""
    pending = gpu_plan.mig_enabled if gpu_plan.mode_change else gpu.mig_pending
    return dict(current=gpu.mig_current if gpu_plan.reset_required else pending, pending=pending)


def describe_layout(gpu, mig_on, pending, placed_devices):
    """One GPU as text for diff mode: mode line, then one line per MIG device by start."""
    mode = "enabled" if mig_on else "disabled"
    if pending is not None and pending != mig_on:
        mode += f" ({'enabled' if pending else 'disabled'} after GPU reset)"
    lines = [f"GPU {gpu.index} ({gpu.name}, {gpu.uuid}): MIG {mode}"]
    for profile, start, size, uuid in sorted(placed_devices, key=lambda d: d[1]):
        suffix = f" {uuid}" if uuid else ""
        lines.append(f"  {profile} at start {start} (memory slices {start}..{start + size - 1}){suffix}")
    return "\n".join(lines) + "\n"


def predicted_devices(gpu_plan, instances):
    """(profile, start, size, uuid) of the MIG devices the GPU will have once the plan has run."""
    if gpu_plan.plan is None or not gpu_plan.mig_enabled:
        return []
    by_start = {d[1]: d for d in instances}
    result = []
    for p in gpu_plan.plan.final:
        prof = gpu_plan.shape.profile(p.profile_id)
        kept = by_start.get(p.start)
        uuid = kept[3] if kept and kept[0] == prof.name else None
        result.append((prof.name, p.start, prof.memory_slices, uuid))
    return result
