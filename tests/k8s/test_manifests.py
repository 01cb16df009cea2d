"""The rendered manifests (no API server needed): content, least privilege, values handling."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from fastshare.cli import main
from fastshare.k8s import manifests, scheduling
from fastshare.k8s.resources import MESSAGE_MAX, TOKEN_AUDIENCE, clip


def _by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def test_every_namespaced_object_lands_in_the_configured_namespace():
    docs = manifests.render({"namespace": "gpu-sharing"})
    assert _by_kind(docs, "Namespace")[0]["metadata"]["name"] == "gpu-sharing"
    cluster_scoped = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    for doc in docs:
        if doc["kind"] not in cluster_scoped:
            assert doc["metadata"]["namespace"] == "gpu-sharing", doc["kind"]
    binding = _by_kind(docs, "ClusterRoleBinding")[0]
    assert binding["subjects"][0]["namespace"] == "gpu-sharing"


def test_rbac_has_no_wildcards_and_exactly_the_controller_needs():
    docs = manifests.render()
    for role in _by_kind(docs, "ClusterRole") + _by_kind(docs, "Role"):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(key, []), (role["metadata"]["name"], rule)
    rules = {
        (group, resource): set(rule["verbs"])
        for rule in _by_kind(docs, "ClusterRole")[0]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert rules == {
        ("fastshare.io", "fastpods"): {"get", "list", "watch", "patch"},
        ("fastshare.io", "fastpods/status"): {"patch"},
        ("fastshare.io", "fastpods/finalizers"): {"update"},
        ("fastshare.io", "fastshareallocations"): {"create", "get", "list", "update", "delete"},
        ("", "pods"): {"create", "get", "list", "watch", "delete"},
        ("", "nodes"): {"list", "watch"},
        ("", "namespaces"): {"list"},
        ("authentication.k8s.io", "tokenreviews"): {"create"},
    }


def test_only_the_node_agent_container_is_privileged_and_it_has_no_api_token():
    docs = manifests.render()
    agent = _by_kind(docs, "DaemonSet")[0]["spec"]["template"]["spec"]
    assert agent["automountServiceAccountToken"] is False
    assert [c["securityContext"].get("privileged") for c in agent["containers"]] == [True]
    run = next(v for v in agent["volumes"] if v["name"] == "run")
    assert run["hostPath"]["path"] == "/run/fastshare"  # MPS root /run/fastshare/mps inside
    args = agent["containers"][0]["args"]
    assert args[:2] == ["node", "serve"] and "--run-dir=/run/fastshare" in args
    controller = _by_kind(docs, "Deployment")[0]
    assert controller["spec"]["replicas"] == 2
    pod = controller["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in pod["containers"]:
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert "privileged" not in container["securityContext"]


def test_values_override_deep_and_unknown_keys_are_refused_by_name():
    docs = manifests.render({"controller": {"replicas": 3}, "image": "registry.local/fastshare:dev"})
    deployment = _by_kind(docs, "Deployment")[0]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/fastshare:dev"
    # defaults next to the overridden key survive
    assert deployment["metadata"]["name"] == "fastshare-controller"
    with pytest.raises(manifests.ValuesError, match=r"controller\.replica: unknown value"):
        manifests.render({"controller": {"replica": 3}})
    with pytest.raises(manifests.ValuesError, match="agent: must be a mapping"):
        manifests.render({"agent": "yes"})


@pytest.mark.parametrize("values, key", [({"agent": {"port": 99999}}, "agent.port"),
                                         ({"controller": {"apiPort": 0}}, "controller.apiPort"),
                                         ({"controller": {"metricsPort": 65536}}, "controller.metricsPort")])
def test_ports_are_refused_outside_what_a_pod_can_have(values, key):
    # agent.port 99999 rendered a DaemonSet the API server refuses and a controller Deployment
    # whose --agent-port its own CLI refuses
    with pytest.raises(manifests.ValuesError, match=rf"{key}: must be an integer in 1\.\.65535"):
        manifests.render(values)
    assert manifests.render({"agent": {"port": 65535}})


@pytest.mark.parametrize("values, says", [
    ({"namespace": "Team-A"}, "namespace: 'Team-A' cannot name a Namespace: must be at most 63 lower-case"),
    ({"namespace": "a" * 64}, "namespace: 'aaaa"),
    ({"namespace": "gpu.sharing"}, "cannot name a Namespace"),
    ({"controller": {"name": "fastshare_ctl"}},
     "controller.name: 'fastshare_ctl' cannot name a Service: must be at most 63 lower-case letters"),
    ({"controller": {"name": "1ctl"}}, "starting with a letter"),       # a Service name (RFC 1035)
    ({"controller": {"serviceAccount": "Ctl"}}, "controller.serviceAccount: 'Ctl' cannot name a "
                                                "ServiceAccount: must be at most 253 lower-case"),
    ({"controller": {"leaseName": "lease..x"}}, "controller.leaseName: 'lease..x' cannot name a Lease"),
    ({"controller": {"tlsSecret": "tls_ca"}}, "controller.tlsSecret: 'tls_ca' cannot name a Secret"),
    ({"agent": {"name": "a" * 64}}, "agent.name: 'aaaa"),                 # also a label value: 63
    ({"agent": {"serviceAccount": "Agent"}}, "agent.serviceAccount: 'Agent' cannot name a ServiceAccount"),
    ({"agent": {"caConfigMap": "CA"}}, "agent.caConfigMap: 'CA' cannot name a ConfigMap"),
    ({"gpuNodeLabel": "Fast.IO/gpu"},
     "gpuNodeLabel: 'Fast.IO/gpu' cannot be a label key: must be [PREFIX/]NAME"),
    ({"labels": {"team": "a" * 64}}, "labels.team: 'aaaa"),
    ({"labels": {"team": "a/b"}}, "labels.team: 'a/b' cannot be a label value: must be empty or at most 63"),
    ({"labels": {"team": 7}}, "labels.team: 7 cannot be a label value: must be a string"),
    ({"labels": {"Team/x": "a"}}, "labels: 'Team/x' cannot be a label key: must be [PREFIX/]NAME"),
])
def test_names_kubernetes_refuses_are_refused_naming_the_key_the_value_and_the_rule(values, says):
    # an upper-case namespace, a name over 63 characters or an underscore rendered without a word
    # and failed only at `kubectl apply`
    with pytest.raises(manifests.ValuesError) as caught:
        manifests.render(values)
    assert says in str(caught.value), caught.value


def test_names_kubernetes_takes_are_rendered():
    values = {"namespace": "a" * 63, "controller": {"name": "c" * 63, "leaseName": "lease.x-1"},
              "agent": {"name": "agent.x", "caConfigMap": "ca.crt"}, "gpuNodeLabel": "example.com/has_GPU.2",
              "labels": {"team": "", "example.com/Owner_1": "A.b-c_D"}}
    deployment = _by_kind(manifests.render(values), "Deployment")[0]
    assert deployment["metadata"]["namespace"] == "a" * 63
    assert deployment["metadata"]["labels"]["example.com/Owner_1"] == "A.b-c_D"


def test_cli_prints_the_same_objects_as_yaml(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text("namespace: gpu\n")
    result = CliRunner().invoke(main, ["k8s", "manifests", "--values", str(values)])
    assert result.exit_code == 0, result.output
    assert list(yaml.safe_load_all(result.output)) == manifests.render({"namespace": "gpu"})
    crd_only = CliRunner().invoke(main, ["k8s", "manifests", "--crd-only"])
    assert [d["metadata"]["name"] for d in yaml.safe_load_all(crd_only.output)] == [
        "fastpods.fastshare.io", "fastshareallocations.fastshare.io"]


def test_cli_rejects_a_bad_values_file_with_the_key(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text("agent: {prot: 1}\n")
    result = CliRunner().invoke(main, ["k8s", "manifests", "--values", str(values)])
    assert result.exit_code != 0
    assert "agent.prot: unknown value" in result.output


def _pod_specs(docs):
    agent = _by_kind(docs, "DaemonSet")[0]["spec"]["template"]["spec"]
    controller = _by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    return agent, controller


def test_no_key_is_in_a_secret_a_gpu_node_pod_names():
    """The agents take GPU-changing calls only from the controller's certificate, and the CA key
    signs every node's. A GPU node's kubelet may read every Secret a Pod on that node names (the
    node authorizer), so the node-agent Pods name no Secret at all: their key is made in the Pod
    (memory-backed emptyDir), the CA certificate comes from a ConfigMap; and the controller
    mounts only the CA's two files (items) from its Secret."""
    docs = manifests.render()
    agent, controller = _pod_specs(docs)
    volumes = {v["name"]: v for v in agent["volumes"]}
    assert not [v for v in agent["volumes"] if "secret" in v]
    projected = [s for v in agent["volumes"] for s in v.get("projected", {}).get("sources", [])]
    assert [s for s in projected if "secret" in s] == []
    assert volumes["tls"]["emptyDir"]["medium"] == "Memory"
    assert volumes["ca"]["configMap"] == {"name": "fastshare-ca",
                                          "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    args = agent["containers"][0]["args"]
    assert {"--tls-cert=/etc/fastshare/tls/node.crt", "--tls-key=/etc/fastshare/tls/node.key",
            "--tls-ca=/etc/fastshare/tls/ca.crt", "--bootstrap-ca=/etc/fastshare/ca/ca.crt",
            "--bootstrap-token=/var/run/secrets/fastshare/token",
            "--bootstrap-controller=fastshare-controller.fastshare-system.svc:7443"} <= set(args)
    mounts = {m["name"]: m for m in agent["containers"][0]["volumeMounts"]}
    assert "readOnly" not in mounts["tls"] and mounts["ca"]["readOnly"] and mounts["token"]["readOnly"]
    tls = next(v for v in controller["volumes"] if v["name"] == "tls")["secret"]
    assert tls["secretName"] == "fastshare-controller-tls"
    assert {i["key"]: i["path"] for i in tls["items"]} == {"ca.crt": "ca.crt", "ca.key": "ca.key"}


def test_the_controller_pod_holding_the_ca_key_never_runs_on_a_gpu_node():
    """The controller mounts ca.key, which signs every node's certificate and its own. A GPU
    node's kubelet may read every Secret a Pod on that node names, so the controller must not
    land on one: not only when the operator added the GPU taint (nothing fails without it, the
    agents need only the label), but by the label itself."""
    docs = manifests.render({"gpuNodeLabel": "example.com/gpu"})
    _, controller = _pod_specs(docs)
    rules = scheduling.constraints(controller)
    gpu = scheduling.NodeFacts("gpu-1", labels=(("example.com/gpu", "true"),))
    assert rules.problem(gpu) is not None
    for labels in ((), (("example.com/gpu", "false"),), (("fastshare.io/gpu", "true"),)):
        assert rules.problem(scheduling.NodeFacts("cpu-1", labels=labels)) is None


def test_the_controller_signs_its_own_certificate_into_a_memory_emptydir_of_a_read_only_pod():
    """The Secret holds only the CA (ca.crt, ca.key): an operator-issued controller.crt expired
    after 30 days with nothing renewing it. The controller writes its own, renewed, to --cert-dir,
    a memory-backed emptyDir; the root filesystem and the Secret stay read-only; its SANs are
    the Service's names, from --service-name and --service-namespace."""
    docs = manifests.render({"namespace": "gpu", "controller": {"name": "ctl"}})
    _, controller = _pod_specs(docs)
    container = controller["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in controller["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/etc/fastshare/tls"] == {"name": "tls", "mountPath": "/etc/fastshare/tls",
                                            "readOnly": True}
    assert [i["key"] for i in volumes["tls"]["secret"]["items"]] == ["ca.crt", "ca.key"]
    assert mounts["/run/fastshare/tls"] == {"name": "cert", "mountPath": "/run/fastshare/tls"}
    assert volumes["cert"] == {"name": "cert", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
    args = container["args"]
    assert {"--tls-dir=/etc/fastshare/tls", "--cert-dir=/run/fastshare/tls", "--service-name=ctl",
            "--service-namespace=gpu"} <= set(args)
    assert _by_kind(docs, "Service")[0]["metadata"] == {**_by_kind(docs, "Service")[0]["metadata"],
                                                         "name": "ctl", "namespace": "gpu"}


def test_the_agent_proves_its_pod_with_an_audience_bound_projected_token():
    agent, _ = _pod_specs(manifests.render())
    assert agent["automountServiceAccountToken"] is False   # no token usable against the API server
    token = next(v for v in agent["volumes"] if v["name"] == "token")["projected"]["sources"]
    assert token == [{"serviceAccountToken": {"audience": "fastshare", "expirationSeconds": 3600,
                                              "path": "token"}}]
    assert TOKEN_AUDIENCE == "fastshare"   # what the controller's TokenReview asks for


def test_the_controller_serves_the_bootstrap_on_its_api_port_for_this_daemonset():
    docs = manifests.render({"namespace": "gpu", "controller": {"name": "ctl", "apiPort": 8443},
                             "agent": {"name": "agents", "serviceAccount": "agent-sa"}})
    agent, controller = _pod_specs(docs)
    args = controller["containers"][0]["args"]
    assert {"--api-port=8443", "--agent-namespace=gpu", "--agent-service-account=agent-sa",
            "--agent-daemonset=agents"} <= set(args)
    assert {"name": "api", "containerPort": 8443, "protocol": "TCP"} in controller["containers"][0]["ports"]
    service = _by_kind(docs, "Service")[0]
    assert service["metadata"]["name"] == "ctl" and {"name": "api", "port": 8443, "targetPort": "api",
                                                    "protocol": "TCP"} in service["spec"]["ports"]
    assert "--bootstrap-controller=ctl.gpu.svc:8443" in agent["containers"][0]["args"]
    assert agent["serviceAccountName"] == "agent-sa"


def test_the_secret_and_configmap_are_named_by_values_and_the_node_secret_is_gone():
    docs = manifests.render({"controller": {"tlsSecret": "ctl"}, "agent": {"caConfigMap": "cluster-ca"}})
    agent, controller = _pod_specs(docs)
    assert next(v for v in controller["volumes"] if v["name"] == "tls")["secret"]["secretName"] == "ctl"
    assert next(v for v in agent["volumes"] if v["name"] == "ca")["configMap"]["name"] == "cluster-ca"
    with pytest.raises(manifests.ValuesError, match=r"agent\.tlsSecret: unknown value .*its own "
                                                    r"certificate from the controller"):
        manifests.render({"agent": {"tlsSecret": "fastshare-node-tls"}})
    with pytest.raises(manifests.ValuesError, match=r"tlsSecret: unknown value"):
        manifests.render({"tlsSecret": "fastshare-tls"})


def test_clip_keeps_a_message_within_the_byte_limit_and_says_what_it_left_out():
    assert clip("short") == "short"
    assert clip("x" * MESSAGE_MAX) == "x" * MESSAGE_MAX
    for text in ("x" * (MESSAGE_MAX + 1), "é" * MESSAGE_MAX, "ab€" * 20000):   # 2- and 3-byte characters
        clipped = clip(text)
        assert len(clipped.encode()) <= MESSAGE_MAX
        kept = clipped.split(" ... [")[0]
        assert text.startswith(kept) and len(kept) > MESSAGE_MAX // 4
        assert clipped.endswith(f" ... [{len(text) - len(kept)} characters left out]")


def test_the_crds_take_the_longest_message_and_reason_the_controller_writes():
    schemas = {d["spec"]["names"]["kind"]: d["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
               for d in manifests.crds()}
    condition = schemas["FastPod"]["properties"]["status"]["properties"]["conditions"]["items"]["properties"]
    assert condition["message"]["maxLength"] == MESSAGE_MAX
    assert condition["reason"]["maxLength"] == 1024
    allocation = schemas["FastShareAllocation"]["properties"]["spec"]["properties"]
    assert allocation["reason"]["maxLength"] == MESSAGE_MAX
    assert allocation["record"]["properties"]["reason"]["maxLength"] == MESSAGE_MAX
