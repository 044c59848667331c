"""Stripe's webhook, POST /stripe/webhook: signature-verified, each event applied once, credits only
for a paid Checkout Session, refunds and disputes taking back no more than the customer still has."""

from __future__ import annotations

import json
import threading
import time
from decimal import Decimal

import pytest
from django.db import connection

from marketplace.billing import services
from marketplace.billing.errors import InsufficientCredits
from marketplace.billing.models import NANO_PER_DOLLAR, AccountKind, LedgerAccount, StripeEvent, TopUp, Transfer
from marketplace.billing.topups import start_top_up
from marketplace.flows.stripe_events import handle_event
from tests.stripe_fake import WEBHOOK_SECRET, deliver, sign

pytest_plugins = ["tests.factories", "tests.stripe_fake"]
pytestmark = [pytest.mark.billing, pytest.mark.django_db]

TEN_DOLLARS = 10 * NANO_PER_DOLLAR


def billing_snapshot() -> dict:
    return {
        "top_ups": list(TopUp.objects.order_by("pk").values()),
        "events": list(StripeEvent.objects.order_by("pk").values()),
        "transfers": list(Transfer.objects.order_by("pk").values()),
        "accounts": list(LedgerAccount.objects.order_by("pk").values()),
    }


def balances(user) -> dict[str, int]:
    """Every balance the payment touches, in nano-dollars."""
    return {
        "credit": services.account(AccountKind.CUSTOMER_CREDIT, user).balance,
        "frozen": services.account(AccountKind.CUSTOMER_FROZEN, user).balance,
        "clearing": services.account(AccountKind.STRIPE_CLEARING).balance,
    }


def ledger() -> list[tuple]:
    return [
        (t.kind, t.debit.kind, t.credit.kind, t.amount, t.reference)
        for t in Transfer.objects.select_related("debit", "credit")
    ]


def events() -> list[tuple]:
    return list(StripeEvent.objects.values_list("event_id", "type", "top_up_id", "processed"))


def spend(user, dollars: int) -> None:
    """The customer uses some of their credits (as a settled job would)."""
    services.transfer(
        services.account(AccountKind.CUSTOMER_CREDIT, user),
        services.account(AccountKind.PLATFORM_REVENUE),
        dollars * NANO_PER_DOLLAR,
        kind="charge",
    )


@pytest.fixture
def top_up(fake_stripe, customer, settings) -> TopUp:
    """A $10.00 top-up whose Checkout Session is open on the fake Stripe."""
    settings.STRIPE_TOPUP_MIN_DOLLARS, settings.STRIPE_TOPUP_MAX_DOLLARS = Decimal("5.00"), Decimal("500.00")
    made, _ = start_top_up(customer, "10.00", origin="https://swarm.example")
    return made


@pytest.fixture
def paid(fake_stripe, top_up) -> TopUp:
    """The top-up, paid and credited through its webhook."""
    assert deliver(fake_stripe.complete_session(top_up.stripe_session_id)).status_code == 200
    top_up.refresh_from_db()
    return top_up


def test_a_paid_checkout_adds_the_credits(fake_stripe, customer, top_up):
    event = fake_stripe.complete_session(top_up.stripe_session_id)

    response = deliver(event)

    assert response.status_code == 200
    assert response.json() == {"received": True, "outcome": "credited"}
    assert balances(customer) == {"credit": TEN_DOLLARS, "frozen": 0, "clearing": -TEN_DOLLARS}
    assert ledger() == [("topup", "stripe_clearing", "customer_credit", 10_000_000_000, event["id"])]
    top_up.refresh_from_db()
    assert top_up.state == "paid"
    assert top_up.payment_intent == fake_stripe.sessions[top_up.stripe_session_id]["payment_intent"]
    assert top_up.paid_at is not None
    assert events() == [(event["id"], "checkout.session.completed", top_up.pk, True)]


def test_a_replayed_event_changes_nothing(fake_stripe, customer, top_up):
    event = fake_stripe.complete_session(top_up.stripe_session_id)
    deliver(event)
    before = billing_snapshot()

    response = deliver(event)

    assert response.status_code == 200
    assert response.json() == {"received": True, "outcome": "duplicate"}
    assert billing_snapshot() == before
    assert services.credits(customer) == TEN_DOLLARS


def test_a_second_event_for_the_same_payment_cannot_credit_twice(fake_stripe, customer, top_up):
    deliver(fake_stripe.complete_session(top_up.stripe_session_id))
    again = fake_stripe.async_payment(top_up.stripe_session_id, succeeded=True)

    response = deliver(again)

    assert response.json() == {"received": True, "outcome": "already_handled"}
    assert services.credits(customer) == TEN_DOLLARS
    assert [kind for kind, *_ in ledger()] == ["topup"]


@pytest.mark.parametrize(
    ("delivery", "error"),
    [
        ({"secret": "whsec_someone_else"}, "the Stripe-Signature header does not verify"),
        ({"signature": "t=1700000000,v1=00ff"}, "the Stripe-Signature header does not verify"),
        ({"signature": False}, "the Stripe-Signature header does not verify"),
        ({"timestamp": int(time.time()) - 301}, "the Stripe-Signature header does not verify"),  # stale: a replay
    ],
    ids=["wrong-secret", "forged", "missing", "stale-timestamp"],
)
def test_an_unverified_event_is_refused_and_changes_nothing(fake_stripe, customer, top_up, delivery, error):
    event = fake_stripe.complete_session(top_up.stripe_session_id)
    before = billing_snapshot()

    response = deliver(event, **delivery)

    assert response.status_code == 400
    assert response.json() == {
        "error": {"message": error, "type": "invalid_request_error", "param": None, "code": "invalid_webhook_signature"}
    }
    assert billing_snapshot() == before
    assert services.credits(customer) == 0


def test_a_payload_changed_after_signing_is_refused(fake_stripe, customer, top_up):
    event = fake_stripe.complete_session(top_up.stripe_session_id)
    signed = sign(json.dumps(event), WEBHOOK_SECRET)
    event["data"]["object"]["amount_total"] = 1_000_000
    before = billing_snapshot()

    response = deliver(event, signature=signed)

    assert response.status_code == 400
    assert billing_snapshot() == before


def test_a_signed_payload_that_is_not_json_is_refused(fake_stripe, customer, top_up):
    before = billing_snapshot()

    response = deliver("this is not json")

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "the payload is not a JSON event",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_webhook_payload",
        }
    }
    assert billing_snapshot() == before


def test_the_webhook_answers_only_post(fake_stripe, client_for):
    assert client_for().get("/stripe/webhook").status_code == 405


def test_the_webhook_is_off_without_a_secret(fake_stripe, customer, top_up, settings):
    event = fake_stripe.complete_session(top_up.stripe_session_id)
    settings.STRIPE_WEBHOOK_SECRET = ""
    before = billing_snapshot()

    response = deliver(event, secret="")

    assert response.status_code == 503
    assert billing_snapshot() == before


def test_an_unpaid_completion_waits_for_the_delayed_payment(fake_stripe, customer, top_up):
    completed = fake_stripe.complete_session(top_up.stripe_session_id, payment_status="unpaid")

    assert deliver(completed).json()["outcome"] == "pending"
    top_up.refresh_from_db()
    assert (top_up.state, services.credits(customer)) == ("pending", 0)

    succeeded = fake_stripe.async_payment(top_up.stripe_session_id, succeeded=True)
    assert deliver(succeeded).json()["outcome"] == "credited"
    assert deliver(succeeded).json()["outcome"] == "duplicate"

    top_up.refresh_from_db()
    assert top_up.state == "paid"
    assert balances(customer) == {"credit": TEN_DOLLARS, "frozen": 0, "clearing": -TEN_DOLLARS}
    assert ledger() == [("topup", "stripe_clearing", "customer_credit", 10_000_000_000, succeeded["id"])]
    assert events() == [
        (completed["id"], "checkout.session.completed", top_up.pk, True),
        (succeeded["id"], "checkout.session.async_payment_succeeded", top_up.pk, True),
    ]


def test_a_failed_delayed_payment_fails_the_top_up(fake_stripe, customer, top_up):
    deliver(fake_stripe.complete_session(top_up.stripe_session_id, payment_status="unpaid"))

    response = deliver(fake_stripe.async_payment(top_up.stripe_session_id, succeeded=False))

    assert response.json() == {"received": True, "outcome": "failed"}
    top_up.refresh_from_db()
    assert (top_up.state, top_up.failure, top_up.paid_at) == ("failed", "the payment failed", None)
    assert services.credits(customer) == 0
    assert Transfer.objects.count() == 0


def test_an_expired_session_expires_the_top_up(fake_stripe, customer, top_up):
    response = deliver(fake_stripe.expire_session(top_up.stripe_session_id))

    assert response.json() == {"received": True, "outcome": "expired"}
    top_up.refresh_from_db()
    assert top_up.state == "expired"
    assert services.credits(customer) == 0
    assert Transfer.objects.count() == 0


def test_a_refund_takes_the_credits_back(fake_stripe, customer, paid):
    refund = fake_stripe.refund(paid.stripe_session_id)

    response = deliver(refund)

    assert response.json() == {"received": True, "outcome": "refunded"}
    assert balances(customer) == {"credit": 0, "frozen": 0, "clearing": 0}
    assert ledger()[1:] == [("refund", "customer_credit", "stripe_clearing", 10_000_000_000, refund["id"])]
    paid.refresh_from_db()
    assert (paid.state, paid.refunded_cents, paid.shortfall, paid.needs_review) == ("refunded", 1000, 0, False)
    assert paid.charge == fake_stripe.charge_for(paid.stripe_session_id)["id"]


def test_partial_refunds_each_take_back_what_is_newly_refunded(fake_stripe, customer, paid):
    first = fake_stripe.refund(paid.stripe_session_id, cents=300)
    second = fake_stripe.refund(paid.stripe_session_id, cents=200)

    deliver(first)
    deliver(second)
    deliver(first)  # replayed

    assert services.credits(customer) == 5 * NANO_PER_DOLLAR
    assert [(kind, amount) for kind, _, _, amount, _ in ledger()] == [
        ("topup", 10_000_000_000),
        ("refund", 3_000_000_000),
        ("refund", 2_000_000_000),
    ]
    paid.refresh_from_db()
    assert (paid.state, paid.refunded_cents, paid.shortfall) == ("refunded", 500, 0)


def test_a_refund_of_spent_credits_leaves_a_visible_debt_and_records_the_shortfall(fake_stripe, customer, paid):
    spend(customer, 7)

    response = deliver(fake_stripe.refund(paid.stripe_session_id))

    assert response.json()["outcome"] == "refunded"
    assert balances(customer) == {"credit": -7 * NANO_PER_DOLLAR, "frozen": 0, "clearing": 0}
    assert ledger()[-1][:4] == ("refund", "customer_credit", "stripe_clearing", TEN_DOLLARS)
    paid.refresh_from_db()
    assert (paid.state, paid.refunded_cents, paid.shortfall, paid.needs_review) == (
        "refunded",
        1000,
        7_000_000_000,
        True,
    )


def test_a_refund_after_spending_everything_leaves_a_debt_that_blocks_new_requests(fake_stripe, customer, paid):
    spend(customer, 10)

    deliver(fake_stripe.refund(paid.stripe_session_id))

    assert services.credits(customer) == -TEN_DOLLARS
    assert [kind for kind, *_ in ledger()] == ["topup", "charge", "refund"]
    paid.refresh_from_db()
    assert (paid.state, paid.shortfall, paid.needs_review) == ("refunded", TEN_DOLLARS, True)
    with pytest.raises(InsufficientCredits):
        services.transfer(
            services.account(AccountKind.CUSTOMER_CREDIT, customer),
            services.account(AccountKind.CUSTOMER_HOLD, customer),
            1,
            kind="hold",
        )
    assert services.credits(customer) == -TEN_DOLLARS


def test_a_dispute_freezes_the_credits(fake_stripe, customer, paid):
    dispute = fake_stripe.dispute(paid.stripe_session_id)

    response = deliver(dispute)

    assert response.json() == {"received": True, "outcome": "frozen"}
    assert balances(customer) == {"credit": 0, "frozen": TEN_DOLLARS, "clearing": -TEN_DOLLARS}
    assert ledger()[-1] == ("dispute_freeze", "customer_credit", "customer_frozen", 10_000_000_000, dispute["id"])
    paid.refresh_from_db()
    assert (paid.state, paid.frozen, paid.shortfall, paid.needs_review) == ("disputed", TEN_DOLLARS, 0, True)
    assert paid.charge == dispute["data"]["object"]["charge"]


def test_a_dispute_of_spent_credits_freezes_it_all_and_leaves_a_debt(fake_stripe, customer, paid):
    spend(customer, 4)

    deliver(fake_stripe.dispute(paid.stripe_session_id))

    assert balances(customer) == {"credit": -4 * NANO_PER_DOLLAR, "frozen": TEN_DOLLARS, "clearing": -TEN_DOLLARS}
    paid.refresh_from_db()
    assert (paid.state, paid.frozen, paid.shortfall) == ("disputed", TEN_DOLLARS, 4 * NANO_PER_DOLLAR)


def test_an_unknown_event_type_is_recorded_and_ignored(fake_stripe, customer, top_up):
    event = fake_stripe.event("customer.created", {"id": "cus_1", "object": "customer"})
    before = billing_snapshot()

    response = deliver(event)

    assert response.status_code == 200
    assert response.json() == {"received": True, "outcome": "ignored"}
    assert events() == [(event["id"], "customer.created", None, False)]
    after = billing_snapshot()
    assert (after["top_ups"], after["transfers"], after["accounts"]) == (
        before["top_ups"],
        before["transfers"],
        before["accounts"],
    )


def test_an_event_about_another_payment_is_recorded_and_ignored(fake_stripe, customer, top_up):
    session = dict(fake_stripe.sessions[top_up.stripe_session_id], id="cs_test_not_ours", metadata={})
    event = fake_stripe.event("checkout.session.completed", dict(session, payment_status="paid"))
    refund = fake_stripe.event("charge.refunded", {"id": "ch_x", "object": "charge", "payment_intent": "pi_other"})

    assert deliver(event).json()["outcome"] == "ignored"
    assert deliver(refund).json()["outcome"] == "ignored"

    assert events() == [
        (event["id"], "checkout.session.completed", None, False),
        (refund["id"], "charge.refunded", None, False),
    ]
    assert Transfer.objects.count() == 0
    assert TopUp.objects.get().state == "pending"


def test_a_session_whose_id_never_reached_us_is_found_by_its_metadata(fake_stripe, customer, top_up):
    session_id = top_up.stripe_session_id
    TopUp.objects.filter(pk=top_up.pk).update(stripe_session_id=None)  # its creation answered too late

    response = deliver(fake_stripe.complete_session(session_id))

    assert response.json()["outcome"] == "credited"
    top_up.refresh_from_db()
    assert (top_up.state, top_up.stripe_session_id) == ("paid", session_id)
    assert services.credits(customer) == TEN_DOLLARS


@pytest.mark.django_db(transaction=True)
def test_concurrent_deliveries_of_one_payment_credit_it_once(fake_stripe, customer, top_up):
    # The same event twice, and another event about the same payment, handled at once.
    completed = fake_stripe.complete_session(top_up.stripe_session_id)
    succeeded = fake_stripe.async_payment(top_up.stripe_session_id, succeeded=True)
    deliveries = [completed, completed, succeeded, completed, succeeded]
    outcomes: list[str] = []
    start = threading.Barrier(len(deliveries))

    def run(event: dict) -> None:
        try:
            start.wait()
            outcomes.append(handle_event(event))
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(event,)) for event in deliveries]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(outcomes) == sorted(["credited", "already_handled", "duplicate", "duplicate", "duplicate"])
    assert services.credits(customer) == TEN_DOLLARS
    assert [kind for kind, *_ in ledger()] == ["topup"]
    assert StripeEvent.objects.count() == 2


@pytest.mark.parametrize(
    ("changes", "paid"),
    [
        ({"amount_total": 100_000}, "100000 'usd'"),
        ({"amount_total": 999}, "999 'usd'"),
        ({"currency": "eur"}, "1000 'eur'"),
    ],
    ids=["more-than-the-top-up", "less-than-the-top-up", "another-currency"],
)
def test_a_session_paid_for_another_amount_or_currency_credits_nothing_and_is_flagged(
    fake_stripe, customer, top_up, changes, paid
):
    event = fake_stripe.complete_session(top_up.stripe_session_id)
    event["data"]["object"].update(changes)

    response = deliver(event)

    assert response.json() == {"received": True, "outcome": "needs_review"}
    assert balances(customer) == {"credit": 0, "frozen": 0, "clearing": 0}
    assert ledger() == []
    top_up.refresh_from_db()
    assert (top_up.state, top_up.needs_review) == ("pending", True)
    assert top_up.failure == f"the session was paid {paid}, not the top-up's 1000 'usd': not credited"


def test_a_won_dispute_unfreezes_the_credit(fake_stripe, customer, paid):
    created = fake_stripe.dispute(paid.stripe_session_id)
    deliver(created)

    closed = fake_stripe.close_dispute(created["data"]["object"]["id"], "won")
    response = deliver(closed)
    replay = deliver(fake_stripe.event("charge.dispute.closed", closed["data"]["object"]))

    assert response.json() == {"received": True, "outcome": "unfrozen"}
    assert replay.json() == {"received": True, "outcome": "already_handled"}
    assert balances(customer) == {"credit": TEN_DOLLARS, "frozen": 0, "clearing": -TEN_DOLLARS}
    assert ledger()[-1] == ("dispute_won", "customer_frozen", "customer_credit", TEN_DOLLARS, closed["id"])
    paid.refresh_from_db()
    assert (paid.state, paid.frozen) == ("paid", 0)


def test_a_won_dispute_of_spent_credit_pays_back_the_debt_it_left(fake_stripe, customer, paid):
    spend(customer, 4)
    created = fake_stripe.dispute(paid.stripe_session_id)
    deliver(created)

    deliver(fake_stripe.close_dispute(created["data"]["object"]["id"], "won"))

    assert balances(customer) == {"credit": 6 * NANO_PER_DOLLAR, "frozen": 0, "clearing": -TEN_DOLLARS}


def test_a_lost_dispute_keeps_the_credit_debited(fake_stripe, customer, paid):
    created = fake_stripe.dispute(paid.stripe_session_id)
    deliver(created)

    closed = fake_stripe.close_dispute(created["data"]["object"]["id"], "lost")
    response = deliver(closed)

    assert response.json() == {"received": True, "outcome": "dispute_lost"}
    assert balances(customer) == {"credit": 0, "frozen": 0, "clearing": 0}
    assert ledger()[-1] == ("dispute_lost", "customer_frozen", "stripe_clearing", TEN_DOLLARS, closed["id"])
    paid.refresh_from_db()
    assert (paid.state, paid.frozen) == ("dispute_lost", 0)
