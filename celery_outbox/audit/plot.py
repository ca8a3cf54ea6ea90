"""The SVG parts of the audit report's plots: a titled frame, round ticks, labels that never overlap.

No transaction: pure rendering. Counts get ticks at 1, 2 or 5 × 10ⁿ from zero (four to six of
them), latencies a log scale with ticks at 1, 2 and 5 of a unit (ms, s, m, h, d), and times ticks at
round clock steps; a tick whose label would crowd its neighbour's is left out. Marker labels sit in
rows above the frame, clear of one another, of the ticks and of the bars. Text widths are estimated
from ``CHAR_W``, the widest a character of the plots' 12px text gets on average in sans-serif fonts.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from itertools import pairwise
from typing import Callable, Iterator

__all__ = ["CHAR_W", "GAP", "PLOT_H", "ROW_H", "W", "X0", "X1", "Frame", "count_ticks", "esc", "human",
           "latency_ticks", "log_domain", "place_labels", "text", "time_domain", "time_ticks", "width_of"]

W = 720  #: the width of a plot's viewBox
X0, X1 = 72, W - 40  #: the frame's left and right, inside the viewBox (room for a centred edge label)
PLOT_H = 190  #: the frame's height
BOTTOM = 56  #: below the frame: the tick labels, then the axis title
CHAR_W = 8.0
ROW_H = 16  #: a row of 12px text, with room between rows
GAP = 8  #: the least room between two labels side by side


def esc(value: object) -> str:
    """``value`` as text safe inside HTML and SVG."""
    return html.escape(str(value))


def human(seconds: float | None) -> str:
    """A duration the way a person writes it: 5ms, 1.2s, 3m, 2h, 4d; an em dash when unknown."""
    if seconds is None:
        return "—"
    if math.isinf(seconds):
        return "∞"
    units = ((86400, "d"), (3600, "h"), (60, "m"), (1, "s"))
    divisor, unit = next(((d, u) for d, u in units if abs(seconds) >= d), (0.001, "ms"))
    return f"{seconds / divisor:.1f}".rstrip("0").rstrip(".") + unit


def text(x: float, y: float, content: object, anchor: str = "middle", extra: str = "") -> str:
    """An SVG text element of escaped ``content``."""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{esc(content)}</text>'


def width_of(label: str) -> float:
    """The estimated width of a label in the plots' text."""
    return CHAR_W * len(label)


@dataclass(frozen=True)
class Frame:
    """A plot's frame in its viewBox: from ``top`` down ``PLOT_H``; ``rows`` of labels sit above it."""

    rows: int = 1

    @property
    def top(self) -> float:
        return 6 + ROW_H * self.rows

    @property
    def bottom(self) -> float:
        return self.top + PLOT_H

    @property
    def height(self) -> float:
        """The whole viewBox's height."""
        return self.bottom + BOTTOM

    def row_y(self, row: int) -> float:
        """The baseline of the ``row``-th row of labels above the frame (0 the nearest)."""
        return self.top - 5 - ROW_H * row

    def svg(self, fig_id: str, title: str, body: str, x_title: str, y_title: str) -> str:
        """The titled SVG: the frame, ``body`` and the axes' titles (x under the ticks, y beside them)."""
        middle = self.top + PLOT_H / 2
        return (f'<svg viewBox="0 0 {W} {self.height:.0f}" role="img" aria-labelledby="{fig_id}-title">'
                f'<title id="{fig_id}-title">{esc(title)}</title>'
                f'<rect class="frame" x="{X0}" y="{self.top:.1f}" width="{X1 - X0}" height="{PLOT_H}"/>{body}'
                + text((X0 + X1) / 2, self.bottom + 47, x_title, extra=' class="axis-title x"')
                + text(16, middle, y_title, extra=f' class="axis-title y" transform="rotate(-90 16 {middle:.1f})"')
                + "</svg>")

    def y_axis(self, ticks: list[int], label: Callable[[int], str]) -> str:
        """The count axis: a grid line and a label at each tick, zero at the frame's bottom."""
        top = ticks[-1] or 1
        parts = []
        for tick in ticks:
            y = self.bottom - PLOT_H * tick / top
            parts.append(f'<line class="grid" x1="{X0}" y1="{y:.1f}" x2="{X1}" y2="{y:.1f}"/>')
            parts.append(text(X0 - 6, y + 4, label(tick), "end", f' class="tick y" data-value="{tick}"'))
        return "".join(parts)

    def x_axis(self, ticks: list[tuple[float, float, str]]) -> str:
        """The x axis: a tick mark and a label at each (x, value, label)."""
        return "".join(f'<line class="grid" x1="{x:.1f}" y1="{self.bottom}" x2="{x:.1f}" y2="{self.bottom + 4}"/>'
                       + text(x, self.bottom + 22, label, extra=f' class="tick x" data-value="{value:.12g}"')
                       for x, value, label in ticks)


def _ladder() -> Iterator[int]:
    """1, 2, 5, 10, 20, 50, ..."""
    for exponent in range(20):
        for mantissa in (1, 2, 5):
            yield mantissa * 10 ** exponent


def count_ticks(peak: int) -> list[int]:
    """Ticks from 0 past ``peak`` (a count), 1, 2 or 5 × 10ⁿ apart: four to six of them."""
    step = next(step for step in _ladder() if math.ceil(peak / step) <= 5)
    return [i * step for i in range(max(math.ceil(peak / step), 3) + 1)]


# the units of latency ticks: (seconds, the least and the most a tick in it may be)
_UNITS = ((1.0, 0.001, 59.0), (60.0, 60.0, 3599.0), (3600.0, 3600.0, 86399.0), (86400.0, 86400.0, math.inf))


def _latency_values(low: float, high: float) -> list[tuple[float, int]]:
    """The round latencies from ``low`` to ``high`` with their rank: 0 for 1 × 10ⁿ of a unit, 1 for 5,
    2 for 2 (the first to go when ticks crowd)."""
    values = []
    for unit, least, most in _UNITS:
        for exponent in range(-3, 4):
            for mantissa, rank in ((1, 0), (2, 2), (5, 1)):
                value = mantissa * 10.0 ** exponent * unit
                if least <= value <= most and low * (1 - 1e-9) <= value <= high * (1 + 1e-9):
                    values.append((value, rank))
    return sorted(values)


def log_domain(low: float, high: float) -> tuple[float, float]:
    """The span of a log latency axis holding ``low`` to ``high`` (seconds, above zero): from a round
    value at or under ``low`` to one at or over ``high``, a tenfold span at least (longer to the right)."""
    below = [v for v, _ in _latency_values(0.001, low)] or [low]
    above = [v for v, _ in _latency_values(high, math.inf)][:1] or [high]
    start, end = min(below[-1], low), max(above[0], high)
    if end / start < 10:
        end = min([v for v, _ in _latency_values(start * 10, math.inf)] or [start * 10])
    return start, end


def _fits(ticks: list[tuple[float, str]]) -> bool:
    return all(b[0] - a[0] >= (width_of(a[1]) + width_of(b[1])) / 2 + GAP for a, b in pairwise(ticks))


def latency_ticks(start: float, end: float, x_of: Callable[[float], float]) -> list[tuple[float, float, str]]:
    """The ticks (x, value, label) of a log latency axis from ``start`` to ``end``: the powers of ten
    of each unit (every other one where they crowd), then each 5 and each 2 whose label fits between
    the ticks taken; nine at most."""
    values = _latency_values(start, end)
    ticks = [(x_of(v), v, human(v)) for v, rank in values if rank == 0]
    while len(ticks) > 2 and not _fits([(x, label) for x, _, label in ticks]):
        ticks = ticks[::2]
    for wanted in (1, 2):
        for value, rank in values:
            tick = (x_of(value), value, human(value))
            taken = sorted([*ticks, tick])
            if rank == wanted and len(ticks) < 9 and _fits([(x, label) for x, _, label in taken]):
                ticks = taken
    return ticks


_CLOCK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800,
                604800)


def time_ticks(start: datetime, end: datetime, x_of: Callable[[datetime], float],
               least: timedelta) -> list[tuple[float, float, str]]:
    """The ticks (x, POSIX seconds, label) of a time axis from ``start`` to ``end`` (aware): at
    multiples of the finest round clock step, ``least`` at least, whose labels fit, seven ticks at most."""
    span = (end - start).total_seconds()
    for step in (step for step in _CLOCK_STEPS if step >= least.total_seconds()):
        first = math.ceil(start.timestamp() / step) * step
        moments = [datetime.fromtimestamp(first + i * step, timezone.utc)
                   for i in range(int((end.timestamp() - first) // step) + 1)]
        shape = "%H:%M:%S" if step < 60 else "%Y-%m-%d" if step >= 86400 else \
            "%m-%d %H:%M" if span > 86400 else "%H:%M"
        ticks = [(x_of(m), m.timestamp(), m.strftime(shape)) for m in moments]
        if len(ticks) <= 7 and _fits([(x, label) for x, _, label in ticks]):
            return ticks
    return [(x_of(start), start.timestamp(), start.strftime("%Y-%m-%d"))]


def time_domain(moments: list[datetime], unit: timedelta) -> tuple[datetime, datetime]:
    """The span of a time axis over ``moments``: theirs, or four ``unit`` around a single one."""
    if moments[-1] > moments[0]:
        return moments[0], moments[-1]
    return moments[0] - 2 * unit, moments[0] + 2 * unit


def place_labels(labels: list[tuple[float, str]]) -> list[tuple[int, float, str]]:
    """Rows for labels centred on their x (kept inside the frame): each in the nearest row where it
    overlaps no label placed before it; returns (row, left, text) for each."""
    placed: list[tuple[int, float, float, str]] = []  # row, left, right, text
    for x, label in labels:
        width = width_of(label)
        left = min(max(x - width / 2, X0), X1 - width)
        row = next(r for r in range(len(labels) + 1) if not any(
            taken == r and left < right + GAP and other_left < left + width + GAP
            for taken, other_left, right, _ in placed))
        placed.append((row, left, left + width, label))
    return [(row, left, label) for row, left, _, label in placed]
