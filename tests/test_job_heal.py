"""Healing a request in flight: its coordinator reports a dead or stalled stage and gets a route
that avoids every node it reported, keeping the surviving stages (a warm spare or another
pipeline's stage holding the dead span takes it); the job stores the new route and the heal."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction

from marketplace.jobs.models import Job, JobState
from marketplace.jobs.services import heal_job, heal_may_wait, load_replacement
from marketplace.nodes.models import Node, NodeState
from marketplace.placement import readiness
from marketplace.placement.healing import heal_wait_s
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.selectors import hold_routes
from tests.factories import MODEL
from tests.heal_fixtures import NOW, report_ready, stage
from worker_agent.protocol.span import Span

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.heal_fixtures"]


def job_on(customer, route: list[dict], *, state: str = JobState.RUNNING, audit_stages=(1,)) -> Job:
    return Job.objects.create(
        public_id="chatcmpl-heal",
        kind="chat",
        customer=customer,
        model=MODEL,
        state=state,
        route=route,
        coordinator_region="local",
        audit_stages=list(audit_stages),
    )


def stored(job: Job) -> tuple:
    job.refresh_from_db()
    return job.route, job.heals, job.audit_stages, job.progress_at


def suspected(node: Node):
    return Node.objects.get(pk=node.pk).suspected_at


def test_the_spare_takes_the_dead_span_and_the_surviving_stage_stays(swarm, customer):
    before = [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)]
    job = job_on(customer, before)

    route = heal_job(job.pk, swarm.b.node_id, "no RESULT within 5 s", now=NOW)

    assert route == [stage(swarm.a, 0, 16), stage(swarm.e, 16, 30)]
    assert stored(job) == (
        route,
        [
            {
                "at": NOW.isoformat(),
                "failed_node": swarm.b.node_id,
                "reason": "no RESULT within 5 s",
                "route_before": before,
            }
        ],
        [1],  # same length: the audited position stays
        NOW,
    )
    assert (suspected(swarm.b), Node.objects.get(pk=swarm.b.pk).suspicion) == (NOW, "no RESULT within 5 s")


def test_the_surviving_stage_is_kept_even_when_a_full_route_elsewhere_is_faster(swarm, customer):
    # a[0:16] computes twice as fast as c[0:16], but the request's prefix already ran on c.
    job = job_on(customer, [stage(swarm.c, 0, 16), stage(swarm.d, 16, 30)])

    route = heal_job(job.pk, swarm.d.node_id, "connection closed", now=NOW)

    assert route == [stage(swarm.c, 0, 16), stage(swarm.e, 16, 30)]


def test_a_second_heal_avoids_every_node_the_job_reported_and_a_third_is_refused(swarm, customer):
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])
    heal_job(job.pk, swarm.b.node_id, "stalled", now=NOW)
    later = NOW + timedelta(seconds=1)
    Node.objects.filter(pk=swarm.b.pk).update(suspected_at=None)  # even were b cleared, this job avoids it

    second = heal_job(job.pk, swarm.e.node_id, "stalled", now=later)
    kept = stored(job)
    third = heal_job(job.pk, swarm.d.node_id, "stalled", now=later + timedelta(seconds=1))

    assert second == [stage(swarm.a, 0, 16), stage(swarm.d, 16, 30)]
    assert [h["failed_node"] for h in kept[1]] == [swarm.b.node_id, swarm.e.node_id]
    assert third is None
    assert stored(job) == kept
    assert suspected(swarm.d) == later + timedelta(seconds=1)  # the failure itself is still reported


def test_no_route_avoiding_the_failed_node_leaves_the_job_as_it_was(swarm, customer):
    Node.objects.filter(pk__in=[swarm.d.pk, swarm.e.pk]).update(state=NodeState.OFFLINE)
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])
    kept = stored(job)

    route = heal_job(job.pk, swarm.b.node_id, "stalled", now=NOW)

    assert route is None
    assert stored(job) == kept
    assert suspected(swarm.b) == NOW


@pytest.mark.parametrize("state", [JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_a_job_that_is_not_running_is_not_healed(swarm, customer, state):
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)], state=state)
    kept = stored(job)

    assert heal_job(job.pk, swarm.b.node_id, "stalled", now=NOW) is None
    assert stored(job) == kept
    assert suspected(swarm.b) is None


def test_a_node_off_the_jobs_route_is_not_healed_around(swarm, customer):
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])
    kept = stored(job)

    assert heal_job(job.pk, swarm.d.node_id, "stalled", now=NOW) is None
    assert heal_job(job.pk + 1, swarm.b.node_id, "stalled", now=NOW) is None  # no such job
    assert stored(job) == kept
    assert (suspected(swarm.d), suspected(swarm.b)) == (None, None)


def test_a_route_of_another_length_draws_its_audited_stages_again(swarm, customer):
    # The job ran on one stage holding every layer (as a's was before the last placement): the
    # route that replaces it has two stages.
    job = job_on(customer, [stage(swarm.a, 0, 30)], audit_stages=[0])
    Node.objects.filter(pk__in=[swarm.c.pk, swarm.e.pk]).update(audit_fraction=1.0)
    Node.objects.filter(pk__in=[swarm.b.pk, swarm.d.pk]).update(state=NodeState.OFFLINE)

    route = heal_job(job.pk, swarm.a.node_id, "stalled", now=NOW)

    assert route == [stage(swarm.c, 0, 16), stage(swarm.e, 16, 30)]
    assert stored(job)[2] == [0, 1]  # every node of the new route audits at fraction 1


def test_with_the_dead_span_only_loading_the_heal_waits_and_takes_it_once_ready(swarm, customer):
    # d is gone and e (the spare of [16:30)) is still loading its block: no route now, but one is coming.
    Node.objects.filter(pk=swarm.d.pk).update(state=NodeState.OFFLINE)
    Assignment.objects.filter(node=swarm.e, state=AssignmentState.READY).update(state=AssignmentState.ASSIGNED)
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])

    assert heal_job(job.pk, swarm.b.node_id, "connection closed", now=NOW) is None
    later = NOW + timedelta(seconds=2)
    assert heal_may_wait(job.pk, now=later)
    assert stored(job)[3] == later  # waiting is a sign of life: the staleness watch leaves the job be

    report_ready()  # e's block is loaded
    Node.objects.filter(pk=swarm.b.pk).update(suspected_at=None, suspicion="")
    route = heal_job(job.pk, swarm.b.node_id, "connection closed", now=later, report=False)

    assert route == [stage(swarm.a, 0, 16), stage(swarm.e, 16, 30)]
    assert [h["failed_node"] for h in stored(job)[1]] == [swarm.b.node_id]
    assert suspected(swarm.b) is None  # asked again without reporting the node again


def test_a_heal_does_not_wait_when_nothing_can_come(swarm, customer):
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])
    Node.objects.update(state=NodeState.OFFLINE)  # no node of the model is left
    assert not heal_may_wait(job.pk, now=NOW)

    Node.objects.update(state=NodeState.ACTIVE)
    assert heal_may_wait(job.pk, now=NOW)
    Job.objects.filter(pk=job.pk).update(heals=[{"failed_node": "x"}] * 2)  # SWARM_MAX_HEALS spent
    assert not heal_may_wait(job.pk, now=NOW)
    Job.objects.filter(pk=job.pk).update(heals=[], state=JobState.SUCCEEDED)
    assert not heal_may_wait(job.pk, now=NOW)
    assert not heal_may_wait(job.pk + 1, now=NOW)  # no such job


def test_with_no_other_holder_a_stalled_node_that_proved_alive_takes_its_span_again(swarm, customer):
    Node.objects.filter(pk__in=[swarm.d.pk, swarm.e.pk]).update(state=NodeState.OFFLINE)
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])

    assert heal_job(job.pk, swarm.b.node_id, "stalled", now=NOW) is None  # b is the only holder, and suspect
    Node.objects.filter(pk=swarm.b.pk).update(suspected_at=None, suspicion="")  # its heartbeats clear it
    route = heal_job(job.pk, swarm.b.node_id, "stalled", now=NOW + timedelta(seconds=5), report=False)

    assert route == [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)]
    assert [h["failed_node"] for h in stored(job)[1]] == [swarm.b.node_id]


def spare_of_another_span(node: Node, start: int, end: int) -> Assignment:
    """Make ``node``'s live block a ready spare of [start:end) (another span than the one that dies)."""
    Assignment.objects.filter(node=node, state__in=[AssignmentState.ASSIGNED, AssignmentState.READY]).update(
        layer_start=start, layer_end=end, is_spare=True
    )
    return Assignment.objects.get(node=node, state=AssignmentState.READY)


def test_with_no_holder_of_the_dead_span_a_spare_of_another_span_loads_it_make_before_break(swarm, customer):
    # b dies; d (the other holder of [16:30)) is gone, and e is a spare of [0:14), not of [16:30).
    Node.objects.filter(pk=swarm.d.pk).update(state=NodeState.OFFLINE)
    old = spare_of_another_span(swarm.e, 0, 14)
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])
    assert heal_job(job.pk, swarm.b.node_id, "stage_lost: connection closed", now=NOW) is None

    assert load_replacement(job.pk, swarm.b.node_id)

    loading = Assignment.objects.get(node=swarm.e, state=AssignmentState.ASSIGNED)
    assert (loading.layer_start, loading.layer_end, loading.is_spare, loading.supersedes_id) == (16, 30, True, old.pk)
    old.refresh_from_db()
    assert (
        old.state == AssignmentState.RELEASED
    )  # nothing new goes to it; its agent keeps it until the new one is ready
    assert load_replacement(job.pk, swarm.b.node_id)  # asked again: the block loading is waited for, not doubled
    assert Assignment.objects.filter(node=swarm.e, layer_start=16, layer_end=30).count() == 1

    report_ready()  # e loaded it
    route = heal_job(job.pk, swarm.b.node_id, "stage_lost: connection closed", now=NOW, report=False)
    assert route == [stage(swarm.a, 0, 16), stage(swarm.e, 16, 30)]
    loading.refresh_from_db()
    assert loading.supersedes_id is None  # the old block was let go at its agent once this one was ready


def test_no_node_loads_the_dead_span_when_none_can_hold_it_or_may_take_it(swarm, customer):
    # e is a spare of [0:14) but holds at most 15 layers: [0:16) is more than it can hold; c serves a
    # pipeline whose other member is gone, so no other pipeline stays whole without it: nobody loads.
    Node.objects.filter(pk=swarm.b.pk).update(state=NodeState.OFFLINE)
    spare_of_another_span(swarm.e, 16, 30)
    job = job_on(customer, [stage(swarm.c, 0, 16), stage(swarm.d, 16, 30)])
    Node.objects.filter(pk=swarm.a.pk).update(state=NodeState.OFFLINE)
    assert heal_job(job.pk, swarm.c.node_id, "stage_lost: connection closed", now=NOW) is None

    assert not load_replacement(job.pk, swarm.c.node_id)
    assert not Assignment.objects.filter(state=AssignmentState.ASSIGNED).exists()


def test_the_wait_for_a_loaded_span_grows_with_its_bytes(settings):
    settings.SWARM_HEAL_WAIT_S, settings.SWARM_HEAL_WAIT_S_PER_GIB = 30.0, 60.0
    one, all_layers = heal_wait_s(Span(MODEL, 0, 1)), heal_wait_s(Span(MODEL, 0, 30))
    assert 30.0 < one < all_layers
    assert all_layers - 30.0 == pytest.approx(30 * (one - 30.0))


def test_a_stage_behind_a_relay_found_down_blames_the_relay_and_waits_for_its_agents_next_relay(
    swarm, customer, settings
):
    settings.SWARM_RELAYS = ["r1=10.9.0.1:7700", "r2=10.9.0.2:7700"]
    Node.objects.filter(pk__in=[swarm.d.pk, swarm.e.pk]).update(state=NodeState.OFFLINE)
    at_r1 = "wss://10.9.0.1:7700"
    Assignment.objects.filter(node=swarm.b, state=AssignmentState.READY).update(data_url=at_r1)
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])

    assert heal_job(job.pk, swarm.b.node_id, "stage_lost: closed", now=NOW, relay_down="10.9.0.1:7700") is None

    b = Node.objects.get(pk=swarm.b.pk)
    assert (b.suspected_at, b.routing_backoff_until, b.failures_total) == (None, None, 0)  # the relay failed, not b
    block = Assignment.objects.get(node=swarm.b, state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
    assert block.state == AssignmentState.ASSIGNED  # off routing at its dead relay's URL
    assert Assignment.objects.get(node=swarm.a, state=AssignmentState.READY)  # a block served directly stays

    # b's agent reports its block again through r2: the job goes on with it.
    readiness.assignment_ready(swarm.b.pk, block.pk, "wss://10.9.0.2:7700")
    route = heal_job(job.pk, swarm.b.node_id, "stage_lost: closed", now=NOW, report=False)
    assert [s["node"] for s in route] == [swarm.a.node_id, swarm.b.node_id]
    assert route[1]["url"] == "wss://10.9.0.2:7700"


def test_an_idle_pipeline_member_whose_span_another_block_holds_loads_the_dead_span(swarm, customer):
    # b dies; d and e are gone: no other block of [16:30). c serves [0:16) on the other pipeline,
    # carries no job, and a holds [0:16) too: c may give its span up for the heal. a is on the route.
    Node.objects.filter(pk__in=[swarm.d.pk, swarm.e.pk]).update(state=NodeState.OFFLINE)
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])
    assert heal_job(job.pk, swarm.b.node_id, "stage_lost: connection closed", now=NOW) is None

    assert load_replacement(job.pk, swarm.b.node_id)

    loading = Assignment.objects.get(node=swarm.c, state=AssignmentState.ASSIGNED)
    assert (loading.layer_start, loading.layer_end, loading.is_spare) == (16, 30, True)
    assert loading.supersedes.layer_start == 0 and not loading.supersedes.is_spare  # its pipeline block


def test_a_pipeline_member_carrying_a_job_is_not_taken(swarm, customer):
    Node.objects.filter(pk__in=[swarm.d.pk, swarm.e.pk]).update(state=NodeState.OFFLINE)
    other = job_on(customer, [stage(swarm.c, 0, 16), stage(swarm.d, 16, 30)])
    Job.objects.filter(pk=other.pk).update(public_id="chatcmpl-other")  # another job in flight on c
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])
    assert heal_job(job.pk, swarm.b.node_id, "stage_lost: connection closed", now=NOW) is None

    assert not load_replacement(job.pk, swarm.b.node_id)
    assert not Assignment.objects.filter(state=AssignmentState.ASSIGNED).exists()


@pytest.mark.django_db(transaction=True)
def test_a_heal_around_a_dead_relay_locks_the_placement_before_the_relays_blocks(swarm, customer, settings):
    # A block reported through another relay (readiness) locks its model's placement row, then the
    # block's row. A heal that blamed the dead relay had locked the relay's blocks first, then the
    # placement row: the two deadlocked, and the job failed. The heal now waits on the placement row
    # before it touches a block, so whoever holds that row can still lock the relay's blocks.
    settings.SWARM_RELAYS = ["r1=10.9.0.1:7700", "r2=10.9.0.2:7700"]
    Node.objects.filter(pk__in=[swarm.d.pk, swarm.e.pk]).update(state=NodeState.OFFLINE)
    Assignment.objects.filter(node=swarm.b, state=AssignmentState.READY).update(data_url="wss://10.9.0.1:7700")
    job = job_on(customer, [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)])
    outcome: list = []

    def heal() -> None:
        try:
            outcome.append(heal_job(job.pk, swarm.b.node_id, "stage_lost: closed", now=NOW, relay_down="10.9.0.1:7700"))
        except Exception as exc:  # a deadlock, here, would be PostgreSQL's to report
            outcome.append(exc)
        finally:
            connection.close()

    with transaction.atomic():
        hold_routes(MODEL)
        healer = threading.Thread(target=heal)
        healer.start()
        deadline = time.monotonic() + 60
        with connection.cursor() as cursor:
            while not outcome and time.monotonic() < deadline:  # until the heal waits on a lock (pg_locks is live)
                cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
                if cursor.fetchone()[0]:
                    break
                time.sleep(0.01)
        assert not outcome  # it waits for the placement row
        blocks = list(Assignment.objects.select_for_update(nowait=True).filter(node=swarm.b))  # not locked by it
    healer.join(60)

    assert blocks and outcome == [None]  # then it goes on: the relay blamed, no route yet
    assert Assignment.objects.get(pk=blocks[0].pk).state == AssignmentState.ASSIGNED
