"""Applying placements: from the pure planner to assignments pushed to agents.

``place_model`` asks ``allocation.place`` for a plan over the active nodes, keeps every
assignment that the new plan leaves unchanged (the agent keeps its warm block), releases the
rest and pushes the new ones to their agents over the control channel. When pipeline members
merely left and spares hold their spans, it repairs the placement instead: the spares take their
places and nobody else moves. Agents answer ``ready`` once their block is loaded; a model is
servable when one pipeline is ready end to end on active nodes that no coordinator reported failed.

Make before break: a node moved onto another span keeps its old block for the jobs in flight
while it loads the new one. The old assignment is released in the database at once (routing
takes only ready assignments, so no new job goes to it), but the agent is told to release it
only once the new assignment is ready, or has failed to load (``readiness.assignment_ready``,
``readiness.assignment_failed``). A node left without any block is told at once.

Several models (``SWARM_MODELS``) share one set of nodes, an agent serving one model at a time:
``shares`` splits the active nodes among them (``sharing.share``: every model first gets the
fewest nodes that hold one complete pipeline of it, in order of demand when the nodes cannot hold
every model's at once; the rest in proportion to each model's work, the tokens of its jobs over
SWARM_DEMAND_WINDOW_S times its layer count, or its layer count alone while nothing is asked), and
each model is placed as above over its own share. Demand moves nodes at most once per
SWARM_REBALANCE_MIN_INTERVAL_S and only when some model's fraction of the work moved by more than
SWARM_DEMAND_SHIFT (``rebalancing.share_by_demand``); nodes joining or leaving re-share at once, by the demand
last used. A node moving from model A to model B is handed over make before break:

1. B's placement leaves it out while it holds a live block of A (``candidates.candidates``);
2. A is placed again over its new share; the moving node's block of A stays live, as a spare, while
   A has no servable pipeline without it (``_apply``); routing takes it only where no chain avoids
   it (``selectors.leaving``): it gets no new request from the moment the move is decided while
   other blocks can serve;
3. once one has (the blocks that replace it report ready, or another pipeline was whole all along),
   its block of A is released (``rebalancing.release_leaving``): the agent takes no new job on it and unloads
   it once its jobs in flight end, and B is placed again, now with that node.

A model the nodes cannot serve alongside the others (its share is empty) has its blocks released
at once: its jobs in flight still end on them, and its new requests find no route.

Churn can leave a span held by one stage and no spare while a spare sits on a span that keeps two
replicas without it (a spare promoted into a departed member's place now holds that span alone,
while a spare placed once every span had one sits on a span two pipelines hold): at each sweep
``respread_spares`` moves at most one ready spare per model, carrying no open job, onto such a
lone span, the one of greatest need first (``allocation.spare_moves``), make before break like
any other move.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.catalog.selectors import served_models
from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node
from marketplace.nodes.services import push
from marketplace.placement import shares
from marketplace.placement.allocation import Placement, Stage, carry_spares, spans_for
from marketplace.placement.blocks import joined_id, push_release, release
from marketplace.placement.candidates import candidates
from marketplace.placement.errors import PlacementError
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState, PlacementState
from marketplace.placement.rebalancing import (
    Wanted,
    join_as_spares,
    leaving_nodes,
    let_go,
    may_move_spares,
    placement_changed,
    release_leaving,
    repair_by_spares,
    spare_moves_of,
    wanted_now,
    wanted_of,
)
from marketplace.placement.selectors import hold_routes, link_maps, region_target, share_of
from marketplace.placement.tour import hop_cost, place_coordinator
from marketplace.placement.trusted import covers, has_trusted_pipeline, place_with_trusted
from worker_agent import model as models
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol.span import Span

log = logging.getLogger("swarm.placement")


def place_dirty_models() -> list[str]:
    """Place every model marked dirty (after sharing the nodes again if they changed); then let go
    the blocks of nodes that moved to another model, where their old model no longer needs them."""
    shares.follow_capacity()
    placed = []
    # A model no longer served (a catalog entry disabled) is not placed again, whatever marked it.
    for state in PlacementState.objects.filter(dirty=True, model__in=served_models()).order_by("pk"):
        place_model(state.model)
        placed.append(state.model)
    for model in shares.shared_models():
        with transaction.atomic():
            release_leaving(model)
    return placed


@transaction.atomic
def place_model(model: str) -> list[Assignment]:
    """Compute and apply a placement of ``model`` over the active nodes; returns live assignments.

    When the only change since the last placement is pipeline members leaving (offline, draining,
    ejected, deleted) and spares hold their spans, the placement is repaired (``repair_by_spares``): the
    spares take the departed members' positions and every surviving member keeps its block and
    position. When the only change is nodes joining or coming back while every pipeline is whole,
    and a fresh plan over all of them would not serve ``SWARM_REPLACE_MARGIN`` more tokens/s, the
    newcomers become warm spares (``join_as_spares``) and nothing that serves moves. Anything
    else (a block that failed to load, a rebalance that pays, a gap no spare covers, a join that
    pays) is planned afresh by ``allocation.place``."""
    shares.follow_capacity()
    state, _ = PlacementState.objects.select_for_update().get_or_create(model=model)
    nodes, capacities = candidates(model, lock=True)
    n_layers = models.n_layers(model)
    by_id = {joined_id(n): n for n in nodes}
    live = {
        joined_id(a.node): a
        for a in Assignment.objects.select_for_update()
        .filter(model=model, state__in=LIVE_STATES)
        .select_related("node")
    }
    now = timezone.now()
    leaving = leaving_nodes(model, live)
    state.generation += 1
    state.dirty = False
    state.placed_at = now
    trusted_ids = {joined_id(n) for n in nodes if n.trusted}
    repaired = repair_by_spares(live, capacities, n_layers, state.coordinator_regions)
    joined = None if repaired is not None else join_as_spares(model, live, capacities, n_layers)
    kept = repaired[0] if repaired is not None else joined
    if (
        kept is not None
        and covers([c for c in capacities if c.node in trusted_ids], n_layers)
        and not has_trusted_pipeline(kept, trusted_ids)
    ):
        repaired = joined = None  # trusted nodes that can form a pipeline of their own get one: plan afresh
    fresh = _spares_ran_out(repaired[0], capacities, trusted_ids, n_layers) if repaired is not None else None
    if fresh is not None:
        repaired = None  # the repair used the last spares up: a plan that keeps one is laid out instead
    if repaired is not None:
        wanted, state.coordinator_regions = repaired
        how = "repaired"
    elif joined is not None:
        wanted, how = joined, "joined as spares"
    else:
        try:
            plan = fresh or (
                place_with_trusted(
                    capacities, trusted_ids, n_layers, spares_per_pipeline=settings.SWARM_SPARES_PER_PIPELINE
                )
                if capacities
                else None
            )
            if plan is None:
                raise PlacementError(
                    "no active node can hold a layer of this model"
                    if share_of(model) is None
                    else "no active node of its share of the nodes can hold a layer of this model"
                )
        except PlacementError as exc:
            state.note = str(exc)
            state.save()
            log.warning("cannot place %s: %s", model, exc)
            # No placement is coming that could replace the blocks of nodes moved to other models.
            let_go([live.pop(node) for node in sorted(leaving)], f"{model} cannot be placed on its share")
            return list(live.values())
        pipelines, state.coordinator_regions = order_pipelines(model, plan.pipelines)
        wanted = wanted_of(pipelines, carry_spares(plan.spares, plan.pipelines, pipelines))
        how = "placed"
    state.note = ""
    state.save()
    result = _apply(model, state.generation, wanted, live, by_id, now, hold=leaving)
    release_leaving(model)
    log.info(
        "%s %s (generation %d): %s",
        how,
        model,
        state.generation,
        ", ".join(f"{a.node.node_id}[{a.layer_start}:{a.layer_end}]" for a in result),
    )
    return result


def respread_spares(carries_jobs: Callable[[str, Span], bool]) -> list[str]:
    """The sweep's step that puts spares back where they help most: for each placed model, the
    first move of ``rebalancing.spare_moves_of`` whose spare carries no open job (``carries_jobs``:
    whether jobs not ended were routed onto that node's block of that span) is made, at most one
    per model and sweep; returns the models where a spare moved.

    The common case, nothing to move, is decided from the live blocks alone and without a lock
    (``rebalancing.may_move_spares``), so admissions of the model never wait on it; a move is
    decided under the locks ``place_model`` takes (the placement row, the nodes, then the
    assignments), and the spare's open jobs are read only then, when no new job can be routed onto
    its block until the move commits. Make before break: the spare's old block is released in the
    database and its agent keeps it until the new one is ready (``_apply``)."""
    moved = []
    placed = PlacementState.objects.filter(dirty=False, placed_at__isnull=False, model__in=served_models())
    for model in placed.order_by("pk").values_list("model", flat=True):
        live = {
            joined_id(a.node): a
            for a in Assignment.objects.filter(model=model, state__in=LIVE_STATES).select_related("node")
        }
        if may_move_spares(live) and _move_a_spare(model, carries_jobs) is not None:
            moved.append(model)
    return moved


@transaction.atomic
def _move_a_spare(model: str, carries_jobs: Callable[[str, Span], bool]) -> Assignment | None:
    """Move one ready spare of ``model`` that carries no open job as ``spare_moves_of`` says, under
    the placement's locks; its new block, or None when none may move now."""
    if not hold_routes(model):  # the placement row first, as place_model takes it
        return None
    state = PlacementState.objects.get(model=model)
    if state.dirty:
        return None  # a placement is coming, which places the spares afresh
    nodes, capacities = candidates(model, lock=True)
    live = {
        joined_id(a.node): a
        for a in Assignment.objects.select_for_update()
        .filter(model=model, state__in=LIVE_STATES)
        .select_related("node")
    }
    for move in spare_moves_of(live, capacities):
        spare = live[move.before.node]
        if carries_jobs(move.before.node, spare.span):
            continue
        wanted = wanted_now(live)
        wanted[move.after.node] = (spare.pipeline, spare.position, move.after.layer_start, move.after.layer_end, True)
        result = _apply(model, state.generation, wanted, live, {joined_id(n): n for n in nodes}, timezone.now())
        log.info(
            "%s: moved the spare %s from [%d:%d] to [%d:%d], held once and by no spare",
            model,
            move.before.node,
            move.before.layer_start,
            move.before.layer_end,
            move.after.layer_start,
            move.after.layer_end,
        )
        return next(a for a in result if a.supersedes_id == spare.pk)
    return None


def _spares_ran_out(wanted: Wanted, capacities, trusted_ids: set[str], n_layers: int) -> Placement | None:
    """The fresh plan to lay out instead of a repair that leaves fewer warm spares than
    SWARM_SPARES_PER_PIPELINE asks, where that plan over the same nodes keeps more: a spare used up
    (promoted into a departed member's place) is then replaced at once, though serving blocks move
    for it (make before break), since without one the next failure has nothing to heal from. None:
    the repair stands (it keeps enough spares, or no plan can do better: no node to spare)."""
    spares = sum(1 for target in wanted.values() if target[4])
    pipelines = {target[0] for target in wanted.values() if not target[4]}
    if spares >= settings.SWARM_SPARES_PER_PIPELINE * len(pipelines):
        return None
    try:
        plan = place_with_trusted(
            capacities, trusted_ids, n_layers, spares_per_pipeline=settings.SWARM_SPARES_PER_PIPELINE
        )
    except PlacementError:
        return None
    return plan if len(plan.spares) > spares else None


def _apply(
    model: str,
    generation: int,
    wanted: Wanted,
    live: dict[str, Assignment],
    by_id: dict[str, Node],
    now,
    *,
    hold: Collection[str] = (),
) -> list[Assignment]:
    """Make the live assignments what ``wanted`` says: a block whose span is unchanged is kept (its
    agent keeps it warm, whatever its new position), the others are released and new ones pushed.
    The blocks of the ``hold`` nodes (moving to another model's share) that ``wanted`` leaves out
    stay live as spares, until ``release_leaving`` lets them go."""
    result = []
    superseded: dict[str, Assignment] = {}  # node -> its released block, held until the new one is ready
    spare_pipeline = max((target[0] for target in wanted.values() if not target[4]), default=-1) + 1
    for node_id, assignment in live.items():
        target = wanted.get(node_id)
        if target is None and node_id in hold:
            target = (spare_pipeline, 0, assignment.layer_start, assignment.layer_end, True)
        if target is not None and (assignment.layer_start, assignment.layer_end) == target[2:4]:
            assignment.pipeline, assignment.position, _, _, assignment.is_spare = target
            assignment.generation = generation
            assignment.save(update_fields=["pipeline", "position", "is_spare", "generation"])
            result.append(assignment)
            continue
        assignment.state = AssignmentState.RELEASED
        assignment.released_at = now
        assignment.save(update_fields=["state", "released_at"])
        notify_node_changed(assignment.node_id)
        if target is None:
            push_release(assignment)
        else:
            superseded[node_id] = assignment
    kept = {a.node.node_id for a in result}
    for node_id, (pipeline_index, position, start, end, spare) in wanted.items():
        if node_id in kept:
            continue
        assignment = Assignment.objects.create(
            node=by_id[node_id],
            model=model,
            generation=generation,
            pipeline=pipeline_index,
            position=position,
            layer_start=start,
            layer_end=end,
            is_spare=spare,
            supersedes=superseded.get(node_id),
        )
        push(node_id, protocol.to_wire(assignment.as_message()))
        notify_node_changed(assignment.node_id)
        result.append(assignment)
    return result


def order_pipelines(model: str, pipelines) -> tuple[list[tuple[Stage, ...]], list[str]]:
    """Each pipeline's ring order and coordinator region, chosen together as the cheapest tour
    with the coordinator as depot over the measured links (an unmeasured link counts as bad).
    Layer counts stay as the water-filling gave them; only who holds which span moves."""
    config = models.load_config(model)
    payload = config.hidden_size * 4 + 256  # one decode step's frame, float32
    nodes = sorted({stage.node for pipeline in pipelines for stage in pipeline})
    rtt, uplink = link_maps(nodes)
    regions = [region_target(r) for r in settings.SWARM_COORDINATOR_REGIONS]

    def cost(a: str, b: str) -> float:
        return hop_cost(a, b, rtt_ms=rtt, uplink_mbps=uplink, payload_bytes=payload)

    ordered, chosen_regions = [], []
    for pipeline in pipelines:
        layers = {stage.node: stage.layer_end - stage.layer_start for stage in pipeline}
        region, tour = place_coordinator(regions, [stage.node for stage in pipeline], cost)
        ordered.append(tuple(spans_for(list(tour.order), layers)))
        chosen_regions.append(region.removeprefix("region:"))
    return ordered, chosen_regions


@transaction.atomic
def stop_serving(model: str) -> int:
    """``model`` is served no more (its catalog entry was disabled): its live blocks are released
    (each agent takes no new job on it and unloads it once its jobs in flight end), it is not
    placed again, and the other models are placed again over the nodes it frees. Returns the
    blocks released."""
    PlacementState.objects.filter(model=model).update(dirty=False, note="not served")
    live = Assignment.objects.select_for_update().filter(model=model, state__in=LIVE_STATES).select_related("node")
    released = list(live.order_by("pk"))
    for assignment in released:
        release(assignment)
    if released:
        log.info("%s is served no more: released its blocks on %d nodes", model, len(released))
        placement_changed()
    return len(released)
