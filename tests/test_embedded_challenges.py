"""Challenges run in the embedded mode that ``make demo`` uses, at the configured rate.

The control plane runs as the demo runs it (uvicorn in a thread, the embedded scheduler, checks
verified inline) and three ``swarm-worker join`` agents serve tiny-llama as one 3-stage pipeline.
Nobody sends a challenge by hand: the scheduler's ``send_due_challenges`` must, at the rate the
settings give, and every node must have a challenge recorded and passed within a bounded wait.
"""

from __future__ import annotations

import pytest

from marketplace.verification.models import Challenge, CheckState, Strike
from tests.live import wait_for
from tests.trust_fixtures import PROVIDERS

pytest_plugins = ["tests.trust_fixtures"]
pytestmark = [pytest.mark.trust, pytest.mark.django_db(transaction=True)]

TRUST_INTERVAL_S = 2.0
PER_DAY = 86400.0 / (4 * TRUST_INTERVAL_S)  # a node is due once in four intervals, on average


def test_the_embedded_scheduler_records_a_passed_challenge_of_every_node(make_swarm):
    swarm = make_swarm(
        cheat=None,
        SWARM_TRUST_INTERVAL_S=TRUST_INTERVAL_S,
        SWARM_CHALLENGES_MIN_PER_DAY=PER_DAY,
        SWARM_CHALLENGES_MAX_PER_DAY=PER_DAY,
    )
    nodes = [swarm.nodes[name].pk for name in PROVIDERS]

    def every_node_passed_one() -> bool:
        passed = set(Challenge.objects.filter(state=CheckState.PASSED).values_list("node_id", flat=True))
        return set(nodes) <= passed

    wait_for(every_node_passed_one, 180, "a passed challenge of every node")

    decided = Challenge.objects.exclude(state__in=(CheckState.SENT, CheckState.ANSWERED))
    assert set(decided.values_list("state", flat=True)) == {CheckState.PASSED}
    assert not Strike.objects.exists()
