"""Simulated machines for the device-layer tests (the only stand-in: the simulated NVML)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fastshare.device import open_devices, simnvml
from fastshare.device.api import Devices


@pytest.fixture
def machine(tmp_path: Path) -> Path:
    """A100-40GB (MIG on), H100 (MIG on), A100-40GB (MIG off), L4."""
    path = tmp_path / "machine.json"
    simnvml.create_machine(path, ["A100-SXM4-40GB", "H100-SXM5-80GB", "A100-SXM4-40GB", "L4"])
    nvml = simnvml.SimNvml(path)
    nvml.nvmlInit()
    for index in (0, 1):
        nvml.nvmlDeviceSetMigMode(nvml.nvmlDeviceGetHandleByIndex(index), 1)
    nvml.nvmlShutdown()
    simnvml.reset_gpu(path, 0)   # Ampere: MIG mode applies at reset
    return path


@pytest.fixture
def devices(machine: Path) -> Iterator[Devices]:
    with open_devices("sim", machine) as d:
        yield d
