"""``n`` choices per request, through the official ``openai`` SDK against the live API on three real
smollm2 agents. Each choice runs as a job of its own (its own route, hold, receipts and settlement)
and is billed as a request of its own; the response carries every choice with its index, choice 0's
id, and the usage summed over the choices. Streamed, every chunk names its choice's index."""

from __future__ import annotations

from collections import defaultdict

import httpx2
import openai
import pytest
from openai import OpenAI

from marketplace.billing.models import AccountKind, Transfer
from marketplace.billing.services import account, cost, credits, grant, transfer
from marketplace.jobs.models import Job, JobState
from tests.api_fixtures import MODEL, greedy_chat, module_db, wait_for

pytestmark = [pytest.mark.api]
pytest_plugins = ["tests.api_fixtures"]
db = module_db

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8


@pytest.fixture
def client(live_swarm) -> OpenAI:
    return OpenAI(base_url=f"{live_swarm.url}/v1", api_key=live_swarm.key, max_retries=0, timeout=180)


def choices_of(public_id: str) -> list[Job]:
    """The jobs of one response, by choice, once every one of them settled."""
    first = Job.objects.get(public_id=public_id)
    jobs = [first, *first.other_choices.order_by("choice_index")]
    pks = [job.pk for job in jobs]
    wait_for(lambda: not Job.objects.filter(pk__in=pks, settled_at__isnull=True).exists(), 60, "the choices to settle")
    return list(Job.objects.filter(pk__in=pks).order_by("choice_index"))


@pytest.mark.billing
def test_n_3_returns_3_choices_each_a_verified_job_billed_as_a_request_of_its_own(live_swarm, client, priced):
    reference = greedy_chat(CHAT, MAX_TOKENS)
    grant(live_swarm.customer, 1)
    before = credits(live_swarm.customer)

    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, n=3)

    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [choice.message.content for choice in response.choices] == [reference.text] * 3
    assert [choice.finish_reason for choice in response.choices] == [reference.finish_reason] * 3
    completion = len(reference.token_ids)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (
        3 * reference.prompt_tokens,
        3 * completion,
    )
    assert response.usage.total_tokens == 3 * (reference.prompt_tokens + completion)
    jobs = choices_of(response.id)
    assert [job.public_id for job in jobs] == [response.id, f"{response.id}-1", f"{response.id}-2"]
    assert [job.choice_index for job in jobs] == [0, 1, 2]
    assert [job.first_choice_id for job in jobs] == [None, jobs[0].pk, jobs[0].pk]
    for job in jobs:
        assert job.state == JobState.SUCCEEDED and job.verified is True, job.verification_error
        assert (job.prompt_tokens, job.completion_tokens) == (reference.prompt_tokens, completion)
        assert {r["job"] for r in job.receipts} == {job.public_id}  # each choice signed as its own job
        assert job.charged_amount == cost(reference.prompt_tokens, completion, priced) > 0
    # Three requests' worth left the customer's credits, through three holds, all settled.
    charged = sum(job.charged_amount for job in jobs)
    assert before - credits(live_swarm.customer) == charged == 3 * cost(reference.prompt_tokens, completion, priced)
    assert Transfer.objects.filter(job__in=jobs, kind="hold").count() == 3
    assert Transfer.objects.filter(job__in=jobs, kind="charge").count() == 3
    assert account(AccountKind.CUSTOMER_HOLD, live_swarm.customer).balance == 0


@pytest.mark.billing
def test_n_choices_the_credits_do_not_all_cover_are_refused_402_with_no_job_and_no_hold(live_swarm, client, priced):
    hold_one = cost(greedy_chat(CHAT, MAX_TOKENS).prompt_tokens, MAX_TOKENS, priced)  # one choice's hold
    credit, grants = account(AccountKind.CUSTOMER_CREDIT, live_swarm.customer), account(AccountKind.GRANTS)
    if credits(live_swarm.customer):  # the customer is left with two choices' credits, less a nano-dollar
        transfer(credit, grants, credits(live_swarm.customer), kind="grant", memo="test: credits taken back")
    transfer(grants, credit, 2 * hold_one - 1, kind="grant", memo="test: credits for two choices, nearly")
    jobs_before, transfers_before = Job.objects.count(), Transfer.objects.count()

    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, n=3)

    assert refused.value.status_code == 402
    assert (Job.objects.count(), Transfer.objects.count()) == (jobs_before, transfers_before)
    assert credits(live_swarm.customer) == 2 * hold_one - 1
    one = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, n=1)
    assert len(one.choices) == 1  # one choice fits: the refusal was about the three


def test_seeded_choices_each_replay_and_choice_i_is_the_request_seeded_seed_plus_i(live_swarm, client):
    def sample(n: int, seed: int) -> list[str]:
        response = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=n
        )
        return [choice.message.content for choice in response.choices]

    first = sample(3, 4242)

    assert sample(3, 4242) == first
    assert sample(1, 4243) == [first[1]]
    assert sample(1, 4244) == [first[2]]


def test_streamed_choices_name_their_index_and_end_with_the_summed_usage(live_swarm, client):
    reference = greedy_chat(CHAT, MAX_TOKENS)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    assert len({chunk.id for chunk in chunks}) == 1
    text, finish, roles = defaultdict(str), {}, set()
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert roles == {0, 1}
    assert dict(text) == {0: reference.text, 1: reference.text}
    assert finish == {0: reference.finish_reason, 1: reference.finish_reason}
    usage = chunks[-1]
    assert usage.choices == []
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (
        2 * reference.prompt_tokens,
        2 * len(reference.token_ids),
    )
    assert len(choices_of(chunks[0].id)) == 2


@pytest.mark.parametrize("n", [0, 9, "2", True, 1.5])
def test_a_bad_n_is_refused_400_naming_it(live_swarm, client, n):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, n=n)
    assert refused.value.body["param"] == "n"
    assert "'n' must be an integer in [1, 8]" in refused.value.body["message"]


def test_a_text_completion_takes_n_too(live_swarm):
    response = httpx2.post(
        f"{live_swarm.url}/v1/completions",
        headers={"Authorization": f"Bearer {live_swarm.key}"},
        json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "n": 2},
        timeout=180,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]
    assert body["usage"]["completion_tokens"] == sum(job.completion_tokens for job in choices_of(body["id"]))
