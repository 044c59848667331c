"""A route is never chosen from a placement older than a release being decided at the same time.

Two transactions race: one decides to let a block go (``rebalancing.release_leaving``: a node moved to
another model's share), the other chooses a route (``services.heal_job`` for a job whose stage died).
Both take the model's placement row first (``selectors.hold_routes``), so the route is chosen after
the release commits and never takes the released block; the block's agent serves only jobs routed to
it before. The release is held open in a thread of its own until the heal is seen waiting for it
(Postgres reports the heal's backend waiting on a lock), so the test decides the interleaving.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from marketplace.jobs.models import Job, JobState
from marketplace.jobs.services import heal_job
from marketplace.nodes.models import Node
from marketplace.placement import rebalancing
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from tests.factories import MODEL
from tests.heal_fixtures import NOW, stage

pytestmark = [pytest.mark.control, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.heal_fixtures"]

WAIT_S = 30.0  # the longest the test waits on any one condition before it fails


def _waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0] > 0


def _in_thread(target, results: dict, name: str) -> threading.Thread:
    def run() -> None:
        try:
            results[name] = target()
        except BaseException as exc:  # reported by the test's asserts
            results[name] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def test_a_heal_chosen_while_a_block_is_being_released_never_takes_it(swarm, customer, swarm_settings):
    # Given: e, the warm spare of [16:30), moves to another model (its share leaves it out), and a job
    # on a[0:16] -> b[16:30] that saw d fail before (d has proved alive since); b failed now and is
    # reported. Of the nodes the job did not see fail, e alone holds [16:30); the job's healer asks
    # for a route again (``report=False``), as it does while it waits for one.
    swarm_settings.SWARM_MODELS = [MODEL, "tiny-llama"]
    PlacementState.objects.filter(model=MODEL).update(share=[n.node_id for n in (swarm.a, swarm.b, swarm.c, swarm.d)])
    Node.objects.filter(pk=swarm.b.pk).update(suspected_at=NOW, suspicion="stalled")
    before = [stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)]
    earlier = {"at": NOW.isoformat(), "failed_node": swarm.d.node_id, "reason": "stalled", "route_before": before}
    job = Job.objects.create(
        public_id="chatcmpl-leaving", kind="chat", customer=customer, model=MODEL, state=JobState.RUNNING,
        route=before, heals=[earlier], coordinator_region="local", audit_stages=[1],
    )  # fmt: skip
    decided, commit, results = threading.Event(), threading.Event(), {}

    def release() -> list[str]:
        with transaction.atomic():
            released = rebalancing.release_leaving(MODEL)
            decided.set()
            assert commit.wait(WAIT_S)
        return released

    # When: the release is decided and not yet committed while the heal chooses its route.
    releasing = _in_thread(release, results, "release")
    assert decided.wait(WAIT_S)
    healing = _in_thread(lambda: heal_job(job.pk, swarm.b.node_id, "stalled", now=NOW, report=False), results, "heal")
    deadline = time.monotonic() + WAIT_S
    while healing.is_alive() and not _waiting_on_a_lock():
        assert time.monotonic() < deadline, "the heal neither ended nor waited for the release"
        time.sleep(0.01)
    commit.set()
    releasing.join(WAIT_S)
    healing.join(WAIT_S)

    # Then: e's block is released, and the heal, chosen after it, went back to d rather than to e.
    assert results["release"] == [swarm.e.node_id]
    assert Assignment.objects.get(node=swarm.e, model=MODEL).state == AssignmentState.RELEASED
    assert [s["node"] for s in results["heal"]] == [swarm.a.node_id, swarm.d.node_id]
    job.refresh_from_db()
    assert [s["node"] for s in job.route] == [swarm.a.node_id, swarm.d.node_id]
    assert [heal["failed_node"] for heal in job.heals] == [swarm.d.node_id, swarm.b.node_id]
