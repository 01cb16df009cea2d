"""Shared output helpers: human tables that fit the terminal, or JSON for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

import click
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text


def print_json(data: Any) -> None:
    """One JSON document on stdout, stable key order, for scripts."""
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A table sized to the terminal: a rule under the header and spaces between columns leave
    the width to the cells. Each column is as wide as its widest cell or whole header, two
    spaces apart, when the table fits that way; else as its widest cell or header word, one
    space apart (headers wrap at spaces); when neither fits, rich folds long cells instead of
    overflowing. The title is a line of its own, so a narrow table does not fold it."""
    cells = [["" if cell is None else str(cell) for cell in row] for row in rows]
    console = Console()

    def widths(header_parts: Callable[[str], list[str]]) -> list[int]:
        return [max(len(part) for part in [*header_parts(column), *(row[i] for row in cells if i < len(row)),
                                             "-"])
                for i, column in enumerate(columns)]

    layout: tuple[list[int] | list[None], int] = ([None] * len(columns), 0)
    for candidate, gap in ((widths(lambda header: [header]), 1), (widths(str.split), 0)):
        if sum(candidate) + (1 + gap) * (len(columns) - 1) <= console.width:
            layout = (candidate, gap)
            break
    chosen, gap = layout
    if title:
        console.print(Text(title, style="bold"))
    table = Table(header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, padding=0)
    for i, (column, width) in enumerate(zip(columns, chosen, strict=True)):
        last = i == len(columns) - 1
        table.add_column(column, overflow="fold", width=width if width is None or last else width + gap)
    for row in cells:
        table.add_row(*row)
    console.print(table)


def fail(message: str, hint: str | None = None) -> NoReturn:
    """Exit with a clear error (and what to do about it) instead of a traceback."""
    raise click.ClickException(message + (f"\nhint: {hint}" if hint else ""))
