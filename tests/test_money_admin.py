"""Money in the Django admin: model prices are entered and listed in dollars per million tokens
(stored as nano-dollars per million tokens), and balances, transfers, payouts and charges read as
dollars to the cent, the exact amount on hover."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.utils import timezone

from marketplace.billing.models import AccountKind, ModelPrice
from marketplace.billing.services import account, transfer
from marketplace.jobs.models import Job
from marketplace.payouts.models import Payout, PayoutBatch

pytestmark = [pytest.mark.billing, pytest.mark.django_db]
pytest_plugins = ["tests.factories"]

ADD_PRICE = "/admin/billing/modelprice/add/"


@pytest.fixture
def browser(django_user_model) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.test", "pw-root-123"))
    return client


def price_form(**overrides) -> dict:
    now = timezone.now()
    return {
        "model": "tiny-llama",
        "prompt_price": "0.20",
        "completion_price": "0.015",
        "effective_from_0": now.strftime("%Y-%m-%d"),
        "effective_from_1": now.strftime("%H:%M:%S"),
        "_save": "Save",
    } | overrides


def cells(page: str, name: str) -> list[str]:
    return re.findall(rf'<td class="field-{name}">(.*?)</td>', page)


def test_a_price_is_entered_in_dollars_per_million_tokens(browser):
    form = browser.get(ADD_PRICE).content.decode()
    assert "Dollars per million prompt tokens, e.g. 0.20 for $0.20 / 1M tokens" in form

    response = browser.post(ADD_PRICE, price_form())

    assert response.status_code == 302
    assert list(ModelPrice.objects.values_list("model", "prompt_per_million", "completion_per_million")) == [
        ("tiny-llama", 200_000_000, 15_000_000)
    ]
    listing = browser.get("/admin/billing/modelprice/").content.decode()
    assert cells(listing, "prompt_per_million_text") == ["$0.20 / 1M tokens"]
    assert cells(listing, "completion_per_million_text") == ["$0.015 / 1M tokens"]


def test_the_change_form_shows_the_price_in_dollars(browser):
    price = ModelPrice.objects.create(
        model="tiny-llama", prompt_per_million=7_000_000_000, completion_per_million=13_000_000_000,
        effective_from=timezone.now(),
    )  # fmt: skip

    page = browser.get(f"/admin/billing/modelprice/{price.pk}/change/").content.decode()

    assert re.search(r'name="prompt_price" value="7\.000000000"', page)
    assert re.search(r'name="completion_price" value="13\.000000000"', page)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("-1", "Ensure this value is greater than or equal to 0."),
        ("0.0000000001", "Ensure that there are no more than 9 decimal places."),
        ("1000001", "Ensure this value is less than or equal to 1000000."),
        ("", "This field is required."),
    ],
)
def test_a_price_out_of_range_is_refused_on_its_field(browser, value, error):
    response = browser.post(ADD_PRICE, price_form(prompt_price=value))

    assert response.status_code == 200
    assert re.findall(r'<ul class="errorlist"[^>]*><li>(.*?)</li>', response.content.decode()) == [error]
    assert not ModelPrice.objects.exists()


def test_ledger_amounts_read_as_dollars_with_the_exact_amount_on_hover(browser, customer):
    transfer(account(AccountKind.GRANTS), account(AccountKind.CUSTOMER_CREDIT, customer), 19_999_975_800, kind="grant")

    accounts = browser.get("/admin/billing/ledgeraccount/").content.decode()
    transfers = browser.get("/admin/billing/transfer/").content.decode()

    assert sorted(cells(accounts, "balance_usd")) == [
        '<span title="$19.9999758">$20.00</span>',  # carol's credit
        '<span title="-$19.9999758">-$20.00</span>',  # the platform's grants
    ]
    assert cells(transfers, "amount_usd") == ['<span title="$19.9999758">$20.00</span>']


def test_payouts_read_as_dollars_and_the_whole_cents_sent(browser, provider):
    batch = PayoutBatch.objects.create(total=1_104_013_440)
    Payout.objects.create(batch=batch, provider=provider, amount=1_104_013_440, cents=110, idempotency_key="p-1")

    batches = browser.get("/admin/payouts/payoutbatch/").content.decode()
    payouts = browser.get("/admin/payouts/payout/").content.decode()
    batch_page = browser.get(f"/admin/payouts/payoutbatch/{batch.pk}/change/").content.decode()

    assert cells(batches, "total_usd") == ['<span title="$1.10401344">$1.10</span>']
    assert cells(payouts, "amount_usd") == ['<span title="$1.10401344">$1.10</span>']
    assert cells(payouts, "cents_usd") == ["$1.10"]
    assert '<span title="$1.10401344">$1.10</span>' in batch_page


@pytest.mark.django_db
def test_a_job_s_page_in_the_admin_shows_its_prices_hold_and_charge_in_dollars(browser, django_user_model):
    customer = django_user_model.objects.create_user("carol", "carol@example.test", None, is_customer=True)
    job = Job.objects.create(
        public_id="chatcmpl-priced",
        kind="chat",
        customer=customer,
        model="tiny-llama",
        price_prompt_per_million=150_000_000,
        price_completion_per_million=600_000_000,
        hold_amount=1_234_567,
        charged_amount=1_104_013_440,
    )
    page = browser.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert "$0.15" in page and "$0.60" in page
    assert '<span title="$0.001234567">$0.00123</span>' in page
    assert '<span title="$1.10401344">$1.10</span>' in page
    assert not re.search(r"(?<![$.\d])(1104013440|1234567|150000000|600000000)(?!\d)", page)  # no raw nano-dollars
