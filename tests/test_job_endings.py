"""How a job ends, whatever way it ends: a stage lost after tokens streamed is healed onto a warm
spare and the job goes on as if unbroken, paid to the nodes that served its verified part; without
a spare the job fails with a clear error and is charged nothing (its tokens were never verified); the
final event goes out before audits are recorded or replayed; a stage lost after the last token
leaves the client its whole answer (the job unverified and free; the stages that sent their receipts
are paid for what those prove, the one that owed its receipt is struck); a response gives up
on a job only when the job stops making progress.

Jobs are admitted onto in-process StageServers (tiny-llama) and run by ``runner.run_job`` in the
test's own event loop, with the in-memory channel layer."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from marketplace.billing.services import cost, grant
from marketplace.flows import runner
from marketplace.jobs import services
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.nodes.models import Node
from marketplace.payouts.models import Earning
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.verification.models import Strike
from tests import stage_fixtures
from tests.stage_fixtures import events_until_final, stage_servers
from worker_agent.errors import SessionError
from worker_agent.protocol.connection import CloseSessions
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.server import StageServer
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
    DyingStage.steps = 0
    with stage_fixtures.in_memory_control_plane(
        settings,
        tmp_path,
        SWARM_DEFAULT_PRICES=PRICES,
        SWARM_AUDIT_NEW_NODE_FRACTION=1.0,  # every stage of these jobs is audited
        SWARM_VERIFIER="inline",
    ) as plane:
        yield plane


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


def run_with_rogue(api_key, monkeypatch, **rogue) -> tuple[str, int, list[dict]]:
    """Run one job on SPANS with stage 1 the given rogue (``rogue_class`` / ``rogue_server``):
    (its final state, its pk, the events its group received up to the final one)."""

    async def scenario():
        async with stage_servers(SPANS, rogue=1, **rogue) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            state = await runner.run_job(job.pk)
            return state, job.pk, await events_until_final(job.public_id)

    return asyncio.run(scenario())


def test_a_stage_lost_with_no_spare_fails_and_is_charged_nothing(control_plane, api_key, monkeypatch):
    state, job_pk, events = run_with_rogue(api_key, monkeypatch, rogue_class=DyingStage)

    job = Job.objects.get(pk=job_pk)
    delivered = tokens_of(events)
    assert state == JobState.FAILED
    assert events[-1]["type"] == "job.error"
    # No node holds the span of the one that died (these stages are in no registry): a clear error.
    assert events[-1]["code"] == "stage_lost"
    assert "no replacement for stage 1 is available" in job.error_message
    # The customer is told what happened, not which node at which address: that is the record's.
    assert events[-1]["message"] == (
        "a provider stage failed (stage_lost) and no route around it was available; nothing is charged for this request"
    )
    assert "ws://" in job.error_message
    assert delivered == LOST_AFTER  # each step it served (the prefill, then one per token) gave a token
    assert (job.state, job.completion_tokens) == (JobState.FAILED, delivered)
    assert job.settled_at is not None
    assert job.charged_amount == 0


def _register(provider, make_joined_node, keys, route, spare: int) -> None:
    """The stages of ``route`` as joined nodes with ready blocks; the one at ``spare`` as a warm spare."""
    PlacementState.objects.get_or_create(model=stage_fixtures.MODEL)
    for index, (key, stage) in enumerate(zip(keys, route, strict=True)):
        node = make_joined_node(provider, f"gpu-{index}", key=key, compute=1000.0).node
        Assignment.objects.create(
            node=node,
            model=stage_fixtures.MODEL,
            generation=1,
            pipeline=1 if index == spare else 0,
            position=0 if index == spare else index,
            layer_start=stage.layer_start,
            layer_end=stage.layer_end,
            is_spare=index == spare,
            state=AssignmentState.READY,
            data_url=stage.data_url,
        )


def test_a_stage_lost_mid_stream_is_healed_onto_a_spare_and_the_job_goes_on(
    control_plane, api_key, monkeypatch, provider, make_joined_node
):
    keys = [generate_signing_key() for _ in range(3)]
    spans = [*SPANS, SPANS[1]]  # the route, and a warm spare of its dying stage's span

    async def run(job):
        state = await runner.run_job(job.pk)
        return state, await events_until_final(job.public_id)

    async def scenario():
        async with stage_servers(spans, rogue=1, rogue_class=DyingStage, keys=keys) as stages:
            await sync_to_async(_register)(provider, make_joined_node, keys, stages, spare=2)
            job = await sync_to_async(admit)(api_key, stages[:2], monkeypatch)
            state, events = await run(job)
            # The same request on an unbroken route, for reference.
            unbroken = await sync_to_async(admit)(api_key, [stages[0], stages[2]], monkeypatch)
            _, reference = await run(unbroken)
            return state, job.pk, events, reference, stages

    state, job_pk, events, reference, stages = asyncio.run(scenario())

    job = Job.objects.get(pk=job_pk)
    assert state == JobState.SUCCEEDED, job.error_message
    assert events[-1]["type"] == "job.done"
    delivered = tokens_of(events)
    assert delivered == job.completion_tokens > LOST_AFTER
    # The client's stream is the unbroken run's, token for token.
    assert [e["token_id"] for e in events if e["type"] == "job.token"] == [
        e["token_id"] for e in reference if e["type"] == "job.token"
    ]
    # The heal is on record, and the job's route is the healed one: the spare took the dead span.
    (heal,) = job.heals
    assert heal["failed_node"] == stages[1].node
    assert [s["node"] for s in job.route] == [stages[0].node, stages[2].node]
    # Verified again by the control plane against the healed route; paid to those who served it.
    assert job.verified is True, job.verification_error
    assert job.charged_amount == cost(job.prompt_tokens, delivered, PRICES)
    paid = set(Earning.objects.filter(job=job).values_list("node__node_id", flat=True))
    assert paid == {stages[0].node, stages[2].node}
    assert Node.objects.get(node_id=stages[1].node).suspected_at is not None  # reported at once


def test_the_final_event_goes_out_before_audits_are_recorded(control_plane, api_key, monkeypatch):
    recording = threading.Event()
    release = threading.Event()
    recorded: list[int] = []
    settled_first: list[bool] = []

    def slow_record_audits(job, materials, gaps=()):
        settled_first.append(Job.objects.get(pk=job.pk).settled_at is not None)
        recording.set()
        assert release.wait(60), "the test never let the audits through"
        recorded.append(len(materials))
        return []

    monkeypatch.setattr(runner, "record_audits", slow_record_audits)

    async def scenario():
        async with stage_servers(SPANS) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            run = asyncio.create_task(runner.run_job(job.pk))
            events = await events_until_final(job.public_id)
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
    # Ended, its final event on the way (sent right after the record is final): the response waits for it.
    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED, finished_at=now)
    assert services.stopped_answering(job.pk, now=now + timedelta(seconds=1)) is None
    grace = timedelta(seconds=services.FINAL_EVENT_GRACE_S)
    late = "the job ended (succeeded) but its last event did not arrive"
    assert services.stopped_answering(job.pk, now=now + grace) == late
    Job.objects.filter(pk=job.pk).update(finished_at=None)  # ended with no time recorded: nothing to wait for
    assert services.stopped_answering(job.pk, now=now) == late
    # Ended by the sweep that found its coordinator lost: nobody will send the event.
    Job.objects.filter(pk=job.pk).update(state=JobState.FAILED, finished_at=now, error_code="coordinator_lost")
    assert services.stopped_answering(job.pk, now=now + timedelta(seconds=1)) == services.COORDINATOR_GONE


class LostAtClose(StageServer):
    """Serves every step, then its connection drops when the coordinator asks for its receipt (a
    restart or a network cut right after the last token)."""

    async def _serve(self, conn, action):
        if isinstance(action, CloseSessions):
            conn.ws.transport.abort()
            return
        await super()._serve(conn, action)


def test_a_stage_lost_after_the_last_token_leaves_the_client_its_answer_unverified_and_unpaid(
    control_plane, api_key, monkeypatch
):
    state, job_pk, events = run_with_rogue(api_key, monkeypatch, rogue_server=LostAtClose)

    job = Job.objects.get(pk=job_pk)
    assert state == JobState.SUCCEEDED
    assert events[-1]["type"] == "job.done"  # every token reached the client: no error event
    assert tokens_of(events) == job.completion_tokens == MAX_TOKENS
    assert job.verified is False
    assert "lost before it sent its receipt" in job.verification_error
    assert job.charged_amount == 0  # unverified: the customer pays nothing
    assert job.receipts and job.route[1]["node"] not in {r["node"] for r in job.receipts}  # the others' are kept
    # These stages' nodes are in no registry: nobody to pay or strike here (tests/test_hostile_failures.py
    # has a registered dropper: struck and unpaid, its neighbours paid for what their receipts prove).
    assert Earning.objects.count() == 0
    assert Strike.objects.count() == 0
