"""Backpressure at admission: a stage carries at most as many jobs as its node holds sessions
(what its agent reported, capped by SWARM_JOBS_PER_NODE). A request that finds every route full
queues for a free one (``marketplace.api.admission``) and is admitted when a job ends; past
SWARM_QUEUE_WAIT_S it answers 503 ``overloaded`` with Retry-After, and nothing was held for it."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from django.db import connections

from marketplace.api import admission
from marketplace.api.errors import error_response
from marketplace.billing.models import Transfer
from marketplace.billing.services import grant
from marketplace.flows import admission as flows_admission
from marketplace.jobs import services
from marketplace.jobs.errors import Overloaded
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.jobs.services import create_api_key
from marketplace.nodes.models import Node
from marketplace.placement.placing import place_model
from marketplace.placement.readiness import assignment_ready
from marketplace.placement.selectors import route_request

pytest_plugins = ["tests.factories", "tests.control_fixtures"]
pytestmark = pytest.mark.control

MODEL = "tiny-llama"


@pytest.fixture
def placed(settings, provider, make_joined_node, swarm_settings, measure_ring):
    """Two nodes each holding half of tiny-llama as one ready pipeline."""
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_SPARES_PER_PIPELINE = 0
    settings.SWARM_JOBS_PER_NODE = 2
    nodes = [make_joined_node(provider, f"gpu-{i}", max_layers=3).node for i in range(2)]
    measure_ring(nodes)
    for assignment in place_model(MODEL):
        assignment_ready(assignment.node_id, assignment.pk, f"ws://127.0.0.1:{9000 + assignment.node_id}")
    return nodes


@pytest.fixture
def api_key(customer):
    grant(customer, 10, memo="credits")
    return create_api_key(customer, "queue")[0]


def admit(api_key) -> list[Job]:
    params = RequestParams(max_tokens=4, temperature=0.0, prompt="Once upon a time")
    return flows_admission.admit_jobs(
        api_key=api_key,
        kind="completion",
        model=MODEL,
        params=params,
        prompt_ids=services.tokenize_prompt(MODEL, params),
    )


@pytest.mark.django_db
def test_a_full_route_refuses_the_next_job_as_overloaded_until_one_ends(placed, api_key):
    first, second = admit(api_key)[0], admit(api_key)[0]
    holds = Transfer.objects.count()

    with pytest.raises(Overloaded) as refused:
        admit(api_key)
    assert refused.value.retry_after > 0
    assert Transfer.objects.count() == holds  # nothing held for the refused request

    Job.objects.filter(pk=first.pk).update(state=JobState.SUCCEEDED)
    third = admit(api_key)[0]
    assert {stage["node"] for stage in third.route} == {n.node_id for n in placed}
    assert second.state == JobState.QUEUED


@pytest.mark.django_db
def test_a_node_that_reported_fewer_sessions_caps_its_stage_there(placed, api_key):
    Node.objects.filter(pk=placed[0].pk).update(max_sessions=1)
    admit(api_key)

    assert route_request(MODEL, flows_admission.jobs_in_flight()) is None  # its one session is taken
    assert route_request(MODEL) is not None  # the model itself is servable: overloaded, not down
    with pytest.raises(Overloaded):
        admit(api_key)


def test_a_queued_request_is_admitted_when_a_job_ends_and_one_that_waits_too_long_gets_503(
    transactional_db, settings, placed, api_key
):
    settings.SWARM_JOBS_PER_NODE = 1
    running = admit(api_key)[0]
    params = RequestParams(max_tokens=4, temperature=0.0, prompt="Once upon a time")
    request = {
        "api_key": api_key,
        "kind": "completion",
        "model": MODEL,
        "params": params,
        "prompt_ids": services.tokenize_prompt(MODEL, params),
    }

    settings.SWARM_QUEUE_WAIT_S = 0.3
    with pytest.raises(Overloaded) as refused:
        asyncio.run(admission.admit(**request))
    response = error_response(refused.value)
    assert response.status_code == 503
    assert json.loads(response.content)["error"]["code"] == "overloaded"
    assert int(response["Retry-After"]) > 0

    settings.SWARM_QUEUE_WAIT_S = 60.0
    admitted = threading.Event()

    def end_the_running_job() -> None:
        try:
            Job.objects.filter(pk=running.pk).update(state=JobState.SUCCEEDED)
        finally:
            connections.close_all()

    async def queue_then_free() -> list[Job]:
        waiting = asyncio.create_task(admission.admit(**request))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # queued behind the running job
        await asyncio.to_thread(end_the_running_job)
        admission.job_ended()  # as the running job's stream does when it sees the end
        jobs = await asyncio.wait_for(waiting, 10)
        admitted.set()
        return jobs

    jobs = asyncio.run(queue_then_free())
    assert admitted.is_set() and jobs[0].state == JobState.QUEUED


def test_a_full_model_s_line_is_first_come_first_served_and_only_its_head_asks(
    transactional_db, settings, placed, api_key, monkeypatch
):
    settings.SWARM_JOBS_PER_NODE = 1
    running = admit(api_key)[0]
    params = RequestParams(max_tokens=4, temperature=0.0, prompt="Once upon a time")
    prompt_ids = services.tokenize_prompt(MODEL, params)
    asked: list[str] = []  # the request id of every admission the database was asked for
    admit_jobs = flows_admission.admit_jobs

    def counted(**job):
        asked.append(job["request_id"])
        return admit_jobs(**job)

    monkeypatch.setattr(flows_admission, "admit_jobs", counted)

    def end(job_pk: int) -> None:
        try:
            Job.objects.filter(pk=job_pk).update(state=JobState.SUCCEEDED)
        finally:
            connections.close_all()

    async def scenario() -> list[str]:
        admitted: list[str] = []

        async def request(name: str) -> None:
            jobs = await admission.admit(
                api_key=api_key, kind="completion", model=MODEL, params=params, prompt_ids=prompt_ids, request_id=name
            )
            admitted.append(name)
            await asyncio.to_thread(end, jobs[0].pk)  # it ran: its session is free again
            admission.job_ended()

        waiting = []
        for name in ("r0", "r1", "r2", "r3"):
            waiting.append(asyncio.create_task(request(name)))
            await asyncio.sleep(0.05)  # in this order
        for _ in range(3):  # streams of other requests end, freeing nothing: only the head asks again
            admission.job_ended()
            await asyncio.sleep(0.05)
        assert set(asked) == {"r0"}
        await asyncio.to_thread(end, running.pk)
        admission.job_ended()
        await asyncio.wait_for(asyncio.gather(*waiting), 30)
        return admitted

    admitted = asyncio.run(scenario())

    assert admitted == ["r0", "r1", "r2", "r3"]
    assert asked[: asked.index("r1")] == ["r0"] * asked.index("r1")  # nobody else asked while r0 waited
