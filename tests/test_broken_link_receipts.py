"""A broken-link receipt has a culprit: the stage whose own signature contradicts its receipt.

Three stages of tiny-llama run as in-process StageServers speaking the real wire protocol; the
middle one is hostile. It forwards its true output to its successor (it must: the successor
checks the sender's signature on every item), but its receipt, and its taps to the coordinator,
carry a copy with one float changed, signed too. The two neighbours' receipts then disagree on
the link between them; the successor's receipt holds the hostile stage's signature over what it
really received, so the evidence pins the lie on the hostile stage. With honest compute and with
garbage compute on top, every job must end with:

- the hostile stage struck and never paid, and out of routing while the strike is open;
- the honest neighbours paid for their steps (by the platform: the customer paid nothing) and
  never struck, and every audit of the job ending in a verdict, never ``error``;
- the customer charged nothing, the whole hold back on their credit with the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from marketplace.billing.models import Transfer
from marketplace.billing.services import credits, grant
from marketplace.flows import runner
from marketplace.jobs import services
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.nodes.models import Node
from marketplace.payouts.models import Earning, EarningState
from marketplace.verification.models import Audit, CheckState, Strike, StrikeKind
from marketplace.verification.strikes import release_earnings_in_good_standing
from tests import stage_fixtures
from tests.stage_fixtures import stage_servers
from worker_agent.dev.cheat import Cheat, CheatingBlock
from worker_agent.protocol import wire
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.protocol.links import sign_link
from worker_agent.protocol.receipts import digest
from worker_agent.server import StageServer
from worker_agent.stage import Stage

pytestmark = [pytest.mark.trust, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.factories"]

SPANS = [(0, 2), (2, 4), (4, 6)]
HOSTILE = 1
JOBS = 3
PRICES = (5_000_000_000, 9_000_000_000)  # nano-dollars per million tokens: $5 and $9


def changed(chunk: bytes) -> bytes:
    """The copy the hostile stage signs for: one float with its lowest bit flipped."""
    return bytes([chunk[0] ^ 0x01]) + chunk[1:]


class BrokenLinkStage(Stage):
    """Signs and forwards its true output, but lists the changed copy's hash in its receipt."""

    garbage = False

    def __init__(self, block, **kwargs) -> None:
        super().__init__(CheatingBlock(block, Cheat("garbage")) if self.garbage else block, **kwargs)
        self._claims: dict[bytes, bytes] = {}  # sha256 of a true output -> the changed copy's

    def open(self, job, sessions, offers=()):
        reused = super().open(job, sessions, offers)
        for session in sessions:
            builder = self._sessions[(job, session)].receipt
            honest = builder.add_step

            def lying(in_hash, out_hash, tokens, link=b"", honest=honest):
                honest(in_hash, self._claims.pop(out_hash), tokens, link)

            builder.add_step = lying
        return reused

    def finish(self, prepared, outputs):
        for out in outputs:
            chunk = wire.tensor_payload(out, prepared.forward.dtype)
            self._claims[digest(chunk)] = digest(changed(chunk))
        return super().finish(prepared, outputs)


class GarbageBrokenLinkStage(BrokenLinkStage):
    garbage = True


class ChangedTaps(StageServer):
    """Taps the coordinator with the changed copy, signed by the stage's own key."""

    async def send_tap(self, coordinator, tap):
        key = self.primary.stage.signing_key
        chunks = [changed(chunk) for chunk in tap.item_bytes()]
        items = tuple(
            dataclasses.replace(item, sig=sign_link(key, tap.job, item.session, item.step, digest(chunk)))
            for item, chunk in zip(tap.items, chunks, strict=True)
        )
        await coordinator.send(dataclasses.replace(tap, items=items, payload=b"".join(chunks)))


@pytest.fixture
def control_plane(settings, tmp_path):
    with stage_fixtures.in_memory_control_plane(
        settings,
        tmp_path,
        SWARM_DEFAULT_PRICES=PRICES,
        SWARM_AUDIT_NEW_NODE_FRACTION=1.0,  # every stage of these jobs is audited
        SWARM_VERIFIER="inline",
    ) as plane:
        yield plane


@pytest.mark.parametrize("stage_class", [BrokenLinkStage, GarbageBrokenLinkStage], ids=["honest", "garbage"])
def test_a_broken_link_receipt_is_the_liars_strike_and_costs_the_customer_nothing(
    stage_class, control_plane, customer, provider, make_joined_node, monkeypatch
):
    grant(customer, 5)
    credit_before = credits(customer)
    api_key, _ = services.create_api_key(customer, "links")
    keys = [generate_signing_key() for _ in SPANS]
    nodes = [make_joined_node(provider, f"gpu-{i}", key=key).node for i, key in enumerate(keys)]
    Node.objects.filter(pk__in=[n.pk for n in nodes]).update(audit_fraction=1.0)
    hostile, honest = nodes[HOSTILE], [n for i, n in enumerate(nodes) if i != HOSTILE]
    params = RequestParams(max_tokens=6, temperature=0.0, prompt="Receipts that name their liar")

    async def scenario():
        ran = []
        async with stage_servers(
            SPANS, rogue=HOSTILE, rogue_class=stage_class, rogue_server=ChangedTaps, keys=keys
        ) as route:
            for _ in range(JOBS):
                job = await sync_to_async(stage_fixtures.admit)(api_key, route, params, monkeypatch)
                ran.append((job.pk, await runner.run_job(job.pk)))
        return ran

    ran = asyncio.run(scenario())

    job_pks = [pk for pk, _ in ran]
    jobs = list(Job.objects.filter(pk__in=job_pks).order_by("pk"))
    assert [state for _, state in ran] == [JobState.SUCCEEDED] * JOBS  # the customer got each stream
    for job in jobs:
        assert job.verified is False
        assert job.verification_error.endswith(
            f"node {hostile.node_id} signed that it sent what stage {HOSTILE + 1} received (receipt_broken_link)"
        ), job.verification_error
        assert job.charged_amount == 0 and job.completion_tokens > 0
        release = Transfer.objects.get(job=job, kind="release")
        assert release.amount == job.hold_amount
        assert release.memo.startswith("not charged: the job's work is unverified")
        assert not Transfer.objects.filter(job=job, kind="charge").exists()
    assert credits(customer) == credit_before  # nothing charged for any of them

    # The liar: a receipt strike per job, never paid, and no longer routable.
    strikes = Strike.objects.filter(node=hostile)
    assert strikes.filter(kind=StrikeKind.RECEIPT).count() == JOBS
    assert not Earning.objects.filter(node=hostile).exists()
    hostile.refresh_from_db()
    assert hostile.under_review is True
    # Every audit ended in a verdict: the successor's audit blames the liar's forged tap; with
    # garbage compute the liar's own replay fails as well.
    audits = Audit.objects.filter(job_id__in=job_pks)
    assert audits.count() == JOBS * len(SPANS)
    assert not audits.filter(state__in=[CheckState.PENDING, CheckState.ERROR]).exists()
    failed = audits.filter(state=CheckState.FAILED)
    assert set(failed.values_list("node_id", flat=True)) == {hostile.pk}
    assert failed.filter(stage=HOSTILE + 1, metrics__code="audit_forged_tap").count() == JOBS
    replays_failed = failed.filter(stage=HOSTILE, metrics__code="audit_mismatch").count()
    assert replays_failed == (JOBS if stage_class is GarbageBrokenLinkStage else 0)

    # The honest neighbours: never struck, paid by the platform for every job's verified steps.
    assert not Strike.objects.filter(node__in=honest).exists()
    release_earnings_in_good_standing(now=timezone.now() + timedelta(days=365))
    for node in honest:
        earned = Earning.objects.filter(node=node, job_id__in=job_pks)
        assert earned.count() == JOBS
        assert [(e.amount > 0, e.state) for e in earned] == [(True, EarningState.AVAILABLE)] * JOBS
        assert all("platform-paid" in t.memo for t in Transfer.objects.filter(kind="earning", job_id__in=job_pks))
    print(
        f"broken link ({stage_class.__name__}): {JOBS} jobs, liar struck {strikes.count()}x, "
        f"paid 0; honest paid {Earning.objects.filter(node__in=honest).count()} earnings; customer charged 0"
    )
