"""Read queries about earnings and payouts."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Count, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from marketplace.payouts.models import Earning, EarningState, Payout


def sessions_per_day(node, now=None) -> float:
    """The node's verified jobs over the last day (one earning per verified job and node)."""
    now = now or timezone.now()
    return float(Earning.objects.filter(node=node, created_at__gte=now - timedelta(days=1)).count())


def earnings_summary(provider) -> dict[str, int]:
    """Nano-dollars by state: pending, available (incl. batched, not yet sent), paid, clawed_back."""
    totals = dict(
        Earning.objects.filter(provider=provider)
        .values("state")
        .annotate(total=Sum("amount"))
        .values_list("state", "total")
    )
    return {
        "pending": totals.get(EarningState.PENDING, 0) or 0,
        "available": (totals.get(EarningState.AVAILABLE, 0) or 0) + (totals.get(EarningState.BATCHED, 0) or 0),
        "paid": totals.get(EarningState.PAID, 0) or 0,
        "clawed_back": totals.get(EarningState.CLAWED_BACK, 0) or 0,
    }


def earnings_by_day_and_node(provider, days: int = 30, now=None) -> list[dict]:
    """[{day, node (pk), node_name, amount, jobs}] of the provider's earnings created per day and
    node (all states but clawed back), the newest day first, then by node name."""
    now = now or timezone.now()
    rows = (
        Earning.objects.filter(provider=provider, created_at__gte=now - timedelta(days=days))
        .exclude(state=EarningState.CLAWED_BACK)
        .annotate(day=TruncDate("created_at"))
        .values("day", "node", "node__name")
        .annotate(amount=Sum("amount"), jobs=Count("id"))
        .order_by("-day", "node__name", "node")
    )
    return [
        {"day": r["day"], "node": r["node"], "node_name": r["node__name"], "amount": r["amount"], "jobs": r["jobs"]}
        for r in rows
    ]


def payout_history(provider):
    return Payout.objects.filter(provider=provider).select_related("batch").order_by("-created_at")
