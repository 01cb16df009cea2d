"""GPU device layer: one interface over NVML (real or simulated)."""
