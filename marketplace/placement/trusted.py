"""Pipelines of trusted nodes: when the nodes an admin marked trusted can hold a model together,
they form pipelines of their own, apart from the other nodes, so that a request that asks for
trusted nodes only (``Privacy.TRUSTED_ONLY``) has a route. Pure functions over the planner's
``NodeCapacity`` list; ``services.place_model`` applies them."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from marketplace.placement.allocation import NodeCapacity, Placement, Stage, place, warm_spares
from marketplace.placement.errors import PlacementError


def covers(capacities: Sequence[NodeCapacity], n_layers: int) -> bool:
    """Whether these nodes' memory holds every layer of the model once."""
    return sum(min(c.max_layers, n_layers) for c in capacities) >= n_layers


def place_with_trusted(
    capacities: Sequence[NodeCapacity], trusted: Collection[str], n_layers: int, *, spares_per_pipeline: int
) -> Placement:
    """``allocation.place`` over ``capacities``, except that when the ``trusted`` nodes can hold the
    model on their own, they are placed apart: their pipelines first, then the other nodes' (or,
    when those cannot hold the model alone, their warm spare blocks of the trusted pipelines' spans)."""
    ours = [c for c in capacities if c.node in trusted]
    if not covers(ours, n_layers):
        return place(capacities, n_layers, spares_per_pipeline=spares_per_pipeline)
    first = place(ours, n_layers, spares_per_pipeline=spares_per_pipeline)
    others = [c for c in capacities if c.node not in trusted]
    if not others:
        return first
    try:
        second = place(others, n_layers, spares_per_pipeline=spares_per_pipeline)
    except PlacementError:
        loss_rates = {c.node: c.loss_rate for c in ours}
        return replace(first, spares=first.spares + spares_for(others, first.pipelines, loss_rates))
    return replace(first, pipelines=first.pipelines + second.pipelines, spares=first.spares + second.spares)


def spares_for(
    nodes: Sequence[NodeCapacity], pipelines: Sequence[Sequence[Stage]], loss_rates: Mapping[str, float]
) -> tuple[Stage, ...]:
    """Warm blocks for ``nodes`` that serve on no pipeline, largest first (``allocation.warm_spares``
    over the pipelines' stages in order, whose nodes' failure rates ``loss_rates`` gives)."""
    ordered = sorted(nodes, key=lambda n: (-n.max_layers, -n.compute, n.node))
    return warm_spares(ordered, [stage for pipeline in pipelines for stage in pipeline], loss_rates)


def has_trusted_pipeline(wanted: Mapping[str, tuple[int, int, int, int, bool]], trusted: Collection[str]) -> bool:
    """Whether a placement (``services.Wanted``: node -> (pipeline, position, start, end, is spare))
    has a pipeline whose every member is trusted."""
    members: dict[int, list[str]] = {}
    for node, (pipeline, _, _, _, is_spare) in wanted.items():
        if not is_spare:
            members.setdefault(pipeline, []).append(node)
    return any(all(node in trusted for node in nodes) for nodes in members.values())
