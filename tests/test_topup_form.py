"""The top-up form's refusals speak dollars: an amount under the least or over the most names them
as money, and an amount that is not dollars and cents says so."""

from __future__ import annotations

import pytest

from marketplace.web.forms import TopUpForm

pytestmark = pytest.mark.billing


@pytest.mark.parametrize(
    ("amount", "error"),
    [
        ("1.00", "The least you can add at once is $5.00."),
        ("20000", "The most you can add at once is $10,000.00."),
        ("10.005", "Give dollars and cents: at most 2 digits after the point."),
        ("ten", "Give an amount in dollars, e.g. 10 or 12.50."),
    ],
)
def test_an_amount_out_of_bounds_is_refused_in_dollars(settings, amount, error):
    settings.STRIPE_TOPUP_MIN_DOLLARS, settings.STRIPE_TOPUP_MAX_DOLLARS = 5, 10_000
    form = TopUpForm(data={"amount": amount})

    assert not form.is_valid()
    assert form.errors["amount"] == [error]


def test_an_amount_within_bounds_is_taken(settings):
    settings.STRIPE_TOPUP_MIN_DOLLARS, settings.STRIPE_TOPUP_MAX_DOLLARS = 5, 10_000
    form = TopUpForm(data={"amount": "12.50"})

    assert form.is_valid(), form.errors
    assert str(form.cleaned_data["amount"]) == "12.50"
