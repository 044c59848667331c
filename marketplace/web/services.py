"""The dashboards' own small use cases, built on the other apps' services."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import transaction

from marketplace.jobs.models import ApiKey
from marketplace.jobs.services import create_playground_key, mark_used
from marketplace.nodes import joining, shown_tokens
from marketplace.nodes.models import Node
from marketplace.placement import lifecycle
from marketplace.web.selectors import playground_key


@transaction.atomic
def ensure_playground_key(user) -> ApiKey:
    """The customer's playground key, created on first use (and again after they revoke it).

    The playground calls the API on the customer's behalf with the key's row, never its secret,
    so the plaintext that creation returns is dropped: nobody can use this key from outside.
    The user's row is locked so that two first requests at once create one key.
    """
    get_user_model().objects.select_for_update().filter(pk=user.pk).first()
    found = playground_key(user)
    if found is None:
        found, _ = create_playground_key(user)
    mark_used(found)  # as the API marks a key a client sends: its row says when the playground last ran
    return found


def add_node(*, owner, name: str, region: str, max_layers: int | None = None) -> Node:
    """Add a node; its join command stays on its owner's pages until they dismiss it."""
    node, token = joining.create_node(owner=owner, name=name, region=region, max_layers=max_layers)
    shown_tokens.keep(node, token)
    return node


def new_join_token(node: Node) -> None:
    """Replace the node's join token (the old one stops working); the new command is shown until dismissed."""
    token = joining.rotate_join_token(node)
    node.refresh_from_db(fields=["join_token_hash", "join_token_expires_at"])
    shown_tokens.keep(node, token)


def dismiss_join_command(node: Node) -> None:
    shown_tokens.forget(node)


def remove_node(node: Node) -> None:
    """The owner removes a node: its agent is told to stop, its blocks are released and the swarm
    re-placed without it; a node that served keeps its row, so its jobs settle and its earnings,
    payouts and strikes stay on record (``placement.lifecycle.delete_node``)."""
    lifecycle.delete_node(node)
    shown_tokens.forget(node)
