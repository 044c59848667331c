"""A response reads its job's events from the Redis channel layer without losing one while it
checks on a silent job. The check used to cancel the receive in flight every few seconds, and a
receive cancelled just as its message arrived dropped that message (channels_redis takes it
from the channel's buffer, then discards it with the cancelled wait): under load, about one
stream in 30 lost a token or never saw its job end. Here the check runs every millisecond while
events arrive at random moments, so a lossy reader would lose many."""

from __future__ import annotations

import asyncio
import random

import pytest
from channels_redis.core import RedisChannelLayer
from django.utils import timezone

from marketplace.api import reply
from marketplace.flows import runner
from marketplace.jobs.models import Job, JobState

pytestmark = [pytest.mark.api, pytest.mark.django_db(transaction=True)]

EVENTS = 400


def test_no_event_is_lost_while_a_silent_job_is_checked_on(monkeypatch, settings, django_user_model):
    assert settings.REDIS_URL, "the tests run against Redis: set REDIS_URL"
    monkeypatch.setattr(reply, "PROGRESS_CHECK_S", 0.001)
    customer = django_user_model.objects.create_user("c", "c@example.test", "x", is_customer=True)
    job = Job.objects.create(
        public_id="chatcmpl-events", kind="chat", customer=customer, model="tiny-llama",
        state=JobState.RUNNING, started_at=timezone.now(), progress_at=timezone.now(),
    )  # fmt: skip
    layer = RedisChannelLayer(hosts=[settings.REDIS_URL], capacity=EVENTS + 10)
    group = runner.group_name(job.pk)

    async def scenario() -> list[dict]:
        channel = await layer.new_channel()
        await layer.group_add(group, channel)
        choice = reply.Choice(job, 0, "chat", layer, channel)

        async def send() -> None:
            pause = random.Random()
            for i in range(EVENTS):
                await asyncio.sleep(pause.uniform(0, 0.003))
                await layer.group_send(group, {"type": "job.token", "text": f"{i} ", "token_id": i})
            await layer.group_send(group, {"type": "job.done", "finish_reason": "length", "completion_tokens": EVENTS})

        sender = asyncio.create_task(send())
        events = [event async for event in choice.events()]
        await sender
        await layer.flush()
        return events

    events = asyncio.run(scenario())

    assert [e["type"] for e in events] == ["job.token"] * EVENTS + ["job.done"]
    assert [e["token_id"] for e in events[:-1]] == list(range(EVENTS))
