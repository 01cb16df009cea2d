"""Engine behaviour that mutation testing (bench/mutation.py on engine.py) showed no test held:
large-node link groups, memory best fit for MPS shares, named and ready MIG slices, restore's
refusals, node changes, and the words of some rejections."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fastshare.placement import Engine, GpuView, InvalidRequest, NodeView, Rejection, Request
from fastshare.placement.model import Assignment, MigSlot
from fastshare.placement.topology import tightest_group

from .conftest import gpu, node


def _islands(n_gpus: int, size: int) -> dict[tuple[int, int], int]:
    """NVLink islands of ``size`` GPUs (level 1 inside); pairs across islands are not given (9)."""
    return {(a, b): 1 for start in range(0, n_gpus, size)
            for a, b in itertools.combinations(range(start, start + size), 2)}


def test_a_large_node_takes_whole_gpus_from_one_link_island():
    # 32 GPUs, 4 at a time: too many combinations to try all (the greedy path)
    view = node("big", n_gpus=32, links=_islands(32, 8))
    assert tightest_group(view, list(range(32)), 4) == (0, 1, 2, 3)
    idle = [5, 6, 9, 10, 11, 12, 13, 30]        # island 0 has 2 idle, island 1 has 5
    group = tightest_group(view, idle, 4)
    assert len(group) == 4 and len(set(group)) == 4 and set(group) <= set(idle)
    assert list(group) == sorted(group)
    eng = Engine([view])
    for i in range(3):                          # take island 0's first 3, then ask for 6
        assert eng.place(Request(f"w{i}", "whole", gpus=1))
    six = eng.place(Request("six", "whole", gpus=6))
    assert six and len(six.gpus) == 6 and all(view.link_level(a, b) == 1
                                              for a, b in itertools.combinations(six.gpus, 2)), six.gpus


def _mps_node(name: str, used_mib: int) -> tuple[NodeView, Assignment | None]:
    view = node(name, n_gpus=1)
    if not used_mib:
        return view, None
    return view, Assignment(Request(f"{name}-held", "mps", gpu_memory_mib=used_mib), name, (0,))


def test_mps_shares_go_to_the_gpu_with_the_least_memory_left_that_fits():
    roomy, _ = _mps_node("a-roomy", 0)
    tight, held = _mps_node("b-tight", 30 * 1024)
    eng = Engine([roomy, tight])
    eng.restore(held)
    small = eng.place(Request("small", "mps", gpu_memory_mib=4096))
    assert small and small.node == "b-tight"   # best fit by memory, not the first node
    big = eng.place(Request("big", "mps", gpu_memory_mib=20 * 1024))
    assert big and big.node == "a-roomy"        # only there it fits


def test_a_named_mig_profile_is_the_profile_given():
    # on an A100-40GB the 3g.20gb and the 4g.20gb have the same memory: the name decides
    eng = Engine([node("n", n_gpus=1)])
    a = eng.place(Request("a", "exclusive", sm_count=1, mig_profile="4g.20gb"))
    assert a and a.mig.profile_name == "4g.20gb"
    b = eng.place(Request("b", "exclusive", sm_count=14))
    assert b and b.mig.profile_name == "1g.5gb"


def test_an_idle_instance_of_the_profile_is_taken_before_a_new_one_is_made():
    v = node("n", n_gpus=1).gpus[0]
    gpu = GpuView(v.index, v.model, v.memory_mib, v.sm_count, True, True, v.mig_profiles,
                  mig_unheld=((19, 6, 1),))    # A100 id 19 = 1g.5gb, left at slice 6
    eng = Engine([NodeView("n", 64000, 262144, (gpu,))])
    a = eng.place(Request("a", "exclusive", sm_count=14))
    assert a and (a.mig.profile_name, a.mig.start) == ("1g.5gb", 6) and not a.enable_mig


def test_restore_refuses_what_it_cannot_hold_and_changes_nothing():
    eng = Engine([node("n", n_gpus=2, cpu=8000)])
    slot = MigSlot(19, "1g.5gb", 0, 1, 14, 4864)   # A100 id 19 = 1g.5gb
    eng.restore(Assignment(Request("e0", "exclusive", sm_count=14), "n", (0,), mig=slot, enable_mig=True))
    before = eng.usage()
    share = Request("s", "mps", gpu_memory_mib=1024, cpu_milli=1000)
    hungry = Request("big", "mps", gpu_memory_mib=1, cpu_milli=9000)
    for assignment, message in [
        (Assignment(share, "elsewhere", (0,)), "elsewhere is not in the cluster view"),
        (Assignment(share, "n", (0, 1)), "exactly 1 GPU"),
        (Assignment(Request("w", "whole", gpus=2), "n", (1, 1)), "GPU 1 appears twice"),
        (Assignment(share, "n", (2,)), "n has no GPU 2"),
        (Assignment(Request("e", "exclusive", sm_count=14), "n", (0,), mig=slot), "is not free"),
        (Assignment(hungry, "n", (1,)), "lacks CPU/memory"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            eng.restore(assignment)
        assert eng.usage() == before and set(eng.assignments) == {"e0"}
    eng.restore(Assignment(hungry, "n", (1,)), check_host=False)   # others' use of the host: kept


def test_node_changes_keep_what_is_held():
    eng = Engine([node("a", n_gpus=1, cpu=8000, mem=8192)])
    with pytest.raises(InvalidRequest, match="already in the cluster view"):
        eng.add_node(node("a", n_gpus=1))
    held = eng.place(Request("h", "mps", gpu_memory_mib=1024, cpu_milli=4000, memory_mib=4096))
    assert held
    with pytest.raises(InvalidRequest, match="still holds 1 assignment"):
        eng.remove_node("a")
    eng.set_capacity("a", 2000, 2048)            # others took the host's CPU and memory
    rej = eng.place(Request("more", "mps", gpu_memory_mib=1, cpu_milli=100))
    assert isinstance(rej, Rejection) and "lack 100 milli-CPU; most free is 0 on a" in rej.reason
    assert eng.place(Request("none", "mps", gpu_memory_mib=1))   # asks for no CPU or memory
    eng.set_capacity("a", 8000, 8192)
    assert eng.place(Request("again", "mps", gpu_memory_mib=1, cpu_milli=3000, memory_mib=3000))
    for rid in ("h", "none", "again"):
        eng.release(rid)
    eng.remove_node("a")
    assert eng.nodes == [] and "no nodes" in eng.place(Request("x", "mps", gpu_memory_mib=1)).reason


def test_rejections_name_the_affinity_binding_and_empty_mig_gpus():
    eng = Engine([node("n", n_gpus=2)])
    assert eng.place(Request("a", "fastpod", sm_percent=90, gpu_memory_mib=1024, affinity="team"))
    rej = eng.place(Request("b", "fastpod", sm_percent=20, gpu_memory_mib=1024, affinity="team"))
    assert isinstance(rej, Rejection) and "affinity tag 'team' binds it to n GPU" in rej.reason
    mig = Engine([NodeView("m", 64000, 262144, (gpu(0, mig_enabled=True), gpu(1, mig_enabled=True)))])
    rej = mig.place(Request("w", "whole", gpus=1))
    assert isinstance(rej, Rejection) and "2 empty GPU(s) are in MIG mode" in rej.reason


@pytest.mark.parametrize(("mib", "text"), [(1023, "1023 MiB"), (1024, "1 GiB"), (1536, "1.5 GiB"),
                                           (20480, "20 GiB")])
def test_memory_in_rejections_reads_as_an_operator_would_write_it(mib, text):
    eng = Engine([node("n", n_gpus=1)])
    assert eng.place(Request("a", "mps", gpu_memory_mib=40960 - mib))
    rej = eng.place(Request("b", "mps", gpu_memory_mib=mib + 1))
    assert isinstance(rej, Rejection) and f"largest free memory is {text} on" in rej.reason


def test_a_lost_gpu_takes_no_share_of_any_kind():
    """A GPU fallen off the bus stays in its node's view (the indexes stay 0..n-1) but takes
    nothing: every kind goes to the healthy GPU, or is refused when that one is full."""
    from fastshare.controller.ledger import gpu_view

    gpus = (gpu_view(0, "GPU-0", "A100-SXM4-40GB", 40 << 30, 108, True, False),
            gpu_view(1, "GPU-1", "A100-SXM4-40GB", 40 << 30, 108, True, False, lost="GPU_IS_LOST"))
    assert gpus[1].lost == "lost (fell off the bus?): NVML_ERROR_GPU_IS_LOST"
    eng = Engine([NodeView("n1", 8000, 65536, gpus)])
    assert eng.place(Request("w1", kind="whole", gpus=1)).gpus == (0,)   # placing holds it
    for request in (Request("w2", kind="whole", gpus=1), Request("e1", kind="exclusive", gpu_memory_mib=4096),
                    Request("f1", kind="fastpod", sm_percent=10, gpu_memory_mib=1024),
                    Request("m1", kind="mps", gpu_memory_mib=1024)):
        assert isinstance(eng.place(request), Rejection), request
    refused = eng.place(Request("w3", kind="whole", gpus=1))
    assert "1 GPU(s) are lost (fell off the bus?): n1 GPU 1" in refused.reason, refused.reason
    eng.release("w1")
    assert eng.place(Request("f2", kind="fastpod", sm_percent=10, gpu_memory_mib=1024)).gpus == (0,)


def test_a_lost_gpu_keeps_its_links_but_is_in_no_whole_group():
    """The agent reads the links once: a GPU lost later keeps its NVLink in the node's view. It is
    in no group handed out and is not counted as idle (checked for the lost-GPU work; passes)."""
    from fastshare.controller.ledger import gpu_view

    gpus = tuple(gpu_view(i, f"GPU-{i}", "A100-SXM4-40GB", 40 << 30, 108, True, False,
                          lost="GPU_IS_LOST" if i == 1 else "") for i in range(4))
    links = ((0, 1, 0), (0, 2, 5), (0, 3, 5), (1, 2, 5), (1, 3, 5), (2, 3, 0))
    eng = Engine([NodeView("n1", 8000, 65536, gpus, links=links)])
    assert eng.place(Request("w2", kind="whole", gpus=2)).gpus == (2, 3)
    eng.release("w2")
    assert eng.place(Request("w3", kind="whole", gpus=3)).gpus == (0, 2, 3)
    eng.release("w3")
    refused = eng.place(Request("w4", kind="whole", gpus=4))
    assert "most idle GPUs on one node is 3" in refused.reason, refused.reason
    assert "1 GPU(s) are lost (fell off the bus?): n1 GPU 1" in refused.reason, refused.reason


PENDING = ("GPU 1 of n1: MIG mode change pending until the GPU is reset (nvidia-smi -r -i 1) or the node "
           "rebooted; it takes no new shares")


@pytest.mark.parametrize("mig_on", [False, True], ids=["enable-pending", "disable-pending"])
def test_a_gpu_whose_mig_mode_change_is_pending_takes_no_new_share_but_keeps_its_own(mig_on):
    """An Ampere GPU's MIG mode change waits for a GPU reset. Meanwhile the engine placed shares there
    as if the mode were final: a whole/MPS/fastpod share on a GPU whose MIG enable is pending loses the
    GPU at the reset, an exclusive share on one whose disable is pending loses its slice. Now such a
    GPU takes no new share of any kind, the rejection says why and what to do, and what it holds
    stays held (not over-committed: the reset waits for the operator's drain)."""
    from fastshare.controller.ledger import gpu_view

    def view(pending: bool) -> NodeView:
        return NodeView("n1", 8000, 65536, (
            gpu_view(0, "GPU-0", "A100-SXM4-40GB", 40 << 30, 108, True, False),
            gpu_view(1, "GPU-1", "A100-SXM4-40GB", 40 << 30, 108, True, mig_on, mig_change_pending=pending)))

    held = (Assignment(Request("held", "exclusive", gpu_memory_mib=4096), "n1", (1,), gpu_uuids=("GPU-1",),
                       mig=MigSlot(19, "1g.5gb", 4, 1, 14, 4864)) if mig_on else
            Assignment(Request("held", "fastpod", sm_percent=10, gpu_memory_mib=1024), "n1", (1,),
                       gpu_uuids=("GPU-1",)))
    assert Engine([view(False)]).restore(held, force=True) is None   # it fit before the change
    eng = Engine([view(True)])
    assert eng.nodes[0].gpus[1].lost == "" and eng.nodes[0].gpus[1].closed, eng.nodes[0].gpus[1]
    assert eng.restore(held, force=True) is None   # kept, and not over-committed
    assert eng.place(Request("w1", kind="whole", gpus=1)).gpus == (0,)   # GPU 0 taken: GPU 1 is all left
    for request in (Request("w2", kind="whole", gpus=1), Request("e1", kind="exclusive", gpu_memory_mib=4096),
                    Request("f1", kind="fastpod", sm_percent=10, gpu_memory_mib=1024),
                    Request("m1", kind="mps", gpu_memory_mib=1024)):
        refused = eng.place(request)
        assert isinstance(refused, Rejection), (request, refused)
        assert PENDING in refused.reason, refused.reason
        assert "lost" not in refused.reason, refused.reason
    eng.release("w1")
    assert eng.place(Request("f2", kind="fastpod", sm_percent=10, gpu_memory_mib=1024)).gpus == (0,)


def test_an_exclusive_request_takes_no_gpu_whose_mig_enable_waits_for_a_reset():
    """An exclusive request on a GPU with MIG off turns MIG on first. On an Ampere GPU that waits for a
    GPU reset: the allocation failed ("waits for a GPU reset") and left the GPU with a pending change,
    taking no new share of any kind; the next request did the same to the next idle GPU. Now such a
    GPU takes no slice while its MIG is off, and the rejection says what to do; a Hopper GPU, where
    MIG comes on at once, still does."""
    from fastshare.controller.ledger import gpu_view

    ampere = NodeView("a", 8000, 65536, tuple(
        gpu_view(i, f"GPU-a{i}", "A100-SXM4-40GB", 40 << 30, 108, True, False) for i in range(2)))
    eng = Engine([ampere])
    refused = eng.place(Request("e1", kind="exclusive", gpu_memory_mib=4096))
    assert isinstance(refused, Rejection), refused
    for says in ("2 idle GPU(s) have MIG off (a GPU 0, a GPU 1)", "waits for a GPU reset",
                 "fastshare mig enable --gpu N", "nvidia-smi -r -i N"):
        assert says in refused.reason, refused.reason
    assert eng.place(Request("f1", kind="fastpod", sm_percent=10, gpu_memory_mib=1024))   # still shared
    on = NodeView("a", 8000, 65536, (gpu_view(0, "GPU-a0", "A100-SXM4-40GB", 40 << 30, 108, True, True),))
    placed = Engine([on]).place(Request("e2", kind="exclusive", gpu_memory_mib=4096))
    assert placed and not placed.enable_mig, placed
    hopper = NodeView("h", 8000, 65536,
                      (gpu_view(0, "GPU-h0", "H100-SXM5-80GB", 80 << 30, 132, True, False),))
    placed = Engine([hopper]).place(Request("e3", kind="exclusive", gpu_memory_mib=4096))
    assert placed and placed.enable_mig, placed


@pytest.mark.parametrize("policy", ["fastshare", "bestfit", "fgd"])
def test_whole_gpus_go_to_the_node_with_the_tightest_group_among_those_scored_alike(policy):
    """Two idle nodes score alike under any policy; the first one's two GPUs sit across the
    system interconnect, the second one's on NVLink. A 2-GPU request went to the first (node
    order broke the tie): its GPUs talked over the host bridge while an NVLink pair sat idle."""
    from fastshare.placement import make_policy
    from fastshare.placement.policies import Task, typical_shapes

    far = node("a-far", n_gpus=2, links={(0, 1): 5})
    near = node("b-near", n_gpus=2, links={(0, 1): 1})
    typical = typical_shapes([Task(0, 1000, 2)])
    eng = Engine([far, near], policy=make_policy(policy, typical))
    w = eng.place(Request("w", "whole", gpus=2))
    assert w and w.node == "b-near", w
    # the tie only: where the policy prefers a node (the default: one already in use), it keeps it
    eng = Engine([node("a-far", n_gpus=3, links={(0, 1): 5, (0, 2): 5, (1, 2): 5}), near])
    assert eng.place(Request("one", "whole", gpus=1)).node == "a-far"
    assert eng.place(Request("two", "whole", gpus=2)).node == "a-far"


def test_an_exclusive_rejection_says_whether_mig_gpus_are_busy_absent_or_lost():
    """Every GPU an exclusive request could not use was reported as "no MIG-capable GPU is free
    of MPS shares and whole-GPU use": also where none looked at can do MIG (T4s, or a model the
    request names that no node has), where waiting never helps, and where the MIG GPU fell off
    the bus, which needs an operator rather than a release."""
    rej = Engine([node("t", n_gpus=2, key="T4")]).place(Request("x", "exclusive", sm_count=10))
    assert isinstance(rej, Rejection)
    assert rej.reason.startswith("none of the 2 GPU(s) looked at is MIG-capable (T4)"), rej.reason
    assert "kind fastpod, mps or whole" in rej.reason
    t4 = Engine([node("t", n_gpus=2, key="T4"), node("a", n_gpus=1)])
    rej = t4.place(Request("x", "exclusive", sm_count=10, gpu_models=("T4",)))
    assert rej.reason.startswith("none of the 2 GPU(s) of model T4 looked at is MIG-capable (T4)"), rej.reason
    rej = t4.place(Request("y", "exclusive", sm_count=10, gpu_models=("H100-SXM5-80GB",)))
    assert rej.reason == "no GPU of model H100-SXM5-80GB on the 2 node(s) looked at", rej.reason
    lost = node("l", n_gpus=1)
    gone = dataclasses.replace(lost.gpus[0], lost="lost (fell off the bus?)")
    lost = dataclasses.replace(lost, gpus=(gone,))
    rej = Engine([lost]).place(Request("z", "exclusive", sm_count=10))
    assert rej.reason == ("no MIG-capable GPU takes a new slice now; 1 GPU(s) are lost (fell off the bus?): "
                          "l GPU 0"), rej.reason
    busy = Engine([node("b", n_gpus=1)])      # the one still worth waiting for
    assert busy.place(Request("w", "whole", gpus=1))
    assert busy.place(Request("v", "exclusive", sm_count=10)).reason == (
        "no MIG-capable GPU is free of MPS shares and whole-GPU use")


def test_an_exclusive_rejection_counts_as_full_only_the_gpus_that_could_serve_it():
    """With an A100 (largest slice 98 of 108 SMs) and an H100 whose 7g.80gb is taken, a second
    100 % request was told "2 candidate GPU(s) are full": the idle A100 was counted as full, so
    the user waited for a release that can never make room there."""
    eng = Engine([node("a", n_gpus=1), node("h", n_gpus=1, key="H100-SXM5-80GB")])
    assert eng.place(Request("x", "exclusive", sm_percent=100)).node == "h"
    rej = eng.place(Request("y", "exclusive", sm_percent=100))
    assert isinstance(rej, Rejection)
    assert rej.reason.startswith("no MIG-capable GPU has a free placement for a slice of 100 % SMs; "
                                 "1 candidate GPU(s) are full; 1 more have no slice that large "
                                 "(A100-SXM4-40GB: the largest is 7g.40gb, 98 SMs, "), rej.reason


def test_an_exclusive_decision_weighs_gpus_laid_out_alike_once_and_counts_them_all():
    """GPUs laid out alike are weighed once per decision (the first in node order stands for
    them), yet every one of them counts: the slice goes to the first GPU of the best layout,
    and a rejection counts each full GPU and each GPU too small."""
    eng = Engine([node("a", n_gpus=3), node("b", n_gpus=3, key="A30-24GB")])
    a100 = ("A100-SXM4-40GB",)
    assert eng.place(Request("x", "exclusive", sm_count=56, gpu_models=a100)).gpus == (0,)
    assert eng.place(Request("w", "exclusive", sm_count=98, gpu_models=a100)).gpus == (1,)
    assert eng.place(Request("y", "exclusive", sm_count=56, gpu_models=a100)).gpus == (2,)
    # GPUs 0 and 2 of a are alike (a 4g.20gb each): the first takes a 2g.10gb
    got = eng.place(Request("z", "exclusive", sm_count=28, gpu_models=a100))
    assert got and (got.node, got.gpus) == ("a", (0,)), got
    eng.release("z")
    rej = eng.place(Request("v", "exclusive", sm_count=60))
    assert isinstance(rej, Rejection)
    assert rej.reason.startswith("no MIG-capable GPU has a free placement for a slice of 60 SMs; "
                                 "3 candidate GPU(s) are full; 3 more have no slice that large "
                                 "(A30-24GB: the largest is "), rej.reason


def test_an_exclusive_request_tells_apart_gpus_of_a_model_that_offer_other_profiles():
    """Nodes alike in all but the MIG profiles their GPUs offer (a driver that lacks some) answer
    an exclusive request differently: the shape's heap must not take one's answer for the
    other's, as it does for nodes truly alike."""
    full = node("b", n_gpus=1)
    profiles = full.gpus[0].mig_profiles
    most = max(p.sm_count for p in profiles)
    only_7g = dataclasses.replace(full.gpus[0], mig_profiles=tuple(p for p in profiles if p.sm_count == most))
    eng = Engine([dataclasses.replace(full, name="a", gpus=(only_7g,)), full, node("c", n_gpus=1)])
    got = eng.place(Request("x", "exclusive", sm_count=14))
    assert got and got.node == "b" and got.mig.profile_name.startswith("1g."), got
    got = eng.place(Request("y", "exclusive", sm_count=14))   # b and c are alike: the first free
    assert got and got.node == "b" and got.mig.start != eng.assignments["x"].mig.start, got
    eng.release("x")
    eng.release("y")
    big = eng.place(Request("z", "exclusive", sm_count=98))
    assert big and big.node == "a", big   # a 7g slice: the only one a offers, as large as b's


@pytest.mark.parametrize("first, then, profile", [
    ({"sm_count": 14}, {"sm_count": 14, "mig_profile": "2g.10gb"}, "2g.10gb"),
    ({"sm_percent": 10}, {"sm_percent": 30}, "3g.20gb"),
    ({"sm_count": 14}, {"sm_count": 14, "gpu_memory_mib": 9000}, "1g.10gb"),
])
def test_an_exclusive_shape_is_sized_by_all_that_sizes_its_slice(first, then, profile):
    """Two exclusive requests alike but for what sizes the slice (a named profile, the SM
    percent, the memory) are two shapes: the second must not be given the first's slice."""
    eng = Engine([node("a", n_gpus=1), node("b", n_gpus=1)])   # b is not changed by x
    assert eng.place(Request("x", "exclusive", **first)).mig.profile_name == "1g.5gb"
    got = eng.place(Request("y", "exclusive", **then))
    assert got and got.mig.profile_name == profile, got


def test_sharing_tags_hold_for_mig_slices_too():
    """Slices of one GPU share it (its memory bandwidth is split, a reset takes them all), and
    `fastshare run --anti-affinity` promises "never share a GPU with others carrying this tag";
    yet exclusive requests ignored every tag: two anti-affine slices landed on one GPU, an
    exclusion-tagged slice beside untagged ones, and affine slices on different GPUs."""
    eng = Engine([node("n", n_gpus=2)])
    a = eng.place(Request("a", "exclusive", sm_count=14, anti_affinity="x"))
    b = eng.place(Request("b", "exclusive", sm_count=14, anti_affinity="x"))
    assert a and b and a.gpus != b.gpus, (a, b)
    rej = eng.place(Request("c", "exclusive", sm_count=14, anti_affinity="x"))
    assert isinstance(rej, Rejection) and "anti-affinity x already on it" in rej.reason, rej.reason
    eng = Engine([node("n", n_gpus=2)])
    s = eng.place(Request("s", "exclusive", sm_count=14, exclusion="secret"))
    t = eng.place(Request("t", "exclusive", sm_count=14))
    u = eng.place(Request("u", "exclusive", sm_count=14, exclusion="secret"))
    assert s and t and u and t.gpus != s.gpus and u.gpus == s.gpus, (s, t, u)
    two = [node("n", n_gpus=1, labels={"r": "1"}), node("m", n_gpus=1, labels={"r": "2"})]
    eng = Engine(two)
    p = eng.place(Request("p", "exclusive", sm_count=14, affinity="team"))
    assert eng.place(Request("filler", "exclusive", sm_count=28, node_selector={"r": "2"})).node == "m"
    q = eng.place(Request("q", "exclusive", sm_count=14, affinity="team"))   # best fit alone: m, the fuller
    assert p and q and (q.node, q.gpus) == (p.node, p.gpus) == ("n", (0,)), (p, q)
    eng.release("p")
    assert eng.place(Request("o", "exclusive", sm_count=14, affinity="team")).node == "n"   # q holds it
    eng.release("o")
    eng.release("q")      # the binding goes with the last holder of the tag
    assert eng.place(Request("r", "exclusive", sm_count=14, affinity="team")).node == "m"


def test_a_whole_request_for_a_model_no_node_has_says_so():
    """"no node has 1 idle H100 GPU(s)" read as if the H100s were busy; there were none, and
    waiting never helps (shares and slices already said "no GPU of model ... looked at")."""
    eng = Engine([node("n", n_gpus=2), node("m", n_gpus=2, key="T4")])
    rej = eng.place(Request("w", "whole", gpus=1, gpu_models=("H100-SXM5-80GB",)))
    assert rej.reason == "no GPU of model H100-SXM5-80GB on the 2 node(s) looked at", rej.reason
    assert eng.place(Request("t", "whole", gpus=2, gpu_models=("T4",)))
    rej = eng.place(Request("u", "whole", gpus=1, gpu_models=("T4",)))
    assert rej.reason == "no node has 1 idle T4 GPU(s)", rej.reason      # these are there, and busy


def test_releasing_a_whole_gpu_keeps_an_affinity_binding_its_tag_never_made():
    """A whole GPU shares nothing, so its tag binds nothing, and its release must not drop the
    binding the tag's sharers made elsewhere."""
    eng = Engine([node("n", n_gpus=3)])
    a = eng.place(Request("a", "fastpod", sm_percent=10, gpu_memory_mib=10, quota_request=0.1, affinity="t"))
    w = eng.place(Request("w", "whole", gpus=1, affinity="t"))
    assert a and w and w.gpus != a.gpus
    eng.release("w")
    b = eng.place(Request("b", "fastpod", sm_percent=10, gpu_memory_mib=10, quota_request=0.1, affinity="t"))
    assert b and b.gpus == a.gpus, (a, b)


def test_a_shape_heap_learns_the_nodes_changed_since_it_last_looked_or_is_dropped_when_behind():
    """Each heap scores again exactly the nodes changed since its shape was last asked for; one
    that fell behind the kept log of changes cannot tell which, and is dropped (built afresh)."""
    from fastshare.placement.shape_heaps import ShapeHeaps

    heaps = ShapeHeaps(log_kept=3)
    asked, _idle = heaps.build("asked", [], None), heaps.build("idle", [], None)
    for name in ("n1", "n2", "n1"):
        heaps.changed(name)
    assert heaps.dirty(asked) == {"n1", "n2"}
    assert heaps.dirty(asked) == set()
    heaps.changed("n3")
    heaps.changed("n4")
    assert heaps.dirty(asked) == {"n3", "n4"}
    heaps.changed("n5")
    heaps.changed("n6")   # seven changes: the log keeps the last three, which "idle" is behind
    assert heaps.get("idle") is None and heaps.get("asked") is asked
    assert heaps.dirty(asked) == {"n5", "n6"}


def test_a_learning_refresh_keeps_the_heaps_of_mig_slices_which_the_policy_does_not_score():
    """The policy's refresh (after a doubling of the requests it saw) scores every share and
    whole-GPU heap again inside one decision; slices are chosen without the policy, so their
    heaps are kept, and still place as before."""
    eng = Engine([node(f"n{i}", n_gpus=2) for i in range(3)])
    assert eng.place(Request("s0", "exclusive", sm_count=14)).node == "n0"
    (slices, heap), = eng._heaps.items()
    generation, k = eng.policy.generation, 0
    while eng.policy.generation == generation:
        k += 1
        assert eng.place(Request(f"f{k}", "fastpod", sm_percent=10 * (1 + k % 5), gpu_memory_mib=1024,
                                 quota_request=0.1, gpu_models=("T4",))) is not None
    assert eng._heaps.get(slices) is heap
    got = eng.place(Request("s1", "exclusive", sm_count=14))
    assert got and (got.node, got.gpus) == ("n0", (0,)), got   # beside s0: the fullest GPU first
