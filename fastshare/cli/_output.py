"""Shared output helpers: human tables that fit the terminal, or JSON for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

import click
from rich import box
from rich.console import Console
from rich.table import Table


def print_json(data: Any) -> None:
    """One JSON document on stdout, stable key order, for scripts."""
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A table sized to the terminal: a rule under the header and one space between columns
    leave the width to the cells. Each column is as wide as its widest cell or header word
    when the table fits that way (headers wrap at spaces); otherwise rich folds long cells
    instead of overflowing."""
    cells = [["" if cell is None else str(cell) for cell in row] for row in rows]
    console = Console()
    widths = [max(len(word) for word in [*column.split(), *(row[i] for row in cells if i < len(row)), "-"])
              for i, column in enumerate(columns)]
    fixed = sum(widths) + len(columns) - 1 <= console.width
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                  show_edge=False, padding=0)
    for column, width in zip(columns, widths, strict=True):
        table.add_column(column, overflow="fold", width=width if fixed else None)
    for row in cells:
        table.add_row(*row)
    console.print(table)


def fail(message: str, hint: str | None = None) -> NoReturn:
    """Exit with a clear error (and what to do about it) instead of a traceback."""
    raise click.ClickException(message + (f"\nhint: {hint}" if hint else ""))
