"""The `fastshare` command line.

Each module in this package that does not start with an underscore contributes commands by
exposing a module-level ``COMMANDS`` list of click commands or groups; this keeps every
component's CLI next to nothing but itself and lets components be added without touching
this file.
"""

from __future__ import annotations

import importlib
import pkgutil

import click

from fastshare import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
