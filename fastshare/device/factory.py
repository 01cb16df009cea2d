"""Choosing the GPU backend: real NVML or the simulated machine, always explicitly.

There is deliberately no automatic fallback: a host whose NVML fails must say so, not
silently pretend to have simulated GPUs.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastshare.device.api import DeviceError, Devices

BACKEND_ENV = "FASTSHARE_GPU_BACKEND"
SIM_STATE_ENV = "FASTSHARE_SIM_STATE"
BACKENDS = ("nvml", "sim")


def open_devices(backend: str | None = None, sim_state: str | os.PathLike[str] | None = None) -> Devices:
    """Open the configured backend (arguments first, then FASTSHARE_GPU_BACKEND /
    FASTSHARE_SIM_STATE). Raises DeviceError saying what is missing or what failed."""
    from fastshare.device.nvml_backend import NvmlDevices

    backend = backend or os.environ.get(BACKEND_ENV)
    if not backend:
        raise DeviceError(
            "no GPU backend configured: pass --gpu-backend nvml|sim or set "
            f"{BACKEND_ENV}=nvml|sim (sim also needs {SIM_STATE_ENV}=PATH or --sim-state PATH)",
            "NOT_CONFIGURED")
    if backend not in BACKENDS:
        raise DeviceError(f"GPU backend {backend!r} is not one of {', '.join(BACKENDS)}",
                          "INVALID_ARGUMENT")
    if backend == "sim":
        from fastshare.device import simnvml
        from fastshare.device.simnvml import SimNvml

        path = sim_state or os.environ.get(SIM_STATE_ENV)
        if not path:
            raise DeviceError(
                f"the sim backend needs a machine file: --sim-state PATH or {SIM_STATE_ENV}=PATH "
                "(create one with `fastshare sim-machine create PATH --gpus A100-SXM4-40GB`)",
                "NOT_CONFIGURED")
        if not Path(path).is_file():
            what = "is not a file" if Path(path).exists() else "does not exist"
            raise DeviceError(
                f"simulated machine file {path} {what}; create it with "
                f"`fastshare sim-machine create {path} --gpus A100-SXM4-40GB`", "NOT_FOUND")
        try:
            simnvml.check_machine(simnvml.load_machine(path))
        except (ValueError, KeyError) as exc:
            raise DeviceError(f"{path} is not a simulated machine file ({exc.__class__.__name__}: {exc}); "
                              "recreate it with `fastshare sim-machine create`", "CORRUPTED") from exc
        return NvmlDevices(SimNvml(path), label=f"simulated NVML ({path})")
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a hard dependency
        raise DeviceError(f"cannot import pynvml (nvidia-ml-py): {exc}", "LIBRARY_NOT_FOUND") from exc
    try:
        return NvmlDevices(pynvml, label="NVML")
    except DeviceError as exc:
        raise DeviceError(
            f"{exc} (is the NVIDIA driver installed and libnvidia-ml.so.1 loadable? "
            "fastshare does not fall back to simulated GPUs; use --gpu-backend sim for that)",
            exc.code) from exc
