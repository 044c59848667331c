"""A client that goes away cancels its job with a ``job.cancel`` message, not a flag polled per token.

The job is admitted onto in-process StageServers (tiny-llama) and run by ``runner.run_job`` as
the embedded launch does (same event loop, in-memory channel layer) or as a Celery thread does
(its own event loop, Redis channel layer). The runner stops between two tokens and records the
job as cancelled with the tokens it delivered."""

from __future__ import annotations

import asyncio
import os

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.db import connection

from marketplace.billing.models import Transfer
from marketplace.flows import events as job_events
from marketplace.flows import runner
from marketplace.jobs import services
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.nodes.tickets import issuer_key
from tests import stage_fixtures
from tests.stage_fixtures import MODEL, stage_servers
from worker_agent.stage import Stage

pytestmark = [pytest.mark.api, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.factories"]

SPANS = [(0, 3), (3, 6)]
MAX_TOKENS = 200
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CANCELLED = ("client_disconnected", "the client went away; partial work recorded")


@pytest.fixture
def control_plane(settings, tmp_path):
    settings.SWARM_TICKET_KEY_PATH = tmp_path / "ticket.key"
    settings.SWARM_JOB_TIMEOUT_S = 120.0
    settings.SWARM_DEFAULT_PRICES = (0, 0)  # free: these jobs are about stopping, not credits
    issuer_key.cache_clear()
    yield settings
    issuer_key.cache_clear()


@pytest.fixture
def in_memory_layer(control_plane):
    control_plane.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    return get_channel_layer()


@pytest.fixture
def redis_layer(control_plane):
    control_plane.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
    }
    return get_channel_layer()


@pytest.fixture
def api_key(customer):
    api_key, _ = services.create_api_key(customer, "cancel")
    return api_key


def admit(api_key, route, monkeypatch) -> Job:
    return stage_fixtures.admit(
        api_key, route, RequestParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt="Once upon a time"), monkeypatch
    )


def test_a_cancel_mid_stream_stops_the_job_between_tokens(in_memory_layer, api_key, monkeypatch):
    async def scenario():
        async with stage_servers(SPANS) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            events = job_events.channel().subscribe(job.public_id)
            running = asyncio.create_task(runner.run_job(job.pk))
            tokens = 0
            while tokens < 2:
                event = await asyncio.wait_for(events.get(), 30)
                tokens += event["type"] == "job.token"
            events.close()
            await runner.request_cancel(in_memory_layer, job.public_id)
            return await asyncio.wait_for(running, 60), job.pk

    state, job_pk = asyncio.run(scenario())

    job = Job.objects.get(pk=job_pk)
    assert state == JobState.CANCELLED
    assert job.state == JobState.CANCELLED
    assert (job.error_code, job.error_message) == CANCELLED
    assert 2 <= job.completion_tokens < MAX_TOKENS
    assert (job.finish_reason, job.verified, job.receipts) == ("", None, [])


def test_a_cancel_sent_before_the_runner_listens_stops_it_after_its_first_token(in_memory_layer, api_key, monkeypatch):
    async def scenario():
        async with stage_servers(SPANS) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            await runner.request_cancel(in_memory_layer, job.public_id)
            return await asyncio.wait_for(runner.run_job(job.pk), 60), job.pk

    state, job_pk = asyncio.run(scenario())

    job = Job.objects.get(pk=job_pk)
    assert state == JobState.CANCELLED
    assert (job.state, job.completion_tokens, job.error_code) == (JobState.CANCELLED, 1, "client_disconnected")


def test_a_cancel_reaches_a_runner_on_another_event_loop_through_redis(redis_layer, api_key, monkeypatch):
    """As with Celery: the runner runs in a thread with its own event loop, the view sends from the web's."""

    async def scenario():
        async with stage_servers(SPANS) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            await runner.request_cancel(redis_layer, job.public_id)
            state = await asyncio.wait_for(asyncio.to_thread(asyncio.run, runner.run_job(job.pk)), 60)
            return state, job.pk

    state, job_pk = asyncio.run(scenario())

    job = Job.objects.get(pk=job_pk)
    assert state == JobState.CANCELLED
    assert (job.state, job.error_code) == (JobState.CANCELLED, "client_disconnected")
    # The runner starts listening as the stream starts: over Redis the cancel's receive may take a
    # round trip longer than a loaded machine's first token or two, never the whole request.
    assert 1 <= job.completion_tokens < MAX_TOKENS


def test_a_job_nobody_cancels_runs_to_its_end(in_memory_layer, api_key, monkeypatch):
    async def scenario():
        async with stage_servers(SPANS) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            return await asyncio.wait_for(runner.run_job(job.pk), 120), job.pk

    state, job_pk = asyncio.run(scenario())

    job = Job.objects.get(pk=job_pk)
    assert state == JobState.SUCCEEDED
    assert (job.state, job.error_code) == (JobState.SUCCEEDED, "")
    assert job.prompt_ids == list(services.tokenize_prompt(MODEL, RequestParams.from_json(job.params)))


class StuckCancelListening:
    """A channel layer (the in-memory one underneath) whose receive on a job's cancel channel does
    not stop when cancelled, until released, as a Redis connection pool busy reconnecting holds a
    blocked receive; then that receive fails with the layer's own error."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.release = asyncio.Event()
        self.ignored = 0  # cancellations the stuck receive sat through

    def __getattr__(self, name: str):
        return getattr(self.layer, name)

    async def receive(self, channel: str) -> dict:
        if not channel.endswith(".cancel"):  # a job's cancel channel: job.<pk>.cancel
            return await self.layer.receive(channel)
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.ignored += 1
        raise ConnectionError("the connection pool reconnected")


def test_a_cancel_listener_stuck_in_the_channel_layer_does_not_hold_the_job_end(control_plane, api_key, monkeypatch):
    control_plane.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels.layers.InMemoryChannelLayer", "CONFIG": {"capacity": MAX_TOKENS + 16}}
    }
    layer = StuckCancelListening(get_channel_layer())
    monkeypatch.setattr(runner, "get_channel_layer", lambda: layer)

    async def scenario():
        async with stage_servers(SPANS) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            state = await asyncio.wait_for(runner.run_job(job.pk), 120)
            stray = set(runner._stray_listeners)  # the job ended with its listener still stuck
            events = await stage_fixtures.events_until_final(job.public_id, 5)
            layer.release.set()
            await asyncio.wait_for(asyncio.gather(*stray, return_exceptions=True), 5)
            return state, job.pk, events, stray

    state, job_pk, events, stray = asyncio.run(scenario())

    job = Job.objects.get(pk=job_pk)
    assert state == JobState.SUCCEEDED
    assert (job.state, job.error_code) == (JobState.SUCCEEDED, "")
    assert events[-1]["type"] == "job.done"
    assert events[-1]["completion_tokens"] == job.completion_tokens == len(events) - 1
    assert len(stray) == 1 and layer.ignored >= 1  # it sat through the cancel: the job did not wait
    assert all(listener.done() for listener in stray) and not runner._stray_listeners


class CountingStage(Stage):
    """A stage that counts the steps it was asked to compute."""

    prepared = 0

    def prepare(self, forward):
        CountingStage.prepared += 1
        return super().prepare(forward)


def test_a_job_cancelled_before_its_coordinator_marks_it_running_sends_its_stages_nothing(
    in_memory_layer, api_key, monkeypatch
):
    """The launch sends the job's brief: its coordinator opens the stages while it marks the job
    running, and sends them the prompt only once that mark is made. A job already cancelled (the
    client left while it was queued) is left as it is: no step computed, no token, nothing charged."""
    CountingStage.prepared = 0

    async def scenario():
        async with stage_servers(SPANS, stage_class=CountingStage) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            brief = services.job_brief(job)
            await sync_to_async(Job.objects.filter(pk=job.pk).update)(state=JobState.CANCELLED)
            events = job_events.channel().subscribe(job.public_id)
            state = await asyncio.wait_for(runner.run_job(job.pk, brief), 60)
            with pytest.raises(TimeoutError):  # nothing was published as the job's events
                await asyncio.wait_for(events.get(), 0.5)
            events.close()
            return state, job.pk

    state, job_pk = asyncio.run(scenario())

    job = Job.objects.get(pk=job_pk)
    assert state == JobState.CANCELLED
    assert (job.state, job.started_at, job.completion_tokens, job.receipts) == (JobState.CANCELLED, None, 0, [])
    assert CountingStage.prepared == 0


def test_a_job_run_from_its_brief_gives_the_tokens_of_one_run_from_its_row(in_memory_layer, api_key, monkeypatch):
    """The brief holds what the coordinator reads of the job's row: both ways run the same job."""

    async def run(brief: bool):
        async with stage_servers(SPANS) as route:
            params = RequestParams(max_tokens=8, temperature=0.0, prompt="Once upon a time")
            job = await sync_to_async(stage_fixtures.admit)(api_key, route, params, monkeypatch)
            state = await asyncio.wait_for(runner.run_job(job.pk, services.job_brief(job) if brief else None), 60)
            events = await stage_fixtures.events_until_final(job.public_id, 10)
            tokens = [event["token_id"] for event in events if event["type"] == "job.token"]
            return state, tokens, job.pk

    from_brief, from_row = asyncio.run(run(True)), asyncio.run(run(False))

    assert from_brief[0] == from_row[0] == JobState.SUCCEEDED
    assert len(from_brief[1]) == len(from_row[1]) == 8
    job = Job.objects.get(pk=from_brief[2])
    assert job.started_at is not None and job.completion_tokens == 8 and job.verified


def test_a_cancel_left_for_a_job_never_stops_a_later_job_that_repeats_its_key(redis_layer, api_key, monkeypatch):
    """A database recreated on the same Redis numbers its jobs from 1 again: a cancel left unread for
    an earlier job (its client went away before its coordinator listened) is named by that job's public
    id, so the job that takes the earlier one's primary key runs to its end."""

    def recreate_with_the_same_key(earlier: Job) -> None:  # as a fresh database would number it
        Transfer.objects.filter(job=earlier).delete()
        Job.objects.filter(pk=earlier.pk).delete()
        with connection.cursor() as cursor:
            cursor.execute("SELECT setval(pg_get_serial_sequence('jobs_job', 'id'), %s, false)", [earlier.pk])

    async def scenario():
        async with stage_servers(SPANS) as route:
            earlier = await sync_to_async(admit)(api_key, route, monkeypatch)
            await runner.request_cancel(redis_layer, earlier.public_id)  # never read: it never runs
            await sync_to_async(recreate_with_the_same_key)(earlier)
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            assert job.pk == earlier.pk
            state = await asyncio.wait_for(asyncio.to_thread(asyncio.run, runner.run_job(job.pk)), 120)
            return state, job.pk

    state, job_pk = asyncio.run(scenario())

    job = Job.objects.get(pk=job_pk)
    assert (state, job.state, job.completion_tokens) == (JobState.SUCCEEDED, JobState.SUCCEEDED, MAX_TOKENS)
