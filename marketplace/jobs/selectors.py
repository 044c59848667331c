"""Read queries over jobs: a customer's usage by day, model or key."""

from __future__ import annotations

from django.db.models import Count, F, Sum
from django.db.models.functions import TruncDay

from marketplace.billing.selectors import money
from marketplace.jobs.models import Job


def usage(user, group: str) -> list[dict]:
    """Tokens and cost of the customer's jobs, grouped by day, model or key."""
    expression = {"day": TruncDay("created_at"), "model": F("model"), "key": F("api_key__prefix")}[group]
    rows = Job.objects.filter(customer=user).annotate(group=expression)
    rows = (
        rows.values("group")
        .annotate(
            requests=Count("id"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            cost=Sum("charged_amount"),
        )
        .order_by("group")
    )
    return [
        {
            group: row["group"].date().isoformat() if group == "day" and row["group"] else row["group"],
            "requests": row["requests"],
            "prompt_tokens": row["prompt_tokens"] or 0,
            "completion_tokens": row["completion_tokens"] or 0,
            "cost": money(row["cost"]),
        }
        for row in rows
    ]
