"""``Idempotency-Key``: a request retried with the same key and body gets the first attempt's answer
again (whole or streamed), runs no job and is charged once; a key reused with another body is
refused; a first attempt that failed or was left by its client lets the retry run afresh. Through
the official ``openai`` SDK against the live API on three real smollm2 agents, priced."""

from __future__ import annotations

import uuid
from datetime import timedelta

import openai
import pytest
from django.utils import timezone
from openai import OpenAI

from marketplace.billing.models import AccountKind, Transfer
from marketplace.billing.services import account, credits, grant, transfer
from marketplace.jobs import idempotency
from marketplace.jobs.models import IdempotentRequest, Job
from tests.api_fixtures import MODEL, module_db, wait_for

pytestmark = [pytest.mark.api, pytest.mark.billing]
pytest_plugins = ["tests.api_fixtures"]
db = module_db

CHAT = [{"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 6


@pytest.fixture
def client(live_swarm, priced) -> OpenAI:
    grant(live_swarm.customer, 1)
    return OpenAI(base_url=f"{live_swarm.url}/v1", api_key=live_swarm.key, max_retries=0, timeout=180)


def settled() -> None:
    wait_for(lambda: not Job.objects.filter(settled_at__isnull=True).exists(), 60, "the jobs to settle")


def key() -> str:
    return f"retry-{uuid.uuid4().hex}"


def test_a_retry_with_the_same_key_gets_the_first_answer_and_is_charged_once(live_swarm, client):
    headers = {"Idempotency-Key": key()}
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=1.0, n=2, extra_headers=headers
    )
    settled()
    jobs, charges = Job.objects.count(), Transfer.objects.filter(kind="charge").count()
    balance = credits(live_swarm.customer)

    again = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=1.0, n=2, extra_headers=headers
    )

    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert again.parse().model_dump() == first.parse().model_dump()  # sampled text and all: the same answer
    assert (Job.objects.count(), Transfer.objects.filter(kind="charge").count()) == (jobs, charges)
    assert credits(live_swarm.customer) == balance


def test_a_streamed_retry_replays_the_answer_as_a_stream(live_swarm, client):
    headers = {"Idempotency-Key": key()}
    request = dict(
        model=MODEL,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
    )

    def text_and_usage(chunks) -> tuple[str, list, str, object]:
        choices = [choice for chunk in chunks for choice in chunk.choices]
        content = [c for choice in choices if choice.logprobs for c in choice.logprobs.content or []]
        text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
        finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
        return text, [(c.token, c.logprob) for c in content], finish, chunks[-1].usage

    first = text_and_usage(list(client.chat.completions.create(**request)))
    # The SDK closed the connection on [DONE]: the answer was kept before [DONE] went out.
    record = IdempotentRequest.objects.get(key=headers["Idempotency-Key"])
    assert record.state == IdempotentRequest.State.DONE
    settled()
    jobs = Job.objects.count()
    again = text_and_usage(list(client.chat.completions.create(**request)))

    assert again == first
    assert first[0] and first[1] and first[3].completion_tokens >= 1
    assert Job.objects.count() == jobs
    # The kept answer is the whole response a non-streamed request gets.
    record = IdempotentRequest.objects.get(key=headers["Idempotency-Key"])
    assert record.state == IdempotentRequest.State.DONE
    assert record.response["choices"][0]["message"]["content"] == first[0]
    assert record.response["object"] == "chat.completion"


def test_a_key_reused_with_another_body_is_refused_400(live_swarm, client):
    headers = {"Idempotency-Key": key()}
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, extra_headers=headers)
    jobs = Job.objects.count()

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS + 1, extra_headers=headers)

    assert refused.value.body["code"] == "idempotency_key_reused"
    assert Job.objects.count() == jobs


@pytest.mark.parametrize("value", ["", "x" * 256, "two words", "tab\there"])
def test_a_malformed_key_is_refused_400(live_swarm, client, value):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, extra_headers={"Idempotency-Key": value}
        )
    assert refused.value.body["code"] == "invalid_idempotency_key"


def test_a_first_attempt_refused_402_lets_the_retry_run_once_credits_are_added(live_swarm, client):
    headers = {"Idempotency-Key": key()}
    credit, grants = account(AccountKind.CUSTOMER_CREDIT, live_swarm.customer), account(AccountKind.GRANTS)
    transfer(credit, grants, credits(live_swarm.customer), kind="grant", memo="test: credits taken back")
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_headers=headers)
    assert refused.value.status_code == 402
    grant(live_swarm.customer, 1)

    answer = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hello", max_tokens=4, extra_headers=headers
    )

    assert "Idempotent-Replayed" not in answer.headers
    assert Job.objects.get(public_id=answer.parse().id).completion_tokens >= 1


def test_a_first_attempt_whose_client_left_lets_the_retry_run(live_swarm, client):
    headers = {"Idempotency-Key": key()}
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=64, temperature=0, stream=True, extra_headers=headers
    )
    next(iter(stream))
    stream.close()  # the client leaves mid-stream: the job is stopped and the key let go
    wait_for(
        lambda: (
            IdempotentRequest.objects.get(key=headers["Idempotency-Key"]).state == IdempotentRequest.State.ABANDONED
        ),
        60,
        "the abandoned attempt to let its key go",
    )

    answer = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=64, temperature=0, stream=True, extra_headers=headers
    )

    assert "Idempotent-Replayed" not in answer.headers
    assert "".join(c.choices[0].delta.content or "" for c in answer.parse() if c.choices)


def test_keys_past_their_time_are_forgotten(live_swarm):
    old = IdempotentRequest.objects.create(
        customer=live_swarm.customer, key=key(), body_sha256="0" * 64, created_at=timezone.now() - timedelta(days=2)
    )
    recent = IdempotentRequest.objects.create(
        customer=live_swarm.customer, key=key(), body_sha256="0" * 64, created_at=timezone.now()
    )

    assert idempotency.forget_expired() >= 1

    assert not IdempotentRequest.objects.filter(pk=old.pk).exists()
    assert IdempotentRequest.objects.filter(pk=recent.pk).exists()
