"""A provider with a payout-ready Stripe Connect account, available earnings and the whole payout
round (batch, approval, transfer) against the fake Stripe: for the payout tests."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.billing.models import AccountKind
from marketplace.billing.services import account, transfer
from marketplace.jobs.models import Job
from marketplace.jobs.services import create_api_key
from marketplace.payouts import services
from marketplace.payouts.models import Earning, EarningState, Payout

CENT = 10_000_000  # nano-dollars


@pytest.fixture
def connected(fake_stripe, provider, settings):
    """Alice, with a payout-ready Stripe Connect account and a $0.01 payout minimum."""
    settings.SWARM_PAYOUT_MINIMUM = CENT
    services.start_onboarding(provider, origin="https://swarm.example")
    fake_stripe.complete_onboarding(provider.connect.stripe_account_id)
    services.refresh_connect(provider)
    return provider


@pytest.fixture
def earn(connected, customer, make_joined_node):
    """Give alice an available earning of ``amount`` nano-dollars, as a released job's share would."""
    node = make_joined_node(connected).node
    api_key, _ = create_api_key(customer, "k")
    jobs = iter(range(1000))

    def give(amount: int) -> Earning:
        job = Job.objects.create(
            public_id=f"chatcmpl-{next(jobs)}", kind="chat", customer=customer, api_key=api_key, model="m"
        )
        earning = Earning.objects.create(
            node=node,
            provider=connected,
            job=job,
            amount=amount,
            layer_tokens=1,
            state=EarningState.AVAILABLE,
            available_at=timezone.now() - timedelta(seconds=1),
        )
        transfer(
            account(AccountKind.PLATFORM_REVENUE),
            account(AccountKind.PROVIDER_AVAILABLE, connected),
            amount,
            kind="earning",
            job=job,
        )
        return earning

    return give


def pay(admin) -> Payout:
    """Build a batch, approve it and send its transfer; the provider's one payout."""
    batch = services.build_batch()
    services.approve_batch(batch, by=admin)
    services.send_payouts()
    return batch.payouts.get()
