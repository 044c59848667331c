"""Sharing one swarm's nodes among the models it serves, in proportion to demand. Pure functions.

An agent serves the blocks of one model at a time, so the nodes are split among the models before
each model is placed on its own share (``allocation.place``, as if it were alone). :func:`share`:

1. **Floors.** Each model first gets the fewest nodes that hold one complete pipeline of it (their
   layer caps for it sum to its layer count), so that every model is served whenever the nodes can
   cover every floor at once. Models take their floors in order of demand, most first (ties, and
   no demand at all: the order given, ``SWARM_MODELS``); a model whose floor the nodes left cannot
   cover gets no node at all and is not served. Each floor is taken from the nodes the model has
   now first (nothing moves that need not), then from the nodes fewer of the models still to come
   can use, the largest first; when keeping a model's own nodes leaves a later model without a
   floor, the choice without that preference is tried too, and the one serving more models wins.
   (Greedy: exact when nodes are alike, not a search over every way to cover the floors.)
2. **The rest in proportion to work.** A model's work is the layer-tokens its demand asks for:
   ``tokens x n_layers`` (a token passes every layer once). Each served model's target is that
   share of the nodes' total credible speed (layer-tokens/s). A node left over stays with the
   model it has now while that brings the model closer to its target; the others go, fastest
   first, each to the model furthest below its target among those it can hold a layer of.
   With no demand at all, each model weighs its layer count: the same tokens/s for every model.

A node counts for its credible speed; what it can hold (its layer cap for that model) decides only
which models it can serve and how many nodes a floor takes.

Re-sharing for demand is damped (:func:`demand_moved`): the demand a share was made for is kept,
and a new one is applied only when some model's fraction of the work has moved by more than a
threshold since; the caller also rate-limits it and applies it only when a node actually moves.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from marketplace.placement.errors import PlacementError


@dataclass(frozen=True)
class ModelDemand:
    """One model to serve, and how much it is asked for."""

    model: str
    n_layers: int  # decoder layers: a token costs this many layer-tokens
    tokens: float = 0.0  # prompt + completion tokens of its jobs over the demand window

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise PlacementError(f"{self.model}: n_layers must be >= 1, got {self.n_layers!r}")
        if not (math.isfinite(self.tokens) and self.tokens >= 0):
            raise PlacementError(f"{self.model}: demand must be finite and >= 0, got {self.tokens!r}")


@dataclass(frozen=True)
class NodeOffer:
    """One node as sharing sees it."""

    node: str  # node id
    speed: float  # credible layer-tokens per second; > 0
    layers: Mapping[str, int] = field(default_factory=dict)  # model -> layers of it the node can hold
    current: str | None = None  # the model whose share has it now, if any

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise PlacementError(f"{self.node}: speed must be finite and > 0, got {self.speed!r}")

    def holds(self, model: ModelDemand) -> int:
        """Layers of ``model`` this node can hold, up to the whole model."""
        return min(max(self.layers.get(model.model, 0), 0), model.n_layers)


Held = dict[str, dict[str, int]]  # node id -> model -> layers of it the node can hold (``NodeOffer.holds``)


def work(models: Sequence[ModelDemand]) -> dict[str, float]:
    """Layer-tokens each model asks for: its tokens times its layers. With no demand for any of
    them, each weighs its layer count alone, as if every model were asked for the same tokens."""
    asked = any(m.tokens > 0 for m in models)
    return {m.model: (m.tokens if asked else 1.0) * m.n_layers for m in models}


def share(models: Sequence[ModelDemand], nodes: Sequence[NodeOffer]) -> dict[str, str]:
    """Node id -> the model it is given (see the module docstring). ``models`` in their order of
    precedence for ties (``SWARM_MODELS``); a node that can hold no layer of a served model is left
    out of the result."""
    if len({m.model for m in models}) != len(models):
        raise PlacementError("a model is listed twice")
    if len({n.node for n in nodes}) != len(nodes):
        raise PlacementError("duplicate node ids")
    held = {n.node: {m.model: n.holds(m) for m in models} for n in nodes}  # read ~10 times a node
    by_demand = sorted(models, key=lambda m: -m.tokens)  # stable: the given order breaks ties
    floors = max((_floors(by_demand, nodes, keep, held) for keep in (True, False)), key=len)  # first wins ties
    served = [m for m in models if m.model in floors]
    if not served:
        return {}
    given = {n.node: model for model, floor in floors.items() for n in floor}
    rest = [n for n in nodes if n.node not in given and any(held[n.node][m.model] for m in served)]
    total_speed = sum(n.speed for n in nodes if n.node in given) + sum(n.speed for n in rest)
    weights = work(served)
    total_work = sum(weights.values())
    target = {m.model: total_speed * weights[m.model] / total_work for m in served}
    speed = {model: sum(n.speed for n in floor) for model, floor in floors.items()}
    can_hold = {n.node: [m.model for m in served if held[n.node][m.model]] for n in rest}
    left = []
    for node in sorted(rest, key=lambda n: (-n.speed, n.node)):
        model = node.current
        # Staying brings its model closer to the target when the model is below it by over half the node.
        if model in can_hold[node.node] and speed[model] + node.speed / 2 < target[model]:
            given[node.node] = model
            speed[model] += node.speed
        else:
            left.append(node)
    rank = {m.model: i for i, m in enumerate(models)}
    for node in left:
        model = max(can_hold[node.node], key=lambda m: (target[m] - speed[m], -rank[m]))
        given[node.node] = model
        speed[model] += node.speed
    return given


def _floors(
    models: Sequence[ModelDemand], nodes: Sequence[NodeOffer], keep: bool, held: Held
) -> dict[str, list[NodeOffer]]:
    """Each model's floor, in the order given, from the nodes the earlier ones left; models whose
    floor cannot be covered are left out. ``keep``: a model takes the nodes it has now first."""
    free = list(nodes)
    floors = {}
    for i, model in enumerate(models):
        floor = _floor(model, free, keep, models[i + 1 :], held)
        if floor is not None:
            floors[model.model] = floor
            taken = {n.node for n in floor}
            free = [n for n in free if n.node not in taken]
    return floors


def _floor(
    model: ModelDemand, nodes: Sequence[NodeOffer], keep: bool, later: Sequence[ModelDemand], held: Held
) -> list[NodeOffer] | None:
    """The nodes that hold one complete pipeline of ``model``, taken until their layers cover it:
    its own first (when ``keep``), then those that fewer of the ``later`` models could use (a node
    only this model can hold is taken before one another model needs), the largest, the fastest.
    None when all of them together do not cover it."""

    def rank(n: NodeOffer) -> tuple:
        layers = held[n.node]
        wanted_later = sum(1 for other in later if layers[other.model])
        return (keep and n.current != model.model, wanted_later, -layers[model.model], -n.speed, n.node)

    able = [n for n in nodes if held[n.node][model.model]]
    if sum(held[n.node][model.model] for n in able) < model.n_layers:
        return None
    # A floor is a few nodes of thousands: a heap yields them in rank order without sorting all.
    # Ranks end with the node id, so they never tie and the nodes themselves are never compared.
    queue = [(rank(n), n) for n in able]
    heapq.heapify(queue)
    chosen, covered = [], 0
    while covered < model.n_layers:
        _, node = heapq.heappop(queue)
        chosen.append(node)
        covered += held[node.node][model.model]
    return chosen


def demand_moved(before: Mapping[str, float], after: Mapping[str, float], threshold: float) -> bool:
    """Whether some model's fraction of the total work (:func:`work`) moved by more than
    ``threshold`` of what it was (0.25: up or down by more than a quarter). A model that was asked
    for nothing and now is has moved; noise around a steady mix has not."""
    old, new = _fractions(before), _fractions(after)
    return any(abs(new.get(m, 0.0) - old.get(m, 0.0)) > threshold * old.get(m, 0.0) for m in old.keys() | new.keys())


def _fractions(weights: Mapping[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {m: (w / total if total > 0 else 0.0) for m, w in weights.items()}
