"""Small inline SVG line charts for the status page: a few series over the last minutes,
drawn as plain SVG markup (no script, no external asset), each with a text legend so a
terminal browser, which skips the SVG, still shows the numbers.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH, HEIGHT = 320, 110
# The plotting area inside the SVG; the rest holds the axis labels.
LEFT, RIGHT, TOP, BOTTOM = 46, 312, 6, 88
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")

Point = tuple[float, float | None]  # (seconds relative to now, <= 0; value, None: no data)


@dataclass
class Line:
    label: str
    points: list[Point]

    def values(self) -> list[float]:
        return [v for _, v in self.points if v is not None]


@dataclass
class Chart:
    title: str
    unit: str  # "/s", "ratio", "seconds" or "" (a count)
    span: float  # seconds shown, ending now
    lines: list[Line]


def fmt(unit: str, value: float | None) -> str:
    if value is None:
        return "-"
    if unit == "ratio":
        return f"{value * 100:.1f} %"
    if unit == "seconds":
        return f"{value:.1f} s" if value >= 10 else f"{value * 1000:.0f} ms"
    if unit == "/s":
        return f"{value:.1f}/s"
    return f"{value:.0f}"


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value``: a round axis top."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * power >= value * (1 - 1e-9):
            return step * power
    return 10 * power


def svg(chart: Chart) -> str:
    """The chart as one ``<svg>`` element; well-formed XML."""
    e = html.escape
    top = nice_ceiling(max((v for line in chart.lines for v in line.values()), default=0.0))
    if chart.unit == "ratio":
        top = min(top, 1.0)

    def xy(t: float, v: float) -> str:
        x = RIGHT + (RIGHT - LEFT) * max(-1.0, min(0.0, t / chart.span))
        y = BOTTOM - (BOTTOM - TOP) * min(v, top) / top
        return f"{x:.1f},{y:.1f}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" font-family="monospace" font-size="10">',
           f"<title>{e(chart.title)}</title>",
           "<desc>" + e("; ".join(f"{line.label}: " + ", ".join(fmt(chart.unit, v)
                                                                    for _, v in line.points)
                                  for line in chart.lines)) + "</desc>",
           f'<rect x="{LEFT}" y="{TOP}" width="{RIGHT - LEFT}" height="{BOTTOM - TOP}" '
           'fill="#fafafa" stroke="#bbb"/>',
           f'<text x="{LEFT - 3}" y="{TOP + 8}" text-anchor="end">{e(fmt(chart.unit, top))}'
           "</text>",
           f'<text x="{LEFT - 3}" y="{BOTTOM}" text-anchor="end">0</text>',
           f'<text x="{LEFT}" y="{BOTTOM + 12}">-{chart.span / 60:.0f} min</text>',
           f'<text x="{RIGHT}" y="{BOTTOM + 12}" text-anchor="end">now</text>']
    for i, line in enumerate(chart.lines):
        color = PALETTE[i % len(PALETTE)]
        for run in _runs(line.points):
            if len(run) == 1:
                x, y = xy(*run[0]).split(",")
                out.append(f'<circle cx="{x}" cy="{y}" r="2" fill="{color}"/>')
            else:
                points = " ".join(xy(t, v) for t, v in run)
                out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                           f'points="{points}"/>')
    out.append("</svg>")
    return "".join(out)


def legend(chart: Chart) -> str:
    """One HTML line per series: its colour, name, latest and highest value."""
    items = []
    for i, line in enumerate(chart.lines):
        values = line.values()
        latest = values[-1] if values else None
        items.append(f'<span style="color:{PALETTE[i % len(PALETTE)]}">&#9632;</span> '
                     f"{html.escape(line.label)}: {fmt(chart.unit, latest)} now, "
                     f"{fmt(chart.unit, max(values) if values else None)} max")
    return "<br>".join(items) or "no data"


def _runs(points: Sequence[Point]) -> list[list[tuple[float, float]]]:
    """Consecutive points with values; a None breaks the line."""
    runs: list[list[tuple[float, float]]] = [[]]
    for t, v in points:
        if v is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((t, v))
    return [run for run in runs if run]
