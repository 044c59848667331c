"""A node's standing: its reputation, and from it how often it is spot-checked.

``refresh_reputation`` gathers what the control plane observed of a node (uptime, checks passed
and failed, late answers, upheld strikes, age), scores it (``reputation.py``) and derives its
challenge rate and audit fraction (``rates.py``); placement and admission read what it stores.
"""

from __future__ import annotations

from django.conf import settings
from django.db.models import Count
from django.utils import timezone

from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node
from marketplace.payouts.selectors import sessions_per_day
from marketplace.verification import rates
from marketplace.verification.models import Audit, Challenge, CheckState, StrikeState
from marketplace.verification.reputation import Observations, reputation


def observations(node: Node, now=None) -> Observations:
    now = now or timezone.now()
    challenges_by_state = dict(
        Challenge.objects.filter(node=node).values("state").annotate(n=Count("id")).values_list("state", "n")
    )
    audits_by_state = dict(
        Audit.objects.filter(node=node).values("state").annotate(n=Count("id")).values_list("state", "n")
    )
    passed = challenges_by_state.get(CheckState.PASSED, 0) + audits_by_state.get(CheckState.PASSED, 0)
    failed = (
        challenges_by_state.get(CheckState.FAILED, 0)
        + challenges_by_state.get(CheckState.EXPIRED, 0)
        + audits_by_state.get(CheckState.FAILED, 0)
    )
    joined = node.joined_at or node.created_at
    return Observations(
        age_days=max((now - joined).total_seconds(), 0.0) / 86400.0,
        online_s=node.online_s,
        checks_passed=passed,
        checks_failed=failed,
        challenges_sent=sum(
            challenges_by_state.get(s, 0) for s in (CheckState.PASSED, CheckState.FAILED, CheckState.EXPIRED)
        ),
        challenges_late=challenges_by_state.get(CheckState.EXPIRED, 0),
        upheld_strikes=node.strikes.filter(state=StrikeState.UPHELD).count(),
    )


def rate_params() -> rates.RateParams:
    return rates.RateParams(
        safety=settings.SWARM_CHECK_SAFETY,
        window_days=settings.SWARM_CHALLENGE_WINDOW_S / 86400.0,
        horizon_days=settings.SWARM_CHECK_HORIZON_DAYS,
        strikes_to_eject=settings.SWARM_STRIKES_TO_EJECT,
        new_node_days=settings.SWARM_NEW_NODE_DAYS,
        challenges_min_per_day=settings.SWARM_CHALLENGES_MIN_PER_DAY,
        challenges_max_per_day=settings.SWARM_CHALLENGES_MAX_PER_DAY,
        audit_min_fraction=settings.SWARM_AUDIT_MIN_FRACTION,
        new_node_fraction=settings.SWARM_AUDIT_NEW_NODE_FRACTION,
    )


def refresh_reputation(node_pk: int, now=None) -> Node:
    """Recompute a node's reputation and, from it, how often it is checked."""

    now = now or timezone.now()
    node = Node.objects.get(pk=node_pk)
    obs = observations(node, now)
    rep = reputation(obs)
    rate = rates.check_rate(
        age_days=obs.age_days,
        reputation=rep.score,
        sessions_per_day=sessions_per_day(node, now),
        params=rate_params(),
    )
    detail = {**rep.to_dict(), "checks": rate.explanation}
    Node.objects.filter(pk=node_pk).update(
        reputation=rep.score,
        reputation_detail=detail,
        audit_fraction=rate.audit_fraction,
        challenges_per_day=rate.challenges_per_day,
    )
    notify_node_changed(node_pk)
    node.refresh_from_db()
    return node
