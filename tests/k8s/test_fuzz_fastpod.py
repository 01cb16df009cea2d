"""Property-based fuzzing of FastPod specs through the real API server (CRD OpenAPI schema + CEL
rules) and the in-cluster controller, with a real node agent on simulated GPUs behind it.

Hypothesis writes random, missing, huge, negative, wrongly typed and unicode values into
``spec.gpu``, ``spec.replicas`` and the parts of the pod template the controller reads or
copies. The property, for every input:

- the API server refuses it (422/400) with a message that names a ``spec.`` field, or
- the controller answers it in the FastPod's ``Scheduled`` condition: placed (then exactly
  ``replicas`` Pods run, each on a GPU node, and nothing else), or not placed with a reason
  and a message (``Invalid`` names the field; then no Pod exists and no agent holds a share);
- the controller never fails while reconciling it (no "reconciling ... failed" in its log),
  and after the FastPod is deleted no Pod and no agent share is left.

Only observable behaviour is used (FastPod status conditions, Pods, the agent's inventory).

    FASTSHARE_FUZZ_EXAMPLES=1000 make pytest PYTEST_ARGS='tests/k8s/test_fuzz_fastpod.py -s'
(CI runs 120 inputs.)
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import uuid
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client

from fastshare.controller.agent_client import AgentPool
from fastshare.controller.core import Settings as CoreSettings
from fastshare.k8s.controller import KubeController, KubeSettings
from fastshare.k8s.pods import FASTPOD_LABEL
from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.security import certs
from fastshare.security.tls import TlsPaths

from .agents import Agent, kubelet_step, register_node
from .conftest import wait_for

EXAMPLES = int(os.environ.get("FASTSHARE_FUZZ_EXAMPLES", "120"))

pytestmark = [pytest.mark.timeout(1800)]

# -- inputs ---------------------------------------------------------------------------------------
huge = st.sampled_from([0, -1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 10**30])
anything = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), huge,
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(["", "ü" * 70, "a" * 300, "1Gi", "8GB", "1e999", "-1Gi", "0.5", "3g.40gb", "L4"]),
    st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))
plausible = {
    "kind": st.sampled_from(["fastpod", "mps", "exclusive", "whole"]),
    "smPercent": st.integers(0, 101),
    "memory": st.sampled_from(["512Mi", "1Gi", "4Gi", "33Gi", "1Ti", "1", "0.5", "1e3", "2e20", "1E9",
                               "0", "100m"]) | st.integers(1, 2**36),
    "quotaRequest": st.sampled_from([0.1, 0.3, 0.5, 1.0, 0.0, 1.2]),
    "quotaLimit": st.sampled_from([0.2, 0.6, 1.0, 0.05]),
    "migProfile": st.sampled_from(["1g.10gb", "3g.40gb", "7g.80gb", "1g.20gb", "7g.999gb", "4g.40gb+me"]),
    "smCount": st.integers(1, 200) | st.just(1024) | st.just(1025),
    "count": st.integers(1, 3) | st.just(16) | st.just(17),
    "models": st.lists(st.sampled_from(["V100-SXM2-32GB", "H100*", "*", "", "x" * 129, "ü"]), max_size=3),
    "affinity": st.sampled_from(["team-a", "a/b.c_d", "has space", "ü", "a" * 64]),
    "antiAffinity": st.sampled_from(["team-b", ""]),
    "exclusion": st.sampled_from(["solo", "no!"]),
    "bogus": st.text(max_size=5),   # unknown field: the structural schema prunes it
}


@st.composite
def gpu_specs(draw) -> dict:
    """Mostly near-valid (a kind and its fields), each field sometimes missing or wild."""
    gpu = {}
    kind = draw(plausible["kind"])
    fields = {"fastpod": ["smPercent", "memory", "quotaRequest", "quotaLimit"], "mps": ["memory"],
              "exclusive": [draw(st.sampled_from(["migProfile", "smCount", "smPercent"]))],
              "whole": ["count"]}[kind]
    if draw(st.integers(0, 9)):         # 1 in 10: no kind at all
        gpu["kind"] = kind if draw(st.integers(0, 9)) else draw(anything)
    for name in fields:
        if draw(st.integers(0, 9)):     # 1 in 10: a needed field is missing
            gpu[name] = draw(plausible[name]) if draw(st.integers(0, 7)) else draw(anything)
    if draw(st.integers(0, 2)) == 0:    # 1 in 3: another field, fitting the kind or not
        name = draw(st.sampled_from(sorted(plausible)))
        gpu[name] = draw(plausible[name]) if draw(st.integers(0, 3)) else draw(anything)
    return gpu


_names = itertools.count()


@st.composite
def fastpods(draw) -> dict:
    body = fastpod_manifest(f"fz-{next(_names)}", draw(gpu_specs()), replicas=1)
    spec = body["spec"]
    if draw(st.integers(0, 4)) == 0:
        spec["replicas"] = draw(huge | anything)
    else:
        spec["replicas"] = draw(st.integers(0, 2))
    pod = spec["template"]["spec"]
    if draw(st.integers(0, 9)) == 0:
        odd_names = st.sampled_from(["Main_Upper", "ü", "a" * 64, ""]) | st.text(max_size=8)
        pod["containers"][0]["name"] = draw(odd_names)
    if draw(st.integers(0, 9)) == 0:
        pod["nodeSelector"] = draw(st.dictionaries(st.sampled_from(["zone", "", "bad key!", "ü"]),
                                                   st.sampled_from(["a", "", "ü"]) | anything, max_size=2))
    if draw(st.integers(0, 19)) == 0:
        del spec["gpu"]
    if draw(st.integers(0, 19)) == 0:
        spec["template"]["metadata"]["labels"]["app"] = draw(st.text(max_size=70))
    return body


# -- the cluster under test ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_env(api_client, fastpod_crd, tmp_path_factory):
    """A namespace, one agent (H100 in MIG mode + V100) with its Node, and the controller."""
    root = tmp_path_factory.mktemp("k8s-fuzz")
    certs.init_ca(root / "ca")
    certs.issue(root / "ca", "controller", root / "controller", role="controller", days=1)
    tls = TlsPaths.in_dir(root / "controller", "controller")
    core = client.CoreV1Api(api_client)
    namespace = f"fz-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(
        metadata=client.V1ObjectMeta(name="default")))
    agent = Agent(root, root / "ca", f"fz-{uuid.uuid4().hex[:4]}", ["H100-SXM5-80GB", "V100-SXM2-32GB"],
                  mig=True)
    agent.start(tls)
    register_node(core, agent)
    controller = KubeController(
        api_client, AgentPool(tls, deadline=10.0),
        KubeSettings(namespace=namespace, workers=2, node_interval=0.5, resync_interval=5, watch_timeout=10),
        CoreSettings(heartbeat_timeout=5.0, reconcile_interval=2.0, busy_wait=10.0))
    failures = _Failures()
    logging.getLogger("fastshare.k8s.controller").addHandler(failures)
    controller.start()
    wait_for(lambda: agent.name in {n.name for n in controller.store.list_nodes() if n.available},
             "the agent registered", timeout=60)
    yield namespace, agent, tls, failures
    logging.getLogger("fastshare.k8s.controller").removeHandler(failures)
    controller.stop()
    controller.core.agents.close()
    agent.stop()
    core.delete_node(agent.name)


class _Failures(logging.Handler):
    """Collects the controller's errors ('reconciling FastPod ... failed': an exception escaped).
    A lost compare-and-set (409 Conflict) is retried by design and must not be logged as one."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        self.messages.append(f"{record.getMessage()}: {exc!r}")


def _scheduled(objects, namespace: str, name: str) -> dict | None:
    """The Scheduled condition once the controller has answered this generation."""
    fp = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    status = fp.get("status") or {}
    if status.get("observedGeneration") != fp["metadata"]["generation"]:
        return None
    return next((c for c in status.get("conditions") or [] if c["type"] == "Scheduled"), None)


def _pods(core, namespace: str, name: str) -> list:
    return core.list_namespaced_pod(namespace, label_selector=f"{FASTPOD_LABEL}={name}").items


def _gone(objects, core, namespace: str, name: str) -> bool:
    kubelet_step(core, namespace)
    try:
        objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        return False
    except client.ApiException as exc:
        if exc.status != 404:
            raise
    return not _pods(core, namespace, name)


def test_every_fastpod_spec_is_refused_with_its_field_or_answered_in_a_condition(
        api_client, fuzz_env, capsys) -> None:
    namespace, agent, tls, failures = fuzz_env
    objects, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    seen: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=fastpods())
    def check(body: dict) -> None:
        seen["inputs"] += 1
        name = body["metadata"]["name"]
        try:
            objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
        except client.ApiException as exc:
            assert exc.status in (400, 422), (exc.status, exc.body, body)
            message = json.loads(exc.body)["message"]
            assert "spec." in message or "spec:" in message, (message, body)
            seen["refused by the API server"] += 1
            return
        condition = wait_for(lambda: _scheduled(objects, namespace, name), f"{name} answered ({body})",
                             timeout=60)
        assert condition["message"], (condition, body)
        pods = _pods(core, namespace, name)
        if condition["status"] == "True":
            stored = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            assert len(pods) == stored["spec"]["replicas"], (condition, body)
            assert all(p.spec.node_name == agent.name for p in pods)
            seen["placed"] += 1
        else:
            assert condition["reason"] in ("Invalid", "Unschedulable", "PodCreateFailed"), (condition, body)
            if condition["reason"] == "Invalid":   # named as the FastPod spells it
                assert condition["message"].startswith(("spec.gpu.", "spec.template.")), (condition, body)
            if condition["reason"] == "PodCreateFailed":   # the API server's reason, naming the field
                assert "spec." in condition["message"] or "metadata." in condition["message"], condition
            if condition["reason"] in ("Invalid", "PodCreateFailed"):
                assert not pods, (condition, body)
                assert not agent.shares(tls), (condition, body)
            seen[f"not placed: {condition['reason']}"] += 1
        objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        wait_for(lambda: _gone(objects, core, namespace, name), f"{name} deleted", timeout=60)
        assert not agent.shares(tls), f"shares left after {name} was deleted ({body})"
        assert not failures.messages, failures.messages[:3]

    check()
    assert not failures.messages, failures.messages[:3]
    # Nothing leaked into the controller's ledger: both GPUs can still be taken whole.
    for name, gpu in (("end-mig", {"kind": "exclusive", "migProfile": "7g.80gb"}),
                      ("end-whole", {"kind": "whole", "count": 1})):
        body = fastpod_manifest(name, gpu)
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
        condition = wait_for(lambda name=name: _scheduled(objects, namespace, name), name, timeout=60)
        assert condition["status"] == "True", condition
    with capsys.disabled():
        print(f"\nfuzz FastPod: {dict(seen)}")

