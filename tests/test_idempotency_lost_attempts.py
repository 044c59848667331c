"""An Idempotency-Key's attempt lost with its web process, or left by its client, and a job whose
coordinator's process died: a retry runs at once, the key is charged for one attempt (the lost
attempt's job charged nothing, or refunded when it had settled), and the dead coordinator's job
ends failed and uncharged without waiting SWARM_JOB_STALE_S. Liveness is read from the cache
(``jobs.liveness``): a process id with no sign of life there is gone."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from marketplace.billing import services
from marketplace.billing.models import AccountKind, Transfer
from marketplace.flows import settlement
from marketplace.jobs import idempotency, liveness
from marketplace.jobs.models import IdempotentRequest, Job, JobState
from marketplace.jobs.services import COORDINATOR_GONE, finish_job, stopped_answering
from tests.job_fixtures import HOLD, funded_customer, running_job
from tests.live import wait_for

pytestmark = [pytest.mark.billing, pytest.mark.django_db]


@pytest.fixture
def customer(django_user_model, settings):
    return funded_customer(django_user_model, settings)


@pytest.fixture(autouse=True)
def lives_recorded_long_since():
    """The cache has kept its record of lives for longer than SWARM_PROCESS_ALIVE_S: a missing sign
    of life is a death."""
    cache.set(liveness.RECORD_KEY, 1, timeout=None)
    cache.delete(liveness.NEW_RECORD_KEY)


GRANT = 1_000_000_000  # the customer's $1
TWO_TOKENS = 40_000 + 6_000  # what a running job that delivered 2 tokens costs
DEAD = "web1:4242:0badcafe"  # a process id nothing keeps alive


def attempt(customer, job: Job | None, *, state=IdempotentRequest.State.RUNNING, owner: str = DEAD, age_s=0.0):
    return IdempotentRequest.objects.create(
        customer=customer,
        key="retry-1",
        body_sha256="0" * 64,
        state=state,
        job=job,
        owner=owner,
        created_at=timezone.now() - timedelta(seconds=age_s),
    )


def charged(job: Job) -> int:
    """What the job costs its customer now: its charges less its refunds."""
    moves = Transfer.objects.filter(job=job)
    return sum(t.amount for t in moves.filter(kind="charge")) - sum(t.amount for t in moves.filter(kind="refund"))


def test_a_retry_of_an_attempt_whose_web_process_is_gone_runs_at_once_and_supersedes_it(customer):
    job = running_job(customer, "chatcmpl-lost")
    record = attempt(customer, job)

    claim = idempotency.claim(customer, "retry-1", "0" * 64)

    assert (claim.wait, claim.replay, claim.superseded) == (False, None, (job.public_id,))
    record.refresh_from_db()
    job.refresh_from_db()
    assert (record.state, record.job, record.owner) == (IdempotentRequest.State.RUNNING, None, liveness.this_process())
    assert job.superseded_at is not None


def test_a_retry_waits_while_the_web_process_answering_the_first_attempt_lives(customer):
    job = running_job(customer, "chatcmpl-alive")
    alive = "web2:4343:0ddba11"
    liveness.report_alive(alive)
    attempt(customer, job, owner=alive)

    claim = idempotency.claim(customer, "retry-1", "0" * 64)

    assert (claim.wait, claim.superseded) == (True, ())
    job.refresh_from_db()
    assert job.superseded_at is None


def test_a_retry_waits_for_an_attempt_a_live_web_process_still_queues_past_the_lost_clock(customer):
    alive = "web2:4343:0ddba11"
    liveness.report_alive(alive)
    attempt(customer, None, owner=alive, age_s=idempotency.LOST_AFTER_S + 30)  # not admitted yet

    claim = idempotency.claim(customer, "retry-1", "0" * 64)

    assert (claim.wait, claim.superseded) == (True, ())


def test_the_superseded_job_settles_to_nothing_when_it_ends_and_its_hold_returns(customer):
    job = running_job(customer, "chatcmpl-lost")
    attempt(customer, job)
    idempotency.claim(customer, "retry-1", "0" * 64)

    finish_job(job.pk, state=JobState.CANCELLED, completion_tokens=2, finish_reason="stop")
    settlement.settle(job.pk)

    job.refresh_from_db()
    assert (job.charged_amount, charged(job)) == (0, 0)
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == 0
    assert services.credits(customer) == GRANT
    release = Transfer.objects.get(job=job, kind="release")
    assert (release.amount, release.memo) == (
        HOLD,
        "not charged: a retry of its Idempotency-Key ran afresh (the key is charged for one attempt)",
    )


def test_an_attempt_its_client_left_that_was_charged_already_is_refunded_once_by_the_retry(customer):
    job = running_job(customer, "chatcmpl-left")
    finish_job(job.pk, state=JobState.CANCELLED, completion_tokens=2, finish_reason="stop")
    settlement.settle(job.pk)
    assert services.credits(customer) == GRANT - TWO_TOKENS
    record = attempt(customer, job, state=IdempotentRequest.State.ABANDONED)

    claim = idempotency.claim(customer, "retry-1", "0" * 64)
    IdempotentRequest.objects.filter(pk=record.pk).update(state=IdempotentRequest.State.ABANDONED, job=job)
    idempotency.claim(customer, "retry-1", "0" * 64)  # a third attempt: the same job is not refunded again

    assert claim.superseded == ()  # it had ended: nothing to stop
    assert charged(job) == 0
    refund = Transfer.objects.get(job=job, kind="refund")
    assert (refund.amount, refund.memo) == (TWO_TOKENS, idempotency.SUPERSEDED_REFUND)
    assert services.credits(customer) == GRANT


def test_an_expired_keys_attempt_is_not_superseded(customer, settings):
    settings.SWARM_IDEMPOTENCY_TTL_S = 60
    job = running_job(customer, "chatcmpl-old")
    finish_job(job.pk, state=JobState.CANCELLED, completion_tokens=2, finish_reason="stop")
    settlement.settle(job.pk)
    attempt(customer, job, state=IdempotentRequest.State.ABANDONED, age_s=120)

    idempotency.claim(customer, "retry-1", "1" * 64)

    job.refresh_from_db()
    assert (job.superseded_at, charged(job)) == (None, TWO_TOKENS)


def test_a_job_whose_coordinator_process_is_gone_is_failed_at_once_and_charged_nothing(customer):
    lost = running_job(customer, "chatcmpl-lost")
    alive = running_job(customer, "chatcmpl-alive")
    live_process = "coord2:4444:feedf00d"
    liveness.report_alive(live_process)
    Job.objects.filter(pk=lost.pk).update(coordinator_process="coord1:4141:deadbeef")
    Job.objects.filter(pk=alive.pk).update(coordinator_process=live_process)

    reason = stopped_answering(lost.pk)
    reconciled = settlement.reconcile_jobs()

    assert (reason, stopped_answering(alive.pk)) == (COORDINATOR_GONE, None)
    assert reconciled == ["chatcmpl-lost"]
    lost.refresh_from_db()
    alive.refresh_from_db()
    assert (lost.state, lost.error_code, lost.charged_amount) == (JobState.FAILED, "coordinator_lost", 0)
    assert alive.state == JobState.RUNNING
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == HOLD


def test_unstamped_work_is_never_judged_gone():
    assert liveness.gone("") is False


def test_after_the_cache_forgets_every_life_no_process_is_gone_until_each_could_sign_again(customer, settings):
    settings.SWARM_PROCESS_ALIVE_S = 2.0
    job = running_job(customer, "chatcmpl-alive")
    live_process = "coord2:4444:feedf00d"
    liveness.report_alive(live_process)
    Job.objects.filter(pk=job.pk).update(coordinator_process=live_process)
    assert liveness.gone(DEAD) is True

    cache.clear()  # Redis restarted or flushed: the live process's sign of life is gone with the rest

    assert (liveness.gone(live_process), liveness.gone(DEAD)) == (False, False)  # no record: no verdict
    liveness.report_alive(DEAD.replace("0badcafe", "5ca1ab1e"))  # another process signs first: a new record
    assert (liveness.gone(live_process), liveness.gone(DEAD)) == (False, False)  # new: still no verdict
    assert settlement.reconcile_jobs() == []
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    wait_for(lambda: cache.get(liveness.NEW_RECORD_KEY) is None, 10, "the record of lives no longer new")
    liveness.report_alive(live_process)  # it beats on
    assert (liveness.gone(live_process), liveness.gone(DEAD)) == (False, True)
