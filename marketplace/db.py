"""Database connection hygiene for async code: the call that hands a thread's connections back, a
wrapper that makes it after one call, and the view decorator that makes it on every way out of an
async view."""

from __future__ import annotations

import functools

from asgiref.sync import sync_to_async
from django.db import connections


def release_connections() -> None:
    """Hand this thread's database connections back (to the pool), unless a transaction is open.

    Async views and job runners run their ORM calls in worker threads; Django's end-of-request
    cleanup runs in another thread and would leave those connections checked out of the pool.
    """
    for connection in connections.all(initialized_only=True):
        if not connection.in_atomic_block:
            connection.close()


def releasing(fn):
    """``fn``, then this thread's database connections handed back (``release_connections``), however
    it ends: for a call an async view makes in a worker thread, after which the request holds none."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            release_connections()

    return wrapped


def releases_db(view):
    """Async views run their ORM calls in a thread of the request's; Django's end-of-request
    cleanup runs elsewhere and would leave that thread's connection checked out of the pool, so
    close it here, on every way out."""

    @functools.wraps(view)
    async def wrapped(request, *args, **kwargs):
        try:
            return await view(request, *args, **kwargs)
        finally:
            await sync_to_async(release_connections)()

    return wrapped
