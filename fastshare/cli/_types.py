"""Parameter types shared by the commands."""

from __future__ import annotations

import math
from typing import Any

import click

LOG_LEVELS = ("debug", "info", "warning", "error")   # the --log-level choices of the services


class Number(click.FloatRange):
    """A finite number within a range. click's FloatRange lets NaN through (it compares false
    with both ends) and infinity through an open end; either would run a simulation of nothing
    or a loop that never waits."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            low = "" if self.min is None else f"{self.min:g}<="
            high = "" if self.max is None else f"<={self.max:g}"
            self.fail(f"{value!r} is not a finite number in the range {low}x{high}.", param, ctx)
        return number


class Seeds(click.ParamType):
    """Seeds written ``42-51``, ``42,43`` or both (``1-3,7``): each range low-high, at most
    ``MOST`` in all (a mistyped range would otherwise run for days, or nothing at all)."""

    name = "seeds"
    MOST = 1000

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        if isinstance(value, list):
            return value
        out: list[int] = []
        for part in str(value).split(","):
            first, dash, last = part.partition("-")
            try:
                low = int(first)
                high = int(last) if dash else low   # "42-" is a range cut short, not seed 42
            except ValueError:
                self.fail(f"expected seeds like 42-51 or 42,43, got {value!r}", param, ctx)
            if high < low:
                self.fail(f"range {part!r} is empty: write it low-high", param, ctx)
            if len(out) + high - low + 1 > self.MOST:
                self.fail(f"at most {self.MOST} seeds, got more in {value!r}", param, ctx)
            out.extend(range(low, high + 1))
        return out

    @staticmethod
    def describe(seeds: list[int]) -> str:
        """``1-5`` for a run of consecutive seeds, else the list."""
        if seeds == list(range(seeds[0], seeds[-1] + 1)):
            return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])
        return ",".join(map(str, seeds))
