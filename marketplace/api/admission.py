"""Admission under load: one admission at a time per model in this process, and a queue for
requests that find every route of their model full.

Each admission (``jobs.services.admit_jobs``) locks its model's placement row until it commits,
so that it counts the jobs admitted before it. Requests of a burst therefore take their turn here,
on an asyncio lock, rather than in the database; and a request waiting its turn has handed its
pooled connection back: a queue of admissions must not hold the process's connections, which the
agents' heartbeats need too (a pool held by waiters took every node offline in a burst of 200).

A request whose model's every route already carries as many jobs as its stages hold
(``Overloaded``) waits for one of this process's streams to end (``job_ended``), or at most its
poll interval (jobs of the other web processes end too), and asks again, up to
SWARM_QUEUE_WAIT_S; then it answers 503 ``overloaded`` with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import weakref
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.conf import settings

from marketplace.db import release_connections
from marketplace.jobs import services
from marketplace.jobs.errors import NoCapacity, Overloaded
from marketplace.jobs.models import Job
from marketplace.placement.selectors import recovering

ADMISSION_POLL_S = 0.25  # how often a request waiting for a recovering model's route asks again
QUEUE_POLL_S = (0.05, 1.0)  # a queued request's longest wait between two asks: from 50 ms, doubling to 1 s


@dataclass
class _Gate:
    """This event loop's admission state: a lock per model, and a signal that some stream ended."""

    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Gate] = weakref.WeakKeyDictionary()


def _gate() -> _Gate:
    loop = asyncio.get_running_loop()
    if loop not in _gates:
        _gates[loop] = _Gate()
    return _gates[loop]


def job_ended() -> None:
    """A stream of this process saw its job end: its sessions are free, the queue may ask again."""
    gate = _gate()
    gate.ended.set()
    gate.ended = asyncio.Event()  # the next waiters wait for the next end


def _admit_jobs(**job) -> list[Job]:
    try:
        return services.admit_jobs(**job)
    finally:
        release_connections()


async def admit(**job) -> list[Job]:
    """Admit the request's jobs (``services.admit_jobs``' arguments). When its model has no ready
    route but is recovering (a node died and its span is being healed, re-placed or reloaded),
    wait up to SWARM_ADMISSION_WAIT_S for one before answering 503: churn in the swarm is normal
    and a client should not see it. When every route is full, queue (see the module docstring)."""
    gate = _gate()
    lock = gate.locks.setdefault(job["model"], asyncio.Lock())
    now = time.monotonic()
    deadline, queue_deadline = now + settings.SWARM_ADMISSION_WAIT_S, now + settings.SWARM_QUEUE_WAIT_S
    poll = QUEUE_POLL_S[0]
    await sync_to_async(release_connections)()  # the key's lookup took one: not held while waiting
    while True:
        ended = gate.ended
        try:
            try:  # the turn itself is waited for no longer than the queue allows
                async with asyncio.timeout(max(queue_deadline - time.monotonic(), 0.01)):
                    await lock.acquire()
            except TimeoutError:
                raise Overloaded(
                    f"Model {job['model']!r} has more requests waiting than it can admit; retry shortly.",
                    retry_after=services.OVERLOADED_RETRY_AFTER_S,
                ) from None
            try:
                return await sync_to_async(_admit_jobs)(**job)
            finally:
                lock.release()
        except Overloaded:
            if time.monotonic() >= queue_deadline:
                raise
            with contextlib.suppress(TimeoutError):  # jittered, so the queued do not all ask in step
                await asyncio.wait_for(ended.wait(), poll * random.uniform(0.5, 1.0))
            poll = min(2 * poll, QUEUE_POLL_S[1])
        except NoCapacity:
            if time.monotonic() >= deadline or not await sync_to_async(recovering)(job["model"]):
                raise
            await asyncio.sleep(ADMISSION_POLL_S)
