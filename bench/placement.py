"""Placement speed: place 1,000 nodes, route one request, order a ring of 16 and of 200 agents.

    .venv/bin/python bench/placement.py

In one run, all inputs seeded:

1. ``place``: 1,000 nodes for an 80-layer model; compute uniform in 50..2,000 layer-tokens/s,
   memory for 4..40 layers, reputation uniform in 0..1 for one node in ten (those below 0.5 are
   kept off pipelines) and 0.5..1 for the rest.
2. ``route``: one request over every load-bearing stage of that placement. The round trips are
   synthetic, not measured: every node and the coordinator get a point in a 2-D plane (distances
   up to ~200 ms round trip) and each ordered pair a jitter of 0..5 ms, computed lazily
   when ``route`` looks the pair up, so the map stands for all 1,001 x 1,000 directed pairs
   without storing them; the run reports how many pairs ``route`` actually looked up.
   A node's time per layer is 1,000 / compute ms.
3. ``best_tour``: Held-Karp on 16 agents and nearest neighbour + 2-opt on 200, hop costs from
   the same kind of plane plus a per-sender uplink term (asymmetric).
4. The greedy pipeline count (used above ``EXACT_STATES`` states) against the exact DP on 2,000
   random instances of at most 12 nodes: how often it finds the same score, and its worst ratio.

Each time is the best of a few repetitions (``time.perf_counter``). Targets are reported, not
asserted: placing 1,000 nodes for 80 layers < 1 s; routing one request < 10 ms. The table goes to
stdout, the figures to ``bench/results/placement.json``.
"""

from __future__ import annotations

import json
import math
import platform
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from marketplace.placement import allocation
from marketplace.placement.allocation import NodeCapacity, place
from marketplace.placement.routing import route
from marketplace.placement.tour import best_tour, nearest_neighbour_tour

RESULTS = Path(__file__).resolve().parent / "results" / "placement.json"
SEED = 20240601
N_NODES, N_LAYERS = 1000, 80
TARGETS = {"place_s": 1.0, "route_ms": 10.0}


class SyntheticRtt(Mapping[tuple[str, str], float]):
    """Round trips from points in a plane plus a per-direction jitter, made on lookup.

    Each point gets two seeded offsets u, w in [0, 1); the jitter of a -> b is
    ``5 * ((u_a + w_b) mod 1)`` ms, so a -> b and b -> a differ, without storing a million pairs.
    """

    def __init__(self, points: Mapping[str, tuple[float, float]], rng: random.Random) -> None:
        self.points, self.lookups = points, 0
        self.offsets = {p: (rng.random(), rng.random()) for p in points}

    def __getitem__(self, pair: tuple[str, str]) -> float:
        a, b = pair
        if a == b or a not in self.points or b not in self.points:
            raise KeyError(pair)
        self.lookups += 1
        return 2 * math.dist(self.points[a], self.points[b]) + 5.0 * ((self.offsets[a][0] + self.offsets[b][1]) % 1.0)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return ((a, b) for a in self.points for b in self.points if a != b)

    def __len__(self) -> int:
        return len(self.points) * (len(self.points) - 1)


def best_of(repeats: int, fn: Callable[[], object]) -> tuple[float, object]:
    """The shortest of ``repeats`` timings of ``fn()`` in seconds, and its last result."""
    best, result = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def nodes_for(rng: random.Random) -> list[NodeCapacity]:
    return [
        NodeCapacity(
            node=f"node-{i:04d}",
            compute=rng.uniform(50.0, 2000.0),
            max_layers=rng.randint(4, 40),
            reputation=rng.uniform(0.0, 1.0) if rng.random() < 0.1 else rng.uniform(0.5, 1.0),
        )
        for i in range(N_NODES)
    ]


def tour_costs(rng: random.Random, n: int) -> tuple[list[str], Callable[[str, str], float]]:
    names = [f"agent-{i:03d}" for i in range(n)]
    where = {p: (rng.uniform(0, 70), rng.uniform(0, 70)) for p in ["coordinator", *names]}
    uplink_ms = {p: rng.uniform(0.1, 3.0) for p in where}
    return names, lambda a, b: math.dist(where[a], where[b]) + uplink_ms[a]


def greedy_against_exact(rng: random.Random, instances: int) -> dict[str, float]:
    same, worst = 0, 1.0
    for _ in range(instances):
        n_layers = rng.randint(1, 60)
        caps = sorted((min(rng.randint(1, 60), n_layers) for _ in range(rng.randint(1, 12))), reverse=True)
        while sum(caps) < n_layers:
            caps.append(n_layers)
        exact, greedy = allocation._exact_groups(caps, n_layers), allocation._greedy_groups(caps, n_layers)
        ratio = (len(greedy) ** 2 / sum(map(len, greedy))) / (len(exact) ** 2 / sum(map(len, exact)))
        same += ratio == 1.0
        worst = min(worst, ratio)
    return {"instances": instances, "same_score": same, "worst_score_ratio": round(worst, 4)}


def main() -> None:
    rng = random.Random(SEED)
    nodes = nodes_for(rng)
    place_s, placement = best_of(5, lambda: place(nodes, N_LAYERS))

    points = {n.node: (rng.uniform(0, 70), rng.uniform(0, 70)) for n in nodes}
    points["coordinator"] = (35.0, 35.0)
    rtt = SyntheticRtt(points, rng)
    layer_ms = {n.node: 1000.0 / n.compute for n in nodes}
    stages = placement.stages
    route_s, best = best_of(20, lambda: route(stages, N_LAYERS, rtt, layer_ms))
    lookups_per_route = rtt.lookups // 20

    names16, cost16 = tour_costs(rng, 16)
    tour16_s, tour16 = best_of(3, lambda: best_tour("coordinator", names16, cost16))
    names200, cost200 = tour_costs(rng, 200)
    tour200_s, tour200 = best_of(3, lambda: best_tour("coordinator", names200, cost200))
    nn200 = nearest_neighbour_tour("coordinator", names200, cost200)
    quality = greedy_against_exact(rng, 2000)

    plan = placement.plan
    verdict = {
        "place": "PASS" if place_s < TARGETS["place_s"] else "MISS",
        "route": "PASS" if route_s * 1e3 < TARGETS["route_ms"] else "MISS",
    }
    rows = [
        (
            "place 1,000 nodes / 80 layers",
            f"{place_s * 1e3:9.1f} ms",
            f"< {TARGETS['place_s'] * 1e3:.0f} ms",
            verdict["place"],
        ),
        ("route one request", f"{route_s * 1e3:9.2f} ms", f"< {TARGETS['route_ms']:.0f} ms", verdict["route"]),
        ("best_tour n=16 (Held-Karp)", f"{tour16_s * 1e3:9.1f} ms", "-", ""),
        ("best_tour n=200 (NN + 2-opt)", f"{tour200_s * 1e3:9.1f} ms", "-", ""),
    ]
    print(f"{'what':32} {'time':>12}  {'target':>9}  verdict")
    for what, took, target, mark in rows:
        print(f"{what:32} {took:>12}  {target:>9}  {mark}")
    print()
    print(
        f"placement: k={plan.k} pipelines, {plan.stages_total} stages, score {plan.score:.2f}, "
        f"exact={plan.exact}, {len(placement.spares)} spares"
    )
    print(
        f"route: {len(best.stages)} stages, {best.cost_ms:.1f} ms predicted per pass, over {len(stages)} stages; "
        f"{lookups_per_route} RTT lookups per route out of {len(rtt):,} synthetic directed pairs"
    )
    print(
        f"tours: n=16 cost {tour16.cost:.1f}; n=200 cost {tour200.cost:.1f} (nearest neighbour alone {nn200.cost:.1f})"
    )
    print(
        f"greedy pipeline count vs exact DP: same score on {quality['same_score']}/{quality['instances']} "
        f"random instances, worst score ratio {quality['worst_score_ratio']}"
    )

    report = {
        "benchmark": "placement",
        "command": "python bench/placement.py",
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "conditions": {
            "seed": SEED,
            "nodes": N_NODES,
            "n_layers": N_LAYERS,
            "rtt": "synthetic: 2 x plane distance + 0..5 ms jitter per direction, made on lookup",
            "timing": "best of 5 (place), 20 (route), 3 (tours) repetitions, time.perf_counter",
        },
        "results": {
            "place_s": round(place_s, 6),
            "route_ms": round(route_s * 1e3, 4),
            "best_tour_16_ms": round(tour16_s * 1e3, 3),
            "best_tour_200_ms": round(tour200_s * 1e3, 3),
            "placement": {
                "k": plan.k,
                "stages_total": plan.stages_total,
                "score": round(plan.score, 4),
                "exact": plan.exact,
                "spares": len(placement.spares),
            },
            "route": {
                "stages": len(best.stages),
                "cost_ms": round(best.cost_ms, 3),
                "candidates": len(stages),
                "rtt_lookups": lookups_per_route,
                "rtt_pairs": len(rtt),
            },
            "tour_cost": {
                "n16": round(tour16.cost, 3),
                "n200": round(tour200.cost, 3),
                "n200_nearest_neighbour": round(nn200.cost, 3),
            },
            "greedy_vs_exact": quality,
        },
        "targets": {"place_s_below": TARGETS["place_s"], "route_ms_below": TARGETS["route_ms"]},
        "verdict": verdict,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
