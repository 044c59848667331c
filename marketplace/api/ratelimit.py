"""Per-key request and token rate limits in fixed one-minute windows, kept in the cache (Redis in
production, so every web process shares them)."""

from __future__ import annotations

import time

from django.core.cache import cache, caches

from marketplace.jobs.errors import RateLimited
from marketplace.jobs.models import ApiKey

WINDOW_S = 60


def _add(amounts: dict[str, int]) -> list[int]:
    """Add each amount to its counter (made when missing, kept two windows) and return the totals:
    on Redis in one round trip, each counter atomically; in the embedded default's in-process cache
    through the cache's own calls."""
    backend = caches["default"]
    if hasattr(backend, "redis_client"):  # marketplace.redis_pool.RedisCache
        pipe = backend.redis_client().pipeline(transaction=False)
        for key, amount in amounts.items():
            full = backend.make_and_validate_key(key)  # what the cache's own calls name it, as tests reset it
            pipe.incrby(full, amount)
            pipe.expire(full, WINDOW_S * 2)
        return [int(total) for total in pipe.execute()[::2]]
    totals = []
    for key, amount in amounts.items():
        cache.add(key, 0, timeout=WINDOW_S * 2)
        totals.append(cache.incr(key, amount))
    return totals


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
    used_requests, used_tokens = _add({requests_key: 1, tokens_key: tokens})
    over_requests = used_requests > api_key.requests_per_minute
    over_tokens = used_tokens > api_key.tokens_per_minute
    if over_requests or over_tokens:  # a refused request is not counted
        used_requests, used_tokens = _add({requests_key: -1, tokens_key: -tokens})
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
