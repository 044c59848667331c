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
only once the new assignment is ready, or has failed to load (``assignment_ready``,
``assignment_failed``). A node left without any block is told at once.

Several models (``SWARM_MODELS``) share one set of nodes, an agent serving one model at a time:
``shares`` splits the active nodes among them (``sharing.share``: every model first gets the
fewest nodes that hold one complete pipeline of it, in order of demand when the nodes cannot hold
every model's at once; the rest in proportion to each model's work, the tokens of its jobs over
SWARM_DEMAND_WINDOW_S times its layer count, or its layer count alone while nothing is asked), and
each model is placed as above over its own share. Demand moves nodes at most once per
SWARM_REBALANCE_MIN_INTERVAL_S and only when some model's fraction of the work moved by more than
SWARM_DEMAND_SHIFT (``share_by_demand``); nodes joining or leaving re-share at once, by the demand
last used. A node moving from model A to model B is handed over make before break:

1. B's placement leaves it out while it holds a live block of A (``_candidates``);
2. A is placed again over its new share; the moving node's block of A stays live, as a spare, while
   A has no servable pipeline without it (``_apply``); routing takes it only where no chain avoids
   it (``selectors.leaving``): it gets no new request from the moment the move is decided while
   other blocks can serve;
3. once one has (the blocks that replace it report ready, or another pipeline was whole all along),
   its block of A is released (``_release_leaving``): the agent takes no new job on it and unloads
   it once its jobs in flight end, and B is placed again, now with that node.

A model the nodes cannot serve alongside the others (its share is empty) has its blocks released
at once: its jobs in flight still end on them, and its new requests find no route.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.catalog.selectors import min_reputation, served_models
from marketplace.nodes import services as nodes
from marketplace.nodes import trust_marks
from marketplace.nodes.capacity import assess, credible_speeds
from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.reachability import relay_at, relay_of
from marketplace.nodes.services import push
from marketplace.placement import shares
from marketplace.placement.allocation import (
    NodeCapacity,
    Stage,
    carry_spares,
    needs_rebalance,
    pays_to_replace,
    per_layer_load,
    repair,
    spans_for,
    throughput,
)
from marketplace.placement.data_urls import check_data_url
from marketplace.placement.errors import InvalidDataUrl, PlacementError
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState, PlacementState
from marketplace.placement.selectors import link_maps, region_target, servable_pipelines, share_of
from marketplace.placement.tour import hop_cost, place_coordinator
from marketplace.placement.trusted import covers, has_trusted_pipeline, place_with_trusted
from worker_agent import control_protocol as protocol
from worker_agent import model as models

log = logging.getLogger("swarm.placement")


def _node_id(node: Node) -> str:
    """The id of a node that placement handles (a candidate, a block's holder, an active or draining
    node): each has joined, so each has one."""
    assert node.node_id is not None
    return node.node_id


def mark_dirty(model: str | None = None) -> None:
    """Ask for a new placement of one model (or every served model) at the next sweep."""
    for name in [model] if model else served_models():
        PlacementState.objects.update_or_create(model=name, defaults={"dirty": True})


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
        _release(assignment)
    if released:
        log.info("%s is served no more: released its blocks on %d nodes", model, len(released))
        _placement_changed()
    return len(released)


@transaction.atomic
def release_node(node_pk: int) -> int:
    now = timezone.now()
    released = Assignment.objects.filter(node_id=node_pk, state__in=LIVE_STATES).update(
        state=AssignmentState.RELEASED, released_at=now
    )
    if released:
        notify_node_changed(node_pk)
    return released


# --- node changes that move the swarm's blocks ------------------------------------------------------
# The node registry records the change; placement releases the node's blocks and asks for a new
# placement once the change commits.


def _placement_changed() -> None:
    transaction.on_commit(mark_dirty)


@transaction.atomic
def register_agent(**join) -> Node:
    """An agent joins with a node's token (``nodes.services.register_agent`` checks it). A node that
    joins again is a new agent process: the blocks its previous agent held are gone with it, so they
    are released and the model placed again; nothing routes to them meanwhile."""
    node = nodes.register_agent(**join)
    if release_node(node.pk):
        _placement_changed()
    return node


@transaction.atomic
def node_connected(node_pk: int) -> Node:
    """The control channel is up: a pending or offline node becomes active and placement is redone.
    An active node whose channel merely reconnected changes no capacity: its blocks stay assigned to
    it. Each is confirmed again before a request is routed to it (ready -> assigned, until the agent
    reports it ready): the agent may be a new process that still has to load it, on another port."""
    node, came_online = nodes.mark_connected(node_pk)
    unconfirmed = Assignment.objects.filter(node_id=node_pk, state=AssignmentState.READY).update(
        state=AssignmentState.ASSIGNED
    )
    if unconfirmed:
        log.info("node %s reconnected: %d block(s) to be confirmed ready", node.node_id, unconfirmed)
    holds = Assignment.objects.filter(node_id=node_pk, state__in=LIVE_STATES).exists()
    failed = Assignment.objects.filter(node_id=node_pk, state=AssignmentState.FAILED).exists()
    if came_online or (failed and not holds):
        # A node left out for its failed blocks (``_failing``) gets a fresh start on reconnect.
        _placement_changed()
    return node


@transaction.atomic
def record_heartbeat(node_pk: int, load: dict, now: datetime | None = None) -> None:
    """A heartbeat: its load is recorded; a node it brings back from offline is placed again. One
    whose agent reports it is stopping (state ``leaving``) is taken off routing at once, in the
    same transaction (``nodes.services.mark_leaving``)."""
    if nodes.apply_heartbeat(node_pk, load, now=now):
        _placement_changed()
    if isinstance(load, dict) and load.get("state") == protocol.LEAVING:
        nodes.mark_leaving(node_pk)


@transaction.atomic
def report_node_failure(node_id: str, reason: str, now: datetime | None = None) -> bool:
    """A job's coordinator saw the node's stage die or stall: no request is routed to it from now
    on (``selectors.servable_pipelines`` and the healing routes skip suspect nodes). Its heartbeats
    decide the rest: silence takes it offline at the sweep, which re-places the model; a heartbeat
    sent after the report clears the suspicion. The report alone changes no capacity, so it asks
    for no new placement. False when no active or draining node has that id."""
    return nodes.mark_suspected(node_id, reason, now=now)


@transaction.atomic
def record_measured_speed(node_pk: int, layer_tokens_per_s: float) -> bool:
    """A speed a passed challenge proved (``nodes.services.record_verified_speed``). A node's first
    proof makes its speed count where a claim in doubt counted for nothing (``nodes.capacity``),
    and a better one lifts its cap: its model is placed again when a fresh plan over the credible
    speeds now serves SWARM_REPLACE_MARGIN more tokens/s (``_replacement_pays``). True when it is."""
    if not nodes.record_verified_speed(node_pk, layer_tokens_per_s):
        return False
    model = Assignment.objects.filter(node_id=node_pk, state__in=LIVE_STATES).values_list("model", flat=True).first()
    if model is None:
        return False
    live = list(Assignment.objects.filter(model=model, state__in=LIVE_STATES, is_spare=False).select_related("node"))
    if not live or not _replacement_pays(model, live):
        return False
    mark_dirty(model)
    return True


def sweep_heartbeats(now=None) -> list[str]:
    """Nodes silent past the timeout go offline and lose their assignments; returns their ids."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.SWARM_HEARTBEAT_TIMEOUT_S)
    silent = list(
        Node.objects.filter(state__in=[NodeState.ACTIVE, NodeState.DRAINING], last_heartbeat_at__lt=cutoff).values_list(
            "pk", "node_id"
        )
    )
    gone = []
    for pk, node_id in silent:
        assert node_id is not None  # an active or draining node has joined
        with transaction.atomic():
            # Conditional: a heartbeat that raced in keeps the node.
            if Node.objects.filter(
                pk=pk, state__in=[NodeState.ACTIVE, NodeState.DRAINING], last_heartbeat_at__lt=cutoff
            ).update(state=NodeState.OFFLINE, connected=False, suspected_at=None, suspicion=""):
                release_node(pk)
                notify_node_changed(pk)
                gone.append(node_id)
                log.info("node %s went offline (no heartbeat since %s)", node_id, cutoff.isoformat())
    if gone:
        _placement_changed()
    return gone


@transaction.atomic
def drain_node(node: Node) -> Node:
    """The node takes no new work; placement is redone without it."""
    if nodes.mark_draining(node):
        _placement_changed()
    node.refresh_from_db()
    return node


@transaction.atomic
def eject_node(node: Node, *, reason: str, by=None) -> Node:
    """Remove a node from the swarm (upheld strikes past the threshold, or an admin): its blocks are
    released, its agent is told to stop, and it cannot come back by itself."""
    if nodes.mark_ejected(node, reason=reason, by=by):
        release_node(node.pk)
        _placement_changed()
    node.refresh_from_db()
    return node


@transaction.atomic
def set_trusted(node: Node, trusted: bool, *, by, reason: str) -> Node:
    """Mark ``node`` trusted, or take the mark away (an admin, with a reason). A new mark redoes
    placement, so that trusted nodes able to hold a model together form a pipeline of their own; a
    mark taken away moves no block (routing stops counting the node as trusted at once). Jobs in
    flight keep their routes."""
    if trusted:
        if trust_marks.mark_trusted(node, by=by, reason=reason):
            _placement_changed()
    else:
        trust_marks.clear_trusted(node, by=by, reason=reason)
    node.refresh_from_db()
    return node


@transaction.atomic
def delete_node(node: Node) -> None:
    """The owner deletes a node: its agent is told to stop and its blocks are released.

    A node that never joined has no history and goes. One that joined is soft-deleted
    (``nodes.services.mark_deleted``): jobs it served may still be running or waiting to settle,
    and its earnings, strikes and challenges point at it, so its row stays and its owner is paid
    for the verified work it did; it is never placed or routed again."""
    if node.node_id:
        push(node.node_id, protocol.to_wire(protocol.Stop(reason="the node was deleted by its owner")))
    release_node(node.pk)
    notify_node_changed(node.pk)
    if node.node_id:
        nodes.mark_deleted(node)
    else:
        node.delete()
    _placement_changed()


def _candidates(model: str, *, lock: bool) -> tuple[list[Node], list[NodeCapacity]]:
    """The nodes a placement of ``model`` may use now, and what the planner knows of each: the
    active nodes of its share (every active node when one model is served)."""
    # An agent serves one model at a time: a node holding a live block of another model is not
    # available to this one until that block is released (a node moving between shares is handed
    # over make before break, see ``_release_leaving``).
    busy = Assignment.objects.filter(state__in=LIVE_STATES).exclude(model=model).values("node_id")
    query = Node.objects.select_for_update() if lock else Node.objects.all()
    query = query.filter(state=NodeState.ACTIVE, connected=True, node_id__isnull=False).exclude(pk__in=busy)
    share = share_of(model)
    if share is not None:
        query = query.filter(node_id__in=share)
    # A catalog model may ask for nodes of some standing (its entry's min_reputation).
    query = query.filter(reputation__gte=min_reputation(model))
    nodes = list(query.order_by("pk"))
    failing = _failing(nodes, model)
    nodes = [n for n in nodes if n.pk not in failing]
    credence = assess(nodes)
    caps = {n.pk: shares.layer_cap(n, model) for n in nodes}
    capacities = [
        NodeCapacity(
            node=_node_id(n),
            compute=credence.speeds[_node_id(n)],
            max_layers=caps[n.pk],
            reputation=n.reputation,
            in_doubt=n.node_id in credence.in_doubt,
        )
        for n in nodes
        if caps[n.pk] >= 1
    ]
    # Sharing gives no node a share of a model it cannot hold a layer of: those are in no share.
    too_small = [n for n in nodes if caps[n.pk] < 1] if share is None else shares.outside_shares()
    for node in too_small:
        if (reason := shares.no_room(node, model)) is not None:
            log.warning("%s: left out of %s placements: %s", node.node_id, model, reason)
    return nodes, capacities


def _failing(nodes: list[Node], model: str) -> set[int]:
    """The nodes (pks) whose last SWARM_BLOCK_FAILURES_BEFORE_BACKOFF blocks of ``model`` since
    their control channel opened all failed (each failure re-places the model, which would
    otherwise put the block right back onto them, forever). A reconnect, a restarted agent, gives a
    node a fresh start. One query for all of them."""
    needed = settings.SWARM_BLOCK_FAILURES_BEFORE_BACKOFF
    since = {n.pk: n.connected_since for n in nodes}
    recent: dict[int, list[str]] = {pk: [] for pk in since}
    rows = Assignment.objects.filter(node_id__in=since, model=model)
    opened_at = [opened for opened in since.values() if opened is not None]
    if len(opened_at) == len(since) and since:  # every node's channel opened at a known time
        rows = rows.filter(created_at__gte=min(opened_at))
    for node_pk, state, created_at in rows.order_by("-created_at", "-pk").values_list("node_id", "state", "created_at"):
        opened = since[node_pk]
        if len(recent[node_pk]) < needed and (opened is None or created_at >= opened):
            recent[node_pk].append(state)
    failing = {pk for pk, states in recent.items() if len(states) == needed and set(states) == {AssignmentState.FAILED}}
    for node in nodes:
        if node.pk in failing:
            log.warning("%s: left out of %s placements: its last %d blocks failed", node.node_id, model, needed)
    return failing


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
            _release_leaving(model)
    return placed


def share_by_demand(tokens: Mapping[str, float], now: datetime | None = None) -> list[str]:
    """Share the nodes among the served models for ``tokens`` (prompt + completion tokens of each
    model's jobs over SWARM_DEMAND_WINDOW_S), when demand moved enough and not too recently
    (``shares.follow_demand``); returns the models whose share changed, placed at the next sweep."""
    return shares.follow_demand(tokens, now=now)


@transaction.atomic
def place_model(model: str) -> list[Assignment]:
    """Compute and apply a placement of ``model`` over the active nodes; returns live assignments.

    When the only change since the last placement is pipeline members leaving (offline, draining,
    ejected, deleted) and spares hold their spans, the placement is repaired (``_repair``): the
    spares take the departed members' positions and every surviving member keeps its block and
    position. When the only change is nodes joining or coming back while every pipeline is whole,
    and a fresh plan over all of them would not serve ``SWARM_REPLACE_MARGIN`` more tokens/s, the
    newcomers become warm spares (``_join_as_spares``) and nothing that serves moves. Anything
    else (a block that failed to load, a rebalance that pays, a gap no spare covers, a join that
    pays) is planned afresh by ``allocation.place``."""
    shares.follow_capacity()
    state, _ = PlacementState.objects.select_for_update().get_or_create(model=model)
    nodes, capacities = _candidates(model, lock=True)
    n_layers = models.n_layers(model)
    by_id = {_node_id(n): n for n in nodes}
    live = {
        _node_id(a.node): a
        for a in Assignment.objects.select_for_update()
        .filter(model=model, state__in=LIVE_STATES)
        .select_related("node")
    }
    now = timezone.now()
    leaving = _leaving(model, live)
    state.generation += 1
    state.dirty = False
    state.placed_at = now
    trusted_ids = {_node_id(n) for n in nodes if n.trusted}
    repaired = _repair(live, capacities, n_layers, state.coordinator_regions)
    joined = None if repaired is not None else _join_as_spares(model, live, capacities, n_layers)
    kept = repaired[0] if repaired is not None else joined
    if (
        kept is not None
        and covers([c for c in capacities if c.node in trusted_ids], n_layers)
        and not has_trusted_pipeline(kept, trusted_ids)
    ):
        repaired = joined = None  # trusted nodes that can form a pipeline of their own get one: plan afresh
    if repaired is not None:
        wanted, state.coordinator_regions = repaired
        how = "repaired"
    elif joined is not None:
        wanted, how = joined, "joined as spares"
    else:
        try:
            plan = (
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
            _let_go([live.pop(node) for node in sorted(leaving)], f"{model} cannot be placed on its share")
            return list(live.values())
        pipelines, state.coordinator_regions = order_pipelines(model, plan.pipelines)
        wanted = _wanted(pipelines, carry_spares(plan.spares, plan.pipelines, pipelines))
        how = "placed"
    state.note = ""
    state.save()
    result = _apply(model, state.generation, wanted, live, by_id, now, hold=leaving)
    _release_leaving(model)
    log.info(
        "%s %s (generation %d): %s",
        how,
        model,
        state.generation,
        ", ".join(f"{a.node.node_id}[{a.layer_start}:{a.layer_end}]" for a in result),
    )
    return result


# node id -> (pipeline, position, layer_start, layer_end, is_spare)
Wanted = dict[str, tuple[int, int, int, int, bool]]


def _wanted(pipelines: Sequence[Sequence[Stage]], spares: Sequence[Stage]) -> Wanted:
    """The assignment each node should hold: pipeline members by position, then the spares."""
    wanted = {}
    for pipeline_index, stages in enumerate(pipelines):
        for position, stage in enumerate(stages):
            wanted[stage.node] = (pipeline_index, position, stage.layer_start, stage.layer_end, False)
    for spare in spares:
        wanted[spare.node] = (len(pipelines), 0, spare.layer_start, spare.layer_end, True)
    return wanted


def _repair(
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
    return _wanted(fixed.pipelines, fixed.spares), [regions[p] if p < len(regions) else default for p in kept]


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
    stay live as spares, until ``_release_leaving`` lets them go."""
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
            _push_release(assignment)
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


def _leaving(model: str, live: dict[str, Assignment]) -> set[str]:
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


def _release_leaving(model: str) -> list[str]:
    """Make before break across models: the blocks of ``model`` on nodes that moved to another
    model's share are let go once ``model`` has a servable pipeline through none of them (their
    replacements are ready, or another pipeline was whole all along); returns those nodes' ids."""
    share = share_of(model)
    if share is None:
        return []
    live = Assignment.objects.select_for_update().filter(model=model, state__in=LIVE_STATES).select_related("node")
    leaving = [a for a in live.order_by("pk") if _node_id(a.node) not in share]
    away = {_node_id(a.node) for a in leaving}
    if not leaving or not any(all(s.node not in away for s in p) for p in servable_pipelines(model)):
        return []
    return _let_go(leaving, f"{model} is servable without them")


def _let_go(leaving: list[Assignment], why: str) -> list[str]:
    """Release the blocks of nodes that moved to another model (the agent takes no new job on them
    and unloads them once their jobs in flight end), and place those models again."""
    if not leaving:
        return []
    for assignment in leaving:
        _release(assignment)
        taker = shares.model_sharing(_node_id(assignment.node))
        if taker is not None:
            # Once this commits: the placement rows are locked before the assignments everywhere else.
            transaction.on_commit(functools.partial(mark_dirty, taker))
    nodes = [_node_id(a.node) for a in leaving]
    log.info("%s: let go the blocks of %s on %s (moved to other models)", why, leaving[0].model, ", ".join(nodes))
    return nodes


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


def request_probes(model: str, nodes: list[Node]) -> None:
    """Ask each placed node to measure its links to the others and to the coordinator regions."""
    for node in nodes:
        targets = [
            protocol.ProbeTarget(target=_node_id(other), url=other.data_url)
            for other in nodes
            if other.pk != node.pk and other.data_url
        ]
        targets += [
            protocol.ProbeTarget(target=region_target(r), url=settings.SWARM_REGION_PROBE_URLS.get(r))
            for r in settings.SWARM_COORDINATOR_REGIONS
        ]
        push(_node_id(node), protocol.to_wire(protocol.Probe(model=model, targets=tuple(targets))))
    log.info("asked %d nodes to probe their links for %s", len(nodes), model)


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
            stages = [Stage(_node_id(a.node), a.layer_start, a.layer_end) for a in live if a.pipeline == pipeline]
            covered = sum(s.layer_end - s.layer_start for s in stages)
            if covered == models.n_layers(state.model) and needs_rebalance(
                per_layer_load(stages, covered, speed), settings.SWARM_REBALANCE_CV
            ):
                if _replacement_pays(state.model, live):
                    mark_dirty(state.model)
                    marked.append(state.model)
                break
    return marked


def _join_as_spares(
    model: str, live: dict[str, Assignment], capacities: list[NodeCapacity], n_layers: int
) -> Wanted | None:
    """The live placement kept as it is, with each node that joined (or came back) since as a warm
    spare of the span it can hold with the fewest replicas; None when something else changed (a
    member left, a pipeline is not whole) or a fresh plan would pay by the margin."""
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
    if not members or _replacement_pays(model, list(live.values())):
        return None
    replicas = Counter((a.layer_start, a.layer_end) for a in live.values())
    wanted: Wanted = {
        node: (a.pipeline, a.position, a.layer_start, a.layer_end, a.is_spare) for node, a in live.items()
    }
    spare_pipeline = max(a.pipeline for a in live.values()) + 1
    for newcomer in sorted(newcomers, key=lambda c: c.node):
        fits = [span for span in sorted(replicas) if span[1] - span[0] <= newcomer.max_layers]
        if not fits:
            continue  # holds no span of this placement: it stays idle until a placement that pays
        span = min(fits, key=lambda span: (replicas[span], -(span[1] - span[0]), span))
        replicas[span] += 1
        wanted[newcomer.node] = (spare_pipeline, 0, span[0], span[1], True)
    return wanted


def _replacement_pays(model: str, live: list[Assignment]) -> bool:
    """Whether a fresh plan over the nodes available now beats the current pipelines by the margin."""
    n_layers = models.n_layers(model)
    nodes, capacities = _candidates(model, lock=False)
    compute = {c.node: c.compute for c in capacities}
    serving = credible_speeds(a.node for a in live)
    for a in live:  # a serving node busy elsewhere is not a candidate, but its stage still counts
        compute.setdefault(_node_id(a.node), serving[_node_id(a.node)])
    current = []
    for pipeline in sorted({a.pipeline for a in live}):
        stages = sorted((Stage(_node_id(a.node), a.layer_start, a.layer_end) for a in live if a.pipeline == pipeline),
                        key=lambda s: s.layer_start)  # fmt: skip
        if sum(s.layers for s in stages) == n_layers:
            current.append(stages)
    try:
        proposed = place_with_trusted(  # the plan place_model would make, trusted pipelines apart
            capacities,
            {_node_id(n) for n in nodes if n.trusted},
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


def _release(assignment: Assignment) -> None:
    """Release a live block: recorded, the agent told, the node's pages updated."""
    assignment.state, assignment.released_at = AssignmentState.RELEASED, timezone.now()
    assignment.save(update_fields=["state", "released_at"])
    _push_release(assignment)
    notify_node_changed(assignment.node_id)


def _push_release(assignment: Assignment) -> None:
    """Tell the agent to let ``assignment``'s block go, and every older block it still holds for it."""
    current: Assignment | None = assignment
    while current is not None:
        push(
            _node_id(current.node),
            protocol.to_wire(protocol.Release(assignment=current.pk, model=current.model)),
        )
        older = current.supersedes
        if older is not None:
            Assignment.objects.filter(pk=current.pk).update(supersedes=None)
        current = older


def _release_superseded(assignment_pk: int) -> None:
    """The new block is ready or failed: the agent may let the blocks it superseded go."""
    assignment = Assignment.objects.select_related("supersedes__node").get(pk=assignment_pk)
    if assignment.supersedes is not None:
        older = assignment.supersedes
        Assignment.objects.filter(pk=assignment.pk).update(supersedes=None)
        _push_release(older)


@transaction.atomic
def assignment_ready(node_pk: int, assignment_pk: int, data_url: str) -> bool:
    """The agent reports its block loaded and served at ``data_url``; False if it is stale.
    The block it superseded on that node is released at the agent now. Once every live block of
    the model is up, the placed nodes measure their links."""
    # A block confirmed again after its node reconnected (``node_connected``) was ready before:
    # the links around it were measured then, and are not probed again for it.
    confirmed_again = Assignment.objects.filter(pk=assignment_pk, ready_at__isnull=False).exists()
    moved = (
        Assignment.objects.filter(pk=assignment_pk, node_id=node_pk, state=AssignmentState.READY)
        .exclude(data_url=data_url[:255])
        .update(data_url=data_url[:255])
    )
    if moved:
        # Served from another address now (through another relay, say): the links are measured again.
        notify_node_changed(node_pk)
        model = Assignment.objects.get(pk=assignment_pk).model
        live = Assignment.objects.filter(model=model, state__in=LIVE_STATES).select_related("node")
        request_probes(model, [a.node for a in live])
        return True
    updated = Assignment.objects.filter(pk=assignment_pk, node_id=node_pk, state=AssignmentState.ASSIGNED).update(
        state=AssignmentState.READY, ready_at=timezone.now(), data_url=data_url[:255]
    )
    if updated:
        _release_superseded(assignment_pk)
        notify_node_changed(node_pk)
        model = Assignment.objects.get(pk=assignment_pk).model
        _release_leaving(model)  # this block may be the last one the model waited for
        live = Assignment.objects.filter(model=model, state__in=LIVE_STATES).select_related("node")
        if not confirmed_again and all(a.state == AssignmentState.READY for a in live):
            request_probes(model, [a.node for a in live])
    return bool(updated)


def report_ready(node_pk: int, assignment_pk: int, data_url: str, *, seen_from: str | None) -> bool:
    """The agent's own report that its block is served at ``data_url``, from a control channel
    that came from ``seen_from`` (an IP address; None when unknown), taken as it comes: as
    ``checked_data_url``, then ``assignment_ready``. The control channel checks that the URL can be
    reached in between (``nodes.reachability``)."""
    return assignment_ready(
        node_pk, assignment_pk, checked_data_url(node_pk, assignment_pk, data_url, seen_from=seen_from)
    )


def checked_data_url(node_pk: int, assignment_pk: int, data_url: str, *, seen_from: str | None) -> str:
    """``data_url`` if the control plane may route to it for this node: its own address
    (``data_urls.check_data_url``) or its URL at a configured relay. Otherwise the assignment fails
    with the reason and ``InvalidDataUrl`` is raised: no connection is ever opened to an address an
    agent merely names."""
    try:
        node_id = Node.objects.values_list("node_id", flat=True).get(pk=node_pk) or ""
        if relay_of(data_url, node_id) is None:
            if (relay := relay_at(data_url)) is not None:  # another node's URL there, or no node's
                raise InvalidDataUrl(
                    f"data URL {data_url!r} is at relay {relay.id} but is not this node's URL there "
                    f"({relay.url(node_id, tls=True)} or {relay.url(node_id, tls=False)})",
                    param="url",
                )
            check_data_url(data_url, seen_from=seen_from, allowed_hosts=settings.SWARM_AGENT_URL_HOSTS)
        _check_tls(node_pk, data_url)
    except InvalidDataUrl as exc:
        assignment_failed(node_pk, assignment_pk, f"{exc.code}: {exc}")
        raise
    return data_url


def _check_tls(node_pk: int, url: str) -> None:
    """A node certified for TLS at join, or any node where the settings require TLS, serves wss://:
    no agent takes its jobs' traffic back to plain text."""
    if url.startswith("wss://"):
        return
    if Node.objects.filter(pk=node_pk).exclude(tls_certificate="").exists():
        raise InvalidDataUrl(f"data URL {url!r} must use wss://: this node joined with a TLS certificate", param="url")
    if settings.SWARM_REQUIRE_DATA_TLS:
        raise InvalidDataUrl(
            f"data URL {url!r} must use wss://: this control plane requires TLS on the data plane "
            "(join again with swarm-worker join --tls auto)",
            param="url",
        )


@transaction.atomic
def assignment_failed(node_pk: int, assignment_pk: int, error: str) -> bool:
    updated = Assignment.objects.filter(pk=assignment_pk, node_id=node_pk, state=AssignmentState.ASSIGNED).update(
        state=AssignmentState.FAILED, error=error[:2000], released_at=timezone.now()
    )
    if updated:
        _release_superseded(assignment_pk)  # nothing to wait for: the old block goes too
        notify_node_changed(node_pk)
        mark_dirty(Assignment.objects.get(pk=assignment_pk).model)
    return bool(updated)
