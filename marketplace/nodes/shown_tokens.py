"""The join token a provider was shown on the dashboard, kept until they dismiss it.

A node's token is stored only as its sha256 (``joining.create_node``), so the command that holds
it can be shown once. On the dashboard, once means "until the provider says they are done with
it": a form error elsewhere on the page, a reload or a visit to the node's own page must not lose
it. The token is kept here, in the cache (Redis in production, shared by every web process), per
node, no longer than the token lives, and never logged. It is shown only while it is the node's
token (waiting for its agent) or the one its agent joined with (used); a token replaced through
the API, or expired, is dropped on the next look.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from django.core.cache import cache
from django.utils import timezone

from marketplace.nodes.models import Node


@dataclass(frozen=True)
class ShownToken:
    token: str
    used: bool  # the node's agent joined with it: the command now only reinstalls and reconnects


def _key(node_pk: int) -> str:
    return f"join-token-shown:{node_pk}"


def keep(node: Node, token: str) -> None:
    """Keep the node's new token for its owner's pages, as long as the token is valid."""
    expires = node.join_token_expires_at
    ttl = (expires - timezone.now()).total_seconds() if expires is not None else 0
    if ttl >= 1:
        cache.set(_key(node.pk), token, timeout=int(ttl))


def shown(node: Node) -> ShownToken | None:
    """The token kept for the node, while it is still its token or the one its agent joined with."""
    token = cache.get(_key(node.pk))
    if not token:
        return None
    digest = hashlib.sha256(token.encode()).hexdigest()
    expires = node.join_token_expires_at
    if digest == node.join_token_hash and expires is not None and expires > timezone.now():
        return ShownToken(token, used=False)
    if digest == node.used_join_token_hash:
        return ShownToken(token, used=True)
    forget(node)
    return None


def forget(node: Node) -> None:
    """The provider dismissed the command (or removed the node): it is not shown again."""
    cache.delete(_key(node.pk))
