"""Who may hold a block of a model now, and what the planner knows of each.

The active, connected nodes of the model's share (every active node when one model is served) of
the standing its catalog entry asks for, less those busy with another model's block and those whose
last blocks of it all failed; each with its credible speed (``nodes.capacity``), the layers it
can hold (``shares.layer_cap``) and the failures per hour expected of it (``loss_rate``).
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.utils import timezone

from marketplace.catalog.selectors import min_reputation
from marketplace.nodes.capacity import assess
from marketplace.nodes.models import Node, NodeState
from marketplace.placement import shares
from marketplace.placement.allocation import NodeCapacity
from marketplace.placement.blocks import joined_id
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState
from marketplace.placement.selectors import share_of

log = logging.getLogger("swarm.placement")


def candidates(model: str, *, lock: bool) -> tuple[list[Node], list[NodeCapacity]]:
    """The nodes a placement of ``model`` may use now, and what the planner knows of each: the
    active nodes of its share (every active node when one model is served)."""
    # An agent serves one model at a time: a node holding a live block of another model is not
    # available to this one until that block is released (a node moving between shares is handed
    # over make before break, see ``release_leaving``).
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
    now = timezone.now()
    capacities = [
        NodeCapacity(
            node=joined_id(n),
            compute=credence.speeds[joined_id(n)],
            max_layers=caps[n.pk],
            reputation=n.reputation,
            in_doubt=n.node_id in credence.in_doubt,
            loss_rate=loss_rate(n, now),
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


def loss_rate(node: Node, now: datetime) -> float:
    """Failures per hour expected of ``node``: the failures attributed to it since it was added
    (``failures_total``, one per incident: ``verification.failures``) over the hours it spent
    heartbeating (``online_s``: it can fail a job only while up), smoothed by a prior of
    SWARM_LOSS_PRIOR_FAILURES failures in SWARM_LOSS_PRIOR_HOURS hours, so that a new node is
    neither spotless nor condemned by one early failure; and SWARM_LOSS_DISTRESS_FACTOR times that
    while a coordinator's report suspects it (no heartbeat since) or its last failure keeps it off
    routing (``routing_backoff_until``), when losing it is likeliest:

        rate = (failures_total + PRIOR_FAILURES) / (online_s / 3600 + PRIOR_HOURS)  [* DISTRESS_FACTOR]

    A new node under the defaults (1 in 24 h, 4x) has 1/24 a hour (``allocation.UNKNOWN_LOSS_RATE``);
    one with 5 failures in 100 h online 6/124, about 0.048; suspected, four times that."""
    rate = (node.failures_total + settings.SWARM_LOSS_PRIOR_FAILURES) / (
        node.online_s / 3600.0 + settings.SWARM_LOSS_PRIOR_HOURS
    )
    backed_off = node.routing_backoff_until is not None and node.routing_backoff_until > now
    if node.suspected_at is not None or backed_off:
        rate *= settings.SWARM_LOSS_DISTRESS_FACTOR
    return rate


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
