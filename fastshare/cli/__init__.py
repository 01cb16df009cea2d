"""The `fastshare` command line.

Each module in this package that does not start with an underscore contributes commands by
exposing a module-level ``COMMANDS`` list of click commands or groups; this keeps every
component's CLI next to nothing but itself and lets components be added without touching
this file.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import signal
import sys
from typing import Any, NoReturn

import click

from fastshare import __version__

# The commands that serve (their gRPC log is an operator's; a client's TLS failure shows there too).
SERVERS = (("controller", "serve"), ("node", "serve"), ("k8s", "controller"))


def _quiet_grpc(argv: list[str]) -> None:
    """gRPC's C core logs a failed TLS handshake to stderr itself ("Handshake failed with error
    SSL_ERROR_SSL ..."), before a client command prints its own error and what to check. It reads
    GRPC_VERBOSITY once, when grpc is imported: set to NONE for that import in client commands (a
    value the user set is left alone), then taken out again, so that the command `fastshare run`
    starts does not inherit it."""
    if "GRPC_VERBOSITY" in os.environ or "grpc" in sys.modules or tuple(argv[1:3]) in SERVERS:
        return
    os.environ["GRPC_VERBOSITY"] = "NONE"
    try:
        import grpc  # noqa: F401 - read now, with the variable set
    finally:
        del os.environ["GRPC_VERBOSITY"]


_quiet_grpc(sys.argv)


class _Cli(click.Group):
    """The top-level group: a reader that closed stdout (`fastshare status | head -1`) ends the
    command quietly, whatever was writing, for every command."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:   # --help and --version print here
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:
            _reader_gone()

    def invoke(self, ctx: click.Context) -> Any:
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()   # here, not at exit, where a broken pipe cannot be handled
            return result
        except BrokenPipeError:
            _reader_gone()


def _reader_gone() -> NoReturn:
    """Python's "Note on SIGPIPE": stdout on /dev/null, so that nothing more (not the final
    flush either) fails, and the status of a process SIGPIPE ended, as `yes | head -1` has:
    not 0, which would say all was written, nor 1, a failure of the command, and what
    `set -o pipefail` already expects from any writer cut short. (Not SIGPIPE's default action:
    a broken gRPC socket would then end the process too.)"""
    devnull = os.open(os.devnull, os.O_WRONLY)
    with contextlib.suppress(OSError, ValueError):   # no file descriptor behind a test runner's stdout
        os.dup2(devnull, sys.stdout.fileno())
    raise click.exceptions.Exit(128 + signal.SIGPIPE)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="fastshare")
def main() -> None:
    """Share NVIDIA GPUs safely: MPS fractions, on-demand MIG slices and whole GPUs."""


def _register_commands() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for command in getattr(module, "COMMANDS", []):
            main.add_command(command)


_register_commands()
