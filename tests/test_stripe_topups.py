"""Starting a top-up: POST /api/v1/billing/top-ups opens a Stripe Checkout Session (on a fake Stripe
reached through the real SDK) and adds no credits; transient provider failures are retried with the
same idempotency key, permanent ones fail the top-up."""

from __future__ import annotations

import runpy
import socket
from decimal import Decimal
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from marketplace.accounts.errors import RoleRequired
from marketplace.billing import services, stripe_client
from marketplace.billing.models import StripeEvent, TopUp, Transfer
from marketplace.billing.topups import start_top_up
from tests.stripe_fake import SECRET_KEY

pytest_plugins = ["tests.factories", "tests.stripe_fake"]
pytestmark = [pytest.mark.billing, pytest.mark.django_db]

URL = "/api/v1/billing/top-ups"
SETTINGS_FILE = Path(__file__).resolve().parent.parent / "marketplace" / "settings.py"


@pytest.fixture
def bounds(settings):
    settings.STRIPE_TOPUP_MIN_DOLLARS = Decimal("5.00")
    settings.STRIPE_TOPUP_MAX_DOLLARS = Decimal("500.00")


def billing_snapshot() -> dict:
    return {
        "top_ups": list(TopUp.objects.order_by("pk").values()),
        "events": list(StripeEvent.objects.order_by("pk").values()),
        "transfers": list(Transfer.objects.order_by("pk").values()),
    }


def checkout_params(top_up: TopUp, cents: int, user) -> dict:
    """The Checkout Session request as Stripe receives it (form-encoded: every value a string)."""
    return {
        "mode": "payment",
        "line_items": [
            {
                "price_data": {"currency": "usd", "unit_amount": str(cents), "product_data": {"name": "Swarm credits"}},
                "quantity": "1",
            }
        ],
        "success_url": "https://swarm.example/customer/billing/?top_up=success&session={CHECKOUT_SESSION_ID}",
        "cancel_url": f"https://swarm.example/customer/billing/top-ups/{top_up.pk}/cancelled/",
        "client_reference_id": str(top_up.pk),
        "metadata": {"top_up": str(top_up.pk), "account": str(user.pk)},
    }


@pytest.fixture
def return_urls(settings):
    """The site's public address is set: Stripe sends the customer back there."""
    settings.SWARM_PUBLIC_URL = "https://swarm.example"


def test_a_top_up_opens_a_checkout_session_and_adds_no_credits(fake_stripe, customer, client_for, bounds, return_urls):
    response = client_for(customer).post(URL, {"amount": "10.00"}, format="json")

    assert response.status_code == 201
    top_up = TopUp.objects.get()
    [session] = fake_stripe.sessions.values()
    assert response.json() == {"id": top_up.pk, "checkout_url": session["url"], "state": "pending"}
    assert session["url"] == f"https://checkout.stripe.com/c/pay/{session['id']}"
    assert (top_up.customer, top_up.amount_cents, top_up.currency, top_up.state) == (customer, 1000, "usd", "pending")
    assert (top_up.stripe_session_id, top_up.payment_intent, top_up.paid_at) == (session["id"], "", None)
    [request] = fake_stripe.requests
    assert (request.method, request.path) == ("POST", "/v1/checkout/sessions")
    assert request.params == checkout_params(top_up, 1000, customer)
    assert request.headers["idempotency-key"] == f"topup-{top_up.pk}"
    assert request.headers["authorization"] == f"Bearer {SECRET_KEY}"
    assert (session["amount_total"], session["currency"], session["payment_status"]) == (1000, "usd", "unpaid")
    assert services.credits(customer) == 0
    assert Transfer.objects.count() == 0


def test_without_a_public_url_checkout_returns_to_the_host_the_customer_came_from(
    fake_stripe, customer, client_for, bounds, settings
):
    settings.SWARM_PUBLIC_URL = ""

    response = client_for(customer).post(URL, {"amount": "10.00"}, format="json", HTTP_HOST="127.0.0.1:8123")

    assert response.status_code == 201
    top_up = TopUp.objects.get()
    [request] = fake_stripe.requests
    assert (request.params["success_url"], request.params["cancel_url"]) == (
        "http://127.0.0.1:8123/customer/billing/?top_up=success&session={CHECKOUT_SESSION_ID}",
        f"http://127.0.0.1:8123/customer/billing/top-ups/{top_up.pk}/cancelled/",
    )


def test_a_json_number_is_taken_as_dollars(fake_stripe, customer, client_for, bounds):
    response = client_for(customer).post(URL, {"amount": 12.5}, format="json")

    assert response.status_code == 201
    assert TopUp.objects.get().amount_cents == 1250
    assert fake_stripe.requests[0].params["line_items"][0]["price_data"]["unit_amount"] == "1250"


@pytest.mark.parametrize("status", [500, 503, 429])
def test_a_transient_failure_is_retried_with_the_same_idempotency_key(
    fake_stripe, customer, client_for, bounds, status
):
    fake_stripe.fail_next(status, times=2)

    response = client_for(customer).post(URL, {"amount": "20.00"}, format="json")

    assert response.status_code == 201
    top_up = TopUp.objects.get()
    assert [r.headers["idempotency-key"] for r in fake_stripe.requests] == [f"topup-{top_up.pk}"] * 3
    [session_id] = fake_stripe.sessions
    assert (top_up.state, top_up.stripe_session_id, top_up.amount_cents) == ("pending", session_id, 2000)


def test_a_timed_out_request_is_retried_and_opens_one_session(fake_stripe, customer, client_for, bounds, settings):
    # Stripe did the work, but its answer came too late: the retry replays it under the same key.
    settings.STRIPE_TIMEOUT_S = 0.3
    fake_stripe.stall_next(1.5)

    response = client_for(customer).post(URL, {"amount": "10.00"}, format="json")

    assert response.status_code == 201
    assert len(fake_stripe.requests) == 2
    [session_id] = fake_stripe.sessions
    assert TopUp.objects.get().stripe_session_id == session_id


def test_a_provider_that_stays_down_answers_503_and_leaves_the_top_up_pending(
    fake_stripe, customer, client_for, bounds
):
    fake_stripe.fail_next(500, times=3)

    response = client_for(customer).post(URL, {"amount": "10.00"}, format="json")

    assert response.status_code == 503
    assert response.json() == {
        "error": {
            "message": "The payment provider is unavailable; nothing was charged. Please try again in a minute.",
            "type": "service_unavailable",
            "param": None,
            "code": "payment_provider_unavailable",
        }
    }
    assert len(fake_stripe.requests) == 3
    top_up = TopUp.objects.get()
    assert (top_up.state, top_up.stripe_session_id, top_up.failure) == ("pending", None, "")
    assert services.credits(customer) == 0


def test_an_unreachable_provider_is_retried_then_answers_503(fake_stripe, customer, client_for, bounds, settings):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        settings.STRIPE_API_BASE = f"http://127.0.0.1:{closed.getsockname()[1]}"

    response = client_for(customer).post(URL, {"amount": "10.00"}, format="json")

    assert response.status_code == 503
    assert response.json()["error"]["code"] == "payment_provider_unavailable"
    assert TopUp.objects.get().state == "pending"


@pytest.mark.parametrize(
    ("status", "error_type", "code", "message", "failure"),
    [
        (
            402,
            "card_error",
            "card_declined",
            "Your card was declined.",
            "CardError: Your card was declined.",
        ),
        (
            400,
            "invalid_request_error",
            "parameter_invalid_integer",
            "Invalid integer: abc",
            "InvalidRequestError: Invalid integer: abc",
        ),
        (
            401,
            "invalid_request_error",
            None,
            "Invalid API Key provided.",
            "AuthenticationError: Invalid API Key provided.",
        ),
    ],
)
def test_a_permanent_failure_fails_the_top_up_with_a_clear_error(
    fake_stripe, customer, client_for, bounds, status, error_type, code, message, failure
):
    fake_stripe.fail_next(status, error_type=error_type, code=code, message=message)

    response = client_for(customer).post(URL, {"amount": "10.00"}, format="json")

    assert response.status_code == 402
    reason = code or "AuthenticationError"
    assert response.json() == {
        "error": {
            "message": f"The payment provider refused this top-up ({reason}); nothing was charged.",
            "type": "payment_error",
            "param": None,
            "code": "top_up_refused",
        }
    }
    assert len(fake_stripe.requests) == 1  # never retried
    top_up = TopUp.objects.get()
    assert (top_up.state, top_up.failure, top_up.stripe_session_id) == ("failed", failure, None)
    assert fake_stripe.sessions == {}
    assert services.credits(customer) == 0


@pytest.mark.parametrize("persona", ["provider", "admin", "stranger"])
def test_only_a_customer_may_top_up(fake_stripe, client_for, bounds, request, persona):
    user = request.getfixturevalue(persona)
    before = billing_snapshot()

    response = client_for(user).post(URL, {"amount": "10.00"}, format="json")

    assert response.status_code == 403
    assert response.json() == {"detail": "this endpoint is for customers"}
    assert billing_snapshot() == before
    assert fake_stripe.requests == []


def test_an_anonymous_request_is_refused(fake_stripe, client_for, bounds):
    response = client_for().post(URL, {"amount": "10.00"}, format="json")

    assert response.status_code == 403
    assert TopUp.objects.count() == 0
    assert fake_stripe.requests == []


def test_the_service_refuses_a_non_customer(fake_stripe, provider, bounds):
    with pytest.raises(RoleRequired, match="only customers can top up credits"):
        start_top_up(provider, "10.00", origin="https://swarm.example")

    assert TopUp.objects.count() == 0
    assert fake_stripe.requests == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"amount": "4.99"}, "amount must be between $5.00 and $500.00"),
        ({"amount": "500.01"}, "amount must be between $5.00 and $500.00"),
        ({"amount": "-10"}, "amount must be between $5.00 and $500.00"),
        ({"amount": "NaN"}, "amount must be between $5.00 and $500.00"),
        ({"amount": "Infinity"}, "amount must be between $5.00 and $500.00"),
        ({"amount": "10.001"}, "amount must be in whole cents (at most two decimals)"),
        ({"amount": "ten"}, "amount must be a number of dollars, got 'ten'"),
        ({"amount": ""}, "amount must be a number of dollars, got ''"),
        ({"amount": True}, "amount must be a number of dollars, got True"),
        ({"amount": ["10"]}, "amount must be a number of dollars, got ['10']"),
        ({}, 'amount is required: a number of dollars such as "10.00"'),
    ],
)
def test_an_amount_out_of_range_or_malformed_gets_400(fake_stripe, customer, client_for, bounds, body, message):
    before = billing_snapshot()

    response = client_for(customer).post(URL, body, format="json")

    assert response.status_code == 400
    assert response.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": "amount", "code": None}
    }
    assert billing_snapshot() == before
    assert fake_stripe.requests == []


def test_top_ups_are_off_without_a_secret_key(fake_stripe, customer, client_for, bounds, settings):
    settings.STRIPE_SECRET_KEY = ""

    response = client_for(customer).post(URL, {"amount": "10.00"}, format="json")

    assert response.status_code == 503
    assert response.json()["error"]["message"] == stripe_client.TOP_UPS_UNAVAILABLE
    assert TopUp.objects.count() == 0
    assert fake_stripe.requests == []


@pytest.mark.parametrize(
    ("low", "high"),
    [("0.49", "100"), ("50", "10"), ("5", "1000000"), ("five", "100"), ("NaN", "100")],
)
def test_settings_refuse_top_up_bounds_stripe_cannot_charge(monkeypatch, low, high):
    monkeypatch.setenv("STRIPE_TOPUP_MIN_DOLLARS", low)
    monkeypatch.setenv("STRIPE_TOPUP_MAX_DOLLARS", high)

    with pytest.raises(ImproperlyConfigured, match="STRIPE_TOPUP_MIN_DOLLARS and STRIPE_TOPUP_MAX_DOLLARS must"):
        runpy.run_path(str(SETTINGS_FILE))


def test_settings_read_the_stripe_configuration(monkeypatch):
    monkeypatch.setenv("STRIPE_API_BASE", "http://127.0.0.1:12111")
    monkeypatch.setenv("STRIPE_TOPUP_MIN_DOLLARS", "1.50")
    monkeypatch.setenv("STRIPE_TOPUP_MAX_DOLLARS", "250")

    loaded = runpy.run_path(str(SETTINGS_FILE))

    assert loaded["STRIPE_API_BASE"] == "http://127.0.0.1:12111"
    assert (loaded["STRIPE_TOPUP_MIN_DOLLARS"], loaded["STRIPE_TOPUP_MAX_DOLLARS"]) == (Decimal("1.50"), Decimal("250"))
