"""Who may see which dashboard page (Django's test client, no browser): visitors are sent to sign
in; a role's pages answer 403 to other roles; another provider's node (with its strikes), another
customer's key or request answer 404, as if absent, and a provider's earnings page shows only their
own. Only admins decide strikes, build and approve payout batches, eject and reinstate nodes.
Every refused request leaves the database as it was. The live channel signs in with the session,
refuses other sites' pages, and tells a user only about their own nodes (admins about all)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.utils import timezone

from marketplace.billing.models import TopUp, Transfer
from marketplace.jobs.models import ApiKey, Job
from marketplace.jobs.services import create_api_key
from marketplace.nodes.live import notify_admins, notify_node_changed
from marketplace.payouts.models import ConnectAccount, Earning, EarningState, Payout, PayoutBatch
from marketplace.placement.lifecycle import eject_node
from marketplace.verification.models import Challenge, CheckState, Strike, StrikeKind
from tests.factories import db_snapshot

pytestmark = [pytest.mark.web, pytest.mark.django_db, pytest.mark.usefixtures("fresh_channel_layer")]
pytest_plugins = ["tests.factories"]

PROVIDER_PAGES = ["/provider/nodes/", "/provider/earnings/"]
CUSTOMER_PAGES = [
    "/customer/keys/",
    "/customer/billing/",
    "/customer/billing/balance/",
    "/customer/billing/ledger/",
    "/customer/usage/",
    "/customer/playground/",
    "/customer/privacy/",
]
ADMIN_PAGES = [
    "/swarm/",
    "/swarm/health/",
    "/swarm/latency/",
    "/swarm/throughput/",
    "/swarm/strikes/",
    "/swarm/strikes/lists/",
    "/swarm/todo/",
    "/swarm/payouts/",
]


def node_pages(pk: int) -> list[str]:
    return [
        f"/provider/nodes/{pk}/",
        f"/provider/nodes/{pk}/status/",
        f"/provider/nodes/{pk}/row/",
        f"/provider/nodes/{pk}/trust/",
        f"/provider/nodes/{pk}/earnings/",
        f"/provider/nodes/{pk}/remove/",
        f"/provider/nodes/{pk}/join-command/",
    ]


def node_actions(pk: int) -> list[str]:
    """Every POST a provider makes about one of their nodes."""
    return [
        f"/provider/nodes/{pk}/rotate-token/",
        f"/provider/nodes/{pk}/join-command/dismiss/",
        f"/provider/nodes/{pk}/drain/",
        f"/provider/nodes/{pk}/remove/",
    ]


def admin_actions(*, strike: int, batch: int, node: int, ejected: int) -> list[tuple[str, dict]]:
    """Every admin POST of the dashboards, with a form that would pass."""
    return [
        (f"/swarm/strikes/{strike}/uphold/", {f"strike-{strike}-reason": "clear evidence"}),
        (f"/swarm/strikes/{strike}/overturn/", {f"strike-{strike}-reason": "verifier bug"}),
        ("/swarm/payouts/build/", {}),
        (f"/swarm/payouts/{batch}/approve/", {}),
        (f"/swarm/nodes/{node}/eject/", {"reason": "fraud"}),
        (f"/swarm/nodes/{ejected}/reinstate/", {}),
    ]


def everything() -> dict:
    """Every row a dashboard action could change."""
    return db_snapshot() | {
        "keys": list(ApiKey.objects.order_by("pk").values()),
        "jobs": list(Job.objects.order_by("pk").values()),
        "top_ups": list(TopUp.objects.order_by("pk").values()),
        "transfers": list(Transfer.objects.order_by("pk").values()),
        "challenges": list(Challenge.objects.order_by("pk").values()),
        "strikes": list(Strike.objects.order_by("pk").values()),
        "earnings": list(Earning.objects.order_by("pk").values()),
        "batches": list(PayoutBatch.objects.order_by("pk").values()),
        "payouts": list(Payout.objects.order_by("pk").values()),
        "connect": list(ConnectAccount.objects.order_by("pk").values()),
    }


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def alices_node(provider, make_node):
    return make_node(provider, "alice-gpu")[0]


@pytest.fixture
def carols_key(customer):
    return create_api_key(customer, "carol-app")[0]


@pytest.fixture
def carols_job(customer, carols_key):
    return Job.objects.create(
        public_id="chatcmpl-carol", kind="chat", customer=customer, api_key=carols_key, model="smollm2-135m"
    )


@pytest.fixture
def alices_strike(alices_node):
    """An open strike on alice's node: a failed challenge with its evidence."""
    now = timezone.now()
    metrics = {"min_cosine": 0.4321, "max_rel_norm": 0.7, "required_cosine": 0.99, "allowed_rel_norm": 0.05}
    challenge = Challenge.objects.create(
        node=alices_node, model="tiny-llama", layer_start=0, layer_end=2, seed=424242, tokens=2,
        state=CheckState.FAILED, sent_at=now, deadline_at=now + timedelta(seconds=30), metrics=metrics,
    )  # fmt: skip
    evidence = {"kind": "challenge", "seed": "424242", "tokens": 2, "cosine": [0.4321, 0.5], **metrics}
    return Strike.objects.create(node=alices_node, kind=StrikeKind.CHALLENGE, challenge=challenge, evidence=evidence)


@pytest.fixture
def alices_pay(provider, customer, alices_node):
    """alice: an available earning of $1.75 in a built batch awaiting approval, and a payout-ready account."""
    job = Job.objects.create(public_id="cmpl-alice-paid", kind="completion", customer=customer, model="tiny-llama")
    batch = PayoutBatch.objects.create(total=1_750_000_000)
    payout = Payout.objects.create(
        batch=batch, provider=provider, amount=1_750_000_000, cents=175, idempotency_key="payout-test-alice"
    )
    Earning.objects.create(
        node=alices_node, provider=provider, job=job, amount=1_750_000_000, layer_tokens=10,
        state=EarningState.BATCHED, available_at=timezone.now(), payout=payout,
    )  # fmt: skip
    ConnectAccount.objects.create(provider=provider, stripe_account_id="acct_alice", payouts_enabled=True)
    return batch


@pytest.fixture
def ejected_node(second_provider, make_node, admin):
    return eject_node(make_node(second_provider, "bob-gpu")[0], reason="caught cheating", by=admin)


def test_visitors_are_sent_to_sign_in(alices_node):
    for url in PROVIDER_PAGES + CUSTOMER_PAGES + ADMIN_PAGES + node_pages(alices_node.pk):
        response = Client().get(url)

        assert response.status_code == 302, url
        assert response["Location"] == f"/login/?next={url}", url


def test_visitors_are_sent_to_sign_in_by_admin_actions(alices_strike, alices_pay, alices_node, ejected_node):
    before = everything()
    actions = admin_actions(strike=alices_strike.pk, batch=alices_pay.pk, node=alices_node.pk, ejected=ejected_node.pk)

    for url, form in [*actions, ("/provider/earnings/connect/", {})]:
        response = Client().post(url, form)

        assert response.status_code == 302, url
        assert response["Location"] == f"/login/?next={url}", url
    assert everything() == before


def test_a_visitor_cannot_post_to_the_playground(customer):
    response = Client().post("/customer/playground/chat/", "{}", content_type="application/json")

    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_signed_in"


def test_a_customer_cannot_reach_provider_pages_or_change_a_node(customer, alices_node):
    client = signed_in(customer)
    before = everything()

    for url in PROVIDER_PAGES + node_pages(alices_node.pk):
        assert client.get(url).status_code == 403, url
    assert client.post("/provider/nodes/", {"name": "mine", "region": "local"}).status_code == 403
    for url in node_actions(alices_node.pk):
        assert client.post(url).status_code == 403, url

    assert everything() == before


@pytest.mark.parametrize("persona", ["customer", "provider", "stranger"])
def test_only_admins_reach_admin_pages(persona, request):
    client = signed_in(request.getfixturevalue(persona))
    before = everything()

    for url in ADMIN_PAGES:
        response = client.get(url)

        assert response.status_code == 403, url
        assert "This page is not for your account" in response.content.decode()
    assert everything() == before


@pytest.mark.parametrize("persona", ["customer", "provider", "second_provider", "stranger"])
def test_only_admins_decide_strikes_pay_out_or_eject(
    persona, request, alices_strike, alices_pay, alices_node, ejected_node, settings
):
    settings.STRIPE_SECRET_KEY = "sk_test_not_used"  # an approval would otherwise stop at "not configured"
    client = signed_in(request.getfixturevalue(persona))
    before = everything()
    actions = admin_actions(strike=alices_strike.pk, batch=alices_pay.pk, node=alices_node.pk, ejected=ejected_node.pk)

    for url, form in actions:
        response = client.post(url, form)

        assert response.status_code == 403, url
        assert "This page is not for your account" in response.content.decode()
    assert client.get(f"/swarm/nodes/{alices_node.pk}/eject/").status_code == 403
    assert everything() == before


def test_an_admin_reaches_admin_pages(admin):
    client = signed_in(admin)

    for url in ADMIN_PAGES:
        assert client.get(url).status_code == 200, url


def test_a_provider_cannot_reach_customer_pages_or_spend(provider, carols_key, carols_job, settings):
    settings.STRIPE_SECRET_KEY = "sk_test_not_used"  # a top-up would otherwise stop at "not configured"
    client = signed_in(provider)
    before = everything()

    for url in [*CUSTOMER_PAGES, f"/customer/playground/jobs/{carols_job.public_id}/"]:
        assert client.get(url).status_code == 403, url
    assert client.post("/customer/keys/", {"name": "mine"}).status_code == 403
    assert client.post(f"/customer/keys/{carols_key.pk}/revoke/").status_code == 403
    assert client.post(f"/customer/keys/{carols_key.pk}/privacy/", {"privacy": "any"}).status_code == 403
    assert client.post("/customer/billing/top-up/", {"amount": "10.00"}).status_code == 403
    chat = client.post(
        "/customer/playground/chat/",
        {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]},
        content_type="application/json",
    )
    assert chat.status_code == 403
    assert chat.json()["error"]["code"] == "not_a_customer"

    assert everything() == before


def test_a_provider_cannot_see_or_change_another_providers_node(second_provider, alices_node, make_node):
    make_node(second_provider, "bob-gpu")
    client = signed_in(second_provider)
    before = everything()

    for url in node_pages(alices_node.pk):
        response = client.get(url)

        assert response.status_code == 404, url
        assert "alice-gpu" not in response.content.decode()
    for url in node_actions(alices_node.pk):
        assert client.post(url).status_code == 404, url
    listing = client.get("/provider/nodes/").content.decode()
    assert "bob-gpu" in listing
    assert "alice-gpu" not in listing

    assert everything() == before


def test_a_provider_sees_neither_another_providers_strikes_nor_earnings(
    second_provider, alices_node, alices_strike, alices_pay
):
    client = signed_in(second_provider)
    before = everything()

    trust = client.get(f"/provider/nodes/{alices_node.pk}/trust/")
    earnings = client.get("/provider/earnings/").content.decode()

    assert trust.status_code == 404
    assert "424242" not in trust.content.decode()
    for hidden in ("cmpl-alice-paid", "$1.75", "acct_alice", "424242"):
        assert hidden not in earnings
    assert 'data-field="available"><span class="money">$0.00</span><' in earnings
    assert 'data-field="connect-status">no Stripe account connected<' in earnings
    assert everything() == before


def test_a_customer_cannot_connect_a_payout_account(customer, settings):
    settings.STRIPE_SECRET_KEY = "sk_test_not_used"  # so that only the role check can refuse
    client = signed_in(customer)
    before = everything()

    response = client.post("/provider/earnings/connect/")

    assert response.status_code == 403
    assert everything() == before


def test_an_admin_cannot_overturn_a_strike_without_a_reason(admin, alices_strike):
    client = signed_in(admin)
    before = everything()

    response = client.post(f"/swarm/strikes/{alices_strike.pk}/overturn/", {f"strike-{alices_strike.pk}-reason": "  "})

    assert response.status_code == 400
    page = response.content.decode()
    assert (
        f'id="id_strike-{alices_strike.pk}-reason_error" role="alert"><p>Overturning a strike needs a reason.</p>'
        in page
    )
    assert everything() == before


def test_a_provider_sees_their_own_node(provider, alices_node):
    client = signed_in(provider)
    pk = alices_node.pk

    detail, status, row, trust, earnings, remove, join = (client.get(url) for url in node_pages(pk))

    assert [r.status_code for r in (detail, status, row, trust, earnings, remove, join)] == [200] * 7
    assert "<h1>alice-gpu</h1>" in detail.content.decode()
    assert f'<section class="card" id="node-status" data-live-node="{pk}"' in status.content.decode()
    assert 'data-field="state">pending</span>' in status.content.decode()
    assert f'<tr id="node-row-{pk}" data-live-node="{pk}"' in row.content.decode()
    assert f'<a href="/provider/nodes/{pk}/">alice-gpu</a>' in row.content.decode()
    assert f'<section class="card" id="node-trust" data-live-node="{pk}"' in trust.content.decode()
    assert "No strikes: no check of this node has failed." in trust.content.decode()
    assert f'<section class="card" id="node-earnings" data-live-node="{pk}"' in earnings.content.decode()
    assert '<h1 id="remove-title" class="long-text">Remove “alice-gpu”?</h1>' in remove.content.decode()
    assert join.content.decode() == f'<div id="join-box-{pk}" hidden></div>'  # its command was never kept


def test_a_customer_cannot_touch_another_customers_key_or_request(make_user, carols_key, carols_job):
    frank = make_user("frank", customer=True)
    client = signed_in(frank)
    before = everything()

    assert client.post(f"/customer/keys/{carols_key.pk}/revoke/").status_code == 404
    assert client.post(f"/customer/keys/{carols_key.pk}/privacy/", {"privacy": "trusted_only"}).status_code == 404
    assert client.get(f"/customer/playground/jobs/{carols_job.public_id}/").status_code == 404
    assert "carol-app" not in client.get("/customer/keys/").content.decode()

    assert everything() == before


# --- the live channel -------------------------------------------------------------------------------


def session_headers(user=None, origin: str = "http://testserver") -> list[tuple[bytes, bytes]]:
    headers = [(b"origin", origin.encode()), (b"host", b"testserver")]
    if user is not None:
        client = Client()
        client.force_login(user)
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    return headers


def dashboard_socket(headers) -> WebsocketCommunicator:
    from marketplace.asgi import application

    return WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)


@pytest.mark.django_db(transaction=True)
def test_the_live_channel_refuses_visitors_and_other_sites(provider):
    attempts = [
        session_headers(None),
        session_headers(provider, origin="http://evil.example"),
        session_headers(provider),
    ]

    async def scenario() -> tuple[bool, bool, bool]:
        results = []
        for headers in attempts:
            socket = dashboard_socket(headers)
            connected, _ = await socket.connect(timeout=5)
            results.append(connected)
            await socket.disconnect()
        return tuple(results)

    assert asyncio.run(scenario()) == (False, False, True)


@pytest.mark.django_db(transaction=True)
def test_a_node_notice_reaches_its_owner_and_the_admins_only(provider, second_provider, admin, make_node):
    node = make_node(provider, "alice-gpu")[0]
    sockets = {
        "alice": dashboard_socket(session_headers(provider)),
        "bob": dashboard_socket(session_headers(second_provider)),
        "dave": dashboard_socket(session_headers(admin)),
    }

    async def scenario() -> dict:
        for socket in sockets.values():
            connected, _ = await socket.connect(timeout=5)
            assert connected
        await database_sync_to_async(notify_node_changed)(node.pk)
        heard = {
            "alice": await sockets["alice"].receive_json_from(timeout=5),
            "dave": await sockets["dave"].receive_json_from(timeout=5),
            "bob heard nothing": await sockets["bob"].receive_nothing(timeout=0.5),
        }
        for socket in sockets.values():
            await socket.disconnect()
        return heard

    assert asyncio.run(scenario()) == {
        "alice": {"topic": "node", "node": node.pk},
        "dave": {"topic": "node", "node": node.pk},
        "bob heard nothing": True,
    }


@pytest.mark.django_db(transaction=True)
def test_a_strike_notice_reaches_the_admins_only(provider, admin):
    sockets = {"alice": dashboard_socket(session_headers(provider)), "dave": dashboard_socket(session_headers(admin))}

    async def scenario() -> dict:
        for socket in sockets.values():
            connected, _ = await socket.connect(timeout=5)
            assert connected
        await database_sync_to_async(notify_admins)("strike")
        heard = {
            "dave": await sockets["dave"].receive_json_from(timeout=5),
            "alice heard nothing": await sockets["alice"].receive_nothing(timeout=0.5),
        }
        for socket in sockets.values():
            await socket.disconnect()
        return heard

    assert asyncio.run(scenario()) == {"dave": {"topic": "strike", "node": None}, "alice heard nothing": True}
