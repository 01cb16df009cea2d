"""Plain data of the placement engine: requests, the cluster view, assignments, rejections.

Everything here converts to and from plain dicts (``to_dict`` / ``from_dict``) because the
controller persists assignments and the cluster view in its state store and rebuilds the
engine from them after a restart; the engine itself never does I/O.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastshare.device.api import MigProfile

KINDS = ("fastpod", "mps", "exclusive", "whole")
MILLI = 1000  # SM share and time quota are tracked in thousandths of a GPU (0.1 % steps)
FARTHEST_LINK = 9  # the link level of a GPU pair a node's links do not give


class InvalidRequest(ValueError):
    """A request or view field is malformed; the message names the field and allowed range."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidRequest(message)


@dataclass(frozen=True)
class Request:
    """What a workload asks for. Which fields matter depends on ``kind``:

    - ``fastpod``: ``sm_percent`` (0 < p <= 100, SM share via MPS), ``gpu_memory_mib`` (> 0),
      ``quota_request`` <= ``quota_limit`` in (0, 1] (time quota for the interception library;
      the requests on one GPU add up to at most 1);
    - ``mps``: ``gpu_memory_mib`` only (no SM limit);
    - ``exclusive``: a MIG slice with at least ``sm_count`` SMs or ``sm_percent`` of the GPU's
      SMs and/or ``gpu_memory_mib`` of memory; ``mig_profile``: only a slice of that profile (name
      or id, as ``catalog.find_profile``; its shape differs per model: sizes alone could pick
      another profile on some model);
    - ``whole``: ``gpus`` entirely idle GPUs on one node.

    Every kind may ask for host ``cpu_milli`` / ``memory_mib``, restrict GPU models
    (``gpu_models``), select nodes by labels (``node_selector``) and carry KubeShare-style tags:
    ``affinity`` (sharers with the same tag go to the same GPU), ``anti_affinity`` (sharers
    with the same tag never share a GPU) and ``exclusion`` (a GPU holding tag X only takes
    sharers tagged X; untagged sharers only share with untagged ones). MIG slices of one GPU
    share it too (its memory bandwidth, a reset); a whole GPU is shared with no one.
    """

    id: str
    kind: str
    sm_percent: float | None = None
    sm_count: int | None = None
    gpu_memory_mib: int = 0
    quota_request: float = 1.0
    quota_limit: float = 1.0
    gpus: int = 1
    cpu_milli: int = 0
    memory_mib: int = 0
    gpu_models: tuple[str, ...] = ()
    node_selector: tuple[tuple[str, str], ...] = ()
    affinity: str | None = None
    anti_affinity: str | None = None
    exclusion: str | None = None
    mig_profile: str | None = None

    def __post_init__(self) -> None:
        # Accept a dict / list for the tuple fields so callers can pass JSON straight in; sorted
        # either way, as to_dict/from_dict (a dict) would give it back.
        pairs = self.node_selector.items() if isinstance(self.node_selector, Mapping) else self.node_selector
        object.__setattr__(self, "node_selector", tuple(sorted(tuple(p) for p in pairs)))
        object.__setattr__(self, "gpu_models", tuple(self.gpu_models))
        # an empty tag is no tag: one meaning for the tag checks and the engine's caches alike
        for tag in ("affinity", "anti_affinity", "exclusion"):
            if getattr(self, tag) == "":
                object.__setattr__(self, tag, None)
        self.validate()

    @functools.cached_property   # asked for every GPU looked at; the request never changes
    def sm_milli(self) -> int:
        """The fastpod SM share in thousandths (what the per-GPU ledger adds up), rounded UP:
        rounding to nearest let shares add up to more than 100 % (3 x 33.34 %) and a share
        under 0.05 % took no capacity at all, so it "fit" a GPU held whole or in MIG mode.
        (The inner round drops float noise such as 30.1 * 10 = 301.00000000000006.)"""
        return math.ceil(round((self.sm_percent or 0) * 10, 6))

    def validate(self) -> None:
        _check(isinstance(self.id, str) and self.id != "", "id: must be a non-empty string")
        _check(self.kind in KINDS, f"kind: must be one of {', '.join(KINDS)} (got {self.kind!r})")
        _check(self.cpu_milli >= 0, f"cpu_milli: must be >= 0 (got {self.cpu_milli})")
        _check(self.memory_mib >= 0, f"memory_mib: must be >= 0 (got {self.memory_mib})")
        _check(self.gpu_memory_mib >= 0, f"gpu_memory_mib: must be >= 0 (got {self.gpu_memory_mib})")
        if self.kind == "fastpod":
            p = self.sm_percent
            _check(p is not None and 0 < p <= 100 and math.isfinite(p),
                   f"sm_percent: fastpod needs an SM share in (0, 100] percent (got {p})")
            _check(self.gpu_memory_mib > 0,
                   "gpu_memory_mib: fastpod needs a GPU memory limit > 0 MiB")
            _check(0 < self.quota_request <= 1,
                   f"quota_request: must be in (0, 1] (got {self.quota_request})")
            _check(0 < self.quota_limit <= 1, f"quota_limit: must be in (0, 1] (got {self.quota_limit})")
            _check(self.quota_request <= self.quota_limit,
                   f"quota_request: must be <= quota_limit ({self.quota_request} > {self.quota_limit})")
        elif self.kind == "mps":
            _check(self.gpu_memory_mib > 0, "gpu_memory_mib: mps needs a GPU memory amount > 0 MiB")
        elif self.kind == "exclusive":
            p = self.sm_percent
            _check(p is None or (0 < p <= 100 and math.isfinite(p)),
                   f"sm_percent: must be in (0, 100] percent (got {p})")
            _check(self.sm_count is None or self.sm_count > 0, f"sm_count: must be > 0 (got {self.sm_count})")
            _check(p is None or self.sm_count is None, "sm_percent/sm_count: give one of them, not both")
            _check(p is not None or self.sm_count is not None or self.gpu_memory_mib > 0,
                   "exclusive: give sm_count, sm_percent or gpu_memory_mib to size the MIG slice")
        else:  # whole
            _check(isinstance(self.gpus, int) and self.gpus >= 1,
                   f"gpus: must be an integer >= 1 (got {self.gpus})")
        _check(self.mig_profile is None or self.kind == "exclusive",
               f"mig_profile: only kind 'exclusive' takes a MIG profile (got kind {self.kind!r})")
        if self.kind != "whole":
            _check(self.gpus == 1, f"gpus: only kind 'whole' takes several GPUs (got {self.gpus})")

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["gpu_models"] = list(self.gpu_models)
        d["node_selector"] = dict(self.node_selector)
        if self.mig_profile is None:   # the persisted form of requests without one is unchanged
            del d["mig_profile"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Request:
        unknown = set(d) - set(cls.__dataclass_fields__)
        _check(not unknown, f"request: unknown field(s) {', '.join(sorted(unknown))}")
        return cls(**d)


@dataclass(frozen=True)
class GpuView:
    """One GPU as inventory reports it. ``mig_profiles`` come from NVML or the device catalog."""

    index: int
    model: str
    memory_mib: int
    sm_count: int
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_profiles: tuple[MigProfile, ...] = ()
    uuid: str = ""
    # MIG instances on the device that no share holds, as (profile id, start, memory slices):
    # a static layout (mig_config), or an instance kept while a process still used it
    mig_unheld: tuple[tuple[int, int, int], ...] = ()
    # why MPS shares (fastpod, mps) cannot run on it, e.g. its node has no MPS control binary;
    # "" when they can
    no_mps: str = ""
    # why it takes no share at all, e.g. "lost (fell off the bus?): NVML_ERROR_GPU_IS_LOST"; "" when usable
    lost: str = ""
    # why it takes no NEW share while those it holds stay held (not over-committed), e.g. a MIG mode
    # change pending until a GPU reset, which the operator drains it for; "" when open
    closed: str = ""
    # turning MIG on waits for a GPU reset (Ampere): with MIG off it takes no MIG slice, since an
    # exclusive request cannot turn MIG on there and go on
    mig_enable_needs_reset: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mig_unheld", tuple(sorted(tuple(i) for i in self.mig_unheld)))

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["mig_profiles"] = [dict(p.__dict__, placements=list(p.placements)) for p in self.mig_profiles]
        d["mig_unheld"] = [list(i) for i in self.mig_unheld]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GpuView:
        d = dict(d)
        d["mig_profiles"] = tuple(
            MigProfile(**dict(p, placements=tuple(p["placements"]))) for p in d.get("mig_profiles", ())
        )
        return cls(**d)


@dataclass(frozen=True)
class NodeView:
    """One host. ``links`` maps a GPU index pair (i < j) to a link level: lower is closer
    (e.g. NVML topology levels: same board / NVLink < PCIe switch < host bridge < system)."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: tuple[GpuView, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    links: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        labels = self.labels.items() if isinstance(self.labels, Mapping) else self.labels
        object.__setattr__(self, "labels", tuple(sorted(tuple(p) for p in labels)))  # as from_dict gives
        object.__setattr__(self, "gpus", tuple(self.gpus))
        links = ([(i, j, lv) for (i, j), lv in self.links.items()] if isinstance(self.links, Mapping)
                 else [tuple(x) for x in self.links])
        _check(self.cpu_milli >= 0, f"node {self.name}: cpu_milli must be >= 0")
        _check(self.memory_mib >= 0, f"node {self.name}: memory_mib must be >= 0")
        idx = [g.index for g in self.gpus]
        _check(idx == list(range(len(idx))), f"node {self.name}: GPU indexes must be 0..n-1 in order")
        for i, j, _lv in links:
            _check(i != j and min(i, j) >= 0 and max(i, j) < len(idx),
                   f"node {self.name}: links: GPU pair ({i}, {j}) must be two GPUs of 0..{len(idx) - 1}")
        # a pair counts whichever way round it is given (as link_level looks it up: low index first)
        object.__setattr__(self, "links", tuple(sorted((min(i, j), max(i, j), lv) for i, j, lv in links)))

    def link_level(self, i: int, j: int) -> int:
        """Link level between two GPUs; pairs not given count as the farthest level
        (``FARTHEST_LINK``)."""
        a, b = min(i, j), max(i, j)
        for x, y, lv in self.links:
            if x == a and y == b:
                return lv
        return FARTHEST_LINK

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cpu_milli": self.cpu_milli,
            "memory_mib": self.memory_mib,
            "gpus": [g.to_dict() for g in self.gpus],
            "labels": dict(self.labels),
            "links": [list(x) for x in self.links],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeView:
        return cls(
            name=d["name"],
            cpu_milli=d["cpu_milli"],
            memory_mib=d["memory_mib"],
            gpus=tuple(GpuView.from_dict(g) for g in d.get("gpus", ())),
            labels=tuple(sorted(dict(d.get("labels", {})).items())),
            links=tuple(tuple(x) for x in d.get("links", ())),
        )


@dataclass(frozen=True)
class MigSlot:
    """A MIG instance an exclusive assignment asks the node agent to create."""

    profile_id: int
    profile_name: str
    start: int
    size: int
    sm_count: int
    memory_mib: int


@dataclass(frozen=True)
class Assignment:
    """Where a request went. Holds the request itself so release/restore need nothing else.

    ``gpus`` are indexes in the node's view when it was placed; ``gpu_uuids`` (same order) name
    the same GPUs for good: indexes shift when a GPU leaves the node, UUIDs do not. Empty when
    the view had no UUIDs, or in an assignment persisted by an earlier version."""

    request: Request
    node: str
    gpus: tuple[int, ...]
    mig: MigSlot | None = None
    enable_mig: bool = False  # the GPU must be switched to MIG mode first
    gpu_uuids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_uuids", tuple(self.gpu_uuids))
        _check(not self.gpu_uuids or len(self.gpu_uuids) == len(self.gpus),
               f"gpu_uuids: must name each of the {len(self.gpus)} GPU(s) of gpus, or none "
               f"(got {list(self.gpu_uuids)})")

    def to_dict(self) -> dict[str, Any]:
        d = {
            "request": self.request.to_dict(),
            "node": self.node,
            "gpus": list(self.gpus),
            "mig": None if self.mig is None else dict(self.mig.__dict__),
            "enable_mig": self.enable_mig,
        }
        if self.gpu_uuids:   # the persisted form without UUIDs is unchanged
            d["gpu_uuids"] = list(self.gpu_uuids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Assignment:
        return cls(
            request=Request.from_dict(d["request"]),
            node=d["node"],
            gpus=tuple(d["gpus"]),
            mig=None if d.get("mig") is None else MigSlot(**d["mig"]),
            enable_mig=bool(d.get("enable_mig", False)),
            gpu_uuids=tuple(d.get("gpu_uuids") or ()),
        )


@dataclass(frozen=True)
class Rejection:
    """Why nothing fits, in words a user can act on."""

    reason: str
    details: tuple[str, ...] = field(default=())

    def __bool__(self) -> bool:  # so `if result:` reads as "placed"
        return False
