"""A payout is a Stripe transfer in whole cents; the part below a cent stays in the provider's
available account and is carried into their next batch's payout, so nothing is left behind."""

from __future__ import annotations

import pytest

from marketplace.billing.models import AccountKind
from marketplace.billing.services import account
from marketplace.payouts import services
from marketplace.payouts.models import PayoutState
from tests.payout_fixtures import CENT, pay

pytest_plugins = ["tests.factories", "tests.stripe_fake", "tests.payout_fixtures"]
pytestmark = [pytest.mark.billing, pytest.mark.django_db]


def test_the_sub_cent_rest_of_a_payout_is_carried_into_the_next_batch(earn, connected, admin, fake_stripe):
    earn(3 * CENT + 4_000_000)  # $0.034
    first = pay(admin)
    earn(2 * CENT + 7_000_000)  # $0.027

    second = pay(admin)

    assert (first.amount, first.cents, first.carried_in, first.state) == (34_000_000, 3, 0, PayoutState.SENT)
    assert (second.amount, second.cents, second.carried_in, second.state) == (
        31_000_000,
        3,
        4_000_000,
        PayoutState.SENT,
    )
    assert [t["amount"] for t in fake_stripe.transfers.values()] == [3, 3]
    assert account(AccountKind.PROVIDER_AVAILABLE, connected).balance == 1_000_000  # the newest rest, carried next
    assert services.carried_rest(connected.pk) == 1_000_000


def test_over_many_batches_every_whole_cent_earned_is_paid(earn, connected, admin, fake_stripe):
    for _ in range(3):
        earn(CENT + 5_000_000)  # $0.015 each
        pay(admin)

    assert [t["amount"] for t in fake_stripe.transfers.values()] == [1, 2, 1]  # 4.5 cents earned, 4 sent
    assert account(AccountKind.PROVIDER_AVAILABLE, connected).balance == 5_000_000
    assert services.build_batch() is None  # half a cent alone is below the minimum: it waits for more


def test_a_rest_carried_into_a_payout_that_failed_is_carried_again(earn, connected, admin, fake_stripe):
    earn(CENT + 6_000_000)
    pay(admin)
    earn(2 * CENT)
    fake_stripe.fail_next(400, message="Your destination account was rejected.")  # permanent

    failed = pay(admin)
    earn(CENT)
    retried = pay(admin)

    assert (failed.carried_in, failed.state) == (6_000_000, PayoutState.FAILED)
    assert (retried.amount, retried.cents, retried.carried_in, retried.state) == (
        3 * CENT + 6_000_000,
        3,
        6_000_000,
        PayoutState.SENT,
    )
    assert account(AccountKind.PROVIDER_AVAILABLE, connected).balance == 6_000_000
