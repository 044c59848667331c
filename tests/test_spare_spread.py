"""Spares where they help most: a node's loss rate from its record, and newcomers warming the span
whose loss is likeliest and costliest."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.nodes.models import Node
from marketplace.placement import placing
from marketplace.placement.candidates import candidates
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from tests.factories import MODEL
from tests.heal_fixtures import layout

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.heal_fixtures"]

READY = AssignmentState.READY
ASSIGNED = AssignmentState.ASSIGNED
HOURS_100 = 100 * 3600.0


@pytest.fixture
def make_swarm(provider, make_joined_node, swarm_settings):
    """Nodes by name (each 100 hours online, none failed) holding the given ready blocks
    (name -> (pipeline, position, layer_start, layer_end, is_spare)) of a placed model."""

    def make(blocks: dict[str, tuple[int, int, int, int, bool]], caps: dict[str, int] | None = None) -> dict:
        nodes = {name: make_joined_node(provider, name, max_layers=(caps or {}).get(name, 15)).node for name in blocks}
        Node.objects.filter(pk__in=[n.pk for n in nodes.values()]).update(online_s=HOURS_100)
        for name, (pipeline, position, start, end, spare) in blocks.items():
            Assignment.objects.create(
                node=nodes[name], model=MODEL, generation=1, pipeline=pipeline, position=position,
                layer_start=start, layer_end=end, is_spare=spare, state=READY, ready_at=timezone.now(),
            )  # fmt: skip
        PlacementState.objects.create(
            model=MODEL, generation=1, dirty=False, placed_at=timezone.now(), coordinator_regions=["local"] * 3
        )
        return {name: Node.objects.get(pk=node.pk) for name, node in nodes.items()}

    return make


def fail(node: Node, failures: int) -> None:
    Node.objects.filter(pk=node.pk).update(failures_total=failures)


def blocks() -> list[tuple[str, int, int, int, int, bool, str]]:
    """(node name, pipeline, position, layer_start, layer_end, is_spare, state) of each live block."""
    return [row[:1] + row[2:] for row in layout()]


def test_candidates_give_a_failing_node_a_higher_loss_rate_and_a_suspected_one_higher_still(
    provider, make_joined_node, swarm_settings
):
    swarm_settings.SWARM_LOSS_PRIOR_FAILURES = 1.0
    swarm_settings.SWARM_LOSS_PRIOR_HOURS = 24.0
    swarm_settings.SWARM_LOSS_DISTRESS_FACTOR = 4.0
    nodes = {name: make_joined_node(provider, name).node for name in ("new", "reliable", "failing", "suspected")}
    Node.objects.filter(pk__in=[nodes[n].pk for n in ("reliable", "failing", "suspected")]).update(online_s=HOURS_100)
    Node.objects.filter(pk__in=[nodes["failing"].pk, nodes["suspected"].pk]).update(failures_total=5)
    Node.objects.filter(pk=nodes["suspected"].pk).update(suspected_at=timezone.now())

    _, capacities = candidates(MODEL, lock=False)

    rates = {name: next(c.loss_rate for c in capacities if c.node == node.node_id) for name, node in nodes.items()}
    assert rates == {
        "new": 1.0 / 24.0,
        "reliable": 1.0 / 124.0,
        "failing": 6.0 / 124.0,
        "suspected": 6.0 / 124.0 * 4.0,
    }


def test_a_node_in_routing_back_off_counts_as_distressed_until_it_ends(provider, make_joined_node, swarm_settings):
    node = make_joined_node(provider, "backed-off").node
    Node.objects.filter(pk=node.pk).update(routing_backoff_until=timezone.now() + timedelta(minutes=5))
    backed_off = candidates(MODEL, lock=False)[1][0].loss_rate
    Node.objects.filter(pk=node.pk).update(routing_backoff_until=timezone.now() - timedelta(seconds=1))

    assert (backed_off, candidates(MODEL, lock=False)[1][0].loss_rate) == (4.0 / 24.0, 1.0 / 24.0)


def test_a_newcomer_warms_the_span_of_the_failing_member_over_an_equal_span_of_a_reliable_one(
    make_swarm, provider, make_joined_node, settings, django_capture_on_commit_callbacks
):
    settings.SWARM_REPLACE_MARGIN = 100.0  # a fresh plan never pays: the newcomer joins as a spare
    nodes = make_swarm({"a": (0, 0, 0, 15, False), "b": (0, 1, 15, 30, False)})
    fail(nodes["b"], 5)
    make_joined_node(provider, "n")
    PlacementState.objects.filter(model=MODEL).update(dirty=True)

    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    # Both spans are held once and are as long: b's failures decide (by span, [0, 15) came first).
    assert blocks() == [
        ("a", 0, 0, 0, 15, False, READY),
        ("b", 0, 1, 15, 30, False, READY),
        ("n", 1, 0, 15, 30, True, ASSIGNED),
    ]
