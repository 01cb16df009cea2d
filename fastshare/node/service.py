"""The NodeAgent gRPC surface: authorisation, deadlines, status codes, metrics, proto mapping.

Who may call what:
- unix socket: everything (the socket's file permissions are the access control);
- mTLS TCP port: read-only calls for any client certificate signed by the cluster CA (gRPC
  refuses the handshake without one); calls that change the node only for the controller: a
  certificate with the controller role (see :mod:`fastshare.security.certs`; another node's
  or a user's certificate is refused, whatever it is named), and named in ``allowed_clients``
  when that list is set;
- read-only TCP port (server TLS only, when configured): read-only calls; mutations fail
  with UNAUTHENTICATED.

A call that changes the node and carries a leader term older than one the agent has seen
(a deposed Kubernetes-mode controller's) is refused before it acts: see :mod:`fastshare.node.terms`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from fastshare.node import terms
from fastshare.node.agent import Agent, AgentError, Deadline, Snapshot
from fastshare.node.journal import ShareRow
from fastshare.node.model import Prepared, ShareSpec
from fastshare.security.certs import reissue_command
from fastshare.security.tls import peer_identity
from fastshare.sqlite_file import write_failure
from fastshare.v1 import agent_pb2, agent_pb2_grpc, common_pb2

log = logging.getLogger("fastshare.node")
_MIB = 1 << 20
KIND_TO_PROTO = {"fastpod": common_pb2.SHARE_KIND_FASTPOD, "mps": common_pb2.SHARE_KIND_MPS,
                 "exclusive": common_pb2.SHARE_KIND_EXCLUSIVE, "whole": common_pb2.SHARE_KIND_WHOLE}
PROTO_TO_KIND = {v: k for k, v in KIND_TO_PROTO.items()}
MAX_WATCH_S = 30.0


class Metrics:
    """RPC latency/errors plus gauges computed from the journal at scrape time."""

    def __init__(self, agent: Agent, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.latency = Histogram("fastshare_node_rpc_seconds", "NodeAgent RPC latency", ["method"],
                                 registry=self.registry,
                                 buckets=(.001, .0025, .005, .01, .02, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.errors = Counter("fastshare_node_rpc_errors", "NodeAgent RPCs that failed", ["method", "code"],
                              registry=self.registry)
        self._agent = agent
        self.registry.register(self)

    def collect(self):
        shares = GaugeMetricFamily("fastshare_node_shares", "Shares held on this node", labels=["kind"])
        counts = {k: 0 for k in KIND_TO_PROTO}
        for row in self._agent.journal.shares():
            counts[row.spec.kind] += 1
        for kind, n in counts.items():
            shares.add_metric([kind], n)
        migs = GaugeMetricFamily("fastshare_node_mig_instances", "MIG instances the agent created")
        migs.add_metric([], len(self._agent.journal.migs()))
        daemons = GaugeMetricFamily("fastshare_node_mps_daemons", "MPS control daemons the agent runs")
        daemons.add_metric([], len(self._agent.journal.mps_daemons()))
        gen = GaugeMetricFamily("fastshare_node_inventory_generation", "Inventory generation")
        gen.add_metric([], self._agent.generation)
        return [shares, migs, daemons, gen]


MAX_BATCH = 256   # calls in one PrepareShares / ReleaseShares


REFUSAL_KEY = "fastshare-refusal"   # trailing metadata of a refusal about the GPU (the Refusal's name)


def refusal(exc: Exception) -> int:
    """The proto Refusal of a call that raised ``exc`` (REFUSAL_UNSPECIFIED unless about the GPU)."""
    why = getattr(exc, "refusal", "")
    return agent_pb2.Refusal.Value(f"REFUSAL_{why}") if why else agent_pb2.REFUSAL_UNSPECIFIED


def failure(name: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a call that raised ``exc`` answers with; the agent's own faults are logged."""
    if isinstance(exc, AgentError):
        return getattr(grpc.StatusCode, exc.code), str(exc)
    if isinstance(exc, _Abort):
        return exc.code, exc.message
    if reason := write_failure(exc):
        log.error("%s: %s", name, reason)
        return grpc.StatusCode.UNAVAILABLE, reason
    log.error("%s failed", name, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"{name} failed inside the agent; see its log"


def rpc(mutating: bool) -> Callable:
    """Wrap a servicer method: authorise, bound by a deadline, map errors, record metrics; a
    mutating method replies only once the journal is on disk (see :mod:`fastshare.node.journal`)."""

    def wrap(method: Callable) -> Callable:
        name = method.__name__

        @functools.wraps(method)
        def handler(self: NodeAgentService, request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            code = "OK"
            try:
                remaining = context.time_remaining()
                budget = self.agent.config.rpc_timeout_s
                if remaining is not None:
                    budget = min(budget, remaining)
                deadline = Deadline(budget)
                if not mutating:
                    return method(self, request, context, deadline)
                self._authorise(context, name)
                # a call of a deposed leader's term is refused before it acts (see terms)
                with self.terms.hold(terms.parse(_metadata(context, terms.METADATA_KEY)), deadline):
                    reply = method(self, request, context, deadline)
                # acknowledged => on disk (one fdatasync shared by concurrent RPCs)
                self.agent.journal.sync()
                return reply
            except Exception as exc:
                status, message = failure(name, exc)
                code = status.name
                if isinstance(exc, terms.StaleTerm):
                    context.set_trailing_metadata(((terms.SEEN_KEY, str(exc.seen)),))
                elif why := refusal(exc):
                    context.set_trailing_metadata(((REFUSAL_KEY, agent_pb2.Refusal.Name(why)),))
                context.abort(status, message)
            finally:
                self.metrics.latency.labels(name).observe(time.perf_counter() - started)
                if code != "OK":
                    self.metrics.errors.labels(name, code).inc()

        return handler

    return wrap


def _metadata(context: grpc.ServicerContext, key: str) -> list[str]:
    return [value for k, value in context.invocation_metadata() or () if k == key]


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class NodeAgentService(agent_pb2_grpc.NodeAgentServicer):
    def __init__(self, agent: Agent, metrics: Metrics) -> None:
        self.agent = agent
        self.metrics = metrics
        self.terms = terms.LeaderTerms(agent.journal)
        # A waiting Watch holds a worker thread (up to MAX_WATCH_S), and the read-only port takes
        # it from anyone: without a bound, waits could take every worker, the controller's calls
        # and the unix socket's included.
        self.max_watch_waits = max(1, agent.config.max_workers // 2)
        self._watch_slots = threading.BoundedSemaphore(self.max_watch_waits)

    def _authorise(self, context: grpc.ServicerContext, method: str) -> None:
        if context.peer().startswith("unix:"):
            return
        peer = peer_identity(context)
        if peer is None:
            raise _Abort(grpc.StatusCode.UNAUTHENTICATED,
                         f"{method} changes the node: it needs a client certificate signed by the cluster "
                         "CA (mTLS port) or the local unix socket")
        if peer.role != "controller":
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"{method} changes the node: over TCP only the controller may call it, and "
                         f"{peer.common_name!r} presents a certificate with {peer.describe_role()}; if "
                         "it is the controller, re-issue its certificate with "
                         f"`{reissue_command('controller', peer.common_name)}`, else use the local unix "
                         "socket")
        allowed = set(self.agent.config.allowed_clients)
        if allowed and not (peer.names() & allowed):
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"client {peer.common_name!r} may not call {method} (not in allowed_clients)")

    @rpc(mutating=False)
    def Ping(self, request, context, deadline):
        return common_pb2.Empty()

    @rpc(mutating=False)
    def GetInventory(self, request, context, deadline):
        return inventory_proto(self.agent.snapshot())

    @rpc(mutating=False)
    def Watch(self, request, context, deadline):
        wait = min(request.wait_ms / 1000.0, MAX_WATCH_S, deadline.remaining())
        boot_changed = bool(request.boot_id) and request.boot_id != self.agent.boot_id
        generation = self.agent.generation
        if not boot_changed and generation == request.since_generation and wait > 0:
            if not self._watch_slots.acquire(blocking=False):
                raise AgentError("RESOURCE_EXHAUSTED",
                                 f"{self.max_watch_waits} Watch calls are waiting for a change, as many as "
                                 "this agent lets wait at once; retry later, or with wait_ms 0")
            try:
                # a caller that cancels or times out leaves at once, and so frees its slot
                context.add_callback(self.agent.wake)
                generation = self.agent.wait_for_change(request.since_generation, wait,
                                                        gone=lambda: not context.is_active())
            finally:
                self._watch_slots.release()
        if boot_changed or generation != request.since_generation:
            snap = self.agent.snapshot()
            return agent_pb2.WatchReply(changed=True, inventory=inventory_proto(snap),
                                        generation=snap.generation, boot_id=snap.boot_id)
        return agent_pb2.WatchReply(changed=False, generation=generation, boot_id=self.agent.boot_id)

    def _prepare(self, request: agent_pb2.PrepareShareRequest,
                 deadline: Deadline) -> agent_pb2.PrepareShareReply:
        if not request.HasField("share"):
            raise AgentError("INVALID_ARGUMENT", "share is required")
        spec = spec_from_proto(request.share)
        prepared, created = self.agent.prepare(spec, deadline)
        return prepared_proto(spec, prepared, created)

    def _release(self, request: agent_pb2.ReleaseShareRequest,
                 deadline: Deadline) -> agent_pb2.ReleaseShareReply:
        result = self.agent.release(request.share_id, deadline)
        return agent_pb2.ReleaseShareReply(released=result.released,
                                           destroyed_mig_devices=result.destroyed_mig_devices,
                                           stopped_mps_daemons=result.stopped_mps_daemons)

    def _each(self, name: str, calls: Any, do: Callable, result_type: type, deadline: Deadline) -> list:
        """Run a batch's calls in order; each gets the result or the error it would have had alone.
        (The wrapper's one journal sync then covers them all.)"""
        if len(calls) > MAX_BATCH:
            raise AgentError("INVALID_ARGUMENT", f"calls: at most {MAX_BATCH} in one batch, got {len(calls)}")
        results = []
        for call in calls:
            try:
                results.append(result_type(reply=do(call, deadline)))
            except Exception as exc:
                status, message = failure(name, exc)
                self.metrics.errors.labels(name, status.name).inc()
                status_pb = agent_pb2.CallStatus(code=status.value[0], message=message, refusal=refusal(exc))
                results.append(result_type(status=status_pb))
        return results

    @rpc(mutating=True)
    def PrepareShare(self, request, context, deadline):
        return self._prepare(request, deadline)

    @rpc(mutating=True)
    def ReleaseShare(self, request, context, deadline):
        return self._release(request, deadline)

    @rpc(mutating=True)
    def PrepareShares(self, request, context, deadline):
        return agent_pb2.PrepareSharesReply(results=self._each(
            "PrepareShare", request.calls, self._prepare, agent_pb2.PrepareSharesReply.Result, deadline))

    @rpc(mutating=True)
    def ReleaseShares(self, request, context, deadline):
        return agent_pb2.ReleaseSharesReply(results=self._each(
            "ReleaseShare", request.calls, self._release, agent_pb2.ReleaseSharesReply.Result, deadline))

    @rpc(mutating=True)
    def SetMigMode(self, request, context, deadline):
        pending, changed, actions = self.agent.set_mig_mode(request.gpu_uuid, request.enabled, deadline,
                                                            request.force, request.destroy_instances)
        return agent_pb2.SetMigModeReply(pending=pending, changed=changed,
                                         actions=[agent_pb2.MigAction(**a) for a in actions])

    @rpc(mutating=False)
    def PlanMigLayout(self, request, context, deadline):
        return self._layout(request, deadline, apply=False)

    @rpc(mutating=True)
    def ApplyMigLayout(self, request, context, deadline):
        return self._layout(request, deadline, apply=True)

    def _layout(self, request, deadline: Deadline, apply: bool):
        from fastshare.node.layout import apply_layout  # needs the device helper's mig_layout

        actions, changed = apply_layout(self.agent, request.gpu_uuid, dict(request.profiles),
                                        request.force, apply, deadline)
        snap_gpu = next(g for g in self.agent.refresh_devices() if g.uuid == request.gpu_uuid)
        migs = {(m.gpu_uuid, m.start): m for m in self.agent.journal.migs(request.gpu_uuid)}
        shares = {r.device_uuid: r.spec.id for r in self.agent.journal.shares() if r.spec.kind == "exclusive"}
        return agent_pb2.MigLayoutReply(
            actions=[agent_pb2.MigAction(**a) for a in actions], changed=changed,
            mig_devices=[_mig_proto(m, migs, shares) for m in snap_gpu.mig_instances])


# --- proto mapping ---------------------------------------------------------------------------

def spec_from_proto(share: agent_pb2.Share) -> ShareSpec:
    kind = PROTO_TO_KIND.get(share.kind)
    if kind is None:
        raise AgentError("INVALID_ARGUMENT", "share.kind must be one of FASTPOD, MPS, EXCLUSIVE, WHOLE")
    return ShareSpec(id=share.id, kind=kind, device_uuids=tuple(share.device_uuids),
                     mig_profile=share.mig_profile,
                     mig_start=share.mig_start if share.HasField("mig_start") else None,
                     sm_percent=share.sm_percent, memory_bytes=share.memory_bytes,
                     quota_request=share.quota_request, quota_limit=share.quota_limit, owner=share.owner,
                     idempotency_key=share.idempotency_key, lease_ttl_seconds=share.lease_ttl_seconds)


def share_proto(spec: ShareSpec, prepared: Prepared | None = None) -> agent_pb2.Share:
    share = agent_pb2.Share(id=spec.id, kind=KIND_TO_PROTO[spec.kind], device_uuids=spec.device_uuids,
                            mig_profile=spec.mig_profile, sm_percent=spec.sm_percent,
                            memory_bytes=spec.memory_bytes, quota_request=spec.quota_request,
                            quota_limit=spec.quota_limit, owner=spec.owner,
                            idempotency_key=spec.idempotency_key, lease_ttl_seconds=spec.lease_ttl_seconds)
    start = prepared.mig_start if prepared and prepared.mig_start is not None else spec.mig_start
    if start is not None:
        share.mig_start = start
    return share


def prepared_proto(spec: ShareSpec, prepared: Prepared, created: bool) -> agent_pb2.PrepareShareReply:
    return agent_pb2.PrepareShareReply(share=share_proto(spec, prepared), env=prepared.env,
                                       host_paths=prepared.host_paths, device_uuids=prepared.device_uuids,
                                       created=created, port=prepared.port)


def _mig_proto(m, agent_migs: dict, share_of_device: dict[str, str]) -> agent_pb2.MigDevice:
    return agent_pb2.MigDevice(gpu_uuid=m.gpu_uuid, uuid=m.uuid or "", profile_id=m.profile_id,
                               profile_name=m.profile_name, start=m.start, size=m.size, sm_count=m.sm_count,
                               memory_bytes=m.memory_mib * _MIB, processes=m.processes,
                               created_by_agent=(m.gpu_uuid, m.start) in agent_migs,
                               share_id=share_of_device.get(m.uuid or "", ""), gi_id=m.gi_id, ci_id=m.ci_id)


def inventory_proto(snap: Snapshot) -> agent_pb2.Inventory:
    gpus = []
    for g in snap.gpus:
        gpus.append(agent_pb2.Gpu(
            index=g.index, uuid=g.uuid, name=g.name, memory_bytes=g.memory_mib * _MIB, sm_count=g.sm_count,
            pci_bus_id=g.pci_bus_id, mig_capable=g.mig_capable, mig_enabled=g.mig_current,
            mig_pending=g.mig_pending, compute_mode=g.compute_mode, processes=g.processes, lost=g.lost,
            pci_device_id=g.pci_device_id,
            mig_devices=[_mig_proto(m, snap.agent_migs, snap.share_of_device) for m in g.mig_instances],
            mig_profiles=[agent_pb2.MigProfileInfo(
                profile_id=p.profile_id, name=p.name, slices=p.slices, memory_slices=p.memory_slices,
                memory_bytes=p.memory_mib * _MIB, sm_count=p.sm_count, placements=p.placements,
                max_instances=p.max_instances)
                for p in snap.profiles.get(g.uuid, [])]))
    return agent_pb2.Inventory(
        node_name=snap.node_name, agent_version=snap.agent_version, driver_version=snap.driver_version,
        generation=snap.generation, boot_id=snap.boot_id, gpus=gpus,
        mps_daemons=[agent_pb2.MpsDaemon(device_uuid=row.device_uuid, pipe_dir=pipe, log_dir=logd,
                                         pid=row.pid or 0, share_ids=ids, healthy=healthy)
                     for row, pipe, logd, ids, healthy in snap.mps_daemons],
        shares=[_share_in_inventory(r) for r in snap.shares if r.state == "ready"],
        lost_shares=[agent_pb2.LostShare(id=x.id, device_uuid=x.device_uuid, reason=x.reason, owner=x.owner)
                     for x in snap.lost_shares],
        share_files=[agent_pb2.ShareFile(device_uuid=d, config_path=c, port_path=p, entries=n)
                     for d, c, p, n in snap.share_files],
        links=[agent_pb2.GpuLink(gpu_a=a, gpu_b=b, level=level) for a, b, level in snap.links],
        mps_unavailable=snap.mps_unavailable, mps_memory_oversubscription=snap.mps_memory_oversubscription)


def _share_in_inventory(row: ShareRow) -> agent_pb2.Share:
    return share_proto(row.spec, row.prepared)
