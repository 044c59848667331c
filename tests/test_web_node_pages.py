"""A provider's node pages without a browser (Django's test client): the join command stays until
dismissed (through a form error, a reload, a visit to the node's page) and "New join token" shows a
new one; removing a node asks first and keeps what it earned; the agent's status is what the
control plane knows, not the last heartbeat's word; a node's page shows its earnings in dollars or
why it has none; its reputation reads as a rising track."""

from __future__ import annotations

import hashlib
import html
import re
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.test import Client
from django.utils import timezone

from marketplace.jobs.models import Job
from marketplace.nodes import joining
from marketplace.nodes.models import Node, NodeState
from marketplace.payouts.models import ConnectAccount, Earning, EarningState
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.verification.models import Challenge, CheckState, Strike, StrikeKind
from marketplace.verification.standing import refresh_reputation
from tests.factories import db_snapshot

pytestmark = [pytest.mark.web, pytest.mark.django_db]
pytest_plugins = ["tests.factories"]

HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture(autouse=True)
def fresh_cache():
    """The join commands on screen live in the cache, keyed by node: none left from another test."""
    cache.clear()
    yield
    cache.clear()


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def join_commands(page) -> dict[int, str]:
    """The join commands a page shows, by node."""
    text = page.content.decode()
    found = re.findall(r'<code id="join-command-(\d+)" class="join-command">(.*?)</code>', text, re.S)
    return {int(pk): html.unescape(command) for pk, command in found}


def token_in(command: str) -> str:
    return re.search(r"SWARM_JOIN_TOKEN=(swj_[A-Za-z0-9_-]+) ", command).group(1)


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def add_node(client: Client, name: str = "gpu-1"):
    page = client.post("/provider/nodes/", {"name": name, "region": "local"})
    assert page.status_code == 200
    return page, Node.objects.get(name=name)


def assign(node: Node, *, state: str = AssignmentState.READY, spare: bool = False) -> Assignment:
    return Assignment.objects.create(
        node=node, model="tiny-llama", generation=1, pipeline=0, position=0, layer_start=0, layer_end=6,
        state=state, is_spare=spare,
    )  # fmt: skip


def earn(node: Node, customer, public_id: str, amount: int, state: str = EarningState.PENDING) -> Earning:
    job = Job.objects.create(public_id=public_id, kind="completion", customer=customer, model="tiny-llama")
    return Earning.objects.create(
        node=node, provider=node.owner, job=job, amount=amount, layer_tokens=6, state=state,
        available_at=timezone.now() + timedelta(days=1),
    )  # fmt: skip


def text_of(page) -> str:
    return page.content.decode()


# --- the join command -----------------------------------------------------------------------------


def test_the_join_command_stays_through_a_form_error_a_reload_and_the_nodes_page(provider):
    client = signed_in(provider)

    added, node = add_node(client)
    refused = client.post("/provider/nodes/", {"name": "gpu 2!", "region": "local"})
    reloaded = client.get("/provider/nodes/")
    own_page = client.get(f"/provider/nodes/{node.pk}/")

    (command,) = join_commands(added).values()
    assert sha(token_in(command)) == node.join_token_hash
    assert refused.status_code == 400
    assert join_commands(refused) == join_commands(reloaded) == join_commands(own_page) == {node.pk: command}


def test_each_new_node_keeps_its_own_join_command(provider):
    client = signed_in(provider)
    add_node(client, "gpu-1")

    page, second = add_node(client, "gpu-2")

    shown = join_commands(page)
    first = Node.objects.get(name="gpu-1")
    assert sorted(shown) == [first.pk, second.pk]
    assert {sha(token_in(c)) for c in shown.values()} == {first.join_token_hash, second.join_token_hash}


def test_a_dismissed_join_command_is_not_shown_again_and_its_token_still_works(provider):
    client = signed_in(provider)
    _, node = add_node(client)

    dismissed = client.post(f"/provider/nodes/{node.pk}/join-command/dismiss/", {"back": "nodes"}, **HTMX)

    assert (dismissed.status_code, dismissed.content) == (200, b"")
    assert join_commands(client.get("/provider/nodes/")) == {}
    assert join_commands(client.get(f"/provider/nodes/{node.pk}/")) == {}
    assert Node.objects.get(pk=node.pk).join_token_hash == node.join_token_hash


def test_dismissing_without_htmx_goes_back_to_the_page_it_came_from(provider):
    client = signed_in(provider)
    _, node = add_node(client)

    from_node = client.post(f"/provider/nodes/{node.pk}/join-command/dismiss/", {"back": "node"})
    from_list = client.post(f"/provider/nodes/{node.pk}/join-command/dismiss/", {"back": "nodes"})

    assert (from_node.status_code, from_node["Location"]) == (302, f"/provider/nodes/{node.pk}/")
    assert (from_list.status_code, from_list["Location"]) == (302, "/provider/nodes/")


def test_a_new_join_token_shows_its_command_until_dismissed(provider):
    client = signed_in(provider)
    _, node = add_node(client)
    client.post(f"/provider/nodes/{node.pk}/join-command/dismiss/", **HTMX)

    rotated = client.post(f"/provider/nodes/{node.pk}/rotate-token/", **HTMX)

    node.refresh_from_db()
    (command,) = join_commands(rotated).values()
    assert sha(token_in(command)) == node.join_token_hash
    assert join_commands(client.get(f"/provider/nodes/{node.pk}/")) == {node.pk: command}
    assert join_commands(client.get("/provider/nodes/")) == {node.pk: command}


def test_a_used_join_command_says_the_node_joined(provider):
    client = signed_in(provider)
    _, node = add_node(client)
    Node.objects.filter(pk=node.pk).update(
        node_id="node-00000000000000aa", used_join_token_hash=node.join_token_hash, join_token_hash=None
    )

    page = client.get("/provider/nodes/")

    assert list(join_commands(page)) == [node.pk]
    assert "“gpu-1” joined with this command" in text_of(page)


def test_a_token_replaced_through_the_api_is_no_longer_shown(provider):
    client = signed_in(provider)
    _, node = add_node(client)

    joining.rotate_join_token(node)

    assert join_commands(client.get("/provider/nodes/")) == {}


# --- removing a node ------------------------------------------------------------------------------


def test_removing_a_node_asks_first(provider, make_node):
    node, _ = make_node(provider, "gpu-9")
    client = signed_in(provider)
    before = db_snapshot()

    page = client.get(f"/provider/nodes/{node.pk}/remove/")

    assert page.status_code == 200
    assert "Remove “gpu-9”?" in text_of(page)
    assert "It has earned nothing, so nothing is lost." in text_of(page)
    assert '<button type="submit" class="danger">Remove gpu-9</button>' in text_of(page)
    assert db_snapshot() == before


def test_removing_a_node_that_never_joined_deletes_it(provider, make_node):
    node, _ = make_node(provider, "gpu-9")
    client = signed_in(provider)

    response = client.post(f"/provider/nodes/{node.pk}/remove/")

    assert (response.status_code, response["Location"]) == (302, "/provider/nodes/")
    assert not Node.objects.filter(pk=node.pk).exists()
    listing = text_of(client.get("/provider/nodes/"))
    assert "gpu-9 was removed. What it earned stays on your Earnings page." in listing
    assert "No nodes yet." in listing


def test_removing_a_node_that_earned_keeps_its_earnings(provider, customer, make_joined_node):
    node = make_joined_node(provider, "gpu-1").node
    assign(node)
    earned = earn(node, customer, "cmpl-1", 1_250_000_000)
    client = signed_in(provider)
    confirm = text_of(client.get(f"/provider/nodes/{node.pk}/remove/"))

    response = client.post(f"/provider/nodes/{node.pk}/remove/")

    assert 'What it earned (<span class="money">$1.25</span>) stays yours' in confirm
    assert response.status_code == 302
    node.refresh_from_db()
    assert (node.state, node.connected, node.deleted_at is not None) == (NodeState.DELETED, False, True)
    assert list(Earning.objects.values_list("pk", "node_id", "amount")) == [(earned.pk, node.pk, 1_250_000_000)]
    assert not Assignment.objects.filter(node=node, state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
    assert client.get(f"/provider/nodes/{node.pk}/").status_code == 404
    assert 'data-field="pending"><span class="money">$1.25</span>' in text_of(client.get("/provider/earnings/"))


# --- the agent's status ---------------------------------------------------------------------------


def agent_label(client: Client, node: Node) -> str:
    page = text_of(client.get(f"/provider/nodes/{node.pk}/status/"))
    return re.search(r'data-field="agent">([^<]*)</span>', page).group(1)


def test_a_node_that_never_joined_says_so(provider, make_node):
    node, _ = make_node(provider)

    assert agent_label(signed_in(provider), node) == "not joined"


@pytest.mark.parametrize(
    ("change", "label"),
    [
        ({}, "serving"),
        ({"connected": False}, "not connected"),  # the agent stopped; the sweep has not run yet
        ({"connected": False, "state": NodeState.OFFLINE}, "offline"),
        ({"connected": False, "state": NodeState.EJECTED}, "ejected"),
        ({"state": NodeState.DRAINING}, "draining"),
        ({"suspected_at": timezone.now()}, "paused"),
    ],
)
def test_serving_is_shown_only_while_the_agent_is_connected_and_its_block_ready(
    change, label, provider, make_joined_node
):
    node = make_joined_node(provider).node
    assign(node)
    Node.objects.filter(pk=node.pk).update(load={"state": "serving", "tokens_served": 12.0}, **change)

    assert agent_label(signed_in(provider), node) == label


@pytest.mark.parametrize(
    ("block", "label"),
    [(None, "idle"), ({"state": AssignmentState.ASSIGNED}, "loading"), ({"spare": True}, "spare")],
)
def test_a_connected_agent_without_a_pipeline_block_is_not_serving(block, label, provider, make_joined_node):
    node = make_joined_node(provider).node
    if block is not None:
        assign(node, **block)

    assert agent_label(signed_in(provider), node) == label


# --- a node's earnings ----------------------------------------------------------------------------


def reasons(client: Client, node: Node) -> list[str]:
    page = text_of(client.get(f"/provider/nodes/{node.pk}/earnings/"))
    return re.findall(r'<li data-reason="([a-z-]+)">', page)


def test_a_node_not_joined_earns_nothing_because_it_is_not_placed(provider, make_node):
    node, _ = make_node(provider)
    client = signed_in(provider)

    page = text_of(client.get(f"/provider/nodes/{node.pk}/earnings/"))

    assert 'data-field="earned"><span class="money">$0.00</span>' in page
    assert "Why it earns nothing yet" in page
    assert reasons(client, node) == ["not-placed", "payout-account-missing"]
    assert "Not placed: its agent has not joined yet." in page


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        ({}, "no-traffic"),
        ({"spare": True}, "spare"),
        ({"state": AssignmentState.ASSIGNED}, "loading"),
        (None, "not-placed"),
    ],
)
def test_a_joined_node_says_why_it_earns_nothing(block, reason, provider, make_joined_node):
    node = make_joined_node(provider).node
    if block is not None:
        assign(node, **block)
    ConnectAccount.objects.create(provider=provider, stripe_account_id="acct_alice", payouts_enabled=True)

    assert reasons(signed_in(provider), node) == [reason]


def test_a_node_that_served_and_awaits_verification_says_so(provider, make_joined_node):
    node = make_joined_node(provider).node
    assign(node)
    Node.objects.filter(pk=node.pk).update(load={"state": "serving", "tokens_served": 40.0})

    assert reasons(signed_in(provider), node) == ["verifying", "payout-account-missing"]


def test_a_node_shows_its_own_earnings_in_dollars(provider, second_provider, customer, make_joined_node):
    node = make_joined_node(provider, "gpu-1").node
    other = make_joined_node(provider, "gpu-2").node
    assign(node)
    earn(node, customer, "cmpl-1", 1_104_013_440)
    earn(node, customer, "cmpl-2", 500_000_000, EarningState.AVAILABLE)
    earn(other, customer, "cmpl-3", 9_000_000_000)
    ConnectAccount.objects.create(provider=provider, stripe_account_id="acct_alice", payouts_enabled=True)
    client = signed_in(provider)

    page = text_of(client.get(f"/provider/nodes/{node.pk}/earnings/"))

    assert 'data-field="earned"><span class="money" title="$1.60401344">$1.60</span>' in page
    assert 'data-field="pending"><span class="money" title="$1.10401344">$1.10</span>' in page
    assert 'data-field="available"><span class="money">$0.50</span>' in page
    assert "for 2 verified requests" in page
    assert reasons(client, node) == []


def test_an_open_strike_and_a_missing_payout_account_hold_its_pay(provider, customer, make_joined_node):
    node = make_joined_node(provider).node
    earn(node, customer, "cmpl-1", 1_000_000_000)
    now = timezone.now()
    challenge = Challenge.objects.create(
        node=node, model="tiny-llama", layer_start=0, layer_end=6, seed=7, tokens=2, state=CheckState.FAILED,
        sent_at=now, deadline_at=now + timedelta(seconds=30),
    )  # fmt: skip
    Strike.objects.create(node=node, kind=StrikeKind.CHALLENGE, challenge=challenge)
    client = signed_in(provider)

    page = text_of(client.get(f"/provider/nodes/{node.pk}/earnings/"))

    assert "What holds its pay" in page
    assert reasons(client, node) == ["strike-open", "payout-account-missing"]


# --- reputation -----------------------------------------------------------------------------------


def test_a_node_not_yet_rated_reads_new_not_one(provider, make_node):
    node, _ = make_node(provider)
    client = signed_in(provider)

    status = text_of(client.get(f"/provider/nodes/{node.pk}/status/"))
    trust = text_of(client.get(f"/provider/nodes/{node.pk}/trust/"))

    assert '<span data-field="reputation">new</span>' in status
    assert '<span class="score" data-field="score">new</span>' in trust
    assert "Not rated yet. A new node starts at 0.85 and rises to 1.00 over its first 30 days" in trust


def test_a_new_nodes_reputation_is_shown_as_a_rising_track(provider, make_joined_node):
    node = make_joined_node(provider).node
    node = refresh_reputation(node.pk)
    full_at = (node.joined_at + timedelta(days=30)).strftime("%Y-%m-%d")
    client = signed_in(provider)

    status = text_of(client.get(f"/provider/nodes/{node.pk}/status/"))
    trust = text_of(client.get(f"/provider/nodes/{node.pk}/trust/"))
    row = text_of(client.get(f"/provider/nodes/{node.pk}/row/"))

    assert node.reputation == pytest.approx(0.85, abs=1e-4)
    assert '<span data-field="reputation">0.85</span>' in status
    assert "building its track record: day 1 of 30" in status
    assert f"<strong>Building its track record:</strong> 0.85 now, rising to 1.00 by {full_at} (day 1 of 30)." in trust
    assert "gains 0.005 a day until it is 30 days old. It is not a penalty" in trust
    assert '<progress max="1" value="0.8500"' in trust
    assert 'data-field="reputation">0.85</td>' in row


def test_what_else_raises_a_reputation_is_named(provider, make_joined_node):
    node = make_joined_node(provider).node
    now = timezone.now()
    Challenge.objects.create(
        node=node, model="tiny-llama", layer_start=0, layer_end=6, seed=7, tokens=2, state=CheckState.EXPIRED,
        sent_at=now, deadline_at=now,
    )  # fmt: skip
    refresh_reputation(node.pk)

    trust = text_of(signed_in(provider).get(f"/provider/nodes/{node.pk}/trust/"))

    assert "Passing checks: every challenge and audit it passes raises its pass rate." in trust
    assert "Answering challenges in time: each one answered before its deadline counts." in trust


# --- no internal addresses ------------------------------------------------------------------------


def test_the_nodes_list_shows_no_internal_address(provider, make_joined_node):
    node = make_joined_node(provider).node
    assign(node)
    client = signed_in(provider)

    listing = text_of(client.get("/provider/nodes/"))

    assert node.data_url.startswith("ws://127.0.0.1:")
    assert "ws://" not in listing
    assert "127.0.0.1" not in listing


def test_the_join_box_follows_the_node_live(provider):
    client = signed_in(provider)
    _, node = add_node(client)
    waiting = client.get(f"/provider/nodes/{node.pk}/join-command/?back=node", **HTMX)
    Node.objects.filter(pk=node.pk).update(
        node_id="node-00000000000000aa", used_join_token_hash=node.join_token_hash, join_token_hash=None
    )

    joined = client.get(f"/provider/nodes/{node.pk}/join-command/?back=node", **HTMX)
    client.post(f"/provider/nodes/{node.pk}/join-command/dismiss/", **HTMX)
    dismissed = client.get(f"/provider/nodes/{node.pk}/join-command/?back=node", **HTMX)

    assert "Join “gpu-1” to the swarm" in text_of(waiting)
    assert '<input type="hidden" name="back" value="node">' in text_of(waiting)
    assert "“gpu-1” joined with this command" in text_of(joined)
    assert join_commands(joined) == join_commands(waiting)
    assert text_of(dismissed) == f'<div id="join-box-{node.pk}" hidden></div>'


@pytest.mark.parametrize(
    ("reachability", "detail", "relay", "shown"),
    [
        (
            "unreachable",
            "wss://203.0.113.7:40513 refused the connection (nothing listens there, or a NAT router answers for it)",
            "",
            "The control plane could not open its data plane: wss://203.0.113.7:40513 refused the connection "
            "(nothing listens there, or a NAT router answers for it). Where this control plane has relays the "
            "agent moves to one by itself; otherwise make its port reachable from the internet, or give the "
            "agent --advertise-url with an address others can reach.",
        ),
        (
            "relayed",
            "reached through relay r1 at wss://198.51.100.4:7700",
            "r1",
            "reached through relay r1 at wss://198.51.100.4:7700",
        ),
    ],
    ids=["unreachable", "relayed"],
)
def test_a_nodes_page_says_how_the_control_plane_reached_it_and_why_not(
    provider, make_joined_node, reachability, detail, relay, shown
):
    node = make_joined_node(provider).node
    Node.objects.filter(pk=node.pk).update(reachability=reachability, reachability_detail=detail, relay=relay)

    page = signed_in(provider).get(f"/provider/nodes/{node.pk}/")

    text = page.content.decode()
    badge = re.search(r'data-field="reachability">([^<]*)<', text).group(1)
    said = re.search(r'data-field="reachability-detail">(.*?)</span>', text, re.S).group(1)
    assert badge == dict(Node._meta.get_field("reachability").choices)[reachability]
    assert html.unescape(said) == shown
