"""A server without a payment provider (no STRIPE_SECRET_KEY, as in the demo) says so before the
click: the top-up and Stripe-connect buttons are disabled, the reason beside them; visiting those
pages logs nothing at ERROR, and a request that needs Stripe anyway is refused (503) with the same
reason, logged at INFO: a fact of the configuration, not a failure."""

from __future__ import annotations

import logging
import re

import pytest

from marketplace.billing import stripe_client
from marketplace.billing.models import TopUp
from marketplace.payouts.models import ConnectAccount

pytestmark = [pytest.mark.billing, pytest.mark.django_db]
pytest_plugins = ["tests.factories"]

PAGES = {"customer": "/customer/billing/", "provider": "/provider/earnings/"}
BUTTONS = {"customer": "Top up with Stripe", "provider": "Connect Stripe account"}
REASONS = {"customer": stripe_client.TOP_UPS_UNAVAILABLE, "provider": stripe_client.PAYOUTS_UNAVAILABLE}


@pytest.fixture
def without_stripe(settings):
    settings.STRIPE_SECRET_KEY = ""


@pytest.fixture
def with_stripe(settings):
    settings.STRIPE_SECRET_KEY = "sk_test_configured"


def button(page: str, label: str) -> str:
    """The opening tag of the button labelled ``label``, with what encloses it up to its form."""
    found = re.search(r"<form[^>]*>(?:(?!</form>).)*?<button[^>]*>" + re.escape(label), page, re.S)
    assert found, f"no {label!r} button"
    return found.group(0)


@pytest.mark.parametrize("role", ["customer", "provider"])
def test_the_buttons_that_need_stripe_are_disabled_with_the_reason(
    role, without_stripe, customer, provider, client_for, caplog
):
    person = customer if role == "customer" else provider
    with caplog.at_level(logging.INFO):
        page = client_for(person).get(PAGES[role]).content.decode()

    form = button(page, BUTTONS[role])
    assert re.search(r"<(fieldset|button)[^>]*\sdisabled", form), form
    assert 'data-reason="payments-not-configured"' in page and REASONS[role] in page
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("role", ["customer", "provider"])
def test_with_stripe_configured_the_buttons_are_enabled(role, with_stripe, customer, provider, client_for):
    person = customer if role == "customer" else provider
    page = client_for(person).get(PAGES[role]).content.decode()

    assert not re.search(r"<(fieldset|button)[^>]*\sdisabled", button(page, BUTTONS[role]))
    assert "payments-not-configured" not in page


def test_a_top_up_sent_anyway_is_refused_with_the_reason_at_info(without_stripe, customer, client_for, caplog):
    with caplog.at_level(logging.INFO):
        response = client_for(customer).post("/customer/billing/top-up/", {"amount": "5.00"})

    assert (response.status_code, response["Retry-After"]) == (503, "3600")
    assert stripe_client.TOP_UPS_UNAVAILABLE in response.content.decode()
    assert not TopUp.objects.exists()
    assert "a top-up refused: no payment provider (Stripe) is configured" in caplog.messages
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_connect_sent_anyway_is_refused_with_the_reason_at_info(without_stripe, provider, client_for, caplog):
    with caplog.at_level(logging.INFO):
        response = client_for(provider).post("/provider/earnings/connect/")

    assert (response.status_code, response["Retry-After"]) == (503, "3600")
    assert stripe_client.PAYOUTS_UNAVAILABLE in response.content.decode()
    assert not ConnectAccount.objects.exists()
    assert "connecting a payout account refused: no payment provider (Stripe) is configured" in caplog.messages
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
