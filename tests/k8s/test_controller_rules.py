"""The controller's reads around one placement (no API server: its Pod/Node/Namespace reads are
answered by a stand-in): what a replica with inter-pod rules is checked against must be what
holds when it is placed, not when its pass began."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubernetes import client

from fastshare.controller.agent_client import AgentPool
from fastshare.k8s.controller import KubeController
from fastshare.k8s.podaffinity import HOSTNAME, Incoming, pod_rules
from fastshare.k8s.scheduling import NodeFacts
from fastshare.security.tls import TlsPaths


class _Reply:
    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


class _Core:
    """list_node and list_namespace as a CoreV1Api answers them (one page)."""

    def __init__(self, nodes: dict[str, dict[str, str]], namespaces: dict[str, dict[str, str]]) -> None:
        self.nodes, self.namespaces = nodes, namespaces

    @staticmethod
    def _page(items: dict[str, dict[str, str]]) -> _Reply:
        return _Reply({"metadata": {}, "items": [{"metadata": {"name": n, "labels": labels}}
                                                 for n, labels in items.items()]})

    def list_node(self, **_: Any) -> _Reply:
        return self._page(self.nodes)

    def list_namespace(self, **_: Any) -> _Reply:
        return self._page(self.namespaces)


def _controller(tmp_path: Path, core: _Core) -> KubeController:
    tls = TlsPaths(tmp_path / "cert", tmp_path / "key", tmp_path / "ca")
    controller = KubeController(client.ApiClient(), AgentPool(tls))
    controller.pods = core   # type: ignore[assignment]
    controller._nodes = {n: NodeFacts(n, ((HOSTNAME, n),)) for n in core.nodes}
    return controller


def _bound(name: str, node: str, spec: dict[str, Any], namespace: str = "other") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, "resourceVersion": "7", "labels": {}},
            "spec": {"nodeName": node, **spec}, "status": {"phase": "Running"}}


def test_a_ruled_replica_reads_namespaces_a_pod_bound_after_its_pass_began_needs(tmp_path):
    """The replica has rules of its own (so its check is made at the pass's start); a Pod whose
    anti-affinity selects it through a namespaceSelector by label is bound only later, before
    the replica takes the lock: the replica's namespace labels must be read then, or the
    term selects nothing and the replica lands in that Pod's domain."""
    core = _Core({"a": {HOSTNAME: "a"}, "b": {HOSTNAME: "b"}}, {"ns": {"team": "x"}, "other": {}})
    controller = _controller(tmp_path, core)
    list(controller.peers.replacing([], "1"))
    labels = {"app": "web"}
    own = {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": HOSTNAME}]}}}
    incoming = Incoming("ns", labels, pod_rules(own, "ns", labels))
    check = controller._serial_check(incoming, (), controller._nodes)
    assert check([]) == {}
    controller.peers.put(_bound("lonely", "a", {"affinity": {"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"app": "web"}}, "topologyKey": HOSTNAME,
             "namespaceSelector": {"matchLabels": {"team": "x"}}}]}}}))
    assert set(check([])) == {"a"}
