"""Money as people read it: dollars rounded half up to the cent, a non-zero amount under half a
cent as "<$0.01", the exact amount on hover; prices per million tokens; counts with separators; a
chart's money axis in dollars, never "3e-05"."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.template import Context, Template

from marketplace.billing import display
from marketplace.web import charts


@pytest.mark.parametrize(
    ("dollars", "shown", "exact"),
    [
        ("19.9999758", "$20.00", "$19.9999758"),
        ("0.218666666", "$0.22", "$0.218666666"),
        ("1.10401344", "$1.10", "$1.10401344"),
        ("0.005", "$0.01", "$0.005"),  # half a cent rounds up
        ("0.0049999", "<$0.01", "$0.0049999"),
        ("0.000061", "<$0.01", "$0.000061"),
        ("-0.000061", "-<$0.01", "-$0.000061"),
        ("-1.5", "-$1.50", "-$1.50"),
        ("0", "$0.00", "$0.00"),
        ("1234567.891", "$1,234,567.89", "$1,234,567.891"),
        (None, "—", "—"),
    ],
)
def test_dollars_show_to_the_cent_and_exactly(dollars, shown, exact):
    value = None if dollars is None else Decimal(dollars)

    assert (display.usd_text(value), display.usd_exact(value)) == (shown, exact)


def test_nano_dollars_show_as_dollars():
    assert (display.nano_text(1_104_013_440), display.nano_exact(1_104_013_440)) == ("$1.10", "$1.10401344")
    assert display.nano_detail(61_000) == "<$0.01 ($0.000061)"
    assert display.nano_detail(70_000_000) == "$0.07"


def test_prices_are_dollars_per_million_tokens_with_every_digit_they_have():
    assert display.price_text(200_000_000) == "$0.20 / 1M tokens"
    assert display.price_text(15_000_000) == "$0.015 / 1M tokens"
    assert display.price_text(7_000_000_000) == "$7.00 / 1M tokens"


def test_counts_have_thousands_separators():
    assert [display.count_text(n) for n in (0, 999, 12_345, 1_000_000)] == ["0", "999", "12,345", "1,000,000"]


def render(source: str, **context) -> str:
    return Template("{% load web_extras %}" + source).render(Context(context))


def test_the_money_filters_put_the_exact_amount_on_hover():
    assert render("{{ v|usd }}", v=Decimal("19.9999758")) == '<span class="money" title="$19.9999758">$20.00</span>'
    assert render("{{ v|usd }}", v=Decimal("10")) == '<span class="money">$10.00</span>'
    assert render("{{ v|nano_usd }}", v=61_000) == '<span class="money" title="$0.000061">&lt;$0.01</span>'
    assert render("{{ v|cents }}", v=110) == '<span class="money">$1.10</span>'
    assert render("{{ v|usd }}", v=None) == "—"
    assert render("{{ v|nano_usd_text }}", v=1_104_013_440) == "$1.10"
    assert render("{{ v|price }}", v=200_000_000) == "$0.20 / 1M tokens"
    assert render("{{ v|count }}", v=12_345) == "12,345"


@pytest.mark.parametrize(
    ("highest", "ticks"),
    [
        (3e-05, ["$0", "$0.00001", "$0.00002", "$0.00003", "$0.00004"]),
        (0.37, ["$0", "$0.10", "$0.20", "$0.30", "$0.40"]),
        (1234.0, ["$0", "$500", "$1,000", "$1,500"]),
    ],
)
def test_a_money_axis_reads_as_dollars(highest, ticks):
    chart = charts.bar_chart("Cost", [("a", highest, "")], tick=charts.dollar_tick)

    assert [tick.text for tick in chart.ticks] == ticks
