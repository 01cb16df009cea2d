"""MIG layout logic, in one place: parse a layout, plan placements, diff, apply.

Why a search: which MIG profiles fit together depends on WHERE each instance sits (allowed
starts differ per profile), so "largest first at the first free start" rejects layouts that
NVML accepts in another arrangement (GPU-FACTS.md, the 19,19,14,9 example). The GPUs are
small (8 memory slices), so an exhaustive search over allowed placements is cheap and lets the
plan keep as many existing instances as possible, never move one that is in use, and among
equal plans keep the largest future shapes available.

Everything here works on a :class:`GpuShape` built from NVML's profiles or from the catalog.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from fastshare.device.api import DeviceError, Devices, GpuInfo, MigInstance, MigProfile
from fastshare.device.catalog import GpuModel, find_profile, known_profiles


class LayoutError(ValueError):
    """A layout that cannot be parsed or cannot be realised; the message says why."""


@dataclass(frozen=True)
class GpuShape:
    """What a MIG-capable GPU offers: its profiles and its slice counts."""

    profiles: tuple[MigProfile, ...]
    memory_slices: int
    compute_slices: int
    label: str = "GPU"

    @classmethod
    def from_model(cls, model: GpuModel) -> GpuShape:
        if not model.mig_capable:
            raise LayoutError(f"{model.key} does not support MIG")
        return cls(model.profiles, model.memory_slices, model.compute_slices, model.key)

    @classmethod
    def from_profiles(cls, profiles: Iterable[MigProfile], label: str = "GPU") -> GpuShape:
        profiles = tuple(profiles)
        if not profiles:
            raise LayoutError(f"{label} reports no MIG profiles (is MIG supported and enabled?)")
        memory = max(max(p.placements, default=0) + p.memory_slices for p in profiles)
        return cls(profiles, memory, max(p.slices for p in profiles), label)

    def profile(self, name_or_id: str | int) -> MigProfile:
        found = find_profile(self.profiles, name_or_id)
        if found is None:
            raise LayoutError(f"unknown MIG profile {name_or_id!r} on {self.label}; "
                              f"known: {known_profiles(self.profiles)}")
        return found

    def mask(self, profile: MigProfile, start: int) -> int:
        return ((1 << profile.memory_slices) - 1) << start


class _HasPlacement(Protocol):
    profile_id: int
    start: int


@dataclass(frozen=True)
class Placed:
    """An instance at a placement; ``in_use``: the plan must keep it (processes run on it, or a
    share holds it); ``processes`` run on it: NVML refuses to destroy it even with force."""

    profile_id: int
    start: int
    in_use: bool = False
    label: str = ""          # e.g. the MIG UUID, for messages
    processes: int = 0
    shares: tuple[str, ...] = ()   # ids of the fastshare shares that hold it, when known

    @classmethod
    def of(cls, item: _HasPlacement | Placed) -> Placed:
        if isinstance(item, Placed):
            return item
        if isinstance(item, MigInstance):
            return cls(item.profile_id, item.start, item.processes > 0, item.uuid or "", item.processes)
        return cls(item.profile_id, item.start)


def placed_instances(instances: Iterable[MigInstance], held: Collection[str] = ()) -> list[Placed]:
    """The instances as the planner sees them: in use when processes run on one or a fastshare
    share holds it (its UUID in ``held``, the node agent journal's devices; a mapping UUID ->
    share ids, as :func:`fastshare.node.journal.held_device_uuids` gives, names the shares)."""
    return [Placed(m.profile_id, m.start, m.processes > 0 or (m.uuid or "") in held, m.uuid or "",
                   m.processes, _shares_on(held, m.uuid or "")) for m in instances]


def _shares_on(held: Collection[str], uuid: str) -> tuple[str, ...]:
    return tuple(held.get(uuid, ())) if isinstance(held, Mapping) else ()


@dataclass(frozen=True)
class Step:
    action: str              # "destroy" | "create"
    profile_id: int
    profile_name: str
    start: int
    size: int

    def describe(self) -> str:
        return (f"{self.action} {self.profile_name} (id {self.profile_id}) at start {self.start} "
                f"(memory slices {self.start}..{self.start + self.size - 1})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"description": self.describe()}


@dataclass(frozen=True)
class Plan:
    """Ordered steps (all destroys first, then creates) from the current to the final layout."""

    steps: tuple[Step, ...]
    keep: tuple[Placed, ...]
    final: tuple[Placed, ...]

    @property
    def changed(self) -> bool:
        return bool(self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "changed": self.changed,
            "steps": [s.to_dict() for s in self.steps],
            "keep": [asdict(p) for p in self.keep],
            "final": [asdict(p) for p in self.final],
        }


# --- parsing ----------------------------------------------------------------------------------
_TOKEN = re.compile(r"^\s*([^=\s]+)\s*(?:=\s*(-?\d+)\s*)?$")


def parse_layout(text: str | dict[str, int], shape: GpuShape) -> Counter[int]:
    """Profile id -> count from ``'3g.20gb=1,1g.5gb=2'``, ``'9,19,14,19'`` (ids, repeats count),
    or a mapping ``{"1g.5gb": 2}``. An empty layout means "no instances"."""
    wanted: Counter[int] = Counter()
    for name, count in layout_counts(text).items():
        wanted[shape.profile(name).profile_id] += count
    return +wanted


def layout_counts(text: str | dict[str, int]) -> dict[str, int]:
    """The profiles of a layout as written (names or ids, not yet looked up on a GPU) -> counts,
    repeats added up: what the node agent's MigLayoutRequest carries."""
    counts: dict[str, int] = {}
    if isinstance(text, dict):
        items = [(str(k), _count(k, v)) for k, v in text.items()]
    else:
        items = []
        for token in filter(None, (t.strip() for t in text.split(","))):
            match = _TOKEN.match(token)
            if not match:
                raise LayoutError(f"layout item {token!r} is not PROFILE or PROFILE=COUNT")
            items.append((match.group(1), _count(match.group(1), match.group(2) or 1)))
    for name, count in items:
        counts[name] = counts.get(name, 0) + count
    return counts


def _count(name: object, value: object) -> int:
    try:
        count = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        raise LayoutError(f"count for {name!r} must be an integer >= 0, got {value!r}") from None
    if count < 0 or str(value).strip() not in (str(count), f"+{count}"):
        raise LayoutError(f"count for {name!r} must be an integer >= 0, got {value!r}")
    return count


def format_layout(counts: Counter[int] | Iterable[Placed], shape: GpuShape) -> str:
    if not isinstance(counts, Counter):
        counts = Counter(p.profile_id for p in counts)
    parts = sorted(counts.items(), key=lambda kv: (-shape.profile(kv[0]).memory_slices, kv[0]))
    return ",".join(f"{shape.profile(pid).name}={n}" for pid, n in parts if n)


# --- feasibility and scoring ------------------------------------------------------------------
def _free_capacity(shape: GpuShape, used_mask: int, used_compute: int, counts: Counter[int],
                   profile: MigProfile) -> int:
    """How many more instances of ``profile`` fit (greedy earliest start is optimal here)."""
    n, end = 0, -1
    for start in profile.placements:
        if start >= end and not shape.mask(profile, start) & used_mask:
            n += 1
            end = start + profile.memory_slices
    free_compute = shape.compute_slices - used_compute
    return max(0, min(n, profile.max_instances - counts[profile.profile_id],
                      free_compute // max(1, profile.slices)))


def _occupied(shape: GpuShape, placed: Sequence[Placed]) -> tuple[int, int, Counter[int]]:
    """Memory-slice mask, compute slices and instance count per profile that ``placed`` takes."""
    mask = compute = 0
    counts: Counter[int] = Counter()
    for p in placed:
        prof = shape.profile(p.profile_id)
        mask |= shape.mask(prof, p.start)
        compute += prof.slices
        counts[p.profile_id] += 1
    return mask, compute, counts


def future_score(shape: GpuShape, placed: Sequence[Placed]) -> tuple[int, ...]:
    """Higher is better: how many of each profile still fit, largest profiles first, then the
    number of (profile, start) placements still possible."""
    used_mask, used_compute, counts = _occupied(shape, placed)
    ordered = sorted((p for p in shape.profiles if not p.media),
                     key=lambda p: (-p.memory_slices, -p.slices, p.profile_id))
    caps = [_free_capacity(shape, used_mask, used_compute, counts, p) for p in ordered]
    starts = sum(1 for p in ordered for s in p.placements
                 if not shape.mask(p, s) & used_mask and p.slices <= shape.compute_slices - used_compute)
    return (*caps, starts)


def _valid(shape: GpuShape, placed: Sequence[Placed]) -> str | None:
    """None when the instances can coexist, else the reason."""
    used = 0
    compute = 0
    counts: Counter[int] = Counter()
    for p in placed:
        prof = shape.profile(p.profile_id)
        if p.start not in prof.placements:
            return f"{prof.name} cannot start at {p.start}"
        m = shape.mask(prof, p.start)
        if m & used:
            return f"{prof.name} at {p.start} overlaps another instance"
        used |= m
        compute += prof.slices
        counts[p.profile_id] += 1
        if counts[p.profile_id] > prof.max_instances:
            return f"more than {prof.max_instances} x {prof.name}"
    if compute > shape.compute_slices:
        return f"{compute} compute slices needed, {shape.compute_slices} exist"
    return None


def check_layout(shape: GpuShape, wanted: Counter[int]) -> str | None:
    """Why ``wanted`` can never fit on an empty GPU of this shape (None if it can)."""
    names = {p.profile_id: p.name for p in shape.profiles}
    for pid, n in wanted.items():
        prof = shape.profile(pid)
        if n > prof.max_instances:
            return f"{n} x {prof.name} requested but at most {prof.max_instances} can exist on {shape.label}"
    memory = sum(shape.profile(pid).memory_slices * n for pid, n in wanted.items())
    if memory > shape.memory_slices:
        return (f"the layout needs {memory} memory slices ({_spell(wanted, shape)}) but "
                f"{shape.label} has {shape.memory_slices}")
    compute = sum(shape.profile(pid).slices * n for pid, n in wanted.items())
    if compute > shape.compute_slices:
        return (f"the layout needs {compute} compute slices ({_spell(wanted, shape)}) but "
                f"{shape.label} has {shape.compute_slices}")
    if _search(shape, [], wanted, {}) is None:
        starts = "; ".join(
            f"{names[pid]} can start only at {', '.join(map(str, shape.profile(pid).placements))}"
            for pid in sorted(wanted))
        return f"no arrangement of allowed placements fits {_spell(wanted, shape)} ({starts})"
    return None


def _spell(wanted: Counter[int], shape: GpuShape) -> str:
    return " + ".join(f"{n} x {shape.profile(pid).name}" for pid, n in sorted(wanted.items()))


# --- the search -------------------------------------------------------------------------------
def _search(shape: GpuShape, fixed: Sequence[Placed], todo: Counter[int],
            existing: dict[tuple[int, int], Placed]) -> list[Placed] | None:
    """Best placement of ``todo`` around ``fixed``: keep most existing (in-use ones first),
    then the best future shapes, then the lowest starts. None if nothing fits."""
    order = sorted(todo.elements(), key=lambda pid: (-shape.profile(pid).memory_slices,
                                                     -shape.profile(pid).slices, pid))
    base_mask, base_compute, counts = _occupied(shape, fixed)
    best: tuple[tuple, list[Placed]] | None = None
    chosen: list[Placed] = []

    def dfs(i: int, mask: int, compute: int, min_start: int) -> None:
        nonlocal best
        if i == len(order):
            kept = [existing[(p.profile_id, p.start)] for p in chosen
                    if (p.profile_id, p.start) in existing]
            score = (sum(k.in_use for k in kept), len(kept), future_score(shape, [*fixed, *chosen]),
                     tuple(-p.start for p in chosen))
            if best is None or score > best[0]:
                best = (score, [existing.get((p.profile_id, p.start), p) for p in chosen])
            return
        prof = shape.profile(order[i])
        if compute + prof.slices > shape.compute_slices:
            return
        if counts[prof.profile_id] + order[: i + 1].count(prof.profile_id) > prof.max_instances:
            return
        same_as_previous = i > 0 and order[i - 1] == order[i]
        for start in prof.placements:
            if same_as_previous and start <= min_start:
                continue   # identical instances: only increasing starts (no permutations)
            m = shape.mask(prof, start)
            if m & mask:
                continue
            chosen.append(Placed(prof.profile_id, start))
            dfs(i + 1, mask | m, compute + prof.slices, start)
            chosen.pop()

    dfs(0, base_mask, base_compute, -1)
    return None if best is None else best[1]


def plan_layout(shape: GpuShape, current: Sequence[_HasPlacement | Placed], wanted: Counter[int],
                *, force: bool = False) -> Plan:
    """The minimal ordered steps from ``current`` to a layout with exactly ``wanted``.

    Instances in use are never destroyed or moved unless ``force``; those that run processes
    never are (NVML refuses to destroy them), so such a plan is refused before any step runs.
    Raises LayoutError with the reason when impossible.
    """
    now = [Placed.of(c) for c in current]
    if reason := _valid(shape, now):
        raise LayoutError(f"the current layout is inconsistent: {reason}")
    if reason := check_layout(shape, wanted):
        raise LayoutError(f"impossible layout: {reason}")
    # Kept in place: instances processes run on (NVML cannot destroy them), then those shares hold
    # (unless force), in that order, so a refusal names the share when only it is in the way.
    busy = sorted((p for p in now if p.processes or (p.in_use and not force)), key=lambda p: not p.processes)
    remaining = Counter(wanted)
    for p in busy:
        if remaining[p.profile_id] == 0:
            raise LayoutError(_running(shape, p) if force else
                              f"{_name(shape, p)} is in use and the layout has no place for it; "
                              + _what_to_do([p]))
        remaining[p.profile_id] -= 1
    existing = {(p.profile_id, p.start): p for p in now if p not in busy}
    found = _search(shape, busy, +remaining, existing)
    if found is None:
        blockers = ", ".join(_name(shape, p) for p in busy)
        raise LayoutError(
            f"the layout fits an empty {shape.label} but not around the instances in use ({blockers}); "
            + _what_to_do(busy))
    final = sorted([*busy, *found], key=lambda p: p.start)
    kept = [p for p in final if (p.profile_id, p.start) in {(q.profile_id, q.start) for q in now}]
    kept_keys = {(p.profile_id, p.start) for p in kept}
    destroy = [p for p in now if (p.profile_id, p.start) not in kept_keys]
    create = [p for p in final if (p.profile_id, p.start) not in {(q.profile_id, q.start) for q in now}]
    create.sort(key=lambda p: (-shape.profile(p.profile_id).memory_slices, p.start))
    steps = [_step(shape, "destroy", p) for p in sorted(destroy, key=lambda p: p.start)]
    steps += [_step(shape, "create", p) for p in create]
    return Plan(tuple(steps), tuple(kept), tuple(final))


def _running(shape: GpuShape, p: Placed) -> str:
    return (f"{_name(shape, p)} has {p.processes} running process(es); NVML cannot destroy it even with "
            "force: stop the processes first")


_FORCE = "force it (`--force`; Ansible: `force: true`)"


def _what_to_do(busy: Sequence[Placed]) -> str:
    """How to free instances in use: processes must stop (NVML refuses to destroy an instance
    they run on, even forced); an instance only a share holds (no process) can be forced."""
    if all(p.processes for p in busy):
        return ("stop its processes first (NVML cannot destroy it while they run, even with force)"
                if len(busy) == 1 else
                "stop their processes first (NVML cannot destroy them while they run, even with force)")
    release = _release_hint([s for p in busy for s in p.shares], many=len(busy) > 1)
    if not any(p.processes for p in busy):
        return (f"a fastshare share holds it: {release} or {_FORCE}" if len(busy) == 1 else
                f"fastshare shares hold them: {release} or {_FORCE}")
    return ("stop the processes (NVML cannot destroy an instance while they run, even with force) and "
            f"{release} or {_FORCE}")


def _release_hint(share_ids: Sequence[str], many: bool = False) -> str:
    """What frees shares: their allocations ended (share id = allocation id), new work kept off."""
    ids = list(dict.fromkeys(share_ids))
    if not ids:
        return "release the shares" if many else "release the share"
    return (f"release {'them' if many or len(ids) > 1 else 'it'} first (`fastshare release "
            f"{' '.join(ids)}`, after `fastshare cordon NODE` so that nothing new is placed here; "
            "on Kubernetes cordon and drain the node)")


def mode_change_pending(gpu_index: int) -> str:
    """Why a GPU whose MIG mode change waits for a GPU reset (Ampere: NVML's current mode differs
    from its pending one) takes no new shares: a whole or MPS share placed there would lose the
    GPU at the reset (MIG enable pending), a MIG slice its instance (MIG disable pending). What
    it holds stays held. The controller's rejection and the agent's refusal say it after
    "GPU N of NODE: "."""
    return (f"MIG mode change pending until the GPU is reset (nvidia-smi -r -i {gpu_index}) or the node "
            "rebooted; it takes no new shares")


def refuse_enable_under_share(gpu: GpuInfo, held: Collection[str], force: bool) -> str | None:
    """Why MIG must not be turned on for ``gpu`` (None: it may): a share holds the GPU whole and
    would lose it (at once, or at the next GPU reset on Ampere); ``force`` overrides."""
    if force or gpu.mig_pending or gpu.uuid not in held:
        return None              # MIG already on (or asked): no change of mode
    shares = _shares_on(held, gpu.uuid)
    by = f"fastshare share {', '.join(shares)}" if shares else "a fastshare share"
    return (f"GPU {gpu.index} ({gpu.name}) {gpu.uuid} is held whole by {by}; enabling MIG takes the GPU "
            f"from the share: {_release_hint(shares)} or {_FORCE}")


def _step(shape: GpuShape, action: str, p: Placed) -> Step:
    prof = shape.profile(p.profile_id)
    return Step(action, prof.profile_id, prof.name, p.start, prof.memory_slices)


def _name(shape: GpuShape, p: Placed) -> str:
    what = [p.label] if p.label else []
    if p.shares:
        what.append(f"held by fastshare share {', '.join(p.shares)}")
    label = f" ({', '.join(what)})" if what else ""
    return f"{shape.profile(p.profile_id).name} at start {p.start}{label}"


def best_placement(shape: GpuShape, current: Sequence[_HasPlacement | Placed],
                   profile: str | int) -> int | None:
    """Start for ONE new instance of ``profile`` that keeps the largest future shapes possible
    (ties: the highest start, filling from the top like NVML). None when it does not fit."""
    prof = shape.profile(profile)
    now = [Placed.of(c) for c in current]
    best: tuple[tuple, int] | None = None
    for start in prof.placements:
        trial = [*now, Placed(prof.profile_id, start)]
        if _valid(shape, trial) is not None:
            continue
        score = (future_score(shape, trial), start)
        if best is None or score > best[0]:
            best = (score, start)
    return None if best is None else best[1]


# --- against a device -------------------------------------------------------------------------
def on_gpu(gpu_index: int, text: str) -> str:
    """``text``, a refusal about GPU ``gpu_index``, led by "GPU N: " unless it names that GPU
    already (those of :func:`shape_of` and of the planner do, with its model): said once."""
    return text if re.search(rf"\bGPU {gpu_index}\b", text) else f"GPU {gpu_index}: {text}"


def shape_of(devices: Devices, gpu_index: int) -> GpuShape:
    info = devices.gpu(gpu_index)
    if not info.mig_capable:
        raise LayoutError(f"GPU {gpu_index} ({info.name}) does not support MIG")
    if not info.mig_current and info.mig_pending:
        raise LayoutError(f"MIG mode is enabled on GPU {gpu_index} but waits for a GPU reset; reset it "
                          f"(nvidia-smi -r -i {gpu_index}) or reboot, then plan again")
    if not info.mig_current:
        raise LayoutError(f"MIG mode is disabled on GPU {gpu_index}; enable it first "
                          f"(`fastshare mig enable --gpu {gpu_index}`)")
    return GpuShape.from_profiles(devices.mig_profiles(gpu_index), f"GPU {gpu_index} ({info.name})")


def plan_for_gpu(devices: Devices, gpu_index: int, layout: str | dict[str, int], *,
                 force: bool = False, held: Collection[str] = ()) -> tuple[GpuShape, Plan]:
    """``held``: devices fastshare shares hold (see :func:`placed_instances`)."""
    shape = shape_of(devices, gpu_index)
    wanted = parse_layout(layout, shape)
    return shape, plan_layout(shape, placed_instances(devices.mig_instances(gpu_index), held), wanted,
                              force=force)


def apply_plan(devices: Devices, gpu_index: int, plan: Plan) -> list[MigInstance]:
    """Run the steps in order; on failure a DeviceError says which step failed and what was
    already done (earlier steps are not undone: they were wanted anyway)."""
    done: list[str] = []
    for step in plan.steps:
        try:
            if step.action == "destroy":
                devices.destroy_mig_instance(gpu_index, step.start)
            else:
                devices.create_mig_instance(gpu_index, step.profile_id, step.start)
        except DeviceError as exc:
            already = "; ".join(done) if done else "nothing"
            raise DeviceError(f"step '{step.describe()}' failed: {exc} (already done: {already})",
                              exc.code) from exc
        done.append(step.describe())
    return devices.mig_instances(gpu_index)
