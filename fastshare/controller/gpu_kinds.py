"""What request validation needs to know of the cluster's GPUs, kept as nodes change.

Validation (``validation.validate``) checks the ranges that depend on the cluster against one
GPU of each model and memory size and the most GPUs on one node. Worked out again from every
stored node after each node write, the Allocate after a registration, a cordon or an
inventory change read the whole cluster: 0.7 s at 10,000 nodes. Kept here node by node instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from fastshare.controller.model import Gpu, Node

Kind = tuple[str, int]   # model, memory in bytes


class GpuKinds:
    """The GPU kinds of a set of nodes, and the most GPUs one has. Not thread-safe: the
    controller core calls it under a lock of its own."""

    def __init__(self, nodes: Iterable[Node] = ()) -> None:
        self._of: dict[str, tuple[Kind, ...]] = {}   # node -> the kind of each of its GPUs
        self._count: Counter[Kind] = Counter()       # kind -> GPUs of it
        self._example: dict[Kind, Gpu] = {}           # kind -> one GPU of it
        self._sizes: Counter[int] = Counter()         # GPUs on a node -> nodes with that many
        self._summary: tuple[list[Gpu], int] | None = None
        for node in nodes:
            self.put(node)

    def put(self, node: Node) -> None:
        """A node added, or written again (its GPUs may have changed)."""
        self.remove(node.name)
        kinds = tuple((g.model, g.memory_bytes) for g in node.gpus)
        self._of[node.name] = kinds
        for kind, gpu in zip(kinds, node.gpus, strict=True):
            self._count[kind] += 1
            self._example[kind] = gpu
        self._sizes[len(kinds)] += 1
        self._summary = None

    def remove(self, name: str) -> None:
        kinds = self._of.pop(name, None)
        if kinds is None:
            return
        for kind in kinds:
            self._count[kind] -= 1
            if not self._count[kind]:
                del self._count[kind], self._example[kind]
        self._sizes[len(kinds)] -= 1
        if not self._sizes[len(kinds)]:
            del self._sizes[len(kinds)]
        self._summary = None

    def summary(self) -> tuple[list[Gpu], int]:
        """One GPU of each kind, and the most GPUs on one node. Nothing while some node has no
        GPU known (its agent never reported since this controller started): what the cluster
        has is then unknown, and validation leaves the cluster's ranges to placement, which
        rejects with a reason instead of calling a valid request invalid."""
        if self._summary is None:
            if self._sizes.get(0):
                self._summary = ([], 0)
            else:
                self._summary = (list(self._example.values()), max(self._sizes, default=0))
        return self._summary
