"""Node certificates for the node agents, proven by Kubernetes (the controller's side).

Each node agent (a DaemonSet Pod) gets a node-role certificate of its own, CN = its node, with
no manual issuing: it sends a CSR and its projected ServiceAccount token (audience
:data:`TOKEN_AUDIENCE`, bound to its Pod) to the controller's ``NodeBootstrap`` service on
``controller.apiPort``. The controller signs only when Kubernetes itself vouches for the node:

1. a TokenReview (audiences [``fastshare``]) authenticates the token: the API server checks
   signature, expiry, audience and that the Pod it is bound to still exists with that uid;
2. the user is ``system:serviceaccount:<agent namespace>:<agent service account>`` and the
   token carries the Pod's name and uid (only a Pod-bound token has them);
3. that Pod (read now, not from a cache) has that uid, is neither being deleted nor ended
   (phase Succeeded or Failed: an evicted Pod stays, and its token still authenticates), is
   controlled by the DaemonSet ``<agent.name>`` (its ownerReference names that DaemonSet's
   current uid: whoever may create Pods there can write any ownerReference, but a name alone
   is not the DaemonSet) and runs on the node the CSR names (``spec.nodeName``);
4. that Node carries the GPU label (``<gpu label>=true``).

A node named like one of the controller's own certificate's names (its Service's DNS names)
is refused before all that: gRPC clients check a server's name, not its role, so that node's
certificate would pass every agent's check of the controller.

The certificate: role node, CN = the node, SANs = the node's name, its agent name (what the
controller dials the agent by, :func:`fastshare.security.certs.agent_name`) and the Pod's
``status.hostIP`` (from the Pod, never from the CSR), valid for :data:`DEFAULT_LIFETIME`
(the agent renews it at 2/3 of that). Signed by :func:`fastshare.security.certs.sign_leaf`,
the same code as ``fastshare certs issue``.

The port has server-side TLS only (the caller has no certificate yet), so anyone in the
cluster can call it: the checks that need no API server (sizes, the CSR, its common name) come
first, then rate limits per caller address and for all callers
(:mod:`fastshare.k8s.ratelimit`, RESOURCE_EXHAUSTED with when to retry), and only then the
TokenReview. The token is never logged; refusals are logged and returned with what did not
match and what to do.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes import client

from fastshare.k8s import names
from fastshare.k8s.controller_cert import service_names
from fastshare.k8s.ratelimit import RETRY_AFTER_KEY, Refusal, RequestLimiter, peer_address
from fastshare.k8s.resources import TOKEN_AUDIENCE
from fastshare.security import certs
from fastshare.security.tls import TlsPaths, server_credentials
from fastshare.v1 import bootstrap_pb2 as pb
from fastshare.v1 import bootstrap_pb2_grpc as pb_grpc

log = logging.getLogger("fastshare.k8s.bootstrap")

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
DEFAULT_LIFETIME = dt.timedelta(hours=24)
MAX_CSR_BYTES = 16 * 1024
MAX_TOKEN_BYTES = 16 * 1024
# Anyone in the cluster may connect (no client certificate): small messages, few at a time.
MAX_MESSAGE_BYTES = 64 * 1024
WORKERS = 4
_CURVES = (ec.SECP256R1, ec.SECP384R1)


class Refused(Exception):
    """The request was not granted: ``code`` (a grpc.StatusCode) and a message saying why."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after


def _denied(message: str) -> Refused:
    return Refused(grpc.StatusCode.PERMISSION_DENIED, message)


def _invalid(message: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class IssuerSettings:
    namespace: str = "fastshare-system"            # the node agents' namespace
    service_account: str = "fastshare-node-agent"   # their ServiceAccount
    daemonset: str = "fastshare-node-agent"         # the DaemonSet that owns their Pods
    gpu_node_label: str = "fastshare.io/gpu"
    lifetime: dt.timedelta = DEFAULT_LIFETIME
    # The controller's own certificate's names (what the agents dial and check): no node
    # certificate may carry one, or its holder could pose as the controller to the agents.
    controller_names: tuple[str, ...] = tuple(service_names("fastshare-controller", "fastshare-system"))

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


@dataclass(frozen=True)
class Issued:
    certificate_pem: bytes
    ca_pem: bytes
    node: str
    pod: str
    host_ip: str
    not_after: dt.datetime


def parse_csr(csr_pem: bytes) -> tuple[str, ec.EllipticCurvePublicKey]:
    """The node name (CN) and public key of a CSR, or INVALID_ARGUMENT saying what is wrong."""
    fix = "send a PEM PKCS#10 CSR of an ECDSA P-256 key with subject CN=<node name>"
    if not csr_pem:
        raise _invalid(f"csr_pem is empty: {fix}")
    if len(csr_pem) > MAX_CSR_BYTES:
        raise _invalid(f"csr_pem is {len(csr_pem)} bytes, more than {MAX_CSR_BYTES}: {fix}")
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
        signed = csr.is_signature_valid
        key = csr.public_key()
        cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except (ValueError, TypeError) as exc:
        raise _invalid(f"csr_pem is not a usable CSR ({exc}): {fix}") from None
    if not signed:
        raise _invalid(f"csr_pem: the CSR's signature does not verify with its own key: {fix}")
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, _CURVES):
        kind = type(key).__name__.removeprefix("_")
        raise _invalid(f"csr_pem: the key is {kind}, not ECDSA P-256/P-384: {fix}")
    if len(cns) != 1 or not isinstance(cns[0].value, str):
        raise _invalid(f"csr_pem: the subject has {len(cns)} common names, not exactly one: {fix}")
    node = cns[0].value
    why = names.node_cn_problem(node)
    if why:
        raise _invalid(f"csr_pem: common name {node!r} is not a Kubernetes node name ({why}): {fix}")
    return node, key


def _api_failure(what: str, exc: client.ApiException) -> Refused:
    """The API server could not be asked: not a refusal of the caller, who should retry."""
    hint = ""
    if exc.status == 403:
        hint = (" (the controller's ClusterRole lacks the permission: apply the manifests of "
                "`fastshare k8s manifests`)")
    return Refused(grpc.StatusCode.UNAVAILABLE,
                   f"the controller could not {what}: API server answered {exc.status} {exc.reason}{hint}; "
                   "retry later")


class NodeCertIssuer:
    """Checks a node agent's token and Pod, then signs its certificate (see the module docstring)."""

    def __init__(self, api: client.ApiClient, ca_dir: Path, settings: IssuerSettings | None = None,
                 limiter: RequestLimiter | None = None) -> None:
        self.settings = settings or IssuerSettings()
        self.ca_dir = Path(ca_dir)
        self.limiter = limiter or RequestLimiter()
        certs.load_ca(self.ca_dir)   # fail at start, not at the first agent
        self._auth = client.AuthenticationV1Api(api)
        self._core = client.CoreV1Api(api)
        self._apps = client.AppsV1Api(api)

    def issue(self, csr_pem: bytes, token: str, caller: str = "") -> Issued:
        """Check and sign; ``caller`` is the caller's address (its rate limit). Everything that
        needs no API server is checked before the limit, and the limit before the TokenReview."""
        node, public_key = parse_csr(csr_pem)
        self._check_not_controller(node)
        if not token:
            raise _invalid("token is empty: send the agent's projected ServiceAccount token "
                           f"(audience {TOKEN_AUDIENCE!r}, see --bootstrap-token)")
        if len(token) > MAX_TOKEN_BYTES:
            raise _invalid(f"token is longer than {MAX_TOKEN_BYTES} bytes; it is not a ServiceAccount token")
        try:
            self.limiter.admit(caller)
        except Refusal as exc:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message, exc.retry_after) from None
        pod_name, pod_uid = self._review(token)
        pod = self._pod(pod_name, pod_uid)
        host_ip = self._check_pod(pod, node)
        self._check_node(node)
        ca_cert, ca_key = certs.load_ca(self.ca_dir)
        cert = certs.sign_leaf(ca_cert, ca_key, node, public_key,
                               certs.san_entries([node, certs.agent_name(node), host_ip]), "node",
                               self.settings.lifetime)
        issued = Issued(cert.public_bytes(serialization.Encoding.PEM),
                        ca_cert.public_bytes(serialization.Encoding.PEM), node,
                        f"{self.settings.namespace}/{pod_name}", host_ip, cert.not_valid_after_utc)
        log.info("issued a node certificate for node %s (SANs %s, %s, %s) to Pod %s, serial %x, valid "
                 "until %s", node, node, certs.agent_name(node), host_ip, issued.pod, cert.serial_number,
                 issued.not_after.isoformat())
        return issued

    def _check_not_controller(self, node: str) -> None:
        """The certificate's SANs list the node's name, and gRPC clients check only the name, not
        the role: a node named like the controller's Service would pass the agents' check of the
        controller they dial."""
        if node.lower() in {name.lower() for name in self.settings.controller_names}:
            raise _denied(f"node name {node!r} is a name of the controller's own certificate (what the "
                          "agents dial and check): a node certificate for it could pose as the controller "
                          "to every agent; give the node another name")
        if problem := certs.agent_name_problem("node", node, node):
            raise _denied(f"node name {problem}; give the node another name")

    def _review(self, token: str) -> tuple[str, str]:
        """TokenReview: the Pod's name and uid the token is bound to."""
        s = self.settings
        review = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[TOKEN_AUDIENCE]))
        try:
            status = self._auth.create_token_review(review).status
        except client.ApiException as exc:
            raise _api_failure("review the token (TokenReview)", exc) from None
        if not status.authenticated:
            raise _denied(f"the API server did not accept the token ({status.error or 'no reason given'}): "
                          f"it must be the agent's projected ServiceAccount token with audience "
                          f"{TOKEN_AUDIENCE!r}, unexpired, of a Pod that still exists (the agent re-reads "
                          "the file the kubelet keeps fresh)")
        if TOKEN_AUDIENCE not in (status.audiences or []):
            raise _denied(f"the token is not for audience {TOKEN_AUDIENCE!r} (the API server reports "
                          f"{status.audiences or []}): project it with audience: {TOKEN_AUDIENCE}")
        user = status.user or client.V1UserInfo()
        if user.username != s.username:
            raise _denied(f"the token is of {user.username!r}, not of {s.username!r}: only the node-agent "
                          f"DaemonSet's ServiceAccount ({s.service_account} in namespace {s.namespace}) "
                          "gets node certificates")
        extra = user.extra or {}
        pod_names, pod_uids = extra.get(POD_NAME_EXTRA) or [], extra.get(POD_UID_EXTRA) or []
        if len(pod_names) != 1 or len(pod_uids) != 1:
            raise _denied("the token is not bound to a Pod (no pod-name/pod-uid in it): use the projected "
                          "serviceAccountToken volume of the node-agent DaemonSet, not a TokenRequest or "
                          "Secret token")
        return pod_names[0], pod_uids[0]

    def _pod(self, name: str, uid: str) -> client.V1Pod:
        s = self.settings
        try:
            pod = self._core.read_namespaced_pod(name, s.namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                raise _denied(f"Pod {s.namespace}/{name}, which the token is bound to, no longer exists: "
                              "only a running node-agent Pod gets a certificate") from None
            raise _api_failure(f"read Pod {s.namespace}/{name}", exc) from None
        if pod.metadata.uid != uid:
            raise _denied(f"Pod {s.namespace}/{name} has uid {pod.metadata.uid}, the token is bound to uid "
                          f"{uid}: the Pod was deleted and re-created; the new Pod's token is needed")
        return pod

    def _check_pod(self, pod: client.V1Pod, node: str) -> str:
        """The Pod's host IP, once it is the agent DaemonSet's Pod on ``node``."""
        s = self.settings
        where = f"Pod {s.namespace}/{pod.metadata.name}"
        if pod.metadata.deletion_timestamp:
            raise _denied(f"{where} is being deleted: its replacement gets a certificate")
        phase = pod.status.phase if pod.status else None
        if phase in ("Succeeded", "Failed"):
            # An evicted Pod stays until something deletes it, and its token still authenticates.
            raise _denied(f"{where} has ended (phase {phase}): only a running node-agent Pod gets a "
                          "certificate; its replacement does")
        owners = [o for o in pod.metadata.owner_references or [] if o.controller]
        owner = next((o for o in owners if o.kind == "DaemonSet" and o.api_version == "apps/v1"
                      and o.name == s.daemonset), None)
        if owner is None:
            owned = ", ".join(f"{o.kind} {o.name}" for o in owners) or "nothing"
            raise _denied(f"{where} is controlled by {owned}, not by the DaemonSet {s.daemonset}: only the "
                          "node-agent DaemonSet's Pods get node certificates")
        daemonset_uid = self._daemonset_uid()
        if owner.uid != daemonset_uid:
            raise _denied(f"{where} names the DaemonSet {s.daemonset} with uid {owner.uid}, but "
                          f"that DaemonSet has uid {daemonset_uid}: the Pod was not made by it (a Pod of "
                          "a deleted DaemonSet of that name, or an ownerReference written by hand); only "
                          "its own Pods get node certificates")
        if pod.spec.node_name != node:
            raise _denied(f"the CSR asks for node {node!r} but {where} runs on "
                          f"{pod.spec.node_name or 'no node yet'!r}: the CSR's common name must be the "
                          "Pod's spec.nodeName (--node-name=$(NODE_NAME))")
        host_ip = (pod.status.host_ip if pod.status else None) or ""
        try:
            ipaddress.ip_address(host_ip)
        except ValueError:
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"{where} has no status.hostIP yet ({host_ip!r}); retry once the kubelet "
                          "reported it") from None
        return host_ip

    def _daemonset_uid(self) -> str:
        """The agent DaemonSet's uid, read now (its Role allows `get` on that name only)."""
        s = self.settings
        try:
            return self._apps.read_namespaced_daemon_set(s.daemonset, s.namespace).metadata.uid
        except client.ApiException as exc:
            if exc.status == 404:
                raise _denied(f"the node-agent DaemonSet {s.namespace}/{s.daemonset} does not exist: "
                              "only its Pods get node certificates (check --agent-daemonset)") from None
            raise _api_failure(f"read DaemonSet {s.namespace}/{s.daemonset}", exc) from None

    def _check_node(self, node: str) -> None:
        label = self.settings.gpu_node_label
        try:
            nodes = self._core.list_node(field_selector=f"metadata.name={node}").items
        except client.ApiException as exc:
            raise _api_failure(f"read Node {node}", exc) from None
        if not nodes:
            raise _denied(f"Node {node} does not exist")
        value = (nodes[0].metadata.labels or {}).get(label)
        if value != "true":
            raise _denied(f"Node {node} is not a fastshare GPU node: it has label {label}="
                          f"{value if value is not None else '(none)'}, not {label}=true; label it "
                          f"(kubectl label node {node} {label}=true) to run an agent there")


class NodeBootstrapService(pb_grpc.NodeBootstrapServicer):
    def __init__(self, issuer: NodeCertIssuer) -> None:
        self.issuer = issuer

    def IssueNodeCertificate(self, request: pb.IssueNodeCertificateRequest,
                             context: grpc.ServicerContext) -> pb.IssueNodeCertificateReply:
        try:
            issued = self.issuer.issue(request.csr_pem, request.token, peer_address(context.peer()))
        except Refused as exc:
            # Over a rate limit: debug only, or a flood of calls would flood the log too.
            level = logging.DEBUG if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED else logging.WARNING
            log.log(level, "node certificate refused (%s) to %s: %s", exc.code.name, context.peer(),
                    exc.message)
            if exc.retry_after is not None:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{exc.retry_after:.3f}"),))
            context.abort(exc.code, exc.message)
        except certs.CertError as exc:   # the CA in --tls-dir became unusable
            log.error("cannot sign a node certificate: %s", exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the controller cannot sign now: {exc}")
        return pb.IssueNodeCertificateReply(certificate_pem=issued.certificate_pem, ca_pem=issued.ca_pem)


def serve(address: str, tls: TlsPaths, issuer: NodeCertIssuer) -> tuple[grpc.Server, int]:
    """Start the NodeBootstrap service on ``address`` (server-side TLS with ``tls``); returns the
    server and the bound port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="bootstrap"),
                         options=[("grpc.so_reuseport", 0),
                                  ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
                         maximum_concurrent_rpcs=WORKERS * 4)
    pb_grpc.add_NodeBootstrapServicer_to_server(NodeBootstrapService(issuer), server)
    try:
        port = server.add_secure_port(address, server_credentials(tls, require_client_cert=False))
    except RuntimeError as exc:
        raise RuntimeError(f"--api-port: cannot listen on {address} (in use?)") from exc
    server.start()
    return server, port
