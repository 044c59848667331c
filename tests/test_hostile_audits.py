"""Live audits against hostile stages: audits fail closed and blame the node that owed the evidence.

Three stages of tiny-llama run as in-process StageServers speaking the real wire protocol; the
middle one is hostile. Jobs go through the control plane's runner with every stage audited and
audits replayed inline. For each attack the hostile node must be struck within 5 jobs and never
paid for them, and its honest neighbours must get no strike and be paid:

- it sends no taps (its outputs, and its successor's inputs, are then missing evidence);
- its taps are malformed (a valid frame one column wider than the model's hidden states);
- it reports a wrong hidden size in HELLO and computes garbage;
- it frames its successor: its taps carry one changed float, while its successor gets the truth.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from marketplace.billing.models import Transfer
from marketplace.billing.services import grant
from marketplace.flows import runner
from marketplace.jobs import services
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.nodes.models import Node
from marketplace.payouts.models import Earning, EarningState
from marketplace.verification.models import Audit, CheckState, Strike
from marketplace.verification.strikes import release_earnings_in_good_standing, uphold_strike
from tests import stage_fixtures
from tests.stage_fixtures import stage_servers
from worker_agent.dev.cheat import Cheat, CheatingStage
from worker_agent.protocol import wire
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.server import StageServer

pytestmark = [pytest.mark.trust, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.factories"]

SPANS = [(0, 2), (2, 4), (4, 6)]
HOSTILE = 1
MAX_JOBS = 5
PRICES = (5_000_000_000, 9_000_000_000)  # nano-dollars per million tokens: $5 and $9


class SilentTaps(StageServer):
    """Forwards its outputs to its successor but never sends the coordinator its taps."""

    async def send_tap(self, coordinator, tap):
        return None


class MalformedTaps(StageServer):
    """Taps that are valid frames, but one column wider than the model's hidden states."""

    async def send_tap(self, coordinator, tap):
        rows, hidden = tap.shape
        wider = bytes(rows * (hidden + 1) * wire.DTYPES[tap.dtype].itemsize)
        await coordinator.send(dataclasses.replace(tap, shape=(rows, hidden + 1), payload=wider))


class FramingTaps(StageServer):
    """Its successor gets the true output; the coordinator's copy carries one changed float, so
    that the successor's audit would see inputs its receipt did not sign."""

    async def send_tap(self, coordinator, tap):
        await coordinator.send(dataclasses.replace(tap, payload=bytes([tap.payload[0] ^ 0x01]) + tap.payload[1:]))


class WrongWidthGarbage(CheatingStage):
    """Claims a hidden size one too wide in HELLO, and computes garbage."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, cheat=Cheat("garbage"), **kwargs)

    def info(self) -> dict:
        return {**super().info(), "hidden_size": self.block.hidden_size + 1}


ATTACKS = {
    "no taps": {"rogue_server": SilentTaps},
    "malformed taps": {"rogue_server": MalformedTaps},
    "wrong hidden size": {"rogue_class": WrongWidthGarbage},
    "framing its successor": {"rogue_server": FramingTaps},
}


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


def _register(provider, make_joined_node, keys) -> list[Node]:
    nodes = [make_joined_node(provider, f"gpu-{i}", key=key).node for i, key in enumerate(keys)]
    Node.objects.filter(pk__in=[n.pk for n in nodes]).update(audit_fraction=1.0)
    return nodes


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_hostile_stage_is_struck_never_paid_and_its_neighbours_are_not_blamed(
    attack, control_plane, customer, provider, make_joined_node, monkeypatch, admin
):
    grant(customer, 5)
    api_key, _ = services.create_api_key(customer, "audits")
    keys = [generate_signing_key() for _ in SPANS]
    nodes = _register(provider, make_joined_node, keys)
    hostile = nodes[HOSTILE]
    params = RequestParams(max_tokens=8, temperature=0.0, prompt="Audits that hold against hostile nodes")

    async def scenario():
        jobs = []
        async with stage_servers(SPANS, rogue=HOSTILE, keys=keys, **ATTACKS[attack]) as route:
            for _ in range(MAX_JOBS):
                job = await sync_to_async(stage_fixtures.admit)(api_key, route, params, monkeypatch)
                jobs.append((job.pk, await runner.run_job(job.pk)))
                if await sync_to_async(Strike.objects.filter(node=hostile).exists)():
                    break
        return jobs

    jobs = asyncio.run(scenario())

    assert all(state == JobState.SUCCEEDED for _, state in jobs)  # the customer got the stream
    assert Strike.objects.filter(node=hostile).exists(), f"{attack}: not struck within {MAX_JOBS} jobs"
    assert Node.objects.get(pk=hostile.pk).under_review is True  # off routing while its strike is open
    honest = [node for node in nodes if node != hostile]
    assert not Strike.objects.filter(node__in=honest).exists()
    assert not Audit.objects.filter(node__in=honest, state=CheckState.FAILED).exists()
    # Whatever the hostile node was credited stays pending past every window, then is clawed back.
    release_earnings_in_good_standing(now=timezone.now() + timedelta(days=365))
    assert not Earning.objects.filter(node=hostile).exclude(state=EarningState.PENDING).exists()
    for strike in Strike.objects.filter(node=hostile):
        uphold_strike(strike, by=admin)
    assert set(Earning.objects.filter(node=hostile).values_list("state", flat=True)) <= {EarningState.CLAWED_BACK}
    # The honest neighbours were paid for every job.
    job_pks = [pk for pk, _ in jobs]
    for node in honest:
        earned = Earning.objects.filter(node=node, job_id__in=job_pks)
        assert earned.count() == len(jobs)
        assert set(earned.values_list("state", flat=True)) == {EarningState.AVAILABLE}
    assert Job.objects.filter(pk__in=job_pks, verified=True).count() == len(jobs)
    # The customer gets back the whole charge of every job a failed audit found bad, and only those.
    for job in Job.objects.filter(pk__in=job_pks):
        refunds = list(Transfer.objects.filter(job=job, kind="refund").values_list("amount", flat=True))
        bad = Audit.objects.filter(job=job, state=CheckState.FAILED).exists()
        assert refunds == ([job.charged_amount] if bad else []) and job.charged_amount > 0
    # The adversarial table's row (pytest -rP shows it).
    paid = Earning.objects.filter(node=hostile).exclude(state=EarningState.CLAWED_BACK).count()
    print(f"{attack}: struck after {len(jobs)} job(s), earnings kept {paid}, strikes on honest nodes 0")
