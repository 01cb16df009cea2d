"""openb trace files: strict readers and the published arrival order (sort, shuffle, tune).

Readers reject a malformed file with the line and column at fault rather than guessing,
because a silently skipped row changes every later decision of a replay.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass, field
from pathlib import Path

MILLI = 1000
MAX_TASK_GPUS = 1024   # bounds a typo, not a cluster: more than any node has just fails
CURVE_POINTS = 131     # a published curve: the allocation % at x = 0..130 % of GPU capacity arrived


class TraceError(ValueError):
    """A trace file is unreadable or malformed; the message names file, line and field."""


@dataclass(frozen=True)
class SimNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True)
class SimPod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: frozenset[str] = frozenset()
    clone: bool = False
    line: int = field(default=0, compare=False, repr=False)   # in its trace file, for messages

    @property
    def gpu_request(self) -> int:
        """Milli-GPU this task asks for in total (a share counts by its size)."""
        return self.num_gpu * self.gpu_milli if self.num_gpu else 0


def _rows(path: Path, required: tuple[str, ...],
          optional: tuple[str, ...] = ()) -> list[tuple[int, dict[str, str]]]:
    """``(line, row)`` for every non-blank record; ``line`` is the record's first physical line,
    also after blank lines and quoted fields that span lines."""
    rows: list[tuple[int, dict[str, str]]] = []
    reader = None
    try:
        # utf-8-sig: a file saved by Excel or PowerShell starts with a byte order mark, which
        # would otherwise become part of the first column's name
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = [h.strip() for h in next(reader, [])]   # "name, cpu_milli" exports
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError(f"{path}: missing column(s) {', '.join(missing)} "
                                 f"(header has {', '.join(header) or 'nothing'})")
            for c in (*required, *optional):
                if header.count(c) > 1:
                    raise TraceError(f"{path} line 1: column {c} appears twice in the header")
            end = reader.line_num
            for raw in reader:
                line, end = end + 1, reader.line_num
                if not any(cell.strip() for cell in raw):   # a blank line, or ",,,," from a spreadsheet
                    continue
                if any(cell.strip() for cell in raw[len(header):]):   # e.g. an unquoted "T4,P100"
                    raise TraceError(f"{path} line {line}: {len(raw)} fields, but the header has "
                                     f"{len(header)} columns (quote a field that holds a comma)")
                rows.append((line, {h: raw[i] if i < len(raw) else "" for i, h in enumerate(header)}))
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e})") from e
    except csv.Error as e:
        at = f" line {reader.line_num}" if reader is not None else ""
        raise TraceError(f"{path}{at}: not a CSV file ({e})") from e
    if not rows:
        raise TraceError(f"{path}: no data rows")
    return rows


def _int(path: Path, line: int, row: dict[str, str], col: str, lo: int, hi: int | None = None) -> int:
    raw = (row.get(col) or "").strip()
    try:
        v = int(raw)
    except ValueError:
        raise TraceError(f"{path} line {line}: {col} must be an integer (got {raw!r})") from None
    if v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise TraceError(f"{path} line {line}: {col} must be {rng} (got {v})")
    return v


def _number(path: Path, line: int, row: dict[str, str], col: str, lo: float, hi: float) -> float:
    raw = (row.get(col) or "").strip()
    try:
        v = float(raw)
    except ValueError:
        raise TraceError(f"{path} line {line}: {col} must be a number (got {raw!r})") from None
    if not lo <= v <= hi:   # NaN too
        raise TraceError(f"{path} line {line}: {col} must be {lo:g}..{hi:g} (got {raw})")
    return v


def _spec(row: dict[str, str]) -> frozenset[str]:
    """The models of a ``|``-separated gpu_spec (empty: any model)."""
    return frozenset(m.strip() for m in (row.get("gpu_spec") or "").split("|") if m.strip())


def read_nodes(path: str | Path) -> list[SimNode]:
    """GPU nodes (``sn, cpu_milli, memory_mib, gpu, model``); GPU-less rows are kept (they
    never take GPU tasks)."""
    path = Path(path)
    out, seen = [], set()
    for line, r in _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model")):
        name = (r["sn"] or "").strip()
        if not name:
            raise TraceError(f"{path} line {line}: sn (node name) is empty")
        if name in seen:
            raise TraceError(f"{path} line {line}: node {name} appears twice")
        seen.add(name)
        out.append(SimNode(name, _int(path, line, r, "cpu_milli", 0), _int(path, line, r, "memory_mib", 0),
                           _int(path, line, r, "gpu", 0, 64), (r["model"] or "").strip()))
    return out


def read_pods(path: str | Path) -> list[SimPod]:
    """Tasks (``name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec, ...``)."""
    path = Path(path)
    out, seen = [], set()
    cols = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
    for line, r in _rows(path, cols, ("gpu_spec",)):
        name = (r["name"] or "").strip()
        if not name:
            raise TraceError(f"{path} line {line}: name is empty")
        if name in seen:
            raise TraceError(f"{path} line {line}: task {name} appears twice")
        seen.add(name)
        # a task may ask for more GPUs than any node has: it fails in the replay, as in the artifact
        num = _int(path, line, r, "num_gpu", 0, MAX_TASK_GPUS)
        # a CPU-only task may leave gpu_milli empty: it asks for no GPU either way
        milli = 0 if num == 0 and not (r.get("gpu_milli") or "").strip() else \
            _int(path, line, r, "gpu_milli", 0, MILLI)
        if num > 1 and milli != MILLI:
            raise TraceError(f"{path} line {line}: gpu_milli must be 1000 for a multi-GPU task "
                             f"(num_gpu {num}, got {milli})")
        if num == 1 and milli == 0:
            raise TraceError(f"{path} line {line}: gpu_milli must be 1..1000 when num_gpu is 1")
        spec = _spec(r)
        out.append(SimPod(name, _int(path, line, r, "cpu_milli", 0), _int(path, line, r, "memory_mib", 0),
                          num, milli if num else 0, spec, line=line))
    return out


def _no_fit_reason(pod: SimPod, nodes: list[SimNode]) -> str | None:
    """Why ``pod`` fits no node even when the cluster is empty (the replay's filters), or None."""
    cand = [n for n in nodes if not pod.gpu_spec or n.model in pod.gpu_spec]
    if pod.num_gpu:
        cand = [n for n in cand if n.gpus]
    spec = "|".join(sorted(pod.gpu_spec))
    if not cand:
        models = ", ".join(sorted({n.model for n in nodes if n.gpus and n.model})) or "none"
        return f"gpu_spec {spec} names no model of the node list (it has {models})"
    if pod.num_gpu > max(n.gpus for n in cand):
        return (f"num_gpu {pod.num_gpu}, but the largest {spec + ' ' if spec else ''}node has "
                f"{max(n.gpus for n in cand)} GPUs")
    cand = [n for n in cand if n.gpus >= pod.num_gpu]
    for col, need, have in (("cpu_milli", pod.cpu_milli, [n.cpu_milli for n in cand]),
                            ("memory_mib", pod.memory_mib, [n.memory_mib for n in cand])):
        if need > max(have):
            return f"{col} {need}, but the largest node for it has {max(have)}"
    if not any(n.cpu_milli >= pod.cpu_milli and n.memory_mib >= pod.memory_mib for n in cand):
        return "no node has cpu_milli, memory_mib and GPUs for it together"
    return None


def check_some_task_fits(pods: list[SimPod], nodes: list[SimNode], pods_path: str | Path,
                         nodes_path: str | Path) -> None:
    """Refuse a trace none of whose tasks fits any node of the empty cluster: every task would
    fail and the replay would report 0 % as if it were a result. (Some tasks that fit nowhere
    are part of a trace: they fail, as in the published runs.)"""
    shapes = {(p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_spec): p for p in reversed(pods)}
    if any(_no_fit_reason(pod, nodes) is None for pod in shapes.values()):
        return
    first = pods[0]
    raise TraceError(f"{pods_path}: every task would fail, none fits a node of {nodes_path}; "
                     f"line {first.line}: {_no_fit_reason(first, nodes)}")


def node_tie_order(nodes: list[SimNode], seed: int) -> list[int]:
    """Rank of every node in score ties: the artifact prefixes sorted node names with a
    random 4-digit index from the seed, so ties go to a seeded permutation."""
    by_name = sorted(range(len(nodes)), key=lambda i: nodes[i].name)
    prefixes = list(range(len(nodes)))
    random.Random(seed).shuffle(prefixes)
    rank = [0] * len(nodes)
    for i, p in zip(by_name, prefixes, strict=True):
        rank[i] = p
    return rank


def arrival_order(pods: list[SimPod], seed: int, tune: float, capacity_milli: int) -> list[SimPod]:
    """Tasks sorted by name, shuffled with the seed, then random copies appended until the next
    copy would push the requested GPU total past ``tune`` x capacity (checked with the copy's
    per-GPU milli, as the artifact does). ``tune`` <= 0, or a trace without GPU tasks (no copy
    would bring it closer), means no copies."""
    rng = random.Random(seed)
    order = sorted(pods, key=lambda p: p.name)
    rng.shuffle(order)
    total = sum(p.gpu_request for p in order)
    target = tune * capacity_milli
    copies: list[SimPod] = []
    while tune > 0 and total:
        base = order[rng.randrange(len(order))]
        if total + base.gpu_milli > target:
            break
        copies.append(SimPod(f"{base.name}-tuned-{len(copies)}", base.cpu_milli, base.memory_mib,
                             base.num_gpu, base.gpu_milli, base.gpu_spec, clone=True))
        total += base.gpu_request
        if len(copies) > 50 * len(order) + 1000:  # a trace of CPU-only tasks never reaches the target
            break
    return order + copies


PublishedCurves = dict[tuple[str, str, float, int], list[float]]


def read_published_curves(path: str | Path) -> PublishedCurves:
    """published_alloc_curves.csv: ``(workload, sc_policy, tune, seed)`` -> the allocation %
    at x = 0..130 % of GPU capacity arrived (columns ``0`` .. ``130``)."""
    path = Path(path)
    points = [str(x) for x in range(CURVE_POINTS)]
    out: PublishedCurves = {}
    seen: dict[tuple[str, str, float, int], int] = {}
    for line, r in _rows(path, ("workload", "sc_policy", "tune", "seed", *points)):
        workload, policy = (r["workload"] or "").strip(), (r["sc_policy"] or "").strip()
        for col, value in (("workload", workload), ("sc_policy", policy)):
            if not value:
                raise TraceError(f"{path} line {line}: {col} is empty")
        tune, seed = _number(path, line, r, "tune", 0, 10), _int(path, line, r, "seed", 0)
        key = (workload, policy, tune, seed)
        if key in seen:
            raise TraceError(f"{path} line {line}: {workload} {policy} tune {tune:g} seed {seed} appears "
                             f"twice (also line {seen[key]})")
        seen[key] = line
        out[key] = [_number(path, line, r, x, 0, 100) for x in points]
    return out


def read_reference_order(path: str | Path) -> list[SimPod]:
    """The exact arrival order of a published run (reference/*_order.csv)."""
    path = Path(path)
    out = []
    cols = ("seq", "name", "tuned_clone", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
    for line, r in _rows(path, cols, ("gpu_spec",)):
        num = _int(path, line, r, "num_gpu", 0, 64)
        spec = _spec(r)
        out.append(SimPod(r["name"], _int(path, line, r, "cpu_milli", 0),
                          _int(path, line, r, "memory_mib", 0), num,
                          _int(path, line, r, "gpu_milli", 0, MILLI), spec, r["tuned_clone"] == "1"))
    return out


def read_reference_ranks(path: str | Path, nodes: list[SimNode]) -> list[int]:
    """Tie ranks from a published run's node prefixes (reference/*_node_prefix.csv)."""
    path = Path(path)
    prefix = {r["node"]: int(r["prefix"]) for _line, r in _rows(path, ("node", "prefix"))}
    missing = [n.name for n in nodes if n.name not in prefix]
    if missing:
        raise TraceError(f"{path}: no prefix for node(s) {', '.join(missing[:3])}")
    return [prefix[n.name] for n in nodes]
