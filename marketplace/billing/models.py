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
    PAYOUTS = "payouts", "payouts"  # money sent out to providers
    GRANTS = "grants", "grants"  # credits given by the platform (trials, the demo)


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
