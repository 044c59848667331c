"""Rebalancing: which models to place again, and the re-placements that move no serving block.

- ``mark_dirty``: a model is placed again at the next sweep (``placing.place_dirty_models``).
- ``rebalance_if_needed`` and ``share_by_demand``: the periodic checks that mark models dirty when
  their load is uneven enough, or the demand moved enough, and a new placement would pay.
- ``repair_by_spares`` and ``join_as_spares``: the placements that keep every serving block where it
  is (spares take the departed members' spans; newcomers become spares), when a fresh plan would not
  pay by SWARM_REPLACE_MARGIN (``replacement_pays``).
- ``spare_moves_of``: once churn has left a span held once and without a spare while another holds
  more than it needs, the ready spare to move onto it (``placing.respread_spares`` moves it).
- ``leaving_nodes``, ``release_leaving``, ``let_go``: a node moving to another model's share keeps its
  block of the old one until that model is servable without it (make before break across models).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.catalog.selectors import served_models
from marketplace.nodes.capacity import credible_speeds
from marketplace.nodes.models import NodeState
from marketplace.placement import shares
from marketplace.placement.allocation import (
    NodeCapacity,
    SpareMove,
    Stage,
    needs_rebalance,
    pays_to_replace,
    per_layer_load,
    repair,
    span_needs,
    spare_moves,
    throughput,
)
from marketplace.placement.blocks import joined_id, release
from marketplace.placement.candidates import candidates
from marketplace.placement.errors import PlacementError
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState, PlacementState
from marketplace.placement.selectors import hold_routes, servable_pipelines, share_of
from marketplace.placement.trusted import place_with_trusted
from worker_agent import model as models

log = logging.getLogger("swarm.placement")


def mark_dirty(model: str | None = None) -> None:
    """Ask for a new placement of one model (or every served model) at the next sweep."""
    for name in [model] if model else served_models():
        PlacementState.objects.update_or_create(model=name, defaults={"dirty": True})


def placement_changed() -> None:
    """Ask for a new placement of every served model once the current transaction commits: a node
    change moved capacity."""
    transaction.on_commit(mark_dirty)


def share_by_demand(tokens: Mapping[str, float], now: datetime | None = None) -> list[str]:
    """Share the nodes among the served models for ``tokens`` (prompt + completion tokens of each
    model's jobs over SWARM_DEMAND_WINDOW_S), when demand moved enough and not too recently
    (``shares.follow_demand``); returns the models whose share changed, placed at the next sweep."""
    return shares.follow_demand(tokens, now=now)


def rebalance_if_needed(now=None) -> list[str]:
    """Mark for re-placement a model whose per-layer load (from the nodes' measured speed) varies
    more than SWARM_REBALANCE_CV, at most once per SWARM_REBALANCE_MIN_INTERVAL_S, and only when a
    new placement over the same nodes is predicted to serve SWARM_REPLACE_MARGIN more tokens/s than
    the current one (``allocation.pays_to_replace``). Nodes coming or going re-place on their own."""
    now = now or timezone.now()
    marked = []
    for state in PlacementState.objects.filter(dirty=False, placed_at__isnull=False):
        if (now - state.placed_at).total_seconds() < settings.SWARM_REBALANCE_MIN_INTERVAL_S:
            continue
        live = list(
            Assignment.objects.filter(model=state.model, state__in=LIVE_STATES, is_spare=False).select_related("node")
        )
        # A placement still loading is not judged yet: its blocks would count as missing.
        if not live or any(a.state != AssignmentState.READY for a in live):
            continue
        speed = credible_speeds(a.node for a in live)
        for pipeline in {a.pipeline for a in live}:
            stages = [Stage(joined_id(a.node), a.layer_start, a.layer_end) for a in live if a.pipeline == pipeline]
            covered = sum(s.layer_end - s.layer_start for s in stages)
            if covered == models.n_layers(state.model) and needs_rebalance(
                per_layer_load(stages, covered, speed), settings.SWARM_REBALANCE_CV
            ):
                if replacement_pays(state.model, live):
                    mark_dirty(state.model)
                    marked.append(state.model)
                break
    return marked


def replacement_pays(model: str, live: list[Assignment]) -> bool:
    """Whether a fresh plan over the nodes available now beats the current pipelines by the margin."""
    n_layers = models.n_layers(model)
    nodes, capacities = candidates(model, lock=False)
    compute = {c.node: c.compute for c in capacities}
    serving = credible_speeds(a.node for a in live)
    for a in live:  # a serving node busy elsewhere is not a candidate, but its stage still counts
        compute.setdefault(joined_id(a.node), serving[joined_id(a.node)])
    current = []
    for pipeline in sorted({a.pipeline for a in live}):
        stages = sorted((Stage(joined_id(a.node), a.layer_start, a.layer_end) for a in live if a.pipeline == pipeline),
                        key=lambda s: s.layer_start)  # fmt: skip
        if sum(s.layers for s in stages) == n_layers:
            current.append(stages)
    try:
        proposed = place_with_trusted(  # the plan place_model would make, trusted pipelines apart
            capacities,
            {joined_id(n) for n in nodes if n.trusted},
            n_layers,
            spares_per_pipeline=settings.SWARM_SPARES_PER_PIPELINE,
        )
    except PlacementError:
        return False
    now_tps, new_tps = throughput(current, compute), throughput(proposed.pipelines, compute)
    pays = pays_to_replace(now_tps, new_tps, settings.SWARM_REPLACE_MARGIN)
    log.info(
        "%s: per-layer load varies past CV %.2f; a new placement would serve %.2f tokens/s against %.2f now: %s",
        model,
        settings.SWARM_REBALANCE_CV,
        new_tps,
        now_tps,
        "re-placing" if pays else f"kept (under the {settings.SWARM_REPLACE_MARGIN:.0%} margin)",
    )
    return pays


# node id -> (pipeline, position, layer_start, layer_end, is_spare)
Wanted = dict[str, tuple[int, int, int, int, bool]]


def wanted_of(pipelines: Sequence[Sequence[Stage]], spares: Sequence[Stage]) -> Wanted:
    """The assignment each node should hold: pipeline members by position, then the spares."""
    wanted = {}
    for pipeline_index, stages in enumerate(pipelines):
        for position, stage in enumerate(stages):
            wanted[stage.node] = (pipeline_index, position, stage.layer_start, stage.layer_end, False)
    for spare in spares:
        wanted[spare.node] = (len(pipelines), 0, spare.layer_start, spare.layer_end, True)
    return wanted


def wanted_now(live: dict[str, Assignment]) -> Wanted:
    """What each node holds now: the live placement as ``Wanted``, for changes that keep it."""
    return {node: (a.pipeline, a.position, a.layer_start, a.layer_end, a.is_spare) for node, a in live.items()}


def repair_by_spares(
    live: dict[str, Assignment], capacities: list[NodeCapacity], n_layers: int, regions: list[str]
) -> tuple[Wanted, list[str]] | None:
    """The live placement with its departed members' spans taken over by spares holding them
    (``allocation.repair``), and each pipeline's coordinator region; None when it cannot be
    repaired that way or nothing departed. Spares that are ready are promoted first."""
    placeable = {c.node for c in capacities}
    if placeable - set(live):
        return None  # a node joined or came back, or a block failed to load: capacity grew
    members: dict[int, list[Stage]] = {}
    spares: list[tuple[bool, int, Stage]] = []
    departed = False
    for node_id, assignment in live.items():
        if node_id not in placeable:
            departed = True  # on a node that drained, or whose agent is gone: released below
            continue
        stage = Stage(node_id, assignment.layer_start, assignment.layer_end)
        if assignment.is_spare:
            spares.append((assignment.state != AssignmentState.READY, assignment.pk, stage))
        else:
            members.setdefault(assignment.pipeline, []).append(stage)
    kept = sorted(members)
    fixed = repair([members[p] for p in kept], [stage for *_, stage in sorted(spares)], n_layers)
    if fixed is None or not (departed or fixed.promoted):
        return None
    default = settings.SWARM_COORDINATOR_REGIONS[0]
    # Pipelines whose members all left are dropped; the others keep their ring order and region.
    return wanted_of(fixed.pipelines, fixed.spares), [regions[p] if p < len(regions) else default for p in kept]


def join_as_spares(
    model: str, live: dict[str, Assignment], capacities: list[NodeCapacity], n_layers: int
) -> Wanted | None:
    """The live placement kept as it is, with each node that joined (or came back) since as a warm
    spare of the span it can hold with the fewest replicas, then the greatest need
    (``allocation.span_needs``: its holders' loss rates times its layers), then the most layers;
    None when something else changed (a member left, a pipeline is not whole) or a fresh plan
    would pay by the margin."""
    placeable = {c.node: c for c in capacities}
    newcomers = [placeable[node] for node in placeable if node not in live]
    if not newcomers or any(node not in placeable for node in live):
        return None
    members = [a for a in live.values() if not a.is_spare]
    pipelines = {a.pipeline for a in members}
    for pipeline in pipelines:
        spans = sorted((a.layer_start, a.layer_end) for a in members if a.pipeline == pipeline)
        if spans[0][0] != 0 or spans[-1][1] != n_layers or any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
            return None
    if not members or replacement_pays(model, list(live.values())):
        return None
    replicas = Counter((a.layer_start, a.layer_end) for a in live.values())
    stages = [Stage(node, a.layer_start, a.layer_end) for node, a in live.items() if not a.is_spare]
    need = span_needs(stages, {node: c.loss_rate for node, c in placeable.items()})
    wanted = wanted_now(live)
    spare_pipeline = max(a.pipeline for a in live.values()) + 1
    for newcomer in sorted(newcomers, key=lambda c: c.node):
        fits = [span for span in sorted(replicas) if span[1] - span[0] <= newcomer.max_layers]
        if not fits:
            continue  # holds no span of this placement: it stays idle until a placement that pays
        span = min(fits, key=lambda span: (replicas[span], -need.get(span, 0.0), -(span[1] - span[0]), span))
        replicas[span] += 1
        wanted[newcomer.node] = (spare_pipeline, 0, span[0], span[1], True)
    return wanted


def spare_moves_of(live: dict[str, Assignment], capacities: list[NodeCapacity]) -> list[SpareMove]:
    """The moves of a ready spare of this live placement onto a span held once and by no spare,
    best first (``allocation.spare_moves``: from a span that keeps more replicas without it, onto
    the lone span of the greatest need). Nothing while the placement is unsettled: a block still
    loading (a placement, or the last move, not done yet) or a live node that placement cannot use
    now (departed, moving to another model: the next placement handles those)."""
    placeable = {c.node: c for c in capacities}
    if any(a.state != AssignmentState.READY for a in live.values()) or any(node not in placeable for node in live):
        return []
    stages = [Stage(node, a.layer_start, a.layer_end) for node, a in live.items() if not a.is_spare]
    spares = [Stage(node, a.layer_start, a.layer_end) for node, a in live.items() if a.is_spare]
    max_layers = {node: c.max_layers for node, c in placeable.items()}
    return spare_moves(stages, spares, max_layers, {node: c.loss_rate for node, c in placeable.items()})


def may_move_spares(live: dict[str, Assignment]) -> bool:
    """Whether ``spare_moves_of`` may find a move, from the live blocks alone (no node read, no
    lock): every block ready, a span held by one stage and nothing else, and a spare whose span
    keeps two replicas or more without it. The sweep asks this first: a model with nothing to
    move costs it one query."""
    replicas = Counter((a.layer_start, a.layer_end) for a in live.values())
    return (
        all(a.state == AssignmentState.READY for a in live.values())
        and any(replicas[(a.layer_start, a.layer_end)] == 1 for a in live.values() if not a.is_spare)
        and any(replicas[(a.layer_start, a.layer_end)] - 1 > 1 for a in live.values() if a.is_spare)
    )


def leaving_nodes(model: str, live: dict[str, Assignment]) -> set[str]:
    """The nodes holding a live block of ``model`` that its share no longer has, while they are
    up (active, control channel open, not reported failed): they moved to another model's share.
    A node that left the swarm is not among them: its block is released as before."""
    share = share_of(model)
    if share is None:
        return set()
    return {
        node_id
        for node_id, assignment in live.items()
        if node_id not in share
        and assignment.node.state == NodeState.ACTIVE
        and assignment.node.connected
        and assignment.node.suspected_at is None
    }


def release_leaving(model: str) -> list[str]:
    """Make before break across models: the blocks of ``model`` on nodes that moved to another
    model's share are let go once ``model`` has a servable pipeline through none of them (their
    replacements are ready, or another pipeline was whole all along); returns those nodes' ids."""
    share = share_of(model)
    if share is None:
        return []
    hold_routes(model)  # no job is routed to these blocks from the release on (before the assignments' locks)
    live = Assignment.objects.select_for_update().filter(model=model, state__in=LIVE_STATES).select_related("node")
    leaving = [a for a in live.order_by("pk") if joined_id(a.node) not in share]
    away = {joined_id(a.node) for a in leaving}
    if not leaving or not any(all(s.node not in away for s in p) for p in servable_pipelines(model)):
        return []
    return let_go(leaving, f"{model} is servable without them")


def let_go(leaving: list[Assignment], why: str) -> list[str]:
    """Release the blocks of nodes that moved to another model (the agent takes no new job on them
    and unloads them once their jobs in flight end), and place those models again."""
    if not leaving:
        return []
    for assignment in leaving:
        release(assignment)
        taker = shares.model_sharing(joined_id(assignment.node))
        if taker is not None:
            # Once this commits: the placement rows are locked before the assignments everywhere else.
            transaction.on_commit(functools.partial(mark_dirty, taker))
    nodes = [joined_id(a.node) for a in leaving]
    log.info("%s: let go the blocks of %s on %s (moved to other models)", why, leaving[0].model, ", ".join(nodes))
    return nodes
