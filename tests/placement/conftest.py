"""Small clusters for engine tests; MIG profile data comes from the device catalog."""

from __future__ import annotations

import pytest

from fastshare.device.api import MigProfile
from fastshare.placement import GpuView, NodeView

try:
    from fastshare.device.catalog import get_model
except ImportError:  # the device catalog lands separately; until then the two models tests use
    get_model = None


def _fallback(key: str) -> tuple[str, int, int, bool, tuple[MigProfile, ...]]:
    if key == "T4":
        return key, 15360, 40, False, ()
    spec = [(19, "1g.5gb", 1, 1, 4864, 14, 7, (0, 1, 2, 3, 4, 5, 6)),
            (20, "1g.5gb+me", 1, 1, 4864, 14, 1, (0, 1, 2, 3, 4, 5, 6)),
            (15, "1g.10gb", 1, 2, 9856, 14, 4, (0, 2, 4, 6)), (14, "2g.10gb", 2, 2, 9856, 28, 3, (0, 2, 4)),
            (9, "3g.20gb", 3, 4, 19968, 42, 2, (0, 4)), (5, "4g.20gb", 4, 4, 19968, 56, 1, (0,)),
            (0, "7g.40gb", 7, 8, 40192, 98, 1, (0,))]
    return key, 40960, 108, True, tuple(MigProfile(*s) for s in spec)


def gpu(index: int, key: str = "A100-SXM4-40GB", mig_enabled: bool = False) -> GpuView:
    if get_model is None:
        name, mem, sms, capable, profiles = _fallback(key)
    else:
        m = get_model(key)
        name, mem, sms, capable, profiles = m.key, m.memory_mib, m.sm_count, m.mig_capable, m.profiles
    return GpuView(index, name, mem, sms, capable, mig_enabled, profiles)


def node(name: str, n_gpus: int = 2, key: str = "A100-SXM4-40GB", cpu: int = 64000, mem: int = 262144,
         labels: dict | None = None, links: dict | None = None) -> NodeView:
    return NodeView(name, cpu, mem, tuple(gpu(i, key) for i in range(n_gpus)), labels or {}, links or {})


@pytest.fixture
def cluster() -> list[NodeView]:
    return [node("node-1"), node("node-2", key="T4"), node("node-3", n_gpus=4)]
