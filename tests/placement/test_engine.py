"""Engine behaviour per request kind and constraint, rejection wording, persistence."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from fastshare.device import catalog
from fastshare.placement import (
    Assignment,
    Engine,
    GpuView,
    InvalidRequest,
    NodeView,
    Rejection,
    Request,
    make_policy,
)
from fastshare.placement.topology import tightest_group

from .conftest import node


def fastpod(rid: str, sm: float = 30, mem: int = 4096, **kw) -> Request:
    kw.setdefault("quota_request", 0.001)  # so that SMs and memory decide (quota: its own test)
    return Request(rid, "fastpod", sm_percent=sm, gpu_memory_mib=mem, **kw)


def test_fastpod_sm_shares_never_exceed_100_percent(cluster):
    eng = Engine([node("n", n_gpus=1)])
    assert eng.place(fastpod("a", 60))
    rej = eng.place(fastpod("b", 50))
    assert isinstance(rej, Rejection)
    assert "40 % SMs" in rej.reason or "largest free SM share is 40 %" in rej.reason
    assert eng.place(fastpod("c", 40))


def test_fastpod_memory_must_fit_and_rejection_names_largest_free():
    eng = Engine([node("node-3", n_gpus=2)])
    assert eng.place(fastpod("a", 10, 30 * 1024))
    assert eng.place(fastpod("b", 10, 28 * 1024))
    rej = eng.place(fastpod("c", 10, 20 * 1024))
    assert not rej
    assert rej.reason.startswith(
        "no GPU with 10 % SMs, 20 GiB and 0.001 time quota free; "
        "largest free memory is 12 GiB on node-3 GPU 1")


def test_quota_fields_are_validated_with_field_names():
    with pytest.raises(InvalidRequest, match="quota_request: must be <= quota_limit"):
        fastpod("a", quota_request=0.8, quota_limit=0.5)
    with pytest.raises(InvalidRequest, match=r"sm_percent: fastpod needs an SM share in \(0, 100\]"):
        fastpod("a", sm=120)
    with pytest.raises(InvalidRequest, match="kind: must be one of"):
        Request("a", "slice")
    with pytest.raises(InvalidRequest, match="gpus: only kind 'whole'"):
        Request("a", "mps", gpu_memory_mib=10, gpus=2)


def test_mps_oversubscription_factor():
    plain = Engine([node("n", n_gpus=1)])
    assert plain.place(Request("a", "mps", gpu_memory_mib=30000))
    assert not plain.place(Request("b", "mps", gpu_memory_mib=30000))
    over = Engine([node("n", n_gpus=1)], mps_oversubscription=2.0)
    assert over.place(Request("a", "mps", gpu_memory_mib=30000))
    assert over.place(Request("b", "mps", gpu_memory_mib=30000))
    with pytest.raises(InvalidRequest, match="mps_oversubscription"):
        Engine([], mps_oversubscription=0.5)


def test_mps_and_fastpod_do_not_mix_on_one_gpu():
    eng = Engine([node("n", n_gpus=1)])
    assert eng.place(Request("a", "mps", gpu_memory_mib=1000))
    rej = eng.place(fastpod("b"))
    assert not rej and "available for fastpod shares" in rej.reason


def test_exclusive_takes_smallest_profile_and_explicit_placement():
    eng = Engine([node("n", n_gpus=1)])
    a = eng.place(Request("a", "exclusive", sm_count=20))
    assert a and a.mig.profile_name == "2g.10gb" and a.enable_mig
    b = eng.place(Request("b", "exclusive", gpu_memory_mib=4000))
    assert b and b.mig.profile_name == "1g.5gb" and not b.enable_mig
    assert b.mig.start != a.mig.start


def test_exclusive_100_percent_only_where_a_slice_has_all_the_sms():
    """A100's largest slice has 98 of its 108 SMs; H100's 7g.80gb has all 132 (GPU-FACTS)."""
    rej = Engine([node("n", n_gpus=1)]).place(Request("a", "exclusive", sm_percent=100))
    assert not rej and "108 SMs" in rej.reason and "7g.40gb (98 SMs" in rej.reason and "'whole'" in rej.reason
    a = Engine([node("h", n_gpus=1, key="H100-SXM5-80GB")]).place(Request("a", "exclusive", sm_percent=100))
    assert a and a.mig.profile_name == "7g.80gb" and a.mig.sm_count == 132


@pytest.mark.parametrize("sizes", [(14, 56), (14, 14, 42), (14, 14, 14, 56), (28, 42, 14),
                                   (42, 14, 14, 14, 14)])
def test_exclusive_placement_keeps_room_for_larger_slices(sizes):
    """Small slices go where they rule out the fewest later combinations, so a 3g or a 4g
    still fits after them (placing a 1g at start 0 would rule out the 4g)."""
    eng = Engine([node("n", n_gpus=1)])
    for k, sms in enumerate(sizes):
        assert eng.place(Request(f"r{k}", "exclusive", sm_count=sms)), (k, eng.usage())


def test_mig_gpu_takes_no_mps_share_and_shared_gpu_takes_no_slice():
    eng = Engine([node("n", n_gpus=1)])
    assert eng.place(Request("a", "exclusive", sm_count=14))
    rej = eng.place(fastpod("b"))
    assert not rej and "available for fastpod shares" in rej.reason
    eng2 = Engine([node("n", n_gpus=1)])
    assert eng2.place(fastpod("a"))
    assert not eng2.place(Request("b", "exclusive", sm_count=14))


def test_exclusive_on_non_mig_model_is_rejected():
    eng = Engine([node("n", n_gpus=1, key="T4")])
    rej = eng.place(Request("a", "exclusive", sm_count=10))
    assert not rej and "MIG-capable" in rej.reason


def test_whole_prefers_tightest_link_group():
    links = {(0, 1): 1, (2, 3): 1, (0, 2): 3, (0, 3): 3, (1, 2): 3, (1, 3): 3}
    eng = Engine([node("n", n_gpus=4, links=links)])
    assert eng.place(fastpod("s", 10, 100))  # lands on GPU 0 (least free that fits: all equal -> 0)
    a = eng.place(Request("w", "whole", gpus=2))
    assert a and a.gpus == (2, 3)
    assert tightest_group(eng.nodes[0], [0, 1, 2, 3], 2) == (0, 1)


def test_links_count_whichever_way_round_the_pair_is_given():
    """NVML reports a level for (a, b) and (b, a); a pair given high index first was ignored
    (read as the farthest level), so the tightest group was missed."""
    links = {(1, 0): 0, (2, 1): 5, (2, 0): 5}
    view = node("n", n_gpus=3, links=links)
    assert view.link_level(0, 1) == 0 and view.link_level(1, 0) == 0
    assert tightest_group(view, [0, 1, 2], 2) == (0, 1)
    assert NodeView.from_dict(view.to_dict()) == view
    with pytest.raises(InvalidRequest, match=r"links: GPU pair \(0, 0\)"):
        node("m", n_gpus=2, links={(0, 0): 0})
    with pytest.raises(InvalidRequest, match=r"links: GPU pair \(0, 5\)"):
        node("m", n_gpus=2, links={(0, 5): 0})


def test_whole_rejection_counts_idle_gpus():
    eng = Engine([node("node-1", n_gpus=2)])
    rej = eng.place(Request("w", "whole", gpus=3))
    assert not rej and rej.reason == "no node has 3 idle GPU(s); most idle GPUs on one node is 2 on node-1"
    for i in range(2):   # a share on each GPU (two do not fit one)
        assert eng.place(Request(f"s{i}", "fastpod", sm_percent=60, gpu_memory_mib=1024))
    rej = eng.place(Request("w2", "whole", gpus=2))   # not even one: say so
    assert not rej
    assert rej.reason == "no node has 2 idle GPU(s); none of the 1 node(s) looked at has an idle GPU"


def test_node_cpu_memory_selector_and_models():
    eng = Engine([node("a", cpu=4000, labels={"zone": "x"}), node("b", key="T4", labels={"zone": "y"})])
    rej = eng.place(fastpod("p", cpu_milli=8000, node_selector={"zone": "x"}))
    assert not rej and "1 node(s) do not match node_selector" in rej.reason and "4000 on a" in rej.reason
    p = eng.place(fastpod("q", gpu_models=("T4",)))
    assert p and p.node == "b"
    assert eng.place(fastpod("r", node_selector={"zone": "x"})).node == "a"
    rej = eng.place(fastpod("s", memory_mib=10**7))
    assert not rej and "host memory" in rej.reason


def test_affinity_anti_affinity_exclusion():
    eng = Engine([node("n", n_gpus=4)])
    a = eng.place(fastpod("a", affinity="team"))
    b = eng.place(fastpod("b", affinity="team"))
    assert a.gpus == b.gpus
    c = eng.place(fastpod("c", anti_affinity="x"))
    d = eng.place(fastpod("d", anti_affinity="x"))
    assert c.gpus != d.gpus
    e = eng.place(fastpod("e", exclusion="secret"))
    assert e and e.gpus[0] not in {a.gpus[0], c.gpus[0], d.gpus[0]}  # only the idle GPU takes it
    assert eng.place(fastpod("f", exclusion="secret")).gpus == e.gpus
    rej = eng.place(fastpod("g", exclusion="other", sm=90))
    assert not rej


def test_release_restores_and_unknown_release_raises():
    eng = Engine([node("n", n_gpus=2)])
    before = eng.usage()
    a = eng.place(fastpod("a"))
    eng.release(a)
    assert eng.usage() == before
    with pytest.raises(KeyError):
        eng.release("nope")


def test_round_trip_through_dicts_and_restore():
    eng = Engine([node("n1", n_gpus=3), node("n2", n_gpus=1)])
    for r in (fastpod("a"), Request("b", "exclusive", sm_count=14), Request("c", "whole", gpus=1),
              Request("d", "mps", gpu_memory_mib=100)):
        assert eng.place(r), r.id
    snap = eng.to_dict()
    again = Engine.from_dict(snap)
    assert again.usage() == eng.usage()
    assert {k: v.to_dict() for k, v in again.assignments.items()} == {
        k: v.to_dict() for k, v in eng.assignments.items()}
    a = eng.assignments["a"]
    assert Assignment.from_dict(a.to_dict()) == a
    with pytest.raises(InvalidRequest, match="already placed"):
        again.restore(a)


def test_restore_refuses_what_no_longer_fits():
    eng = Engine([node("n", n_gpus=1)])
    a = eng.place(fastpod("a", 80))
    other = Engine([node("n", n_gpus=1)])
    assert other.place(fastpod("x", 50))
    with pytest.raises(InvalidRequest, match="SMs free"):
        other.restore(a)


def test_policies_by_name():
    for name in ("random", "dotprod", "gpuclustering", "gpupacking", "bestfit", "fastshare"):
        eng = Engine([node("n", n_gpus=2)], policy=make_policy(name))
        assert eng.place(fastpod("a")), name
    with pytest.raises(InvalidRequest, match="policy: must be one of"):
        make_policy("magic")


def test_gpuclustering_scores_nodes_by_the_task_shapes_they_hold():
    """GpuClustering keeps tasks of one shape ("share", "N-gpu") together: a node scores
    higher for a shape it holds alone, lower when it holds other shapes. The engine showed the
    policy every node as holding none, so a share went next to a whole-GPU job (the fuller
    node) instead of onto an empty node, unlike the trace replay. A release takes a node's tag
    away only with the last request of that shape there, and a restored engine holds the tags
    of its assignments. (Scores here: fill = 25 * (8000 - free milli) // 8000, plus 75 for a
    node holding only the task's shape, 50 for one holding it among others, 25 for an empty one.)"""
    policy = make_policy("gpuclustering")
    eng = Engine([node("a", n_gpus=4), node("b", n_gpus=4)], policy=policy)
    assert eng.place(Request("w", "whole", gpus=1)).node == "a"   # both empty: the first node
    assert eng.place(fastpod("s1", 20)).node == "b"   # a: 15 (holds 1-gpu), b: 12 + 25 (empty)
    assert eng.place(fastpod("s2", 20)).node == "b"   # b: 13 + 75 (holds only shares)
    assert eng.place(Request("w2", "whole", gpus=1)).node == "a"

    eng = Engine([node("a", n_gpus=4), node("b", n_gpus=4)], policy=policy)
    eng.restore(Assignment(Request("w", "whole", gpus=1), "a", (0,)))
    eng.restore(Assignment(fastpod("x", 20), "a", (1,)))
    eng.restore(Assignment(fastpod("y", 20), "a", (1,)))
    eng.release("x")   # y still holds a share on a
    assert eng.place(fastpod("s", 20)).node == "a"   # a: 16 + 50 (1-gpu and share), b: 12 + 25
    eng.release("w")   # the last 1-gpu task on a
    again = Engine.from_dict(eng.to_dict(), policy=make_policy("gpuclustering"))
    for e in (eng, again):
        assert e.place(Request("w2", "whole", gpus=1)).node == "b"   # a: 13 (holds shares only)


def test_gpuclustering_tells_nodes_alike_but_for_the_shapes_they_hold_apart():
    """Nodes in the same state share cached answers and scores: two nodes whose GPUs are held
    alike, one by a 2-GPU job and one by two 1-GPU jobs, must still score apart for a policy
    that weighs the shapes a node holds (a cached answer would send the next 1-GPU job to the
    empty node instead of next to the other 1-GPU jobs)."""
    eng = Engine([node(name, n_gpus=4) for name in "abc"], policy=make_policy("gpuclustering"))
    assert eng.place(Request("d", "whole", gpus=2)).node == "a"
    assert eng.place(Request("u1", "whole", gpus=1)).node == "b"   # a: 18 (holds 2-gpu), b: 12 + 25
    assert eng.place(Request("u2", "whole", gpus=1)).node == "b"   # b: 15 + 75
    assert eng.place(Request("u3", "whole", gpus=1)).node == "b"   # a: 18, b: 18 + 75, c: 12 + 25
    assert eng.place(Request("d2", "whole", gpus=2)).node == "a"   # a: 18 + 75


@pytest.mark.parametrize("held", [
    Request("m", "mps", gpu_memory_mib=4096),
    Request("e", "exclusive", sm_count=14),
])
def test_gpuclustering_counts_mps_shares_and_mig_slices_as_shares(held):
    """An MPS share or a MIG slice is a fraction of a GPU, as a fastpod share is: GpuClustering
    keeps whole-GPU jobs off the node holding one (as it would off a node holding fastpod shares)."""
    eng = Engine([node("a", n_gpus=4), node("b", n_gpus=4)], policy=make_policy("gpuclustering"))
    assert eng.place(held).node == "a"
    assert eng.place(Request("w", "whole", gpus=1)).node == "b"   # a: 15 (holds a share), b: 12 + 25
    assert eng.place(fastpod("s", 20)).node == "a"   # a: 15 + 75, b: 15 (holds 1-gpu)


def test_fractional_sm_shares_round_up_to_the_ledger_step():
    """SM shares are kept in 0.1 % steps; a share that rounded down could take 0 steps (and
    then "fit" a GPU held whole) or let three 33.34 % shares add up to 100.02 %."""
    eng = Engine([node("n", n_gpus=2)])
    assert eng.place(Request("w", "whole", gpus=1))
    tiny = eng.place(fastpod("tiny", 0.04, 100))
    assert tiny and tiny.gpus == (1,)  # never the GPU held whole
    assert [u["sm_used_percent"] for u in eng.usage()] == [0, 0.1]
    eng = Engine([node("n", n_gpus=1)])
    assert eng.place(fastpod("a", 33.34)) and eng.place(fastpod("b", 33.34))
    rej = eng.place(fastpod("c", 33.34))
    assert not rej and "33.2 % on n GPU 0" in rej.reason


def test_rejection_names_nodes_ruled_out_by_cpu_memory_or_selector():
    """When some nodes pass the CPU/memory/selector filter and their GPUs are full, the
    reason also names the nodes the filter dropped: the idle GPU on a node short of CPU is
    not "no GPU free"."""
    x = {"zone": "x"}
    eng = Engine([node("a", n_gpus=1, labels=x), node("b", n_gpus=1, cpu=1000, labels=x),
                  node("c", n_gpus=1, mem=1024, labels=x), node("d", n_gpus=1, labels={"zone": "y"})])
    ask = {"cpu_milli": 2000, "memory_mib": 2048, "node_selector": x}
    assert eng.place(fastpod("x", 80, **ask)).node == "a"
    for r in (fastpod("y", 80, **ask), Request("z", "whole", **ask),
              Request("e", "exclusive", sm_count=14, **ask)):
        rej = eng.place(r)
        assert not rej, r
        assert "1 node(s) lack 2000 milli-CPU; most free is 1000 on b" in rej.reason, rej.reason
        assert "1 node(s) lack 2 GiB host memory; most free is 1 GiB on c" in rej.reason, rej.reason
        assert "1 node(s) do not match node_selector {'zone': 'x'}" in rej.reason, rej.reason


def test_rejection_blames_tags_not_capacity_when_tags_rule_out_a_gpu_with_room():
    """A GPU with room that only the sharing tags rule out is named with the tag, also when
    the tag belongs to the sharers already there (the new request carries none)."""
    eng = Engine([node("n", n_gpus=1)])
    assert eng.place(fastpod("a", 10, exclusion="secret"))
    rej = eng.place(fastpod("b", 10))
    assert not rej and not rej.reason.startswith("no GPU with"), rej.reason
    assert "n GPU 0 (exclusion tags differ)" in rej.reason
    assert eng.place(fastpod("c", 10, exclusion="secret", anti_affinity="x"))
    rej = eng.place(fastpod("d", 10, exclusion="secret", anti_affinity="x"))
    assert not rej and "n GPU 0 (anti-affinity x already on it)" in rej.reason
    two = Engine([node("n", n_gpus=2)])
    assert two.place(fastpod("a", 90, affinity="team"))
    rej = two.place(fastpod("b", 20, affinity="team"))
    assert not rej and "affinity tag 'team' binds it to n GPU 0" in rej.reason
    assert "largest free SM share is 10 % on n GPU 0" not in rej.reason  # GPU 1 has 100 %


def test_oversubscription_never_promises_one_mps_share_more_than_the_gpu_has():
    """Oversubscription lets the shares on a GPU add up to more than its memory; one share
    larger than the whole device could never get what it was promised."""
    eng = Engine([node("n", n_gpus=1)], mps_oversubscription=2.0)
    rej = eng.place(Request("big", "mps", gpu_memory_mib=60 * 1024))
    assert not rej and "no GPU has 60 GiB of memory; the largest is 40 GiB (n GPU 0)" in rej.reason, rej
    assert eng.place(Request("a", "mps", gpu_memory_mib=40 * 1024))
    assert eng.place(Request("b", "mps", gpu_memory_mib=40 * 1024))
    mixed = Engine([node("a100", n_gpus=1), node("h100", n_gpus=1, key="H100-SXM5-80GB")],
                   mps_oversubscription=2.0)
    assert mixed.place(Request("big", "mps", gpu_memory_mib=60 * 1024)).node == "h100"


def test_rejection_does_not_invent_busy_gpus_when_the_nodes_looked_at_have_none_of_the_model():
    eng = Engine([node("a", key="T4", labels={"zone": "x"}), node("b", labels={"zone": "y"})])
    rej = eng.place(fastpod("p", gpu_models=("T4",), node_selector={"zone": "y"}))
    assert not rej and "MIG mode" not in rej.reason, rej.reason
    assert rej.reason.startswith("no GPU of model T4 on the 1 node(s) looked at"), rej.reason


def test_selector_and_labels_given_as_pairs_round_trip():
    r = fastpod("a", node_selector=[("zone", "x"), ("rack", "1")])
    assert Request.from_dict(r.to_dict()) == r
    v = node("n", n_gpus=1)
    v = NodeView(v.name, v.cpu_milli, v.memory_mib, v.gpus, [("zone", "x"), ("rack", "1")])
    assert NodeView.from_dict(v.to_dict()) == v
    eng = Engine([v])
    a = eng.place(r)
    assert Engine.from_dict(eng.to_dict()).assignments == {"a": a}


def _with_layout(layout: tuple[tuple[int, int, int], ...]) -> NodeView:
    """One A100 in MIG mode carrying ``layout`` (profile id, start, memory slices) made outside
    the engine, e.g. by the Ansible mig_config module."""
    v = node("n", n_gpus=1).gpus[0]
    gpu = GpuView(v.index, v.model, v.memory_mib, v.sm_count, True, True, v.mig_profiles, mig_unheld=layout)
    return NodeView("n", 64000, 262144, (gpu,))


def test_exclusive_takes_a_slice_of_a_static_layout_and_never_overlaps_one():
    """A100 ids: 9 = 3g.20gb (4 memory slices). The layout is two 3g.20gb at 0 and 4, which
    fill the GPU: requests take them as they are (a small one too: no smaller slice fits
    beside them), and nothing is created over them."""
    eng = Engine([_with_layout(((9, 0, 4), (9, 4, 4)))])
    a = eng.place(Request("a", "exclusive", sm_count=42))
    assert a and (a.mig.profile_name, a.mig.start) == ("3g.20gb", 0) and not a.enable_mig
    small = eng.place(Request("small", "exclusive", sm_count=14))
    assert small and (small.mig.profile_name, small.mig.start) == ("3g.20gb", 4)
    rej = eng.place(Request("c", "exclusive", sm_count=14))
    assert not rej and "no MIG-capable GPU has a free placement" in rej.reason
    eng.release("a")
    again = eng.place(Request("again", "exclusive", sm_count=42))
    assert again and again.mig.start == 0


@pytest.mark.parametrize(("key", "media", "plain", "sms", "fill"), [
    ("A30-24GB", "2g.12gb+me", "2g.12gb", 28, 2),
    ("A100-SXM4-40GB", "1g.5gb+me", "1g.5gb", 14, 7),
])
def test_a_media_slice_of_a_static_layout_is_kept_for_requests_naming_it(key, media, plain, sms, fill):
    """A +me slice laid out by hand (mig_config) on GPU 0 is taken by a request that does not
    name it only when no plain slice can be had anywhere: while GPU 1 can make one, the media
    engines stay free for the request that names them."""
    m = catalog.get_model(key)
    me = m.profile(media)
    gpus = (GpuView(0, m.key, m.memory_mib, m.sm_count, True, True, m.profiles,
                    mig_unheld=((me.profile_id, 0, me.memory_slices),)),
            GpuView(1, m.key, m.memory_mib, m.sm_count, True, True, m.profiles))
    eng = Engine([NodeView("n", 64000, 262144, gpus)])
    placed = [eng.place(Request(f"p{i}", "exclusive", sm_count=sms)) for i in range(2 * fill - 1)]
    assert all(placed) and all(a.mig.profile_name == plain for a in placed), placed
    named = eng.place(Request("m", "exclusive", sm_count=sms, mig_profile=media))
    assert named and (named.gpus, named.mig.profile_name, named.mig.start) == ((0,), media, 0), named
    eng.release("m")
    last = eng.place(Request("last", "exclusive", sm_count=sms))    # no plain slice left anywhere
    assert last and (last.gpus, last.mig.profile_name) == ((0,), media), last


def test_new_slices_go_around_a_static_layout():
    eng = Engine([_with_layout(((9, 4, 4),))])        # one 3g.20gb at 4, slices 0-3 free
    small = eng.place(Request("small", "exclusive", sm_count=14))
    assert small and small.mig.profile_name == "1g.5gb" and small.mig.start < 4
    view = eng.to_dict()
    assert Engine.from_dict(view).to_dict() == view


def test_new_slices_go_around_an_instance_of_a_profile_fastshare_does_not_know():
    """An instance whose profile id is not among the GPU's profiles (the controller takes them
    from fastshare's catalog; a newer driver offers more, and one may be made by hand): the
    measure of future shapes looked its profile up and raised KeyError, so every exclusive
    request that reached that GPU failed inside the engine. Its memory slices count as taken,
    and its size stands in for its compute slices, as where free placements are found."""
    eng = Engine([_with_layout(((99, 0, 1),))])
    small = eng.place(Request("small", "exclusive", sm_count=14))
    assert small and small.mig.profile_name == "1g.5gb" and small.mig.start != 0, small
    assert eng.place(Request("big", "exclusive", sm_count=42)).mig.start == 4


def test_whole_rejection_names_empty_gpus_in_mig_mode():
    """An empty GPU in MIG mode is not idle for a whole request; the reason must say so rather
    than leave the user wondering why an empty GPU is not counted."""
    rej = Engine([_with_layout(())]).place(Request("w", "whole", gpus=1))
    assert not rej and "1 empty GPU(s) are in MIG mode" in rej.reason
    rej = Engine([_with_layout(((9, 0, 4),))]).place(Request("w", "whole", gpus=1))
    assert not rej and "MIG mode" not in rej.reason      # not empty: a layout slice is on it


def test_nodes_the_caller_excludes_are_skipped_and_named_with_the_reason():
    eng = Engine([node("a", n_gpus=1), node("b", n_gpus=1), node("c", n_gpus=1)])
    excluded = {"a": "have taint k=v:NoSchedule that tolerations does not tolerate",
                "b": "do not match the required node affinity"}
    assert eng.place(fastpod("p", 30), excluded).node == "c"
    rej = eng.place(fastpod("q", 30), {**excluded, "c": "do not match the required node affinity"})
    assert not rej
    assert "2 node(s) do not match the required node affinity (b, c)" in rej.reason, rej.reason
    assert "1 node(s) have taint k=v:NoSchedule that tolerations does not tolerate (a)" in rej.reason
    # the GPUs are full where the caller lets it go: the reason also says why the rest was skipped
    rej = eng.place(fastpod("r", 80), {"a": "are cordoned", "b": "are cordoned"})
    assert not rej and "only 1 of 3 node(s) were looked at: 2 node(s) are cordoned (a, b)" in rej.reason


def test_capacity_may_shrink_below_what_assignments_hold_without_dropping_them():
    """Others (Pods the engine does not place) took the host's CPU: what the engine placed
    stays, the node takes no more CPU, but a request for no CPU still fits (as in Kubernetes)."""
    eng = Engine([node("a", n_gpus=2, cpu=4000, mem=8192)])
    placed = eng.place(fastpod("p", 30, cpu_milli=3000, memory_mib=4096))
    assert placed
    eng.set_capacity("a", 1000, 1024)
    assert "p" in eng.assignments
    rej = eng.place(fastpod("q", 30, cpu_milli=100))
    assert not rej and "lack 100 milli-CPU; most free is 0 on a" in rej.reason, rej.reason
    assert eng.place(fastpod("r", 30))   # asks no CPU or memory
    eng.set_capacity("a", 8000, 8192)
    assert eng.place(fastpod("s", 30, cpu_milli=4000, memory_mib=1024)).node == "a"
    with pytest.raises(InvalidRequest, match="lacks CPU/memory"):
        Engine([node("b", cpu=1000)]).restore(placed.__class__(placed.request, "b", (0,)))
    lenient = Engine([node("a", cpu=1000)])
    lenient.restore(placed, check_host=False)
    assert "p" in lenient.assignments


def test_fastpod_time_quota_requests_never_exceed_one_per_gpu():
    # The node agent admits fastpod shares only while their quota requests add up to at most
    # 1 per GPU; the engine packed by SMs alone and chose a GPU the agent refuses, while
    # another GPU was idle (the controller then rejected the request).
    eng = Engine([node("n", n_gpus=2)], policy=make_policy("bestfit"))
    a = eng.place(fastpod("a", 60, quota_request=0.6))
    b = eng.place(fastpod("b", 40, quota_request=0.6))
    assert a and b and a.gpus != b.gpus
    assert eng.place(fastpod("c", 40, quota_request=0.4)).gpus == a.gpus
    rej = eng.place(fastpod("d", 10, quota_request=0.5))
    assert not rej and rej.reason.startswith("no GPU with 10 % SMs, 4 GiB and 0.5 time quota free")
    assert "largest free time quota is 0.40 on n GPU 1" in rej.reason
    eng.release("c")
    assert eng.place(fastpod("d", 10, quota_request=0.4)).gpus == a.gpus


def test_mps_rejection_names_the_most_one_share_can_get_under_oversubscription():
    """With oversubscription a GPU's free promise can exceed its memory, but one share never
    gets more than the device has: the figure named must be what the request could get."""
    eng = Engine([node("a100", n_gpus=1), node("h100", n_gpus=1, key="H100-SXM5-80GB")],
                 mps_oversubscription=2.0)
    assert eng.place(Request("h1", "mps", gpu_memory_mib=75 * 1024)).node == "h100"
    assert eng.place(Request("h2", "mps", gpu_memory_mib=75 * 1024)).node == "h100"
    rej = eng.place(Request("x", "mps", gpu_memory_mib=45 * 1024))   # the A100 has 40 GiB
    assert not rej
    assert "largest free memory is 40 GiB on a100 GPU 0" in rej.reason, rej.reason  # not 80


@pytest.mark.parametrize("kind, gpus, why", [
    ("fastpod", (0, 0), r"gpus: a fastpod assignment holds exactly 1 GPU\(s\)"),
    ("fastpod", (), r"gpus: a fastpod assignment holds exactly 1 GPU\(s\)"),
    ("whole", (0,), r"gpus: a whole assignment holds exactly 2 GPU\(s\) \(assignment a lists \[0\]\)"),
    ("whole", (1, 1), "gpus: GPU 1 appears twice"),
])
def test_restore_refuses_an_assignment_whose_gpus_do_not_match_its_request(kind, gpus, why):
    """A persisted assignment is input: one GPU listed twice counted a share twice (and its
    release then failed half-way), a whole request restored on fewer GPUs than it asked."""
    eng = Engine([node("n", n_gpus=2)])
    r = fastpod("a") if kind == "fastpod" else Request("a", "whole", gpus=2)
    before = eng.usage()
    with pytest.raises(InvalidRequest, match=why):
        eng.restore(Assignment(r, "n", gpus))
    assert eng.usage() == before and not eng.assignments


def test_releasing_a_stale_assignment_leaves_the_current_one_alone():
    """release(assignment) gives back what that placement took: an Assignment already released,
    whose id was placed again elsewhere since, must not release the new placement."""
    eng = Engine([node("n", n_gpus=2)])
    old = eng.place(fastpod("a", 40))
    eng.release(old)
    new = eng.place(fastpod("a", 40, mem=8192))
    assert new and new != old
    held = eng.usage()
    with pytest.raises(KeyError, match="released already"):
        eng.release(old)
    assert eng.usage() == held and eng.assignments["a"] == new
    with pytest.raises(KeyError, match="request nope is not placed"):
        eng.release("nope")


def test_shares_skip_gpus_that_cannot_run_mps_and_the_rejection_says_why():
    """A GPU whose node cannot run MPS (``no_mps``) takes no fastpod or mps share; exclusive MIG
    slices and whole GPUs, which need no MPS daemon, still go there."""
    why = "MPS control binary /usr/bin/nvidia-cuda-mps-control not found"
    blocked = NodeView("blocked", 64000, 262144, tuple(dataclasses.replace(g, no_mps=why)
                                                       for g in node("x").gpus))
    eng = Engine([blocked, node("ok", n_gpus=1)])
    share = eng.place(fastpod("a", 50))
    assert isinstance(share, Assignment) and share.node == "ok"
    rej = eng.place(Request("m", "mps", gpu_memory_mib=1024))
    assert isinstance(rej, Rejection)
    assert "the others are" in rej.reason and f"node blocked cannot run MPS: {why}" in rej.reason
    only_blocked = Engine([blocked])
    rej = only_blocked.place(fastpod("b", 10))
    assert isinstance(rej, Rejection) and "the others" not in rej.reason and why in rej.reason
    slice_ = Request("e", "exclusive", sm_count=14, gpu_memory_mib=4096)
    assert isinstance(only_blocked.place(slice_), Assignment)
    assert isinstance(only_blocked.place(Request("w", "whole", gpus=1)), Assignment)


def test_a_named_mig_profile_no_gpu_has_is_refused_naming_the_profile_and_the_models():
    """It was refused in SMs and memory ("no MIG profile has 0 SMs ..."), words for a size
    request, not for a profile the user named."""
    eng = Engine([node("n", n_gpus=1, key="A100-SXM4-40GB")])
    rej = eng.place(Request("e", "exclusive", sm_count=1, mig_profile="4g.40gb"))
    assert isinstance(rej, Rejection)
    assert "4g.40gb slice" in rej.reason and "A100-SXM4-40GB" in rej.reason and "SMs and memory" in rej.reason


def test_an_assignment_names_its_gpus_by_uuid_and_is_never_restored_on_another_gpu():
    """Indexes shift when a GPU leaves a node; an assignment carries its GPUs' UUIDs (persisted,
    absent from what earlier versions wrote), and restore refuses one whose index now names
    another GPU instead of counting it there."""
    view = dataclasses.replace(node("n", n_gpus=2), gpus=tuple(
        dataclasses.replace(g, uuid=f"GPU-{g.index}") for g in node("n", n_gpus=2).gpus))
    eng = Engine([view])
    a = eng.place(Request("a", "whole", gpus=2))
    assert a.gpu_uuids == tuple(view.gpus[i].uuid for i in a.gpus)
    assert Assignment.from_dict(a.to_dict()) == a
    anonymous = Engine([node("n", n_gpus=2)]).place(Request("a", "whole", gpus=1))
    assert anonymous.gpu_uuids == () and "gpu_uuids" not in anonymous.to_dict()
    with pytest.raises(InvalidRequest, match="gpu_uuids: must name each of the 1 GPU"):
        Assignment(fastpod("x"), "n", (0,), gpu_uuids=("GPU-0", "GPU-1"))

    other = Engine([view])
    with pytest.raises(InvalidRequest, match="GPU 1 of n is GPU-1, not the GPU-9 assignment b holds"):
        other.restore(Assignment(fastpod("b"), "n", (1,), gpu_uuids=("GPU-9",)))
    assert not other.assignments and other.usage() == Engine([view]).usage()
    other.restore(Assignment(fastpod("b"), "n", (1,)))   # no UUIDs (an earlier version's): by index
    assert other.assignments["b"].gpus == (1,)


def _changed(view: NodeView, **gpu_changes) -> NodeView:
    """The node's view after something outside fastshare changed its GPU 0."""
    return dataclasses.replace(view, gpus=(dataclasses.replace(view.gpus[0], **gpu_changes), *view.gpus[1:]))


@pytest.mark.parametrize("held, changes, oversub, why", [
    ([fastpod("a", 50)], {"mig_enabled": True}, 1.0, "in MIG mode (MPS shares need the whole device)"),
    ([Request("a", "whole", gpus=1)], {"mig_enabled": True}, 1.0, "in MIG mode"),
    ([fastpod("a", 50, mem=30000)], {"memory_mib": 20480}, 1.0, "only 20 GiB free"),
    ([Request("a", "mps", gpu_memory_mib=30000), Request("b", "mps", gpu_memory_mib=30000)], {}, 1.0,
     "MPS shares may promise 1 x its 40 GiB"),
    ([fastpod("a", 50)], {"no_mps": "MPS control binary not found"}, 1.0, "MPS control binary not found"),
])
def test_forced_restore_counts_a_held_share_that_no_longer_fits_until_released(held, changes, oversub, why):
    """A share held on a GPU whose view changed under it (MIG mode turned on by hand, less memory
    reported, the oversubscription factor lowered at a restart, MPS gone from the node) was refused
    by restore, so the controller left it out and the GPU was offered as free. Restored with
    ``force`` it is counted (the GPU is over-committed and takes nothing new), restore says why,
    and releasing it gives back exactly what it took."""
    before = Engine([node("n", n_gpus=1)], mps_oversubscription=2.0)
    placed = [before.place(r) for r in held]
    assert all(placed), placed
    after = Engine([_changed(node("n", n_gpus=1), **changes)], mps_oversubscription=oversub)
    empty = after.usage()
    problems = [after.restore(a, force=True) for a in placed]
    assert problems[-1] is not None and why in problems[-1] and "n GPU 0" in problems[-1], problems
    strict = Engine([_changed(node("n", n_gpus=1), **changes)], mps_oversubscription=oversub)
    for a in placed[:-1]:
        strict.restore(a)
    with pytest.raises(InvalidRequest, match=r"assignment (a|b)"):   # without force: refused
        strict.restore(placed[-1])
    assert set(after.assignments) == {a.request.id for a in placed}
    for r in (fastpod("x", 1, mem=1), Request("y", "mps", gpu_memory_mib=1), Request("z", "whole", gpus=1),
              Request("e", "exclusive", sm_count=14)):
        assert not after.place(r), r
    for a in reversed(placed):
        after.release(a)
    assert after.usage() == empty and not after.assignments
    assert after.place(Request("w", "whole", gpus=1) if not changes.get("mig_enabled")
                       else Request("e", "exclusive", sm_count=14))


def test_forced_restore_still_refuses_what_cannot_be_counted():
    """Force counts a share beside a changed view, never two holders that exclude each other
    (the engine has one whole holder and one share kind per GPU) nor a GPU that is not there."""
    eng = Engine([node("n", n_gpus=1)])
    assert eng.place(Request("w", "whole", gpus=1))
    for a, match in ((Assignment(fastpod("a"), "n", (0,)), "held whole by w"),
                     (Assignment(Request("v", "whole", gpus=1), "n", (0,)), "held whole by w"),
                     (Assignment(fastpod("a"), "n", (1,)), "has no GPU 1"),
                     (Assignment(fastpod("a"), "m", (0,)), "not in the cluster view")):
        with pytest.raises(InvalidRequest, match=match):
            eng.restore(a, force=True)
    eng.release("w")
    assert eng.place(Request("m", "mps", gpu_memory_mib=10))
    with pytest.raises(InvalidRequest, match="shared as mps"):
        eng.restore(Assignment(fastpod("a"), "n", (0,)), force=True)


def test_a_held_slice_overlapped_by_a_foreign_instance_is_over_committed_and_that_instance_not_offered():
    """A held 3g.20gb at slice 4 whose instance was destroyed by hand and a 1g.5gb (id 19) laid
    out at slice 5 in its place: restoring the held slice found nothing wrong (only the other
    held slices were looked at), and the foreign 1g.5gb was offered as a ready slice to the next
    small request, on top of the held one. Now the restore says why the slice does not fit
    (naming the foreign instance) and new slices go beside both."""
    held = Engine([_with_layout(())]).place(Request("held", "exclusive", sm_count=42))
    assert held and held.mig.start == 4
    eng = Engine([_with_layout(((19, 5, 1),))])
    why = eng.restore(held, force=True)
    assert why and "3g.20gb at memory slice 4 on n GPU 0 overlaps a 1g.5gb at memory slice 5" in why, why
    assert "destroy it" in why
    small = eng.place(Request("small", "exclusive", sm_count=14))
    assert small and small.mig.start < 4, small
    # its own instance, not yet shown as held, is no foreign one
    assert Engine([_with_layout(((9, 4, 4),))]).restore(held, force=True) is None


class _Unmemoized(Engine):
    """The engine scoring every node afresh on every decision (as before its node memos, shape
    heaps, scores remembered by node state, GPU answers remembered by GPU state and rejections
    remembered)."""

    def place(self, request, excluded=None):
        for n in self._nodes.values():   # (what exclusive requests keep per node, too)
            n.memo.clear()
        return super().place(request, excluded)

    def _memo_key(self, r):
        return None

    def _rejection_seen(self, request, excluded):
        return None

    def _policy_score(self, model, cpu_left, free, task, tags=frozenset()):
        return self.policy.score(model, cpu_left, free, task, tags)[0]

    def _gpu_answers(self, r, n):
        return [self._gpu_answer(r, g, n.view.name) for g in n.gpus]


def _walk_alike(engines: tuple[Engine, Engine], rng, steps: int, release: float, resize: float,
                nodes: list[str], capacities: Callable[[], tuple[int, int]],
                request: Callable[[int], Request]) -> int:
    """Random steps on two engines over the same nodes: release a held request (probability
    ``release``), change a node's host CPU and memory (``resize``), or place ``request(k)``;
    both answer every step alike, and end holding the same. Returns the rejections."""
    held: list[str] = []
    rejected = 0
    for k in range(steps):
        step = rng.random()
        if step < release and held:
            rid = held.pop(rng.randrange(len(held)))
            for eng in engines:
                eng.release(rid)
            continue
        if step < release + resize:
            name, (cpu, mem) = rng.choice(nodes), capacities()
            for eng in engines:
                eng.set_capacity(name, cpu, mem)
            continue
        r = request(k)
        got = engines[0].place(r)
        assert got == engines[1].place(r), k
        if got:
            held.append(r.id)
        else:
            rejected += 1
    assert engines[0].usage() == engines[1].usage()
    return rejected


def test_node_memos_change_no_decision_through_releases_tags_and_capacity_changes():
    """Each node remembers its answer per request shape until it changes; a stale answer (a
    release, a capacity change or an affinity binding not taken into account) would place a
    request elsewhere than scoring every node afresh does, or reject it."""
    import random

    rng = random.Random(5)
    views = [node(f"n{i}", n_gpus=rng.choice([1, 2, 4]), cpu=rng.choice([8000, 16000]))
             for i in range(8)]

    def request(k: int) -> Request:
        tags = {"affinity": rng.choice([None, None, "a", "b"]), "anti_affinity": rng.choice([None, "x"]),
                "exclusion": rng.choice([None, None, None, "e"])}
        if rng.random() < 0.8:
            return Request(f"r{k}", "fastpod", sm_percent=rng.choice([10, 30, 50, 70]), gpu_memory_mib=2048,
                           quota_request=0.2, quota_limit=0.5, cpu_milli=rng.choice([500, 1000, 2000]),
                           **tags)
        return Request(f"r{k}", "whole", gpus=rng.choice([1, 2]), cpu_milli=1000)

    _walk_alike((Engine(views), _Unmemoized(views)), rng, 600, 0.3, 0.05, [v.name for v in views],
                lambda: (rng.choice([4000, 8000, 16000]), 64 * 1024), request)


@pytest.mark.parametrize("seed, policy, small", [
    (1, "fastshare", False), (2, "fastshare", False), (3, "fastshare", False),
    (4, "fastshare", True), (5, "fgd", True), (6, "bestfit", False), (7, "gpupacking", True),
    (8, "gpuclustering", False), (9, "gpuclustering", True),
])
def test_shape_heaps_place_as_looking_at_every_node(seed, policy, small, monkeypatch):
    """Decisions and rejections through the per-shape heaps (only the nodes changed since a
    shape was last asked for are scored again; nodes in the same state share answers and
    rejection summaries; a rejection is given again until a node changes) equal the engine that
    looks at every node on every decision, through everything that changes a node or the set of
    nodes: placements and releases of every kind (tags: affinity, anti-affinity, exclusion, on
    shares and MIG slices), capacity changes (to none), nodes added and removed (also under a
    name used before, with another view), held shares counted again by force (over-committed
    GPUs), GPU views changed as the controller does it (a new engine, the same policy, the
    assignments restored by force: lost, closed, no MPS, MIG on, MIG instances no one holds),
    node selectors, model lists, nodes excluded by the caller, host memory, MPS
    oversubscription, the same ask again, the policy's learning refreshes, and (gpuclustering)
    the task shapes a node holds, which placements and releases change. ``small``: the
    caches are made tiny, so that they are emptied and their heaps dropped mid-way (also for
    falling behind the log of changes). Requests
    repeat a few shapes, as in a cluster, so the caches are used."""
    import random

    from fastshare.placement import engine as engine_module
    from fastshare.placement import ledger as ledger_module
    from fastshare.placement.policies import Task, typical_shapes
    from fastshare.placement.shape_heaps import ShapeHeaps

    rng = random.Random(seed)
    if small:
        monkeypatch.setattr(engine_module, "SCORES_KEPT", 20)
        monkeypatch.setattr(engine_module, "MEMO_SIZE", 3)
        monkeypatch.setattr(ledger_module, "MEMO_SIZE", 3)   # (a node's memo of bound shapes)
        monkeypatch.setattr(engine_module, "ShapeHeaps", lambda: ShapeHeaps(limit=2, log_kept=4))
    typical = typical_shapes([Task(1000, 300, 1), Task(2000, 1000, 1), Task(500, 500, 1), Task(0, 1000, 2)])
    oversub = rng.choice([1.0, 2.0])
    links = {(0, 1): 1, (2, 3): 1, (0, 2): 3, (0, 3): 3, (1, 2): 3, (1, 3): 3}
    flat = {pair: 2 for pair in links}   # nodes alike but for links: whole GPUs go to the tighter
    serial = iter(range(10**6))

    def gpu_state(g: GpuView) -> GpuView:
        x = rng.random() * 2   # most GPUs plain, so that many nodes are alike
        if x < 0.05:
            return dataclasses.replace(g, lost="lost (fell off the bus?): NVML_ERROR_GPU_IS_LOST")
        if x < 0.10:
            return dataclasses.replace(g, closed="MIG mode change pending a GPU reset")
        if x < 0.15:
            return dataclasses.replace(g, no_mps="no MPS control binary on the node")
        if x < 0.25 and g.mig_capable:
            return dataclasses.replace(g, mig_enabled=True, mig_unheld=((19, 6, 1),) if x < 0.2 else ())
        return dataclasses.replace(g, mig_enable_needs_reset=g.mig_capable and x < 0.3)

    def view(name: str) -> NodeView:
        gpus = rng.choice([1, 2, 2, 4])
        v = node(name, n_gpus=gpus, cpu=rng.choice([8000, 16000]), mem=rng.choice([16384, 65536]),
                 labels={"zone": rng.choice("ab")}, links=rng.choice([links, flat]) if gpus == 4 else None,
                 key=rng.choice(["A100-SXM4-40GB", "A100-SXM4-40GB", "T4"]))
        return dataclasses.replace(v, gpus=tuple(dataclasses.replace(gpu_state(g), uuid=f"GPU-{next(serial)}")
                                                 for g in v.gpus))

    def engines(views: list[NodeView], policies=None) -> tuple[Engine, Engine]:
        policies = policies or [make_policy(policy, typical) for _ in range(2)]
        return (Engine(views, policies[0], mps_oversubscription=oversub),
                _Unmemoized(views, policies[1], mps_oversubscription=oversub))

    def both(method: str, *args, **kwargs):   # on both engines: the same answer, or the same error
        out = []
        for eng in (heaps, fresh):
            try:
                out.append(getattr(eng, method)(*args, **kwargs))
            except (InvalidRequest, KeyError) as exc:
                out.append(repr(exc))
        assert out[0] == out[1], (k, out)
        return out[0]

    heaps, fresh = engines([view(f"n{i}") for i in range(10)])
    names = [v.name for v in heaps.nodes]
    placed: list[Assignment] = []
    last = None
    remembered = rejected = most_heaps = 0
    for k in range(1500):
        step = rng.random()
        held = list(heaps.assignments)
        if step < 0.20 and held:
            rid = rng.choice(held)
            both("release", rid)
            continue
        if step < 0.23:
            both("set_capacity", rng.choice(names), rng.choice([0, 4000, 8000, 16000]),
                 rng.choice([0, 16384, 65536]))
            continue
        if step < 0.27:
            busy = {a.node for a in heaps.assignments.values()}
            idle = [n for n in names if n not in busy]
            if idle:
                name = rng.choice(idle)
                both("remove_node", name)
                names.remove(name)
            v = view(name if idle and rng.random() < 0.7 else f"n{next(serial)}")
            both("add_node", v)
            names.append(v.name)
            continue
        if step < 0.29 and placed:   # a share its node still holds, counted again (the controller's adopt)
            a = rng.choice(placed)
            if a.request.id not in heaps.assignments:
                both("restore", a, check_host=False, force=True)
            continue
        if step < 0.31:   # a node's GPUs changed: the controller builds a new engine, same policy
            name, plain = rng.choice(names), {"lost": "", "closed": "", "no_mps": "", "mig_enabled": False,
                                              "mig_unheld": ()}
            views = [v if v.name != name else dataclasses.replace(
                         v, gpus=tuple(gpu_state(dataclasses.replace(g, **plain)) for g in v.gpus))
                     for v in heaps.nodes]
            held = list(heaps.assignments.values())
            heaps, fresh = engines(views, [heaps.policy, fresh.policy])
            for a in held:
                both("restore", a, check_host=False, force=True)
            continue
        if step < 0.37 and last:   # the same ask again (a full cluster rejects the same shapes over and over)
            r, excluded = dataclasses.replace(last[0], id=f"r{k}"), last[1]
            remembered += heaps._rejection_seen(r, excluded or {}) is not None
        else:
            # gpuclustering asks no CPU: more nodes then score alike but for the shapes they hold
            cpu = [0, 500, 2000] if policy != "gpuclustering" else [0]
            ask = {"cpu_milli": rng.choice(cpu), "memory_mib": rng.choice([0, 1024, 32768]),
                   "node_selector": rng.choice([{}, {}, {"zone": "a"}]),
                   "gpu_models": rng.choice([(), (), ("T4",), ("A100-SXM4-40GB", "A30-24GB")]),
                   "anti_affinity": rng.choice([None, None, "x"]),
                   "exclusion": rng.choice([None, None, None, "e"]),
                   "affinity": rng.choice([None] * 6 + ["a", "b"])}
            kind = rng.random()
            if kind < 0.5:
                r = Request(f"r{k}", "fastpod", sm_percent=rng.choice([10, 30, 50, 33.34]),
                            gpu_memory_mib=rng.choice([2048, 12000]), quota_limit=1.0,
                            quota_request=rng.choice([0.2, 0.1, 0.7]), **ask)
            elif kind < 0.65:
                r = Request(f"r{k}", "mps", gpu_memory_mib=rng.choice([4096, 12288, 30000]), **ask)
            elif kind < 0.85:
                r = Request(f"r{k}", "whole", gpus=rng.choice([1, 2, 2, 3]), **ask)
            else:
                size = rng.choice([{"sm_count": 14}, {"sm_count": 28}, {"sm_count": 42}, {"sm_percent": 30},
                                   {"gpu_memory_mib": 10000}, {"mig_profile": "1g.5gb", "sm_count": 14},
                                   {"mig_profile": "2g.10gb", "sm_count": 14}])
                r = Request(f"r{k}", "exclusive", **size, **ask)
            excluded = {rng.choice(names): "are cordoned"} if rng.random() < 0.2 else None
            last = (r, excluded)
        got = both("place", r, excluded)
        most_heaps = max(most_heaps, len(heaps._heaps))
        if got:
            placed.append(got)
        else:
            rejected += 1
    assert heaps.usage() == fresh.usage()
    # the caches were used: heaps, remembered rejections, the policy's refreshes
    assert most_heaps >= (2 if small else 8), most_heaps
    assert remembered > 10 and rejected > 100, (remembered, rejected)
    assert policy != "fastshare" or heaps.policy.generation > 2


def test_a_shapes_heap_stays_bounded_and_right_through_nodes_coming_back_to_their_states():
    """A shape's heap holds an entry per node state; a node that changes and comes back to a state
    it was in adds another entry for it each time, and host memory rules the first node of a
    state out now and then (its state's entry moves past it and is left behind). A long-lived
    controller asks the same shapes for ever: the heap is compacted (one entry per state kept)
    and keeps placing as looking at every node does."""
    import random

    rng = random.Random(3)
    views = [node(f"n{i}", n_gpus=2, mem=8192) for i in range(3)]
    heaps, fresh = Engine(views), _Unmemoized(views)
    held: list[str] = []
    for k in range(400):
        if held and (len(held) > 4 or rng.random() < 0.5):
            rid = held.pop(rng.randrange(len(held)))
            heaps.release(rid)
            fresh.release(rid)
            continue
        r = fastpod(f"r{k}", rng.choice([30, 60]), memory_mib=rng.choice([0, 6000]))
        got = heaps.place(r)
        assert got == fresh.place(r), k
        if got:
            held.append(r.id)
    assert heaps.usage() == fresh.usage()

    # one node placed on and emptied again and again: each time its heap gets another entry for
    # the empty state, all of them live; compacting keeps one
    eng = Engine([node("n", n_gpus=1)])
    for k in range(300):
        assert eng.place(fastpod(f"c{k}", 30)).node == "n"
        eng.release(f"c{k}")
        (_shape, h), = eng._heaps.items()
        assert len(h.heap) <= 2 * 1 + 64 + 1, (k, len(h.heap))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_rejections_folded_per_block_say_what_looking_at_every_node_says(seed):
    """A rejection of a share or whole GPUs is folded per block of nodes sorted by free host CPU
    (blocks split as nodes move between them) and per prefix by free memory, and only blocks
    changed since are folded again: its every figure, count and node named (ties go to the
    first node in node order) equals looking at every node, through placements, releases and
    capacity changes that move nodes across blocks, on a cluster of nodes with few distinct
    free CPU and memory figures (so ties are many) and GPUs lost, unable to run MPS or tagged."""
    import random

    rng = random.Random(seed)

    def view(i: int) -> NodeView:
        v = node(f"n{i}", n_gpus=rng.choice([1, 2, 4]), cpu=rng.choice([8000, 16000, 32000]),
                 mem=rng.choice([16384, 32768, 65536]), key=rng.choice(["A100-SXM4-40GB", "T4"]))
        gpus = tuple(dataclasses.replace(g, lost="lost (fell off the bus?)") if rng.random() < 0.03
                     else dataclasses.replace(g, no_mps="no MPS control binary") if rng.random() < 0.03
                     else g for g in v.gpus)
        return dataclasses.replace(v, gpus=gpus)

    def request(k: int) -> Request:
        ask = {"cpu_milli": rng.choice([0, 1000, 2000, 6000]), "memory_mib": rng.choice([0, 4096, 12288]),
               "gpu_models": rng.choice([(), (), ("T4",)]), "exclusion": rng.choice([None] * 5 + ["e"])}
        kind = rng.random()
        if kind < 0.5:
            return Request(f"r{k}", "fastpod", sm_percent=rng.choice([20, 50, 90]),
                           gpu_memory_mib=rng.choice([2048, 14000]), quota_request=rng.choice([0.2, 0.6]),
                           **ask)
        if kind < 0.7:
            return Request(f"r{k}", "mps", gpu_memory_mib=rng.choice([4096, 20000]), **ask)
        return Request(f"r{k}", "whole", gpus=rng.choice([1, 2, 4]), **ask)

    views = [view(i) for i in range(70)]
    blocks = Engine(views)
    rejected = _walk_alike((blocks, _Unmemoized(views)), rng, 1200, 0.25, 0.03, [v.name for v in views],
                           lambda: (rng.choice([4000, 8000, 32000]), rng.choice([8192, 65536])), request)
    assert rejected > 200 and blocks._blocks is not None, rejected


def test_a_remembered_rejection_lasts_only_until_a_node_changes():
    """The same ask rejected again with no node changed gets the remembered rejection; after any
    change (a release here) it is looked at afresh: placed, or rejected with the new figures."""
    eng = Engine([node("n", n_gpus=1)])
    assert eng.place(Request("big", "exclusive", sm_percent=90))
    first = eng.place(Request("e1", "exclusive", sm_percent=50))
    assert not first and eng.place(Request("e2", "exclusive", sm_percent=50)) == first
    eng.release("big")
    assert eng.place(Request("e3", "exclusive", sm_percent=50))

    eng = Engine([node("n", n_gpus=1)])
    assert eng.place(fastpod("a", 60)) and eng.place(fastpod("b", 30))
    rej = eng.place(fastpod("c", 50))
    assert not rej and "largest free SM share is 10 %" in rej.reason, rej.reason
    eng.release("a")
    assert eng.place(fastpod("d", 50))
    rej = eng.place(fastpod("e", 50))
    assert not rej and "largest free SM share is 20 %" in rej.reason, rej.reason
    eng.set_capacity("n", 64000, 1024)
    rej = eng.place(fastpod("f", 50, memory_mib=2048))
    assert not rej and "host memory" in rej.reason, rej.reason


def test_a_node_added_again_under_its_name_is_judged_by_its_new_view():
    """The shape heaps' entries carry a node's version, which counted from 0 for every node
    added: a node removed and added again under its name (another view: its A100 replaced by a
    T4) made the entries of its earlier self current again. A request bound to A100s then went
    to the T4 node (a whole GPU: an assignment holding no GPU; a share: a TypeError), where
    looking at every node rejects it."""
    for ask in (Request("w", "whole", gpus=1, gpu_models=("A100-SXM4-40GB",)),
                fastpod("f", gpu_models=("A100-SXM4-40GB",))):
        eng = Engine([node("a", n_gpus=1), node("b", n_gpus=1, key="T4")])
        first = eng.place(dataclasses.replace(ask, id="first"), excluded={"a": "are cordoned"})
        assert not first and "1 node(s) are cordoned (a)" in first.reason, first
        eng.remove_node("a")
        eng.add_node(node("a", n_gpus=1, key="T4"))
        again = eng.place(ask)
        assert not again and again == _Unmemoized(eng.nodes).place(ask), again


def test_an_empty_exclusion_tag_is_no_tag_for_cached_and_fresh_answers_alike():
    """Nodes in the same state share answers, and a GPU's state wrote its sharers' exclusion
    tags as ``tag or ""``: a sharer tagged ``""`` and an untagged one looked alike, while the
    tag check told them apart (``"" != None``). So after an answer was worked out on a node
    holding the one, a node holding the other got it: a share was rejected ("the sharing tags
    rule them out") where looking at every node placed it. An empty tag is now no tag, as for
    affinity and anti-affinity (and as the controller sends it)."""
    def share(rid: str, **tags) -> Request:
        return fastpod(rid, quota_request=0.2, **tags)

    assert share("a", exclusion="") == share("a")
    for eng in (Engine([node("x", n_gpus=1), node("y", n_gpus=1)]),
                _Unmemoized([node("x", n_gpus=1), node("y", n_gpus=1)])):
        assert eng.place(share("a", exclusion="")).node == "x"
        assert eng.place(share("b"), excluded={"x": "are cordoned"}).node == "y"
        assert eng.place(share("c", exclusion=""), excluded={"y": "are cordoned"}).node == "x"
        assert eng.place(share("d")), type(eng)


def test_a_rejection_names_the_affinity_tag_of_the_request_it_rejects():
    """Two affinity tags bound to one GPU gave their requests one shape (the binding, not the
    tag, was in its key), so the second request's rejection reused the node summaries worked
    out for the first and named the other workload's tag ("affinity tag 'a' binds it to x GPU
    0" to a request tagged 'b')."""
    def share(rid: str, sm: float, tag: str) -> Request:
        return fastpod(rid, sm, quota_request=0.2, affinity=tag)

    for eng in (Engine([node("x", n_gpus=1), node("y", n_gpus=1)], policy=make_policy("bestfit")),
                _Unmemoized([node("x", n_gpus=1), node("y", n_gpus=1)], policy=make_policy("bestfit"))):
        assert eng.place(share("a1", 30, "a")).node == "x"
        assert eng.place(share("b1", 30, "b"), excluded={"y": "are cordoned"}).node == "x"
        for tag in "ab":
            rej = eng.place(share(f"{tag}2", 50, tag))
            assert not rej and f"y GPU 0 (affinity tag '{tag}' binds it to x GPU 0)" in rej.reason, rej


def test_an_affinity_tag_split_by_restores_stays_bound_while_any_gpu_holds_it():
    """Restored holders of one affinity tag on two GPUs (a database or annotations from before a
    view change: a restore counts what runs): the second restore moved the binding, and a release
    dropped it while the other GPU still held the tag, so the next request of the tag went to
    any GPU. The binding now stays with the first holder's GPU and moves to a remaining holder's
    GPU when that one empties."""
    def held(rid: str, sm: float, gpu: int) -> Assignment:
        return Assignment(fastpod(rid, sm, affinity="team"), "n", (gpu,))

    for eng in (Engine([node("n", n_gpus=2)]), _Unmemoized([node("n", n_gpus=2)])):
        assert eng.restore(held("a1", 60, 0)) is None and eng.restore(held("a2", 30, 1)) is None
        eng.release("a2")   # GPU 1 no longer holds it; GPU 0 does
        rej = eng.place(fastpod("b", 50, affinity="team"))
        assert not rej and "affinity tag 'team' binds it to n GPU 0" in rej.reason, rej

    for eng in (Engine([node("n", n_gpus=2)]), _Unmemoized([node("n", n_gpus=2)])):
        assert eng.restore(held("a1", 60, 0)) is None and eng.restore(held("a2", 30, 1)) is None
        eng.release("a1")   # GPU 0 empties; GPU 1 still holds the tag
        rej = eng.place(fastpod("b", 80, affinity="team"))
        assert not rej and "affinity tag 'team' binds it to n GPU 1" in rej.reason, rej
        assert eng.place(fastpod("c", 20, affinity="team")).gpus == (1,)


def test_rejections_of_shares_of_any_size_name_only_the_tagged_gpus_with_room():
    """Rejections of one kind share the nodes' summaries whatever their sizes, so which GPUs
    that only the tags rule out have room is checked per request: a GPU full for the share is
    not said to be ruled out by the tags."""
    for eng in (Engine([node("n", n_gpus=2)]), _Unmemoized([node("n", n_gpus=2)])):
        assert eng.place(fastpod("x", 10, exclusion="x")).gpus == (0,)
        assert eng.place(fastpod("full", 95)).gpus == (1,)
        rej = eng.place(fastpod("a", 50))
        assert not rej and "is free on 1 GPU(s), but the sharing tags rule them out: n GPU 0 " \
            "(exclusion tags differ)" in rej.reason, rej
        rej = eng.place(fastpod("b", 95))
        assert not rej and rej.reason.startswith("no GPU with 95 % SMs"), rej
