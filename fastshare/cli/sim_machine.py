"""`fastshare sim-machine`: make and poke a simulated GPU machine file (tests, demos)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from fastshare.cli._output import fail, print_json, print_table
from fastshare.device import catalog, simnvml
from fastshare.device.factory import SIM_STATE_ENV


def _machine_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse a --state file that is no machine (empty, another program's JSON) up front: the
    commands would fail on it with a traceback, or `show` print it as if it were one."""
    if value is not None:
        try:
            simnvml.check_machine(simnvml.load_machine(value))
        except (ValueError, KeyError) as exc:   # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise click.BadParameter(f"{value} is not a simulated machine file ({exc}); recreate it with "
                                     "`fastshare sim-machine create`", ctx, param) from None
    return value


_state_option = click.option("--state", "state", type=click.Path(exists=True, dir_okay=False),
                             envvar=SIM_STATE_ENV, required=True, callback=_machine_file,
                             help=f"machine file [env {SIM_STATE_ENV}]")


@click.group("sim-machine")
def sim_group() -> None:
    """Simulated GPU machines: a JSON file that the sim backend (simulated NVML) acts on."""


@sim_group.command("create")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--gpus", required=True,
              help=f"comma-separated catalog models, one per GPU (1 to {simnvml.MAX_GPUS}), "
                   "e.g. A100-SXM4-40GB,H100-SXM5-80GB")
@click.option("--mig-enabled", is_flag=True, help="start with MIG mode on for MIG-capable GPUs")
@click.option("--force", is_flag=True, help="replace an existing file")
def sim_create(path: str, gpus: str, mig_enabled: bool, force: bool) -> None:
    """Write a new simulated machine file at PATH."""
    if not path.strip():
        raise click.BadParameter("name the machine file to write", param_hint="PATH")
    parent = next((p for p in Path(path).absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        fail(f"cannot create {path}: {parent} is not a directory")
    models = [m.strip() for m in gpus.split(",") if m.strip()]
    if not 1 <= len(models) <= simnvml.MAX_GPUS:
        raise click.BadParameter(f"{len(models)} GPU models listed; a machine has 1 to {simnvml.MAX_GPUS} "
                                 "GPUs, one model each", param_hint="'--gpus'")
    try:
        state = simnvml.create_machine(path, models, mig_enabled=mig_enabled, overwrite=force)
    except catalog.CatalogError as exc:
        fail(f"--gpus: {exc}")
    except FileExistsError:
        fail(f"{path} already exists", "pass --force to replace it")
    except ValueError as exc:
        fail(str(exc))
    except OSError as exc:   # e.g. no permission to write there
        fail(f"cannot create {path}: {exc.strerror or exc}")
    names = ", ".join(g["model"] for g in state["gpus"])
    click.echo(f"created {path} with {len(state['gpus'])} GPU(s): {names}")
    click.echo(f"use it with: export FASTSHARE_GPU_BACKEND=sim {SIM_STATE_ENV}={os.path.abspath(path)}")


@sim_group.command("models")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def sim_models(as_json: bool) -> None:
    """GPU models a simulated machine can have."""
    models = list(catalog.MODELS.values())
    if as_json:
        print_json([{"key": m.key, "name": m.name, "memory_mib": m.memory_mib, "sm_count": m.sm_count,
                     "mig_capable": m.mig_capable} for m in models])
        return
    print_table("GPU models", ["model", "NVML name", "memory MiB", "SMs", "MIG"],
                [[m.key, m.name, m.memory_mib, m.sm_count, "yes" if m.mig_capable else "no"] for m in models])


@sim_group.command("show")
@_state_option
def sim_show(state: str) -> None:
    """Dump the machine file (JSON)."""
    try:
        print_json(simnvml.load_machine(state))
    except simnvml.NVMLError:
        fail(f"simulated machine file {state} does not exist")


@sim_group.command("add-process")
@_state_option
@click.option("--gpu", "gpu_index", type=int, required=True, help="GPU index")
@click.option("--mig", "mig_uuid", help="MIG device UUID (required when the GPU is in MIG mode)")
@click.option("--memory-mib", type=click.IntRange(min=0), default=256, show_default=True,
              help="GPU memory the process uses")
def sim_add_process(state: str, gpu_index: int, mig_uuid: str | None, memory_mib: int) -> None:
    """Pretend a CUDA process runs on a GPU or MIG device; prints its pid."""
    try:
        gpus = simnvml.load_machine(state)["gpus"]
        if mig_uuid is None and 0 <= gpu_index < len(gpus) and gpus[gpu_index]["mig_current"]:
            fail(f"add-process: GPU {gpu_index} is in MIG mode: a process runs on one of its MIG devices; "
                 "name it with --mig", "`fastshare gpu list` shows their UUIDs")
        click.echo(simnvml.add_process(state, gpu_index, mig_uuid=mig_uuid, used_mib=memory_mib))
    except (ValueError, simnvml.NVMLError) as exc:
        fail(f"add-process: {exc}")


@sim_group.command("remove-process")
@_state_option
@click.argument("pid", type=int)
def sim_remove_process(state: str, pid: int) -> None:
    """End a simulated process."""
    try:
        simnvml.remove_process(state, pid)
    except (ValueError, simnvml.NVMLError) as exc:
        fail(f"remove-process: {exc}")


@sim_group.command("reset")
@_state_option
@click.option("--gpu", "gpu_index", type=int, required=True, help="GPU index")
def sim_reset(state: str, gpu_index: int) -> None:
    """Reset one GPU (applies a pending MIG mode; refused while processes run)."""
    try:
        simnvml.reset_gpu(state, gpu_index)
    except simnvml.NVMLError_InUse:
        fail(f"GPU {gpu_index} has running processes: NVML_ERROR_IN_USE")
    except (ValueError, simnvml.NVMLError) as exc:
        fail(f"reset: {exc}")


@sim_group.command("reboot")
@_state_option
def sim_reboot(state: str) -> None:
    """Reboot the machine: processes and MIG instances vanish, MIG mode stays."""
    try:
        simnvml.reboot(state)
    except simnvml.NVMLError as exc:
        fail(f"reboot: {exc}")


@sim_group.command("remove-gpu")
@_state_option
@click.option("--gpu", "gpu_index", type=int, required=True, help="GPU index")
def sim_remove_gpu(state: str, gpu_index: int) -> None:
    """Take a GPU out (or let it fall off the bus) and reboot: the GPUs after it get new indexes."""
    try:
        gone = simnvml.remove_gpu(state, gpu_index)
    except (ValueError, simnvml.NVMLError) as exc:
        fail(f"remove-gpu: {exc}")
    left = simnvml.load_machine(state)["gpus"]
    click.echo(f"removed GPU {gpu_index} ({gone}); the machine rebooted with {len(left)} GPU(s): "
               + ", ".join(f"{g['index']}={g['uuid']}" for g in left))


@sim_group.command("lose-gpu")
@_state_option
@click.option("--gpu", "gpu_index", type=int, required=True, help="GPU index")
@click.option("--handle-ok", is_flag=True,
              help="its handle can still be acquired; only calls on it fail (default: that fails too)")
def sim_lose_gpu(state: str, gpu_index: int, handle_ok: bool) -> None:
    """Let a GPU fall off the bus (Xid 79): it stays listed, calls on it raise NVML_ERROR_GPU_IS_LOST
    until a `reset` or `reboot`."""
    try:
        lost = simnvml.lose_gpu(state, gpu_index, handle=not handle_ok)
    except (ValueError, simnvml.NVMLError) as exc:
        fail(f"lose-gpu: {exc}")
    click.echo(f"GPU {gpu_index} ({lost}) is lost: NVML calls on it raise NVML_ERROR_GPU_IS_LOST")


COMMANDS = [sim_group]
