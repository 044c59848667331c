"""Errors of the billing app: Stripe top-ups and the signed webhook that reports them."""

from __future__ import annotations

from marketplace.errors import DomainError


class BillingError(DomainError):
    code = "billing_error"


class InsufficientCredits(BillingError):
    """The customer's credit does not cover the transfer (a job's hold, a new request)."""

    code = "insufficient_quota"


class InvalidAmount(BillingError):
    """A top-up amount that is missing, not a number of dollars, out of range or finer than cents."""

    code = "invalid_request"


class PaymentProviderUnavailable(BillingError):
    """Stripe is not configured here, or did not answer after the retries."""

    code = "payment_provider_unavailable"


class TopUpRefused(BillingError):
    """Stripe refused the top-up for good (card, request, account); nothing was charged."""

    code = "top_up_refused"


class WebhookNotConfigured(BillingError):
    """This server has no STRIPE_WEBHOOK_SECRET, so it cannot verify an event."""

    code = "webhook_not_configured"


class InvalidWebhookPayload(BillingError):
    code = "invalid_webhook_payload"


class InvalidWebhookSignature(BillingError):
    """The Stripe-Signature header is missing, forged, for another secret or too old (a replay)."""

    code = "invalid_webhook_signature"
