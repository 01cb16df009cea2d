"""Why the k8s state moved out of FastPod status: the cost of one FastPod GET and status PUT
against the real kube-apiserver grows with the number of replicas listed in
``status.assignments``, while the write of one allocation record (a FastShareAllocation object,
fastshare.k8s.store) stays flat; both compared with a small ConfigMap patch.

When each allocation step rewrote the whole list of full records in the status (the first
design), the status PUT cost 5.6 ms empty, 63 ms with 50 records and 291 ms with 200, paid ~3
times per replica. Now the status carries only per-replica summaries, written once per
reconcile pass, and each allocation step writes its own small object.

    .venv/bin/python bench/k8s_status_size.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kubernetes import client

from fastshare.controller.model import Allocation, Device, Kind, Spec, State
from fastshare.k8s import envtest
from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.k8s.store import KubeStateStore, replica_key, summary

ROUNDS = 10


def _allocation(i: int) -> Allocation:
    now = time.time()
    return Allocation(id=f"alloc-{i:04d}", spec=Spec(kind=Kind.MPS, memory_bytes=2**27), owner="ns/fp",
                      idempotency_key=replica_key("ns", "fp", f"fp-{i}"), state=State.ACTIVE, node="node-0",
                      devices=[Device(gpu_index=0, gpu_uuid=f"GPU-{i:032x}")],
                      env={"CUDA_VISIBLE_DEVICES": f"GPU-{i:032x}", "CUDA_MPS_PIPE_DIRECTORY": "/run/x/pipe"},
                      assignment={"node": "node-0", "gpu": 0, "memory": 2**27},
                      created_at=now, updated_at=now)


def _median_ms(fn) -> float:
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    with envtest.ControlPlane(envtest.find_assets()) as plane:
        api = plane.api_client()
        envtest.install_crds(api)
        core, objects = client.CoreV1Api(api), client.CustomObjectsApi(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="ns")))
        core.create_namespaced_config_map("ns", {"metadata": {"name": "c"}, "data": {"a": "0"}})
        baseline = _median_ms(lambda: core.patch_namespaced_config_map("c", "ns", {"data": {"a": "1"}}))
        print(f"baseline: ConfigMap patch {baseline:.1f} ms")
        objects.create_namespaced_custom_object(GROUP, VERSION, "ns", PLURAL,
                                                fastpod_manifest("fp", {"kind": "mps", "memory": "128Mi"}, 1))
        for n in (0, 1, 10, 50, 100, 200):
            fastpod = objects.get_namespaced_custom_object(GROUP, VERSION, "ns", PLURAL, "fp")
            fastpod.setdefault("status", {})["assignments"] = [summary(f"fp-{i}", _allocation(i))
                                                               for i in range(n)]
            latest = {"fp": objects.replace_namespaced_custom_object_status(GROUP, VERSION, "ns", PLURAL,
                                                                            "fp", fastpod)}
            get = _median_ms(lambda: objects.get_namespaced_custom_object(GROUP, VERSION, "ns", PLURAL, "fp"))
            put = objects.replace_namespaced_custom_object_status
            write = _median_ms(lambda latest=latest, put=put: latest.update(
                fp=put(GROUP, VERSION, "ns", PLURAL, "fp", latest["fp"])))
            size = len(json.dumps(latest["fp"])) / 1024
            print(f"{n:4d} assignments ({size:6.1f} KiB): GET {get:6.1f} ms ({get / baseline:5.1f} x), "
                  f"status PUT {write:6.1f} ms ({write / baseline:5.1f} x)")
        store = KubeStateStore(api, "ns")
        for i in range(200):
            store.create_allocation(_allocation(i))
        record = _median_ms(lambda: store.update("alloc-0100", lease_ttl=1))
        print(f"one allocation record update (200 records stored): {record:6.1f} ms "
              f"({record / baseline:5.1f} x)")


if __name__ == "__main__":
    main()
