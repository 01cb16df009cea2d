"""FastPod -> Spec and FastPod -> replica Pod, checked against the real API server."""

from __future__ import annotations

import copy
import time
import uuid

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kubernetes import client

from fastshare.controller.model import Allocation, Device, Kind, Spec, State
from fastshare.controller.validation import Request, ValidationError, validate
from fastshare.k8s.pods import (
    ALLOCATION_ANNOTATION,
    FASTPOD_LABEL,
    TEMPLATE_HASH_LABEL,
    is_outdated,
    replica_pod,
    spec_of,
    template_hash,
)
from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.k8s.store import replica_key

from .test_crd import FULL_TEMPLATE, VALID_GPU

GiB = 2**30


def test_spec_of_maps_every_field():
    fp = fastpod_manifest("x", {"kind": "fastpod", "smPercent": 40, "memory": "1.5Gi", "quotaRequest": 0.25,
                                "quotaLimit": 0.5, "models": ["A100*"], "affinity": "team-a",
                                "antiAffinity": "noisy", "exclusion": "secure"})
    fp["spec"]["template"]["spec"]["nodeSelector"] = {"zone": "b", "rack": "1"}
    assert spec_of(fp) == Spec(
        kind=Kind.FASTPOD, sm_percent=40, memory_bytes=3 * GiB // 2, quota_request=0.25, quota_limit=0.5,
        models=("A100*",), node_selector=(("rack", "1"), ("zone", "b")), affinity="team-a",
        anti_affinity="noisy", exclusion="secure")
    assert spec_of(fastpod_manifest("x", {"kind": "mps", "memory": 1000})).memory_bytes == 1000
    assert spec_of(fastpod_manifest("x", {"kind": "mps", "memory": "1G"})).memory_bytes == 10**9
    assert spec_of(fastpod_manifest("x", VALID_GPU["whole"])).gpu_count == 2
    assert spec_of(fastpod_manifest("x", VALID_GPU["exclusive"])).mig_profile == "1g.10gb"


_gpu = st.fixed_dictionaries(
    {"kind": st.sampled_from(["fastpod", "mps", "exclusive", "whole"])},
    optional={
        "smPercent": st.integers(-5, 110),
        "memory": st.sampled_from(["0", "1", "512Mi", "8Gi", "1.5Gi", "3e9", 0, 4096]),
        "quotaRequest": st.sampled_from([0, 0.1, 0.5, 1, 1.5]),
        "quotaLimit": st.sampled_from([0, 0.2, 0.5, 1, 2]),
        "migProfile": st.sampled_from(["1g.10gb", "3g.40gb", "7g.80gb"]),
        "smCount": st.sampled_from([0, 1, 42, 200, 1024, 1025]),
        "count": st.integers(0, 20),
        "models": st.lists(st.sampled_from(["A100", "H100*", "", "M" * 128, "M" * 129]),
                           max_size=3, unique=True),
        "affinity": st.sampled_from(["a", "team/x", "bad tag"]),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gpu=_gpu)
@example(gpu={"kind": "whole", "count": 17})  # at the limits the two share (validation.schema_limits)
@example(gpu={"kind": "exclusive", "smCount": 1025})
@example(gpu={"kind": "mps", "memory": "1Gi", "models": ["M" * 129]})
def test_the_crd_and_the_controller_validation_agree(api_client, fastpod_crd, namespace, gpu):
    """Whatever the API server admits, the controller accepts (with no GPU known) and vice versa,
    except that the CRD refuses a field written as zero where it does not apply (or must be > 0),
    which the controller cannot tell from an unset field."""
    objects = client.CustomObjectsApi(api_client)
    body = fastpod_manifest("agree", gpu)
    try:
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, dry_run="All")
        admitted, why = True, ""
    except client.ApiException as exc:
        assert exc.status == 422, exc.body
        admitted, why = False, exc.body
    try:
        validate(Request(spec=spec_of(body)), [])
        accepted, reason = True, ""
    except ValidationError as exc:
        accepted, reason = False, str(exc)
    if accepted and not admitted:
        # only allowed when the difference is a field written as zero: without them it is admitted
        unset = {k: v for k, v in gpu.items() if str(v) != "0"}
        assert unset != gpu, (gpu, why)
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                fastpod_manifest("agree", unset), dry_run="All")
    else:
        assert admitted == accepted, (gpu, why, reason)


def _allocation(node: str, env: dict[str, str]) -> Allocation:
    now = time.time()
    return Allocation(id="alloc-1", spec=Spec(kind=Kind.FASTPOD, sm_percent=40, memory_bytes=GiB), owner="o",
                      state=State.ACTIVE, node=node, devices=[Device(gpu_index=0, gpu_uuid="GPU-aaa")],
                      env=env, created_at=now, updated_at=now)


ENV = {
    "CUDA_VISIBLE_DEVICES": "GPU-aaa",
    "NVIDIA_VISIBLE_DEVICES": "GPU-aaa",
    "CUDA_MPS_PIPE_DIRECTORY": "/run/fastshare/mps/GPU-aaa/pipe",
    "CUDA_MPS_LOG_DIRECTORY": "/run/fastshare/mps/GPU-aaa/log",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
}


@pytest.fixture
def cluster_prereqs(api_client, namespace):
    """What FULL_TEMPLATE refers to: a ServiceAccount and a PriorityClass (admission checks both)."""
    client.CoreV1Api(api_client).create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="trainer")))
    try:
        client.SchedulingV1Api(api_client).create_priority_class(
            client.V1PriorityClass(metadata=client.V1ObjectMeta(name="high"), value=1000))
    except client.ApiException as exc:
        if exc.status != 409:
            raise


def test_replica_pod_keeps_the_template_and_adds_the_gpu_share(api_client, fastpod_crd, namespace,
                                                                 cluster_prereqs):
    objects = client.CustomObjectsApi(api_client)
    template = copy.deepcopy(FULL_TEMPLATE)
    template["spec"]["containers"][0]["env"].append({"name": "CUDA_VISIBLE_DEVICES", "value": "all"})
    fp = objects.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, fastpod_manifest("full", VALID_GPU["fastpod"], template=template))
    pod_name = f"full-{uuid.uuid4().hex[:5]}"
    body = replica_pod(fp, pod_name, _allocation("gpu-node-1", ENV))
    created = client.CoreV1Api(api_client).create_namespaced_pod(namespace, body)
    pod = client.ApiClient().sanitize_for_serialization(created)
    spec = pod["spec"]

    assert spec["nodeName"] == "gpu-node-1"
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("FastPod", "full",
                                                                                 fp["metadata"]["uid"], True)
    assert pod["metadata"]["labels"] == {"app": "full", "tier": "train", FASTPOD_LABEL: "full",
                                         TEMPLATE_HASH_LABEL: template_hash(fp)}
    assert pod["metadata"]["annotations"] == {"note": "kept", ALLOCATION_ANNOTATION: "alloc-1"}
    for container in spec["initContainers"] + spec["containers"]:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {k: env[k] for k in ENV} == ENV
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["fastshare-mps-pipe"] == "/run/fastshare/mps/GPU-aaa/pipe"
        assert mounts["fastshare-mps-log"] == "/run/fastshare/mps/GPU-aaa/log"
        assert mounts["data"] == "/data"
    main = spec["containers"][0]
    assert [e["name"] for e in main["env"]].count("CUDA_VISIBLE_DEVICES") == 1  # ours replaced "all"
    assert {e["name"]: e.get("value") for e in main["env"]}["A"] == "1"
    assert main["args"] == ["train.py", "--epochs", "3"]
    assert main["securityContext"] == {"runAsUser": 1000, "readOnlyRootFilesystem": True}
    assert main["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["data"]["emptyDir"] == {"sizeLimit": "1Gi"}
    assert volumes["fastshare-mps-pipe"]["hostPath"] == {"path": "/run/fastshare/mps/GPU-aaa/pipe",
                                                         "type": "Directory"}
    assert spec["tolerations"][0] == {"key": "dedicated", "operator": "Equal", "value": "ml",
                                      "effect": "NoSchedule"}
    assert {"key": "fastshare.io/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    for field in ("affinity", "nodeSelector", "priorityClassName", "serviceAccountName", "hostAliases",
                  "terminationGracePeriodSeconds"):
        assert spec[field] == FULL_TEMPLATE["spec"][field], field
    assert spec["securityContext"] == FULL_TEMPLATE["spec"]["securityContext"]
    # the FastPod's own template is untouched
    assert fp["spec"]["template"] == objects.get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "full")["spec"]["template"]


def test_whole_gpu_pods_get_env_but_no_mps_mounts(api_client, fastpod_crd, namespace):
    fp = client.CustomObjectsApi(api_client).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, fastpod_manifest("whole", VALID_GPU["whole"]))
    env = {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b", "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    body = replica_pod(fp, "whole-0", _allocation("n2", env))
    created = client.CoreV1Api(api_client).create_namespaced_pod(namespace, body)
    assert created.spec.node_name == "n2"
    assert not any(v.host_path for v in created.spec.volumes or [])
    assert {e.name: e.value for e in created.spec.containers[0].env} == env


def test_every_request_field_is_named_as_the_fastpod_spells_it():
    """Conditions name the FastPod field the user wrote (spec.gpu.memory), not the gRPC name."""
    from dataclasses import fields

    from fastshare.k8s.manifests import crds
    from fastshare.k8s.pods import fastpod_field

    crd = next(c for c in crds() if c["spec"]["names"]["plural"] == PLURAL)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for f in fields(Spec):
        path = fastpod_field(f"spec.{f.name}").split(".")
        assert path[0] == "spec" and path[1] in schema, (f.name, path)
        if path[1] == "gpu":
            assert path[2] in schema["gpu"]["properties"], (f.name, path)
    with pytest.raises(ValidationError) as caught:
        validate(Request(spec=spec_of(fastpod_manifest("x", {"kind": "mps", "memory": 0}))), [])
    assert fastpod_field(caught.value.field) == "spec.gpu.memory"


def test_the_longest_names_the_crd_accepts_make_a_valid_replica_request():
    """A FastPod name of up to 63 characters (the CRD's limit) in a namespace of up to 63: its
    replicas' idempotency key (namespace/fastpod/pod, the pod named fastpod-xxxxxx) must pass the
    controller's validation, or every replica is refused for good with a message about an
    internal field the user never wrote."""
    namespace, name = "n" * 63, "f" * 63
    fp = fastpod_manifest(name, {"kind": "mps", "memory": "1Gi"}, namespace=namespace)
    pod = f"{name}-abcdef"
    validate(Request(spec=spec_of(fp), owner=f"{namespace}/{name}",
                     idempotency_key=replica_key(namespace, name, pod)), [])


@pytest.mark.parametrize("selector", [
    {f"k{i}": "v" for i in range(65)},          # more entries than the controller takes
    {"zone": "v" * 64},                          # a value no node label can have
], ids=["65-entries", "long-value"])
def test_a_node_selector_the_controller_refuses_is_refused_at_create_naming_it(
        api_client, fastpod_crd, namespace, selector):
    body = fastpod_manifest("selector", {"kind": "mps", "memory": "1Gi"})
    body["spec"]["template"]["spec"]["nodeSelector"] = selector
    with pytest.raises(ValidationError, match=r"spec\.node_selector"):
        validate(Request(spec=spec_of(body)), [])
    with pytest.raises(client.ApiException) as refused:
        client.CustomObjectsApi(api_client).create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, body, dry_run="All")
    assert refused.value.status == 422
    assert "spec.template.spec.nodeSelector" in refused.value.body


def test_a_replica_is_outdated_only_when_its_recorded_template_hash_differs():
    def pod(labels):
        return {"metadata": {"name": "p", "labels": labels}}
    assert not is_outdated(pod({TEMPLATE_HASH_LABEL: "abc"}), "abc")
    assert is_outdated(pod({TEMPLATE_HASH_LABEL: "old"}), "abc")
    # made by a version that recorded no hash (an upgrade): unknown, not counted
    assert not is_outdated(pod({"app": "x"}), "abc")
    assert not is_outdated({"metadata": {"name": "p"}}, "abc")
