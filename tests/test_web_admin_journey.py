"""An admin's day, in a real browser: the home page lists what needs doing; the strike queue shows
the open strikes grouped by node and takes in a new one without a reload; upholding and
overturning ask for a confirmation first (a cancelled one changes nothing); a payout batch is built
and, once confirmed, approved and paid by a Stripe transfer. Every step is seen at 1280x800 and at
390x844, where no page scrolls sideways, the header fits in one row behind a menu button, money
reads as dollars and cents, and a node name of 100 characters or a reason of 2,000 is cut short
with the whole text on hover.

The nodes have no agent: they are joined and serving in the database, and the test plays the
agents' answers to challenges through the verification services (``tests.web_trust_fixtures``).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection
from playwright.sync_api import expect

from marketplace.payouts.models import BatchState, ConnectAccount, EarningState, Payout, PayoutBatch, PayoutState
from marketplace.verification.models import Strike, StrikeState
from tests.browser import PHONE, confirm, expect_cut_short, sign_in
from tests.web_trust_fixtures import PENDING_PAY, answer, earning, serving_node, user

pytestmark = [pytest.mark.web, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.browser", "tests.stripe_fake", "tests.web_trust_fixtures"]

LIVE_TIMEOUT_MS = 30_000
LONG_NAME = "gpu-" + "a100-" * 19 + "x"  # 100 characters, the longest name a node may have
LONG_REASON = "pasted log: " + "0123456789abcdef" * 124  # 1,996 characters without a space
NO_SIDEWAYS = "document.documentElement.scrollWidth <= window.innerWidth"
# Money as people read it: dollars and cents from a dollar up, three significant digits below.
MONEY = re.compile(r"^(-?\$(?:[1-9]\d{0,2}(?:,\d{3})*\.\d{2}|0\.(?:\d{2}|0*[1-9]\d{0,2}))|—)$")


@pytest.fixture
def queue(struck, fake_stripe):
    """Open strikes on two nodes: two on pat's gpu-7 (its pending pay withheld), one on quinn's
    node with the longest name. pat also has $1.25 available and a Stripe account ready for it."""
    node, first, second = struck
    long_node = serving_node(user("quinn", is_provider=True), LONG_NAME)
    third = Strike.objects.get(challenge=answer(long_node, 3, honest=False))
    earning(node, "cmpl-yesterday", 600_000_000, EarningState.AVAILABLE, days_ago=1)
    earning(node, "cmpl-three-days-ago", 650_000_000, EarningState.AVAILABLE, days_ago=3)
    pat = node.owner
    ConnectAccount.objects.create(
        provider=pat,
        stripe_account_id=fake_stripe.onboarded_account(pat.email),
        payouts_enabled=True,
        details_submitted=True,
    )
    return node, long_node, first, second, third


def in_own_thread(work):
    """Run ``work`` on a thread of its own and return what it returns: this thread runs Playwright's
    event loop, from which the services' live notices cannot go out."""

    def run():
        try:
            return work()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result(timeout=60)


def both_sizes(web, name: str) -> None:
    """Screenshots at 1280x800 and 390x844; at neither does the page scroll sideways."""
    web.shot(name)
    assert web.page.evaluate(NO_SIDEWAYS), name
    assert web.phone(f"{name}-phone"), name


def money_on(page) -> list[str]:
    return [text.strip() for text in page.locator("span.money").all_inner_texts()]


def test_an_admin_reviews_strikes_and_pays_a_batch(queue, fake_stripe, web):
    node, long_node, _, second, third = queue
    page = web.page
    sign_in(page, "dave")

    # What needs doing, on the admin's home.
    todo = page.locator("#admin-todo")
    expect(todo.locator("[data-field=open-strikes]")).to_have_text("3 open strikes on 2 nodes to review")
    expect(todo.locator("[data-field=batches-awaiting]")).to_have_text("No payout batch awaits approval")
    expect(todo.locator("[data-field=node-states]")).to_have_text("0 nodes offline, 0 ejected")
    both_sizes(web, "1-home-todo")

    # On a phone the header is one row: the brand and a menu button that opens the sections.
    page.set_viewport_size(PHONE)
    header = page.locator("header.top")
    assert header.bounding_box()["height"] < 64
    expect(page.get_by_role("navigation", name="Dashboard")).to_be_hidden()
    page.get_by_role("button", name="Menu").click()
    expect(page.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Strikes")).to_be_visible()
    assert page.evaluate(NO_SIDEWAYS)
    web.shot("2-menu-open-phone")
    page.get_by_role("button", name="Menu").click()
    page.set_viewport_size({"width": 1280, "height": 800})

    # The queue, by node: the node whose oldest strike is due first comes first.
    todo.get_by_role("link", name="3 open strikes on 2 nodes to review").click()
    expect(page).to_have_url(f"{web.url}/swarm/strikes/")
    groups = page.locator("#admin-strikes section.node-strikes")
    expect(groups.locator("[data-field=node-name]")).to_have_text(["gpu-7", LONG_NAME])
    expect(groups.locator("[data-field=node-open-count]")).to_have_text(["2 open", "1 open"])
    expect(page.locator(f"#node-strikes-{node.pk} article.strike")).to_have_count(2)
    expect(page.locator(f"#node-strikes-{long_node.pk} article.strike")).to_have_count(1)
    expect(page.locator("[data-field=open-count]")).to_have_text("(3)")
    name = page.locator(f"#node-strikes-{long_node.pk} [data-field=node-name]")
    expect(name).to_have_attribute("title", LONG_NAME)
    expect_cut_short(page, f"#node-strikes-{long_node.pk} [data-field=node-name]")
    both_sizes(web, "3-strikes-by-node")

    # A check fails meanwhile: its strike joins its node's group on the open page.
    expect(page.locator("body")).to_have_attribute("data-live", "on")
    page.evaluate("window.__sameDocument = true")
    fourth = in_own_thread(lambda: Strike.objects.get(challenge=answer(long_node, 4, honest=False)))
    expect(page.locator(f"#node-strikes-{long_node.pk} #strike-{fourth.pk}")).to_be_visible(timeout=LIVE_TIMEOUT_MS)
    expect(page.locator(f"#node-strikes-{long_node.pk} [data-field=node-open-count]")).to_have_text("2 open")
    expect(page.locator("[data-field=open-count]")).to_have_text("(4)")
    assert page.evaluate("window.__sameDocument === true")

    # Uphold asks first; cancelling changes nothing.
    card = page.locator(f"#strike-{second.pk}")
    card.get_by_label("Reason").fill("copied its input")
    card.get_by_role("button", name="Uphold").click()
    dialog = page.get_by_role("dialog")
    expect(dialog.locator(".question")).to_have_text(
        f"Uphold strike {second.pk} on gpu-7? The node's pending pay is clawed back, and the strike counts toward "
        "ejecting it."
    )
    both_sizes(web, "4-uphold-confirm")
    dialog.get_by_role("button", name="Cancel").click()
    expect(dialog).to_be_hidden()
    assert Strike.objects.get(pk=second.pk).state == StrikeState.OPEN
    expect(card.get_by_label("Reason")).to_have_value("copied its input")

    card.get_by_role("button", name="Uphold").click()
    confirm(page, f"Uphold strike {second.pk}")
    status = page.get_by_role("status")
    expect(status).to_have_text(f"Strike {second.pk} on gpu-7 upheld.")
    expect(page.locator(f"#strike-{second.pk}")).to_have_count(0)
    expect(page.locator(f"#node-strikes-{node.pk} [data-field=node-open-count]")).to_have_text("1 open")
    expect(page.locator("[data-field=open-count]")).to_have_text("(3)")
    decided = page.locator(f"#decided-strike-{second.pk}")
    expect(decided.locator("[data-field=state]")).to_have_text("upheld")
    expect(decided.locator("[data-field=clawed-back]")).to_have_text("$0.123")
    expect(decided.locator("[data-field=clawed-back] .money")).to_have_attribute("title", "$0.123456789")
    second.refresh_from_db()
    assert (second.state, second.clawed_back, second.decided_by.username) == (StrikeState.UPHELD, PENDING_PAY, "dave")
    both_sizes(web, "5-strike-upheld")

    # Overturned with a reason of 2,000 characters: the table cuts it short, the whole on hover.
    card = page.locator(f"#strike-{third.pk}")
    card.get_by_label("Reason").fill(LONG_REASON)
    card.get_by_role("button", name="Overturn").click()
    confirm(page, f"Overturn strike {third.pk}")
    expect(status).to_have_text(f"Strike {third.pk} on {LONG_NAME} overturned.")
    reason = page.locator(f"#decided-strike-{third.pk} [data-field=reason]")
    expect(reason).to_have_attribute("title", LONG_REASON)
    expect_cut_short(page, f"#decided-strike-{third.pk} [data-field=reason]")
    expect(page.locator(f"#node-strikes-{long_node.pk} [data-field=node-open-count]")).to_have_text("1 open")
    assert Strike.objects.get(pk=third.pk).state == StrikeState.OVERTURNED
    assert all(MONEY.match(text) for text in money_on(page)), money_on(page)
    both_sizes(web, "6-strike-overturned")

    # The swarm page: the longest name does not push its Eject button away.
    page.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Swarm").click()
    row = page.locator(f"#swarm-node-{long_node.pk}")
    expect(row.locator("th .truncate")).to_have_attribute("title", LONG_NAME)
    expect_cut_short(page, f"#swarm-node-{long_node.pk} th .truncate")
    eject = row.get_by_role("link", name=f"Eject {LONG_NAME}")
    expect(eject).to_be_visible()
    assert eject.bounding_box()["x"] + eject.bounding_box()["width"] <= 1280
    both_sizes(web, "7-swarm-long-name")

    # A payout batch: built, shown on the home's to-do, approved once confirmed.
    page.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Payouts").click()
    due = page.locator("#due-table tbody tr > *")
    expect(due).to_have_text(["pat", "$1.25", "2", "ready to receive payouts", "yes"])
    both_sizes(web, "8-payouts-due")
    page.get_by_role("button", name="Build batch now").click()
    expect(status).to_have_text(re.compile(r"^Batch \d+ built: 1 payout, awaiting approval\.$"))
    batch = PayoutBatch.objects.get()
    assert (batch.state, batch.total) == (BatchState.BUILT, 1_250_000_000)
    expect(page.locator(f"#batch-{batch.pk} [data-field=total]")).to_have_text("$1.25")
    both_sizes(web, "9-batch-built")

    page.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Home").click()
    expect(todo.locator("[data-field=open-strikes]")).to_have_text("2 open strikes on 2 nodes to review")
    awaiting = todo.get_by_role("link", name="1 payout batch ($1.25) awaiting approval")
    expect(awaiting).to_be_visible()
    both_sizes(web, "10-home-batch-awaiting")
    awaiting.click()

    card = page.locator(f"#batch-{batch.pk}")
    card.get_by_role("button", name=f"Approve batch {batch.pk}").click()
    expect(page.get_by_role("dialog").locator(".question")).to_have_text(
        f"Approve batch {batch.pk} and pay $1.25 to 1 provider now? The Stripe transfers go out at once."
    )
    both_sizes(web, "11-approve-confirm")
    assert fake_stripe.transfers == {}
    confirm(page, "Approve and pay $1.25")
    expect(status).to_have_text(f"Batch {batch.pk} approved: 1 sent, 0 failed, 0 still sending.")
    payout = Payout.objects.get()
    ((transfer_id, sent),) = fake_stripe.transfers.items()
    connect = ConnectAccount.objects.get(provider=node.owner)
    assert (sent["amount"], sent["destination"]) == (125, connect.stripe_account_id)
    assert (payout.state, payout.stripe_transfer_id) == (PayoutState.SENT, transfer_id)
    row = page.locator(f"#payout-{payout.pk}")
    expect(row.locator("[data-field=amount]")).to_have_text("$1.25")
    expect(row.locator("[data-field=state]")).to_have_text("sent")
    expect(page.get_by_text("No batch awaits approval.")).to_be_visible()
    assert all(MONEY.match(text) for text in money_on(page)), money_on(page)
    both_sizes(web, "12-batch-paid")

    page.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Home").click()
    expect(todo.locator("[data-field=batches-awaiting]")).to_have_text("No payout batch awaits approval")
