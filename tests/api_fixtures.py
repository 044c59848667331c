"""A live swarm for the OpenAI-compatible API's tests, and the greedy reference they compare to.

``live_swarm`` (module scope) starts the control plane on uvicorn in a thread of the test process
(sharing the test database), joins three ``swarm-worker join`` agents capped at 10 layers, so that
smollm2-135m's 30 layers are placed as one pipeline 0:10, 10:20, 20:30, and waits until it is
servable. Starting agents costs tens of seconds, so a module's tests share them, and the rows they
need outlive each test: a module using ``live_swarm`` overrides pytest-django's per-test ``db``
with ``module_db`` (``db = module_db``), which asks for the test database, opens it for the whole
module and flushes it at the end. (Without a ``db`` of module scope, ``live_swarm`` fails with a
ScopeMismatch instead of touching a database that pytest-django did not set up.)

Personas: ``provider`` (alice) owns the three nodes; ``customer`` (carol) holds the API key.

Test modules load this file with ``pytest_plugins = ["tests.api_fixtures"]`` and import its helpers,
which happens before pytest loads it as a plugin; it holds no assert statement, hence
PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache

import pytest
import torch
from django.contrib.auth import get_user_model
from django.core.cache import cache as django_cache
from django.core.management import call_command
from django.test.utils import override_settings
from django.utils import timezone

from marketplace.api import ratelimit
from marketplace.billing.models import ModelPrice
from marketplace.billing.services import grant
from marketplace.jobs import services as jobs_services
from marketplace.jobs.models import ApiKey
from marketplace.nodes import joining
from marketplace.nodes.tickets import issuer_key
from marketplace.placement.selectors import servable_pipelines
from tests.live import LiveServer
from worker_agent import model as models
from worker_agent.agent.joining import TOKEN_ENV

MODEL = "smollm2-135m"
SPANS = [(0, 10), (10, 20), (20, 30)]
SERVABLE_TIMEOUT_S = 300.0


@dataclass
class Swarm:
    url: str
    provider: object
    customer: object
    api_key: ApiKey
    key: str  # carol's API key in full
    route: list[dict]  # the one pipeline, as a job records it
    agents: list[subprocess.Popen]


def wait_for(condition, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def forget_rate_counts(api_key: ApiKey) -> None:
    """Drop the key's rate-limit counters around now: a shared cache (Redis) keeps them across
    test runs, and a new test database hands out the same primary keys again."""
    window = int(time.time() // ratelimit.WINDOW_S)
    django_cache.delete_many(
        [f"rl:{kind}:{api_key.pk}:{w}" for kind in ("req", "tok") for w in (window - 1, window, window + 1)]
    )


def join(url: str, token: str, workdir, index: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "worker_agent.agent.cli",
        "join",
        "--control-plane",
        url,
        "--key",
        str(workdir / f"agent{index}.key"),
        "--model",
        MODEL,
        "--max-layers",
        "10",
        "--threads",
        "1",
        "--log-level",
        "info",
    ]
    log = open(workdir / f"agent{index}.log", "w")  # noqa: SIM115 - owned by the child process
    env = {**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: token}  # never on the command line
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def servable_route(agents: list[subprocess.Popen], workdir) -> list[dict] | None:
    dead = [i for i, agent in enumerate(agents) if agent.poll() is not None]
    if dead:
        log = (workdir / f"agent{dead[0]}.log").read_text()[-3000:]
        raise AssertionError(f"agent {dead[0]} exited with {agents[dead[0]].returncode}:\n{log}")
    pipelines = servable_pipelines(MODEL)
    if not pipelines:
        return None
    (pipeline,) = pipelines
    spans = [(s.layer_start, s.layer_end) for s in pipeline]
    if spans != SPANS:
        raise AssertionError(f"three agents capped at 10 layers were placed as {spans}, expected {SPANS}")
    return [
        {
            "node": s.node,
            "node_key": s.node_key,
            "url": s.data_url,
            "layer_start": s.layer_start,
            "layer_end": s.layer_end,
        }
        for s in pipeline
    ]


def provider_and_customer(nodes: int, *, credits: int = 50) -> tuple[list[str], str]:
    """A provider with ``nodes`` nodes added (their join tokens) and a customer with ``credits``
    dollars and an API key whose limits a test's bursts stay under (the key)."""
    users = get_user_model().objects
    provider = users.create_user("alice", "alice@example.test", None, is_provider=True)
    customer = users.create_user("carol", "carol@example.test", None, is_customer=True)
    grant(customer, credits)
    api_key, key = jobs_services.create_api_key(customer, "carol's app")
    ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1000, tokens_per_minute=1_000_000)
    return [joining.create_node(owner=provider, name=f"gpu-{i}")[1] for i in range(nodes)], key


def stop_agents(agents: list[subprocess.Popen]) -> None:
    for agent in agents:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
    for agent in agents:
        try:
            agent.wait(timeout=15)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(timeout=15)


@pytest.fixture(scope="module")
def module_db(django_db_setup, django_db_blocker):
    """The test database, open to a module's tests and its live server until the module ends,
    then flushed as a transactional test would leave it. A module installs it as its ``db``
    fixture, which is also what makes pytest-django set the test database up for it."""
    with django_db_blocker.unblock():
        try:
            yield
        finally:
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture(scope="module")
def live_swarm(db, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("live-swarm")
    overrides = override_settings(
        SWARM_COORDINATOR_LAUNCH="inprocess",  # CI's REDIS_URL would send coordinators to Celery
        SWARM_EMBEDDED_SCHEDULER=True,
        SWARM_HEARTBEAT_INTERVAL_S=1.0,
        SWARM_HEARTBEAT_TIMEOUT_S=30.0,  # generous: the machine may be busy with other work
        SWARM_SWEEP_INTERVAL_S=0.5,
        SWARM_MODELS=[MODEL],
        SWARM_SPARES_PER_PIPELINE=0,
        SWARM_COORDINATOR_REGIONS=["local"],
        SWARM_JOB_TIMEOUT_S=300.0,
        SWARM_DEFAULT_PRICES=(0, 0),  # tokens are free here: these tests are about the API, not credits
        SWARM_TICKET_KEY_PATH=workdir / "ticket.key",
    )
    overrides.enable()
    issuer_key.cache_clear()
    agents: list[subprocess.Popen] = []
    server = None
    try:
        models.load_head(MODEL)  # the coordinator's part, loaded once before the first job
        models.load_tokenizer(MODEL)
        users = get_user_model().objects
        provider = users.create_user("alice", "alice@example.test", None, is_provider=True)
        customer = users.create_user("carol", "carol@example.test", None, is_customer=True)
        api_key, key = jobs_services.create_api_key(customer, "carol's app")
        ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1000, tokens_per_minute=1_000_000)
        api_key.refresh_from_db()
        forget_rate_counts(api_key)
        server = LiveServer().start()
        tokens = [joining.create_node(owner=provider, name=f"gpu-{i}")[1] for i in range(3)]
        agents = [join(server.url, token, workdir, i) for i, token in enumerate(tokens)]
        route = wait_for(lambda: servable_route(agents, workdir), SERVABLE_TIMEOUT_S, "a servable pipeline", 0.5)
        yield Swarm(server.url, provider, customer, api_key, key, route, agents)
    finally:
        stop_agents(agents)
        if server is not None:
            server.stop()
        overrides.disable()
        issuer_key.cache_clear()


@cache
def reference_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(models.resolve_checkpoint(MODEL), dtype=torch.float32).eval()


@dataclass(frozen=True)
class Reference:
    prompt_tokens: int
    token_ids: tuple[int, ...]  # the completion, without the EOS
    text: str
    finish_reason: str


@cache
def _greedy(prompt_ids: tuple[int, ...], max_tokens: int) -> Reference:
    tokenizer = models.load_tokenizer(MODEL)
    with torch.no_grad():
        out = reference_model().generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False)
    tokens = out[0, len(prompt_ids) :].tolist()
    finish = "length"
    if tokenizer.eos_token_id in tokens:
        tokens, finish = tokens[: tokens.index(tokenizer.eos_token_id)], "stop"
    return Reference(len(prompt_ids), tuple(tokens), tokenizer.decode(tokens, skip_special_tokens=True), finish)


def greedy_chat(messages: list[dict], max_tokens: int) -> Reference:
    """Single-process greedy ``generate`` on the chat template, as the API's chat completions run it."""
    ids = models.load_tokenizer(MODEL).apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    return _greedy(tuple(ids), max_tokens)


def greedy_text(prompt: str, max_tokens: int) -> Reference:
    """Single-process greedy ``generate`` on a plain prompt, as the API's text completions run it."""
    return _greedy(tuple(models.load_tokenizer(MODEL)(prompt)["input_ids"]), max_tokens)


@pytest.fixture
def priced():
    """The model priced ($7 / $13 per million tokens) for the test's length: (prompt, completion)
    nano-dollars per million tokens (the live swarm's tokens are free otherwise)."""
    price = ModelPrice.objects.create(
        model=MODEL,
        prompt_per_million=7_000_000_000,
        completion_per_million=13_000_000_000,
        effective_from=timezone.now(),
    )
    yield price.prompt_per_million, price.completion_per_million
    price.delete()
