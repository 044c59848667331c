"""Coordinator placement: the ring of agents as a tour, with the coordinator as its depot.

In a ring topology the coordinator sends the hidden state to the first agent, each agent passes
it to the next, and the last returns the result to the coordinator: one cycle
``depot -> a_1 -> ... -> a_n -> depot`` per token. Its latency is the sum of the hop costs, so
the cheapest ring order is a travelling-salesman tour over the agents with the coordinator as
depot, and the coordinator's region is chosen jointly with it: the region whose best tour is
cheapest (:func:`place_coordinator`).

A hop is priced by :func:`hop_cost`: one-way latency plus serialization of the payload on the
sender's uplink. Costs may be asymmetric (uplinks differ, routes differ), so every algorithm
here prices each direction with its own measurement.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from marketplace.placement.errors import PlacementError

EXACT_TOUR_NODES = 16  # Held-Karp up to here: 2**16 * 16 states, 16 predecessors each
DEFAULT_UNMEASURED_MS = 10_000.0

Cost = Callable[[str, str], float]


@dataclass(frozen=True)
class Tour:
    """A cycle from the depot through every node and back."""

    order: tuple[str, ...]  # the nodes in ring order, depot excluded: depot -> order[0] .. order[-1] -> depot
    cost: float  # sum of the hop costs around the cycle, in the cost function's unit (ms)


def hop_cost(
    sender: str,
    receiver: str,
    *,
    rtt_ms: Mapping[tuple[str, str], float],
    uplink_mbps: Mapping[str, float],
    payload_bytes: int,
    unmeasured_ms: float = DEFAULT_UNMEASURED_MS,
) -> float:
    """Milliseconds for ``payload_bytes`` to go from ``sender`` to ``receiver``.

    ``rtt_ms[(sender, receiver)] / 2 + payload_bytes * 8 / (uplink_mbps[sender] * 1e6) * 1e3``:
    one-way latency plus serialization on the sender's uplink (the receiver's downlink is
    assumed the wider). Only the (sender, receiver) entry measures this direction. A missing
    round trip, or a missing or non-positive uplink, costs ``unmeasured_ms``: bad, never free.
    """
    rtt = rtt_ms.get((sender, receiver))
    uplink = uplink_mbps.get(sender)
    if rtt is None or uplink is None or not uplink > 0:
        return unmeasured_ms
    if not (math.isfinite(rtt) and rtt >= 0):
        raise PlacementError(f"bad round trip {sender} -> {receiver}: {rtt!r}")
    return rtt / 2 + payload_bytes * 8 / (uplink * 1e6) * 1e3


def _matrix(depot: str, nodes: Sequence[str], cost: Cost) -> tuple[list[str], np.ndarray]:
    """Sorted node names and the cost matrix over ``[depot, *names]`` (row = sender)."""
    names = sorted(nodes)
    if len(set(names)) != len(names):
        raise PlacementError("duplicate node in tour")
    if depot in names:
        raise PlacementError(f"the depot {depot} is also listed as a node")
    points = [depot, *names]
    matrix = np.array([[0.0 if a == b else float(cost(a, b)) for b in points] for a in points], dtype=np.float64)
    if not np.isfinite(matrix).all():
        raise PlacementError("tour costs must be finite (price an unmeasured link, do not make it infinite)")
    return names, matrix


def _cycle_cost(matrix: np.ndarray, order: Sequence[int]) -> float:
    """Hop costs summed left to right around ``0 -> order -> 0`` (indices into the matrix)."""
    path = [0, *order, 0]
    return sum(float(matrix[a, b]) for a, b in itertools.pairwise(path))


def _held_karp(matrix: np.ndarray) -> list[int]:
    """Exact cheapest cycle by Held-Karp, O(n^2 2^n), vectorised over the subsets of each size.

    ``D[S, j]`` = cheapest path from the depot through exactly the nodes of S, ending at j in S:
    ``D[{j}, j] = c(0, j)``, ``D[S, j] = min_{i in S - j} D[S - j, i] + c(i, j)``, and the tour
    costs ``min_j D[all, j] + c(j, 0)``. Sums run in path order, so the result equals the brute
    force minimum exactly; ties go to the smaller index (numpy's argmin).
    """
    n = len(matrix) - 1
    between = matrix[1:, 1:]  # (n, n) sender i -> receiver j, among the nodes
    full = 1 << n
    best = np.full((full, n), np.inf)  # (subsets, last node)
    before = np.zeros((full, n), dtype=np.int8)  # the node visited before the last
    best[1 << np.arange(n), np.arange(n)] = matrix[0, 1:]
    subsets = np.arange(full)
    size = sum((subsets >> b) & 1 for b in range(n))
    for k in range(2, n + 1):
        of_size = subsets[size == k]
        for j in range(n):
            ending = of_size[(of_size >> j) & 1 == 1]
            candidates = best[ending ^ (1 << j)] + between[:, j]  # (len(ending), n): arrive at j from each i
            choice = np.argmin(candidates, axis=1)
            best[ending, j] = candidates[np.arange(len(ending)), choice]
            before[ending, j] = choice
    last = int(np.argmin(best[full - 1] + matrix[1:, 0]))
    order, subset = [], full - 1
    while subset:
        order.append(last + 1)
        subset, last = subset ^ (1 << last), int(before[subset, last])
    return order[::-1]


def _nearest_neighbour(matrix: np.ndarray) -> list[int]:
    """From the depot, always on to the cheapest node not yet visited (ties: smaller index)."""
    rows = matrix.tolist()
    left, order, at = list(range(1, len(rows))), [], 0
    while left:
        at = min(left, key=lambda j: (rows[at][j], j))
        left.remove(at)
        order.append(at)
    return order


def _two_opt(matrix: np.ndarray, order: list[int]) -> list[int]:
    """Best-improvement 2-opt that prices reversals exactly under asymmetric costs.

    Reversing positions i..j of the cycle ``p_0 = 0, p_1 .. p_n, p_{n+1} = 0`` replaces the
    edges ``p_{i-1} -> p_i`` and ``p_j -> p_{j+1}`` by ``p_{i-1} -> p_j`` and ``p_i -> p_{j+1}``, and
    also turns every edge inside the segment around: ``p_t -> p_{t+1}`` becomes
    ``p_{t+1} -> p_t``, which is a different cost when costs are asymmetric. With prefix sums
    ``F[t] = sum_{u<t} c(p_u, p_{u+1})`` and ``B[t] = sum_{u<t} c(p_{u+1}, p_u)`` the full change is

        c(p_{i-1}, p_j) + c(p_i, p_{j+1}) - c(p_{i-1}, p_i) - c(p_j, p_{j+1}) + (B[j] - B[i]) - (F[j] - F[i])

    for all pairs at once. Each pass applies the most negative change, if the recomputed cycle
    cost is really lower; the tour only ever gets cheaper, so it ends no worse than it began.
    """
    n = len(order)
    first, last = np.triu_indices(n, k=1)
    first, last = first + 1, last + 1  # positions i < j in the cycle, 1-based
    cost = _cycle_cost(matrix, order)
    while n > 2:
        path = np.array([0, *order, 0])
        forward = matrix[path[:-1], path[1:]]
        backward = matrix[path[1:], path[:-1]]
        f = np.concatenate(([0.0], np.cumsum(forward)))
        b = np.concatenate(([0.0], np.cumsum(backward)))
        change = (
            matrix[path[first - 1], path[last]]
            + matrix[path[first], path[last + 1]]
            - forward[first - 1]
            - forward[last]
            + (b[last] - b[first])
            - (f[last] - f[first])
        )
        move = int(np.argmin(change))
        if not change[move] < 0:
            break
        i, j = int(first[move]), int(last[move])
        candidate = order[: i - 1] + order[i - 1 : j][::-1] + order[j:]
        candidate_cost = _cycle_cost(matrix, candidate)
        if not candidate_cost < cost:
            break
        order, cost = candidate, candidate_cost
    return order


def _tour(names: list[str], matrix: np.ndarray, order: list[int]) -> Tour:
    return Tour(order=tuple(names[i - 1] for i in order), cost=_cycle_cost(matrix, order))


def nearest_neighbour_tour(depot: str, nodes: Sequence[str], cost: Cost) -> Tour:
    """The plain nearest-neighbour cycle (the starting point of the 2-opt in :func:`best_tour`)."""
    names, matrix = _matrix(depot, nodes, cost)
    return _tour(names, matrix, _nearest_neighbour(matrix))


def best_tour(depot: str, nodes: Sequence[str], cost: Cost, *, exact_max_nodes: int = EXACT_TOUR_NODES) -> Tour:
    """The cheapest cycle ``depot -> every node once -> depot`` under the directed ``cost(a, b)``.

    Exact (Held-Karp) for up to ``exact_max_nodes`` nodes, at most 16 (time and memory grow as
    n^2 2^n); above, nearest neighbour then asymmetric 2-opt, a local optimum never worse than
    the nearest-neighbour tour. ``cost`` is called once per ordered pair and must be finite.
    Deterministic: nodes are taken in sorted order and every tie goes to the smaller name.
    """
    if exact_max_nodes > EXACT_TOUR_NODES:
        raise PlacementError(f"exact tours are limited to {EXACT_TOUR_NODES} nodes")
    names, matrix = _matrix(depot, nodes, cost)
    if not names:
        return Tour(order=(), cost=0.0)
    if len(names) <= exact_max_nodes:
        return _tour(names, matrix, _held_karp(matrix))
    return _tour(names, matrix, _two_opt(matrix, _nearest_neighbour(matrix)))


def place_coordinator(regions: Sequence[str], nodes: Sequence[str], cost: Cost) -> tuple[str, Tour]:
    """The coordinator region and ring order chosen together: the region with the cheapest best tour.

    Each candidate region is tried as the depot (``cost`` prices hops to and from the region's
    coordinator like any other); the cheapest tour wins, ties to the smaller region name.
    """
    if not regions:
        raise PlacementError("no candidate region for the coordinator")
    tours = {region: best_tour(region, nodes, cost) for region in sorted(set(regions))}
    region = min(tours, key=lambda r: (tours[r].cost, r))
    return region, tours[region]
