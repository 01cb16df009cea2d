"""Shared output helpers: human tables that fit the terminal, or JSON for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table


def print_json(data: Any) -> None:
    """One JSON document on stdout, stable key order, for scripts."""
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A table sized to the terminal (rich folds long cells instead of overflowing)."""
    table = Table(title=title, title_justify="left", header_style="bold")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*("" if cell is None else str(cell) for cell in row))
    Console().print(table)


def fail(message: str, hint: str | None = None) -> NoReturn:
    """Exit with a clear error (and what to do about it) instead of a traceback."""
    raise click.ClickException(message + (f"\nhint: {hint}" if hint else ""))
