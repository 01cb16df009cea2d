"""bench/openb_variants.py: each variant has the property its name promises, and bad names
are refused before anything is written."""

from __future__ import annotations

import csv
import importlib.util
import random
from pathlib import Path

import pytest

from fastshare.sim.experiment import default_data_dir

_spec = importlib.util.spec_from_file_location(
    "openb_variants", Path(__file__).resolve().parents[2] / "bench" / "openb_variants.py")
openb_variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(openb_variants)

DATA = default_data_dir()
needs_data = pytest.mark.skipif(DATA is None or not (DATA / "openb_pod_list_gpuspec25.csv").is_file(),
                                reason="openb data (../shared/data/openb) not present")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _gpu_milli(rows, keep) -> int:
    return sum(openb_variants._milli(r) for r in rows if keep(r))


@needs_data
def test_each_variant_has_the_share_its_name_gives(tmp_path):
    default = _rows(DATA / "openb_pod_list_default.csv")
    for name in ("gpushare60", "multigpu40", "gpuspec50"):
        openb_variants.write_variant(DATA, tmp_path, name, seed=7)
    share = _rows(tmp_path / "openb_pod_list_gpushare60.csv")
    assert len(share) == len(default)
    sharing = _gpu_milli(share, openb_variants._sharing) / _gpu_milli(share, lambda r: True)
    assert sharing == pytest.approx(0.60, abs=0.03)
    multi = _rows(tmp_path / "openb_pod_list_multigpu40.csv")
    assert multi[:len(default)] == [{**r, "name": f"openb-pod-{i:04d}"} for i, r in enumerate(default)]
    multi_share = _gpu_milli(multi, lambda r: int(r["num_gpu"]) > 1) / _gpu_milli(multi, lambda r: True)
    assert 0.40 <= multi_share < 0.41
    spec = _rows(tmp_path / "openb_pod_list_gpuspec50.csv")
    gpu = [r for r in spec if int(r["num_gpu"]) > 0]
    assert sum(1 for r in gpu if r["gpu_spec"]) == round(0.5 * len(gpu))
    assert not any(r["gpu_spec"] for r in spec if int(r["num_gpu"]) == 0)


@needs_data
def test_the_same_seed_writes_the_same_variant(tmp_path):
    a = openb_variants.write_variant(DATA, tmp_path, "gpuspec20", seed=3).read_bytes()
    assert openb_variants.write_variant(DATA, tmp_path, "gpuspec20", seed=3).read_bytes() == a


def test_gpuspec_lists_come_from_tasks_with_the_same_gpu_count():
    base = [{"num_gpu": "1", "gpu_milli": "500", "gpu_spec": ""},
            {"num_gpu": "8", "gpu_milli": "1000", "gpu_spec": ""}]
    lists = [{"num_gpu": "1", "gpu_spec": "T4"}, {"num_gpu": "8", "gpu_spec": "G2"}]
    rows = openb_variants.gpuspec(base, 0.99, random.Random(1), lists)
    assert [r["gpu_spec"] for r in rows] == ["T4", "G2"]


@pytest.mark.parametrize("name", ["gpuspec0", "gpuspec100", "cpu50", "gpushare"])
def test_a_bad_variant_name_is_refused_and_writes_nothing(tmp_path, name):
    with pytest.raises(SystemExit, match=r"NN in 1\.\.99"):
        openb_variants.write_variant(DATA or tmp_path, tmp_path, name, seed=7)
    assert list(tmp_path.iterdir()) == []
