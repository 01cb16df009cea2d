"""Leadership fencing: a controller whose Lease lapsed mid-pass takes no further step of it (no
API write, no agent call that changes a GPU); a standby may be leading by then."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
from kubernetes import client

from fastshare.controller.agent_client import AgentPool
from fastshare.controller.core import Settings as CoreSettings
from fastshare.k8s.controller import KubeController, KubeSettings
from fastshare.k8s.leader import Deposed, LeaderElector
from fastshare.k8s.pods import FASTPOD_LABEL
from fastshare.k8s.resources import ALLOCATION_PLURAL, GROUP, PLURAL, VERSION, fastpod_manifest

from .agents import Agent, register_node

MPS = {"kind": "mps", "memory": "2Gi"}
TIMING = {"lease_duration": 15.0, "renew_deadline": 10.0, "retry_period": 2.0}


@pytest.fixture(scope="module")
def agent(api_client, pki):
    root, tls = pki
    started = Agent(root, root / "ca", f"fence-{uuid.uuid4().hex[:4]}", ["V100-SXM2-32GB"] * 4, mig=False)
    core = client.CoreV1Api(api_client)
    started.start(tls)
    register_node(core, started)
    yield started
    started.stop()
    core.delete_node(started.name)


class Clock:
    """The elector's monotonic clock, moved by hand: the Lease lapses when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def leading(api_client, namespace):
    clock = Clock()
    elector = LeaderElector(api_client, namespace, f"fence-{uuid.uuid4().hex[:6]}", "me", monotonic=clock,
                            **TIMING)
    assert elector.step() and elector.is_leader

    def lapse() -> None:
        clock.now += TIMING["renew_deadline"]   # no renewal for renew_deadline: not leading

    return elector, lapse


def _controller(api_client, namespace, tls, elector) -> KubeController:
    controller = KubeController(api_client, AgentPool(tls, deadline=10.0),
                                KubeSettings(namespace=namespace, workers=1),
                                CoreSettings(heartbeat_timeout=30.0), elector=elector)
    controller.podcache.replace([], "0")   # not started: no watch fills them
    controller.usage.replace(controller.peers.replacing([]))
    return controller


@pytest.mark.parametrize("when", ["after-first-pod", "between-record-and-prepare"])
def test_a_pass_takes_no_step_once_the_lease_lapsed(api_client, fastpod_crd, namespace, pki, agent,
                                                    leading, when):
    elector, lapse = leading
    controller = _controller(api_client, namespace, pki[1], elector)
    try:
        controller.sync_nodes()
        before = set(agent.shares(pki[1]))   # the module's agent: earlier tests' shares stay
        objects = client.CustomObjectsApi(api_client)
        manifest = fastpod_manifest("f", MPS, 3)
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
        if when == "after-first-pod":
            create = controller.pods.create_namespaced_pod

            def create_then_lapse(*args, **kwargs):
                made = create(*args, **kwargs)
                if kwargs.get("dry_run") is None:
                    lapse()
                return made

            controller.pods.create_namespaced_pod = create_then_lapse
        else:
            record = controller.store.create_allocation

            def record_then_lapse(allocation):
                record(allocation)
                lapse()

            controller.store.create_allocation = record_then_lapse
        with pytest.raises(Deposed):
            controller.reconcile(namespace, "f")
        pods = client.CoreV1Api(api_client).list_namespaced_pod(namespace, label_selector=FASTPOD_LABEL).items
        records = objects.list_namespaced_custom_object(GROUP, VERSION, namespace, ALLOCATION_PLURAL)["items"]
        fastpod = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "f")
        shares = sorted(set(agent.shares(pki[1])) - before)
        if when == "after-first-pod":   # the first replica was done before the lapse, nothing after
            assert (len(pods), len(records), len(shares)) == (1, 1, 1), (pods, records, shares)
        else:   # the record was written, the agent was not asked (a new leader rolls it forward)
            assert (len(pods), len(records), shares) == (0, 1, []), (pods, records, shares)
            assert records[0]["spec"]["state"] == "pending"
        assert not fastpod.get("status"), "a deposed controller wrote the FastPod's status"
    finally:
        controller.stop()
        controller.core.agents.close()


def test_a_deposed_worker_abandons_the_pass_logs_once_and_requeues_nothing(api_client, namespace, pki,
                                                                            leading, caplog):
    elector, lapse = leading
    controller = _controller(api_client, namespace, pki[1], elector)
    lapse()
    passes = []

    def reconcile(ns, name):
        passes.append(name)
        controller.fence.check()
        return 1.0

    controller.reconcile = reconcile
    for name in ("a", "b"):
        controller.queue.add((namespace, name))
    worker = threading.Thread(target=controller._worker)
    with caplog.at_level(logging.WARNING):
        worker.start()
        try:
            deadline = threading.Event()
            while len(passes) < 2 and not deadline.wait(0.05):
                pass
            deadline.wait(0.5)
        finally:
            controller.stop()
            worker.join(10)
            controller.core.agents.close()
    assert passes == ["a", "b"]
    assert len(controller.queue) == 0, "a deposed controller requeued its FastPods"
    lapsed = [r for r in caplog.records if "leader" in r.getMessage().lower()]
    assert len(lapsed) == 1, [r.getMessage() for r in lapsed]
    assert not [r for r in caplog.records if r.exc_info], "Deposed was logged as a failure"


def test_is_leader_from_another_thread_survives_a_concurrent_loss(api_client, namespace):
    """Workers ask is_leader while the election thread may reset the renewal time to None."""
    elector = LeaderElector(api_client, namespace, f"race-{uuid.uuid4().hex[:6]}", "me", **TIMING)
    assert elector.step()

    def lost_meanwhile() -> float:   # step() ruled the lease lost between is_leader's two reads
        elector._renewed_at = None
        return time.monotonic() + TIMING["renew_deadline"]

    elector.monotonic = lost_meanwhile
    assert elector.is_leader is False


# --- fencing tokens: a call that left before the lapse and arrives after a takeover -------------

def _standby_takes_over(api_client, namespace: str, lease: str) -> LeaderElector:
    """A standby that has watched the Lease go unrenewed for a whole lease_duration: it takes over
    (leaseTransitions + 1), while the old leader's clock still says it leads."""
    clock = Clock()
    standby = LeaderElector(api_client, namespace, lease, "standby", monotonic=clock, **TIMING)
    assert not standby.step()
    clock.now += TIMING["lease_duration"]
    assert standby.step() and standby.is_leader
    return standby


def _late_prepares(pool: AgentPool, agent: Agent, meanwhile) -> None:
    """The agent's prepares run ``meanwhile(share id)`` after the fence check and before they go
    out: the call is in flight while the standby takes over and acts."""
    agent_client = pool.get(agent.name, agent.address)
    prepare = agent_client.prepare

    def late(share, term=None):
        meanwhile(share.id)
        return prepare(share, term)

    agent_client.prepare = late


@pytest.mark.parametrize("standby_does", ["releases-it", "rolls-it-forward"])
def test_a_late_call_of_a_deposed_term_is_refused_and_nothing_is_undone(api_client, fastpod_crd, namespace,
                                                                        pki, agent, leading, standby_does):
    """The old leader records an allocation and sends its prepare; before it lands, the standby
    takes over and either releases the pending allocation (its FastPod went away) or finishes
    it. The old leader's prepare (term 0) then reaches the agent, which has seen term 1: refused.
    The old leader stops its pass (Deposed) without compensating: no share made for a released
    record, and the standby's active allocation is not marked releasing nor freed."""
    elector, _ = leading
    tls = pki[1]
    old_pool = AgentPool(tls, deadline=10.0)
    old = _controller_in_term(api_client, namespace, old_pool, elector)
    new: list[KubeController] = []
    objects = client.CustomObjectsApi(api_client)

    def standby_acts(share_id: str) -> None:
        standby = _standby_takes_over(api_client, namespace, elector.name)
        assert elector.is_leader and standby.term == elector.term + 1
        controller = _controller_in_term(api_client, namespace, AgentPool(tls, deadline=10.0), standby)
        new.append(controller)
        controller.sync_nodes()
        if standby_does == "releases-it":
            assert controller.core.release(share_id, "FastPod deleted").state.value == "failed"
        else:
            assert share_id in controller.reconciler.start().completed

    try:
        old.sync_nodes()
        assert elector.term == 0 and old.fence.term == 0
        _late_prepares(old_pool, agent, standby_acts)
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fastpod_manifest("f", MPS))
        with pytest.raises(Deposed):
            old.reconcile(namespace, "f")
        (record,) = _records(objects, namespace)
        allocation_id = record["spec"]["record"]["id"]
        shares = agent.shares(tls)
        if standby_does == "releases-it":
            assert record["spec"]["state"] == "failed"
            assert allocation_id not in shares, "the deposed leader's late prepare made a share nobody holds"
        else:
            assert record["spec"]["state"] == "active", record["spec"]
            assert allocation_id in shares, "the deposed leader freed the new leader's share"
        pods = client.CoreV1Api(api_client).list_namespaced_pod(namespace, label_selector=FASTPOD_LABEL).items
        fastpod = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "f")
        assert not pods and not fastpod.get("status"), "the deposed controller went on with its pass"
    finally:
        for controller in (old, *new):
            controller.stop()
            controller.core.agents.close()


def test_a_lease_made_anew_moves_its_term_past_what_the_agents_have_seen(api_client, fastpod_crd, namespace,
                                                                          pki, agent, leading):
    """The Lease was deleted (or --lease-name changed): the leader's term counts from 0 again,
    below what the agents have seen. Its first refused call moves the Lease's term past theirs
    (only while it holds the Lease) and goes through again; it is not taken as deposed."""
    elector, _ = leading
    tls = pki[1]
    seen = 40
    probe = AgentPool(tls, deadline=10.0)
    try:   # a leader of the former Lease, term ``seen``, was the last to call
        probe.get(agent.name, agent.address).release("fs-from-an-older-lease", term=seen)
    finally:
        probe.close()
    controller = _controller_in_term(api_client, namespace, AgentPool(tls, deadline=10.0), elector)
    try:
        controller.sync_nodes()
        objects = client.CustomObjectsApi(api_client)
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fastpod_manifest("g", MPS))
        controller.reconcile(namespace, "g")
        (record,) = _records(objects, namespace)
        assert record["spec"]["state"] == "active" and record["spec"]["record"]["id"] in agent.shares(tls)
        lease = client.CoordinationV1Api(api_client).read_namespaced_lease(elector.name, namespace)
        assert lease.spec.lease_transitions == seen + 1 == elector.term == controller.fence.term
        assert elector.is_leader and lease.spec.holder_identity == "me"
    finally:
        controller.stop()
        controller.core.agents.close()


def _records(objects: client.CustomObjectsApi, namespace: str) -> list[dict]:
    return objects.list_namespaced_custom_object(GROUP, VERSION, namespace, ALLOCATION_PLURAL)["items"]


def _controller_in_term(api_client, namespace, pool: AgentPool, elector: LeaderElector) -> KubeController:
    """A controller for ``elector``'s current term of office (as run_with_leader_election makes)."""
    controller = KubeController(api_client, pool, KubeSettings(namespace=namespace, workers=1),
                                CoreSettings(heartbeat_timeout=30.0), elector=elector)
    controller.podcache.replace([], "0")
    controller.usage.replace(controller.peers.replacing([]))
    return controller
