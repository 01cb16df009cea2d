"""Client side of the controller API, shared by `fastshare run`, `fastshare status` and scripts.

Connection settings come from flags or the environment (FASTSHARE_CONTROLLER,
FASTSHARE_TLS_DIR, FASTSHARE_TLS_NAME, FASTSHARE_TOKEN_FILE, FASTSHARE_CONTROLLER_NAME):
TLS is always on; a client certificate is presented when DIR/NAME.crt exists, a bearer token
when a token file is given.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fastshare.security.certs import reissue_command
from fastshare.security.tls import secure_channel
from fastshare.v1 import controller_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "127.0.0.1:7070"
DEFAULT_SERVER_NAME = "controller"
# The largest reply taken (gRPC's default is 4 MiB): a cluster's status is about 660 bytes a node
# of 8 GPUs and 300 an allocation, so 4 MiB refused the status of some 6,300 such nodes with no
# allocation. 256 MiB holds 10,000 nodes with 800,000 allocations.
MAX_REPLY_BYTES = 256 * 1024 * 1024


class ClientConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ClientConfig:
    address: str = DEFAULT_ADDRESS
    tls_dir: Path | None = None
    tls_name: str = "client"
    token_file: Path | None = None
    server_name: str = DEFAULT_SERVER_NAME
    timeout: float = 30.0

    def channel(self) -> grpc.Channel:
        from fastshare.node.config import ConfigError, check_hostport

        try:   # gRPC dials a port over 65535 modulo 65536, and an address without one on its default
            address = check_hostport("--controller (or FASTSHARE_CONTROLLER)", self.address)
        except ConfigError as exc:
            raise ClientConfigError(str(exc)) from None
        if self.tls_dir is None:
            raise ClientConfigError("tls-dir: give the directory with ca.crt (and NAME.crt/NAME.key for a "
                                    "client certificate), e.g. --tls-dir or FASTSHARE_TLS_DIR")
        ca = Path(self.tls_dir) / "ca.crt"
        if not ca.is_file():
            raise ClientConfigError(f"tls-dir: {ca} does not exist")
        cert, key = Path(self.tls_dir) / f"{self.tls_name}.crt", Path(self.tls_dir) / f"{self.tls_name}.key"
        have_cert = cert.is_file() and key.is_file()
        if not have_cert and self.token_file is None:
            raise ClientConfigError(f"tls-name: no client certificate {cert} and no token file; give one "
                                    "of them (--tls-name or --token-file)")
        _check_files(ca, cert, key, have_cert)
        return secure_channel(address, ca, cert if have_cert else None, key if have_cert else None,
                              server_name=self.server_name,
                              options=[("grpc.max_receive_message_length", MAX_REPLY_BYTES)])

    def metadata(self) -> tuple[tuple[str, str], ...]:
        if self.token_file is None:
            return ()
        try:
            mode = Path(self.token_file).stat().st_mode & 0o777
            if mode & 0o077:  # as the controller does: a token is a password, for its owner only
                raise ClientConfigError(f"token-file: {self.token_file} has mode {mode:04o}; allowed: 0600 "
                                        f"or 0400 (owner only): `chmod 600 {self.token_file}`")
            words = Path(self.token_file).read_text().split()
        except OSError as exc:
            raise ClientConfigError(f"token-file: cannot read a token from {self.token_file}: {exc}") from exc
        except UnicodeDecodeError:
            raise ClientConfigError(f"token-file: {self.token_file} is not a text file (a token is one line "
                                    "of text)") from None
        if not words:
            raise ClientConfigError(f"token-file: {self.token_file} is empty; put the bearer token in it")
        return (("authorization", f"Bearer {words[0]}"),)


def _check_files(ca: Path, cert: Path, key: Path, have_cert: bool) -> None:
    """gRPC only fails at the handshake on a damaged file, reporting the controller UNAVAILABLE
    ('Failed to create security handshaker'); name the file instead."""
    now = dt.datetime.now(dt.UTC)
    try:
        try:
            authorities = x509.load_pem_x509_certificates(ca.read_bytes())
        except ValueError as exc:
            raise ClientConfigError(f"tls-dir: {ca} is not a PEM certificate ({exc})") from None
        if all(c.not_valid_after_utc <= now for c in authorities):
            ends = max(c.not_valid_after_utc for c in authorities).isoformat()
            raise ClientConfigError(f"tls-dir: {ca} expired on {ends}: no certificate verifies against it; "
                                    "put the cluster's current ca.crt there")
        if not have_cert:
            return
        try:
            certificate = x509.load_pem_x509_certificate(cert.read_bytes())
        except ValueError as exc:
            raise ClientConfigError(f"tls-name: {cert} is not a PEM certificate ({exc})") from None
        try:
            private_key = serialization.load_pem_private_key(key.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:   # TypeError: encrypted
            raise ClientConfigError(f"tls-name: {key} is not a PEM private key without a password "
                                    f"({exc})") from None
    except OSError as exc:
        raise ClientConfigError(f"tls-dir: cannot read {exc.filename}: {exc.strerror}") from None
    if certificate.not_valid_after_utc <= now:
        raise ClientConfigError(f"tls-name: {cert} expired on {certificate.not_valid_after_utc.isoformat()}; "
                                f"issue it again (`{reissue_command('client', cert.stem)}`)")
    if certificate.not_valid_before_utc > now:
        raise ClientConfigError(f"tls-name: {cert} is not valid before "
                                f"{certificate.not_valid_before_utc.isoformat()} (now {now.isoformat()}); "
                                "check this host's clock")
    if certificate.public_key() != private_key.public_key():
        raise ClientConfigError(f"tls-name: {key} is not the key of {cert}; issue the pair again "
                                f"(`{reissue_command('client', cert.stem)}`)")


def unreachable_hint(exc: grpc.RpcError, config: ClientConfig) -> str | None:
    """What to check when the controller could not be reached or trusted: gRPC reports all of it
    as UNAVAILABLE, with the TLS library's words at the end of its details. Also a certificate
    client on the port for bearer tokens, which never asks for its certificate."""
    details = exc.details() or ""
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        cert = Path(config.tls_dir or ".") / f"{config.tls_name}.crt"
        if config.token_file is None and cert.is_file() and "requires a client certificate" in details:
            return (f"{config.address} did not ask for your client certificate: it is the controller's port "
                    "for bearer tokens (--token-listen); give its main port (--listen) instead, or a token "
                    "with --token-file")
        return None
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    ca = Path(config.tls_dir or ".") / "ca.crt"
    if "Connection refused" in details:
        return (f"nothing listens at {config.address}: is the controller running there? (the address is "
                "--controller or FASTSHARE_CONTROLLER)")
    if "Hostname Verification" in details:
        return (f"the controller's certificate does not name {config.server_name!r}: give a name it lists "
                "with --server-name or FASTSHARE_CONTROLLER_NAME (`fastshare certs show CERT` prints them)")
    if "CERTIFICATE_VERIFY_FAILED" in details and "certificate has expired" in details:
        return ("the controller's certificate has expired: issue it again on the controller's host "
                f"(`{reissue_command('controller', 'controller')}`, or the name of its certificate); the "
                "controller re-reads it without a restart")
    if "CERTIFICATE_VERIFY_FAILED" in details and "certificate is not yet valid" in details:
        return ("the controller's certificate is not valid yet: check the clocks of this host and of the "
                "controller's")
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (f"the controller's certificate is not signed by a CA in {ca}: put the cluster CA's ca.crt "
                "there (the one `fastshare certs issue` wrote beside your certificate)")
    if "Socket closed" in details and config.token_file is None:
        return ("the controller closed the TLS handshake, as it does for a client certificate its cluster "
                f"CA did not sign: issue yours from that CA (`{reissue_command('client', config.tls_name)}`)")
    if "Socket closed" in details:
        return ("the controller closed the TLS handshake: this port asks for a client certificate of the "
                "cluster CA; a bearer token (--token-file) goes to the controller's --token-listen port")
    return None


class Client:
    """The Controller stub with deadlines and credentials on every call."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._metadata = config.metadata()
        self._channel = config.channel()
        self.stub = pb_grpc.ControllerStub(self._channel)

    def call(self, method: str, request: object, timeout: float | None = None) -> object:
        return getattr(self.stub, method)(request, timeout=timeout or self.config.timeout,
                                          metadata=self._metadata)

    def stream(self, method: str, request: object, timeout: float | None = None):
        return getattr(self.stub, method)(request, timeout=timeout, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


MAX_BYTES = 1 << 50  # 1 PiB: far above any GPU's memory, far below what the request's uint64 holds


def parse_bytes(text: str) -> int:
    """'8GiB', '512MiB', '1.5G', '1073741824' -> bytes (at most ``MAX_BYTES``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; use e.g. 8GiB, 512MiB or a number of bytes")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size > MAX_BYTES:
        raise ValueError(f"{text!r} is over 1 PiB; no GPU has that much memory")
    return size



def client_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adds --controller/--tls-dir/--tls-name/--token-file/--server-name; passes `client_config`."""

    @click.option("--controller", "address", envvar="FASTSHARE_CONTROLLER", default="127.0.0.1:7070",
                  show_default=True, help="Controller host:port [env FASTSHARE_CONTROLLER].")
    @click.option("--tls-dir", envvar="FASTSHARE_TLS_DIR", type=click.Path(path_type=Path, file_okay=False),
                  help="Directory with ca.crt and NAME.crt/NAME.key [env FASTSHARE_TLS_DIR].")
    @click.option("--tls-name", envvar="FASTSHARE_TLS_NAME", default="client", show_default=True,
                  help="Client certificate name in --tls-dir [env FASTSHARE_TLS_NAME].")
    @click.option("--token-file", envvar="FASTSHARE_TOKEN_FILE",
                  type=click.Path(path_type=Path, dir_okay=False),
                  help="Bearer token instead of a client certificate [env FASTSHARE_TOKEN_FILE].")
    @click.option("--server-name", envvar="FASTSHARE_CONTROLLER_NAME", default="controller",
                  show_default=True,
                  help="Name in the controller's certificate [env FASTSHARE_CONTROLLER_NAME].")
    @functools.wraps(fn)
    def wrapper(*args: Any, address: str, tls_dir: Path | None, tls_name: str, token_file: Path | None,
                server_name: str, **kwargs: Any) -> Any:
        config = ClientConfig(address=address, tls_dir=tls_dir, tls_name=tls_name, token_file=token_file,
                              server_name=server_name)
        return fn(*args, client_config=config, **kwargs)

    return wrapper
