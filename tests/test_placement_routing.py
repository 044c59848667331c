"""Request routing over measured round trips: best chain, unmeasured links, gaps."""

from __future__ import annotations

import math
import random

import pytest

from marketplace.placement.allocation import Stage
from marketplace.placement.errors import PlacementError
from marketplace.placement.routing import route

pytestmark = pytest.mark.control

# Two pipelines (a -> b, c -> d) split at layer 4, and one node (e) holding all 8 layers.
STAGES = [Stage("a", 0, 4), Stage("b", 4, 8), Stage("c", 0, 4), Stage("d", 4, 8), Stage("e", 0, 8)]
LAYER_MS = {"a": 1.0, "b": 3.0, "c": 2.0, "d": 1.5, "e": 4.0}
RTT_MS = {
    ("coordinator", "a"): 20.0,
    ("coordinator", "c"): 10.0,
    ("coordinator", "e"): 4.0,
    ("a", "b"): 10.0,
    ("a", "d"): 6.0,
    ("c", "b"): 30.0,
    ("c", "d"): 40.0,
    ("b", "coordinator"): 8.0,
    ("d", "coordinator"): 12.0,
    ("e", "coordinator"): 4.0,
}


def test_picks_the_cheapest_chain_even_across_pipelines():
    # a -> b: 10 + 4 + 5 + 12 + 4 = 35       a -> d: 10 + 4 + 3 + 6 + 6 = 29
    # c -> b: 5 + 8 + 15 + 12 + 4 = 44       c -> d: 5 + 8 + 20 + 6 + 6 = 45       e: 2 + 32 + 2 = 36
    best = route(STAGES, 8, RTT_MS, LAYER_MS)

    assert best.stages == (Stage("a", 0, 4), Stage("d", 4, 8))
    assert best.cost_ms == 29.0


def test_accepts_stages_as_tuples_and_a_named_source():
    rtt = {("eu", "a"): 2.0, ("a", "b"): 4.0, ("b", "eu"): 6.0}

    best = route([("a", 0, 3), ("b", 3, 5)], 5, rtt, {"a": 1.0, "b": 2.0}, source="eu")

    assert best.stages == (Stage("a", 0, 3), Stage("b", 3, 5))
    assert best.cost_ms == 1.0 + 3.0 + 2.0 + 4.0 + 3.0


def test_never_chooses_an_unmeasured_link_when_a_measured_chain_exists():
    # x -> y would be nearly free if its link counted as 0; only p -> q is fully measured.
    stages = [Stage("x", 0, 2), Stage("y", 2, 4), Stage("p", 0, 2), Stage("q", 2, 4)]
    rtt = {
        ("coordinator", "x"): 1.0,
        ("y", "coordinator"): 1.0,
        ("coordinator", "p"): 400.0,
        ("p", "q"): 600.0,
        ("q", "coordinator"): 400.0,
    }
    layer_ms = {"x": 0.5, "y": 0.5, "p": 50.0, "q": 50.0}

    best = route(stages, 4, rtt, layer_ms)

    assert best.stages == (Stage("p", 0, 2), Stage("q", 2, 4))
    assert best.cost_ms == 200.0 + 100.0 + 300.0 + 100.0 + 200.0


def test_a_reverse_measurement_does_not_price_the_forward_hop():
    stages = [Stage("x", 0, 2), Stage("y", 2, 4), Stage("p", 0, 2), Stage("q", 2, 4)]
    rtt = {
        ("coordinator", "x"): 1.0,
        ("y", "x"): 1.0,
        ("y", "coordinator"): 1.0,
        ("coordinator", "p"): 400.0,
        ("p", "q"): 600.0,
        ("q", "coordinator"): 400.0,
    }
    layer_ms = {"x": 0.5, "y": 0.5, "p": 50.0, "q": 50.0}

    assert route(stages, 4, rtt, layer_ms).stages == (Stage("p", 0, 2), Stage("q", 2, 4))


def test_an_unmeasured_chain_is_still_returned_at_its_penalty_when_it_is_the_only_one():
    best = route([Stage("a", 0, 2), Stage("b", 2, 4)], 4, {}, {"a": 1.0}, unmeasured_ms=1000.0)

    assert best.stages == (Stage("a", 0, 2), Stage("b", 2, 4))
    assert best.cost_ms == 1000.0 + 2.0 + 1000.0 + 1000.0 + 1000.0


def test_raises_when_no_chain_covers_every_layer():
    with pytest.raises(PlacementError):
        route([Stage("a", 0, 4), Stage("b", 5, 8), Stage("c", 4, 7)], 8, RTT_MS, LAYER_MS)


def test_raises_on_a_stage_beyond_the_model():
    with pytest.raises(PlacementError):
        route([Stage("a", 0, 9)], 8, RTT_MS, LAYER_MS)


def cheapest_by_enumeration(stages, n_layers, rtt, layer_ms, unmeasured_ms) -> float:
    """The least cost over every chain of ``stages`` from layer 0 to ``n_layers``, by trying them all."""

    def hop(a: str, b: str) -> float:
        return 0.0 if a == b else rtt[(a, b)] / 2 if (a, b) in rtt else unmeasured_ms

    def work(stage: Stage) -> float:
        return stage.layers * layer_ms[stage.node] if stage.node in layer_ms else unmeasured_ms

    def rest(previous: str, layer: int) -> float:
        if layer == n_layers:
            return hop(previous, "coordinator")
        return min(
            (hop(previous, s.node) + work(s) + rest(s.node, s.layer_end) for s in stages if s.layer_start == layer),
            default=math.inf,
        )

    return rest("coordinator", 0)


def test_the_route_costs_the_least_of_all_chains_on_random_instances():
    # Whole-number costs add up exactly, so the enumeration and the route agree to the last bit,
    # and ties are frequent: the pruned second pass must keep a cheapest chain all the same.
    rng = random.Random(23)
    for _ in range(400):
        nodes = [f"n{i}" for i in range(rng.randint(1, 8))]
        n_layers = rng.randint(1, 8)
        stages = list(
            {
                Stage(rng.choice(nodes), start, rng.randint(start + 1, n_layers))
                for start in (rng.randrange(n_layers) for _ in range(rng.randint(1, 14)))
            }
        )
        points = [*nodes, "coordinator"]
        rtt = {(a, b): float(rng.randint(0, 9)) for a in points for b in points if a != b and rng.random() < 0.8}
        layer_ms = {n: float(rng.randint(0, 5)) for n in nodes if rng.random() < 0.9}

        expected = cheapest_by_enumeration(stages, n_layers, rtt, layer_ms, 100.0)

        if math.isinf(expected):
            with pytest.raises(PlacementError):
                route(stages, n_layers, rtt, layer_ms, unmeasured_ms=100.0)
            continue
        best = route(stages, n_layers, rtt, layer_ms, unmeasured_ms=100.0)
        assert best.cost_ms == expected
        assert [s.layer_start for s in best.stages] == [0] + [s.layer_end for s in best.stages[:-1]]
        assert best.stages[-1].layer_end == n_layers
