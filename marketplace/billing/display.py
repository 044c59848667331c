"""Money and counts as people read them; the exact amount stays one hover away.

The ledger keeps integer nano-dollars (1e-9 USD) and a request costs fractions of a cent, so an
exact amount reads "$19.9999758". One rule everywhere (pages, charts' tables, the admin, forms):
``usd_text`` shows three significant digits and never fewer than cents, rounded half up, so an
amount of a dollar or more reads in dollars and cents ("$20.00", "$1,234.57") and a smaller one
with the digits it needs ("$0.50", "$0.219", "$0.0000168"): a request's charge, a node's share of
it and a provider's first earnings read as what they are, and nothing non-zero shows as "$0.00".
A table's column takes more digits where three would show two different amounts alike
(``significant_for``: a request's shares of 1,333 and 1,334 nano-dollars read "$0.000001333" and
"$0.000001334"), so that rows that differ read differently. A negative amount reads "-$0.0000168".
``usd_exact`` keeps every digit (a hover title, a detail view). Prices are dollars per million
tokens ("$0.20 / 1M tokens"), with as many digits as they have. The dashboards' template filters
(``web.templatetags.web_extras``) and the admin's columns use these.
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import ROUND_HALF_UP, Decimal

from marketplace.billing.selectors import dollars

CENT = Decimal("0.01")
SIGNIFICANT = 3  # digits an amount shows (at least cents), unless its column needs more to tell rows apart
MOST_SIGNIFICANT = 18  # a billion dollars to the nano-dollar
MISSING = "—"

Amount = Decimal | int | float | str


def _decimal(value: Amount) -> Decimal:
    return Decimal(str(value))


def usd_text(value: Amount | None, significant: int = SIGNIFICANT) -> str:
    """Dollars with ``significant`` significant digits (three unless a column needs more) and never
    fewer than cents, rounded half up, no zeros after the last digit past the cents: 19.9999758 ->
    "$20.00", -1.5 -> "-$1.50", 0.218666 -> "$0.219", 0.07 -> "$0.07", 0.0000168 -> "$0.0000168",
    0 -> "$0.00", None -> "—"."""
    if value is None or value == "":
        return MISSING
    amount = _decimal(value)
    sign = "-" if amount < 0 else ""
    amount = abs(amount)
    if amount == 0:
        return "$0.00"
    places = max(2, significant - 1 - amount.adjusted())
    shown = amount.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    whole, fraction = f"{shown:,f}".split(".")
    return f"{sign}${whole}.{fraction.rstrip('0').ljust(2, '0')}"


def significant_for(values: Iterable[Amount | None]) -> int:
    """The fewest significant digits (SIGNIFICANT at least) at which the amounts that differ among
    ``values`` (a table's column) all read differently in ``usd_text``."""
    amounts = {_decimal(value) for value in values if value is not None and value != ""}
    significant = SIGNIFICANT
    while significant < MOST_SIGNIFICANT and len({usd_text(a, significant) for a in amounts}) < len(amounts):
        significant += 1
    return significant


def usd_exact(value: Amount | None) -> str:
    """Dollars with cents and every further digit the amount has: 9.9999938 -> "$9.9999938"."""
    if value is None or value == "":
        return MISSING
    amount = _decimal(value)
    sign = "-" if amount < 0 else ""
    amount = abs(amount)
    if amount == amount.quantize(CENT):
        return f"{sign}${amount.quantize(CENT):,.2f}"
    return f"{sign}${amount.normalize():,f}"


def usd_detail(value: Amount | None) -> str:
    """``usd_text``, followed by the exact amount when rounding hid digits: "$0.219 ($0.218666)"."""
    shown, exact = usd_text(value), usd_exact(value)
    return shown if shown == exact else f"{shown} ({exact})"


def nano_text(nano: int | None) -> str:
    """Nano-dollars as ``usd_text`` shows dollars: 1_104_013_440 -> "$1.10"."""
    return MISSING if nano is None or nano == "" else usd_text(dollars(nano))


def nano_exact(nano: int | None) -> str:
    """Nano-dollars as ``usd_exact`` shows dollars: 1_104_013_440 -> "$1.10401344"."""
    return MISSING if nano is None or nano == "" else usd_exact(dollars(nano))


def nano_detail(nano: int | None) -> str:
    """Nano-dollars as ``usd_detail`` shows dollars."""
    return MISSING if nano is None or nano == "" else usd_detail(dollars(nano))


def price_amount(nano_per_million: int) -> str:
    """A price in nano-dollars per million tokens as dollars, cents always and further digits
    when it has them: 200_000_000 -> "$0.20", 15_000_000 -> "$0.015"."""
    return usd_exact(dollars(nano_per_million))


def price_text(nano_per_million: int) -> str:
    """A price per million tokens: 200_000_000 -> "$0.20 / 1M tokens"."""
    return f"{price_amount(nano_per_million)} / 1M tokens"


def count_text(value: int | None) -> str:
    """A count with thousands separators: 12345 -> "12,345"."""
    return MISSING if value is None or value == "" else f"{int(value):,}"


# A customer's ledger entries and accounts in their own words (``selectors.transactions``).
ENTRY_KINDS = {
    "topup": "credits bought",
    "grant": "credits granted",
    "hold": "held for a request",
    "charge": "charged for a request",
    "release": "unused hold released",
    "refund": "payment refunded",
    "dispute_freeze": "frozen: payment disputed",
    "dispute_won": "dispute won: unfrozen",
    "dispute_lost": "dispute lost",
}
CUSTOMER_ACCOUNTS = {
    "customer_credit": "available credit",
    "customer_hold": "on hold",
    "customer_frozen": "frozen",
}


def entry_text(kind: str) -> str:
    return ENTRY_KINDS.get(kind, kind.replace("_", " "))


def account_text(kind: str) -> str:
    return CUSTOMER_ACCOUNTS.get(kind, kind.replace("_", " "))
