"""A coordinator's failure report stops routing to the node at once; its heartbeats then decide:
one clearly sent after the report clears the suspicion, silence takes the node offline at the
sweep. A report alone asks for no new placement."""

from __future__ import annotations

from datetime import timedelta

import pytest

from marketplace.nodes.models import Node, NodeState
from marketplace.placement import lifecycle
from marketplace.placement.models import PlacementState
from marketplace.placement.selectors import route_request, servable_pipelines
from tests.factories import MODEL
from tests.heal_fixtures import NOW

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.heal_fixtures"]

INTERVAL = timedelta(seconds=5)  # SWARM_HEARTBEAT_INTERVAL_S in swarm_settings


def routed_nodes() -> list[str]:
    _, stages, _ = route_request(MODEL)
    return [s.node for s in stages]


def suspicion(node: Node) -> tuple:
    node = Node.objects.get(pk=node.pk)
    return node.suspected_at, node.suspicion


def test_a_reported_node_is_skipped_by_routing_at_once(swarm, django_capture_on_commit_callbacks):
    # Every routable block counts, the warm spare too: e is the fastest holder of [16:30).
    assert routed_nodes() == [swarm.a.node_id, swarm.e.node_id]

    with django_capture_on_commit_callbacks(execute=True):
        reported = lifecycle.report_node_failure(swarm.e.node_id, "stalled", now=NOW)

    assert reported is True
    assert suspicion(swarm.e) == (NOW, "stalled")
    assert routed_nodes() == [swarm.a.node_id, swarm.b.node_id]

    lifecycle.report_node_failure(swarm.b.node_id, "stalled", now=NOW)

    assert routed_nodes() == [swarm.a.node_id, swarm.d.node_id]
    assert [[s.node for s in p] for p in servable_pipelines(MODEL)] == [[swarm.c.node_id, swarm.d.node_id]]
    assert PlacementState.objects.get(model=MODEL).dirty is False  # no capacity changed: no re-placement


def test_a_heartbeat_sent_after_the_report_clears_the_suspicion(swarm, django_capture_on_commit_callbacks):
    lifecycle.report_node_failure(swarm.b.node_id, "stalled", now=NOW)

    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.record_heartbeat(swarm.b.pk, {"sessions": 0}, now=NOW + INTERVAL)  # may predate the failure
    still = suspicion(swarm.b)
    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.record_heartbeat(swarm.b.pk, {"sessions": 0}, now=NOW + INTERVAL + timedelta(milliseconds=1))

    assert still == (NOW, "stalled")
    assert suspicion(swarm.b) == (None, "")
    assert swarm.b.node_id in {s.node for p in servable_pipelines(MODEL) for s in p}
    assert PlacementState.objects.get(model=MODEL).dirty is False


def test_a_silent_reported_node_goes_offline_at_the_sweep_and_the_model_is_placed_again(
    swarm, django_capture_on_commit_callbacks
):
    later = NOW + timedelta(seconds=21)
    Node.objects.filter(pk__in=[n.pk for n in swarm]).update(last_heartbeat_at=later)
    Node.objects.filter(pk=swarm.b.pk).update(last_heartbeat_at=NOW)
    lifecycle.report_node_failure(swarm.b.node_id, "stalled", now=NOW)

    with django_capture_on_commit_callbacks(execute=True):
        gone = lifecycle.sweep_heartbeats(now=later)

    b = Node.objects.get(pk=swarm.b.pk)
    assert gone == [swarm.b.node_id]
    assert (b.state, b.suspected_at, b.suspicion) == (NodeState.OFFLINE, None, "")
    assert PlacementState.objects.get(model=MODEL).dirty is True


def test_a_report_about_an_unknown_or_offline_node_changes_nothing(swarm):
    Node.objects.filter(pk=swarm.b.pk).update(state=NodeState.OFFLINE)

    assert lifecycle.report_node_failure("node-0000000000000000", "stalled", now=NOW) is False
    assert lifecycle.report_node_failure(swarm.b.node_id, "stalled", now=NOW) is False
    assert Node.objects.filter(suspected_at__isnull=False).count() == 0
