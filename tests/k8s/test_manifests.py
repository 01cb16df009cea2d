"""The rendered manifests (no API server needed): content, least privilege, values handling."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from fastshare.cli import main
from fastshare.k8s import manifests


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
        ("", "pods"): {"create", "list", "watch", "delete"},
        ("", "nodes"): {"list"},
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


def test_the_controller_key_is_in_no_secret_a_gpu_node_pod_names():
    """The agents take GPU-changing calls only from the controller's certificate. A GPU node's
    kubelet may read every Secret a Pod on that node names (the node authorizer), so the
    controller's key must be in a Secret the node-agent Pods never name; and each Pod mounts
    only its own three files (items), so nothing else put in a Secret reaches it."""
    docs = manifests.render()

    def tls_volume(pod_spec):
        volume = next(v for v in pod_spec["volumes"] if v["name"] == "tls")
        items = volume["secret"].get("items", [])
        return volume["secret"]["secretName"], {i["key"]: i["path"] for i in items}

    agent = _by_kind(docs, "DaemonSet")[0]["spec"]["template"]["spec"]
    controller = _by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    assert tls_volume(agent) == ("fastshare-node-tls",
                                 {"ca.crt": "ca.crt", "node.crt": "node.crt", "node.key": "node.key"})
    args = agent["containers"][0]["args"]
    assert {"--tls-cert=/etc/fastshare/tls/node.crt", "--tls-key=/etc/fastshare/tls/node.key",
            "--tls-ca=/etc/fastshare/tls/ca.crt"} <= set(args)
    assert tls_volume(controller) == ("fastshare-controller-tls", {
        "ca.crt": "ca.crt", "controller.crt": "controller.crt", "controller.key": "controller.key"})
    named_by_agent = {v["secret"]["secretName"] for v in agent["volumes"] if "secret" in v}
    assert "fastshare-controller-tls" not in named_by_agent


def test_the_two_secrets_are_named_by_values_and_the_old_shared_name_is_refused():
    docs = manifests.render({"controller": {"tlsSecret": "ctl"}, "agent": {"tlsSecret": "nodes"}})
    names = {d["kind"]: next(v["secret"]["secretName"] for v in d["spec"]["template"]["spec"]["volumes"]
                             if v["name"] == "tls") for d in docs if d["kind"] in ("DaemonSet", "Deployment")}
    assert names == {"DaemonSet": "nodes", "Deployment": "ctl"}
    with pytest.raises(manifests.ValuesError, match=r"tlsSecret: unknown value"):
        manifests.render({"tlsSecret": "fastshare-tls"})
