"""A provider's earnings per day and per node: each day's total and each node's part of it (pay
clawed back by a strike left out), the newest day first; a line opens its per-request rows, and the
per-request rows of another provider's node are never shown."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.jobs.models import Job
from marketplace.payouts.models import Earning, EarningState
from marketplace.web import trust_selectors

pytestmark = [pytest.mark.web, pytest.mark.django_db]
pytest_plugins = ["tests.factories"]


@pytest.fixture
def served(provider, second_provider, customer, make_joined_node):
    """alice's gpu-1 and gpu-2 earned today and two days ago (one share clawed back); bob's gpu-9 today."""
    nodes = {name: make_joined_node(provider, name).node for name in ("gpu-1", "gpu-2")}
    nodes["gpu-9"] = make_joined_node(second_provider, "gpu-9").node
    now = timezone.now()
    rows = [
        ("cmpl-a", "gpu-1", 1_333, 0, EarningState.PENDING),
        ("cmpl-a", "gpu-2", 1_334, 0, EarningState.PENDING),
        ("cmpl-b", "gpu-1", 2_000, 0, EarningState.PENDING),
        ("cmpl-c", "gpu-2", 5_000_000, 2, EarningState.AVAILABLE),
        ("cmpl-d", "gpu-2", 9_000, 2, EarningState.CLAWED_BACK),
        ("cmpl-e", "gpu-9", 7_000, 0, EarningState.PENDING),
    ]
    for public_id, node, amount, days_ago, state in rows:
        job, _ = Job.objects.get_or_create(
            public_id=public_id, kind="completion", customer=customer, model="tiny-llama"
        )
        earning = Earning.objects.create(
            node=nodes[node], provider=nodes[node].owner, job=job, amount=amount, layer_tokens=6, state=state,
            available_at=now + timedelta(days=1),
        )  # fmt: skip
        Earning.objects.filter(pk=earning.pk).update(created_at=now - timedelta(days=days_ago))
    return nodes


def test_each_day_has_its_total_then_each_nodes_part(provider, served):
    view = trust_selectors.earnings_view(provider)
    today = timezone.localdate()

    assert [(r["day"], r["node_name"], r["amount"], r["jobs"]) for r in view.rollup] == [
        (today, "", 1_333 + 1_334 + 2_000, 3),
        (today, "gpu-1", 1_333 + 2_000, 2),
        (today, "gpu-2", 1_334, 1),
        (today - timedelta(days=2), "", 5_000_000, 1),
        (today - timedelta(days=2), "gpu-2", 5_000_000, 1),
    ]
    assert view.showing is None and len(view.recent) == 5


def test_a_line_opens_its_days_and_nodes_requests(provider, served, client_for):
    today = timezone.localdate()
    client = client_for(provider)
    page = client.get("/provider/earnings/").content.decode()
    link = f"?day={today:%Y-%m-%d}&amp;node={served['gpu-1'].pk}#recent-title"
    assert f'<a href="{link}">gpu-1</a>' in page
    # The latest rows: gpu-1's 1,333 and gpu-2's 1,334 nano-dollars of one request read apart.
    assert "$0.000001333</span>" in page and "$0.000001334</span>" in page

    opened = client.get(f"/provider/earnings/?day={today:%Y-%m-%d}&node={served['gpu-1'].pk}").content.decode()
    table = opened[opened.index('id="earnings-table"') :]
    assert f"Requests of gpu-1 on {today:%Y-%m-%d}" in opened
    assert re.findall(r"<code>(cmpl-\w+)</code>", table) == ["cmpl-b", "cmpl-a"]
    assert re.findall(r'data-field="amount">.*?\$([0-9.]+)<', table) == ["0.000002", "0.00000133"]

    theirs = client.get(f"/provider/earnings/?day={today:%Y-%m-%d}&node={served['gpu-9'].pk}")
    assert theirs.status_code == 404  # bob's node: not one of alice's


@pytest.mark.parametrize("query", ["day=yesterday", "day=2026-13-01", "day=2026-12-01&node=gpu-1"])
def test_a_malformed_day_or_node_is_refused_400(provider, client_for, query):
    response = client_for(provider).get(f"/provider/earnings/?{query}")

    assert response.status_code == 400
    assert "day must be a date (YYYY-MM-DD)" in response.content.decode()
