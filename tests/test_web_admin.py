"""The admin's swarm health page in a real browser, over three real tiny-llama agents (one
pipeline of three stages): ready nodes and layers covered per model, the coverage map, the
pipeline, the nodes' states, the measured latencies, the throughput of a request just served; then
an agent stops and the open page shows the lost coverage without a reload. With no failed check
and no earnings yet, the strike and payout pages say that nothing awaits a decision.

The live part needs the node and placement services to announce their changes
(``marketplace.nodes.live.notify_node_changed``).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from marketplace.billing.services import grant
from marketplace.jobs.models import ApiKey, Job, JobState
from marketplace.jobs.services import create_api_key
from marketplace.nodes.models import LinkMeasurement, Node, NodeState
from marketplace.placement.selectors import servable_pipelines
from tests.browser import MODEL, PASSWORD, floatformat
from tests.live import wait_for
from worker_agent.dev.local import stop_processes

pytestmark = [pytest.mark.web, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.browser"]

LIVE_TIMEOUT_MS = 60_000


def one_completion(url: str, key: str) -> dict:
    """A chat completion through the public API, as any client sends it."""
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 10, "temperature": 0}
        ).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture
def measured(tiny_pipeline):
    """Each placed node measured its links to the two others and to the coordinator region."""
    wait_for(lambda: LinkMeasurement.objects.count() == 9, 60, "nine measured links")


@pytest.fixture
def served(tiny_pipeline, web_server):
    """One request served by the pipeline, for a customer with credits."""
    customer = get_user_model().objects.create_user("carol", "carol@example.test", PASSWORD, is_customer=True)
    grant(customer, "1.00")
    _, key = create_api_key(customer, "app")
    body = one_completion(web_server.url, key)
    job = Job.objects.get(public_id=body["id"])
    assert job.state == JobState.SUCCEEDED
    assert ApiKey.objects.get(pk=job.api_key_id).user == customer
    return job


def test_an_admin_sees_swarm_health_and_watches_coverage_drop_live(tiny_pipeline, measured, served, web):
    get_user_model().objects.create_user("dave", "dave@example.test", PASSWORD, is_staff=True)
    page = web.page
    page.goto("/login/")
    page.get_by_label("Username").fill("dave")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("/")
    expect(page.get_by_text("Your roles: admin.")).to_be_visible()
    expect(page.get_by_text(f"3 active nodes; servable: {MODEL}.")).to_be_visible()

    page.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Swarm").click()
    expect(page).to_have_url(f"{web.url}/swarm/")
    model = page.locator(f".model-health[data-model='{MODEL}']")
    expect(model.locator("[data-field=ready-nodes]")).to_have_text("3")
    expect(model.locator("[data-field=layers-covered]")).to_have_text("6 of 6")
    expect(model.locator("[data-field=pipelines]")).to_have_text("1")
    expect(model.locator("svg rect.span-ready")).to_have_count(3)
    expect(model.locator("svg rect.cell.covered")).to_have_count(6)
    expect(model.locator("svg rect.cell.gap")).to_have_count(0)
    (pipeline,) = servable_pipelines(MODEL)
    names = dict(Node.objects.values_list("node_id", "name"))
    stages = " → ".join(f"{names[s.node]} layers {s.layer_start}–{s.layer_end}, local" for s in pipeline)
    expect(model.locator("[data-field=pipeline]")).to_have_text(f"coordinator in local: {stages}")

    counts = page.locator("#node-state-counts")
    expect(counts.locator("[data-state=active]")).to_have_text("3")
    expect(counts.locator("[data-state=offline]")).to_have_text("0")
    expect(page.locator("#all-nodes tbody tr")).to_have_count(3)
    for name in ("gpu-0", "gpu-1", "gpu-2"):
        expect(page.get_by_role("link", name=f"Eject {name}")).to_be_visible()

    # Latency: a row per node; its peers and the region measured, itself not.
    table = page.locator("#latency-table")
    expect(table.locator("thead th")).to_have_count(5)  # the corner, three nodes, one region
    expect(table.locator("tbody tr")).to_have_count(3)
    headers = table.locator("thead th").all_inner_texts()[1:]
    by_name = {name: node_id for node_id, name in names.items()}
    for row in table.locator("tbody tr").all():
        source = by_name[row.locator("th").inner_text()]
        expected = []
        for header in headers:
            target = "region:local" if header == "local (region)" else by_name[header]
            link = LinkMeasurement.objects.filter(source__node_id=source, target=target).first()
            expected.append("—" if link is None else floatformat(link.rtt_ms, 1))
        expect(row.locator("td")).to_have_text(expected)
    expect(table.locator("td", has_text="—")).to_have_count(3)

    # Throughput: the request just served.
    throughput = page.locator("#throughput")
    expect(throughput.locator("[data-field=tokens]")).to_have_text(str(served.completion_tokens))
    expect(throughput.locator("[data-field=jobs]")).to_have_text("1")
    expect(throughput.locator("[data-field=running]")).to_have_text("0")
    web.shot("swarm")
    assert web.phone("swarm-phone")

    # The agent holding the last layers stops: the page shows the gap without a reload.
    last = max(pipeline, key=lambda s: s.layer_end)
    index = sorted(names, key=lambda node_id: names[node_id]).index(last.node)  # gpu-0, gpu-1, gpu-2
    expect(page.locator("body")).to_have_attribute("data-live", "on")
    page.evaluate("window.__sameDocument = true")
    stop_processes([tiny_pipeline[index]])
    expect(model.locator("[data-field=ready-nodes]")).to_have_text("2", timeout=LIVE_TIMEOUT_MS)
    expect(model.locator("[data-field=layers-covered]")).to_have_text("4 of 6", timeout=LIVE_TIMEOUT_MS)
    expect(model.locator("[data-field=pipelines]")).to_have_text("0")
    expect(model.locator("svg rect.cell.gap")).to_have_count(2)
    expect(counts.locator("[data-state=offline]")).to_have_text("1", timeout=LIVE_TIMEOUT_MS)
    assert page.evaluate("window.__sameDocument === true")
    assert Node.objects.get(node_id=last.node).state == NodeState.OFFLINE
    web.shot("swarm-after-loss")

    page.get_by_role("link", name="Strikes").click()
    expect(page.locator("[data-field=open-count]")).to_have_text("(0)")
    expect(page.locator("#admin-strikes")).to_contain_text("No open strikes.")
    expect(page.get_by_text("No decided strikes yet.")).to_be_visible()
    web.shot("strikes")
    page.get_by_role("link", name="Payouts").click()
    expect(page.locator("#admin-payouts")).to_contain_text("No batch awaits approval.")
    expect(page.get_by_text("No available earnings outside a batch.")).to_be_visible()
    expect(page.get_by_text("No payouts sent yet.")).to_be_visible()
    web.shot("payouts")
