"""A small double-entry ledger, after TigerBeetle's transfers.

Money is an integer number of nano-dollars (1e-9 USD): no floats anywhere. Every balance change is
a ``Transfer`` of a positive amount from one account (debited) to another (credited), so every
entry balances by construction; transfers are immutable (the database refuses UPDATE and DELETE
on them), and a correction is a new transfer. An account's ``balance`` (credits minus debits) is
kept in the same transaction as each transfer that moves it.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

NANO_PER_DOLLAR = 1_000_000_000


class AccountKind(models.TextChoices):
    CUSTOMER_CREDIT = "customer_credit", "customer credit"  # spendable prepaid credits
    CUSTOMER_HOLD = "customer_hold", "customer hold"  # reserved for running jobs
    PROVIDER_PENDING = "provider_pending", "provider pending"  # earned, inside the challenge window
    PROVIDER_AVAILABLE = "provider_available", "provider available"  # earned, payable
    PLATFORM_REVENUE = "platform_revenue", "platform revenue"
    STRIPE_CLEARING = "stripe_clearing", "Stripe clearing"  # money on its way in from Stripe
    PROVIDER_PAYOUT = "provider_payout", "provider payout"  # earned, in a payout batch being sent
    PAYOUTS = "payouts", "payouts"  # money sent out to providers
    GRANTS = "grants", "grants"  # credits given by the platform (trials, the demo)
    CUSTOMER_FROZEN = "customer_frozen", "customer frozen"  # paid-in credit held while a payment is disputed


class LedgerAccount(models.Model):
    kind = models.CharField(max_length=32, choices=AccountKind.choices)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True, related_name="ledger_accounts"
    )
    balance = models.BigIntegerField(default=0)  # nano-dollars: credits minus debits

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["kind", "owner"], name="one_account_per_kind_and_owner"),
            models.UniqueConstraint(
                fields=["kind"], condition=models.Q(owner__isnull=True), name="one_platform_account_per_kind"
            ),
            # Holds never exceed what was reserved. (Spendable credit may go negative, but only
            # through a refund or dispute of money already spent; spending checks it first.)
            models.CheckConstraint(
                condition=~models.Q(kind="customer_hold") | models.Q(balance__gte=0),
                name="customer_hold_not_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind}:{self.owner_id or 'platform'}"


class Transfer(models.Model):
    debit = models.ForeignKey(LedgerAccount, on_delete=models.PROTECT, related_name="debits")
    credit = models.ForeignKey(LedgerAccount, on_delete=models.PROTECT, related_name="credits")
    amount = models.BigIntegerField()  # nano-dollars, > 0
    kind = models.CharField(max_length=32)  # topup, hold, release, charge, grant, refund, ...
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, null=True, blank=True, related_name="transfers")
    reference = models.CharField(max_length=128, blank=True)  # e.g. a Stripe event id
    memo = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(amount__gt=0), name="transfer_amount_positive"),
            models.CheckConstraint(condition=~models.Q(debit=models.F("credit")), name="transfer_between_two_accounts"),
        ]

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("transfers are immutable: post a correcting transfer instead")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValueError("transfers are immutable: post a correcting transfer instead")


class ModelPrice(models.Model):
    """Per-model prices in nano-dollars per million tokens; the newest row in force applies."""

    model = models.CharField(max_length=128)
    prompt_per_million = models.BigIntegerField()
    completion_per_million = models.BigIntegerField()
    effective_from = models.DateTimeField()

    class Meta:
        ordering = ["model", "-effective_from"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(prompt_per_million__gte=0) & models.Q(completion_per_million__gte=0),
                name="prices_not_negative",
            ),
        ]


class TopUpState(models.TextChoices):
    PENDING = "pending", "pending"  # a Checkout Session is open, or Stripe has not yet confirmed the payment
    PAID = "paid", "paid"  # Stripe confirmed it; the credits are on the customer's account
    FAILED = "failed", "failed"  # Stripe refused to start it, or the (asynchronous) payment failed
    EXPIRED = "expired", "expired"  # the Checkout Session expired unpaid
    # The customer left Checkout through its cancel link (should the session be paid all the same, it is credited).
    CANCELLED = "cancelled", "cancelled"
    REFUNDED = "refunded", "refunded"  # some or all of it was refunded
    DISPUTED = "disputed", "disputed"  # the payment is disputed: its credit is frozen
    DISPUTE_LOST = "dispute_lost", "dispute lost"  # the dispute was lost: the frozen credit went back to the cardholder


class TopUp(models.Model):
    """A customer's purchase of credits through a Stripe Checkout Session.

    Amounts are in cents, as Stripe counts them (the ledger gets 1 cent = 10_000_000 nano-dollars).
    Credits arrive only with Stripe's signed webhook, never with the customer's return from Checkout.
    """

    customer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="top_ups")
    amount_cents = models.PositiveIntegerField()
    currency = models.CharField(max_length=3, default="usd")
    state = models.CharField(max_length=16, choices=TopUpState.choices, default=TopUpState.PENDING)
    stripe_session_id = models.CharField(max_length=255, unique=True, null=True, blank=True)
    payment_intent = models.CharField(max_length=255, blank=True, db_index=True)  # set when Stripe reports payment
    charge = models.CharField(max_length=255, blank=True)  # set by a refund or a dispute
    refunded_cents = models.PositiveIntegerField(default=0)  # the charge's amount_refunded as Stripe last reported it
    frozen = models.BigIntegerField(default=0)  # nano-dollars moved to customer_frozen by a dispute
    # Nano-dollars a refund or dispute could not take back because the customer had already spent them.
    shortfall = models.BigIntegerField(default=0)
    needs_review = models.BooleanField(default=False)  # a shortfall, a dispute or an unexpected payment
    failure = models.CharField(max_length=255, blank=True)  # why Stripe refused it or the payment failed
    created_at = models.DateTimeField(auto_now_add=True)
    paid_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(amount_cents__gt=0), name="top_up_amount_positive"),
            models.CheckConstraint(
                condition=models.Q(frozen__gte=0) & models.Q(shortfall__gte=0), name="top_up_amounts_not_negative"
            ),
        ]

    def __str__(self) -> str:
        return f"top-up {self.pk} ({self.amount_cents} {self.currency}, {self.state})"


class StripeEvent(models.Model):
    """A Stripe webhook event, recorded once by its id in the transaction that acts on it, so a
    replayed event changes nothing."""

    event_id = models.CharField(max_length=255, unique=True)
    type = models.CharField(max_length=128)
    top_up = models.ForeignKey(TopUp, on_delete=models.PROTECT, null=True, blank=True, related_name="events")
    processed = models.BooleanField(default=False)  # False: recorded and ignored (a type or top-up not ours)
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.type} {self.event_id}"
