"""Trust and payouts on the dashboards, in a real browser.

A provider's node answers two challenges wrongly (it returns its input: it skipped its layers) and
one honestly; the verifier opens two strikes. The provider sees the evidence numbers on the node's
page; an admin overturns one strike (first without a reason: the form says one is needed) and
upholds the other, and the provider's open page follows both decisions without a reload; the
upheld strike claws back the node's pending pay, which the earnings page shows. A provider with
available earnings connects a Stripe account (a fake Stripe reached by the real SDK, its onboarding
page stood in for in the browser); an admin builds a payout batch and approves it, and the
transfer exists on the fake. An admin ejects a node (a reason is required) and reinstates it.

The node has no agent here: it is joined, active and serving in the database, and the test plays
the agent's answers through the verification services. The server's own trust schedule (random
challenges, releases, daily batches) is switched off so that only the test acts. Two checks need no
browser: connecting without Stripe configured says so, and Stripe's default return address (no
trailing slash) reaches the earnings page.
"""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from playwright.sync_api import expect

from marketplace.billing import stripe_client
from marketplace.billing.models import AccountKind
from marketplace.nodes.models import Node, NodeState
from marketplace.payouts.models import BatchState, ConnectAccount, EarningState, Payout, PayoutState
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.verification.models import Challenge, Strike, StrikeState
from tests.browser import confirm, floatformat, sign_in
from tests.web_trust_fixtures import PENDING_PAY, TOKENS, balance, earning, serving_node, user

pytestmark = [pytest.mark.web, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.browser", "tests.stripe_fake", "tests.web_trust_fixtures"]

LIVE_TIMEOUT_MS = 30_000


def mark_page(page) -> None:
    page.evaluate("window.__sameDocument = true")


def same_document(page) -> bool:
    return page.evaluate("window.__sameDocument === true")


def evidence_texts(strike: Strike) -> dict[str, str]:
    """What the evidence block must show for this strike, from the database."""
    e = strike.evidence
    return {
        "subject": f"seed {e['seed']}, {TOKENS} tokens",
        "min-cosine": f"{floatformat(e['min_cosine'], 4)} (required ≥ {floatformat(e['required_cosine'], 4)})",
        "max-rel-norm": f"{floatformat(e['max_rel_norm'], 4)} (allowed ≤ {floatformat(e['allowed_rel_norm'], 4)})",
    }


def test_a_provider_sees_strike_evidence_and_an_admin_decides_it_live(struck, web):
    node, first, second = struck
    page = web.page
    sign_in(page, "pat")
    page.goto(f"/provider/nodes/{node.pk}/")
    trust = page.locator("#node-trust")

    # Reputation, its explanation and check rates, as computed when the strikes opened.
    detail = node.reputation_detail
    expect(trust.locator("[data-field=score]")).to_have_text(floatformat(node.reputation, 2))
    expect(trust.locator("#reputation-explanation li")).to_have_text(detail["explanation"])
    components = detail["components"]
    assert components["check_pass_rate"] == round((1 + 2) / (3 + 2), 4)  # 1 passed, 2 failed, prior of 2
    expect(trust.locator("#reputation-components dd")).to_have_text(
        [
            f"{components['uptime'] * 100:.1f}%",
            f"{components['check_pass_rate'] * 100:.1f}%",
            f"{components['reliability'] * 100:.1f}%",
            f"{components['age'] * 100:.1f}%",
            "0",
        ]
    )
    expect(trust.locator("[data-field=check-rates]")).to_have_text(
        f"Audits on {node.audit_fraction * 100:.1f}% of its sessions; "
        f"{floatformat(node.challenges_per_day, 1)} challenges a day."
    )
    expect(trust.locator("[data-field=check-explanation]")).to_have_text(detail["checks"])

    # Each strike with its evidence: seed, worst values against the thresholds, per-token chart.
    for strike in (first, second):
        block = trust.locator(f"#node-strike-{strike.pk}")
        for field, text in evidence_texts(strike).items():
            expect(block.locator(f"[data-field={field}]")).to_have_text(text)
        expect(block.locator("[data-field=strike-state]")).to_have_text("open")
        expect(block.locator("[data-field=decision]")).to_contain_text("Open: your pending pay is withheld")
        expect(block.locator("svg rect.bar")).to_have_count(len(strike.evidence["cosine"]))  # a bar per row
        below = sum(1 for value in strike.evidence["cosine"] if value < strike.evidence["required_cosine"])
        assert below >= 1
        expect(block.locator("svg rect.bar.failed")).to_have_count(below)
        challenge = strike.challenge
        latency = (challenge.answered_at - challenge.sent_at).total_seconds() * 1000
        expect(block.locator("[data-field=timing]")).to_contain_text(
            f"after {floatformat(latency, 0)} ms (42 ms over the data plane, first step to last result)"
        )
    rows = trust.locator("#node-challenges tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.locator("[data-field=state]")).to_have_text(["failed", "failed", "passed"])
    cosines = [floatformat(c.metrics["min_cosine"], 4) for c in Challenge.objects.filter(node=node).order_by("-pk")]
    expect(rows.locator("[data-field=min-cosine]")).to_have_text(cosines)
    web.shot("provider-node-strikes")
    assert web.phone("provider-node-strikes-phone")

    # The admin's queue: both strikes open, oldest first, with the same evidence.
    admin = web.new_session()
    sign_in(admin, "dave")
    admin.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Strikes").click()
    expect(admin.locator("[data-field=open-count]")).to_have_text("(2)")
    expect(admin.locator("article.strike")).to_have_count(2)
    expect(admin.locator("article.strike").first).to_have_id(f"strike-{first.pk}")
    for field, text in evidence_texts(first).items():
        expect(admin.locator(f"#strike-{first.pk} [data-field={field}]")).to_have_text(text)
    web.shot("admin-strikes-open", admin)

    # Overturn without a reason: the field says why, and nothing changes.
    mark_page(page)
    card = admin.locator(f"#strike-{first.pk}")
    card.get_by_role("button", name="Overturn").click()
    confirm(admin, f"Overturn strike {first.pk}")
    expect(card.locator(".field.invalid .errors")).to_have_text("Overturning a strike needs a reason.")
    expect(card.get_by_label("Reason")).to_have_attribute("aria-invalid", "true")
    assert Strike.objects.get(pk=first.pk).state == StrikeState.OPEN
    web.shot("admin-overturn-needs-reason", admin)

    card.get_by_label("Reason").fill("verifier bug #12: wrong layer span")
    card.get_by_role("button", name="Overturn").click()
    confirm(admin, f"Overturn strike {first.pk}")
    expect(admin.get_by_role("status")).to_have_text(f"Strike {first.pk} on gpu-7 overturned.")
    decided = admin.locator(f"#decided-strike-{first.pk}")
    expect(decided.locator("[data-field=state]")).to_have_text("overturned")
    expect(decided.locator("[data-field=decider]")).to_have_text("dave")
    expect(decided.locator("[data-field=reason]")).to_have_text("verifier bug #12: wrong layer span")
    expect(decided.locator("[data-field=clawed-back]")).to_have_text("$0.00")
    first.refresh_from_db()
    assert (first.state, first.decided_by.username, first.clawed_back) == (StrikeState.OVERTURNED, "dave", 0)

    # The provider's open page follows the decision without a reload.
    overturned = page.locator(f"#node-strike-{first.pk}")
    expect(overturned.locator("[data-field=strike-state]")).to_have_text("overturned", timeout=LIVE_TIMEOUT_MS)
    expect(overturned.locator("[data-field=decision]")).to_have_text(
        f"Overturned {first.decided_at:%Y-%m-%d %H:%M} UTC: verifier bug #12: wrong layer span"
    )
    assert same_document(page)

    # Upholding the other one claws back the node's pending pay.
    card = admin.locator(f"#strike-{second.pk}")
    card.get_by_label("Reason").fill("copied its input")
    card.get_by_role("button", name="Uphold").click()
    confirm(admin, f"Uphold strike {second.pk}")
    expect(admin.get_by_role("status")).to_have_text(f"Strike {second.pk} on gpu-7 upheld.")
    expect(admin.locator("[data-field=open-count]")).to_have_text("(0)")
    decided = admin.locator(f"#decided-strike-{second.pk}")
    expect(decided.locator("[data-field=state]")).to_have_text("upheld")
    expect(decided.locator("[data-field=clawed-back]")).to_have_text("$0.123")
    expect(decided.locator("[data-field=clawed-back] .money")).to_have_attribute("title", "$0.123456789")
    second.refresh_from_db()
    assert (second.state, second.clawed_back, second.decision_reason) == (
        StrikeState.UPHELD,
        PENDING_PAY,
        "copied its input",
    )
    assert balance(AccountKind.PROVIDER_PENDING, node.owner) == 0
    web.shot("admin-strikes-decided", admin)

    upheld = page.locator(f"#node-strike-{second.pk}")
    expect(upheld.locator("[data-field=strike-state]")).to_have_text("upheld", timeout=LIVE_TIMEOUT_MS)
    expect(upheld.locator("[data-field=decision]")).to_have_text(
        f"Upheld {second.decided_at:%Y-%m-%d %H:%M} UTC: copied its input. $0.123 of pending pay clawed back."
    )
    node.refresh_from_db()
    assert node.reputation_detail["components"]["upheld_strikes"] == 1
    expect(trust.locator("[data-field=score]")).to_have_text(floatformat(node.reputation, 2))
    assert same_document(page)
    web.shot("provider-node-decided")

    page.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Earnings").click()
    summary = page.locator("#earnings-summary")
    expect(summary.locator("[data-field=pending]")).to_have_text("$0.00")
    expect(summary.locator("[data-field=clawed-back]")).to_have_text("$0.123")
    expect(page.locator("#earnings-table [data-field=state]")).to_have_text(["clawed back"])
    web.shot("provider-earnings-clawed-back")


@pytest.fixture
def earned(people, web_server):
    """pat's node served three requests: $0.07 still pending, $0.60 and $0.65 available."""
    node = serving_node(people[0], "gpu-7")
    return [
        earning(node, "cmpl-today", 70_000_000, EarningState.PENDING),
        earning(node, "cmpl-yesterday", 600_000_000, EarningState.AVAILABLE, days_ago=1),
        earning(node, "cmpl-three-days-ago", 650_000_000, EarningState.AVAILABLE, days_ago=3),
    ]


def stand_in_for_onboarding(page, fake_stripe) -> None:
    """Stripe's onboarding pages, which the tests cannot reach: the provider fills them in (the
    fake's account becomes payout-ready) and follows the Account Link's return URL back."""

    def serve(route) -> None:
        account_id = route.request.url.split("/")[-2]  # .../setup/e/<account>/<link>
        fake_stripe.complete_onboarding(account_id)
        link = next(r for r in reversed(fake_stripe.requests) if r.path == "/v1/account_links")
        return_url = link.params["return_url"]
        route.fulfill(
            content_type="text/html",
            body=(
                '<!doctype html><html lang="en"><head><title>Onboarding (test stand-in)</title>'
                '<link rel="icon" href="data:,"></head><body><h1>Stripe onboarding</h1>'
                f'<a id="done" href="{return_url}">Return to the marketplace</a></body></html>'
            ),
        )

    page.route("https://connect.stripe.com/**", serve)


def test_a_provider_connects_stripe_and_an_admin_approves_the_payout(earned, fake_stripe, web):
    page = web.page
    sign_in(page, "pat")
    page.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Earnings").click()
    summary = page.locator("#earnings-summary")
    expect(summary.locator("[data-field=pending]")).to_have_text("$0.07")
    expect(summary.locator("[data-field=available]")).to_have_text("$1.25")
    expect(summary.locator("[data-field=paid]")).to_have_text("$0.00")
    expect(summary.locator("[data-field=clawed-back]")).to_have_text("$0.00")
    chart = page.locator("svg[aria-labelledby='earnings-chart-title']")
    expect(chart.locator("rect.bar")).to_have_count(30)
    today = timezone.localdate()
    titles = chart.locator("rect.bar title").all_text_contents()
    assert titles[-1] == f"{today:%m-%d}: $0.07"
    assert titles[-2] == f"{today - timedelta(days=1):%m-%d}: $0.60"
    assert titles[-4] == f"{today - timedelta(days=3):%m-%d}: $0.65"
    assert sum(1 for title in titles if not title.endswith(": $0.00")) == 3
    rows = page.locator("#earnings-table tbody tr")
    expect(rows.locator("td code")).to_have_text(["cmpl-today", "cmpl-yesterday", "cmpl-three-days-ago"])
    expect(rows.locator("[data-field=amount]")).to_have_text(["$0.07", "$0.60", "$0.65"])
    expect(rows.locator("[data-field=state]")).to_have_text(["pending", "available", "available"])
    expect(page.locator("[data-field=connect-status]")).to_have_text("no Stripe account connected")
    expect(page.get_by_text("No payouts yet.")).to_be_visible()
    web.shot("earnings")
    assert web.phone("earnings-phone")

    # Onboarding on Stripe, and back: the page asks Stripe what the account can do now.
    stand_in_for_onboarding(page, fake_stripe)
    page.get_by_role("button", name="Connect Stripe account").click()
    page.wait_for_url("https://connect.stripe.com/**")
    connect = ConnectAccount.objects.get(provider__username="pat")
    assert page.url.startswith(f"https://connect.stripe.com/setup/e/{connect.stripe_account_id}/")
    link = next(r for r in fake_stripe.requests if r.path == "/v1/account_links")
    assert (link.params["return_url"], link.params["refresh_url"]) == (
        f"{web.url}/provider/earnings/?connect=done",
        f"{web.url}/provider/earnings/?connect=refresh",
    )
    page.get_by_role("link", name="Return to the marketplace").click()
    expect(page.locator("[data-field=connect-status]")).to_have_text("ready to receive payouts")
    expect(page.get_by_role("button", name="Connect Stripe account")).to_have_count(0)
    connect.refresh_from_db()
    assert (connect.payouts_enabled, connect.details_submitted) == (True, True)
    web.shot("earnings-connected")

    # The admin builds a batch now and approves it: one Stripe transfer of 125 cents.
    admin = web.new_session()
    sign_in(admin, "dave")
    admin.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Payouts").click()
    expect(admin.locator("#due-table tbody tr > *")).to_have_text(
        ["pat", "$1.25", "2", "ready to receive payouts", "yes"]
    )
    expect(admin.get_by_text("No batch awaits approval.")).to_be_visible()
    admin.get_by_role("button", name="Build batch now").click()
    expect(admin.get_by_role("status")).to_have_text(re.compile(r"^Batch \d+ built: 1 payout, awaiting approval\.$"))
    batch = Payout.objects.get().batch
    expect(admin.get_by_role("status")).to_have_text(f"Batch {batch.pk} built: 1 payout, awaiting approval.")
    card = admin.locator(f"#batch-{batch.pk}")
    expect(card.locator("[data-field=total]")).to_have_text("$1.25")
    expect(card.locator("tbody tr th")).to_have_text(["pat"])
    expect(card.locator("[data-field=amount]")).to_have_text(["$1.25"])
    expect(card.locator("[data-field=connect]")).to_have_text(["ready to receive payouts"])
    assert (batch.state, batch.total) == (BatchState.BUILT, 1_250_000_000)
    assert fake_stripe.transfers == {}
    web.shot("admin-payouts-built", admin)

    card.get_by_role("button", name=f"Approve batch {batch.pk}").click()
    confirm(admin, "Approve and pay $1.25")
    expect(admin.get_by_role("status")).to_have_text(f"Batch {batch.pk} approved: 1 sent, 0 failed, 0 still sending.")
    ((transfer_id, sent),) = fake_stripe.transfers.items()
    assert (sent["amount"], sent["currency"], sent["destination"]) == (125, "usd", connect.stripe_account_id)
    payout = Payout.objects.get()
    assert (payout.state, payout.stripe_transfer_id, payout.flagged) == (PayoutState.SENT, transfer_id, False)
    row = admin.locator(f"#payout-{payout.pk}")
    expect(row.locator("[data-field=amount]")).to_have_text("$1.25")
    expect(row.locator("[data-field=state]")).to_have_text("sent")
    expect(row.locator("[data-field=transfer]")).to_have_text(transfer_id)
    expect(row.locator("[data-field=error]")).to_have_text("—")
    expect(admin.get_by_text("No batch awaits approval.")).to_be_visible()
    web.shot("admin-payouts-sent", admin)

    page.reload()
    expect(summary.locator("[data-field=pending]")).to_have_text("$0.07")
    expect(summary.locator("[data-field=available]")).to_have_text("$0.00")
    expect(summary.locator("[data-field=paid]")).to_have_text("$1.25")
    history = page.locator("#payouts-table tbody tr")
    expect(history.locator("[data-field=amount]")).to_have_text(["$1.25"])
    expect(history.locator("[data-field=state]")).to_have_text(["sent"])
    expect(history.locator("[data-field=transfer]")).to_have_text([transfer_id])
    expect(history.locator("[data-field=flagged]")).to_have_text(["no"])
    assert balance(AccountKind.PROVIDER_AVAILABLE, payout.provider) == 0
    web.shot("earnings-paid")


@pytest.fixture
def serving(people):
    return serving_node(people[0], "gpu-7")


def test_an_admin_ejects_a_node_with_a_reason_and_reinstates_it(serving, web):
    node = serving
    page = web.page
    sign_in(page, "pat")
    page.goto(f"/provider/nodes/{node.pk}/")
    status = page.locator("#node-status")
    expect(status.locator("[data-field=state]")).to_have_text("active")
    expect(page.locator("body")).to_have_attribute("data-live", "on")
    mark_page(page)

    admin = web.new_session()
    sign_in(admin, "dave")
    admin.goto("/swarm/")
    row = admin.locator(f"#swarm-node-{node.pk}")
    expect(row.locator("[data-field=state]")).to_have_text("active")
    row.get_by_role("link", name="Eject gpu-7").click()
    panel = admin.locator("#node-action")
    panel.get_by_role("button", name="Eject gpu-7").click()
    confirm(admin, "Eject gpu-7")
    expect(panel.locator(".field.invalid .errors")).to_have_text("This field is required.")
    assert Node.objects.get(pk=node.pk).state == NodeState.ACTIVE
    web.shot("admin-eject-needs-reason", admin)

    panel.get_by_label("Reason").fill("hardware fraud report")
    panel.get_by_role("button", name="Eject gpu-7").click()
    confirm(admin, "Eject gpu-7")
    expect(panel.get_by_role("status")).to_have_text("gpu-7 ejected: hardware fraud report")
    expect(row.locator("[data-field=state]")).to_have_text("ejected", timeout=LIVE_TIMEOUT_MS)
    expect(row.locator("[data-field=ejection-reason]")).to_have_text("hardware fraud report")
    node.refresh_from_db()
    assert (node.state, node.ejection_reason) == (NodeState.EJECTED, "hardware fraud report")
    assert Assignment.objects.get(node=node).state == AssignmentState.RELEASED
    web.shot("admin-node-ejected", admin)

    # The owner's open page shows it, with the reason.
    expect(status.locator("[data-field=state]")).to_have_text("ejected", timeout=LIVE_TIMEOUT_MS)
    expect(status.locator("[data-field=ejection]")).to_have_text(
        f"{node.ejected_at:%Y-%m-%d %H:%M} UTC: hardware fraud report"
    )
    assert same_document(page)
    web.shot("provider-node-ejected")

    row.get_by_role("button", name="Reinstate gpu-7").click()
    expect(panel.get_by_role("status")).to_have_text("gpu-7 reinstated: it is offline until its agent reconnects.")
    expect(row.locator("[data-field=state]")).to_have_text("offline", timeout=LIVE_TIMEOUT_MS)
    node.refresh_from_db()
    assert (node.state, node.ejection_reason) == (NodeState.OFFLINE, "")
    expect(status.locator("[data-field=state]")).to_have_text("offline", timeout=LIVE_TIMEOUT_MS)
    expect(status.locator("[data-field=ejection]")).to_have_count(0)
    web.shot("admin-node-reinstated", admin)


@pytest.fixture
def pat(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    return user("pat", is_provider=True)


def test_connecting_without_stripe_says_payouts_are_not_configured(pat, settings):
    settings.STRIPE_SECRET_KEY = ""
    client = Client()
    client.force_login(pat)

    response = client.post("/provider/earnings/connect/")

    assert response.status_code == 503
    page = response.content.decode()
    assert f'<div class="errors notice" role="alert">{html.escape(stripe_client.PAYOUTS_UNAVAILABLE)}' in page
    assert not ConnectAccount.objects.exists()


def test_stripes_default_return_address_reaches_the_earnings_page(pat):
    client = Client()
    client.force_login(pat)

    response = client.get("/provider/earnings?connect=done")

    assert (response.status_code, response["Location"]) == (301, "/provider/earnings/?connect=done")
