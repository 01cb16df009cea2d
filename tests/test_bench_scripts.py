"""The bench/ scripts that BENCHMARKS.md and the README tell a user to run answer --help, and
refuse a bad argument, before they start anything."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_placement_report_help_and_a_missing_file():
    # `--help` was opened as a JSON file: a FileNotFoundError traceback
    out = subprocess.run([sys.executable, str(BENCH / "placement_report.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: placement_report.py" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, str(BENCH / "placement_report.py"), "nosuch.json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "nosuch.json" in out.stderr and "Traceback" not in out.stderr


def test_k8s_status_size_help_starts_no_control_plane(capsys):
    # `--help` was ignored: it started a kube-apiserver and etcd (or built them first)
    spec = importlib.util.spec_from_file_location("k8s_status_size", BENCH / "k8s_status_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert "Why the k8s state moved out of FastPod status" in capsys.readouterr().out


def test_placement_report_mig_table_when_a_baseline_had_no_fragmentation_rejection(tmp_path):
    # at low load a baseline may reject nothing for fragmentation: the report divided by its
    # 0 % and died with ZeroDivisionError (`fastshare bench mig` itself prints n/a)
    counts = (("fastshare", 0), ("largest-first", 0), ("first-fit", 2))
    rows = [{"strategy": s, "requests": 100, "rejected": r, "frag_rejected": r,
             "frag_rejection_ratio": float(r)} for s, r in counts]
    (tmp_path / "mig.json").write_text(json.dumps(rows))
    out = subprocess.run([sys.executable, str(BENCH / "placement_report.py"), str(tmp_path / "mig.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "| fastshare | 100 | 0 | 0 | 0.0 | n/a | 0.000x |" in out.stdout, out.stdout
