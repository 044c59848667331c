"""A spare takes a departed member's place: when a pipeline member goes offline (or drains) and a
warm spare holds exactly its span, the placement that follows promotes that spare into the member's
position and leaves every surviving block where it is (same assignment rows, same spans, nothing
pushed to reload); what a spare cannot cover is placed afresh."""

from __future__ import annotations

from datetime import timedelta

import pytest

from marketplace.nodes.models import Node
from marketplace.placement import lifecycle, placing, rebalancing
from marketplace.placement.models import AssignmentState, PlacementState
from marketplace.placement.selectors import servable_pipelines
from tests.factories import MODEL
from tests.heal_fixtures import NOW, layout, url_of

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.heal_fixtures"]

READY = AssignmentState.READY
ASSIGNED = AssignmentState.ASSIGNED
SILENT = NOW - timedelta(seconds=21)


def test_the_swarm_starts_with_two_pipelines_and_a_spare_of_the_second_span(swarm):
    assert [row[:1] + row[2:] for row in layout()] == [
        ("a", 0, 0, 0, 16, False, READY),
        ("b", 0, 1, 16, 30, False, READY),
        ("c", 1, 0, 0, 16, False, READY),
        ("d", 1, 1, 16, 30, False, READY),
        ("e", 2, 0, 16, 30, True, READY),
    ]


def test_a_silent_member_is_replaced_by_the_spare_holding_its_span_and_nobody_else_moves(
    swarm, pushed, django_capture_on_commit_callbacks
):
    before = {row[0]: row for row in layout()}
    Node.objects.filter(pk__in=[n.pk for n in swarm]).update(last_heartbeat_at=NOW)
    Node.objects.filter(pk=swarm.b.pk).update(last_heartbeat_at=SILENT)

    with django_capture_on_commit_callbacks(execute=True):
        gone = lifecycle.sweep_heartbeats(now=NOW)
    with django_capture_on_commit_callbacks(execute=True):
        placed = placing.place_dirty_models()

    assert gone == [swarm.b.node_id]
    assert placed == [MODEL]
    assert layout() == [
        ("a", before["a"][1], 0, 0, 0, 16, False, READY),
        ("e", before["e"][1], 0, 1, 16, 30, False, READY),
        ("c", before["c"][1], 1, 0, 0, 16, False, READY),
        ("d", before["d"][1], 1, 1, 16, 30, False, READY),
    ]
    assert pushed.messages == []  # no block to load, none to release: the spare was already warm
    assert [[s.node for s in p] for p in servable_pipelines(MODEL)] == [
        [swarm.a.node_id, swarm.e.node_id],
        [swarm.c.node_id, swarm.d.node_id],
    ]
    assert servable_pipelines(MODEL)[0][1].data_url == url_of(swarm.e)
    state = PlacementState.objects.get(model=MODEL)
    assert (state.generation, state.dirty, state.coordinator_regions) == (2, False, ["local", "local"])


def test_a_draining_member_is_replaced_by_the_spare_and_told_to_release_its_block(
    swarm, pushed, django_capture_on_commit_callbacks
):
    before = {row[0]: row for row in layout()}

    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.drain_node(swarm.d)
    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    assert layout() == [
        ("a", before["a"][1], 0, 0, 0, 16, False, READY),
        ("b", before["b"][1], 0, 1, 16, 30, False, READY),
        ("c", before["c"][1], 1, 0, 0, 16, False, READY),
        ("e", before["e"][1], 1, 1, 16, 30, False, READY),
    ]
    assert pushed.messages == [
        (f"node.{swarm.d.node_id}", {"type": "drain"}),
        (f"node.{swarm.d.node_id}", {"type": "release", "assignment": before["d"][1], "model": MODEL}),
    ]


def test_a_departed_span_that_no_spare_holds_is_placed_afresh(swarm, django_capture_on_commit_callbacks):
    # a's span [0, 16) has no spare (e is too small for it): the model is placed again over b, c, d, e.
    Node.objects.filter(pk__in=[n.pk for n in swarm]).update(last_heartbeat_at=NOW)
    Node.objects.filter(pk=swarm.a.pk).update(last_heartbeat_at=SILENT)

    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.sweep_heartbeats(now=NOW)
    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    names = {row[0] for row in layout()}
    assert names == {"b", "c", "d", "e"}
    assert ASSIGNED in {row[7] for row in layout()}  # some blocks moved: a fresh plan, not a repair
    assert PlacementState.objects.get(model=MODEL).dirty is False


def test_a_node_coming_back_while_a_member_is_gone_is_placed_afresh(
    swarm, provider, make_joined_node, django_capture_on_commit_callbacks
):
    # Capacity also grew (a new node joined): the repair would leave it idle, so a fresh plan runs.
    Node.objects.filter(pk__in=[n.pk for n in swarm]).update(last_heartbeat_at=NOW)
    Node.objects.filter(pk=swarm.b.pk).update(last_heartbeat_at=SILENT)
    newcomer = make_joined_node(provider, "f", compute=500.0, max_layers=16, last_heartbeat_at=NOW).node

    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.sweep_heartbeats(now=NOW)
    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    assert "f" in {row[0] for row in layout()}
    assert Node.objects.get(pk=newcomer.pk).assignments.filter(state__in=[ASSIGNED, READY]).count() == 1


def test_a_node_joining_a_whole_placement_becomes_a_spare_and_nothing_that_serves_moves(
    swarm, provider, make_joined_node, pushed, settings, django_capture_on_commit_callbacks
):
    """Capacity grew, but a fresh plan over the six would not serve the margin more tokens/s (set
    out of reach here): the newcomer warms a spare of the span with the fewest replicas, and every
    serving block stays."""
    settings.SWARM_REPLACE_MARGIN = 100.0
    before = layout()
    newcomer = make_joined_node(provider, "f", compute=200.0, max_layers=16, last_heartbeat_at=NOW).node
    rebalancing.mark_dirty(MODEL)

    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    after = layout()
    assert after[: len(before)] == before  # the same rows, spans and positions: nothing reloads
    (joined,) = [row for row in after if row[0] == "f"]
    # [0:16) is held by two pipelines, [16:30) by two pipelines and e's spare: f warms [0:16).
    assert joined[4:8] == (0, 16, True, ASSIGNED)
    assert Node.objects.get(pk=newcomer.pk).assignments.count() == 1


def test_a_join_that_pays_is_placed_afresh(
    swarm, provider, make_joined_node, settings, django_capture_on_commit_callbacks
):
    settings.SWARM_REPLACE_MARGIN = -1.0  # any plan pays
    make_joined_node(provider, "f", compute=200.0, max_layers=16, last_heartbeat_at=NOW)
    rebalancing.mark_dirty(MODEL)

    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    assert ASSIGNED in {row[7] for row in layout() if row[0] != "f"}  # some serving block moved


def test_a_repair_that_uses_up_the_last_spare_gives_way_to_a_plan_that_keeps_one(
    provider, make_joined_node, measure_ring, swarm_settings, django_capture_on_commit_callbacks
):
    # Five nodes of 10 layers for 30: one pipeline of four stages and one spare. A member whose span
    # the spare holds goes: promoting the spare would leave four stages and no spare, though three
    # nodes hold the model: the placement that follows lays out three stages and keeps a spare.
    swarm_settings.SWARM_SPARES_PER_PIPELINE = 1
    nodes = [
        make_joined_node(provider, name, compute=100.0, max_layers=10, last_heartbeat_at=NOW).node
        for name in ("p", "q", "r", "s", "t")
    ]
    measure_ring(nodes)
    placing.place_model(MODEL)
    before = layout()
    assert sum(1 for row in before if row[6]) == 1 and len(before) == 5
    spare = next(row for row in before if row[6])
    member = next(row for row in before if not row[6] and row[4:6] == spare[4:6])
    Node.objects.filter(pk__in=[n.pk for n in nodes]).update(last_heartbeat_at=NOW)
    Node.objects.filter(name=member[0]).update(last_heartbeat_at=SILENT)

    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.sweep_heartbeats(now=NOW)
    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    after = layout()
    assert len(after) == 4 and member[0] not in {row[0] for row in after}
    assert [row[6] for row in after].count(True) == 1  # a spare again
    assert sorted(row[4:6] for row in after if not row[6]) == [(0, 10), (10, 20), (20, 30)]
