"""The runner keeps each succeeded job's step times, and challenges keep to them.

A job run through the real runner (``runner.run_job``) on three in-process stages of tiny-llama is
stored with when each stage of its route put out each of its first steps (``Job.step_outputs_s``);
``recent_shapes`` reads them back, so the pace a challenge draws (``challenger.Pace``) holds the
jobs' first outputs and gaps per stage. Jobs without them (ended before they were recorded, failed,
healed) keep the mean pace of their decoding rate alone.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
from asgiref.sync import sync_to_async

from marketplace.billing.services import grant
from marketplace.flows import runner
from marketplace.jobs import services
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.payouts.models import Earning
from marketplace.verification import traffic
from marketplace.verification.traffic import (
    STEP_OUTPUTS_KEPT,
    TrafficShape,
    draw_request,
    kept_step_outputs,
    recent_shapes,
)
from tests import stage_fixtures
from tests.stage_fixtures import stage_servers
from worker_agent.coordinator.challenger import Pace
from worker_agent.protocol.keys import generate_signing_key

pytest_plugins = ["tests.factories"]

SPANS = [(0, 2), (2, 4), (4, 6)]
KEPT = 4  # steps kept per stage in the runner's test: fewer than the job takes
MAX_TOKENS = 6  # plain decoding: a prefill step, then one step per token after the first


def test_keeps_the_first_steps_of_each_stage_rounded_to_the_millisecond():
    outputs = [[0.1234, *(0.2 + 0.01 * step for step in range(STEP_OUTPUTS_KEPT + 5))], [0.5, 0.5, 2]]

    kept = kept_step_outputs(outputs)

    assert len(kept[0]) == STEP_OUTPUTS_KEPT
    assert kept[0][:3] == (0.123, 0.2, 0.21)
    assert kept[1] == (0.5, 0.5, 2.0)


@pytest.mark.parametrize(
    "outputs",
    [
        None,
        "0.1,0.2",
        {"0": [0.1]},
        [],  # no stage
        [[0.1], []],  # a stage that put out nothing: a partial record
        [[0.1], "0.2"],
        [[0.1, "0.2"]],
        [[0.1, True]],
        [[0.1, float("nan")]],
        [[0.1, float("inf")]],
        [[-0.1, 0.2]],
        [[0.3, 0.2]],  # out of order
        [[0.1]] * (traffic.MAX_STAGES + 1),
    ],
)
def test_keeps_nothing_of_a_malformed_record(outputs):
    assert kept_step_outputs(outputs) == ()


def _job(customer, public_id: str, **fields) -> Job:
    api_key, _ = services.create_api_key(customer, public_id)
    return Job.objects.create(
        public_id=public_id, kind="chat", customer=customer, api_key=api_key, model=stage_fixtures.MODEL,
        params={"max_tokens": 8}, prompt_tokens=5, **fields,
    )  # fmt: skip


@pytest.mark.django_db
def test_finish_job_keeps_step_times_of_a_succeeded_job_only(customer):
    succeeded, failed = _job(customer, "chatcmpl-a"), _job(customer, "chatcmpl-b")
    outputs = ((0.0104, 0.02), (0.0156, 0.03))

    services.finish_job(succeeded.pk, state=JobState.SUCCEEDED, completion_tokens=2, step_outputs_s=outputs)
    services.finish_job(failed.pk, state=JobState.FAILED, completion_tokens=1, step_outputs_s=outputs)

    assert Job.objects.get(pk=succeeded.pk).step_outputs_s == [[0.01, 0.02], [0.016, 0.03]]
    assert Job.objects.get(pk=failed.pk).step_outputs_s == []


@pytest.mark.django_db
def test_finish_job_keeps_nothing_of_malformed_step_times(customer):
    job = _job(customer, "chatcmpl-c")

    services.finish_job(job.pk, state=JobState.SUCCEEDED, completion_tokens=2, step_outputs_s=[[0.2, 0.1]])

    job.refresh_from_db()
    assert (job.state, job.completion_tokens, job.step_outputs_s) == (JobState.SUCCEEDED, 2, [])


@pytest.mark.django_db
def test_jobs_without_step_times_keep_the_mean_pace(customer, provider, make_joined_node):
    node = make_joined_node(provider, "gpu-0").node
    old = _job(customer, f"chatcmpl-{'1' * 32}", completion_tokens=4, tokens_per_s=20.0, state=JobState.SUCCEEDED)
    garbled = _job(customer, f"chatcmpl-{'2' * 32}", completion_tokens=4, tokens_per_s=20.0, step_outputs_s="x")
    for job in (old, garbled):
        Earning.objects.create(
            node=node, provider=provider, job=job, amount=1, layer_tokens=1, available_at=job.created_at
        )

    shapes = recent_shapes(stage_fixtures.MODEL)

    assert [shape.step_outputs_s for shape in shapes] == [(), ()]
    assert shapes[0].pace == Pace(0.05, firsts_s=(), gaps_s=())


@pytest.fixture
def control_plane(settings, tmp_path):
    with stage_fixtures.in_memory_control_plane(
        settings, tmp_path, SWARM_AUDIT_NEW_NODE_FRACTION=0.0, SWARM_AUDIT_MIN_FRACTION=0.0
    ) as configured:
        yield configured


@pytest.mark.django_db(transaction=True)
def test_a_job_run_by_the_runner_keeps_its_step_times_for_challenges(
    control_plane, customer, provider, make_joined_node, monkeypatch
):
    monkeypatch.setattr(traffic, "STEP_OUTPUTS_KEPT", KEPT)
    grant(customer, 5)
    api_key, _ = services.create_api_key(customer, "steps")
    keys = [generate_signing_key() for _ in SPANS]
    for index, key in enumerate(keys):
        make_joined_node(provider, f"gpu-{index}", key=key)
    params = RequestParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt="Times of the steps", speculation=False)

    async def scenario() -> tuple[int, str]:
        async with stage_servers(SPANS, keys=keys) as route:
            job = await sync_to_async(stage_fixtures.admit)(api_key, route, params, monkeypatch)
            return job.pk, await runner.run_job(job.pk)

    job_pk, state = asyncio.run(scenario())

    job = Job.objects.get(pk=job_pk)
    assert (state, job.completion_tokens, job.heals, job.verified) == (JobState.SUCCEEDED, MAX_TOKENS, [], True)
    assert len(job.step_outputs_s) == len(SPANS)
    for stage in job.step_outputs_s:
        assert len(stage) == KEPT  # the job took MAX_TOKENS steps; the first KEPT are kept
        assert all(round(time, 3) == time >= 0 for time in stage)
        assert all(earlier <= later for earlier, later in itertools.pairwise(stage))
    stored = tuple(map(tuple, job.step_outputs_s))
    # Read back for the challenges: the shape, and the pace a challenge copying it keeps to.
    (shape,) = recent_shapes(stage_fixtures.MODEL)
    assert isinstance(shape, TrafficShape)
    assert (shape.job_id, shape.step_outputs_s) == (job.public_id, stored)
    drawn = draw_request(random.Random(0), [shape], ["a pool of words to draw from"], lambda text, chat: [1, 2, 3])
    assert drawn.pace is not None
    assert drawn.pace.firsts_s == tuple((stage[0],) for stage in stored)
    assert drawn.pace.gaps_s == tuple(tuple(b - a for a, b in itertools.pairwise(stage)) for stage in stored)
    assert drawn.pace.per_token_s == pytest.approx(1.0 / job.tokens_per_s)
