"""Money as people read it: dollars and cents from a dollar up, three significant digits below
(never "$0.00" for what is not zero), the exact amount on hover; prices per million tokens; counts with separators; a
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
        ("1.10401344", "$1.10", "$1.10401344"),
        ("1.005", "$1.01", "$1.005"),  # half a cent rounds up
        ("0.999951", "$1.00", "$0.999951"),
        ("0.218666666", "$0.219", "$0.218666666"),
        ("0.5", "$0.50", "$0.50"),
        ("0.07", "$0.07", "$0.07"),
        ("0.0049999", "$0.005", "$0.0049999"),
        ("0.0000168", "$0.0000168", "$0.0000168"),  # a request at the default prices
        ("0.00001684", "$0.0000168", "$0.00001684"),
        ("0.000061", "$0.000061", "$0.000061"),
        ("0.000000001", "$0.000000001", "$0.000000001"),  # a nano-dollar
        ("-0.000061", "-$0.000061", "-$0.000061"),
        ("-1.5", "-$1.50", "-$1.50"),
        ("0", "$0.00", "$0.00"),
        ("1234567.891", "$1,234,567.89", "$1,234,567.891"),
        (None, "—", "—"),
    ],
)
def test_dollars_show_cents_from_a_dollar_and_three_significant_digits_below(dollars, shown, exact):
    value = None if dollars is None else Decimal(dollars)

    assert (display.usd_text(value), display.usd_exact(value)) == (shown, exact)


def test_amounts_a_cent_apart_or_less_read_apart():
    charges = [Decimal(n) / 10**9 for n in (16_800, 17_400, 18_000, 18_600, 201_600, 2_016_000)]
    assert len({display.usd_text(charge) for charge in charges}) == len(charges)
    assert all(display.usd_text(charge) not in ("$0.00", "$0.01") for charge in charges)


def test_nano_dollars_show_as_dollars():
    assert (display.nano_text(1_104_013_440), display.nano_exact(1_104_013_440)) == ("$1.10", "$1.10401344")
    assert display.nano_detail(61_000) == "$0.000061"
    assert display.nano_detail(218_666_666) == "$0.219 ($0.218666666)"
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
    assert render("{{ v|nano_usd }}", v=61_000) == '<span class="money">$0.000061</span>'
    assert render("{{ v|nano_usd }}", v=16_840) == '<span class="money" title="$0.00001684">$0.0000168</span>'
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


@pytest.mark.parametrize("highest", [3e-05, 0.000123, 0.37, 1234.0, 98_765_432.0])
def test_a_charts_value_labels_fit_left_of_its_plot(highest):
    chart = charts.bar_chart(
        "Cost", [("2026-12-01", highest / 2, ""), ("2026-12-02", highest, "")], tick=charts.dollar_tick
    )

    widest = max(charts.text_width(tick.text) for tick in chart.ticks)
    assert chart.plot_left - charts.TICK_GAP - widest >= 0  # each label's start lies inside the chart
    assert chart.plot_left >= charts.LEFT


def test_category_labels_lie_inside_the_chart_and_apart():
    days = [(f"model-with-a-long-name-{day}", float(day), "") for day in range(1, 31)]
    chart = charts.bar_chart("Tokens", days)

    shown = [bar for bar in chart.bars if bar.show_label]
    halves = [charts.text_width(bar.label[: charts.LABEL_CHARS]) / 2 for bar in shown]
    assert all(half <= bar.label_x <= chart.width - half for bar, half in zip(shown, halves, strict=True))
    assert all(b.label_x - a.label_x >= 2 * half for a, b, half in zip(shown, shown[1:], halves, strict=False))


@pytest.mark.parametrize("items", [[], [("2026-12-01", 0.0, "$0.00")]])
def test_a_chart_with_nothing_to_draw_says_so(items):
    assert charts.bar_chart("Cost", items, tick=charts.dollar_tick).empty
    page = render(
        '{% include "web/partials/bar_chart.html" with chart=chart chart_id="c" %}',
        chart=charts.bar_chart("Cost", items, tick=charts.dollar_tick),
    )
    assert "Nothing to chart yet." in page and "<svg" not in page


def test_a_column_takes_the_digits_that_tell_its_rows_apart():
    shares = [1_333, 1_333, 1_334]  # one request's charge split three ways, to the nano-dollar
    digits = render('{% column_digits rows "amount" as d %}{{ d }}', rows=[{"amount": n} for n in shares])
    cells = render(
        '{% column_digits rows "amount" as d %}{% for r in rows %}{{ r.amount|nano_usd:d }};{% endfor %}',
        rows=[{"amount": n} for n in shares],
    )

    assert digits == "4"
    assert cells == '<span class="money">$0.000001333</span>;' * 2 + '<span class="money">$0.000001334</span>;'
    assert display.significant_for([Decimal("0.0000168"), Decimal("0.0000174")]) == display.SIGNIFICANT
    assert display.significant_for([Decimal("20.001"), Decimal("20.002")]) == 5  # "$20.001", "$20.002"
    assert display.significant_for([]) == display.SIGNIFICANT
