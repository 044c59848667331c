"""Ledger use cases: accounts, transfers, prices, grants.

Every balance change is one immutable transfer between two accounts. A job's hold and settlement
use these from ``marketplace.jobs.settlement``, which keeps a job's money steps in one place.
"""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from marketplace.billing.errors import InsufficientCredits
from marketplace.billing.models import NANO_PER_DOLLAR, AccountKind, LedgerAccount, ModelPrice, Transfer


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
    amount = int(Decimal(str(dollars)) * NANO_PER_DOLLAR)
    return transfer(
        account(AccountKind.GRANTS), account(AccountKind.CUSTOMER_CREDIT, user), amount, kind="grant", memo=memo
    )
