"""A job's money, in one place: the hold at admission, the settlement when it ends, the providers' shares.

- ``place_hold(job)``: price x (prompt tokens + max tokens) moves from the customer's credit to their
  hold account before any agent is touched (``InsufficientCredits`` when it does not fit).
- ``settle(job_pk)``: exactly once per ended job. The control plane first verifies the job's receipts
  again itself, against the route it assigned and the coordinator's transcripts. The customer is
  charged for the tokens delivered only when that verification holds (or when they cancelled the job
  themselves); a job that failed, or ended unverified, is charged nothing, and the whole hold returns
  to credit with the reason on the ledger. In the same transaction a verified job's stages are
  credited their share of the charge (``payouts.services.credit_earnings``). An unverified job whose
  failure the receipts pin on one node (``coverage.verify_job`` names it on the evidence it signed)
  pays every other stage whose own receipts still prove its part (``coverage.honest_work``) what
  that part was worth, from the platform's revenue; the culprit gets nothing (and a strike, from the
  runner).
- ``reconcile_jobs()``: the periodic sweep behind both. A job whose coordinator went silent (or whose
  coordinator's process is gone: ``jobs.liveness``) is ended as failed, and every ended job whose
  hold is still open is settled, each in its own transaction; one whose settlement raises is tried
  again after a backoff (``settle_failure``), and flagged for admins past SWARM_SETTLE_FLAG_AFTER
  failures in a row.
- A superseded job (a retry of its request's Idempotency-Key ran afresh: ``jobs.idempotency``) is
  charged nothing: its key is charged for one attempt. Its stages are still paid for work that
  verified, from the platform's revenue (the answer was lost on the platform's side or the
  client's, never the stages'). One that had settled already was refunded by the claim that
  superseded it.
- Later, a failed audit of the job refunds its whole charge (``billing.services.refund_charge``, called
  by ``verification.audits``): the customer never pays for work found bad.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from marketplace.billing.models import AccountKind
from marketplace.billing.services import Move, accounts, cost, prices_for, transfer_many
from marketplace.jobs import liveness
from marketplace.jobs.models import FINAL_STATES, Job, JobState
from marketplace.jobs.route import route_assignments
from marketplace.jobs.services import COORDINATOR_LOST, finish_job
from marketplace.payouts.services import credit_earnings
from worker_agent import model as models
from worker_agent.errors import ReceiptError
from worker_agent.protocol.coverage import JobVerification, honest_work, verify_job
from worker_agent.protocol.receipts import MalformedReceipt, Receipt, SessionTranscript

log = logging.getLogger("swarm.jobs")


def hold_terms(model: str, prompt_tokens: int, max_tokens: int) -> dict:
    """A new job's prices (nano-dollars per million prompt and completion tokens, as they stand
    now) and its hold (its worst case: the prompt and ``max_tokens`` at those prices), as the
    job's fields."""
    prices = prices_for(model)
    return {
        "price_prompt_per_million": prices[0],
        "price_completion_per_million": prices[1],
        "hold_amount": cost(prompt_tokens, max_tokens, prices),
    }


@transaction.atomic(savepoint=False)  # admission's transaction is all or none already
def place_hold(job: Job, *, priced: bool = False) -> None:
    """Reserve the job's worst-case price; InsufficientCredits when the credits do not cover it,
    which fails the caller's transaction whole (no savepoint: admission rolls back all of it).
    ``priced``: the job was created with its ``hold_terms`` already (admission does so, saving a
    write); otherwise they are set and saved here."""
    if not priced:
        terms = hold_terms(job.model, job.prompt_tokens, job.params["max_tokens"])
        for name, value in terms.items():
            setattr(job, name, value)
        job.save(update_fields=list(terms))
    if job.hold_amount:
        owner = job.customer_id
        found = accounts([(AccountKind.CUSTOMER_CREDIT, owner), (AccountKind.CUSTOMER_HOLD, owner)])
        credit, hold = found[(AccountKind.CUSTOMER_CREDIT, owner)], found[(AccountKind.CUSTOMER_HOLD, owner)]
        transfer_many([Move(credit, hold, job.hold_amount, kind="hold", job=job)], savepoint=False)


@transaction.atomic
def settle(job_pk: int) -> int:
    """Settle an ended job's hold once: charge the delivered tokens of a verified (or cancelled) job,
    release the rest, credit the stages that proved their work. Returns the charge."""
    job = Job.objects.select_for_update().get(pk=job_pk)
    if job.settled_at is not None or job.state not in FINAL_STATES:
        return job.charged_amount
    verification, culprit = _verdict(job)
    prices = (job.price_prompt_per_million, job.price_completion_per_million)
    worth = min(cost(job.prompt_tokens, job.completion_tokens, prices) if job.completion_tokens else 0, job.hold_amount)
    # A cancelled job stopped at its customer's word: what was delivered is theirs to pay, unless a
    # retry of its Idempotency-Key ran afresh (the retry is what they pay for).
    billable = (job.verified is True or job.state == JobState.CANCELLED) and job.superseded_at is None
    charge = worth if billable else 0
    owner = job.customer_id
    found = accounts(
        [(AccountKind.CUSTOMER_HOLD, owner), (AccountKind.PLATFORM_REVENUE, None), (AccountKind.CUSTOMER_CREDIT, owner)]
    )
    hold = found[(AccountKind.CUSTOMER_HOLD, owner)]
    moves = []
    if charge:
        moves.append(Move(hold, found[(AccountKind.PLATFORM_REVENUE, None)], charge, kind="charge", job=job))
    if job.hold_amount - charge:
        release = job.hold_amount - charge
        memo = "" if billable or not worth else f"not charged: {_why_free(job)}"[:255]
        moves.append(
            Move(hold, found[(AccountKind.CUSTOMER_CREDIT, owner)], release, kind="release", job=job, memo=memo)
        )
    transfer_many(moves)
    job.charged_amount = charge
    job.settled_at = timezone.now()
    job.settle_flagged, job.settle_retry_at = False, None  # settled: nothing left for an admin (the error stays)
    job.save(update_fields=["charged_amount", "settled_at", "settle_flagged", "settle_retry_at"])
    # In this transaction: the charge and the providers' shares land together.
    if verification is not None and job.superseded_at is not None:
        memo = " (platform-paid: a retry of the job's Idempotency-Key ran afresh)"
        credit_earnings(job, verification.layer_tokens_by_node, worth=worth, memo=memo)
    elif verification is not None:
        credit_earnings(job, verification.layer_tokens_by_node)
    elif culprit is not None and worth:
        honest = honest_work(**_verify_args(job), culprit=culprit)
        if honest:
            credit_earnings(job, honest, worth=worth, memo=f" (platform-paid: the job is unverified by {culprit})")
    return charge


def _why_free(job: Job) -> str:
    if job.superseded_at is not None:
        return "a retry of its Idempotency-Key ran afresh (the key is charged for one attempt)"
    if job.state == JobState.FAILED:
        return f"the job failed ({job.error_code or 'error'})"
    return f"the job's work is unverified: {job.verification_error or 'no receipts'}"


def _verdict(job: Job) -> tuple[JobVerification | None, str | None]:
    """The control plane's own verdict on a succeeded job's receipts: its verification, or the node
    the evidence blames (None when it cannot be told). A job the coordinator called verified that
    fails here is marked unverified with the reason."""
    if job.state != JobState.SUCCEEDED or job.verified is None:
        return None, None
    try:
        verification = reverify(job)
    except ReceiptError as exc:
        if job.verified:
            job.verified = False
            job.verification_error = f"control plane re-verification: {exc} ({exc.code})"[:2000]
            job.save(update_fields=["verified", "verification_error"])
            log.warning("job %s: receipts failed re-verification: %s", job.public_id, exc)
        return None, exc.node
    if not job.verified:  # the coordinator could not verify what holds here: it is not paid as verified
        return None, None
    return verification, None


def _verify_args(job: Job) -> dict:
    for name in ("receipts", "transcripts"):
        if not isinstance(getattr(job, name), list):
            raise MalformedReceipt(f"the job's stored {name} must be a list")
    return {
        "job": job.public_id,
        "model": models.model_name(job.model),
        "n_layers": models.n_layers(job.model),
        "assignments": route_assignments(job.route),
        "receipts": [Receipt.from_json(r) for r in job.receipts],
        "transcripts": [SessionTranscript.from_json(t) for t in job.transcripts],
    }


def reverify(job: Job) -> JobVerification:
    """Verify the job's stored receipts again, here: the coordinator's ``verified`` flag is its own
    word, and money moves only on this check. It calls the coordinator's ``verify_job`` with the
    same inputs the coordinator had: the assignments of the route this control plane chose, the
    receipts and transcripts as the runner stored them (each decoded once, by its codec).
    Raises a ReceiptError naming the first failure (and, where the evidence pins it, its node)."""
    return verify_job(**_verify_args(job))


def reconcile_jobs(now=None) -> list[str]:
    """End jobs whose coordinator went silent or whose coordinator's process is gone (its process
    died) as failed, keeping the tokens their record shows delivered, and settle every ended job
    whose hold is still open. Returns job ids.

    Each job settles in its own transaction: one that raises is rolled back alone, recorded
    (``settle_failure``) and tried again only after a backoff, so it never blocks the jobs behind
    it nor fails in a loop; past SWARM_SETTLE_FLAG_AFTER failures in a row it is flagged for admins."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.SWARM_JOB_STALE_S)
    open_jobs = Job.objects.exclude(state__in=FINAL_STATES)
    processes = (
        open_jobs.exclude(coordinator_process="").order_by().values_list("coordinator_process", flat=True).distinct()
    )
    gone = [process for process in processes if liveness.gone(process)]
    stale = open_jobs.annotate(last=Coalesce("progress_at", "started_at", "created_at")).filter(
        Q(last__lt=cutoff) | Q(coordinator_process__in=gone)
    )
    touched = []
    for job in stale:
        if finish_job(
            job.pk,
            state=JobState.FAILED,
            completion_tokens=job.completion_tokens,
            error_code=COORDINATOR_LOST,
            error_message="the job's coordinator stopped reporting",
        ):
            touched.append(job.public_id)
    due = Job.objects.filter(Q(state__in=FINAL_STATES), settled_at__isnull=True).filter(
        Q(settle_retry_at__isnull=True) | Q(settle_retry_at__lte=now)
    )
    for ended in due.only("pk", "public_id").order_by("pk"):
        try:
            settle(ended.pk)  # its own transaction: one job that cannot settle never blocks the others
        except Exception as exc:
            settle_failure(ended.pk, exc, now=now)
            continue
        if ended.public_id not in touched:
            touched.append(ended.public_id)
    return touched


def settle_retry_delay_s(failures: int) -> float:
    """How long to wait before settling a job again after ``failures`` failures in a row: doubling
    from SWARM_SETTLE_RETRY_S, at most SWARM_SETTLE_RETRY_MAX_S."""
    exponent = min(max(failures - 1, 0), 32)  # 2**32 times any base is past every cap
    return min(settings.SWARM_SETTLE_RETRY_S * 2**exponent, settings.SWARM_SETTLE_RETRY_MAX_S)


def settle_failure(job_pk: int, error: BaseException, now: datetime | None = None) -> Job:
    """Record that settling a job raised ``error`` (the settlement itself was rolled back): count
    it, keep the error, put the next try off, and flag the job for admins once it failed
    SWARM_SETTLE_FLAG_AFTER times in a row."""
    now = now or timezone.now()
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_pk)
        job.settle_failures += 1
        job.settle_error = f"{type(error).__name__}: {error}"[:2000]
        job.settle_retry_at = now + timedelta(seconds=settle_retry_delay_s(job.settle_failures))
        job.settle_flagged = job.settle_flagged or job.settle_failures >= settings.SWARM_SETTLE_FLAG_AFTER
        job.save(update_fields=["settle_failures", "settle_error", "settle_retry_at", "settle_flagged"])
    log.error(
        "job %s could not be settled (failure %d%s; next try at %s): %s",
        job.public_id,
        job.settle_failures,
        ", flagged for admins" if job.settle_flagged else "",
        job.settle_retry_at.isoformat(),
        job.settle_error,
        exc_info=error,
    )
    return job
