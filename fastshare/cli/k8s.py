"""`fastshare k8s ...`: the Kubernetes side (manifests now; the in-cluster controller next)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import click
import yaml

from fastshare.cli._output import fail
from fastshare.cli._types import LOG_LEVELS, Number
from fastshare.k8s import controller_cert, names


@click.group("k8s")
def k8s() -> None:
    """Run fastshare inside a Kubernetes cluster (FastPod CRD, controller, node agents)."""


@k8s.command("manifests")
@click.option("--values", "values_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="YAML file overriding templates/defaults.yaml (namespace, image, ...).")
@click.option("--crd-only", is_flag=True,
              help="Print only the CustomResourceDefinitions (FastPod, FastShareAllocation).")
def manifests_cmd(values_file: Path | None, crd_only: bool) -> None:
    """Print the manifests (CRD, namespace, RBAC, controller, node agent) as YAML for kubectl apply."""
    from fastshare.k8s import manifests

    values = {}
    if values_file is not None:
        try:
            values = yaml.safe_load(values_file.read_text()) or {}
        except yaml.YAMLError as exc:
            fail(f"{values_file}: not valid YAML: {exc}")
        except (OSError, UnicodeDecodeError) as exc:   # unreadable, or not a text file
            fail(f"{values_file}: cannot read it: {exc}")
        if not isinstance(values, dict):
            fail(f"{values_file}: must be a YAML mapping of values, got {type(values).__name__}")
    try:
        if crd_only:
            sys.stdout.write(yaml.safe_dump_all(manifests.crds(values), sort_keys=False))
        else:
            sys.stdout.write(manifests.render_text(values))
    except manifests.ValuesError as exc:
        fail(f"{values_file}: {exc}", hint="see `fastshare k8s manifests` output or templates/defaults.yaml")


def _k8s(rule: Callable[[str], str | None]) -> Callable[..., str | None]:
    """A click callback refusing a value that breaks ``rule`` (a function of fastshare.k8s.names)."""

    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        why = None if value is None else rule(value)
        if why:
            raise click.BadParameter(f"{value!r} {why}", ctx, param)
        return value

    return check


def _controller_tls(tls_dir: Path, cert_dir: Path, sans: list[str], lifetime_s: float, api_port: int):
    """The controller's certificate paths: its own, signed (and later renewed) with the CA when
    ``tls_dir`` holds ca.key, else the hand-issued controller.crt there. Returns the paths, the
    renewer (or None) and the certificate it issued (or None); exits naming the option at fault."""
    import datetime as dt
    import logging

    from fastshare.security.certs import CA_CERT, CA_KEY, CertError
    from fastshare.security.tls import TlsPaths

    if (tls_dir / CA_KEY).is_file():
        # The controller holds the CA key anyway: it signs (and renews) its own certificate
        # rather than serving one an operator issued, which nothing would renew.
        hand_issued = [n for n in ("controller.crt", "controller.key") if (tls_dir / n).exists()]
        if hand_issued:
            logging.getLogger("fastshare.k8s").info(
                "--tls-dir %s: ignoring %s: with ca.key there the controller issues and renews its own "
                "certificate in --cert-dir %s", tls_dir, " and ".join(hand_issued), cert_dir)
        lifetime = dt.timedelta(seconds=lifetime_s)
        own = controller_cert.ControllerCert(tls_dir, cert_dir, sans, lifetime=lifetime)
        try:
            if not own.tls.ca.is_file():
                raise CertError(f"--tls-dir {tls_dir}: {CA_CERT} not found next to {CA_KEY}")
            return own.tls, own, own.issue()
        except CertError as exc:
            fail(str(exc), hint="the controller's Secret holds ca.crt and ca.key from `fastshare certs init` "
                                "(README, Kubernetes)")
    tls = TlsPaths.in_dir(tls_dir, "controller")
    try:
        tls.check()
    except (OSError, ValueError) as exc:
        fail(f"--tls-dir {tls_dir}: {exc}",
             hint="put ca.crt and ca.key in it (the controller then issues its own certificate), or "
                  "controller.crt/.key from `fastshare certs issue --role controller --name controller`")
    if api_port:
        fail(f"--tls-dir {tls_dir}: ca.key not found; the node-certificate service (--api-port "
             f"{api_port}) signs the agents' certificates with the cluster CA key",
             hint="add ca.key to the controller's Secret (README, Kubernetes), or pass --api-port 0 "
                  "and issue every node's certificate by hand")
    return tls, None, None


@k8s.command("controller")
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False),
              help="Kubeconfig to use (default: the in-cluster service account, else ~/.kube/config).")
@click.option("--namespace", default=None, callback=_k8s(names.namespace_problem),
              help="Serve the FastPods of this namespace only (default: all).")
@click.option("--lease-namespace", default="fastshare-system", show_default=True,
              callback=_k8s(names.namespace_problem), help="Namespace of the leader election Lease.")
@click.option("--lease-name", default="fastshare-controller", show_default=True,
              callback=_k8s(names.name_problem), help="Name of the leader election Lease.")
@click.option("--identity", envvar="POD_NAME", default=None,
              help="Leader election identity (default: $POD_NAME, else the host name and pid).")
@click.option("--gpu-node-label", default="fastshare.io/gpu", show_default=True,
              callback=_k8s(names.label_key_problem),
              help="Nodes labelled <label>=true run a node agent.")
@click.option("--agent-port", default=7444, show_default=True, type=click.IntRange(1, 65535),
              help="Node agents' port when a Node has no fastshare.io/agent-endpoint annotation.")
@click.option("--tls-dir", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Directory with ca.crt and ca.key (the controller's Secret): the controller signs its "
                   "own certificate (see --cert-dir) and the node agents' with them. Without ca.key "
                   "(--api-port 0 only): controller.crt, controller.key and ca.crt issued by hand.")
@click.option("--cert-dir", default=Path("/run/fastshare/tls"), show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="Writable directory where the controller writes its own certificate and key, renewed at "
                   "2/3 of their life (a memory-backed emptyDir in the Deployment); used when --tls-dir "
                   "holds ca.key.")
@click.option("--service-name", default="fastshare-controller", show_default=True,
              callback=_k8s(names.service_name_problem),
              help="The controller's Service: its own certificate names "
                   "<service-name>.<service-namespace>.svc (and .svc.cluster.local), which the node agents "
                   "dial and check.")
@click.option("--service-namespace", default=None, callback=_k8s(names.namespace_problem),
              help="Namespace of the controller's Service (default: --lease-namespace).")
@click.option("--cert-lifetime", default=controller_cert.DEFAULT_LIFETIME.total_seconds(), hidden=True,
              type=Number(1, 30 * 86400), help="Seconds the controller's own certificate is valid (tests).")
@click.option("--api-port", default=7443, show_default=True, type=click.IntRange(0, 65535),
              help="Serve the node agents' certificate bootstrap (server-side TLS with the controller's "
                   "certificate) on this port, on every replica; 0 = off (agents then need certificates "
                   "issued by hand).")
@click.option("--agent-namespace", default="fastshare-system", show_default=True,
              callback=_k8s(names.namespace_problem),
              help="Namespace of the node-agent DaemonSet whose Pods get node certificates.")
@click.option("--agent-service-account", default="fastshare-node-agent", show_default=True,
              callback=_k8s(names.name_problem), help="The node agents' ServiceAccount (their tokens' user).")
@click.option("--agent-daemonset", default="fastshare-node-agent", show_default=True,
              callback=_k8s(names.name_problem),
              help="The DaemonSet that must own a Pod asking for a certificate.")
@click.option("--metrics-port", default=0, type=click.IntRange(0, 65535),
              help="Serve Prometheus metrics (and liveness) on this port; 0 = off.")
@click.option("--lease-duration", default=15.0, show_default=True, type=Number(1.0, 3600),
              help="Seconds a leader holds the Lease without renewing it before another replica takes over.")
@click.option("--node-interval", default=2.0, show_default=True, type=Number(0.1, 3600),
              help="Seconds between agent pings (heartbeats); longer past 1,000 pings a second "
                   "(10 s at 10,000 nodes), the timeout stretched as much.")
@click.option("--heartbeat-timeout", default=8.0, show_default=True, type=Number(0.5, 86400),
              help="Silence after which a node agent counts as down.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(LOG_LEVELS, case_sensitive=False), help="Log verbosity.")
def controller_cmd(kubeconfig, namespace, lease_namespace, lease_name, identity, gpu_node_label,
                   agent_port, tls_dir, cert_dir, service_name, service_namespace, cert_lifetime, api_port,
                   agent_namespace, agent_service_account, agent_daemonset,
                   metrics_port, lease_duration, node_interval, heartbeat_timeout,
                   log_level) -> None:
    """Run the in-cluster controller (one active replica at a time, chosen through a Lease)."""
    import logging
    import os
    import socket
    import threading

    from kubernetes import config

    from fastshare.controller.agent_client import AgentPool
    from fastshare.controller.core import Settings as CoreSettings
    from fastshare.k8s.controller import KubeController, KubeSettings, run_with_leader_election
    from fastshare.k8s.leader import LeaderElector
    from fastshare.security.certs import CertError
    from fastshare.security.rotation import watch_expiry
    from fastshare.server_runtime import settle_startup
    from fastshare.stop_signal import stop_on_signals

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sans = controller_cert.service_names(service_name, service_namespace or lease_namespace)
    tls, own_cert, issued = _controller_tls(tls_dir, cert_dir, sans, cert_lifetime, api_port)
    try:
        if kubeconfig:
            api = config.new_client_from_config(config_file=kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            from kubernetes import client

            api = client.ApiClient()
    except Exception as exc:
        fail(f"cannot configure the Kubernetes client: {exc}", hint="pass --kubeconfig")
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port)
    identity = identity or f"{socket.gethostname()}-{os.getpid()}"
    settings = KubeSettings(gpu_node_label=gpu_node_label, agent_port=agent_port, namespace=namespace,
                            node_interval=node_interval)
    core_settings = CoreSettings(heartbeat_interval=node_interval, heartbeat_timeout=heartbeat_timeout)
    agents = AgentPool(tls)
    elector = LeaderElector(api, lease_namespace, lease_name, identity, lease_duration=lease_duration,
                            renew_deadline=lease_duration * 2 / 3, retry_period=lease_duration / 7.5)
    stop = threading.Event()
    lost = threading.Event()
    stop_on_signals(stop)
    if own_cert is not None:
        own_cert.start_renewals(issued, stop)
    else:   # the operator's certificate: nothing renews it, so its end is announced from a week before
        watch_expiry(tls.cert, controller_cert.ROLE, controller_cert.NAME, logging.getLogger("fastshare.k8s"),
                     stop)

    def on_lost() -> None:
        lost.set()
        stop.set()

    bootstrap_server = None
    if api_port:
        from fastshare.k8s import bootstrap

        try:
            issuer = bootstrap.NodeCertIssuer(api, tls_dir, bootstrap.IssuerSettings(
                namespace=agent_namespace, service_account=agent_service_account, daemonset=agent_daemonset,
                gpu_node_label=gpu_node_label, controller_names=tuple(sans)))
            # Every replica serves it (the Service picks any): signing needs no leadership.
            bootstrap_server, _ = bootstrap.serve(f"[::]:{api_port}", tls, issuer)
        except (CertError, OSError, RuntimeError) as exc:
            fail(f"--api-port {api_port}: {exc}")
    settle_startup()
    # every change a controller makes checks first that the Lease is still held, and agent calls
    # carry the leader term, which agents that have seen a newer one refuse (see Fence)
    run_with_leader_election(lambda: KubeController(api, agents, settings, core_settings, elector=elector),
                             elector, stop, on_lost)
    agents.close()
    if bootstrap_server is not None:
        bootstrap_server.stop(5).wait()
    if lost.is_set():
        fail("lost leadership; exiting so that a fresh process rebuilds its state")


COMMANDS = [k8s]
