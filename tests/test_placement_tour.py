"""Coordinator placement as a tour: hop cost, Held-Karp, nearest neighbour + 2-opt, region choice."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from marketplace.placement.errors import PlacementError
from marketplace.placement.tour import best_tour, hop_cost, nearest_neighbour_tour, place_coordinator

pytestmark = pytest.mark.control


def random_asymmetric(seed: int, n: int) -> tuple[list[str], dict[tuple[str, str], float]]:
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(n)]
    points = ["depot", *names]
    return names, {(a, b): rng.uniform(1.0, 100.0) for a in points for b in points if a != b}


def geographic(seed: int, n: int) -> tuple[list[str], dict[tuple[str, str], float]]:
    """Points in a plane: one-way latency by distance plus a per-sender uplink term (asymmetric)."""
    rng = random.Random(seed)
    names = [f"n{i:02d}" for i in range(n)]
    where = {p: (rng.uniform(0, 100), rng.uniform(0, 100)) for p in ["depot", *names]}
    uplink = {p: rng.uniform(0.5, 5.0) for p in where}
    return names, {(a, b): math.dist(where[a], where[b]) + uplink[a] for a in where for b in where if a != b}


def cycle_cost(costs: dict[tuple[str, str], float], order: tuple[str, ...]) -> float:
    path = ("depot", *order, "depot")
    return sum(costs[a, b] for a, b in itertools.pairwise(path))


def hops(order: tuple[str, ...]) -> set[tuple[str, str]]:
    return set(itertools.pairwise(("depot", *order, "depot")))


def test_hop_cost_is_half_the_round_trip_plus_serialization_on_the_sender_uplink():
    cost = hop_cost("a", "b", rtt_ms={("a", "b"): 40.0}, uplink_mbps={"a": 1.0}, payload_bytes=125_000)

    assert cost == 20.0 + 1000.0


def test_hop_cost_of_an_unmeasured_link_or_uplink_is_the_penalty():
    rtt, uplink = {("a", "b"): 40.0}, {"a": 1.0, "b": 0.0}

    assert hop_cost("b", "a", rtt_ms=rtt, uplink_mbps=uplink, payload_bytes=10) == 10_000.0
    assert hop_cost("a", "b", rtt_ms=rtt, uplink_mbps={}, payload_bytes=10, unmeasured_ms=500.0) == 500.0
    assert hop_cost("b", "a", rtt_ms={("b", "a"): 2.0}, uplink_mbps=uplink, payload_bytes=10) == 10_000.0


def test_held_karp_equals_brute_force_on_random_asymmetric_instances():
    for seed in range(50):
        names, costs = random_asymmetric(seed, 1 + seed % 8)
        brute = min(cycle_cost(costs, order) for order in itertools.permutations(names))

        tour = best_tour("depot", names, lambda a, b, costs=costs: costs[a, b])

        assert sorted(tour.order) == names
        assert tour.cost == brute
        assert cycle_cost(costs, tour.order) == tour.cost


def test_two_opt_gives_a_permutation_never_worse_than_nearest_neighbour():
    improved = 0
    for seed in range(12):
        names, costs = (geographic if seed % 2 else random_asymmetric)(seed, 20 + 5 * seed)
        cost = lambda a, b, costs=costs: costs[a, b]  # noqa: E731

        tour = best_tour("depot", names, cost)
        plain = nearest_neighbour_tour("depot", names, cost)

        assert sorted(tour.order) == sorted(names)
        assert tour.cost == cycle_cost(costs, tour.order)
        assert tour.cost <= plain.cost
        improved += tour.cost < plain.cost
    assert improved >= 6


def test_heuristic_on_a_small_instance_is_never_below_the_exact_tour():
    for seed in range(10):
        names, costs = geographic(seed, 10)
        cost = lambda a, b, costs=costs: costs[a, b]  # noqa: E731

        assert best_tour("depot", names, cost, exact_max_nodes=0).cost >= best_tour("depot", names, cost).cost


def test_two_opt_does_not_reverse_a_one_way_ring():
    names = [f"n{i:02d}" for i in range(20)]
    ring = ["depot", *names, "depot"]
    cheap = set(itertools.pairwise(ring))

    tour = best_tour("depot", names, lambda a, b: 1.0 if (a, b) in cheap else 100.0)

    assert tour.order == tuple(names)
    assert tour.cost == 21.0


def test_avoids_an_unmeasured_link_when_a_fully_measured_tour_exists():
    # On a line depot=0, a=1, b=2, c=3, d=4 every tour costs >= 8, and a -> b is not measured:
    # counted as free it would allow depot -> a -> b -> c -> d -> depot at 7.
    where = {"depot": 0, "a": 1, "b": 2, "c": 3, "d": 4}
    rtt = {(x, y): 2.0 * abs(where[x] - where[y]) for x in where for y in where if x != y}
    del rtt["a", "b"]
    uplink = dict.fromkeys(where, 100.0)

    def cost(a: str, b: str) -> float:
        return hop_cost(a, b, rtt_ms=rtt, uplink_mbps=uplink, payload_bytes=0)

    tour = best_tour("depot", list("abcd"), cost)
    with_gap_as_free = best_tour("depot", list("abcd"), lambda a, b: 0.0 if (a, b) == ("a", "b") else cost(a, b))

    assert ("a", "b") not in hops(tour.order)
    assert tour.cost == 8.0
    assert ("a", "b") in hops(with_gap_as_free.order)
    assert with_gap_as_free.cost == 7.0


def test_places_the_coordinator_in_the_region_with_the_cheapest_ring():
    # Nodes sit near "eu"; "us" is far away, "asia" farther, and "eu2" mirrors "eu" exactly.
    # Hops towards the origin cost 0.5 more, so a -> b -> c (30.5) beats c -> b -> a (31.5).
    where = {"eu": 0.0, "eu2": 0.0, "us": 60.0, "asia": 90.0, "a": 5.0, "b": 10.0, "c": 15.0}

    def cost(x: str, y: str) -> float:
        return abs(where[x] - where[y]) + (0.5 if where[y] < where[x] else 0.0)

    region, tour = place_coordinator(["us", "eu2", "asia", "eu"], ["c", "a", "b"], cost)

    assert region == "eu"
    assert tour.order == ("a", "b", "c")
    assert tour.cost == 30.5


def test_a_tour_with_no_nodes_costs_nothing_and_bad_inputs_raise():
    assert best_tour("depot", [], lambda a, b: 1.0).cost == 0.0
    with pytest.raises(PlacementError):
        best_tour("depot", ["depot", "a"], lambda a, b: 1.0)
    with pytest.raises(PlacementError):
        best_tour("depot", ["a"], lambda a, b: math.inf)
    with pytest.raises(PlacementError):
        place_coordinator([], ["a"], lambda a, b: 1.0)
