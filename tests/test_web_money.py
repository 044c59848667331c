"""Money people can read, in a real browser: after ten requests at the default prices (a fraction
of a thousandth of a cent each), every request's row in billing, the usage totals and every node's
share in the provider's earnings show their non-zero amount as the display rule has it, and rows
whose amounts differ read differently; no label of a chart is cut off at 1280 or 390 px."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from openai import OpenAI
from playwright.sync_api import expect

from marketplace.billing.models import ModelPrice
from marketplace.billing.services import grant
from marketplace.jobs.models import Job
from marketplace.jobs.services import create_api_key
from marketplace.payouts.models import Earning
from tests.browser import DESKTOP, MODEL, PASSWORD, PHONE, column_of_dollars, dollars, sign_in
from tests.live import wait_for

pytestmark = [pytest.mark.web, pytest.mark.billing, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.browser"]

REQUESTS = 10
CHARTED = ["/customer/usage/", "/provider/earnings/"]

# Every text of every bar chart on the page whose box is not inside its chart's box.
CLIPPED = """() => [...document.querySelectorAll('figure.chart svg')].flatMap(svg => {
  const box = svg.getBoundingClientRect();
  return [...svg.querySelectorAll('text')].map(text => [text.textContent, text.getBoundingClientRect()])
    .filter(([, r]) => r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5
                       || r.bottom > box.bottom + 0.5)
    .map(([label]) => label);
})"""


@pytest.fixture
def ten_requests(settings, tiny_pipeline, live_server_url):
    """Ten chat completions of a customer "dana" through the official SDK, at the default prices
    (no price set for the model), prompts of ten lengths; settled, their shares credited."""
    settings.SWARM_VERIFIER = "inline"  # receipts and audits checked, and shares paid, in the server's process
    assert not ModelPrice.objects.exists()
    customer = get_user_model().objects.create_user("dana", "dana@example.test", PASSWORD, is_customer=True)
    grant(customer, 1)
    # Retried as a client does on a 503 (a busy machine may miss a heartbeat): only answers are counted.
    client = OpenAI(base_url=f"{live_server_url}/v1", api_key=create_api_key(customer, "app")[1], max_retries=5)
    for words in range(1, REQUESTS + 1):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Repeat: " + "spam " * words}], max_tokens=4
        )
    wait_for(lambda: Job.objects.filter(settled_at__isnull=True).count() == 0, 120, "every job settled")
    jobs = list(Job.objects.filter(customer=customer))
    assert len(jobs) == REQUESTS and all(job.verified and job.charged_amount > 0 for job in jobs)
    wait_for(lambda: Earning.objects.count() >= 3 * REQUESTS, 60, "every stage's share credited")
    return jobs


@pytest.fixture
def live_server_url(web_server) -> str:
    return web_server.url


def readable(shown: list[str], amounts: list[int]) -> None:
    """A column's amounts show as the rule has it, none as nothing, as many distinct texts as amounts."""
    assert shown == column_of_dollars(amounts)
    assert all(text not in ("$0.00", "") and "<" not in text for text in shown), shown
    assert len(set(shown)) == len(set(amounts)), shown


def test_ten_small_requests_read_as_ten_amounts_and_no_chart_label_is_cut_off(ten_requests, web):
    page = web.page
    sign_in(page, "dana")
    page.goto("/customer/billing/")
    rows = page.locator("#requests tbody tr")
    expect(rows).to_have_count(REQUESTS)
    by_id = {job.public_id: job.charged_amount for job in ten_requests}
    ids = [row_id.removeprefix("request-") for row_id in rows.evaluate_all("rows => rows.map(r => r.id)")]
    readable(rows.locator("[data-field=cost]").all_inner_texts(), [by_id[public_id] for public_id in ids])
    assert len(set(by_id.values())) > 1  # the prompts' lengths made charges that differ

    page.goto("/customer/usage/")
    total = sum(by_id.values())
    expect(page.locator("#usage-totals [data-field=cost]")).to_have_text(dollars(total))
    readable([page.locator("#usage-table tbody tr td").last.inner_text()], [total])

    pat = web.new_session()
    sign_in(pat, "pat")
    pat.goto("/provider/earnings/")
    shown = pat.locator("#earnings-table tbody tr")
    expect(shown.first).to_be_visible()
    earned = {(e.job.public_id, e.node.name): e.amount for e in Earning.objects.select_related("job", "node")}
    cells = shown.evaluate_all("rows => rows.map(r => [r.cells[1], r.cells[2], r.cells[3]].map(c => c.innerText))")
    readable([amount for _, _, amount in cells], [earned[(job, node)] for job, node, _ in cells])

    # The day's total and each node's, a line each; a node's line opens its requests.
    per_node = {name: sum(a for (_, node), a in earned.items() if node == name) for name in ("gpu-0", "gpu-1", "gpu-2")}
    rollup = pat.locator("#earnings-rollup tbody tr")
    expect(rollup).to_have_count(4)
    readable(
        rollup.locator("[data-field=amount]").all_inner_texts(),
        [sum(earned.values()), per_node["gpu-0"], per_node["gpu-1"], per_node["gpu-2"]],
    )
    expect(rollup.locator("[data-field=jobs]")).to_have_text([str(3 * REQUESTS), *[str(REQUESTS)] * 3])
    pat.locator("#earnings-rollup").get_by_role("link", name="gpu-1").click()
    expect(pat.locator("#recent-title")).to_contain_text("Requests of gpu-1 on")
    expect(shown).to_have_count(REQUESTS)
    expect(shown.locator("td:nth-child(3)")).to_have_text(["gpu-1"] * REQUESTS)
    web.shot("earnings")

    # No label of a chart is cut off, on a desktop or a phone.
    for path, person in zip(CHARTED, (page, pat), strict=True):
        for size in (DESKTOP, PHONE):
            person.set_viewport_size(size)
            person.goto(path)
            expect(person.locator("figure.chart svg").first).to_be_visible()
            assert person.evaluate(CLIPPED) == [], f"{path} at {size['width']} px"
            web.shot(f"{path.strip('/').replace('/', '-')}-{size['width']}", person)
