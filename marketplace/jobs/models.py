"""API keys and jobs: one job per inference request."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from marketplace.nodes.models import Privacy


class ApiKey(models.Model):
    """A customer's API key: the full key is shown once; only its sha256 is stored."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=24, unique=True)  # shown in listings, e.g. "sk-sw-3f9a1c2b"
    key_hash = models.CharField(max_length=64, unique=True)
    requests_per_minute = models.PositiveIntegerField(default=60)
    tokens_per_minute = models.PositiveIntegerField(default=100_000)
    privacy = models.CharField(max_length=16, choices=Privacy.choices, default=Privacy.ANY)  # every request's floor
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class JobState(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"


FINAL_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class Job(models.Model):
    public_id = models.CharField(max_length=64, unique=True)  # the response id, e.g. "chatcmpl-..."
    kind = models.CharField(max_length=16)  # "chat" or "completion"
    # The HTTP request that admitted it (``req_<hex>``, its x-request-id header, which its customer
    # can quote); every choice of that request has it, and so does every line its run logs.
    request_id = models.CharField(max_length=64, blank=True)
    customer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    api_key = models.ForeignKey(ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="jobs")
    model = models.CharField(max_length=128)
    params = models.JSONField(default=dict)  # RequestParams.to_json(): max_tokens, temperature, top_p, seed, stop, ...
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.QUEUED)
    # A request asking for n choices runs n jobs: choice 0 carries the response's id, and each
    # other choice points to it (``first_choice``) with its index.
    choice_index = models.PositiveSmallIntegerField(default=0)
    first_choice = models.ForeignKey(
        "self", on_delete=models.CASCADE, null=True, blank=True, related_name="other_choices"
    )
    finish_reason = models.CharField(max_length=16, blank=True)  # "stop" or "length"
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)

    privacy = models.CharField(max_length=16, choices=Privacy.choices, default=Privacy.ANY)  # its key's or its own
    route = models.JSONField(default=list)  # [{node, node_key, url, layer_start, layer_end}] in order
    # Each heal of the route mid-request, oldest first: {at (ISO 8601), failed_node, reason,
    # route_before}; ``route`` is the route after the last one.
    heals = models.JSONField(default=list)
    coordinator_region = models.CharField(max_length=64, blank=True)
    # The coordinator process running it (``liveness.this_process``), set when it starts: a job whose
    # process is gone ends at once rather than after SWARM_JOB_STALE_S of silence. "" embedded.
    coordinator_process = models.CharField(max_length=128, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    # The prompt as the model's token ids, tokenized once at admission; the coordinator runs these.
    prompt_ids = models.JSONField(default=list)
    completion_tokens = models.PositiveIntegerField(default=0)  # tokens delivered to the client
    ttft_ms = models.FloatField(null=True, blank=True)
    tokens_per_s = models.FloatField(null=True, blank=True)  # decode rate, first to last token
    # A succeeded job's pace as its stages kept it, for challenges to keep to: per stage of its route,
    # when it put out each of its session's first steps, in seconds from the coordinator's HELLOs
    # (``verification.traffic.kept_step_outputs``); [] for any other job, or one healed onto another route.
    step_outputs_s = models.JSONField(default=list, blank=True)
    drafted_tokens = models.PositiveIntegerField(default=0)  # speculative drafts the pipeline verified
    accepted_tokens = models.PositiveIntegerField(default=0)  # ... of which accepted (committed as drafted)

    # Billing: the price in force at admission (nano-dollars per million tokens), the hold placed
    # then, and the charge it settled to (nano-dollars).
    price_prompt_per_million = models.BigIntegerField(default=0)
    price_completion_per_million = models.BigIntegerField(default=0)
    hold_amount = models.BigIntegerField(default=0)
    charged_amount = models.BigIntegerField(default=0)
    settled_at = models.DateTimeField(null=True, blank=True)
    # A retry of its request's Idempotency-Key ran afresh: this job's answer never reached its client
    # whole, and the key is charged for one attempt only (``jobs.idempotency``), so it is charged
    # nothing, or refunded when it had settled already (``flows.settlement``).
    superseded_at = models.DateTimeField(null=True, blank=True)
    # A settlement that raised: how many times in a row, the last error, and when the periodic
    # reconcile tries again (backing off); past SWARM_SETTLE_FLAG_AFTER failures it is flagged
    # for admins (Django admin, Jobs filtered by "settlement flagged").
    settle_failures = models.PositiveIntegerField(default=0)
    settle_error = models.TextField(blank=True)
    settle_retry_at = models.DateTimeField(null=True, blank=True)
    settle_flagged = models.BooleanField(default=False)

    receipts = models.JSONField(default=list)  # the stages' signed receipts (JSON form)
    # The coordinator's own record of each session: sha256 (hex) of the bytes it sent to the first
    # stage and received from the last, per step: [{session, sent: [...], received: [...]}].
    transcripts = models.JSONField(default=list)
    audit_stages = models.JSONField(default=list)  # pipeline positions whose sessions are audited (secret)
    verified = models.BooleanField(null=True)  # None until the job ended with receipts
    verification_error = models.TextField(blank=True)

    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # A running job's coordinator writes its progress (completion_tokens so far) at least every
    # flows.progress.PROGRESS_INTERVAL_S; a job silent past SWARM_JOB_STALE_S is reconciled from this record.
    progress_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["customer", "created_at"]), models.Index(fields=["state"])]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.state})"


class IdempotentRequest(models.Model):
    """A request sent with an ``Idempotency-Key``: a retry with the same key and body gets the first
    one's answer again instead of running (and being charged) twice. Kept SWARM_IDEMPOTENCY_TTL_S."""

    class State(models.TextChoices):
        RUNNING = "running", "running"  # the request that claimed the key is being answered
        DONE = "done", "done"  # answered: ``response`` is sent again to a retry
        ABANDONED = "abandoned", "abandoned"  # it failed or its client left: a retry runs afresh

    customer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    body_sha256 = models.CharField(max_length=64)  # of the request body, canonical JSON
    state = models.CharField(max_length=16, choices=State.choices, default=State.RUNNING)
    job = models.ForeignKey(Job, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")  # choice 0
    response = models.JSONField(null=True, blank=True)  # the whole response, once answered
    created_at = models.DateTimeField()  # when this attempt claimed the key
    # The web process answering this attempt (``liveness.this_process``): once it is gone, the attempt
    # is lost and a retry runs afresh at once. "" embedded, where the clocks decide (LOST_AFTER_S).
    owner = models.CharField(max_length=128, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["customer", "key"], name="one_request_per_idempotency_key")]
        indexes = [models.Index(fields=["created_at"])]
