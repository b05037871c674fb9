"""What every report writer shares: percentiles, table cells, the matplotlib backend.

The percentile itself is `worker.scheduling.metrics.percentile` (linear interpolation between order
statistics, numpy's default; NaN for no data): the simulator's metrics, the Locust report, the
quota and tier reports and the gateway benchmark all read it from there.
"""

from __future__ import annotations

import math

from worker.scheduling.metrics import percentile as _percentile

MISSING = "–"


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) of `xs` by linear interpolation; None for no data (a JSON
    summary writes it as null)."""
    return _percentile(xs, q) if xs else None


def cell(x, digits: int = 2, thousands: bool = False) -> str:
    """A Markdown table cell: `MISSING` for None or NaN, a float with `digits` decimals (and thousands
    separators when asked), anything else as `str`."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return MISSING
    if thousands and isinstance(x, (int, float)) and not isinstance(x, bool):
        return f"{x:,.{digits}f}"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def pyplot():
    """`matplotlib.pyplot` on the non-interactive Agg backend (reports write PNG files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
