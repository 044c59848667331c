"""Demand per model: the tokens its jobs asked for lately, by which the swarm's nodes are shared
among the served models (``placement.rebalancing.share_by_demand``).

It lives with the jobs because it reads them; placement sits below jobs and never imports them,
so the periodic sweep runs ``share_nodes_by_demand`` here, which hands the figures down.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F, Sum
from django.utils import timezone

from marketplace.catalog.selectors import served_models
from marketplace.jobs.models import Job
from marketplace.placement import rebalancing
from marketplace.placement.shares import due, shared_models


def recent_demand(now: datetime | None = None) -> dict[str, int]:
    """Tokens (prompt + completion) of each served model's jobs admitted over the last
    SWARM_DEMAND_WINDOW_S, whatever became of them: a job that failed for want of capacity is
    demand all the same. A running job counts the tokens it delivered so far."""
    now = now or timezone.now()
    since = now - timedelta(seconds=settings.SWARM_DEMAND_WINDOW_S)
    served = served_models()
    rows = (
        Job.objects.filter(created_at__gte=since, created_at__lte=now, model__in=served)
        .values("model")
        .annotate(tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
        .values_list("model", "tokens")
    )
    return dict.fromkeys(served, 0) | {model: int(tokens or 0) for model, tokens in rows}


def share_nodes_by_demand(now: datetime | None = None) -> list[str]:
    """The periodic entry: share the nodes by the demand of the window, when several models are
    served and demand may move nodes now; the models whose share changed."""
    if not shared_models() or not due(now):
        return []  # nothing to share, or too soon: the jobs are not even counted
    return rebalancing.share_by_demand(recent_demand(now), now=now)
