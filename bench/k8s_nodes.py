#!/usr/bin/env python3
"""What a Node sync of the in-cluster controller costs it to read the GPU nodes: a listing of
every Node object each sync (before 2026-11-28), against the Node watch's cache (now).

Builds ``--nodes`` Node objects as a kubelet reports them (labels, annotations, allocatable,
four conditions, addresses, node info, its 50 largest images: what ``nodeStatusMaxImages``
keeps), serialized as the API server sends them, then times in this process:
  - the old sync's read: the listing's JSON parsed into typed ``V1Node`` objects by the
    Kubernetes client, then each node's facts;
  - the watch's one-time cost: the same listing parsed as JSON into the cache (``NodeCache``);
  - each sync now: the cache's snapshot and each node's facts;
  - a watch event (one Node changed): parsed and put into the cache.
Not measured: the API server's side (it served the listing every sync; now one watch) and the
network. No API server is needed: the figures are the controller's CPU.

    python bench/k8s_nodes.py [--nodes 10000]
"""

from __future__ import annotations

import argparse
import json
import time

from kubernetes import client

from fastshare.k8s.nodecache import NodeCache
from fastshare.k8s.scheduling import node_facts


def kubelet_node(i: int) -> dict:
    name = f"gpu-node-{i:05d}"
    stamp = "2026-11-28T00:00:00Z"
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-{i}", "resourceVersion": str(1000 + i),
                     "creationTimestamp": stamp,
                     "labels": {"kubernetes.io/hostname": name, "fastshare.io/gpu": "true",
                                "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                                "topology.kubernetes.io/zone": f"z{i % 3}"},
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0",
                                     "volumes.kubernetes.io/controller-managed-attach-detach": "true"}},
        "spec": {"podCIDR": "10.0.0.0/24", "podCIDRs": ["10.0.0.0/24"]},
        "status": {
            "capacity": {"cpu": "96", "memory": "1000Gi", "pods": "110", "nvidia.com/gpu": "8"},
            "allocatable": {"cpu": "95", "memory": "990Gi", "pods": "110", "nvidia.com/gpu": "8"},
            "conditions": [{"type": t, "status": "False", "lastHeartbeatTime": stamp,
                            "lastTransitionTime": stamp, "reason": f"KubeletHasNo{t}",
                            "message": f"kubelet has no {t}"}
                           for t in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")],
            "addresses": [{"type": "InternalIP", "address": f"10.0.{i // 256}.{i % 256}"},
                          {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": "m", "systemUUID": "s", "bootID": "b", "kernelVersion": "6.1.0",
                         "osImage": "Debian GNU/Linux 12", "containerRuntimeVersion": "containerd://1.7.20",
                         "kubeletVersion": "v1.31.0", "kubeProxyVersion": "v1.31.0",
                         "operatingSystem": "linux", "architecture": "amd64"},
            "images": [{"names": [f"registry.example.com/team/image-{k}@sha256:{'a' * 64}",
                                  f"registry.example.com/team/image-{k}:v1.2.{k}"], "sizeBytes": 123456789}
                       for k in range(50)]}}


def cpu(step) -> tuple[float, object]:
    began = time.process_time()
    result = step()
    return time.process_time() - began, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10000, help="GPU nodes [10000]")
    args = parser.parse_args()
    body = json.dumps({"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "99999"},
                       "items": [kubelet_node(i) for i in range(args.nodes)]})
    api = client.ApiClient()

    def old_sync():
        listed = api.deserialize(body, "V1NodeList", "application/json").items
        return {n.metadata.name: n for n in listed}   # then each node's facts, as now (not timed)

    old_s, _ = cpu(old_sync)
    cache = NodeCache()
    watch_s, _ = cpu(lambda: cache.replace(json.loads(body)["items"], "99999"))
    now_s, facts = cpu(lambda: {n["metadata"]["name"]: node_facts(n) for n in cache.nodes()})
    event = json.dumps({"type": "MODIFIED", "object": {**kubelet_node(7), "metadata": {
        **kubelet_node(7)["metadata"], "resourceVersion": "100000"}}})
    event_s, _ = cpu(lambda: [cache.put(json.loads(event)["object"]) for _ in range(1000)])
    assert len(facts) == args.nodes
    print(f"{args.nodes:,} GPU Node objects, {len(body) / 1e6:.1f} MB of JSON as listed")
    print(f"{'CPU s':>61}")
    print(f"{'each sync before: the listing parsed into V1Node objects':52} {old_s:>8.2f}")
    print(f"{'once now: the watch listing parsed into the cache':52} {watch_s:>8.2f}")
    print(f"{'each sync now: the cache read and the facts of every node':52} {now_s:>8.2f}")
    print(f"{'a watch event (one Node changed), CPU ms':52} {event_s / 1000 * 1e3:>8.3f}")
    print(f"each sync reads the nodes in {now_s / old_s:.2f}x the CPU of before")


if __name__ == "__main__":
    main()
