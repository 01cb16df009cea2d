"""`fastshare controller serve`: the standalone controller (SQLite state, gRPC API)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import click
import yaml

from fastshare.cli._output import fail
from fastshare.cli._types import LOG_LEVELS

KEYS = ("state_dir", "listen", "token_listen", "tls_dir", "tls_name", "client_auth", "token_file",
        "heartbeat_interval", "heartbeat_timeout", "reconcile_interval", "agent_deadline",
        "mps_oversubscription", "finished_retention", "log_level")
# the numeric settings: lowest and highest allowed (seconds, except the memory factor; agents
# are told the heartbeat interval in whole seconds, and their own RPC timeouts are 1-3600 s)
LIMITS = {"heartbeat_interval": (1.0, 3600.0), "heartbeat_timeout": (2.0, 86400.0),
          "reconcile_interval": (1.0, 86400.0), "agent_deadline": (1.0, 3600.0),
          "mps_oversubscription": (1.0, 16.0), "finished_retention": (3600.0, 3650 * 86400.0)}
CHOICES = {"client_auth": ("cert", "token", "any"), "log_level": LOG_LEVELS}


def _number(values: dict[str, Any], key: str, default: float) -> float:
    """A numeric setting from a flag or the config file, refused unless it is a finite number
    in its range (a NaN deadline or a negative interval would only fail later, obscurely)."""
    raw = values.get(key, default)
    low, high = LIMITS[key]
    try:
        number = math.nan if isinstance(raw, bool) else float(raw)
    except (TypeError, ValueError):
        number = math.nan
    if not low <= number <= high:  # NaN fails too
        fail(f"--{key.replace('_', '-')} (or {key} in --config) must be a number in {low:g}..{high:g}, "
             f"got {raw!r}")
    return number


def _load(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:   # UnicodeDecodeError: not a text file
        fail(f"--config {path}: {exc}")
    if not isinstance(data, dict):
        fail(f"--config {path}: must be a mapping of settings")
    unknown = sorted(str(key) for key in set(data) - set(KEYS))
    if unknown:
        fail(f"--config {path}: unknown setting(s) {', '.join(unknown)}", f"known: {', '.join(KEYS)}")
    for key, value in data.items():
        if key in LIMITS:
            continue  # numbers: _number checks them, with the flags' values
        if not isinstance(value, str):
            fail(f"--config {path}: {key} must be a string, got {value!r}")
        if key in CHOICES and value not in CHOICES[key]:
            fail(f"--config {path}: {key} must be one of {', '.join(CHOICES[key])}, got {value!r}")
    return data


@click.group("controller")
def controller() -> None:
    """The standalone controller: places requests across node agents."""


@controller.command("serve")
@click.option("--config", "config_path", type=click.Path(path_type=Path, dir_okay=False),
              help="YAML file with any of the settings below (flags win).")
@click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Directory for the SQLite state and the single-instance lock.")
@click.option("--listen", help="host:port of the mTLS port (agents and certificate clients) "
                               "[127.0.0.1:7070].")
@click.option("--token-listen", help="Extra host:port with server-only TLS for bearer-token clients.")
@click.option("--tls-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Directory with ca.crt and NAME.crt/NAME.key (from `fastshare certs issue`).")
@click.option("--tls-name", help="Certificate name in --tls-dir [controller].")
@click.option("--client-auth", type=click.Choice(CHOICES["client_auth"]),
              help="What API clients must present [cert].")
@click.option("--token-file", type=click.Path(path_type=Path, dir_okay=False),
              help="Accepted bearer tokens, one per line.")
@click.option("--heartbeat-interval", type=float,
              help="Seconds between agent heartbeats [2]; agents are told longer ones past 1,000 heartbeats "
                   "a second (10 s at 10,000 nodes), and the timeout stretches as much.")
@click.option("--heartbeat-timeout", type=float, help="Silence after which a node is unavailable [8].")
@click.option("--reconcile-interval", type=float, help="Seconds between reconciler passes [5].")
@click.option("--agent-deadline", type=float, help="Deadline of every RPC to an agent, seconds [10].")
@click.option("--mps-oversubscription", type=float, help="Memory factor MPS shares may promise [1.0].")
@click.option("--finished-retention", type=float,
              help="Seconds released and failed allocations are kept (Get, status --all, idempotency "
                   "keys) before they are forgotten [604800: 7 days].")
@click.option("--log-level", type=click.Choice(CHOICES["log_level"], case_sensitive=False),
              help="Log verbosity [info].")
def serve(config_path: Path | None, **flags: Any) -> None:
    """Run the controller until SIGTERM/SIGINT. A second one on the same state dir refuses to start."""
    from fastshare.controller.core import Settings
    from fastshare.controller.server import Config, ControllerServer
    from fastshare.controller.store import StoreError
    from fastshare.node.config import ConfigError, check_hostport
    from fastshare.security.certs import CertError, validate_name
    from fastshare.security.tls import TlsPaths
    from fastshare.server_runtime import settle_startup
    from fastshare.state_lock import LockedError

    values = {**_load(config_path), **{k: v for k, v in flags.items() if v is not None}}
    logging.basicConfig(level=str(values.get("log_level", "info")).upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        validate_name("--tls-name (or tls_name in --config)", values.get("tls_name", "controller"))
    except CertError as exc:
        fail(str(exc))
    for key in ("listen", "token_listen"):   # gRPC binds a port over 65535 to some other port
        if values.get(key):
            try:
                values[key] = check_hostport(f"--{key.replace('_', '-')} (or {key} in --config)", values[key])
            except ConfigError as exc:
                fail(str(exc))
    if "state_dir" not in values:
        fail("--state-dir is required (or state_dir in --config)")
    if "tls_dir" not in values:
        fail("--tls-dir is required (or tls_dir in --config)",
             "create certificates with `fastshare certs init` and "
             "`fastshare certs issue --role controller --name controller`")
    tokens: tuple[str, ...] = ()
    if values.get("token_file"):
        try:
            mode = Path(values["token_file"]).stat().st_mode & 0o777
            if mode & 0o077:  # the tokens are passwords: refuse a file others can read or change
                fail(f"--token-file: {values['token_file']} has mode {mode:04o}; allowed: 0600 or 0400 "
                     "(owner only)", f"chmod 600 {values['token_file']}")
            tokens = tuple(line.strip() for line in Path(values["token_file"]).read_text().splitlines()
                           if line.strip() and not line.startswith("#"))
        except OSError as exc:
            fail(f"--token-file: {exc}")
        except UnicodeDecodeError:
            fail(f"--token-file: {values['token_file']} is not a text file (one token a line)")
    hb = _number(values, "heartbeat_interval", 2.0)
    settings = Settings(heartbeat_interval=hb, heartbeat_timeout=_number(values, "heartbeat_timeout", 4 * hb),
                        reconcile_interval=_number(values, "reconcile_interval", 5.0),
                        finished_retention=_number(values, "finished_retention", 7 * 86400.0))
    if settings.heartbeat_timeout <= settings.heartbeat_interval:
        fail(f"--heartbeat-timeout ({settings.heartbeat_timeout}) must be greater than --heartbeat-interval "
             f"({settings.heartbeat_interval})")
    config = Config(
        state_dir=Path(values["state_dir"]),
        tls=TlsPaths.in_dir(Path(values["tls_dir"]), values.get("tls_name", "controller")),
        listen=values.get("listen", "127.0.0.1:7070"), token_listen=values.get("token_listen", ""),
        client_auth=values.get("client_auth", "cert"), tokens=tokens, settings=settings,
        agent_deadline=_number(values, "agent_deadline", 10.0),
        mps_oversubscription=_number(values, "mps_oversubscription", 1.0))
    server = ControllerServer(config)
    settle_startup()   # a server from here on: its start loads the cluster with the collector paused
    try:
        server.start()
    except LockedError as exc:
        fail(str(exc))
    except (ValueError, OSError, RuntimeError, StoreError) as exc:   # StoreError: e.g. a newer schema
        fail(f"cannot start the controller: {exc}")
    tokens_on = (f", bearer tokens on {config.token_listen} (port {server.token_port})"
                 if config.token_listen else "")
    click.echo(f"controller listening on {config.listen} (port {server.port}){tokens_on}, state in "
               f"{config.state_dir}", err=True)
    server.serve_forever()


@controller.command("backup")
@click.option("--state", "state", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="The controller's state file, STATE_DIR/state.db (the controller may be running).")
@click.option("--out", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="Where to write the copy; must not exist yet.")
def backup(state: Path, out: Path) -> None:
    """Copy the controller's state consistently, also while it runs (SQLite's online backup; copying
    the file alone can tear it), check the copy's integrity, and flush it to disk."""
    import os
    import sqlite3
    from urllib.parse import quote

    if not state.is_file():
        fail(f"--state {state}: no such file", "the controller keeps its state in STATE_DIR/state.db")
    if out.exists():
        fail(f"--out {out} exists already; give a new file name (a backup is never overwritten)")
    # Written as OUT.partial and linked to OUT only once checked and on disk: a backup killed midway
    # (a cron job's timeout, Ctrl-C) leaves no file at OUT that looks like a backup.
    partial = out.with_name(out.name + ".partial")
    try:   # created here, owner only (it holds every allocation's environment)
        os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        fail(f"{partial} exists: an interrupted backup left it (or one runs now); remove it and retry")
    except OSError as exc:
        fail(f"--out {out}: cannot create {partial} ({exc})")
    try:
        # quoted: '#', '?' and '%' in the path would otherwise open (and create) another file
        source = sqlite3.connect(f"file:{quote(str(state.absolute()))}?mode=ro", uri=True, timeout=30)
        copy = sqlite3.connect(partial, isolation_level=None)
        try:
            if source.execute("SELECT 1 FROM sqlite_master WHERE name = 'allocations'").fetchone() is None:
                raise sqlite3.DatabaseError(f"{state} is not a fastshare controller state (no allocations "
                                            "table)")
            source.backup(copy)   # one step: a consistent snapshot; the controller keeps writing meanwhile
            copy.execute("PRAGMA journal_mode=DELETE")   # one self-contained file, no -wal beside it
            problems = [row[0] for row in copy.execute("PRAGMA integrity_check")]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError(f"the copy fails its integrity check: {'; '.join(problems[:3])}")
            allocations, nodes = (copy.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                                  for table in ("allocations", "nodes"))
        finally:
            source.close()
            copy.close()
        with open(partial, "rb") as written:
            os.fsync(written.fileno())
        os.link(partial, out)   # never replaces a file made meanwhile (FileExistsError)
        partial.unlink()
        directory = os.open(out.parent if str(out.parent) else ".", os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except BaseException as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, FileExistsError):
            fail(f"--out {out} exists already (made while the backup ran); nothing was written there")
        if isinstance(exc, (OSError, sqlite3.Error)):
            fail(f"backup of {state} failed, nothing was written to {out}: {exc}")
        raise
    click.echo(f"backup of {state} written to {out}: {allocations} allocation(s), {nodes} node(s); integrity "
               "check ok", err=True)


COMMANDS = [controller]
