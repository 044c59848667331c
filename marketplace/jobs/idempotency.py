"""``Idempotency-Key``: a request retried with the same key gets the first attempt's answer, and is
charged once.

A client that timed out, or whose connection dropped, cannot know whether its request ran. Sent
again with the same ``Idempotency-Key`` header (any 1-255 visible ASCII characters, unique per
customer) and the same body:

- the first attempt answered: its whole response is sent again (streamed again when asked for a
  stream), with ``Idempotent-Replayed: true``; no job runs, nothing is charged;
- the first attempt is still being answered: the retry waits for that answer;
- the first attempt failed, its client left before the answer, or it was lost with the web process
  answering it (``liveness``: gone once that process stopped signing its life; an attempt of a
  process that signs none is lost LOST_AFTER_S after its jobs ended): the retry runs as a new
  request, and it supersedes the attempt before it.

A key is charged for one attempt at most: the one whose answer its client got, or the last one.
Superseding an attempt marks its jobs (``Job.superseded_at``): one not yet settled is charged
nothing (``flows.settlement``), one already settled is refunded here, in the claim's transaction,
and the ones still running are returned for the caller to stop. The server cannot tell a client
that left from a connection that was cut under it (a web process or a load balancer gone): either
way that attempt's answer did not reach the client whole, and its retry is not charged twice.

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
from django.db.models import Q
from django.utils import timezone

from marketplace.billing.services import refund_charge
from marketplace.jobs import liveness
from marketplace.jobs.errors import InvalidRequest
from marketplace.jobs.models import FINAL_STATES, IdempotentRequest, Job

KEY = re.compile(r"[\x21-\x7e]{1,255}")  # visible ASCII, as a header carries it
# An attempt whose jobs all ended this long ago and that stored no answer was lost with its web
# process: a retry runs afresh. (An attempt whose web process is known gone is lost at once.)
LOST_AFTER_S = 30.0
SUPERSEDED_REFUND = "refunded: a retry of its Idempotency-Key ran afresh (the key is charged for one attempt)"

State = IdempotentRequest.State


@dataclass(frozen=True)
class Claim:
    record: int  # the IdempotentRequest's pk
    replay: dict | None = None  # the first attempt's whole response, to send again
    wait: bool = False  # the first attempt is still being answered
    superseded: tuple[str, ...] = ()  # public ids of the superseded attempt's jobs still running: to be stopped


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
    or wait for the attempt in flight. InvalidRequest when the key came with another body. The
    attempt is this process's (``liveness.this_process``): it is lost once this process is gone."""
    now = now or timezone.now()
    owner = liveness.this_process()
    record, created = IdempotentRequest.objects.get_or_create(
        customer=customer, key=key, defaults={"body_sha256": digest, "created_at": now, "owner": owner}
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
    # An expired key's attempt is another request's, answered or not: only a live key's is superseded.
    running = () if expired or record.job_id is None else _supersede(record.job_id, now)
    record.body_sha256, record.state, record.job, record.response, record.created_at, record.owner = (
        digest,
        State.RUNNING,
        None,
        None,
        now,
        owner,
    )
    record.save()
    return Claim(record.pk, superseded=running)


def _lost(record: IdempotentRequest, now: datetime) -> bool:
    """Whether a running attempt is gone without a word (its web process ended mid-request): its
    web process is gone, or its jobs all ended LOST_AFTER_S ago and it kept no answer, or (an
    unstamped attempt's only clue) it was not admitted within LOST_AFTER_S. A live web process may
    hold a request in its admission queue for longer (SWARM_QUEUE_WAIT_S)."""
    if liveness.gone(record.owner):
        return True
    cutoff = now - timedelta(seconds=LOST_AFTER_S)
    if record.job_id is None:
        return not record.owner and record.created_at < cutoff
    choices = Job.objects.filter(pk=record.job_id) | Job.objects.filter(first_choice_id=record.job_id)
    return not choices.exclude(state__in=FINAL_STATES).exists() and not choices.filter(finished_at__gte=cutoff).exists()


def _supersede(first_choice: int, now: datetime) -> tuple[str, ...]:
    """Mark the jobs of the attempt whose choice 0 is ``first_choice`` superseded, refund the ones
    that settled with a charge already, and return the public ids of those still running. Inside the
    claim's transaction: the mark and the refund commit with the new attempt, or neither does. A
    settlement in flight holds the job's row until it commits; this waits for it and refunds."""
    jobs = Job.objects.filter(Q(pk=first_choice) | Q(first_choice_id=first_choice))
    jobs.filter(superseded_at__isnull=True).update(superseded_at=now)
    for job in jobs.filter(settled_at__isnull=False, charged_amount__gt=0).order_by("pk"):
        refund_charge(job, SUPERSEDED_REFUND)
    return tuple(jobs.exclude(state__in=FINAL_STATES).order_by("pk").values_list("public_id", flat=True))


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
