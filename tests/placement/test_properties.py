"""Invariants over random request streams: capacity never exceeded, MIG slices only where the
hardware allows them, sharing tags, node selectors and model lists honoured, release is exact,
decisions are deterministic."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from fastshare.placement import Engine, NodeView, Request
from fastshare.placement.mig import compute_slices_total, used_mask

from .conftest import gpu, node

kinds = st.sampled_from(["fastpod", "mps", "exclusive", "whole"])


@st.composite
def requests(draw, i: int) -> Request:
    kind = draw(kinds)
    common = {"cpu_milli": draw(st.integers(0, 20000)), "memory_mib": draw(st.integers(0, 50000)),
              "anti_affinity": draw(st.sampled_from([None, "x"])),
              "exclusion": draw(st.sampled_from([None, None, "e"])),
              "affinity": draw(st.sampled_from([None, None, "a"])),
              "gpu_models": draw(st.sampled_from([(), (), ("T4",), ("A100-SXM4-40GB", "A30-24GB")])),
              "node_selector": draw(st.sampled_from([{}, {}, {"zone": "a"}]))}
    if kind == "fastpod":
        return Request(f"r{i}", kind, sm_percent=draw(st.integers(1, 100)),
                       gpu_memory_mib=draw(st.integers(1, 45000)),
                       quota_request=draw(st.sampled_from([0.1, 0.2, 0.3, 0.7, 1.0])), **common)
    if kind == "mps":
        return Request(f"r{i}", kind, gpu_memory_mib=draw(st.integers(1, 45000)), **common)
    if kind == "exclusive":
        size = draw(st.sampled_from([{"sm_count": draw(st.integers(1, 98))},
                                     {"sm_percent": draw(st.integers(1, 100))},
                                     {"gpu_memory_mib": draw(st.integers(1, 40000))},
                                     {"sm_count": 1, "mig_profile": draw(st.sampled_from(
                                         ["1g.5gb", "1g.10gb", "3g.20gb", "2g.12gb"]))}]))
        return Request(f"r{i}", kind, **size, **common)
    return Request(f"r{i}", kind, gpus=draw(st.integers(1, 3)), cpu_milli=common["cpu_milli"],
                   gpu_models=common["gpu_models"], node_selector=common["node_selector"])


@st.composite
def streams(draw):
    n = draw(st.integers(1, 25))
    reqs = [draw(requests(i)) for i in range(n)]
    releases = draw(st.lists(st.integers(0, n - 1), max_size=n))
    return reqs, releases


def a30_node(cpu: int = 32000, mem: int = 131072) -> NodeView:
    """Two A30s (4 slices, other placements than the A100's), the first already in MIG mode."""
    return NodeView("n4", cpu, mem, (gpu(0, "A30-24GB", mig_enabled=True), gpu(1, "A30-24GB")),
                    {"zone": "b"})


def cluster():
    return [node("n1", n_gpus=2, cpu=64000, labels={"zone": "a"}), node("n2", n_gpus=2, key="T4", cpu=32000),
            node("n3", n_gpus=1, labels={"zone": "a"}), a30_node()]


def tight_cluster():
    """Host CPU and memory run out before the GPUs do (the other cluster rarely gets there)."""
    return [node("n1", n_gpus=2, cpu=24000, mem=60000, labels={"zone": "a"}),
            node("n2", n_gpus=2, key="T4", cpu=16000, mem=40000),
            node("n3", n_gpus=1, cpu=20000, mem=50000, labels={"zone": "a"}), a30_node(16000, 40000)]


def check_capacity(eng: Engine) -> None:
    nodes = {n.name: n for n in eng.nodes}
    bound: dict[str, set[tuple[str, int]]] = {}
    for a in eng.assignments.values():
        if a.request.kind != "whole" and a.request.affinity:
            bound.setdefault(a.request.affinity, set()).add((a.node, a.gpus[0]))
    assert all(len(places) == 1 for places in bound.values()), bound   # an affinity tag is one GPU
    cpu = dict.fromkeys(nodes, 0)
    mem = dict.fromkeys(nodes, 0)
    for a in eng.assignments.values():
        cpu[a.node] += a.request.cpu_milli
        mem[a.node] += a.request.memory_mib
    for name, n in nodes.items():
        assert cpu[name] <= n.cpu_milli and mem[name] <= n.memory_mib
        assert eng.held_on(name) == [a for a in eng.assignments.values() if a.node == name]   # kept per node
    quota: dict[tuple[str, int], float] = {}
    for a in eng.assignments.values():
        if a.request.kind == "fastpod":
            key = (a.node, a.gpus[0])
            quota[key] = quota.get(key, 0.0) + a.request.quota_request
    assert all(q <= 1 + 1e-9 for q in quota.values()), quota
    for a in eng.assignments.values():   # where a request may go at all
        r, view = a.request, nodes[a.node]
        assert all(dict(view.labels).get(k) == v for k, v in r.node_selector), (r, view.labels)
        assert not r.gpu_models or all(view.gpus[i].model in r.gpu_models for i in a.gpus), (r, a.gpus)
    for u in eng.usage():
        g = nodes[u["node"]].gpus[u["gpu"]]
        assert u["sm_used_percent"] <= 100
        assert u["memory_used_mib"] <= g.memory_mib * eng.mps_oversubscription
        uses = bool(u["sharers"]) + bool(u["mig"]) + (u["whole"] is not None)
        assert uses <= 1, u
        assert not (g.mig_enabled and (u["sharers"] or u["whole"] is not None)), u
        sharers = [eng.assignments[rid].request for rid in [*u["sharers"], *(m[3] for m in u["mig"])]]
        assert len({s.exclusion for s in sharers}) <= 1, u                      # exclusion tags
        anti = [s.anti_affinity for s in sharers if s.anti_affinity]
        assert len(anti) == len(set(anti)), u                                  # anti-affinity tags
        inst = [(pid, s, z) for s, z, pid, _rid in u["mig"]]
        assert sum(z for _p, _s, z in inst) == bin(used_mask(inst)).count("1")  # no overlap
        # only what the hardware allows: each slice at a start its profile has on this model,
        # within the profile's instance count and the GPU's compute slices
        profiles = {p.profile_id: p for p in g.mig_profiles}
        for pid, s, z in inst:
            assert pid in profiles and s in profiles[pid].placements and z == profiles[pid].memory_slices, u
        assert all(n <= profiles[pid].max_instances for pid, n in Counter(p for p, _s, _z in inst).items()), u
        assert sum(profiles[pid].slices for pid, _s, _z in inst) <= compute_slices_total(g.mig_profiles), u


@settings(max_examples=60, deadline=None)
@given(streams(), st.sampled_from([cluster, tight_cluster]))
def test_capacity_never_exceeded_and_release_is_exact(stream, make_cluster):
    reqs, _releases = stream
    eng = Engine(make_cluster())
    snapshots = []
    for r in reqs:
        before = eng.usage()
        res = eng.place(r)
        check_capacity(eng)
        if res:
            snapshots.append((res, before))
        else:
            assert eng.usage() == before  # a rejection changes nothing
    # releasing the most recent placement restores the ledger exactly
    while snapshots:
        res, before = snapshots.pop()
        eng.release(res)
        assert eng.usage() == before
        check_capacity(eng)
    assert not eng.assignments
    # and the hosts got back all their CPU and memory (usage() shows GPUs only), the affinity
    # tags their freedom: a request for a whole host, bound to a tag used before, fits every node
    for i, n in enumerate(eng.nodes):
        full = Request(f"full{i}", "mps", gpu_memory_mib=1, cpu_milli=n.cpu_milli, memory_mib=n.memory_mib,
                       affinity="a")
        assert eng.place(full, excluded={m.name: "not this one" for m in eng.nodes if m is not n})
        eng.release(full.id)


@settings(max_examples=60, deadline=None)
@given(streams(), st.sampled_from([cluster, tight_cluster]))
def test_capacity_holds_with_releases_in_between(stream, make_cluster):
    # releases between placements: what one release gives back (an affinity tag's binding while
    # other sharers still hold it, host CPU) must be exactly its own
    reqs, releases = stream
    eng = Engine(make_cluster())
    for k, r in enumerate(reqs):
        eng.place(r)
        check_capacity(eng)
        for j in (j for j in releases if j == k):
            held = reqs[(k * 7 + j) % (k + 1)].id   # one of the requests placed so far
            if held in eng.assignments:
                eng.release(held)
                check_capacity(eng)


@settings(max_examples=30, deadline=None)
@given(streams())
def test_decisions_are_deterministic(stream):
    reqs, releases = stream

    def run(work_out_states_between: bool = False):
        eng = Engine(cluster())
        out = []
        for k, r in enumerate(reqs):
            if work_out_states_between:   # as a controller's start does: no decision changes
                eng.work_out_states()
            res = eng.place(r)
            out.append(res.to_dict() if res else res.reason)
            if k in releases and res:
                eng.release(res)
        return out

    assert run() == run() == run(work_out_states_between=True)


@settings(max_examples=30, deadline=None)
@given(streams())
def test_round_trip_keeps_ledger(stream):
    reqs, _ = stream
    eng = Engine(cluster())
    for r in reqs:
        eng.place(r)
    assert Engine.from_dict(eng.to_dict()).usage() == eng.usage()


def changed_cluster():
    """``cluster()`` after changes outside fastshare: MIG mode turned on (by hand) on n1 GPU 0
    and n3 GPU 0, n2 GPU 1 reporting half its memory."""
    import dataclasses

    def change(view, i, **kw):
        gpus = list(view.gpus)
        gpus[i] = dataclasses.replace(gpus[i], **kw)
        return dataclasses.replace(view, gpus=tuple(gpus))

    n1, n2, n3, *rest = cluster()
    return [change(n1, 0, mig_enabled=True), change(n2, 1, memory_mib=n2.gpus[1].memory_mib // 2),
            change(n3, 0, mig_enabled=True), *rest]


def over_committed(eng: Engine) -> set[tuple[str, int]]:
    """GPUs holding more than their view takes now."""
    nodes = {n.name: n for n in eng.nodes}
    out = set()
    for u in eng.usage():
        g = nodes[u["node"]].gpus[u["gpu"]]
        if (u["sm_used_percent"] > 100 or u["memory_used_mib"] > g.memory_mib * eng.mps_oversubscription
                or (g.mig_enabled and (u["sharers"] or u["whole"] is not None))
                or (u["share_kind"] == "fastpod" and u["memory_used_mib"] > g.memory_mib)):
            out.add((u["node"], u["gpu"]))
    return out


@settings(max_examples=60, deadline=None)
@given(streams(), streams())
def test_a_view_changed_under_held_shares_takes_nothing_new_until_they_drain(stream, more):
    """Held shares restored with force into a view that changed under them (and a lowered MPS
    oversubscription): the engine counts them all, places nothing new on a GPU they
    over-commit, and every release gives back exactly what it took."""
    before = Engine(cluster(), mps_oversubscription=2.0)
    for r in stream[0]:
        before.place(r)
    eng = Engine(changed_cluster(), mps_oversubscription=1.0)
    empty = eng.usage()
    for a in before.assignments.values():
        eng.restore(a, check_host=False, force=True)
    assert set(eng.assignments) == set(before.assignments)
    held = eng.usage()
    over = over_committed(eng)
    placed = []
    for r in more[0]:
        r = Request.from_dict(dict(r.to_dict(), id=f"new-{r.id}"))
        res = eng.place(r)
        if res:
            assert not over & {(res.node, i) for i in res.gpus}, (res, over)
            placed.append(res)
    for res in reversed(placed):
        eng.release(res)
    assert eng.usage() == held
    for rid in list(eng.assignments):
        eng.release(rid)
    assert eng.usage() == empty and not eng.assignments
