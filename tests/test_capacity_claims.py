"""Capacity is measured, not claimed: placement and routing use a node's credible speed, its claim
capped by what it proved (a passed challenge, timed by the control plane) or, unproven, by the
swarm's proven and claimed medians (``marketplace/nodes/capacity.py``); a claim far beyond what the
node proved is a strike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.utils import timezone

from marketplace.nodes.capacity import credible_speeds
from marketplace.nodes.models import Node
from marketplace.nodes.services import record_verified_speed
from marketplace.placement.selectors import route_request
from marketplace.placement.services import assignment_ready, place_model
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


def test_an_unproven_claim_is_capped_by_the_medians(settings):
    settings.SWARM_SPEED_CLAIM_OUTLIER = 4.0
    alone = credible_speeds([node("a", 300.0), node("b", 250.0), node("liar", 1e12)])
    assert alone["liar"] == 4.0 * 300.0  # four times the median claim
    assert (alone["a"], alone["b"]) == (300.0, 250.0)  # honest spreads within the factor stay

    among_proven = credible_speeds([node("a", 300.0, 280.0), node("b", 250.0, 240.0), node("liar", 1e12)])
    assert among_proven["liar"] == 240.0  # no more than the slowest proven node, until it proves more


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
    every request; at its credible speed it shares the layers and requests go to the proven pair."""
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

    strike = strike_false_capacity_claim(liar.pk, passed_challenge(liar))

    assert strike is not None and strike.kind == StrikeKind.CAPACITY
    assert strike.evidence["claimed_layer_tokens_per_s"] == 1e12
    assert strike.evidence["proven_layer_tokens_per_s"] == 500.0
    assert "2000000000x the 500 it proved" in strike.evidence["reason"]
    # One open strike per false claim, not one per challenge it passes.
    assert strike_false_capacity_claim(liar.pk, passed_challenge(liar)) is None
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
