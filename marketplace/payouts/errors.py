"""Error codes of the payouts app."""

from __future__ import annotations

from marketplace.errors import DomainError


class PayoutError(DomainError):
    code = "payout_error"


class PayoutRefused(PayoutError):
    """Not allowed: not an admin, not a provider, or a batch not awaiting approval."""

    code = "payout_refused"
