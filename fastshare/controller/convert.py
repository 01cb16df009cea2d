"""Protobuf <-> records, and the cluster status view (usage per GPU from the allocations)."""

from __future__ import annotations

from collections.abc import Mapping

from fastshare.controller.model import HOLDING, Allocation, Device, Kind, Node, Spec, State
from fastshare.device import catalog
from fastshare.v1 import common_pb2
from fastshare.v1 import controller_pb2 as pb

_KIND_FROM_PB = {common_pb2.SHARE_KIND_FASTPOD: Kind.FASTPOD, common_pb2.SHARE_KIND_MPS: Kind.MPS,
                 common_pb2.SHARE_KIND_EXCLUSIVE: Kind.EXCLUSIVE, common_pb2.SHARE_KIND_WHOLE: Kind.WHOLE}
_KIND_TO_PB = {v: k for k, v in _KIND_FROM_PB.items()}
_STATE_TO_PB = {s: pb.AllocationState.Value(f"ALLOCATION_STATE_{s.name}") for s in State}
MiB = 1024**2


def spec_from_pb(msg: pb.AllocationSpec) -> Spec:
    """Decode; an unknown kind stays a plain int so validation can name the field."""
    return Spec(kind=_KIND_FROM_PB.get(msg.kind, msg.kind), sm_percent=msg.sm_percent,
                memory_bytes=msg.memory_bytes, quota_request=msg.quota_request,
                quota_limit=msg.quota_limit, mig_profile=msg.mig_profile, sm_count=msg.sm_count,
                gpu_count=msg.gpu_count, models=tuple(msg.models),
                node_selector=tuple(sorted(msg.node_selector.items())), affinity=msg.affinity,
                anti_affinity=msg.anti_affinity, exclusion=msg.exclusion)


def spec_to_pb(spec: Spec) -> pb.AllocationSpec:
    return pb.AllocationSpec(kind=_KIND_TO_PB[spec.kind], sm_percent=spec.sm_percent,
                             memory_bytes=spec.memory_bytes, quota_request=spec.quota_request,
                             quota_limit=spec.quota_limit, mig_profile=spec.mig_profile,
                             sm_count=spec.sm_count, gpu_count=spec.gpu_count, models=list(spec.models),
                             node_selector=dict(spec.node_selector), affinity=spec.affinity,
                             anti_affinity=spec.anti_affinity, exclusion=spec.exclusion)


def device_to_pb(d: Device) -> pb.AssignedDevice:
    return pb.AssignedDevice(**d.to_json())


def allocation_to_pb(a: Allocation, node_available: bool = True) -> pb.Allocation:
    return pb.Allocation(id=a.id, spec=spec_to_pb(a.spec), owner=a.owner, idempotency_key=a.idempotency_key,
                         state=_STATE_TO_PB[a.state], node=a.node,
                         devices=[device_to_pb(d) for d in a.devices],
                         env=a.env, reason=a.reason, created_at=a.created_at, updated_at=a.updated_at,
                         lease_expires_at=a.lease_expires_at, node_available=node_available)


def _memory_slices(model: str) -> int:
    known = catalog.find_model(model)
    return known.memory_slices if known and known.mig_capable else 0


def cluster_status(nodes: list[Node], allocations: list[Allocation],
                   over: Mapping[str, str] | None = None) -> pb.ClusterStatus:
    """Per-GPU usage computed from the allocations that hold capacity (the state of record).
    ``over``: allocation id -> why its GPU no longer takes it (``Ledger.overcommitted``); the
    GPUs such an allocation holds are marked over-committed, with the why."""
    out = pb.ClusterStatus()
    # a GPU by UUID: its index shifts when another GPU leaves the node, and the allocation's
    # record may not say the new one yet (by index only where a record names no UUID)
    usage: dict[tuple[str, int | str], pb.GpuUsage] = {}
    available = {n.name: n.available for n in nodes}
    # over-committed GPUs: why, per allocation
    whys: dict[tuple[str, int], tuple[pb.GpuUsage, list[str]]] = {}
    for n in nodes:
        ns = out.nodes.add(name=n.name, address=n.address, available=n.available,
                           last_heartbeat=n.last_heartbeat, labels=n.labels, cordoned=n.cordoned,
                           cordon_reason=n.cordon_reason,
                           mps_unavailable=n.inventory.get("mps_unavailable", ""))
        for g in n.gpus:
            usage[(n.name, g.uuid)] = usage[(n.name, g.index)] = ns.gpus.add(
                index=g.index, uuid=g.uuid, model=g.model, memory_bytes=g.memory_bytes, sm_count=g.sm_count,
                mig_enabled=g.mig_enabled, memory_slices=_memory_slices(g.model) if g.mig_capable else 0,
                lost=g.lost, mig_change_pending=g.mig_change_pending)
    for a in allocations:
        out.allocations.append(allocation_to_pb(a, available.get(a.node, False)))
        if a.state not in HOLDING:
            continue
        for d in a.devices:
            gpu = usage.get((a.node, d.gpu_uuid or d.gpu_index))
            if gpu is None:
                continue
            gpu.allocation_ids.append(a.id)
            if over and a.id in over:
                whys.setdefault((a.node, gpu.index), (gpu, []))[1].append(over[a.id])
            if a.spec.kind is Kind.FASTPOD:
                gpu.sm_percent_used += a.spec.sm_percent
                gpu.memory_bytes_used += a.spec.memory_bytes
                gpu.quota_request_used += a.spec.quota_request or 1.0
            elif a.spec.kind is Kind.MPS:
                gpu.memory_bytes_used += a.spec.memory_bytes
            elif a.spec.kind is Kind.EXCLUSIVE:
                gpu.mig_slices.append(device_to_pb(d))
                mig = a.assignment.get("mig") or {}
                gpu.memory_bytes_used += int(mig.get("memory_mib", 0)) * MiB
            else:
                gpu.whole_held = True
                gpu.memory_bytes_used = gpu.memory_bytes
                gpu.sm_percent_used = 100
    for gpu, said in whys.values():   # short: the first allocation's why, and how many more there are
        gpu.over_committed = True
        more = f" (and {len(said) - 1} more allocation(s))" if len(said) > 1 else ""
        gpu.over_commit_reason = said[0] + more
    return out
