"""`fastshare mig`: plan and apply MIG layouts with explicit placements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import click

from fastshare.cli._output import fail, print_json, print_table
from fastshare.cli.gpu import backend_options, devices_from
from fastshare.device.api import Devices
from fastshare.device.mig_layout import (
    GpuShape,
    LayoutError,
    Plan,
    apply_plan,
    format_layout,
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
        click.option("--json", "as_json", is_flag=True, help="machine-readable output"),
    ]):
        command = option(command)
    return command


def _planned(devices: Devices, gpu_index: int, layout: str, force: bool,
             held: dict[str, list[str]]) -> tuple[GpuShape, Plan]:
    try:
        return plan_for_gpu(devices, gpu_index, layout, force=force, held=held)
    except LayoutError as exc:
        fail(f"GPU {gpu_index}: {exc}")


@mig_group.command("plan")
@_layout_options
def mig_plan(gpu_backend: str | None, sim_state: str | None, gpu_index: int, layout: str, force: bool,
             agent_journal: str | None, as_json: bool) -> None:
    """Show the steps that would turn the current layout into LAYOUT (changes nothing)."""
    held = _held(agent_journal)
    with devices_from(gpu_backend, sim_state) as devices:
        shape, plan = _planned(devices, gpu_index, layout, force, held)
    _show_plan(gpu_index, layout, shape.label, plan.to_dict(), as_json, f"plan for GPU {gpu_index}")


@mig_group.command("apply")
@_layout_options
def mig_apply(gpu_backend: str | None, sim_state: str | None, gpu_index: int, layout: str, force: bool,
              agent_journal: str | None, as_json: bool) -> None:
    """Create/destroy MIG instances so GPU IDX has exactly LAYOUT (instances that processes run on
    or that node agent shares hold are kept; refused, before any change, if LAYOUT has no place
    for them)."""
    held = _held(agent_journal)
    with devices_from(gpu_backend, sim_state) as devices:
        shape, plan = _planned(devices, gpu_index, layout, force, held)
        instances = apply_plan(devices, gpu_index, plan)
    if as_json:
        print_json({"gpu": gpu_index, "layout": layout, **plan.to_dict(),
                    "instances": [asdict(i) for i in instances]})
        return
    _show_plan(gpu_index, layout, shape.label, plan.to_dict(), False, f"applied on GPU {gpu_index}")
    click.echo(f"GPU {gpu_index} now: {format_layout(instances, shape) or 'no MIG instances'}")


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
            fail(f"GPU {gpu_index}: {exc}")
    if as_json:
        print_json({"gpu": gpu_index, "profiles": [asdict(p) for p in shape.profiles]})
        return
    print_table(f"MIG profiles of {shape.label}",
                ["id", "name", "compute slices", "memory slices", "memory MiB", "SMs", "max", "starts"],
                [[p.profile_id, p.name, p.slices, p.memory_slices, p.memory_mib, p.sm_count, p.max_instances,
                  ",".join(map(str, p.placements))] for p in shape.profiles])


def _set_mode(gpu_backend: str | None, sim_state: str | None, gpu_index: int, enabled: bool,
              held: dict[str, list[str]] | None = None, force: bool = False) -> None:
    with devices_from(gpu_backend, sim_state) as devices:
        if enabled and (reason := refuse_enable_under_share(devices.gpu(gpu_index), held or {}, force)):
            fail(reason)
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
              help="enable MIG although a fastshare share holds the GPU whole (the share loses the GPU)")
@_journal_option
def mig_enable(gpu_backend: str | None, sim_state: str | None, gpu_index: int, force: bool,
               agent_journal: str | None) -> None:
    """Enable MIG mode (Ampere: pending until the GPU is reset); refused while a node agent share
    holds the GPU whole."""
    _set_mode(gpu_backend, sim_state, gpu_index, True, _held(agent_journal), force)


@mig_group.command("disable")
@backend_options
@click.option("--gpu", "gpu_index", type=int, required=True, help="GPU index")
def mig_disable(gpu_backend: str | None, sim_state: str | None, gpu_index: int) -> None:
    """Disable MIG mode (refused while MIG instances or processes exist)."""
    _set_mode(gpu_backend, sim_state, gpu_index, False)


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
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def mig_config(gpu_backend: str | None, sim_state: str | None, config_file, name: str, do_apply: bool,
               force: bool, agent_journal: str | None, as_json: bool) -> None:
    """Make the host's GPUs match a named mig-parted config (plan, or --apply)."""
    from fastshare.device.mig_parted import ConfigError, apply_host, parse_config, plan_host, resolve

    held = _held(agent_journal)
    with devices_from(gpu_backend, sim_state) as devices:
        try:
            text = config_file.read()
        except UnicodeDecodeError as exc:
            fail(f"{config_file.name}: not a text file: {exc}")
        try:
            configs = parse_config(text)
            plans = plan_host(devices, resolve(configs, name, devices.gpus()), force=force, held=held)
        except ConfigError as exc:
            fail(f"{config_file.name}: {exc}")
        results = apply_host(devices, plans) if do_apply else [p.to_dict() for p in plans]
    if as_json:
        print_json({"config": name, "applied": do_apply, "changed": any(p.changed for p in plans),
                    "gpus": results})
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
