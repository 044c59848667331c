"""Ledger use cases: transfers, prices, holds at admission, settlement on actual usage.

A job's hold is price x (prompt tokens + max tokens), moved from the customer's credit to their
hold account before any agent is touched; at the end it settles exactly once: the charge for the
tokens delivered goes to platform revenue and the rest returns to credit. A job that delivered
no tokens is charged nothing. In the same transaction a verified job's stages are credited their
share of the charge (``payouts.services.credit_earnings``).
"""

from __future__ import annotations

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from marketplace.billing.models import NANO_PER_DOLLAR, AccountKind, LedgerAccount, ModelPrice, Transfer
from marketplace.jobs.errors import InsufficientCredits


def account(kind: str, owner=None) -> LedgerAccount:
    owner_id = getattr(owner, "pk", owner)
    found, _ = LedgerAccount.objects.get_or_create(kind=kind, owner_id=owner_id)
    return found


@transaction.atomic
def transfer(
    debit: LedgerAccount,
    credit: LedgerAccount,
    amount: int,
    *,
    kind: str,
    job=None,
    reference: str = "",
    memo: str = "",
    allow_negative: bool = False,
) -> Transfer:
    """Move ``amount`` nano-dollars. A customer's credit may not go below zero (InsufficientCredits)
    unless ``allow_negative``: a refund or dispute of money already spent."""
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        raise ValueError(f"a transfer moves a positive whole number of nano-dollars, got {amount!r}")
    # Lock both rows in primary-key order, so concurrent transfers cannot deadlock.
    locked = {
        a.pk: a for a in LedgerAccount.objects.select_for_update().filter(pk__in=[debit.pk, credit.pk]).order_by("pk")
    }
    source = locked[debit.pk]
    if source.kind == AccountKind.CUSTOMER_CREDIT and not allow_negative and source.balance < amount:
        raise InsufficientCredits("Insufficient credits: top up your balance to continue.")
    try:
        with transaction.atomic():
            LedgerAccount.objects.filter(pk=debit.pk).update(balance=F("balance") - amount)
            LedgerAccount.objects.filter(pk=credit.pk).update(balance=F("balance") + amount)
    except IntegrityError as exc:  # customer_hold_not_negative: a bug, never a customer's doing
        raise ValueError(f"transfer of {amount} would take a hold below zero") from exc
    return Transfer.objects.create(
        debit=debit, credit=credit, amount=amount, kind=kind, job=job, reference=reference, memo=memo
    )


def prices_for(model: str) -> tuple[int, int]:
    """(prompt, completion) nano-dollars per million tokens in force now."""
    price = ModelPrice.objects.filter(model=model, effective_from__lte=timezone.now()).first()
    if price is not None:
        return price.prompt_per_million, price.completion_per_million
    prompt, completion = settings.SWARM_DEFAULT_PRICES
    return prompt, completion


def cost(prompt_tokens: int, completion_tokens: int, prices: tuple[int, int]) -> int:
    """Nano-dollars for the tokens, rounded up to a whole nano-dollar."""
    numerator = prompt_tokens * prices[0] + completion_tokens * prices[1]
    return -(-numerator // 1_000_000)


def credits(user) -> int:
    return account(AccountKind.CUSTOMER_CREDIT, user).balance


@transaction.atomic
def grant(user, dollars: int | str, *, memo: str = "granted credits") -> Transfer:
    from decimal import Decimal

    amount = int(Decimal(str(dollars)) * NANO_PER_DOLLAR)
    return transfer(
        account(AccountKind.GRANTS), account(AccountKind.CUSTOMER_CREDIT, user), amount, kind="grant", memo=memo
    )


@transaction.atomic
def place_hold(job) -> None:
    """Reserve the job's worst-case price; 402 when the credits do not cover it."""
    prices = prices_for(job.model)
    hold = cost(job.prompt_tokens, job.params["max_tokens"], prices)
    job.price_prompt_per_million, job.price_completion_per_million = prices
    job.hold_amount = hold
    job.save(update_fields=["price_prompt_per_million", "price_completion_per_million", "hold_amount"])
    if hold:
        customer = job.customer
        transfer(
            account(AccountKind.CUSTOMER_CREDIT, customer),
            account(AccountKind.CUSTOMER_HOLD, customer),
            hold,
            kind="hold",
            job=job,
        )


@transaction.atomic
def settle(job_pk: int) -> int:
    """Settle an ended job's hold once: charge the delivered tokens, release the rest. Returns the charge."""
    from marketplace.jobs.models import FINAL_STATES, Job

    job = Job.objects.select_for_update().get(pk=job_pk)
    if job.settled_at is not None or job.state not in FINAL_STATES:
        return job.charged_amount
    prices = (job.price_prompt_per_million, job.price_completion_per_million)
    charge = cost(job.prompt_tokens, job.completion_tokens, prices) if job.completion_tokens else 0
    charge = min(charge, job.hold_amount)
    hold = account(AccountKind.CUSTOMER_HOLD, job.customer)
    if charge:
        transfer(hold, account(AccountKind.PLATFORM_REVENUE), charge, kind="charge", job=job)
    if job.hold_amount - charge:
        transfer(
            hold, account(AccountKind.CUSTOMER_CREDIT, job.customer), job.hold_amount - charge, kind="release", job=job
        )
    job.charged_amount = charge
    job.settled_at = timezone.now()
    job.save(update_fields=["charged_amount", "settled_at"])
    from marketplace.payouts.services import credit_earnings

    credit_earnings(job)  # in this transaction: the charge and the providers' shares land together
    return charge
