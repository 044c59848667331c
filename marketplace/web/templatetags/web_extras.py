"""Template filters of the dashboards: money, durations, states."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from django import template

from marketplace.billing.selectors import dollars

register = template.Library()

CENT = Decimal("0.01")


@register.filter
def usd(value) -> str:
    """Dollars with cents, and every further digit the amount has (token prices are fractions of a
    cent): 10 -> "$10.00", 9.9999938 -> "$9.9999938", -1.5 -> "-$1.50"."""
    if value is None or value == "":
        return "—"
    amount = Decimal(str(value))
    sign = "-" if amount < 0 else ""
    amount = abs(amount)
    text = format(amount.quantize(CENT), "f") if amount == amount.quantize(CENT) else format(amount.normalize(), "f")
    return f"{sign}${text}"


@register.filter
def nano_usd(value) -> str:
    """Nano-dollars (the ledger's integer unit) shown as ``usd`` shows dollars: 1_250_000_000 -> "$1.25"."""
    if value is None or value == "":
        return "—"
    return usd(dollars(int(value)))


@register.filter
def percent(value, places: int = 1) -> str:
    """A share in [0, 1] as a percentage: 0.25 -> "25.0%"."""
    if value is None or value == "":
        return "—"
    return f"{float(value) * 100:.{int(places)}f}%"


@register.filter
def duration(seconds) -> str:
    """A length of time for people: "42 s", "3 min 5 s", "2 h 10 min", "3 d 4 h"."""
    if seconds is None:
        return "—"
    total = int(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{secs} s"


@register.filter
def layers(block) -> str:
    """A block's layer span as people read it: layers 0–10 (the end is exclusive)."""
    return f"{block.layer_start}–{block.layer_end}"


@register.filter
def cents(value) -> str:
    """A whole number of cents as dollars: 1000 -> "$10.00"."""
    return usd(Decimal(int(value)) / 100)


@register.filter
def iso_time(value: str) -> str:
    """An ISO 8601 timestamp as "2025-01-31 12:00:05" (UTC)."""
    try:
        moment = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return value
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
