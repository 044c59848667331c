"""A response reads its job's events (``flows.events``, Redis streams) without losing one while it
checks on a silent job, however the events and the checks interleave; the tokens that arrived
together go out in one chunk; a stream read to its end is deleted. The check used to cancel the
receive in flight every few seconds, and a receive cancelled just as its message arrived dropped
that message: under load, about one stream in 30 lost a token or never saw its job end. Here the
check runs every millisecond while events arrive at random moments, so a lossy reader would lose
many."""

from __future__ import annotations

import asyncio
import gc
import json
import random

import pytest
import redis.asyncio
from django.utils import timezone

from marketplace.api import reply
from marketplace.flows import events as job_events
from marketplace.jobs.models import Job, JobState

pytestmark = [pytest.mark.api, pytest.mark.django_db(transaction=True)]

EVENTS = 400


@pytest.fixture
def job(settings, django_user_model) -> Job:
    assert settings.REDIS_URL, "the tests run against Redis: set REDIS_URL"
    customer = django_user_model.objects.create_user("c", "c@example.test", "x", is_customer=True)
    return Job.objects.create(
        public_id=f"chatcmpl-events-{random.getrandbits(32)}", kind="chat", customer=customer, model="tiny-llama",
        state=JobState.RUNNING, started_at=timezone.now(), progress_at=timezone.now(),
    )  # fmt: skip


async def read(events, job_id: str, count: int) -> list[dict]:
    """The first ``count`` events of the job, from a subscription of ``events()`` made in this loop."""
    subscription = events().subscribe(job_id)
    try:
        return [await asyncio.wait_for(subscription.get(), 10) for _ in range(count)]
    finally:
        subscription.close()


def test_no_event_is_lost_while_a_silent_job_is_checked_on(monkeypatch, settings, job):
    monkeypatch.setattr(reply, "PROGRESS_CHECK_S", 0.001)

    async def scenario() -> list[dict]:
        events = job_events.channel()
        choice = reply.Choice(job, 0, "chat", events.subscribe(job.public_id))

        async def send() -> None:
            pause = random.Random()
            for i in range(EVENTS):
                await asyncio.sleep(pause.uniform(0, 0.003))
                await events.publish(job.public_id, {"type": "job.token", "text": f"{i} ", "token_id": i})
            done = {"type": "job.done", "finish_reason": "length", "completion_tokens": EVENTS}
            await events.publish(job.public_id, done)

        sender = asyncio.create_task(send())
        received = [event async for event in choice.events()]
        await sender
        # Read to its end: the stream's deletion was sent as the response stopped reading.
        client = redis.asyncio.Redis.from_url(settings.REDIS_URL)
        for _ in range(200):
            if not await client.exists(job_events.stream_key(job.public_id)):
                break
            await asyncio.sleep(0.05)
        kept = await client.exists(job_events.stream_key(job.public_id))
        await client.aclose()
        return received, kept

    received, kept = asyncio.run(scenario())

    assert [e["type"] for e in received] == ["job.token"] * EVENTS + ["job.done"]
    assert [e["token_id"] for e in received[:-1]] == list(range(EVENTS))
    assert kept == 0


def test_tokens_that_arrived_together_go_out_in_one_chunk(job):
    """Published before the response reads (a client slower than its tokens): one chunk for them all."""

    async def scenario() -> list[dict | int]:
        events = job_events.channel()
        for i, text in enumerate(["Hel", "lo", ",", " world"]):
            await events.publish(job.public_id, {"type": "job.token", "text": text, "token_id": i})
        await events.publish(job.public_id, {"type": "job.done", "finish_reason": "stop", "completion_tokens": 4})
        choice = reply.Choice(job, 0, "chat", events.subscribe(job.public_id))
        return [item async for item in choice.deltas()]

    chunks = asyncio.run(scenario())

    assert chunks == [
        {"index": 0, "delta": {"content": "Hello, world"}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"},
        4,
    ]


def test_a_subscription_started_late_reads_every_event_from_the_first(job):
    """A job's events are kept from its first: the reader may subscribe after its job began, or
    after it ended, and reads them all, in order, on another event loop than the publisher's."""

    async def publish() -> None:
        events = job_events.channel()
        for i in range(5):
            await events.publish(job.public_id, {"type": "job.token", "text": str(i), "token_id": i})
        await events.publish(job.public_id, {"type": "job.error", "code": "timeout", "message": "gone"})

    asyncio.run(publish())
    received = asyncio.run(read(job_events.channel, job.public_id, 6))

    assert [e.get("token_id") for e in received] == [0, 1, 2, 3, 4, None]
    assert received[-1] == {"type": "job.error", "code": "timeout", "message": "gone"}


def test_a_quiet_stream_is_read_past_the_reading_connections_socket_timeout(monkeypatch, job):
    """An XREAD that waits its whole block on a stream with nothing new (a long prefill, a heal) is
    no error: the block stays under the reading connection's socket timeout. Scaled down here: a
    0.5 s socket timeout, a quiet stream for four times that, then its event."""
    monkeypatch.setattr(job_events, "READ_SOCKET_TIMEOUT_S", 0.5)
    monkeypatch.setattr(job_events, "READ_BLOCK_MS", 200)
    monkeypatch.setattr(job_events, "READ_RETRY_S", 1.0)  # a reader timing out would fail its streams within the wait

    async def scenario() -> dict:
        events = job_events.RedisEvents(job_events.settings.REDIS_URL)
        subscription = events.subscribe(job.public_id)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiting := asyncio.ensure_future(subscription.get())), 2.0)
            await events.publish(job.public_id, {"type": "job.done", "finish_reason": "stop", "completion_tokens": 0})
            return await asyncio.wait_for(waiting, 10)
        finally:
            subscription.close()

    assert asyncio.run(scenario())["type"] == "job.done"


def test_a_subscription_dropped_unclosed_is_no_longer_read(monkeypatch, job):
    """A response dropped before it began (its client left at once) never closes its subscription:
    the process's reader lets it go with the response, and stops once it reads nothing else."""
    monkeypatch.setattr(job_events, "READ_BLOCK_MS", 100)

    async def scenario() -> bool:
        events = job_events.RedisEvents(job_events.settings.REDIS_URL)
        subscription = events.subscribe(job.public_id)
        reader = events._reader
        del subscription
        gc.collect()
        await asyncio.wait_for(asyncio.shield(reader), 10)
        return reader.done()

    assert asyncio.run(scenario())


def test_in_memory_events_keep_the_same_contract(job):
    """The embedded default (no Redis): events kept from the first, in order, to a reader on another
    event loop than the publisher's, and the stream let go once read to its end."""
    events = job_events.LocalEvents()

    async def publish() -> None:
        for i in range(3):
            await events.publish(job.public_id, {"type": "job.token", "text": str(i), "token_id": i})
        await events.publish(job.public_id, {"type": "job.done", "finish_reason": "stop", "completion_tokens": 3})

    asyncio.run(publish())
    received = asyncio.run(read(lambda: events, job.public_id, 4))

    assert [e.get("token_id") for e in received] == [0, 1, 2, None]
    assert received[-1]["type"] == "job.done"
    assert events._streams == {}


def test_events_published_together_reach_each_stream_in_order_trimmed_and_expiring(monkeypatch, settings):
    """A batch of several jobs' events goes to Redis in one command (``PUBLISH_SCRIPT``): each job's
    stream holds its own events in order, is trimmed to about STREAM_MAXLEN and expires; after a
    Redis that forgot its scripts (a restart, SCRIPT FLUSH), the next batch still goes out."""
    monkeypatch.setattr(job_events, "STREAM_MAXLEN", 10)
    jobs = [f"chatcmpl-batch-{random.getrandbits(32)}-{i}" for i in range(3)]

    async def scenario() -> tuple[list[list[int]], list[int], list[int]]:
        events = job_events.RedisEvents(settings.REDIS_URL)
        client = redis.asyncio.Redis.from_url(settings.REDIS_URL)
        try:
            for round_ in range(2):
                if round_:
                    await client.script_flush()
                await asyncio.gather(
                    *(events.publish(job, {"type": "job.token", "n": n}) for n in range(200) for job in jobs)
                )
            held = []
            for job in jobs:
                entries = await client.xrange(job_events.stream_key(job))
                held.append([json.loads(fields[b"e"])["n"] for _, fields in entries])
            lengths = [await client.xlen(job_events.stream_key(job)) for job in jobs]
            ttls = [await client.ttl(job_events.stream_key(job)) for job in jobs]
            await client.delete(*(job_events.stream_key(job) for job in jobs))
            return held, lengths, ttls
        finally:
            await client.aclose()

    held, lengths, ttls = asyncio.run(scenario())
    for events in held:  # the last events of the second round, in order, and about the last ten kept
        assert events == list(range(200 - len(events), 200)) and 10 <= len(events) < 200
    assert all(10 <= length < 200 for length in lengths)
    assert all(0 < ttl <= job_events.STREAM_TTL_S for ttl in ttls)
