"""Read queries over jobs: a customer's usage by day, model or key, their requests one by one, and
the jobs in flight on each node."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, F, QuerySet, Sum
from django.db.models.functions import TruncDay

from marketplace.billing.selectors import money
from marketplace.jobs.models import FINAL_STATES, Job, JobState


def usage(user, group: str) -> list[dict]:
    """Tokens and cost of the customer's jobs, grouped by day, model or key (a key's row names it:
    ``key`` its prefix, ``key_name`` the name its owner gave it; both None once it is deleted)."""
    expression = {"day": TruncDay("created_at"), "model": F("model"), "key": F("api_key__prefix")}[group]
    named = {"key_name": F("api_key__name")} if group == "key" else {}
    grouped = Job.objects.filter(customer=user).annotate(group=expression, **named)
    rows = (
        grouped.values("group", *named)
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
            **{name: row[name] for name in named},
        }
        for row in rows
    ]


def customer_requests(user) -> QuerySet[Job]:
    """The customer's requests, newest first: each as its first choice's job (a request asking for
    ``n`` choices ran ``n`` jobs; ``request_rows`` adds the others in)."""
    return Job.objects.filter(customer=user, first_choice__isnull=True).order_by("-created_at", "-pk")


@dataclass(frozen=True)
class RequestRow:
    """One request as its customer's billing page lists it, all its choices together."""

    public_id: str
    created_at: datetime
    model: str
    choices: int
    prompt_tokens: int
    completion_tokens: int
    cost: int  # nano-dollars charged
    on_hold: int  # nano-dollars held while it runs, 0 once settled
    status: str  # running, settling, charged, stopped or failed
    status_text: str  # the status as the page says it


def _status(jobs: list[Job], cost: int) -> tuple[str, str]:
    if any(job.state not in FINAL_STATES for job in jobs):
        return "running", "running"
    if any(job.settled_at is None for job in jobs):
        return "settling", "settling"
    for state, status in ((JobState.FAILED, "failed"), (JobState.CANCELLED, "stopped")):
        if any(job.state == state for job in jobs):
            return status, f"{status}, {'charged for the tokens received' if cost else 'not charged'}"
    return "charged", "charged"


def request_rows(firsts: Iterable[Job]) -> list[RequestRow]:
    """``firsts`` (first choices, as ``customer_requests`` gives them) as rows, with their other choices."""
    firsts = list(firsts)
    others: dict[int, list[Job]] = {}
    for job in Job.objects.filter(first_choice__in=firsts).order_by("choice_index"):
        assert job.first_choice_id is not None  # the filter picks other choices only
        others.setdefault(job.first_choice_id, []).append(job)
    rows = []
    for first in firsts:
        jobs = [first, *others.get(first.pk, [])]
        cost = sum(job.charged_amount for job in jobs)
        status, status_text = _status(jobs, cost)
        rows.append(
            RequestRow(
                public_id=first.public_id,
                created_at=first.created_at,
                model=first.model,
                choices=len(jobs),
                prompt_tokens=sum(job.prompt_tokens for job in jobs),
                completion_tokens=sum(job.completion_tokens for job in jobs),
                cost=cost,
                on_hold=sum(job.hold_amount for job in jobs if job.settled_at is None),
                status=status,
                status_text=status_text,
            )
        )
    return rows


def jobs_in_flight() -> Counter[str]:
    """Jobs admitted and not ended, by node id: each holds a session on every stage of its route."""
    busy: Counter[str] = Counter()
    for route in Job.objects.filter(state__in=[JobState.QUEUED, JobState.RUNNING]).values_list("route", flat=True):
        busy.update(stage["node"] for stage in route)
    return busy
