"""Real requests through the official ``openai`` client move the control plane's job series: jobs
finished by state, time to first token, decode rate, tokens, speculation, and the HTTP counter of the
endpoint that served them. A live control plane serves smollm2-135m over three joined agents
(tests/api_fixtures.py); each test scrapes ``/metrics`` before and after its request."""

from __future__ import annotations

import urllib.request

import pytest
from openai import OpenAI

from marketplace.jobs.models import Job, JobState
from tests.api_fixtures import MODEL, module_db, wait_for
from tests.scrape import moved, samples, value

# The module's tests share one live swarm, whose rows must outlive each test.
pytestmark = [pytest.mark.api]
pytest_plugins = ["tests.api_fixtures"]
db = module_db

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8
CHAT_ROUTE = "/v1/chat/completions"


@pytest.fixture
def client(live_swarm) -> OpenAI:
    return OpenAI(base_url=f"{live_swarm.url}/v1", api_key=live_swarm.key, max_retries=0, timeout=180)


def scrape(swarm) -> str:
    with urllib.request.urlopen(f"{swarm.url}/metrics", timeout=60) as response:
        return response.read().decode()


def test_a_chat_completion_moves_the_job_and_http_series(live_swarm, client):
    before = scrape(live_swarm)

    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    after = scrape(live_swarm)

    job = Job.objects.get(public_id=reply.id)
    assert job.state == JobState.SUCCEEDED
    assert job.ttft_ms is not None and job.tokens_per_s is not None
    assert moved(before, after, "swarm_jobs_finished_total", model=MODEL, state="succeeded") == 1
    assert moved(before, after, "swarm_job_ttft_seconds_count", model=MODEL) == 1
    assert moved(before, after, "swarm_job_ttft_seconds_sum", model=MODEL) == pytest.approx(job.ttft_ms / 1000)
    assert moved(before, after, "swarm_job_decode_tokens_per_second_count", model=MODEL) == 1
    assert moved(before, after, "swarm_job_tokens_total", model=MODEL, kind="prompt") == reply.usage.prompt_tokens
    assert (
        moved(before, after, "swarm_job_tokens_total", model=MODEL, kind="completion") == reply.usage.completion_tokens
    )
    assert moved(before, after, "swarm_speculative_drafted_tokens_total", model=MODEL) == job.drafted_tokens
    assert moved(before, after, "swarm_speculative_accepted_tokens_total", model=MODEL) == job.accepted_tokens
    assert moved(before, after, "swarm_http_requests_total", endpoint=CHAT_ROUTE, method="POST", status="200") == 1
    assert value(after, "swarm_jobs_in_flight", model=MODEL, state="running") == 0
    assert value(after, "swarm_assignments", model=MODEL, state="ready", role="serving") == 3
    assert value(after, "swarm_nodes", state="active") == 3


def test_a_completion_counts_the_models_cpu_by_part(live_swarm, client):
    """The coordinator's embeddings, LM head and sampling are counted as the model's CPU, apart from
    the control plane's own (bench/load.py's per-process table subtracts them)."""

    def spent(body: str, part: str) -> float:
        return sum(
            seconds
            for (name, labels), seconds in samples(body).items()
            if name == "swarm_model_cpu_seconds_total" and ("part", part) in labels
        )

    before = scrape(live_swarm)
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    after = scrape(live_swarm)

    for part in ("embed", "head", "sampling"):
        assert spent(after, part) > spent(before, part), part


def test_a_streamed_completion_is_timed_to_the_end_of_its_stream(live_swarm, client):
    before = scrape(live_swarm)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    # The request is recorded once its stream has ended, just after the client read the last chunk.
    timed = ("swarm_http_request_duration_seconds_count", frozenset({("endpoint", CHAT_ROUTE), ("method", "POST")}))

    def recorded() -> str | None:
        body = scrape(live_swarm)
        return body if samples(body).get(timed, 0) > samples(before).get(timed, 0) else None

    after = wait_for(recorded, 60, "the streamed request to be recorded")

    usage = chunks[-1].usage
    assert moved(before, after, "swarm_http_request_duration_seconds_count", endpoint=CHAT_ROUTE, method="POST") == 1
    assert moved(before, after, "swarm_http_requests_total", endpoint=CHAT_ROUTE, method="POST", status="200") == 1
    assert moved(before, after, "swarm_jobs_finished_total", model=MODEL, state="succeeded") == 1
    assert moved(before, after, "swarm_job_tokens_total", model=MODEL, kind="completion") == usage.completion_tokens
