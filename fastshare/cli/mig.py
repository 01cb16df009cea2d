"""`fastshare mig`: plan and apply MIG layouts with explicit placements."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from fastshare.cli._output import fail, print_json, print_table
from fastshare.cli.gpu import backend_options, devices_from
from fastshare.device.api import Devices
from fastshare.device.mig_layout import (
    GpuShape,
    LayoutError,
    Placed,
    Plan,
    Step,
    apply_plan,
    format_layout,
    layout_counts,
    on_gpu,
    plan_for_gpu,
    refuse_enable_under_share,
    shape_of,
)
from fastshare.node.config import NodeConfig

_LAYOUT_HELP = "profiles and counts, e.g. '3g.20gb=1,2g.10gb=1,1g.5gb=2' or profile ids '9,19,14,19'"
_AGENT_JOURNAL = str(Path(NodeConfig.state_dir) / "journal.db")
_journal_option = click.option(
    "--agent-journal", type=click.Path(dir_okay=False), default=_AGENT_JOURNAL, show_default=True,
    help="the node agent's journal (journal.db in its state_dir): MIG devices and whole GPUs its shares "
         "hold count as in use; a missing file means no agent on this host")
_layout_force_option = click.option(
    "--force", is_flag=True,
    help="also destroy MIG instances that fastshare shares hold (the shares lose them); an instance "
         "with running processes is never destroyed")


_socket_option = click.option(
    "--unix-socket", default=NodeConfig.unix_socket, envvar="FASTSHARE_NODE_UNIX_SOCKET", show_default=True,
    help="the node agent's socket: while an agent answers there, it makes the change under its lock of the "
         "GPU, so a share it is preparing counts too (--gpu-backend, --sim-state and --agent-journal are "
         "then not used); with no agent there, the change is made directly")
_UINT32_MAX = 2**32 - 1


def _local_agent(unix_socket: str, agent_journal: str | None) -> Any | None:
    """A stub of the node agent on this host if it answers on ``unix_socket`` (None: none runs);
    ends the command while an agent is starting (fastshare.node.local_agent)."""
    from fastshare.node.local_agent import LocalAgentError, local_agent

    try:
        return local_agent(unix_socket, _state_dir(agent_journal))
    except LocalAgentError as exc:
        fail(str(exc), exc.hint)


def _state_dir(agent_journal: str | None) -> Path:
    return Path(agent_journal or _AGENT_JOURNAL).parent


@contextlib.contextmanager
def _without_agent(agent_journal: str | None) -> Iterator[None]:
    """While MIG is changed directly (no agent answered): hold the agent's state directory, so an
    agent starting meanwhile waits for the change instead of reconciling beside it."""
    from fastshare.node.local_agent import LocalAgentError, without_agent

    try:
        with without_agent(_state_dir(agent_journal)):
            yield
    except LocalAgentError as exc:   # only taking the lock raises it
        fail(str(exc), exc.hint)


def _note_forced_enable(agent_journal: str | None, gpu_uuids: list[str]) -> None:
    """Before a forced MIG enable made directly: the journal says why its shares lose the GPUs."""
    from fastshare.node.local_agent import LocalAgentError, note_forced_enable

    try:
        note_forced_enable(agent_journal, gpu_uuids)
    except LocalAgentError as exc:
        fail(str(exc), exc.hint)


def _ask(method: Callable[..., Any], request: Any, gpu_index: int | None,
         hint: str | None = None) -> Any:
    """One call to the local agent; a refusal or failure ends the command, naming the GPU it
    was about (if any) once."""
    from fastshare.node.local_agent import AgentRefused, ask

    try:
        return ask(method, request)
    except AgentRefused as exc:
        fail(str(exc) if gpu_index is None else on_gpu(gpu_index, str(exc)), hint if exc.refused else None)


def _agent_inventory(agent: Any, gpu_index: int) -> tuple[Any, dict[str, list[str]]]:
    """The agent's GPU ``gpu_index`` and the devices its shares hold (UUID -> share ids, as
    :func:`_held` reads them from its journal: exclusive shares by their MIG device, the others by
    the device they name)."""
    from fastshare.node.local_agent import held_by_agent
    from fastshare.v1 import agent_pb2

    inventory = _ask(agent.GetInventory, agent_pb2.GetInventoryRequest(), None)
    gpu = next((g for g in inventory.gpus if g.index == gpu_index), None)
    if gpu is None:
        fail(f"GPU index {gpu_index} does not exist (valid: 0..{len(inventory.gpus) - 1})")
    return gpu, held_by_agent(inventory)


def _layout_via_agent(agent: Any, gpu_index: int, layout: str, force: bool,
                      apply: bool) -> tuple[str, dict, list[dict], str]:
    """`mig plan/apply` by the node agent (Plan/ApplyMigLayout: the same planner and refusals, under
    its lock of the GPU): (GPU label, plan as ``Plan.to_dict``, instances after, layout after)."""
    from fastshare.v1 import agent_pb2

    gpu, held = _agent_inventory(agent, gpu_index)
    try:
        profiles = layout_counts(layout)
    except LayoutError as exc:
        fail(f"GPU {gpu_index}: {exc}")
    for name, count in profiles.items():
        if count > _UINT32_MAX:
            fail(f"GPU {gpu_index}: count for {name!r} must be at most {_UINT32_MAX}, got {count}")
    request = agent_pb2.MigLayoutRequest(gpu_uuid=gpu.uuid, profiles=profiles, force=force)
    reply = _ask(agent.ApplyMigLayout if apply else agent.PlanMigLayout, request, gpu_index)
    size = {p.profile_id: p.memory_slices for p in gpu.mig_profiles}
    steps = [Step(a.op, a.profile_id, a.profile_name, a.start, size.get(a.profile_id, 0))
             for a in reply.actions]
    devices = sorted(reply.mig_devices, key=lambda m: m.start)   # after an apply, before a plan
    for m in devices:   # an exclusive share prepared since the inventory was read
        if m.share_id and m.share_id not in held.get(m.uuid, []):
            held[m.uuid] = sorted([*held.get(m.uuid, []), m.share_id])
    shown = [Placed(m.profile_id, m.start, bool(m.processes or held.get(m.uuid)), m.uuid, m.processes,
                    tuple(held.get(m.uuid, ()))) for m in devices]
    created = [Placed(s.profile_id, s.start) for s in steps if s.action == "create"]
    if apply:   # the instances there before (not the ones just created) were kept
        made = {(p.profile_id, p.start) for p in created}
        keep, final = [p for p in shown if (p.profile_id, p.start) not in made], shown
    else:
        keep = [p for p in shown if p.start not in {s.start for s in steps if s.action == "destroy"}]
        final = sorted([*keep, *created], key=lambda p: p.start)
    instances = [{"gpu_uuid": m.gpu_uuid, "gpu_index": gpu_index, "profile_id": m.profile_id,
                  "profile_name": m.profile_name, "start": m.start, "size": m.size, "gi_id": m.gi_id,
                  "ci_id": m.ci_id if m.HasField("ci_id") else None, "uuid": m.uuid or None,
                  "sm_count": m.sm_count, "memory_mib": m.memory_bytes >> 20, "processes": m.processes,
                  "share_id": (held.get(m.uuid) or [""])[0]} for m in devices]
    now = Counter(m.profile_name for m in sorted(devices, key=lambda m: (-m.size, m.profile_id)))
    return (f"GPU {gpu.index} ({gpu.name})", Plan(tuple(steps), tuple(keep), tuple(final)).to_dict(),
            instances, ",".join(f"{name}={n}" for name, n in now.items()))


@contextlib.contextmanager
def _devices_of(agent: Any, gpu_backend: str | None, sim_state: str | None) -> Iterator[Devices]:
    """The GPUs as the node agent's inventory gives them while it answers (it makes the changes;
    no backend of our own needed), else as the backend reads them (also for an agent too old to give
    what planning needs)."""
    from fastshare.device.api import DeviceError
    from fastshare.node.local_agent import planning_devices

    try:
        with planning_devices(agent, lambda: devices_from(gpu_backend, sim_state)) as devices:
            yield devices
    except DeviceError as exc:
        fail(str(exc))


def _held(agent_journal: str | None) -> dict[str, list[str]]:
    """Devices the node agent's shares hold (none without an agent journal)."""
    from fastshare.node.journal import held_device_uuids
    from fastshare.sqlite_file import StateFileError

    try:
        return held_device_uuids(agent_journal)
    except StateFileError as exc:
        fail(f"--agent-journal: {exc}")


@click.group("mig")
def mig_group() -> None:
    """MIG mode and layouts (explicit placements, incremental, busy instances left alone)."""


def _show_plan(gpu: int, layout: str, shape_label: str, plan_dict: dict, as_json: bool, title: str) -> None:
    if as_json:
        print_json({"gpu": gpu, "layout": layout, **plan_dict})
        return
    steps = plan_dict["steps"]
    if not steps:
        click.echo(f"{shape_label} already has layout {layout!r}: nothing to do")
        return
    print_table(title, ["#", "step"], [[n + 1, s["description"]] for n, s in enumerate(steps)])


def _layout_options(command: Callable[..., None]) -> Callable[..., None]:
    """The options `mig plan` and `mig apply` share: what they plan is the same."""
    for option in reversed([
        backend_options,
        click.option("--gpu", "gpu_index", type=int, required=True, help="GPU index"),
        click.option("--layout", required=True, help=_LAYOUT_HELP),
        _layout_force_option,
        _journal_option,
        _socket_option,
        click.option("--json", "as_json", is_flag=True, help="machine-readable output"),
    ]):
        command = option(command)
    return command


def _planned(devices: Devices, gpu_index: int, layout: str, force: bool,
             held: dict[str, list[str]]) -> tuple[GpuShape, Plan]:
    try:
        return plan_for_gpu(devices, gpu_index, layout, force=force, held=held)
    except LayoutError as exc:
        fail(on_gpu(gpu_index, str(exc)))


def _change_layout(gpu_backend: str | None, sim_state: str | None, gpu_index: int, layout: str, force: bool,
                   agent_journal: str | None, unix_socket: str,
                   apply: bool) -> tuple[str, dict, list[dict], str]:
    """Plan (and with ``apply`` make) LAYOUT on GPU ``gpu_index``: by the node agent when one answers
    on ``unix_socket``, else directly. (GPU label, plan as ``Plan.to_dict``, instances after, layout
    after; the last two only with ``apply``.)"""
    agent = _local_agent(unix_socket, agent_journal)
    if agent is not None:
        return _layout_via_agent(agent, gpu_index, layout, force, apply)
    with _without_agent(agent_journal) if apply else contextlib.nullcontext():
        held = _held(agent_journal)
        with devices_from(gpu_backend, sim_state) as devices:
            shape, planned = _planned(devices, gpu_index, layout, force, held)
            done = apply_plan(devices, gpu_index, planned) if apply else []
    instances = [{**asdict(i), "share_id": (held.get(i.uuid or "") or [""])[0]} for i in done]
    return shape.label, planned.to_dict(), instances, format_layout(done, shape)


@mig_group.command("plan")
@_layout_options
def mig_plan(gpu_backend: str | None, sim_state: str | None, gpu_index: int, layout: str, force: bool,
             agent_journal: str | None, unix_socket: str, as_json: bool) -> None:
    """Show the steps that would turn the current layout into LAYOUT (changes nothing)."""
    label, plan, _, _ = _change_layout(gpu_backend, sim_state, gpu_index, layout, force, agent_journal,
                                       unix_socket, apply=False)
    _show_plan(gpu_index, layout, label, plan, as_json, f"plan for GPU {gpu_index}")


@mig_group.command("apply")
@_layout_options
def mig_apply(gpu_backend: str | None, sim_state: str | None, gpu_index: int, layout: str, force: bool,
              agent_journal: str | None, unix_socket: str, as_json: bool) -> None:
    """Create/destroy MIG instances so GPU IDX has exactly LAYOUT (instances that processes run on
    or that node agent shares hold are kept; refused, before any change, if LAYOUT has no place
    for them)."""
    label, plan, instances, now = _change_layout(gpu_backend, sim_state, gpu_index, layout, force,
                                                 agent_journal, unix_socket, apply=True)
    if as_json:
        print_json({"gpu": gpu_index, "layout": layout, **plan, "instances": instances})
        return
    _show_plan(gpu_index, layout, label, plan, False, f"applied on GPU {gpu_index}")
    click.echo(f"GPU {gpu_index} now: {now or 'no MIG instances'}")


@mig_group.command("profiles")
@backend_options
@click.option("--gpu", "gpu_index", type=int, required=True, help="GPU index")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def mig_profiles(gpu_backend: str | None, sim_state: str | None, gpu_index: int, as_json: bool) -> None:
    """MIG profiles of a GPU with their allowed placements."""
    with devices_from(gpu_backend, sim_state) as devices:
        try:
            shape = shape_of(devices, gpu_index)
        except LayoutError as exc:
            fail(on_gpu(gpu_index, str(exc)))
    if as_json:
        print_json({"gpu": gpu_index, "profiles": [asdict(p) for p in shape.profiles]})
        return
    print_table(f"MIG profiles of {shape.label}",
                ["id", "name", "compute slices", "memory slices", "memory MiB", "SMs", "max", "starts"],
                [[p.profile_id, p.name, p.slices, p.memory_slices, p.memory_mib, p.sm_count, p.max_instances,
                  ",".join(map(str, p.placements))] for p in shape.profiles])


def _set_mode(gpu_backend: str | None, sim_state: str | None, gpu_index: int, enabled: bool,
              unix_socket: str, agent_journal: str | None = None, force: bool = False) -> None:
    agent = _local_agent(unix_socket, agent_journal)
    if agent is not None:   # under the agent's lock of the GPU, by its rules (SetMigMode)
        from fastshare.v1 import agent_pb2

        gpu, _ = _agent_inventory(agent, gpu_index)
        request = agent_pb2.SetMigModeRequest(gpu_uuid=gpu.uuid, enabled=enabled, force=force)
        # An agent older than SetMigMode's force ignores it, and refuses as before (never enables
        # MIG under a share unasked); its refusal does not name --force.
        hint = ("an agent that asks to release its shares despite --force is older than this CLI and "
                "ignores --force: upgrade it, or release the shares" if force else None)
        pending = _ask(agent.SetMigMode, request, gpu_index, hint).pending
    else:
        with _without_agent(agent_journal), devices_from(gpu_backend, sim_state) as devices:
            held = _held(agent_journal) if enabled else {}
            gpu = devices.gpu(gpu_index)
            if enabled and (reason := refuse_enable_under_share(gpu, held, force)):
                fail(reason)
            if enabled and not gpu.mig_pending and gpu.uuid in held:   # forced: the agent must know
                _note_forced_enable(agent_journal, [gpu.uuid])
            pending = devices.set_mig_mode(gpu_index, enabled)
    state = "enabled" if enabled else "disabled"
    if pending:
        click.echo(f"GPU {gpu_index}: MIG {state} on next GPU reset (pending; reset the GPU or reboot)")
    else:
        click.echo(f"GPU {gpu_index}: MIG {state}")


@mig_group.command("enable")
@backend_options
@click.option("--gpu", "gpu_index", type=int, required=True, help="GPU index")
@click.option("--force", is_flag=True,
              help="enable MIG although a fastshare share holds the GPU whole (the share loses the GPU: the "
                   "node agent drops it, reported lost with that cause, at once or at its next start); "
                   "NVML still refuses while processes run on the GPU")
@_journal_option
@_socket_option
def mig_enable(gpu_backend: str | None, sim_state: str | None, gpu_index: int, force: bool,
               agent_journal: str | None, unix_socket: str) -> None:
    """Enable MIG mode (Ampere: pending until the GPU is reset); refused while a node agent share
    holds the GPU whole."""
    _set_mode(gpu_backend, sim_state, gpu_index, True, unix_socket, agent_journal, force)


@mig_group.command("disable")
@backend_options
@click.option("--gpu", "gpu_index", type=int, required=True, help="GPU index")
@_journal_option
@_socket_option
def mig_disable(gpu_backend: str | None, sim_state: str | None, gpu_index: int, agent_journal: str | None,
                unix_socket: str) -> None:
    """Disable MIG mode (refused while MIG instances or processes exist)."""
    _set_mode(gpu_backend, sim_state, gpu_index, False, unix_socket, agent_journal)


COMMANDS = [mig_group]


@mig_group.command("config")
@backend_options
@click.option("--file", "config_file", type=click.File("r"), required=True,
              help="mig-parted style YAML (version: v1, mig-configs: ...)")
@click.option("--select", "name", required=True, help="name of the config under mig-configs")
@click.option("--apply", "do_apply", is_flag=True, help="carry the plan out (default: only show it)")
@click.option("--force", is_flag=True,
              help="also destroy MIG instances that fastshare shares hold, and enable MIG on a GPU a share "
                   "holds whole (the shares lose them); an instance with running processes is never "
                   "destroyed")
@_journal_option
@click.option("--unix-socket", default=NodeConfig.unix_socket, envvar="FASTSHARE_NODE_UNIX_SOCKET",
              show_default=True,
              help="the node agent's socket: while an agent answers there, the changes are its calls "
                   "(SetMigMode, ApplyMigLayout, each GPU checked by PlanMigLayout first) under its lock of "
                   "the GPU, so a share it is preparing counts too, and the shares it holds count as in use "
                   "(--agent-journal is then not used, nor --gpu-backend: the GPUs are read from its "
                   "inventory); with no agent there, the change is made directly, holding the agent's state "
                   "directory")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def mig_config(gpu_backend: str | None, sim_state: str | None, config_file, name: str, do_apply: bool,
               force: bool, agent_journal: str | None, unix_socket: str, as_json: bool) -> None:
    """Make the host's GPUs match a named mig-parted config (plan, or --apply)."""
    from fastshare.device.mig_parted import (
        ConfigError,
        apply_host_via_agent,
        check_host_via_agent,
        lost_left_out,
        parse_config,
        plan_host,
        resolve,
    )
    from fastshare.node.local_agent import LocalAgentError, apply_directly, held_by_agent
    from fastshare.v1 import agent_pb2

    try:
        text = config_file.read()
    except UnicodeDecodeError as exc:
        fail(f"{config_file.name}: not a text file: {exc}")
    agent = _local_agent(unix_socket, agent_journal)
    with _without_agent(agent_journal) if do_apply and agent is None else contextlib.nullcontext():
        if agent is None:
            held = _held(agent_journal)
        else:
            held = held_by_agent(_ask(agent.GetInventory, agent_pb2.GetInventoryRequest(), None))
        with _devices_of(agent, gpu_backend, sim_state) as devices:
            try:
                configs = parse_config(text)
                gpus = devices.gpus()
                chosen = resolve(configs, name, gpus)
                skipped = lost_left_out(configs, name, gpus, chosen)   # lost, under `devices: all`
                plans = plan_host(devices, chosen, force=force, held=held)
                if agent is None:
                    results = (apply_directly(devices, plans, agent_journal) if do_apply else
                               [p.to_dict() for p in plans])
                elif do_apply:
                    results = apply_host_via_agent(agent, devices, plans)
                else:
                    check_host_via_agent(agent, devices, plans)
                    results = [p.to_dict() for p in plans]
            except ConfigError as exc:
                fail(f"{config_file.name}: {exc}")
            except LocalAgentError as exc:   # the journal cannot take the note of a forced enable
                fail(str(exc), exc.hint)
    for left_out in skipped:
        click.echo(f"Warning: {left_out['reason']}", err=True)
    if as_json:
        print_json({"config": name, "applied": do_apply, "changed": any(p.changed for p in plans),
                    "gpus": results, "skipped": skipped})
        return
    rows = []
    for r in results:
        what = [s["description"] for s in r["steps"]] or ["(no instance changes)"]
        if r["mode_change"]:
            what.insert(0, f"{'enable' if r['mig_enabled'] else 'disable'} MIG mode")
        if r["reset_required"]:
            what.append("GPU reset required for the MIG mode change"
                        + ("; run again after it to create the instances" if r["mig_enabled"] else ""))
        rows.append([r["gpu"], r["layout"] or ("MIG off" if not r["mig_enabled"] else "-"),
                     "yes" if r["changed"] else "no", "\n".join(what)])
    print_table(f"config {name!r} ({'applied' if do_apply else 'plan'})",
                ["gpu", "layout", "changed", "steps"], rows)
