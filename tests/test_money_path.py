"""The whole money path, end to end: a customer tops up through Stripe Checkout (a signed webhook on
the local Stripe-compatible server), pays for jobs that real agents serve, the jobs' receipts verify
and their stages' earnings go pending; the challenge window passes (time is moved), earnings become
available, providers onboard their Connect accounts, a batch is built, an admin approves it in the
Django admin, and the transfers appear on the Stripe server. The ledger is checked at every step:
every account's exact balance, and that all of them sum to zero."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db.models import Sum
from django.test import Client

from marketplace.billing.models import LedgerAccount, Transfer
from marketplace.billing.services import cost
from marketplace.billing.topups import start_top_up
from marketplace.jobs.models import Job
from marketplace.payouts import services as payouts
from marketplace.payouts.models import BatchState, ConnectAccount, Earning, EarningState, Payout, PayoutState
from tests.stripe_fake import deliver

pytest_plugins = ["tests.trust_fixtures", "tests.stripe_fake"]
pytestmark = [pytest.mark.trust, pytest.mark.billing, pytest.mark.django_db(transaction=True)]

PRICE = 10_000 * 10**9  # $10,000 per million tokens: a job costs cents, so payouts carry whole cents
NANO_PER_CENT = 10**7
FEE_BPS = 2000


def balances() -> dict[tuple[str, str | None], int]:
    return {
        (a.kind, a.owner.username if a.owner else None): a.balance
        for a in LedgerAccount.objects.select_related("owner")
        if a.balance
    }


def assert_balanced() -> None:
    assert LedgerAccount.objects.aggregate(total=Sum("balance"))["total"] == 0
    for account in LedgerAccount.objects.all():
        credits = Transfer.objects.filter(credit=account).aggregate(s=Sum("amount"))["s"] or 0
        debits = Transfer.objects.filter(debit=account).aggregate(s=Sum("amount"))["s"] or 0
        assert account.balance == credits - debits, account


def test_top_up_jobs_earnings_window_batch_approval_and_transfers(make_swarm, fake_stripe, settings):
    settings.SWARM_PAYOUT_MINIMUM = NANO_PER_CENT
    swarm = make_swarm(cheat=None, SWARM_DEFAULT_PRICES=(PRICE, PRICE), SWARM_PLATFORM_FEE_BPS=FEE_BPS)
    customer = swarm.customer
    granted = 5 * 10**9  # the fixture's trial credit
    admin = get_user_model().objects.create_superuser("dave", "dave@example.test", "pw-dave-123")

    # 1. Top-up: $10 through Checkout, credited by the signed webhook.
    top_up, _ = start_top_up(customer, "10.00", origin="https://swarm.example")
    assert deliver(fake_stripe.complete_session(top_up.stripe_session_id)).status_code == 200
    topped = 10 * 10**9
    assert balances() == {
        ("grants", None): -granted,
        ("stripe_clearing", None): -topped,
        ("customer_credit", "carol"): granted + topped,
    }
    assert_balanced()

    # 2. Jobs: charged on delivered tokens; verified receipts pay each stage pending.
    jobs = [swarm.run_job(f"Write a line about rivers, take {i}") for i in range(3)]
    charged = sum(job.charged_amount for job in jobs)
    fees = sum(job.charged_amount * FEE_BPS // 10_000 for job in jobs)
    assert all(job.verified for job in jobs)
    assert charged == sum(cost(job.prompt_tokens, job.completion_tokens, (PRICE, PRICE)) for job in jobs)
    earned = {name: sum(e.amount for e in Earning.objects.filter(provider__username=name)) for name in swarm.users}
    assert sum(earned.values()) == charged - fees
    for job in jobs:  # each job's pool is split in proportion to layers x tokens
        shares = [(e.layer_tokens, e.amount) for e in Earning.objects.filter(job=job)]
        pool = job.charged_amount - job.charged_amount * FEE_BPS // 10_000
        assert len(shares) == 3 and len({layer_tokens for layer_tokens, _ in shares}) == 1  # 2 layers each
        assert sorted(amount for _, amount in shares) == sorted([pool // 3 + (i < pool % 3) for i in range(3)])
    assert set(Earning.objects.values_list("state", flat=True)) == {EarningState.PENDING}
    assert balances() == {
        ("grants", None): -granted,
        ("stripe_clearing", None): -topped,
        ("customer_credit", "carol"): granted + topped - charged,
        ("platform_revenue", None): fees,
        **{("provider_pending", name): amount for name, amount in earned.items()},
    }
    assert_balanced()

    # 3. Inside the window nothing is released; once it has passed, everything is.
    window_start = min(Earning.objects.values_list("available_at", flat=True))
    window_end = max(Earning.objects.values_list("available_at", flat=True))
    assert payouts.release_earnings(now=window_start - timedelta(seconds=1)) == 0
    assert payouts.release_earnings(now=window_end + timedelta(seconds=1)) == 3 * len(jobs)
    assert set(Earning.objects.values_list("state", flat=True)) == {EarningState.AVAILABLE}
    assert balances() == {
        ("grants", None): -granted,
        ("stripe_clearing", None): -topped,
        ("customer_credit", "carol"): granted + topped - charged,
        ("platform_revenue", None): fees,
        **{("provider_available", name): amount for name, amount in earned.items()},
    }
    assert_balanced()

    # 4. Providers onboard Connect accounts through Account Links.
    for name, user in swarm.users.items():
        url = payouts.start_onboarding(user, origin="https://swarm.example")
        connect = ConnectAccount.objects.get(provider=user)
        assert url.startswith(f"https://connect.stripe.com/setup/e/{connect.stripe_account_id}/")
        assert payouts.refresh_connect(user).payouts_enabled is False
        fake_stripe.complete_onboarding(connect.stripe_account_id)
        assert payouts.refresh_connect(user).payouts_enabled is True, name

    # 5. A batch of one payout per provider awaits approval; nothing is sent yet.
    batch = payouts.build_batch()
    assert batch is not None and batch.state == BatchState.BUILT
    assert {p.provider.username: p.amount for p in batch.payouts.all()} == earned
    assert fake_stripe.transfers == {}
    assert_balanced()

    # 6. An admin approves it in the Django admin; the transfers go out.
    client = Client()
    client.force_login(admin)
    response = client.post(
        "/admin/payouts/payoutbatch/", {"action": "approve", "_selected_action": [str(batch.pk)]}, follow=True
    )
    assert response.status_code == 200, (response.redirect_chain, response.content[-1500:])
    batch.refresh_from_db()
    assert batch.state == BatchState.DONE
    assert batch.approved_by == admin
    sent = list(Payout.objects.filter(batch=batch))
    assert [p.state for p in sent] == [PayoutState.SENT] * 3
    transfers = {t["id"]: t for t in fake_stripe.transfers.values()}
    assert len(transfers) == 3
    for payout in sent:
        transfer = transfers[payout.stripe_transfer_id]
        connect = ConnectAccount.objects.get(provider=payout.provider)
        assert (transfer["amount"], transfer["destination"], transfer["currency"]) == (
            payout.amount // NANO_PER_CENT,
            connect.stripe_account_id,
            "usd",
        )
    assert set(Earning.objects.values_list("state", flat=True)) == {EarningState.PAID}
    paid_out = sum(amount // NANO_PER_CENT * NANO_PER_CENT for amount in earned.values())
    rests = {name: amount % NANO_PER_CENT for name, amount in earned.items() if amount % NANO_PER_CENT}
    assert balances() == {
        ("grants", None): -granted,
        ("stripe_clearing", None): -topped,
        ("customer_credit", "carol"): granted + topped - charged,
        ("platform_revenue", None): fees,
        ("payouts", None): paid_out,
        **{("provider_available", name): rest for name, rest in rests.items()},
    }
    assert_balanced()

    # 7. Approving twice sends nothing more.
    client.post("/admin/payouts/payoutbatch/", {"action": "approve", "_selected_action": [str(batch.pk)]})
    assert len(fake_stripe.transfers) == 3
    assert Job.objects.filter(verified=True).count() == len(jobs)
