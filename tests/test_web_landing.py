"""The front door: a signed-out visitor's ``/`` says what the product is, shows the swarm's figures
as the database holds them (nodes online, the models with their prices per million tokens, tokens
served today), leads to sign-up as a GPU owner or as a developer, and gives the API quick start
with this site's own address to copy. It reads well at desktop and phone sizes.

The figures come from real rows: nodes in every state, and requests that ended today, yesterday or
not yet. A signed-in person still gets their own home at ``/``.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from playwright.sync_api import expect

from marketplace.billing.services import set_prices
from marketplace.jobs.models import Job, JobState
from marketplace.nodes.joining import create_node
from marketplace.nodes.models import Node, NodeState
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.web.landing_selectors import swarm_figures
from tests.browser import MODEL
from tests.web_trust_fixtures import serving_node, user

pytestmark = [pytest.mark.web, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.browser", "tests.web_trust_fixtures"]

PROMPT_PER_MILLION = 150_000_000  # nano-dollars: $0.15 per million input tokens
COMPLETION_PER_MILLION = 600_000_000  # $0.60 per million output tokens


def node_in(owner, name: str, state: str, **fields) -> Node:
    node, _ = create_node(owner=owner, name=name)
    Node.objects.filter(pk=node.pk).update(state=state, last_heartbeat_at=timezone.now(), **fields)
    return node


def job(customer, public_id: str, state: str, prompt: int, completion: int, finished_at) -> Job:
    return Job.objects.create(
        public_id=public_id, kind="chat", customer=customer, model=MODEL, state=state,
        prompt_tokens=prompt, completion_tokens=completion, finished_at=finished_at,
    )  # fmt: skip


@pytest.fixture
def swarm_today(settings):
    """Two nodes online (active, draining) among five; three requests ended today (35,700 tokens),
    one yesterday, one still running; the model's prices set by an admin."""
    settings.SWARM_MODELS = [MODEL]
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    pat = user("pat", is_provider=True)
    carol = user("carol", is_customer=True)
    node_in(pat, "gpu-active", NodeState.ACTIVE)
    node_in(pat, "gpu-draining", NodeState.DRAINING)
    node_in(pat, "gpu-offline", NodeState.OFFLINE)
    node_in(pat, "gpu-ejected", NodeState.EJECTED, ejection_reason="fraud")
    create_node(owner=pat, name="gpu-pending")
    now = timezone.now()
    job(carol, "chatcmpl-1", JobState.SUCCEEDED, 1_200, 30_000, now)
    job(carol, "chatcmpl-2", JobState.SUCCEEDED, 400, 3_600, now)
    job(carol, "chatcmpl-3", JobState.FAILED, 500, 0, now)
    job(carol, "chatcmpl-old", JobState.SUCCEEDED, 9_000, 9_000, now - timedelta(days=1))
    job(carol, "chatcmpl-now", JobState.RUNNING, 7_000, 0, None)
    set_prices(MODEL, PROMPT_PER_MILLION, COMPLETION_PER_MILLION)


def test_a_visitor_sees_what_the_swarm_is_and_does_today(trust_server, swarm_today, web):
    page = web.page
    web.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.goto("/")

    expect(page.get_by_role("heading", level=1)).to_have_text("Open LLMs, served by a swarm of community GPUs")
    figures = page.locator("#swarm-figures")
    expect(figures.locator("[data-field=nodes-online]")).to_have_text("2")
    expect(figures.locator("[data-field=tokens-today]")).to_have_text("35,700")
    expect(figures.locator("[data-field=requests-today]")).to_have_text("3")
    row = figures.locator(f"#model-prices tr[data-model='{MODEL}']")
    expect(row.locator("[data-field=input-price]")).to_have_text("$0.15 / 1M tokens")
    expect(row.locator("[data-field=output-price]")).to_have_text("$0.60 / 1M tokens")
    expect(row.locator("[data-field=availability]")).to_have_text("waiting for GPUs")
    expect(page.locator("[data-field=provider-share]")).to_have_text("80%")
    header = page.locator("header.top")
    expect(header.get_by_role("link", name="Sign in")).to_have_attribute("href", "/login/")

    # The quick start names this site's own API, ready to paste.
    code = page.locator("#quickstart-code")
    expect(code).to_contain_text(f'client = OpenAI(base_url="{web.url}/v1", api_key="YOUR_API_KEY")')
    expect(code).to_contain_text(f'model="{MODEL}"')
    page.get_by_role("button", name="Copy code").click()
    expect(page.get_by_role("button", name="Copied", exact=True)).to_be_visible()
    assert page.evaluate("navigator.clipboard.readText()") == code.inner_text().strip()
    web.shot("landing")
    assert web.phone("landing-phone")

    # Each path starts a sign-up with its role ticked.
    page.get_by_role("link", name="Earn with your GPU").first.click()
    expect(page).to_have_url(f"{web.url}/signup/?as=provider")
    expect(page.get_by_label("I provide GPUs (provider)")).to_be_checked()
    expect(page.get_by_label("I buy inference (customer)")).not_to_be_checked()
    page.go_back()
    page.get_by_role("link", name="Get an API key").first.click()
    expect(page).to_have_url(f"{web.url}/signup/?as=customer")
    expect(page.get_by_label("I buy inference (customer)")).to_be_checked()
    expect(page.get_by_label("I provide GPUs (provider)")).not_to_be_checked()
    web.shot("signup-customer")
    assert web.phone("signup-customer-phone")


def test_a_model_with_a_ready_pipeline_shows_as_serving(settings):
    settings.SWARM_MODELS = [MODEL]
    pat = user("pat", is_provider=True)
    PlacementState.objects.create(model=MODEL)
    node = serving_node(pat, "gpu-7")

    figures = swarm_figures()

    assert [(m.name, m.available) for m in figures.models] == [(MODEL, True)]
    assert figures.nodes_online == 1
    Assignment.objects.filter(node=node).update(state=AssignmentState.ASSIGNED)  # still loading
    assert [(m.name, m.available) for m in swarm_figures().models] == [(MODEL, False)]


def test_the_figures_refresh_on_their_own_and_a_signed_in_person_gets_their_home(swarm_today):
    visitor = Client()
    fragment = visitor.get("/figures/")
    assert fragment.status_code == 200
    assert '<span class="figure-value" data-field="tokens-today">35,700</span>' in fragment.content.decode()

    signed_in = Client()
    signed_in.force_login(Node.objects.get(name="gpu-active").owner)
    home = signed_in.get("/")
    assert home.status_code == 200
    assert home.templates[0].name == "web/home.html"


def test_a_visitor_back_from_checkout_is_asked_to_sign_in():
    response = Client().get("/?top_up=done")

    assert (response.status_code, response["Location"]) == (302, "/login/?next=/%3Ftop_up%3Ddone")
