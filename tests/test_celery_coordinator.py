"""The production launch path: a job's coordinator runs as a Celery task on the queue of its
coordinator region (a real `celery worker` process, threads pool) and its tokens reach the HTTP
response through the Redis channel layer."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from django.db import connection
from openai import OpenAI

from marketplace.billing.services import grant
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.services import create_api_key
from marketplace.nodes.services import create_node
from marketplace.placement.selectors import servable_pipelines
from tests.live import LiveServer

pytestmark = [pytest.mark.api, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-llama"
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def database_url() -> str:
    """The test database, as a URL another process can open."""
    params = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{params['NAME']}"
    return f"postgres://{params['USER']}@{params['HOST'] or '127.0.0.1'}:{params['PORT'] or 5432}/{params['NAME']}"


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


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


def test_a_job_runs_in_a_celery_worker_of_its_region(celery_control_plane, django_user_model, tmp_path):
    provider = django_user_model.objects.create_user(username="p", email="p@e.com", password="x", is_provider=True)
    customer = django_user_model.objects.create_user(username="c", email="c@e.com", password="x", is_customer=True)
    tokens = [create_node(owner=provider, name=f"n{i}")[1] for i in range(3)]
    _, key = create_api_key(customer, "k")
    grant(customer, 1)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DATABASE_URL": database_url(),
        "REDIS_URL": REDIS_URL,
        "SWARM_MODELS": MODEL,
    }
    worker_log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 - owned by the child process
    worker = subprocess.Popen(
        [
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
        ],
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    agents = []
    try:
        for i, token in enumerate(tokens):
            log = open(tmp_path / f"agent{i}.log", "w")  # noqa: SIM115 - owned by the child process
            agents.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "worker_agent.cli",
                        "join",
                        "--control-plane",
                        celery_control_plane.url,
                        "--token",
                        token,
                        "--key",
                        str(tmp_path / f"n{i}.key"),
                        "--model",
                        MODEL,
                        "--max-layers",
                        "2",
                        "--threads",
                        "1",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            )
        wait_for(lambda: servable_pipelines(MODEL), 180, "a ready tiny-llama pipeline")
        wait_for(lambda: "ready" in (tmp_path / "worker.log").read_text(), 60, "the celery worker")
        client = OpenAI(base_url=celery_control_plane.url + "/v1", api_key=key, max_retries=0, timeout=120)

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
        done = re.compile(r"Task marketplace\.jobs\.tasks\.run_job\[[0-9a-f-]+\] succeeded in [0-9.]+s: 'succeeded'")
        wait_for(lambda: done.search((tmp_path / "worker.log").read_text()), 30, "the task to finish in the worker")
        job.refresh_from_db()
        assert job.charged_amount > 0
    finally:
        for process in [*agents, worker]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [*agents, worker]:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
