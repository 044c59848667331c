"""The cache on Redis (``marketplace.redis_pool``): every cache client of a process shares one
connection, where Django's own backend opened one per request context; and the rate limit's
counters, added in one round trip, are the cache's own keys."""

from __future__ import annotations

import contextvars
import os
import uuid

import pytest
import redis
from django.core.cache.backends.redis import RedisCache as DjangoRedisCache

from marketplace.redis_pool import RedisCache

pytestmark = pytest.mark.api

REQUESTS = 12


def connections_named(name: str) -> int:
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    try:
        return sum(1 for entry in client.client_list() if entry.get("name") == name)
    finally:
        client.close()


def serve_requests(backend: type) -> int:
    """Each request context makes its own cache client, as Django's cache handler does per asyncio
    context, and uses it; returns how many connections to Redis they opened in all."""
    name = f"cache-test-{uuid.uuid4().hex[:12]}"
    kept = []  # the clients stay alive, as a busy process's requests overlap

    def request(index: int) -> None:
        cache = backend(os.environ["REDIS_URL"], {"OPTIONS": {"client_name": name}})
        cache.set(f"{name}:{index}", index)
        assert cache.get(f"{name}:{index}") == index
        kept.append(cache)

    for index in range(REQUESTS):
        contextvars.Context().run(request, index)
    return connections_named(name)


def test_every_request_shares_one_connection():
    assert serve_requests(RedisCache) == 1


def test_djangos_own_backend_opens_one_per_request():
    """What the shared pool is for (and the measure above can tell the difference)."""
    assert serve_requests(DjangoRedisCache) == REQUESTS
