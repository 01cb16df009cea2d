"""KubeStateStore against the real API server: the same contract as the SQLite store (which serves
as the oracle in a property test), compare-and-set between two controllers, no lost writes."""

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
from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest
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
    """Allocation ids are unique cluster-wide (the API server is shared by all tests)."""
    namespace, name = where
    now = time.time()
    return Allocation(id=f"{name}-{i}", spec=SPEC, owner=f"{namespace}/{name}", state=state, node=node,
                      idempotency_key=replica_key(namespace, name, f"pod-{i}"),
                      devices=[Device(gpu_index=0, gpu_uuid="GPU-1", model="A100")],
                      assignment={"gpu": 0, "sm": 30, "ratio": 0.25}, created_at=now, updated_at=now)


def _id(where: tuple[str, str], i: str) -> str:
    return f"{where[1]}-{i}"


def _mine(allocations: list[Allocation], where: tuple[str, str]) -> list[Allocation]:
    """The store lists the whole cluster; tests share one API server."""
    return [a for a in allocations if a.owner == f"{where[0]}/{where[1]}"]


def test_round_trip_index_and_status_entry(store, fastpod, api_client):
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
    objects = client.CustomObjectsApi(api_client)
    fp = objects.get_namespaced_custom_object(GROUP, VERSION, fastpod[0], PLURAL, fastpod[1])
    entry = fp["status"]["assignments"][0]
    assert (entry["pod"], entry["node"], entry["state"], entry["gpuUUIDs"]) == (
        "pod-a1", "n1", "pending", ["GPU-1"])


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


def test_duplicate_key_returns_the_existing_allocation(store, fastpod):
    a = _alloc(fastpod, "a1")
    store.create_allocation(a)
    with pytest.raises(DuplicateKey) as info:
        store.create_allocation(replace(a, id=_id(fastpod, "a2")))
    assert info.value.existing == a
    with pytest.raises(StoreError, match="does not match key"):
        store.create_allocation(replace(_alloc(fastpod, "a3"), owner="other/thing"))


def test_forget_only_drops_finished_allocations(store, fastpod):
    store.create_allocation(_alloc(fastpod, "a1"))
    with pytest.raises(StoreError, match="release it first"):
        store.forget(_id(fastpod, "a1"))
    store.transition(_id(fastpod, "a1"), [State.PENDING], State.RELEASING)
    store.transition(_id(fastpod, "a1"), [State.RELEASING], State.FAILED)
    store.forget(_id(fastpod, "a1"))
    assert store.get_allocation(_id(fastpod, "a1")) is None
    assert _mine(store.list_allocations(), fastpod) == []


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
