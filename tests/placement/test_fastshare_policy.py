"""fastshare's default policy: the value of free milli learned online, and the choices it drives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastshare.placement import Engine, Request
from fastshare.placement.fastshare_policy import (
    BINS,
    KAPPA,
    STEP,
    FastsharePolicy,
    best_fill,
    fresh_value,
    hole_values,
    value_table,
)
from fastshare.placement.policies import MILLI, Task

from .conftest import node


def taught(*mix: tuple[Task, int]) -> FastsharePolicy:
    pol = FastsharePolicy()
    for task, n in mix:
        for _ in range(n):
            pol.observe(task)
    pol._refresh()  # adopt the whole mix now, not at the next doubling
    return pol


def best_node(pol: FastsharePolicy, states: list[tuple[int, tuple[int, ...]]], task: Task) -> int:
    """Index of the state the policy prefers (earliest on ties, as the callers do)."""
    scores = [pol.score("T4", cpu, gpus, task)[0] for cpu, gpus in states]
    return max(range(len(states)), key=lambda i: (scores[i], -i))


def test_value_table_before_any_request_counts_every_free_milli():
    v = value_table([0.0] * (BINS + 1))
    assert v[BINS] == MILLI and v[19] == 190


def test_value_table_a_hole_no_request_fits_is_worth_nothing():
    counts = [0.0] * (BINS + 1)
    counts[81] = 10  # only 810-milli shares arrive
    v = value_table(counts)
    assert v[80] == 0 and v[19] == 0
    assert v[81] == pytest.approx(810 / 1.001) and v[BINS] == pytest.approx(810 / 1.001)


def test_observe_learns_the_mix_and_bumps_the_generation():
    pol = FastsharePolicy()
    assert pol.generation == 0 and pol.rho == 0
    pol.observe(Task(4000, 0, 0))            # CPU-only: no GPU size to learn
    assert pol.seen == 0
    pol.observe(Task(3000, 500, 1))
    assert pol.generation == 1 and pol.rho == pytest.approx(3000 / 500)
    assert pol.values[50] > 0 and pol.values[49] == 0  # only 500-milli shares so far


def test_a_small_share_completes_the_gpu_next_to_a_large_one():
    pol = taught((Task(1000, 810, 1), 50), (Task(1000, 470, 1), 40), (Task(1000, 160, 1), 3))
    states = [(64000, (MILLI, MILLI)), (64000, (190, MILLI)), (64000, (530, MILLI))]
    _score, chosen = pol.score("T4", *states[1], Task(1000, 160, 1))
    assert best_node(pol, states, Task(1000, 160, 1)) == 1 and chosen == (0,)


def test_when_large_shares_dominate_a_medium_share_opens_a_fresh_gpu():
    # Fresh GPUs mostly end as an 810 beside an unfillable hole, so a 470 on a fresh GPU
    # (two 470s end at 940) is worth more than closing a 530 hole with it.
    pol = taught((Task(1000, 810, 1), 60), (Task(1000, 470, 1), 40))
    _score, chosen = pol.score("T4", 64000, (530, MILLI), Task(1000, 470, 1))
    assert chosen == (1,)
    # ... and when the only other shares are 470s, it closes the hole (two 470s end at 940
    # either way) and the fresh GPU is left to whole-GPU requests.
    pol = taught((Task(1000, MILLI, 1), 60), (Task(1000, 470, 1), 40))
    _score, chosen = pol.score("T4", 64000, (530, MILLI), Task(1000, 470, 1))
    assert chosen == (0,)


DEFAULT_LIKE = ((Task(1000, MILLI, 1), 600), (Task(1000, 810, 1), 150), (Task(1000, 470, 1), 100),
                (Task(1000, 320, 1), 45), (Task(1000, 650, 1), 35), (Task(1000, 160, 1), 10))


def test_a_free_gpu_is_valued_by_the_shares_alone():
    pol = taught(*DEFAULT_LIKE)
    with_wholes, fresh = value_table(pol.counts), fresh_value(pol.counts)
    assert fresh[:BINS] == with_wholes[:BINS]
    assert fresh[BINS] < with_wholes[BINS] - 30   # whole requests no longer fill it
    only_wholes = taught((Task(1000, MILLI, 1), 10))
    assert only_wholes.values == value_table(only_wholes.counts)


def test_best_fill_packs_only_the_common_sizes():
    counts = [0.0] * (BINS + 1)
    counts[47], counts[32], counts[16] = 60, 35, 2   # 160s are 2 % of the shares: not common
    counts[BINS] = 500                               # whole-GPU requests never fill a hole
    w = best_fill(counts)
    assert w is not None
    assert w[19] == 0 and w[53] == 470 and w[68] == 640 and w[79] == 790 and w[BINS] == 960


def test_without_a_common_size_the_policy_scores_with_the_random_filler_alone():
    counts = [0.0] * (BINS + 1)
    for b in range(10, 90, 2):   # 40 sizes, 2.5 % each
        counts[b] = 1
    assert best_fill(counts) is None and hole_values(counts) == fresh_value(counts)
    assert best_fill([0.0] * (BINS + 1)) is None


def test_a_share_closes_a_hole_rather_than_open_a_second_one_for_the_same_rare_partner():
    # A 680 hole waits for a 650 (a tenth of the shares). The best fill alone counts on a
    # 650 for every such hole, so it puts a 320 on the free GPU and opens a second one;
    # scored with the mean, the 320 closes the hole (360 left, which another 320 completes)
    # and the free GPU stays free.
    pol = taught(*DEFAULT_LIKE)
    task = Task(1000, 320, 1)
    assert pol.score("T4", 64000, (680, MILLI), task)[1] == (0,)
    best = best_fill(pol.counts)
    assert best is not None
    pol.values = best
    assert pol.score("T4", 64000, (680, MILLI), task)[1] == (1,)


def test_a_share_keeps_off_a_hole_that_common_sizes_complete_exactly():
    # A 650 in a 790 hole leaves 140 that no size fits; a 470 and a 320 complete the hole
    # exactly, and a 320 completes the 650 on the free GPU. The random filler alone, which
    # counts on whatever fits the 790 hole (160s, 320s, 470s and 650s by how often each
    # comes), sends the 650 in.
    pol = taught(*DEFAULT_LIKE)
    task = Task(1000, 650, 1)
    assert pol.score("T4", 64000, (790, MILLI), task)[1] == (1,)
    pol.values = fresh_value(pol.counts)
    assert pol.score("T4", 64000, (790, MILLI), task)[1] == (0,)


def test_a_share_opens_a_free_gpu_rather_than_a_hole_it_fits_badly():
    # A 320 beside a 470 leaves 210 that only the rare 160s fit; on a free GPU it leaves
    # 680 that a 650 completes. A 350 hole it does close.
    pol = taught(*DEFAULT_LIKE)
    assert pol.score("T4", 64000, (530, MILLI), Task(1000, 320, 1))[1] == (1,)
    assert pol.score("T4", 64000, (350, MILLI), Task(1000, 320, 1))[1] == (0,)


def test_a_cpu_heavy_share_avoids_stranding_gpus():
    pol = taught((Task(8000, 470, 1), 50), (Task(3000, 810, 1), 50))
    # same GPUs; on the first node the task would use up the CPU the free GPU needs
    states = [(9000, (MILLI, MILLI)), (40000, (MILLI, MILLI))]
    assert best_node(pol, states, Task(8000, 470, 1)) == 1


def test_cpu_only_tasks_go_where_cpu_is_spare():
    pol = taught((Task(8000, MILLI, 1), 50), (Task(16000, 0, 0), 10))
    states = [(16000, (MILLI, MILLI)), (64000, (MILLI, MILLI)), (20000, (0, 0))]
    assert best_node(pol, states, Task(16000, 0, 0)) in (1, 2)


def test_the_engine_teaches_its_default_policy():
    eng = Engine([node("n1", n_gpus=2), node("n2", n_gpus=2)])
    assert isinstance(eng.policy, FastsharePolicy)
    eng.place(Request("a", "fastpod", sm_percent=30, gpu_memory_mib=1024, cpu_milli=2000))
    eng.place(Request("b", "whole", gpus=1, cpu_milli=4000))
    eng.place(Request("c", "mps", gpu_memory_mib=1024))
    assert eng.policy.seen == 2
    assert eng.policy.counts[30] == 1 and eng.policy.counts[BINS] == 1 and STEP == 10


def test_cpu_only_demand_counts_only_when_the_cluster_is_short_of_cpu():
    mix = ((Task(10_000, MILLI, 1), 50), (Task(8_000, 0, 0), 50))   # 10 + 8 CPU milli per GPU milli
    plenty, short = taught(*mix), taught(*mix)
    plenty.cluster(20 * 8000, {"T4": 8000})
    short.cluster(12 * 8000, {"T4": 8000})
    plenty.observe(Task(10_000, MILLI, 1))
    short.observe(Task(10_000, MILLI, 1))
    assert plenty.rho == pytest.approx(10)
    assert short.rho == pytest.approx(10 + 8 * 50 / 51)


def test_exposed_cpu_is_free_cpu_times_the_share_of_cpu_only_requests_that_fit():
    pol = taught((Task(8_000, 0, 0), 3), (Task(16_000, 0, 0), 1), (Task(4_000, MILLI, 1), 10))
    assert pol.exposed(7_999) == 0                         # no CPU-only request fits
    assert pol.exposed(10_000) == pytest.approx(10_000 * 0.75)
    assert pol.exposed(16_000) == 16_000
    assert pol.exposed(-500) == 0


def short_of_cpu(n: int) -> FastsharePolicy:
    """A mix whose GPU requests ask 4 CPU milli per GPU milli and whose CPU-only requests
    ask as much again, on a cluster with 6 per GPU milli: a third short."""
    pol = taught((Task(4_000, MILLI, 1), n), (Task(8_000, 0, 0), n // 2))
    pol.cluster(6 * 8_000, {"T4": 8_000})
    pol._refresh()
    return pol


def test_when_cpu_is_short_gpu_requests_leave_no_cpu_that_cpu_only_requests_fit():
    # On the second node a 4-core request leaves 5 cores, too few for the 8-core CPU-only
    # requests; on the first it leaves 12 that they would take. Without the guard both
    # choices add the same (each node's CPU feeds its GPUs in proportion), so the first wins.
    states = [(16_000, (MILLI, MILLI, MILLI)), (9_000, (MILLI, MILLI, MILLI))]
    task = Task(4_000, MILLI, 1)
    short = short_of_cpu(400)
    assert short.guard == pytest.approx(1 / 4)              # GPU milli per CPU milli
    assert best_node(short, states, task) == 1
    plenty = short_of_cpu(400)
    plenty.cluster(20 * 8_000, {"T4": 8_000})
    plenty._refresh()
    assert plenty.guard == 0
    assert best_node(plenty, states, task) == 0


def test_a_few_requests_do_not_set_off_the_cpu_guard():
    assert short_of_cpu(4).guard == 0      # a third short, but 6 requests prove nothing
    assert short_of_cpu(200).guard > 0


def test_requests_allowing_several_models_count_against_each_by_its_capacity():
    pol = FastsharePolicy()
    pol.cluster(64_000, {"A": 3_000, "B": 1_000, "C": 4_000})
    pol.observe(Task(1_000, MILLI, 2, frozenset({"A", "B"})))   # 2,000 milli: 1,500 A, 500 B
    pol.observe(Task(1_000, 500, 1, frozenset({"B"})))
    pol.observe(Task(1_000, 500, 1))
    assert pol.model_reserve.share("A").ratio() == pytest.approx(1_500 / 3_000)
    assert pol.model_reserve.share("B").ratio() == pytest.approx(1_000 / 3_000)
    assert pol.model_reserve.share("C").ratio() == 0


def bound_mix(n: int, bound_share: float) -> list[tuple[Task, int]]:
    """``n`` whole-GPU requests, ``bound_share`` of them bound to the A100 model."""
    bound = round(n * bound_share)
    return [(Task(4_000, MILLI, 1, frozenset({"A100-SXM4-40GB"})), bound), (Task(4_000, MILLI, 1), n - bound)]


def test_requests_with_a_choice_leave_a_model_to_the_requests_that_will_fill_it():
    # Half the capacity is A100; when two thirds of the demand can only run there, a request
    # that can run anywhere goes to the T4 node, although the A100 node comes first.
    cluster = [node("a100", n_gpus=4), node("t4", n_gpus=4, key="T4")]
    short = taught(*bound_mix(300, 2 / 3))
    eng = Engine(cluster, policy=short)
    short._refresh()
    assert short.model_reserve.reserve == {"A100-SXM4-40GB": 1.0}
    assert eng.place(Request("x", "whole", gpus=1, cpu_milli=4_000)).node == "t4"
    plenty = taught(*bound_mix(300, 1 / 3))
    eng = Engine(cluster, policy=plenty)
    plenty._refresh()
    assert plenty.model_reserve.reserve == {}
    assert eng.place(Request("x", "whole", gpus=1, cpu_milli=4_000)).node == "a100"


def test_a_few_bound_requests_do_not_set_off_the_model_reserve():
    for n, reserved in ((6, False), (300, True)):
        pol = taught(*bound_mix(n, 2 / 3))
        pol.cluster(64_000, {"A100-SXM4-40GB": 4_000, "T4": 4_000})
        pol._refresh()
        assert bool(pol.model_reserve.reserve) is reserved


def test_the_engine_tells_its_policy_the_models_requests_are_bound_to():
    eng = Engine([node("a100", n_gpus=2), node("t4", n_gpus=2, key="T4")])
    assert eng.policy.model_reserve.capacity == {"A100-SXM4-40GB": 2_000, "T4": 2_000}
    eng.place(Request("a", "whole", gpus=1, cpu_milli=1_000, gpu_models=("T4",)))
    assert eng.policy.model_reserve.share("T4").ratio() == 1


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(1, BINS - 1), st.integers(1, 50), min_size=1, max_size=12))
def test_best_fill_never_promises_more_than_the_hole_and_grows_with_it(sizes):
    counts = [0.0] * (BINS + 1)
    for b, n in sizes.items():
        counts[b] = n
    w = best_fill(counts)
    assert w is not None   # at most 12 sizes: the most frequent has p^2 >= 1/144 > KAPPA
    assert all(0 <= w[f] <= f * STEP for f in range(BINS + 1))
    assert all(w[f] <= w[f + 1] for f in range(BINS))
    smallest = min(b for b, n in sizes.items() if (n / sum(sizes.values())) ** 2 >= KAPPA)
    assert w[smallest - 1] == 0 and w[smallest] == smallest * STEP
