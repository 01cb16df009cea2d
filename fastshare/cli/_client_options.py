"""Connection options shared by the commands that talk to the controller (run, status)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click


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
        from fastshare.controller.client import ClientConfig

        config = ClientConfig(address=address, tls_dir=tls_dir, tls_name=tls_name, token_file=token_file,
                              server_name=server_name)
        return fn(*args, client_config=config, **kwargs)

    return wrapper
