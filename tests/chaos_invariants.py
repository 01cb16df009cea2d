"""The chaos invariants as plain data, shared by the standalone and the Kubernetes chaos tests.

Each mode turns what it can observe (the controller's cluster status, or the agents' own
inventories and the Pods) into :class:`GpuLoad` and :class:`AgentHoldings`; the checks here
return human-readable problems (empty: the invariant holds) and know nothing of gRPC or
Kubernetes, so both modes check exactly the same rules.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from fastshare.v1 import agent_pb2, common_pb2


@dataclass(frozen=True)
class GpuLoad:
    """What one GPU carries at one moment, against what it has."""

    where: str                      # "node-a GPU 0", for messages
    memory_capacity: int
    sm_percent: float = 0.0
    memory_bytes: int = 0
    quota_request: float = 0.0
    mig_slices: tuple[tuple[int, int], ...] = ()   # (start, size) of every MIG slice in use
    memory_slices: int = 8
    whole_holders: int = 0          # whole-GPU shares on it (alone or nothing)
    other_holders: int = 0          # fractional shares and MIG slices on it


@dataclass(frozen=True)
class AgentHoldings:
    """What one agent holds: shares, the MIG instances it made (and the share holding each),
    its MPS daemons (and the shares each serves)."""

    node: str
    shares: frozenset[str]
    owned_mig: tuple[tuple[str, str], ...] = ()          # (MIG uuid, holding share id or "")
    mps_daemons: tuple[tuple[str, tuple[str, ...]], ...] = ()   # (device uuid, share ids)


@dataclass
class Records:
    """What the system of record says: allocation id -> node, for held and for finished ones."""

    active: dict[str, str] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)


def capacity_problems(gpus: Iterable[GpuLoad]) -> list[str]:
    """No GPU over 100 % SMs, its memory or its time quota; MIG slices never overlap; a whole
    GPU is held by one share and nothing else."""
    problems = []
    for gpu in gpus:
        if gpu.sm_percent > 100:
            problems.append(f"{gpu.where}: {gpu.sm_percent:g} % SMs")
        if gpu.memory_bytes > gpu.memory_capacity:
            problems.append(f"{gpu.where}: memory {gpu.memory_bytes} > {gpu.memory_capacity}")
        if gpu.quota_request > 1.0 + 1e-9:
            problems.append(f"{gpu.where}: quota requests {gpu.quota_request:g}")
        cells = [0] * max(8, gpu.memory_slices, *(s + n for s, n in gpu.mig_slices))
        for start, size in gpu.mig_slices:
            for c in range(start, start + size):
                cells[c] += 1
        if max(cells) > 1:
            problems.append(f"{gpu.where}: MIG slices overlap {sorted(gpu.mig_slices)}")
        if gpu.whole_holders > 1 or (gpu.whole_holders and gpu.other_holders):
            problems.append(f"{gpu.where}: held whole by {gpu.whole_holders} share(s) and shared by "
                            f"{gpu.other_holders}")
    return problems


def ownership_problems(records: Records, agents: Iterable[AgentHoldings], prefix: str = "") -> list[str]:
    """Every active allocation is held by its agent, no finished one is; an agent holds no
    share (with ``prefix``: of ours) that no allocation records, no MIG instance it made
    without a share holding it, and no MPS daemon serving no share."""
    problems = []
    agents = list(agents)
    held = {a.node: a.shares for a in agents}
    for allocation, node in records.active.items():
        if node in held and allocation not in held[node]:
            problems.append(f"{allocation} is active but {node} does not hold it")
    for allocation, node in records.finished.items():
        if allocation in held.get(node, ()):
            problems.append(f"{allocation} is released but {node} still holds it")
    for agent in agents:
        orphans = {s for s in agent.shares if s.startswith(prefix)} - set(records.active)
        if orphans:
            problems.append(f"{agent.node} holds shares no allocation records: {sorted(orphans)}")
        for uuid, share in agent.owned_mig:
            if share not in agent.shares:
                problems.append(f"{agent.node}: MIG instance {uuid} it made has no owner (share {share!r})")
        for device, shares in agent.mps_daemons:
            if not set(shares) & agent.shares:
                problems.append(f"{agent.node}: MPS daemon on {device} serves no share")
    return problems


def leftovers(agents: Iterable[AgentHoldings]) -> list[str]:
    """What agents still hold once every allocation is released (should be nothing)."""
    left = []
    for agent in agents:
        left += [f"{agent.node}: share {s}" for s in sorted(agent.shares)]
        left += [f"{agent.node}: MPS daemon on {device}" for device, _ in agent.mps_daemons]
        left += [f"{agent.node}: MIG {uuid}" for uuid, _ in agent.owned_mig]
    return left


def p50_p99(latencies: Iterable[float]) -> tuple[float, float]:
    """Median and 99th percentile (nearest rank) of answer latencies; zeros when there are none."""
    ordered = sorted(latencies)
    if not ordered:
        return 0.0, 0.0
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run_problems(observations: int, violations: list[str], unanswered: list[str]) -> list[str]:
    """The verdict of a whole run: something was observed, nothing violated, all answered."""
    problems = [] if observations else ["the observer never saw anything"]
    return problems + violations[:10] + [f"unanswered: {u}" for u in unanswered[:10]]


# -- from an agent's own inventory (what both modes can ask the agents directly) -------------------
def agent_holdings(node: str, inventory: agent_pb2.Inventory) -> AgentHoldings:
    return AgentHoldings(
        node=node, shares=frozenset(s.id for s in inventory.shares),
        owned_mig=tuple((m.uuid, m.share_id) for g in inventory.gpus for m in g.mig_devices
                        if m.created_by_agent),
        mps_daemons=tuple((d.device_uuid, tuple(d.share_ids)) for d in inventory.mps_daemons))


def agent_gpu_loads(node: str, inventory: agent_pb2.Inventory) -> list[GpuLoad]:
    """Per GPU, the sum of what the agent's shares take (shares on a MIG device count in its slice)."""
    loads = []
    for gpu in inventory.gpus:
        on_gpu = [s for s in inventory.shares if gpu.uuid in s.device_uuids]
        whole = [s for s in on_gpu if s.kind == common_pb2.SHARE_KIND_WHOLE]
        fractional = [s for s in on_gpu
                      if s.kind in (common_pb2.SHARE_KIND_FASTPOD, common_pb2.SHARE_KIND_MPS)]
        loads.append(GpuLoad(
            where=f"{node} GPU {gpu.index}", memory_capacity=gpu.memory_bytes,
            sm_percent=sum(s.sm_percent for s in fractional if s.kind == common_pb2.SHARE_KIND_FASTPOD),
            memory_bytes=sum(s.memory_bytes for s in fractional),
            quota_request=sum(s.quota_request for s in fractional),
            mig_slices=tuple((m.start, m.size) for m in gpu.mig_devices),
            whole_holders=len(whole), other_holders=len(fractional) + len(gpu.mig_devices)))
    return loads
