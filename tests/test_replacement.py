"""Re-placement only when it pays: a model is placed again when its per-layer load is uneven AND a
fresh plan over the same nodes is predicted to serve SWARM_REPLACE_MARGIN more tokens/s, or when a
node comes or goes; measurement noise and a control channel reconnecting never re-place it (a
reconnected node's blocks are routed to again once its agent confirms where it serves them).

Time is moved by hand: the sweep (``rebalance_if_needed`` then ``place_dirty_models``) runs every 5 s
of simulated time for 10 minutes while the agents' heartbeats report their measured speed."""

from __future__ import annotations

import logging
import random
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.nodes.joining import rotate_join_token
from marketplace.nodes.models import Node
from marketplace.placement import lifecycle, placing, readiness, rebalancing
from marketplace.placement.allocation import Stage, pays_to_replace, throughput
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState, PlacementState
from marketplace.placement.selectors import servable_pipelines
from tests.factories import MODEL, join_payload
from worker_agent.protocol.keys import generate_signing_key

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

SPEEDS = {"a": 300.0, "b": 200.0, "c": 150.0, "d": 100.0}  # layer-tokens/s, unequal on purpose
SWEEP = timedelta(seconds=5)


@pytest.fixture
def four_nodes(provider, make_joined_node, measure_ring, swarm_settings):
    swarm_settings.SWARM_REBALANCE_CV = 0.05  # sensitive: noise passes it, so the margin is what decides
    swarm_settings.SWARM_REBALANCE_MIN_INTERVAL_S = 60.0
    swarm_settings.SWARM_REPLACE_MARGIN = 0.15
    nodes = [make_joined_node(provider, name, compute=speed, max_layers=15).node for name, speed in SPEEDS.items()]
    measure_ring(nodes)
    placing.place_model(MODEL)
    report_ready()
    return nodes


def generation() -> int:
    return PlacementState.objects.get(model=MODEL).generation


def run_sweeps(nodes: list[Node], minutes: int, speed_of) -> tuple[int, int]:
    """Heartbeats and the sweep every 5 s of simulated time; (re-placements, rebalance checks that fired)."""
    start, fired, before = timezone.now(), 0, generation()
    for step in range(1, minutes * 60 // 5 + 1):
        for node in nodes:
            lifecycle.record_heartbeat(node.pk, {"layer_ms": 1000.0 / speed_of(node.name, step)})
        fired += len(rebalancing.rebalance_if_needed(now=start + step * SWEEP))
        placing.place_dirty_models()
        report_ready()  # the agents load new blocks within one sweep
    return generation() - before, fired


def report_ready() -> None:
    for assignment in Assignment.objects.filter(state=AssignmentState.ASSIGNED):
        readiness.assignment_ready(assignment.node_id, assignment.pk, f"ws://127.0.0.1:{9000 + assignment.node_id}")


def test_throughput_is_the_sum_of_each_pipelines_slowest_stage():
    pipelines = [[Stage("a", 0, 10), Stage("b", 10, 30)], [Stage("c", 0, 30)]]

    assert throughput(pipelines, {"a": 100.0, "b": 400.0, "c": 90.0}) == pytest.approx(10.0 + 3.0)


def test_a_new_placement_pays_only_past_the_margin():
    assert pays_to_replace(10.0, 11.49, 0.15) is False
    assert pays_to_replace(10.0, 11.5, 0.15) is True
    assert pays_to_replace(0.0, 1.0, 0.15) is True  # nothing is served now
    assert pays_to_replace(0.0, 0.0, 0.15) is False


def test_noisy_speeds_over_ten_minutes_re_place_nothing(four_nodes, caplog):
    noise = random.Random(20261201)  # a pure draw: the same sequence on every machine
    caplog.set_level(logging.INFO, logger="swarm.placement")

    replaced, fired = run_sweeps(four_nodes, 10, lambda name, step: SPEEDS[name] * noise.uniform(0.8, 1.2))

    assert replaced == 0
    assert fired == 0
    kept = [r.getMessage() for r in caplog.records if "kept (under the 15% margin)" in r.getMessage()]
    assert kept  # the uneven load was seen, and the margin is what kept the placement


def test_a_node_that_really_slows_down_is_re_placed_once(four_nodes):
    replaced, fired = run_sweeps(four_nodes, 3, lambda name, step: SPEEDS[name] / (5 if name == "a" else 1))

    assert (replaced, fired) == (1, 1)


def test_a_control_channel_reconnect_of_an_active_node_does_not_re_place(
    four_nodes, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.node_connected(four_nodes[1].pk)

    assert PlacementState.objects.get(model=MODEL).dirty is False


def test_a_reconnected_node_is_routed_to_again_only_once_its_agent_confirms_each_block_where_it_serves(
    four_nodes, django_capture_on_commit_callbacks, monkeypatch
):
    probes = []
    monkeypatch.setattr(readiness, "request_probes", lambda model, nodes: probes.append(model))
    # The agent process restarted with the same key (a restart, an upgrade): its control channel
    # reconnects before its block is loaded again, and it serves on another port this time.
    restarted = four_nodes[1]
    (block,) = Assignment.objects.filter(node=restarted, state=AssignmentState.READY)
    assert len(servable_pipelines(MODEL)) == 2

    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.node_connected(restarted.pk)

    block.refresh_from_db()
    assert block.state == AssignmentState.ASSIGNED  # kept, but not routed to until confirmed
    assert all(stage.node != restarted.node_id for pipeline in servable_pipelines(MODEL) for stage in pipeline)
    assert len(servable_pipelines(MODEL)) == 1

    assert readiness.assignment_ready(restarted.pk, block.pk, "ws://127.0.0.1:19999")
    block.refresh_from_db()
    assert (block.state, block.data_url) == (AssignmentState.READY, "ws://127.0.0.1:19999")
    urls = {stage.node: stage.data_url for pipeline in servable_pipelines(MODEL) for stage in pipeline}
    assert urls[restarted.node_id] == "ws://127.0.0.1:19999"
    assert PlacementState.objects.get(model=MODEL).dirty is False  # no re-placement for any of it
    assert probes == []  # nor a new round of link probes: the links were measured when it was placed


def test_a_node_joining_again_with_a_new_agent_leaves_no_stale_stage_to_route_to(
    four_nodes, django_capture_on_commit_callbacks
):
    # A restarted agent (e.g. `make demo` run again) joins its node with a fresh key: the blocks the
    # previous agent process held are gone, so its stages must not stay routable.
    assert len(servable_pipelines(MODEL)) == 2
    rejoining = four_nodes[1]
    token = rotate_join_token(rejoining)

    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.register_agent(**join_payload(token, generate_signing_key()))

    rejoining.refresh_from_db()
    assert rejoining.connected is False
    assert Assignment.objects.filter(node=rejoining, state__in=LIVE_STATES).count() == 0
    assert all(stage.node != rejoining.node_id for pipeline in servable_pipelines(MODEL) for stage in pipeline)
    assert len(servable_pipelines(MODEL)) == 1
    assert PlacementState.objects.get(model=MODEL).dirty is True
