"""Database connection hygiene for async code."""

from __future__ import annotations

from django.db import connections


def release_connections() -> None:
    """Hand this thread's database connections back (to the pool), unless a transaction is open.

    Async views and job runners run their ORM calls in worker threads; Django's end-of-request
    cleanup runs in another thread and would leave those connections checked out of the pool.
    """
    for connection in connections.all(initialized_only=True):
        if not connection.in_atomic_block:
            connection.close()
