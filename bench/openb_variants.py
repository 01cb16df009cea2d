#!/usr/bin/env python3
"""Write openb trace variants beyond the published ones, to test the default policy on
workloads it was not developed on ("other traces exist that you have not seen").

    python bench/openb_variants.py /tmp/variants gpuspec50 gpuspec60 gpushare60 multigpu70
    fastshare bench placement --data /tmp/variants --traces gpuspec50,gpuspec60 \
        --policies fgd,fastshare --seeds 42-51 --no-speed

Each variant starts from ``openb_pod_list_default.csv`` and changes one property the way the
published variants do (read off them; the artifact's generator is not public):

- ``gpushareNN``: the CPU-only tasks as in default; the GPU tasks redrawn (with replacement)
  from default's sharing and non-sharing GPU tasks so that sharing tasks ask NN % of the
  GPU milli.
- ``multigpuNN``: default plus random copies of its multi-GPU tasks until they ask NN % of
  the GPU milli.
- ``gpuspecNN``: default with NN % of its GPU tasks given a model list, drawn from the lists
  that tasks with the same GPU count carry in the published ``gpuspec25``.

The node list is copied beside them. ``--seed`` fixes the draw (default 7).
"""

from __future__ import annotations

import argparse
import csv
import random
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fastshare.sim.experiment import default_data_dir

Row = dict[str, str]


def _milli(row: Row) -> int:
    gpus = int(row["num_gpu"])
    return gpus * 1000 if gpus > 1 else gpus * int(row["gpu_milli"])


def _sharing(row: Row) -> bool:
    return int(row["num_gpu"]) == 1 and int(row["gpu_milli"]) < 1000


def gpushare(base: list[Row], share: float, rng: random.Random) -> list[Row]:
    cpu_only = [r for r in base if int(r["num_gpu"]) == 0]
    gpu = [r for r in base if int(r["num_gpu"]) > 0]
    sharing = [r for r in gpu if _sharing(r)]
    other = [r for r in gpu if not _sharing(r)]
    mean_sharing = sum(map(_milli, sharing)) / len(sharing)
    mean_other = sum(map(_milli, other)) / len(other)
    n_sharing = round(len(gpu) * share * mean_other / (share * mean_other + (1 - share) * mean_sharing))
    return (cpu_only + [rng.choice(sharing) for _ in range(n_sharing)]
            + [rng.choice(other) for _ in range(len(gpu) - n_sharing)])


def multigpu(base: list[Row], share: float, rng: random.Random) -> list[Row]:
    multi = [r for r in base if int(r["num_gpu"]) > 1]
    rows = list(base)
    total = sum(map(_milli, base))
    ask = sum(map(_milli, multi))
    while ask < share * total:
        copy = rng.choice(multi)
        rows.append(copy)
        ask += _milli(copy)
        total += _milli(copy)
    return rows


def gpuspec(base: list[Row], share: float, rng: random.Random, lists: list[Row]) -> list[Row]:
    rows = [dict(r) for r in base]
    gpu = [r for r in rows if int(r["num_gpu"]) > 0]
    for row in rng.sample(gpu, round(share * len(gpu))):
        same = [s for s in lists if s["num_gpu"] == row["num_gpu"]] or lists
        row["gpu_spec"] = rng.choice(same)["gpu_spec"]
    return rows


def _read(path: Path) -> list[Row]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_variant(data: Path, out: Path, name: str, seed: int) -> Path:
    m = re.fullmatch(r"(gpushare|multigpu|gpuspec)(\d+)", name)
    if not m or not 0 < int(m[2]) < 100:
        raise SystemExit(f"variant {name!r}: must be gpushareNN, multigpuNN or gpuspecNN with NN in 1..99")
    kind, share = m[1], int(m[2]) / 100
    base = _read(data / "openb_pod_list_default.csv")
    rng = random.Random(seed)
    if kind == "gpushare":
        rows = gpushare(base, share, rng)
    elif kind == "multigpu":
        rows = multigpu(base, share, rng)
    else:
        lists = [r for r in _read(data / "openb_pod_list_gpuspec25.csv") if r["gpu_spec"]]
        rows = gpuspec(base, share, rng, lists)
    path = out / f"openb_pod_list_{name}.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(base[0]))
        w.writeheader()
        for i, row in enumerate(rows):
            w.writerow({**row, "name": f"openb-pod-{i:04d}"})
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory to write the variants and the node list to")
    ap.add_argument("variants", nargs="+", help="e.g. gpuspec50 gpushare60 multigpu70")
    ap.add_argument("--data", type=Path, default=None, help="openb directory (default ../shared/data/openb)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    data = args.data or default_data_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copy(data / "openb_node_list_gpu_node.csv", args.out)
    for name in args.variants:
        print(write_variant(data, args.out, name, args.seed))


if __name__ == "__main__":
    main()
