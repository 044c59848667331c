"""Leaving Stripe Checkout through its cancel link: GET /customer/billing/top-ups/<pk>/cancelled/
cancels the customer's own pending top-up at once (no 24 h "pending"), expires its Checkout
Session on the (fake) Stripe, and the billing page says so. A payment Stripe reports all the same
is still credited: the money is the customer's."""

from __future__ import annotations

from decimal import Decimal

import pytest

from marketplace.billing import services
from marketplace.billing.models import TopUp, TopUpState, Transfer
from marketplace.billing.topups import start_top_up
from tests.stripe_fake import deliver

pytest_plugins = ["tests.factories", "tests.stripe_fake"]
pytestmark = [pytest.mark.billing, pytest.mark.django_db]

ORIGIN = "https://swarm.example"


@pytest.fixture
def pending(fake_stripe, customer, settings) -> TopUp:
    """carol's $10.00 top-up, its Checkout Session open on the fake Stripe."""
    settings.STRIPE_TOPUP_MIN_DOLLARS, settings.STRIPE_TOPUP_MAX_DOLLARS = Decimal("5.00"), Decimal("500.00")
    top_up, _ = start_top_up(customer, "10.00", origin=ORIGIN)
    fake_stripe.requests.clear()
    return top_up


def cancel_url(top_up: TopUp) -> str:
    return f"/customer/billing/top-ups/{top_up.pk}/cancelled/"


def test_the_cancel_link_cancels_the_top_up_at_once_and_expires_its_session(pending, fake_stripe, customer, client_for):
    client = client_for(customer)

    response = client.get(cancel_url(pending))

    assert (response.status_code, response["Location"]) == (302, "/customer/billing/?top_up=cancelled")
    pending.refresh_from_db()
    assert pending.state == TopUpState.CANCELLED
    [request] = fake_stripe.requests
    assert (request.method, request.path) == ("POST", f"/v1/checkout/sessions/{pending.stripe_session_id}/expire")
    assert request.headers["idempotency-key"] == f"topup-expire-{pending.pk}"
    assert fake_stripe.sessions[pending.stripe_session_id]["status"] == "expired"
    page = client.get(response["Location"]).content.decode()
    assert "You left Stripe's checkout: the top-up is cancelled and nothing was charged." in page
    assert (
        f'<tr id="top-up-{pending.pk}"><td>{pending.created_at:%Y-%m-%d %H:%M}</td>'
        '<td class="money" data-field="amount"><span class="money">$10.00</span></td>'
        '<td><span class="badge topup-cancelled" data-field="state">cancelled</span>'
        ' <span class="muted">nothing was charged</span></td></tr>'
    ) in page
    assert services.credits(customer) == 0


def test_following_the_cancel_link_again_changes_nothing(pending, fake_stripe, customer, client_for):
    client = client_for(customer)
    client.get(cancel_url(pending))

    response = client.get(cancel_url(pending))

    assert response.status_code == 302
    assert TopUp.objects.get(pk=pending.pk).state == TopUpState.CANCELLED
    assert len(fake_stripe.requests) == 1  # Stripe was asked once


def test_a_session_paid_before_the_cancel_is_still_credited(pending, fake_stripe, customer, client_for):
    # The customer paid in another tab, then pressed the first tab's back link: Stripe refuses to
    # expire a complete session, and its webhook credits the payment.
    event = fake_stripe.complete_session(pending.stripe_session_id)

    response = client_for(customer).get(cancel_url(pending))

    assert response.status_code == 302
    assert TopUp.objects.get(pk=pending.pk).state == TopUpState.CANCELLED
    assert fake_stripe.sessions[pending.stripe_session_id]["status"] == "complete"
    assert deliver(event).json() == {"received": True, "outcome": "credited"}
    assert TopUp.objects.get(pk=pending.pk).state == TopUpState.PAID
    assert services.credits(customer) == 10 * 10**9


def test_the_cancel_stands_when_stripe_is_unavailable(pending, fake_stripe, customer, client_for):
    fake_stripe.fail_next(500, times=3)

    response = client_for(customer).get(cancel_url(pending))

    assert response.status_code == 302
    assert TopUp.objects.get(pk=pending.pk).state == TopUpState.CANCELLED
    assert len(fake_stripe.requests) == 3  # tried, with retries, then left to the session's own expiry
    assert fake_stripe.sessions[pending.stripe_session_id]["status"] == "open"


def test_a_paid_top_up_is_not_cancelled(pending, fake_stripe, customer, client_for):
    deliver(fake_stripe.complete_session(pending.stripe_session_id))
    fake_stripe.requests.clear()

    response = client_for(customer).get(cancel_url(pending))

    assert response.status_code == 302
    assert TopUp.objects.get(pk=pending.pk).state == TopUpState.PAID
    assert fake_stripe.requests == []
    assert services.credits(customer) == 10 * 10**9


def test_another_customers_top_up_looks_absent(pending, fake_stripe, client_for, make_user):
    before = list(TopUp.objects.values())

    response = client_for(make_user("mallory", customer=True)).get(cancel_url(pending))

    assert response.status_code == 404
    assert list(TopUp.objects.values()) == before
    assert fake_stripe.requests == []


@pytest.mark.parametrize("persona", ["provider", "admin"])
def test_only_a_customer_may_follow_a_cancel_link(pending, fake_stripe, client_for, request, persona):
    before = list(TopUp.objects.values())

    response = client_for(request.getfixturevalue(persona)).get(cancel_url(pending))

    assert response.status_code == 403
    assert list(TopUp.objects.values()) == before
    assert fake_stripe.requests == []
    assert Transfer.objects.count() == 0


def test_a_signed_out_visitor_is_sent_to_sign_in(pending, fake_stripe, client_for):
    response = client_for().get(cancel_url(pending))

    assert (response.status_code, response["Location"]) == (302, f"/login/?next={cancel_url(pending)}")
    assert TopUp.objects.get(pk=pending.pk).state == TopUpState.PENDING
    assert fake_stripe.requests == []
