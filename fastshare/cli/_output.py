"""Shared output helpers: human tables that fit the terminal, or JSON for scripts."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import click
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """Rich's own answer is exit 1; the CLI ends every command the same way when its reader
        went away (fastshare.cli)."""
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


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
    console = _Console()

    def widest(i: int, header_parts: list[str]) -> int:
        return max(len(part) for part in [*header_parts, *(row[i] for row in cells if i < len(row)), "-"])

    whole = [widest(i, [column]) for i, column in enumerate(columns)]
    words = [widest(i, column.split()) for i, column in enumerate(columns)]
    gaps = len(columns) - 1
    widths: list[int] | list[None]
    if sum(whole) + 2 * gaps <= console.width:
        widths, extra = whole, 1   # one space more than the table's own separator
    elif sum(words) + gaps <= console.width:
        widths, extra = words, 0
    else:
        widths, extra = [None] * len(columns), 0
    if title:
        console.print(Text(title, style="bold"))
    table = Table(header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, padding=0)
    for i, (column, width) in enumerate(zip(columns, widths, strict=True)):
        if width is not None and i < gaps:   # the last column needs no space after it
            width += extra
        table.add_column(column, overflow="fold", width=width)
    for row in cells:   # Text: a cell shows what it holds; "[/x]" in an owner is no markup
        table.add_row(*(Text(cell) for cell in row))
    console.print(table)


@contextlib.contextmanager
def progress_bar(label: str, *, timed: bool = False) -> Iterator[Callable[[int, int], None]]:
    """A bar on stderr (gone when done; nothing at all when stderr is not a terminal) for long
    work; yields ``update(done, total)``. Stdout stays for the result, tables or JSON.
    ``timed``: the work measures its own latency, so the bar is redrawn by ``update`` (between
    timed steps), not by a thread that would take the interpreter in the middle of one."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = _Console(stderr=True)
    if not console.is_terminal:   # a pipe or a file: rich would still leave an empty line there
        yield lambda done, total: None
        return
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                  console=console, auto_refresh=not timed) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, refresh=timed)

        yield update


def fail(message: str, hint: str | None = None) -> NoReturn:
    """Exit with a clear error (and what to do about it) instead of a traceback."""
    raise click.ClickException(message + (f"\nhint: {hint}" if hint else ""))
