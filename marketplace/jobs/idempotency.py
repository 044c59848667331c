"""``Idempotency-Key``: a request retried with the same key gets the first attempt's answer, and is
charged once.

A client that timed out, or whose connection dropped, cannot know whether its request ran. Sent
again with the same ``Idempotency-Key`` header (any 1-255 visible ASCII characters, unique per
customer) and the same body:

- the first attempt answered: its whole response is sent again (streamed again when asked for a
  stream), with ``Idempotent-Replayed: true``; no job runs, nothing is charged;
- the first attempt is still being answered: the retry waits for that answer;
- the first attempt failed or its client left before the answer (its jobs were stopped and charged
  for what they produced, as always): the retry runs as a new request.

The same key with another body is refused (400 ``idempotency_key_reused``). Keys, and the answers
kept for them, are forgotten SWARM_IDEMPOTENCY_TTL_S (24 h) after their attempt began.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.jobs.errors import InvalidRequest
from marketplace.jobs.models import FINAL_STATES, IdempotentRequest, Job

KEY = re.compile(r"[\x21-\x7e]{1,255}")  # visible ASCII, as a header carries it
# An attempt whose jobs all ended this long ago and that stored no answer was lost with its web
# process: a retry runs afresh.
LOST_AFTER_S = 30.0

State = IdempotentRequest.State


@dataclass(frozen=True)
class Claim:
    record: int  # the IdempotentRequest's pk
    replay: dict | None = None  # the first attempt's whole response, to send again
    wait: bool = False  # the first attempt is still being answered


def check_key(value: str) -> str:
    if not KEY.fullmatch(value):
        raise InvalidRequest(
            "The Idempotency-Key header must be 1 to 255 visible ASCII characters.",
            param=None,
            code="invalid_idempotency_key",
        )
    return value


def body_digest(body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@transaction.atomic
def claim(customer, key: str, digest: str, now: datetime | None = None) -> Claim:
    """Claim ``key`` for a request whose body hashes to ``digest``: run it, replay the answer kept,
    or wait for the attempt in flight. InvalidRequest when the key came with another body."""
    now = now or timezone.now()
    record, created = IdempotentRequest.objects.get_or_create(
        customer=customer, key=key, defaults={"body_sha256": digest, "created_at": now}
    )
    if created:
        return Claim(record.pk)
    record = IdempotentRequest.objects.select_for_update().get(pk=record.pk)
    expired = record.created_at < now - timedelta(seconds=settings.SWARM_IDEMPOTENCY_TTL_S)
    if not expired and record.body_sha256 != digest:
        raise InvalidRequest(
            "This Idempotency-Key was already used with a different request body; use a new key for a new request.",
            param=None,
            code="idempotency_key_reused",
        )
    if not expired and record.state == State.DONE:
        return Claim(record.pk, replay=record.response)
    if not expired and record.state == State.RUNNING and not _lost(record, now):
        return Claim(record.pk, wait=True)
    record.body_sha256, record.state, record.job, record.response, record.created_at = (
        digest,
        State.RUNNING,
        None,
        None,
        now,
    )
    record.save()
    return Claim(record.pk)


def _lost(record: IdempotentRequest, now: datetime) -> bool:
    """Whether a running attempt is gone without a word (its web process ended mid-request)."""
    cutoff = now - timedelta(seconds=LOST_AFTER_S)
    if record.job_id is None:  # not admitted yet: admission takes well under this
        return record.created_at < cutoff
    choices = Job.objects.filter(pk=record.job_id) | Job.objects.filter(first_choice_id=record.job_id)
    return not choices.exclude(state__in=FINAL_STATES).exists() and not choices.filter(finished_at__gte=cutoff).exists()


def attach(record: int, job: Job) -> None:
    """The attempt was admitted: ``job`` is its choice 0."""
    IdempotentRequest.objects.filter(pk=record, state=State.RUNNING).update(job=job)


def complete(record: int, response: dict) -> None:
    """The attempt was answered with ``response`` (the whole response, as a non-streamed request gets it)."""
    IdempotentRequest.objects.filter(pk=record, state=State.RUNNING).update(state=State.DONE, response=response)


def abandon(record: int) -> None:
    """The attempt failed, or its client left before the answer: a retry runs afresh."""
    IdempotentRequest.objects.filter(pk=record, state=State.RUNNING).update(state=State.ABANDONED)


def forget_expired(now: datetime | None = None) -> int:
    """Delete the keys (and the answers kept for them) past SWARM_IDEMPOTENCY_TTL_S; periodic."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.SWARM_IDEMPOTENCY_TTL_S)
    deleted, _ = IdempotentRequest.objects.filter(created_at__lt=cutoff).delete()
    return deleted
