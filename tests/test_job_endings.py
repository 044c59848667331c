"""How a job ends, whatever way it ends: a stage lost after tokens streamed leaves the job charged
exactly the tokens its client received; the final event goes out before audits are recorded or
replayed; a response gives up on a job only when the job stops making progress.

Jobs are admitted onto in-process StageServers (tiny-llama) and run by ``runner.run_job`` in the
test's own event loop, with the in-memory channel layer."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.utils import timezone

from marketplace.billing.services import cost, grant
from marketplace.jobs import runner, services
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.nodes.tickets import issuer_key
from marketplace.payouts.models import Earning
from tests import stage_fixtures
from tests.stage_fixtures import stage_servers
from worker_agent.errors import SessionError
from worker_agent.stage import Stage

pytestmark = [pytest.mark.api, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.factories"]

SPANS = [(0, 3), (3, 6)]
MAX_TOKENS = 40
PRICES = (7_000, 13_000)  # nano-dollars per million prompt / completion tokens
LOST_AFTER = 6  # steps a dying stage serves before it fails every one


class DyingStage(Stage):
    """Serves a few steps, then fails every step as a lost stage would."""

    steps = 0

    def finish(self, prepared, outputs):
        DyingStage.steps += 1
        if DyingStage.steps > LOST_AFTER:
            raise SessionError("this stage went away", code="stage_lost")
        return super().finish(prepared, outputs)


@pytest.fixture
def control_plane(settings, tmp_path):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.SWARM_TICKET_KEY_PATH = tmp_path / "ticket.key"
    settings.SWARM_JOB_TIMEOUT_S = 120.0
    settings.SWARM_DEFAULT_PRICES = PRICES
    settings.SWARM_AUDIT_NEW_NODE_FRACTION = 1.0  # every stage of these jobs is audited
    settings.SWARM_VERIFIER = "inline"
    issuer_key.cache_clear()
    DyingStage.steps = 0
    yield settings
    issuer_key.cache_clear()


@pytest.fixture
def api_key(customer):
    grant(customer, 5)
    api_key, _ = services.create_api_key(customer, "endings")
    return api_key


def admit(api_key, route, monkeypatch) -> Job:
    params = RequestParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt="Once upon a time, far away")
    return stage_fixtures.admit(api_key, route, params, monkeypatch)


def tokens_of(events: list[dict]) -> int:
    return sum(1 for event in events if event["type"] == "job.token" and event["token_id"] is not None)


async def receive_until_final(layer, channel: str) -> list[dict]:
    events: list[dict] = []
    while not events or events[-1]["type"] not in ("job.done", "job.error"):
        events.append(await asyncio.wait_for(layer.receive(channel), 60))
    return events


def test_a_stage_lost_after_tokens_streamed_charges_exactly_the_delivered_tokens(control_plane, api_key, monkeypatch):
    async def scenario():
        async with stage_servers(SPANS, rogue=1, rogue_class=DyingStage) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            layer = get_channel_layer()
            channel = await layer.new_channel()
            await layer.group_add(runner.group_name(job.pk), channel)
            state = await runner.run_job(job.pk)
            return state, job.pk, await receive_until_final(layer, channel)

    state, job_pk, events = asyncio.run(scenario())

    job = Job.objects.get(pk=job_pk)
    delivered = tokens_of(events)
    assert state == JobState.FAILED
    assert events[-1]["type"] == "job.error"
    assert delivered == LOST_AFTER  # each step it served (the prefill, then one per token) gave a token
    assert (job.state, job.completion_tokens) == (JobState.FAILED, delivered)
    assert job.settled_at is not None
    assert job.charged_amount == cost(job.prompt_tokens, delivered, PRICES)


def test_the_final_event_goes_out_before_audits_are_recorded(control_plane, api_key, monkeypatch):
    recording = threading.Event()
    release = threading.Event()
    recorded: list[int] = []
    settled_first: list[bool] = []

    def slow_record_audits(job, materials):
        settled_first.append(Job.objects.get(pk=job.pk).settled_at is not None)
        recording.set()
        assert release.wait(60), "the test never let the audits through"
        recorded.append(len(materials))
        return []

    monkeypatch.setattr(runner, "record_audits", slow_record_audits)

    async def scenario():
        async with stage_servers(SPANS) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            layer = get_channel_layer()
            channel = await layer.new_channel()
            await layer.group_add(runner.group_name(job.pk), channel)
            run = asyncio.create_task(runner.run_job(job.pk))
            events = await receive_until_final(layer, channel)
            audits_pending = not release.is_set()
            await asyncio.to_thread(recording.wait, 60)
            release.set()
            return await run, events, audits_pending

    state, events, audits_pending = asyncio.run(scenario())

    assert state == JobState.SUCCEEDED
    assert events[-1]["type"] == "job.done"
    assert audits_pending is True  # the client had its final event while audits were still held
    assert recorded == [len(SPANS)]  # and they were recorded afterwards, every stage's material
    assert settled_first == [True]  # settlement does not wait for audits either
    job = Job.objects.get()
    assert job.charged_amount == cost(job.prompt_tokens, job.completion_tokens, PRICES) > 0
    # These stages' nodes are in no registry: their shares stay platform revenue, and the job settles.
    assert Earning.objects.count() == 0


def test_a_response_gives_up_only_when_the_job_stops_making_progress(control_plane, api_key, monkeypatch):
    control_plane.SWARM_JOB_STALE_S = 60.0
    job = admit(api_key, [], monkeypatch)
    now = timezone.now()

    assert services.stopped_answering(job.pk, now=job.created_at + timedelta(seconds=59)) is None
    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING, progress_at=now)
    assert services.stopped_answering(job.pk, now=now + timedelta(seconds=60)) is None
    assert services.stopped_answering(job.pk, now=now + timedelta(seconds=61)) == "the job made no progress for 61s"
    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED)
    assert services.stopped_answering(job.pk, now=now) == "the job ended (succeeded) but its last event did not arrive"
