"""What a rejection tells, folded over the nodes it looked at, and kept per block of nodes.

A rejection says why no node took a request: the largest free GPU memory and where, how many
nodes lack the host CPU or memory asked, which GPUs are lost... Worked out node by node that
looks at every node, and a full cluster rejects a quarter of the requests (37 ms each at
10,000 nodes). Every figure is a fold (a count, "any", "all", a best with the first node in
node order that has it), so folds of any groups of nodes combine, in any order. The nodes a
rejection looks at are those with the host CPU and memory it asks, so ``HostBlocks`` keeps the
nodes sorted by free host CPU (most first) in blocks, and in each block by free host memory,
with each block's folds of its first nodes by memory kept per kind of rejection: a request's
nodes are then whole blocks (up to one, split by its CPU, gone through node by node), a prefix
of each by memory. A block's folds are worked out again after one of its nodes changed.

Nodes carry ``rank`` (their place in node order) for the ties. A fold's ``*_at`` fields name
the node a figure is on; a node's own summary leaves them None (nodes alike share one
summary), and ``merge`` takes the node to fill them with.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar


class Fold(Protocol):
    def merge(self, other: Any, at: Any) -> None: ...

    def copy(self) -> Any: ...


F = TypeVar("F", bound=Fold)
KEYS_KEPT = 8   # kinds of rejection whose folds a block keeps (then all forgotten): at 10,000 nodes
# a kind kept in every block is ~20,000 folds, ~5 MB (the default trace asks two kinds)


def _before(value: Any, at: Any, best: Any, best_at: Any) -> bool:
    """Whether ``value`` on node ``at`` beats ``best`` on ``best_at``: greater, or equal on a
    node earlier in node order."""
    return value > best or (value == best and at.rank < best_at.rank)


def _below(value: Any, at: Any, best: Any, best_at: Any) -> bool:
    """Whether ``value`` on node ``at`` beats ``best`` on ``best_at``: less, or equal on a node
    earlier in node order."""
    return value < best or (value == best and at.rank < best_at.rank)


@dataclass
class ShareFold:
    """What nodes tell about a rejected share: whether they have GPUs of the models asked
    (``wanted``), lost or closed (``shut``), unable to run MPS (``no_mps``: the first node's
    reason, and how many nodes have one), or ``usable`` for the share's kind; of the usable ones
    the best figures, each with its GPU (the most memory and free memory, with -index; the
    least SM and quota used, with index: the first GPU wins ties, then the first node);
    and the usable GPUs the sharing tags keep it off, ``(node, GPU index, why)`` (the rejection
    keeps those with room for the share: a summary leaves the share's sizes out)."""

    wanted: bool = False
    any_shut: bool = False
    all_shut: bool = True
    all_no_mps: bool = True
    no_mps: str | None = None
    no_mps_at: Any = None
    no_mps_nodes: int = 0
    usable: bool = False
    big: tuple[int, int] = (0, 0)
    big_at: Any = None
    free: tuple[float, int] = (0.0, 0)
    free_at: Any = None
    sm: tuple[int, int] = (0, 0)
    sm_at: Any = None
    quota: tuple[float, int] = (0.0, 0)
    quota_at: Any = None
    tagged: list[tuple[Any, int, str]] = field(default_factory=list)

    def copy(self) -> ShareFold:
        out = ShareFold.__new__(ShareFold)
        out.__dict__.update(self.__dict__)
        out.tagged = list(self.tagged)
        return out

    def merge(self, o: ShareFold, at: Any) -> None:
        """Fold in ``o`` (``at``: its node, if it is a node's own summary)."""
        self.wanted |= o.wanted
        self.any_shut |= o.any_shut
        self.all_shut &= o.all_shut
        self.all_no_mps &= o.all_no_mps
        if o.no_mps is not None:
            where = o.no_mps_at or at
            if self.no_mps is None or where.rank < self.no_mps_at.rank:
                self.no_mps, self.no_mps_at = o.no_mps, where
            self.no_mps_nodes += o.no_mps_nodes
        if not o.usable:
            return
        if not self.usable:
            self.usable = True
            self.big, self.big_at, self.free, self.free_at = o.big, o.big_at or at, o.free, o.free_at or at
            self.sm, self.sm_at, self.quota, self.quota_at = o.sm, o.sm_at or at, o.quota, o.quota_at or at
        else:
            if _before(o.big, where := o.big_at or at, self.big, self.big_at):
                self.big, self.big_at = o.big, where
            if _before(o.free, where := o.free_at or at, self.free, self.free_at):
                self.free, self.free_at = o.free, where
            if _below(o.sm, where := o.sm_at or at, self.sm, self.sm_at):
                self.sm, self.sm_at = o.sm, where
            if _below(o.quota, where := o.quota_at or at, self.quota, self.quota_at):
                self.quota, self.quota_at = o.quota, where
        if o.tagged:
            self.tagged.extend((node or at, i, why) for node, i, why in o.tagged)


@dataclass
class WholeFold:
    """What nodes tell about a rejected whole-GPU request: whether they have GPUs of the
    models asked, the most GPUs it may have on one node (idle) and where, how many GPUs are
    empty but in MIG mode, and the lost ones (how many, and the first three in node order as
    (node, index))."""

    wanted: bool = False
    idle: int = 0
    idle_at: Any = None
    mig: int = 0
    lost: int = 0
    lost_first: list[tuple[Any, int]] = field(default_factory=list)

    def copy(self) -> WholeFold:
        return WholeFold(self.wanted, self.idle, self.idle_at, self.mig, self.lost, list(self.lost_first))

    def merge(self, o: WholeFold, at: Any) -> None:
        self.wanted |= o.wanted
        where = o.idle_at or at
        if o.idle and (self.idle_at is None or _before(o.idle, where, self.idle, self.idle_at)):
            self.idle, self.idle_at = o.idle, where
        self.mig += o.mig
        if o.lost:
            self.lost += o.lost
            lost = self.lost_first + [(node or at, i) for node, i in o.lost_first]
            self.lost_first = sorted(lost, key=lambda gpu: (gpu[0].rank, gpu[1]))[:3]


@dataclass
class HostFold:
    """How the nodes looked at split on a request's host CPU and memory: how many lack the CPU
    (and the most free among them, on the first node having it, as (free, -rank, name)), how
    many have the CPU but lack the memory (likewise), and how many have both."""

    cpu: int
    memory: int
    no_cpu: int = 0
    most_cpu: tuple[float, int, str] = (-math.inf, 0, "")
    no_mem: int = 0
    most_mem: tuple[float, int, str] = (-math.inf, 0, "")
    fit: int = 0

    def takes(self, cpu_left: int, mem_left: int, rank: int, name: str) -> bool:
        """Count one node; whether it has the CPU and memory asked."""
        if self.cpu and self.cpu > cpu_left:
            self.lacks_cpu(1, (cpu_left, -rank, name))
            return False
        if self.memory and self.memory > mem_left:
            self.lacks_memory(1, (mem_left, -rank, name))
            return False
        self.fit += 1
        return True

    def lacks_cpu(self, nodes: int, most: tuple[float, int, str]) -> None:
        self.no_cpu += nodes
        self.most_cpu = max(self.most_cpu, most)

    def lacks_memory(self, nodes: int, most: tuple[float, int, str]) -> None:
        self.no_mem += nodes
        self.most_mem = max(self.most_mem, most)


class _Block:
    """Nodes next to each other in free CPU order: ``keys`` (-free CPU, rank) ascending, and,
    worked out when first asked after a change (None until then), the same nodes by free
    memory, most first (``by_mem``, with ``mem_keys`` (-free memory, rank)), and per key the
    folds of the first j of them (``prefix``)."""

    __slots__ = ("by_mem", "keys", "mem_keys", "nodes", "prefix")

    def __init__(self, keys: list[tuple[int, int]], nodes: list[Any]) -> None:
        self.keys, self.nodes = keys, nodes
        self.by_mem: list[Any] | None = None
        self.mem_keys: list[tuple[int, int]] = []
        self.prefix: dict[Hashable, list[Any]] = {}


class HostBlocks:
    """The nodes sorted by free host CPU, most first, then node order, in blocks of ``size`` to
    ``2 * size`` (see the module's docstring). ``host``: a node's free CPU, free memory and name;
    a node's ``rank`` is its place in node order. ``touched`` when a node is about to change."""

    def __init__(self, nodes: list[Any], host: Callable[[Any], tuple[int, int, str]], size: int) -> None:
        self._host, self._size = host, size
        self._touched: dict[int, Any] = {}   # by rank: nodes to sort in again (they changed since)
        items = sorted(((-host(n)[0], n.rank), n) for n in nodes)   # (a node's rank is unique)
        self._key = {n.rank: key for key, n in items}   # where each node sorts now
        self._blocks = [_Block([k for k, _n in items[i:i + size]], [n for _k, n in items[i:i + size]])
                        for i in range(0, len(items), size)]
        self._lasts = [b.keys[-1] for b in self._blocks]

    def touched(self, n: Any) -> None:
        """Node ``n`` is about to change: sorted in again, as it will then be, before the next fold."""
        self._touched[n.rank] = n

    def _move(self, n: Any) -> None:
        """Put node ``n`` where its free CPU now sorts; its old and new blocks' folds go stale."""
        old = self._key[n.rank]
        i = bisect.bisect_left(self._lasts, old)
        b = self._blocks[i]
        j = bisect.bisect_left(b.keys, old)
        del b.keys[j], b.nodes[j]
        if b.keys:
            b.by_mem = None
            self._lasts[i] = b.keys[-1]
        else:
            del self._blocks[i], self._lasts[i]
        key = self._key[n.rank] = (-self._host(n)[0], n.rank)
        i = min(bisect.bisect_left(self._lasts, key), len(self._blocks) - 1)
        if i < 0:   # it was the only node
            self._blocks, self._lasts = [_Block([key], [n])], [key]
            return
        b = self._blocks[i]
        j = bisect.bisect_left(b.keys, key)
        b.keys.insert(j, key)
        b.nodes.insert(j, n)
        b.by_mem = None
        self._lasts[i] = b.keys[-1]
        if len(b.keys) > 2 * self._size:
            half = len(b.keys) // 2
            self._blocks[i + 1:i + 1] = [_Block(b.keys[half:], b.nodes[half:])]
            del b.keys[half:], b.nodes[half:]
            self._lasts[i:i + 1] = [b.keys[-1], self._blocks[i + 1].keys[-1]]

    def fold(self, host: HostFold, key: Hashable, new: Callable[[], F], summary: Callable[[Any], F]) -> F:
        """The fold of ``summary`` (what ``key`` names) over the nodes with the host CPU and
        memory ``host`` asks, counting the others in ``host``."""
        for n in self._touched.values():
            self._move(n)
        self._touched.clear()
        out = new()
        cpu, mem = host.cpu, host.memory
        for bi, b in enumerate(self._blocks):
            if not cpu or -b.keys[-1][0] >= cpu:   # every node has the CPU
                if b.by_mem is None:
                    self._sort_by_mem(b)
                j = bisect.bisect_right(b.mem_keys, (-mem, math.inf)) if mem else len(b.keys)
                if j < len(b.keys):
                    _cpu, mem_left, name = self._host(b.by_mem[j])
                    host.lacks_memory(len(b.keys) - j, (mem_left, -b.mem_keys[j][1], name))
                if j:
                    out.merge(self._prefix(b, key, new, summary)[j], None)
                    host.fit += j
            elif -b.keys[0][0] < cpu:   # none has it: nor have the blocks after
                rest = sum(len(later.keys) for later in self._blocks[bi:])
                first = b.nodes[0]
                host.lacks_cpu(rest, (-b.keys[0][0], -first.rank, self._host(first)[2]))
                break
            else:
                for n in b.nodes:
                    left, mem_left, name = self._host(n)
                    if host.takes(left, mem_left, n.rank, name):
                        out.merge(summary(n), n)
        return out

    def _sort_by_mem(self, b: _Block) -> None:
        pairs = sorted(((-self._host(n)[1], n.rank), n) for n in b.nodes)
        b.mem_keys, b.by_mem = [k for k, _n in pairs], [n for _k, n in pairs]
        b.prefix.clear()

    @staticmethod
    def _prefix(b: _Block, key: Hashable, new: Callable[[], F], summary: Callable[[Any], F]) -> list[F]:
        """The folds of ``b``'s first j nodes by free memory, for j from 0 on."""
        folds = b.prefix.get(key)
        if folds is None:   # (sorting the block by memory again drops them all)
            if len(b.prefix) >= KEYS_KEPT:
                b.prefix.clear()
            fold = new()
            folds = [fold.copy()]
            for n in b.by_mem:
                fold.merge(summary(n), n)
                folds.append(fold.copy())
            b.prefix[key] = folds
        return folds
