"""Journey 2, a developer buying inference, walked in Chromium as a person would: sign up; get an
API key; the playground without credits says so and links to a top-up; a Checkout left through its
cancel link shows as cancelled at once; a paid Checkout returns to this server's own billing page
(its host and port) with the new balance; a streamed playground reply, and a second one stopped
mid-stream; the billing page's one row per request and the ledger behind it.

Each step is screenshotted at 1280x800 and at 390x844 (where the page must not scroll sideways),
and every amount a page shows is dollars and cents (the exact amount on hover), compared with the
ledger. The models are priced high ($700 and $1,300 per million tokens) so that a short reply
costs whole cents.
"""

from __future__ import annotations

import json
import re
import urllib.request
from decimal import Decimal
from urllib.parse import urlsplit

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from marketplace.billing.models import NANO_PER_DOLLAR, ModelPrice, TopUp, TopUpState, Transfer
from marketplace.jobs.models import Job, JobState
from tests.browser import MODEL, dollars, exact_dollars, sign_up
from tests.live import wait_for
from tests.stripe_fake import WEBHOOK_SECRET, sign

pytestmark = [pytest.mark.web, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.browser", "tests.stripe_fake"]

PROMPT_PRICE = 700 * NANO_PER_DOLLAR  # per million tokens
COMPLETION_PRICE = 1_300 * NANO_PER_DOLLAR
STOPPED_MAX_TOKENS = 400  # long enough to be stopped mid-stream
NANO = Decimal(NANO_PER_DOLLAR)
AMOUNT = re.compile(r"<?-?\$[0-9][0-9,]*(?:\.[0-9]+)?")
# As the pages show money: cents from a dollar up, three significant digits below (never "<$0.01").
READABLE = re.compile(r"-?\$(?:[1-9][0-9,]*\.[0-9]{2}|0\.(?:[0-9]{2}|0*[1-9][0-9]{0,2}))")
LIVE_TIMEOUT_MS = 60_000


@pytest.fixture
def priced(db):
    ModelPrice.objects.create(
        model=MODEL, prompt_per_million=PROMPT_PRICE, completion_per_million=COMPLETION_PRICE,
        effective_from=timezone.now(),
    )  # fmt: skip


@pytest.fixture
def own_origin(settings):
    """No public URL is configured: every redirect back is built from the address the browser used."""
    settings.SWARM_PUBLIC_URL = ""


def for_people(page) -> None:
    """What the page's main text shows: money as people read it, no internals."""
    text = page.locator("main").inner_text()
    amounts = AMOUNT.findall(text)
    assert all(READABLE.fullmatch(amount) for amount in amounts), amounts
    for internal in ("ws://", "customer_hold", "customer_credit", "nano", "Traceback", "stage 0"):
        assert internal not in text, internal


def both(web, name: str) -> None:
    """Screenshots at 1280x800 and 390x844; on the phone the page must not scroll sideways."""
    for_people(web.page)
    web.shot(name)
    assert web.phone(f"{name}-phone"), f"{name}: the page scrolls sideways at 390 px"


def stand_in_for_checkout(page, fake_stripe) -> None:
    """Stripe's Checkout page, which the tests cannot reach: a pay link to the session's success URL
    (the session id filled in, as Stripe does) and its cancel link, as Stripe's back arrow."""

    def serve(route) -> None:
        session_id = route.request.url.rsplit("/", 1)[-1]
        session = fake_stripe.sessions[session_id]
        paid = session["success_url"].replace("{CHECKOUT_SESSION_ID}", session_id)
        route.fulfill(
            content_type="text/html",
            body=(
                '<!doctype html><html lang="en"><head><title>Checkout (test stand-in)</title>'
                '<link rel="icon" href="data:,"></head><body>'
                f"<h1>Pay ${Decimal(session['amount_total']) / 100:.2f}</h1>"
                f'<a id="pay" href="{paid}">Pay</a> <a id="back" href="{session["cancel_url"]}">Back</a></body></html>'
            ),
        )

    page.route("https://checkout.stripe.com/**", serve)


def deliver_webhook(url: str, event: dict) -> dict:
    """POST a Stripe event to the live server as Stripe does: raw JSON, signed."""
    payload = json.dumps(event)
    headers = {"Content-Type": "application/json", "Stripe-Signature": sign(payload, WEBHOOK_SECRET)}
    request = urllib.request.Request(f"{url}/stripe/webhook", data=payload.encode(), method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def send(page, message: str, max_tokens: int) -> None:
    page.get_by_label("Max tokens").fill(str(max_tokens))
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Message").fill(message)
    page.get_by_role("button", name="Send").click()


def settled_job(**filters) -> Job:
    return wait_for(lambda: Job.objects.filter(settled_at__isnull=False, **filters).first(), 60, "a settled job")


def test_a_developer_gets_a_key_tops_up_chats_and_stops_a_reply(priced, tiny_pipeline, fake_stripe, own_origin, web):
    page = web.page
    server = urlsplit(web.url).netloc  # 127.0.0.1:<port>, the address the browser uses
    sign_up(page, "erin", customer=True)
    both(web, "1-signed-up")

    # --- an API key, shown once ------------------------------------------------------------------
    page.get_by_role("link", name="API keys").click()
    page.get_by_label("Key name").fill("my-app")
    page.get_by_role("button", name="Create key").click()
    expect(page.locator("#new-key")).to_have_text(re.compile(r"^sk-sw-"))
    both(web, "2-api-key")

    # --- the playground without credits: what to do next, not an error code ------------------------
    page.get_by_role("link", name="Playground").click()
    expect(page.locator("#pg-price")).to_have_text("Prompt $700.00 / 1M tokens, completion $1,300.00 / 1M tokens")
    expect(page.locator("#pg-available")).to_have_text("$0.00")
    web.provoke("the server responded with a status of 402 (Payment Required)")
    send(page, "Hello there.", 12)
    advice = page.locator("#pg-error")
    expect(advice).to_have_attribute("data-code", "insufficient_quota")
    expect(advice.locator("p").first).to_have_text(
        "Your credits do not cover this reply: a reply holds the price of Max tokens until it ends. "
        "Add credits, or lower Max tokens."
    )
    expect(page.get_by_role("button", name="Stop")).to_be_hidden()
    both(web, "3-playground-needs-credits")

    # --- a Checkout left through its back link: cancelled at once -----------------------------------
    advice.get_by_role("link", name="Add credits").click()
    page.wait_for_url(f"{web.url}/customer/billing/")
    stand_in_for_checkout(page, fake_stripe)
    page.get_by_label("Amount (USD)").fill("5.00")
    page.get_by_role("button", name="Top up with Stripe").click()
    page.wait_for_url("https://checkout.stripe.com/**")
    page.locator("#back").click()
    page.wait_for_url(f"{web.url}/customer/billing/?top_up=cancelled")
    cancelled = TopUp.objects.get()
    assert (cancelled.state, cancelled.amount_cents) == (TopUpState.CANCELLED, 500)
    assert fake_stripe.sessions[cancelled.stripe_session_id]["status"] == "expired"
    expect(page.get_by_role("status")).to_have_text(
        "You left Stripe's checkout: the top-up is cancelled and nothing was charged."
    )
    row = page.locator(f"#top-up-{cancelled.pk}")
    expect(row.locator("[data-field=amount]")).to_have_text("$5.00")
    expect(row.locator("[data-field=state]")).to_have_text("cancelled")
    both(web, "4-checkout-cancelled")

    # --- a paid Checkout: back on this server's billing page, the credits there ------------------------
    page.get_by_label("Amount (USD)").fill("10.00")
    page.get_by_role("button", name="Top up with Stripe").click()
    page.wait_for_url("https://checkout.stripe.com/**")
    paid = TopUp.objects.exclude(pk=cancelled.pk).get()
    assert deliver_webhook(web.url, fake_stripe.complete_session(paid.stripe_session_id))["outcome"] == "credited"
    page.locator("#pay").click()
    page.wait_for_url(f"http://{server}/customer/billing/?top_up=success&session={paid.stripe_session_id}")
    expect(page.locator("[data-field=available]")).to_have_text("$10.00")
    expect(page.locator(f"#top-up-{paid.pk} [data-field=state]")).to_have_text("paid")
    expect(page.locator(f"#top-up-{cancelled.pk} [data-field=state]")).to_have_text("cancelled")
    both(web, "5-topped-up")

    # --- a streamed reply; the balance follows it -----------------------------------------------------
    page.get_by_role("link", name="Playground").click()
    expect(page.locator("#pg-available")).to_have_text("$10.00")
    send(page, "Tell me a story.", 12)
    expect(page.locator("#pg-status")).to_have_text("Done.", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#pg-conversation .message.assistant .text")).not_to_be_empty()
    reply = settled_job(customer__username="erin", state=JobState.SUCCEEDED)
    charge = Transfer.objects.get(job=reply, kind="charge").amount
    assert charge == reply.prompt_tokens * 700_000 + reply.completion_tokens * 1_300_000 == reply.charged_amount
    stats = page.locator("#pg-stats-body[data-settled='1']")
    expect(stats.locator("[data-field=cost]")).to_have_text(dollars(charge), timeout=LIVE_TIMEOUT_MS)
    if dollars(charge) != exact_dollars(charge):
        expect(stats.locator("[data-field=cost] .money")).to_have_attribute("title", exact_dollars(charge))
    expect(page.locator("#pg-available")).to_have_text(dollars(10 * NANO_PER_DOLLAR - charge))
    both(web, "6-playground-reply")

    # --- a second reply, stopped mid-stream: cancelled, charged for what arrived --------------------------
    page.get_by_role("button", name="New chat").click()
    send(page, "Tell me a long story about the sea.", STOPPED_MAX_TOKENS)
    expect(page.locator("#pg-status")).to_have_text("Streaming…", timeout=LIVE_TIMEOUT_MS)
    page.get_by_role("button", name="Stop").click()
    expect(page.locator("#pg-status")).to_have_text("Stopped.")
    expect(page.get_by_role("button", name="Stop")).to_be_hidden()
    stopped = settled_job(customer__username="erin", state=JobState.CANCELLED)
    assert 1 <= stopped.completion_tokens < STOPPED_MAX_TOKENS
    assert stopped.error_code == "client_disconnected"
    assert stopped.charged_amount == stopped.prompt_tokens * 700_000 + stopped.completion_tokens * 1_300_000
    stats = page.locator("#pg-stats-body[data-settled='1']")
    expect(stats.locator("[data-field=state]")).to_have_text("(stopped)", timeout=LIVE_TIMEOUT_MS)
    expect(stats.locator("[data-field=cost]")).to_have_text(dollars(stopped.charged_amount))
    left = 10 * NANO_PER_DOLLAR - charge - stopped.charged_amount
    expect(page.locator("#pg-available")).to_have_text(dollars(left))
    both(web, "7-playground-stopped")

    # --- billing: one row per request, the ledger one click away -----------------------------------------
    page.get_by_role("link", name="Billing").click()
    expect(page.locator("[data-field=available]")).to_have_text(dollars(left))
    rows = page.locator("#requests tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.locator("[data-field=status]")).to_have_text(["stopped, charged for the tokens received", "charged"])
    expect(rows.locator("[data-field=cost]")).to_have_text([dollars(stopped.charged_amount), dollars(charge)])
    expect(rows.locator("[data-field=tokens-out]")).to_have_text(
        [f"{stopped.completion_tokens:,}", f"{reply.completion_tokens:,}"]
    )
    both(web, "8-billing")

    rows.first.get_by_role("link", name=f"Ledger entries of request {stopped.public_id}").click()
    page.wait_for_url(f"{web.url}/customer/billing/ledger/?request={stopped.public_id}")
    expect(page.locator("#ledger [data-field=what]")).to_have_text(
        ["unused hold released", "charged for a request", "held for a request"]
    )
    both(web, "9-ledger")
