"""The one Stripe client of the control plane: top-ups (``billing.topups``) and payouts both call it.

Calls carry an explicit timeout. Transient failures (no connection, timeout, rate limit, 5xx) are
retried a bounded number of times with the caller's idempotency key, so a retry can never act twice,
and end in ``PaymentProviderUnavailable``; permanent ones (invalid request, card, authentication,
permission) are raised to the caller, which decides what failed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import stripe
from django.conf import settings

from marketplace.billing.errors import PaymentProviderUnavailable

logger = logging.getLogger(__name__)

PERMANENT_ERRORS = (
    stripe.InvalidRequestError,
    stripe.CardError,
    stripe.AuthenticationError,
    stripe.PermissionError,
    stripe.IdempotencyError,
)


# --- calling Stripe -------------------------------------------------------------------------------


@functools.cache
def _http_client(timeout_s: float) -> stripe.HTTPClient:
    return stripe.RequestsClient(timeout=timeout_s)


def configure() -> None:
    """Point the SDK at the configured API, with this project's timeout; retries are ours, not the SDK's."""
    stripe.api_key = settings.STRIPE_SECRET_KEY
    stripe.api_base = settings.STRIPE_API_BASE
    stripe.max_network_retries = 0
    stripe.default_http_client = _http_client(settings.STRIPE_TIMEOUT_S)


def is_transient(exc: stripe.StripeError) -> bool:
    """Worth retrying with the same idempotency key: the request may not have been processed."""
    if isinstance(exc, PERMANENT_ERRORS):
        return False
    if isinstance(exc, (stripe.APIConnectionError, stripe.RateLimitError)):
        return True
    return exc.http_status is None or exc.http_status >= 500


_Result = TypeVar("_Result", bound=stripe.StripeObject)


# Why a page's Stripe buttons are disabled, and what a request that needs Stripe is told, where none is configured.
TOP_UPS_UNAVAILABLE = (
    "Top-ups are not available: this server has no payment provider (Stripe) configured. An admin can grant credits."
)
PAYOUTS_UNAVAILABLE = (
    "Payouts are not set up on this marketplace: it has no payment provider (Stripe) configured. "
    "Your earnings keep accruing until it has."
)


def configured() -> bool:
    """Whether this server has a payment provider: top-ups (Checkout) and payouts (Connect) need it."""
    return bool(settings.STRIPE_SECRET_KEY)


def call_stripe(operation: Callable[[], _Result], *, what: str) -> _Result:
    """Run one Stripe request, retrying transient failures; the caller passes the idempotency key."""
    configure()
    attempts = settings.STRIPE_MAX_RETRIES + 1
    last_error: stripe.StripeError | None = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(settings.STRIPE_RETRY_BACKOFF_S * 2 ** (attempt - 1))
        try:
            return operation()
        except stripe.StripeError as exc:
            if not is_transient(exc):
                raise
            logger.warning("Stripe %s failed (attempt %d of %d): %r", what, attempt + 1, attempts, exc)
            last_error = exc
    raise PaymentProviderUnavailable(
        "The payment provider is unavailable; nothing was charged. Please try again in a minute."
    ) from last_error
