"""The in-cluster controller: FastPods in, replica Pods holding GPU shares out.

It is the standalone controller's core (validation, engine ledger, agent client, reconciler)
over :class:`KubeStateStore`, so each allocation is recorded (one FastShareAllocation object per
replica) before any agent is asked to prepare it. What is Kubernetes-specific lives here:

- agents are found through Node objects labelled ``<gpu label>=true`` (endpoint annotation
  ``fastshare.io/agent-endpoint``, else InternalIP:agent port) and pinged as heartbeats;
- one FastPod is reconciled by one worker at a time (its missing replicas are allocated and
  created in parallel batches, its status written once per pass): holding allocations whose Pod is gone
  are released (Pod deleted behind our back, crash between allocation and Pod creation,
  scale-down finished), Pods without a holding allocation are deleted, missing replicas are
  allocated and then created (a failed create releases the allocation again), surplus ones
  deleted; the share of a deleted Pod is released only once the Pod is really gone;
- replicas go only where their Pod fits as the kubelet and the kube-scheduler would check it
  (fastshare binds them itself): the nodes' allocatable CPU/memory minus what every bound Pod
  requests (a cluster-wide watch, see nodeusage), the same for extended resources, hugepages
  and ephemeral storage, required node affinity, taints, cordons (see scheduling), required
  inter-pod (anti-)affinity, also an existing Pod's against the replica, and topology spread
  (see podaffinity), and host ports against those bound Pods take (replicas with inter-pod
  rules or host ports are placed one at a time and alone, each seeing the ones before, see
  PlacementLock); a template with ResourceClaims is refused (nothing would allocate them);
- a finalizer keeps a deleted FastPod until every share is released;
- on start (and on every leadership change) it rebuilds its view from FastPods, their Pods
  and the agents; it never deletes and re-creates a running Pod to change it (a template edit
  goes to new replicas only; the status counts the outdated ones, see pods.template_hash).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import datetime
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kubernetes import client

from fastshare.controller.agent_client import AgentError, AgentPool
from fastshare.controller.core import AgentFailed, Busy, ControllerCore, KeyConflict, NodeInUse, Rejected
from fastshare.controller.core import Settings as CoreSettings
from fastshare.controller.model import FINISHED, HOLDING, Allocation, Node, Spec, State
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.store import Conflict
from fastshare.controller.validation import Request, ValidationError
from fastshare.k8s.fenced_agents import FencedAgents
from fastshare.k8s.leader import Deposed, Fence, LeaderElector
from fastshare.k8s.listwatch import ListWatch, pages, raw
from fastshare.k8s.nodecache import NodeCache
from fastshare.k8s.nodeusage import FIELD_SELECTOR, NodeUsage, extended_used, host_left, pods_left
from fastshare.k8s.peers import PodPeers
from fastshare.k8s.podaffinity import (
    Incoming,
    Peer,
    needs_namespaces,
    peer,
    replica_incoming,
    ruled_out,
)
from fastshare.k8s.podcache import PodCache, pod_key
from fastshare.k8s.pods import (
    FASTPOD_LABEL,
    MPS_PATH_ENV,
    TEMPLATE_SPEC,
    fastpod_field,
    is_outdated,
    is_ready,
    is_terminated,
    replica_constraints,
    replica_host_ports,
    replica_pod,
    spec_of,
    template_hash,
)
from fastshare.k8s.resources import FINALIZER, GROUP, PLURAL, VERSION, clip
from fastshare.k8s.scheduling import (
    Demand,
    HostPort,
    MiB,
    NodeFacts,
    TemplateError,
    node_facts,
    pod_demand,
    pod_running_demand,
    port_taken,
    running_host_ports,
)
from fastshare.k8s.store import KubeStateStore, replica_key, summary
from fastshare.k8s.workqueue import WorkQueue
from fastshare.server_runtime import collection_paused

log = logging.getLogger("fastshare.k8s.controller")

ENDPOINT_ANNOTATION = "fastshare.io/agent-endpoint"
# A FastPod's status.assignments lists at most this many replicas, of at most this much JSON (the
# CRD's maxItems): each costs ~185 bytes (~300 with MIG) plus ~120 of managedFields, and etcd
# stores at most 1.5 MiB per object, so listing every replica of a FastPod of some 5,000 made
# each status write fail. The rest are counted (status.assignmentsOmitted); each replica's
# FastShareAllocation object shows the same summary.
ASSIGNMENTS_LISTED = 1000
ASSIGNMENTS_BYTES = 256 * 1024

# Agents pinged at once by the Node sync: each one that does not answer holds a thread for a
# deadline, so the others' pings (their heartbeats) still go out while some hang.
PING_THREADS = 32


@dataclass(frozen=True)
class KubeSettings:
    gpu_node_label: str = "fastshare.io/gpu"
    agent_port: int = 7444
    workers: int = 4
    create_parallelism: int = 16    # replicas of one FastPod allocated and created at once (at most)
    node_interval: float = 2.0      # Node listing + agent pings (heartbeats)
    resync_interval: float = 30.0   # every FastPod reconciled at least this often
    watch_timeout: int = 30         # seconds a watch request stays open before it is renewed
    namespace: str | None = None    # serve one namespace only (None: every namespace)
    # Pods per page of the listing of every bound Pod (node usage): one page is held at a time,
    # not every Pod of the cluster as JSON at once
    list_page: int = 500


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_message(exc: client.ApiException) -> str:
    """The API server's own explanation (it names the field of a refused object)."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.body or "")[:500]


def _lost_race(exc: Exception) -> bool:
    """A compare-and-set lost to another writer (409 Conflict): retried, not an error."""
    return isinstance(exc, Conflict) or (isinstance(exc, client.ApiException) and exc.status == 409)


def _meta(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["metadata"]


def listed_assignments(entries: list[dict[str, Any]], ready: set[str]) -> tuple[list[dict[str, Any]], int]:
    """The ``status.assignments`` to write, by pod name, and how many replicas it leaves out:
    every one, unless that passes ASSIGNMENTS_LISTED items or ASSIGNMENTS_BYTES of JSON; then
    those worth a look go first (their share not active, a reason given, or their Pod not
    ``ready``)."""
    def fine(entry: dict[str, Any]) -> bool:
        return entry["state"] == State.ACTIVE.value and "reason" not in entry and entry["pod"] in ready

    listed: list[dict[str, Any]] = []
    size = 0
    for entry in sorted(entries, key=lambda e: (fine(e), e["pod"])):
        size += len(json.dumps(entry).encode()) + 2
        if len(listed) == ASSIGNMENTS_LISTED or size > ASSIGNMENTS_BYTES:
            break
        listed.append(entry)
    return sorted(listed, key=lambda e: e["pod"]), len(entries) - len(listed)


def selector_string(selector: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        op, key, values = expr["operator"], expr["key"], ",".join(expr.get("values") or [])
        parts.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})",
                      "Exists": key, "DoesNotExist": f"!{key}"}[op])
    return ",".join(parts)


class PlacementLock:
    """Replicas without inter-pod rules or host ports of their own are placed under it shared
    (many at once), replicas with such rules or ports alone (exclusive, and a waiting exclusive
    goes before new shared ones): a placement never runs beside one whose new Pod its rules or
    ports, or an existing Pod's anti-affinity, would have to see. Each holder reads the Pods
    around it after it got the lock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._alone = False
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._alone and not self._shared)
            self._waiting -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()


def _pooled(api: client.ApiClient, connections: int) -> client.ApiClient:
    """``api``, or a client with its configuration and a pool of ``connections``: when more
    threads talk at once than the pool holds (default 5 per CPU), connections are thrown away and
    every new one costs a TLS handshake on both sides, which under load was most of the API
    server's CPU."""
    if (api.configuration.connection_pool_maxsize or 0) >= connections:
        return api
    configuration = copy.deepcopy(api.configuration)
    configuration.connection_pool_maxsize = connections
    return client.ApiClient(configuration)


class KubeController:
    """Watches, a work queue with workers, node sync and the core's reconciler; start()/stop().

    ``elector``: the leader election; every API write and every agent call that changes a GPU
    checks first that this process still holds the Lease (see Fence), and a pass that finds it
    does not stops there (nothing requeued: the next leader rebuilds). Agent calls carry the
    leader term, so an agent that has seen a newer leader's refuses one that arrives late.
    None: no election (always leading, no term sent)."""

    def __init__(self, api: client.ApiClient, agents: AgentPool, settings: KubeSettings | None = None,
                 core_settings: CoreSettings | None = None,
                 elector: LeaderElector | None = None) -> None:
        self.settings = settings or KubeSettings()
        self.fence = Fence(elector)
        # workers + replica creators + two watches + node sync + reconcile + one spare (the pings
        # read and write nodes in the store's memory; a registration's queue_all runs in the sync)
        pooled = _pooled(api, self.settings.workers + self.settings.create_parallelism + 5)
        self._own_api = pooled is not api
        self.api = api = pooled
        self.store = KubeStateStore(api, self.settings.namespace, fence=self.fence)
        self.core = ControllerCore(self.store, FencedAgents(agents, self.fence),
                                   core_settings or CoreSettings())
        self.reconciler = Reconciler(self.core)
        self.pods = client.CoreV1Api(api)
        self.objects = client.CustomObjectsApi(api)
        self.queue = WorkQueue()
        # FastPod uid -> generation whose Pod dry-ran fine, and that Pod's request as admitted
        # (with the namespace's LimitRange defaults and the RuntimeClass overhead)
        self._templates_ok: dict[str, tuple[int, Demand]] = {}
        # FastPod uid -> (passes that found replica Pods terminated since all its replicas were last
        # ready, no replacement before this monotonic time, why the last one ended)
        self._ended: dict[str, tuple[int, float, str]] = {}
        self.podcache = PodCache()
        self.usage = NodeUsage()                   # what bound Pods request, per node
        self.peers = PodPeers()                    # the same Pods' labels, for inter-pod rules
        self.nodecache = NodeCache()               # every Node object: the GPU ones' sync, topology domains
        # every replica is placed and created under it: one with inter-pod rules or host ports alone
        self._placing = PlacementLock()
        # replicas placed that ask what the engine does not count (extended resources, hugepages,
        # ephemeral storage): allocation id -> (node, request) until the node watch shows the Pod
        self._unseen_extended: dict[str, tuple[str, Demand]] = {}
        self._extended_lock = threading.Lock()
        self._nodes: dict[str, NodeFacts] = {}     # GPU nodes as their Node objects say
        self._pings = concurrent.futures.ThreadPoolExecutor(PING_THREADS, thread_name_prefix="ping")
        self._pinging: set[str] = set()            # nodes whose ping (or registration) is out
        self._pinging_lock = threading.Lock()
        self._capacity_appeared = threading.Event()   # an agent registered since the last sync
        self._pool = concurrent.futures.ThreadPoolExecutor(self.settings.create_parallelism,
                                                           thread_name_prefix="replica")
        self._stop = threading.Event()
        self._listwatch = ListWatch(self._stop, self.settings.watch_timeout)
        self._threads: list[threading.Thread] = []

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Rebuild from the cluster (nodes, agents, allocation records), then watch and work."""
        # Watch threads are not joined on stop: they block in a read for up to watch_timeout and
        # then see the stop flag; until then their events go to the closed queue and are dropped.
        threading.Thread(target=self._watch_nodes, name="watch-nodes", daemon=True).start()
        self.nodecache.wait_synced(30.0)   # its listing is the first sync's (else one of its own)
        self._sync_from_watch()
        report = self.reconciler.start()
        log.info("state rebuilt from the cluster: %s", report)
        for name, target in (("watch-fastpods", self._watch_fastpods), ("watch-pods", self._watch_pods),
                             ("watch-node-pods", self._watch_node_pods)):
            threading.Thread(target=target, name=name, daemon=True).start()
        # passes wait for them anyway (reconcile requeues)
        if not (self.podcache.wait_synced(60.0) and self.usage.wait_synced(60.0)
                and self.peers.wait_synced(1.0)):
            log.warning("no Pod listing after 60 s; FastPods wait until it arrives")
        self.refresh_host()
        self._spawn("node-sync", self._sync_nodes_periodically)
        self._spawn("reconcile", self._reconcile_periodically)
        for i in range(self.settings.workers):
            self._spawn(f"worker-{i}", self._worker)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.queue.close()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pings.shutdown(wait=False, cancel_futures=True)
        if self._own_api:
            self.api.close()

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- nodes and agents --------------------------------------------------------------------------
    def _endpoint(self, node: Mapping[str, Any]) -> str | None:
        annotated = ((node.get("metadata") or {}).get("annotations") or {}).get(ENDPOINT_ANNOTATION)
        if annotated:
            return annotated
        for address in (node.get("status") or {}).get("addresses") or []:
            if address.get("type") == "InternalIP":
                return f"{address.get('address')}:{self.settings.agent_port}"
        return None

    def _all_nodes(self) -> Iterable[dict[str, Any]]:
        """Every Node object: the watch's (``nodecache``), or read now until its first listing
        has arrived."""
        return self.nodecache.nodes() if self.nodecache.synced else self._listed(self.pods.list_node)

    def _gpu_nodes(self, nodes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        label = self.settings.gpu_node_label
        return [node for node in nodes if (node["metadata"].get("labels") or {}).get(label) == "true"]

    def sync_nodes(self) -> None:
        """A Node sync from the Nodes read now (a test that has just changed one); the start and
        the periodic syncs read the watch's."""
        self._sync(self._gpu_nodes(self._listed(self.pods.list_node)))

    def _sync(self, listed: list[dict[str, Any]]) -> None:
        """Register new agents, heartbeat reachable ones; silent ones go unavailable on timeout.

        Each agent is pinged in a thread of its own, and the sync waits for the answers for half
        the heartbeat timeout at most: an agent that does not answer holds its ping a whole
        deadline, and while the sync waited for it, the agents pinged before it were judged
        after that wait, past their timeout, and taken for unavailable. A node's next ping goes
        out only once its last one has ended."""
        self._nodes = {node["metadata"]["name"]: node_facts(node) for node in listed}
        sent = []
        for node in listed:
            name, address = node["metadata"]["name"], self._endpoint(node)
            if address is not None and self._claim_ping(name):
                sent.append(self._ping(name, address, dict(node["metadata"].get("labels") or {})))
        concurrent.futures.wait(sent, timeout=self.core.settings.heartbeat_timeout / 2)
        if self._capacity_appeared.is_set():
            self._capacity_appeared.clear()
            self.queue_all()  # retry unschedulable FastPods
        self.core.check_liveness()
        self.refresh_host()
        self._forget_deleted_nodes()

    def _claim_ping(self, name: str) -> bool:
        """False while the node's last ping (or look before forgetting it) is still out."""
        with self._pinging_lock:
            if name in self._pinging:
                return False
            self._pinging.add(name)
            return True

    def _ping_done(self, name: str) -> None:
        with self._pinging_lock:
            self._pinging.discard(name)

    def _ping(self, name: str, address: str, labels: dict[str, str]) -> concurrent.futures.Future:
        """The node's heartbeat; done once judged. A known agent is pinged with no thread waiting
        for it: with a pool thread per ping, PING_THREADS hung agents (a rack cut off) held every
        thread a deadline and the other nodes' pings queued behind them, past their heartbeat
        timeout. A new or relabelled node registers, and an agent whose certificate must be
        looked at first is pinged, in a pool thread."""
        judged: concurrent.futures.Future = concurrent.futures.Future()

        def answered(error: AgentError | None) -> None:
            self._pinged(name, address, labels, error, judged)

        try:
            if (self._known(self.store.get_node(name), address, labels)
                    and self.core.agents.get(name, address).ping_unwaited(answered)):
                return judged
            return self._pings.submit(self._ping_or_register, name, address, labels)
        except Exception:   # e.g. the pool stopped: the node must not stay claimed for good
            log.exception("node %s: its ping could not be sent; the next sync tries again", name)
            self._ping_done(name)
            judged.set_result(None)
            return judged

    @staticmethod
    def _known(stored: Node | None, address: str, labels: dict[str, str]) -> bool:
        """Registered as it is: relabelled, it registers again (the engine matches nodeSelector
        against the labels it was given, the kubelet against the Node's own, and refuses a Pod
        they miss)."""
        return stored is not None and stored.address == address and stored.labels == labels

    def _pinged(self, name: str, address: str, labels: dict[str, str], error: AgentError | None,
                judged: concurrent.futures.Future) -> None:
        """A ping's answer (in a gRPC thread: only the heartbeat here, which is in memory)."""
        try:
            if error is None and not self.core.heartbeat(name):
                registered = self._pings.submit(self._ping_or_register, name, address, labels)
                registered.add_done_callback(lambda _: judged.set_result(None))
                return
            if error is not None:
                log.info("node agent %s at %s unreachable: %s", name, address, error.details)
            self._ping_done(name)
        except Exception:
            log.exception("node %s: its heartbeat failed; the next sync tries again", name)
            self._ping_done(name)
        judged.set_result(None)

    def _ping_or_register(self, name: str, address: str, labels: dict[str, str]) -> None:
        try:
            stored = self.store.get_node(name)
            known = self._known(stored, address, labels)
            try:
                if known:  # the ping is the heartbeat: it counts only once the agent answered
                    self.core.agents.get(name, address).ping()
                if not known or not self.core.heartbeat(name):
                    self.core.register_node(name, address, labels)
                    self._capacity_appeared.set()
            except AgentError as exc:
                if stored is None:
                    self.core.put_node(Node(name=name, address=address, labels=labels, available=False))
                log.info("node agent %s at %s unreachable: %s", name, address, exc.details)
        except Deposed:
            pass   # the fence logged it; the election stops this controller
        except Exception:
            log.exception("node %s: its ping or registration failed; the next sync tries again", name)
        finally:
            self._ping_done(name)

    def _forget_deleted_nodes(self, also: Iterable[str] = ()) -> None:
        """Forget the nodes whose Node object is gone (decommissioned, scaled down) and whose agent
        does not answer: their shares end without asking it (ControllerCore.forget_node), as the
        Pod GC deletes the Pods bound to such a Node. Otherwise a share there could only be
        released through that agent: it stayed ``releasing`` for good, retried every pass, and
        its FastPod's finalizer (and a namespace deletion) waited for it. ``also``: nodes of
        allocation records that this process does not know (after a restart). A node only
        stripped of its GPU label, or whose agent still answers, is kept.

        Each is looked at in a ping thread, not waited for: an agent whose host hangs holds its
        ping a whole deadline, and the sync that pinged them itself held every node's heartbeat
        as long."""
        known = {node.name: node for node in self.store.list_nodes()}
        for name in sorted((set(known) | set(also)) - set(self._nodes)):
            # not missed its heartbeats yet, or looked at already
            if not self.core.is_available(name) and self._claim_ping(name):
                try:
                    self._pings.submit(self._forget_if_deleted, name, known.get(name))
                except RuntimeError:   # stopping: the pool takes no more
                    self._ping_done(name)

    def _forget_if_deleted(self, name: str, stored: Node | None) -> None:
        try:
            if self.pods.list_node(field_selector=f"metadata.name={name}").items:
                return   # the Node is there, only not (or no longer) labelled
            if stored is not None:
                with contextlib.suppress(AgentError):
                    self.core.agents.get(name, stored.address).ping()
                    return   # the machine still runs: its agent releases what it holds
            if self._stop.is_set():
                return   # the ping outlived the controller (its stop does not wait for pings)
            if stored is None:
                self.core.put_node(Node(name=name, address="", available=False))
            ended = self.core.forget_node(name, "its Node object was deleted and its agent does not answer",
                                          by="the controller")
            for key in sorted({tuple(a.owner.split("/", 1)) for a in ended if "/" in a.owner}):
                self.queue.add(key)
        except Deposed:
            pass   # the fence logged it; the election stops this controller
        except (Busy, NodeInUse) as exc:
            log.info("node %s, whose Node object was deleted, is not forgotten yet: %s; the next sync "
                     "tries again", name, exc)
        except Exception:
            log.exception("node %s, whose Node object was deleted: forgetting it failed; the next sync "
                          "tries again", name)
        finally:
            self._ping_done(name)

    def refresh_host(self) -> None:
        """Tell the engine each GPU node's CPU/memory: allocatable minus what bound Pods request
        that the engine does not count itself (see nodeusage.host_left); and how many of its
        assignments the node takes: status.allocatable.pods less the bound Pods holding none
        (pods_left). The engine counts its own assignments when it chooses a node, so replicas
        placed at once, in one pass or several, never pass the limit together; what remains
        is Pods that others bind after this refresh (each pass and node sync makes one),
        counted from the next, as for CPU/memory."""
        if not self.usage.synced:
            return
        nodes = self._nodes
        # the Pods before the engine's assignments: a share released in between then counts
        # by its Pod, not by neither
        usage = self.usage.on(nodes)
        held = self.core.ledger.host_requests()
        for name, pods in usage.items():
            facts, mine = nodes[name], held.get(name, {})
            left = host_left(facts.allocatable, pods, mine)
            self.core.ledger.set_host(name, left.cpu_milli, left.memory_bytes // MiB)
            self.core.ledger.set_room(name, pods_left(facts.max_pods, pods, mine) if facts.max_pods else None)

    # -- event sources ---------------------------------------------------------------------------------
    def queue_all(self) -> None:
        """Every FastPod, and the owner of every allocation record: a FastPod gone without its
        finalizer having run leaves records (and shares) that only a pass for it releases."""
        keys = {(fp["metadata"]["namespace"], fp["metadata"]["name"]) for fp in self.store.list_fastpods()}
        allocations = self.store.list_allocations()
        keys.update(tuple(a.owner.split("/", 1)) for a in allocations if "/" in a.owner)
        self._forget_deleted_nodes({a.node for a in allocations if a.state in HOLDING and a.node})
        for key in sorted(keys):
            self.queue.add(key)

    def _watch_fastpods(self) -> None:
        def on_fastpod(_: str, obj: dict[str, Any]) -> None:
            self.queue.add((obj["metadata"]["namespace"], obj["metadata"]["name"]))

        if self.settings.namespace:
            self._listwatch.run(self.objects.list_namespaced_custom_object, on_fastpod, group=GROUP,
                                version=VERSION, namespace=self.settings.namespace, plural=PLURAL)
        else:
            self._listwatch.run(self.objects.list_cluster_custom_object, on_fastpod, group=GROUP,
                                version=VERSION, plural=PLURAL)

    def _watch_pods(self) -> None:
        def on_list(listing: dict[str, Any]) -> None:
            self.podcache.replace(listing["items"], listing["metadata"]["resourceVersion"])

        def on_pod(kind: str, pod: dict[str, Any]) -> None:
            if kind == "DELETED":
                self.podcache.remove(pod)
            elif kind in ("ADDED", "MODIFIED"):
                self.podcache.put(pod)
            owner = (_meta(pod).get("labels") or {}).get(FASTPOD_LABEL)
            if owner:
                self.queue.add((_meta(pod)["namespace"], owner))

        if self.settings.namespace:
            self._listwatch.run(self.pods.list_namespaced_pod, on_pod, on_list,
                                on_progress=self.podcache.caught_up, namespace=self.settings.namespace,
                                label_selector=FASTPOD_LABEL)
        else:
            self._listwatch.run(self.pods.list_pod_for_all_namespaces, on_pod, on_list,
                                on_progress=self.podcache.caught_up, label_selector=FASTPOD_LABEL)

    def _watch_node_pods(self) -> None:
        """Every namespace's bound Pods (the kubelet counts them all), for node usage."""
        def on_list(listing: dict[str, Any]) -> None:
            # one read of the pages for both
            version = listing["metadata"]["resourceVersion"]
            self.usage.replace(self.peers.replacing(listing["items"], version), version)

        def on_pod(kind: str, pod: dict[str, Any]) -> None:
            if kind == "DELETED":
                self.usage.remove(pod)
                self.peers.remove(pod)
            elif kind in ("ADDED", "MODIFIED"):
                self.usage.put(pod)
                self.peers.put(pod)

        def on_progress(version: str) -> None:
            self.usage.caught_up(version)
            self.peers.caught_up(version)

        self._listwatch.run(self.pods.list_pod_for_all_namespaces, on_pod, on_list,
                            page=self.settings.list_page, on_progress=on_progress,
                            field_selector=FIELD_SELECTOR)

    def _watch_nodes(self) -> None:
        """Every Node object: the GPU nodes for the periodic Node syncs, all of them for the
        topology domains of inter-pod rules (see nodecache)."""
        def on_node(kind: str, node: dict[str, Any]) -> None:
            if kind == "DELETED":
                self.nodecache.remove(node)
            elif kind in ("ADDED", "MODIFIED"):
                self.nodecache.put(node)

        self._listwatch.run(self.pods.list_node, on_node,
                            lambda listing: self.nodecache.replace(listing["items"],
                                                                   listing["metadata"]["resourceVersion"]),
                            page=self.settings.list_page, on_progress=self.nodecache.caught_up)

    def _sync_from_watch(self) -> None:
        self._sync(self._gpu_nodes(self._all_nodes()))

    def _sync_nodes_periodically(self) -> None:
        s = self.settings
        next_resync = time.monotonic()
        # past HEARTBEATS_PER_SECOND agents (2,000 at 2 s) the pings go out less often, and the
        # heartbeat timeout stretches as much (the core's Settings.heartbeat_interval is node_interval)
        while not self._stop.wait(max(s.node_interval, self.core.interval_for_size())):
            self._safe(self._sync_from_watch)
            now = time.monotonic()
            if now >= next_resync:
                self._safe(self.queue_all)
                next_resync = now + s.resync_interval

    def _reconcile_periodically(self) -> None:
        """In a thread of its own: a pass waits a whole deadline on an agent that does not
        answer, and the Node sync (the agents' heartbeats) must not wait behind it."""
        while not self._stop.wait(self.core.pass_interval()):
            with collection_paused():   # then what the pass left is collected, the rest frozen
                self._safe(self.reconciler.run_once)

    @staticmethod
    def _safe(fn: Callable[[], object]) -> None:
        try:
            fn()
        except Deposed:
            pass   # the fence logged it; the election stops this controller
        except Exception:
            log.exception("background step failed")

    def _worker(self) -> None:
        while not self._stop.is_set():
            key = self.queue.get(timeout=1.0)
            if key is None:
                continue
            try:
                again = self.reconcile(*key)
            except Deposed:   # the fence logged it; the next leader rebuilds and reconciles
                again = None
            except Exception as exc:
                if _lost_race(exc):   # another writer changed an object first: read it again
                    log.info("FastPod %s/%s changed while being reconciled; reconciling again", *key)
                    again = 0.1
                else:
                    log.exception("reconciling FastPod %s/%s failed; retrying", *key)
                    again = 2.0
            finally:
                self.queue.done(key)
            if again:
                self.queue.add(key, delay=again)

    # -- one FastPod ---------------------------------------------------------------------------------
    def reconcile(self, namespace: str, name: str) -> float | None:
        """Bring one FastPod's Pods and shares in line with its spec; returns a requeue delay."""
        try:
            fastpod = self.objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except client.ApiException as exc:
            if exc.status == 404:
                return self._clean_up_after(namespace, name)
            raise
        meta = fastpod["metadata"]
        deleting = bool(meta.get("deletionTimestamp"))
        if not deleting and FINALIZER not in (meta.get("finalizers") or []):
            fastpod = self._patch_finalizers(fastpod, [*(meta.get("finalizers") or []), FINALIZER])
            meta = fastpod["metadata"]
        self.store.remember_owner(fastpod)
        if not (self.podcache.synced and self.usage.synced and self.peers.synced):
            return 1.0
        # Pods (from the watch's cache, see podcache) before records: a record made after this
        # cannot be mistaken for one whose Pod is gone (this FastPod's replicas are only made by
        # this pass, and go into the cache from the create's reply).
        labelled = {_meta(p)["name"]: p for p in self.podcache.of(namespace, name)}
        pods = {n: p for n, p in labelled.items()
                if any(o["uid"] == meta["uid"] for o in _meta(p).get("ownerReferences") or [])}
        allocations, marked = self.store.allocations_of(namespace, name)
        wait = None

        # Records marked for deletion (someone deleted them): their Pod goes, then their share.
        for pod_name in marked & set(pods):
            if allocations[pod_name].state in HOLDING and not _meta(pods[pod_name]).get("deletionTimestamp"):
                log.warning("deleting pod %s/%s: its allocation record was deleted", namespace, pod_name)
                self._delete_pod(namespace, pod_name)
        # Shares whose Pod is gone: deleted behind our back, never created, or scaled down.
        for pod_name, allocation in allocations.items():
            if allocation.state in HOLDING and pod_name not in pods:
                if (stray := labelled.get(pod_name)) is not None:
                    # Not (any more) this FastPod's, yet it runs on the share: orphaned (a deletion
                    # with --cascade=orphan) or of an earlier FastPod of this name. It goes first
                    # (nothing else would release its share), then its share.
                    if not _meta(stray).get("deletionTimestamp"):
                        log.warning("deleting pod %s/%s: it holds a share of FastPod %s but is not its own",
                                    namespace, pod_name, name)
                        self._delete_pod(namespace, pod_name)
                    wait = 1.0
                    continue
                allocations[pod_name] = self._release(allocation, f"pod {pod_name} is gone")
                if allocations[pod_name].state not in FINISHED:
                    wait = 2.0  # agent unreachable: the core's reconciler finishes the release
        # Pods without a share (their share was released or never recorded): not ours to run.
        for pod_name, pod in pods.items():
            allocation = allocations.get(pod_name)
            holds = allocation is not None and allocation.state in HOLDING
            if not holds and not _meta(pod).get("deletionTimestamp"):
                log.warning("deleting pod %s/%s: it holds no GPU share", namespace, pod_name)
                self._delete_pod(namespace, pod_name)
        for pod_name, allocation in list(allocations.items()):
            if allocation.state in FINISHED and pod_name not in pods:
                self.store.forget(allocation.id)
                del allocations[pod_name]

        held = [n for n, p in pods.items() if not _meta(p).get("deletionTimestamp") and n not in marked
                and allocations.get(n) is not None and allocations[n].state in HOLDING]
        # Pods that ended (evicted, exited) would hold their share for good: they go (the share is
        # released once they are gone) and are replaced below, as a ReplicaSet replaces them, but
        # after a growing delay: a kubelet that refuses every Pod (e.g. OutOfcpu) is no hot loop.
        ended = {n: f"pod {n} {pods[n]['status'].get('reason') or pods[n]['status']['phase']}"
                 for n in held if is_terminated(pods[n])}
        for pod_name, why in ended.items():
            log.info("deleting pod %s/%s: it has terminated: %s", namespace, pod_name, why)
            self._delete_pod(namespace, pod_name)
            held.remove(pod_name)
        if ended:
            rounds = self._ended.get(meta["uid"], (0, 0.0, ""))[0] + 1
            # the exponent capped: 2.0 ** 1024 overflows (a replica ending for days on end)
            self._ended[meta["uid"]] = (rounds, time.monotonic() + min(2.0 ** min(rounds - 1, 9), 300.0),
                                        next(iter(ended.values())))
        live = [pods[n] for n in held]
        if deleting:
            for pod in live:
                self._delete_pod(namespace, _meta(pod)["name"])
            if pods or any(a.state in HOLDING for a in allocations.values()):
                return 1.0  # wait until the Pods are gone and their shares released
            self._patch_finalizers(fastpod, [f for f in meta.get("finalizers") or [] if f != FINALIZER])
            self._templates_ok.pop(meta["uid"], None)
            self._ended.pop(meta["uid"], None)
            return None

        desired = int(fastpod["spec"].get("replicas", 1))
        condition = {"type": "Scheduled", "status": "True", "reason": "Scheduled",
                     "message": f"{desired} replica(s) placed"}
        if len(live) > desired:
            # surplus: not-ready first, then the newest (RFC 3339 UTC times sort as strings)
            by_age = sorted(live, key=lambda p: _meta(p)["creationTimestamp"], reverse=True)
            victims = sorted(by_age, key=is_ready)
            for pod in victims[: len(live) - desired]:
                self._delete_pod(namespace, _meta(pod)["name"])
                live.remove(pod)
        _, not_before, why = self._ended.get(meta["uid"], (0, 0.0, ""))
        # The template is checked when a replica is missing, and also when an edit is first seen
        # (or was refused): an invalid edit of a FastPod whose replicas all run is shown at once,
        # not once a replica is to be replaced (the running ones are left as they are).
        status = fastpod.get("status") or {}
        shown = next((c for c in status.get("conditions") or [] if c.get("type") == "Scheduled"), {})
        check = (len(live) < desired or status.get("observedGeneration") != meta.get("generation", 0)
                 or shown.get("reason") in ("Invalid", "PodCreateFailed"))
        if len(live) < desired and (left := not_before - time.monotonic()) > 0:
            condition = {"type": "Scheduled", "status": "False", "reason": "BackOff",
                         "message": f"{why}; its replacement waits {left:.0f} s"}
            wait = left
        elif check and (refused := self._template_refusal(fastpod)) is not None:
            condition = refused
        elif len(live) < desired:
            taken = set(pods) | set(allocations)
            created, problem = self._create_replicas(fastpod, desired - len(live), taken)
            for pod, allocation in created:
                live.append(pod)
                allocations[_meta(pod)["name"]] = allocation
            if problem is not None:
                condition = problem
                wait = 5.0
        if len(live) == desired and all(is_ready(p) for p in live):
            self._ended.pop(meta["uid"], None)   # all well again: no delay for the next one
        self._write_status(fastpod, live, allocations, condition)
        return wait

    def _clean_up_after(self, namespace: str, name: str) -> float | None:
        """A FastPod gone although its finalizer never ran (an operator removed it, e.g. while a
        Pod hung on a dead node): do what the finalizer would have done. Its Pods go, and each
        share is released once its Pod is gone; otherwise the shares stay held for good."""
        allocations, _ = self.store.allocations_of(namespace, name)
        if not allocations:
            return None
        if not self.podcache.synced:
            return 1.0
        pods = {_meta(p)["name"]: p for p in self.podcache.of(namespace, name)}
        wait = None
        for pod_name, allocation in allocations.items():
            pod = pods.get(pod_name)
            if pod is not None:
                if not _meta(pod).get("deletionTimestamp"):
                    self._delete_pod(namespace, pod_name)
                wait = 1.0
                continue
            if allocation.state in HOLDING:
                allocation = self._release(allocation, f"FastPod {namespace}/{name} is gone")
            if allocation.state in FINISHED:
                self.store.forget(allocation.id)
            else:
                wait = 2.0  # agent unreachable: the core's reconciler finishes the release
        return wait

    def _template_refusal(self, fastpod: dict[str, Any]) -> dict[str, str] | None:
        """Dry-run a replica Pod once per FastPod generation: a template the API server refuses
        gets a condition naming the field before any GPU share is allocated for it."""
        meta = fastpod["metadata"]
        generation = meta.get("generation", 0)
        if self._templates_ok.get(meta["uid"], (None,))[0] == generation:
            return None
        try:   # what the controller itself reads of the template: resources, affinity, tolerations, ports
            spec = spec_of(fastpod)
            replica_constraints(fastpod, self.settings.gpu_node_label)
            replica_incoming(fastpod, self.settings.gpu_node_label)
            replica_host_ports(fastpod)
        except TemplateError as exc:
            return {"type": "Scheduled", "status": "False", "reason": "Invalid", "message": str(exc)}
        probe = Allocation(id="dry-run", spec=spec, owner="", state=State.PENDING, node="dry-run",
                           env={"CUDA_VISIBLE_DEVICES": "GPU-dry-run",
                                **{var: f"/run/fastshare/mps/dry-run/{var.lower()}" for var in MPS_PATH_ENV}})
        pod = replica_pod(fastpod, f"{meta['name']}-dry-run", probe, self.settings.gpu_node_label)
        try:
            admitted = raw(self.pods.create_namespaced_pod(meta["namespace"], pod, dry_run="All",
                                                            _preload_content=False))
        except client.ApiException as exc:
            if exc.status in (409, 429) or exc.status >= 500:
                raise   # not about the template: retried
            return {"type": "Scheduled", "status": "False", "reason": "PodCreateFailed",
                    "message": f"the pod template is refused: {exc.status} {exc.reason}: {api_message(exc)}"}
        except (TypeError, ValueError) as exc:   # the client's own model check (e.g. a non-string label)
            return {"type": "Scheduled", "status": "False", "reason": "PodCreateFailed",
                    "message": f"the pod template is refused: {' '.join(str(exc).split())[:500]}"}
        self._templates_ok[meta["uid"]] = (generation, pod_running_demand(admitted).most(
            Demand(spec.cpu_milli, spec.host_memory_bytes)))
        return None

    def _replica_spec(self, fastpod: dict[str, Any]) -> Spec:
        """The request of one replica; its host part as the dry run's Pod was admitted."""
        spec = spec_of(fastpod)
        generation, admitted = self._templates_ok.get(fastpod["metadata"]["uid"], (None, None))
        if admitted is None or generation != fastpod["metadata"].get("generation", 0):
            return spec
        return replace(spec, cpu_milli=admitted.cpu_milli, host_memory_bytes=admitted.memory_bytes)

    def _create_replicas(self, fastpod: dict[str, Any], count: int, taken: set[str]
                         ) -> tuple[list[tuple[dict[str, Any], Allocation]], dict[str, str] | None]:
        """Up to ``count`` new replicas, in parallel, with a slow start: one at first, one more in
        flight per success (so 1, 2, 4, ... per round trip, ``create_parallelism`` at most), and no
        new one after the first problem, so that a FastPod that cannot be placed costs one attempt
        per pass, not ``count`` (as ReplicaSets do). A window, not batches: nothing waits for the
        slowest of a batch. Replicas with inter-pod rules or host ports go one at a time instead,
        each placed alone with the ones created before it counted (see podaffinity, PlacementLock):
        two replicas taking the same host port never land on one node."""
        try:
            rules = replica_constraints(fastpod, self.settings.gpu_node_label)
            incoming = replica_incoming(fastpod, self.settings.gpu_node_label)
            ports = replica_host_ports(fastpod)
        except TemplateError as exc:
            return [], {"type": "Scheduled", "status": "False", "reason": "Invalid", "message": str(exc)}
        # The GPU nodes this pass checks: a replica goes to none other (see Ledger.place). The
        # ledger's nodes are read first: the node sync lists Nodes before it registers their
        # agents, so one missing from the later snapshot has no labelled Node now.
        registered = self.core.ledger.node_names()
        nodes = self._nodes
        gone = f"have no Node object labelled {self.settings.gpu_node_label}=true"
        excluded = {name: gone for name in registered if name not in nodes}
        excluded.update({name: why for name, facts in nodes.items()
                         if (why := rules.problem(facts, TEMPLATE_SPEC))})
        self.refresh_host()   # Pods bound since the last node sync (CPU, memory, Pod count)
        serial = bool(incoming.rules or ports)
        around = self._serial_check(incoming, ports, nodes) if serial else None
        seen: dict[frozenset[tuple[str, str]], dict[str, str]] = {}   # by the Pods that forbid
        names: list[str] = []
        prefix = fastpod["metadata"]["name"]
        while len(names) < count:
            candidate = f"{prefix}-{secrets.token_hex(3)}"
            if candidate not in taken:
                taken.add(candidate)
                names.append(candidate)
        created: list[tuple[dict[str, Any], Allocation]] = []
        problem: dict[str, str] | None = None
        error: BaseException | None = None
        window, running = 1, set()
        while running or (names and problem is None and error is None):
            while names and problem is None and error is None and len(running) < window:
                if around is not None:
                    job = self._pool.submit(self._create_ruled_replica, fastpod, names.pop(), excluded,
                                            nodes, around, [pod for pod, _ in created])
                else:
                    job = self._pool.submit(self._create_unruled_replica, fastpod, names.pop(), excluded,
                                            nodes, incoming, seen)
                running.add(job)
            done, running = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                try:
                    pod, allocation, trouble = future.result()
                except Exception as exc:  # raised once nothing of this pass runs any more
                    error = error or exc
                    continue
                if pod is not None:
                    created.append((pod, allocation))
                    window = 1 if serial else min(window + 1, self.settings.create_parallelism)
                problem = problem or trouble
        if error is not None:
            raise error
        return created, problem

    def _pod_rules(self, incoming: Incoming, forbidding: list[Peer], gpu_nodes: Mapping[str, NodeFacts]
                   ) -> Callable[[list[dict[str, Any]]], dict[str, str]] | None:
        """What rules the pass's GPU nodes (``gpu_nodes``) out for ``incoming`` by the Pods around
        it (``forbidding``: those with required anti-affinity): a function of the Pods created
        since (None: no inter-pod rule concerns it). Every Node (domains and the nodes of other Pods) is read
        once here, only when some rule is in play; every Namespace once, when a term in play
        selects them by label: for a replica with rules of its own, decided from the Pods as
        they are at each check (under the placement lock), so that a Pod bound after this
        read with such a term is not checked against no labels."""
        if not incoming.rules and not forbidding:
            return None
        read: dict[str, dict[str, str]] | None = None

        def namespaces(peers: Iterable[Peer]) -> dict[str, dict[str, str]]:
            nonlocal read
            if read is None and needs_namespaces(incoming, peers):
                read = self._namespace_labels()
            return read or {}

        if not incoming.rules:   # only bound Pods' anti-affinity: none of it may select the replica
            labels = namespaces(forbidding)
            if not any(t.selects(incoming.namespace, incoming.labels, labels)
                       for p in forbidding for t in p.anti_affinity):
                return None
        nodes = {n.name: n for n in map(node_facts, self._all_nodes())}

        def check(created: list[dict[str, Any]]) -> dict[str, str]:
            if not incoming.rules:
                return ruled_out(incoming, gpu_nodes, nodes, forbidding, namespaces(forbidding))
            peers = self.peers.all()
            for pod in created:   # this pass's, whether or not the watch has them yet
                if (entry := peer(pod)) is not None:
                    peers[pod_key(pod)] = entry
            return ruled_out(incoming, gpu_nodes, nodes, peers.values(), namespaces(peers.values()))

        return check

    def _serial_check(self, incoming: Incoming, ports: tuple[HostPort, ...],
                      gpu_nodes: Mapping[str, NodeFacts]) -> Callable[[list[dict[str, Any]]], dict[str, str]]:
        """What rules the GPU nodes out for a replica placed alone, as a function of this pass's
        Pods (``created``): its inter-pod rules (or, without, bound Pods' anti-affinity as they
        are when it holds the lock) and the host ports bound Pods already take."""
        rules = self._pod_rules(incoming, self.peers.forbidding(), gpu_nodes) if incoming.rules else None

        def check(created: list[dict[str, Any]]) -> dict[str, str]:
            around = rules or self._pod_rules(incoming, self.peers.forbidding(), gpu_nodes)
            return {**self._ports_taken(ports, created, gpu_nodes),
                    **(around(created) if around is not None else {})}

        return check

    def _ports_taken(self, ports: tuple[HostPort, ...], created: list[dict[str, Any]],
                     gpu_nodes: Iterable[str]) -> dict[str, str]:
        """The GPU nodes (of ``gpu_nodes``) where a Pod (bound, or of this pass whether or not
        the watch has it yet) takes one of ``ports``, each with the port named."""
        if not ports:
            return {}
        used = self.usage.ports(gpu_nodes)
        for pod in created:
            if (node := (pod.get("spec") or {}).get("nodeName")) in used:
                used[node].extend(running_host_ports(pod))
        return {node: f"have host port {port} in use" for node, taken in used.items()
                if (port := port_taken(ports, taken)) is not None}

    def _listed(self, list_fn: Callable[..., Any]) -> Iterator[dict[str, Any]]:
        """Every object of a cluster-wide listing, read a page at a time."""
        for page in pages(list_fn, self.settings.list_page):
            yield from page["items"]

    def _namespace_labels(self) -> dict[str, dict[str, str]]:
        """Every Namespace's labels (only when a term selects namespaces by them)."""
        return {ns["metadata"]["name"]: ns["metadata"].get("labels") or {}
                for ns in self._listed(self.pods.list_namespace)}

    def _create_ruled_replica(self, fastpod: dict[str, Any], pod_name: str, excluded: dict[str, str],
                              gpu_nodes: Mapping[str, NodeFacts],
                              around: Callable[[list[dict[str, Any]]], dict[str, str]],
                              created: list[dict[str, Any]]
                              ) -> tuple[dict[str, Any] | None, Allocation | None, dict[str, str] | None]:
        """One replica with inter-pod rules or host ports: the nodes they rule out, with the Pods
        of this pass (``created``) and of other FastPods' passes counted, then the create, alone."""
        with self._placing.exclusive():
            return self._create_replica(fastpod, pod_name, {**around(created), **excluded}, gpu_nodes)

    def _create_unruled_replica(self, fastpod: dict[str, Any], pod_name: str, excluded: dict[str, str],
                                gpu_nodes: Mapping[str, NodeFacts], incoming: Incoming,
                                seen: dict[frozenset[tuple[str, str]], dict[str, str]]
                                ) -> tuple[dict[str, Any] | None, Allocation | None, dict[str, str] | None]:
        """One replica without rules of its own, beside others (shared): the nodes that bound
        Pods' anti-affinity keeps it from, as they are once it holds the lock (``seen``: this
        pass's answers, by the set of such Pods, so that most replicas read no Node)."""
        with self._placing.shared():
            forbidding = self.peers.forbidding()
            key = frozenset((p.namespace, p.name) for p in forbidding)
            if key not in seen:
                around = self._pod_rules(incoming, forbidding, gpu_nodes)
                seen[key] = around([]) if around is not None else {}
            return self._create_replica(fastpod, pod_name, {**seen[key], **excluded}, gpu_nodes)

    def _create_replica(self, fastpod: dict[str, Any], pod_name: str, excluded: dict[str, str],
                        gpu_nodes: Mapping[str, NodeFacts]
                        ) -> tuple[dict[str, Any] | None, Allocation | None, dict[str, str] | None]:
        """Allocate (record first, then the agent) on one of the pass's ``gpu_nodes`` not
        ``excluded``, then create the Pod; a failed create releases."""
        meta = fastpod["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        try:
            request = Request(spec=self._replica_spec(fastpod), owner=f"{namespace}/{name}",
                              idempotency_key=replica_key(namespace, name, pod_name))
            allocation = self._allocate(fastpod, request, excluded, gpu_nodes)
        except TemplateError as exc:
            return None, None, {"type": "Scheduled", "status": "False", "reason": "Invalid",
                                "message": str(exc)}
        except Rejected as exc:
            return None, None, {"type": "Scheduled", "status": "False", "reason": "Unschedulable",
                                "message": str(exc)}
        except AgentFailed as exc:
            return None, None, {"type": "Scheduled", "status": "False", "reason": "AgentUnavailable",
                                "message": str(exc)}
        except ValidationError as exc:
            return None, None, {"type": "Scheduled", "status": "False", "reason": "Invalid",
                                "message": f"{fastpod_field(exc.field)}: {exc.detail}"}
        except KeyConflict as exc:
            return None, None, {"type": "Scheduled", "status": "False", "reason": "Invalid",
                                "message": str(exc)}
        try:
            self.fence.check()
            pod = raw(self.pods.create_namespaced_pod(namespace, replica_pod(
                fastpod, pod_name, allocation, self.settings.gpu_node_label), _preload_content=False))
            self.podcache.put(pod)
            self.peers.put(pod)
            self.usage.put(pod)   # its host ports taken for the next placement, seen or not
        except client.ApiException as exc:
            message = f"creating pod {pod_name} failed: {exc.status} {exc.reason}: {api_message(exc)}"
            self._release(allocation, message)
            return None, None, {"type": "Scheduled", "status": "False", "reason": "PodCreateFailed",
                                "message": message}
        log.info("FastPod %s/%s: pod %s on %s holds %s", namespace, name, pod_name, allocation.node,
                 allocation.id)
        return pod, allocation, None

    def _replica_demand(self, fastpod: dict[str, Any]) -> Demand:
        """One replica Pod's request as the dry run's Pod was admitted (else as the template says)."""
        generation, admitted = self._templates_ok.get(fastpod["metadata"]["uid"], (None, None))
        if admitted is not None and generation == fastpod["metadata"].get("generation", 0):
            return admitted
        return pod_demand(fastpod["spec"]["template"].get("spec") or {}, TEMPLATE_SPEC)

    def _allocate(self, fastpod: dict[str, Any], request: Request, excluded: dict[str, str],
                  gpu_nodes: Mapping[str, NodeFacts]) -> Allocation:
        """The core's allocation (a fresh name: creating is the check) on one of ``gpu_nodes``,
        those the pass checked (a node registered since is not offered); a replica that asks
        resources the engine does not count (extended resources, hugepages, ephemeral storage)
        goes only where they are free: allocatable less bound Pods' requests and the replicas
        placed whose Pod the watch has not shown yet. Those placements go one at a time, so that
        two do not take the same last device."""
        asked = self._replica_demand(fastpod)
        if not asked.extended:
            return self.core.allocate(request, lookup=False, excluded=excluded, checked=gpu_nodes)
        with self._extended_lock:
            held = self.core.ledger.host_requests()
            usage = self.usage.on(gpu_nodes)
            seen = {allocation for pods in usage.values() for _, allocation in pods}
            self._unseen_extended = {a: (node, demand) for a, (node, demand) in self._unseen_extended.items()
                                     if a in held.get(node, {}) and a not in seen}
            without = dict(excluded)
            for name, facts in gpu_nodes.items():
                placing = {a: demand for a, (node, demand) in self._unseen_extended.items() if node == name}
                why = facts.extended_problem(asked, extended_used(usage.get(name, []), placing))
                if why and name not in without:
                    without[name] = why
            allocation = self.core.allocate(request, lookup=False, excluded=without, checked=gpu_nodes)
            self._unseen_extended[allocation.id] = (allocation.node, asked)
            return allocation

    def _release(self, allocation: Allocation, reason: str) -> Allocation:
        try:
            return self.core.release(allocation.id, reason)
        except Busy:
            return allocation

    def _delete_pod(self, namespace: str, name: str) -> None:
        """Delete a Pod; the reply goes into the cache at once (marked, or gone), so that the
        next pass does not count it as live and delete another one."""
        self.fence.check()
        try:
            pod = raw(self.pods.delete_namespaced_pod(name, namespace, _preload_content=False))
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            self.podcache.gone(namespace, name)
            return
        if pod.get("kind") == "Pod" and _meta(pod).get("deletionTimestamp"):
            self.podcache.put(pod)
        elif pod.get("kind") == "Pod":
            self.podcache.remove(pod)

    def _patch_finalizers(self, fastpod: dict[str, Any], finalizers: list[str]) -> dict[str, Any]:
        meta = fastpod["metadata"]
        body = {"metadata": {"finalizers": finalizers, "resourceVersion": meta["resourceVersion"]}}
        self.fence.check()
        return self.objects.patch_namespaced_custom_object(GROUP, VERSION, meta["namespace"], PLURAL,
                                                           meta["name"], body)

    def _write_status(self, fastpod: dict[str, Any], live: list[dict[str, Any]],
                      allocations: dict[str, Allocation], scheduled: dict[str, str]) -> None:
        """The FastPod's status, once per pass (and only if it changed): counts (outdated: live
        replicas not made from the current template, which is not rolled out to them),
        conditions, and where each replica runs (summaries of its allocation records; as many
        as fit, see listed_assignments)."""
        meta, spec = fastpod["metadata"], fastpod["spec"]
        ready_pods = {_meta(p)["name"] for p in live if is_ready(p)}
        ready = len(ready_pods)
        desired = int(spec.get("replicas", 1))
        old = {c["type"]: c for c in (fastpod.get("status") or {}).get("conditions") or []}
        conditions = []
        for condition in (scheduled, {
            "type": "Ready", "status": "True" if ready == desired else "False",
            "reason": "AllReplicasReady" if ready == desired else "ReplicasNotReady",
            "message": f"{ready}/{desired} replica(s) ready",
        }):
            previous = old.get(condition["type"])
            same = previous is not None and previous["status"] == condition["status"]
            # an agent's error or the API server's refusal may be longer than a message may be
            conditions.append({**condition, "message": clip(condition["message"]),
                               "observedGeneration": meta.get("generation", 0),
                               "lastTransitionTime": previous["lastTransitionTime"] if same else _now()})
        selector = selector_string(spec["selector"])
        listed, omitted = listed_assignments([summary(pod, a) for pod, a in allocations.items()], ready_pods)
        current = template_hash(fastpod)
        outdated = sum(1 for p in live if is_outdated(p, current))
        status = {"replicas": len(live), "readyReplicas": ready, "selector": selector,
                  "templateHash": current, "outdatedReplicas": outdated,
                  "observedGeneration": meta.get("generation", 0), "conditions": conditions,
                  "assignments": listed, "assignmentsOmitted": omitted}
        written = fastpod.get("status") or {}
        if all(written.get(k) == v for k, v in status.items()):
            return
        self.fence.check()
        self.objects.patch_namespaced_custom_object_status(GROUP, VERSION, meta["namespace"], PLURAL,
                                                           meta["name"], {"status": status},
                                                           _preload_content=False).drain_conn()


def run_with_leader_election(make_controller: Callable[[], KubeController], elector, stop: threading.Event,
                             on_lost: Callable[[], None] | None = None) -> None:
    """Run a controller only while ``elector`` holds the Lease; a fresh one per term of office.

    A new term rebuilds everything from the cluster (never from the previous term's memory).
    ``on_lost`` is called when leadership is lost (the CLI exits, as client-go programs do).
    """
    current: list[KubeController] = []

    def renew(until: threading.Event) -> None:
        while not until.wait(elector.retry_period):
            elector.step()

    def changed(leading: bool) -> None:
        if leading:
            controller = make_controller()
            # The election loop waits for this call, and a start asks every agent (a hung one
            # takes the RPC deadline): the Lease is renewed meanwhile, or it runs out and a
            # standby takes over while this one starts, and both act.
            started = threading.Event()
            renewer = threading.Thread(target=renew, args=(started,), name="lease-renewal", daemon=True)
            renewer.start()
            try:
                controller.start()
            except Deposed:   # the Lease lapsed while starting: this term is over
                controller.stop()
                if on_lost is not None and not stop.is_set():
                    on_lost()
                return
            finally:
                started.set()
                renewer.join()
            current.append(controller)
        elif current:
            current.pop().stop()
            if on_lost is not None and not stop.is_set():
                on_lost()

    elector.run(stop, changed)
