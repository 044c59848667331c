"""A request's prefix keys as its session's OPEN offers them and its CLOSE keeps them (prefix reuse,
``protocol/prefix.py``): nothing without the request's salt."""

from __future__ import annotations

from worker_agent.coordinator.session import GenerationRequest, GenerationState
from worker_agent.protocol.prefix import PrefixKey, keep_keys, offer_keys


def offer(
    request: GenerationRequest, session: str, model: str
) -> dict[str, tuple[tuple[int, ...], tuple[PrefixKey, ...]]] | None:
    """``Pipeline.open``'s prompts for a session beginning ``request``: its prompt and its prefixes' keys."""
    if request.prefix_salt is None:
        return None
    return {session: (request.prompt_ids, offer_keys(request.prefix_salt, model, request.prompt_ids))}


def keep(state: GenerationState, session: str, model: str) -> dict[str, tuple[PrefixKey, ...]] | None:
    """``Pipeline.close_by_stage``'s keep keys for a finished session: the prefixes of its committed
    tokens within the positions the stages computed from them."""
    salt = state.request.prefix_salt
    if salt is None:
        return None
    return {session: keep_keys(salt, model, state.committed, state.position)}
