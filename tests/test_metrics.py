"""The control plane's ``GET /metrics``, scraped through the real ASGI app (uvicorn in a thread of the
test process): HTTP requests by route and status, what the database holds now, the Celery queues'
lengths, the token that guards it, and the counters of several processes added up
(PROMETHEUS_MULTIPROC_DIR). Jobs' series, moved by real requests, are in test_metrics_jobs.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import timedelta
from email.message import Message

import pytest
import redis
from django.utils import timezone

from marketplace import metrics
from marketplace.billing import services as billing
from marketplace.jobs.models import Job, JobState
from marketplace.nodes.models import Node, NodeState
from marketplace.verification.models import Challenge, CheckState
from marketplace.verification.strikes import open_strike
from tests.live import LiveServer, free_port
from tests.scrape import label_values, moved, value

pytestmark = [pytest.mark.control, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.factories"]

MODEL = "smollm2-135m"
TOKEN = "scrape-secret-4f1c9a"
NODES_ROUTE = "/api/v1/nodes/(?P<pk>[^/.]+)/"


@pytest.fixture
def live(settings):
    """The live app, with no periodic work running that could change rows under a scrape."""
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_EMBEDDED_SCHEDULER = False
    settings.SWARM_METRICS_TOKEN = ""
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Message, str]:
    """Status, headers (looked up in any case, as HTTP's names are: uvicorn sends them lower-case) and body."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.headers, refused.read().decode()


def scrape(server: LiveServer, token: str | None = None) -> str:
    status, _, body = get(f"{server.url}/metrics", {"Authorization": f"Bearer {token}"} if token else None)
    assert status == 200, body
    return body


def test_requests_are_counted_by_route_and_status_never_by_raw_path(live):
    before = scrape(live)

    statuses = [get(f"{live.url}{path}")[0] for path in ("/api/v1/nodes/41/", "/api/v1/nodes/42/", "/no/such/7")]
    after = scrape(live)

    assert statuses == [403, 403, 404]
    assert moved(before, after, "swarm_http_requests_total", endpoint=NODES_ROUTE, method="GET", status="403") == 2
    assert moved(before, after, "swarm_http_request_duration_seconds_count", endpoint=NODES_ROUTE, method="GET") == 2
    assert moved(before, after, "swarm_http_requests_total", endpoint="unmatched", method="GET", status="404") == 1
    endpoints = label_values(after, "swarm_http_requests_total", "endpoint")
    assert {"/metrics", NODES_ROUTE, "unmatched"} <= endpoints
    assert [e for e in endpoints if "41" in e or "42" in e or "/no/" in e] == []


def test_the_database_figures_are_read_at_scrape_time(live, provider, customer, make_node):
    nodes = [make_node(provider, f"gpu-{i}")[0] for i in range(4)]
    Node.objects.filter(pk__in=[nodes[0].pk, nodes[1].pk]).update(state=NodeState.ACTIVE)
    Node.objects.filter(pk=nodes[2].pk).update(state=NodeState.OFFLINE)
    for index, state in enumerate([JobState.QUEUED, JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED]):
        Job.objects.create(public_id=f"chatcmpl-m{index}", kind="chat", customer=customer, model=MODEL, state=state)
    now = timezone.now()
    checks = [
        Challenge.objects.create(
            node=nodes[0],
            model=MODEL,
            layer_start=0,
            layer_end=10,
            seed=index,
            tokens=8,
            state=state,
            sent_at=now,
            deadline_at=now + timedelta(seconds=30),
        )
        for index, state in enumerate([CheckState.PASSED, CheckState.PASSED, CheckState.FAILED, CheckState.SENT])
    ]
    open_strike(nodes[0], "challenge", challenge=checks[2], evidence={"kind": "challenge"})
    billing.grant(customer, "12.50")

    body = scrape(live)

    assert value(body, "swarm_scrape_source_up", source="database") == 1
    assert {state: value(body, "swarm_nodes", state=state) for state in NodeState.values} == {
        "pending": 1, "active": 2, "draining": 0, "offline": 1, "ejected": 0, "deleted": 0,
    }  # fmt: skip
    assert [value(body, "swarm_jobs_in_flight", model=MODEL, state=s) for s in ("queued", "running")] == [2, 1]
    assert label_values(body, "swarm_jobs_in_flight", "state") == {"queued", "running"}
    assert [value(body, "swarm_challenges", state=s) for s in ("sent", "passed", "failed", "expired")] == [1, 2, 1, 0]
    assert value(body, "swarm_strikes", kind="challenge", state="open") == 1
    assert value(body, "swarm_strikes", kind="challenge", state="upheld") == 0
    assert value(body, "swarm_ledger_balance_dollars", kind="customer_credit") == 12.5
    assert value(body, "swarm_ledger_balance_dollars", kind="grants") == -12.5
    assert value(body, "swarm_ledger_balance_dollars", kind="platform_revenue") == 0
    assert value(body, "swarm_assignments", model=MODEL, state="ready", role="serving") == 0


def test_with_a_token_set_metrics_want_it_as_a_bearer_token(live, settings):
    settings.SWARM_METRICS_TOKEN = TOKEN
    url = f"{live.url}/metrics"

    missing = get(url)
    wrong = get(url, {"Authorization": "Bearer not-the-token"})
    basic = get(url, {"Authorization": f"Basic {TOKEN}"})
    right = get(url, {"Authorization": f"Bearer {TOKEN}"})

    assert [r[0] for r in (missing, wrong, basic)] == [401, 401, 401]
    assert missing[1]["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert "swarm_nodes" not in missing[2] + wrong[2] + basic[2]
    assert right[0] == 200
    assert value(right[2], "swarm_scrape_source_up", source="database") == 1


def test_without_a_token_metrics_answer_only_this_machine(client, settings):
    settings.SWARM_METRICS_TOKEN = ""

    elsewhere = client.get("/metrics", REMOTE_ADDR="203.0.113.9")
    here = client.get("/metrics", REMOTE_ADDR="::1")

    assert (elsewhere.status_code, elsewhere.json()) == (
        403,
        {"error": "metrics answer other machines only with SWARM_METRICS_TOKEN set"},
    )
    assert here.status_code == 200
    assert value(here.content.decode(), "swarm_scrape_source_up", source="database") == 1


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs a Redis (REDIS_URL) to hold Celery's queues")
def test_queue_lengths_are_the_brokers_lists_summed_over_priorities(live, settings):
    settings.CELERY_BROKER_URL = os.environ["REDIS_URL"]
    settings.SWARM_COORDINATOR_REGIONS = ["metrics-a", "metrics-b"]
    broker = redis.Redis.from_url(os.environ["REDIS_URL"])
    keys = ["coord.metrics-a", "coord.metrics-a\x06\x166", "coord.metrics-b"]
    broker.delete(*keys)
    try:
        broker.rpush(keys[0], "t1", "t2")
        broker.rpush(keys[1], "t3")

        body = scrape(live)
    finally:
        broker.delete(*keys)
        broker.close()

    assert value(body, "swarm_scrape_source_up", source="queues") == 1
    assert label_values(body, "swarm_celery_queue_length", "queue") == {
        "celery", "verify", "coord.metrics-a", "coord.metrics-b",
    }  # fmt: skip
    assert value(body, "swarm_celery_queue_length", queue="coord.metrics-a") == 3
    assert value(body, "swarm_celery_queue_length", queue="coord.metrics-b") == 0


def test_a_broker_that_is_down_leaves_its_queues_out_and_the_rest_in(live, settings):
    settings.CELERY_BROKER_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

    body = scrape(live)

    assert value(body, "swarm_scrape_source_up", source="queues") == 0
    assert value(body, "swarm_scrape_source_up", source="database") == 1
    assert label_values(body, "swarm_celery_queue_length", "queue") == set()
    assert value(body, "swarm_nodes", state="active") == 0


def test_the_embedded_default_has_no_queues_to_count(live, settings):
    settings.CELERY_BROKER_URL = "memory://"

    body = scrape(live)

    assert label_values(body, "swarm_scrape_source_up", "source") == {"database"}
    assert label_values(body, "swarm_celery_queue_length", "queue") == set()


def test_in_multiprocess_mode_metrics_add_up_every_processs_counters(live, tmp_path, monkeypatch):
    record = (
        "from marketplace import metrics; metrics.job_finished('multi-model', 'succeeded', prompt_tokens=3, "
        "completion_tokens=5, ttft_ms=250.0, tokens_per_s=None, drafted_tokens=4, accepted_tokens=2)"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", record], env=env, check=True, timeout=120)
    monkeypatch.setattr(metrics, "MULTIPROC_DIR", str(tmp_path / "prom"))

    body = scrape(live)

    files = sorted(path.name for path in (tmp_path / "prom").iterdir())
    assert len(files) == 4  # a counter file and a histogram file per process
    assert all(name.split("_", 1)[1].startswith(f"{socket.gethostname()}-") for name in files)
    assert value(body, "swarm_jobs_finished_total", model="multi-model", state="succeeded") == 2
    assert value(body, "swarm_job_tokens_total", model="multi-model", kind="completion") == 10
    assert value(body, "swarm_speculative_accepted_tokens_total", model="multi-model") == 4
    assert value(body, "swarm_job_ttft_seconds_count", model="multi-model") == 2
    assert value(body, "swarm_job_ttft_seconds_bucket", model="multi-model", le="0.25") == 2
    assert value(body, "swarm_nodes", state="active") == 0
    # This process counts in memory, not in the directory: its requests are not in the sum.
    assert label_values(body, "swarm_http_requests_total", "endpoint") == set()
