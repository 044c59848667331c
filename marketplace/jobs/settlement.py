"""A job's money, in one place: the hold at admission, the settlement when it ends, the providers' shares.

- ``place_hold(job)``: price x (prompt tokens + max tokens) moves from the customer's credit to their
  hold account before any agent is touched (``InsufficientCredits`` when it does not fit).
- ``settle(job_pk)``: exactly once per ended job, the charge for the tokens delivered goes from the
  hold to platform revenue and the rest returns to credit; a job that delivered nothing is charged
  nothing. In the same transaction the control plane verifies the job's receipts again itself, against
  the route it assigned and the coordinator's transcripts: a verified job's stages are credited their
  share of the charge (``payouts.services.credit_earnings``); one that fails is marked unverified with
  the reason and pays nobody.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from marketplace.billing.models import AccountKind
from marketplace.billing.services import Move, accounts, cost, prices_for, transfer_many
from marketplace.jobs.models import FINAL_STATES, Job
from marketplace.jobs.route import route_assignments
from marketplace.payouts.services import credit_earnings
from worker_agent import model as models
from worker_agent.coverage import JobVerification, verify_job
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
    """Settle an ended job's hold once: charge the delivered tokens, release the rest, credit the
    stages of a verified job. Returns the charge."""
    job = Job.objects.select_for_update().get(pk=job_pk)
    if job.settled_at is not None or job.state not in FINAL_STATES:
        return job.charged_amount
    prices = (job.price_prompt_per_million, job.price_completion_per_million)
    charge = cost(job.prompt_tokens, job.completion_tokens, prices) if job.completion_tokens else 0
    charge = min(charge, job.hold_amount)
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
        moves.append(Move(hold, found[(AccountKind.CUSTOMER_CREDIT, owner)], release, kind="release", job=job))
    transfer_many(moves)
    job.charged_amount = charge
    job.settled_at = timezone.now()
    job.settle_flagged, job.settle_retry_at = False, None  # settled: nothing left for an admin (the error stays)
    job.save(update_fields=["charged_amount", "settled_at", "settle_flagged", "settle_retry_at"])
    _credit_verified_work(job)  # in this transaction: the charge and the providers' shares land together
    return charge


def reverify(job: Job) -> JobVerification:
    """Verify the job's stored receipts again, here: the coordinator's ``verified`` flag is its own
    word, and money moves only on this check. It calls the coordinator's ``verify_job`` with the
    same inputs the coordinator had: the assignments of the route this control plane chose, the
    receipts and transcripts as the runner stored them (each decoded once, by its codec).
    Raises a ReceiptError naming the first failure."""
    for name in ("receipts", "transcripts"):
        if not isinstance(getattr(job, name), list):
            raise MalformedReceipt(f"the job's stored {name} must be a list")
    return verify_job(
        job=job.public_id,
        model=models.model_name(job.model),
        n_layers=models.n_layers(job.model),
        assignments=route_assignments(job.route),
        receipts=[Receipt.from_json(r) for r in job.receipts],
        transcripts=[SessionTranscript.from_json(t) for t in job.transcripts],
    )


def _credit_verified_work(job: Job) -> None:
    if job.charged_amount <= 0 or not job.verified:
        return
    try:
        verification = reverify(job)
    except ReceiptError as exc:
        job.verified = False
        job.verification_error = f"control plane re-verification: {exc} ({exc.code})"[:2000]
        job.save(update_fields=["verified", "verification_error"])
        log.warning("job %s: receipts failed re-verification: %s", job.public_id, exc)
        return
    credit_earnings(job, verification.layer_tokens_by_node)
