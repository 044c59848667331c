"""Node registry use cases for a joined node: connect, heartbeat, suspicion, reachability, links,
drain, eject, delete, reinstate; and ``push``, a control message to a node's agent.

Agents talk to these through the control channel; providers and admins through the API and the
dashboards; joining is ``joining``. Every state change is an atomic, conditional write; messages to
agents go out on commit. Changes that also move the swarm's blocks (a node connecting, coming back,
going silent, draining, ejected or deleted) are placement's verbs (``marketplace.placement.lifecycle``),
which call these.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from marketplace.nodes.errors import InvalidReport, NodeNotAllowed
from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import LinkMeasurement, Node, NodeState, Reachability
from marketplace.nodes.reachability import relay_of, relay_offer
from marketplace.nodes.reports import number
from worker_agent.protocol import control_protocol as protocol

log = logging.getLogger("swarm.nodes")

SPEED_SMOOTHING = 0.3  # weight of the newest measured speed in the node's running estimate


def node_group(node_id: str) -> str:
    """The channel-layer group of a node's control channel."""
    return f"node.{node_id}"


def push(node_id: str, message: dict) -> None:
    """Send a control message to a node's agent once the current transaction commits."""

    def send() -> None:
        layer = get_channel_layer()
        if layer is not None:
            async_to_sync(layer.group_send)(node_group(node_id), {"type": "control.push", "message": message})

    transaction.on_commit(send)


@transaction.atomic
def mark_connected(node_pk: int) -> tuple[Node, bool]:
    """The control channel is up: a pending or offline node becomes active, and a suspect one is
    cleared (its agent is alive and answered the handshake). Returns the node and whether it came
    online (placement's ``node_connected``, the verb callers use, re-places then)."""
    now = timezone.now()
    Node.objects.filter(pk=node_pk).update(
        connected=True, last_heartbeat_at=now, connected_since=now, suspected_at=None, suspicion=""
    )
    came_online = bool(
        Node.objects.filter(pk=node_pk, state__in=[NodeState.PENDING, NodeState.OFFLINE]).update(state=NodeState.ACTIVE)
    )
    node = Node.objects.get(pk=node_pk)
    notify_node_changed(node_pk)
    return node, came_online


def node_disconnected(node_pk: int, connected_at) -> None:
    """A channel opened at ``connected_at`` closed: the node becomes suspect at once (no new request
    is routed to it: its process may have died), and stays otherwise as it is until its heartbeats
    time out or it reconnects. A newer channel (the agent reconnected first) keeps it connected."""
    now = timezone.now()
    if Node.objects.filter(pk=node_pk, connected_since__lte=connected_at).update(connected=False):
        Node.objects.filter(
            pk=node_pk, state__in=[NodeState.ACTIVE, NodeState.DRAINING], suspected_at__isnull=True
        ).update(suspected_at=now, suspicion="its control channel closed")
        notify_node_changed(node_pk)


def record_reachability(node_pk: int, data_url: str, problem: str | None) -> protocol.UseRelay | None:
    """What the control plane found when it opened the data URL the node's agent reported
    (``reachability.reach``: ``problem`` None when it answered). An unreachable node's owner reads
    why on its page and in its agent's log; the agent gets the relays it may serve through
    (``reachability.relay_offer``), None when there are none."""
    node = Node.objects.only("node_id", "public_key").get(pk=node_pk)
    relay = relay_of(data_url, node.node_id or "")
    if problem is None:
        state = Reachability.RELAYED if relay is not None else Reachability.DIRECT
        detail = f"reached through relay {relay.id} at {data_url}" if relay is not None else f"reached at {data_url}"
    else:
        state, detail = Reachability.UNREACHABLE, problem
    Node.objects.filter(pk=node_pk).update(
        reachability=state,
        reachability_detail=detail[:2000],
        relay=relay.id if relay is not None and problem is None else "",
        reachability_checked_at=timezone.now(),
        # Where its links are measured from now on (probes name the node's URL).
        **({"data_url": data_url[:255]} if problem is None else {}),
    )
    notify_node_changed(node_pk)
    if problem is None:
        log.info("node %s %s", node.node_id, detail)
        return None
    log.warning("node %s is unreachable: %s", node.node_id, problem)
    return relay_offer(node.node_id or "", node.public_key or "", problem)


def mark_suspected(node_id: str, reason: str, now: datetime | None = None) -> bool:
    """A job's coordinator reports the node failed: it is suspect from ``now`` on (placement routes
    nothing to it). False when no active or draining node has that id."""
    updated = Node.objects.filter(node_id=node_id, state__in=[NodeState.ACTIVE, NodeState.DRAINING]).update(
        suspected_at=now or timezone.now(), suspicion=str(reason)[:255]
    )
    if updated:
        pk = Node.objects.only("pk").get(node_id=node_id).pk
        log.warning("node %s reported failed: %s", node_id, reason)
        notify_node_changed(pk)
    return bool(updated)


def _clears_suspicion(suspected_at: datetime | None, now: datetime) -> bool:
    """A heartbeat received more than one heartbeat interval after a failure report was sent after
    it: the node lives (it froze briefly, or only the coordinator's link to it failed). One that
    arrives sooner may have left before the failure, and proves nothing."""
    return suspected_at is not None and (now - suspected_at).total_seconds() > settings.SWARM_HEARTBEAT_INTERVAL_S


@transaction.atomic
def apply_heartbeat(node_pk: int, load: dict, now: datetime | None = None) -> bool:
    """Record a heartbeat's load, received at ``now``; True when it brought an offline node back
    (placement's ``record_heartbeat`` then asks for a new placement). A heartbeat clearly sent after
    a failure report clears the node's suspicion."""
    if not isinstance(load, dict):
        raise InvalidReport("load must be an object")
    clean: dict[str, Any] = {}  # numbers, and the model and state as text
    for key in ("sessions", "tokens_served", "uptime_s", "queue", "layer_ms"):
        if key in load:
            clean[key] = number(load, key)
    for key in ("model", "state"):
        if key in load:
            clean[key] = str(load[key])[:64]
    now = now or timezone.now()
    node = Node.objects.only("compute_layer_tokens_per_s", "last_heartbeat_at", "suspected_at").get(pk=node_pk)
    updates = {"last_heartbeat_at": now, "load": clean, "connected": True}
    if _clears_suspicion(node.suspected_at, now):
        updates |= {"suspected_at": None, "suspicion": ""}
        log.info("node %s heartbeats after its failure report: no longer suspect", node_pk)
    if node.last_heartbeat_at is not None:
        # Uptime: the time since the previous heartbeat counts as online, up to two intervals
        # (a longer gap means the node was away for the rest of it).
        gap = (now - node.last_heartbeat_at).total_seconds()
        updates["online_s"] = F("online_s") + max(0.0, min(gap, 2 * settings.SWARM_HEARTBEAT_INTERVAL_S))
    if clean.get("layer_ms"):
        # The measured speed under real traffic replaces the join-time benchmark, smoothed.
        measured = 1000.0 / clean["layer_ms"]
        updates["compute_layer_tokens_per_s"] = SPEED_SMOOTHING * measured + (1 - SPEED_SMOOTHING) * (
            node.compute_layer_tokens_per_s or measured
        )
    Node.objects.filter(pk=node_pk).update(**updates)
    back = bool(Node.objects.filter(pk=node_pk, state=NodeState.OFFLINE).update(state=NodeState.ACTIVE))
    notify_node_changed(node_pk)
    return back


def clamp_positions(node_pk: int, positions: int) -> bool:
    """The node's stage refused a session for its length: it holds at most ``positions`` positions
    per session, whatever it reported (``max_positions``, which admission lets requests use). True
    when its report was higher; it stands until its agent joins again."""
    clamped = Node.objects.filter(pk=node_pk, max_positions__gt=positions).update(max_positions=max(positions, 1))
    if clamped:
        notify_node_changed(node_pk)
    return bool(clamped)


def record_verified_memory(node_pk: int, memory_bytes: int) -> bool:
    """Memory a passed memory challenge proved the node holds; its best figure is kept. True when it
    is its best so far."""
    if memory_bytes < 1:
        return False
    best = Q(verified_memory_bytes__isnull=True) | Q(verified_memory_bytes__lt=memory_bytes)
    return bool(Node.objects.filter(best, pk=node_pk).update(verified_memory_bytes=memory_bytes))


def clamp_memory(node_pk: int, memory_bytes: int) -> bool:
    """A memory challenge showed the node has at most ``memory_bytes`` (it failed to hold what more
    would hold): its memory counts as no more (``memory_limit_bytes``), whatever it reported, until
    its agent joins again. True when that lowers what was believed."""
    lower = Q(memory_limit_bytes__isnull=True) | Q(memory_limit_bytes__gt=memory_bytes)
    clamped = Node.objects.filter(lower, pk=node_pk).update(memory_limit_bytes=max(memory_bytes, 0))
    if clamped:
        notify_node_changed(node_pk)
    return bool(clamped)


def mark_leaving(node_pk: int) -> bool:
    """The node's agent says it is stopping (SIGTERM, Ctrl-C), before it refuses any job: no
    request is routed to it from now on (placement routes only nodes whose control channel is up)
    and it gets no new block. Its agent is told it may stop taking jobs (a Drain, the answer it
    waits for). Its blocks stay assigned: a restarted agent confirms each one again. True when an
    active or draining node was marked."""
    if not Node.objects.filter(pk=node_pk, state__in=[NodeState.ACTIVE, NodeState.DRAINING]).update(connected=False):
        return False
    node_id = Node.objects.values_list("node_id", flat=True).get(pk=node_pk)
    assert node_id is not None  # an active or draining node has joined
    push(node_id, protocol.to_wire(protocol.Drain()))
    log.info("node %s is stopping: no new job is routed to it", node_id)
    notify_node_changed(node_pk)
    return True


def mark_draining(node: Node) -> bool:
    """An active or pending node takes no new work; its agent is told. True when it changed."""
    if not Node.objects.filter(pk=node.pk, state__in=[NodeState.ACTIVE, NodeState.PENDING]).update(
        state=NodeState.DRAINING
    ):
        return False
    if node.node_id:
        push(node.node_id, protocol.to_wire(protocol.Drain()))
    notify_node_changed(node.pk)
    return True


def mark_ejected(node: Node, *, reason: str, by=None) -> bool:
    """Mark a node ejected and tell its agent to stop; it cannot come back by itself. True when it changed.
    Placement's ``eject_node`` is the verb callers use: it also releases the node's blocks."""
    if by is not None and not by.is_staff:
        raise NodeNotAllowed("only admins eject nodes")
    if not (
        Node.objects.filter(pk=node.pk)
        .exclude(state__in=[NodeState.EJECTED, NodeState.DELETED])
        .update(state=NodeState.EJECTED, ejected_at=timezone.now(), ejection_reason=reason[:2000], connected=False)
    ):
        return False
    if node.node_id:
        push(node.node_id, protocol.to_wire(protocol.Stop(reason=f"ejected: {reason}"[: protocol.MAX_TEXT_CHARS])))
    log.warning("node %s ejected: %s", node.node_id, reason)
    notify_node_changed(node.pk)
    return True


def mark_deleted(node: Node) -> bool:
    """Soft-delete a node for its owner: it leaves every list of theirs and every placement and
    route, its agent cannot reconnect, and its join token stops working; the row stays for the
    jobs, earnings and strikes that name it. Placement's ``delete_node`` is the verb callers use.
    True when it changed."""
    if not Node.objects.filter(pk=node.pk, deleted_at__isnull=True).update(
        state=NodeState.DELETED,
        deleted_at=timezone.now(),
        connected=False,
        join_token_hash=None,
        join_token_expires_at=None,
    ):
        return False
    log.info("node %s deleted by its owner; kept for settlement", node.node_id)
    notify_node_changed(node.pk)
    return True


@transaction.atomic
def reinstate_node(node: Node, *, by) -> Node:
    """An admin lets an ejected node back: it rejoins as offline and becomes active when its agent
    reconnects (restarted by its owner)."""
    if by is None or not by.is_staff:
        raise NodeNotAllowed("only admins reinstate nodes")
    if Node.objects.filter(pk=node.pk, state=NodeState.EJECTED).update(
        state=NodeState.OFFLINE, ejected_at=None, ejection_reason=""
    ):
        notify_node_changed(node.pk)
    node.refresh_from_db()
    return node


@transaction.atomic
def record_links(node_pk: int, results: list) -> int:
    """Store the RTT/uplink an agent measured to the targets it can have been asked to probe:
    another node the control plane knows, or a configured coordinator region. Measurements of
    any other target are dropped, so a node holds at most one row per node and region (rows are
    upserted); returns how many were stored."""
    if not isinstance(results, list) or len(results) > protocol.MAX_ITEMS:
        raise InvalidReport(f"results must be a list of at most {protocol.MAX_ITEMS} measurements")
    parsed = []
    for result in results:
        if not isinstance(result, dict) or not isinstance(result.get("target"), str):
            raise InvalidReport("each measurement needs a target")
        parsed.append((result["target"], number(result, "rtt_ms"), number(result, "uplink_mbps", required=False)))
    regions = {f"region:{region}" for region in settings.SWARM_COORDINATOR_REGIONS}
    named = {target for target, _, _ in parsed if target not in regions}
    peers = set(Node.objects.filter(node_id__in=named).exclude(pk=node_pk).values_list("node_id", flat=True))
    now, stored = timezone.now(), 0
    for target, rtt, uplink in parsed:
        if target not in regions and target not in peers:
            continue
        before = LinkMeasurement.objects.filter(source_id=node_pk, target=target).first()
        lowest = rtt if before is None or before.lowest_rtt_ms is None else min(before.lowest_rtt_ms, rtt)
        LinkMeasurement.objects.update_or_create(
            source_id=node_pk,
            target=target,
            defaults={
                "rtt_ms": rtt,
                "lowest_rtt_ms": lowest,
                "samples": (before.samples if before is not None else 0) + 1,
                "uplink_mbps": uplink,
                "measured_at": now,
            },
        )
        stored += 1
        if uplink is not None and target in regions:
            Node.objects.filter(pk=node_pk).update(uplink_mbps=uplink)
    if stored < len(parsed):
        log.warning(
            "node %s: dropped %d measurements of targets it was never asked about", node_pk, len(parsed) - stored
        )
    return stored


def record_verified_speed(node_pk: int, layer_tokens_per_s: float) -> bool:
    """A speed the control plane measured itself (a passed challenge): the node's best one is kept.
    True when it is the node's best so far (its credible speed may have changed)."""
    if not (layer_tokens_per_s > 0):
        return False
    node = Node.objects.only("verified_layer_tokens_per_s").get(pk=node_pk)
    if node.verified_layer_tokens_per_s is None or layer_tokens_per_s > node.verified_layer_tokens_per_s:
        Node.objects.filter(pk=node_pk).update(verified_layer_tokens_per_s=layer_tokens_per_s)
        return True
    return False
