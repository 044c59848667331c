"""Spot-checks of nodes' computation and the strikes they lead to.

A ``Challenge`` is a job the verifier runs through one node and stand-ins of its own; an ``Audit`` is one
stage of one live session whose exact inputs and outputs the coordinator kept (the node signed
their hashes in its receipt). Both are replayed on the control plane's trusted float32 block and
compared per token. A failed check becomes a ``Strike`` with its evidence; an admin upholds or
overturns it (with a reason), and unreviewed strikes are upheld after the review period.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from worker_agent.protocol.span import Span


class CheckState(models.TextChoices):
    SENT = "sent", "sent"  # challenge opened, its session not finished yet
    ANSWERED = "answered", "answered"  # answer stored, not yet compared
    PENDING = "pending", "pending"  # audit material stored, not yet replayed
    PASSED = "passed", "passed"
    FAILED = "failed", "failed"  # the output disagrees with the trusted recompute (or hashes do not match)
    EXPIRED = "expired", "expired"  # no answer within the deadline: a failure
    ERROR = "error", "error"  # the verifier itself could not run (not the node's fault; no strike)


class Challenge(models.Model):
    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="challenges")
    model = models.CharField(max_length=128)
    layer_start = models.PositiveIntegerField()
    layer_end = models.PositiveIntegerField()
    seed = models.BigIntegerField()  # 0 <= seed < 2**63: draws its request (traffic.py)
    tokens = models.PositiveIntegerField()  # completion tokens its request asks for (0: not drawn yet)
    # A memory challenge's sessions, held open at once, and the positions each one fills (prompt and
    # completion); 1 and 0 for one that checks the node's outputs only.
    sessions = models.PositiveSmallIntegerField(default=1)
    positions = models.PositiveIntegerField(default=0)
    state = models.CharField(max_length=16, choices=CheckState.choices, default=CheckState.SENT)
    sent_at = models.DateTimeField()
    deadline_at = models.DateTimeField()
    answered_at = models.DateTimeField(null=True, blank=True)
    elapsed_ms = models.FloatField(null=True, blank=True)  # the node's share of its job's steps, timed here
    # The node's part of its job: AuditMaterial.to_bytes(); a memory challenge's, one per session
    # (``verification.challenges.pack_materials``).
    output = models.BinaryField(null=True, blank=True)
    metrics = models.JSONField(default=dict)  # per-token cosine and rel_norm, min/max, thresholds
    reason = models.TextField(blank=True)
    checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-sent_at"]
        indexes = [models.Index(fields=["node", "sent_at"]), models.Index(fields=["state", "deadline_at"])]

    @property
    def span(self) -> Span:
        return Span(self.model, self.layer_start, self.layer_end)

    def __str__(self) -> str:
        return f"challenge {self.pk} of {self.node_id} ({self.state})"


class Audit(models.Model):
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="audits")
    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="audits")
    session = models.CharField(max_length=64)
    stage = models.PositiveIntegerField()  # position in the job's pipeline
    model = models.CharField(max_length=128)
    layer_start = models.PositiveIntegerField()
    layer_end = models.PositiveIntegerField()
    material = models.BinaryField()  # worker_agent.protocol.audit.AuditMaterial.to_bytes()
    state = models.CharField(max_length=16, choices=CheckState.choices, default=CheckState.PENDING)
    metrics = models.JSONField(default=dict)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.UniqueConstraint(fields=["job", "session", "stage"], name="one_audit_per_stage")]

    @property
    def span(self) -> Span:
        return Span(self.model, self.layer_start, self.layer_end)

    def __str__(self) -> str:
        return f"audit {self.pk} of {self.node_id} in job {self.job_id} ({self.state})"


class StrikeKind(models.TextChoices):
    CHALLENGE = "challenge", "failed challenge"
    AUDIT = "audit", "failed audit"
    RECEIPT = "receipt", "unverifiable receipt"  # it made a job's receipts fail (none, not its own, false)
    CAPACITY = "capacity", "false capacity claim"  # far more speed, or shorter round trips, than measured
    FAILURES = "failures", "repeated failures"  # stalls, drops and refusals attributed to it, past a threshold
    PROTOCOL = "protocol", "protocol breach"  # a breach proven by its own signatures (a second peer connection)


class StrikeState(models.TextChoices):
    OPEN = "open", "open"  # withholds the node's pending pay until decided
    UPHELD = "upheld", "upheld"  # pending pay in the window clawed back; counts toward ejection
    OVERTURNED = "overturned", "overturned"  # an admin found it unjustified (with a reason)


class Strike(models.Model):
    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="strikes")
    kind = models.CharField(max_length=16, choices=StrikeKind.choices)
    challenge = models.OneToOneField(Challenge, on_delete=models.PROTECT, null=True, blank=True, related_name="strike")
    audit = models.OneToOneField(Audit, on_delete=models.PROTECT, null=True, blank=True, related_name="strike")
    # A receipt strike's job: the node made its receipts fail verification.
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, null=True, blank=True, related_name="strikes")
    evidence = models.JSONField(default=dict)  # kind, seed or job, per-token cosine and rel_norm, timings
    state = models.CharField(max_length=16, choices=StrikeState.choices, default=StrikeState.OPEN)
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    decision_reason = models.TextField(blank=True)
    clawed_back = models.BigIntegerField(default=0)  # nano-dollars taken back from pending earnings

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["node", "state"])]
        constraints = [
            # A capacity strike may stand on its figures alone: a claim and the measurement that
            # contradicts it (round trips reported by a link's two ends: no check or job behind it).
            models.CheckConstraint(
                condition=models.Q(challenge__isnull=False)
                | models.Q(audit__isnull=False)
                | models.Q(job__isnull=False)
                | models.Q(kind="capacity"),
                name="strike_has_evidence",
            ),
            models.CheckConstraint(
                condition=~models.Q(state="overturned") | ~models.Q(decision_reason=""),
                name="overturn_needs_reason",
            ),
        ]

    def __str__(self) -> str:
        return f"strike {self.pk} on {self.node_id} ({self.kind}, {self.state})"
