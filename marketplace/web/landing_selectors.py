"""Read queries of the front door: what a signed-out visitor sees of the swarm right now."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, time

from django.conf import settings
from django.db.models import Count, Sum
from django.utils import timezone

from marketplace.billing.services import prices_for
from marketplace.catalog.selectors import served_models
from marketplace.jobs.models import FINAL_STATES, Job
from marketplace.nodes.models import Node, NodeState
from marketplace.placement.selectors import servable_pipelines
from worker_agent.checkpoints import ref_name

ONLINE_STATES = (NodeState.ACTIVE, NodeState.DRAINING)  # joined and heartbeating


@dataclass(frozen=True)
class ModelOffer:
    name: str
    prompt_per_million: int  # nano-dollars per million input tokens
    completion_per_million: int  # nano-dollars per million output tokens
    available: bool  # a pipeline serves it end to end right now


@dataclass(frozen=True)
class SwarmFigures:
    nodes_online: int
    models: list[ModelOffer]
    tokens_today: int  # prompt + completion tokens of the requests that ended today (UTC)
    requests_today: int
    provider_share_percent: float  # of what a request pays, shared among the nodes that served it
    payout_window_h: float  # earnings stay pending this long (the challenge window) before they can be paid


def start_of_day(now: datetime) -> datetime:
    return datetime.combine(timezone.localdate(now), time.min, tzinfo=timezone.get_current_timezone())


def swarm_figures(now: datetime | None = None) -> SwarmFigures:
    now = now or timezone.now()
    today = Job.objects.filter(state__in=FINAL_STATES, finished_at__gte=start_of_day(now)).aggregate(
        prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"), requests=Count("id")
    )
    models = []
    for model in served_models():
        prompt, completion = prices_for(model)
        models.append(ModelOffer(ref_name(model), prompt, completion, bool(servable_pipelines(model))))
    return SwarmFigures(
        nodes_online=Node.objects.filter(state__in=ONLINE_STATES, deleted_at__isnull=True).count(),
        models=models,
        tokens_today=(today["prompt"] or 0) + (today["completion"] or 0),
        requests_today=today["requests"],
        provider_share_percent=(10_000 - settings.SWARM_PLATFORM_FEE_BPS) / 100,
        payout_window_h=settings.SWARM_CHALLENGE_WINDOW_S / 3600,
    )
