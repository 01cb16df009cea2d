"""From a FastPod to what the controller needs: the engine's Spec, and each replica's Pod.

The Pod is the user's template, whole (init containers, tolerations, affinity, security
context, volumes, ...); the controller only adds what the GPU share needs: ``nodeName``, the
GPU environment in every container, hostPath mounts of the MPS pipe/log directories, a
toleration of the GPU-node taint, an owner reference to the FastPod, and labels/annotations
that tie the Pod to its allocation.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from kubernetes.utils import parse_quantity

from fastshare.controller.model import Allocation, Kind, Spec
from fastshare.k8s.resources import API_VERSION, KIND
from fastshare.k8s.scheduling import (
    Constraints,
    HostPort,
    constraints,
    host_ports,
    pod_demand,
    refuse_gpu_resources,
    refuse_resource_claims,
)

FASTPOD_LABEL = "fastshare.io/fastpod"
ALLOCATION_ANNOTATION = "fastshare.io/allocation"
# The hash of the template a replica Pod was made from (template_hash): a template edit is not
# rolled out to running replicas, and the FastPod's status counts those of an older one.
TEMPLATE_HASH_LABEL = "fastshare.io/template-hash"
# The MPS directories the agent hands out in the environment; mounted from the host as they are.
MPS_PATH_ENV = {
    "CUDA_MPS_PIPE_DIRECTORY": "fastshare-mps-pipe",
    "CUDA_MPS_LOG_DIRECTORY": "fastshare-mps-log",
}


# The controller's request fields (gRPC names) -> where the user wrote them in a FastPod.
FASTPOD_FIELDS = {
    "spec.kind": "spec.gpu.kind", "spec.sm_percent": "spec.gpu.smPercent",
    "spec.memory_bytes": "spec.gpu.memory", "spec.quota_request": "spec.gpu.quotaRequest",
    "spec.quota_limit": "spec.gpu.quotaLimit", "spec.mig_profile": "spec.gpu.migProfile",
    "spec.sm_count": "spec.gpu.smCount", "spec.gpu_count": "spec.gpu.count",
    "spec.models": "spec.gpu.models", "spec.affinity": "spec.gpu.affinity",
    "spec.anti_affinity": "spec.gpu.antiAffinity", "spec.exclusion": "spec.gpu.exclusion",
    "spec.node_selector": "spec.template.spec.nodeSelector",
    "spec.cpu_milli": "spec.template.spec.containers[*].resources.requests.cpu",
    "spec.host_memory_bytes": "spec.template.spec.containers[*].resources.requests.memory",
}


def fastpod_field(field: str) -> str:
    """A request field as the FastPod spells it, so a condition names what the user wrote."""
    return FASTPOD_FIELDS.get(field, field)


TEMPLATE_SPEC = "spec.template.spec"   # where a FastPod's Pod spec is, for messages


def spec_of(fastpod: dict[str, Any]) -> Spec:
    """The controller's request for one replica of ``fastpod`` (already schema-validated); the
    host CPU/memory is the replica Pod's effective request (TemplateError if unreadable, or if
    it asks the device plugin for a GPU or has ResourceClaims)."""
    gpu = fastpod["spec"]["gpu"]
    pod_spec = fastpod["spec"]["template"].get("spec") or {}
    demand = pod_demand(pod_spec, TEMPLATE_SPEC)
    refuse_gpu_resources(pod_spec, TEMPLATE_SPEC)
    refuse_resource_claims(pod_spec, TEMPLATE_SPEC)
    memory = gpu.get("memory")
    return Spec(
        kind=Kind(gpu["kind"]),
        sm_percent=int(gpu.get("smPercent", 0)),
        memory_bytes=math.ceil(parse_quantity(memory)) if memory is not None else 0,
        quota_request=float(gpu.get("quotaRequest", 0.0)),
        quota_limit=float(gpu.get("quotaLimit", 0.0)),
        mig_profile=gpu.get("migProfile", ""),
        sm_count=int(gpu.get("smCount", 0)),
        gpu_count=int(gpu.get("count", 0)),
        models=tuple(gpu.get("models") or ()),
        node_selector=tuple(sorted((pod_spec.get("nodeSelector") or {}).items())),
        affinity=gpu.get("affinity", ""),
        anti_affinity=gpu.get("antiAffinity", ""),
        exclusion=gpu.get("exclusion", ""),
        cpu_milli=demand.cpu_milli,
        host_memory_bytes=demand.memory_bytes,
    )


def gpu_toleration(gpu_node_label: str) -> dict[str, str]:
    """Added to every replica Pod: GPU nodes may be tainted to keep other Pods off."""
    return {"key": gpu_node_label, "operator": "Exists", "effect": "NoSchedule"}


def replica_constraints(fastpod: dict[str, Any], gpu_node_label: str) -> Constraints:
    """The replica Pod's required node affinity and tolerations (ours added), TemplateError if
    the template's cannot be read."""
    pod_spec = dict(fastpod["spec"]["template"].get("spec") or {})
    tolerations = pod_spec.get("tolerations") or []
    if isinstance(tolerations, list):
        pod_spec["tolerations"] = [*tolerations, gpu_toleration(gpu_node_label)]
    return constraints(pod_spec, TEMPLATE_SPEC)


def replica_host_ports(fastpod: dict[str, Any]) -> tuple[HostPort, ...]:
    """The host ports each replica Pod takes on its node (TemplateError if unreadable)."""
    return host_ports(fastpod["spec"]["template"].get("spec") or {}, TEMPLATE_SPEC)


def _with_env(container: dict[str, Any], env: dict[str, str]) -> None:
    """Our variables win over the user's of the same name (they decide which GPU is visible)."""
    kept = [e for e in container.get("env") or [] if e.get("name") not in env]
    container["env"] = kept + [{"name": k, "value": v} for k, v in sorted(env.items())]


def template_hash(fastpod: Mapping[str, Any]) -> str:
    """A short hash of ``fastpod``'s Pod template (a label value)."""
    text = json.dumps(fastpod["spec"]["template"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_outdated(pod: dict[str, Any], current: str) -> bool:
    """The replica Pod was made from another template than the one whose hash is ``current``.
    One made before the hash was recorded (an upgrade) is not counted: its template is not
    known, and counting it would call every replica of every FastPod outdated at once."""
    made_from = (pod["metadata"].get("labels") or {}).get(TEMPLATE_HASH_LABEL)
    return made_from is not None and made_from != current


def replica_labels(fastpod: Mapping[str, Any]) -> dict[str, str]:
    """The labels of ``fastpod``'s replica Pods: the template's, its name's and its hash's (the
    inter-pod rules are checked against these, see podaffinity.replica_incoming)."""
    template = fastpod["spec"]["template"]
    return {**((template.get("metadata") or {}).get("labels") or {}),
            FASTPOD_LABEL: fastpod["metadata"]["name"], TEMPLATE_HASH_LABEL: template_hash(fastpod)}


def replica_pod(fastpod: dict[str, Any], pod_name: str, allocation: Allocation,
                gpu_node_label: str = "fastshare.io/gpu") -> dict[str, Any]:
    """The Pod for one replica, holding ``allocation`` on ``allocation.node``."""
    meta = fastpod["metadata"]
    template = copy.deepcopy(fastpod["spec"]["template"])
    metadata = template.get("metadata") or {}
    metadata.update({
        "name": pod_name,
        "namespace": meta["namespace"],
        "labels": replica_labels(fastpod),
        "annotations": {**(metadata.get("annotations") or {}), ALLOCATION_ANNOTATION: allocation.id},
        "ownerReferences": [{
            "apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True,
        }],
    })
    metadata.pop("generateName", None)
    spec = template["spec"]
    spec["nodeName"] = allocation.node
    mounts = [{"name": volume, "mountPath": allocation.env[var]}
              for var, volume in MPS_PATH_ENV.items() if allocation.env.get(var)]
    for container in (spec.get("initContainers") or []) + spec["containers"]:
        _with_env(container, allocation.env)
        if mounts:
            names = {m["name"] for m in mounts}
            container["volumeMounts"] = [m for m in container.get("volumeMounts") or []
                                         if m.get("name") not in names] + copy.deepcopy(mounts)
    if mounts:
        ours = {m["name"] for m in mounts}
        spec["volumes"] = [v for v in spec.get("volumes") or [] if v.get("name") not in ours] + [
            {"name": m["name"], "hostPath": {"path": m["mountPath"], "type": "Directory"}} for m in mounts
        ]
    toleration = gpu_toleration(gpu_node_label)
    tolerations = spec.setdefault("tolerations", [])
    if toleration not in tolerations:
        tolerations.append(toleration)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def is_terminated(pod: dict[str, Any]) -> bool:
    """Its containers stopped for good (evicted, or exited under restartPolicy Never/OnFailure):
    the Pod runs nothing any more and never will again, but it stays until someone deletes it."""
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
