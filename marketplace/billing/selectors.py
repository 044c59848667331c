"""Read queries for customers: balance, transactions, money as people read it (usage: ``jobs.selectors``)."""

from __future__ import annotations

from decimal import Decimal

from django.db.models import Q, Sum

from marketplace.billing.models import NANO_PER_DOLLAR, AccountKind, LedgerAccount, Transfer

CREDIT_KINDS = ("grant", "topup")


def dollars(nano: int | None) -> Decimal:
    return (Decimal(nano or 0) / NANO_PER_DOLLAR).quantize(Decimal("0.000000001"))


def money(nano: int | None) -> str:
    """Dollars as a fixed-point string with nine decimals, e.g. "0.000061000"."""
    return format(dollars(nano), "f")


def per_token(per_million: int) -> str:
    """A per-million-tokens price in nano-dollars as dollars per token, a decimal string."""
    return format((Decimal(per_million) / NANO_PER_DOLLAR / 1_000_000).normalize(), "f")


def balance(user) -> dict:
    accounts = {a.kind: a.balance for a in LedgerAccount.objects.filter(owner=user)}
    return {
        "available": dollars(accounts.get(AccountKind.CUSTOMER_CREDIT, 0)),
        "on_hold": dollars(accounts.get(AccountKind.CUSTOMER_HOLD, 0)),
    }


def totals(user) -> dict:
    """All credits ever added, and all usage ever charged, in dollars."""
    credited = Transfer.objects.filter(
        credit__owner=user, credit__kind=AccountKind.CUSTOMER_CREDIT, kind__in=CREDIT_KINDS
    ).aggregate(s=Sum("amount"))["s"]
    charged = Transfer.objects.filter(
        debit__owner=user, debit__kind=AccountKind.CUSTOMER_HOLD, kind="charge"
    ).aggregate(s=Sum("amount"))["s"]
    return {"total_credits": dollars(credited), "total_usage": dollars(charged)}


def transactions(user, limit: int = 100, *, job: str = "") -> list[dict]:
    """The customer's ledger movements, newest first, signed from their point of view; only those
    of the request whose completion id is ``job`` when it is given."""
    rows = Transfer.objects.filter(Q(credit__owner=user) | Q(debit__owner=user))
    if job:
        rows = rows.filter(job__public_id=job)
    rows = rows.select_related("credit", "debit", "job").order_by("-id")[:limit]
    result = []
    for t in rows:
        mine_in = t.credit.owner_id == user.pk
        if mine_in and t.debit.owner_id == user.pk:  # between their own accounts: as spendable credit sees it
            mine_in = t.credit.kind == AccountKind.CUSTOMER_CREDIT
        result.append(
            {
                "id": t.pk,
                "at": t.created_at.isoformat(),
                "kind": t.kind,
                "account": (t.credit if mine_in else t.debit).kind,
                "amount": money(t.amount if mine_in else -t.amount),
                "job": t.job.public_id if t.job else None,
                "memo": t.memo,
            }
        )
    return result
