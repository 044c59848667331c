"""Prefix reuse on the control plane: each account's salt, and which route served its prefixes lately.

Stages keep the KV of finished requests under keys their coordinator computes from the tokens
(``worker_agent/protocol/prefix.py``), salted per customer account: ``prefix_salt`` is an HMAC of
the server's SECRET_KEY and the account id, so no account can compute, and so time, another's keys.
The coordinator gets the salt with its job's inputs (``coordinator_inputs.generation_request``).

KV locality: a finished job's route is remembered under the keys of its longest prefixes
(``remember_route``, ROUTE_KEYS of them, each expiring after SWARM_PREFIX_ROUTE_TTL_S in the
cache); admission looks the new prompt's keys up (``remembered_route``, the longest first) and
routing prefers that route within a margin of the fastest (``placement.selectors.route_request``).
"""

from __future__ import annotations

from collections.abc import Sequence

from django.conf import settings
from django.core.cache import cache
from django.utils.crypto import salted_hmac

from worker_agent import model as models
from worker_agent.protocol.prefix import keep_keys, offer_keys

ROUTE_KEYS = 4  # the longest prefixes of a finished job its route is remembered under
_CACHE_PREFIX = "swarm:prefix-route:"

RouteStages = list[tuple[str, int, int]]  # (node, layer_start, layer_end) per stage, in route order


def prefix_salt(account_id: int) -> bytes | None:
    """The account's prefix salt (32 bytes); None while prefix reuse is off (SWARM_PREFIX_REUSE)."""
    if not settings.SWARM_PREFIX_REUSE:
        return None
    return salted_hmac("swarm.prefix-salt", str(account_id), algorithm="sha256").digest()


def remember_route(account_id: int, model: str, tokens: Sequence[int], route: Sequence[dict]) -> None:
    """A job of the account ran ``tokens`` (prompt and answer) on ``route`` (its stored stages):
    a later request starting with their prefixes is best served there."""
    salt = prefix_salt(account_id)
    if salt is None or not settings.SWARM_PREFIX_ROUTE_TTL_S:
        return
    # The answer's last token was never sent through the stages: they hold one position less.
    keys = keep_keys(salt, models.model_name(model), tokens, len(tokens) - 1)[-ROUTE_KEYS:]
    stages = [[stage["node"], stage["layer_start"], stage["layer_end"]] for stage in route]
    cache.set_many({_CACHE_PREFIX + key.key.hex(): stages for key in keys}, settings.SWARM_PREFIX_ROUTE_TTL_S)


def remembered_route(account_id: int, model: str, prompt: Sequence[int]) -> RouteStages | None:
    """The route that served the longest prefix of ``prompt`` the account sent lately, if any."""
    salt = prefix_salt(account_id)
    if salt is None:
        return None
    keys = [_CACHE_PREFIX + key.key.hex() for key in offer_keys(salt, models.model_name(model), prompt)]
    found = cache.get_many(keys)
    for name in reversed(keys):
        if name in found:
            return [(node, start, end) for node, start, end in found[name]]
    return None
