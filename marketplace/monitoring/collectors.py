"""Series read at scrape time: what the database says now, and how long the Celery queues are.

Read fresh by whichever process answers ``/metrics``, so they are the same from every process and
need no multiprocess bookkeeping. Checks (challenges, audits) and strikes are counted here as rows
by state, not as counters where they are decided: they are decided in Celery workers (the verify
queue), by Celery beat and by admins in the web process, and the rows are the record all of them
share. A row's state only moves forward, so a decided state's count only grows: ``delta()`` over a
window gives the decisions in it.

Each source runs in a worker thread under a deadline (the view's): a source that fails or is late
reports ``swarm_scrape_source_up{source=...} 0`` and leaves its series out; the scrape still answers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal

import redis
from django.conf import settings
from django.db.models import Count, QuerySet, Sum
from kombu.transport.redis import PRIORITY_STEPS
from kombu.transport.redis import Channel as RedisChannel
from prometheus_client.core import GaugeMetricFamily, Metric

from marketplace.billing.models import NANO_PER_DOLLAR, AccountKind, LedgerAccount
from marketplace.catalog.selectors import served_models
from marketplace.db import release_connections
from marketplace.jobs.models import Job, JobState
from marketplace.nodes.models import Node, NodeState
from marketplace.placement.models import LIVE_STATES, Assignment
from marketplace.verification.models import Audit, Challenge, CheckState, Strike, StrikeKind, StrikeState

IN_FLIGHT = (JobState.QUEUED, JobState.RUNNING)
CHALLENGE_STATES = (
    CheckState.SENT,
    CheckState.ANSWERED,
    CheckState.PASSED,
    CheckState.FAILED,
    CheckState.EXPIRED,
    CheckState.ERROR,
)
AUDIT_STATES = (CheckState.PENDING, CheckState.PASSED, CheckState.FAILED, CheckState.ERROR)
ROLES = {False: "serving", True: "spare"}
# The queues tasks are sent to: Celery's default, the verifiers' (verification.dispatch) and one per
# coordinator region (flows.tasks).
FIXED_QUEUES = ("celery", "verify")


def _counts(queryset: QuerySet, *fields: str) -> dict[tuple, int]:
    """Rows of ``queryset`` grouped by ``fields`` (the models' default ordering dropped: it would
    split the groups)."""
    rows = queryset.order_by().values(*fields).annotate(rows=Count("pk"))
    return {tuple(row[field] for field in fields): row["rows"] for row in rows}


def _gauge(
    name: str, documentation: str, labels: Sequence[str], counts: Mapping[tuple, float], zeros: Iterable[tuple]
) -> GaugeMetricFamily:
    """A gauge family with a sample per ``counts`` entry, and 0 for each of ``zeros`` not in it (a
    known state with no row still reads 0, so that alerts on it see a value)."""
    family = GaugeMetricFamily(name, documentation, labels=list(labels))
    for key in sorted(set(counts) | set(zeros), key=lambda k: tuple(map(str, k))):
        family.add_metric([str(part) for part in key], counts.get(key, 0))
    return family


def database_families() -> list[Metric]:
    """The database's figures, in one short read per table (worker thread; its connection is handed back)."""
    try:
        models = served_models()
        jobs = _counts(Job.objects.filter(state__in=IN_FLIGHT), "model", "state")
        nodes = _counts(Node.objects.all(), "state")
        assignments = _counts(Assignment.objects.filter(state__in=LIVE_STATES), "model", "state", "is_spare")
        challenges = _counts(Challenge.objects.all(), "state")
        audits = _counts(Audit.objects.all(), "state")
        strikes = _counts(Strike.objects.all(), "kind", "state")
        balances = {
            (row["kind"],): Decimal(row["total"] or 0) / NANO_PER_DOLLAR
            for row in LedgerAccount.objects.order_by().values("kind").annotate(total=Sum("balance"))
        }
    finally:
        release_connections()
    return [
        _gauge(
            "swarm_jobs_in_flight",
            "Jobs not ended yet, by model and state",
            ["model", "state"],
            jobs,
            [(m, s) for m in models for s in IN_FLIGHT],
        ),
        _gauge("swarm_nodes", "Nodes by state", ["state"], nodes, [(s,) for s in NodeState.values]),
        _gauge(
            "swarm_assignments",
            "Live blocks by model, state (assigned: loading, ready: serving) and role (serving or spare)",
            ["model", "state", "role"],
            {(m, s, ROLES[spare]): n for (m, s, spare), n in assignments.items()},
            [(m, s, role) for m in models for s in LIVE_STATES for role in ROLES.values()],
        ),
        _gauge(
            "swarm_challenges",
            "Challenges by state (decided states only grow: delta() gives the decisions in a window)",
            ["state"],
            challenges,
            [(s,) for s in CHALLENGE_STATES],
        ),
        _gauge(
            "swarm_audits",
            "Live audits by state (decided states only grow: delta() gives the decisions in a window)",
            ["state"],
            audits,
            [(s,) for s in AUDIT_STATES],
        ),
        _gauge(
            "swarm_strikes",
            "Strikes by kind and state (open: withholding pay; upheld, overturned: decided)",
            ["kind", "state"],
            strikes,
            [(k, s) for k in StrikeKind.values for s in StrikeState.values],
        ),
        _gauge(
            "swarm_ledger_balance_dollars",
            "Sum of the ledger accounts' balances by account kind, in US dollars",
            ["kind"],
            {key: float(value) for key, value in balances.items()},
            [(k,) for k in AccountKind.values],
        ),
    ]


def celery_queues() -> list[str]:
    return [*FIXED_QUEUES, *(f"coord.{region}" for region in settings.SWARM_COORDINATOR_REGIONS)]


def broker_is_redis() -> bool:
    return settings.CELERY_BROKER_URL.startswith(("redis://", "rediss://", "unix://"))


def queue_families(timeout_s: float) -> list[Metric]:
    """Tasks waiting in each Celery queue: the LLEN of its Redis list, summed over the lists Celery
    keeps per priority step. Nothing without a Redis broker (the embedded default runs tasks eagerly)."""
    if not broker_is_redis():
        return []
    queues = celery_queues()
    client = redis.Redis.from_url(
        settings.CELERY_BROKER_URL, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    try:
        with client.pipeline(transaction=False) as pipe:
            for queue in queues:
                for step in PRIORITY_STEPS:
                    pipe.llen(f"{queue}{RedisChannel.sep}{step}" if step else queue)
            lengths = pipe.execute()
    finally:
        client.close()
    per_queue: dict[tuple, float] = defaultdict(int)
    for index, length in enumerate(lengths):
        per_queue[(queues[index // len(PRIORITY_STEPS)],)] += length
    return [_gauge("swarm_celery_queue_length", "Tasks waiting in each Celery queue", ["queue"], per_queue, [])]
