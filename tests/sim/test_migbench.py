"""The MIG benchmark's generator and strategies on a short stream."""

from __future__ import annotations

import json

from click.testing import CliRunner

from fastshare.cli import main
from fastshare.device.catalog import get_model
from fastshare.sim.migbench import generate, run


def test_generator_is_seeded_and_strategies_see_the_same_stream():
    profiles = get_model("A100-SXM4-40GB").profiles
    a = generate(3, 200, 8, profiles=profiles)
    assert a == generate(3, 200, 8, profiles=profiles) and a != generate(4, 200, 8, profiles=profiles)
    assert all(leave > step for step, _rid, _sm, leave in a)
    results = [run(s, a, 8) for s in ("fastshare", "largest-first", "first-fit")]
    assert len({r.requests for r in results}) == 1
    for r in results:
        assert 0 <= r.frag_rejected <= r.rejected <= r.requests


    args = ["bench", "mig", "--seeds", "1", "--steps", "100", "--gpus", "4", "--json"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert {r["strategy"] for r in json.loads(out.stdout)} == {"fastshare", "largest-first", "first-fit"}


def test_bench_mig_shows_its_progress_on_stderr_and_keeps_stdout_json():
    # the default `bench mig` runs over a minute and said nothing until its table
    args = ["bench", "mig", "--seeds", "1-2", "--steps", "10", "--gpus", "1", "--json"]
    out = CliRunner().invoke(main, args, env={"FORCE_COLOR": "1", "COLUMNS": "100"})
    assert out.exit_code == 0, out.output
    assert len(json.loads(out.stdout)) == 3
    assert "6/6" in out.stderr and "bench mig" in out.stderr


def test_bench_placement_speed_shows_its_progress_on_stderr(tmp_path, monkeypatch):
    # the speed part replays the default trace on clusters of up to 10,000 nodes, for many
    # minutes, and said nothing until its table (the quality part names every run it finishes)
    import threading

    from fastshare.cli import bench
    from fastshare.sim.experiment import Experiment

    (tmp_path / "openb_node_list_gpu_node.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,V100M16\nn1,64000,262144,8,T4\n")
    (tmp_path / "openb_pod_list_default.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        + "".join(f"p{i},1000,1024,1,{250 * (1 + i % 4)}\n" for i in range(40)))
    monkeypatch.setattr(bench, "SPEED_SIZES", [2, 30])
    # decision times are measured: no refresh thread may run beside the replay
    run, threads, before = Experiment.run, [], threading.active_count()
    monkeypatch.setattr(Experiment, "run", lambda self, *a: threads.append(threading.active_count())
                        or run(self, *a))
    out = CliRunner().invoke(main, ["bench", "placement", "--data", str(tmp_path), "--no-quality", "--json"],
                             env={"FORCE_COLOR": "1", "COLUMNS": "120"})
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)["speed"]
    assert [r["nodes"] for r in rows] == [2, 30]
    assert threads == [before] * 2
    for r in rows:
        assert f"speed, {r['nodes']} nodes" in out.stderr and f"/{r['tasks']}" in out.stderr, out.stderr
