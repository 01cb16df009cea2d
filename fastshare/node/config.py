"""Node agent configuration: /etc/fastshare/node.yaml, overridden by flags and environment.

Every value is validated at start with an error that names the key and the allowed values,
so a typo stops the agent before it touches a GPU. A value is named as the user gave it: a flag
or environment variable by those (the caller says how), a key of the file by the key and the
file. Secure by default: a TCP listener needs TLS, and anonymous read-only access exists only on
its own, explicitly configured port.
"""

from __future__ import annotations

import dataclasses
import grp
import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_PATH = Path("/etc/fastshare/node.yaml")
BACKENDS = ("nvml", "sim")
# A running agent holds its state_dir's lock (fastshare.state_lock) from before it touches the
# journal or the GPUs until it exits: one agent per state directory.
AGENT_LOCK_OWNER = "node agent"
# While no agent runs, a MIG change made directly (`fastshare mig ...`, the mig_config module,
# fastshare-mig-layout.service) holds that lock with this note: an agent starting meanwhile
# waits for it (up to MIG_CHANGE_WAIT_S, extending the unit's start timeout by as much) instead of
# failing after the 2 s a second agent gets.
MIG_CHANGE_NOTE = "a MIG change made without the node agent (fastshare mig)"
MIG_CHANGE_WAIT_S = 150.0
# An agent that serves says so in the lock's status, with its unix socket ("serving on /run/...",
# "serving on no unix socket"): a MIG change that finds no agent on the socket it was given tells
# it from one still starting.
SERVING = "serving on"


class ConfigError(ValueError):
    """Invalid configuration; the message names the key."""


@dataclass(frozen=True)
class TlsConfig:
    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def configured(self) -> bool:
        return bool(self.cert or self.key or self.ca)


@dataclass(frozen=True)
class NodeConfig:
    node_name: str = field(default_factory=socket.gethostname)
    # mTLS TCP listener for the controller ("" disables). Every call needs a client cert.
    listen: str = ""
    # Optional second TCP listener: server-side TLS only, read-only calls, anonymous.
    readonly_listen: str = ""
    unix_socket: str = "/run/fastshare/node.sock"
    unix_socket_mode: int = 0o660
    unix_socket_group: str = ""
    tls: TlsConfig = field(default_factory=TlsConfig)
    # CN/SAN allowed to mutate over TCP, on top of the controller role (always needed); empty = any
    allowed_clients: tuple[str, ...] = ()
    state_dir: str = "/var/lib/fastshare/node"
    run_dir: str = "/run/fastshare"
    device_backend: str = "nvml"
    sim_state: str = ""
    mps_control_binary: str = "/usr/bin/nvidia-cuda-mps-control"
    mps_timeout_s: float = 15.0
    share_ports: str = "50100-50999"
    mps_memory_oversubscription: float = 1.0
    metrics_listen: str = "127.0.0.1:9402"
    reconcile_interval_s: float = 60.0
    rpc_timeout_s: float = 60.0
    controller_address: str = ""  # registration hook: the controller helper dials this
    max_workers: int = 16

    @property
    def journal_path(self) -> Path:
        return Path(self.state_dir) / "journal.db"

    @property
    def mps_root(self) -> Path:
        return Path(self.run_dir) / "mps"

    @property
    def share_root(self) -> Path:
        return Path(self.run_dir) / "shares"

    @property
    def port_range(self) -> tuple[int, int]:
        low, _, high = self.share_ports.partition("-")
        return int(low), int(high)

    def validate(self, names: Mapping[str, str] | None = None) -> NodeConfig:
        """Check every value; `names` says how the user gave a key (default: the key itself)."""
        def n(key: str) -> str:
            return (names or {}).get(key, key)

        if not self.node_name or len(self.node_name) > 253:
            raise ConfigError(f"{n('node_name')} must be 1-253 characters")
        keys = ("listen", "readonly_listen", "metrics_listen", "controller_address")
        addresses = {key: check_hostport(n(key), getattr(self, key)) for key in keys if getattr(self, key)}
        if not (self.listen or self.unix_socket):
            raise ConfigError(f"{n('listen')} and {n('unix_socket')} are both empty: the agent would be "
                              "unreachable")
        tcp = [n(key) for key in ("listen", "readonly_listen") if getattr(self, key)]
        if tcp and not all((self.tls.cert, self.tls.key, self.tls.ca)):
            raise ConfigError(f"{' and '.join(tcp)} need{'s' if len(tcp) == 1 else ''} tls.cert, tls.key and "
                              "tls.ca (mTLS is required on TCP); create them with `fastshare certs issue "
                              "--role node`, or serve only the unix socket by leaving listen empty")
        listen, readonly = addresses.get("listen", ""), addresses.get("readonly_listen", "")
        if readonly and readonly == listen and not listen.endswith(":0"):
            raise ConfigError(f"{n('readonly_listen')} must differ from {n('listen')}")
        if self.unix_socket and self.unix_socket_group:
            try:
                grp.getgrnam(self.unix_socket_group)
            except KeyError:
                raise ConfigError(f"{n('unix_socket_group')}: no group {self.unix_socket_group!r} on this "
                                  "host; name an existing group, or '' for the agent's own") from None
        if not 0 <= self.unix_socket_mode <= 0o777:
            raise ConfigError(f"{n('unix_socket_mode')} must be an octal permission like 0o660, got "
                              f"{self.unix_socket_mode:o}")
        if self.unix_socket_mode & 0o007:
            # the socket gives full control of the GPUs through a root agent: never to every local user
            raise ConfigError(f"{n('unix_socket_mode')} 0o{self.unix_socket_mode:03o} lets others (every "
                              "local user) use the agent; allowed: owner and group bits only, e.g. 0o660 "
                              "with unix_socket_group naming the group that may use the CLI")
        if self.device_backend not in BACKENDS:
            raise ConfigError(f"{n('device_backend')} must be one of {', '.join(BACKENDS)}, got "
                              f"{self.device_backend!r}")
        if self.device_backend == "sim" and not self.sim_state:
            raise ConfigError(f"{n('device_backend')} is sim, which needs sim_state (path of the simulated "
                              "machine's state file, also --sim-state or FASTSHARE_SIM_STATE)")
        try:
            low, high = self.port_range
        except ValueError:
            raise ConfigError(f"{n('share_ports')} must look like 50100-50999, got "
                              f"{self.share_ports!r}") from None
        if not 1024 <= low <= high <= 65535:
            raise ConfigError(f"{n('share_ports')} must be a range within 1024-65535, got "
                              f"{self.share_ports!r}")
        if not 1.0 <= self.mps_memory_oversubscription <= 16.0:
            raise ConfigError(f"{n('mps_memory_oversubscription')} must be between 1.0 and 16.0, got "
                              f"{self.mps_memory_oversubscription}")
        for key, low_s, high_s in (("mps_timeout_s", 1, 600), ("reconcile_interval_s", 1, 86400),
                                   ("rpc_timeout_s", 1, 3600)):
            if not low_s <= getattr(self, key) <= high_s:
                raise ConfigError(f"{n(key)} must be between {low_s} and {high_s}, got {getattr(self, key)}")
        if not 2 <= self.max_workers <= 256:
            raise ConfigError(f"{n('max_workers')} must be between 2 and 256, got {self.max_workers}")
        return dataclasses.replace(self, **addresses) if addresses else self


_HOST_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"{_HOST_LABEL}(\.{_HOST_LABEL})*")


def check_hostport(key: str, value: str) -> str:
    """HOST:PORT with HOST an IPv4 address, a host name or an IPv6 address; returns it as gRPC
    reads it. The port is required, so the last ':' ends the host: an IPv6 address written
    without brackets ("fd00::5:7444", e.g. a Pod's IP from the downward API) is put in them,
    since gRPC would read it all as one address and use its default port."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise ConfigError(f"{key} must be HOST:PORT (port 0-65535; [::1]:PORT for IPv6), got {value!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed or ":" in host:
        try:
            ipaddress.IPv6Address(host[1:-1] if bracketed else host)
        except ValueError:
            raise ConfigError(f"{key}: {host!r} is not an IPv6 address (write [ADDRESS]:PORT)") from None
        return f"{host if bracketed else f'[{host}]'}:{int(port)}"
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        if len(host) > 253 or not _HOST_NAME.fullmatch(host):
            raise ConfigError(f"{key}: {host!r} is neither an IP address nor a host name") from None
    return f"{host}:{int(port)}"


_FIELDS = {f.name: f for f in dataclasses.fields(NodeConfig)}


def _coerce(key: str, value: Any, name: str) -> Any:
    """Turn YAML/flag/env values into the field's type, naming the value (`name`) on failure."""
    default = _FIELDS[key].default if _FIELDS[key].default is not dataclasses.MISSING else None
    try:
        if key == "tls":
            if not isinstance(value, dict) or set(value) - {"cert", "key", "ca"}:
                raise ConfigError(f"{name} must be a mapping with keys cert, key, ca")
            return TlsConfig(**{k: str(v) for k, v in value.items()})
        if key == "allowed_clients":
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, list | tuple):
                raise ConfigError(f"{name} must be a list of names")
            return tuple(str(v).strip() for v in items if str(v).strip())
        if key == "unix_socket_mode":
            return int(value, 8) if isinstance(value, str) else int(value)
        if isinstance(default, bool):
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
        return "" if value is None else str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: cannot use {value!r} ({exc})") from None


def load(path: Path | None, overrides: dict[str, Any] | None = None,
         names: Mapping[str, str] | None = None) -> NodeConfig:
    """File (if it exists; an explicitly given path must exist) + overrides (flags/env). `names`
    says how the user gives an override (e.g. "--listen (or FASTSHARE_NODE_LISTEN)"): a refusal
    names that, or the key and the file for a value from the file, what the user has to fix."""
    data: dict[str, Any] = {}
    given: dict[str, str] = {}   # key -> how the user gave its value
    if path is not None:
        path = Path(path)
        if path.exists():
            try:
                loaded = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: not valid YAML: {exc}") from None
            except (OSError, UnicodeDecodeError) as exc:   # unreadable, or not a text file
                raise ConfigError(f"{path}: cannot read it: {exc}") from None
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: must be a mapping of settings")
            data.update(loaded)
            given = {key: f"{key} (in {path})" for key in loaded}
        elif path != DEFAULT_PATH:
            raise ConfigError(f"config file {path} does not exist")
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key == "tls" and isinstance(value, dict) and isinstance(data.get("tls"), dict):
            value = {**data["tls"], **value}  # a flag replaces one path, not the whole block
        data[key] = value
        given[key] = (names or {}).get(key, key)
    unknown = sorted(set(data) - set(_FIELDS), key=str)   # YAML keys may be numbers
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(given[k] for k in unknown)}; "
                          f"known: {', '.join(sorted(_FIELDS))}")
    return NodeConfig(**{k: _coerce(k, v, given[k]) for k, v in data.items()}).validate(given)
