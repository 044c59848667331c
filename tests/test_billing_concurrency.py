"""Money under concurrency, through the public API with the `openai` SDK: 100 concurrent streaming
requests from one customer whose credits cover only some of them, on three real tiny-llama agents."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import httpx2 as httpx
import openai
import pytest
from django.db.models import Count, Q, Sum
from django.utils import timezone

from marketplace.billing import services
from marketplace.billing.models import AccountKind, LedgerAccount, ModelPrice, Transfer
from marketplace.billing.services import add_credits_url
from marketplace.jobs.models import ApiKey, Job, JobState
from marketplace.jobs.services import create_api_key
from marketplace.nodes.joining import create_node
from marketplace.placement.selectors import servable_pipelines
from tests.live import LiveServer, wait_for
from worker_agent.dev.local import join_agent, stop_processes
from worker_agent.model import load_tokenizer

pytestmark = [pytest.mark.billing, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-llama"
PROMPT_PRICE = 7_000_000_000  # nano-dollars per million tokens: $7.00
COMPLETION_PRICE = 13_000_000_000  # $13.00
MAX_TOKENS = 8
REQUESTS = 100
PROMPT = "Tell me a story."


@pytest.fixture
def tiny_api(settings, django_user_model, tmp_path):
    """A live control plane with three joined tiny-llama agents, a priced model and a customer key."""
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_COORDINATOR_LAUNCH = "inprocess"
    settings.SWARM_EMBEDDED_SCHEDULER = True
    settings.SWARM_HEARTBEAT_INTERVAL_S = 0.5
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 30.0
    settings.SWARM_SWEEP_INTERVAL_S = 0.5
    settings.SWARM_SPARES_PER_PIPELINE = 0
    # The production channel layer: every token and job event travels through Redis, as between
    # a web process and the coordinator workers. (A response's receive cancelled by its liveness
    # check lost the event arriving then, and one stream in about 30 stalled: see api/reply.py.)
    assert settings.REDIS_URL, "the tests run against Redis: set REDIS_URL"
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [{"address": settings.REDIS_URL, "socket_timeout": 30}], "capacity": 4096},
        }
    }
    ModelPrice.objects.create(
        model=MODEL,
        prompt_per_million=PROMPT_PRICE,
        completion_per_million=COMPLETION_PRICE,
        effective_from=timezone.now(),
    )
    provider = django_user_model.objects.create_user(username="p", email="p@e.com", password="x", is_provider=True)
    customer = django_user_model.objects.create_user(username="c", email="c@e.com", password="x", is_customer=True)
    api_key, key = create_api_key(customer, "load")
    ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=10_000, tokens_per_minute=10_000_000)
    server = LiveServer().start()
    agents = []
    try:
        for i in range(3):
            _, token = create_node(owner=provider, name=f"n{i}")
            agents.append(
                join_agent(
                    server.url, token, tmp_path / f"n{i}.key", tmp_path / f"agent{i}.log", model=MODEL, max_layers=2
                )
            )
        wait_for(lambda: servable_pipelines(MODEL), 180, "a ready tiny-llama pipeline")
        yield server, customer, key
    finally:
        stop_processes(agents)
        server.stop()


async def one_request(client: openai.AsyncOpenAI, index: int):
    """Returns ("ok", usage, job id) or ("402", None, None)."""
    try:
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage, job_id = None, None
        async for chunk in stream:
            job_id = chunk.id
            if chunk.usage:
                usage = chunk.usage
        return "ok", usage, job_id
    except openai.APIStatusError as exc:
        if exc.status_code == 402:
            assert exc.response.headers["x-should-retry"] == "false"
            assert exc.body["code"] == "insufficient_quota"
            # The message says where to add credits: the billing page, as a client can open it.
            assert exc.body["message"] == f"Insufficient credits: add credits at {add_credits_url()} to continue."
            assert add_credits_url().endswith("/customer/billing/")
            return "402", None, None
        raise


def test_concurrent_requests_are_admitted_only_while_credits_last_and_each_is_settled_once(tiny_api):
    server, customer, key = tiny_api
    tokenizer_prompt_tokens = len(load_tokenizer(MODEL)(PROMPT)["input_ids"])
    hold = services.cost(tokenizer_prompt_tokens, MAX_TOKENS, (PROMPT_PRICE, COMPLETION_PRICE))
    services.grant(customer, str(Decimal(hold * 30 + hold // 2) / 1_000_000_000))  # covers 30.5 worst cases
    granted = services.credits(customer)

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1",
            api_key=key,
            max_retries=0,
            timeout=300,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=200)),
        ) as c:
            return await asyncio.gather(*(one_request(c, i) for i in range(REQUESTS)))

    outcomes = asyncio.run(run_all())

    admitted = [o for o in outcomes if o[0] == "ok"]
    refused = [o for o in outcomes if o[0] == "402"]
    assert len(admitted) + len(refused) == REQUESTS
    assert len(admitted) >= 30 and refused  # the credits ran out, and every admission was covered
    wait_for(lambda: not Job.objects.filter(settled_at__isnull=True).exists(), 60, "every job to settle")
    jobs = list(Job.objects.all())
    assert len(jobs) == len(admitted)  # a refused request left no job behind
    assert {j.public_id for j in jobs} == {o[2] for o in admitted}
    assert all(j.state == JobState.SUCCEEDED for j in jobs)
    assert all(j.prompt_tokens == tokenizer_prompt_tokens for j in jobs)
    for _, usage, job_id in admitted:
        job = next(j for j in jobs if j.public_id == job_id)
        assert (usage.prompt_tokens, usage.completion_tokens) == (job.prompt_tokens, job.completion_tokens)
    # Settled exactly once: one hold and one charge per job, holds all released.
    for kind in ("hold", "charge"):
        per_job = Transfer.objects.filter(kind=kind).values("job").annotate(n=Count("id")).values_list("n", flat=True)
        assert sorted(per_job) == [1] * len(jobs)
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == 0
    # The sum of charges is the metered tokens times the price, to the last nano-dollar.
    charged = Transfer.objects.filter(kind="charge").aggregate(s=Sum("amount"))["s"]
    expected = sum(services.cost(j.prompt_tokens, j.completion_tokens, (PROMPT_PRICE, COMPLETION_PRICE)) for j in jobs)
    assert charged == expected == sum(j.charged_amount for j in jobs)
    assert services.credits(customer) == granted - charged
    # The customer's spendable credit never went below zero, at any transfer.
    running = 0
    credit = services.account(AccountKind.CUSTOMER_CREDIT, customer)
    for t in Transfer.objects.filter(Q(debit=credit) | Q(credit=credit)).order_by("id"):
        running += t.amount if t.credit_id == credit.pk else -t.amount
        assert running >= 0
    # Every account's balance is the sum of its transfers, and all balances sum to zero.
    for account in LedgerAccount.objects.all():
        inflow = Transfer.objects.filter(credit=account).aggregate(s=Sum("amount"))["s"] or 0
        outflow = Transfer.objects.filter(debit=account).aggregate(s=Sum("amount"))["s"] or 0
        assert account.balance == inflow - outflow
    assert sum(a.balance for a in LedgerAccount.objects.all()) == 0


def test_credits_usage_grows_by_the_listed_prices_and_generations_agree_with_usage(tiny_api):
    server, customer, key = tiny_api
    services.grant(customer, 1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    (listed,) = client.models.list().data
    pricing = listed.model_extra["pricing"]
    before = http.get("/api/v1/credits").json()["data"]["total_usage"]

    responses = [
        client.completions.create(model=MODEL, prompt=f"Say {word}", max_tokens=n, temperature=0)
        for word, n in (("one", 3), ("two", 5), ("three", 1))
    ]

    expected = sum(
        Decimal(r.usage.prompt_tokens) * Decimal(pricing["prompt"])
        + Decimal(r.usage.completion_tokens) * Decimal(pricing["completion"])
        for r in responses
    )
    wait_for(lambda: not Job.objects.filter(settled_at__isnull=True).exists(), 30, "every job to settle")
    after = http.get("/api/v1/credits").json()["data"]["total_usage"]
    assert Decimal(str(after)) - Decimal(str(before)) == expected
    for response in responses:
        record = http.get("/api/v1/generation", params={"id": response.id}).json()["data"]
        assert (record["tokens_prompt"], record["tokens_completion"], record["model"]) == (
            response.usage.prompt_tokens,
            response.usage.completion_tokens,
            MODEL,
        )
        assert Decimal(str(record["total_cost"])) == (
            Decimal(response.usage.prompt_tokens) * Decimal(pricing["prompt"])
            + Decimal(response.usage.completion_tokens) * Decimal(pricing["completion"])
        )


def test_a_client_that_disconnects_mid_stream_pays_exactly_the_tokens_it_was_sent(tiny_api):
    server, customer, key = tiny_api
    services.grant(customer, 1)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}

    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response,
    ):
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 3:
                break  # leaving the block closes the connection mid-stream

    job = wait_for(
        lambda: Job.objects.filter(state=JobState.CANCELLED, settled_at__isnull=False).first(),
        60,
        "the job to end as cancelled and settle",
    )
    assert job.error_code == "client_disconnected"
    assert 3 <= job.completion_tokens < 200
    assert job.charged_amount == services.cost(
        job.prompt_tokens, job.completion_tokens, (PROMPT_PRICE, COMPLETION_PRICE)
    )
    assert services.credits(customer) == 1_000_000_000 - job.charged_amount
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == 0
