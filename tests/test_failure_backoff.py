"""A failure a job's coordinator attributed to a node keeps requests off it for a time that doubles
with each failure of its window (capped), which no heartbeat or reconnect shortens, wherever a chain
of other nodes covers the model (a last resort where none does); more than the
configured number in one window is one ``failures`` strike; a node not on the job's route is not
counted (``marketplace.verification.failures``)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.jobs.models import Job, JobState
from marketplace.nodes.models import Node
from marketplace.placement import lifecycle
from marketplace.placement.selectors import route_request
from marketplace.verification.failures import backoff_s, record_failure
from marketplace.verification.models import Strike, StrikeKind
from tests.factories import MODEL
from tests.heal_fixtures import NOW, stage

pytestmark = [pytest.mark.trust, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.heal_fixtures"]

BASE_S, CAP_S, WINDOW_S, INCIDENT_S = 30.0, 100.0, 3600.0, 5.0


@pytest.fixture
def failure_settings(swarm_settings):
    swarm_settings.SWARM_FAILURE_BACKOFF_S = BASE_S
    swarm_settings.SWARM_FAILURE_BACKOFF_MAX_S = CAP_S
    swarm_settings.SWARM_FAILURE_WINDOW_S = WINDOW_S
    swarm_settings.SWARM_FAILURES_BEFORE_STRIKE = 3
    swarm_settings.SWARM_FAILURE_INCIDENT_S = INCIDENT_S
    return swarm_settings


def alive(node: Node, at) -> None:
    """The node's agent has had its control channel since long before the job, and heartbeated at ``at``."""
    Node.objects.filter(pk=node.pk).update(
        connected=True, connected_since=NOW - timedelta(hours=1), last_heartbeat_at=at
    )


@pytest.fixture
def job(swarm, customer, failure_settings) -> Job:
    return Job.objects.create(
        public_id="chatcmpl-failures",
        kind="chat",
        customer=customer,
        model=MODEL,
        state=JobState.RUNNING,
        route=[stage(swarm.a, 0, 16), stage(swarm.e, 16, 30)],
        coordinator_region="local",
    )


def counters(node: Node) -> tuple:
    node = Node.objects.get(pk=node.pk)
    return node.recent_failures, node.failures_total, node.failures_since, node.routing_backoff_until


def routed_nodes() -> list[str]:
    _, stages, _ = route_request(MODEL)
    return [s.node for s in stages]


def test_the_back_off_doubles_with_each_failure_of_the_window_up_to_its_cap(failure_settings):
    assert [backoff_s(n) for n in range(1, 6)] == [30.0, 60.0, 100.0, 100.0, 100.0]
    assert backoff_s(10_000) == CAP_S  # no overflow however many


def test_each_failure_counts_and_backs_the_node_off_for_longer(swarm, job):
    record_failure(swarm.e.node_id, "stage_stalled: no progress", job=job, now=NOW)
    first = counters(swarm.e)
    record_failure(swarm.e.node_id, "stage_lost: connection dropped", job=job, now=NOW + timedelta(seconds=40))

    assert first == (1, 1, NOW, NOW + timedelta(seconds=BASE_S))
    assert counters(swarm.e) == (2, 2, NOW, NOW + timedelta(seconds=40 + 2 * BASE_S))
    assert Node.objects.get(pk=swarm.e.pk).last_failure == "stage_lost: connection dropped"
    assert counters(swarm.a) == (0, 0, None, None)  # its neighbour on the route is not counted
    assert not Strike.objects.exists()


def test_a_failure_after_the_window_starts_a_new_one(swarm, job):
    for offset in (0, 10):  # two incidents, INCIDENT_S apart and more
        record_failure(swarm.e.node_id, "stalled", job=job, now=NOW + timedelta(seconds=offset))
    later = NOW + timedelta(seconds=WINDOW_S)

    record_failure(swarm.e.node_id, "stalled", job=job, now=later)

    assert counters(swarm.e) == (1, 3, later, later + timedelta(seconds=BASE_S))


def test_a_backed_off_node_is_not_routed_until_its_time_is_up_whatever_its_heartbeats_say(
    job, django_capture_on_commit_callbacks
):
    routed = routed_nodes()
    failed = Node.objects.get(node_id=routed[-1])  # whichever node routing picks now
    Job.objects.filter(pk=job.pk).update(route=[{"node": node} for node in routed])
    job.refresh_from_db()
    now = timezone.now()

    record_failure(failed.node_id, "stage_stalled", job=job, now=now)
    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.record_heartbeat(failed.pk, {"sessions": 0}, now=now + timedelta(seconds=10))
    backed_off = routed_nodes()
    Node.objects.filter(pk=failed.pk).update(routing_backoff_until=now - timedelta(seconds=1))  # its time is up

    assert failed.node_id not in backed_off
    assert routed_nodes() == routed


def test_a_backed_off_node_is_routed_only_where_no_chain_avoids_it(job):
    # One stall on a machine starved of CPU, with no spare: the model keeps a route, through the
    # backed-off nodes, rather than answer 503 for half a minute. A node a coordinator reported
    # (suspected until its next heartbeat) or under review is still never routed.
    first = routed_nodes()
    Node.objects.filter(node_id=first[-1]).update(routing_backoff_until=timezone.now() + timedelta(seconds=60))
    other = routed_nodes()  # the chain that avoids it
    Node.objects.exclude(node_id__in=other).update(routing_backoff_until=timezone.now() + timedelta(seconds=60))
    avoiding = routed_nodes()
    Node.objects.update(routing_backoff_until=timezone.now() + timedelta(seconds=60))
    last_resort = route_request(MODEL)
    Node.objects.update(suspected_at=timezone.now())

    assert first[-1] not in other
    assert avoiding == other  # while one chain avoids every backed-off node, it is taken
    assert last_resort is not None  # every node backed off: still a route
    assert route_request(MODEL) is None


def test_more_failures_than_the_threshold_in_a_window_is_one_strike(swarm, job):
    strikes = []
    for n in range(5):  # a stall every 10 s while its agent answers its heartbeats
        at = NOW + timedelta(seconds=10 * n)
        alive(swarm.e, at)
        strikes.append(record_failure(swarm.e.node_id, f"stage_stalled: {n}", job=job, now=at))

    [strike] = Strike.objects.all()
    assert strikes == [None, None, None, strike, None]  # the fourth of the window, and once
    assert (strike.node_id, strike.kind, strike.job_id) == (swarm.e.pk, StrikeKind.FAILURES, job.pk)
    assert (strike.evidence["failures"], strike.evidence["since"]) == (4, NOW.isoformat())
    assert Node.objects.get(pk=swarm.e.pk).under_review is True


@pytest.mark.parametrize(
    ("reason", "heartbeat_age_s", "channel_opened_s"),
    [
        ("stage_lost: connection dropped", 0.0, -3600.0),  # a lost connection: a crash drops it too
        ("stage_stalled: no progress", 60.0, -3600.0),  # no heartbeat for a minute: frozen
        ("stage_stalled: no progress", 0.0, 30.0),  # its channel opened after the job began: restarted
    ],
    ids=["lost connection", "frozen", "restarted"],
)
def test_failures_that_churn_explains_are_counted_and_backed_off_but_never_struck(
    swarm, job, reason, heartbeat_age_s, channel_opened_s
):
    Job.objects.filter(pk=job.pk).update(started_at=NOW - timedelta(seconds=60))
    job.refresh_from_db()
    for n in range(6):
        at = NOW + timedelta(seconds=10 * n)
        Node.objects.filter(pk=swarm.e.pk).update(
            connected=True,
            connected_since=job.started_at + timedelta(seconds=channel_opened_s),
            last_heartbeat_at=at - timedelta(seconds=heartbeat_age_s),
        )
        record_failure(swarm.e.node_id, reason, job=job, now=at)

    node = Node.objects.get(pk=swarm.e.pk)
    assert (node.recent_failures, node.recent_deliberate) == (6, 0)
    assert node.routing_backoff_until == NOW + timedelta(seconds=50 + CAP_S)
    assert not Strike.objects.exists()


def test_failures_within_an_incident_count_once(swarm, job):
    for ms in range(0, 3000, 100):  # thirty jobs lost within three seconds: one crash
        record_failure(swarm.e.node_id, "stage_lost: connection dropped", job=job, now=NOW + timedelta(milliseconds=ms))

    assert counters(swarm.e) == (1, 1, NOW, NOW + timedelta(seconds=BASE_S))


def test_a_node_not_on_the_jobs_route_is_not_counted(swarm, job):
    assert record_failure(swarm.b.node_id, "stalled", job=job, now=NOW) is None
    assert record_failure("node-0000000000000000", "stalled", job=job, now=NOW) is None

    assert counters(swarm.b) == (0, 0, None, None)
    assert not Strike.objects.exists()
