"""Ledger use cases: accounts, transfers, prices, grants.

Every balance change is one immutable transfer between two accounts. A job's hold and settlement
use these from ``marketplace.flows.settlement``, which keeps a job's money steps in one place.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import BigIntegerField, Case, F, Value, When
from django.utils import timezone

from marketplace.billing.errors import InsufficientCredits
from marketplace.billing.models import NANO_PER_DOLLAR, AccountKind, LedgerAccount, ModelPrice, Transfer
from worker_agent.checkpoints import ref_name

# The dashboard's billing page (``web.urls`` serves it here): named in a 402 from any process, an
# inference-only one too, whose URLs hold no dashboard to reverse.
BILLING_PAGE = "/customer/billing/"


def add_credits_url() -> str:
    """Where a customer adds credits: the billing page, at SWARM_PUBLIC_URL when it is set."""
    return settings.SWARM_PUBLIC_URL + BILLING_PAGE


def insufficient_credits_message() -> str:
    return f"Insufficient credits: add credits at {add_credits_url()} to continue."


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
        raise InsufficientCredits(insufficient_credits_message())
    try:
        with transaction.atomic():
            LedgerAccount.objects.filter(pk=debit.pk).update(balance=F("balance") - amount)
            LedgerAccount.objects.filter(pk=credit.pk).update(balance=F("balance") + amount)
    except IntegrityError as exc:  # customer_hold_not_negative: a bug, never a customer's doing
        raise ValueError(f"transfer of {amount} would take a hold below zero") from exc
    return Transfer.objects.create(
        debit=debit, credit=credit, amount=amount, kind=kind, job=job, reference=reference, memo=memo
    )


@dataclass(frozen=True)
class Move:
    """One transfer of ``transfer_many``: ``transfer``'s arguments."""

    debit: LedgerAccount
    credit: LedgerAccount
    amount: int
    kind: str
    job: Any = None
    reference: str = ""
    memo: str = ""


def accounts(wanted: Iterable[tuple[str, Any]]) -> dict[tuple[str, int | None], LedgerAccount]:
    """The accounts of ``(kind, owner)`` pairs (an owner, its pk, or None for the platform's), by
    ``(kind, owner pk)``: those that exist in one query, the others created as ``account`` does."""
    keys = {(kind, getattr(owner, "pk", owner)) for kind, owner in wanted}
    found: dict[tuple[str, int | None], LedgerAccount] = {}
    owned = [(kind, owner) for kind, owner in keys if owner is not None]
    platform = [kind for kind, owner in keys if owner is None]
    query = LedgerAccount.objects.none()
    if owned:
        query = LedgerAccount.objects.filter(
            kind__in={kind for kind, _ in owned}, owner_id__in={owner for _, owner in owned}
        )
    if platform:
        query = query | LedgerAccount.objects.filter(kind__in=platform, owner__isnull=True)
    for row in query:
        found[(row.kind, row.owner_id)] = row
    for kind, owner in keys - found.keys():
        found[(kind, owner)] = account(kind, owner)
    return found


def transfer_many(moves: Sequence[Move], *, savepoint: bool = True) -> list[Transfer]:
    """Make each of ``moves`` as ``transfer`` would, in one transaction and three statements: the
    accounts locked once (in primary-key order, as ``transfer`` locks them), every balance changed
    by its net amount in one update, the transfers written in one insert. The moves are checked in
    order against the locked balances first, so nothing is written when one fails: a customer's
    credit may not go below zero (InsufficientCredits) nor a hold (ValueError, a bug).

    Inside a caller's transaction, the moves take a savepoint of their own, so that the caller
    may go on after a failure; ``savepoint=False`` spares its two statements when a failure fails
    the caller's whole transaction anyway (admission's hold)."""
    with transaction.atomic(savepoint=savepoint):
        return _transfer_many(moves)


def _transfer_many(moves: Sequence[Move]) -> list[Transfer]:
    for move in moves:
        if not isinstance(move.amount, int) or isinstance(move.amount, bool) or move.amount <= 0:
            raise ValueError(f"a transfer moves a positive whole number of nano-dollars, got {move.amount!r}")
        if move.debit.pk == move.credit.pk:
            raise ValueError(f"a transfer is between two accounts, not {move.debit} and itself")
    if not moves:
        return []
    ids = sorted({move.debit.pk for move in moves} | {move.credit.pk for move in moves})
    locked = {a.pk: a for a in LedgerAccount.objects.select_for_update().filter(pk__in=ids).order_by("pk")}
    balance = {pk: row.balance for pk, row in locked.items()}
    net: dict[int, int] = defaultdict(int)
    for move in moves:
        kind = locked[move.debit.pk].kind
        if kind == AccountKind.CUSTOMER_CREDIT and balance[move.debit.pk] < move.amount:
            raise InsufficientCredits(insufficient_credits_message())
        if kind == AccountKind.CUSTOMER_HOLD and balance[move.debit.pk] < move.amount:
            raise ValueError(f"transfer of {move.amount} would take a hold below zero")
        balance[move.debit.pk] -= move.amount
        balance[move.credit.pk] += move.amount
        net[move.debit.pk] -= move.amount
        net[move.credit.pk] += move.amount
    changes = {pk: change for pk, change in net.items() if change}
    if changes:
        by_account = Case(
            *(When(pk=pk, then=Value(change)) for pk, change in changes.items()), output_field=BigIntegerField()
        )
        LedgerAccount.objects.filter(pk__in=changes).update(balance=F("balance") + by_account)
    return Transfer.objects.bulk_create(
        Transfer(
            debit=move.debit,
            credit=move.credit,
            amount=move.amount,
            kind=move.kind,
            job=move.job,
            reference=move.reference,
            memo=move.memo,
        )
        for move in moves
    )


def refund_charge(job, reason: str) -> int:
    """Inside the caller's transaction: return a settled job's whole charge to its customer's credit,
    once, with ``reason`` on the ledger entry (a failed audit found its work bad). Returns the amount
    refunded (0 when nothing was charged, or it was refunded already)."""
    job = type(job).objects.select_for_update().get(pk=job.pk)  # one refund, whoever else fails an audit of it
    if job.charged_amount <= 0 or Transfer.objects.filter(job=job, kind="refund").exists():
        return 0
    found = accounts([(AccountKind.PLATFORM_REVENUE, None), (AccountKind.CUSTOMER_CREDIT, job.customer_id)])
    transfer_many(
        [
            Move(
                found[(AccountKind.PLATFORM_REVENUE, None)],
                found[(AccountKind.CUSTOMER_CREDIT, job.customer_id)],
                job.charged_amount,
                kind="refund",
                job=job,
                memo=reason[:255],
            )
        ]
    )
    return job.charged_amount


def prices_for(model: str) -> tuple[int, int]:
    """(prompt, completion) nano-dollars per million tokens in force now. Prices are set by model
    name: a catalog model ref (``name@<hash>``) pays its name's prices."""
    price = ModelPrice.objects.filter(model=ref_name(model), effective_from__lte=timezone.now()).first()
    if price is not None:
        return price.prompt_per_million, price.completion_per_million
    prompt, completion = settings.SWARM_DEFAULT_PRICES
    return prompt, completion


def set_prices(model: str, prompt_per_million: int, completion_per_million: int) -> ModelPrice | None:
    """Put new prices (nano-dollars per million tokens) in force now for the model named ``model``:
    a new row, so that the price each job paid stays on record; None when they are in force already."""
    for value in (prompt_per_million, completion_per_million):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"a price is a whole number of nano-dollars >= 0, got {value!r}")
    wanted = (prompt_per_million, completion_per_million)
    if ModelPrice.objects.filter(model=model).exists() and prices_for(model) == wanted:
        return None
    return ModelPrice.objects.create(
        model=model,
        prompt_per_million=prompt_per_million,
        completion_per_million=completion_per_million,
        effective_from=timezone.now(),
    )


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
