"""Per-key request and token rate limits in fixed one-minute windows, kept in the cache (Redis in
production, so every web process shares them)."""

from __future__ import annotations

import functools
import time

from django.core.cache import caches

from marketplace.jobs.errors import RateLimited
from marketplace.jobs.models import ApiKey

WINDOW_S = 60


@functools.cache
def _cache():
    """One cache client for the whole process. ``django.core.cache.cache`` is one per thread, and
    an async view's ORM and cache calls run in a thread per request: with Redis that is a new
    connection (and its handshake) per request."""
    return caches.create_connection("default")


def _incr(key: str, amount: int) -> int:
    _cache().add(key, 0, timeout=WINDOW_S * 2)
    return _cache().incr(key, amount)


def check(api_key: ApiKey, tokens: int, *, now: float | None = None) -> dict:
    """Count one request of ``tokens`` (prompt + max completion) against the key's limits.

    Returns the ``x-ratelimit-*`` headers; raises RateLimited (with them and Retry-After) when a
    limit would be passed, in which case the request is not counted.
    """
    now = time.time() if now is None else now
    window = int(now // WINDOW_S)
    reset = max(1, int((window + 1) * WINDOW_S - now))
    requests_key = f"rl:req:{api_key.pk}:{window}"
    tokens_key = f"rl:tok:{api_key.pk}:{window}"
    used_requests = _incr(requests_key, 1)
    used_tokens = _incr(tokens_key, tokens)
    over_requests = used_requests > api_key.requests_per_minute
    over_tokens = used_tokens > api_key.tokens_per_minute
    if over_requests or over_tokens:  # a refused request is not counted
        used_requests = _cache().decr(requests_key, 1)
        used_tokens = _cache().decr(tokens_key, tokens)
    headers = {
        "x-ratelimit-limit-requests": str(api_key.requests_per_minute),
        "x-ratelimit-remaining-requests": str(max(0, api_key.requests_per_minute - used_requests)),
        "x-ratelimit-reset-requests": f"{reset}s",
        "x-ratelimit-limit-tokens": str(api_key.tokens_per_minute),
        "x-ratelimit-remaining-tokens": str(max(0, api_key.tokens_per_minute - used_tokens)),
        "x-ratelimit-reset-tokens": f"{reset}s",
    }
    if over_requests or over_tokens:
        what = "requests" if over_requests else "tokens"
        limit = api_key.requests_per_minute if over_requests else api_key.tokens_per_minute
        raise RateLimited(
            f"Rate limit reached for {what} per minute (limit {limit}); retry in {reset}s.",
            retry_after=reset,
            headers=headers,
        )
    return headers
