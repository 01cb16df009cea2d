"""Per request shape, the nodes that can take it, best first: what lets a decision look at a
few nodes instead of all of them.

Between two decisions only the node placed on changes, and requests repeat a few shapes. So
each shape keeps a heap of entries ``(key, name, tag)``, ``key`` ordering the nodes as the
engine ranks them (best first, then node order). A node that changes (a placement, a release,
a capacity change, added or removed) goes on a log of changes, and each heap scores the nodes
logged since it last looked the next time its shape is asked for (a change costs one append,
not one mark per heap). The log keeps the last ``log_kept`` changes; a heap that has not looked
for longer is dropped, and built afresh when next asked (by then most nodes have changed).

Most of a large cluster is alike, and nodes alike answer alike, so an entry names a node
*state* (``name`` empty, ``tag`` the state's number): the nodes in that state from the rank in
``key`` on. A shape seen for the first time then costs one entry per state, not per node; a
node that changes leaves its state (the entry moves on to the next node in it when asked). A
shape whose answer differs between nodes alike (a node selector, an affinity binding) keeps an
entry per node instead (``name`` the node, ``tag`` its version, stale once it changes). The
trace replay (``fastshare/sim/replay.py``) works the same way, by node; this is the
controller's engine's copy.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

Entry = tuple[Any, str, int]   # ((key, rank), node name, node version) or ((key, rank), "", state)


@dataclass
class ShapeHeap:
    """The nodes one request shape fits, best first; ``seen``: the changes it has looked at (a
    position in :class:`ShapeHeaps`' log)."""

    heap: list[Entry] = field(default_factory=list)
    sample: Any = None    # a request of this shape, to score its nodes again after a policy change
    seen: int = 0

    def push(self, entry: Entry) -> None:
        heapq.heappush(self.heap, entry)

    def pop(self) -> Entry:
        return heapq.heappop(self.heap)

    def replace_top(self, entry: Entry) -> None:
        """Pop the top and push ``entry`` in one step (a state's entry moved on to a later node)."""
        heapq.heapreplace(self.heap, entry)

    def compact(self, live: Callable[[list[Entry]], list[Entry]], nodes: int) -> None:
        """Keep only the ``live`` entries once the heap outgrows the nodes (a long-lived
        controller would otherwise keep one per change)."""
        if len(self.heap) > 2 * nodes + 64:
            self.heap = live(self.heap)
            heapq.heapify(self.heap)


class ShapeHeaps:
    """The heaps of the last ``limit`` shapes asked for (the least recently asked is dropped)."""

    def __init__(self, limit: int = 128, log_kept: int = 1 << 16) -> None:
        self.limit = limit
        self.log_kept = log_kept
        self._heaps: OrderedDict[Hashable, ShapeHeap] = OrderedDict()
        self._log: list[str] = []   # the nodes changed, oldest first ...
        self._base = 0              # ... the first being change number _base

    def __len__(self) -> int:
        return len(self._heaps)

    def get(self, shape: Hashable) -> ShapeHeap | None:
        h = self._heaps.get(shape)
        if h is not None:
            self._heaps.move_to_end(shape)
        return h

    def build(self, shape: Hashable, entries: Iterable[Entry], sample: Any) -> ShapeHeap:
        h = ShapeHeap(list(entries), sample=sample, seen=self._base + len(self._log))
        heapq.heapify(h.heap)
        self._heaps[shape] = h
        self._heaps.move_to_end(shape)
        while len(self._heaps) > self.limit:
            self._heaps.popitem(last=False)
        return h

    def drop(self, shape: Hashable) -> None:
        self._heaps.pop(shape, None)

    def changed(self, name: str) -> None:
        """Node ``name`` changed: every heap scores it again when next asked."""
        self._log.append(name)
        if len(self._log) > 2 * self.log_kept:
            cut = len(self._log) - self.log_kept
            del self._log[:cut]
            self._base += cut
            for shape in [shape for shape, h in self._heaps.items() if h.seen < self._base]:
                del self._heaps[shape]   # too far behind to tell what changed: built afresh

    def dirty(self, h: ShapeHeap) -> set[str]:
        """The nodes changed since ``h`` last looked; from now on it has seen them."""
        names = set(self._log[h.seen - self._base:])
        h.seen = self._base + len(self._log)
        return names

    def clear(self) -> None:
        self._heaps.clear()

    def items(self) -> list[tuple[Hashable, ShapeHeap]]:
        return list(self._heaps.items())
