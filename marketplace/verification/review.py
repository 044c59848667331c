"""The periodic review of spot-checks: expire unanswered challenges, uphold strikes left unreviewed,
refresh every node's reputation and check rates."""

from __future__ import annotations

from django.utils import timezone

from marketplace.nodes.models import Node
from marketplace.verification.challenges import expire_challenges
from marketplace.verification.standing import refresh_reputation
from marketplace.verification.strikes import uphold_overdue_strikes


def review(now=None) -> dict:
    """Periodic: expire challenges, uphold strikes left unreviewed, refresh reputations."""
    now = now or timezone.now()
    expired = expire_challenges(now)
    upheld = uphold_overdue_strikes(now)
    refreshed = 0
    for pk in Node.objects.exclude(node_id__isnull=True).values_list("pk", flat=True):
        refresh_reputation(pk, now)
        refreshed += 1
    return {"expired": expired, "upheld": upheld, "refreshed": refreshed}
