"""Which nodes each served model may be placed on, when the swarm serves several (``SWARM_MODELS``).

The split is ``sharing.share`` (pure: floors first, the rest in proportion to demand); this module
keeps it in ``PlacementState.share`` and redoes it when

- the nodes changed (``follow_capacity``, before every placement): a node joined, came back or
  left. The demand the shares were last made for is kept, and a node moves only when a floor or
  the targets need it elsewhere;
- demand moved (``follow_demand``, from the periodic sweep with the tokens of the demand window):
  at most once per SWARM_REBALANCE_MIN_INTERVAL_S, only when some model's fraction of the work moved
  by more than SWARM_DEMAND_SHIFT since the shares were made (``sharing.demand_moved``), and only
  when the new split moves at least one node from one model to another.

A model whose blocks are not exactly on its new share is marked dirty, and its next placement
uses that share (``services.place_model``, which also hands a moving node over make before break).
With one model served there is nothing to share: ``share_of`` is None and every node may take it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.catalog.selectors import min_reputation
from marketplace.nodes.capacity import credible_memory, credible_speeds
from marketplace.nodes.models import Node, NodeState
from marketplace.placement import memory
from marketplace.placement.models import LIVE_STATES, Assignment, PlacementState
from marketplace.placement.selectors import AGENT_DEFAULT_POSITIONS, model_positions, shared_models
from marketplace.placement.sharing import ModelDemand, NodeOffer, demand_moved, share, work
from worker_agent import model as models

log = logging.getLogger("swarm.placement")


def layer_cap(node: Node, model: str) -> int:
    """How many layers of ``model`` a node can hold: what fits its memory (``memory``: weights in
    the dtype it serves in plus a KV budget; its credible memory, ``nodes.capacity``), and no more
    than its owner's cap."""
    fits = memory.layers_that_fit(credible_memory(node), layer_footprint(node, model))
    return min(node.max_layers, fits) if node.max_layers else fits


def no_room(node: Node, model: str) -> str | None:
    """Why ``node`` cannot hold a single layer of ``model``; None when it can."""
    layer, held = layer_footprint(node, model), credible_memory(node)
    return memory.no_room(held, layer) if memory.layers_that_fit(held, layer) < 1 else None


def layer_footprint(node: Node, model: str) -> memory.LayerFootprint:
    """One layer of ``model`` on ``node``: in the dtype it serves in (``memory.serving_dtype``), with
    a KV budget of SWARM_KV_BUDGET_SESSIONS sessions (no more than the node said it holds at once)
    of as many positions as one session may hold there (the node's limit and the model's own)."""
    config = models.load_config(model)
    shape = memory.ModelShape(
        layer_parameters=models.layer_parameters(model),
        hidden=config.hidden_size,
        kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    )
    limits = [p for p in (node.max_positions, model_positions(model)) if p]
    sessions = settings.SWARM_KV_BUDGET_SESSIONS
    return memory.footprint(
        shape,
        memory.serving_dtype(node.dtypes),
        positions=min(limits, default=AGENT_DEFAULT_POSITIONS),
        sessions=min(sessions, node.max_sessions) if node.max_sessions else sessions,
    )


def outside_shares() -> list[Node]:
    """The nodes able to serve now (active, control channel up) that no served model's share has:
    those too small for every model, or that joined since the nodes were last shared."""
    shared = {node for state in PlacementState.objects.filter(model__in=shared_models()) for node in state.share}
    able = Node.objects.filter(state=NodeState.ACTIVE, connected=True, node_id__isnull=False)
    return [n for n in able.order_by("pk") if n.node_id not in shared]


def model_sharing(node_id: str) -> str | None:
    """The model whose share holds ``node_id``, if any."""
    for state in PlacementState.objects.filter(model__in=shared_models()).only("model", "share"):
        if node_id in state.share:
            return state.model
    return None


def due(now: datetime | None = None) -> bool:
    """Whether demand may move nodes now: several models are served and the last move by demand is
    SWARM_REBALANCE_MIN_INTERVAL_S old (or there was none)."""
    served = shared_models()
    if not served:
        return False
    return _interval_passed(list(PlacementState.objects.filter(model__in=served)), now or timezone.now())


@transaction.atomic
def follow_capacity() -> list[str]:
    """Share the nodes again if the set of nodes able to serve changed since the shares were made;
    the models whose share changed (marked dirty)."""
    served = shared_models()
    if not served:
        return []
    states = _states(served)
    offers = _offers(served, states)
    able = {offer.node for offer in offers if any(layers >= 1 for layers in offer.layers.values())}
    # A model with no share yet (just added to the served models) is shared nodes now too, not
    # when a node next joins or leaves.
    unshared = [state.model for state in states if not state.share]
    if able == {node for state in states for node in state.share} and not unshared:
        return []
    given = share(_demands(served, {state.model: state.demand for state in states}), offers)
    return _store(states, given, f"{', '.join(unshared)} had no nodes" if unshared else "the nodes changed")


@transaction.atomic
def follow_demand(tokens: Mapping[str, float], now: datetime | None = None) -> list[str]:
    """Share the nodes for ``tokens`` (prompt + completion tokens per model over the demand window)
    when demand moved enough (see the module docstring); the models whose share changed (marked dirty)."""
    served = shared_models()
    if not served:
        return []
    now = now or timezone.now()
    states = _states(served)
    if not _interval_passed(states, now):
        return []
    demands = _demands(served, tokens)
    before = work(_demands(served, {state.model: state.demand for state in states}))
    if not demand_moved(before, work(demands), settings.SWARM_DEMAND_SHIFT):
        return []
    current = {node: state.model for state in states for node in state.share}
    given = share(demands, _offers(served, states))
    moves = sorted(node for node, model in given.items() if current.get(node, model) != model)
    for state in states:
        # Moved or not, this demand becomes the reference that the next shift is measured from.
        state.demand = float(tokens.get(state.model, 0.0))
        if moves:
            state.shared_at = now
    mix = ", ".join(f"{d.model} {d.tokens:.0f}" for d in demands)
    return _store(
        states, given, f"demand moved (tokens over the window: {mix}); moving {', '.join(moves) or 'no node'}"
    )


def _interval_passed(states: list[PlacementState], now: datetime) -> bool:
    last = max((state.shared_at for state in states if state.shared_at is not None), default=None)
    return last is None or (now - last).total_seconds() >= settings.SWARM_REBALANCE_MIN_INTERVAL_S


def _states(served: list[str]) -> list[PlacementState]:
    """One locked row per served model (rows locked in pk order, as every placement locks them),
    returned in SWARM_MODELS order."""
    for model in served:
        PlacementState.objects.get_or_create(model=model)
    rows = {s.model: s for s in PlacementState.objects.select_for_update().filter(model__in=served).order_by("pk")}
    return [rows[model] for model in served]


def _demands(served: list[str], tokens: Mapping[str, float]) -> list[ModelDemand]:
    return [ModelDemand(model, models.n_layers(model), max(float(tokens.get(model, 0.0)), 0.0)) for model in served]


def _offers(served: list[str], states: list[PlacementState]) -> list[NodeOffer]:
    """The nodes that may serve now (active, control channel up), each with its credible speed, what
    it can hold of each model, and the model whose share has it (for a node in no share yet: the
    model it holds a block of, as when a swarm that served one model starts serving several)."""
    nodes = list(Node.objects.filter(state=NodeState.ACTIVE, connected=True, node_id__isnull=False).order_by("pk"))
    speeds = credible_speeds(nodes)
    needs = {model: min_reputation(model) for model in served}
    current = {node: state.model for state in states for node in state.share}
    holding = dict(
        Assignment.objects.filter(state__in=LIVE_STATES, model__in=served, node__in=nodes)
        .order_by("pk")
        .values_list("node__node_id", "model")
    )
    return [
        NodeOffer(
            node=node_id,
            speed=speeds[node_id],
            # A node below a model's minimum reputation (its catalog entry's) can hold none of it.
            layers={model: layer_cap(n, model) if n.reputation >= needs[model] else 0 for model in served},
            current=current.get(node_id) or holding.get(node_id),
        )
        for n in nodes
        if (node_id := n.node_id) is not None  # always: the query keeps joined nodes only
    ]


def _store(states: list[PlacementState], given: Mapping[str, str], why: str) -> list[str]:
    """Save each model's share; return the models whose share changed, marking dirty those whose
    blocks are not exactly on their new share (a share first recorded for the nodes a model already
    holds moves nothing, and places nothing again)."""
    held: dict[str, set[str]] = {state.model: set() for state in states}
    live = Assignment.objects.filter(state__in=LIVE_STATES, model__in=held).values_list("model", "node__node_id")
    for model, node in live:
        assert node is not None  # a node holds blocks only once joined
        held[model].add(node)
    changed = []
    for state in states:
        nodes = sorted(node for node, model in given.items() if model == state.model)
        if nodes != sorted(state.share):
            state.share = nodes
            state.dirty = state.dirty or set(nodes) != held[state.model]
            changed.append(state.model)
        state.save()
    if changed:
        log.info(
            "shared the nodes (%s): %s", why, "; ".join(f"{state.model}: {', '.join(state.share)}" for state in states)
        )
    return changed
