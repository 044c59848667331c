"""Capacity is measured, not claimed: placement and routing use a node's credible speed, its claim
capped by what it proved (a passed challenge, timed by the control plane) or, unproven, by the
slowest proven speed; an unproven claim far past the other nodes' is in doubt and counts for
nothing until a challenge measures it: no pipeline of its own and no request while other nodes can
serve (``marketplace/nodes/capacity.py``); a claim far beyond what the node proved is a strike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.utils import timezone

from marketplace.nodes.capacity import assess, credible_speeds
from marketplace.nodes.models import Node
from marketplace.nodes.services import record_verified_speed
from marketplace.placement.allocation import NodeCapacity, place
from marketplace.placement.lifecycle import record_measured_speed
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState, PlacementState
from marketplace.placement.placing import place_model
from marketplace.placement.readiness import assignment_ready
from marketplace.placement.selectors import route_request
from marketplace.verification.models import Challenge, CheckState, Strike, StrikeKind
from marketplace.verification.strikes import strike_false_capacity_claim

pytest_plugins = ["tests.factories", "tests.control_fixtures"]
pytestmark = [pytest.mark.trust, pytest.mark.django_db]

MODEL = "tiny-llama"


def node(name: str, claim: float, verified: float | None = None):
    return SimpleNamespace(node_id=name, compute_layer_tokens_per_s=claim, verified_layer_tokens_per_s=verified)


def test_a_proven_node_counts_up_to_the_slack_times_what_it_proved(settings):
    settings.SWARM_SPEED_VERIFIED_SLACK = 4.0
    speeds = credible_speeds([node("a", 1000.0, verified=100.0), node("b", 300.0, verified=200.0)])

    assert speeds == {"a": 400.0, "b": 300.0}


def test_an_unproven_claim_far_past_the_others_is_in_doubt_and_counts_for_nothing(settings):
    settings.SWARM_SPEED_CLAIM_OUTLIER = 4.0
    fresh = assess([node("a", 300.0), node("b", 250.0), node("liar", 1e12)])
    assert fresh.in_doubt == {"liar"}
    assert fresh.speeds == {"a": 300.0, "b": 250.0, "liar": 250.0}  # no faster than any node in sight

    # With one other node the liar's own claim cannot drag up the median it is judged by.
    pair = assess([node("a", 300.0), node("liar", 1e12)])
    assert (pair.in_doubt, pair.speeds) == ({"liar"}, {"a": 300.0, "liar": 300.0})

    # An honest spread within the factor counts as claimed, never above the slowest proven speed.
    among_proven = assess([node("a", 300.0, 280.0), node("b", 250.0, 240.0), node("new", 900.0)])
    assert among_proven.in_doubt == frozenset()
    assert among_proven.speeds == {"a": 300.0, "b": 250.0, "new": 240.0}


def test_a_node_in_doubt_joins_a_pipeline_only_when_the_others_cannot_hold_the_model():
    honest = [NodeCapacity("a", 300.0, 3), NodeCapacity("b", 250.0, 3)]
    liar = NodeCapacity("liar", 250.0, 6, in_doubt=True)

    plan = place([*honest, liar], 6)
    assert [[s.node for s in p] for p in plan.pipelines] == [["a", "b"]]
    assert [s.node for s in plan.spares] == ["liar"]

    needed = place([honest[0], liar], 6)  # a alone holds half the model: nothing else can serve
    assert sorted(s.node for p in needed.pipelines for s in p) == ["a", "liar"]
    assert needed.spares == ()


def test_the_best_proven_speed_is_kept(provider, make_joined_node):
    joined = make_joined_node(provider, "gpu-1").node
    record_verified_speed(joined.pk, 120.0)
    record_verified_speed(joined.pk, 80.0)
    record_verified_speed(joined.pk, 0.0)

    joined.refresh_from_db()
    assert joined.verified_layer_tokens_per_s == 120.0


def test_a_node_claiming_1e12_does_not_take_the_model(
    settings, provider, make_joined_node, swarm_settings, measure_ring
):
    """Two proven nodes that can hold half the model each, and a new one that can hold all of it and
    claims 1e12 layer-tokens/s: taken at its word it would be placed alone over every layer and get
    every request; in doubt, it is a warm spare and requests go to the proven pair."""
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_SPARES_PER_PIPELINE = 0
    a = make_joined_node(provider, "gpu-a", compute=300.0, max_layers=3).node
    b = make_joined_node(provider, "gpu-b", compute=250.0, max_layers=3).node
    Node.objects.filter(pk=a.pk).update(verified_layer_tokens_per_s=280.0)
    Node.objects.filter(pk=b.pk).update(verified_layer_tokens_per_s=240.0)
    liar = make_joined_node(provider, "gpu-liar", compute=1e12, max_layers=6).node
    measure_ring([a, b, liar])

    placed = place_model(MODEL)
    for assignment in placed:
        assignment_ready(assignment.node_id, assignment.pk, f"ws://127.0.0.1:{9000 + assignment.node_id}")
    _, route, _ = route_request(MODEL)

    assert [s.node for s in route] == [a.node_id, b.node_id]  # requests go to the proven pair
    assert Assignment.objects.get(node=liar, state__in=LIVE_STATES).is_spare is True


def test_in_a_fresh_swarm_a_1e12_claim_gets_no_pipeline_of_its_own_and_wins_no_request_until_measured(
    settings, provider, make_joined_node, swarm_settings, measure_ring
):
    """Nobody is measured yet. A node that can hold the whole model claims 1e12 layer-tokens/s and is
    the nearest to the coordinator: until a challenge measures it, it holds a warm spare while the
    two honest nodes serve; once one does, its speed counts as measured and it may serve alone."""
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_SPARES_PER_PIPELINE = 0
    settings.SWARM_SPEED_VERIFIED_SLACK = 4.0
    a = make_joined_node(provider, "gpu-a", compute=300.0, max_layers=3).node
    b = make_joined_node(provider, "gpu-b", compute=250.0, max_layers=3).node
    liar = make_joined_node(provider, "gpu-liar", compute=1e12, max_layers=6).node
    measure_ring([liar, a, b])

    ready(place_model(MODEL))

    assert layout() == [("gpu-a", 0, 3, False), ("gpu-b", 3, 6, False), ("gpu-liar", 3, 6, True)]
    routes = {tuple(s.node for s in route_request(MODEL)[1]) for _ in range(3)}
    assert routes == {(a.node_id, b.node_id)}

    # A passed challenge proves 500 layer-tokens/s: its speed counts (up to the slack over that), a
    # plan with a pipeline of its own now pays, and it is placed again.
    assert record_measured_speed(liar.pk, 500.0) is True
    liar.refresh_from_db()
    assert assess([liar, a, b]).speeds[liar.node_id] == 2000.0
    assert PlacementState.objects.get(model=MODEL).dirty is True
    ready(place_model(MODEL))

    assert layout() == [("gpu-a", 0, 3, False), ("gpu-b", 3, 6, False), ("gpu-liar", 0, 6, False)]
    _, route, _ = route_request(MODEL)
    assert [s.node for s in route] == [liar.node_id]


def ready(placed: list[Assignment]) -> None:
    for assignment in placed:
        if assignment.state == AssignmentState.ASSIGNED:
            assignment_ready(assignment.node_id, assignment.pk, f"ws://127.0.0.1:{9000 + assignment.node_id}")


def layout() -> list[tuple[str, int, int, bool]]:
    """(node name, layer_start, layer_end, is_spare) of each live block, pipelines first."""
    return list(
        Assignment.objects.filter(state__in=LIVE_STATES)
        .order_by("is_spare", "pipeline", "position")
        .values_list("node__name", "layer_start", "layer_end", "is_spare")
    )


def test_a_claim_far_beyond_what_the_node_proved_is_a_strike_and_an_honest_gap_is_not(
    settings, provider, make_joined_node
):
    settings.SWARM_SPEED_FALSE_CLAIM = 50.0
    liar = make_joined_node(provider, "gpu-liar", compute=1e12).node
    honest = make_joined_node(provider, "gpu-honest", compute=3000.0).node
    # Their challenges proved 500 and 300 layer-tokens/s (timed with round trips and queueing: an
    # honest node proves well under its benchmark, here 10x under).
    record_verified_speed(liar.pk, 500.0)
    record_verified_speed(honest.pk, 300.0)
    # One passed challenge is no evidence yet: load only slows a challenge (SWARM_SPEED_EVIDENCE_CHALLENGES: 3).
    assert strike_false_capacity_claim(liar.pk, passed_challenge(liar)) is None
    passed_challenge(liar)

    strike = strike_false_capacity_claim(liar.pk, passed_challenge(liar))

    assert strike is not None and strike.kind == StrikeKind.CAPACITY
    assert strike.evidence["claimed_layer_tokens_per_s"] == 1e12
    assert strike.evidence["proven_layer_tokens_per_s"] == 500.0
    assert "2000000000x the 500 it proved" in strike.evidence["reason"]
    # One open strike per false claim, not one per challenge it passes.
    assert strike_false_capacity_claim(liar.pk, passed_challenge(liar)) is None
    for _ in range(3):
        assert strike_false_capacity_claim(honest.pk, passed_challenge(honest)) is None
    unproven = make_joined_node(provider, "gpu-new", compute=1e12).node
    assert strike_false_capacity_claim(unproven.pk, None) is None  # nothing proved yet: only capped, not struck
    assert list(Strike.objects.values_list("node__name", "kind")) == [("gpu-liar", StrikeKind.CAPACITY)]


def passed_challenge(node: Node) -> Challenge:
    now = timezone.now()
    return Challenge.objects.create(
        node=node, model=MODEL, layer_start=0, layer_end=6, seed=1, tokens=8, state=CheckState.PASSED,
        sent_at=now, deadline_at=now, elapsed_ms=96.0,
    )  # fmt: skip
