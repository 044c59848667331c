"""Template filters of the dashboards: money, counts, durations, states.

Money shows as people read it (``billing.display``): ``usd`` (dollars) and ``nano_usd`` (the
ledger's nano-dollars) render ``<span class="money" title="$19.9999758">$20.00</span>``, the exact
amount on hover when rounding hid digits; use them in element content only. In a table, a column's
amounts take the digits that tell its rows apart: ``{% column_digits rows "cost" as digits %}``
before the table, then ``{{ r.cost|nano_usd:digits }}`` in it. ``usd_text`` and
``nano_usd_text`` are the same amounts as plain text, for an attribute, an ``<option>`` or an SVG
``<title>``. ``price`` is a price per million tokens, ``count`` a number with thousands separators.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from django import template
from django.conf import settings
from django.utils.html import format_html
from django.utils.safestring import SafeString

from marketplace.billing import display, stripe_client
from marketplace.billing.selectors import dollars

register = template.Library()


def _money(shown: str, exact: str) -> SafeString:
    if shown == display.MISSING:
        return format_html("{}", shown)
    if exact == shown:
        return format_html('<span class="money">{}</span>', shown)
    return format_html('<span class="money" title="{}">{}</span>', exact, shown)


@register.filter
def usd(value, significant: int = display.SIGNIFICANT) -> SafeString:
    """Dollars as ``display.usd_text`` shows them, the exact amount on hover: 19.9999758 -> "$20.00"
    (title "$19.9999758"); ``significant``: a column's digits (``column_digits``)."""
    return _money(display.usd_text(value, significant), display.usd_exact(value))


@register.filter
def nano_usd(value, significant: int = display.SIGNIFICANT) -> SafeString:
    """Nano-dollars (the ledger's integer unit) as ``usd`` shows dollars: 1_250_000_000 -> "$1.25"."""
    if value is None or value == "":
        return _money(display.MISSING, display.MISSING)
    return usd(dollars(int(value)), significant)


@register.simple_tag
def reset_link_lifetime() -> str:
    """How long a password reset link works, in words: "an hour", "2 hours", "30 minutes"."""
    seconds = settings.PASSWORD_RESET_TIMEOUT
    if seconds % 3600 == 0:
        hours = seconds // 3600
        return "an hour" if hours == 1 else f"{hours} hours"
    minutes = max(1, seconds // 60)
    return "a minute" if minutes == 1 else f"{minutes} minutes"


@register.simple_tag
def payments_unavailable(what: str) -> str:
    """Why the page's ``what`` ("top-ups" or "payouts") button is disabled: no payment provider is
    configured; "" when one is."""
    if stripe_client.configured():
        return ""
    return stripe_client.TOP_UPS_UNAVAILABLE if what == "top-ups" else stripe_client.PAYOUTS_UNAVAILABLE


@register.simple_tag
def column_digits(rows, field: str, nano: bool = True) -> int:
    """The significant digits at which the amounts ``field`` of ``rows`` (objects or dicts; nano-dollars
    unless ``nano`` is False) that differ all read differently (``display.significant_for``)."""
    values = [row.get(field) if isinstance(row, dict) else getattr(row, field) for row in rows]
    if nano:
        values = [None if value is None or value == "" else dollars(int(value)) for value in values]
    return display.significant_for(values)


@register.filter
def usd_text(value) -> str:
    """``usd`` as plain text, without the exact amount."""
    return display.usd_text(value)


@register.filter
def nano_usd_text(value) -> str:
    """``nano_usd`` as plain text, without the exact amount."""
    return display.nano_text(value)


@register.filter
def price(nano_per_million) -> str:
    """A price in nano-dollars per million tokens: 200_000_000 -> "$0.20 / 1M tokens"."""
    return display.price_text(int(nano_per_million))


@register.filter
def count(value) -> str:
    """A count with thousands separators: 12345 -> "12,345"."""
    return display.count_text(value)


@register.filter
def ledger_entry(kind: str) -> str:
    """A ledger entry's kind in the customer's words: "charge" -> "charged for a request"."""
    return display.entry_text(kind)


@register.filter
def ledger_account(kind: str) -> str:
    """One of the customer's ledger accounts in their words: "customer_hold" -> "on hold"."""
    return display.account_text(kind)


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
def cents(value) -> SafeString:
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
