"""The FastPod CRD against a real kube-apiserver: schema + CEL validation, subresources, columns."""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes import client

from fastshare.k8s.resources import fastpod_manifest

GROUP, VERSION, PLURAL = "fastshare.io", "v1alpha1", "fastpods"

VALID_GPU = {
    "fastpod": {"kind": "fastpod", "smPercent": 50, "memory": "8Gi", "quotaRequest": 0.3, "quotaLimit": 0.6},
    "mps": {"kind": "mps", "memory": "4Gi"},
    "exclusive": {"kind": "exclusive", "migProfile": "1g.10gb"},
    "whole": {"kind": "whole", "count": 2},
}


def fastpod(name: str, gpu: dict, replicas: int = 1, template: dict | None = None) -> dict:
    return fastpod_manifest(name, gpu, replicas, template)


@pytest.fixture
def objects(api_client, fastpod_crd):
    return client.CustomObjectsApi(api_client)


def _create(objects, namespace, body):
    return objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def _rejection(objects, namespace, body) -> str:
    with pytest.raises(client.ApiException) as info:
        _create(objects, namespace, body)
    assert info.value.status == 422, info.value.body
    return json.loads(info.value.body)["message"]


def test_crd_is_established_with_names_and_subresources(api_client, fastpod_crd):
    crd = client.ApiextensionsV1Api(api_client).read_custom_resource_definition("fastpods.fastshare.io")
    assert crd.spec.scope == "Namespaced"
    assert crd.status.accepted_names.short_names == ["fp"]
    version = crd.spec.versions[0]
    assert (version.name, version.served, version.storage) == ("v1alpha1", True, True)
    assert version.subresources.scale.label_selector_path == ".status.selector"
    conditions = {c.type: c.status for c in crd.status.conditions}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"


@pytest.mark.parametrize("kind", sorted(VALID_GPU))
def test_a_valid_fastpod_of_each_kind_is_accepted(objects, namespace, kind):
    created = _create(objects, namespace, fastpod(f"ok-{kind}", VALID_GPU[kind]))
    assert created["spec"]["gpu"] == VALID_GPU[kind]
    assert created["spec"]["replicas"] == 1


INVALID = [
    ("limit-below-request", {**VALID_GPU["fastpod"], "quotaRequest": 0.8, "quotaLimit": 0.4},
     "spec.gpu.quotaLimit must be >= spec.gpu.quotaRequest"),
    ("sm-zero", {**VALID_GPU["fastpod"], "smPercent": 0}, "spec.gpu.smPercent: Invalid value: 0"),
    ("sm-101", {**VALID_GPU["fastpod"], "smPercent": 101}, "should be less than or equal to 100"),
    ("unknown-kind", {"kind": "fraction", "memory": "1Gi"}, 'spec.gpu.kind: Unsupported value: "fraction"'),
    ("fastpod-no-memory", {"kind": "fastpod", "smPercent": 20},
     "kind fastpod needs spec.gpu.smPercent and spec.gpu.memory"),
    ("mps-no-memory", {"kind": "mps"}, "kind mps needs spec.gpu.memory"),
    ("whole-no-count", {"kind": "whole"}, "kind whole needs spec.gpu.count"),
    ("exclusive-two-shapes", {"kind": "exclusive", "migProfile": "1g.10gb", "smCount": 14},
     "kind exclusive needs exactly one of spec.gpu.migProfile, spec.gpu.smCount, spec.gpu.smPercent"),
    ("exclusive-no-shape", {"kind": "exclusive"}, "kind exclusive needs exactly one of"),
    ("bad-quantity", {"kind": "mps", "memory": "8GB"}, "spec.gpu.memory: Invalid value"),
    ("zero-memory", {"kind": "mps", "memory": "0"}, "spec.gpu.memory must be > 0"),
    ("quota-zero", {**VALID_GPU["fastpod"], "quotaRequest": 0}, "spec.gpu.quotaRequest: Invalid value: 0"),
    ("quota-above-one", {**VALID_GPU["fastpod"], "quotaLimit": 1.5}, "should be less than or equal to 1"),
    ("quota-alone", {"kind": "fastpod", "smPercent": 10, "memory": "1Gi", "quotaRequest": 0.5},
     "spec.gpu.quotaRequest and spec.gpu.quotaLimit go together"),
    ("quota-on-mps", {"kind": "mps", "memory": "1Gi", "quotaRequest": 0.1, "quotaLimit": 0.2},
     "apply to kind fastpod only"),
    ("count-on-fastpod", {**VALID_GPU["fastpod"], "count": 2}, "spec.gpu.count > 1 needs kind whole"),
    ("memory-on-whole", {"kind": "whole", "count": 1, "memory": "1Gi"}, "does not apply to kind whole"),
    ("bad-mig-profile", {"kind": "exclusive", "migProfile": "half"}, "spec.gpu.migProfile: Invalid value"),
    ("bad-tag", {**VALID_GPU["mps"], "affinity": "has space"}, "spec.gpu.affinity: Invalid value"),
]


@pytest.mark.parametrize(("name", "gpu", "message"), INVALID, ids=[case[0] for case in INVALID])
def test_invalid_gpu_requests_are_rejected_with_the_field(objects, namespace, name, gpu, message):
    assert message in _rejection(objects, namespace, fastpod(name, gpu))


def test_missing_gpu_selector_mismatch_and_preset_node_name_are_rejected(objects, namespace):
    body = fastpod("no-gpu", VALID_GPU["mps"])
    del body["spec"]["gpu"]
    assert "spec.gpu: Required value" in _rejection(objects, namespace, body)

    body = fastpod("mismatch", VALID_GPU["mps"])
    body["spec"]["selector"] = {"matchLabels": {"app": "other"}}
    assert "spec.selector.matchLabels must match spec.template.metadata.labels" in _rejection(
        objects, namespace, body)

    body = fastpod("node-name", VALID_GPU["mps"])
    body["spec"]["template"]["spec"]["nodeName"] = "gpu-1"
    assert "nodeName is set by the fastshare controller" in _rejection(objects, namespace, body)

    body = fastpod("no-containers", VALID_GPU["mps"])
    body["spec"]["template"]["spec"]["containers"] = []
    assert "spec.template.spec.containers" in _rejection(objects, namespace, body)


FULL_TEMPLATE = {
    "metadata": {"labels": {"app": "full", "tier": "train"}, "annotations": {"note": "kept"}},
    "spec": {
        "initContainers": [{"name": "fetch", "image": "busybox", "command": ["true"],
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        "containers": [{
            "name": "main",
            "image": "pytorch:latest",
            "args": ["train.py", "--epochs", "3"],
            "env": [{"name": "A", "value": "1"}],
            "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
            "securityContext": {"runAsUser": 1000, "readOnlyRootFilesystem": True},
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        }],
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}],
        }}},
        "securityContext": {"fsGroup": 2000, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [{"name": "data", "emptyDir": {"sizeLimit": "1Gi"}}],
        "nodeSelector": {"gpu": "a100"},
        "priorityClassName": "high",
        "serviceAccountName": "trainer",
        "terminationGracePeriodSeconds": 5,
        "hostAliases": [{"ip": "127.0.0.1", "hostnames": ["local"]}],
    },
}


def test_a_full_pod_template_round_trips_unchanged(objects, namespace):
    body = fastpod("full", VALID_GPU["fastpod"], replicas=3, template=copy.deepcopy(FULL_TEMPLATE))
    body["spec"]["selector"] = {"matchLabels": {"app": "full"}}
    _create(objects, namespace, body)
    stored = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "full")
    assert stored["spec"]["template"] == FULL_TEMPLATE


def test_scale_subresource_sets_replicas_and_reports_the_selector(objects, namespace):
    _create(objects, namespace, fastpod("scaled", VALID_GPU["mps"]))
    objects.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "scaled", {"status": {"replicas": 1, "selector": "app=scaled"}})
    objects.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "scaled",
                                                 {"spec": {"replicas": 3}})
    stored = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "scaled")
    assert stored["spec"]["replicas"] == 3
    scale = objects.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "scaled")
    assert scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 1, "selector": "app=scaled"}
    with pytest.raises(client.ApiException) as info:
        objects.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "scaled",
                                                     {"spec": {"replicas": -1}})
    assert info.value.status == 422


def test_status_is_a_separate_subresource(objects, namespace):
    created = _create(objects, namespace, fastpod("status", VALID_GPU["exclusive"]))
    generation = created["metadata"]["generation"]
    status = {
        "replicas": 1,
        "readyReplicas": 0,
        "assignments": [{"pod": "status-0", "node": "gpu-1", "gpuUUIDs": ["GPU-1"], "migUUID": "MIG-1",
                         "placement": {"gpuIndex": 0, "profile": "1g.10gb", "start": 6, "size": 2}}],
        "conditions": [{"type": "Scheduled", "status": "False", "reason": "Unschedulable",
                        "message": "no GPU with a free 1g.10gb placement",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}],
    }
    # Status written through the main resource is dropped ...
    objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "status", {"status": status})
    assert "status" not in objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "status")
    # ... and written through /status it is kept, without touching spec or generation.
    objects.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "status", {"status": status, "spec": {"replicas": 5}})
    stored = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "status")
    assert stored["status"] == status
    assert stored["spec"]["replicas"] == 1
    assert stored["metadata"]["generation"] == generation
    with pytest.raises(client.ApiException) as info:
        objects.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, "status",
            {"status": {"conditions": [{**status["conditions"][0], "reason": "not a reason"}]}})
    assert "reason" in json.loads(info.value.body)["message"]


def test_the_gpu_share_is_immutable(objects, namespace):
    _create(objects, namespace, fastpod("immutable", VALID_GPU["fastpod"]))
    with pytest.raises(client.ApiException) as info:
        objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "immutable",
                                               {"spec": {"gpu": {"smPercent": 90}}})
    assert "spec.gpu is immutable" in json.loads(info.value.body)["message"]


def test_printer_columns_show_kind_and_replicas(api_client, objects, namespace):
    _create(objects, namespace, fastpod("columns", VALID_GPU["whole"], replicas=2))
    method, url, headers, body, post = api_client.param_serialize(
        "GET", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}",
        header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
    response = api_client.call_api(method, url, headers, body, post)
    response.read()
    table = json.loads(response.data)
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names[:5] == ["Name", "Kind", "Desired", "Ready", "SM%"]
    row = table["rows"][0]["cells"]
    assert row[:3] == ["columns", "whole", 2]
