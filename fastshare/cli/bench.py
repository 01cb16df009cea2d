"""`fastshare bench`: measured figures for BENCHMARKS.md (other components add subcommands
as bench/*.py scripts; this group holds the placement ones)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import click

from fastshare.cli._output import fail, print_json, print_table, progress_bar
from fastshare.cli._types import Number, Seeds

SPEED_SIZES = [1213, 2500, 5000, 10000]   # node counts the speed part times decisions on


def _data_dir(path: str | None) -> Path:
    from fastshare.sim.experiment import default_data_dir

    d = Path(path) if path else default_data_dir()
    if d is None or not (d / "openb_node_list_gpu_node.csv").is_file():
        fail("openb data not found", "pass --data DIR (the directory with openb_*.csv)")
    return d


@click.group("bench")
def bench() -> None:
    """Benchmarks that print measured figures (tables, or --json)."""


@bench.command("placement")
@click.option("--data", type=click.Path(file_okay=False),
              help="openb directory (default ../shared/data/openb).")
@click.option("--traces", default="all", show_default=True, help="Comma list of trace names, or 'all'.")
@click.option("--policies", default="fgd,bestfit,fastshare", show_default=True,
              help="Comma list of placement policies (those of `fastshare sim --policy`).")
@click.option("--seeds", type=Seeds(), default="42-51", show_default=True, help="e.g. 42-51 or 42,43.")
@click.option("--speed/--no-speed", default=True, show_default=True,
              help="Also time decisions on 1,213 / 2,500 / 5,000 / 10,000-node clusters.")
@click.option("--quality/--no-quality", default=True, show_default=True,
              help="Replay every trace x policy x seed and report the final GPU allocation.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout instead of tables.")
def placement(data: str | None, traces: str, policies: str, seeds: list[int], speed: bool, quality: bool,
              as_json: bool) -> None:
    """Final GPU allocation per trace x policy (mean over seeds, beside the published means),
    and decision time against cluster size."""
    from fastshare.placement.policies import POLICY_NAMES
    from fastshare.sim import benchmarks
    from fastshare.sim.trace import TraceError

    if not speed and not quality:
        raise click.UsageError("--no-speed and --no-quality leave nothing to measure; drop one of them")
    d = _data_dir(data)
    known = benchmarks.traces_in(d)
    names = known if traces == "all" else [t.strip() for t in traces.split(",") if t.strip()]
    if not names:
        fail("--traces: name at least one trace, or 'all'", f"choose from {', '.join(known)}")
    missing = [t for t in names if t not in known]
    if missing:
        fail(f"--traces: no openb_pod_list_{missing[0]}.csv in {d}", f"choose from {', '.join(known)}")
    pols = [p.strip().lower() for p in policies.split(",") if p.strip()]
    bad = [p for p in pols if p not in POLICY_NAMES]
    if bad or not pols:
        fail(f"--policies: unknown {', '.join(bad)}" if bad else "--policies: name at least one policy",
             f"choose from {', '.join(POLICY_NAMES)}")
    try:
        _placement(d, names, pols, seeds, speed, quality, as_json)
    except TraceError as exc:
        fail(str(exc))


def _placement(d: Path, names: list[str], pols: list[str], seeds: list[int], speed: bool, quality: bool,
               as_json: bool) -> None:
    import sys

    from fastshare.sim import benchmarks

    out: dict = {}
    if quality and speed:   # the speed part's trace too, before the quality runs
        benchmarks.load_trace(d, benchmarks.SPEED_TRACE)
    if quality:
        def note(s: dict) -> None:
            print(f"{s['trace']:>12} {s['policy']:>10} seed {s['seed']}: {s['gpu_alloc_ratio']:.2f} % "
                  f"({s['wall_s']:.1f} s)", file=sys.stderr, flush=True)

        rows = benchmarks.quality(d, names, pols, seeds, on_run=note)
        out["quality"] = rows
        if not as_json:
            print_table("Final GPU allocation ratio % (tune 1.3), mean over seeds",
                        ["trace", "policy", "seeds", "mean", "min", "max", "published", "diff",
                         "vs published FGD", "wall s/run"],
                        [[r["trace"], r["policy"], r["seeds"], r["mean"], r["min"], r["max"],
                          r["published_mean"], r["diff_vs_published"], r["diff_vs_published_fgd"],
                          r["wall_s_mean"]] for r in rows])
    if speed:
        def bar(nodes: int) -> AbstractContextManager[Callable[[int, int], None]]:
            return progress_bar(f"bench placement speed, {nodes} nodes", timed=True)

        def engine_bar(nodes: int) -> AbstractContextManager[Callable[[int, int], None]]:
            return progress_bar(f"bench placement speed, engine, {nodes} nodes", timed=True)

        rows = benchmarks.speed(d, SPEED_SIZES, progress=bar)
        engine_rows = benchmarks.engine_speed(d, SPEED_SIZES, progress=engine_bar)
        out["speed"] = rows
        out["engine_speed"] = engine_rows
        if not as_json:
            print_table("Decision time vs cluster size, trace replay (default trace, tune 1.3, seed 42, "
                        "fastshare)",
                        ["nodes", "GPUs", "tasks", "p50 ms", "p99 ms", "max ms", "p99 CPU ms", "wall s",
                         "alloc %"],
                        [[r["nodes"], r["gpus"], r["tasks"], r["p50_ms"], r["p99_ms"], r["max_ms"],
                          r["cpu_p99_ms"], r["wall_s"], r["gpu_alloc_ratio"]] for r in rows])
            print_table("Decision time vs cluster size, the controller's engine (the same arrivals, GPU "
                        "tasks only: the cluster fills, then a quarter are rejected)",
                        ["nodes", "tasks", "rejected", "p50 ms", "p99 ms", "p99 placed", "p99 rejected",
                         "max ms", "p99 CPU ms", "wall s"],
                        [[r["nodes"], r["tasks"], r["rejected"], r["p50_ms"], r["p99_ms"], r["placed_p99_ms"],
                          r["rejected_p99_ms"], r["max_ms"], r["cpu_p99_ms"], r["wall_s"]]
                         for r in engine_rows])
    if as_json:
        print_json(out)


@bench.command("mig")
@click.option("--seeds", type=Seeds(), default="1-5", show_default=True,
              help="Request streams, e.g. 1-5 or 1,3.")
@click.option("--steps", type=click.IntRange(10, 100000), default=2000, show_default=True,
              help="Arrivals and departures per stream.")
@click.option("--gpus", type=click.IntRange(1, 4096), default=32, show_default=True,
              help="A100-40GB GPUs in the simulated cluster.")
@click.option("--load", type=Number(0.1, 5), default=1.1, show_default=True,
              help="Offered load as a multiple of the cluster's compute slices.")
@click.option("--json", "as_json", is_flag=True, help="One JSON list on stdout instead of a table.")
def mig(seeds: list[int], steps: int, gpus: int, load: float, as_json: bool) -> None:
    """Fragmentation rejections of exclusive (MIG) requests with departures: fastshare's
    placement vs NVIDIA's default largest-first order vs first-fit, on the same streams."""
    from fastshare.sim.migbench import benchmark

    with progress_bar(f"bench mig ({gpus} GPUs, {steps} steps)") as progress:
        rows = benchmark(seeds, steps, gpus, load, progress)
    if as_json:
        print_json(rows)
        return
    base = {r["strategy"]: r["frag_rejection_ratio"] for r in rows}
    print_table(f"MIG fragmentation rejections ({gpus} A100-40GB GPUs, {steps} steps, load {load}, "
                f"seeds {Seeds.describe(seeds)})",
                ["strategy", "requests", "rejected", "frag. rejected", "frag. rejection %",
                 "vs largest-first", "vs first-fit"],
                [[r["strategy"], r["requests"], r["rejected"], r["frag_rejected"], r["frag_rejection_ratio"],
                  _ratio(r["frag_rejection_ratio"], base["largest-first"]),
                  _ratio(r["frag_rejection_ratio"], base["first-fit"])] for r in rows])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b else "n/a"


COMMANDS = [bench]
