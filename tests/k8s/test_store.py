"""KubeStateStore against the real API server: the same contract as the SQLite store (which serves
as the oracle in a property test), one FastShareAllocation object per allocation (owned by the
FastPod, protected by a finalizer while it holds a share), compare-and-set between two
controllers, no lost writes."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client

from fastshare.controller.model import Allocation, Device, Kind, Spec, State
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.controller.store import Conflict, DuplicateKey, StoreError
from fastshare.k8s.resources import (
    ALLOCATION_FINALIZER,
    ALLOCATION_LABEL,
    ALLOCATION_PLURAL,
    GROUP,
    PLURAL,
    VERSION,
    fastpod_manifest,
)
from fastshare.k8s.store import KubeStateStore, replica_key

SPEC = Spec(kind=Kind.FASTPOD, sm_percent=30, memory_bytes=2**30, node_selector=(("zone", "a"),))
GPU = {"kind": "fastpod", "smPercent": 30, "memory": "1Gi"}


@pytest.fixture
def store(api_client, fastpod_crd):
    return KubeStateStore(api_client)


@pytest.fixture
def fastpod(api_client, fastpod_crd, namespace):
    name = f"fp-{uuid.uuid4().hex[:6]}"
    client.CustomObjectsApi(api_client).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, fastpod_manifest(name, GPU))
    return namespace, name


def _alloc(where: tuple[str, str], i: str, state: State = State.PENDING, node: str = "n1") -> Allocation:
    """Allocation ids are unique cluster-wide (the API server is shared by all tests); the pod (and
    so the object's name) is unique in the namespace."""
    namespace, name = where
    now = time.time()
    return Allocation(id=f"{name}-{i}", spec=SPEC, owner=f"{namespace}/{name}", state=state, node=node,
                      idempotency_key=replica_key(namespace, name, _pod(where, i)),
                      devices=[Device(gpu_index=0, gpu_uuid="GPU-1", model="A100")],
                      assignment={"gpu": 0, "sm": 30, "ratio": 0.25}, created_at=now, updated_at=now)


def _id(where: tuple[str, str], i: str) -> str:
    return f"{where[1]}-{i}"


def _pod(where: tuple[str, str], i: str) -> str:
    return f"{where[1]}-pod-{i}"


def _object(api_client, where: tuple[str, str], i: str) -> dict | None:
    try:
        return client.CustomObjectsApi(api_client).get_namespaced_custom_object(
            GROUP, VERSION, where[0], ALLOCATION_PLURAL, _pod(where, i))
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _mine(allocations: list[Allocation], where: tuple[str, str]) -> list[Allocation]:
    """The store lists the whole cluster; tests share one API server."""
    return [a for a in allocations if a.owner == f"{where[0]}/{where[1]}"]


def test_round_trip_and_the_allocation_object(store, fastpod, api_client):
    a = _alloc(fastpod, "a1")
    store.create_allocation(a)
    assert store.get_allocation(_id(fastpod, "a1")) == a
    assert store.find_by_key(a.idempotency_key) == a
    # a second store (another controller process) finds it through the API alone
    other = KubeStateStore(api_client)
    assert other.get_allocation(_id(fastpod, "a1")) == a
    assert _mine(other.list_allocations(states=[State.PENDING], node="n1"), fastpod) == [a]
    assert _mine(other.list_allocations(node="n2"), fastpod) == []
    assert _mine(other.list_allocations(states=[State.ACTIVE]), fastpod) == []
    assert other.allocations_of(*fastpod) == ({_pod(fastpod, "a1"): a}, set())
    # one object, named after the pod, owned by the FastPod, kept by a finalizer while it holds
    owner = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        GROUP, VERSION, fastpod[0], PLURAL, fastpod[1])
    obj = _object(api_client, fastpod, "a1")
    assert obj["metadata"]["labels"][ALLOCATION_LABEL] == _id(fastpod, "a1")
    assert [(r["kind"], r["uid"]) for r in obj["metadata"]["ownerReferences"]] == [
        ("FastPod", owner["metadata"]["uid"])]
    assert obj["metadata"]["finalizers"] == [ALLOCATION_FINALIZER]
    spec = obj["spec"]
    assert (spec["pod"], spec["node"], spec["state"], spec["gpuUUIDs"], spec["allocation"]) == (
        _pod(fastpod, "a1"), "n1", "pending", ["GPU-1"], _id(fastpod, "a1"))
    assert "record" in spec and "record" not in (owner.get("status") or {})


def test_the_schema_keeps_a_record_consistent(store, fastpod, api_client):
    store.create_allocation(_alloc(fastpod, "s1"))
    objects = client.CustomObjectsApi(api_client)
    obj = _object(api_client, fastpod, "s1")
    for change, message in (({"state": "active"}, "must match the record"),
                            ({"allocation": "fs-other"}, "immutable"),
                            ({"record": {**obj["spec"]["record"], "owner": "x/y"}}, "immutable")):
        body = {**obj, "spec": {**obj["spec"], **change}}
        with pytest.raises(client.ApiException) as info:
            objects.replace_namespaced_custom_object(GROUP, VERSION, fastpod[0], ALLOCATION_PLURAL,
                                                     _pod(fastpod, "s1"), body)
        assert info.value.status == 422 and message in info.value.body, change


def test_transition_is_compare_and_set(store, fastpod):
    store.create_allocation(_alloc(fastpod, "a1"))
    env = {"CUDA_VISIBLE_DEVICES": "GPU-1"}
    moved = store.transition(_id(fastpod, "a1"), [State.PENDING], State.PREPARED, env=env)
    assert moved.state is State.PREPARED and moved.env == {"CUDA_VISIBLE_DEVICES": "GPU-1"}
    with pytest.raises(Conflict, match="is prepared, expected one of: pending"):
        store.transition(_id(fastpod, "a1"), [State.PENDING], State.ACTIVE)
    with pytest.raises(Conflict, match="missing"):
        store.transition("nope", [State.PENDING], State.ACTIVE)
    with pytest.raises(StoreError, match="cannot change"):
        store.update(_id(fastpod, "a1"), owner="mallory")
    assert store.update(_id(fastpod, "a1"), lease_ttl=30).lease_ttl == 30
    assert store.get_allocation(_id(fastpod, "a1")).state is State.PREPARED


def test_a_release_reason_too_long_for_the_object_is_kept_clipped_not_refused(store, fastpod, api_client):
    """A reason is an agent's error or the API server's refusal of a Pod, whatever their length;
    the object's schema allows 32768. The write was refused (422): the release (or compensation)
    that carried it failed in every pass and the share stayed held."""
    store.create_allocation(_alloc(fastpod, "r1", State.ACTIVE))
    reason = "creating pod failed: 422: " + "; spec.containers[0].env[1].name: Invalid value" * 1000
    moved = store.transition(_id(fastpod, "r1"), [State.ACTIVE], State.RELEASING, reason=reason)
    assert moved.state is State.RELEASING
    assert len(moved.reason.encode()) <= 32768 and moved.reason.startswith(reason[:1000])
    assert moved.reason.endswith("characters left out]")
    spec = _object(api_client, fastpod, "r1")["spec"]
    assert spec["reason"] == spec["record"]["reason"] == moved.reason
    assert store.get_allocation(_id(fastpod, "r1")) == moved


def test_duplicate_key_returns_the_existing_allocation(store, fastpod):
    a = _alloc(fastpod, "a1")
    store.create_allocation(a)
    with pytest.raises(DuplicateKey) as info:
        store.create_allocation(replace(a, id=_id(fastpod, "a2")))
    assert info.value.existing == a
    with pytest.raises(StoreError, match="does not match key"):
        store.create_allocation(replace(_alloc(fastpod, "a3"), owner="other/thing"))


def test_forget_only_drops_finished_allocations(store, fastpod, api_client):
    store.create_allocation(_alloc(fastpod, "a1"))
    with pytest.raises(StoreError, match="release it first"):
        store.forget(_id(fastpod, "a1"))
    store.transition(_id(fastpod, "a1"), [State.PENDING], State.RELEASING)
    assert _object(api_client, fastpod, "a1")["metadata"]["finalizers"] == [ALLOCATION_FINALIZER]
    store.transition(_id(fastpod, "a1"), [State.RELEASING], State.FAILED)
    assert not _object(api_client, fastpod, "a1")["metadata"].get("finalizers")  # nothing left to guard
    store.forget(_id(fastpod, "a1"))
    assert store.get_allocation(_id(fastpod, "a1")) is None
    assert _object(api_client, fastpod, "a1") is None
    assert _mine(store.list_allocations(), fastpod) == []
    store.forget(_id(fastpod, "a1"))  # twice is fine


def test_a_deleted_record_that_holds_a_share_stays_until_released(store, fastpod, api_client):
    """kubectl delete (or the garbage collector in foreground mode) only marks it: the record of a
    share the agent still holds cannot vanish."""
    store.create_allocation(_alloc(fastpod, "d1", state=State.ACTIVE))
    client.CustomObjectsApi(api_client).delete_namespaced_custom_object(
        GROUP, VERSION, fastpod[0], ALLOCATION_PLURAL, _pod(fastpod, "d1"))
    assert _object(api_client, fastpod, "d1")["metadata"]["deletionTimestamp"]
    other = KubeStateStore(api_client)
    allocations, marked = other.allocations_of(*fastpod)
    assert marked == {_pod(fastpod, "d1")} and allocations[_pod(fastpod, "d1")].state is State.ACTIVE
    other.transition(_id(fastpod, "d1"), [State.ACTIVE], State.RELEASING)
    assert _object(api_client, fastpod, "d1") is not None
    other.transition(_id(fastpod, "d1"), [State.RELEASING], State.RELEASED)
    assert _object(api_client, fastpod, "d1") is None  # released: the deletion completes
    other.forget(_id(fastpod, "d1"))


def test_two_controllers_creating_one_replica_store_one_record(store, fastpod, api_client):
    """Creating the object IS the idempotency check: the loser gets DuplicateKey with the winner's."""
    stores = [store, KubeStateStore(api_client)]
    for round_ in range(4):
        barrier = threading.Barrier(2)
        results: list[object] = []
        candidates = [replace(_alloc(fastpod, f"c{round_}"), id=f"{_id(fastpod, f'c{round_}')}-{n}")
                      for n in range(2)]

        def create(s, a, results=results, barrier=barrier):
            barrier.wait()
            try:
                s.create_allocation(a)
                results.append(a.id)
            except DuplicateKey as exc:
                results.append(exc)

        pairs = zip(stores, candidates, strict=True)
        threads = [threading.Thread(target=create, args=pair) for pair in pairs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winner = [r for r in results if isinstance(r, str)]
        losers = [r for r in results if isinstance(r, DuplicateKey)]
        assert len(winner) == 1 and len(losers) == 1, results
        assert losers[0].existing.id == winner[0]
        assert [a.id for a in _mine(store.list_allocations(), fastpod)
                if a.idempotency_key == candidates[0].idempotency_key] == winner


def test_a_stale_copy_never_overwrites_a_newer_record(store, fastpod, api_client):
    """Each store keeps the last object it saw; the other controller moved on meanwhile."""
    other = KubeStateStore(api_client)
    store.create_allocation(_alloc(fastpod, "s1"))
    assert other.get_allocation(_id(fastpod, "s1")).state is State.PENDING   # other's copy: pending
    store.transition(_id(fastpod, "s1"), [State.PENDING], State.RELEASING)
    with pytest.raises(Conflict, match="is releasing, expected one of: pending"):
        other.transition(_id(fastpod, "s1"), [State.PENDING], State.PREPARED)
    assert other.update(_id(fastpod, "s1"), lease_ttl=7).state is State.RELEASING  # re-read, kept
    assert store.transition(_id(fastpod, "s1"), [State.RELEASING], State.FAILED).lease_ttl == 7


def test_two_controllers_racing_on_one_allocation_never_both_win(store, fastpod, api_client):
    stores = [store, KubeStateStore(api_client)]
    for i in range(5):
        store.create_allocation(_alloc(fastpod, f"r{i}"))
    for i in range(5):
        results: list[object] = []
        barrier = threading.Barrier(2)

        def race(s, i=i, results=results, barrier=barrier):
            barrier.wait()
            try:
                results.append(s.transition(_id(fastpod, f"r{i}"), [State.PENDING], State.RELEASING))
            except Conflict as exc:
                results.append(exc)

        threads = [threading.Thread(target=race, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(type(r).__name__ for r in results) == ["Allocation", "Conflict"]


def test_concurrent_writes_to_different_entries_of_one_fastpod_are_all_kept(store, fastpod, api_client):
    stores = [store, KubeStateStore(api_client)]
    errors: list[BaseException] = []

    def writer(s, prefix):
        try:
            for i in range(6):
                s.create_allocation(_alloc(fastpod, f"{prefix}{i}"))
                s.transition(_id(fastpod, f"{prefix}{i}"), [State.PENDING], State.ACTIVE)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(s, p)) for s, p in zip(stores, "xy", strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    active = _mine(store.list_allocations(states=[State.ACTIVE]), fastpod)
    assert sorted(a.id for a in active) == sorted(_id(fastpod, f"{p}{i}") for p in "xy" for i in range(6))


_STATES = list(State)
_ops = st.lists(st.one_of(
    st.tuples(st.just("create"), st.integers(0, 3)),
    st.tuples(st.just("transition"), st.integers(0, 3), st.sets(st.sampled_from(_STATES), min_size=1),
              st.sampled_from(_STATES)),
    st.tuples(st.just("update"), st.integers(0, 3), st.integers(0, 100)),
), max_size=12)


def _outcome(call):
    try:
        result = call()
    except (Conflict, DuplicateKey, StoreError) as exc:
        return type(exc).__name__
    if isinstance(result, Allocation):
        return replace(result, updated_at=0.0)
    return result


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_behaves_like_the_sqlite_store(api_client, fastpod_crd, namespace, tmp_path_factory, ops):
    objects = client.CustomObjectsApi(api_client)
    name = f"fp-{uuid.uuid4().hex[:8]}"
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fastpod_manifest(name, GPU))
    kube = KubeStateStore(api_client)
    oracle = SqliteStore(tmp_path_factory.mktemp("oracle") / "state.db")
    try:
        for op in ops:
            i = f"{name}-{op[1]}"
            if op[0] == "create":
                a = _alloc((namespace, name), str(op[1]))
                got = [_outcome(lambda s=s, a=a: s.create_allocation(a)) for s in (kube, oracle)]
            elif op[0] == "transition":
                got = [_outcome(lambda s=s, i=i, op=op: s.transition(i, op[2], op[3]))
                       for s in (kube, oracle)]
            else:
                got = [_outcome(lambda s=s, i=i, op=op: s.update(i, lease_ttl=op[2])) for s in (kube, oracle)]
            assert got[0] == got[1], op
        strip = lambda allocations: [replace(a, updated_at=0.0) for a in allocations]  # noqa: E731
        assert strip(_mine(kube.list_allocations(), (namespace, name))) == strip(oracle.list_allocations())
    finally:
        oracle.close()
