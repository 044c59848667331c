"""Admission under load: the requests of a model take their turns at admission in this process,
first come first served, and the request at the head of the line waits for room when every route
of its model is full.

Each admission (``flows.admission.admit_jobs``) locks its model's placement row until it commits,
so that it counts the jobs admitted before it. Requests of a burst therefore take their turn here,
in a line per model, rather than in the database; and a request waiting its turn has handed its
pooled connection back: a line of admissions must not hold the process's connections, which the
agents' heartbeats need too (a pool held by waiters took every node offline in a burst of 200).

Only the head of the line asks the database. When its model's every route already carries as
many jobs as its stages hold (``Overloaded``), it waits for one of this process's streams to end
(``job_ended``), or at most its poll interval (jobs of the other web processes end too), and asks
again; the others wait behind it without asking (a stream's end used to wake every waiter, and
each ran a whole admission for the one session freed). A request that leaves the head, admitted
or refused, hands the turn to the next at once. Nobody waits longer than SWARM_QUEUE_WAIT_S in
all: then it is answered 503 ``overloaded`` with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.conf import settings

from marketplace.db import releasing
from marketplace.flows import admission
from marketplace.jobs.errors import NoCapacity, Overloaded
from marketplace.jobs.models import Job
from marketplace.nodes.models import strictest
from marketplace.placement.selectors import recovering

ADMISSION_POLL_S = 0.25  # how often a request waiting for a recovering model's route asks again
QUEUE_POLL_S = (0.05, 1.0)  # the head of a full model's line asks again within 50 ms, doubling to 1 s


@dataclass
class _Gate:
    """This event loop's admission state: a line per model (each request's turn, a future set when
    it is at the head), and a signal that some stream ended."""

    lines: dict[str, deque[asyncio.Future]] = field(default_factory=dict)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Gate] = weakref.WeakKeyDictionary()


def _gate() -> _Gate:
    loop = asyncio.get_running_loop()
    if loop not in _gates:
        _gates[loop] = _Gate()
    return _gates[loop]


def job_ended() -> None:
    """A stream of this process saw its job end: its sessions are free, the head of a line may ask again."""
    gate = _gate()
    gate.ended.set()
    gate.ended = asyncio.Event()  # the next waiters wait for the next end


async def admit(**job) -> list[Job]:
    """Admit the request's jobs (``flows.admission.admit_jobs``' arguments) at its turn in its model's
    line. When its model has no ready route but is recovering (a node died and its span is being
    healed, re-placed or reloaded), wait up to SWARM_ADMISSION_WAIT_S for one before answering 503:
    churn in the swarm is normal and a client should not see it. When every route is full, wait for
    room (see the module docstring). The caller holds no database connection while it waits
    (``api.openai`` hands its request's back first)."""
    gate = _gate()
    line = gate.lines.setdefault(job["model"], deque())
    now = time.monotonic()
    deadline, queue_deadline = now + settings.SWARM_ADMISSION_WAIT_S, now + settings.SWARM_QUEUE_WAIT_S
    turn = asyncio.get_running_loop().create_future()
    line.append(turn)
    if line[0] is turn:
        turn.set_result(None)
    try:
        await asyncio.wait({turn}, timeout=max(queue_deadline - time.monotonic(), 0.01))
        if not turn.done():
            raise Overloaded(
                f"Model {job['model']!r} has more requests waiting than it can admit; retry shortly.",
                retry_after=admission.OVERLOADED_RETRY_AFTER_S,
            )
        return await _at_head(gate, job, deadline, queue_deadline)
    finally:
        head = line[0] is turn
        line.remove(turn)
        if head and line and not line[0].done():
            line[0].set_result(None)  # the next request's turn


async def _at_head(gate: _Gate, job: dict, deadline: float, queue_deadline: float) -> list[Job]:
    poll = QUEUE_POLL_S[0]
    while True:
        ended = gate.ended
        try:
            return await sync_to_async(releasing(admission.admit_jobs))(**job)
        except Overloaded:
            left = queue_deadline - time.monotonic()
            if left <= 0:
                raise
            with contextlib.suppress(TimeoutError):  # jittered, so the processes' heads do not ask in step
                await asyncio.wait_for(ended.wait(), min(poll * random.uniform(0.5, 1.0), left))
            poll = min(2 * poll, QUEUE_POLL_S[1])
        except NoCapacity:
            privacy = strictest(job["api_key"].privacy, job["params"].privacy)
            if time.monotonic() >= deadline or not await sync_to_async(recovering)(job["model"], privacy):
                raise
            await asyncio.sleep(ADMISSION_POLL_S)
