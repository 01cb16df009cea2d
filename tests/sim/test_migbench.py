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
