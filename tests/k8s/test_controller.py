"""The in-cluster controller against the real API server, without GPUs or agents reachable:
finalizer, status, Unschedulable reasons, orphan pods, deletion, leader election.

(The full path through node agents is in test_controller_agents.py.)"""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest
from kubernetes import client

from fastshare.controller.agent_client import AgentError, AgentPool
from fastshare.controller.core import Settings as CoreSettings
from fastshare.k8s.controller import (
    ENDPOINT_ANNOTATION,
    KubeController,
    KubeSettings,
    run_with_leader_election,
)
from fastshare.k8s.leader import LeaderElector
from fastshare.k8s.pods import FASTPOD_LABEL
from fastshare.k8s.resources import FINALIZER, GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.security import certs
from fastshare.security.tls import TlsPaths

from .conftest import wait_for

MPS = {"kind": "mps", "memory": "2Gi"}


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsPaths:
    root = tmp_path_factory.mktemp("pki")
    certs.init_ca(root / "ca")
    certs.issue(root / "ca", "controller", root / "pki", sans=["127.0.0.1", "localhost"], role="controller")
    return TlsPaths.in_dir(root / "pki", "controller")


def _settings(namespace: str) -> KubeSettings:
    return KubeSettings(namespace=namespace, workers=2, node_interval=0.5, resync_interval=3,
                        watch_timeout=10)


def _core_settings() -> CoreSettings:
    return CoreSettings(heartbeat_timeout=3.0, reconcile_interval=2.0, busy_wait=10.0)


@pytest.fixture
def make_controller(api_client, fastpod_crd, tls):
    started: list[KubeController] = []

    def make(namespace: str) -> KubeController:
        controller = KubeController(api_client, AgentPool(tls, deadline=5.0), _settings(namespace),
                                    _core_settings())
        started.append(controller)
        return controller

    yield make
    for controller in started:
        controller.stop()
        controller.core.agents.close()


def _fastpod(objects, namespace, name):
    return objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def _condition(fastpod, kind):
    return next((c for c in (fastpod.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def test_without_gpu_nodes_a_fastpod_is_unschedulable_with_the_reason(api_client, namespace, make_controller):
    make_controller(namespace).start()
    objects = client.CustomObjectsApi(api_client)
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fastpod_manifest("a", MPS, 2))
    fp = wait_for(lambda: (f := _fastpod(objects, namespace, "a")) and _condition(f, "Scheduled") and f,
                  "Scheduled condition")
    scheduled = _condition(fp, "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    assert "no nodes" in scheduled["message"]
    assert FINALIZER in fp["metadata"]["finalizers"]
    assert fp["status"]["replicas"] == 0 and fp["status"]["readyReplicas"] == 0
    assert fp["status"]["selector"] == "app=a"
    assert _condition(fp, "Ready")["reason"] == "ReplicasNotReady"
    assert client.CoreV1Api(api_client).list_namespaced_pod(namespace).items == []


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def _gpu_node_with_dead_agent(api_client) -> tuple[str, client.CoreV1Api]:
    """A GPU Node whose agent endpoint answers nothing; its name and the core API."""
    node = f"gpu-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api_client)
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(
        name=node, labels={"fastshare.io/gpu": "true"}, annotations={ENDPOINT_ANNOTATION: _dead_endpoint()})))
    return node, core


def test_a_gpu_node_whose_agent_is_down_is_unschedulable(api_client, namespace, make_controller):
    node, core = _gpu_node_with_dead_agent(api_client)
    controller = make_controller(namespace)
    controller.start()
    assert controller.store.get_node(node).available is False
    objects = client.CustomObjectsApi(api_client)
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fastpod_manifest("b", MPS))
    fp = wait_for(lambda: (f := _fastpod(objects, namespace, "b")) and _condition(f, "Scheduled") and f,
                  "Scheduled condition")
    scheduled = _condition(fp, "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    assert scheduled["message"]
    core.delete_node(node)


def test_pods_without_a_share_are_deleted_and_deletion_waits_for_the_finalizer(api_client, namespace,
                                                                                make_controller):
    make_controller(namespace).start()
    objects = client.CustomObjectsApi(api_client)
    fp = objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 fastpod_manifest("c", MPS, replicas=0))
    wait_for(lambda: FINALIZER in (_fastpod(objects, namespace, "c")["metadata"].get("finalizers") or []),
             "finalizer")
    core = client.CoreV1Api(api_client)
    stray = client.V1Pod(
        metadata=client.V1ObjectMeta(
            name="c-stray", labels={FASTPOD_LABEL: "c", "app": "c"},
            owner_references=[client.V1OwnerReference(api_version=f"{GROUP}/{VERSION}", kind="FastPod",
                                                      name="c", uid=fp["metadata"]["uid"], controller=True)]),
        spec=client.V1PodSpec(containers=[client.V1Container(name="m", image="busybox")]))
    core.create_namespaced_pod(namespace, stray)
    wait_for(lambda: not core.list_namespaced_pod(namespace).items, "stray pod deleted")
    objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "c")

    def gone():
        try:
            _fastpod(objects, namespace, "c")
            return False
        except client.ApiException as exc:
            return exc.status == 404

    wait_for(gone, "FastPod deleted after its finalizer is removed")


def test_only_the_leader_runs_a_controller_and_a_standby_takes_over(api_client, namespace, make_controller):
    objects = client.CustomObjectsApi(api_client)
    lease = f"ctl-{uuid.uuid4().hex[:6]}"
    running: list[str] = []
    terms: list[str] = []
    stops = {name: threading.Event() for name in ("one", "two")}

    def factory(name):
        def make():
            controller = make_controller(namespace)
            original_stop = controller.stop

            def stop(timeout=30.0):
                if name in running:
                    running.remove(name)
                original_stop(timeout)

            controller.stop = stop
            running.append(name)
            terms.append(name)
            return controller
        return make

    threads = []
    for name, event in stops.items():
        elector = LeaderElector(api_client, namespace, lease, name, lease_duration=4, renew_deadline=3,
                                retry_period=0.3)
        thread = threading.Thread(target=run_with_leader_election, args=(factory(name), elector, event))
        thread.start()
        threads.append(thread)
    try:
        wait_for(lambda: len(running) == 1, "one leader")
        first = running[0]
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fastpod_manifest("d", MPS))
        wait_for(lambda: _condition(_fastpod(objects, namespace, "d"), "Scheduled"), "leader reconciled d")
        assert len(running) == 1
        stops[first].set()  # the leader shuts down cleanly and releases the lease
        wait_for(lambda: running and running[0] != first, "standby took over", timeout=60)
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fastpod_manifest("e", MPS))
        wait_for(lambda: _condition(_fastpod(objects, namespace, "e"), "Scheduled"), "the new leader acted")
        assert len(running) == 1
        assert terms == [first, next(n for n in stops if n != first)]
    finally:
        for event in stops.values():
            event.set()
        for thread in threads:
            thread.join(60)
    assert running == []


def test_an_unplaceable_fastpod_costs_one_attempt_per_pass_not_one_per_replica(api_client, namespace,
                                                                               make_controller):
    """Replicas are created through a slow-start window: the first failure stops the pass."""
    controller = make_controller(namespace)
    controller.podcache.replace([], "0")  # not started: no watch fills them
    controller.usage.replace(controller.peers.replacing([]))
    attempts = []
    allocate = controller.core.allocate
    controller.core.allocate = lambda *a, **k: (attempts.append(a), allocate(*a, **k))[1]
    objects = client.CustomObjectsApi(api_client)
    manifest = fastpod_manifest("many", MPS, 20)
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    assert controller.reconcile(namespace, "many") == 5.0  # retried later
    assert len(attempts) == 1
    assert _condition(_fastpod(objects, namespace, "many"), "Scheduled")["reason"] == "Unschedulable"


# Template fields the controller reads (nodeSelector) or rewrites (env, mounts, volumes,
# tolerations) in every container, written with a wrong type. The template's spec is otherwise
# free-form (x-kubernetes-preserve-unknown-fields).
ODD_TEMPLATES = {
    "nodeSelector-list": ("spec.template.spec.nodeSelector", lambda s: s.update(nodeSelector=["gpu"])),
    "tolerations-map": ("spec.template.spec.tolerations",
                        lambda s: s.update(tolerations={"key": "dedicated", "operator": "Exists"})),
    "tolerations-string": ("spec.template.spec.tolerations", lambda s: s.update(tolerations="all")),
    "initContainers-map": ("spec.template.spec.initContainers",
                           lambda s: s.update(initContainers={"name": "init", "image": "busybox"})),
    "initContainers-strings": ("spec.template.spec.initContainers",
                               lambda s: s.update(initContainers=["busybox"])),
    "env-map": ("spec.template.spec.containers[0].env", lambda s: s["containers"][0].update(env={"A": "1"})),
    "env-strings": ("spec.template.spec.containers[0].env",
                    lambda s: s["containers"][0].update(env=["A=1"])),
    "volumeMounts-string": ("spec.template.spec.containers[0].volumeMounts",
                            lambda s: s["containers"][0].update(volumeMounts="/data")),
    "volumes-strings": ("spec.template.spec.volumes", lambda s: s.update(volumes=["data"])),
}


@pytest.mark.parametrize("case", sorted(ODD_TEMPLATES))
def test_a_template_field_of_the_wrong_type_is_refused_by_name_not_a_controller_crash(
        api_client, namespace, make_controller, case):
    """Refused by the API server naming the field, or answered in the Scheduled condition; never
    an exception in every pass (retried for good, with no status for the user)."""
    field, spoil = ODD_TEMPLATES[case]
    controller = make_controller(namespace)
    controller.podcache.replace([], "0")  # not started: no watch fills them
    controller.usage.replace(controller.peers.replacing([]))
    objects = client.CustomObjectsApi(api_client)
    manifest = fastpod_manifest("odd", MPS)
    spoil(manifest["spec"]["template"]["spec"])
    try:
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    except client.ApiException as exc:
        assert exc.status == 422 and field in exc.body, exc.body
        return
    controller.reconcile(namespace, "odd")
    scheduled = _condition(_fastpod(objects, namespace, "odd"), "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "PodCreateFailed"), scheduled
    assert client.CoreV1Api(api_client).list_namespaced_pod(namespace).items == []


def test_the_lease_is_renewed_while_a_new_leader_starts(api_client, namespace):
    """A start rebuilds from the cluster and asks every agent (a hung one: up to the RPC deadline,
    twice), which can outlast the Lease: it must be renewed meanwhile, or a standby takes over
    while this one starts, and both act at once."""
    lease = f"slow-{uuid.uuid4().hex[:6]}"
    started = threading.Event()

    class SlowStart:
        def start(self):
            started.set()
            time.sleep(5)   # longer than the lease duration

        def stop(self, timeout=30.0):
            pass

    timing = {"lease_duration": 3, "renew_deadline": 2, "retry_period": 0.3}
    leader = LeaderElector(api_client, namespace, lease, "slow", **timing)
    standby = LeaderElector(api_client, namespace, lease, "standby", **timing)
    stop = threading.Event()
    thread = threading.Thread(target=run_with_leader_election, args=(SlowStart, leader, stop))
    thread.start()
    try:
        assert started.wait(30)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert not standby.step(), "the standby took over while the leader was starting"
            time.sleep(0.3)
    finally:
        stop.set()
        thread.join(30)


def test_a_fastpod_name_too_long_for_its_pods_label_is_refused_at_create(api_client, fastpod_crd, namespace):
    """Each replica Pod carries the FastPod's name as a label value (at most 63 characters). A
    longer name was admitted and every Pod creation then failed, naming the label."""
    objects = client.CustomObjectsApi(api_client)
    manifest = fastpod_manifest("x" * 64, MPS)
    with pytest.raises(client.ApiException) as exc:
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    assert exc.value.status == 422 and "metadata.name" in exc.value.body, exc.value.body
    longest = fastpod_manifest("x" * 63, MPS)
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, longest)


def test_a_refusal_too_long_for_a_condition_is_shown_clipped_not_lost(api_client, namespace, make_controller):
    """A pod template with many invalid fields: the API server's refusal lists each, longer than a
    condition message may be (32768 characters). The status write was refused (422) in every
    pass, so the user never saw why; now the message is clipped, saying so."""
    controller = make_controller(namespace)
    controller.podcache.replace([], "0")  # not started: no watch fills them
    controller.usage.replace(controller.peers.replacing([]))
    objects = client.CustomObjectsApi(api_client)
    manifest = fastpod_manifest("wordy", MPS)
    manifest["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": f"A=B{i}", "value": "x"} for i in range(400)]
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    controller.reconcile(namespace, "wordy")
    scheduled = _condition(_fastpod(objects, namespace, "wordy"), "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "PodCreateFailed"), scheduled
    message = scheduled["message"]
    assert len(message) <= 32768 and "env[0].name" in message
    assert message.endswith("characters left out]"), message[-200:]


def test_a_forgotten_node_has_its_agent_channel_closed_and_dropped(api_client, namespace, make_controller):
    """A GPU node whose Node object is deleted and whose agent does not answer is forgotten; its
    gRPC channel in the agent pool went with it, not kept (and retried) for good: one per node
    ever seen, on a cluster whose nodes come and go (autoscaling)."""
    node, core = _gpu_node_with_dead_agent(api_client)
    controller = make_controller(namespace)
    controller.start()
    pool = controller.core.agents._pool
    channel = pool._clients[node]   # the registration tried it
    core.delete_node(node)
    wait_for(lambda: controller.store.get_node(node) is None, "the deleted node forgotten")
    assert node not in pool._clients
    with pytest.raises(AgentError, match=r"channel to this node was closed .*the node was forgotten"):
        channel.ping()   # closed: a call that had just taken it fails as an unreachable agent
