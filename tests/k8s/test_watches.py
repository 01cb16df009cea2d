"""The controller's watches against the real API server: a watch that times out is renewed from
the last resourceVersion it saw, not by listing everything again; only a version the API server
refuses (410 Gone, "too large resource version") lists again; the caches' tombstones are still
forgotten meanwhile."""

from __future__ import annotations

import collections
import functools
import time

import pytest
from kubernetes import client

from fastshare.controller.agent_client import AgentPool
from fastshare.k8s.controller import KubeController, KubeSettings
from fastshare.k8s.pods import FASTPOD_LABEL
from fastshare.security import certs
from fastshare.security.tls import TlsPaths

from .conftest import wait_for


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsPaths:
    root = tmp_path_factory.mktemp("pki")
    certs.init_ca(root / "ca")
    certs.issue(root / "ca", "controller", root / "pki", sans=["127.0.0.1"], role="controller")
    return TlsPaths.in_dir(root / "pki", "controller")


# What the API server streams for a version it no longer has (410), and for one it does not have
# yet (after etcd was restored from a snapshot without bumping its revision). This one keeps every
# event since its start in its watch cache, so it never says either within a test.
TOO_OLD = (b'{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",'
           b'"message":"too old resource version: 1 (207)","reason":"Expired","code":410}}\n')
TOO_LARGE = (b'{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",'
             b'"message":"Timeout: Too large resource version: 900, current: 207","reason":"Timeout",'
             b'"details":{"causes":[{"reason":"ResourceVersionTooLarge","message":"Too large resource '
             b'version"}],"retryAfterSeconds":1},"code":504}}\n')


class _Refused:
    """A watch response that is only the API server's ERROR event ``line``."""

    def __init__(self, line: bytes) -> None:
        self.line = line

    def stream(self, amt=None, decode_content=False):
        yield self.line

    def close(self):
        pass

    def release_conn(self):
        pass


def _counted(api: object, name: str, calls: collections.Counter, refuse_first_watch: bytes = b"") -> None:
    """Count ``api.name``'s LIST and WATCH requests (``refuse_first_watch``: the first watch is
    answered with that ERROR event, e.g. 410 Gone after a watch that was down longer than the API
    server keeps events)."""
    real = getattr(api, name)

    @functools.wraps(real)
    def call(*args, **kwargs):
        kind = "watch" if kwargs.get("watch") else "list"
        calls[(name, kind)] += 1
        if kind == "watch" and refuse_first_watch and calls[(name, kind)] == 1:
            return _Refused(refuse_first_watch)
        return real(*args, **kwargs)

    setattr(api, name, call)


def _pod(name: str) -> client.V1Pod:
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name, labels={FASTPOD_LABEL: "fp"}),
                        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="x")]))


@pytest.mark.parametrize("refusal", [TOO_OLD, TOO_LARGE], ids=["410-too-old", "504-too-large"])
def test_watches_resume_after_their_timeout_and_list_again_only_when_refused(api_client, fastpod_crd,
                                                                             namespace, tls, refusal):
    """A watch the API server refuses with an ERROR event lists again (resuming from that version
    is refused again, for good, when it is ahead of the API server's)."""
    controller = KubeController(api_client, AgentPool(tls, deadline=5.0), KubeSettings(
        namespace=namespace, workers=1, node_interval=0.5, resync_interval=3600, watch_timeout=1))
    calls: collections.Counter = collections.Counter()
    _counted(controller.objects, "list_namespaced_custom_object", calls)          # FastPods
    _counted(controller.pods, "list_namespaced_pod", calls, refusal)   # replicas
    _counted(controller.pods, "list_pod_for_all_namespaces", calls)               # every bound Pod
    core = client.CoreV1Api(api_client)
    try:
        controller.start()
        time.sleep(6)   # several watch timeouts
        for name in ("list_namespaced_custom_object", "list_pod_for_all_namespaces"):
            assert calls[(name, "watch")] >= 3, calls
            assert calls[(name, "list")] == 1, f"{name} listed again on every watch timeout: {calls}"
        # the replicas' watch was refused its version: listed once more, then resumed
        assert calls[("list_namespaced_pod", "list")] == 2, calls
        assert calls[("list_namespaced_pod", "watch")] >= 3, calls
        # events still arrive after the renewals, and a deleted Pod's tombstone is forgotten
        # once the watch has moved past it, without a relist
        core.create_namespaced_pod(namespace, _pod("a"))
        wait_for(lambda: controller.podcache.of(namespace, "fp"), "the Pod in the cache")
        core.delete_namespaced_pod("a", namespace, grace_period_seconds=0)
        wait_for(lambda: not controller.podcache.of(namespace, "fp"), "the Pod gone from the cache")
        wait_for(lambda: not controller.podcache._gone, "the tombstone forgotten", timeout=10)
        assert calls[("list_namespaced_pod", "list")] == 2, calls
    finally:
        controller.stop()
        controller.core.agents.close()
