"""Parameter types shared by the commands."""

from __future__ import annotations

import math
from typing import Any

import click


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
