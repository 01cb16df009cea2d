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
# The longest condition message (metav1.Condition) and allocation reason the API server takes:
# maxLength in the CRDs, which it counts in bytes (UTF-8).
MESSAGE_MAX = 32768


def clip(text: str, limit: int = MESSAGE_MAX) -> str:
    """``text`` within ``limit`` bytes of UTF-8, its end replaced by a note of what was left out:
    an agent's error or the API server's refusal can be longer than an object field may be,
    and a write refused for it would lose the whole status (or release) it was part of."""
    data = text.encode()
    if len(data) <= limit:
        return text
    room = limit - len(f" ... [{len(text)} characters left out]".encode())
    kept = data[:room].decode(errors="ignore")   # not half a character
    return f"{kept} ... [{len(text) - len(kept)} characters left out]"


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
