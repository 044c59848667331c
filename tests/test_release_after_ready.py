"""Make before break at the control plane: a node moved onto another span is told to release its
old block only once its new one is ready (or failed to load); routing stops using the old block at
once. A node left with no block is told at once, as before."""

from __future__ import annotations

import pytest

from marketplace.nodes.models import Node, NodeState
from marketplace.placement import placing, readiness
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.selectors import servable_pipelines
from tests.factories import MODEL
from worker_agent.protocol import control_protocol as protocol

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]


@pytest.fixture
def two_nodes(provider, make_joined_node, measure_ring, swarm_settings):
    """Nodes a and b holding one ready pipeline a[0:15] -> b[15:30]."""
    a = make_joined_node(provider, "a", max_layers=15).node
    b = make_joined_node(provider, "b", max_layers=15).node
    measure_ring([a, b])
    placing.place_model(MODEL)
    for assignment in Assignment.objects.all():
        readiness.assignment_ready(assignment.node_id, assignment.pk, f"ws://127.0.0.1:{9000 + assignment.node_id}")
    return a, b


def spans(node) -> dict[str, tuple[int, int]]:
    return {a.state: (a.layer_start, a.layer_end) for a in Assignment.objects.filter(node=node)}


def sent(pushed, node) -> list[dict]:
    return [message for group, message in pushed.messages if group == f"node.{node.node_id}"]


def swap(two_nodes, measure_ring, pushed, capture) -> tuple[Assignment, Assignment, Assignment, Assignment]:
    """Re-place the pipeline as b[0:15] -> a[15:30]; (a's old, a's new, b's old, b's new)."""
    a, b = two_nodes
    old_a, old_b = (Assignment.objects.get(node=n, state=AssignmentState.READY) for n in (a, b))
    measure_ring([b, a])
    with capture(execute=True):
        placing.place_model(MODEL)
    new_a, new_b = (Assignment.objects.get(node=n, state=AssignmentState.ASSIGNED) for n in (a, b))
    return old_a, new_a, old_b, new_b


def test_a_moved_node_is_assigned_its_new_span_but_keeps_its_old_block_until_the_new_one_is_ready(
    two_nodes, measure_ring, pushed, django_capture_on_commit_callbacks
):
    a, b = two_nodes

    old_a, new_a, old_b, new_b = swap(two_nodes, measure_ring, pushed, django_capture_on_commit_callbacks)

    assert spans(a) == {AssignmentState.RELEASED: (0, 15), AssignmentState.ASSIGNED: (15, 30)}
    assert spans(b) == {AssignmentState.RELEASED: (15, 30), AssignmentState.ASSIGNED: (0, 15)}
    assert (new_a.supersedes_id, new_b.supersedes_id) == (old_a.pk, old_b.pk)
    # Only the new assignments are pushed: no release yet.
    assert sent(pushed, a) == [protocol.to_wire(new_a.as_message())]
    assert sent(pushed, b) == [protocol.to_wire(new_b.as_message())]
    # Nothing new is routed to a released block, and the new ones are not ready yet.
    assert servable_pipelines(MODEL) == []


def test_the_old_block_is_released_at_the_agent_once_the_new_one_is_ready(
    two_nodes, measure_ring, pushed, django_capture_on_commit_callbacks
):
    a, b = two_nodes
    old_a, new_a, _old_b, _new_b = swap(two_nodes, measure_ring, pushed, django_capture_on_commit_callbacks)
    pushed.events.clear()

    with django_capture_on_commit_callbacks(execute=True):
        assert readiness.assignment_ready(a.pk, new_a.pk, "ws://127.0.0.1:9901") is True

    assert sent(pushed, a) == [{"type": "release", "assignment": old_a.pk, "model": MODEL}]
    assert sent(pushed, b) == []
    new_a.refresh_from_db()
    assert new_a.supersedes_id is None

    # A second report of the same readiness is stale and sends nothing again.
    with django_capture_on_commit_callbacks(execute=True):
        assert readiness.assignment_ready(a.pk, new_a.pk, "ws://127.0.0.1:9901") is False
    assert len(sent(pushed, a)) == 1


def test_the_old_block_is_released_at_the_agent_when_the_new_one_fails_to_load(
    two_nodes, measure_ring, pushed, django_capture_on_commit_callbacks
):
    a, b = two_nodes
    _old_a, _new_a, old_b, new_b = swap(two_nodes, measure_ring, pushed, django_capture_on_commit_callbacks)
    pushed.events.clear()

    with django_capture_on_commit_callbacks(execute=True):
        assert readiness.assignment_failed(b.pk, new_b.pk, "out of memory") is True

    assert sent(pushed, b) == [{"type": "release", "assignment": old_b.pk, "model": MODEL}]
    assert sent(pushed, a) == []
    assert Assignment.objects.get(pk=new_b.pk).state == AssignmentState.FAILED


def test_a_block_superseded_twice_before_its_successor_is_ready_is_released_with_it(
    two_nodes, measure_ring, pushed, django_capture_on_commit_callbacks
):
    a, b = two_nodes
    old_a, new_a, _, _ = swap(two_nodes, measure_ring, pushed, django_capture_on_commit_callbacks)
    # Placed back before a's new block loaded: a holds old_a and is loading new_a.
    measure_ring([a, b])
    with django_capture_on_commit_callbacks(execute=True):
        placing.place_model(MODEL)
    newest_a = Assignment.objects.get(node=a, state=AssignmentState.ASSIGNED)
    assert (newest_a.layer_start, newest_a.layer_end, newest_a.supersedes_id) == (0, 15, new_a.pk)
    pushed.events.clear()

    with django_capture_on_commit_callbacks(execute=True):
        readiness.assignment_ready(a.pk, newest_a.pk, "ws://127.0.0.1:9901")

    assert sent(pushed, a) == [
        {"type": "release", "assignment": new_a.pk, "model": MODEL},
        {"type": "release", "assignment": old_a.pk, "model": MODEL},
    ]


def test_a_node_left_without_a_block_is_told_to_release_it_at_once(
    two_nodes, provider, make_joined_node, pushed, django_capture_on_commit_callbacks, swarm_settings
):
    _a, b = two_nodes
    old_b = Assignment.objects.get(node=b, state=AssignmentState.READY)
    make_joined_node(provider, "c", max_layers=15)
    Node.objects.filter(pk=b.pk).update(state=NodeState.DRAINING)

    with django_capture_on_commit_callbacks(execute=True):
        placing.place_model(MODEL)

    assert {"type": "release", "assignment": old_b.pk, "model": MODEL} in sent(pushed, b)
