"""GPU device layer: one interface over NVML (real or simulated).

``open_devices(backend, sim_state)`` returns a ``Devices`` (see ``api``); ``catalog`` knows
the GPU models, ``mig_layout`` plans MIG layouts, ``simnvml`` stands in for pynvml.
"""

from fastshare.device.api import DeviceError, Devices, GpuInfo, MigInstance, MigProfile, Topology
from fastshare.device.factory import open_devices

__all__ = ["DeviceError", "Devices", "GpuInfo", "MigInstance", "MigProfile", "Topology", "open_devices"]
