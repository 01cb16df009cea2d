"""Names of the fastshare custom resources and a builder for FastPod objects (used by tests, bench
and docs)."""

from __future__ import annotations

import copy
from typing import Any

GROUP, VERSION, PLURAL, KIND = "fastshare.io", "v1alpha1", "fastpods", "FastPod"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = "fastshare.io/release-shares"
# One FastShareAllocation per replica: the controller's state of record (fastshare.k8s.store).
ALLOCATION_PLURAL, ALLOCATION_KIND = "fastshareallocations", "FastShareAllocation"
ALLOCATION_FINALIZER = "fastshare.io/release-share"   # on an allocation object while it holds a share
ALLOCATION_LABEL = "fastshare.io/allocation"          # the allocation id (= the agent's share id)
# Audience of the node agents' projected ServiceAccount token: the DaemonSet projects it, the
# controller's TokenReview asks for it (fastshare.k8s.bootstrap). Not a value: both sides must agree.
TOKEN_AUDIENCE = "fastshare"


def fastpod_manifest(name: str, gpu: dict[str, Any], replicas: int = 1,
                     template: dict[str, Any] | None = None, namespace: str | None = None) -> dict[str, Any]:
    """A FastPod whose selector is ``app=<name>`` (added to the template's labels)."""
    template = copy.deepcopy(template) if template else {
        "spec": {"containers": [{"name": "main", "image": "busybox", "command": ["sleep", "inf"]}]},
    }
    template.setdefault("metadata", {}).setdefault("labels", {})["app"] = name
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}}, "template": template,
                 "gpu": dict(gpu)},
    }
