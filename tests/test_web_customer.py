"""The customer's dashboard in a real browser: sign up as a customer; create an API key (shown
once), then revoke it; top up through Stripe Checkout (a fake Stripe reached by the real SDK, its
Checkout page stood in for in the browser, credits arriving only with the signed webhook); chat in
the playground with real tiny-llama agents; see the usage charts and download the CSV.

Every figure the pages show is compared with the database: the key's hash, the balance, the reply
against the streamed response, the reply's time to first token, speed, tokens and cost against
its job and the ledger's charge.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import io
import json
import re
import urllib.request
from decimal import Decimal
from pathlib import Path

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from marketplace.billing.models import ModelPrice, TopUp, TopUpState, Transfer
from marketplace.jobs.models import ApiKey, Job, JobState
from marketplace.web.selectors import PLAYGROUND_KEY_NAME
from tests.browser import MODEL, confirm, dollars, exact_dollars, floatformat, sign_up
from tests.stripe_fake import WEBHOOK_SECRET, sign

pytestmark = [pytest.mark.web, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.browser", "tests.stripe_fake"]

PROMPT_PRICE = 7_000_000_000  # nano-dollars per million tokens: $7.00
COMPLETION_PRICE = 13_000_000_000  # $13.00
MAX_TOKENS = 12
NANO = Decimal(1_000_000_000)


@pytest.fixture
def priced(db):
    """tiny-llama at $7 per million prompt tokens and $13 per million completion tokens."""
    ModelPrice.objects.create(
        model=MODEL,
        prompt_per_million=PROMPT_PRICE,
        completion_per_million=COMPLETION_PRICE,
        effective_from=timezone.now(),
    )


@pytest.fixture
def checkout_returns(settings):
    """No public URL is configured: Stripe sends the customer back to the address they came from."""
    settings.SWARM_PUBLIC_URL = ""


def stand_in_for_checkout(page, fake_stripe) -> None:
    """Stripe's Checkout page, which the tests cannot reach: a page with a pay link back to the
    session's success URL (with the session id filled in, as Stripe does)."""

    def serve(route) -> None:
        session_id = route.request.url.rsplit("/", 1)[-1]
        session = fake_stripe.sessions[session_id]
        back = session["success_url"].replace("{CHECKOUT_SESSION_ID}", session_id)
        amount = Decimal(session["amount_total"]) / 100
        route.fulfill(
            content_type="text/html",
            body=(
                '<!doctype html><html lang="en"><head><title>Checkout (test stand-in)</title>'
                '<link rel="icon" href="data:,"></head><body><h1>Pay '
                f'${amount:.2f}</h1><a id="pay" href="{back}">Pay</a></body></html>'
            ),
        )

    page.route("https://checkout.stripe.com/**", serve)


def deliver_webhook(url: str, event: dict) -> dict:
    """POST a Stripe event to the live server as Stripe does: raw JSON, signed."""
    payload = json.dumps(event)
    request = urllib.request.Request(
        f"{url}/stripe/webhook",
        data=payload.encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Stripe-Signature": sign(payload, WEBHOOK_SECRET)},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def streamed_reply(body: str) -> tuple[str, dict | None, str]:
    """The text, the usage and the completion id of an SSE chat completion."""
    text, usage, completion_id = [], None, ""
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        completion_id = chunk["id"]
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content") or "")
        usage = chunk.get("usage") or usage
    return "".join(text), usage, completion_id


def test_a_customer_manages_keys_tops_up_chats_and_reads_usage(
    priced, tiny_pipeline, fake_stripe, checkout_returns, web
):
    page = web.page
    sign_up(page, "carol", customer=True)
    expect(page.get_by_text("Your roles: customer.")).to_be_visible()
    web.shot("home")

    # --- an API key: shown once, then only its prefix; revoked on demand -----------------------
    page.get_by_role("link", name="API keys").click()
    page.get_by_label("Key name").fill("my-app")
    page.get_by_role("button", name="Create key").click()
    shown = page.locator("#new-key")
    expect(shown).to_be_visible()
    full_key = shown.inner_text()
    api_key = ApiKey.objects.get(user__username="carol", name="my-app")
    assert full_key.startswith("sk-sw-")
    assert hashlib.sha256(full_key.encode()).hexdigest() == api_key.key_hash
    assert full_key.startswith(api_key.prefix)
    # Beside it, a first request ready to paste: the key, this server's /v1 and a servable model.
    python = page.locator("#new-key-python").inner_text()
    ast.parse(python)
    assert f'OpenAI(base_url="{web.url}/v1", api_key="{full_key}")' in python
    assert 'model="tiny-llama"' in python
    curl = page.locator("#new-key-curl").inner_text()
    assert curl.startswith(f"curl {web.url}/v1/chat/completions") and f"Bearer {full_key}" in curl
    web.shot("key-created")

    page.reload()
    expect(page.locator("#new-key")).to_have_count(0)
    assert full_key not in page.content()
    row = page.locator(f"#key-{api_key.pk}")
    expect(row.locator("code")).to_have_text(f"{api_key.prefix}…")
    expect(row.locator("[data-field=status]")).to_have_text("active")

    row.get_by_role("button", name="Revoke my-app").click()
    confirm(page, "Confirm")
    expect(page.locator(f"#key-{api_key.pk} [data-field=status]")).to_contain_text("revoked")
    api_key.refresh_from_db()
    assert api_key.revoked_at is not None
    web.shot("key-revoked")

    # --- a top-up through Stripe Checkout; the credits come with the signed webhook ---------------
    page.get_by_role("link", name="Billing").click()
    expect(page.locator("[data-field=available]")).to_have_text("$0.00")
    stand_in_for_checkout(page, fake_stripe)
    page.get_by_label("Amount (USD)").fill("10.00")
    page.get_by_role("button", name="Top up with Stripe").click()
    page.wait_for_url("https://checkout.stripe.com/**")
    top_up = TopUp.objects.get()
    assert (top_up.customer.username, top_up.amount_cents, top_up.state) == ("carol", 1000, TopUpState.PENDING)
    assert page.url == fake_stripe.sessions[top_up.stripe_session_id]["url"]
    web.shot("checkout")

    event = fake_stripe.complete_session(top_up.stripe_session_id)
    assert deliver_webhook(web.url, event) == {"received": True, "outcome": "credited"}
    page.locator("#pay").click()
    page.wait_for_url(f"{web.url}/customer/billing/?top_up=success&session={top_up.stripe_session_id}")
    expect(page.get_by_role("status")).to_contain_text("Stripe took your payment.")
    expect(page.locator("[data-field=available]")).to_have_text("$10.00")
    expect(page.locator("#top-ups tbody tr").first).to_contain_text("$10.00")
    expect(page.locator("#top-ups tbody tr").first).to_contain_text("paid")
    expect(page.locator("#top-ups tbody tr").first.locator("[data-field=amount]")).to_have_text("$10.00")
    web.shot("billing-after-top-up")
    assert web.phone("billing-phone")

    # --- the playground, on the real agents -------------------------------------------------------
    page.get_by_role("link", name="Playground").click()
    expect(page.get_by_label("Model")).to_have_value(MODEL)
    page.get_by_label("Max tokens").fill(str(MAX_TOKENS))
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Message").fill("Tell me a story.")
    with page.expect_response(lambda r: r.url == f"{web.url}/customer/playground/chat/") as answer:
        page.get_by_role("button", name="Send").click()
    expect(page.locator("#pg-status")).to_have_text("Done.", timeout=60_000)
    streamed, usage, completion_id = streamed_reply(answer.value.text())
    reply = page.locator("#pg-conversation .message.assistant .text")
    expect(reply).to_have_text(streamed)
    assert streamed
    job = Job.objects.get(public_id=completion_id)
    assert (job.customer.username, job.api_key.name, job.model, job.state) == (
        "carol",
        PLAYGROUND_KEY_NAME,
        MODEL,
        JobState.SUCCEEDED,
    )
    assert usage == {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }
    stats = page.locator("#pg-stats-body[data-settled='1']")
    expect(stats).to_be_visible(timeout=30_000)
    job.refresh_from_db()
    charge = Transfer.objects.get(job=job, kind="charge")
    assert charge.amount == job.charged_amount == job.prompt_tokens * 7000 + job.completion_tokens * 13000
    expect(stats.locator("[data-field=cost]")).to_have_text(dollars(charge.amount))
    if dollars(charge.amount) != exact_dollars(charge.amount):  # the exact amount on hover, when digits were hidden
        expect(stats.locator("[data-field=cost] .money")).to_have_attribute("title", exact_dollars(charge.amount))
    expect(stats.locator("[data-field=ttft]")).to_have_text(f"{floatformat(job.ttft_ms, 0)} ms")
    expect(stats.locator("[data-field=tokens-per-s]")).to_have_text(f"{floatformat(job.tokens_per_s, 1)} tokens/s")
    expect(stats.locator("[data-field=tokens]")).to_have_text(
        f"{job.prompt_tokens} prompt + {job.completion_tokens} completion"
    )
    expect(stats.locator("[data-field=verified]")).to_have_text("verified")
    web.shot("playground")
    assert web.phone("playground-phone")
    # The playground's key is the customer's own, listed with their keys; its secret never left the server.
    assert ApiKey.objects.filter(user=job.customer, name=PLAYGROUND_KEY_NAME, revoked_at=None).count() == 1

    page.get_by_role("link", name="Billing").click()
    expect(page.locator("[data-field=available]")).to_have_text(dollars(1_000 * 10_000_000 - charge.amount))

    # --- usage: charts and CSV ------------------------------------------------------------------
    page.get_by_role("link", name="Usage").click()
    page.get_by_role("link", name="By model").click()
    tokens = job.prompt_tokens + job.completion_tokens
    expect(page.locator("#usage-totals")).to_have_text(
        f"1 request, {tokens:,} tokens, {dollars(charge.amount)} charged."
    )
    rows = page.locator("#usage-table tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first.locator("th, td")).to_have_text(
        [MODEL, "1", f"{job.prompt_tokens:,}", f"{job.completion_tokens:,}", dollars(charge.amount)]
    )
    expect(page.locator("svg rect.bar")).to_have_count(2)
    expect(page.locator("svg rect.bar title").first).to_have_text(f"{MODEL}: {tokens:,}")
    cost_axis = page.locator("svg[aria-labelledby='usage-cost-title'] text.tick[text-anchor='end']")
    ticks = cost_axis.all_text_contents()  # dollars in fixed point, never "3e-05"
    assert ticks[0] == "$0" and all(re.fullmatch(r"\$\d+\.\d{2,9}", tick) for tick in ticks[1:]), ticks
    web.shot("usage-by-model")
    with page.expect_download() as download:
        page.locator("#usage-csv").click()
    content = Path(download.value.path()).read_text()
    assert list(csv.reader(io.StringIO(content))) == [
        ["model", "requests", "prompt_tokens", "completion_tokens", "cost_usd"],
        [MODEL, "1", str(job.prompt_tokens), str(job.completion_tokens), format(Decimal(charge.amount) / NANO, ".9f")],
    ]
    page.get_by_role("link", name="By API key").click()
    expect(page.locator("#usage-table tbody tr").first.locator("th")).to_have_text(
        f"{job.api_key.name} ({job.api_key.prefix}…)"
    )
    web.shot("usage-by-key")
    page.get_by_role("link", name="By day").click()
    expect(page.locator("#usage-table tbody tr").first.locator("th")).to_have_text(job.created_at.date().isoformat())
    web.shot("usage-by-day")
    assert web.phone("usage-phone")
