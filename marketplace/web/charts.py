"""Chart geometry for the dashboards' inline SVG: pure functions from numbers to shapes.

The templates (``web/partials/bar_chart.html``, ``web/partials/coverage_map.html``) draw what
these return; every chart also comes with a table of its numbers, for screen readers and for
anyone who wants the exact values. Coordinates are in the SVG's viewBox units: a chart is drawn
at its width where there is room and scales down to a narrower box (a phone), whole. Widths are
kept modest (640 for the wide charts) so that its text stays legible when scaled down.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

# Room around a bar chart's plot: value labels on the left (as wide as the widest of them),
# category labels below.
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 12, 40
MAX_LABELS = 12  # category labels drawn at most; the others are in the table
LABEL_CHARS = 14  # a category label is cut to this many characters (the template's truncatechars)
# The largest size the stylesheet gives a chart's text (a phone's, where the chart is scaled down:
# svg .tick), in viewBox units, and the width of one of its characters, generously (digits, "$",
# letters of a day's or a model's name are 0.5-0.6 em): margins sized with it hold every label.
FONT_PX = 16
CHAR_PX = 0.62 * FONT_PX
TICK_GAP = 6  # between a value label's end and the plot


@dataclass(frozen=True)
class Tick:
    position: float  # y for a value axis, x for a layer axis
    text: str


@dataclass(frozen=True)
class Bar:
    label: str
    text: str  # the value as the page shows it
    x: float
    y: float
    width: float
    height: float
    show_label: bool
    label_x: float


@dataclass(frozen=True)
class BarChart:
    title: str
    width: int
    height: int
    bars: tuple[Bar, ...]
    ticks: tuple[Tick, ...]
    plot_left: float
    plot_right: float
    plot_top: float
    plot_bottom: float
    label_y: float
    empty: bool  # nothing above zero to draw: the page says so rather than draw an axis for nothing


def text_width(text: str) -> float:
    """An upper bound of ``text``'s width in viewBox units at FONT_PX."""
    return len(text) * CHAR_PX


def nice_ceiling(value: float) -> tuple[float, float]:
    """An axis maximum at or above ``value`` and its step: 1, 2 or 5 times a power of ten, 4 or 5 steps."""
    if value <= 0 or not math.isfinite(value):
        return 1.0, 0.25
    raw_step = value / 4
    power = 10 ** math.floor(math.log10(raw_step))
    for factor in (1, 2, 2.5, 5, 10):
        step = factor * power
        if step * 4 >= value:
            break
    top = step * math.ceil(value / step)
    return top, step


def _tick_text(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    if value == int(value):
        return str(int(value))
    return f"{value:g}"


def number_tick(value: float, step: float) -> str:
    """A count on a value axis: 2500 -> "2,500", 0.25 -> "0.25"."""
    return _tick_text(value)


def dollar_tick(value: float, step: float) -> str:
    """Dollars on a value axis, in fixed point with as many decimals as the step needs (at least
    cents, none for whole-dollar steps): 0.00003 with a step of 0.00001 -> "$0.00003", never
    "3e-05"; 1000 with a step of 500 -> "$1,000"; zero is "$0"."""
    if value == 0:
        return "$0"
    if step >= 1 and step == int(step):
        return f"${value:,.0f}"
    places = 2
    while places < 9 and abs(step * 10**places - round(step * 10**places)) > 1e-6 * step * 10**places:
        places += 1
    return f"${value:,.{places}f}"


def bar_chart(
    title: str,
    items: list[tuple[str, float, str]],
    *,
    width: int = 480,
    height: int = 240,
    tick: Callable[[float, float], str] = number_tick,
) -> BarChart:
    """Vertical bars, one per ``(label, value, text)``, on an axis from zero; ``tick(value, step)``
    labels the value axis (``dollar_tick`` for money)."""
    empty = not any(value > 0 for _, value, _ in items)
    top, step = nice_ceiling(max((value for _, value, _ in items), default=0.0))
    tick_values = [step * index for index in range(round(top / step) + 1)]
    tick_texts = [tick(value, step) for value in tick_values]
    plot_left = max(LEFT, round(TICK_GAP + 4 + max(map(text_width, tick_texts)), 1))
    plot_right = width - RIGHT
    plot_top, plot_bottom = TOP, height - BOTTOM
    scale = (plot_bottom - plot_top) / top
    slot = (plot_right - plot_left) / max(len(items), 1)
    bar_width = max(2.0, min(48.0, slot * 0.7))
    # Category labels far enough apart not to overlap, and each whole inside the chart.
    label_width = max((text_width(label[:LABEL_CHARS]) for label, _, _ in items), default=0.0)
    every = max(1, math.ceil(len(items) / MAX_LABELS), math.ceil((label_width + 4) / slot))
    bars = []
    for index, (label, value, text) in enumerate(items):
        bar_height = max(0.0, value) * scale
        center = plot_left + slot * (index + 0.5)
        half = text_width(label[:LABEL_CHARS]) / 2
        bars.append(
            Bar(
                label=label,
                text=text,
                x=round(center - bar_width / 2, 2),
                y=round(plot_bottom - bar_height, 2),
                width=round(bar_width, 2),
                height=round(bar_height, 2),
                show_label=index % every == 0,
                label_x=round(min(max(center, half + 2), width - half - 2), 2),
            )
        )
    ticks = tuple(
        Tick(round(plot_bottom - value * scale, 2), text) for value, text in zip(tick_values, tick_texts, strict=True)
    )
    return BarChart(
        title=title,
        width=width,
        height=height,
        bars=tuple(bars),
        ticks=ticks,
        plot_left=plot_left,
        plot_right=plot_right,
        plot_top=plot_top,
        plot_bottom=plot_bottom,
        label_y=plot_bottom + 18,
        empty=empty,
    )


@dataclass(frozen=True)
class SpanRow:
    label: str  # the node's name
    detail: str  # e.g. "layers 0–10, ready"
    state: str  # the assignment's state: "ready" or "assigned"
    spare: bool
    node_state: str
    x: float
    y: float
    width: float
    height: float
    label_y: float


@dataclass(frozen=True)
class LayerCell:
    layer: int
    covered: bool
    x: float
    width: float


@dataclass(frozen=True)
class CoverageMap:
    n_layers: int
    width: int
    height: int
    rows: tuple[SpanRow, ...]
    cells: tuple[LayerCell, ...]  # the top strip: each layer covered by a ready serving stage, or not
    ticks: tuple[Tick, ...]
    plot_left: float
    plot_right: float
    strip_y: float
    strip_height: float
    axis_y: float


COVERAGE_LABELS = 150  # room for node names on the left
ROW_HEIGHT, ROW_GAP, STRIP = 18, 8, 14


def coverage_map(n_layers: int, spans: list[dict], covered: list[bool], *, width: int = 640) -> CoverageMap:
    """Layers on the x axis, one bar per node over the layers it holds.

    ``spans``: dicts with label, detail, state, spare, node_state, layer_start, layer_end (in the
    order to draw). ``covered``: per layer, whether a ready stage of a serving pipeline holds it.
    """
    plot_left, plot_right = COVERAGE_LABELS, width - RIGHT
    per_layer = (plot_right - plot_left) / max(n_layers, 1)
    strip_y = 8
    axis_y = strip_y + STRIP + 16
    first_row = axis_y + 10
    rows = []
    for index, span in enumerate(spans):
        y = first_row + index * (ROW_HEIGHT + ROW_GAP)
        rows.append(
            SpanRow(
                label=span["label"],
                detail=span["detail"],
                state=span["state"],
                spare=span["spare"],
                node_state=span["node_state"],
                x=round(plot_left + span["layer_start"] * per_layer, 2),
                y=y,
                width=round((span["layer_end"] - span["layer_start"]) * per_layer, 2),
                height=ROW_HEIGHT,
                label_y=y + ROW_HEIGHT - 5,
            )
        )
    cells = tuple(
        LayerCell(layer, is_covered, round(plot_left + layer * per_layer, 2), round(per_layer, 2))
        for layer, is_covered in enumerate(covered)
    )
    every = max(1, math.ceil(n_layers / 15))
    ticks = tuple(
        Tick(round(plot_left + layer * per_layer, 2), str(layer))
        for layer in range(0, n_layers + 1)
        if layer % every == 0 or layer == n_layers
    )
    height = int(first_row + max(len(rows), 1) * (ROW_HEIGHT + ROW_GAP) + 4)
    return CoverageMap(
        n_layers=n_layers,
        width=width,
        height=height,
        rows=tuple(rows),
        cells=cells,
        ticks=ticks,
        plot_left=plot_left,
        plot_right=plot_right,
        strip_y=strip_y,
        strip_height=STRIP,
        axis_y=axis_y,
    )


# A light scale from green (near) through yellow to red (far): dark text stays readable on all.
HEAT_STOPS = ((0.0, (0xD7, 0xF2, 0xDC)), (0.5, (0xFF, 0xF0, 0xB3)), (1.0, (0xFF, 0xC9, 0xC9)))


def heat_colour(value: float, high: float) -> str:
    """The background colour of a latency cell: ``value`` on a scale from 0 to ``high``."""
    share = 0.0 if high <= 0 else min(max(value / high, 0.0), 1.0)
    for (low_at, low), (high_at, top) in itertools.pairwise(HEAT_STOPS):
        if share <= high_at:
            t = (share - low_at) / (high_at - low_at)
            red, green, blue = (round(a + (b - a) * t) for a, b in zip(low, top, strict=True))
            return f"#{red:02x}{green:02x}{blue:02x}"
    red, green, blue = HEAT_STOPS[-1][1]
    return f"#{red:02x}{green:02x}{blue:02x}"


@dataclass(frozen=True)
class TokenBar:
    token: int  # 1-based, as people count
    value: float
    failed: bool  # below the required value
    x: float
    y: float
    width: float
    height: float


@dataclass(frozen=True)
class TokenChart:
    title: str
    width: int
    height: int
    bars: tuple[TokenBar, ...]
    ticks: tuple[Tick, ...]  # values on the y axis
    labels: tuple[Tick, ...]  # token numbers on the x axis
    threshold: float
    threshold_y: float
    zero_y: float
    plot_left: float
    plot_right: float
    plot_top: float
    plot_bottom: float
    label_y: float


TOKEN_LEFT, TOKEN_RIGHT, TOKEN_TOP, TOKEN_BOTTOM = 40, 8, 8, 20
TOKEN_LABELS = 8  # token numbers drawn at most


def token_chart(
    title: str, values: list[float], threshold: float, *, width: int = 320, height: int = 120
) -> TokenChart:
    """One bar per token of a per-token similarity in [-1, 1] (a check's cosine), with the line it
    must reach. The axis runs from 0 (or from the lowest half-step below 0) to 1, so a failing token
    stands out against the threshold line; a value that is not a number is drawn at the bottom."""
    clean = [min(max(v, -1.0), 1.0) if isinstance(v, int | float) and math.isfinite(v) else -1.0 for v in values]
    low = min(0.0, math.floor(min(clean, default=0.0) * 2) / 2)
    plot_left, plot_right = TOKEN_LEFT, width - TOKEN_RIGHT
    plot_top, plot_bottom = TOKEN_TOP, height - TOKEN_BOTTOM

    def y_of(value: float) -> float:
        return plot_bottom - (value - low) / (1.0 - low) * (plot_bottom - plot_top)

    zero_y = y_of(0.0)
    slot = (plot_right - plot_left) / max(len(clean), 1)
    bar_width = max(1.0, min(24.0, slot * 0.75))
    every = max(1, math.ceil(len(clean) / TOKEN_LABELS))
    bars, labels = [], []
    for index, value in enumerate(clean):
        center = plot_left + slot * (index + 0.5)
        top = y_of(value)
        bars.append(
            TokenBar(
                token=index + 1,
                value=values[index],
                failed=not value >= threshold,
                x=round(center - bar_width / 2, 2),
                y=round(min(top, zero_y), 2),
                width=round(bar_width, 2),
                height=round(abs(zero_y - top), 2),
            )
        )
        if index % every == 0 or index == len(clean) - 1:
            labels.append(Tick(round(center, 2), str(index + 1)))
    steps = round((1.0 - low) / 0.5)
    ticks = tuple(Tick(round(y_of(low + 0.5 * i), 2), _tick_text(low + 0.5 * i)) for i in range(steps + 1))
    return TokenChart(
        title=title,
        width=width,
        height=height,
        bars=tuple(bars),
        ticks=ticks,
        labels=tuple(labels),
        threshold=threshold,
        threshold_y=round(y_of(min(max(threshold, low), 1.0)), 2),
        zero_y=round(zero_y, 2),
        plot_left=plot_left,
        plot_right=plot_right,
        plot_top=plot_top,
        plot_bottom=plot_bottom,
        label_y=plot_bottom + 14,
    )
