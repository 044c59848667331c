"""Challenges are jobs: a node that cheats only where it could tell a job from a check is caught.

Three stages of tiny-llama run as in-process StageServers speaking the real wire protocol, placed as
one pipeline (layers 0:2, 2:4, 4:6). The middle node cheats, but only in the sessions of ring jobs,
or only in those where it has a ring successor: exactly the sessions the challenges of old (one-stage
star sessions with nothing after the node) never were. Customers' jobs run through it (no live
audits here: the challenges are the only check), then the control plane challenges it, as
``send_due_challenges`` would, until it is struck: within 50 checks it must be struck and its pay for
the jobs clawed back, while its honest neighbours, challenged as often, are never struck and keep
their pay. (Challenges are opened and run here one by one; ``send_challenge`` would run each in a
thread of its own.) What each challenge showed the node is checked too: a ring job's HELLO with a successor,
and FORWARDs from a ring predecessor.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from marketplace.billing.services import grant
from marketplace.flows import runner
from marketplace.jobs import services
from marketplace.jobs.models import JobState
from marketplace.jobs.params import RequestParams
from marketplace.nodes.tickets import issuer_key
from marketplace.payouts.models import Earning, EarningState
from marketplace.verification import challenges as challenge_checks
from marketplace.verification.models import Challenge, CheckState, Strike
from marketplace.verification.strikes import release_earnings_in_good_standing, uphold_strike
from tests import stage_fixtures
from tests.stage_fixtures import stage_servers
from worker_agent.dev.cheat import Cheat, CheatingServer, CheatingStage
from worker_agent.protocol.connection import AcceptHello, Dispatch
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.stage import Stage

pytestmark = [pytest.mark.trust, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.factories"]

SPANS = [(0, 2), (2, 4), (4, 6)]
CHEATER = 1
JOBS = 3
MAX_CHECKS = 50
PRICES = (5_000, 9_000)


def cheating_stage(mode: str) -> type[Stage]:
    class Cheating(CheatingStage):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, cheat=Cheat(mode), **kwargs)

    return Cheating


class Watching(CheatingServer):
    """The cheater's server (which shows its cheat each job's route), noting what each job showed it:
    (topology, next_url set, FORWARD roles)."""

    seen: dict[str, list] = {}

    async def _act(self, conn, action) -> bool:
        match action:
            case AcceptHello() if action.binding.role == "coordinator":
                Watching.seen[action.hello.job] = [action.hello.topology, bool(action.hello.next_url), set()]
            case Dispatch() if action.forward.job in Watching.seen:
                Watching.seen[action.forward.job][2].add(str(conn.role))
        return await super()._act(conn, action)


@pytest.fixture
def control_plane(settings, tmp_path):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.SWARM_TICKET_KEY_PATH = tmp_path / "ticket.key"
    settings.SWARM_JOB_TIMEOUT_S = 120.0
    settings.SWARM_DEFAULT_PRICES = PRICES
    settings.SWARM_AUDIT_NEW_NODE_FRACTION = 0.0  # no live audits: only the challenges check
    settings.SWARM_AUDIT_MIN_FRACTION = 0.0
    settings.SWARM_VERIFIER = "inline"
    issuer_key.cache_clear()
    Watching.seen = {}
    yield settings
    issuer_key.cache_clear()


@pytest.mark.parametrize("mode", ["ring-only", "with-successor"])
def test_a_node_that_cheats_only_where_old_challenges_never_looked_is_caught_and_unpaid(
    mode, control_plane, customer, provider, make_joined_node, monkeypatch, admin
):
    grant(customer, 5)
    api_key, _ = services.create_api_key(customer, "checks")
    keys = [generate_signing_key() for _ in SPANS]
    nodes = [make_joined_node(provider, f"gpu-{i}", key=key).node for i, key in enumerate(keys)]
    cheater = nodes[CHEATER]
    params = RequestParams(max_tokens=6, temperature=0.0, prompt="Checks that look like work")

    async def scenario() -> tuple[list[tuple[int, str]], list[Challenge]]:
        jobs, checks = [], []
        async with stage_servers(
            SPANS, rogue=CHEATER, keys=keys, rogue_class=cheating_stage(mode), rogue_server=Watching
        ) as route:
            await sync_to_async(stage_fixtures.place_route)(nodes, route)
            for _ in range(JOBS):
                job = await sync_to_async(stage_fixtures.admit)(api_key, route, params, monkeypatch)
                jobs.append((job.pk, await runner.run_job(job.pk)))
            for _ in range(MAX_CHECKS):
                for node in nodes:  # every node of the pipeline is challenged alike
                    challenge = await sync_to_async(challenge_checks.open_challenge)(node)
                    checks.append(await sync_to_async(_decided)(challenge.pk))
                if await sync_to_async(Strike.objects.filter(node=cheater).exists)():
                    break
        return jobs, checks

    jobs, checks = asyncio.run(scenario())

    assert all(state == JobState.SUCCEEDED for _, state in jobs)  # the customers got their streams
    cheater_checks = [check for check in checks if check.node_id == cheater.pk]
    assert Strike.objects.filter(node=cheater).exists(), f"{mode}: not struck within {MAX_CHECKS} checks"
    assert len(cheater_checks) <= MAX_CHECKS
    assert cheater_checks[-1].state == CheckState.FAILED
    assert cheater_checks[-1].reason.startswith("output disagrees with the trusted recompute: cosine ")
    honest = [node for node in nodes if node != cheater]
    assert not Strike.objects.filter(node__in=honest).exists()
    assert {check.state for check in checks if check.node_id != cheater.pk} == {CheckState.PASSED}
    # What the challenges showed the cheater: ring jobs with a successor, fed by a ring predecessor.
    challenge_jobs = set(Watching.seen) - {job.public_id for job in map(_job, jobs)}
    assert challenge_jobs
    shown = {
        (topology, successor, frozenset(roles)) for topology, successor, roles in map(Watching.seen.get, challenge_jobs)
    }
    assert shown == {("ring", True, frozenset({"peer"}))}
    # Its pay for the customers' jobs stays pending past every window, then is clawed back.
    release_earnings_in_good_standing(now=timezone.now() + timedelta(days=365))
    assert Earning.objects.filter(node=cheater).count() == JOBS
    assert not Earning.objects.filter(node=cheater).exclude(state=EarningState.PENDING).exists()
    for strike in Strike.objects.filter(node=cheater):
        uphold_strike(strike, by=admin)
    assert set(Earning.objects.filter(node=cheater).values_list("state", flat=True)) == {EarningState.CLAWED_BACK}
    for node in honest:
        earned = Earning.objects.filter(node=node)
        assert earned.count() == JOBS
        assert set(earned.values_list("state", flat=True)) == {EarningState.AVAILABLE}
    print(f"{mode}: struck after {len(cheater_checks)} check(s) of its own; honest nodes 0 strikes")


def _decided(challenge_pk: int) -> Challenge:
    """Run the challenge (as the thread ``send_challenge`` starts would, here in this test's worker
    thread) and return it decided: the verifier runs inline once its answer is stored."""
    challenge_checks.run_challenge(challenge_pk)
    return Challenge.objects.get(pk=challenge_pk)


def _job(entry: tuple[int, str]):
    from marketplace.jobs.models import Job

    return Job.objects.get(pk=entry[0])
