"""An open strike takes its node off routing at once, heartbeats or not; deciding every open
strike on it returns it (an upheld strike past the threshold ejects it instead)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from marketplace.jobs.models import Job
from marketplace.nodes.models import Node
from marketplace.placement import lifecycle
from marketplace.placement.selectors import route_request
from marketplace.verification.models import StrikeKind, StrikeState
from marketplace.verification.strikes import open_strike, overturn_strike, uphold_strike
from tests.factories import MODEL
from tests.heal_fixtures import NOW

pytestmark = [pytest.mark.trust, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.heal_fixtures"]


def routed_nodes() -> list[str]:
    _, stages, _ = route_request(MODEL)
    return [s.node for s in stages]


def strike(node: Node):
    customer = get_user_model().objects.get_or_create(username="carol")[0]
    job = Job.objects.create(public_id=f"cmpl-{Job.objects.count()}", kind="completion", customer=customer, model=MODEL)
    return open_strike(node, StrikeKind.RECEIPT, job=job, evidence={"kind": "receipt", "reason": "its receipt lies"})


def test_an_open_strike_takes_the_node_off_routing_until_every_strike_is_decided(swarm, admin):
    assert routed_nodes() == [swarm.a.node_id, swarm.e.node_id]

    first, second = strike(swarm.e), strike(swarm.e)
    lifecycle.record_heartbeat(swarm.e.pk, {"sessions": 0}, now=NOW)  # signs of life do not clear a strike

    assert Node.objects.get(pk=swarm.e.pk).under_review is True
    assert routed_nodes() == [swarm.a.node_id, swarm.b.node_id]

    overturn_strike(first, by=admin, reason="the verifier's copy was stale")
    still = routed_nodes()
    uphold_strike(second, by=admin)

    assert still == [swarm.a.node_id, swarm.b.node_id]  # one strike still open
    assert [s.state for s in swarm.e.strikes.order_by("pk")] == [StrikeState.OVERTURNED, StrikeState.UPHELD]
    assert Node.objects.get(pk=swarm.e.pk).under_review is False
    assert routed_nodes() == [swarm.a.node_id, swarm.e.node_id]


def test_a_strike_on_one_node_leaves_the_others_routable(swarm):
    strike(swarm.b)

    assert list(Node.objects.filter(under_review=True).values_list("node_id", flat=True)) == [swarm.b.node_id]
    assert routed_nodes() == [swarm.a.node_id, swarm.e.node_id]
