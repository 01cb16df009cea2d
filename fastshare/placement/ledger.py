"""The engine's ledger: what each GPU and node of the cluster view holds.

A record changes only through ``hold`` and ``give_back``, so ``Engine.release`` gives back
exactly what ``place`` or ``restore`` took. Each record also carries what the engine worked out
about it (``state``, ``memo``, ``room``); the engine drops those whenever the record changes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fastshare.device.api import MigProfile
from fastshare.placement import mig as migmath
from fastshare.placement.model import GpuView, MigSlot, NodeView, Request

MEMO_SIZE = 256   # request shapes whose answers a node remembers (then all forgotten)


@dataclass
class GpuRecord:
    """One GPU: its view and who holds what of it."""

    view: GpuView
    sm_used: int = 0            # fastpod SM share, thousandths
    mem_used: int = 0           # fastpod + mps GPU memory, MiB
    share_kind: str | None = None  # "fastpod" | "mps" while sharers exist
    sharers: dict[str, Request] = field(default_factory=dict)
    mig: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # request id -> instance
    whole: str | None = None
    quota_used: float = 0.0     # time quota the fastpod sharers hold (the node agent admits at most 1)
    state: int | None = None    # the number of its state (Engine._gpu_state), None once it changes

    def hold(self, r: Request, slot: MigSlot | None) -> None:
        """Count ``r`` (its MIG slice ``slot`` for an exclusive request) on this GPU."""
        if r.kind in ("fastpod", "mps"):
            self.sharers[r.id] = r
            self.share_kind = r.kind
            self.sm_used += r.sm_milli if r.kind == "fastpod" else 0
            self.mem_used += r.gpu_memory_mib
            self.count_quota()
        elif r.kind == "exclusive":
            self.mig[r.id] = (slot.profile_id, slot.start, slot.size)
        else:
            self.whole = r.id

    def give_back(self, r: Request) -> None:
        """Undo :meth:`hold` of ``r``."""
        if r.kind in ("fastpod", "mps"):
            del self.sharers[r.id]
            self.sm_used -= r.sm_milli if r.kind == "fastpod" else 0
            self.mem_used -= r.gpu_memory_mib
            self.count_quota()
            if not self.sharers:
                self.share_kind = None
        elif r.kind == "exclusive":
            del self.mig[r.id]
        else:
            self.whole = None

    def count_quota(self) -> None:
        """Sum the sharers' quota again (a sum, not a running total: no float drift)."""
        self.quota_used = sum(s.quota_request for s in self.sharers.values() if s.kind == "fastpod")

    @property
    def mig_mode(self) -> bool:
        return self.view.mig_enabled or bool(self.mig)

    def unheld(self) -> list[tuple[int, int, int]]:
        """MIG instances on the device that no assignment here holds (a static layout, or one
        kept while busy): new slices go around them, and a request may take one as it is."""
        own = {start for _pid, start, _size in self.mig.values()}
        return [i for i in self.view.mig_unheld if i[1] not in own]

    @property
    def idle(self) -> bool:
        return not self.sharers and not self.mig and self.whole is None and not self.view.mig_enabled

    def open_to(self, kind: str) -> bool:
        """Whether the device takes new ``kind`` shares at all (room, tags and models aside): it
        works, runs MPS, is held neither whole nor in MIG mode, and is not shared the other way."""
        v = self.view
        return (not (v.lost or v.closed or v.no_mps) and self.whole is None and not self.mig_mode
                and self.share_kind in (None, kind))

    def clash(self, r: Request) -> str | None:
        """Why ``r`` cannot be counted here beside what other assignments hold, however the GPU's
        view changed (one whole holder and one share kind per GPU)."""
        if self.whole is not None:
            return f"is held whole by {self.whole}"
        if r.kind == "whole" and (self.sharers or self.mig):
            return "holds shares or MIG slices"
        if r.kind in ("fastpod", "mps") and self.mig:
            return "holds MIG slices"
        if r.kind in ("fastpod", "mps") and self.share_kind not in (None, r.kind):
            return f"is shared as {self.share_kind}"
        if r.kind == "exclusive" and self.sharers:
            return "holds MPS shares"
        return None

    def foreign_overlap(self, m: MigSlot, node: str) -> str:
        """Why a held MIG slice cannot be had at its placement: instances no assignment holds
        (made outside fastshare, e.g. by hand after the slice's own instance was destroyed) lie
        on its memory slices ("" when none do). Its own instance, not yet shown as held, is not one."""
        own = (m.profile_id, m.start, m.size)
        mask = migmath.used_mask([own])
        names = {p.profile_id: p.name for p in self.view.mig_profiles}
        foreign = [f"a {names.get(i[0], f'profile {i[0]}')} at memory slice {i[1]}"
                   for i in self.view.mig_unheld if i != own and mask & migmath.used_mask([i])]
        if not foreign:
            return ""
        return (f"MIG placement {m.profile_name} at memory slice {m.start} on {self.label(node)} overlaps "
                f"{' and '.join(foreign)} that fastshare did not create (laid out by hand?): destroy "
                f"{'it' if len(foreign) == 1 else 'them'} (nvidia-smi mig -dci, -dgi) to give the slice "
                "back, or release this allocation")

    def best_slice(self, fitting: list[MigProfile]) -> tuple[tuple, int, MigProfile] | None:
        """:func:`fastshare.placement.mig.best_slice` of this GPU: beside what is held and what
        lies on the device unheld."""
        return migmath.best_slice(self.view.mig_profiles, list(self.mig.values()), self.unheld(), fitting)

    def label(self, node: str) -> str:
        return f"{node} GPU {self.view.index}"


@dataclass
class NodeRecord:
    """A node and what it holds. ``memo``: its answers to the shapes bound to it by an affinity
    tag since it last changed (other shapes' answers are shared by nodes alike, see
    :meth:`Engine._lookup`); ``state``: the number of its state; ``version`` counts its changes
    (the shape heaps' entries carry it; numbered across nodes, see ``Engine._ticks``); ``rank``:
    its place in the node order, which breaks ties."""

    view: NodeView
    gpus: list[GpuRecord]
    rank: int = 0
    cpu_used: int = 0
    mem_used: int = 0
    version: int = 0
    memo: dict[tuple, Any] = field(default_factory=dict)
    state: int | None = None   # what its answers depend on, but its name (Engine._state)
    tags: Counter[str] = field(default_factory=Counter)   # task shapes held, see Engine._held_tags
    held: dict[str, None] = field(default_factory=dict)   # ids of the requests held, in their order
    room: dict[str, tuple[float, float, float]] | None = None   # see Engine._room

    def hold(self, r: Request, tag: str) -> None:
        """Count ``r``'s host CPU and memory here, and its task shape ``tag``."""
        self.cpu_used += r.cpu_milli
        self.mem_used += r.memory_mib
        self.tags[tag] += 1
        self.held[r.id] = None

    def give_back(self, r: Request, tag: str) -> None:
        """Undo :meth:`hold` of ``r``."""
        self.cpu_used -= r.cpu_milli
        self.mem_used -= r.memory_mib
        self.held.pop(r.id, None)
        self.tags[tag] -= 1
        if not self.tags[tag]:   # its last holder left
            del self.tags[tag]

    def remember(self, key: tuple, answer: Any) -> Any:
        if len(self.memo) >= MEMO_SIZE:
            self.memo.clear()
        self.memo[key] = answer
        return answer

    @property
    def cpu_left(self) -> int:
        return self.view.cpu_milli - self.cpu_used

    @property
    def mem_left(self) -> int:
        return self.view.memory_mib - self.mem_used


def host_left(n: NodeRecord) -> tuple[int, int, str]:
    return n.cpu_left, n.mem_left, n.view.name
