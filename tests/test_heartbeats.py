"""Heartbeats and their timeout: silent nodes go offline and lose their blocks, returning nodes come
back, and the model is re-placed over the nodes that are left."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from marketplace.nodes.models import Node, NodeState
from marketplace.placement import lifecycle
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.placement.placing import place_model
from marketplace.placement.readiness import assignment_ready
from marketplace.placement.selectors import PipelineStage, servable_pipelines
from tests.factories import MODEL, db_snapshot

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
TIMEOUT = timedelta(seconds=20)


def live(node: Node) -> list[tuple[int, int, str]]:
    return list(
        Assignment.objects.filter(node=node, state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
        .order_by("pk")
        .values_list("layer_start", "layer_end", "state")
    )


def spans() -> list[tuple[str, int, int, int, int, int]]:
    """(node name, pipeline, position, layer_start, layer_end, generation) of every live assignment."""
    return list(
        Assignment.objects.filter(state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
        .order_by("pipeline", "position")
        .values_list("node__name", "pipeline", "position", "layer_start", "layer_end", "generation")
    )


def assign(node: Node, assignment: Assignment) -> tuple[str, dict]:
    return (
        f"node.{node.node_id}",
        {
            "type": "assign",
            "assignment": assignment.pk,
            "model": MODEL,
            "layer_start": assignment.layer_start,
            "layer_end": assignment.layer_end,
        },
    )


@pytest.fixture
def three_nodes(provider, make_joined_node, measure_ring, swarm_settings):
    """Three active, connected nodes of 15 layers each at 300, 200 and 100 layer-tokens/s, whose
    measured links make a -> b -> c the cheapest ring; all heard from at NOW."""
    nodes = [
        make_joined_node(provider, name, compute=compute, max_layers=15, last_heartbeat_at=NOW).node
        for name, compute in (("a", 300.0), ("b", 200.0), ("c", 100.0))
    ]
    measure_ring(nodes)
    return nodes


def test_sweep_takes_a_silent_node_offline_and_releases_its_blocks(
    provider, make_joined_node, swarm_settings, django_capture_on_commit_callbacks
):
    silent = make_joined_node(
        provider, "silent", max_layers=None, last_heartbeat_at=NOW - TIMEOUT - timedelta(milliseconds=1)
    )
    at_limit = make_joined_node(provider, "at-limit", max_layers=None, last_heartbeat_at=NOW - TIMEOUT)
    recent = make_joined_node(provider, "recent", max_layers=None, last_heartbeat_at=NOW - timedelta(seconds=1))
    place_model(MODEL)  # each node holds all 30 layers: three one-stage pipelines

    with django_capture_on_commit_callbacks(execute=True):
        gone = lifecycle.sweep_heartbeats(now=NOW)

    assert gone == [silent.node.node_id]
    states = dict(Node.objects.values_list("name", "state"))
    assert states == {"silent": NodeState.OFFLINE, "at-limit": NodeState.ACTIVE, "recent": NodeState.ACTIVE}
    assert Node.objects.get(name="silent").connected is False
    assert live(silent.node) == []
    assert Assignment.objects.get(node=silent.node).state == AssignmentState.RELEASED
    assert Assignment.objects.get(node=silent.node).released_at is not None
    assert live(at_limit.node) == [(0, 30, AssignmentState.ASSIGNED)]
    assert live(recent.node) == [(0, 30, AssignmentState.ASSIGNED)]
    assert list(PlacementState.objects.values_list("model", "dirty")) == [(MODEL, True)]


def test_sweep_honours_the_configured_timeout(provider, make_joined_node, settings):
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 5.0
    node = make_joined_node(provider, last_heartbeat_at=NOW - timedelta(seconds=6)).node

    gone = lifecycle.sweep_heartbeats(now=NOW)

    assert gone == [node.node_id]
    assert Node.objects.get(pk=node.pk).state == NodeState.OFFLINE


def test_sweep_with_nothing_silent_changes_nothing(provider, make_joined_node, swarm_settings):
    make_joined_node(provider, "a", last_heartbeat_at=NOW - timedelta(seconds=3))
    make_joined_node(provider, "b", last_heartbeat_at=NOW)
    before = db_snapshot()

    gone = lifecycle.sweep_heartbeats(now=NOW)

    assert gone == []
    assert db_snapshot() == before


@pytest.mark.parametrize("state", [NodeState.PENDING, NodeState.OFFLINE, NodeState.EJECTED])
def test_sweep_leaves_nodes_that_are_not_serving_alone(state, provider, make_joined_node, swarm_settings):
    make_joined_node(provider, state=state, last_heartbeat_at=NOW - timedelta(hours=1))
    before = db_snapshot()

    gone = lifecycle.sweep_heartbeats(now=NOW)

    assert gone == []
    assert db_snapshot() == before


def test_a_silent_draining_node_also_goes_offline(provider, make_joined_node, swarm_settings):
    node = make_joined_node(provider, state=NodeState.DRAINING, last_heartbeat_at=NOW - timedelta(minutes=5)).node

    gone = lifecycle.sweep_heartbeats(now=NOW)

    assert gone == [node.node_id]
    assert (Node.objects.get(pk=node.pk).state, Node.objects.get(pk=node.pk).connected) == (NodeState.OFFLINE, False)


def test_a_heartbeat_from_an_offline_node_makes_it_active_again(
    provider, make_joined_node, swarm_settings, django_capture_on_commit_callbacks
):
    node = make_joined_node(provider, state=NodeState.OFFLINE, connected=False, last_heartbeat_at=NOW).node

    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.record_heartbeat(node.pk, {"sessions": 0, "uptime_s": 3.0})

    node.refresh_from_db()
    assert (node.state, node.connected) == (NodeState.ACTIVE, True)
    assert node.last_heartbeat_at > NOW
    assert node.load == {"sessions": 0.0, "uptime_s": 3.0}
    assert list(PlacementState.objects.values_list("model", "dirty")) == [(MODEL, True)]


def test_a_heartbeat_from_an_active_node_does_not_ask_for_a_new_placement(
    provider, make_joined_node, swarm_settings, django_capture_on_commit_callbacks
):
    node = make_joined_node(provider, last_heartbeat_at=NOW).node

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        lifecycle.record_heartbeat(node.pk, {"sessions": 1})

    # The only thing sent on commit is the dashboards' notice that the node's load changed.
    assert [callback.__qualname__ for callback in callbacks] == ["_send_on_commit.<locals>.send"]
    assert PlacementState.objects.count() == 0
    assert Node.objects.get(pk=node.pk).state == NodeState.ACTIVE


def test_a_heartbeat_from_a_draining_node_keeps_it_draining(provider, make_joined_node, swarm_settings):
    node = make_joined_node(provider, state=NodeState.DRAINING, last_heartbeat_at=NOW).node

    lifecycle.record_heartbeat(node.pk, {})

    assert Node.objects.get(pk=node.pk).state == NodeState.DRAINING


def test_a_heartbeat_with_a_measured_layer_time_smooths_the_nodes_speed(provider, make_joined_node, swarm_settings):
    node = make_joined_node(provider, compute=250.0).node

    lifecycle.record_heartbeat(node.pk, {"layer_ms": 2.0})  # 500 layer-tokens/s measured under traffic

    assert Node.objects.get(pk=node.pk).compute_layer_tokens_per_s == pytest.approx(0.3 * 500.0 + 0.7 * 250.0)


def test_placement_over_three_nodes_splits_by_speed_along_the_measured_ring(
    three_nodes, pushed, django_capture_on_commit_callbacks
):
    a, b, c = three_nodes

    with django_capture_on_commit_callbacks(execute=True):
        placed = place_model(MODEL)

    # 30 layers in proportion to 300 : 200 : 100, each node capped at 15.
    assert spans() == [("a", 0, 0, 0, 15, 1), ("b", 0, 1, 15, 25, 1), ("c", 0, 2, 25, 30, 1)]
    assert [assignment.node_id for assignment in placed] == [a.pk, b.pk, c.pk]
    first, second, third = placed
    assert pushed.messages == [assign(a, first), assign(b, second), assign(c, third)]
    state = PlacementState.objects.get(model=MODEL)
    assert (state.generation, state.dirty, state.note, state.coordinator_regions) == (1, False, "", ["local"])


def test_placing_again_over_the_same_nodes_keeps_every_block_and_pushes_nothing(
    three_nodes, pushed, django_capture_on_commit_callbacks
):
    first_pks = sorted(a.pk for a in place_model(MODEL))

    with django_capture_on_commit_callbacks(execute=True):
        again = place_model(MODEL)

    assert sorted(a.pk for a in again) == first_pks
    assert spans() == [("a", 0, 0, 0, 15, 2), ("b", 0, 1, 15, 25, 2), ("c", 0, 2, 25, 30, 2)]
    assert Assignment.objects.count() == 3
    assert pushed.messages == []
    assert PlacementState.objects.get(model=MODEL).generation == 2


def test_after_a_node_goes_offline_the_model_is_placed_on_two_stages_of_fifteen(
    three_nodes, pushed, django_capture_on_commit_callbacks
):
    a, b, c = three_nodes
    place_model(MODEL)
    first_of_a = Assignment.objects.get(node=a)
    Node.objects.filter(pk=b.pk).update(last_heartbeat_at=NOW - TIMEOUT - timedelta(seconds=1))

    with django_capture_on_commit_callbacks(execute=True):
        gone = lifecycle.sweep_heartbeats(now=NOW)
        placed = place_model(MODEL)

    assert gone == [b.node_id]
    assert spans() == [("a", 0, 0, 0, 15, 2), ("c", 0, 1, 15, 30, 2)]
    kept, moved = placed
    assert kept.pk == first_of_a.pk  # a's block [0, 15) is unchanged: its agent keeps it warm
    assert live(b) == []
    assert list(Assignment.objects.filter(node=c).order_by("pk").values_list("layer_start", "layer_end", "state")) == [
        (25, 30, AssignmentState.RELEASED),
        (15, 30, AssignmentState.ASSIGNED),
    ]
    assert pushed.messages == [assign(c, moved)]


def test_once_every_stage_is_ready_the_model_is_servable_in_ring_order(three_nodes, swarm_settings):
    a, b, c = three_nodes
    placed = place_model(MODEL)

    for node, assignment in zip((a, b, c), placed, strict=True):
        assert assignment_ready(node.pk, assignment.pk, f"ws://10.0.0.{node.pk}:9100") is True

    assert servable_pipelines(MODEL) == [
        [
            PipelineStage(a.node_id, a.public_key, f"ws://10.0.0.{a.pk}:9100", 0, 15, "local"),
            PipelineStage(b.node_id, b.public_key, f"ws://10.0.0.{b.pk}:9100", 15, 25, "local"),
            PipelineStage(c.node_id, c.public_key, f"ws://10.0.0.{c.pk}:9100", 25, 30, "local"),
        ]
    ]


def test_a_model_with_a_stage_not_yet_ready_is_not_servable(three_nodes, swarm_settings):
    a, b, _ = three_nodes
    first, second, _ = place_model(MODEL)
    assignment_ready(a.pk, first.pk, "ws://10.0.0.1:9100")
    assignment_ready(b.pk, second.pk, "ws://10.0.0.2:9100")

    assert servable_pipelines(MODEL) == []


def test_placement_with_no_node_that_can_hold_a_layer_leaves_a_note(provider, make_joined_node, swarm_settings):
    make_joined_node(provider, state=NodeState.OFFLINE, connected=False)

    placed = place_model(MODEL)

    assert placed == []
    state = PlacementState.objects.get(model=MODEL)
    assert (state.generation, state.dirty, state.note) == (1, False, "no active node can hold a layer of this model")
