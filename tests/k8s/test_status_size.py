"""A FastPod's status stays within what the API server stores (etcd takes at most 1.5 MiB per
object) for any replica count the CRD allows (10,000): each replica's summary costs ~185 bytes
of status (~300 with MIG) plus ~120 of managedFields, so listing every replica of a FastPod of
~5,000 made every status write fail."""

from __future__ import annotations

import json

from kubernetes import client

from fastshare.controller.agent_client import AgentPool
from fastshare.controller.model import Allocation, Device, Kind, Spec, State
from fastshare.k8s.controller import (
    ASSIGNMENTS_BYTES,
    ASSIGNMENTS_LISTED,
    KubeController,
    KubeSettings,
    listed_assignments,
)
from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.k8s.store import replica_key, summary

ETCD_LIMIT = 1536 * 1024
REPLICAS = 10_000


def _allocation(namespace: str, pod: str, i: int, state: State = State.ACTIVE,
                reason: str = "") -> Allocation:
    uuid = f"{i:08x}-1111-2222-3333-444455556666"
    return Allocation(id=f"fs-{i:016x}", spec=Spec(kind=Kind.EXCLUSIVE, mig_profile="1g.10gb"),
                      owner=f"{namespace}/big", idempotency_key=replica_key(namespace, "big", pod),
                      state=state, node=f"gpu-node-{i % 500:04d}.cluster.example.com", reason=reason,
                      devices=[Device(gpu_index=i % 8, gpu_uuid=f"GPU-{uuid}", mig_uuid=f"MIG-{uuid}",
                                      mig_profile="1g.10gb", mig_start=i % 7, mig_size=1)])


def _pod(name: str, ready: bool) -> dict:
    return {"metadata": {"name": name}, "status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_the_status_of_ten_thousand_replicas_is_bounded_and_written(api_client, fastpod_crd, namespace, pki):
    objects = client.CustomObjectsApi(api_client)
    manifest = fastpod_manifest("big", {"kind": "exclusive", "migProfile": "1g.10gb"}, REPLICAS)
    fastpod = objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    names = [f"big-{i:06x}" for i in range(REPLICAS)]
    troubled = {names[7]: State.RELEASING, names[9001]: State.PENDING}
    allocations = {name: _allocation(namespace, name, i, troubled.get(name, State.ACTIVE),
                                     "agent unreachable" if name in troubled else "")
                   for i, name in enumerate(names)}
    not_ready = {names[5000], names[9999]}
    live = [_pod(name, name not in not_ready) for name in names if name not in troubled]
    controller = KubeController(api_client, AgentPool(pki[1]), KubeSettings(namespace=namespace))
    try:
        controller._write_status(fastpod, live, allocations, {"type": "Scheduled", "status": "True",
                                                              "reason": "Scheduled", "message": "placed"})
    finally:
        controller.stop()
    stored = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "big")
    status = stored["status"]
    assert len(json.dumps(stored).encode()) < ETCD_LIMIT / 2
    listed = status["assignments"]
    assert 0 < len(listed) <= ASSIGNMENTS_LISTED
    assert len(json.dumps(listed).encode()) <= ASSIGNMENTS_BYTES
    assert status["assignmentsOmitted"] == REPLICAS - len(listed)
    assert (status["replicas"], status["readyReplicas"]) == (REPLICAS - 2, REPLICAS - 4)
    # the replicas worth a look are listed first: not active, or whose Pod is not ready
    assert set(troubled) | not_ready <= {entry["pod"] for entry in listed}
    assert [entry["pod"] for entry in listed] == sorted(entry["pod"] for entry in listed)


def test_a_few_replicas_are_all_listed_and_long_reasons_count_by_their_bytes():
    names = [f"fp-{i}" for i in range(20)]
    entries = [summary(name, _allocation("ns", name, i)) for i, name in enumerate(names)]
    assert listed_assignments(entries, set(names)) == (sorted(entries, key=lambda e: e["pod"]), 0)
    failing = [summary(name, _allocation("ns", name, i, State.FAILED, "x" * 30_000))
               for i, name in enumerate(names)]
    listed, omitted = listed_assignments(failing, set())
    assert len(listed) == ASSIGNMENTS_BYTES // 30_000 and omitted == len(names) - len(listed)
