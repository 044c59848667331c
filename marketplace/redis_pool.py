"""The cache on Redis with one connection pool and one client per process (``CACHES``' backend).

Django makes a cache client per asyncio context, and an async view's ORM and cache calls run in
a thread of their request's. With Django's own backend each of those opened its own pool, so
every request opened a new connection to Redis (its handshake, and redis-py's lookup of its own
version in the package metadata: 2 to 5 ms on the path to a first token), and every cache call
built a new ``redis.Redis`` (its table of reply callbacks). Here every cache client of the process
draws from one pool per URL and options, through one ``redis.Redis`` per pool: both are
thread-safe, and redis-py's pool starts over in a forked child.
"""

from __future__ import annotations

import threading

import redis
from django.core.cache.backends import redis as django_redis

_pools: dict[tuple, redis.ConnectionPool] = {}
_clients: dict[redis.ConnectionPool, redis.Redis] = {}
_lock = threading.Lock()


class SharedConnectionPool(redis.ConnectionPool):
    @classmethod
    def from_url(cls, url: str, **options) -> redis.ConnectionPool:  # type: ignore[override]
        key = (url, tuple(sorted((name, repr(value)) for name, value in options.items())))
        with _lock:
            if key not in _pools:
                _pools[key] = redis.ConnectionPool.from_url(url, **options)
            return _pools[key]


class _Client(django_redis.RedisCacheClient):
    def __init__(self, servers, **options) -> None:
        options.setdefault("pool_class", SharedConnectionPool)
        super().__init__(servers, **options)

    def get_client(self, key=None, *, write: bool = False) -> redis.Redis:
        pool = self._get_connection_pool(write)  # type: ignore[attr-defined]
        with _lock:
            if pool not in _clients:
                _clients[pool] = self._client(connection_pool=pool)  # type: ignore[attr-defined]
            return _clients[pool]


class RedisCache(django_redis.RedisCache):
    def __init__(self, server, params) -> None:
        super().__init__(server, params)
        self._class = _Client  # Django's sets its own client class here

    def redis_client(self) -> redis.Redis:
        """The process's client of the cache's Redis (for what the cache API cannot say in one round trip)."""
        return self._cache.get_client(write=True)
