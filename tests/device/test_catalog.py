"""The catalog matches GPU-FACTS.md and its lookup helpers answer what the engine asks."""

import pytest

from fastshare.device import catalog
from fastshare.device.catalog import CatalogError, choose_profile, get_model, smallest_profile


def test_a100_40gb_table_matches_gpu_facts():
    m = get_model("A100-SXM4-40GB")
    assert (m.name, m.memory_mib, m.sm_count, m.memory_slices, m.compute_slices) == (
        "NVIDIA A100-SXM4-40GB", 40960, 108, 8, 7)
    rows = {p.name: (p.profile_id, p.memory_slices, p.placements, p.slices, p.max_instances, p.sm_count)
            for p in m.profiles}
    assert rows == {
        "1g.5gb": (19, 1, (0, 1, 2, 3, 4, 5, 6), 1, 7, 14),
        "1g.5gb+me": (20, 1, (0, 1, 2, 3, 4, 5, 6), 1, 1, 14),
        "1g.10gb": (15, 2, (0, 2, 4, 6), 1, 4, 14),
        "2g.10gb": (14, 2, (0, 2, 4), 2, 3, 28),
        "3g.20gb": (9, 4, (0, 4), 3, 2, 42),
        "4g.20gb": (5, 4, (0,), 4, 1, 56),
        "7g.40gb": (0, 8, (0,), 7, 1, 98),
    }
    assert m.profile("3g.20gb").memory_mib == 19968
    assert m.mig_pending_until_reset


def test_a30_table_has_the_2g_12gb_plus_me_of_current_drivers():
    """The MIG user guide's A30 table and `nvidia-smi mig -lgip`/-lgipp on an A30 (R535) list a
    2g.12gb+me (R525 and later): id 6, NVML index 2_SLICE_REV1, 28 SMs, the 2g.12gb's memory
    slices, one instance at most, at 0 or 2. Sized like a 2g.12gb, it is never the cheapest
    profile for a request that does not name it."""
    m = get_model("A30")
    rows = {p.name: (p.profile_id, p.memory_slices, p.placements, p.slices, p.max_instances, p.sm_count)
            for p in m.profiles}
    assert rows == {
        "1g.6gb": (14, 1, (0, 1, 2, 3), 1, 4, 14),
        "1g.6gb+me": (21, 1, (0, 1, 2, 3), 1, 1, 14),
        "2g.12gb": (5, 2, (0, 2), 2, 2, 28),
        "2g.12gb+me": (6, 2, (0, 2), 2, 1, 28),
        "4g.24gb": (0, 4, (0,), 4, 1, 56),
    }
    assert m.profile("2g.12gb+me").memory_mib == m.profile("2g.12gb").memory_mib
    assert m.profile_by_enum(catalog.ENUM_2_SLICE_REV1).profile_id == 6
    assert m.engines(6) == catalog.MigEngines(copy=2, decoders=2, jpeg=1, ofa=1)
    for other in ("A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H100-PCIE-80GB", "H200-SXM5-141GB"):
        assert get_model(other).profile_by_enum(catalog.ENUM_2_SLICE_REV1) is None
    assert smallest_profile(m, sm_count=28).name == "2g.12gb"
    assert smallest_profile(m, sm_count=15, memory_mib=7000).name == "2g.12gb"


def test_lookup_by_alias_nvml_name_and_profile_id():
    assert get_model("NVIDIA H100 80GB HBM3").key == "H100-SXM5-80GB"
    assert get_model("h200").key == "H200-SXM5-141GB"
    assert get_model("Tesla V100-SXM2-16GB").mig_capable is False
    h100 = get_model("H100-SXM5-80GB")
    assert not h100.mig_pending_until_reset
    assert h100.profile(9).name == "3g.40gb" and h100.profile("9").sm_count == 60
    assert h100.profile_by_enum(catalog.ENUM_1_SLICE_REV2).profile_id == 15
    with pytest.raises(CatalogError, match="known"):
        get_model("GTX-480")
    with pytest.raises(CatalogError, match="does not exist on"):
        h100.profile("5g.50gb")


def test_every_mig_model_has_consistent_profiles():
    for m in catalog.MODELS.values():
        if not m.mig_capable:
            assert m.profiles == ()
            continue
        assert {pid for _, pid in m.profile_enum} == {p.profile_id for p in m.profiles}
        for p in m.profiles:
            assert all(s + p.memory_slices <= m.memory_slices for s in p.placements), (m.key, p.name)
            assert p.sm_count <= m.sm_count
            assert 0 < p.memory_mib <= m.memory_mib


def test_smallest_profile_by_sms_percent_and_memory():
    a100 = get_model("A100-SXM4-40GB")
    assert smallest_profile(a100, sm_count=14).name == "1g.5gb"
    assert smallest_profile(a100, sm_count=14, memory_mib=8000).name == "1g.10gb"
    assert smallest_profile(a100, sm_percent=30).name == "3g.20gb"     # 33 SMs
    assert smallest_profile(a100, sm_percent=50, memory_mib=1).name == "4g.20gb"
    assert smallest_profile(a100, sm_percent=100) is None


def test_choose_profile_explains_impossible_requests():
    a100 = get_model("A100-SXM4-40GB")
    with pytest.raises(CatalogError, match=r"largest MIG slice .* 98 of the GPU's 108 SMs"):
        choose_profile(a100, sm_percent=100)
    with pytest.raises(CatalogError, match="60000 MiB"):
        choose_profile(a100, memory_mib=60000)
    with pytest.raises(CatalogError, match="does not support MIG"):
        choose_profile(get_model("L4"), sm_count=1)
    with pytest.raises(CatalogError, match=r"sm_percent must be within 0\.\.100"):
        choose_profile(a100, sm_percent=120)
