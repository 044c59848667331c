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
from collections.abc import Mapping, Sequence
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
    scan stops once ``d(a)`` alone reaches the best found (hops are >= 0), which leaves most
    pairs unlooked-up when stage costs differ. Deterministic: among equal costs the predecessor
    scanned first wins (lower ``d(a)``, then smaller (node, start, end)).

    Raises PlacementError when no chain covers every layer.
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise PlacementError(f"n_layers must be an int >= 1, got {n_layers!r}")
    starting: dict[int, list[Stage]] = defaultdict(list)
    for stage in sorted({_as_stage(s, n_layers) for s in stages}, key=lambda s: (s.node, s.layer_start, s.layer_end)):
        starting[stage.layer_start].append(stage)
    ending: dict[int, list[tuple[float, Stage | None]]] = defaultdict(list)
    ending[0].append((0.0, None))
    came_from: dict[Stage, Stage | None] = {}
    for boundary in sorted(starting):
        arrivals = sorted(ending.pop(boundary, []), key=lambda da: (da[0], _key(da[1])))
        if not arrivals:
            continue
        for stage in starting[boundary]:
            compute = layer_ms.get(stage.node)
            if compute is not None and not (math.isfinite(compute) and compute >= 0):
                raise PlacementError(f"{stage.node}: bad layer time {compute!r}")
            work = unmeasured_ms if compute is None else stage.layers * compute
            best, prev = math.inf, None
            for cost, before in arrivals:
                if cost >= best:
                    break
                total = cost + _hop(rtt_ms, source if before is None else before.node, stage.node, unmeasured_ms)
                if total < best:
                    best, prev = total, before
            came_from[stage] = prev
            ending[stage.layer_end].append((best + work, stage))
    finals = sorted(ending.get(n_layers, []), key=lambda da: (da[0], _key(da[1])))
    best, last = math.inf, None
    for cost, stage in finals:
        if cost >= best:
            break
        total = cost + _hop(rtt_ms, stage.node, source, unmeasured_ms)
        if total < best:
            best, last = total, stage
    if last is None:
        raise PlacementError(f"no chain of the {len(came_from)} reachable stages covers layers 0:{n_layers}")
    chain = [last]
    while came_from[chain[-1]] is not None:
        chain.append(came_from[chain[-1]])
    return Route(stages=tuple(reversed(chain)), cost_ms=best)


def _key(stage: Stage | None) -> tuple[str, int, int]:
    return ("", 0, 0) if stage is None else (stage.node, stage.layer_start, stage.layer_end)
