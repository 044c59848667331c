"""The customer's billing page lists one row per request (time, model, tokens in and out, cost in
dollars, status), newest first and paged; the ledger's holds, charges and releases are one click
away, in the customer's words, never the ledger's internal account names on the main view."""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.billing.models import AccountKind
from marketplace.billing.services import account, grant, transfer
from marketplace.jobs.models import Job, JobState

pytestmark = [pytest.mark.billing, pytest.mark.django_db]
pytest_plugins = ["tests.factories"]

BILLING = "/customer/billing/"


def job(customer, public_id: str, state: str, *, minutes_ago: int, settled: bool = True, **fields) -> Job:
    made = Job.objects.create(
        public_id=public_id, kind="chat", customer=customer, model="tiny-llama", state=state,
        settled_at=timezone.now() if settled else None, **fields,
    )  # fmt: skip
    Job.objects.filter(pk=made.pk).update(created_at=timezone.now() - timedelta(minutes=minutes_ago))
    return made


def rows(page: str) -> list[list[str]]:
    """The requests table's rows, each cell's text without tags."""
    body = page.split('<table id="requests">', 1)[1].split("</table>", 1)[0]
    return [
        [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        for row in re.findall(r"<tr id=\"request-[^\"]+\">(.*?)</tr>", body)
    ]


@pytest.fixture
def requests(customer):
    """carol's requests: charged, a two-choice one, stopped, failed, and one still running."""
    job(customer, "chatcmpl-ok", JobState.SUCCEEDED, minutes_ago=50, prompt_tokens=1_234, completion_tokens=56,
        charged_amount=19_999_975_800)  # fmt: skip
    first = job(customer, "chatcmpl-two", JobState.SUCCEEDED, minutes_ago=40, prompt_tokens=10, completion_tokens=5,
                charged_amount=61_000)  # fmt: skip
    job(customer, "chatcmpl-two-1", JobState.SUCCEEDED, minutes_ago=40, prompt_tokens=10, completion_tokens=7,
        charged_amount=63_000, first_choice=first, choice_index=1)  # fmt: skip
    job(customer, "chatcmpl-stopped", JobState.CANCELLED, minutes_ago=30, prompt_tokens=3, completion_tokens=2,
        charged_amount=5_000_000)  # fmt: skip
    job(customer, "chatcmpl-failed", JobState.FAILED, minutes_ago=20, prompt_tokens=3)
    job(customer, "chatcmpl-running", JobState.RUNNING, minutes_ago=10, settled=False, prompt_tokens=3,
        hold_amount=2_000_000_000)  # fmt: skip


def test_the_billing_page_lists_one_row_per_request(requests, customer, client_for):
    page = client_for(customer).get(BILLING).content.decode()

    assert [row[1:] for row in rows(page)] == [
        ["tiny-llama", "3", "0", "$0.00 ($2.00 on hold)", "running ledger"],
        ["tiny-llama", "3", "0", "$0.00", "failed, not charged ledger"],
        ["tiny-llama", "3", "2", "$0.005", "stopped, charged for the tokens received ledger"],
        ["tiny-llama (2 choices)", "20", "12", "$0.000124", "charged ledger"],
        ["tiny-llama", "1,234", "56", "$20.00", "charged ledger"],
    ]
    assert '<span class="money">$0.000124</span>' in page  # every digit it has: no hover needed
    assert '<span class="money" title="$19.9999758">$20.00</span>' in page
    assert 'href="/customer/billing/ledger/?request=chatcmpl-ok"' in page
    for internal in ("customer_hold", "customer_credit", "platform_revenue", "stripe_clearing", "nano"):
        assert internal not in page


def test_requests_are_paged_newest_first(customer, client_for):
    for index in range(25):
        job(customer, f"chatcmpl-{index:02d}", JobState.SUCCEEDED, minutes_ago=100 - index, completion_tokens=index)
    client = client_for(customer)

    first = client.get(BILLING).content.decode()
    second = client.get(f"{BILLING}?page=2").content.decode()

    assert [row[3] for row in rows(first)] == [str(n) for n in range(24, 4, -1)]
    assert [row[3] for row in rows(second)] == ["4", "3", "2", "1", "0"]
    assert '<a href="?page=2" rel="next">Older</a>' in first
    assert '<a href="?page=1" rel="prev">Newer</a>' in second


def test_the_ledger_shows_each_movement_in_the_customers_words(customer, client_for):
    grant(customer, 5, memo="trial")
    ran = job(customer, "chatcmpl-ok", JobState.SUCCEEDED, minutes_ago=5, charged_amount=61_000)
    credit, hold = account(AccountKind.CUSTOMER_CREDIT, customer), account(AccountKind.CUSTOMER_HOLD, customer)
    transfer(credit, hold, 1_000_000, kind="hold", job=ran)
    transfer(hold, account(AccountKind.PLATFORM_REVENUE), 61_000, kind="charge", job=ran)
    transfer(hold, credit, 939_000, kind="release", job=ran)
    client = client_for(customer)

    everything = client.get("/customer/billing/ledger/").content.decode()
    one = client.get("/customer/billing/ledger/?request=chatcmpl-ok").content.decode()

    def entries(page: str) -> list[tuple[str, str]]:
        return re.findall(r'<td data-field="what">(.*?)</td><td data-field="account">(.*?)</td>', page)

    assert entries(everything) == [
        ("unused hold released", "available credit"),
        ("charged for a request", "on hold"),
        ("held for a request", "available credit"),
        ("credits granted", "available credit"),
    ]
    assert entries(one) == entries(everything)[:3]
    assert "Entries of request <code>chatcmpl-ok</code>." in one


def test_another_customers_requests_are_not_listed(requests, client_for, make_user):
    page = client_for(make_user("mallory", customer=True)).get(BILLING).content.decode()

    assert "chatcmpl-" not in page
    assert "No requests yet." in page
