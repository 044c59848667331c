"""The ledger: balanced, immutable transfers; holds at admission; settlement on delivered tokens."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection, transaction
from django.db.models import Sum

from marketplace.billing import services
from marketplace.billing.errors import InsufficientCredits
from marketplace.billing.models import NANO_PER_DOLLAR, AccountKind, LedgerAccount, ModelPrice, Transfer
from marketplace.flows import settlement
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.services import create_api_key, finish_job

pytestmark = [pytest.mark.billing, pytest.mark.django_db]

MODEL = "smollm2-135m"


@pytest.fixture
def customer(django_user_model):
    return django_user_model.objects.create_user(username="cust", email="c@example.com", password="x", is_customer=True)


@pytest.fixture
def price(settings):
    from django.utils import timezone

    settings.SWARM_MODELS = [MODEL]
    return ModelPrice.objects.create(
        model=MODEL,
        prompt_per_million=1_000_000_000,
        completion_per_million=3_000_000_000,
        effective_from=timezone.now(),
    )


def make_job(customer, *, max_tokens=100, prompt_tokens=40):
    api_key, _ = create_api_key(customer, "k")
    return Job.objects.create(
        public_id=f"chatcmpl-{Job.objects.count()}",
        kind="chat",
        customer=customer,
        api_key=api_key,
        model=MODEL,
        params={"max_tokens": max_tokens},
        prompt_tokens=prompt_tokens,
    )


def test_every_balance_is_the_sum_of_its_transfers(customer, price):
    services.grant(customer, "2.5")
    job = make_job(customer)
    settlement.place_hold(job)
    finish_job(job.pk, state=JobState.SUCCEEDED, completion_tokens=10)
    settlement.settle(job.pk)

    for account in LedgerAccount.objects.all():
        credits = Transfer.objects.filter(credit=account).aggregate(s=Sum("amount"))["s"] or 0
        debits = Transfer.objects.filter(debit=account).aggregate(s=Sum("amount"))["s"] or 0
        assert account.balance == credits - debits
    assert sum(a.balance for a in LedgerAccount.objects.all()) == 0


def test_a_hold_reserves_the_worst_case_and_settles_to_the_delivered_tokens(customer, price):
    services.grant(customer, 1)
    job = make_job(customer, max_tokens=100, prompt_tokens=40)

    settlement.place_hold(job)
    job.refresh_from_db()
    # 40 prompt x $1/M + 100 completion x $3/M = 340e-6 dollars = 340_000 nano-dollars
    assert job.hold_amount == 340_000
    assert services.credits(customer) == NANO_PER_DOLLAR - 340_000
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == 340_000

    # Cancelled by its customer after 7 tokens: what was delivered is theirs to pay, receipts or not.
    finish_job(job.pk, state=JobState.CANCELLED, completion_tokens=7)
    charge = settlement.settle(job.pk)

    assert charge == 40_000 + 21_000
    assert services.credits(customer) == NANO_PER_DOLLAR - 61_000
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == 0
    assert services.account(AccountKind.PLATFORM_REVENUE).balance == 61_000
    assert [(t.kind, t.amount) for t in Transfer.objects.filter(job=job)] == [
        ("hold", 340_000),
        ("charge", 61_000),
        ("release", 279_000),
    ]


def test_settling_twice_charges_once(customer, price):
    services.grant(customer, 1)
    job = make_job(customer)
    settlement.place_hold(job)
    finish_job(job.pk, state=JobState.CANCELLED, completion_tokens=3)

    first = settlement.settle(job.pk)
    second = settlement.settle(job.pk)

    assert first == second == 49_000
    assert Transfer.objects.filter(job=job, kind="charge").count() == 1


def test_a_job_that_delivered_nothing_is_not_charged(customer, price):
    services.grant(customer, 1)
    job = make_job(customer)
    settlement.place_hold(job)
    finish_job(job.pk, state=JobState.CANCELLED, completion_tokens=0)

    assert settlement.settle(job.pk) == 0
    assert services.credits(customer) == NANO_PER_DOLLAR
    assert not Transfer.objects.filter(job=job, kind="charge").exists()


@pytest.mark.parametrize(
    ("state", "verified", "error_code", "why"),
    [
        (JobState.FAILED, None, "stage_lost", "the job failed (stage_lost)"),
        (JobState.SUCCEEDED, False, "", "the job's work is unverified: receipt_missing"),
        # The coordinator's word is not enough: the control plane finds no receipts to verify.
        (JobState.SUCCEEDED, True, "", "the job's work is unverified: control plane re-verification: no stage"),
    ],
)
def test_a_failed_or_unverified_job_is_charged_nothing_and_says_why(customer, price, state, verified, error_code, why):
    services.grant(customer, 1)
    job = make_job(customer)
    settlement.place_hold(job)
    finish_job(
        job.pk, state=state, completion_tokens=5, verified=verified, verification_error="receipt_missing",
        error_code=error_code, error_message="lost",
    )  # fmt: skip

    assert settlement.settle(job.pk) == 0

    assert services.credits(customer) == NANO_PER_DOLLAR
    assert services.account(AccountKind.PLATFORM_REVENUE).balance == 0
    release = Transfer.objects.get(job=job, kind="release")
    assert release.amount == 340_000
    assert release.memo.startswith(f"not charged: {why}")
    assert not Transfer.objects.filter(job=job, kind="charge").exists()


def test_a_refund_returns_the_whole_charge_once_with_its_reason(customer, price):
    services.grant(customer, 1)
    job = make_job(customer)
    settlement.place_hold(job)
    finish_job(job.pk, state=JobState.CANCELLED, completion_tokens=7)
    settlement.settle(job.pk)
    job.refresh_from_db()

    first = services.refund_charge(job, "refund: audit 7 of stage 1 failed")
    second = services.refund_charge(job, "refund: audit 8 of stage 2 failed")

    assert (first, second) == (61_000, 0)
    assert services.credits(customer) == NANO_PER_DOLLAR
    assert services.account(AccountKind.PLATFORM_REVENUE).balance == 0
    refund = Transfer.objects.get(job=job, kind="refund")
    assert (refund.amount, refund.memo) == (61_000, "refund: audit 7 of stage 1 failed")


def test_a_running_job_is_not_settled(customer, price):
    services.grant(customer, 1)
    job = make_job(customer)
    settlement.place_hold(job)

    assert settlement.settle(job.pk) == 0
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == 340_000


def test_a_hold_beyond_the_credits_is_refused_and_changes_nothing(customer, price):
    services.grant(customer, "0.0003")  # 300_000 nano-dollars, less than the 340_000 hold
    job = make_job(customer)

    with pytest.raises(InsufficientCredits), transaction.atomic():
        settlement.place_hold(job)

    assert services.credits(customer) == 300_000
    assert services.account(AccountKind.CUSTOMER_HOLD, customer).balance == 0
    assert Transfer.objects.filter(job=job).count() == 0


def test_transfers_cannot_be_changed_or_deleted(customer, price):
    services.grant(customer, 1)
    transfer = Transfer.objects.get()

    with pytest.raises(ValueError):
        transfer.save()
    with pytest.raises(ValueError):
        transfer.delete()
    with pytest.raises(DatabaseError), transaction.atomic():
        Transfer.objects.filter(pk=transfer.pk).update(amount=1)
    if connection.vendor == "postgresql":  # SQLite keeps DELETE for the test flush (see the migration)
        with pytest.raises(DatabaseError), transaction.atomic():
            Transfer.objects.filter(pk=transfer.pk).delete()
    assert Transfer.objects.get().amount == NANO_PER_DOLLAR


def test_transfers_move_only_positive_whole_amounts(customer, price):
    credit = services.account(AccountKind.CUSTOMER_CREDIT, customer)
    grants = services.account(AccountKind.GRANTS)

    for amount in (0, -5, 1.5):
        with pytest.raises(ValueError):
            services.transfer(grants, credit, amount, kind="grant")
    assert Transfer.objects.count() == 0


def test_default_prices_apply_without_a_price_row(customer, settings):
    settings.SWARM_DEFAULT_PRICES = (100_000_000, 200_000_000)

    assert services.prices_for("some-model") == (100_000_000, 200_000_000)
    assert services.cost(1, 1, (100_000_000, 200_000_000)) == 300


def _balances() -> dict[int, int]:
    return dict(LedgerAccount.objects.values_list("pk", "balance"))


def test_several_transfers_at_once_move_each_balance_by_its_net_and_record_each(customer, django_user_model):
    services.grant(customer, "1")
    provider = django_user_model.objects.create_user(username="prov", email="p@example.com", password="x")
    found = services.accounts(
        [
            (AccountKind.CUSTOMER_CREDIT, customer),
            (AccountKind.CUSTOMER_HOLD, customer.pk),
            (AccountKind.PLATFORM_REVENUE, None),
            (AccountKind.PROVIDER_PENDING, provider),  # not there yet: created
        ]
    )
    credit, hold = found[(AccountKind.CUSTOMER_CREDIT, customer.pk)], found[(AccountKind.CUSTOMER_HOLD, customer.pk)]
    revenue, pending = found[(AccountKind.PLATFORM_REVENUE, None)], found[(AccountKind.PROVIDER_PENDING, provider.pk)]
    before = _balances()

    made = services.transfer_many(
        [
            services.Move(credit, hold, 700, kind="hold"),
            services.Move(hold, revenue, 500, kind="charge"),
            services.Move(hold, credit, 200, kind="release"),
            services.Move(revenue, pending, 300, kind="earning", memo="node n"),
        ]
    )

    after = _balances()
    assert [(t.kind, t.amount, t.debit_id, t.credit_id) for t in made] == [
        ("hold", 700, credit.pk, hold.pk),
        ("charge", 500, hold.pk, revenue.pk),
        ("release", 200, hold.pk, credit.pk),
        ("earning", 300, revenue.pk, pending.pk),
    ]
    assert all(t.pk is not None and t.created_at is not None for t in made)
    assert after[credit.pk] - before[credit.pk] == -500
    assert after[hold.pk] - before[hold.pk] == 0
    assert after[revenue.pk] - before[revenue.pk] == 200
    assert after[pending.pk] == 300
    assert (
        services.accounts([(AccountKind.PROVIDER_PENDING, provider)])[(AccountKind.PROVIDER_PENDING, provider.pk)].pk
        == pending.pk
    )  # found again, not created twice


def test_several_transfers_at_once_write_nothing_when_one_fails(customer):
    services.grant(customer, "1")
    found = services.accounts([(AccountKind.CUSTOMER_CREDIT, customer), (AccountKind.CUSTOMER_HOLD, customer)])
    credit, hold = found[(AccountKind.CUSTOMER_CREDIT, customer.pk)], found[(AccountKind.CUSTOMER_HOLD, customer.pk)]
    revenue = services.account(AccountKind.PLATFORM_REVENUE)
    before, count = _balances(), Transfer.objects.count()
    dollar = NANO_PER_DOLLAR

    with pytest.raises(InsufficientCredits):  # the second move overdraws what the first left
        services.transfer_many([services.Move(credit, hold, dollar // 2, kind="hold"),
                                services.Move(credit, hold, dollar, kind="hold")])  # fmt: skip
    with pytest.raises(ValueError, match="would take a hold below zero"):
        services.transfer_many([services.Move(hold, revenue, 1, kind="charge")])
    with pytest.raises(ValueError, match="positive whole number"):
        services.transfer_many([services.Move(credit, hold, 0, kind="hold")])
    with pytest.raises(ValueError, match="between two accounts"):
        services.transfer_many([services.Move(credit, credit, 5, kind="hold")])

    assert _balances() == before
    assert Transfer.objects.count() == count
