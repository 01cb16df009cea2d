"""In-cluster controller throughput against a real kube-apiserver, with real node agents on
simulated GPUs, compared with the API server's own rate for plain Pod creates (same run).

    .venv/bin/python bench/k8s.py [--fastpods 10] [--replicas 50] [--workers 4] [--parallelism 16]

1. baseline: `workers` threads create fastpods x replicas plain Pods (same template, nodeName
   set) through the same Python client: what the API server + client manage on this machine;
2. fastshare: `fastpods` FastPods of `replicas` MPS replicas each; the controller allocates
   (FastShareAllocation object), has an agent prepare the share (gRPC, mTLS), creates the Pod; a stand-in
   kubelet marks Pods Ready. Reported: Pods created per second, and time until every
   FastPod reports all replicas ready.
Target: >= 30 pods/s on this machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kubernetes import client, watch

from fastshare.controller.agent_client import AgentPool
from fastshare.controller.core import Settings as CoreSettings
from fastshare.k8s import envtest
from fastshare.k8s.controller import KubeController, KubeSettings
from fastshare.k8s.pods import FASTPOD_LABEL
from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.security import certs
from fastshare.security.tls import TlsPaths
from tests.k8s.agents import NODE_ALLOCATABLE, Agent, register_node

CONTAINER = {"name": "main", "image": "busybox", "command": ["sleep", "inf"]}


def _namespace(core: client.CoreV1Api) -> str:
    name = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    account = client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="default"))
    core.create_namespaced_service_account(name, account)
    return name


def baseline(api: client.ApiClient, total: int, workers: int, node: str) -> float:
    core = client.CoreV1Api(api)
    namespace = _namespace(core)

    def create(i: int) -> None:
        # The reply is not turned into typed models (~7 ms per Pod in Python): the API server's rate.
        core.create_namespaced_pod(namespace, {"apiVersion": "v1", "kind": "Pod",
                                               "metadata": {"name": f"plain-{i}", "labels": {"app": "plain"}},
                                               "spec": {"nodeName": node, "containers": [CONTAINER]}},
                                   _preload_content=False).drain_conn()

    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(create, range(total)))
    return total / (time.perf_counter() - started)


def kubelet(api: client.ApiClient, namespace: str, stop: threading.Event, seen: list[float]) -> None:
    """Marks each new bound Pod Running + Ready (what kubelets would report) and notes when it saw
    it in ``seen``; watches, never polls, and handles plain JSON (no typed models), so that the
    bench harness, which shares the process and the API server with the controller, does not
    compete with it for the 2 cores."""
    core = client.CoreV1Api(api)
    done: set[str] = set()
    while not stop.is_set():
        stream = watch.Watch()
        for event in stream.stream(core.list_namespaced_pod, namespace, label_selector=FASTPOD_LABEL,
                                   timeout_seconds=5, deserialize=False):
            pod = event["object"]
            name = pod["metadata"]["name"]
            if event["type"] != "ADDED" or name in done or not pod["spec"].get("nodeName"):
                continue
            seen.append(time.perf_counter())
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            core.patch_namespaced_pod_status(name, namespace, {"status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}},
                _preload_content=False).drain_conn()
            done.add(name)
            if stop.is_set():
                break


def fastshare_run(api: client.ApiClient, fastpods: int, replicas: int, workers: int, tls: TlsPaths,
                  parallelism: int = KubeSettings.create_parallelism) -> tuple[float, float, float]:
    core = client.CoreV1Api(api)
    objects = client.CustomObjectsApi(api)
    namespace = _namespace(core)
    controller = KubeController(api, AgentPool(tls, deadline=30.0),
                                KubeSettings(namespace=namespace, workers=workers, node_interval=2.0,
                                             resync_interval=60, watch_timeout=30,
                                             create_parallelism=parallelism),
                                CoreSettings(heartbeat_timeout=30.0, reconcile_interval=30.0))
    controller.start()
    stop = threading.Event()
    seen: list[float] = []
    helper = threading.Thread(target=kubelet, args=(api, namespace, stop, seen), daemon=True)
    helper.start()
    total = fastpods * replicas
    started = time.perf_counter()
    for i in range(fastpods):
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fastpod_manifest(
            f"fp-{i}", {"kind": "mps", "memory": "128Mi"}, replicas))
    created_at = ready_at = None
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline and ready_at is None:
        if created_at is None and len(seen) >= total:
            created_at = seen[total - 1]
        if created_at:  # not before: reading 10 FastPods each second costs the controller's process too
            items = objects.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
            if all((f.get("status") or {}).get("readyReplicas") == replicas for f in items):
                ready_at = time.perf_counter()
        time.sleep(0.5)
    stop.set()
    controller.stop()
    controller.core.agents.close()
    if ready_at is None:
        raise SystemExit("fastshare run did not finish within 30 minutes")
    return total / (created_at - started), created_at - started, ready_at - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fastpods", type=int, default=10)
    parser.add_argument("--replicas", type=int, default=50)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--parallelism", type=int, default=KubeSettings.create_parallelism,
                        help="replicas of one FastPod in flight at once (the controller's default)")
    args = parser.parse_args()
    total = args.fastpods * args.replicas
    with tempfile.TemporaryDirectory() as tmp, envtest.ControlPlane(envtest.find_assets()) as plane:
        root = Path(tmp)
        api = plane.api_client()
        envtest.install_crds(api)
        certs.init_ca(root / "ca")
        certs.issue(root / "ca", "controller", root / "controller", role="controller", days=1)
        tls = TlsPaths.in_dir(root / "controller", "controller")
        # 2 nodes x 8 GPUs x 48 MPS clients each = 768 shares >= 500; each node allows as many
        # Pods (kubelet --max-pods 1000: the controller counts status.allocatable.pods)
        agents = [Agent(root, root / "ca", f"node-{i}", ["V100-SXM2-32GB"] * 8, mig=False) for i in range(2)]
        core = client.CoreV1Api(api)
        try:
            for agent in agents:
                agent.start(tls)
                register_node(core, agent)
                allocatable = {**NODE_ALLOCATABLE, "pods": "1000"}
                core.patch_node_status(agent.name, {"status": {"allocatable": allocatable,
                                                               "capacity": allocatable}})
            # bound to a node that is not a GPU node: the baseline's Pods take none of their room
            plain = baseline(api, total, args.workers, "baseline-node")
            rate, created, ready = fastshare_run(api, args.fastpods, args.replicas, args.workers, tls,
                                                 args.parallelism)
        finally:
            for agent in agents:
                agent.stop()
    print(f"plain Pod creates (baseline, {args.workers} threads): {plain:7.1f} pods/s")
    print(f"fastshare replicas ({args.fastpods} FastPods x {args.replicas}): {rate:7.1f} pods/s "
          f"= {rate / plain:.2f} x baseline; all created in {created:.1f} s, all ready in {ready:.1f} s")


if __name__ == "__main__":
    main()
