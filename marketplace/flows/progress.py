"""What a coordinator process's running jobs have delivered, written down for all of them at once.

A running job's record keeps the tokens it delivered so far and when it last made progress
(``services.record_progress``): a response checks it to tell a silent job from a lost one, and a
lost coordinator's jobs are settled by it (``flows.settlement.reconcile_jobs``). One UPDATE per job
per second was a statement a second for every stream; here each job notes its count in memory
(``note``) and one statement every PROGRESS_INTERVAL_S writes every count that moved.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable

from marketplace.jobs import services

log = logging.getLogger("swarm.jobs")
PROGRESS_INTERVAL_S = 1.0  # how often a process's running jobs record the tokens they delivered


class ProgressBook:
    """The counts of one event loop's jobs; ``in_thread`` runs the write off the loop."""

    def __init__(self, in_thread: Callable[..., Awaitable]) -> None:
        self._in_thread = in_thread
        self._moved: dict[int, int] = {}  # job pk -> tokens delivered, not yet written
        self._running: set[int] = set()
        self._writer: asyncio.Task | None = None

    def start(self, job_pk: int) -> None:
        self._running.add(job_pk)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write())

    def note(self, job_pk: int, tokens: int) -> None:
        if job_pk in self._running:
            self._moved[job_pk] = tokens

    def stop(self, job_pk: int) -> None:
        """The job ended: its own record says the rest."""
        self._running.discard(job_pk)
        self._moved.pop(job_pk, None)

    async def _write(self) -> None:
        while self._running:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            moved, self._moved = self._moved, {}
            try:
                await self._in_thread(services.record_progress, moved)
            except Exception:  # the database's own error: the next interval writes the counts again
                log.exception("recording %d running jobs' progress failed", len(moved))
                self._moved = moved | self._moved


_books: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ProgressBook] = weakref.WeakKeyDictionary()


def book(in_thread: Callable[..., Awaitable]) -> ProgressBook:
    """This event loop's book."""
    loop = asyncio.get_running_loop()
    if loop not in _books:
        _books[loop] = ProgressBook(in_thread)
    return _books[loop]
