"""The controller's records: what a request asks for, what a node has, what an allocation holds.

Plain dataclasses with JSON round-trips, so that any state store (SQLite here, the Kubernetes
API in-cluster) can persist them without knowing the protobuf or the engine types.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

# Allocation ids are the agents' share ids: "fs-", the allocation's sequence number in hex, "-" and
# 8 random hex digits. The sequence grows with every allocation (it starts from the clock in
# microseconds, so a database restored from a backup issues numbers above any it lost, and goes
# on above every number seen on an agent, for a clock behind them), and the state store keeps the
# highest it recorded: a share numbered above it is newer than the database (see ``Reconciler``).
# Ids made before the sequence ("fs-" and 16 hex digits) have none, nor has a number of more than
# 14 hex digits: no clock makes one (microseconds reach 16**14 in the year 4253), and 16 would not
# fit SQLite's integers (an agent share so numbered broke every reconciler pass).
ID_PREFIX = "fs-"
_SEQUENCED = re.compile(r"fs-([0-9a-f]{1,14})-[0-9a-f]{8}")


def sequence_of(allocation_id: str) -> int | None:
    """The sequence number an allocation id carries (None: not one this controller numbered)."""
    found = _SEQUENCED.fullmatch(allocation_id)
    return int(found.group(1), 16) if found else None


class Kind(enum.StrEnum):
    FASTPOD = "fastpod"
    MPS = "mps"
    EXCLUSIVE = "exclusive"
    WHOLE = "whole"


class State(enum.StrEnum):
    """Life cycle: pending -> prepared -> active -> releasing -> released | failed."""

    PENDING = "pending"
    PREPARED = "prepared"
    ACTIVE = "active"
    RELEASING = "releasing"
    RELEASED = "released"
    FAILED = "failed"


# States in which an allocation holds capacity on its node (the engine must count it).
HOLDING = frozenset({State.PENDING, State.PREPARED, State.ACTIVE, State.RELEASING})
FINISHED = frozenset({State.RELEASED, State.FAILED})


@dataclass(frozen=True)
class Spec:
    """What a workload asks for; which fields apply depends on ``kind`` (see validation)."""

    kind: Kind
    sm_percent: int = 0
    memory_bytes: int = 0
    quota_request: float = 0.0
    quota_limit: float = 0.0
    mig_profile: str = ""
    sm_count: int = 0
    gpu_count: int = 0
    models: tuple[str, ...] = ()
    node_selector: tuple[tuple[str, str], ...] = ()
    affinity: str = ""
    anti_affinity: str = ""
    exclusion: str = ""
    cpu_milli: int = 0            # host CPU and memory the workload needs beside the GPU share
    host_memory_bytes: int = 0    # (in-cluster: the replica Pod's effective request)

    def to_json(self) -> dict[str, Any]:
        data = dict(vars(self))   # every field is a scalar or a tuple replaced below (asdict deep-copies)
        data["kind"] = self.kind.value
        data["node_selector"] = dict(self.node_selector)
        data["models"] = list(self.models)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Spec:
        data = dict(data)
        data["kind"] = Kind(data["kind"])
        data["node_selector"] = tuple(sorted(dict(data.get("node_selector") or {}).items()))
        data["models"] = tuple(data.get("models") or ())
        return cls(**data)


@dataclass(frozen=True)
class Device:
    """One device an allocation holds: a GPU, or a MIG slice of one."""

    gpu_index: int
    gpu_uuid: str
    model: str = ""
    mig_profile: str = ""
    mig_start: int = 0
    mig_size: int = 0
    mig_uuid: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))   # scalars only: what asdict gives, without its deep copy


@dataclass
class Allocation:
    id: str
    spec: Spec
    owner: str
    state: State
    node: str
    idempotency_key: str = ""
    devices: list[Device] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    assignment: dict[str, Any] = field(default_factory=dict)  # the engine's serialised reservation
    created_at: float = 0.0
    updated_at: float = 0.0
    lease_ttl: int = 0
    lease_expires_at: float = 0.0


@dataclass(frozen=True)
class Gpu:
    """A GPU as the node agent last reported it."""

    index: int
    uuid: str
    model: str
    memory_bytes: int
    sm_count: int
    mig_capable: bool = False
    mig_enabled: bool = False
    # MIG instances that no share holds, as (profile id, start, memory slices): a static layout
    # or an instance kept while busy. Placement goes around them or takes one as it is.
    mig_unheld: tuple[tuple[int, int, int], ...] = ()
    lost: str = ""   # "" while it works; else the NVML error it answers (GPU_IS_LOST): it takes no shares
    # a MIG mode change (to ``not mig_enabled``) waits for a GPU reset: it takes no new shares until then
    mig_change_pending: bool = False


@dataclass
class Node:
    name: str
    address: str
    labels: dict[str, str] = field(default_factory=dict)
    gpus: list[Gpu] = field(default_factory=list)
    available: bool = False
    last_heartbeat: float = 0.0
    registered_at: float = 0.0
    inventory: dict[str, Any] = field(default_factory=dict)  # the agent's raw inventory, for the engine
    cordoned: bool = False           # an operator said: no new work here (e.g. MIG change)
    cordon_reason: str = ""
