"""`fastshare gpu`: what GPUs this host has (real NVML or a simulated machine)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import click

from fastshare.cli._output import fail, print_json, print_table
from fastshare.device import DeviceError, Devices, open_devices
from fastshare.device.factory import BACKEND_ENV, BACKENDS, SIM_STATE_ENV


def backend_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--gpu-backend / --sim-state, also read from FASTSHARE_GPU_BACKEND / FASTSHARE_SIM_STATE."""
    func = click.option("--sim-state", type=click.Path(dir_okay=False), envvar=SIM_STATE_ENV,
                        help=f"simulated machine file for --gpu-backend sim [env {SIM_STATE_ENV}]")(func)
    return click.option("--gpu-backend", type=click.Choice(BACKENDS), envvar=BACKEND_ENV,
                        help=f"real NVML or the simulated machine [env {BACKEND_ENV}]")(func)


@contextlib.contextmanager
def devices_from(gpu_backend: str | None, sim_state: str | None) -> Iterator[Devices]:
    """Open the backend or exit with the reason; device errors become clean CLI errors."""
    try:
        devices = open_devices(gpu_backend, sim_state)
    except DeviceError as exc:
        fail(str(exc), "choose a backend: --gpu-backend nvml, or --gpu-backend sim --sim-state PATH")
    try:
        with devices:
            yield devices
    except DeviceError as exc:
        fail(str(exc))


@click.group("gpu")
def gpu_group() -> None:
    """GPU inventory (real or simulated)."""


@gpu_group.command("list")
@backend_options
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def gpu_list(gpu_backend: str | None, sim_state: str | None, as_json: bool) -> None:
    """GPUs with their MIG mode and MIG devices."""
    with devices_from(gpu_backend, sim_state) as devices:
        driver = devices.driver_version()
        gpus = devices.gpus()
    if as_json:
        print_json({"driver_version": driver, "gpus": [asdict(g) for g in gpus]})
        return
    mig = {True: "on", False: "off"}
    print_table(f"GPUs (driver {driver})",
                ["idx", "name", "memory MiB", "SMs", "MIG", "compute mode", "procs", "UUID"],
                [[g.index, f"LOST (NVML_ERROR_{g.lost}): reset the GPU or reboot" if g.lost else g.name,
                  g.memory_mib, g.sm_count,
                  (mig[g.mig_current] + (f" (pending {mig[g.mig_pending]})" if g.mig_pending != g.mig_current
                                         else "")) if g.mig_capable else "n/a",
                  g.compute_mode, g.processes, g.uuid] for g in gpus])
    rows = [[i.gpu_index, i.profile_name, i.profile_id, f"{i.start}..{i.start + i.size - 1}", i.sm_count,
             i.memory_mib, i.processes, i.uuid or "(no compute instance)"]
            for g in gpus for i in g.mig_instances]
    if rows:
        print_table("MIG devices", ["gpu", "profile", "id", "slices", "SMs", "memory MiB", "procs", "UUID"],
                    rows)


@gpu_group.command("topology")
@backend_options
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def gpu_topology(gpu_backend: str | None, sim_state: str | None, as_json: bool) -> None:
    """Pairwise link between GPUs (NVLink, or the NVML PCIe topology level)."""
    with devices_from(gpu_backend, sim_state) as devices:
        topo = devices.topology()
    pairs = sorted(topo.levels)
    if as_json:
        print_json({"pairs": [{"a": a, "b": b, "level": topo.levels[(a, b)], "nvlink": (a, b) in topo.nvlink}
                              for a, b in pairs]})
        return
    names = {0: "internal", 10: "single PCIe switch", 20: "multiple PCIe switches", 30: "host bridge",
             40: "NUMA node", 50: "system (across CPUs)"}
    def link(a: int, b: int) -> object:
        return "NVLink" if (a, b) in topo.nvlink else names.get(topo.levels[(a, b)], topo.levels[(a, b)])

    print_table("GPU topology", ["a", "b", "link"], [[a, b, link(a, b)] for a, b in pairs])


COMMANDS = [gpu_group]
