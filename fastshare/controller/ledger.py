"""The controller's use of the placement engine: one engine behind one lock, no I/O inside.

Translates the API's :class:`Spec` into the engine's ``Request`` (globs in the model
allow-list become the models present, a MIG profile name becomes its SM count and memory),
keeps unavailable and cordoned nodes in the engine (their shares are still held) but out of
reach of new requests (the engine's ``excluded``, so a rejection names them and why), and
rebuilds the engine from persisted assignments after a restart.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace

from fastshare.controller.model import Kind, Spec
from fastshare.device import catalog, mig_layout
from fastshare.placement.engine import Engine
from fastshare.placement.model import Assignment, GpuView, NodeView, Rejection, Request

MiB = 1024**2
# why a node the caller did not check is ruled out (worded after "N node(s)")
UNCHECKED = "joined after this placement began (checked on the next pass)"


def _names(model: str) -> set[str]:
    """Every name a user may use for a model: catalog key, NVML name, aliases."""
    known = catalog.find_model(model)
    if known is None:
        return {model}
    return {model, known.key, known.name, *known.aliases}


def expand_models(patterns: Sequence[str], present: Iterable[str]) -> tuple[str, ...]:
    """The models present that match any glob (case-insensitive)."""
    out = []
    for model in sorted(set(present)):
        names = [n.lower() for n in _names(model)]
        if any(fnmatch.fnmatchcase(n, p.lower()) for p in patterns for n in names):
            out.append(model)
    return tuple(out)


class Ledger:
    """Who holds what, and where the next request goes. Thread-safe; every call is pure CPU."""

    def __init__(self, mps_oversubscription: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._oversub = mps_oversubscription
        self._engine = Engine(mps_oversubscription=mps_oversubscription)
        self._views: dict[str, NodeView] = {}
        self._models: frozenset[str] | None = None   # of the views, worked out when asked (see models)
        self._down: set[str] = set()   # nodes of the views that are unavailable
        self._cordoned: dict[str, str] = {}   # node -> the operator's reason
        # node -> host (cpu milli, memory MiB) left for the engine's assignments, where a caller
        # knows it (in-cluster: allocatable minus other Pods); else the view's own figures
        self._host: dict[str, tuple[int, int]] = {}
        # node -> how many assignments it takes (held ones included), where a caller knows a
        # limit (in-cluster: status.allocatable.pods less the Pods that hold no share there)
        self._room: dict[str, int] = {}
        self._full: set[str] = set()   # nodes of ``_room`` holding that many (see ``_recount``)
        # allocation id -> why its GPU cannot take it any more (the view changed under the held
        # share: MIG mode or layout, memory, the oversubscription factor, MPS on the node). Still
        # counted, so the GPU is over-committed and takes nothing new until enough is released.
        self._over: dict[str, str] = {}
        # node -> why it takes nothing new: it holds shares the state store has no record of
        # (newer than the store, see ``Reconciler``) until they are adopted
        self._held_out: dict[str, str] = {}

    @property
    def mps_oversubscription(self) -> float:
        """The memory factor MPS shares of a GPU may promise here (see ``Engine``)."""
        return self._oversub

    # -- cluster view -------------------------------------------------------------------------
    def _view(self, view: NodeView) -> NodeView:
        cpu, memory = self._host.get(view.name, (view.cpu_milli, view.memory_mib))
        return NodeView(name=view.name, cpu_milli=cpu, memory_mib=memory, gpus=view.gpus,
                        labels=dict(view.labels), links=view.links)

    def _rebuild(self, assignments: Iterable[Assignment]) -> list[tuple[Assignment, str]]:
        """New engine from the views + assignments (policy kept); returns what cannot be counted
        (its node or GPU gone). Host CPU/memory is not checked: a held share's Pod is on its
        node already, and others may have taken the node's CPU since (see ``set_host``).
        What its GPU no longer takes is counted all the same (see ``overcommitted``)."""
        engine = Engine((self._view(v) for _, v in sorted(self._views.items())),
                        policy=self._engine.policy, mps_oversubscription=self._oversub)
        failed, over = [], {}
        for a in assignments:
            try:
                why = engine.restore(self._follow(a), check_host=False, force=True)
            except Exception as exc:  # the engine says why (node or GPU gone, another holder)
                failed.append((a, str(exc)))
                continue
            if why:
                over[a.request.id] = why
        self._engine = engine
        self._over = over
        self._recount(*self._room)
        return failed

    def _judge(self, allocation_id: str) -> None:
        """Whether a held assignment fits its GPU beside all else held there now (under the lock)."""
        a = self._engine.assignment(allocation_id)
        if a is None:
            self._over.pop(allocation_id, None)
            return
        self._engine.release(allocation_id)
        why = self._engine.restore(a, check_host=False, force=True)   # on the same node: its count stays
        if why:
            self._over[allocation_id] = why
        else:
            self._over.pop(allocation_id, None)

    def _recount(self, *names: str) -> None:
        """Whether each node of ``names`` holds as many assignments as it takes (under the lock).
        Kept as each changes: counting every assignment at each placement took 8 ms at 10,000
        nodes holding 20,000, forty times the placement itself."""
        for name in names:
            room = self._room.get(name)
            if room is not None and len(self._engine.held_on(name)) >= room:
                self._full.add(name)
            else:
                self._full.discard(name)

    def _follow(self, a: Assignment) -> Assignment:
        """``a`` on its GPUs' indexes in the node's current view, found by UUID: when a GPU leaves
        a node (fell off the bus, removed) NVML numbers the others anew. Raises ValueError naming
        a GPU that is no longer there. An assignment without UUIDs (persisted by an earlier
        version), or a view without them, keeps its indexes."""
        view = self._views.get(a.node)
        where = {g.uuid: g.index for g in view.gpus if g.uuid} if view is not None else {}
        if not a.gpu_uuids or not where:
            return a
        gone = [(u, i) for u, i in zip(a.gpu_uuids, a.gpus, strict=True) if u not in where]
        if gone:
            raise ValueError(gpus_gone(a.node, gone))
        gpus = tuple(where[u] for u in a.gpu_uuids)
        return a if gpus == a.gpus else replace(a, gpus=gpus)

    def reset(self, nodes: Iterable[tuple[NodeView, bool]],
              assignments: Iterable[Assignment]) -> list[tuple[Assignment, str]]:
        """Start over from the state of record (controller start)."""
        nodes = list(nodes)   # read twice
        with self._lock:
            self._views = {v.name: v for v, _ in nodes}
            self._models = None
            self._down = {v.name for v, available in nodes if not available}
            return self._rebuild(assignments)

    def set_node(self, view: NodeView, available: bool) -> list[tuple[Assignment, str]]:
        """Add or refresh a node (new inventory or availability); assignments are kept. Returns
        those of its assignments that cannot be counted (their GPU gone), as ``reset`` does."""
        with self._lock:
            self._mark(view.name, available)
            if self._views.get(view.name) == view:
                return []
            self._views[view.name] = view
            self._models = None
            held = self._take_out(view.name)
            self._engine.add_node(self._view(view))
            failed = self._put_back(held)   # raises nothing: what cannot be counted is returned
            self._recount(view.name)
            return failed

    def remove_node(self, name: str) -> None:
        """Forget a node (its assignments must have been released)."""
        with self._lock:
            for table in (self._views, self._cordoned, self._host, self._room):
                table.pop(name, None)
            self._down.discard(name)
            self._models = None
            self._take_out(name)
            self._full.discard(name)

    def _take_out(self, name: str) -> list[Assignment]:
        """Node ``name`` out of the engine, if there, with the assignments it holds (returned).
        One node at a time: a new engine for the whole cluster, on each new or changed node,
        took 35 ms at 2,000 nodes (a cluster's first registrations: quadratic)."""
        held = self._engine.held_on(name)
        for a in held:
            self._engine.release(a.request.id)
            self._over.pop(a.request.id, None)
        if self._engine.has_node(name):
            self._engine.remove_node(name)
        return held

    def _put_back(self, held: list[Assignment]) -> list[tuple[Assignment, str]]:
        """``held`` counted again on its node's new view, as ``_rebuild`` counts them."""
        failed = []
        for a in held:
            try:
                why = self._engine.restore(self._follow(a), check_host=False, force=True)
            except Exception as exc:  # the engine says why (GPU gone, another holder)
                failed.append((a, str(exc)))
                continue
            if why:
                self._over[a.request.id] = why
        return failed

    def set_available(self, name: str, available: bool) -> None:
        with self._lock:
            if name in self._views:
                self._mark(name, available)

    def _mark(self, name: str, available: bool) -> None:
        if available:
            self._down.discard(name)
        else:
            self._down.add(name)

    def set_cordoned(self, name: str, cordoned: bool, reason: str = "") -> None:
        """Cordon (no new work, shares kept) or uncordon a node; unknown names are remembered."""
        with self._lock:
            if cordoned:
                self._cordoned[name] = reason
            else:
                self._cordoned.pop(name, None)

    def held_out(self, name: str) -> bool:
        """The node is kept from new work until its shares newer than the store are adopted."""
        with self._lock:
            return name in self._held_out

    def set_held_out(self, name: str, reason: str) -> None:
        """Keep a node from new work with ``reason`` (worded after "N node(s)"); "" lets it take
        work again. Unknown names are remembered."""
        with self._lock:
            if reason:
                self._held_out[name] = reason
            else:
                self._held_out.pop(name, None)

    def adopt(self, assignment: Assignment) -> str:
        """Count a share its node holds already (see ``Engine.restore``'s ``force``): returns why
        its GPU does not take it ("": it does; it is then over-committed). Raises ValueError
        when it cannot be counted at all (unknown GPU, held whole, shares of the other kind)."""
        with self._lock:
            why = self._engine.restore(self._follow(assignment), check_host=False, force=True) or ""
            self._recount(assignment.node)
            if why:
                self._over[assignment.request.id] = why
            return why

    def set_host(self, name: str, cpu_milli: int, memory_mib: int) -> None:
        """The host CPU/memory a node has for the engine's assignments (held ones included);
        no rebuild, so it may change often. Unknown names are remembered."""
        with self._lock:
            self._host[name] = (max(0, cpu_milli), max(0, memory_mib))
            if name in self._views:
                self._engine.set_capacity(name, *self._host[name])

    def set_room(self, name: str, assignments: int | None) -> None:
        """How many assignments a node takes, held ones included (None: no limit). Checked
        where the node is chosen, under the lock, so that concurrent placements cannot
        together pass it, however many run at once. Unknown names are remembered."""
        with self._lock:
            if assignments is None:
                self._room.pop(name, None)
            else:
                self._room[name] = assignments
            self._recount(name)

    def host_requests(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Node -> allocation id -> the host (cpu milli, memory MiB) the engine counts for it there."""
        out: dict[str, dict[str, tuple[int, int]]] = {}
        with self._lock:
            for rid, a in self._engine.assignments.items():
                out.setdefault(a.node, {})[rid] = (a.request.cpu_milli, a.request.memory_mib)
        return out

    def node_names(self) -> set[str]:
        with self._lock:
            return set(self._views)

    def models(self) -> frozenset[str]:
        """The GPU models present, kept until a node comes, changes or goes: each request asks,
        and going over every GPU took 8 ms of each Allocate at 10,000 nodes."""
        with self._lock:
            if self._models is None:
                self._models = frozenset(g.model for v in self._views.values() for g in v.gpus)
            return self._models

    # -- decisions -----------------------------------------------------------------------------
    def to_request(self, allocation_id: str, spec: Spec) -> Request | Rejection:
        """The engine's request for an API spec (validated already)."""
        models: tuple[str, ...] = ()
        present = self.models()
        if spec.models:
            models = expand_models(spec.models, present)
            if not models:
                return Rejection(f"no GPU model present matches {list(spec.models)}; present: "
                                 f"{sorted(present)}")
        sm_percent = float(spec.sm_percent) if spec.sm_percent else None
        sm_count = spec.sm_count or None
        memory_mib = -(-spec.memory_bytes // MiB)
        if spec.kind is Kind.EXCLUSIVE and spec.mig_profile:
            # A profile name exists on some models only; ask for its shape on those models.
            having = []
            for m in models or tuple(sorted(present)):
                known = catalog.find_model(m)
                if known is None:
                    continue
                try:
                    profile = known.profile(spec.mig_profile)
                except catalog.CatalogError:
                    continue
                having.append((m, profile))
            if not having:
                return Rejection(f"no GPU present has MIG profile {spec.mig_profile!r}")
            models = tuple(m for m, _ in having)
            sm_count = min(p.sm_count for _, p in having)
            memory_mib = max(memory_mib, min(p.memory_mib for _, p in having))
        selector = dict(spec.node_selector)
        return Request(
            id=allocation_id, kind=spec.kind.value, sm_percent=sm_percent, sm_count=sm_count,
            gpu_memory_mib=memory_mib, quota_request=spec.quota_request or 1.0,
            quota_limit=spec.quota_limit or 1.0, gpus=spec.gpu_count or 1, gpu_models=models,
            cpu_milli=spec.cpu_milli, memory_mib=-(-spec.host_memory_bytes // MiB),
            node_selector=selector, affinity=spec.affinity or None,
            anti_affinity=spec.anti_affinity or None, exclusion=spec.exclusion or None,
            mig_profile=spec.mig_profile if spec.kind is Kind.EXCLUSIVE and spec.mig_profile else None)

    def place(self, request: Request, excluded: dict[str, str] | None = None,
              checked: Collection[str] | None = None) -> Assignment | Rejection:
        """``excluded``: nodes ruled out for this request, with why (see ``Engine.place``).
        ``checked``: the nodes the caller judged ``excluded`` on (None: all). Any other node of
        the ledger (registered since) is ruled out here, under the lock, for the caller could
        not say whether the request may go there; ``excluded`` may give a better reason."""
        with self._lock:
            unchecked = {} if checked is None else {n: UNCHECKED for n in self._views if n not in checked}
            placed = self._engine.place(request, {**self._no_new_work(), **self._full_nodes(), **unchecked,
                                                  **(excluded or {})})
            if isinstance(placed, Assignment):
                self._recount(placed.node)
            return placed

    def _no_new_work(self) -> dict[str, str]:
        """Nodes that keep their shares but take nothing new, with why (worded after "N node(s)")."""
        out = {n: f"are cordoned: {why}" if why else "are cordoned"
               for n, why in self._cordoned.items() if n in self._views}
        down = "are unavailable (their agent does not answer)"
        out.update(dict.fromkeys(self._down, down))   # not every node: each request asks
        out.update({n: why for n, why in self._held_out.items() if n in self._views})
        return out

    def _full_nodes(self) -> dict[str, str]:
        """Nodes holding as many assignments as they take (see ``set_room``), with why."""
        return dict.fromkeys(self._full, "run as many Pods as they allow (status.allocatable.pods)")

    def work_out_states(self) -> None:
        """See ``Engine.work_out_states``."""
        with self._lock:
            self._engine.work_out_states()

    def release(self, allocation_id: str) -> bool:
        """Give back what an allocation holds; False if the engine did not hold it. The node's
        over-committed assignments are judged again (one may fit now)."""
        with self._lock:
            self._over.pop(allocation_id, None)
            try:
                released = self._engine.release(allocation_id)
            except KeyError:
                return False
            self._recount(released.node)
            for rid in [rid for rid in self._over if self._engine.assignment(rid).node == released.node]:
                self._judge(rid)
            return True

    def overcommitted(self, node: str | None = None) -> dict[str, str]:
        """Allocation id -> why its GPU no longer takes it (only on ``node`` if given): a share
        still held where the GPU's view changed under it. It is counted, so its GPU takes
        nothing new; it fits again once enough is released there."""
        with self._lock:
            return {rid: why for rid, why in self._over.items()
                    if node is None or self._engine.assignment(rid).node == node}

    def over(self, allocation_id: str) -> str:
        """Why an allocation's GPU no longer takes it ("" if it does); see ``overcommitted``."""
        with self._lock:
            return self._over.get(allocation_id, "")

    def misfit(self, allocation_id: str) -> str:
        """Why a held assignment does not fit its GPU beside all else held there now ("" if it
        does, or its GPU is not over-committed): asked before its share is prepared on the
        agent, which must not be given more than the GPU takes."""
        with self._lock:
            if not self._over:   # the common case: nothing is over-committed
                return ""
            a = self._engine.assignment(allocation_id)
            if a is None:
                return ""
            over = [self._engine.assignment(rid) for rid in self._over]
            if allocation_id not in self._over and not any(
                    o.node == a.node and set(o.gpus) & set(a.gpus) for o in over):
                return ""
            self._judge(allocation_id)
            return self._over.get(allocation_id, "")

    def restore(self, assignment: Assignment) -> None:
        with self._lock:
            if self._engine.assignment(assignment.request.id) is None:
                self._engine.restore(assignment)
                self._recount(assignment.node)

    def holds(self, allocation_id: str) -> bool:
        with self._lock:
            return self._engine.assignment(allocation_id) is not None

    def usage(self) -> list[dict]:
        with self._lock:
            return self._engine.usage()


def gpus_gone(node: str, gone: Iterable[tuple[str, int]]) -> str:
    """Why an allocation cannot be held any more: GPUs (UUID, index it had) its node lost."""
    return "; ".join(f"GPU {uuid} (GPU {index} when it was placed) is no longer on node {node} "
                     "(removed, replaced or fallen off the bus)" for uuid, index in gone)


LOST = "lost (fell off the bus?): "   # how the engine's reason for a lost GPU starts (gpu_view)


def gpu_view(index: int, uuid: str, model: str, memory_bytes: int, sm_count: int, mig_capable: bool,
             mig_enabled: bool, mig_unheld: tuple[tuple[int, int, int], ...] = (),
             no_mps: str = "", lost: str = "", mig_change_pending: bool = False) -> GpuView:
    """A GPU for the engine; MIG profiles from the catalog (the engine needs max_instances).
    ``no_mps``: why its node cannot run MPS shares (the agent's inventory says). ``lost``: the
    NVML error a lost GPU answers (GPU_IS_LOST), "" while it works; a lost GPU takes no shares.
    ``mig_change_pending``: its MIG mode change waits for a GPU reset; it takes no new shares."""
    known = catalog.find_model(model)
    profiles = known.profiles if (known is not None and mig_capable) else ()
    return GpuView(index=index, model=model, memory_mib=memory_bytes // MiB, sm_count=sm_count,
                   mig_capable=mig_capable and bool(profiles), mig_enabled=mig_enabled,
                   mig_profiles=profiles, uuid=uuid, mig_unheld=mig_unheld if profiles else (),
                   no_mps=no_mps,
                   lost=f"{LOST}NVML_ERROR_{lost}" if lost else "",
                   closed=mig_layout.mode_change_pending(index) if mig_change_pending else "",
                   mig_enable_needs_reset=bool(profiles) and known.mig_pending_until_reset)
