"""Running estimates of what the request mix asks, with their uncertainty.

The default policy changes its behaviour when the mix asks more of something than the
cluster has (CPU, or the GPUs of one model). A few hundred requests can suggest a shortage
that is not there, so it acts on an estimate less ``SURE`` of its standard errors, and
fully only from 10 % over on (``excess``).
"""

from __future__ import annotations

import math

SURE = 2.0        # standard errors by which demand must exceed supply before the policy acts


class RunningRatio:
    """Running estimate of ``sum(x) / sum(y)`` over requests, with its standard error (the
    delta method for a ratio of means)."""

    def __init__(self, n: int = 0, sx: float = 0.0, sy: float = 0.0, sxx: float = 0.0,
                 syy: float = 0.0, sxy: float = 0.0) -> None:
        """Empty, or from the sums of ``n`` requests already seen."""
        self.n = n
        self.sx, self.sy, self.sxx, self.syy, self.sxy = sx, sy, sxx, syy, sxy

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.syy += y * y
        self.sxy += x * y

    def ratio(self) -> float:
        return self.sx / self.sy if self.sy > 0 else 0.0

    def lower(self, sure: float = SURE) -> float:
        """The ratio less ``sure`` standard errors (0 before two requests with some ``y``)."""
        if self.n < 2 or self.sy <= 0:
            return 0.0
        r = self.ratio()
        spread = max(0.0, self.sxx - 2 * r * self.sxy + r * r * self.syy) / (self.n - 1)
        return r - sure * math.sqrt(spread / self.n) / (self.sy / self.n)


def excess(pressure: float) -> float:
    """0 while demand / supply is at most 1, rising to 1 at 10 % over."""
    return min(1.0, max(0.0, (pressure - 1.0) / 0.1))
