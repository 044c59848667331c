"""A job whose coordinator process died is settled from its own record by the periodic task,
and nothing is ever charged twice. (Settlement charges only verified work, or what a job its client
cancelled was sent: the jobs here that must be charged are cancelled ones, which need no receipts.)"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from marketplace.billing import services
from marketplace.billing.models import AccountKind, Transfer
from marketplace.flows import settlement
from marketplace.flows.settlement import reconcile_jobs
from marketplace.jobs.models import JobState
from marketplace.jobs.services import finish_job, record_progress
from tests.job_fixtures import funded_customer, running_job

pytestmark = [pytest.mark.billing, pytest.mark.django_db]


@pytest.fixture
def customer(django_user_model, settings):
    return funded_customer(django_user_model, settings)


def test_a_job_whose_coordinator_went_silent_is_failed_and_charged_nothing(customer):
    job = running_job(customer, "chatcmpl-lost")
    record_progress({job.pk: 5})
    later = timezone.now() + timedelta(seconds=61)

    reconciled = reconcile_jobs(now=later)

    job.refresh_from_db()
    assert reconciled == ["chatcmpl-lost"]
    assert (job.state, job.error_code, job.completion_tokens) == (JobState.FAILED, "coordinator_lost", 5)
    # Its 5 tokens were never verified (its receipts went with its coordinator): nothing is charged.
    assert job.charged_amount == 0
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == 0
    assert services.credits(customer) == 1_000_000_000
    assert Transfer.objects.get(job=job, kind="release").memo == "not charged: the job failed (coordinator_lost)"


def test_reconciling_again_charges_nothing_more(customer):
    job = running_job(customer, "chatcmpl-lost")
    record_progress({job.pk: 5})
    later = timezone.now() + timedelta(seconds=61)
    reconcile_jobs(now=later)

    assert reconcile_jobs(now=later + timedelta(seconds=61)) == []
    assert Transfer.objects.filter(job=job, kind="release").count() == 1
    assert services.credits(customer) == 1_000_000_000


def test_a_job_that_is_still_reporting_is_left_alone(customer):
    job = running_job(customer, "chatcmpl-alive")
    record_progress({job.pk: 3})

    assert reconcile_jobs(now=timezone.now() + timedelta(seconds=30)) == []
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == 340_000


def test_an_ended_job_whose_settlement_was_lost_is_settled(customer):
    job = running_job(customer, "chatcmpl-ended")
    finish_job(job.pk, state=JobState.CANCELLED, completion_tokens=2, finish_reason="stop")

    assert reconcile_jobs() == ["chatcmpl-ended"]
    job.refresh_from_db()
    assert job.charged_amount == 40_000 + 6_000
    assert job.settled_at is not None


def test_a_job_that_failed_before_the_first_token_charges_nothing(customer):
    job = running_job(customer, "chatcmpl-failed")
    finish_job(job.pk, state=JobState.FAILED, completion_tokens=0, error_code="stage_lost")

    reconcile_jobs()

    job.refresh_from_db()
    assert job.charged_amount == 0
    assert services.credits(customer) == 1_000_000_000
    assert not Transfer.objects.filter(job=job, kind="charge").exists()


def test_a_job_that_cannot_settle_does_not_block_the_others(customer, monkeypatch):
    stuck = running_job(customer, "chatcmpl-stuck")
    ended = running_job(customer, "chatcmpl-after")
    for job in (stuck, ended):
        finish_job(job.pk, state=JobState.CANCELLED, completion_tokens=2, finish_reason="stop")
    real_settle = settlement.settle

    def settle(job_pk: int) -> int:
        if job_pk == stuck.pk:
            raise RuntimeError("a record that cannot be settled")
        return real_settle(job_pk)

    monkeypatch.setattr("marketplace.flows.settlement.settle", settle)

    assert reconcile_jobs() == ["chatcmpl-after"]
    stuck.refresh_from_db()
    ended.refresh_from_db()
    assert (stuck.settled_at, stuck.charged_amount) == (None, 0)
    assert ended.settled_at is not None
    assert ended.charged_amount == 40_000 + 6_000


def test_a_job_that_keeps_failing_to_settle_backs_off_and_is_flagged_for_admins(customer, monkeypatch, settings):
    settings.SWARM_SETTLE_RETRY_S, settings.SWARM_SETTLE_RETRY_MAX_S, settings.SWARM_SETTLE_FLAG_AFTER = 30, 45, 3
    stuck = running_job(customer, "chatcmpl-stuck")
    finish_job(stuck.pk, state=JobState.CANCELLED, completion_tokens=2, finish_reason="stop")
    tries = []

    def settle(job_pk: int) -> int:
        tries.append(job_pk)
        raise KeyError("node-gone")

    monkeypatch.setattr("marketplace.flows.settlement.settle", settle)
    start = timezone.now()
    seen = []
    for offset in (0, 10, 29, 31, 60, 76, 200):  # due at 0, then 30 after it, then 45 (capped) after that
        reconcile_jobs(now=start + timedelta(seconds=offset))
        stuck.refresh_from_db()
        seen.append((offset, len(tries), stuck.settle_failures, stuck.settle_flagged))

    assert seen == [
        (0, 1, 1, False),
        (10, 1, 1, False),
        (29, 1, 1, False),
        (31, 2, 2, False),
        (60, 2, 2, False),
        (76, 3, 3, True),
        (200, 4, 4, True),
    ]
    assert stuck.settle_error == "KeyError: 'node-gone'"
    assert stuck.settle_retry_at == start + timedelta(seconds=200 + 45)
    assert (stuck.settled_at, stuck.charged_amount) == (None, 0)
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == 340_000


def test_a_flagged_settlement_shows_in_the_admin_and_settles_once_retried(customer, monkeypatch, settings, client):
    settings.SWARM_SETTLE_FLAG_AFTER = 1
    stuck = running_job(customer, "chatcmpl-stuck")
    finish_job(stuck.pk, state=JobState.CANCELLED, completion_tokens=2, finish_reason="stop")
    monkeypatch.setattr("marketplace.flows.settlement.settle", lambda job_pk: 1 / 0)
    reconcile_jobs()
    monkeypatch.undo()
    admin = type(customer).objects.create_superuser(username="root", email="root@example.com", password="x")
    client.force_login(admin)

    listing = client.get("/admin/jobs/job/?settle_flagged__exact=1")
    retried = client.post(
        "/admin/jobs/job/", {"action": "retry_settlement", "_selected_action": [stuck.pk]}, follow=True
    )
    settled = reconcile_jobs()

    assert listing.status_code == 200
    assert "chatcmpl-stuck" in listing.content.decode()
    assert "ZeroDivisionError: division by zero" in listing.content.decode()
    assert "1 job(s) will be settled at the next reconcile." in retried.content.decode()
    assert settled == ["chatcmpl-stuck"]
    stuck.refresh_from_db()
    assert (stuck.settle_flagged, stuck.settle_failures, stuck.charged_amount) == (False, 1, 40_000 + 6_000)


def test_a_processs_running_jobs_record_their_progress_in_one_statement(customer):
    first, second = running_job(customer, "chatcmpl-one"), running_job(customer, "chatcmpl-two")
    ended = running_job(customer, "chatcmpl-ended")
    finish_job(ended.pk, state=JobState.SUCCEEDED, completion_tokens=2)

    with CaptureQueriesContext(connection) as queries:
        record_progress({first.pk: 7, second.pk: 11, ended.pk: 99})

    assert len(queries) == 1
    for job in (first, second, ended):
        job.refresh_from_db()
    assert (first.completion_tokens, second.completion_tokens, ended.completion_tokens) == (7, 11, 2)
    assert first.progress_at is not None and first.progress_at == second.progress_at
