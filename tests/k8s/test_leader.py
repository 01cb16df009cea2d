"""Lease leader election against the real API server: one leader, take-over only after the lease
expires on the candidate's own clock, immediate hand-over on release."""

from __future__ import annotations

import copy
import threading
import time
import uuid

import pytest
from kubernetes import client

from fastshare.k8s.leader import LeaderElector

from .conftest import wait_for


@pytest.fixture
def lease_name():
    return f"lease-{uuid.uuid4().hex[:8]}"


def _electors(api_client, namespace, lease_name, n=2, **timing):
    timing = {"lease_duration": 3.0, "renew_deadline": 2.0, "retry_period": 0.2, **timing}
    return [LeaderElector(api_client, namespace, lease_name, f"controller-{i}", **timing) for i in range(n)]


def test_exactly_one_of_two_candidates_leads(api_client, namespace, lease_name):
    a, b = _electors(api_client, namespace, lease_name)
    assert a.step() is True
    assert b.step() is False
    assert a.step() is True  # renew
    lease = client.CoordinationV1Api(api_client).read_namespaced_lease(lease_name, namespace)
    assert lease.spec.holder_identity == "controller-0"
    assert lease.spec.lease_transitions == 0


def test_a_silent_leader_is_replaced_only_after_the_lease_duration(api_client, namespace, lease_name):
    a, b = _electors(api_client, namespace, lease_name)
    assert a.step()
    started = time.monotonic()
    # `a` stops renewing (crashed). `b` must wait a full lease duration of unchanged record.
    wait_for(b.step, "b to take over", timeout=60)
    assert time.monotonic() - started >= 3.0
    lease = client.CoordinationV1Api(api_client).read_namespaced_lease(lease_name, namespace)
    assert (lease.spec.holder_identity, lease.spec.lease_transitions) == ("controller-1", 1)
    # the old leader notices on its next attempt and does not act any more
    assert a.step() is False
    assert not a.is_leader


def test_release_hands_over_without_waiting(api_client, namespace, lease_name):
    a, b = _electors(api_client, namespace, lease_name, lease_duration=60.0, renew_deadline=30.0)
    assert a.step()
    assert not b.step()
    a.release()
    assert not a.is_leader
    assert b.step()


def test_racing_candidates_in_threads_never_lead_together(api_client, namespace, lease_name):
    electors = _electors(api_client, namespace, lease_name, n=3)
    stop = threading.Event()
    overlaps: list[tuple[str, ...]] = []
    changes: list[tuple[str, bool]] = []
    threads = [threading.Thread(target=e.run, args=(stop, lambda v, e=e: changes.append((e.identity, v))))
               for e in electors]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            leading = tuple(e.identity for e in electors if e.is_leader)
            if len(leading) > 1:
                overlaps.append(leading)
            time.sleep(0.05)
        assert overlaps == []
        assert sum(e.is_leader for e in electors) == 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    # each thread released on stop; the leader reported gaining and then losing leadership
    assert [v for _, v in changes].count(True) == 1
    assert [v for _, v in changes].count(False) == 1


def test_timings_are_checked():
    with pytest.raises(ValueError, match="lease_duration > renew_deadline > retry_period"):
        LeaderElector(None, "ns", "x", "me", lease_duration=5, renew_deadline=10, retry_period=1)


def test_an_api_server_blip_is_ridden_out_until_the_renew_deadline(api_client, namespace, lease_name):
    """The API server restarting (connection refused: urllib3's MaxRetryError, not an OSError)
    must not escape step(): the leader keeps leading until renew_deadline, then steps down, and
    run() (the election thread of both controller processes) goes on instead of crashing."""
    configuration = copy.deepcopy(api_client.configuration)
    own = client.ApiClient(configuration)
    try:
        elector = LeaderElector(own, namespace, lease_name, "blip", lease_duration=3.0, renew_deadline=2.0,
                                retry_period=0.2)
        assert elector.step() is True
        real_host, configuration.host = configuration.host, "https://127.0.0.1:1"  # nothing listens there
        assert elector.step() is True   # one failed renewal: still within the renew deadline
        time.sleep(2.1)
        assert elector.step() is False  # deposed itself, without an exception
        stop = threading.Event()
        thread = threading.Thread(target=elector.run, args=(stop,))
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive()        # still trying, not crashed
        configuration.host = real_host
        wait_for(lambda: elector.is_leader, "leading again once the API server answers", timeout=30)
        stop.set()
        thread.join(30)
    finally:
        own.close()


def test_a_renewal_whose_reply_comes_late_does_not_extend_leadership(api_client, namespace, lease_name):
    """The renewal's write lands, then its reply is held up longer than the lease: the candidate
    saw that write and took over a lease duration later. The late reply must not make the old
    leader lead again (its term counts from when the attempt started, not when it returned)."""
    a, b = _electors(api_client, namespace, lease_name)
    assert a.step() and not b.step()
    real_replace = a.leases.replace_namespaced_lease
    written = threading.Event()

    def slow_reply(*args, **kwargs):
        result = real_replace(*args, **kwargs)
        written.set()
        time.sleep(4.0)   # longer than the lease duration (3 s)
        return result

    a.leases.replace_namespaced_lease = slow_reply
    renewal = threading.Thread(target=a.step)
    renewal.start()
    assert written.wait(10)
    wait_for(b.step, "b to take over", timeout=30)
    renewal.join(30)
    assert b.is_leader
    assert not a.is_leader, "both lead: a late renewal reply counted as a fresh renewal"


def test_a_hung_api_server_does_not_keep_the_leader_waiting(namespace, lease_name):
    """An API server that accepts the connection and never answers: step() gives up within the
    renew deadline instead of blocking, so run() reports the lost leadership (and the controller
    stops acting) instead of hanging in a renewal for ever."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.getsockname()[1]}"
    own = client.ApiClient(configuration)
    try:
        elector = LeaderElector(own, namespace, lease_name, "hung", lease_duration=3.0, renew_deadline=2.0,
                                retry_period=0.2)
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(elector.step()), daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "step() still blocked on an API server that never answers"
        assert result == [False]
        assert time.monotonic() - started < 5
    finally:
        own.close()
        server.close()


def test_the_lease_never_says_shorter_than_the_leader_believes(api_client, namespace, lease_name):
    """Candidates wait the Lease's leaseDurationSeconds (whole seconds); with a fractional
    --lease-duration it must be rounded up, or a candidate takes over while the leader still
    believes it leads (renew deadline 1.5 s > 1 s written)."""
    elector = LeaderElector(api_client, namespace, lease_name, "frac", lease_duration=1.9, renew_deadline=1.5,
                            retry_period=0.2)
    assert elector.step()
    lease = client.CoordinationV1Api(api_client).read_namespaced_lease(lease_name, namespace)
    assert lease.spec.lease_duration_seconds >= elector.renew_deadline
    assert lease.spec.lease_duration_seconds >= 1.9
