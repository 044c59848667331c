"""The provider's dashboard in a real browser: sign up as a provider, add a node (a field error
first), copy the join command it shows, run a real agent with that command's token, and watch the
node go pending -> active -> serving its block -> offline on the open pages, without a reload.

The live part needs the node and placement services to announce their changes
(``marketplace.nodes.live.notify_node_changed``): nothing in this test announces anything itself.
"""

from __future__ import annotations

import hashlib
import re

import pytest
from playwright.sync_api import expect

from marketplace.nodes.models import Node, NodeState
from marketplace.placement.models import Assignment, AssignmentState
from tests.browser import MODEL, floatformat, sign_up
from tests.live import wait_for
from worker_agent.dev.local import join_agent, stop_processes
from worker_agent.protocol.span import Span

pytestmark = [pytest.mark.web, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.browser"]

LIVE_TIMEOUT_MS = 120_000  # an agent's start (torch import, benchmark, block load) on a busy 2-core box


def mark_page(page) -> None:
    """A flag that only survives as long as the document: a reload or navigation drops it."""
    page.evaluate("window.__sameDocument = true")


def same_document(page) -> bool:
    return page.evaluate("window.__sameDocument === true")


def test_a_provider_adds_a_node_runs_the_agent_and_watches_it_join_live(web, tmp_path):
    page = web.page
    web.context.grant_permissions(["clipboard-read", "clipboard-write"])

    sign_up(page, "frank", provider=True)
    expect(page.get_by_role("heading", level=1)).to_have_text("Welcome, frank")
    expect(page.get_by_text("Your roles: provider.")).to_be_visible()
    web.shot("home")

    page.get_by_role("navigation", name="Dashboard").get_by_role("link", name="Nodes").click()
    expect(page).to_have_url(f"{web.url}/provider/nodes/")
    expect(page.get_by_text("No nodes yet.")).to_be_visible()
    web.shot("nodes-empty")

    # A name the registry refuses: the field says why, and no node is added.
    page.get_by_label("Node name").fill("gpu 1!")
    page.get_by_role("button", name="Add node").click()
    error = page.locator(".field.invalid .errors")
    expect(error).to_have_text(
        "Use letters, digits, spaces, dots, dashes or underscores, starting with a letter or digit."
    )
    expect(page.get_by_label("Node name")).to_have_attribute("aria-invalid", "true")
    assert Node.objects.count() == 0
    web.shot("node-form-error")

    page.get_by_label("Node name").fill("gpu-1")
    page.get_by_label("Region").fill("eu-west")
    page.get_by_role("button", name="Add node").click()
    expect(page.locator(".join-command")).to_be_visible()
    node = Node.objects.get()
    command_box = page.locator(f"#join-command-{node.pk}")
    assert (node.owner.username, node.name, node.region, node.state) == ("frank", "gpu-1", "eu-west", "pending")
    command = command_box.inner_text()
    match = re.fullmatch(
        rf"curl -fsSL {re.escape(web.url)}/install/agent\.sh \| SWARM_JOIN_TOKEN=(swj_[A-Za-z0-9_-]+) sh", command
    )
    assert match, command
    token = match.group(1)
    assert hashlib.sha256(token.encode()).hexdigest() == node.join_token_hash

    page.get_by_role("button", name="Copy command").click()
    expect(page.get_by_role("button", name="Copied", exact=True)).to_be_visible()
    assert page.evaluate("navigator.clipboard.readText()") == command

    row = page.locator(f"#node-row-{node.pk}")
    expect(row.locator("[data-field=state]")).to_have_text("pending")
    expect(row.locator("[data-field=blocks]")).to_have_text("—")
    web.shot("node-added")
    assert web.phone("node-added-phone")

    # The agent joins with the token the page showed; the open page follows it without a reload.
    expect(page.locator("body")).to_have_attribute("data-live", "on")
    mark_page(page)
    agent = join_agent(web.url, token, tmp_path / "node.key", tmp_path / "agent.log", model=MODEL)
    try:
        expect(row.locator("[data-field=state]")).to_have_text("active", timeout=LIVE_TIMEOUT_MS)
        expect(row.locator("[data-field=blocks]")).to_have_text(f"{MODEL} layers 0–6 (ready)", timeout=LIVE_TIMEOUT_MS)
        assert same_document(page)
        node.refresh_from_db()
        assert (node.state, node.connected) == (NodeState.ACTIVE, True)
        (assignment,) = Assignment.objects.filter(node=node, state=AssignmentState.READY)
        assert assignment.span == Span(MODEL, 0, 6)
        web.shot("node-live-ready")

        page.get_by_role("link", name="gpu-1").click()
        expect(page).to_have_url(f"{web.url}/provider/nodes/{node.pk}/")
        status = page.locator("#node-status")
        expect(status.locator("[data-field=state]")).to_have_text("active")
        expect(status.locator("[data-field=blocks]")).to_have_text(f"{MODEL}: layers 0–6 ready pipeline 1, stage 1")
        # The review sweep recomputes reputation in the background (a new node's age lowers it), and
        # the open page follows: wait until what it shows is what the database holds.
        shown_reputation = status.locator("[data-field=reputation]")
        wait_for(
            lambda: shown_reputation.inner_text().strip() == floatformat(Node.objects.get(pk=node.pk).reputation, 2),
            LIVE_TIMEOUT_MS / 1000,
            "the page to show the node's stored reputation",
        )
        expect(status.get_by_text(node.node_id)).to_be_visible()
        expect(status.locator("[data-field=tokens]")).to_have_text(
            re.compile(r"^[\d,]+ by its current block$"), timeout=LIVE_TIMEOUT_MS
        )
        expect(status.locator("[data-field=uptime]")).to_have_text(re.compile(r"since it last connected$"))
        trust = page.locator("#node-trust")
        expect(trust).to_contain_text("No strikes: no check of this node has failed.")
        wait_for(
            lambda: (
                trust.locator("[data-field=score]").inner_text().strip()
                == floatformat(Node.objects.get(pk=node.pk).reputation, 2)
            ),
            LIVE_TIMEOUT_MS / 1000,
            "the trust panel to show the node's stored reputation",
        )
        web.shot("node-detail")
        assert web.phone("node-detail-phone")

        # The agent stops: its heartbeats stop, the sweep takes the node offline and releases its
        # block, and the open detail page shows it.
        expect(page.locator("body")).to_have_attribute("data-live", "on")
        mark_page(page)
        stop_processes([agent])
        expect(status.locator("[data-field=state]")).to_have_text("offline", timeout=LIVE_TIMEOUT_MS)
        expect(status.locator("[data-field=blocks]")).to_have_text("none assigned", timeout=LIVE_TIMEOUT_MS)
        expect(status.locator("[data-field=agent]")).to_have_text("offline")
        assert same_document(page)
        wait_for(lambda: Node.objects.get(pk=node.pk).state == NodeState.OFFLINE, 10, "the node offline")
        assert not Assignment.objects.filter(node=node, state__in=["assigned", "ready"]).exists()
        web.shot("node-offline")
    finally:
        stop_processes([agent])
