"""The LP upper bound of bench/openb_bound.py: no policy's run beats it, at the run's own
saturation point or overall, and it is exact where the optimum is known by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fastshare.placement import make_policy
from fastshare.placement.policies import MILLI, Task, typical_shapes
from fastshare.sim.replay import simulate
from fastshare.sim.trace import SimNode, SimPod

_spec = importlib.util.spec_from_file_location(
    "openb_bound", Path(__file__).resolve().parents[2] / "bench" / "openb_bound.py")
openb_bound = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(openb_bound)


def _pod(i: int, gpus: int, milli: int, cpu: int = 1000) -> SimPod:
    return SimPod(f"p{i:03d}", cpu, 100, gpus, milli)


def _all_taus(bound, order) -> float:
    """The bound over every saturation point; a run that never saturates placed at most
    all of the GPU demand."""
    demand = min(100.0, sum(p.gpu_request for p in order) * 100 / (bound.gpus * MILLI))
    return max([demand] + [b for t in range(len(order) + 1) if (b := bound.at(t)) is not None])


def test_exact_where_the_optimum_is_known():
    # two GPUs: two 600s take them (no GPU free after the second), the 400s then fill both holes
    nodes = [SimNode("n0", 64000, 128000, 2, "T4")]
    order = [_pod(0, 1, 600), _pod(1, 1, 600), _pod(2, 1, 400), _pod(3, 1, 400)]
    bound = openb_bound.Bound(order, nodes)
    assert bound.at(2) == 100.0
    # one task cannot have taken the last of two free GPUs
    assert bound.at(1) is None


def test_no_task_before_tau_means_no_run_saturates_there():
    # only 2-GPU tasks (found by hypothesis): before the first arrives nothing can cover the GPUs
    nodes = [SimNode("n0", 64000, 128000, 2, "T4"), SimNode("n1", 64000, 128000, 4, "T4")]
    order = [_pod(i, 2, MILLI) for i in range(4)]
    bound = openb_bound.Bound(order, nodes)
    assert bound.at(0) is None
    assert _all_taus(bound, order) == 100.0


def test_node_cpu_limits_the_bound():
    # one 2-GPU node with CPU for one task only: whatever the order, one GPU stays empty
    nodes = [SimNode("n0", 4000, 128000, 2, "T4")]
    order = [_pod(0, 1, 500, cpu=4000), _pod(1, 1, 500, cpu=4000), _pod(2, 1, 500, cpu=4000)]
    bound = openb_bound.Bound(order, nodes, dead=True)
    values = [b for t in range(len(order) + 1) if (b := bound.at(t)) is not None]
    assert values and max(values) <= 25.0 + 1e-9


SIZES = st.sampled_from([100, 200, 300, 450, 500, 650, 800, MILLI])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2), SIZES), min_size=4, max_size=40),
       st.sampled_from(["bestfit", "fgd", "fastshare"]))
def test_no_policy_beats_the_bound(tasks, policy):
    nodes = [SimNode("n0", 256000, 1 << 20, 2, "T4"), SimNode("n1", 256000, 1 << 20, 4, "T4")]
    order = [_pod(i, 1 if milli < MILLI else n, milli) for i, (n, milli) in enumerate(tasks)]
    typical = typical_shapes([Task(p.cpu_milli, p.gpu_milli, p.num_gpu, p.gpu_spec) for p in order])
    res = simulate(nodes, order, make_policy(policy, typical), list(range(len(nodes))))
    bound = openb_bound.Bound(order, nodes)
    assert res.gpu_alloc_ratio <= round(_all_taus(bound, order), 2) + 1e-9
    tau = openb_bound.saturation(nodes, res)
    if tau is not None:  # the bound at the run's own saturation point holds too
        assert res.gpu_alloc_ratio <= round(bound.at(tau, dead=True), 2) + 1e-9
