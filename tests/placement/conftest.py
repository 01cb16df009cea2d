"""Small clusters for engine tests; MIG profile data comes from the device catalog."""

from __future__ import annotations

import pytest

from fastshare.device.catalog import get_model
from fastshare.placement import GpuView, NodeView


def gpu(index: int, key: str = "A100-SXM4-40GB", mig_enabled: bool = False) -> GpuView:
    m = get_model(key)
    return GpuView(index, m.key, m.memory_mib, m.sm_count, m.mig_capable, mig_enabled, m.profiles)


def node(name: str, n_gpus: int = 2, key: str = "A100-SXM4-40GB", cpu: int = 64000, mem: int = 262144,
         labels: dict | None = None, links: dict | None = None) -> NodeView:
    return NodeView(name, cpu, mem, tuple(gpu(i, key) for i in range(n_gpus)), labels or {}, links or {})


@pytest.fixture
def cluster() -> list[NodeView]:
    return [node("node-1"), node("node-2", key="T4"), node("node-3", n_gpus=4)]
