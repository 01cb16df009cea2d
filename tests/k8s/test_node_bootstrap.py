"""Each node agent's own certificate, proven by Kubernetes: a real API server (TokenRequest,
TokenReview, RBAC as rendered), the controller's real NodeBootstrap gRPC service on loopback
(with the controller ServiceAccount's token, so the rendered RBAC is enough), and a real
`fastshare node serve` that bootstraps its certificate and then serves mTLS with it.

There is no kubelet or DaemonSet controller here: the tests create the agent Pods themselves,
owned by the rendered DaemonSet, bound to a node, with status.hostIP set through the status
subresource, and get each Pod's token from the TokenRequest API (bound to the Pod, audience
fastshare), as the kubelet would for the projected volume."""

from __future__ import annotations

import copy
import datetime as dt
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import yaml
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from kubernetes import client, utils

from fastshare.cli import main
from fastshare.controller.agent_client import AgentClient, AgentError, AgentTarget
from fastshare.device import simnvml
from fastshare.k8s import bootstrap, manifests
from fastshare.k8s.controller import ENDPOINT_ANNOTATION
from fastshare.k8s.ratelimit import RETRY_AFTER_KEY, Limits, RequestLimiter
from fastshare.security import certs
from fastshare.security.tls import TlsPaths
from fastshare.v1 import bootstrap_pb2 as pb
from fastshare.v1 import bootstrap_pb2_grpc as pb_grpc
from tests.security.handmade import served_certificate

from .agents import Agent, free_port, start_controller
from .conftest import wait_for

BIN = Path(sys.executable).parent
SUFFIX = uuid.uuid4().hex[:6]
NS = f"fsboot-{SUFFIX}"
VALUES = {"namespace": NS, "controller": {"name": f"fsboot-ctl-{SUFFIX}"}}
GPU_NODES = (f"gpu-a-{SUFFIX}", f"gpu-b-{SUFFIX}")
PLAIN_NODE = f"plain-{SUFFIX}"


class Cluster:
    """The rendered namespace, ServiceAccounts, RBAC and node-agent DaemonSet; three Nodes; the
    controller's bootstrap service (its ServiceAccount's token); helpers for agent Pods."""

    def __init__(self, control_plane, api_client, root: Path) -> None:
        self.admin = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.values = manifests.default_values()
        self.values["namespace"] = NS
        self.values["controller"]["name"] = VALUES["controller"]["name"]
        docs = manifests.render(VALUES)
        for doc in docs:
            if doc["kind"] in {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                               "RoleBinding", "DaemonSet"}:
                utils.create_from_dict(api_client, doc)
        self.agent_sa = self.values["agent"]["serviceAccount"]
        self.daemonset = self.apps.read_namespaced_daemon_set(self.values["agent"]["name"], NS)
        # another DaemonSet and another ServiceAccount in the same namespace (not the agents')
        other_ds = next(d for d in docs if d["kind"] == "DaemonSet")
        other_ds["metadata"]["name"] = "impostor"
        other_ds["spec"]["selector"]["matchLabels"] = {"app": "impostor"}
        other_ds["spec"]["template"]["metadata"]["labels"] = {"app": "impostor"}
        self.impostor = self.apps.create_namespaced_daemon_set(NS, other_ds)
        self.admin.create_namespaced_service_account(
            NS, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="other")))
        for node in GPU_NODES:
            self.admin.create_node(client.V1Node(metadata=client.V1ObjectMeta(
                name=node, labels={"fastshare.io/gpu": "true"})))
        self.admin.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=PLAIN_NODE)))

        # PKI: the controller's Secret holds ca.crt, ca.key, controller.crt/.key; its certificate
        # names the Service (what the agents dial in a cluster) and loopback (what they dial here).
        certs.init_ca(root / "ca")
        service = f"{self.values['controller']['name']}.{NS}.svc"
        certs.issue(root / "ca", "controller", root / "ctl", sans=[service, "localhost", "127.0.0.1"],
                    role="controller", days=1)
        shutil.copy(root / "ca" / "ca.key", root / "ctl" / "ca.key")
        self.ca_dir = root / "ca"
        self.ca_file = root / "ca" / "ca.crt"
        self.service_dns = f"{self.values['controller']['name']}.{NS}.svc"
        self.tls = TlsPaths.in_dir(root / "ctl", "controller")

        token = self._token(self.values["controller"]["serviceAccount"], bound_to=None, audience="")
        self.controller_api = control_plane.api_client({"token": token})
        self.issuer = bootstrap.NodeCertIssuer(self.controller_api, root / "ctl", bootstrap.IssuerSettings(
            namespace=NS, service_account=self.agent_sa, daemonset=self.values["agent"]["name"],
            gpu_node_label=self.values["gpuNodeLabel"]), limiter=self.unlimited())
        self.server, port = bootstrap.serve("127.0.0.1:0", self.tls, self.issuer)
        self.address = f"127.0.0.1:{port}"

    @staticmethod
    def unlimited() -> RequestLimiter:
        """Every test here calls from 127.0.0.1, many times within seconds: no rate limit gets in
        the way but where a test asks for one."""
        return RequestLimiter(Limits(peer_burst=10_000, global_burst=10_000))

    def close(self) -> None:
        self.server.stop(None)
        self.controller_api.close()
        for node in (*GPU_NODES, PLAIN_NODE):
            self.admin.delete_node(node)
        self.admin.delete_namespace(NS)

    def _token(self, service_account: str, bound_to: client.V1Pod | None, audience: str = "fastshare") -> str:
        """A TokenRequest token; ``audience`` "" = the API server's own (a credential for it)."""
        ref = None if bound_to is None else client.V1BoundObjectReference(
            kind="Pod", api_version="v1", name=bound_to.metadata.name, uid=bound_to.metadata.uid)
        spec = client.V1TokenRequestSpec(audiences=[audience] if audience else [], expiration_seconds=3600,
                                         bound_object_ref=ref)
        request = client.AuthenticationV1TokenRequest(spec=spec)
        return self.admin.create_namespaced_service_account_token(service_account, NS, request).status.token

    def agent_pod(self, node: str, owner: client.V1DaemonSet | None = None, service_account: str = "",
                  host_ip: str = "127.0.0.1") -> client.V1Pod:
        """A Pod as the DaemonSet controller would make it (ownerReference, nodeName), with the
        hostIP the kubelet would report."""
        owner = owner or self.daemonset
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(
                generate_name=f"{owner.metadata.name}-",
                owner_references=[client.V1OwnerReference(
                    api_version="apps/v1", kind="DaemonSet", name=owner.metadata.name, uid=owner.metadata.uid,
                    controller=True, block_owner_deletion=True)]),
            spec=client.V1PodSpec(node_name=node, service_account_name=service_account or self.agent_sa,
                                  automount_service_account_token=False,
                                  containers=[client.V1Container(name="agent", image="fastshare")]))
        pod = self.admin.create_namespaced_pod(NS, pod)
        self.admin.patch_namespaced_pod_status(pod.metadata.name, NS, {"status": {
            "phase": "Running", "hostIP": host_ip, "hostIPs": [{"ip": host_ip}]}})
        return pod

    def token(self, pod: client.V1Pod, audience: str = "fastshare") -> str:
        return self._token(pod.spec.service_account_name, bound_to=pod, audience=audience)


@pytest.fixture(scope="module")
def cluster(control_plane, api_client, tmp_path_factory):
    made = Cluster(control_plane, api_client, tmp_path_factory.mktemp("boot"))
    yield made
    made.close()


def _csr(node: str, key=None) -> bytes:
    key = key or ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


def _ask(cluster: Cluster, csr_pem: bytes, token: str) -> pb.IssueNodeCertificateReply:
    return _ask_at(cluster.address, cluster, csr_pem, token)


def _ask_at(address: str, cluster: Cluster, csr_pem: bytes, token: str) -> pb.IssueNodeCertificateReply:
    """Over loopback, checking the server's certificate for the Service's DNS name."""
    channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(cluster.ca_file.read_bytes()),
                                  options=[("grpc.ssl_target_name_override", cluster.service_dns)])
    try:
        return pb_grpc.NodeBootstrapStub(channel).IssueNodeCertificate(
            pb.IssueNodeCertificateRequest(csr_pem=csr_pem, token=token), timeout=30)
    finally:
        channel.close()


def _refused(cluster: Cluster, csr_pem: bytes, token: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        _ask(cluster, csr_pem, token)
    return info.value


def _sans(cert: x509.Certificate) -> set[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = (str(ip) for ip in san.get_values_for_type(x509.IPAddress))
    return {*san.get_values_for_type(x509.DNSName), *ips}


# --- the happy path: a real agent process bootstraps, then serves mTLS with its certificate ------


def _start_agent(root: Path, cluster: Cluster, node: str, token: str) -> tuple[subprocess.Popen, str]:
    root.mkdir(parents=True)
    (root / "tls").mkdir()
    (root / "token").write_text(token)
    machine = root / "machine.json"
    simnvml.create_machine(machine, ["V100-SXM2-32GB"], mig_enabled=False)
    address = f"127.0.0.1:{free_port()}"
    config = root / "node.yaml"
    config.write_text(yaml.safe_dump({
        "node_name": node, "listen": address, "unix_socket": str(root / "node.sock"),
        "state_dir": str(root / "state"), "run_dir": str(root / "run"), "device_backend": "sim",
        "sim_state": str(machine), "mps_control_binary": str(BIN / "fastshare-mps-standin"),
        "metrics_listen": "127.0.0.1:0", "reconcile_interval_s": 3600}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    args = [str(BIN / "fastshare"), "node", "serve", "--config", str(config),
            f"--tls-cert={root / 'tls' / 'node.crt'}", f"--tls-key={root / 'tls' / 'node.key'}",
            f"--tls-ca={root / 'tls' / 'ca.crt'}", f"--bootstrap-controller={cluster.address}",
            f"--bootstrap-token={root / 'token'}", f"--bootstrap-ca={cluster.ca_file}"]
    with open(root / "agent.log", "ab") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, address


def test_an_agent_gets_its_own_node_certificate_and_only_that_node_name_is_accepted(cluster, tmp_path):
    node, other = GPU_NODES
    pod = cluster.agent_pod(node, host_ip="127.0.0.1")
    proc, address = _start_agent(tmp_path / "agent", cluster, node, cluster.token(pod))
    tls_dir = tmp_path / "agent" / "tls"
    try:
        probe = AgentClient(AgentTarget(node, address), cluster.tls, deadline=5)

        def serving():
            if proc.poll() is not None:
                raise AssertionError(f"agent exited:\n{(tmp_path / 'agent' / 'agent.log').read_text()}")
            try:
                probe.ping()
                return True
            except AgentError:
                return False

        wait_for(serving, "the agent serving mTLS with its bootstrapped certificate", timeout=90)
        probe.close()
        cert = x509.load_pem_x509_certificate((tls_dir / "node.crt").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node
        assert certs.role_of(cert) == "node"
        assert _sans(cert) == {node, certs.agent_name(node), "127.0.0.1"}   # the Pod's hostIP, from the Pod
        life = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
        assert dt.timedelta(hours=23) < life <= dt.timedelta(hours=24)
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(cluster.ca_file.read_bytes()))
        assert stat.S_IMODE((tls_dir / "node.key").stat().st_mode) == 0o600
        assert (tls_dir / "ca.crt").read_bytes() == cluster.ca_file.read_bytes()

        # the controller, dialling the same address as the OTHER node, is refused at the handshake
        impostor = AgentClient(AgentTarget(other, address), cluster.tls, deadline=5)
        try:
            with pytest.raises(AgentError) as info:
                impostor.ping()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            impostor.close()
        again = AgentClient(AgentTarget(node, address), cluster.tls, deadline=5)
        try:
            again.ping()   # and the agent is still there for its own name
        finally:
            again.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)


def test_the_agent_waits_for_an_unreachable_controller_then_renews(cluster, tmp_path, caplog):
    """Started before the controller listens: it retries (logging what it waits for) and gets its
    certificate once the service is up; a due certificate is renewed with a new key."""
    from fastshare.node.bootstrap import BootstrapConfig, Bootstrapper

    node = GPU_NODES[1]
    pod = cluster.agent_pod(node, host_ip="10.1.2.3")
    (tmp_path / "token").write_text(cluster.token(pod))
    port = free_port()
    config = BootstrapConfig(controller=f"127.0.0.1:{port}", token_file=tmp_path / "token",
                             ca_file=cluster.ca_file, node_name=node, cert=tmp_path / "tls" / "node.crt",
                             key=tmp_path / "tls" / "node.key", ca=tmp_path / "tls" / "ca.crt")
    agent = Bootstrapper(config, timeout=5, min_renew_interval=0.2)
    got: list[object] = []
    stop = threading.Event()
    caplog.set_level("WARNING", logger="fastshare.node.bootstrap")
    waiting = threading.Thread(target=lambda: got.append(agent.obtain(stop)))
    waiting.start()
    server = None
    try:
        wait_for(lambda: "waiting for a node certificate from the controller at" in caplog.text,
                 "the agent to log what it waits for", timeout=30)
        # a short-lived certificate: due for renewal as soon as it is issued
        settings = bootstrap.IssuerSettings(
            namespace=NS, service_account=cluster.agent_sa, daemonset=cluster.values["agent"]["name"],
            lifetime=dt.timedelta(minutes=2))
        short = bootstrap.NodeCertIssuer(cluster.controller_api, cluster.tls.cert.parent, settings,
                                         limiter=cluster.unlimited())
        server, _ = bootstrap.serve(f"127.0.0.1:{port}", cluster.tls, short)
        waiting.join(60)
        assert not waiting.is_alive() and isinstance(got[0], x509.Certificate)
        first = got[0]
        assert _sans(first) == {node, certs.agent_name(node), "10.1.2.3"}
        first_key = (tmp_path / "tls" / "node.key").read_bytes()
        agent.start_renewals(first, stop)

        def renewed():
            cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "node.crt").read_bytes())
            return cert.serial_number != first.serial_number and cert
        second = wait_for(renewed, "the certificate renewed", timeout=30)
        assert agent.problem(second) is None
        assert (tmp_path / "tls" / "node.key").read_bytes() != first_key
        assert "token" not in caplog.text.lower().replace("--bootstrap-token", "")
    finally:
        stop.set()
        if server is not None:
            server.stop(None)


def test_a_burst_over_the_rate_limit_is_refused_before_any_token_review_and_the_agent_waits(
        cluster, tmp_path, caplog):
    """Ten calls at once from one address against a limit of two: two TokenReviews, eight
    RESOURCE_EXHAUSTED saying when to retry; a garbage CSR is still refused for what it is (the
    cheap checks come first). An agent that is refused waits as long as it was told, once, then
    gets its certificate."""
    from fastshare.node.bootstrap import BootstrapConfig, Bootstrapper

    node = GPU_NODES[0]
    settings = bootstrap.IssuerSettings(namespace=NS, service_account=cluster.agent_sa,
                                        daemonset=cluster.values["agent"]["name"])
    limiter = RequestLimiter(Limits(peer_burst=2, peer_rate=1 / 4, global_burst=50, global_rate=10))
    issuer = bootstrap.NodeCertIssuer(cluster.controller_api, cluster.tls.cert.parent, settings,
                                      limiter=limiter)
    reviews: list[str] = []
    review = issuer._auth.create_token_review   # the real one, counted

    def counted(body, **kwargs):
        reviews.append(body.spec.token[:8])
        return review(body, **kwargs)
    issuer._auth.create_token_review = counted
    server, port = bootstrap.serve("127.0.0.1:0", cluster.tls, issuer)
    try:
        pod = cluster.agent_pod(node, host_ip="10.9.8.7")
        token = cluster.token(pod)
        channel = grpc.secure_channel(f"127.0.0.1:{port}",
                                      grpc.ssl_channel_credentials(cluster.ca_file.read_bytes()))
        stub = pb_grpc.NodeBootstrapStub(channel)

        def call(csr_pem: bytes):
            try:
                stub.IssueNodeCertificate(pb.IssueNodeCertificateRequest(csr_pem=csr_pem, token=token),
                                          timeout=30)
                return grpc.StatusCode.OK, "", {}
            except grpc.RpcError as exc:
                return exc.code(), exc.details(), dict(exc.trailing_metadata() or ())

        barrier = threading.Barrier(10)

        def at_once(_):
            barrier.wait()
            return call(_csr(node))
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(at_once, range(10)))
        codes = [code for code, _, _ in answers]
        assert codes.count(grpc.StatusCode.OK) == 2, answers
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 8, answers
        assert len(reviews) == 2
        for code, details, trailer in answers:
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "too many node-certificate requests from 127.0.0.1" in details
                assert "retry in" in details
                assert 0 < float(trailer[RETRY_AFTER_KEY]) <= 4
        code, details, _ = call(b"not a csr")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "csr_pem" in details
        assert len(reviews) == 2
        channel.close()

        (tmp_path / "token").write_text(token)
        config = BootstrapConfig(controller=f"127.0.0.1:{port}", token_file=tmp_path / "token",
                                 ca_file=cluster.ca_file, node_name=node, cert=tmp_path / "tls" / "node.crt",
                                 key=tmp_path / "tls" / "node.key", ca=tmp_path / "tls" / "ca.crt")
        caplog.set_level("WARNING", logger="fastshare.node.bootstrap")
        cert = Bootstrapper(config, timeout=5).obtain(threading.Event())
        assert isinstance(cert, x509.Certificate)
        assert _sans(cert) == {node, certs.agent_name(node), "10.9.8.7"}
        waits = [r.getMessage() for r in caplog.records if "waiting for a node certificate" in r.getMessage()]
        assert len(waits) == 1 and "RESOURCE_EXHAUSTED" in waits[0], waits   # told when, waited that long
        assert len(reviews) == 3
    finally:
        server.stop(None)


def test_the_agent_asks_again_at_once_when_its_ca_bundle_changes(cluster, tmp_path, caplog):
    """Step 1 of a CA rotation (README): the ConfigMap (--bootstrap-ca) gets the new CA next to the old
    one. The agent, whose certificate is good for hours yet, asks for a new one within seconds
    (over a channel trusting the two-CA bundle, the controller's CA second) and then trusts
    both for the controller's client certificate; an idle check changes nothing. A certificate
    in place that no CA of the bundle signed is not used at start."""
    from fastshare.node.bootstrap import BootstrapConfig, Bootstrapper

    node = GPU_NODES[1]
    pod = cluster.agent_pod(node, host_ip="10.1.2.4")
    (tmp_path / "token").write_text(cluster.token(pod))
    bundle = tmp_path / "configmap-ca.crt"
    bundle.write_bytes(cluster.ca_file.read_bytes())
    config = BootstrapConfig(controller=cluster.address, token_file=tmp_path / "token", ca_file=bundle,
                             node_name=node, cert=tmp_path / "tls" / "node.crt",
                             key=tmp_path / "tls" / "node.key", ca=tmp_path / "tls" / "ca.crt")
    agent = Bootstrapper(config, timeout=5, min_renew_interval=0.2, check_interval=0.2)
    stop = threading.Event()
    first = agent.obtain(stop)
    caplog.set_level("INFO", logger="fastshare.node.bootstrap")
    agent.start_renewals(first, stop)
    try:
        def serial():
            return x509.load_pem_x509_certificate(config.cert.read_bytes()).serial_number
        time.sleep(1)
        assert serial() == first.serial_number           # nothing changed: no new request
        certs.init_ca(tmp_path / "new")
        new_ca = (tmp_path / "new" / "ca.crt").read_bytes()
        certs.write_atomic(bundle, new_ca + cluster.ca_file.read_bytes(), 0o644)
        wait_for(lambda: serial() != first.serial_number, "a new certificate after the bundle changed",
                 timeout=10)
        assert "CA bundle --bootstrap-ca" in caplog.text and "changed" in caplog.text
        trusted = x509.load_pem_x509_certificates(config.ca.read_bytes())
        assert [c.subject for c in trusted] == [x509.load_pem_x509_certificate(new_ca).subject,
                                                x509.load_pem_x509_certificate(cluster.ca_file.read_bytes()).subject]
        assert agent.existing() is not None
    finally:
        stop.set()
    certs.write_atomic(bundle, new_ca, 0o644)       # the old CA gone: its certificate is not kept
    assert agent.existing() is None


def test_the_agents_token_is_no_credential_for_the_api_server(control_plane, cluster):
    """Audience fastshare: the API server itself refuses it (401), unlike the automounted token
    the DaemonSet does not get."""
    pod = cluster.agent_pod(GPU_NODES[0])
    api = control_plane.api_client({"token": cluster.token(pod)})
    try:
        with pytest.raises(client.ApiException) as info:
            client.CoreV1Api(api).list_namespaced_pod(NS)
        assert info.value.status == 401
    finally:
        api.close()


def _ca_only_secret(cluster: Cluster, where: Path, *extra: Path) -> Path:
    """The controller's Secret as the README has the operator create it: ca.crt and ca.key
    (and ``extra`` files, e.g. a hand-issued controller.crt left over)."""
    where.mkdir()
    for path in (cluster.ca_dir / "ca.crt", cluster.ca_dir / "ca.key", *extra):
        shutil.copy(path, where / path.name)
    return where


def _start_own_cert_controller(control_plane, cluster: Cluster, tls_dir: Path, cert_dir: Path, port: int,
                               log: Path, *extra: str) -> subprocess.Popen:
    """`fastshare k8s controller` with the Deployment's certificate options: the Service's name
    and namespace, a writable --cert-dir, the bootstrap on ``port``."""
    return start_controller(control_plane.kubeconfig, NS, tls_dir, "boot", log,
                            "--api-port", str(port), "--cert-dir", str(cert_dir),
                            "--service-name", cluster.values["controller"]["name"], "--service-namespace", NS,
                            "--agent-namespace", NS, "--agent-service-account", cluster.agent_sa,
                            "--agent-daemonset", cluster.daemonset.metadata.name, *extra)


def _bootstrap_into(cluster: Cluster, agent: Agent, port: int, token_file: Path,
                    stop: threading.Event) -> x509.Certificate:
    """What the agent does at start, into the files ``agent`` serves with: against the controller
    on loopback, checking its certificate for the Service's DNS name (what a cluster's agent
    dials)."""
    from fastshare.node.bootstrap import BootstrapConfig, Bootstrapper

    pki = agent.root / "pki"
    (pki / f"{agent.name}.crt").unlink()   # the hand-issued one Agent() made: not used
    (pki / f"{agent.name}.key").unlink()
    config = BootstrapConfig(controller=f"127.0.0.1:{port}", token_file=token_file, ca_file=cluster.ca_file,
                             node_name=agent.name, cert=pki / f"{agent.name}.crt",
                             key=pki / f"{agent.name}.key", ca=pki / "ca.crt",
                             server_name=cluster.service_dns)
    give_up = threading.Timer(60, stop.set)   # obtain() waits for the controller as long as it takes
    give_up.start()
    try:
        cert = Bootstrapper(config, timeout=5).obtain(stop)
    finally:
        give_up.cancel()
    assert cert is not None
    return cert


def _point_node_at(cluster: Cluster, node: str, address: str | None) -> None:
    """The endpoint annotation the controller dials the node's agent at (None: remove it)."""
    cluster.admin.patch_node(node, {"metadata": {"annotations": {ENDPOINT_ANNOTATION: address}}})


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_the_k8s_controller_process_issues_its_own_certificate_and_serves_agents_with_it(
        control_plane, fastpod_crd, cluster, tmp_path):
    """`fastshare k8s controller` (what the Deployment runs) with a --tls-dir of ca.crt and
    ca.key only: it signs its own controller certificate (Service DNS names, 24 h, key 0600) into
    --cert-dir, an agent bootstraps its node certificate against it checking the Service's name,
    and the controller's agent client talks to that agent (mTLS with the controller's own
    certificate, the agent's bootstrapped one)."""
    node = GPU_NODES[0]
    pod = cluster.agent_pod(node, host_ip="127.0.0.1")
    (tmp_path / "token").write_text(cluster.token(pod))
    secret = _ca_only_secret(cluster, tmp_path / "secret")
    cert_dir = tmp_path / "run-tls"
    port = free_port()
    log = tmp_path / "ctl.log"
    proc = _start_own_cert_controller(control_plane, cluster, secret, cert_dir, port, log)
    agent = Agent(tmp_path, cluster.ca_dir, node, ["V100-SXM2-32GB"], mig=False)
    stop = threading.Event()
    try:
        node_cert = _bootstrap_into(cluster, agent, port, tmp_path / "token", stop)
        assert _sans(node_cert) == {node, certs.agent_name(node), "127.0.0.1"}
        assert certs.role_of(node_cert) == "node"

        own = x509.load_pem_x509_certificate((cert_dir / "controller.crt").read_bytes())
        assert own.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "controller"
        assert certs.role_of(own) == "controller"
        assert _sans(own) == {cluster.service_dns, f"{cluster.service_dns}.cluster.local"}
        life = own.not_valid_after_utc - dt.datetime.now(dt.UTC)
        assert dt.timedelta(hours=23) < life <= dt.timedelta(hours=24)
        own.verify_directly_issued_by(x509.load_pem_x509_certificate(cluster.ca_file.read_bytes()))
        assert stat.S_IMODE((cert_dir / "controller.key").stat().st_mode) == 0o600
        served = served_certificate(f"127.0.0.1:{port}", cluster.ca_file, cluster.service_dns)
        assert served.serial_number == own.serial_number
        assert sorted(p.name for p in secret.iterdir()) == ["ca.crt", "ca.key"]   # nothing written there

        agent.start(cluster.tls)   # serves mTLS with the bootstrapped certificate
        _point_node_at(cluster, node, agent.address)
        wait_for(lambda: f"node {node} registered at {agent.address}" in log.read_text(),
                 "the controller to register the agent (its inventory over mTLS)", timeout=60)
        text = log.read_text()
        assert f"issued the controller's own certificate (role controller, SANs {cluster.service_dns}" in text
        assert f"serial {own.serial_number:x}" in text and "PRIVATE KEY" not in text
        assert f"node agent {node} at" not in text   # never unreachable
        assert proc.poll() is None, text
    finally:
        stop.set()
        _point_node_at(cluster, node, None)
        agent.stop()
        _stop(proc)


def test_the_controllers_own_certificate_is_renewed_and_the_old_one_is_not_needed(
        control_plane, fastpod_crd, cluster, tmp_path):
    """With a 6 s lifetime the controller replaces its certificate (new serial, new key) every
    2 s; new connections to its bootstrap port get the new one, verified after the first one
    has expired; its agent client keeps talking to an agent across renewals. A hand-issued
    controller.crt/.key next to ca.key is ignored, and the log says so."""
    node = GPU_NODES[1]
    pod = cluster.agent_pod(node, host_ip="127.0.0.1")
    (tmp_path / "token").write_text(cluster.token(pod))
    secret = _ca_only_secret(cluster, tmp_path / "secret", cluster.tls.cert, cluster.tls.key)
    cert_dir = tmp_path / "run-tls"
    port = free_port()
    log = tmp_path / "ctl.log"
    proc = _start_own_cert_controller(control_plane, cluster, secret, cert_dir, port, log,
                                      "--cert-lifetime", "6")
    agent = Agent(tmp_path, cluster.ca_dir, node, ["V100-SXM2-32GB"], mig=False)
    stop = threading.Event()

    def current() -> x509.Certificate:
        return x509.load_pem_x509_certificate((cert_dir / "controller.crt").read_bytes())

    try:
        agent.start(cluster.tls)
        first = wait_for(lambda: (cert_dir / "controller.crt").exists() and current(),
                         "the first certificate")
        first_key = (cert_dir / "controller.key").read_bytes()
        _point_node_at(cluster, node, agent.address)
        wait_for(lambda: f"node {node} registered at {agent.address}" in log.read_text(),
                 "the controller to register the agent", timeout=60)

        second = wait_for(lambda: current().serial_number != first.serial_number and current(),
                          "the certificate renewed", timeout=30)
        assert (cert_dir / "controller.key").read_bytes() != first_key
        assert second.public_key() != first.public_key()
        assert _sans(second) == _sans(first) and certs.role_of(second) == "controller"

        # past the first certificate's end: a new connection verifies (chain and expiry) and
        # presents a certificate of the files, never the first one
        time.sleep(max(0.0, (first.not_valid_after_utc - dt.datetime.now(dt.UTC)).total_seconds()) + 1)
        before = current().serial_number
        served = served_certificate(f"127.0.0.1:{port}", cluster.ca_file, cluster.service_dns)
        assert served.serial_number != first.serial_number
        assert served.serial_number in {before, current().serial_number}
        # an agent can still bootstrap through it
        spare = Agent(tmp_path / "other", cluster.ca_dir, node, ["V100-SXM2-32GB"], mig=False)
        node_cert = _bootstrap_into(cluster, spare, port, tmp_path / "token", stop)
        assert certs.role_of(node_cert) == "node"
        # heartbeats (pings every 0.5 s) went on with renewed certificates: never unreachable
        time.sleep(2)
        text = log.read_text()
        assert f"node agent {node} at" not in text, text
        assert (f"--tls-dir {secret}: ignoring controller.crt and controller.key: with ca.key there the "
                "controller issues and renews its own certificate") in text
        assert text.count("issued the controller's own certificate") >= 3
        assert "PRIVATE KEY" not in text and proc.poll() is None, text
    finally:
        stop.set()
        _point_node_at(cluster, node, None)
        agent.stop()
        _stop(proc)


def test_no_node_certificate_carries_the_name_the_agents_check_the_controller_for(
        control_plane, fastpod_crd, cluster, tmp_path):
    """A node named like the controller's Service (a kubelet may register a Node of any name it
    holds credentials for, and label it) would get a node certificate whose SAN passes every
    agent's check of the controller it dials: a man in the middle of the bootstrap port would
    collect the agents' tokens (each one good for that agent's own certificate). The controller
    process refuses to sign one, for either of its own certificate's names."""
    port = free_port()
    log = tmp_path / "ctl.log"
    proc = _start_own_cert_controller(control_plane, cluster, _ca_only_secret(cluster, tmp_path / "secret"),
                                      tmp_path / "run-tls", port, log)
    address = f"127.0.0.1:{port}"
    made = []
    try:
        for name in (cluster.service_dns, f"{cluster.service_dns}.cluster.local"):
            cluster.admin.create_node(client.V1Node(metadata=client.V1ObjectMeta(
                name=name, labels={"fastshare.io/gpu": "true"})))
            made.append(name)
            pod = cluster.agent_pod(name)
            csr, token = _csr(name), cluster.token(pod)

            def answer(name=name, csr=csr, token=token) -> grpc.RpcError | None:
                try:
                    _ask_at(address, cluster, csr, token)
                except grpc.RpcError as exc:
                    return None if exc.code() == grpc.StatusCode.UNAVAILABLE else exc
                raise AssertionError(f"a node certificate for {name} was issued")

            error = wait_for(answer, "the controller's answer", timeout=60)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
            assert (f"node name {name!r} is a name of the controller's own certificate"
                    in error.details())
        assert proc.poll() is None, log.read_text()
    finally:
        _stop(proc)
        for name in made:
            cluster.admin.delete_node(name)


# --- refusals: each names what did not match ------------------------------------------------


def test_refused_when_the_csr_names_another_node_than_the_pods(cluster):
    node, other = GPU_NODES
    pod = cluster.agent_pod(node)
    error = _refused(cluster, _csr(other), cluster.token(pod))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    where = f"Pod {NS}/{pod.metadata.name}"
    assert f"the CSR asks for node '{other}' but {where} runs on '{node}'" in error.details()


def test_refused_for_a_node_named_like_another_nodes_agent_name(cluster):
    """The controller dials node N's agent by N's agent name (N.agent.fastshare.invalid), which only
    N's certificate may list: a node named so would get a certificate that passes that check
    for N. Refused before the token is even looked at, naming the name and why."""
    name = f"{GPU_NODES[0]}.agent.fastshare.invalid"
    error = _refused(cluster, _csr(name), "not-looked-at")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    assert f"node name {name!r} is refused" in error.details() and "pose as a node's agent" in error.details()


def test_refused_for_a_token_of_another_audience(cluster):
    node = GPU_NODES[0]
    pod = cluster.agent_pod(node)
    error = _refused(cluster, _csr(node), cluster.token(pod, audience="https://kubernetes.default.svc"))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "did not accept the token" in error.details() and "audience 'fastshare'" in error.details()
    assert "audiences" in error.details()   # the API server's own reason is passed on


def test_refused_for_a_token_of_another_service_account(cluster):
    node = GPU_NODES[0]
    pod = cluster.agent_pod(node, service_account="other")
    error = _refused(cluster, _csr(node), cluster.token(pod))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (f"the token is of 'system:serviceaccount:{NS}:other', not of "
            f"'system:serviceaccount:{NS}:{cluster.agent_sa}'") in error.details()


def test_refused_for_a_pod_the_agent_daemonset_does_not_own(cluster):
    node = GPU_NODES[0]
    pod = cluster.agent_pod(node, owner=cluster.impostor)
    error = _refused(cluster, _csr(node), cluster.token(pod))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (f"is controlled by DaemonSet impostor, not by the DaemonSet {cluster.daemonset.metadata.name}"
            in error.details())


def test_refused_for_a_pod_whose_owner_reference_names_the_daemonset_but_not_its_uid(cluster):
    """Whoever may create Pods in the namespace can write any ownerReference; the DaemonSet's
    name with another uid (a hand-written reference, or one to a deleted DaemonSet of that
    name) is not the DaemonSet."""
    node = GPU_NODES[0]
    forged = copy.deepcopy(cluster.daemonset)
    forged.metadata.uid = "00000000-0000-4000-8000-000000000000"
    pod = cluster.agent_pod(node, owner=forged)
    error = _refused(cluster, _csr(node), cluster.token(pod))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (f"names the DaemonSet {cluster.daemonset.metadata.name} with uid {forged.metadata.uid}, "
            f"but that DaemonSet has uid {cluster.daemonset.metadata.uid}") in error.details()


def test_refused_once_the_pod_is_deleted_or_recreated(cluster):
    node = GPU_NODES[0]
    pod = cluster.agent_pod(node)
    token = cluster.token(pod)
    cluster.admin.delete_namespaced_pod(pod.metadata.name, NS, grace_period_seconds=0)
    wait_for(lambda: not [p for p in cluster.admin.list_namespaced_pod(NS).items
                          if p.metadata.name == pod.metadata.name], "the Pod gone")
    error = _refused(cluster, _csr(node), token)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    # the API server's reason, then ours
    assert "did not accept the token" in error.details() and "invalidated" in error.details()
    assert "of a Pod that still exists" in error.details()
    # a Pod of the same name again (new uid): the old token is still refused
    again = client.V1Pod(metadata=client.V1ObjectMeta(
        name=pod.metadata.name, owner_references=pod.metadata.owner_references), spec=pod.spec)
    again = cluster.admin.create_namespaced_pod(NS, again)
    assert again.metadata.uid != pod.metadata.uid
    error = _refused(cluster, _csr(node), token)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "did not accept the token" in error.details()
    assert f"pod UID ({again.metadata.uid}) does not match" in error.details()


@pytest.mark.parametrize("phase", ["Failed", "Succeeded"])
def test_refused_for_a_pod_that_has_terminated(cluster, phase):
    """An evicted (or otherwise ended) Pod stays in the API until something deletes it, and the
    API server still accepts its token: it is no running agent and gets no certificate."""
    node = GPU_NODES[0]
    pod = cluster.agent_pod(node)
    token = cluster.token(pod)
    cluster.admin.patch_namespaced_pod_status(pod.metadata.name, NS, {"status": {
        "phase": phase, "reason": "Evicted" if phase == "Failed" else None}})
    error = _refused(cluster, _csr(node), token)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"Pod {NS}/{pod.metadata.name} has ended (phase {phase})" in error.details()


def test_the_issuer_itself_refuses_a_uid_mismatch(cluster):
    """Should the API server vouch for a Pod uid that is no longer the Pod's (a review served
    before a re-creation), the controller's own read of the Pod refuses it."""
    node = GPU_NODES[0]
    pod = cluster.agent_pod(node)
    with pytest.raises(bootstrap.Refused) as info:
        cluster.issuer._pod(pod.metadata.name, "00000000-0000-0000-0000-000000000000")
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "was deleted and re-created" in info.value.message and pod.metadata.uid in info.value.message


def test_refused_for_a_node_without_the_gpu_label(cluster):
    pod = cluster.agent_pod(PLAIN_NODE)
    error = _refused(cluster, _csr(PLAIN_NODE), cluster.token(pod))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (f"Node {PLAIN_NODE} is not a fastshare GPU node: it has label fastshare.io/gpu=(none), "
            "not fastshare.io/gpu=true") in error.details()


@pytest.mark.parametrize("csr, says", [
    (b"", "csr_pem is empty"),
    (b"-----BEGIN CERTIFICATE REQUEST-----\nbm90IGEgY3Ny\n-----END CERTIFICATE REQUEST-----\n",
     "csr_pem is not a usable CSR"),
    (b"garbage" * 10, "csr_pem is not a usable CSR"),
    ("rsa", "not ECDSA P-256/P-384"),
    ("bad-name", "is not a Kubernetes node name"),
], ids=["empty", "bad-der", "garbage", "rsa-key", "bad-cn"])
def test_refused_for_a_garbage_csr(cluster, csr, says):
    if csr == "rsa":
        csr = _csr(GPU_NODES[0], rsa.generate_private_key(public_exponent=65537, key_size=2048))
    elif csr == "bad-name":
        csr = _csr("Not_A_Node")
    pod = cluster.agent_pod(GPU_NODES[0])
    error = _refused(cluster, csr, cluster.token(pod))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in error.details() and "CN=<node name>" in error.details()


def test_refused_for_an_empty_or_unknown_token(cluster):
    error = _refused(cluster, _csr(GPU_NODES[0]), "")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "token is empty" in error.details()
    error = _refused(cluster, _csr(GPU_NODES[0]), "not-a-token")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "did not accept the token" in error.details()


def test_refused_for_a_token_not_bound_to_a_pod(cluster):
    token = cluster._token(cluster.agent_sa, bound_to=None)
    error = _refused(cluster, _csr(GPU_NODES[0]), token)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not bound to a Pod" in error.details()


# --- the command lines --------------------------------------------------------------------


def test_node_serve_checks_the_bootstrap_options(tmp_path):
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("t")
    ca.write_text("x")
    (tmp_path / "node.yaml").write_text("{}\n")
    base = ["node", "serve", "--config", str(tmp_path / "node.yaml"), "--node-name", "gpu-a",
            "--unix-socket", str(tmp_path / "s"), "--gpu-backend", "sim", "--sim-state", str(tmp_path / "m")]
    tls = [f"--tls-cert={tmp_path}/tls/node.crt", f"--tls-key={tmp_path}/tls/node.key",
           f"--tls-ca={tmp_path}/tls/ca.crt"]
    cases = [
        (["--bootstrap-controller", "ctl:7443"], "--bootstrap-token, --bootstrap-ca are required with "
                                                 "--bootstrap-controller"),
        (["--bootstrap-controller", "ctl", "--bootstrap-token", str(token), "--bootstrap-ca", str(ca), *tls],
         "--bootstrap-controller must be HOST:PORT"),
        (["--bootstrap-token", str(tmp_path / "missing")], "Invalid value for '--bootstrap-token'"),
        (["--bootstrap-controller", "ctl:7443", "--bootstrap-token", str(token), "--bootstrap-ca", str(ca)],
         "--bootstrap-controller needs --tls-cert"),
        (["--bootstrap-controller", "ctl:7443", "--bootstrap-token", str(token), "--bootstrap-ca", str(ca),
          *tls], f"--tls-cert {tmp_path}/tls/node.crt: its directory {tmp_path}/tls is not a writable "),
    ]
    for extra, says in cases:
        result = CliRunner().invoke(main, [*base, *extra])
        assert result.exit_code != 0, (extra, result.output)
        assert says in result.output, (extra, result.output)


def test_the_k8s_controller_needs_ca_key_unless_the_bootstrap_is_off(tmp_path):
    certs.init_ca(tmp_path / "ca")
    certs.issue(tmp_path / "ca", "controller", tmp_path / "ctl", role="controller", days=1)
    result = CliRunner().invoke(main, ["k8s", "controller", "--tls-dir", str(tmp_path / "ctl"),
                                       "--kubeconfig", str(tmp_path / "ca" / "ca.crt")])
    assert result.exit_code == 1
    assert f"--tls-dir {tmp_path / 'ctl'}: ca.key not found" in result.output
    assert "--api-port 0" in result.output


def test_the_k8s_controller_warns_of_the_end_of_an_operator_issued_certificate(tmp_path):
    """Without ca.key the controller serves the controller.crt an operator issued, which nothing
    renews: like the standalone controller it says so at start (and daily) from 7 days before
    its end, naming the file and the command; it said nothing, and every agent then refused it."""
    certs.init_ca(tmp_path / "ca")
    certs.issue(tmp_path / "ca", "controller", tmp_path / "ctl", sans=["fastshare-controller.x.svc"],
                role="controller", days=3)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],   # nobody there
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    log = tmp_path / "controller.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(BIN / "fastshare"), "k8s", "controller", "--tls-dir",
                                 str(tmp_path / "ctl"), "--api-port", "0", "--kubeconfig", str(kubeconfig)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        cert = tmp_path / "ctl" / "controller.crt"
        wait_for(lambda: f"certificate {cert} expires on" in log.read_text() or proc.poll() is not None,
                 "the expiry warning", timeout=30)
        said = log.read_text()
        assert f"WARNING fastshare.k8s: certificate {cert} expires on" in said, said
        assert ("fastshare certs issue --role controller --name controller --san fastshare-controller.x.svc"
                in said), said
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_k8s_controller_names_what_keeps_it_from_issuing_its_own_certificate(tmp_path):
    certs.init_ca(tmp_path / "ca")
    (tmp_path / "file").write_text("")
    base = ["k8s", "controller", "--tls-dir", str(tmp_path / "ca"), "--kubeconfig", str(tmp_path / "file")]
    result = CliRunner().invoke(main, [*base, "--cert-dir", str(tmp_path / "file" / "tls")])
    assert result.exit_code == 1
    assert (f"--cert-dir {tmp_path / 'file' / 'tls'}: cannot write the controller's certificate there"
            in result.output) and "writable directory" in result.output
    (tmp_path / "ca" / "ca.crt").unlink()
    result = CliRunner().invoke(main, [*base, "--cert-dir", str(tmp_path / "tls")])
    assert result.exit_code == 1
    assert f"--tls-dir {tmp_path / 'ca'}: ca.crt not found next to ca.key" in result.output
    assert not (tmp_path / "tls" / "controller.key").exists()
