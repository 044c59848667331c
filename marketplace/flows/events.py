"""A job's events, from its coordinator to the web process that answers its request.

The coordinator (``flows.runner``) publishes, in order: ``job.token`` events (text, token_id, and
log-probabilities where asked), then exactly one of ``job.done`` or ``job.error``. The web process
(``api.reply``) reads them in the same order, however far apart the two processes are.

A job's events are named by its public id (``chatcmpl-...``: random, never reused, unlike a
row's primary key after a database is restored or recreated). With Redis (``REDIS_URL``), they
are a Redis stream, ``swarm:job:<public id>:events``:

- **Published in batches** (``publish``): a process's events wait at most for the publish in
  flight to return, then go together in one command (a script of ``XADD`` and ``EXPIRE``
  commands, ``PUBLISH_SCRIPT``), one round trip for every job of the process. A token costs its
  publisher well under a tenth of a millisecond of CPU, where a channel-layer group message (a Lua
  script and its bookkeeping per message) cost about one.
- **Read by one reader per process** (``subscribe``): a single blocking ``XREAD`` over every
  stream the process answers returns whatever came for any of them since the last; a new
  subscription wakes it through the reader's own wake stream. Reading from a stream's start, a
  subscription sees every event however late it began (before or after its job's coordinator
  started), and a reader that lost its connection reads on from the last ids it had: nothing is
  lost in a Redis blip. Past ``READ_RETRY_S`` of errors, every subscription gets the error.
- **Bounded**: a stream is trimmed to ``STREAM_MAXLEN`` events and expires ``STREAM_TTL_S`` after its
  last event; a subscription that read its job's last event deletes its stream.

Without Redis (the embedded default: one process), the same contract is kept in memory.

A subscription's ``get`` may be cancelled (a check on a silent job, a client that went away)
without losing an event: events wait in an ``asyncio.Queue``, which keeps an item whose getter
was cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from django.conf import settings

log = logging.getLogger("swarm.jobs")
STREAM_MAXLEN = 10_000  # events kept per job: a completion's tokens and its end, with room
STREAM_TTL_S = 3600  # a stream nobody read to its end is dropped this long after its last event
READ_BLOCK_MS = 2000  # the longest one XREAD waits; a new subscription wakes it sooner
# What XREAD answers: (stream key, [(entry id, {field: value})]) per stream with news, or None.
Entries = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None
# The reading connection's socket timeout, well past READ_BLOCK_MS: an XREAD that waits its whole
# block on a quiet stream (a prefill, a heal) is no error. redis-py's default, 5 s, made it one.
READ_SOCKET_TIMEOUT_S = 30.0
READ_RETRY_S = 10.0  # how long the reader retries a failing Redis before failing its subscriptions
ENDINGS = ("job.done", "job.error")
# A batch of events in one command: each entry (KEYS[i], its payload ARGV[i + 2]) appended to its
# stream, trimmed to about ARGV[1] entries, and each stream's expiry set to ARGV[2] seconds. As a
# pipeline it was two commands per event, each packed and its answer parsed in the publisher.
PUBLISH_SCRIPT = """
for i, key in ipairs(KEYS) do
    redis.call('XADD', key, 'MAXLEN', '~', ARGV[1], '*', 'e', ARGV[i + 2])
end
for _, key in ipairs(KEYS) do
    redis.call('EXPIRE', key, ARGV[2])
end
return #KEYS
"""


def stream_key(job_id: str) -> str:
    return f"swarm:job:{job_id}:events"


class Subscription:
    """One job's events, in order, for one reader. ``get`` returns the next event, or raises the
    error that stopped the process's reader (the channel's own, e.g. Redis gone for good)."""

    def __init__(self, job_id: str, on_close: Callable[[Subscription], None]) -> None:
        self.job_id = job_id
        self.ended = False  # its job's last event was read
        self._queue: asyncio.Queue[dict | BaseException] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._on_close = on_close
        self._closed = False

    def deliver(self, item: dict | BaseException) -> None:
        """From any thread: the next event (or the reader's error)."""
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # a thread with no event loop
            here = False
        if here:
            self._queue.put_nowait(item)
        else:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> dict:
        item = await self._queue.get()
        return self._taken(item)

    def get_nowait(self) -> dict | None:
        """The next event if one is here already, else None."""
        try:
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        return self._taken(item)

    def _taken(self, item: dict | BaseException) -> dict:
        if isinstance(item, BaseException):
            raise item
        if item["type"] in ENDINGS:
            self.ended = True
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close(self)


# --- Redis --------------------------------------------------------------------------------


class _Batch:
    """The events waiting for the next pipeline, and the future their publishers wait on."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.entries: list[tuple[str, bytes]] = []
        self.sent: asyncio.Future[None] = loop.create_future()


class RedisEvents:
    """Job events over Redis streams, for the processes of one event loop (see the module docstring)."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis  # only where Redis is configured

        self._client = aioredis.from_url(url)
        self._publish = self._client.register_script(PUBLISH_SCRIPT)  # EVALSHA, loaded again after a restart
        self._reading = aioredis.from_url(url, socket_timeout=READ_SOCKET_TIMEOUT_S)  # it blocks in XREAD
        self._next: _Batch | None = None  # the batch publishers add to now
        self._flushing: asyncio.Task | None = None
        # Held weakly: a response dropped without closing its subscription (its client left before
        # it began) must not keep the reader reading its stream.
        self._subscriptions: dict[str, weakref.WeakSet[Subscription]] = {}
        self._last_ids: dict[str, bytes] = {}
        self._wake_key = f"swarm:events-reader:{secrets.token_hex(8)}"
        self._wake_id = b"0"
        self._reader: asyncio.Task | None = None
        self._chores: set[asyncio.Task] = set()  # wake-ups and deletions in flight

    async def publish(self, job_id: str, event: dict) -> None:
        """Append ``event`` to the job's stream; returns once Redis holds it. ConnectionError (an
        OSError) where Redis failed: the runner fails the job, as it does a stage it lost."""
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = _Batch(loop)
        batch = self._next
        batch.entries.append((stream_key(job_id), json.dumps(event, separators=(",", ":")).encode()))
        if self._flushing is None or self._flushing.done():
            self._flushing = loop.create_task(self._flush())
        await asyncio.shield(batch.sent)

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the publishers ready in this turn of the loop join the batch
        while self._next is not None:
            batch, self._next = self._next, None
            try:
                await self._publish(
                    keys=[key for key, _ in batch.entries],
                    args=[STREAM_MAXLEN, STREAM_TTL_S, *(payload for _, payload in batch.entries)],
                )
            except Exception as exc:  # Redis's own error: every publisher of the batch gets it, as an OSError
                error = ConnectionError(f"the job's events could not be sent: {exc!r}")
                error.__cause__ = exc
                batch.sent.set_exception(error)
                batch.sent.exception()  # retrieved: a batch whose publishers all left is no stray error
            else:
                batch.sent.set_result(None)

    def subscribe(self, job_id: str) -> Subscription:
        subscription = Subscription(job_id, self._unsubscribe)
        self._subscriptions.setdefault(job_id, weakref.WeakSet()).add(subscription)
        self._last_ids.setdefault(job_id, b"0")
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        else:
            self._spawn(self._wake())
        return subscription

    async def _wake(self) -> None:
        """Return the reader's XREAD in flight, so that it reads the new subscription's stream too."""
        pipe = self._client.pipeline(transaction=False)
        pipe.xadd(self._wake_key, {"w": b"1"}, maxlen=16, approximate=True)
        pipe.expire(self._wake_key, STREAM_TTL_S)
        await pipe.execute()

    def _unsubscribe(self, subscription: Subscription) -> None:
        subscribers = self._subscriptions.get(subscription.job_id, weakref.WeakSet())
        subscribers.discard(subscription)
        if not subscribers:
            self._subscriptions.pop(subscription.job_id, None)
            self._last_ids.pop(subscription.job_id, None)
            if subscription.ended:  # read to its end: nobody needs it again
                self._spawn(self._client.delete(stream_key(subscription.job_id)))

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._chores.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._chores.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("job events: a stream's bookkeeping failed: %r", task.exception())

    async def _read(self) -> None:
        failing_since: float | None = None
        while True:
            for job_id in [job_id for job_id, subscribers in self._subscriptions.items() if not subscribers]:
                del self._subscriptions[job_id], self._last_ids[job_id]  # dropped unclosed: nobody reads it
            if not self._subscriptions:
                return
            jobs = {stream_key(job_id).encode(): job_id for job_id in self._subscriptions}
            streams: dict[Any, Any] = {key: self._last_ids[job_id] for key, job_id in jobs.items()}
            streams[self._wake_key.encode()] = self._wake_id
            try:
                answer = cast(Entries, await self._reading.xread(streams, block=READ_BLOCK_MS))
            except Exception as exc:  # Redis's own error: read on from the same ids, for a while
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since < READ_RETRY_S:
                    log.warning("job events: reading failed, retrying: %r", exc)
                    await asyncio.sleep(0.2)
                    continue
                log.warning("job events: reading failed for %.0fs; failing its streams: %r", now - failing_since, exc)
                for subscribers in list(self._subscriptions.values()):
                    for subscription in list(subscribers):
                        subscription.deliver(exc)
                return
            failing_since = None
            for key, entries in answer or ():
                if key not in jobs:  # the wake stream
                    self._wake_id = entries[-1][0]
                    continue
                job_id = jobs[key]
                if job_id not in self._subscriptions:
                    continue  # closed while this read was in flight
                self._last_ids[job_id] = entries[-1][0]
                for _, fields in entries:
                    event = json.loads(fields[b"e"])
                    for subscription in list(self._subscriptions[job_id]):
                        subscription.deliver(event)


# --- in memory (embedded) -----------------------------------------------------------------


@dataclass
class _LocalStream:
    events: list[dict] = field(default_factory=list)
    subscribers: weakref.WeakSet[Subscription] = field(default_factory=weakref.WeakSet)  # held weakly, as Redis's
    ended_at: float | None = None  # when its last event came, for the streams nobody read to their end


class LocalEvents:
    """Job events in this process's memory (no Redis: the embedded default), for any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, _LocalStream] = {}

    async def publish(self, job_id: str, event: dict) -> None:
        with self._lock:
            stream = self._streams.setdefault(job_id, _LocalStream())
            stream.events.append(event)
            subscribers = list(stream.subscribers)
            if event["type"] in ENDINGS:
                stream.ended_at = time.monotonic()
                self._expire(stream.ended_at - STREAM_TTL_S)
        for subscription in subscribers:
            subscription.deliver(event)

    def subscribe(self, job_id: str) -> Subscription:
        subscription = Subscription(job_id, self._unsubscribe)
        with self._lock:
            stream = self._streams.setdefault(job_id, _LocalStream())
            stream.subscribers.add(subscription)
            for event in stream.events:
                subscription.deliver(event)
        return subscription

    def _unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            stream = self._streams.get(subscription.job_id)
            if stream is None:
                return
            stream.subscribers.discard(subscription)
            if not stream.subscribers and subscription.ended:
                del self._streams[subscription.job_id]

    def _expire(self, before: float) -> None:
        """Drop the streams that ended before ``before`` and nobody reads (under the lock)."""
        stale = [
            key
            for key, stream in self._streams.items()
            if not stream.subscribers and (stream.ended_at or before) < before
        ]
        for job_id in stale:
            del self._streams[job_id]


_redis: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RedisEvents] = weakref.WeakKeyDictionary()
_local = LocalEvents()


def channel() -> RedisEvents | LocalEvents:
    """The job events of this event loop: over Redis where REDIS_URL is set, else in memory."""
    if not settings.REDIS_URL:
        return _local
    loop = asyncio.get_running_loop()
    events = _redis.get(loop)
    if events is None:
        events = _redis[loop] = RedisEvents(settings.REDIS_URL)
    return events
