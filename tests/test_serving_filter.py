"""``placement.selectors.SERVING`` (the filter queries use) admits exactly the stages ``serving``
(the test on a row) does, whichever of its conditions a node fails; ``context_length`` reads
through it."""

from __future__ import annotations

import pytest
from django.utils import timezone

from marketplace.nodes.models import Node, NodeState
from marketplace.placement.models import Assignment
from marketplace.placement.selectors import SERVING, context_length, live_assignments, serving
from tests.factories import MODEL

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.heal_fixtures"]

FAILURES = {
    "offline": {"state": NodeState.OFFLINE},
    "disconnected": {"connected": False},
    "suspected": {"suspected_at": timezone.now()},
    "under review": {"under_review": True},
}


def both_ways() -> tuple[set[int], set[int]]:
    by_row = {a.pk for a in live_assignments(MODEL) if serving(a)}
    by_query = set(Assignment.objects.filter(SERVING, model=MODEL).values_list("pk", flat=True))
    return by_row, by_query


@pytest.mark.parametrize("failure", FAILURES)
def test_the_filter_and_the_row_test_agree(swarm, failure):
    by_row, by_query = both_ways()
    assert by_row == by_query and len(by_row) == 5  # every block of the five nodes serves

    Node.objects.filter(pk=swarm.b.pk).update(**FAILURES[failure])

    by_row, by_query = both_ways()
    assert by_row == by_query
    assert not Assignment.objects.filter(pk__in=by_query, node=swarm.b).exists()
    assert len(by_query) == 4


def test_the_context_length_is_the_least_any_serving_stage_holds(swarm):
    Node.objects.filter(pk=swarm.c.pk).update(max_positions=512)
    Node.objects.filter(pk=swarm.d.pk).update(max_positions=300)
    assert context_length(MODEL) == 300

    Node.objects.filter(pk=swarm.d.pk).update(connected=False)  # off routing: it no longer bounds requests
    assert context_length(MODEL) == 512
