"""Admins' marks of trust on nodes: vetted hardware and operators that a customer may require to be
the only ones to see its requests (``Privacy``). A mark records who set it, when and why; it is set
and cleared only here, by staff, with a reason. Placement's ``set_trusted`` is the verb callers use:
it also re-plans the node's models, so that trusted nodes can form a pipeline of their own."""

from __future__ import annotations

import logging

from django.utils import timezone

from marketplace.nodes.errors import NodeNotAllowed, TrustMarkRefused
from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node, NodeState

log = logging.getLogger("swarm.nodes")

MAX_REASON_CHARS = 500


def _checked_reason(reason: str) -> str:
    reason = (reason or "").strip()
    if not reason:
        raise TrustMarkRefused("A reason is required (what was vetted, and how).")
    if len(reason) > MAX_REASON_CHARS:
        raise TrustMarkRefused(f"The reason is {len(reason)} characters long; at most {MAX_REASON_CHARS}.")
    return reason


def mark_trusted(node: Node, *, by, reason: str) -> bool:
    """Mark ``node`` trusted by the admin ``by`` for ``reason``; True when it changed (a node already
    trusted keeps its first mark). An ejected or deleted node cannot be marked."""
    if by is None or not by.is_staff:
        raise NodeNotAllowed("only admins mark nodes trusted")
    reason = _checked_reason(reason)
    changed = (
        Node.objects.filter(pk=node.pk, trusted_at__isnull=True)
        .exclude(state__in=[NodeState.EJECTED, NodeState.DELETED])
        .update(trusted_at=timezone.now(), trusted_reason=reason, trusted_by=by)
    )
    if not changed:
        node.refresh_from_db()
        if node.state in (NodeState.EJECTED, NodeState.DELETED):
            raise TrustMarkRefused(f"Node {node.name!r} is {node.state}: it cannot be marked trusted.")
        return False
    log.info("node %s marked trusted by %s: %s", node.node_id, by.get_username(), reason)
    notify_node_changed(node.pk)
    return True


def clear_trusted(node: Node, *, by, reason: str) -> bool:
    """Take ``node``'s trust mark away (the admin ``by``, for ``reason``); True when it changed."""
    if by is None or not by.is_staff:
        raise NodeNotAllowed("only admins clear trust marks")
    reason = _checked_reason(reason)
    if not Node.objects.filter(pk=node.pk, trusted_at__isnull=False).update(
        trusted_at=None, trusted_reason="", trusted_by=None
    ):
        return False
    log.warning("node %s no longer trusted (%s): %s", node.node_id, by.get_username(), reason)
    notify_node_changed(node.pk)
    return True
