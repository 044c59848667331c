"""Provider earnings from coverage-verified work, and the payouts that send them.

An ``Earning`` is one node's share of one verified job (nano-dollars). It is pending through the
challenge window (an upheld strike claws it back), then available. A periodic task gathers the
available earnings of providers above the minimum into a ``PayoutBatch``; an admin approves it, and
each ``Payout`` goes out as a Stripe Connect transfer to the provider's connected account. Every
amount also moves in the ledger (``billing.Transfer``): the rows here say *why*, the ledger *how much*.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class EarningState(models.TextChoices):
    PENDING = "pending", "pending"  # inside the challenge window
    AVAILABLE = "available", "available"  # payable
    BATCHED = "batched", "batched"  # in a payout batch
    PAID = "paid", "paid"
    CLAWED_BACK = "clawed_back", "clawed back"  # taken back by an upheld strike


class Earning(models.Model):
    node = models.ForeignKey("nodes.Node", on_delete=models.PROTECT, related_name="earnings")
    provider = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="earnings")
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, related_name="earnings")
    amount = models.BigIntegerField()  # nano-dollars
    layer_tokens = models.BigIntegerField()  # layers x token rows this node processed for the job
    state = models.CharField(max_length=16, choices=EarningState.choices, default=EarningState.PENDING)
    available_at = models.DateTimeField()  # end of the challenge window
    payout = models.ForeignKey("Payout", on_delete=models.PROTECT, null=True, blank=True, related_name="earnings")
    strike = models.ForeignKey(
        "verification.Strike", on_delete=models.PROTECT, null=True, blank=True, related_name="clawed_earnings"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["job", "node"], name="one_earning_per_job_and_node"),
            models.CheckConstraint(condition=models.Q(amount__gte=0), name="earning_not_negative"),
        ]
        indexes = [models.Index(fields=["state", "available_at"]), models.Index(fields=["provider", "state"])]


class ConnectAccount(models.Model):
    """A provider's Stripe Connect (Express) account, onboarded through Account Links."""

    provider = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="connect")
    stripe_account_id = models.CharField(max_length=64, unique=True)
    payouts_enabled = models.BooleanField(default=False)  # Stripe says it can receive transfers
    details_submitted = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    refreshed_at = models.DateTimeField(null=True, blank=True)


class BatchState(models.TextChoices):
    BUILT = "built", "awaiting approval"
    APPROVED = "approved", "approved"  # transfers going out
    DONE = "done", "done"  # every payout sent or given up


class PayoutBatch(models.Model):
    state = models.CharField(max_length=16, choices=BatchState.choices, default=BatchState.BUILT)
    total = models.BigIntegerField(default=0)  # nano-dollars
    created_at = models.DateTimeField(auto_now_add=True)
    approved_at = models.DateTimeField(null=True, blank=True)
    approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "payout batches"

    def __str__(self) -> str:
        return f"batch {self.pk} ({self.state})"


class PayoutState(models.TextChoices):
    PENDING = "pending", "awaiting approval"
    APPROVED = "approved", "approved, sending"
    SENT = "sent", "sent"
    FAILED = "failed", "failed"  # given up: the money went back to available; flagged for admins


class Payout(models.Model):
    batch = models.ForeignKey(PayoutBatch, on_delete=models.PROTECT, related_name="payouts")
    provider = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="payouts")
    amount = models.BigIntegerField()  # nano-dollars; sent in whole cents (the rest stays available)
    cents = models.BigIntegerField()  # what the Stripe transfer carries
    # Of ``amount``, the sub-cent rests of the provider's earlier sent payouts, carried into this one.
    carried_in = models.BigIntegerField(default=0)
    state = models.CharField(max_length=16, choices=PayoutState.choices, default=PayoutState.PENDING)
    idempotency_key = models.CharField(max_length=64, unique=True)
    stripe_transfer_id = models.CharField(max_length=64, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    flagged = models.BooleanField(default=False)  # needs an admin: a permanent failure or retries exhausted
    sent_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(condition=models.Q(amount__gt=0), name="payout_amount_positive"),
            models.UniqueConstraint(fields=["batch", "provider"], name="one_payout_per_provider_per_batch"),
        ]
