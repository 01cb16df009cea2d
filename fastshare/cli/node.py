"""`fastshare node`: run the node agent, and talk to the local one."""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

import click
import grpc
from google.protobuf.json_format import MessageToDict

from fastshare.cli._output import fail, print_json, print_table
from fastshare.cli._types import LOG_LEVELS
from fastshare.node import config as node_config

_OPTIONS = [
    # (flag, config key, env, help)
    ("--node-name", "node_name", "FASTSHARE_NODE_NAME", "Name reported to the controller."),
    ("--listen", "listen", "FASTSHARE_NODE_LISTEN", "mTLS TCP HOST:PORT ('' = none)."),
    ("--readonly-listen", "readonly_listen", "FASTSHARE_NODE_READONLY_LISTEN",
     "Anonymous read-only TLS HOST:PORT (off unless set)."),
    ("--unix-socket", "unix_socket", "FASTSHARE_NODE_UNIX_SOCKET", "Local socket for the CLI ('' = none)."),
    ("--tls-cert", None, "FASTSHARE_NODE_TLS_CERT", "Server certificate (PEM)."),
    ("--tls-key", None, "FASTSHARE_NODE_TLS_KEY", "Server key (PEM)."),
    ("--tls-ca", None, "FASTSHARE_NODE_TLS_CA", "Cluster CA certificate (PEM)."),
    ("--state-dir", "state_dir", "FASTSHARE_NODE_STATE_DIR", "Journal directory."),
    ("--run-dir", "run_dir", "FASTSHARE_NODE_RUN_DIR", "MPS pipe/log dirs and share files root."),
    ("--gpu-backend", "device_backend", "FASTSHARE_GPU_BACKEND", "Real NVML or the simulated machine."),
    ("--sim-state", "sim_state", "FASTSHARE_SIM_STATE", "Simulated machine file (backend sim)."),
    ("--mps-control-binary", "mps_control_binary", "FASTSHARE_MPS_CONTROL_BINARY",
     "nvidia-cuda-mps-control (or fastshare-mps-standin)."),
    ("--metrics-listen", "metrics_listen", "FASTSHARE_NODE_METRICS_LISTEN", "Prometheus HOST:PORT ('' off)."),
    ("--controller-address", "controller_address", "FASTSHARE_CONTROLLER_ADDRESS",
     "Controller to register with."),
]


# How a refusal names a value given by flag or environment (the configuration check names the
# others by their key and the file).
_NAMES = {key: f"{flag} (or {env})" for flag, key, env, _help in _OPTIONS if key}
# Flags whose values click checks itself, so that a refusal names the flag (or its variable),
# not the configuration key the value goes to.
_TYPES = {"--gpu-backend": click.Choice(node_config.BACKENDS)}


def _serve_options(fn):
    for flag, _key, env, help_text in reversed(_OPTIONS):
        fn = click.option(flag, envvar=env, default=None, type=_TYPES.get(flag), show_envvar=True,
                          help=help_text)(fn)
    return fn


@click.group("node")
def node() -> None:
    """The node agent (one per GPU host)."""


@node.command("serve")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              default=str(node_config.DEFAULT_PATH), envvar="FASTSHARE_NODE_CONFIG", show_default=True,
              show_envvar=True, help="YAML settings; flags and environment override it.")
@click.option("--log-level", default="info", type=click.Choice(LOG_LEVELS, case_sensitive=False),
              envvar="FASTSHARE_LOG_LEVEL", show_envvar=True, show_default=True, help="Log verbosity.")
@_serve_options
@click.option("--bootstrap-controller", envvar="FASTSHARE_NODE_BOOTSTRAP_CONTROLLER", show_envvar=True,
              default=None, help="Kubernetes mode: HOST:PORT of the controller's node-certificate service; "
              "the agent gets its own certificate there and writes it to --tls-cert/--tls-key/--tls-ca "
              "(renewed at 2/3 of its life). Needs --bootstrap-token and --bootstrap-ca.")
@click.option("--bootstrap-token", envvar="FASTSHARE_NODE_BOOTSTRAP_TOKEN", show_envvar=True, default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The Pod's projected ServiceAccount token (audience fastshare); re-read on every request.")
@click.option("--bootstrap-ca", envvar="FASTSHARE_NODE_BOOTSTRAP_CA", show_envvar=True, default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The cluster CA certificate to verify --bootstrap-controller with (e.g. from a "
                   "ConfigMap).")
def serve(config_path: Path, log_level: str, bootstrap_controller: str | None,
          bootstrap_token: Path | None, bootstrap_ca: Path | None, **flags: str | None) -> None:
    """Run the agent: reconcile the journal with the GPUs, then serve gRPC until SIGTERM."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides: dict[str, object] = {}
    tls = {}
    for flag, key, _env, _help in _OPTIONS:
        value = flags[flag.lstrip("-").replace("-", "_")]
        if value is None:
            continue
        if key is None:
            tls[flag.removeprefix("--tls-")] = value
        else:
            overrides[key] = value
    if tls:
        overrides["tls"] = tls
    try:
        cfg = node_config.load(config_path, overrides, _NAMES)
    except node_config.ConfigError as exc:
        fail(f"invalid node agent configuration: {exc}")
    bootstrapped = bool(bootstrap_controller or bootstrap_token or bootstrap_ca)
    if bootstrapped:
        _bootstrap(cfg, bootstrap_controller, bootstrap_token, bootstrap_ca)
    from fastshare.device.api import DeviceError
    from fastshare.node.server import serve as run

    try:
        run(cfg, cert_renewed=bootstrapped)   # the bootstrap renews the certificate by itself
    except DeviceError as exc:
        fail(f"cannot open the GPUs: {exc}")
    except (OSError, RuntimeError) as exc:
        fail(f"node agent failed to start: {exc}")


def _bootstrap(cfg: node_config.NodeConfig, controller: str | None, token: Path | None,
               ca: Path | None) -> None:
    """Check the --bootstrap-* options, get this node's certificate (waiting for the controller
    if need be) and keep renewing it in the background."""
    import os
    import threading

    from fastshare.k8s import names
    from fastshare.node.bootstrap import BootstrapConfig, BootstrapError, Bootstrapper

    given = {"--bootstrap-controller": controller, "--bootstrap-token": token, "--bootstrap-ca": ca}
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        present = ", ".join(flag for flag, value in given.items() if value)
        fail(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required with {present}",
             hint="the three --bootstrap-* options go together (Kubernetes mode)")
    try:
        controller = node_config.check_hostport("--bootstrap-controller", controller)
    except node_config.ConfigError as exc:
        fail(str(exc))
    paths = {"--tls-cert": cfg.tls.cert, "--tls-key": cfg.tls.key, "--tls-ca": cfg.tls.ca}
    for flag, value in paths.items():
        if not value:
            fail(f"--bootstrap-controller needs {flag}: where the issued certificate, key and CA are written")
        parent = Path(value).parent
        if not (parent.is_dir() and os.access(parent, os.W_OK)):
            fail(f"{flag} {value}: its directory {parent} is not a writable directory (the bootstrap writes "
                 "the file there; in Kubernetes an emptyDir)")
    why = names.node_cn_problem(cfg.node_name)
    if why:
        fail(f"--node-name {cfg.node_name!r} cannot be a certificate's common name for a Kubernetes node: "
             f"{why}")
    bootstrapper = Bootstrapper(BootstrapConfig(
        controller=controller, token_file=token, ca_file=ca, node_name=cfg.node_name,
        cert=Path(cfg.tls.cert), key=Path(cfg.tls.key), ca=Path(cfg.tls.ca)))
    never = threading.Event()   # SIGTERM ends the process; the renewals are a daemon thread
    try:
        cert = bootstrapper.obtain(never)
    except BootstrapError as exc:
        fail(str(exc))
    bootstrapper.start_renewals(cert, never)


def _stub(unix_socket: str):
    from fastshare.node.client import channel, stub

    return stub(channel(unix_socket=unix_socket))


_SOCKET = click.option("--unix-socket", default="/run/fastshare/node.sock",
                       envvar="FASTSHARE_NODE_UNIX_SOCKET", show_default=True,
                       help="The local agent's socket.")


def _call(fn, *args):
    try:
        return fn(*args, timeout=30)
    except grpc.RpcError as exc:
        unreachable = exc.code() == grpc.StatusCode.UNAVAILABLE   # any other code is the agent's answer
        fail(f"{exc.code().name}: {exc.details()}",
             "is `fastshare node serve` running and the socket readable by you?" if unreachable else None)


def _mig_mode(current: bool, pending: bool) -> str:
    """A GPU's MIG mode, and the change that waits for a GPU reset (Ampere) if one does."""
    now = "on" if current else "off"
    return now if current == pending else f"{now} ({'on' if pending else 'off'} after a GPU reset)"


@node.command("status")
@_SOCKET
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(unix_socket: str, as_json: bool) -> None:
    """GPUs, MIG devices, MPS daemons and shares of the local agent."""
    from fastshare.v1 import agent_pb2, common_pb2

    inv = _call(_stub(unix_socket).GetInventory, agent_pb2.GetInventoryRequest())
    if as_json:
        print_json(MessageToDict(inv, preserving_proto_field_name=True))
        return
    print_table(f"node {inv.node_name} (agent {inv.agent_version}, driver {inv.driver_version})",
                ["gpu", "uuid", "name", "MIG", "mig devices"],
                [[g.index, g.uuid or "-", g.name or "-",
                  "LOST" if g.lost else _mig_mode(g.mig_enabled, g.mig_pending),
                  ", ".join(f"{m.profile_name}@{m.start}{'*' if m.created_by_agent else ''}"
                            for m in g.mig_devices)] for g in inv.gpus])
    lost = [[g.index, g.uuid or "unknown (lost before the agent read it)", f"NVML_ERROR_{g.lost}"]
            for g in inv.gpus if g.lost]
    if lost:
        print_table("lost GPUs (fell off the bus?): they take no new shares and the shares on them are "
                    "dropped; drain the node, then reset the GPU (nvidia-smi -r) or reboot",
                    ["gpu", "uuid", "NVML"], lost)
    print_table("shares", ["id", "kind", "devices", "owner"],
                [[s.id, common_pb2.ShareKind.Name(s.kind).removeprefix("SHARE_KIND_").lower(),
                  ", ".join(s.device_uuids), s.owner] for s in inv.shares])
    print_table("MPS daemons", ["device", "pid", "healthy", "shares"],
                [[d.device_uuid, d.pid, d.healthy, ", ".join(d.share_ids)] for d in inv.mps_daemons])
    if inv.lost_shares:   # dropped with their device; listed until their id is released
        print_table("lost shares (device gone; listed until released)", ["id", "owner", "why"],
                    [[s.id, s.owner, s.reason] for s in inv.lost_shares])


@node.command("release")
@_SOCKET
@click.argument("share_id")
def release(unix_socket: str, share_id: str) -> None:
    """Release a share on the local agent (idempotent)."""
    from fastshare.v1 import agent_pb2

    reply = _call(_stub(unix_socket).ReleaseShare, agent_pb2.ReleaseShareRequest(share_id=share_id))
    click.echo(f"released {share_id}" if reply.released else f"{share_id} was not held")


@node.command("unit")
def unit() -> None:
    """Print the hardened systemd unit template (fastshare-node.service)."""
    click.echo(resources.files("fastshare.node").joinpath("fastshare-node.service").read_text(), nl=False)


COMMANDS = [node]
