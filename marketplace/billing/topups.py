"""Stripe top-ups: a Checkout Session out, signed webhook events in.

``start_top_up(user, dollars, origin=...)`` records a pending ``TopUp`` and asks Stripe for a Checkout
Session; the customer pays on Stripe's page, and Stripe sends them back to the billing page at
``origin``, the address they reached this site at (or SWARM_PUBLIC_URL): never a fixed host that may
not be this one. Leaving Checkout through its cancel link lands on ``cancel_top_up``, which marks
the top-up cancelled at once and expires its session. Credits move only through ``HANDLERS``, one per webhook event
type, which ``marketplace.flows.stripe_events.handle_event`` runs once per verified event in one
transaction; a top-up is claimed by a conditional update from pending, so two events about one
payment credit it once.

Stripe is called through ``billing.stripe_client`` (timeouts, bounded retries with the same
idempotency key, so a retry can never open a second session); a permanent failure (invalid request,
card, authentication, permission) marks the top-up failed and raises ``TopUpRefused``.

Refunds and disputes take back only the credit the customer still has: what was already spent is
recorded on the top-up as a shortfall and flagged for review, and the balance never goes negative.
A dispute freezes the disputed credit until it closes: won (or an inquiry closed without a
chargeback) returns it to the customer's credit; lost sends it back out through Stripe clearing.

A completed session credits the top-up's own recorded amount, and only when Stripe reports that
exact amount and currency paid; a mismatch credits nothing and flags the top-up for review.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation

import stripe
from django.conf import settings
from django.db.models import F
from django.urls import reverse
from django.utils import timezone

from marketplace.accounts.errors import RoleRequired
from marketplace.billing import stripe_client
from marketplace.billing.errors import InvalidAmount, PaymentProviderUnavailable, TopUpRefused
from marketplace.billing.models import NANO_PER_DOLLAR, AccountKind, LedgerAccount, TopUp, TopUpState
from marketplace.billing.services import account, transfer
from marketplace.billing.stripe_client import TOP_UPS_UNAVAILABLE, call_stripe

logger = logging.getLogger(__name__)

NANO_PER_CENT = NANO_PER_DOLLAR // 100
CENT = Decimal("0.01")
# A payment Stripe reports is credited from these states only: a cancelled top-up's session may
# still have been paid (in another tab, before it expired), and that money is the customer's.
CREDITABLE = (TopUpState.PENDING, TopUpState.CANCELLED)


# --- top-ups --------------------------------------------------------------------------------------


def top_up_cents(dollars: object) -> int:
    """A requested amount in dollars ("10.00"), checked against the configured bounds, in cents."""
    low, high = settings.STRIPE_TOPUP_MIN_DOLLARS, settings.STRIPE_TOPUP_MAX_DOLLARS
    if dollars is None:
        raise InvalidAmount('amount is required: a number of dollars such as "10.00"', param="amount")
    malformed = InvalidAmount(f"amount must be a number of dollars, got {dollars!r}", param="amount")
    if isinstance(dollars, bool) or not isinstance(dollars, (str, int, float, Decimal)):
        raise malformed
    try:
        amount = Decimal(str(dollars).strip())
    except InvalidOperation:
        raise malformed from None
    if not amount.is_finite() or not low <= amount <= high:
        raise InvalidAmount(f"amount must be between ${low} and ${high}", param="amount")
    if amount != amount.quantize(CENT):
        raise InvalidAmount("amount must be in whole cents (at most two decimals)", param="amount")
    return int(amount * 100)


def checkout_returns(origin: str, top_up_pk: int) -> tuple[str, str]:
    """Where Stripe Checkout sends the customer back to, on ``origin`` (e.g. "https://swarm.example"):
    the billing page after paying (Stripe fills in the session id), the top-up's cancel link otherwise."""
    success = f"{origin}{reverse('web:billing')}?top_up=success&session={{CHECKOUT_SESSION_ID}}"
    return success, f"{origin}{reverse('web:top-up-cancelled', args=[top_up_pk])}"


def start_top_up(user, dollars: object, *, origin: str) -> tuple[TopUp, str]:
    """Open a Stripe Checkout Session for a customer's top-up; returns the top-up and the page to pay on.
    Stripe sends the customer back to this site at ``origin``.

    No credit moves here: the webhook adds it once Stripe reports the payment.
    """
    if not user.is_customer:
        raise RoleRequired("only customers can top up credits")
    cents = top_up_cents(dollars)
    if not stripe_client.configured():
        raise PaymentProviderUnavailable(TOP_UPS_UNAVAILABLE)
    top_up = TopUp.objects.create(customer=user, amount_cents=cents, currency="usd")
    success_url, cancel_url = checkout_returns(origin, top_up.pk)

    def create_session() -> stripe.checkout.Session:
        return stripe.checkout.Session.create(
            mode="payment",
            line_items=[
                {
                    "price_data": {
                        "currency": top_up.currency,
                        "unit_amount": cents,
                        "product_data": {"name": "Swarm credits"},
                    },
                    "quantity": 1,
                }
            ],
            success_url=success_url,
            cancel_url=cancel_url,
            client_reference_id=str(top_up.pk),
            metadata={"top_up": str(top_up.pk), "account": str(user.pk)},
            idempotency_key=f"topup-{top_up.pk}",
        )

    try:
        session = call_stripe(create_session, what=f"checkout session for top-up {top_up.pk}")
    except stripe.StripeError as exc:
        failure = f"{type(exc).__name__}: {exc.user_message or exc}"
        TopUp.objects.filter(pk=top_up.pk, state=TopUpState.PENDING).update(
            state=TopUpState.FAILED, failure=failure[:255]
        )
        logger.error("Stripe refused top-up %s: %s", top_up.pk, failure)
        reason = exc.code or type(exc).__name__
        raise TopUpRefused(f"The payment provider refused this top-up ({reason}); nothing was charged.") from exc
    TopUp.objects.filter(pk=top_up.pk).update(stripe_session_id=session.id)
    top_up.refresh_from_db()
    assert session.url is not None  # a new hosted Checkout Session has its page's URL (until it completes or expires)
    return top_up, session.url


def cancel_top_up(top_up: TopUp) -> bool:
    """The customer left Checkout through its cancel link: a pending top-up is cancelled at once
    (True), and its session expired at Stripe so that it can no longer be paid. Should Stripe still
    report a payment (paid in another tab before the expiry), the webhook credits it all the same.
    A top-up no longer pending is left as it is (False)."""
    if TopUp.objects.filter(pk=top_up.pk, state=TopUpState.PENDING).update(state=TopUpState.CANCELLED) != 1:
        return False
    top_up.state = TopUpState.CANCELLED
    if top_up.stripe_session_id and settings.STRIPE_SECRET_KEY:
        session_id = top_up.stripe_session_id
        try:
            call_stripe(
                lambda: stripe.checkout.Session.expire(session_id, idempotency_key=f"topup-expire-{top_up.pk}"),
                what=f"expiring the checkout session of top-up {top_up.pk}",
            )
        except (stripe.StripeError, PaymentProviderUnavailable) as exc:
            # Already completed or expired, or Stripe is away: the session's own expiry and the
            # webhook settle it; the customer's cancel stands either way.
            logger.warning("Could not expire the checkout session of top-up %s: %r", top_up.pk, exc)
    return True


# --- webhook events -------------------------------------------------------------------------------


def _top_up_for_session(session: Mapping) -> TopUp | None:
    found = TopUp.objects.filter(stripe_session_id=session["id"]).first()
    if found is not None:
        return found
    # The session's id never reached us (its creation timed out after Stripe made it): use the metadata.
    reference = str((session.get("metadata") or {}).get("top_up", ""))
    if not reference.isdigit():
        return None
    return TopUp.objects.filter(pk=int(reference), stripe_session_id__isnull=True).first()


def _top_up_for_charge(charge_or_dispute: Mapping) -> TopUp | None:
    payment_intent = charge_or_dispute.get("payment_intent")
    if not payment_intent:
        return None
    return TopUp.objects.select_for_update().filter(payment_intent=payment_intent).first()


def _credit(top_up: TopUp, session: Mapping, event_id: str) -> str:
    """Credit a paid session's amount once: only the event that moves the top-up out of pending (or
    cancelled) credits.

    The session must have been paid in the top-up's currency and for exactly its amount; anything
    else is credited to nobody and flagged for review (the top-up stays pending)."""
    paid = session.get("amount_total")
    if session.get("currency") != top_up.currency or isinstance(paid, bool) or paid != top_up.amount_cents:
        mismatch = (
            f"the session was paid {paid!r} {session.get('currency')!r}, "
            f"not the top-up's {top_up.amount_cents} {top_up.currency!r}: not credited"
        )
        TopUp.objects.filter(pk=top_up.pk).update(needs_review=True, failure=mismatch[:255])
        logger.error("Top-up %s: %s", top_up.pk, mismatch)
        return "needs_review"
    claimed = TopUp.objects.filter(pk=top_up.pk, state__in=CREDITABLE).update(
        state=TopUpState.PAID,
        paid_at=timezone.now(),
        stripe_session_id=session["id"],
        payment_intent=session.get("payment_intent") or "",
    )
    if claimed != 1:
        return "already_handled"
    transfer(
        account(AccountKind.STRIPE_CLEARING),
        account(AccountKind.CUSTOMER_CREDIT, top_up.customer),
        top_up.amount_cents * NANO_PER_CENT,
        kind="topup",
        reference=event_id,
        memo=f"top-up {top_up.pk}",
    )
    return "credited"


def _take_back(top_up: TopUp, amount: int, to: LedgerAccount, *, kind: str, event_id: str) -> tuple[int, int]:
    """Move ``amount`` nano-dollars out of the customer's spendable credit, into the negative if they
    already spent it: a visible debt that blocks new requests (402) until topped up. Returns
    (taken, shortfall), the shortfall being the part that was already spent."""
    credit = account(AccountKind.CUSTOMER_CREDIT, top_up.customer)
    # Lock both accounts in primary-key order (as transfer does) before reading what is there.
    locked = {
        a.pk: a for a in LedgerAccount.objects.select_for_update().filter(pk__in=[credit.pk, to.pk]).order_by("pk")
    }
    shortfall = max(0, amount - max(locked[credit.pk].balance, 0))
    transfer(credit, to, amount, kind=kind, reference=event_id, memo=f"top-up {top_up.pk}", allow_negative=True)
    if shortfall:
        logger.warning("%s of top-up %s leaves a debt of %d nano-dollars: already spent", kind, top_up.pk, shortfall)
    return amount, shortfall


def _session_completed(event_id: str, session: Mapping) -> tuple[TopUp | None, str]:
    top_up = _top_up_for_session(session)
    if top_up is None:
        return None, "ignored"
    if session.get("payment_status") != "paid":  # a delayed payment method: async_payment_* follows
        return top_up, "pending"
    return top_up, _credit(top_up, session, event_id)


def _async_payment_succeeded(event_id: str, session: Mapping) -> tuple[TopUp | None, str]:
    top_up = _top_up_for_session(session)
    if top_up is None:
        return None, "ignored"
    return top_up, _credit(top_up, session, event_id)


def _close_pending(session: Mapping, state: str, failure: str = "") -> tuple[TopUp | None, str]:
    top_up = _top_up_for_session(session)
    if top_up is None:
        return None, "ignored"
    changed = TopUp.objects.filter(pk=top_up.pk, state=TopUpState.PENDING).update(state=state, failure=failure)
    return top_up, state if changed else "already_handled"


def _async_payment_failed(event_id: str, session: Mapping) -> tuple[TopUp | None, str]:
    return _close_pending(session, TopUpState.FAILED, "the payment failed")


def _session_expired(event_id: str, session: Mapping) -> tuple[TopUp | None, str]:
    return _close_pending(session, TopUpState.EXPIRED)


def _charge_refunded(event_id: str, charge: Mapping) -> tuple[TopUp | None, str]:
    """Debit what was newly refunded: ``amount_refunded`` is the charge's running total."""
    top_up = _top_up_for_charge(charge)
    if top_up is None:
        return None, "ignored"
    refunded = int(charge.get("amount_refunded") or 0)
    new_cents = refunded - top_up.refunded_cents
    if new_cents <= 0:
        return top_up, "already_handled"
    _, short = _take_back(
        top_up, new_cents * NANO_PER_CENT, account(AccountKind.STRIPE_CLEARING), kind="refund", event_id=event_id
    )
    TopUp.objects.filter(pk=top_up.pk).update(
        state=TopUpState.REFUNDED,
        refunded_cents=refunded,
        charge=charge["id"],
        shortfall=F("shortfall") + short,
        needs_review=top_up.needs_review or short > 0,
    )
    return top_up, "refunded"


def _dispute_created(event_id: str, dispute: Mapping) -> tuple[TopUp | None, str]:
    """Freeze the disputed amount until the dispute is decided; a dispute always wants a reply."""
    top_up = _top_up_for_charge(dispute)
    if top_up is None:
        return None, "ignored"
    frozen, short = _take_back(
        top_up,
        int(dispute["amount"]) * NANO_PER_CENT,
        account(AccountKind.CUSTOMER_FROZEN, top_up.customer),
        kind="dispute_freeze",
        event_id=event_id,
    )
    TopUp.objects.filter(pk=top_up.pk).update(
        state=TopUpState.DISPUTED,
        charge=dispute.get("charge") or top_up.charge,
        frozen=F("frozen") + frozen,
        shortfall=F("shortfall") + short,
        needs_review=True,
    )
    return top_up, "frozen"


def _dispute_closed(event_id: str, dispute: Mapping) -> tuple[TopUp | None, str]:
    """Unfreeze a dispute's credit once it is decided: back to the customer's credit when won (or
    an inquiry closed without a chargeback), out to Stripe clearing when lost (the cardholder got
    the money back). Only what the dispute froze moves, and only once."""
    top_up = _top_up_for_charge(dispute)
    if top_up is None:
        return None, "ignored"
    status = dispute.get("status")
    if status not in ("won", "warning_closed", "lost"):
        return top_up, "ignored"
    amount = min(int(dispute.get("amount") or 0) * NANO_PER_CENT, top_up.frozen)
    if top_up.state != TopUpState.DISPUTED or amount <= 0:
        return top_up, "already_handled"
    frozen = account(AccountKind.CUSTOMER_FROZEN, top_up.customer)
    left = top_up.frozen - amount
    if status == "lost":
        transfer(
            frozen,
            account(AccountKind.STRIPE_CLEARING),
            amount,
            kind="dispute_lost",
            reference=event_id,
            memo=f"top-up {top_up.pk}",
        )
        state, outcome = TopUpState.DISPUTE_LOST, "dispute_lost"
    else:
        transfer(
            frozen,
            account(AccountKind.CUSTOMER_CREDIT, top_up.customer),
            amount,
            kind="dispute_won",
            reference=event_id,
            memo=f"top-up {top_up.pk}",
        )
        state, outcome = (TopUpState.REFUNDED if top_up.refunded_cents else TopUpState.PAID), "unfrozen"
    TopUp.objects.filter(pk=top_up.pk).update(frozen=left, state=TopUpState.DISPUTED if left else state)
    return top_up, outcome


HANDLERS: dict[str, Callable[[str, Mapping], tuple[TopUp | None, str]]] = {
    "checkout.session.completed": _session_completed,
    "checkout.session.async_payment_succeeded": _async_payment_succeeded,
    "checkout.session.async_payment_failed": _async_payment_failed,
    "checkout.session.expired": _session_expired,
    "charge.refunded": _charge_refunded,
    "charge.dispute.created": _dispute_created,
    "charge.dispute.closed": _dispute_closed,
}
