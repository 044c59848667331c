"""Node changes that move the swarm's blocks: join, connect, heartbeat, measured speed, silence,
drain, eject, trust, delete.

The node registry records each change (``nodes.services``); placement releases the node's blocks
where it must and asks for a new placement once the change commits (``rebalancing.mark_dirty``).
These are the verbs the edges and the other apps call.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.nodes import joining, trust_marks
from marketplace.nodes import services as nodes
from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.reachability import relay_at
from marketplace.nodes.services import push
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState
from marketplace.placement.rebalancing import mark_dirty, placement_changed, replacement_pays
from worker_agent.protocol import control_protocol as protocol

log = logging.getLogger("swarm.placement")


@transaction.atomic
def release_node(node_pk: int) -> int:
    now = timezone.now()
    released = Assignment.objects.filter(node_id=node_pk, state__in=LIVE_STATES).update(
        state=AssignmentState.RELEASED, released_at=now
    )
    if released:
        notify_node_changed(node_pk)
    return released


@transaction.atomic
def register_agent(**join) -> Node:
    """An agent joins with a node's token (``nodes.joining.register_agent`` checks it). A node that
    joins again is a new agent process: the blocks its previous agent held are gone with it, so they
    are released and the model placed again; nothing routes to them meanwhile."""
    node = joining.register_agent(**join)
    if release_node(node.pk):
        placement_changed()
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
        placement_changed()
    return node


@transaction.atomic
def record_heartbeat(node_pk: int, load: dict, now: datetime | None = None) -> None:
    """A heartbeat: its load is recorded; a node it brings back from offline is placed again. One
    whose agent reports it is stopping (state ``leaving``) is taken off routing at once, in the
    same transaction (``nodes.services.mark_leaving``)."""
    if nodes.apply_heartbeat(node_pk, load, now=now):
        placement_changed()
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
def relay_lost(address: str, reason: str) -> list[str]:
    """A job's coordinator found the relay at ``address`` (``host:port``) down: every block served
    through it is to be confirmed again before a request is routed to it (ready -> assigned), as
    after a reconnect, until its agent reports it at its next relay's URL (``readiness``); nothing
    is counted against the nodes. Returns their ids."""
    served = Assignment.objects.select_for_update().filter(
        state=AssignmentState.READY, data_url__contains=f"//{address}"
    )
    moved = [a for a in served.select_related("node") if (relay := relay_at(a.data_url)) and relay.address == address]
    Assignment.objects.filter(pk__in=[a.pk for a in moved]).update(state=AssignmentState.ASSIGNED)
    for assignment in moved:
        notify_node_changed(assignment.node_id)
    nodes_behind = sorted({a.node.node_id or "" for a in moved})
    log.warning(
        "relay at %s is down (%s): the blocks of %s are off routing until their agents report them through another",
        address,
        reason,
        ", ".join(nodes_behind) or "no node",
    )
    return nodes_behind


@transaction.atomic
def record_measured_speed(node_pk: int, layer_tokens_per_s: float) -> bool:
    """A speed a passed challenge proved (``nodes.services.record_verified_speed``). A node's first
    proof makes its speed count where a claim in doubt counted for nothing (``nodes.capacity``),
    and a better one lifts its cap: its model is placed again when a fresh plan over the credible
    speeds now serves SWARM_REPLACE_MARGIN more tokens/s (``replacement_pays``). True when it is."""
    if not nodes.record_verified_speed(node_pk, layer_tokens_per_s):
        return False
    model = Assignment.objects.filter(node_id=node_pk, state__in=LIVE_STATES).values_list("model", flat=True).first()
    if model is None:
        return False
    live = list(Assignment.objects.filter(model=model, state__in=LIVE_STATES, is_spare=False).select_related("node"))
    if not live or not replacement_pays(model, live):
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
        placement_changed()
    return gone


@transaction.atomic
def drain_node(node: Node) -> Node:
    """The node takes no new work; placement is redone without it."""
    if nodes.mark_draining(node):
        placement_changed()
    node.refresh_from_db()
    return node


@transaction.atomic
def eject_node(node: Node, *, reason: str, by=None) -> Node:
    """Remove a node from the swarm (upheld strikes past the threshold, or an admin): its blocks are
    released, its agent is told to stop, and it cannot come back by itself."""
    if nodes.mark_ejected(node, reason=reason, by=by):
        release_node(node.pk)
        placement_changed()
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
            placement_changed()
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
    placement_changed()
