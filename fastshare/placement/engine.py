"""The placement engine: the decision procedure over the cluster's ledger.

One ``Engine`` owns the ledger (who holds what on which GPU: ``ledger.py``). ``place`` either
commits a request to the ledger and returns an :class:`Assignment`, or changes nothing and
returns a :class:`Rejection` that says why. ``release`` gives back exactly what ``place`` took.
``restore`` re-applies persisted assignments after a restart (no policy involved).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields, replace
from typing import Any

from fastshare.device.api import MigProfile
from fastshare.placement import mig as migmath
from fastshare.placement.ledger import MEMO_SIZE, GpuRecord, NodeRecord, host_left
from fastshare.placement.model import (
    MILLI,
    Assignment,
    GpuView,
    InvalidRequest,
    MigSlot,
    NodeView,
    Rejection,
    Request,
)
from fastshare.placement.policies import Policy, Task, best_first, clustering_tag
from fastshare.placement.rejection_folds import HostBlocks, HostFold, ShareFold, WholeFold
from fastshare.placement.rejection_words import (
    closed_note,
    fmt_mib,
    host_words,
    mig_off_note,
    no_mig_gpu_reason,
    no_slice_words,
    only_looked,
    share_words,
    some,
    whole_words,
)
from fastshare.placement.shape_heaps import Entry, ShapeHeap, ShapeHeaps
from fastshare.placement.topology import group_cost, tightest_group

SCORES_KEPT = 200_000   # policy scores remembered by node state (then forgotten)


_UNSEEN = object()   # a cache miss (a score kept may be anything)
QUOTA_SLACK = 1e-9  # float noise in a sum of quota requests (0.1 + 0.2 + 0.7), as the node agent allows


def _policy_task(r: Request) -> Task:
    """A request as the policy sees it: whole GPUs, an SM share, or (memory-only MPS) the
    least share, with the models it may run on."""
    if r.kind == "whole":
        return _task(r.cpu_milli, MILLI, r.gpus, r.gpu_models)
    return _task(r.cpu_milli, r.sm_milli if r.kind == "fastpod" else 1, 1, r.gpu_models)


@functools.lru_cache(maxsize=4096)
def _task(cpu: int, milli: int, gpus: int, models: tuple[str, ...]) -> Task:
    """One Task per shape: requests repeat a few shapes, and the scores kept are keyed by the
    Task, so each key would otherwise hold a Task (and a frozenset) of its own for the garbage
    collector to walk."""
    return Task(cpu, milli, gpus, frozenset(models))


def _tag(r: Request) -> str:
    """The task shape a request held on a node counts as for policies that use tags: every
    kind, as the trace replay counts every GPU task it placed ("share" for a fastpod or MPS
    share and a MIG slice, "N-gpu" for whole GPUs and a 100 % fastpod share)."""
    return clustering_tag(_policy_task(r))


class Engine:
    """Placement over a cluster view. Deterministic: same view + same calls = same answers.

    ``policy`` scores nodes for ``fastpod`` and ``whole`` requests (default: fastshare's own
    policy, learning the request mix from the requests it sees); ``mps_oversubscription`` lets
    memory-only MPS shares promise up to that factor of a GPU's memory (1.0 = none)."""

    def __init__(self, nodes: Iterable[NodeView] = (), policy: Policy | None = None,
                 mps_oversubscription: float = 1.0) -> None:
        if not (1.0 <= mps_oversubscription <= 16.0) or not math.isfinite(mps_oversubscription):
            raise InvalidRequest(f"mps_oversubscription: must be in [1, 16] (got {mps_oversubscription})")
        self.mps_oversubscription = mps_oversubscription
        if policy is None:
            from fastshare.placement.fastshare_policy import FastsharePolicy
            policy = FastsharePolicy()
        self.policy = policy
        self._nodes: dict[str, NodeRecord] = {}
        self._cpu_total = 0
        self._closed_gpus = 0   # GPUs whose view says they take nothing new (see _closed_note)
        self._gpu_milli: Counter[str] = Counter()   # per GPU model
        self._assignments: dict[str, Assignment] = {}
        self._affinity: dict[str, tuple[str, int]] = {}  # affinity tag -> (node, gpu)
        self._memo_generation = policy.generation
        self._heaps = ShapeHeaps()
        # numbers node ranks and versions: a node added again under a name never has a version
        # its earlier self had (the heaps' entries of that one stay stale)
        self._ticks = itertools.count()
        self._changes = 0   # changes to any node so far: a remembered rejection holds until the next
        self._rejected: dict[tuple, tuple[int, Rejection]] = {}
        self._scores: dict[tuple, Any] = {}   # see _policy_score
        self._answers: dict[tuple, dict[int, Any]] = {}  # shape -> node state -> answer (see _answer)
        self._states: dict[tuple, int] = {}   # node state -> its number (see _state)
        self._gpu_states: dict[tuple, int] = {}   # GPU state -> its number (see _gpu_state)
        self._gpu_alike: dict[tuple, dict[int, tuple[bool, int]]] = {}   # see _gpu_answers
        self._alike: dict[int, list[int]] = {}   # state number -> the ranks of the nodes in it, in order
        self._by_rank: dict[int, NodeRecord] = {}
        self._stateless: set[str] = set()   # nodes whose state is not worked out since they changed
        self._blocks: HostBlocks | None = None   # rejections' folds per block of nodes (see _say_why)
        for n in nodes:
            self.add_node(n)

    # ---- cluster view ------------------------------------------------------------------------
    def add_node(self, view: NodeView) -> None:
        if view.name in self._nodes:
            raise InvalidRequest(f"node {view.name}: already in the cluster view")
        tick = next(self._ticks)
        record = NodeRecord(view, [GpuRecord(g) for g in view.gpus], rank=tick, version=tick)
        self._nodes[view.name] = self._by_rank[tick] = record
        self._stateless.add(view.name)
        self._changed(view.name)
        self._blocks = None   # cut again, in the new node order
        self._capacity(view, +1)

    def remove_node(self, name: str) -> None:
        """Forget a node; refused while assignments still live on it."""
        held = list(self._nodes[name].held)
        if held:
            raise InvalidRequest(f"node {name}: still holds {len(held)} assignment(s), e.g. {held[0]}")
        gone = self._nodes.pop(name)
        self._unstate(gone)
        del self._by_rank[gone.rank]
        self._capacity(gone.view, -1)
        self._changed(name)
        self._blocks = None

    def _capacity(self, view: NodeView, sign: int) -> None:
        """Keep the cluster's CPU and GPU totals and tell the policy (it weighs CPU and the
        models requests are bound to by them; it says by its ``generation`` when it scores
        differently from then on)."""
        self._cpu_total += sign * view.cpu_milli
        self._closed_gpus += sign * sum(1 for g in view.gpus if g.closed)
        for g in view.gpus:
            self._gpu_milli[g.model] += sign * MILLI
        self.policy.cluster(self._cpu_total, self._gpu_milli)

    def _touch(self, node: NodeRecord) -> None:
        """``node`` changed: its remembered answers and heap entries no longer hold."""
        node.memo.clear()
        self._unstate(node)
        for g in node.gpus:
            g.state = None
        node.room = None
        node.version = next(self._ticks)
        self._changed(node.view.name)
        if self._blocks is not None:
            self._blocks.touched(node)

    def _unstate(self, node: NodeRecord) -> None:
        """``node``'s state no longer holds: out of the nodes alike, worked out again when asked."""
        if node.state is not None:
            ranks = self._alike[node.state]
            del ranks[bisect.bisect_left(ranks, node.rank)]
            if not ranks:
                del self._alike[node.state]
            node.state = None
        self._stateless.add(node.view.name)

    def _changed(self, name: str) -> None:
        """Node ``name`` changed, came or went: the shape heaps score it again, and no rejection
        is given again as it was."""
        self._heaps.changed(name)
        self._changes += 1

    def _forget(self) -> None:
        """The policy's scores changed: drop every node's memo and score every shape heap again
        now, inside this one decision (left for later, the next request of each shape would be
        slow instead). A heap for an affinity-bound shape is dropped: its binding may be gone.
        MIG slices are chosen without the policy: their answers and heaps stay as they are."""
        for n in self._nodes.values():
            n.memo.clear()
        self._scores.clear()
        self._answers = {key: alike for key, alike in self._answers.items() if key[0] == "exclusive"}
        self._memo_generation = self.policy.generation
        for shape, h in self._heaps.items():
            if h.sample.affinity:
                self._heaps.drop(shape)
            elif h.sample.kind != "exclusive":
                self._heaps.build(shape, self._every_entry(shape, h.sample), h.sample)

    def set_capacity(self, name: str, cpu_milli: int, memory_mib: int) -> None:
        """Change the host CPU/memory a node offers, assignments kept: where others (Pods the
        engine does not place) took it, the node may end up over-committed and takes only
        requests that ask for no CPU/memory, as the kube-scheduler does."""
        node = self._nodes[name]
        if (node.view.cpu_milli, node.view.memory_mib) == (cpu_milli, memory_mib):
            return
        self._capacity(node.view, -1)
        node.view = replace(node.view, cpu_milli=max(0, cpu_milli), memory_mib=max(0, memory_mib))
        self._capacity(node.view, +1)
        self._touch(node)

    @property
    def nodes(self) -> list[NodeView]:
        return [n.view for n in self._nodes.values()]

    def has_node(self, name: str) -> bool:
        return name in self._nodes

    @property
    def assignments(self) -> dict[str, Assignment]:
        """A copy of every assignment: for one, or one node's, see :meth:`assignment` and
        :meth:`held_on`, which do not copy them all."""
        return dict(self._assignments)

    def assignment(self, request_id: str) -> Assignment | None:
        return self._assignments.get(request_id)

    def held_on(self, name: str) -> list[Assignment]:
        """The assignments node ``name`` holds, in the order they were placed or restored."""
        node = self._nodes.get(name)
        return [] if node is None else [self._assignments[rid] for rid in node.held]

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [n.view.to_dict() for n in self._nodes.values()],
            "assignments": [a.to_dict() for a in self._assignments.values()],
            "mps_oversubscription": self.mps_oversubscription,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], policy: Policy | None = None) -> Engine:
        eng = cls((NodeView.from_dict(n) for n in d["nodes"]), policy=policy,
                  mps_oversubscription=d.get("mps_oversubscription", 1.0))
        for a in d.get("assignments", ()):
            eng.restore(Assignment.from_dict(a))
        return eng

    def usage(self) -> list[dict[str, Any]]:
        """Per-GPU ledger, for status displays and tests."""
        out = []
        for n in self._nodes.values():
            for g in n.gpus:
                out.append({
                    "node": n.view.name, "gpu": g.view.index, "model": g.view.model,
                    "sm_used_percent": g.sm_used / 10, "memory_used_mib": g.mem_used,
                    "share_kind": g.share_kind, "sharers": sorted(g.sharers),
                    "mig": sorted((s, z, pid, rid) for rid, (pid, s, z) in g.mig.items()),
                    "whole": g.whole,
                })
        return out

    # ---- decisions ---------------------------------------------------------------------------
    def place(self, request: Request, excluded: Mapping[str, str] | None = None) -> Assignment | Rejection:
        """``excluded``: nodes the caller rules out (node -> why, worded to follow "N node(s)"),
        e.g. for a Pod's node affinity or taints, which the engine does not model itself."""
        if request.id in self._assignments:
            raise InvalidRequest(f"id: request {request.id} is already placed")
        if request.kind in ("fastpod", "whole"):   # the kinds whose GPU share the policy learns
            self.policy.observe(_policy_task(request))
        if self.policy.generation != self._memo_generation:
            self._forget()
        if len(self._states) >= SCORES_KEPT:   # forget them all, and the answers keyed by them (here,
            self._states.clear()                 # between decisions: the numbers hold within one)
            self._answers.clear()
            self._gpu_states.clear()
            self._gpu_alike.clear()
            self._alike.clear()
            self._heaps.clear()   # their entries name states by number
            for n in self._nodes.values():
                n.state = None
                for g in n.gpus:
                    g.state = None
            self._stateless = set(self._nodes)
        excluded = excluded or {}
        result = self._place_from_heap(request, excluded)
        if result is None:   # no shape (a random policy), or no node takes it: look at every node
            result = self._rejection_seen(request, excluded)   # (a Rejection is falsy: no `or`)
            if result is None:
                result = self._place_scanning(request, excluded)
        if isinstance(result, Assignment):
            uuids = tuple(self._nodes[result.node].view.gpus[i].uuid for i in result.gpus)
            if all(uuids):   # the GPUs for good (their indexes shift when a GPU leaves the node)
                result = replace(result, gpu_uuids=uuids)
            self._apply(result)
        return result

    def _rejection_seen(self, request: Request, excluded: Mapping[str, str]) -> Rejection | None:
        """The rejection given to the same request (but its id) when no node has changed since:
        a full cluster rejects the arrivals of a few shapes over and over, and saying why looks
        at every GPU."""
        seen = self._rejected.get(_asked(request, excluded))
        return seen[1] if seen and seen[0] == self._changes else None

    def _place_scanning(self, request: Request, excluded: Mapping[str, str]) -> Assignment | Rejection:
        """Place by looking at every node; a rejection says why each was not taken (and is
        remembered, see :meth:`_rejection_seen`)."""
        result = self._scan(request, excluded)
        if isinstance(result, Rejection):
            if len(self._rejected) >= MEMO_SIZE:
                self._rejected.clear()
            self._rejected[_asked(request, excluded)] = (self._changes, result)
        return result

    def _scan(self, request: Request, excluded: Mapping[str, str]) -> Assignment | Rejection:
        if self._memo_key(request) is not None and request.kind in ("fastpod", "mps", "whole"):
            return self._say_why(request, excluded)   # its shape's heap found no node
        nodes, why = self._filter_nodes(request, excluded)
        if not nodes:
            return Rejection(why)
        result: Assignment | Rejection
        if request.kind == "exclusive":
            result = self._place_exclusive(request, nodes)
        elif request.kind == "whole":
            result = self._place_whole(request, nodes)
        else:
            result = self._shares(request, nodes)
        if isinstance(result, Rejection):
            reason = result.reason + self._closed_note(request, nodes) + mig_off_note(request, nodes)
            result = Rejection(reason + only_looked(len(nodes), len(self._nodes), why), result.details)
        return result

    def _say_why(self, r: Request, excluded: Mapping[str, str]) -> Rejection:
        """Why no node takes share or whole GPUs ``r`` (its shape's heap found none): folded
        per block of nodes (``fastshare/placement/rejection_folds.py``; a full cluster rejects
        often, and this would look at every node), or node by node where the blocks' folds do
        not tell it: a node selector, nodes the caller excludes, an affinity binding (a node's
        own answer), closed GPUs (named one by one)."""
        key = self._why_key(r)
        words = whole_words if r.kind == "whole" else self._share_words
        if r.node_selector or excluded or key[-1] or self._closed_gpus or not self._nodes:
            nodes, why = self._filter_nodes(r, excluded)
            if not nodes:
                return Rejection(why)
            return Rejection(words(r, self._nodes_fold(r, nodes), len(nodes)) + self._closed_note(r, nodes)
                             + only_looked(len(nodes), len(self._nodes), why))
        if self._blocks is None:
            self._blocks = HostBlocks(list(self._nodes.values()), host_left,
                                      max(4, math.isqrt(len(self._nodes)) // 4))
        host = HostFold(r.cpu_milli, r.memory_mib)
        fold = self._blocks.fold(host, key, *self._summary(r, key))
        why = "; ".join(host_words(r, host))
        if not host.fit:
            return Rejection(why)
        return Rejection(words(r, fold, host.fit) + only_looked(host.fit, len(self._nodes), why))

    def release(self, assignment: Assignment | str) -> Assignment:
        """Give back what an assignment holds; returns it. Unknown ids, and an Assignment that is
        not the one held under its id (released already, the id placed again since), raise
        KeyError and change nothing."""
        rid = assignment if isinstance(assignment, str) else assignment.request.id
        a = self._assignments.get(rid)
        if a is None:
            raise KeyError(f"request {rid} is not placed (unknown, or released already)")
        if not isinstance(assignment, str) and assignment != a:
            raise KeyError(f"request {rid}: this assignment was released already; the id now holds "
                           f"{a.node} GPU(s) {list(a.gpus)}")
        del self._assignments[rid]
        node = self._nodes[a.node]
        self._touch(node)
        r = a.request
        node.give_back(r, _tag(r))
        for i in a.gpus:
            g = node.gpus[i]
            g.give_back(r)
            if r.affinity and r.kind != "whole" and self._affinity.get(r.affinity) == (a.node, i) \
                    and not any(h.affinity == r.affinity for h in self._holders(g)):
                self._rebind(r.affinity)
        return a

    def _rebind(self, tag: str) -> None:
        """Bind affinity tag ``tag`` to the GPU of its first remaining holder, if any: restores
        may have counted holders of one tag on several GPUs, and a tag some GPU still holds must
        keep its later requests there."""
        self._affinity.pop(tag, None)
        for a in self._assignments.values():
            if a.request.affinity == tag and a.request.kind != "whole":
                self._affinity[tag] = (a.node, a.gpus[0])
                return

    def restore(self, assignment: Assignment, check_host: bool = True, force: bool = False) -> str | None:
        """Re-apply a persisted assignment (controller restart). Refuses one that no longer fits;
        ``check_host=False`` skips the host CPU/memory check (see :meth:`set_capacity`).

        ``force``: a share its node still holds, where the GPU's view changed under it (MIG mode
        or layout changed by hand, less memory reported, the MPS oversubscription factor lowered,
        MPS gone from the node), is counted all the same: its GPU is then over-committed and
        takes nothing new until enough is released. Returns why it does not fit (None when it
        does). What cannot be counted at all (an unknown node or GPU, another GPU's UUID, a GPU
        held whole by another assignment, shares of the other kind) is refused either way."""
        r = assignment.request
        if r.id in self._assignments:
            raise InvalidRequest(f"id: request {r.id} is already placed")
        node = self._nodes.get(assignment.node)
        if node is None:
            raise InvalidRequest(f"node: {assignment.node} is not in the cluster view")
        if check_host and (r.cpu_milli > node.cpu_left or r.memory_mib > node.mem_left):
            raise InvalidRequest(f"assignment {r.id}: node {node.view.name} lacks CPU/memory for it")
        want = r.gpus if r.kind == "whole" else 1
        if len(assignment.gpus) != want:
            raise InvalidRequest(f"gpus: a {r.kind} assignment holds exactly {want} GPU(s) "
                                 f"(assignment {r.id} lists {list(assignment.gpus)})")
        twice = [i for i, c in Counter(assignment.gpus).items() if c > 1]
        if twice:
            raise InvalidRequest(f"gpus: GPU {twice[0]} appears twice in assignment {r.id}")
        if r.kind == "exclusive" and assignment.mig is None:
            raise InvalidRequest(f"mig: exclusive assignment {r.id} names no MIG slice")
        problems = []
        for i in assignment.gpus:
            if not 0 <= i < len(node.gpus):
                raise InvalidRequest(f"gpus: {node.view.name} has no GPU {i}")
            g = node.gpus[i]
            uuid = assignment.gpu_uuids[assignment.gpus.index(i)] if assignment.gpu_uuids else ""
            if uuid and g.view.uuid and uuid != g.view.uuid:
                raise InvalidRequest(f"gpus: GPU {i} of {node.view.name} is {g.view.uuid}, not the "
                                     f"{uuid} assignment {r.id} holds")
            clash = g.clash(r)
            if clash:
                raise InvalidRequest(f"assignment {r.id}: {g.label(node.view.name)} {clash}")
            problem = self._gpu_problem(r, g, node.view.name, placing=False)
            if r.kind == "exclusive":
                m = assignment.mig
                prof = next((p for p in g.view.mig_profiles if p.profile_id == m.profile_id), None)
                if prof is None or m.start not in migmath.free_starts(prof, g.view.mig_profiles,
                                                                       list(g.mig.values())):
                    problem = (f"MIG placement {m.profile_name} at memory slice {m.start} is not free on "
                               f"{g.label(node.view.name)}" if prof is not None else
                               f"MIG profile {m.profile_name} (id {m.profile_id}) is not offered on "
                               f"{g.label(node.view.name)}")
                else:
                    problem = g.foreign_overlap(m, node.view.name) or problem
            elif problem == "not idle" and g.view.mig_enabled:
                problem = "in MIG mode (a whole GPU needs MIG disabled)"
            elif r.kind == "mps" and problem and problem.startswith("only "):
                problem += (f" for its {fmt_mib(r.gpu_memory_mib)} (MPS shares may promise "
                            f"{self.mps_oversubscription:g} x its {fmt_mib(g.view.memory_mib)})")
            if problem and not force:
                raise InvalidRequest(f"assignment {r.id}: {problem}")
            if problem:
                label = g.label(node.view.name)
                problems.append(problem if label in problem else f"{label}: {problem}")
        self._apply(assignment)
        return "; ".join(problems) or None

    def _apply(self, a: Assignment) -> None:
        r = a.request
        node = self._nodes[a.node]
        self._touch(node)
        node.hold(r, _tag(r))
        for i in a.gpus:
            node.gpus[i].hold(r, a.mig)
            if r.affinity and r.kind != "whole":   # a restore may count a holder elsewhere
                self._affinity.setdefault(r.affinity, (a.node, i))
        self._assignments[r.id] = a

    # ---- filters -----------------------------------------------------------------------------
    def _filter_nodes(self, r: Request, excluded: Mapping[str, str]) -> tuple[list[NodeRecord], str]:
        """The nodes not ``excluded`` whose labels, free CPU and free memory fit ``r``, and why
        the others do not ("" when none was dropped)."""
        sel = dict(r.node_selector)
        out, no_sel = [], 0
        ruled_out: dict[str, list[str]] = {}
        host = HostFold(r.cpu_milli, r.memory_mib)
        for n in self._nodes.values():   # once per node per rejection: kept lean
            view = n.view
            if sel and any(dict(view.labels).get(k) != v for k, v in sel.items()):
                no_sel += 1
            elif excluded and view.name in excluded:
                ruled_out.setdefault(excluded[view.name], []).append(view.name)
            elif host.takes(view.cpu_milli - n.cpu_used, view.memory_mib - n.mem_used, n.rank, view.name):
                out.append(n)
        if not self._nodes:
            return [], "the cluster view has no nodes"
        parts = []
        for why, names in sorted(ruled_out.items()):
            parts.append(f"{len(names)} node(s) {why} ({some(names)})")
        if no_sel:
            parts.append(f"{no_sel} node(s) do not match node_selector {sel}")
        return out, "; ".join(parts + host_words(r, host))

    def _gpu_problem(self, r: Request, g: GpuRecord, node: str, placing: bool = True) -> str | None:
        """Why GPU ``g`` cannot take a share ``r`` (None when it can). ``placing`` False: ``r`` is a
        share it holds, counted again (``restore``): affinity bindings and a closed GPU do not apply."""
        v = g.view
        if v.lost:
            return v.lost
        if placing and v.closed:
            return v.closed
        if r.gpu_models and v.model not in r.gpu_models:
            return f"model {v.model} not in {list(r.gpu_models)}"
        if r.kind in ("fastpod", "mps"):
            if v.no_mps:
                return v.no_mps
            if g.whole is not None:
                return "held whole"
            if g.mig_mode:
                return "in MIG mode (MPS shares need the whole device)"
            if g.share_kind not in (None, r.kind):
                return f"already shared as {g.share_kind}"
            return self._tag_problem(r, g, node, placing) or self._room_problem(r, g)
        if r.kind == "whole":
            return None if g.idle else "not idle"
        if not v.mig_capable:
            return "not MIG-capable"
        if placing and not g.mig_mode and v.mig_enable_needs_reset:
            return "MIG off, and turning it on waits for a GPU reset"
        if g.sharers or g.whole is not None:
            return "in use by MPS shares or whole"
        return self._tag_problem(r, g, node, placing)

    def _closed_note(self, r: Request, nodes: list[NodeRecord]) -> str:
        """:func:`closed_note`, without a look at every GPU when none in the cluster is closed."""
        return closed_note(r, nodes) if self._closed_gpus else ""

    def _share_words(self, r: Request, fold: ShareFold, looked: int) -> str:
        """:func:`share_words`, with the GPUs that only the tags rule out among those with room
        for ``r`` (a node's summary leaves ``r``'s sizes out) and the binding of its affinity tag."""
        tagged = [f"{n.view.name} GPU {i} ({why})" for n, i, why in sorted(fold.tagged, key=_node_order)
                  if self._room_problem(r, n.gpus[i]) is None]
        return share_words(r, fold, looked, tagged, self._affinity.get(r.affinity) if r.affinity else None)

    def _holders(self, g: GpuRecord) -> Iterable[Request]:
        """Who shares ``g``: its MPS sharers, or the holders of its MIG slices (which split its
        memory bandwidth and go down together), for the sharing tags."""
        if not g.mig:
            return g.sharers.values()
        return [*g.sharers.values(), *(self._assignments[rid].request for rid in g.mig)]

    def _tag_problem(self, r: Request, g: GpuRecord, node: str, check_affinity: bool = True) -> str | None:
        """Why the KubeShare tags (of ``r`` or of those sharing ``g``) keep share or slice ``r`` off ``g``."""
        if check_affinity and r.affinity and r.affinity in self._affinity \
                and self._affinity[r.affinity] != (node, g.view.index):
            bound_node, bound_gpu = self._affinity[r.affinity]
            return f"affinity tag {r.affinity!r} binds it to {bound_node} GPU {bound_gpu}"
        for s in self._holders(g):
            if s.exclusion != r.exclusion:
                return "exclusion tags differ"
            if r.anti_affinity and s.anti_affinity == r.anti_affinity:
                return f"anti-affinity {r.anti_affinity} already on it"
        return None

    def _room_problem(self, r: Request, g: GpuRecord) -> str | None:
        """Why share ``r`` does not fit the SMs / memory left on ``g``."""
        v = g.view
        if r.kind == "fastpod":
            if g.sm_used + r.sm_milli > MILLI:
                return f"only {max(0, MILLI - g.sm_used) / 10:g} % SMs free"
            if g.quota_used + r.quota_request > 1 + QUOTA_SLACK:
                return f"only {max(0.0, 1 - g.quota_used):.2f} of its time quota free"
            if g.mem_used + r.gpu_memory_mib > v.memory_mib:
                return f"only {fmt_mib(max(0, v.memory_mib - g.mem_used))} free"
        elif r.gpu_memory_mib > v.memory_mib:  # oversubscription is for the sum, not one share
            return f"has {fmt_mib(v.memory_mib)} of memory in all"
        elif g.mem_used + r.gpu_memory_mib > v.memory_mib * self.mps_oversubscription:
            return f"only {fmt_mib(max(0, v.memory_mib * self.mps_oversubscription - g.mem_used))} free"
        return None

    @staticmethod
    def _policy_free(r: Request, g: GpuRecord, fits: bool) -> int:
        """``g``'s free share as the policy sees it for ``r`` (``fits``: ``r`` may go there): the
        SM share that later fastpod shares can still take, which is what the policies value (and
        what the trace replay gives them). A GPU ``r`` cannot use shows it only when it is smaller
        than ``r`` needs, so the policy never picks that GPU; otherwise (MIG, whole, MPS, lost or
        closed, or only ``r``'s memory, quota or tags keep it off) it shows none. Showing none for
        every GPU ``r`` did not fit made a half-shared GPU count as full, so the engine scored
        nodes unlike the replay behind the published figures."""
        if fits:
            return max(0, MILLI - g.sm_used)
        if not g.open_to("fastpod"):
            return 0
        free = max(0, MILLI - g.sm_used)
        return free if free < (r.sm_milli if r.kind == "fastpod" else MILLI) else 0

    # ---- per kind ----------------------------------------------------------------------------
    def _memo_key(self, r: Request) -> tuple | None:
        """``r``'s shape: what of ``r`` decides how a node answers it (None: look at every node,
        afresh). Between two decisions only the node placed on changes, and requests repeat a
        few shapes: so each shape keeps a heap of the nodes that take it, best first, and a node
        is scored again only after it changes (``_touch``) or the policy's scores do
        (``_forget``); nodes in the same state share their answers (``_lookup``). The request's
        id and what is checked each time (host memory, nodes the caller excludes) are not in it;
        its node selector keys the heap beside it."""
        if self.policy.randomized:   # a random policy draws on every score: nothing repeats
            return None
        # a bound tag with its binding: a rejection names the tag (two tags may bind one GPU)
        bound = (r.affinity, self._affinity[r.affinity]) if r.affinity in self._affinity else None
        if r.kind == "exclusive":
            return (r.kind, r.sm_count, r.sm_percent, r.gpu_memory_mib, r.mig_profile, r.cpu_milli,
                    r.gpu_models, r.exclusion, r.anti_affinity, bound)
        return (r.kind, r.sm_milli, r.gpu_memory_mib, r.quota_request, r.gpus, r.cpu_milli, r.gpu_models,
                r.exclusion, r.anti_affinity, bound)

    def _why_key(self, r: Request) -> tuple | None:
        """What of ``r`` a node's summary for its rejection depends on (``_share_why``,
        ``_whole_why``): its kind, GPU models and tags, not its sizes, so the rejected shapes of a
        kind share summaries (a node changed is summed up once, not once per shape). None: look
        at every node afresh; last, as in a shape, the tag's binding."""
        memo = self._memo_key(r)
        return None if memo is None else ("why", r.kind, r.gpu_models, r.exclusion, r.anti_affinity, memo[-1])

    def _answer(self, r: Request, n: NodeRecord, memo: tuple) -> Any:
        """Node ``n``'s answer to shape ``memo`` (see :meth:`_lookup`)."""
        return self._lookup(r, memo, memo, self._work_out)(n)[0]

    def _work_out(self, r: Request, n: NodeRecord) -> tuple[Any, Any]:
        if r.kind == "exclusive":
            best = self._node_slice(r, n)
            return best, None if best is None else best[0]
        task = _policy_task(r)
        if r.kind == "whole":
            idle, score = self._whole_answer(r, n, task)
            if score is None:
                return (idle, None), None
            # the GPUs to take; nodes the policy scores alike differ to the job in how they
            # talk, so the group's tightness ranks next (the heap's top is the node to take)
            group = tightest_group(n.view, idle, r.gpus)
            return (group, score), (best_first(score), group_cost(n.view, group))
        answer = self._share_answer(r, n, task)
        return answer, None if answer is None else best_first(answer[0])

    def _state(self, n: NodeRecord) -> int:
        """The number of ``n``'s state: everything of ``n`` a request's answer (through its shape's
        heap) depends on, but its name (which only an affinity binding looks at): its free CPU, how its
        GPUs are linked (whole GPUs rank by it) and, per GPU, its index and state
        (:meth:`_gpu_state`); for a policy that uses tags, also the task shapes the node holds."""
        if n.state is None:
            gpu_state = self._gpu_state
            state = (n.cpu_left, n.view.links, tuple(
                (g.view.index, g.state if g.state is not None else gpu_state(g)) for g in n.gpus))
            if self.policy.uses_tags:
                state = (*state, self._held_tags(n))
            n.state = self._states.setdefault(state, len(self._states))
            bisect.insort(self._alike.setdefault(n.state, []), n.rank)
            self._stateless.discard(n.view.name)
        return n.state

    def _gpu_state(self, g: GpuRecord) -> int:
        """The number of ``g``'s state: what the device is and offers (its MIG profiles too), and
        what its holders take and are tagged with: all a request's look at one GPU depends on, but
        the node's name and the GPU's index, which only an affinity binding looks at."""
        v = g.view
        state = (v.model, v.memory_mib, v.sm_count, v.mig_profiles, v.lost, v.closed, v.no_mps,
                 v.mig_capable, v.mig_enabled, v.mig_enable_needs_reset, v.mig_unheld, g.sm_used, g.mem_used,
                 g.quota_used, g.share_kind, g.whole is not None, tuple(sorted(g.mig.values())),
                 tuple(sorted((h.exclusion or "", h.anti_affinity or "") for h in self._holders(g))))
        g.state = self._gpu_states.setdefault(state, len(self._gpu_states))
        return g.state

    def _gpu_answers(self, r: Request, n: NodeRecord) -> list[tuple[bool, int]]:
        """Per GPU of ``n``: whether share or whole ``r`` may go there, and its free share as the
        policy sees it (:meth:`_policy_free`). GPUs alike answer alike, and a node that changes
        mostly changes one GPU: so the answers are kept per GPU state and what of ``r`` they
        depend on, but where ``r``'s affinity tag is bound (the binding names a node and GPU)."""
        name = n.view.name
        if r.affinity and r.affinity in self._affinity:
            return [self._gpu_answer(r, g, name) for g in n.gpus]
        key = (r.kind, r.sm_milli, r.gpu_memory_mib, r.quota_request, r.gpu_models, r.exclusion,
               r.anti_affinity)
        alike = self._gpu_alike.get(key)
        if alike is None:
            if len(self._gpu_alike) >= MEMO_SIZE:
                self._gpu_alike.clear()
            alike = self._gpu_alike[key] = {}
        out = []
        for g in n.gpus:
            state = g.state if g.state is not None else self._gpu_state(g)
            got = alike.get(state)
            if got is None:
                got = alike[state] = self._gpu_answer(r, g, name)
            out.append(got)
        return out

    def _gpu_answer(self, r: Request, g: GpuRecord, node: str) -> tuple[bool, int]:
        need = r.sm_milli if r.kind == "fastpod" else 0   # too few SMs left: a problem, no need to word it
        fits = g.sm_used + need <= MILLI and self._gpu_problem(r, g, node) is None
        return fits, self._policy_free(r, g, fits)

    def _room(self, n: NodeRecord) -> dict[str, tuple[float, float, float]]:
        """The most ``n`` offers a request of each kind, figure by figure, each over the GPUs
        open to that kind (see :func:`_need`): a node short in any figure cannot take the
        request, which :meth:`_entries` tells without looking up its answer. Late in a trace
        most nodes are full and few are alike, so this spares most of a heap build."""
        if n.room is None:
            fp = [g for g in n.gpus if g.open_to("fastpod")]
            mps = [g for g in n.gpus if g.open_to("mps")]
            idle = sum(1 for g in n.gpus if g.idle and not g.view.lost and not g.view.closed)
            cap = self.mps_oversubscription
            n.room = {
                "fastpod": (max((MILLI - g.sm_used for g in fp), default=-math.inf),
                            # a hair above the quota allowed: float sums round, and a looser
                            # figure only looks up more answers
                            max((1 + 2 * QUOTA_SLACK - g.quota_used for g in fp), default=-math.inf),
                            max((g.view.memory_mib - g.mem_used for g in fp), default=-math.inf)),
                "mps": (max((g.view.memory_mib * cap - g.mem_used for g in mps), default=-math.inf),
                        max((g.view.memory_mib for g in mps), default=-math.inf), math.inf),
                "whole": (idle, math.inf, math.inf),
                "exclusive": (sum(1 for g in n.gpus if g.view.mig_capable and not g.view.lost
                                  and not g.view.closed and not g.sharers and g.whole is None),
                              math.inf, math.inf),
            }
        return n.room

    def _entry_key(self, shape: tuple, r: Request) -> Callable[[NodeRecord], Any]:
        """``n ->`` its key in the heap of ``r``'s shape, None when its labels, CPU or GPUs do not
        take ``r`` (host memory is checked when it comes to the top)."""
        memo, selector = shape
        cpu, ranked = r.cpu_milli, self._lookup(r, memo, memo, self._work_out)
        kind, (a, b, c) = r.kind, _need(r)
        room = self._room

        def key_of(n: NodeRecord) -> Any:
            if selector and any(dict(n.view.labels).get(k) != v for k, v in selector):
                return None
            if cpu and cpu > n.view.cpu_milli - n.cpu_used:
                return None
            most = (n.room or room(n))[kind]
            if a > most[0] or b > most[1] or c > most[2]:
                return None
            return ranked(n)[1]
        return key_of

    @staticmethod
    def _by_state(shape: tuple) -> bool:
        """Whether the heap of ``shape`` holds states rather than nodes: not where a node selector
        (labels are no part of a state) or an affinity binding (which names a node) tells nodes
        alike apart."""
        memo, selector = shape
        return not (selector or memo[-1])

    def _entries(self, shape: tuple, r: Request, nodes: Iterable[NodeRecord]) -> list[Entry]:
        """The entries of ``nodes`` in the heap of ``r``'s shape (see :meth:`_entry_key`): their
        states' from each one's rank on, or their own."""
        key_of = self._entry_key(shape, r)
        if self._by_state(shape):   # (key_of has worked the state out where it gives a key)
            return [((key, n.rank), "", n.state) for n in nodes if (key := key_of(n)) is not None]
        return [((key, n.rank), n.view.name, n.version) for n in nodes if (key := key_of(n)) is not None]

    def work_out_states(self) -> None:
        """Work out the state of every node that changed since (all, at first): the first request
        of a shape does, and it took 0.2 s at 10,000 nodes; a controller does it at its start."""
        for name in list(self._stateless):
            if (n := self._nodes.get(name)) is not None:
                self._state(n)
        self._stateless.clear()

    def _every_entry(self, shape: tuple, r: Request) -> list[Entry]:
        """The entries of every node in the heap of ``r``'s shape: one per state, on the word of
        any of its nodes (a shape seen for the first time looks at each state once, not at each
        node: most of a large cluster is alike)."""
        if not self._by_state(shape):
            return self._entries(shape, r, self._nodes.values())
        self.work_out_states()
        key_of, by_rank = self._entry_key(shape, r), self._by_rank
        return [((key, ranks[0]), "", state) for state, ranks in self._alike.items()
                if (key := key_of(by_rank[ranks[0]])) is not None]

    def _place_from_heap(self, r: Request, excluded: Mapping[str, str]) -> Assignment | None:
        """Place a share, whole GPUs or a MIG slice through the heap of its shape (see
        ``fastshare/placement/shape_heaps.py``): the same node and GPUs as looking at every node
        gives, found by looking at the few that changed. None when no node takes ``r`` (the
        rejection, which says why, looks at every node) or it has no shape."""
        memo = self._memo_key(r)
        if memo is None:
            return None
        shape = (memo, r.node_selector)
        h = self._heaps.get(shape)
        if h is None:
            h = self._heaps.build(shape, self._every_entry(shape, r), r)
        elif dirty := self._heaps.dirty(h):
            nodes = self._nodes
            for e in self._entries(shape, r, (nodes[name] for name in dirty if name in nodes)):
                h.push(e)
            h.compact(self._live, len(nodes))
        n = self._heap_best(h, r, excluded)
        if n is None:
            return None
        answer = self._answer(r, n, memo)
        if r.kind == "exclusive":
            return self._slice_assignment(r, n, n.gpus[answer[1]], answer[3], answer[2])
        return Assignment(r, n.view.name, answer[0] if r.kind == "whole" else self._share_gpu(r, n, answer))

    def _first_alike(self, state: int, rank: int) -> NodeRecord | None:
        """The first node in state ``state`` from ``rank`` on (node order), if any."""
        ranks = self._alike.get(state)
        if not ranks:
            return None
        i = bisect.bisect_left(ranks, rank)
        return self._by_rank[ranks[i]] if i < len(ranks) else None

    def _live(self, entries: list[Entry]) -> list[Entry]:
        """The entries that still name a node as it is: a node's own until it changes; a state's
        while a node in it ranks from the entry's rank on, and only its first (the others name
        nodes it names too)."""
        out, first = [], {}
        for e in entries:
            (_key, rank), name, tag = e
            if name:
                n = self._nodes.get(name)
                if n is not None and n.version == tag:
                    out.append(e)
            elif self._first_alike(tag, rank) is not None and rank < first.get(tag, (math.inf,))[0]:
                first[tag] = (rank, e)
        return out + [e for _rank, e in first.values()]

    def _heap_best(self, h: ShapeHeap, r: Request, excluded: Mapping[str, str]) -> NodeRecord | None:
        """The best node on ``h`` that ``excluded`` and its free host memory let take ``r``.
        A node's entry is dropped once the node changed; a state's is moved on to its first node
        from the entry's rank on, and dropped when none is left. The entries looked at are put
        back."""
        put_back: list[Entry] = []
        best = None
        heap = h.heap
        while heap:
            (key, rank), name, tag = heap[0]
            if name:
                n = self._nodes.get(name)
                if n is None or n.version != tag:
                    h.pop()
                    continue
            else:
                n = self._first_alike(tag, rank)
                if n is None:
                    h.pop()
                    continue
                if n.rank != rank:
                    h.replace_top(((key, n.rank), name, tag))
                    continue
            put_back.append(h.pop())
            if not ((excluded and n.view.name in excluded) or (r.memory_mib and r.memory_mib > n.mem_left)):
                best = n
                break
            if not name:   # the state's next nodes (this entry stays: a second one for some of the
                # same nodes, dropped when compacted)
                h.push(((key, rank + 1), name, tag))
        for e in put_back:
            h.push(e)
        return best

    def _shares(self, r: Request, nodes: list[NodeRecord]) -> Assignment | Rejection:
        """Look at every node (requests without a shape: a random policy; see ``_scan``)."""
        task = _policy_task(r)
        best_key, best = None, None
        for order, n in enumerate(nodes):
            answer = self._share_answer(r, n, task)
            if answer is None:
                continue
            key = (answer[0], -order)
            if best_key is None or key > best_key:
                best_key, best = key, (n, answer)
        if best is None:
            return Rejection(self._share_words(r, self._nodes_fold(r, nodes), len(nodes)))
        n, answer = best
        return Assignment(r, n.view.name, self._share_gpu(r, n, answer))

    def _share_gpu(self, r: Request, n: NodeRecord, answer: tuple[Any, tuple[int, ...]]) -> tuple[int, ...]:
        """The GPU node ``n`` gives share ``r``, from its answer: the one an MPS share packs onto,
        or the one the policy picks (asked again: the answer keeps only the score)."""
        if r.kind == "mps":
            return answer[1]
        return tuple(self.policy.score(n.gpus[0].view.model, n.cpu_left, answer[1], _policy_task(r),
                                       self._held_tags(n))[1])

    def _held_tags(self, n: NodeRecord) -> frozenset[str]:
        """The task shapes ``n`` holds, for a policy that uses them (GpuClustering; as the trace
        replay gives them); none for the others, whose scores and caches must not depend on them."""
        return frozenset(n.tags) if self.policy.uses_tags else frozenset()

    def _policy_score(self, model: str, cpu_left: int, free: tuple[int, ...], task: Task,
                      tags: frozenset[str] = frozenset()) -> Any:
        """The policy's score, remembered per node state as the policy keys it (nodes alike score
        alike: most of a cluster, early on; see ``Policy.state_key``), and by the node's ``tags``
        when the policy uses them."""
        key = self.policy.state_key(model, cpu_left, free, task)
        key = (model, cpu_left, free, task) if key is None else (key, task)
        if tags:
            key = (key, tags)
        score = self._scores.get(key, _UNSEEN)
        if score is _UNSEEN:
            if len(self._scores) >= SCORES_KEPT:
                self._scores.clear()
            score = self._scores[key] = self.policy.score(model, cpu_left, free, task, tags)[0]
        return score

    def _share_answer(self, r: Request, n: NodeRecord, task: Task) -> tuple[Any, tuple[int, ...]] | None:
        """Node ``n``'s score for share ``r`` (higher wins) and, for an MPS share, its GPU (for a
        fastpod share, the free shares the policy saw), None when no GPU takes it."""
        gpus = self._gpu_answers(r, n)
        if not any(fits for fits, _free in gpus):
            return None
        if r.kind == "mps":
            # Memory-only: pack by memory (least free memory that fits), no SM arithmetic.
            def slack(i: int) -> float:
                return n.gpus[i].view.memory_mib * self.mps_oversubscription - n.gpus[i].mem_used
            i = min((i for i, (fits, _free) in enumerate(gpus) if fits), key=lambda i: (slack(i), i))
            return -slack(i), (i,)
        model = n.gpus[0].view.model if n.gpus else ""
        free = tuple(free for _fits, free in gpus)
        return self._policy_score(model, n.cpu_left, free, task, self._held_tags(n)), free

    def _share_why(self, r: Request, n: NodeRecord) -> ShareFold:
        """What of node ``n`` a rejection of share ``r`` tells (see :class:`ShareFold`)."""
        w = ShareFold()
        cap = self.mps_oversubscription if r.kind == "mps" else 1.0
        for g in n.gpus:
            v = g.view
            if r.gpu_models and v.model not in r.gpu_models:
                continue
            shut = bool(v.lost or v.closed)
            w.wanted = True
            w.any_shut |= shut
            w.all_shut &= shut
            w.all_no_mps &= bool(v.no_mps)
            if shut:
                continue
            if v.no_mps:
                w.no_mps, w.no_mps_nodes = w.no_mps or v.no_mps, 1
            elif g.open_to(r.kind):
                i = v.index
                big, free = (v.memory_mib, -i), (min(v.memory_mib, v.memory_mib * cap - g.mem_used), -i)
                sm, quota = (g.sm_used, i), (g.quota_used, i)
                if not w.usable:
                    w.usable, w.big, w.free, w.sm, w.quota = True, big, free, sm, quota
                else:
                    w.big, w.free = max(w.big, big), max(w.free, free)
                    w.sm, w.quota = min(w.sm, sm), min(w.quota, quota)
                if why := self._tag_problem(r, g, n.view.name):
                    w.tagged.append((None, i, why))
        return w

    def _summary(self, r: Request, key: tuple | None,
                 ) -> tuple[type[ShareFold] | type[WholeFold], Callable[[NodeRecord], Any]]:
        """For a rejection of ``r`` (a share or whole GPUs; ``key``: its ``_why_key``): the fold
        it takes, and each node's summary (shared by nodes alike, see :meth:`_lookup`)."""
        if r.kind == "whole":
            return WholeFold, self._lookup(r, key, key, self._whole_why)
        return ShareFold, self._lookup(r, key, key, self._share_why)

    def _nodes_fold(self, r: Request, nodes: list[NodeRecord]) -> ShareFold | WholeFold:
        """The fold of ``nodes``' summaries for a rejection of ``r`` (a share or whole GPUs)."""
        new, summary = self._summary(r, self._why_key(r))
        fold = new()
        for n in nodes:   # once per node per rejection: kept lean
            fold.merge(summary(n), n)
        return fold

    def _place_whole(self, r: Request, nodes: list[NodeRecord]) -> Assignment | Rejection:
        """Look at every node (requests without a shape: a random policy; see ``_scan``)."""
        task = _policy_task(r)
        best_score, best = None, []
        for n in nodes:
            idle, score = self._whole_answer(r, n, task)
            if score is None:
                continue
            if best_score is None or score > best_score:
                best_score, best = score, [(n, idle)]
            elif score == best_score:
                best.append((n, idle))
        if not best:
            return Rejection(whole_words(r, self._nodes_fold(r, nodes), len(nodes)))
        return self._tightest_of(r, best)

    def _lookup(self, r: Request, memo: tuple | None, key: tuple,
                work: Callable[[Request, NodeRecord], Any]) -> Callable[[NodeRecord], Any]:
        """``n -> work(r, n)`` as any node in ``n``'s state gave it for ``key`` (nodes alike
        answer alike, and most of a cluster is alike: a shape seen for the first time then costs
        a lookup per node), worked out when none was asked yet; ``n``'s own (its memo) when the
        shape ``memo`` has an affinity binding, which names a node; worked out each time when
        ``r`` has no shape (``memo`` None)."""
        if memo is None:
            return lambda n: work(r, n)
        if memo[-1]:
            def own(n: NodeRecord) -> Any:
                got = n.memo.get(key)
                return got if got is not None else n.remember(key, work(r, n))
            return own
        alike = self._answers.get(key)
        if alike is None:
            if len(self._answers) >= MEMO_SIZE:
                self._answers.clear()
            alike = self._answers[key] = {}
        state = self._state

        def look_up(n: NodeRecord) -> Any:
            got = alike.get(n.state if n.state is not None else state(n))
            if got is None:
                got = alike[n.state] = work(r, n)
            return got
        return look_up

    def _whole_why(self, r: Request, n: NodeRecord) -> WholeFold:
        """What of node ``n`` a rejection of whole GPUs ``r`` tells (see :class:`WholeFold`)."""
        gpus = [g for g in n.gpus if not r.gpu_models or g.view.model in r.gpu_models]
        lost = [(None, g.view.index) for g in gpus if g.view.lost]
        return WholeFold(
            wanted=bool(gpus),
            idle=sum(1 for g in n.gpus if g.idle and self._gpu_problem(r, g, n.view.name) is None),
            mig=sum(1 for g in gpus
                    if g.view.mig_enabled and not g.mig and not g.unheld() and not g.view.closed),
            lost=len(lost), lost_first=lost[:3])

    @staticmethod
    def _tightest_of(r: Request, best: list[tuple[NodeRecord, list[int]]]) -> Assignment:
        """Whole GPUs on one of the ``best`` nodes (in node order, with their idle GPUs), for a
        look at every node; a shape's heap ranks nodes the same way (see :meth:`_work_out`)."""
        # Nodes the policy scores alike (two idle nodes always are) differ to the job in how its
        # GPUs talk: the tightest group wins, then the node order.
        groups: dict[tuple, tuple[tuple[int, ...], tuple[int, int]]] = {}   # alike nodes: worked out once

        def tightest(n: NodeRecord, idle: list[int]) -> tuple[tuple[int, ...], tuple[int, int]]:
            key = (n.view.links, tuple(idle))
            if key not in groups:
                group = tightest_group(n.view, idle, r.gpus)
                groups[key] = (group, group_cost(n.view, group))
            return groups[key]

        tied = best if r.gpus > 1 else best[:1]   # one GPU is as tight anywhere
        n, (group, _cost) = min(((n, tightest(n, idle)) for n, idle in tied), key=lambda x: x[1][1])
        return Assignment(r, n.view.name, group)

    def _whole_answer(self, r: Request, n: NodeRecord, task: Task) -> tuple[list[int], Any]:
        """Node ``n``'s idle GPUs that ``r`` may have, and its score (None when too few)."""
        gpus = self._gpu_answers(r, n)
        idle = [g.view.index for g, (fits, _free) in zip(n.gpus, gpus, strict=True) if fits]
        if len(idle) < r.gpus:
            return idle, None
        free = tuple(free for _fits, free in gpus)
        return idle, self._policy_score(n.gpus[0].view.model, n.cpu_left, free, task, self._held_tags(n))

    def _layouts(self, r: Request, n: NodeRecord) -> tuple[tuple[tuple, int, GpuRecord, int], ...]:
        """Node ``n``'s GPUs that exclusive ``r`` may have a slice of, by layout (what a slice's
        choice depends on): each layout with its first GPU (and that GPU's place on the node)
        and how many GPUs have it. Kept in the node's memo: it depends on ``r``'s models and
        tags, not its size."""
        out: dict[tuple, tuple[int, GpuRecord, int]] = {}
        for i, g in enumerate(n.gpus):
            if self._gpu_problem(r, g, n.view.name) is None:
                v = g.view
                layout = (id(v.mig_profiles), v.sm_count, v.mig_unheld, tuple(sorted(g.mig.values())))
                first = out.get(layout)
                out[layout] = (i, g, 1) if first is None else (first[0], first[1], first[2] + 1)
        return tuple((layout, i, g, alike) for layout, (i, g, alike) in out.items())

    def _place_exclusive(self, r: Request, nodes: list[NodeRecord]) -> Assignment | Rejection:
        bound = (r.affinity, self._affinity[r.affinity]) if r.affinity in self._affinity else None
        key = ("exclusive", r.gpu_models, r.exclusion, r.anti_affinity, bound)
        # GPUs laid out alike answer alike, and the first in node order wins ties: work out the
        # first of each layout only (an empty cluster of 8-GPU nodes has one layout)
        layouts: dict[tuple, tuple[tuple[int, int], NodeRecord, GpuRecord, int]] = {}
        candidates = 0
        for n in nodes:
            on_node = n.memo.get(key)
            if on_node is None:
                on_node = n.remember(key, self._layouts(r, n))
            for layout, i, g, alike in on_node:
                candidates += alike
                first = layouts.get(layout)
                layouts[layout] = (((n.rank, i), n, g, alike) if first is None
                                   else (*first[:3], first[3] + alike))
        if not candidates:
            # the GPUs only the sharing tags rule out (a tag problem is the last one looked for)
            tagged = [f"{g.label(n.view.name)} ({why})" for n in nodes for g in n.gpus
                      if (why := self._gpu_problem(r, g, n.view.name))
                      and why == self._tag_problem(r, g, n.view.name)]
            return Rejection(no_mig_gpu_reason(r, nodes, tagged))
        best_key, best = None, None
        too_big: list[tuple[GpuView, int]] = []   # the first GPU of each layout too small
        too_big_gpus = 0
        for order, n, g, alike in layouts.values():
            profs = migmath.request_profiles(r, g.view)
            if not profs:
                too_big.append((g.view, migmath.request_sms(r, g.view)))
                too_big_gpus += alike
                continue
            got = g.best_slice(profs)
            if got is not None and (best_key is None or (got[0], order, got[1]) < best_key):
                best_key, best = (got[0], order, got[1]), (n, g, got[2], got[1])
        if best is None:
            return Rejection(no_slice_words(r, candidates, too_big, too_big_gpus))
        n, g, p, s = best
        return self._slice_assignment(r, n, g, p, s)

    @staticmethod
    def _slice_assignment(r: Request, n: NodeRecord, g: GpuRecord, p: MigProfile, start: int) -> Assignment:
        slot = MigSlot(p.profile_id, p.name, start, p.memory_slices, p.sm_count, p.memory_mib)
        return Assignment(r, n.view.name, (g.view.index,), mig=slot, enable_mig=not g.mig_mode)

    def _node_slice(self, r: Request, n: NodeRecord) -> tuple[tuple, int, int, MigProfile] | None:
        """Node ``n``'s best slice for exclusive ``r`` (its rank, lower first; the GPU's place on
        the node; the start; the profile), as :meth:`_place_exclusive` ranks them across nodes
        (the GPU's place and the start break ties), None when none is free."""
        best = None
        for _layout, i, g, _alike in self._layouts(r, n):
            profs = migmath.request_profiles(r, g.view)
            got = g.best_slice(profs) if profs else None
            if got is not None and (best is None or (got[0], i, got[1]) < best[:3]):
                best = (got[0], i, got[1], got[2])
        return best



_ASKED = tuple(f.name for f in fields(Request) if f.name != "id")


def _node_order(tagged: tuple[NodeRecord, int, str]) -> int:
    return tagged[0].rank


def _need(r: Request) -> tuple[float, float, float]:
    """What request ``r`` needs of one node, figure by figure as
    :meth:`Engine._room` gives them: a fastpod share SMs, time quota and memory on one GPU, an MPS
    share memory left (oversubscribed) and in all on one GPU, whole GPUs that many idle, a MIG
    slice one MIG-capable GPU that works and holds no share nor whole request."""
    if r.kind == "fastpod":
        return r.sm_milli, r.quota_request, r.gpu_memory_mib
    if r.kind == "mps":
        return r.gpu_memory_mib, r.gpu_memory_mib, 0
    if r.kind == "exclusive":
        return 1, 0, 0
    return r.gpus, 0, 0


def _asked(r: Request, excluded: Mapping[str, str]) -> tuple:
    """What ``r`` asks (all of it but its id) and the nodes ruled out: a rejection's key."""
    return (*(getattr(r, name) for name in _ASKED), tuple(sorted(excluded.items())))
