"""One verified Stripe webhook event, applied exactly once: top-ups (billing) and Connect accounts (payouts).

The event id is inserted in the event's own transaction, so a replayed event changes nothing; the
event then goes to the app it is about. An event of another type, or about a payment that is not a
top-up, is recorded and ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from django.db import IntegrityError, transaction

from marketplace.billing.models import StripeEvent
from marketplace.billing.topups import HANDLERS
from marketplace.payouts.services import connect_account_updated

logger = logging.getLogger(__name__)


@transaction.atomic
def handle_event(event: Mapping) -> str:
    """Apply one verified Stripe event exactly once; returns what it did ("credited", "duplicate", ...)."""
    try:
        with transaction.atomic():
            record = StripeEvent.objects.create(event_id=event["id"], type=event["type"])
    except IntegrityError:
        return "duplicate"
    if record.type == "account.updated":  # a provider's Connect account (payouts), not a top-up
        return connect_account_updated(event["data"]["object"])
    handler = HANDLERS.get(record.type)
    if handler is None:
        return "ignored"
    top_up, outcome = handler(record.event_id, event["data"]["object"])
    if top_up is None:
        logger.warning("Stripe event %s (%s) is about no top-up of ours: ignored", record.event_id, record.type)
        return outcome
    StripeEvent.objects.filter(pk=record.pk).update(top_up=top_up, processed=True)
    return outcome
