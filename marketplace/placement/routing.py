"""Request routing: the fastest chain of stages through every layer, over measured round trips.

A request leaves the coordinator (``source``), passes through a chain of stages whose spans
follow one another (each starts where the previous ends, the first at layer 0, the last ending at
``n_layers``) and comes back. Stages may belong to different pipelines, so the best chain is a
shortest path, not a choice of pipeline. With the coordinator written ``s`` and the chain
``a_1 .. a_m``::

    cost = rtt(s, a_1)/2 + sum_i layers(a_i) * layer_ms(a_i) + sum_i rtt(a_i, a_i+1)/2 + rtt(a_m, s)/2

Measurements are directed: ``rtt_ms[(a, b)]`` is the round trip measured from a to b and prices
only the hop a -> b; the reverse entry is not consulted, since asymmetric links are the reason to
measure both ways. An unmeasured hop costs ``unmeasured_ms`` (instead of rtt/2), and a node
without a ``layer_ms`` costs ``unmeasured_ms`` for its whole stage: bad, never free, so a measured
alternative wins whenever one exists. A hop from a node to itself costs 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from marketplace.placement.allocation import Stage
from marketplace.placement.errors import PlacementError

DEFAULT_UNMEASURED_MS = 10_000.0


@dataclass(frozen=True)
class Route:
    """The chain chosen for one request."""

    stages: tuple[Stage, ...]  # in layer order, covering [0, n_layers)
    cost_ms: float  # predicted time of one pass through the chain and back, ms


def _hop(rtt_ms: Mapping[tuple[str, str], float], a: str, b: str, unmeasured_ms: float) -> float:
    if a == b:
        return 0.0
    rtt = rtt_ms.get((a, b))
    if rtt is None:
        return unmeasured_ms
    if not (math.isfinite(rtt) and rtt >= 0):
        raise PlacementError(f"bad round trip {a} -> {b}: {rtt!r}")
    return rtt / 2


def _as_stage(stage: Stage | tuple[str, int, int], n_layers: int) -> Stage:
    stage = stage if isinstance(stage, Stage) else Stage(*stage)
    if stage.layer_end > n_layers:
        raise PlacementError(f"{stage.node}: stage {stage.layer_start}:{stage.layer_end} beyond {n_layers} layers")
    return stage


Arrival = tuple[float, Stage | None]  # (cost of the chain kept to a stage's end, that stage; None: the source)
Priced = dict[int, list[tuple[Stage, float]]]  # boundary -> the stages starting there, each with its compute, ms
Choose = Callable[[Stage, float, list[Arrival]], Arrival | None]  # (stage, its compute, arrivals) -> kept

# Relative room left above the first pass's bound, so that float rounding in adding the same costs
# in another order never prunes the best chain.
BOUND_SLACK = 1e-9


def route(
    stages: Sequence[Stage | tuple[str, int, int]],
    n_layers: int,
    rtt_ms: Mapping[tuple[str, str], float],
    layer_ms: Mapping[str, float],
    *,
    source: str = "coordinator",
    unmeasured_ms: float = DEFAULT_UNMEASURED_MS,
) -> Route:
    """The lowest-cost chain of ``stages`` covering ``[0, n_layers)``; see the module docstring.

    Stages (``Stage`` or ``(node, layer_start, layer_end)``) are the vertices of a DAG: an edge
    a -> b when b starts where a ends, weighted by the hop a -> b plus b's compute. The hop price
    depends on the previous node, so the state is the stage, not the layer boundary. Boundaries
    are visited in increasing order (every edge goes forward, a DP over a DAG, O(edges)):
    ``d(b) = compute(b) + min over a ending at start(b) of (d(a) + hop(a, b))``, with the source
    as the only predecessor at layer 0, and the answer is ``min over a ending at n_layers of
    d(a) + hop(a, source)``. The predecessors of a boundary are scanned cheapest first and the
    scan stops once ``d(a)`` alone reaches the best found (hops are >= 0). Deterministic: among
    equal costs the predecessor scanned first wins (lower ``d(a)``, then smaller (node, start, end)).

    Round trips are the cost (a lookup each), so two passes look up few of them. The first takes
    each stage after its cheapest arrival alone: every figure it finds is a real chain's cost, so
    its best bounds the answer. The second is the DP above, skipping a predecessor ``a`` of ``b``
    once ``d(a) + compute(b) + rest(end(b))`` passes that bound, ``rest`` being the least compute
    any chain from a boundary to the last layer needs: no chain through that hop can be the best,
    and the best chain's own hops all stay under the bound, so the answer, and the chain chosen
    among equal costs, are the DP's.

    Raises PlacementError when no chain covers every layer.
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise PlacementError(f"n_layers must be an int >= 1, got {n_layers!r}")
    starting: dict[int, list[Stage]] = defaultdict(list)
    for stage in sorted({_as_stage(s, n_layers) for s in stages}, key=lambda s: (s.node, s.layer_start, s.layer_end)):
        starting[stage.layer_start].append(stage)
    priced = _price(starting, layer_ms, unmeasured_ms)

    def hop(before: Stage | None, node: str) -> float:
        return _hop(rtt_ms, source if before is None else before.node, node, unmeasured_ms)

    def cheapest(stage: Stage, arrivals: list[Arrival]) -> Arrival:
        cost, before = arrivals[0]
        return cost + hop(before, stage.node), before

    _, finals = _sweep(priced, n_layers, lambda stage, work, arrivals: cheapest(stage, arrivals))
    bound, _ = _close(finals, hop, source)
    if math.isinf(bound):
        reached = sum(len(row) for row in priced.values())
        raise PlacementError(f"no chain of the {reached} reachable stages covers layers 0:{n_layers}")
    rest = _rest(priced, n_layers)
    ceiling = bound * (1 + BOUND_SLACK)

    def best_under_bound(stage: Stage, work: float, arrivals: list[Arrival]) -> Arrival | None:
        limit = ceiling - work - rest.get(stage.layer_end, math.inf)
        best: Arrival | None = None
        for cost, before in arrivals:
            if cost > limit or (best is not None and cost >= best[0]):
                break
            total = cost + hop(before, stage.node)
            if best is None or total < best[0]:
                best = (total, before)
        return best

    came_from, finals = _sweep(priced, n_layers, best_under_bound)
    best, last = _close(finals, hop, source)
    assert last is not None  # the bound keeps the best chain
    chain = [last]
    while (before := came_from[chain[-1]]) is not None:
        chain.append(before)
    return Route(stages=tuple(reversed(chain)), cost_ms=best)


def _price(starting: Mapping[int, list[Stage]], layer_ms: Mapping[str, float], unmeasured_ms: float) -> Priced:
    """The stages that some chain from layer 0 reaches, by start, each with its compute time: its
    layers times the node's time per layer, or ``unmeasured_ms`` for a node without one."""
    priced: Priced = {}
    reached = {0}
    for boundary in sorted(starting):
        if boundary not in reached:
            continue
        priced[boundary] = []
        for stage in starting[boundary]:
            compute = layer_ms.get(stage.node)
            if compute is not None and not (math.isfinite(compute) and compute >= 0):
                raise PlacementError(f"{stage.node}: bad layer time {compute!r}")
            priced[boundary].append((stage, unmeasured_ms if compute is None else stage.layers * compute))
            reached.add(stage.layer_end)
    return priced


def _sweep(priced: Priced, n_layers: int, choose: Choose) -> tuple[dict[Stage, Stage | None], list[Arrival]]:
    """Boundaries in increasing order: each stage gets the predecessor ``choose`` picks among the
    chains arriving at its start, cheapest first (None: the stage is dropped). Returns each kept
    stage's predecessor and the chains arriving at the last layer."""
    ending: dict[int, list[Arrival]] = defaultdict(list)
    ending[0].append((0.0, None))
    came_from: dict[Stage, Stage | None] = {}
    for boundary, row in priced.items():
        arrivals = sorted(ending.pop(boundary, []), key=lambda da: (da[0], _key(da[1])))
        if not arrivals:
            continue
        for stage, work in row:
            chosen = choose(stage, work, arrivals)
            if chosen is not None:
                came_from[stage] = chosen[1]
                ending[stage.layer_end].append((chosen[0] + work, stage))
    return came_from, ending.get(n_layers, [])


def _close(finals: list[Arrival], hop: Callable[[Stage | None, str], float], source: str) -> tuple[float, Stage | None]:
    """The cheapest of the chains reaching the last layer once back at the source (inf, None: none)."""
    best, last = math.inf, None
    for cost, stage in sorted(finals, key=lambda da: (da[0], _key(da[1]))):
        if cost >= best:
            break
        total = cost + hop(stage, source)
        if total < best:
            best, last = total, stage
    return best, last


def _rest(priced: Priced, n_layers: int) -> dict[int, float]:
    """From each boundary, the least compute of any chain of these stages to the last layer: hops
    cost >= 0, so no chain from there costs less."""
    rest = {n_layers: 0.0}
    for boundary in sorted(priced, reverse=True):
        for stage, work in priced[boundary]:
            if stage.layer_end in rest:
                rest[boundary] = min(rest.get(boundary, math.inf), work + rest[stage.layer_end])
    return rest


def _key(stage: Stage | None) -> tuple[str, int, int]:
    return ("", 0, 0) if stage is None else (stage.node, stage.layer_start, stage.layer_end)
