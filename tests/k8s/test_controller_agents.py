"""The whole in-cluster path on a real API server with real node agents on simulated GPUs:
FastPod -> allocation recorded (a FastShareAllocation object) -> agent prepares the share -> Pod
with nodeName, env and MPS mounts; scale 3 -> 1 -> 0 -> 2; Pod deleted behind the controller's
back; FastPod deletion; controller restart (no double allocation, no leaked share); a controller
process killed between the record and the Pod; one replica key allocated by two controllers at
once; agent down."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from kubernetes import client

from fastshare.controller import faults
from fastshare.controller.agent_client import AgentPool
from fastshare.controller.core import Settings as CoreSettings
from fastshare.controller.model import Node, State
from fastshare.controller.store import StoreError
from fastshare.controller.validation import Request
from fastshare.device import simnvml
from fastshare.k8s import controller as k8s_controller
from fastshare.k8s.controller import KubeController, KubeSettings
from fastshare.k8s.pods import FASTPOD_LABEL, TEMPLATE_HASH_LABEL, spec_of
from fastshare.k8s.resources import ALLOCATION_PLURAL, FINALIZER, GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.k8s.store import replica_key

from .agents import Agent, kubelet_step, register_node, started_agent
from .conftest import wait_for


@pytest.fixture(scope="module")
def agents(api_client, pki):
    """Two GPU nodes: 4 V100 (MPS, fastpod, whole) and one H100 in MIG mode (exclusive)."""
    root, tls = pki
    suffix = uuid.uuid4().hex[:4]
    started = {
        "v100": Agent(root, root / "ca", f"v100-{suffix}", ["V100-SXM2-32GB"] * 4, mig=False),
        "h100": Agent(root, root / "ca", f"h100-{suffix}", ["H100-SXM5-80GB"], mig=True),
    }
    core = client.CoreV1Api(api_client)
    for agent in started.values():
        agent.start(tls)
        register_node(core, agent)
    yield started
    for agent in started.values():
        agent.stop()
        core.delete_node(agent.name)


@pytest.fixture
def controller(api_client, fastpod_crd, namespace, pki, agents):
    made = []

    def make() -> KubeController:
        c = KubeController(api_client, AgentPool(pki[1], deadline=10.0),
                           KubeSettings(namespace=namespace, workers=3, node_interval=0.5, resync_interval=3,
                                        watch_timeout=10),
                           CoreSettings(heartbeat_timeout=3.0, reconcile_interval=2.0, busy_wait=10.0))
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()
        c.core.agents.close()


class View:
    """What a test looks at: the FastPod, its Pods, the agents' shares; drives the fake kubelet."""

    def __init__(self, api_client, namespace, name, agents, tls):
        self.core = client.CoreV1Api(api_client)
        self.objects = client.CustomObjectsApi(api_client)
        self.namespace, self.name, self.agents, self.tls = namespace, name, agents, tls

    def fastpod(self):
        return self.objects.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)

    def fastpod_gone(self) -> bool:
        """One kubelet step, then whether the FastPod is deleted (its finalizer removed)."""
        kubelet_step(self.core, self.namespace)
        try:
            self.fastpod()
            return False
        except client.ApiException as exc:
            return exc.status == 404

    def pods(self, include_terminating=False):
        selector = f"{FASTPOD_LABEL}={self.name}"
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return [p for p in pods if include_terminating or not p.metadata.deletion_timestamp]

    def shares(self):
        return sorted(s for a in self.agents.values() for s in a.shares(self.tls))

    def records(self):
        """This FastPod's allocation objects, by pod name."""
        items = self.objects.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, ALLOCATION_PLURAL, label_selector=f"{FASTPOD_LABEL}={self.name}")
        return {o["spec"]["pod"]: o["spec"] for o in items["items"]}

    def active(self):
        entries = (self.fastpod().get("status") or {}).get("assignments") or []
        return {e["pod"]: e for e in entries if e["state"] == "active"}

    def settled(self, replicas):
        """Pods, shares and status agree on ``replicas`` (running the kubelet's part meanwhile)."""
        kubelet_step(self.core, self.namespace)
        pods = self.pods(include_terminating=True)
        active = self.active()
        status = self.fastpod().get("status") or {}
        return (len(pods) == replicas and sorted(p.metadata.name for p in pods) == sorted(active)
                and self.shares() == sorted(e["allocation"] for e in active.values())
                and sorted(self.records()) == sorted(active)
                and status.get("replicas") == replicas and status.get("readyReplicas") == replicas)

    def scale(self, replicas):
        self.objects.patch_namespaced_custom_object_scale(GROUP, VERSION, self.namespace, PLURAL, self.name,
                                                          {"spec": {"replicas": replicas}})


def _env(pod):
    return {e.name: e.value for e in pod.spec.containers[0].env or []}


def test_mps_replicas_scale_survive_external_deletes_and_are_released_on_delete(
        api_client, namespace, controller, agents, pki):
    controller().start()
    view = View(api_client, namespace, "svc", agents, pki[1])
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 fastpod_manifest("svc", {"kind": "mps", "memory": "4Gi"}, 3))
    wait_for(lambda: view.settled(3), "3 replicas running", timeout=120)
    for pod in view.pods():
        assert pod.spec.node_name == agents["v100"].name
        env = _env(pod)
        assert env["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        mounts = {m.name: m.mount_path for m in pod.spec.containers[0].volume_mounts}
        assert mounts["fastshare-mps-pipe"] == pipe
        host_paths = {v.name: v.host_path.path for v in pod.spec.volumes if v.host_path}
        assert host_paths["fastshare-mps-pipe"] == pipe
        assert pod.metadata.owner_references[0].name == "svc"
    fp = view.fastpod()
    conditions = {c["type"]: c["status"] for c in fp["status"]["conditions"]}
    assert conditions == {"Scheduled": "True", "Ready": "True"}
    records = view.records()
    for entry in fp["status"]["assignments"]:
        assert entry["node"] == agents["v100"].name and entry["gpuUUIDs"][0].startswith("GPU-")
        assert {k: v for k, v in records[entry["pod"]].items() if k != "record"} == entry

    for replicas in (1, 0, 2):
        view.scale(replicas)
        wait_for(lambda r=replicas: view.settled(r), f"scaled to {replicas}", timeout=120)

    victim = view.pods()[0]
    victim_share = view.active()[victim.metadata.name]["allocation"]
    view.core.delete_namespaced_pod(victim.metadata.name, namespace, grace_period_seconds=0)
    wait_for(lambda: view.settled(2) and victim_share not in view.shares()
             and victim.metadata.name not in view.active(), "replacement replica", timeout=120)

    view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "svc")

    wait_for(view.fastpod_gone, "FastPod deleted once its shares are released", timeout=120)
    assert view.shares() == [] and view.pods(include_terminating=True) == []
    wait_for(lambda: view.records() == {}, "allocation records gone with the FastPod")


@pytest.mark.parametrize(("gpu", "node"), [
    ({"kind": "fastpod", "smPercent": 30, "memory": "4Gi", "quotaRequest": 0.3, "quotaLimit": 0.6}, "v100"),
    ({"kind": "exclusive", "migProfile": "1g.10gb"}, "h100"),
    ({"kind": "whole", "count": 1}, "v100"),
], ids=["fastpod", "exclusive", "whole"])
def test_three_replicas_of_each_kind(api_client, namespace, controller, agents, pki, gpu, node):
    controller().start()
    view = View(api_client, namespace, gpu["kind"], agents, pki[1])
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 fastpod_manifest(gpu["kind"], gpu, 3))
    wait_for(lambda: view.settled(3), f"3 {gpu['kind']} replicas", timeout=180)
    entries = view.active()
    visible = set()
    for pod in view.pods():
        entry = entries[pod.metadata.name]
        assert pod.spec.node_name == entry["node"] == agents[node].name
        env = _env(pod)
        visible.add(env["CUDA_VISIBLE_DEVICES"])
        has_mps = any(v.host_path for v in pod.spec.volumes or [])
        assert has_mps == (gpu["kind"] == "fastpod")
        if gpu["kind"] == "exclusive":
            assert env["CUDA_VISIBLE_DEVICES"] == entry["migUUID"] and entry["migUUID"].startswith("MIG-")
            assert entry["placement"]["profile"] == "1g.10gb"
        else:
            assert env["CUDA_VISIBLE_DEVICES"] == entry["gpuUUIDs"][0]
    if gpu["kind"] in ("exclusive", "whole"):
        assert len(visible) == 3  # nothing shared
    view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, gpu["kind"])
    wait_for(lambda: (kubelet_step(view.core, namespace), view.shares() == [])[1], "released", timeout=120)


def test_restart_neither_double_allocates_nor_leaks_and_rolls_back_a_replica_without_pod(
        api_client, namespace, controller, agents, pki):
    first = controller()
    first.start()
    view = View(api_client, namespace, "job", agents, pki[1])
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 fastpod_manifest("job", {"kind": "mps", "memory": "2Gi"}, 2))
    wait_for(lambda: view.settled(2), "2 replicas", timeout=120)
    before = view.shares()
    first.stop()
    # What a crash between "allocation committed + prepared" and "Pod created" leaves behind:
    orphan = first.core.allocate(Request(spec=spec_of(view.fastpod()), owner=f"{namespace}/job",
                                         idempotency_key=replica_key(namespace, "job", "job-crashed")))
    assert orphan.id in view.shares()

    second = controller()
    second.start()
    wait_for(lambda: view.settled(2) and orphan.id not in view.shares(), "rolled back", timeout=120)
    assert view.shares() == before  # the two live replicas kept their shares; nothing new
    view.scale(3)
    wait_for(lambda: view.settled(3), "scaled up after restart", timeout=120)


def test_agent_down_makes_new_replicas_unschedulable_with_a_reason(api_client, namespace, controller, agents,
                                                                    pki):
    controller().start()
    view = View(api_client, namespace, "mig", agents, pki[1])
    agents["h100"].stop(kill=True)
    try:
        view.objects.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, fastpod_manifest("mig", {"kind": "exclusive", "smCount": 16}))

        def unschedulable():
            conditions = {c["type"]: c for c in (view.fastpod().get("status") or {}).get("conditions") or []}
            scheduled = conditions.get("Scheduled")
            return scheduled and scheduled["status"] == "False" and scheduled

        condition = wait_for(unschedulable, "Unschedulable", timeout=120)
        assert condition["reason"] in ("Unschedulable", "AgentUnavailable")
        assert condition["message"]
        assert view.pods() == []
    finally:
        agents["h100"].start(pki[1])
    wait_for(lambda: view.settled(1), "scheduled once the agent is back", timeout=120)
    view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "mig")
    # the agents serve the whole module: leave them without shares
    wait_for(lambda: (kubelet_step(view.core, namespace), view.shares() == [])[1], "released", timeout=120)


def test_one_replica_key_allocated_by_two_controllers_at_once_is_one_share(
        api_client, namespace, controller, agents, pki):
    """Split brain on one replica: both controllers' engines place it, only one record is created
    (the object's name is the replica), the other controller gets the winner's allocation, and
    the agent holds one share; asking again returns the same allocation."""
    view = View(api_client, namespace, "dup", agents, pki[1])
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 fastpod_manifest("dup", {"kind": "mps", "memory": "2Gi"}, 0))
    cores = [controller(), controller()]
    for c in cores:
        c.sync_nodes()
    for round_ in range(3):
        request = Request(spec=spec_of(view.fastpod()), owner=f"{namespace}/dup",
                          idempotency_key=replica_key(namespace, "dup", f"dup-{round_}"))
        barrier = threading.Barrier(2)
        results: list[object] = []

        def allocate(c, request=request, barrier=barrier, results=results):
            barrier.wait()
            try:
                results.append(c.core.allocate(request))
            except StoreError as exc:  # lost a compare-and-set while completing the winner's record
                results.append(exc)

        threads = [threading.Thread(target=allocate, args=(c,)) for c in cores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        records = view.records()
        assert list(records) == [f"dup-{round_}"], records
        winner = records[f"dup-{round_}"]["allocation"]
        assert {r.id for r in results if not isinstance(r, Exception)} == {winner}, results
        again = cores[round_ % 2].core.allocate(request)
        assert (again.id, again.state) == (winner, State.ACTIVE)
        assert view.shares() == [winner]
        cores[0].core.release(winner)
        cores[0].store.forget(winner)
        assert view.shares() == [] and view.records() == {}


def _controller_process(control_plane, namespace, pki, fault: str, log: Path) -> subprocess.Popen:
    """`fastshare k8s controller` that kills itself (SIGKILL) at ``fault``. Its lease lasts 10 s: with
    3 s (a renewal due within 2 s) a loaded machine made it lose leadership before its first pass."""
    exe = shutil.which("fastshare") or str(Path(sys.executable).parent / "fastshare")
    args = [exe, "k8s", "controller", "--kubeconfig", str(control_plane.kubeconfig),
            "--namespace", namespace, "--lease-namespace", namespace, "--identity", "doomed",
            "--tls-dir", str(pki[0] / "controller"), "--lease-duration", "10", "--node-interval", "0.5",
            "--api-port", "0"]
    return subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, faults.ENV: fault})


# Every crash point an allocation passes (the release points are covered by the core's tests).
ALLOCATE_FAULTS = [p for p in faults.POINTS if "release" not in p]


@pytest.mark.parametrize("fault", ALLOCATE_FAULTS)
def test_controller_killed_between_record_and_pod_leaks_nothing(
        control_plane, api_client, namespace, controller, agents, pki, tmp_path, fault):
    """kill -9 of a real controller process after the record was created and before the Pod:
    the next controller finishes or rolls the replica back, and no share is left over."""
    view = View(api_client, namespace, "crash", agents, pki[1])
    manifest = fastpod_manifest("crash", {"kind": "mps", "memory": "2Gi"}, 2)
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    proc = _controller_process(control_plane, namespace, pki, fault, tmp_path / "controller.log")
    try:
        assert proc.wait(120) == -9, (tmp_path / "controller.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    records = view.records()
    assert [r["state"] for r in records.values()] in (["pending"], ["prepared"], ["active"])
    assert view.pods() == []
    crashed = next(iter(records.values()))["allocation"]
    assert (crashed in view.shares()) == (fault != "controller.after_commit")  # prepared after that

    controller().start()  # the restarted controller (a fresh process would rebuild the same way)
    wait_for(lambda: view.settled(2) and crashed not in view.shares() and crashed not in
             {r["allocation"] for r in view.records().values()}, "crashed replica rolled back", timeout=120)
    assert len(view.shares()) == 2


def test_an_agent_that_dies_after_registering_is_marked_unavailable(api_client, namespace, controller, agents,
                                                                    pki):
    """The Node sync pings registered agents as their heartbeat: one that stops answering must
    miss its heartbeats (and get no new work), not be counted as seen before the ping failed."""
    c = controller()
    c.sync_nodes()
    name = agents["h100"].name
    assert c.store.get_node(name).available
    agents["h100"].stop(kill=True)
    try:
        def unavailable():
            c.sync_nodes()
            return not c.store.get_node(name).available

        wait_for(unavailable, "the dead agent's node unavailable", timeout=20)  # heartbeat_timeout is 3 s
        assert c.store.get_node(agents["v100"].name).available
    finally:
        agents["h100"].start(pki[1])
    wait_for(lambda: (c.sync_nodes(), c.store.get_node(name).available)[1], "available again", timeout=30)


def test_agents_registering_in_one_sync_queue_every_fastpod_once(api_client, namespace, controller, agents):
    """Queueing every FastPod lists every FastPod and every allocation record from the API; a
    controller's start registers every agent in one sync, and did it once per agent."""
    c = controller()
    queued = []
    queue_all = c.queue_all
    c.queue_all = lambda: (queued.append(1), queue_all())
    c.sync_nodes()
    assert all(c.store.get_node(a.name).available for a in agents.values())
    assert len(queued) == 1, f"{len(queued)} listings for {len(agents)} registrations"
    c.sync_nodes()   # nothing registered
    assert len(queued) == 1


def test_the_periodic_syncs_read_the_nodes_from_a_watch_and_see_one_labelled_since(
        api_client, namespace, controller, agents, pki):
    """Each sync listed every GPU Node object (117 MB and ~5 CPU s at 10,000 real Nodes): the
    periodic ones now read the watch's cache, which a Node labelled later enters, and leaves
    when deleted."""
    c = controller()
    core = client.CoreV1Api(api_client)
    listings = []
    list_node = c.pods.list_node
    c.pods.list_node = lambda *a, **kw: (listings.append(kw.get("watch", False)), list_node(*a, **kw))[1]
    late = started_agent(core, pki, "late", ["L4"])
    core.patch_node(late.name, {"metadata": {"labels": {"fastshare.io/gpu": None}}})
    try:
        c.start()
        assert c.store.get_node(late.name) is None   # not a GPU node yet
        assert all(c.store.get_node(a.name).available for a in agents.values())
        listings.clear()
        core.patch_node(late.name, {"metadata": {"labels": {"fastshare.io/gpu": "true"}}})
        wait_for(lambda: c.store.get_node(late.name) is not None and c.store.get_node(late.name).available,
                 "the node labelled since the start registered by a periodic sync", timeout=30)
        time.sleep(2.0)   # four more syncs
        assert listings.count(False) <= 1, f"{listings.count(False)} listings of the Nodes after the start"
        late.stop(kill=True)
        core.delete_node(late.name)
        wait_for(lambda: c.store.get_node(late.name) is None, "the deleted node forgotten", timeout=30)
    finally:
        late.stop()
        with contextlib.suppress(client.ApiException):
            core.delete_node(late.name)

def test_a_hung_agent_does_not_make_the_others_miss_their_heartbeats(api_client, namespace, controller,
                                                                     agents):
    """The Node sync pings the agents as their heartbeats. One that does not answer (SIGSTOP: its
    connection stays open) holds its ping for a whole deadline (10 s here); the agents pinged
    before it were judged after that wait, past the 3 s heartbeat timeout, and taken for
    unavailable although they had answered. The same in the running controller, whose reconcile
    pass (in the same thread as the sync) waited another deadline on the hung agent."""
    c = controller()
    c.sync_nodes()
    hung, healthy = agents["v100"], agents["h100"]
    assert healthy.name < hung.name   # listed, and pinged, first
    os.kill(hung.proc.pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        for _ in range(3):
            c.sync_nodes()
            assert c.store.get_node(healthy.name).available, f"{time.monotonic() - began:.1f} s in"
        assert time.monotonic() - began < 10, "each sync waited for the hung agent"
        wait_for(lambda: (c.sync_nodes(), not c.store.get_node(hung.name).available)[1],
                 "the hung agent's node unavailable", 30)
        c.start()
        began = time.monotonic()
        while time.monotonic() - began < 15:
            assert c.store.get_node(healthy.name).available, f"{time.monotonic() - began:.1f} s after start"
            time.sleep(0.2)
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
    wait_for(lambda: (c.sync_nodes(), c.store.get_node(hung.name).available)[1], "the agent back", timeout=30)


@pytest.mark.parametrize("phase", ["Failed", "Succeeded"])
def test_a_replica_whose_pod_terminated_is_replaced_and_its_share_released(
        api_client, namespace, controller, agents, pki, phase):
    """An evicted (Failed) or exited (Succeeded) Pod runs nothing any more: like a ReplicaSet,
    the controller replaces it, and the GPU share it held goes back instead of staying held by
    a dead Pod for good. Replacements that end again wait longer each time (say, a kubelet
    refusing every Pod for lack of CPU), and the Scheduled condition says why."""
    controller().start()
    view = View(api_client, namespace, "ended", agents, pki[1])
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 fastpod_manifest("ended", {"kind": "mps", "memory": "2Gi"}))
    wait_for(lambda: view.settled(1), "1 replica running", timeout=120)

    def end(pod):
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        view.core.patch_namespaced_pod_status(pod, namespace, {"status": {
            "phase": phase, "reason": "Evicted" if phase == "Failed" else None,
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}]}})

    def replaced(dead, dead_share):
        pods = [p.metadata.name for p in view.pods(include_terminating=True)]
        shares = view.shares()
        done = len(pods) == 1 and dead not in pods and dead_share not in shares and len(shares) == 1
        return done and pods[0]

    first = view.pods()[0].metadata.name
    first_share = view.active()[first]["allocation"]
    end(first)
    second = wait_for(lambda: replaced(first, first_share), "the ended replica replaced, its share released",
                      timeout=60)
    second_share = wait_for(lambda: view.active().get(second, {}).get("allocation"), "its share")
    end(second)   # before it was ever ready: its replacement waits longer

    def backing_off():
        conditions = (view.fastpod().get("status") or {}).get("conditions") or []
        scheduled = next(c for c in conditions if c["type"] == "Scheduled")
        return scheduled["reason"] == "BackOff" and scheduled

    assert second in wait_for(backing_off, "BackOff", timeout=30)["message"]
    wait_for(lambda: replaced(second, second_share), "replaced again", timeout=60)
    wait_for(lambda: view.settled(1), "the replacement running", timeout=60)
    view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "ended")
    wait_for(lambda: (kubelet_step(view.core, namespace), view.shares() == [])[1], "released", timeout=120)


def test_a_fastpod_whose_finalizer_was_removed_by_hand_leaks_no_share(
        api_client, namespace, controller, agents, pki):
    """A FastPod stuck deleting (its Pod hangs on a node whose kubelet is gone) whose finalizer an
    operator removes: the FastPod vanishes before the controller released its shares. Once the
    Pod is gone, the share it held must still be released and its record removed, not held by
    nothing for good (also by a controller started afterwards)."""
    first = controller()
    first.start()
    view = View(api_client, namespace, "forced", agents, pki[1])
    manifest = fastpod_manifest("forced", {"kind": "mps", "memory": "2Gi"}, 2)
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    wait_for(lambda: view.settled(2), "2 replicas running", timeout=120)
    view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "forced")
    wait_for(lambda: all(p.metadata.deletion_timestamp for p in view.pods(include_terminating=True)),
             "the controller deleting the pods (no kubelet finishes it)", timeout=60)
    view.objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "forced",
                                                {"metadata": {"finalizers": None}})
    first.stop()  # the one replica is cleaned up after a restart, the other one live
    survivor, doomed = sorted(p.metadata.name for p in view.pods(include_terminating=True))
    view.core.delete_namespaced_pod(doomed, namespace, grace_period_seconds=0)
    controller().start()
    wait_for(lambda: len(view.shares()) == 1 and list(view.records()) == [survivor],
             "the share of the Pod gone while no controller ran released", timeout=60)
    kubelet_step(view.core, namespace)
    wait_for(lambda: (view.shares(), view.records(), view.pods(include_terminating=True)) == ([], {}, []),
             "every share released and record removed", timeout=60)


def test_a_share_stays_held_while_its_orphaned_pod_still_exists(
        api_client, namespace, controller, agents, pki):
    """``kubectl delete --cascade=orphan``: the garbage collector strips the owner reference from
    the replica Pods while the FastPod waits on its finalizer. The Pods still run on their GPU
    shares: a share must not be released (and handed to someone else) before its Pod is gone.
    The controller deletes such a Pod (nothing else would release its share later), and only
    then releases the share and drops its finalizer."""
    first = controller()
    first.start()
    view = View(api_client, namespace, "orphaned", agents, pki[1])
    manifest = fastpod_manifest("orphaned", {"kind": "mps", "memory": "2Gi"}, 1)
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    wait_for(lambda: view.settled(1), "1 replica running", timeout=120)
    share = view.shares()
    first.stop()
    view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "orphaned",
                                                 propagation_policy="Orphan")
    (pod,) = view.pods()
    view.core.patch_namespaced_pod(pod.metadata.name, namespace,   # the garbage collector's part
                                   {"metadata": {"ownerReferences": None}})
    controller().start()
    time.sleep(5)   # several passes
    assert view.shares() == share, "the share was released while its pod still exists"
    wait_for(lambda: view.pods(include_terminating=True)[0].metadata.deletion_timestamp is not None,
             "the orphaned pod deleted", timeout=60)
    kubelet_step(view.core, namespace)
    wait_for(lambda: view.shares() == [] and view.records() == {}, "released once the pod is gone",
             timeout=60)
    wait_for(lambda: FINALIZER not in (view.fastpod()["metadata"].get("finalizers") or []),
             "the controller's finalizer removed", timeout=60)


def test_a_template_edit_is_not_rolled_out_but_the_status_counts_the_outdated_replicas(
        api_client, namespace, controller, agents, pki):
    """Running replicas keep the template they were made from (a template edit is not rolled
    out), but nothing said which ones run an old one: each replica Pod now carries its
    template's hash (label fastshare.io/template-hash), the status the current one and how many
    live replicas run another (outdatedReplicas)."""
    controller().start()
    view = View(api_client, namespace, "edited", agents, pki[1])
    manifest = fastpod_manifest("edited", {"kind": "mps", "memory": "2Gi"}, 2)
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    wait_for(lambda: view.settled(2), "2 replicas running", timeout=120)
    status = view.fastpod()["status"]
    assert status["outdatedReplicas"] == 0
    assert {p.metadata.labels[TEMPLATE_HASH_LABEL] for p in view.pods()} == {status["templateHash"]}
    first = sorted(p.metadata.name for p in view.pods())

    view.objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "edited", {
        "spec": {"template": {"metadata": {"annotations": {"example.com/edited": "yes"}}}}})

    def seen():
        fp = view.fastpod()
        return fp["status"].get("observedGeneration") == fp["metadata"]["generation"] and fp["status"]
    edited = wait_for(seen, "the edit seen")
    assert edited["templateHash"] != status["templateHash"]
    assert edited["outdatedReplicas"] == 2
    assert sorted(p.metadata.name for p in view.pods()) == first   # not rolled out

    view.scale(3)
    wait_for(lambda: view.settled(3), "3 replicas running", timeout=120)
    assert view.fastpod()["status"]["outdatedReplicas"] == 2
    [new] = [p for p in view.pods() if p.metadata.name not in first]
    assert new.metadata.labels[TEMPLATE_HASH_LABEL] == edited["templateHash"]
    assert new.metadata.annotations["example.com/edited"] == "yes"


def _whole_l4_fastpod(view, namespace: str, name: str, replicas: int, what: str, timeout: float) -> None:
    """A FastPod of ``replicas`` replicas of one whole L4 each, created and waited for until they run."""
    whole = {"kind": "whole", "count": 1, "models": ["L4"]}
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 fastpod_manifest(name, whole, replicas))
    wait_for(lambda: view.settled(replicas), what, timeout=timeout)


def test_a_gpu_removed_from_a_node_keeps_the_replicas_on_the_others_held_on_their_gpus(
        api_client, namespace, controller, pki):
    """One of a node's three GPUs is taken out and the host boots without it: NVML numbers the
    GPU after it anew (GPU 2 is GPU 1 now). In-cluster the agent comes back at the same address,
    so the controller takes the new GPU set from its inventory. Allocations were tied to GPUs
    by index: the replica on old GPU 2 was dropped from the placement engine while its record
    stayed active (naming GPU 2), and the replacement of the replica whose GPU went was placed
    on its GPU, held already. Now the records follow their GPUs by UUID and the replacement is
    unschedulable: no GPU is idle."""
    tls = pki[1]
    core = client.CoreV1Api(api_client)
    agent = started_agent(core, pki, "l4", ["L4"] * 3)
    view = View(api_client, namespace, "boards", {"l4": agent}, tls)
    try:
        controller().start()
        _whole_l4_fastpod(view, namespace, "boards", 3, "3 whole-GPU replicas", timeout=180)
        on = {r["record"]["devices"][0]["gpu_index"]: r["record"] for r in view.records().values()}
        assert sorted(on) == [0, 1, 2]

        agent.stop()
        assert simnvml.remove_gpu(agent.machine, 1) == on[1]["devices"][0]["gpu_uuid"]
        agent.start(tls)

        def followed():
            kubelet_step(view.core, namespace)
            held = {r["allocation"]: r["record"]["devices"] for r in view.records().values()
                    if r["state"] == "active"}
            return (view.shares() == sorted([on[0]["id"], on[2]["id"]])
                    and held.get(on[0]["id"]) == on[0]["devices"]
                    and held.get(on[2]["id"]) == [{**on[2]["devices"][0], "gpu_index": 1}])
        wait_for(followed, "the replicas on the GPUs left keep them, under their new indexes", timeout=120)

        def unschedulable():
            kubelet_step(view.core, namespace)
            conditions = {c["type"]: c for c in (view.fastpod().get("status") or {}).get("conditions") or []}
            scheduled = conditions.get("Scheduled")
            return scheduled and scheduled["reason"] == "Unschedulable" and scheduled
        condition = wait_for(unschedulable, "the replacement replica unschedulable", timeout=120)
        assert "idle" in condition["message"], condition
        assert view.shares() == sorted([on[0]["id"], on[2]["id"]])
    finally:
        try:
            with contextlib.suppress(client.ApiException):   # not created
                view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "boards")
            wait_for(lambda: (kubelet_step(view.core, namespace), agent.shares(tls) == [])[1], "released",
                     timeout=120)
        finally:   # also when the test failed: a leftover agent would outlive the run
            agent.stop()
            core.delete_node(agent.name)


def test_mig_mode_turned_on_under_a_fastpod_replica_keeps_its_gpu_held_and_says_why(
        api_client, namespace, controller, pki):
    """`nvidia-smi -mig 1` on a GPU holding a fastpod replica's share. In-cluster the agent's
    changed inventory reaches the controller through the reconciler; the share was then dropped
    from the placement engine (only logged) while its record stayed active, and an exclusive
    FastPod got a MIG slice on that GPU. Now the share stays counted, the replica's status entry
    says it is over-committed and why, and the exclusive replica is unschedulable."""
    tls = pki[1]
    model = "A100-SXM4-80GB"
    core = client.CoreV1Api(api_client)
    agent = started_agent(core, pki, "a100", [model])
    view = View(api_client, namespace, "shared", {"a100": agent}, tls)
    sliced = View(api_client, namespace, "sliced", {"a100": agent}, tls)
    try:
        controller().start()
        fastpod = {"kind": "fastpod", "smPercent": 50, "memory": "4Gi", "models": [model]}
        view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                     fastpod_manifest("shared", fastpod, 1))
        wait_for(lambda: view.settled(1), "the fastpod replica", timeout=180)

        state = json.loads(agent.machine.read_text())
        state["gpus"][0]["mig_current"] = state["gpus"][0]["mig_pending"] = 1
        agent.machine.write_text(json.dumps(state))

        def noted():
            kubelet_step(view.core, namespace)
            entry = next(iter(view.active().values()), {})
            return "over-committed" in entry.get("reason", "") and entry["reason"]
        reason = wait_for(noted, "the replica's entry says it is over-committed", timeout=120)
        assert "GPU 0" in reason and "in MIG mode" in reason, reason

        exclusive = {"kind": "exclusive", "migProfile": "1g.10gb", "models": [model]}
        sliced.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                       fastpod_manifest("sliced", exclusive, 1))

        def unschedulable():
            kubelet_step(view.core, namespace)
            status = sliced.fastpod().get("status") or {}
            conditions = {c["type"]: c for c in status.get("conditions") or []}
            scheduled = conditions.get("Scheduled")
            return scheduled and scheduled["reason"] == "Unschedulable" and scheduled
        wait_for(unschedulable, "the exclusive replica unschedulable", timeout=120)
        assert len(agent.shares(tls)) == 1 and not sliced.records()
    finally:
        try:
            for name in ("shared", "sliced"):
                with contextlib.suppress(client.ApiException):   # not created
                    view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            wait_for(lambda: (kubelet_step(view.core, namespace), agent.shares(tls) == [])[1], "released",
                     timeout=120)
        finally:   # also when the test failed: a leftover agent would outlive the run
            agent.stop()
            core.delete_node(agent.name)


def test_more_hung_agents_than_ping_threads_do_not_make_the_others_miss_their_heartbeats(
        api_client, namespace, controller, agents, monkeypatch):
    """Each ping held a pool thread until answered: as many hung agents as the pool has threads
    (32: a rack cut off) held every thread a deadline, and the other nodes' pings queued behind
    them, past their heartbeat timeout, so every node was taken for unavailable. Here with one
    thread and two hung agents (listeners that never speak), whose Nodes are listed first."""
    monkeypatch.setattr(k8s_controller, "PING_THREADS", 1)
    c = controller()
    c.sync_nodes()
    core = client.CoreV1Api(api_client)
    hung = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    names = [f"a-hung-{i}-{uuid.uuid4().hex[:4]}" for i in range(len(hung))]
    try:
        for name, listener in zip(names, hung, strict=True):
            register_node(core, SimpleNamespace(name=name, address=f"127.0.0.1:{listener.getsockname()[1]}"))
        began = time.monotonic()
        while time.monotonic() - began < 15:   # heartbeat timeout 3 s, deadline 10 s
            c.sync_nodes()
            for agent in agents.values():
                assert c.store.get_node(agent.name).available, f"{time.monotonic() - began:.1f} s in"
            time.sleep(0.5)
        assert not any(c.core.is_available(name) for name in names)
    finally:
        for name in names:
            with contextlib.suppress(client.ApiException):
                core.delete_node(name)
        for listener in hung:
            listener.close()


def test_a_deleted_node_whose_agent_hangs_does_not_hold_up_the_sync(api_client, namespace, controller,
                                                                     agents):
    """A node whose Node object is gone is forgotten once its agent does not answer a ping. The
    sync pinged such nodes itself, one after another: one whose host hangs (here a listener that
    never speaks) held the sync for a whole deadline (10 s), and every healthy node missed its
    heartbeats meanwhile (timeout 3 s)."""
    c = controller()
    c.sync_nodes()
    gone = f"gone-{uuid.uuid4().hex[:4]}"
    with socket.create_server(("127.0.0.1", 0)) as silent:
        c.core.put_node(Node(name=gone, address=f"127.0.0.1:{silent.getsockname()[1]}", available=False))
        began = time.monotonic()
        c.sync_nodes()
        took = time.monotonic() - began
        assert took < 3, f"the sync took {took:.1f} s (deadline 10 s, heartbeat timeout 3 s)"
        assert all(c.store.get_node(a.name).available for a in agents.values())
        wait_for(lambda: (c.sync_nodes(), c.store.get_node(gone) is None)[1], "the gone node forgotten", 30)
    assert all(c.store.get_node(a.name).available for a in agents.values())


def test_a_replica_on_a_node_deleted_from_the_cluster_is_replaced_and_its_share_ended(
        api_client, namespace, controller, pki):
    """A GPU node is decommissioned: its machine goes (the agent with it), its Node object is
    deleted and the Pod GC deletes the Pods bound to it. The replica's share could only be
    released through the agent, which is gone: its record stayed ``releasing`` for good, the
    release was retried every pass, and deleting the FastPod (or its namespace) hung on the
    finalizer. Now a node whose Node object is gone and whose agent does not answer is
    forgotten: its shares end (nothing is asked of it), the replica is replaced elsewhere and
    the FastPod can be deleted."""
    root, tls = pki
    spare = Agent(root, root / "ca", f"spare-{uuid.uuid4().hex[:4]}", ["L4"], mig=False)
    core = client.CoreV1Api(api_client)
    doomed = started_agent(core, pki, "gone", ["L4"])
    view = View(api_client, namespace, "nomad", {"doomed": doomed}, tls)
    try:
        c = controller()
        c.start()
        _whole_l4_fastpod(view, namespace, "nomad", 1, "the replica on the doomed node", timeout=120)
        [old] = view.records().values()
        assert old["node"] == doomed.name
        spare.start(tls)
        register_node(core, spare)
        view.agents = {"spare": spare}

        doomed.stop(kill=True)
        core.delete_node(doomed.name)
        for pod in view.pods():   # the Pod GC: Pods bound to a Node that no longer exists
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)

        def replaced():
            kubelet_step(view.core, namespace)
            records = view.records()
            return (view.settled(1) and old["allocation"] not in {r["allocation"] for r in records.values()}
                    and [r["node"] for r in records.values()] == [spare.name])
        wait_for(replaced, "the replica replaced on the spare node, the gone node's share ended", timeout=90)
        wait_for(lambda: c.store.get_node(doomed.name) is None, "the gone node forgotten")

        view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "nomad")

        wait_for(view.fastpod_gone, "the FastPod deleted", timeout=60)
        assert spare.shares(tls) == []
    finally:
        with contextlib.suppress(client.ApiException):
            view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "nomad")
        for agent in (doomed, spare):
            agent.stop()
            with contextlib.suppress(client.ApiException):
                core.delete_node(agent.name)


def test_a_node_deleted_while_the_controller_was_down_does_not_hold_its_shares(
        api_client, namespace, controller, pki):
    """As above, but the node goes while no controller runs: the new one learns nodes from the
    labelled Node objects only, so the record's node was unknown to it and its release failed
    on every pass (no address to ask) while the FastPod's deletion waited. Now it is ended."""
    tls = pki[1]
    core = client.CoreV1Api(api_client)
    doomed = started_agent(core, pki, "gone", ["L4"])
    view = View(api_client, namespace, "lost", {"doomed": doomed}, tls)
    try:
        first = controller()
        first.start()
        _whole_l4_fastpod(view, namespace, "lost", 1, "the replica on the doomed node", timeout=120)
        first.stop()
        doomed.stop(kill=True)
        core.delete_node(doomed.name)
        for pod in view.pods():   # the Pod GC
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        view.agents = {}
        view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "lost")
        second = controller()
        second.start()

        wait_for(view.fastpod_gone, "the FastPod deleted", timeout=60)
        wait_for(lambda: view.records() == {}, "its allocation record gone")
        wait_for(lambda: second.store.get_node(doomed.name) is None, "the gone node not kept")
    finally:
        with contextlib.suppress(client.ApiException):
            view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "lost")
        doomed.stop()
        with contextlib.suppress(client.ApiException):
            core.delete_node(doomed.name)


def test_an_invalid_template_edit_of_a_running_fastpod_is_refused_by_name(api_client, namespace, controller,
                                                                          agents, pki):
    """Its template edited while every replica runs (here: it asks the device plugin for a GPU).
    The template was checked only when a replica was missing, so the status said the new
    generation was observed and Scheduled=True until a replica died and could not be replaced.
    Now the edit is checked when it is seen: Scheduled=False, Invalid, naming the field; the
    replica running keeps its Pod and share. Put right, it is Scheduled again."""
    controller().start()
    view = View(api_client, namespace, "edited", agents, pki[1])
    mps = {"kind": "mps", "memory": "4Gi"}
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 fastpod_manifest("edited", mps))
    wait_for(lambda: view.settled(1), "the replica running", timeout=120)
    [pod] = view.pods()
    share = view.shares()

    def scheduled(generation):
        status = view.fastpod().get("status") or {}
        condition = next((c for c in status.get("conditions") or [] if c["type"] == "Scheduled"), None)
        return (status.get("observedGeneration") == generation and condition is not None
                and condition["observedGeneration"] == generation and condition)

    def container_limits(limits):
        main = {"name": "main", "image": "busybox", "command": ["sleep", "inf"],
                "resources": {"limits": limits}}
        return {"spec": {"template": {"spec": {"containers": [main]}}}}

    edited = view.objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "edited",
                                                         container_limits({"nvidia.com/gpu": "1"}))
    condition = wait_for(lambda: scheduled(edited["metadata"]["generation"]), "the edit observed", timeout=60)
    assert (condition["status"], condition["reason"]) == ("False", "Invalid"), condition
    assert "spec.template.spec.containers[0].resources.limits" in condition["message"], condition
    assert [p.metadata.name for p in view.pods()] == [pod.metadata.name] and view.shares() == share

    fixed = view.objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "edited",
                                                        container_limits({"cpu": "1"}))
    condition = wait_for(lambda: scheduled(fixed["metadata"]["generation"]), "the fix observed", timeout=60)
    assert (condition["status"], condition["reason"]) == ("True", "Scheduled"), condition
    assert [p.metadata.name for p in view.pods()] == [pod.metadata.name] and view.shares() == share


def test_a_release_on_a_node_this_controller_does_not_know_waits_and_the_fastpod_goes_on(
        api_client, namespace, controller, pki):
    """A GPU node's label is taken off while a replica runs there, and the controller restarts:
    the new one knows only labelled nodes, so it has no address for that replica's agent. When
    the replica is scaled away its release failed with AttributeError on every pass, and the
    whole FastPod's pass with it (status never written again). Now the share stays releasing,
    the pass goes on, and once the node is labelled again the release finishes."""
    tls = pki[1]
    core = client.CoreV1Api(api_client)
    agent = started_agent(core, pki, "unl", ["L4"])
    view = View(api_client, namespace, "unlabelled", {"l4": agent}, tls)
    try:
        first = controller()
        first.start()
        _whole_l4_fastpod(view, namespace, "unlabelled", 1, "the replica running", timeout=120)
        [held] = agent.shares(tls)
        first.stop()
        core.patch_node(agent.name, {"metadata": {"labels": {"fastshare.io/gpu": None}}})
        controller().start()
        view.scale(0)

        def releasing():
            kubelet_step(view.core, namespace)
            status = view.fastpod().get("status") or {}
            states = [e["state"] for e in status.get("assignments") or []]
            return view.pods(include_terminating=True) == [] and status.get("replicas") == 0 and states == [
                "releasing"]
        wait_for(releasing, "the scale-down shown, the share releasing", timeout=60)
        assert agent.shares(tls) == [held]

        core.patch_node(agent.name, {"metadata": {"labels": {"fastshare.io/gpu": "true"}}})
        wait_for(lambda: view.settled(0) and agent.shares(tls) == [], "released once the node is back",
                 timeout=60)
    finally:
        with contextlib.suppress(client.ApiException):
            core.patch_node(agent.name, {"metadata": {"labels": {"fastshare.io/gpu": "true"}}})
        with contextlib.suppress(client.ApiException):
            view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "unlabelled")
        with contextlib.suppress(Exception):
            wait_for(lambda: (kubelet_step(view.core, namespace), agent.shares(tls) == [])[1], "released",
                     timeout=60)
        agent.stop()
        with contextlib.suppress(client.ApiException):
            core.delete_node(agent.name)


def test_a_replica_that_keeps_ending_for_days_still_backs_off(api_client, namespace, controller, agents, pki):
    """Replicas that end again and again (an exiting command, a kubelet refusing every Pod) wait
    2^(n-1) s, at most 300 s. The power was taken before the cap: after 1,025 ends in a row
    (about three and a half days at 300 s) it overflowed, and every pass of the FastPod failed
    with OverflowError from then on. Now it keeps waiting 300 s."""
    c = controller()
    c.start()
    view = View(api_client, namespace, "looping", agents, pki[1])
    mps = {"kind": "mps", "memory": "2Gi"}
    view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 fastpod_manifest("looping", mps))
    wait_for(lambda: view.settled(1), "1 replica running", timeout=120)
    [pod] = view.pods()

    def status(phase, ready):
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        view.core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": {
            "phase": phase, "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": now}]}})

    status("Running", "False")   # not ready: no pass forgets the history set below
    wait_for(lambda: (view.fastpod().get("status") or {}).get("readyReplicas") == 0, "not ready seen")
    c._ended[view.fastpod()["metadata"]["uid"]] = (1024, 0.0, "pod earlier Failed")
    status("Failed", "False")

    def backing_off():
        conditions = (view.fastpod().get("status") or {}).get("conditions") or []
        scheduled = next(c for c in conditions if c["type"] == "Scheduled")
        return scheduled["reason"] == "BackOff" and scheduled

    assert "waits 300 s" in wait_for(backing_off, "BackOff", timeout=30)["message"]
    view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "looping")
    wait_for(lambda: (kubelet_step(view.core, namespace), view.shares() == [])[1], "released", timeout=120)


def _delete_and_stop(view, namespace: str, name: str, agent, core, tls) -> None:
    """End of a one-agent test: the FastPod deleted and its shares released, then the agent
    stopped and its Node deleted (also when the release times out)."""
    try:
        with contextlib.suppress(client.ApiException):
            view.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        wait_for(lambda: (kubelet_step(view.core, namespace), agent.shares(tls) == [])[1], "released",
                 timeout=120)
    finally:
        agent.stop()
        core.delete_node(agent.name)


def test_an_exclusive_replica_whose_mig_slice_is_destroyed_by_hand_is_replaced(
        api_client, namespace, controller, pki, caplog):
    """A replica's MIG slice destroyed by hand (nvidia-smi mig -dci/-dgi) while its agent runs: the
    share stayed ready and the replica kept running on a device that no longer existed. Now the
    agent drops the share, the controller ends the allocation failed naming the slice, and the
    replica is replaced on a new slice (its Pod, whose env names the old slice, deleted)."""
    import logging

    from fastshare.device import open_devices

    tls = pki[1]
    core = client.CoreV1Api(api_client)
    agent = started_agent(core, pki, "sliced", ["A100-SXM4-80GB"], mig=True,
                          settings={"reconcile_interval_s": 1})
    view = View(api_client, namespace, "sliced", {"sliced": agent}, tls)
    caplog.set_level(logging.WARNING, logger="fastshare.controller")
    try:
        controller().start()
        view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fastpod_manifest(
            "sliced", {"kind": "exclusive", "migProfile": "3g.40gb", "models": ["A100-SXM4-80GB"]}, 1))
        wait_for(lambda: view.settled(1), "the exclusive replica", timeout=180)
        ((pod_name, old),) = view.active().items()
        with open_devices("sim", agent.machine) as devices:
            (instance,) = [m for m in devices.mig_instances(0) if m.uuid == old["migUUID"]]
            devices.destroy_mig_instance(0, instance.start)

        def replaced():
            if not view.settled(1):
                return False
            ((name, entry),) = view.active().items()
            return name != pod_name and entry["allocation"] != old["allocation"] and entry
        new = wait_for(replaced, "the replica replaced on a new slice", timeout=120)
        assert new["migUUID"] != old["migUUID"] and view.shares() == [new["allocation"]]
        assert any(old["allocation"] in r.getMessage() and "device gone" in r.getMessage()
                   and old["migUUID"] in r.getMessage() for r in caplog.records), caplog.text
    finally:
        _delete_and_stop(view, namespace, "sliced", agent, core, tls)


def test_a_gpu_lost_under_a_replica_ends_its_share_and_the_replacement_waits_saying_so(
        api_client, namespace, controller, pki, caplog):
    """GPU 1 of two falls off the bus while a whole-GPU replica holds each: NVML keeps counting it
    but calls on it raise GPU_IS_LOST. The agent's whole device read failed, so its inventory and
    housekeeping failed every round. Now its share ends failed naming the GPU, the replica on
    GPU 0 keeps running, and the replacement is unschedulable saying a GPU is lost."""
    import logging

    tls = pki[1]
    core = client.CoreV1Api(api_client)
    agent = started_agent(core, pki, "lostbus", ["L4"] * 2, settings={"reconcile_interval_s": 1})
    view = View(api_client, namespace, "lostbus", {"lostbus": agent}, tls)
    caplog.set_level(logging.WARNING, logger="fastshare.controller")
    try:
        controller().start()
        _whole_l4_fastpod(view, namespace, "lostbus", 2, "2 whole-GPU replicas", timeout=180)
        on = {r["record"]["devices"][0]["gpu_index"]: r["record"] for r in view.records().values()}
        assert sorted(on) == [0, 1]
        lost_uuid = simnvml.lose_gpu(agent.machine, 1)
        assert lost_uuid == on[1]["devices"][0]["gpu_uuid"]

        def unschedulable():
            kubelet_step(view.core, namespace)
            conditions = {c["type"]: c for c in (view.fastpod().get("status") or {}).get("conditions") or []}
            scheduled = conditions.get("Scheduled")
            return scheduled and scheduled["reason"] == "Unschedulable" and scheduled
        condition = wait_for(unschedulable, "the replacement replica unschedulable", timeout=120)
        assert "lost (fell off the bus?)" in condition["message"], condition
        assert view.shares() == [on[0]["id"]]
        assert any(on[1]["id"] in r.getMessage() and "device gone" in r.getMessage()
                   and lost_uuid in r.getMessage() and "lost (fell off the bus?)" in r.getMessage()
                   for r in caplog.records), caplog.text
    finally:
        _delete_and_stop(view, namespace, "lostbus", agent, core, tls)


def test_a_gpu_whose_mig_mode_change_is_pending_takes_no_replica_saying_why(
        api_client, namespace, controller, pki):
    """`nvidia-smi -mig 1` on an A100 waits for a GPU reset. In-cluster the controller placed a
    fastpod replica there all the same (it lost the GPU at the reset). Now the replica is
    unschedulable, its condition saying the MIG mode change is pending and how to end it."""
    root, tls = pki
    model = "A100-SXM4-80GB"
    core = client.CoreV1Api(api_client)
    agent = Agent(root, root / "ca", f"migpend-{uuid.uuid4().hex[:4]}", [model], mig=False)
    state = json.loads(agent.machine.read_text())
    state["gpus"][0]["mig_pending"] = 1   # MIG enabled, pending until a GPU reset
    agent.machine.write_text(json.dumps(state))
    agent.start(tls)
    register_node(core, agent)
    view = View(api_client, namespace, "migpend", {agent.name: agent}, tls)
    try:
        controller().start()
        fastpod = {"kind": "fastpod", "smPercent": 50, "memory": "4Gi", "models": [model]}
        view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                     fastpod_manifest("migpend", fastpod, 1))

        def unschedulable():
            kubelet_step(view.core, namespace)
            conditions = {c["type"]: c for c in (view.fastpod().get("status") or {}).get("conditions") or []}
            scheduled = conditions.get("Scheduled")
            return scheduled and scheduled["reason"] == "Unschedulable" and scheduled
        condition = wait_for(unschedulable, "the replica unschedulable", timeout=120)
        assert (f"GPU 0 of {agent.name}: MIG mode change pending until the GPU is reset (nvidia-smi -r -i 0)"
                in condition["message"]), condition
        assert agent.shares(tls) == [] and not view.records()
    finally:
        _delete_and_stop(view, namespace, "migpend", agent, core, tls)


def test_a_replica_refused_because_its_gpu_closed_behind_the_controllers_back_is_placed_again(
        api_client, namespace, fastpod_crd, pki, caplog):
    """In-cluster as standalone (the same core): `fastshare mig enable` on an idle A100 the
    controller has not seen yet (no reconcile pass meanwhile). The replica's allocation placed there
    was refused by the agent and failed (the replica unscheduled, AgentUnavailable, until a later
    pass); now it is placed again at once on the other GPU, and the controller's view shows the
    first one pending."""
    import logging

    from fastshare.controller.agent_client import AgentClient, AgentTarget

    caplog.set_level(logging.INFO, logger="fastshare")

    root, tls = pki
    core = client.CoreV1Api(api_client)
    agent = Agent(root, root / "ca", f"replace-{uuid.uuid4().hex[:4]}", ["A100-SXM4-40GB"] * 2, mig=False)
    agent.start(tls)
    register_node(core, agent)
    view = View(api_client, namespace, "replace", {agent.name: agent}, tls)
    c = KubeController(api_client, AgentPool(tls, deadline=10.0),
                       KubeSettings(namespace=namespace, workers=3, node_interval=0.5, resync_interval=3,
                                    watch_timeout=10),
                       CoreSettings(heartbeat_timeout=3.0, reconcile_interval=3600.0, busy_wait=10.0))
    try:
        c.start()
        wait_for(lambda: c.core.node_facts(agent.name) is not None, "the node known", timeout=60)
        gpu0 = simnvml.load_machine(agent.machine)["gpus"][0]["uuid"]
        probe = AgentClient(AgentTarget(agent.name, agent.address), tls, deadline=30)
        try:   # an idle node's first whole GPU is GPU 0 (as the standalone tests show)
            assert probe.set_mig_mode(gpu0, True).pending
        finally:
            probe.close()
        assert not c.core.node_facts(agent.name).gpus[0].mig_change_pending
        view.objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fastpod_manifest(
            "replace", {"kind": "whole", "count": 1, "models": ["A100-SXM4-40GB"]}, 1))
        wait_for(lambda: view.settled(1), "the replica active", timeout=120)
        (entry,) = view.active().values()
        assert entry["gpuUUIDs"] != [gpu0], entry
        assert c.core.node_facts(agent.name).gpus[0].mig_change_pending
        said = [r.getMessage() for r in caplog.records]
        assert any("placed again" in m and "MIG mode change pending" in m for m in said), said
        assert not any("releasing it" in m for m in said), said   # no allocation compensated (failed)
    finally:
        try:
            _delete_and_stop(view, namespace, "replace", agent, core, tls)
        finally:
            c.stop()
            c.core.agents.close()
