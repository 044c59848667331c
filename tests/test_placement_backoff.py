"""A node whose blocks keep failing (its agent cannot load them, or cannot serve them) is left out
of that model's placements instead of being given the block back at every re-placement, forever;
its reconnect (a restarted agent) gives it a fresh start."""

from __future__ import annotations

import pytest

from marketplace.placement import lifecycle, placing, readiness
from marketplace.placement.models import Assignment, AssignmentState
from tests.factories import MODEL

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]


@pytest.fixture
def b(provider, make_joined_node, measure_ring, swarm_settings):
    """Node b of a model placed over two nodes of 15 layers each: the model needs both."""
    a = make_joined_node(provider, "a", max_layers=15).node
    b = make_joined_node(provider, "b", max_layers=15).node
    measure_ring([a, b])
    placing.place_model(MODEL)
    return b


def live(node) -> list[Assignment]:
    return list(Assignment.objects.filter(node=node, state=AssignmentState.ASSIGNED))


def test_a_node_whose_last_blocks_all_failed_is_left_out_until_it_reconnects(
    b, settings, django_capture_on_commit_callbacks
):
    settings.SWARM_BLOCK_FAILURES_BEFORE_BACKOFF = 3

    for failure in range(3):
        [block] = live(b)  # placed (back) onto b: the model needs both nodes
        with django_capture_on_commit_callbacks(execute=True):
            assert readiness.assignment_failed(b.pk, block.pk, f"cannot serve on port 1 (failure {failure})")
        placing.place_dirty_models()

    assert live(b) == []  # the third failure in a row: b is left out
    assert Assignment.objects.filter(node=b, state=AssignmentState.FAILED).count() == 3

    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.node_connected(b.pk)  # its agent came back
    placing.place_dirty_models()
    assert len(live(b)) == 1


def test_fewer_failures_than_the_threshold_do_not_leave_a_node_out(b, settings, django_capture_on_commit_callbacks):
    settings.SWARM_BLOCK_FAILURES_BEFORE_BACKOFF = 3
    for _ in range(2):
        [block] = live(b)
        with django_capture_on_commit_callbacks(execute=True):
            assert readiness.assignment_failed(b.pk, block.pk, "out of memory")
        placing.place_dirty_models()
    assert len(live(b)) == 1  # two failures of three: placed again
