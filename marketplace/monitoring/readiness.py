"""What ``/readyz`` checks: can this process reach the database, Redis and the Celery broker now?

Each check opens a fresh connection of its own (the database's pool would make a request wait up
to SWARM_DB_POOL_TIMEOUT_S for a connection while PostgreSQL is down) with a connect timeout of
SWARM_READYZ_TIMEOUT_S (Redis and the broker: a read timeout too), in a worker thread under a
deadline a second past it; the checks run at the same time. A dependency that is not configured
(Redis and the broker in the embedded default) is not checked.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
from collections.abc import Callable

import dj_database_url
import redis
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.utils import load_backend
from kombu import Connection as BrokerConnection

from marketplace.monitoring.collectors import broker_is_redis

log = logging.getLogger("swarm.readiness")

OK, FAILED = "ok", "failed"
LIBPQ_MIN_CONNECT_TIMEOUT_S = 2  # libpq counts whole seconds and takes anything below 2 as 2


def database_settings(timeout_s: float) -> dict:
    """The settings of the database to check (SWARM_READYZ_DATABASE_URL, or the app's own), for a
    single unpooled connection that gives up connecting after about ``timeout_s``."""
    url = settings.SWARM_READYZ_DATABASE_URL
    db = copy.deepcopy(dj_database_url.parse(url) if url else connections.settings[DEFAULT_DB_ALIAS])
    options = db.setdefault("OPTIONS", {})
    options.pop("pool", None)
    if db["ENGINE"] == "django.db.backends.postgresql":
        options["connect_timeout"] = max(LIBPQ_MIN_CONNECT_TIMEOUT_S, math.ceil(timeout_s))
    db["CONN_MAX_AGE"], db["CONN_HEALTH_CHECKS"] = 0, False
    return connections.configure_settings({DEFAULT_DB_ALIAS: db})[DEFAULT_DB_ALIAS]


def check_database(timeout_s: float) -> None:
    db = database_settings(timeout_s)
    connection = load_backend(db["ENGINE"]).DatabaseWrapper(db, "readyz")
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    finally:
        connection.close()


def check_redis(timeout_s: float) -> None:
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
    finally:
        client.close()


def check_broker(timeout_s: float) -> None:
    options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s} if broker_is_redis() else {}
    with BrokerConnection(settings.CELERY_BROKER_URL, connect_timeout=timeout_s, transport_options=options) as broker:
        broker.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=timeout_s)


def checks() -> dict[str, Callable[[float], None]]:
    """The checks that apply to this configuration, by name."""
    found: dict[str, Callable[[float], None]] = {"database": check_database}
    if settings.REDIS_URL:
        found["redis"] = check_redis
    if not settings.CELERY_BROKER_URL.startswith("memory://"):
        found["broker"] = check_broker
    return found


async def run_check(name: str, check: Callable[[float], None], timeout_s: float) -> str:
    """``ok`` or ``failed``; why it failed (refused, timed out, ...) is logged, not answered: it may
    name hosts and ports. The clients' own timeouts end a check first; the deadline, a second
    later, is the backstop for one that hangs anyway (its thread is left to end on its own)."""
    try:
        await asyncio.wait_for(asyncio.to_thread(check, timeout_s), max(timeout_s, LIBPQ_MIN_CONNECT_TIMEOUT_S) + 1)
    except TimeoutError:
        log.warning("readiness: %s did not answer in time", name)
        return FAILED
    except Exception as exc:  # whatever the client library raises: the dependency is not usable
        log.warning("readiness: %s failed: %s", name, exc)
        return FAILED
    return OK


async def readiness(timeout_s: float) -> dict[str, str]:
    """Each applicable check's outcome, run concurrently."""
    found = checks()
    outcomes = await asyncio.gather(*(run_check(name, check, timeout_s) for name, check in found.items()))
    return dict(zip(found, outcomes, strict=True))
