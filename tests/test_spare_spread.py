"""Spares where they help most: a node's loss rate from its record, newcomers warming the span
whose loss is likeliest and costliest, and the sweep's step that moves a ready spare carrying no
open job off a span held three times onto a span held once and by no spare (make before break:
the new block supersedes the old one), at most one per model and sweep."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace import periodic
from marketplace.jobs import spares
from marketplace.jobs.models import Job, JobState
from marketplace.nodes.models import Node
from marketplace.placement import lifecycle, placing, readiness
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


# Two pipelines hold [0, 15) and [15, 30); a third is cut in three spans held once each; the spare s
# holds [0, 15), which a and c hold too.
THREE_PIPELINES = {
    "a": (0, 0, 0, 15, False),
    "b": (0, 1, 15, 30, False),
    "c": (1, 0, 0, 15, False),
    "d": (1, 1, 15, 30, False),
    "e": (2, 0, 0, 10, False),
    "f": (2, 1, 10, 20, False),
    "g": (2, 2, 20, 30, False),
    "s": (3, 0, 0, 15, True),
}


def fail(node: Node, failures: int) -> None:
    Node.objects.filter(pk=node.pk).update(failures_total=failures)


def blocks() -> list[tuple[str, int, int, int, int, bool, str]]:
    """(node name, pipeline, position, layer_start, layer_end, is_spare, state) of each live block."""
    return [row[:1] + row[2:] for row in layout()]


def sweep(django_capture_on_commit_callbacks) -> list[str]:
    with django_capture_on_commit_callbacks(execute=True):
        return spares.respread_spares()


def report_ready() -> None:
    for assignment in Assignment.objects.filter(state=ASSIGNED):
        readiness.assignment_ready(assignment.node_id, assignment.pk, f"ws://127.0.0.1:{9000 + assignment.node_id}")


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


def test_the_sweep_moves_a_spare_off_a_span_held_three_times_onto_the_lone_span_likeliest_lost(
    make_swarm, pushed, django_capture_on_commit_callbacks
):
    nodes = make_swarm(THREE_PIPELINES)
    fail(nodes["f"], 5)
    old = Assignment.objects.get(node=nodes["s"])

    moved = sweep(django_capture_on_commit_callbacks)

    assert moved == [MODEL]
    new = Assignment.objects.get(node=nodes["s"], state__in=[READY, ASSIGNED])
    assert (new.pipeline, new.position, new.layer_start, new.layer_end, new.is_spare, new.state) == (
        3, 0, 10, 20, True, ASSIGNED,
    )  # fmt: skip
    assert (new.supersedes_id, new.generation) == (old.pk, 1)
    old.refresh_from_db()
    assert old.state == AssignmentState.RELEASED
    assert old.released_at is not None
    assert pushed.messages == [
        (
            f"node.{nodes['s'].node_id}",
            {"type": "assign", "assignment": new.pk, "model": MODEL, "layer_start": 10, "layer_end": 20},
        )
    ]
    assert blocks()[:7] == [(name, *THREE_PIPELINES[name][:4], False, READY) for name in "abcdefg"]


def test_the_moved_spare_lets_its_old_block_go_once_the_new_one_is_ready(
    make_swarm, pushed, django_capture_on_commit_callbacks
):
    nodes = make_swarm(THREE_PIPELINES)
    old = Assignment.objects.get(node=nodes["s"])
    sweep(django_capture_on_commit_callbacks)
    new = Assignment.objects.get(node=nodes["s"], state=ASSIGNED)

    with django_capture_on_commit_callbacks(execute=True):
        report_ready()

    releases = [message for message in pushed.messages if message[1]["type"] == "release"]
    assert releases == [(f"node.{nodes['s'].node_id}", {"type": "release", "assignment": old.pk, "model": MODEL})]
    new.refresh_from_db()
    assert (new.state, new.layer_start, new.layer_end, new.supersedes_id) == (READY, 0, 10, None)


def test_after_a_spare_takes_a_departed_members_place_another_spare_comes_to_its_span(
    make_swarm, pushed, django_capture_on_commit_callbacks
):
    # Every span of the third pipeline has a spare, and t, the fourth, holds [15, 30) beside b and d.
    layout_now = {name: block for name, block in THREE_PIPELINES.items() if name != "s"}
    layout_now |= {
        "s": (3, 0, 0, 10, True),
        "u": (3, 0, 10, 20, True),
        "w": (3, 0, 20, 30, True),
        "t": (3, 0, 15, 30, True),
    }
    nodes = make_swarm(layout_now)
    Node.objects.filter(pk=nodes["e"].pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=21))
    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.sweep_heartbeats()
    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()  # s takes e's place: [0, 10) is now held by s alone

    moved = sweep(django_capture_on_commit_callbacks)

    assert moved == [MODEL]
    assert [row for row in blocks() if row[0] in {"s", "f", "t"}] == [
        ("s", 2, 0, 0, 10, False, READY),
        ("f", 2, 1, 10, 20, False, READY),
        ("t", 3, 0, 0, 10, True, ASSIGNED),
    ]


def test_a_spare_carrying_an_open_job_stays_until_the_job_ends(
    make_swarm, customer, pushed, django_capture_on_commit_callbacks
):
    nodes = make_swarm(THREE_PIPELINES)
    on_spare = [
        {"node": nodes["s"].node_id, "node_key": nodes["s"].public_key, "url": "ws://s", "layer_start": 0,
         "layer_end": 15},
        {"node": nodes["b"].node_id, "node_key": nodes["b"].public_key, "url": "ws://b", "layer_start": 15,
         "layer_end": 30},
    ]  # fmt: skip
    job = Job.objects.create(
        public_id="chatcmpl-on-spare", kind="chat", customer=customer, model=MODEL, state=JobState.RUNNING,
        route=on_spare, coordinator_region="local",
    )  # fmt: skip
    before = layout()

    held = sweep(django_capture_on_commit_callbacks)
    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED)
    after_the_job = sweep(django_capture_on_commit_callbacks)

    assert held == []
    assert after_the_job == [MODEL]
    assert len(pushed.messages) == 1  # the one Assign of the move after the job ended
    assert [row for row in layout() if row[0] != "s"] == [row for row in before if row[0] != "s"]


def test_the_sweep_moves_nothing_when_the_spares_are_where_they_help_most(
    swarm, pushed, django_capture_on_commit_callbacks
):
    # Two pipelines a[0:16] -> b[16:30] and c[0:16] -> d[16:30], e the spare of [16:30): no span is lone.
    before = layout()

    moved = sweep(django_capture_on_commit_callbacks)

    assert moved == []
    assert layout() == before
    assert pushed.messages == []


def test_the_sweep_never_swaps_a_spare_between_two_spans_held_once(
    make_swarm, pushed, django_capture_on_commit_callbacks
):
    # s on [0, 15) beside a; [15, 30) held by b alone, b failing: a move would only make [0, 15) lone.
    nodes = make_swarm({"a": (0, 0, 0, 15, False), "b": (0, 1, 15, 30, False), "s": (1, 0, 0, 15, True)})
    fail(nodes["b"], 20)
    before = layout()

    moved = sweep(django_capture_on_commit_callbacks)

    assert moved == []
    assert layout() == before
    assert pushed.messages == []


def test_the_sweep_moves_at_most_one_spare_per_model_and_the_next_once_the_first_is_ready(
    make_swarm, pushed, django_capture_on_commit_callbacks
):
    nodes = make_swarm(THREE_PIPELINES | {"t": (3, 0, 0, 15, True)})
    first, second = sorted(("s", "t"), key=lambda name: nodes[name].node_id)  # equal needs: by node id

    moved = [sweep(django_capture_on_commit_callbacks)]
    moved.append(sweep(django_capture_on_commit_callbacks))  # the first move is still loading
    with django_capture_on_commit_callbacks(execute=True):
        report_ready()
    moved.append(sweep(django_capture_on_commit_callbacks))
    moved.append(sweep(django_capture_on_commit_callbacks))

    assert moved == [[MODEL], [], [MODEL], []]
    spares_now = {row[0]: row[4:7] for row in layout() if row[6]}
    # Equal rates and lengths: [0, 10) first, then [10, 20); [0, 15) keeps a and c.
    assert spares_now == {first: (0, 10, True), second: (10, 20, True)}


def test_the_sweep_runs_the_spare_step_after_placing():
    names = [work.name for work in periodic.PERIODIC_WORK]

    assert names.index("spares") == names.index("placement") + 1
    assert periodic.BY_NAME["spares"].function == "marketplace.jobs.spares.respread_spares"
