"""A heal from any spare: a failed stage's span loaded on another node while its job waits.

A job whose stage died or stalled moves onto a route around it (``jobs.services.heal_job``). When no
ready block holds the failed span (no warm spare of it, no other pipeline's stage), the job waits,
and ``load_for_heal`` has the best node load that span now instead of letting the wait run out:

- who: a node of the model's placement candidates (active, connected, of its share and standing,
  not failing to load) that can hold the span's layers, is not on the job's route (its block there
  is needed), is in good standing (not reported failed, under no review, not backed off), and that
  the request's privacy allows. A spare or a node holding no block of the model comes first, then
  a pipeline member that carries no open job and whose span another ready block holds (a request
  routes through any chain of blocks, spares included, so its span stays served); among them the
  fewest open jobs, then the
  fastest stage in the route's place: its credible time for the span's layers plus the measured
  round trips from the failed stage's predecessor and to its successor (an unmeasured hop costs
  ``UNMEASURED_MS``, never nothing);
- how: make before break. The node's block of the model (it holds at most one) is released in the
  database, so nothing new is routed to it, and superseded by the new one, so its agent keeps it
  for the sessions in flight until the new block is ready or failed (``readiness``). The new block
  is a warm spare of the failed span: routing takes it for the waiting job as soon as it is ready
  (``selectors.route_around``), and once the failed node is gone the next placement repairs its
  pipeline with it (``rebalancing.repair_by_spares``);
- once: a block of the span being loaded already (for another job's heal, or a placement) is waited
  for instead of starting another.

A pipeline member taken leaves a gap in its pipeline that the other holder of its span fills for
routing; the next placement (the failed node's departure sets one off) repairs the pipeline with the
blocks as they are then. The wait is the caller's: ``heal_wait_s`` bounds it by the span's bytes.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node, Privacy
from marketplace.nodes.services import push
from marketplace.placement.blocks import joined_id
from marketplace.placement.candidates import candidates
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState, PlacementState
from marketplace.placement.selectors import stage_costs
from worker_agent import model as models
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol.span import Span

log = logging.getLogger("swarm.placement")

UNMEASURED_MS = 1000.0  # a hop nobody measured, in the ranking of who loads a span: bad, never free
GIB = 1 << 30


def heal_wait_s(span: Span) -> float:
    """How long a job waits for a block of ``span`` to be loaded for its heal: SWARM_HEAL_WAIT_S, plus
    SWARM_HEAL_WAIT_S_PER_GIB for each GiB of the span's float32 weights (the most a node fetches
    and loads for it)."""
    weights = models.layer_parameters(span.model) * 4 * span.layers
    return settings.SWARM_HEAL_WAIT_S + settings.SWARM_HEAL_WAIT_S_PER_GIB * weights / GIB


@dataclass(frozen=True)
class Loader:
    """A node that may load the span, and how it ranks (lower first)."""

    node: Node
    held: Assignment | None  # its live block of the model, superseded by the new one
    rank: tuple


def load_for_heal(
    span: Span,
    *,
    route: list[str],
    neighbours: tuple[str | None, str | None],
    avoid: Collection[str],
    open_jobs: Mapping[str, int],
    privacy: str = Privacy.ANY,
) -> Assignment | None:
    """Have the best node load ``span`` for a waiting heal (see the module's docstring); returns the
    block being loaded (a new one, or one loading already), or None when no node can. ``route``: the
    nodes of the job's route; ``neighbours``: the nodes before and after the failed stage (None at an
    end); ``avoid``: nodes the job saw fail; ``open_jobs``: jobs in flight by node id. The caller holds
    the model's placement row (``selectors.hold_routes``) in its transaction."""
    model = span.model
    live = list(Assignment.objects.filter(model=model, state__in=LIVE_STATES).select_related("node"))
    for assignment in live:
        if (
            assignment.state == AssignmentState.ASSIGNED
            and assignment.span == span
            and assignment.node.node_id not in avoid
            and assignment.node.suspected_at is None
        ):
            return assignment  # loading already: wait for it
    loader = _best_loader(span, live, route, neighbours, avoid, open_jobs, privacy)
    if loader is None:
        return None
    return _assign(span, loader, live)


def _best_loader(
    span: Span,
    live: list[Assignment],
    route: list[str],
    neighbours: tuple[str | None, str | None],
    avoid: Collection[str],
    open_jobs: Mapping[str, int],
    privacy: str,
) -> Loader | None:
    nodes, capacities = candidates(span.model, lock=False)
    caps = {c.node: c.max_layers for c in capacities}
    held = {joined_id(a.node): a for a in live}
    n_layers = models.n_layers(span.model)
    ends = span.start == 0 or span.end == n_layers
    # The ready blocks of each span on nodes in good standing, the failed ones aside.
    holders = Counter(
        a.span
        for a in live
        if a.state == AssignmentState.READY and a.node.node_id not in avoid and _in_good_standing(a.node)
    )
    eligible: list[tuple[Node, Assignment | None, int]] = []
    for node in nodes:
        node_id = joined_id(node)
        block = held.get(node_id)
        if (
            caps.get(node_id, 0) < span.layers
            or node_id in avoid
            or node_id in route
            or not _in_good_standing(node)
            or not (privacy == Privacy.ANY or node.trusted or (privacy == Privacy.TRUSTED_ENDS and not ends))
        ):
            continue
        if block is None or block.is_spare:
            tier = 0
        elif not open_jobs.get(node_id) and holders[block.span] > 1:
            tier = 1  # an idle pipeline member whose span another ready block holds
        else:
            continue
        eligible.append((node, block, tier))
    if not eligible:
        return None
    before, after = neighbours
    ids = [joined_id(node) for node, _, _ in eligible] + [n for n in (before, after) if n is not None]
    rtt, layer_ms, _ = stage_costs(sorted(set(ids)))

    def stage_ms(node_id: str) -> float:
        hops = [rtt.get((before, node_id), UNMEASURED_MS) if before is not None else 0.0]
        hops.append(rtt.get((node_id, after), UNMEASURED_MS) if after is not None else 0.0)
        return layer_ms.get(node_id, UNMEASURED_MS) * span.layers + sum(hops) / 2

    loaders = [
        Loader(node, block, (tier, open_jobs.get(joined_id(node), 0), stage_ms(joined_id(node)), joined_id(node)))
        for node, block, tier in eligible
    ]
    return min(loaders, key=lambda loader: loader.rank)


def _in_good_standing(node: Node) -> bool:
    """Not reported failed since its last sign of life, under no strike review, not backed off."""
    backoff = node.routing_backoff_until
    return node.suspected_at is None and not node.under_review and (backoff is None or backoff <= timezone.now())


def _assign(span: Span, loader: Loader, live: list[Assignment]) -> Assignment:
    node, old = loader.node, loader.held
    now = timezone.now()
    state = PlacementState.objects.get(model=span.model)
    spare_pipeline = max((a.pipeline for a in live if not a.is_spare), default=-1) + 1
    if old is not None:
        old.state, old.released_at = AssignmentState.RELEASED, now
        old.save(update_fields=["state", "released_at"])
    assignment = Assignment.objects.create(
        node=node,
        model=span.model,
        generation=state.generation,
        pipeline=spare_pipeline,
        position=0,
        layer_start=span.start,
        layer_end=span.end,
        is_spare=True,
        supersedes=old,
    )
    push(joined_id(node), protocol.to_wire(assignment.as_message()))
    notify_node_changed(node.pk)
    log.info(
        "%s loads %s[%d:%d] for a heal (it held %s)",
        joined_id(node),
        span.model,
        span.start,
        span.end,
        f"[{old.layer_start}:{old.layer_end}]{' as a spare' if old.is_spare else ''}" if old else "no block",
    )
    return assignment
