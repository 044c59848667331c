"""The production launch path: a job's coordinator runs as a Celery task on the queue of its
coordinator region (a real `celery worker` process, threads pool) and its tokens reach the HTTP
response through the Redis channel layer."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx2 as httpx
import pytest
from django.db import connection
from openai import OpenAI

from marketplace.billing.models import NANO_PER_DOLLAR, AccountKind, Transfer
from marketplace.billing.services import account, credits, grant
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.services import create_api_key
from marketplace.nodes.joining import create_node
from marketplace.placement.selectors import servable_pipelines
from tests.live import LiveServer, wait_for
from worker_agent.dev.local import join_agent, stop_processes

pytestmark = [pytest.mark.api, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-llama"
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def database_url() -> str:
    """The test database, as a URL another process can open."""
    params = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{params['NAME']}"
    return f"postgres://{params['USER']}@{params['HOST'] or '127.0.0.1'}:{params['PORT'] or 5432}/{params['NAME']}"


@pytest.fixture
def celery_control_plane(settings):
    from marketplace.celery import app

    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_COORDINATOR_LAUNCH = "celery"
    settings.SWARM_EMBEDDED_SCHEDULER = True
    settings.SWARM_HEARTBEAT_INTERVAL_S = 0.5
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 10.0
    settings.SWARM_SWEEP_INTERVAL_S = 0.5
    settings.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
    }
    previous = dict((app.conf.broker_url and {"broker_url": app.conf.broker_url}) or {})
    app.conf.update(broker_url=REDIS_URL, task_always_eager=False)
    server = LiveServer().start()
    yield server
    server.stop()
    app.conf.update(task_always_eager=True, **previous)


def start_worker(tmp_path, model: str) -> subprocess.Popen:
    """A real `celery worker` for the region "local", on the test database."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DATABASE_URL": database_url(),
        "REDIS_URL": REDIS_URL,
        "SWARM_MODELS": model,
    }
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 - owned by the child process
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "marketplace",
        "worker",
        "-Q",
        "coord.local",
        "--pool",
        "threads",
        "--concurrency",
        "2",
        "--loglevel",
        "info",
        "--without-mingle",
        "--without-gossip",
    ]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def start_agents(server, tokens, tmp_path) -> list[subprocess.Popen]:
    return [
        join_agent(server.url, token, tmp_path / f"n{i}.key", tmp_path / f"agent{i}.log", model=MODEL, max_layers=2)
        for i, token in enumerate(tokens)
    ]


@pytest.fixture
def swarm_with_worker(celery_control_plane, django_user_model, tmp_path):
    """Three joined tiny-llama agents, a celery worker of region "local", a customer with $1 and a key."""
    provider = django_user_model.objects.create_user(username="p", email="p@e.com", password="x", is_provider=True)
    customer = django_user_model.objects.create_user(username="c", email="c@e.com", password="x", is_customer=True)
    tokens = [create_node(owner=provider, name=f"n{i}")[1] for i in range(3)]
    _, key = create_api_key(customer, "k")
    grant(customer, 1)
    worker = start_worker(tmp_path, MODEL)
    agents = start_agents(celery_control_plane, tokens, tmp_path)
    try:
        wait_for(lambda: servable_pipelines(MODEL), 180, "a ready tiny-llama pipeline")
        wait_for(lambda: "ready" in (tmp_path / "worker.log").read_text(), 60, "the celery worker")
        yield celery_control_plane, customer, key, worker
    finally:
        stop_processes([*agents, worker], timeout_s=20)


def test_a_job_runs_in_a_celery_worker_of_its_region(swarm_with_worker, tmp_path):
    server, _, key, _ = swarm_with_worker
    client = OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)

    stream = client.completions.create(
        model=MODEL,
        prompt="Hello there",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)

    usage = chunks[-1].usage
    assert usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    job = Job.objects.get()
    assert job.state == JobState.SUCCEEDED
    assert job.coordinator_region == "local"
    assert job.completion_tokens == 6
    assert job.verified is True
    assert len(job.receipts) == 3
    done = re.compile(r"task marketplace\.jobs\.tasks\.run_job\[[0-9a-f-]+\] ended: SUCCESS")
    wait_for(lambda: done.search((tmp_path / "worker.log").read_text()), 30, "the task to finish in the worker")
    job.refresh_from_db()
    assert job.charged_amount > 0


def test_a_job_whose_worker_is_killed_is_settled_from_its_record(swarm_with_worker, settings):
    server, customer, key, worker = swarm_with_worker
    settings.SWARM_JOB_STALE_S = 3.0
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "stream": True}

    with (
        httpx.Client(base_url=server.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response,
    ):
        wait_for(lambda: Job.objects.filter(completion_tokens__gt=0).exists(), 60, "recorded progress")
        worker.send_signal(signal.SIGKILL)  # the process running the coordinator dies mid-stream
        worker.wait(timeout=10)
        assert response.status_code == 200

    job = wait_for(
        lambda: Job.objects.filter(state=JobState.FAILED, settled_at__isnull=False).first(),
        60,
        "the periodic task to reconcile the job",
    )
    assert job.error_code == "coordinator_lost"
    assert 0 < job.completion_tokens < 2000
    # Its receipts died with its worker: the tokens it streamed were never verified, so they are free.
    assert job.charged_amount == 0
    assert account(AccountKind.CUSTOMER_HOLD, customer).balance == 0
    assert credits(customer) == NANO_PER_DOLLAR
    assert not Transfer.objects.filter(job=job, kind="charge").exists()
    assert Transfer.objects.get(job=job, kind="release").memo == "not charged: the job failed (coordinator_lost)"
