"""The control plane's log lines: each names the request (its x-request-id) and the job it was
logged for, in the web process and in a Celery worker, as text or JSON; a job records the id of
the request that admitted it.

The module shares one live control plane (uvicorn in a thread of this process, on Redis), three
joined tiny-llama agents and a real `celery worker` of the region "local" that logs JSON. Records of
this process are captured by a handler on the root logger that carries the filter settings.LOGGING
installed; the worker's lines are read from its output.
"""

from __future__ import annotations

import json
import logging
import os
import re
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test.utils import override_settings
from openai import OpenAI

from marketplace import logs
from marketplace.celery import app as celery_app
from marketplace.jobs.models import ApiKey, Job, JobState
from marketplace.jobs.services import create_api_key
from marketplace.nodes.joining import create_node
from marketplace.placement.selectors import servable_pipelines
from tests.api_fixtures import forget_rate_counts, module_db
from tests.live import LiveServer, wait_for
from worker_agent.dev.local import join_agent, stop_processes

pytestmark = [pytest.mark.api]
db = module_db

MODEL = "tiny-llama"
REQUEST_ID = re.compile(r"req_[0-9a-f]{32}")
# Loggers of the code that serves a request (``swarm.api``) and runs its job (the rest).
JOB_LOGGERS = ("swarm.jobs", "swarm.coordinator")
SERVING_LOGGERS = ("swarm.api", *JOB_LOGGERS)
ROOT = Path(__file__).resolve().parent.parent
TEXT_LINE = re.compile(
    r"(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (?P<level>[A-Z]+) (?P<logger>\S+) "
    r"request=(?P<request_id>\S+) job=(?P<job_id>\S+) (?P<message>.*)"
)
JSON_KEYS = {"timestamp", "level", "logger", "request_id", "job_id", "message"}
# Logs a line outside any request or job, then one inside both, in a fresh process set up as the
# web process is (settings.LOGGING from the environment).
LOG_TWO_LINES = """
import logging, django
django.setup()
from marketplace import logs
log = logging.getLogger("swarm.check")
log.info("outside")
with logs.bound(request_id="req_0123", job_id="chatcmpl-4567"):
    log.warning("inside %d", 2)
"""


class Captured(logging.Handler):
    """Keeps every record handled on the root logger, run through ``filters`` first (as the
    console handler of settings.LOGGING runs them)."""

    def __init__(self, filters: list) -> None:
        super().__init__(logging.DEBUG)
        self.filters = list(filters)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Iterator[Captured]:
    root = logging.getLogger()
    (console,) = [h for h in root.handlers if any(isinstance(f, logs.ContextFilter) for f in h.filters)]
    handler = Captured(console.filters)
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def database_url() -> str:
    """The test database, as a URL the worker process can open."""
    params = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{params['NAME']}"
    return f"postgres://{params['USER']}@{params['HOST'] or '127.0.0.1'}:{params['PORT'] or 5432}/{params['NAME']}"


def start_worker(workdir: Path) -> subprocess.Popen:
    """A real `celery worker` of the region "local" on the test database, logging JSON."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DATABASE_URL": database_url(),
        "SWARM_MODELS": MODEL,
        "SWARM_LOG_FORMAT": "json",
        "SWARM_LOG_LEVEL": "INFO",
    }
    log = open(workdir / "worker.log", "w")  # noqa: SIM115 - owned by the child process
    command = [sys.executable, "-m", "celery", "-A", "marketplace", "worker", "-Q", "coord.local"]
    command += ["--pool", "threads", "--concurrency", "2", "--without-mingle", "--without-gossip"]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def worker_lines(workdir: Path) -> list[dict]:
    """The worker's JSON log lines (its start-up banner is printed, not logged)."""
    text = (workdir / "worker.log").read_text()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def swarm(db, tmp_path_factory):
    """The live control plane, three tiny-llama agents, a celery worker; carol's API key."""
    workdir = tmp_path_factory.mktemp("logging")
    redis_url = os.environ.get("REDIS_URL", "")
    assert redis_url, "these tests run against Redis: set REDIS_URL"
    overrides = override_settings(
        SWARM_MODELS=[MODEL],
        SWARM_EMBEDDED_SCHEDULER=True,
        SWARM_HEARTBEAT_INTERVAL_S=0.5,
        SWARM_HEARTBEAT_TIMEOUT_S=30.0,
        SWARM_SWEEP_INTERVAL_S=0.5,
        SWARM_SPARES_PER_PIPELINE=0,
        SWARM_COORDINATOR_REGIONS=["local"],
        SWARM_DEFAULT_PRICES=(0, 0),
        CHANNEL_LAYERS={
            "default": {
                "BACKEND": "channels_redis.core.RedisChannelLayer",
                "CONFIG": {"hosts": [{"address": redis_url, "socket_timeout": 30}], "capacity": 4096},
            }
        },
    )
    overrides.enable()
    eager = celery_app.conf.task_always_eager
    broker = celery_app.conf.broker_url
    celery_app.conf.update(broker_url=redis_url, task_always_eager=False)
    processes: list[subprocess.Popen] = []
    server = None
    try:
        users = get_user_model().objects
        provider = users.create_user("alice", "alice@example.test", None, is_provider=True)
        customer = users.create_user("carol", "carol@example.test", None, is_customer=True)
        api_key, key = create_api_key(customer, "carol's app")
        ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1000, tokens_per_minute=1_000_000)
        forget_rate_counts(api_key)
        server = LiveServer().start()
        for i in range(3):
            token = create_node(owner=provider, name=f"gpu-{i}")[1]
            agent = join_agent(
                server.url, token, workdir / f"n{i}.key", workdir / f"agent{i}.log", model=MODEL, max_layers=2
            )
            processes.append(agent)
        wait_for(lambda: servable_pipelines(MODEL), 180, "a ready tiny-llama pipeline")
        processes.append(start_worker(workdir))  # once the agents are up: on a busy machine they start faster alone
        wait_for(lambda: "ready." in (workdir / "worker.log").read_text(), 120, "the celery worker")
        yield server, key, workdir
    finally:
        stop_processes(processes, timeout_s=20)
        if server is not None:
            server.stop()
        celery_app.conf.update(broker_url=broker, task_always_eager=eager)
        overrides.disable()


def complete(server, key: str) -> tuple[str, str]:
    """One text completion through the OpenAI SDK: (the response's x-request-id, its id)."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0)
    return raw.headers["x-request-id"], raw.parse().id


def settled(public_id: str) -> Job:
    return wait_for(
        lambda: Job.objects.filter(public_id=public_id, settled_at__isnull=False).first(), 60, "the job to settle"
    )


def test_every_line_of_a_request_and_its_job_names_them(swarm, captured, settings):
    server, key, _ = swarm
    settings.SWARM_COORDINATOR_LAUNCH = "inprocess"

    request_id, public_id = complete(server, key)
    job = settled(public_id)
    wait_for(lambda: any(r.getMessage() == "job ended: succeeded" for r in captured.records), 30, "the job's end")

    assert REQUEST_ID.fullmatch(request_id)
    assert job.state == JobState.SUCCEEDED
    assert job.request_id == request_id
    lines = [(r.name, r.request_id, r.job_id, r.getMessage()) for r in captured.records]
    assert ("swarm.api", request_id, public_id, f"admitted 1 job(s) for {MODEL} on key {job.api_key.prefix}") in lines
    running = f"job running: {MODEL}, {job.prompt_tokens} prompt tokens, on 3 stages"
    assert ("swarm.jobs", request_id, public_id, running) in lines
    assert ("swarm.jobs", request_id, public_id, "job ended: succeeded") in lines
    serving = [line for line in lines if line[0] in SERVING_LOGGERS]
    assert serving and all(rid == request_id for _, rid, _, _ in serving), serving
    assert all(jid == public_id for name, _, jid, _ in serving if name in JOB_LOGGERS), serving
    # Whatever else was logged meanwhile (node heartbeats, sweeps, other requests) is not this job's.
    assert all(rid == request_id for _, rid, jid, _ in lines if jid == public_id)
    # The customer finds the request id with the generation too.
    generation = httpx.get(
        f"{server.url}/api/v1/generation", params={"id": public_id}, headers={"Authorization": f"Bearer {key}"}
    ).json()["data"]
    assert (generation["id"], generation["request_id"]) == (public_id, request_id)


def test_a_request_refused_at_validation_is_logged_with_its_request_id(swarm, captured):
    server, key, _ = swarm

    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": "not a list"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )

    assert response.status_code == 400
    request_id = response.headers["x-request-id"]
    assert REQUEST_ID.fullmatch(request_id)
    refused = [r for r in captured.records if r.name == "django.request"]
    assert [(r.levelname, r.getMessage(), r.request_id, r.job_id) for r in refused] == [
        ("WARNING", "Bad Request: /v1/chat/completions", request_id, "-")
    ]
    assert not Job.objects.filter(request_id=request_id).exists()


def test_any_answer_names_its_request(swarm):
    server, _, _ = swarm

    first, second = (httpx.get(f"{server.url}/healthz", timeout=30) for _ in range(2))

    assert REQUEST_ID.fullmatch(first.headers["x-request-id"])
    assert REQUEST_ID.fullmatch(second.headers["x-request-id"])
    assert first.headers["x-request-id"] != second.headers["x-request-id"]


def test_a_celery_worker_logs_its_task_and_job_as_json_with_their_ids(swarm, captured, settings):
    server, key, workdir = swarm
    settings.SWARM_COORDINATOR_LAUNCH = "celery"

    request_id, public_id = complete(server, key)
    job = settled(public_id)
    ended = re.compile(r"task marketplace\.jobs\.tasks\.run_job\[[0-9a-f-]+\] ended: SUCCESS")
    wait_for(lambda: any(ended.fullmatch(line["message"]) for line in worker_lines(workdir)), 60, "the task's end")

    assert job.request_id == request_id
    assert ("swarm.api", request_id, public_id) in {(r.name, r.request_id, r.job_id) for r in captured.records}
    lines = worker_lines(workdir)
    assert all(line.keys() >= JSON_KEYS for line in lines)
    ours = [line for line in lines if line["job_id"] == public_id]
    messages = [(line["logger"], line["level"], line["message"]) for line in ours]
    started = re.compile(rf"task marketplace\.jobs\.tasks\.run_job\[[0-9a-f-]+\] started with \[{job.pk}\]")
    assert messages[0][:2] == ("swarm.tasks", "INFO") and started.fullmatch(messages[0][2]), messages
    assert ("swarm.jobs", "INFO", f"job running: {MODEL}, {job.prompt_tokens} prompt tokens, on 3 stages") in messages
    assert ("swarm.jobs", "INFO", "job ended: succeeded") in messages
    # Celery's own "received"/"succeeded" lines only repeat the start and end: left out.
    assert not any(line["logger"] in ("celery.app.trace", "celery.worker.strategy") for line in lines)
    assert messages[-1][:2] == ("swarm.tasks", "INFO") and ended.fullmatch(messages[-1][2]), messages
    assert all(line["request_id"] == request_id for line in ours)
    # The worker ran nothing else meanwhile: every line from the task's start to its end is the job's,
    # and none before it (start-up, "ready") names a request or a job.
    first, last = lines.index(ours[0]), lines.index(ours[-1])
    assert all(line["job_id"] == public_id for line in lines[first : last + 1])
    assert {(line["request_id"], line["job_id"]) for line in lines[:first]} == {("-", "-")}


def run_logging(log_format: str) -> list[str]:
    """The stderr lines of a fresh process that logs ``LOG_TWO_LINES`` in ``log_format``."""
    env = {**os.environ, "SWARM_LOG_FORMAT": log_format, "SWARM_LOG_LEVEL": "INFO"}
    done = subprocess.run(
        [sys.executable, "-c", LOG_TWO_LINES], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stderr.splitlines() if "swarm.check" in line]


def test_json_lines_are_one_object_each_with_the_ids():
    lines = [json.loads(line) for line in run_logging("json")]

    assert [{k: v for k, v in line.items() if k != "timestamp"} for line in lines] == [
        {"level": "INFO", "logger": "swarm.check", "request_id": "-", "job_id": "-", "message": "outside"},
        {
            "level": "WARNING",
            "logger": "swarm.check",
            "request_id": "req_0123",
            "job_id": "chatcmpl-4567",
            "message": "inside 2",
        },
    ]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00", line["timestamp"]) for line in lines)


def test_text_lines_have_time_level_logger_and_the_ids():
    lines = [TEXT_LINE.fullmatch(line) for line in run_logging("text")]

    assert all(lines)
    assert [(m["level"], m["logger"], m["request_id"], m["job_id"], m["message"]) for m in lines] == [
        ("INFO", "swarm.check", "-", "-", "outside"),
        ("WARNING", "swarm.check", "req_0123", "chatcmpl-4567", "inside 2"),
    ]


@pytest.mark.parametrize(
    ("name", "value"), [("SWARM_LOG_FORMAT", "xml"), ("SWARM_LOG_LEVEL", "LOUD"), ("SWARM_LOG_LEVEL", "10")]
)
def test_a_bad_log_setting_is_refused_at_start(name, value, monkeypatch):
    monkeypatch.setenv(name, value)

    with pytest.raises(ImproperlyConfigured, match=f"^{name} must be one of "):
        runpy.run_path(str(ROOT / "marketplace" / "settings.py"))


@pytest.mark.parametrize(("raw", "value"), [(" JSON ", "json"), ("text", "text")])
def test_the_log_format_is_read_in_any_case(raw, value, monkeypatch):
    monkeypatch.setenv("SWARM_LOG_FORMAT", raw)
    monkeypatch.setenv("SWARM_LOG_LEVEL", "warning")

    loaded = runpy.run_path(str(ROOT / "marketplace" / "settings.py"))

    assert (loaded["SWARM_LOG_FORMAT"], loaded["SWARM_LOG_LEVEL"]) == (value, "WARNING")
    assert loaded["LOGGING"]["root"] == {"handlers": ["console"], "level": "WARNING"}
