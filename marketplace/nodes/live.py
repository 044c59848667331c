"""Live dashboard updates: tell the browsers that may show a node that it changed.

A producer (a service that changed a node's state, load, assignments or reputation) calls
``notify_node_changed(node_pk)`` from synchronous code, inside its transaction or not. The notice
goes out on the channel layer once the transaction commits, so a page never fetches a state that
the database does not hold yet, and a rolled-back change notifies nobody. It reaches the node's
owner and the admins (``DashboardConsumer``); their pages fetch the fragments that show the node,
through the same views (and permission checks) as a page load. ``notify_admins(topic)`` does the
same for what only admins see (``strike``: the strike queue).
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from marketplace.nodes.models import Node

log = logging.getLogger("swarm.web")

ADMIN_GROUP = "dashboard.admin"


def user_group(user_pk: int) -> str:
    """The channel-layer group of one user's open dashboard pages."""
    return f"dashboard.user.{user_pk}"


def notify_node_changed(node_pk: int) -> None:
    """Tell the node's owner and the admins that the node changed, once the transaction commits.

    The owner is looked up now, so a node deleted in the same transaction still reaches its owner's
    pages (which then drop it). A failure to notify is logged and never fails the caller.
    """
    owner_pk = Node.objects.filter(pk=node_pk).values_list("owner_id", flat=True).first()
    groups = [ADMIN_GROUP] if owner_pk is None else [user_group(owner_pk), ADMIN_GROUP]
    _send_on_commit(groups, {"type": "dashboard.event", "topic": "node", "node": node_pk})


def notify_admins(topic: str) -> None:
    """Tell the admins' pages that something under ``topic`` changed (``strike``: one opened or was
    decided), once the transaction commits; their pages refetch what they show of it."""
    _send_on_commit([ADMIN_GROUP], {"type": "dashboard.event", "topic": topic, "node": None})


def _send_on_commit(groups: list[str], event: dict) -> None:
    def send() -> None:
        layer = get_channel_layer()
        if layer is None:
            return

        async def to_all() -> None:  # one event loop, and one connection to the layer, for all of them
            for group in groups:
                await layer.group_send(group, event)

        async_to_sync(to_all)()

    transaction.on_commit(send, robust=True)
