"""`fastshare sim`: replay an openb trace through a placement policy, as the FGD paper did."""

from __future__ import annotations

import os
from pathlib import Path

import click

from fastshare.cli._output import fail, print_json, print_table, progress_bar
from fastshare.cli._types import Number
from fastshare.placement.policies import POLICY_NAMES
from fastshare.sim.experiment import Experiment, default_data_dir, load, published_curves, read_published
from fastshare.sim.trace import CURVE_POINTS, SimNode, TraceError, read_nodes


def _default(name: str) -> str | None:
    d = default_data_dir()
    return str(d / name) if d else None


@click.command("sim")
@click.option("--pods", type=click.Path(exists=True, dir_okay=False),
              default=lambda: _default("openb_pod_list_default.csv"),
              show_default="../shared/data/openb/openb_pod_list_default.csv", help="Task list CSV.")
@click.option("--nodes", type=click.Path(exists=True, dir_okay=False),
              default=lambda: _default("openb_node_list_gpu_node.csv"),
              show_default="../shared/data/openb/openb_node_list_gpu_node.csv", help="Node list CSV.")
@click.option("--policy", type=click.Choice(POLICY_NAMES, case_sensitive=False), default="fastshare",
              show_default=True, help="Placement policy.")
@click.option("--tune", type=Number(0, 10), default=1.3, show_default=True,
              help="Append random task copies until requested GPU = TUNE x capacity (0 = none).")
@click.option("--seed", type=click.IntRange(min=0), default=42, show_default=True,
              help="Arrival shuffle and tie order.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True),
              help="Write the allocation curve (with the published FGD curve, and a zoom on where the "
                   "cluster fills) to a PNG.")
def sim(pods: str | None, nodes: str | None, policy: str, tune: float, seed: int, as_json: bool,
        plot: str | None) -> None:
    """Replay a trace: tasks sorted by name, shuffled with SEED, TUNE copies, no departures;
    prints the GPU allocation ratio as arrivals grow, failures, fragmentation and wall time."""
    if not pods or not nodes:
        fail("no trace given and ../shared/data/openb not found", "pass --pods and --nodes")
    if plot:
        _check_plot(plot)   # before the replay, which can take minutes
    try:
        node_list, pod_list, trace = load(pods, nodes)
    except TraceError as e:
        fail(str(e))
    if not any(n.gpus for n in node_list):
        fail(f"{nodes}: the node list has no GPUs", "give a node list with GPU nodes (column gpu > 0)")
    ref, label = None, ""
    if plot:   # the published curve too is read before the replay, which can take minutes
        try:
            ref, label = _published_fgd(Path(pods).resolve().parent, trace, node_list, seed, tune)
        except TraceError as e:
            fail(str(e))
    exp = Experiment(node_list, pod_list, policy.lower(), seed, tune, trace)
    with progress_bar(f"{policy} {trace} seed {seed}") as progress:
        _res, summary = exp.run(progress)
    if plot:
        _plot(plot, summary, ref, label)
    if as_json:
        print_json(summary)
        return
    points = [p for p in summary["curve"] if p[0] % 10 == 0]
    print_table(f"GPU allocation ratio, {policy} on {trace} (seed {seed}, tune {tune})",
                ["arrived % of GPU capacity", "allocated %"], points)
    print_table(None, ["final alloc %", "pods", "failed", "GPU pods failed", "frag % of free",
                       "decision p99 ms", "wall s"],
                [[summary["gpu_alloc_ratio"], summary["pods_total"], summary["pods_failed"],
                  summary["gpu_pods_failed"], summary["frag_ratio"], summary["decision_ms"]["p99"],
                  summary["wall_s"]]])


Curve = list[tuple[float, float]]   # (arrived %, allocated %)


def zoom_window(curves: list[Curve], margin: float = 0.5) -> tuple[float, float, float] | None:
    """``(x0, y0, y1)``: from 10 points before the first curve leaves the diagonal (allocated
    more than one point below arrived) to the end, the y range the curves span there. Policies
    differ only in that stretch, by a point or two, which the full 0-100 % axis hides. None
    when no curve leaves the diagonal."""
    left = [x for curve in curves for x, y in curve if y < x - 1]
    if not left:
        return None
    x0 = max(0.0, min(left) - 10)
    ys = [y for curve in curves for x, y in curve if x >= min(left)]
    return x0, min(ys) - margin, max(ys) + margin


def _published_fgd(data_dir: Path, trace: str, nodes: list[SimNode], seed: int,
                   tune: float) -> tuple[list[float] | None, str]:
    """The published FGD curve to draw beside this run, and its label: of the same seed, else
    the mean over the published seeds; none unless the run is of the published setting (the
    openb GPU cluster at tune 1.3) and the data directory has the curves."""
    published_nodes = data_dir / "openb_node_list_gpu_node.csv"
    if tune != 1.3 or not published_nodes.is_file() or not _same_nodes(published_nodes, nodes):
        return None, ""
    curves = published_curves(read_published(data_dir), trace, "fgd")
    if seed in curves:
        return curves[seed], "FGD (published, same seed)"
    if curves:
        mean = [sum(c[x] for c in curves.values()) / len(curves) for x in range(CURVE_POINTS)]
        return mean, f"FGD (published, mean of {len(curves)} seeds)"
    return None, ""


def _same_nodes(path: Path, nodes: list[SimNode]) -> bool:
    try:
        return read_nodes(path) == nodes
    except TraceError:
        return False


def _check_plot(path: str) -> None:
    """Refuse a --plot file that could not be written, and a missing matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("--plot needs matplotlib", "pip install 'fastshare[plot]'")
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise click.BadParameter(f"{path}: directory {parent} does not exist", param_hint="'--plot'")
    # Open it for real: os.access says yes to root everywhere, and knows nothing of read-only
    # mounts. Append mode leaves an existing file as it is; a file made here is removed again.
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise click.BadParameter(f"{path}: cannot write ({e.strerror or e})", param_hint="'--plot'") from None
    if not existed:
        os.unlink(path)


def _plot(path: str, summary: dict, published_fgd: list[float] | None, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves = [[(x, y) for x, y in summary["curve"]]]
    if published_fgd:
        curves.append(list(enumerate(published_fgd)))
    zoom = zoom_window(curves)
    if zoom is None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        axes = [ax]
    else:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), width_ratios=(3, 2))
        ax, zoomed = axes
        zoomed.set_xlim(zoom[0], max(x for x, _ in curves[0]))
        zoomed.set_ylim(zoom[1], zoom[2])
        zoomed.set_xlabel("arrived workload (%), where the cluster fills")
    for a in axes:
        a.grid(alpha=0.3)
        a.plot(*zip(*curves[0], strict=True), label=f"{summary['policy']} (this run)")
        if published_fgd:
            a.plot(*zip(*curves[1], strict=True), "--", label=label)
        a.plot([0, 100], [0, 100], ":", color="grey", linewidth=0.8)
    ax.set_xlabel("arrived workload (% of GPU capacity)")
    ax.set_ylabel("GPU allocation ratio (%)")
    ax.set_title(f"{summary['trace']} seed {summary['seed']} tune {summary['tune']}: "
                 f"final {summary['gpu_alloc_ratio']} %")
    ax.legend(loc="lower right")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120, format="png")   # a PNG, whatever the name ends with
    except OSError as e:
        fail(f"--plot {path}: cannot write ({e.strerror or e})")
    finally:
        plt.close(fig)


COMMANDS = [sim]
