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
- Later, a failed audit of the job refunds its whole charge (``billing.services.refund_charge``, called
  by ``verification.audits``): the customer never pays for work found bad.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from marketplace.billing.models import AccountKind
from marketplace.billing.services import Move, accounts, cost, prices_for, transfer_many
from marketplace.jobs.models import FINAL_STATES, Job, JobState
from marketplace.jobs.route import route_assignments
from marketplace.payouts.services import credit_earnings
from worker_agent import model as models
from worker_agent.coverage import JobVerification, honest_work, verify_job
from worker_agent.errors import ReceiptError
from worker_agent.receipts import MalformedReceipt, Receipt, SessionTranscript

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
    # A cancelled job stopped at its customer's word: what was delivered is theirs to pay.
    billable = job.verified is True or job.state == JobState.CANCELLED
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
    if verification is not None:
        credit_earnings(job, verification.layer_tokens_by_node)
    elif culprit is not None and worth:
        honest = honest_work(**_verify_args(job), culprit=culprit)
        if honest:
            credit_earnings(job, honest, worth=worth, memo=f" (platform-paid: the job is unverified by {culprit})")
    return charge


def _why_free(job: Job) -> str:
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
