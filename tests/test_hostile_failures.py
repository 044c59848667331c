"""Stalls, drops and blame-shifting on the data plane: every failure lands on the node that caused it.

Three stages of tiny-llama run as in-process StageServers speaking the real wire protocol, one of
them hostile; jobs go through the control plane's runner. Each attack must be attributed to the
attacker alone (counted, backed off, struck past the threshold), and its honest neighbours must get
no failure, no suspicion and no strike:

- a predecessor opens a second peer connection to its successor and sends an OPEN on it, or sends
  one on its own peer connection: refused to it alone, and the job completes;
- a predecessor taps its outputs but withholds them from its successor: the coordinator relays
  them itself, and the job completes with nobody blamed;
- a predecessor claims its successor is unreachable: the coordinator asks the successor itself;
- a stage accepts its sessions and swallows every FORWARD: it is relayed its input by the
  coordinator, then blamed, counted and struck;
- a stage drops before its receipt (its connection, or its session): it is the job's culprit.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connection
from django.utils import timezone
from websockets.asyncio.client import connect

from marketplace.billing.services import grant
from marketplace.flows import runner
from marketplace.jobs import services
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.nodes.models import Node
from marketplace.payouts.models import Earning, EarningState
from marketplace.verification.models import Strike, StrikeKind
from marketplace.verification.strikes import release_earnings_in_good_standing, uphold_strike
from tests import stage_fixtures
from tests.forged import another_signature
from tests.stage_fixtures import stage_servers
from worker_agent.errors import SessionError
from worker_agent.protocol import wire
from worker_agent.protocol.connection import CloseSessions, Dispatch, Role
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.protocol.links import PEER_CONTEXT, peer_proof
from worker_agent.server import StageServer
from worker_agent.stage import Stage

pytestmark = [pytest.mark.trust, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.factories"]

SPANS = [(0, 2), (2, 4), (4, 6)]
PRICES = (5_000_000_000, 9_000_000_000)  # nano-dollars per million tokens: $5 and $9
BACKOFF_S = 60.0
HEARTBEAT_S = 0.5  # the simulated agents' heartbeat interval (``Heartbeats``)
PARAMS = RequestParams(max_tokens=6, temperature=0.0, prompt="Failures land on whoever caused them")


@pytest.fixture
def control_plane(settings, tmp_path):
    with stage_fixtures.in_memory_control_plane(
        settings,
        tmp_path,
        SWARM_JOB_TIMEOUT_S=60.0,
        SWARM_DEFAULT_PRICES=PRICES,
        SWARM_AUDIT_NEW_NODE_FRACTION=0.0,  # no audits: these attacks are about failures
        SWARM_VERIFIER="inline",
        SWARM_STALL_TIMEOUT_S=2.0,  # short, yet long for tiny-llama on a busy machine
        SWARM_HEAL_WAIT_S=0.0,
        SWARM_FAILURE_BACKOFF_S=BACKOFF_S,
        SWARM_FAILURE_BACKOFF_MAX_S=3600.0,
        SWARM_FAILURE_WINDOW_S=3600.0,
        SWARM_FAILURES_BEFORE_STRIKE=1,
        SWARM_FAILURE_INCIDENT_S=0.0,  # these jobs run one after another: each failure is its own
        SWARM_HEARTBEAT_INTERVAL_S=HEARTBEAT_S,
    ) as plane:
        yield plane


class Heartbeats:
    """The agents' control channels, as the control plane sees them: each live node's heartbeat lands
    every HEARTBEAT_S (a thread writes it, as the channel's consumer would); a node taken out of
    ``live`` stops heartbeating, as a crashed or frozen agent does."""

    def __init__(self, nodes: list[Node]) -> None:
        self.live = {node.pk for node in nodes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        try:
            while not self._stop.wait(HEARTBEAT_S / 4):
                Node.objects.filter(pk__in=list(self.live)).update(last_heartbeat_at=timezone.now())
        finally:
            connection.close()

    def __enter__(self) -> Heartbeats:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def nodes_and_keys(control_plane, customer, provider, make_joined_node):
    keys = [generate_signing_key() for _ in SPANS]
    nodes = [make_joined_node(provider, f"gpu-{i}", key=key).node for i, key in enumerate(keys)]
    # Their agents' control channels opened before any job: alive through it while they heartbeat.
    Node.objects.filter(pk__in=[n.pk for n in nodes]).update(connected_since=timezone.now() - timedelta(hours=1))
    grant(customer, 5)
    api_key, _ = services.create_api_key(customer, "failures")
    return nodes, keys, api_key


@pytest.fixture
def heartbeats(nodes_and_keys):
    with Heartbeats(nodes_and_keys[0]) as beating:
        yield beating


def run_jobs(api_key, keys, monkeypatch, count: int, **rogue) -> list[Job]:
    async def scenario():
        pks = []
        async with stage_servers(SPANS, keys=keys, **rogue) as route:
            for _ in range(count):
                job = await sync_to_async(stage_fixtures.admit)(api_key, route, PARAMS, monkeypatch)
                await runner.run_job(job.pk)
                pks.append(job.pk)
        return pks

    return [Job.objects.get(pk=pk) for pk in asyncio.run(scenario())]


def failures(node: Node) -> tuple[int, int]:
    node = Node.objects.get(pk=node.pk)
    return node.recent_failures, node.failures_total


def assert_untouched(nodes: list[Node]) -> None:
    for node in nodes:
        fresh = Node.objects.get(pk=node.pk)
        assert (fresh.recent_failures, fresh.failures_total, fresh.routing_backoff_until) == (0, 0, None)
        assert (fresh.suspected_at, fresh.under_review) == (None, False)
    assert not Strike.objects.filter(node__in=nodes).exists()


class SecondPeerOpens(StageServer):
    """Once its own peer connection to its successor is up, opens a second one with its pass (under
    ``proof``: none, its own proof again, or another signature of the pass that it made itself) and
    sends an OPEN on it: the attack that had the successor blamed."""

    proof = "none"
    answers: list = []

    async def _send_on(self, slot, job, output):
        route = slot.jobs.get(job)
        if route is not None and route.peer is not None and not SecondPeerOpens.answers:
            SecondPeerOpens.answers = await self._second_connection(job, route)
            if SecondPeerOpens.proof == "same":  # the successor took the new one for a reconnect
                await asyncio.wait_for(route.peer.ws.wait_closed(), 10)
        await super()._send_on(slot, job, output)

    @staticmethod
    async def _second_connection(job, route) -> list:
        message = PEER_CONTEXT + hashlib.sha256(route.next_ticket).digest()
        proof = {
            "none": None,
            "same": peer_proof(route.signing_key, route.next_ticket),
            "another": another_signature(route.signing_key, message),
        }[SecondPeerOpens.proof]
        hello = wire.Hello(job=job, role="peer", ticket=route.next_ticket, topology="ring", proof=proof)
        async with connect(route.next_url, compression=None) as ws:
            await ws.send(wire.encode(hello, 1))
            answers = [wire.decode(await asyncio.wait_for(ws.recv(), 10)).message]
            try:
                await ws.send(wire.encode(wire.Open(job, ("stolen",)), 2))
                answers.append(wire.decode(await asyncio.wait_for(ws.recv(), 10)).message)
            except Exception as exc:  # the refused HELLO closed it: the OPEN never got in
                answers.append(type(exc).__name__)
        return answers


class PeerOpens(StageServer):
    """Sends an OPEN on its own peer connection to its successor, once, mid-job."""

    sent = False

    async def _send_on(self, slot, job, output):
        route = slot.jobs.get(job)
        if route is not None and route.peer is not None and not PeerOpens.sent:
            PeerOpens.sent = True
            await route.peer.send(wire.Open(job, ("stolen",)))
        await super()._send_on(slot, job, output)


@pytest.mark.parametrize("attacker", ["unproven second connection", "own connection"])
def test_a_predecessors_open_on_a_peer_connection_is_refused_and_nobody_is_blamed(
    attacker, nodes_and_keys, monkeypatch
):
    nodes, keys, api_key = nodes_and_keys
    SecondPeerOpens.answers, SecondPeerOpens.proof, PeerOpens.sent = [], "none", False
    server = SecondPeerOpens if attacker == "unproven second connection" else PeerOpens

    [job] = run_jobs(api_key, keys, monkeypatch, 1, rogue=0, rogue_server=server)

    assert (job.state, job.verified, job.heals, job.error_code) == (JobState.SUCCEEDED, True, [], "")
    assert job.completion_tokens == PARAMS.max_tokens
    assert_untouched(nodes)  # the successor is not blamed, and the attacker's refused frame costs nobody a job
    if server is SecondPeerOpens:
        hello, after = SecondPeerOpens.answers
        assert (type(hello), hello.code, hello.fatal) == (wire.Error, "peer_unproven", True)
        assert after == "ConnectionClosedOK"
    else:
        assert PeerOpens.sent


def test_a_second_peer_connection_under_another_signature_is_the_senders_strike_and_unpaid(
    nodes_and_keys, heartbeats, monkeypatch
):
    nodes, keys, api_key = nodes_and_keys
    attacker = nodes[0]
    SecondPeerOpens.answers, SecondPeerOpens.proof = [], "another"

    [job] = run_jobs(api_key, keys, monkeypatch, 1, rogue=0, rogue_server=SecondPeerOpens)

    # The successor refused it and handed the coordinator both signatures; the job went on, verified.
    hello, after = SecondPeerOpens.answers
    assert (type(hello), hello.code, hello.fatal) == (wire.Error, "peer_twice", True)
    assert after == "ConnectionClosedOK"
    assert (job.state, job.verified, job.heals, job.error_code) == (JobState.SUCCEEDED, True, [], "")
    [strike] = Strike.objects.filter(node=attacker)
    assert (strike.kind, strike.job_id, strike.evidence["kind"]) == (StrikeKind.PROTOCOL, job.pk, "peer_twice")
    assert len(bytes.fromhex(strike.evidence["signatures"])) == 128  # both of its signatures over the pass
    assert Node.objects.get(pk=attacker.pk).under_review
    assert_untouched(nodes[1:])
    # Paid for nothing: its pending pay is withheld while the strike is open and clawed back when upheld.
    release_earnings_in_good_standing(now=timezone.now() + timedelta(days=365))
    states = dict(Earning.objects.filter(job=job).values_list("node_id", "state"))
    assert states == {
        attacker.pk: EarningState.PENDING,
        nodes[1].pk: EarningState.AVAILABLE,
        nodes[2].pk: EarningState.AVAILABLE,
    }
    uphold_strike(strike)
    assert Earning.objects.get(job=job, node=attacker).state == EarningState.CLAWED_BACK


def test_a_second_peer_connection_under_its_own_proof_replaces_the_first_and_its_loss_is_the_senders(
    nodes_and_keys, heartbeats, monkeypatch
):
    nodes, keys, api_key = nodes_and_keys
    attacker = nodes[0]
    SecondPeerOpens.answers, SecondPeerOpens.proof = [], "same"

    [job] = run_jobs(api_key, keys, monkeypatch, 1, rogue=0, rogue_server=SecondPeerOpens)

    # A reconnect, as far as anyone can tell: the new connection replaced the first, whose later
    # outputs then could not reach the successor; the coordinator asked the successor, which
    # answered, so the failure is the sender's.
    hello, opened = SecondPeerOpens.answers
    assert (type(hello), hello.role) == (wire.Hello, "stage")
    assert (type(opened), opened.code) == (wire.Error, "not_allowed")
    assert (job.state, job.error_code, job.charged_amount) == (JobState.FAILED, "next_unconfirmed", 0)
    assert failures(attacker) == (1, 1)
    assert Node.objects.get(pk=attacker.pk).recent_deliberate == 1  # alive through it: the next one is a strike
    assert not Strike.objects.exists()
    assert_untouched(nodes[1:])


class Withholds(StageServer):
    """Taps every output to the coordinator, signed as ever, but never forwards it to its successor:
    the successor then puts out nothing, and used to be blamed for the stall."""

    async def _send_on(self, slot, job, output):
        route = slot.jobs.get(job)
        if route is None or not route.next_url:
            await super()._send_on(slot, job, output)
            return
        tap = wire.Result(job=job, items=output.items, dtype=output.dtype, shape=output.shape, payload=output.payload)
        await self.send_tap(route.coordinator, tap)


def test_a_predecessor_withholding_its_outputs_cannot_frame_its_successor(nodes_and_keys, monkeypatch):
    nodes, keys, api_key = nodes_and_keys

    [job] = run_jobs(api_key, keys, monkeypatch, 1, rogue=0, rogue_server=Withholds)

    # The coordinator handed the successor each tapped output itself: the job went through.
    assert (job.state, job.heals, job.error_code) == (JobState.SUCCEEDED, [], "")
    assert job.completion_tokens == PARAMS.max_tokens
    assert_untouched(nodes[1:])


class ClaimsUnreachable(StageServer):
    """Says it cannot reach its successor, which is alive and well, and passes nothing on."""

    async def _send_on(self, slot, job, output):
        route = slot.jobs.get(job)
        if route is None or not route.next_url:
            await super()._send_on(slot, job, output)
            return
        await self._error(route.coordinator, wire.Error("next_unreachable", "cannot reach the next stage", job=job))


def test_a_false_claim_that_the_successor_is_unreachable_is_checked_and_falls_on_the_claimant(
    nodes_and_keys, monkeypatch
):
    nodes, keys, api_key = nodes_and_keys

    [job] = run_jobs(api_key, keys, monkeypatch, 1, rogue=0, rogue_server=ClaimsUnreachable)

    assert (job.state, job.error_code) == (JobState.FAILED, "next_unconfirmed")
    assert "but it answers the coordinator" in job.error_message
    assert failures(nodes[0]) == (1, 1)
    assert Node.objects.get(pk=nodes[0].pk).suspicion.startswith("next_unconfirmed: stage 0 says it cannot reach")
    assert_untouched(nodes[1:])


class Swallows(StageServer):
    """Accepts its sessions, then swallows every FORWARD, whoever sends it; records who did."""

    fed_by: list[Role] = []

    async def _serve(self, conn, action):
        if isinstance(action, Dispatch):
            Swallows.fed_by.append(conn.role)
            return
        await super()._serve(conn, action)


def test_a_stage_that_swallows_its_inputs_is_relayed_them_then_blamed_backed_off_and_struck(
    nodes_and_keys, heartbeats, monkeypatch
):
    nodes, keys, api_key = nodes_and_keys
    staller = nodes[1]
    Swallows.fed_by = []

    first, second = run_jobs(api_key, keys, monkeypatch, 2, rogue=1, rogue_server=Swallows)

    for job in (first, second):
        assert (job.state, job.error_code, job.completion_tokens) == (JobState.FAILED, "stage_stalled", 0)
        assert job.charged_amount == 0 and not Earning.objects.filter(job=job).exists()
        assert f"stage 1 (node {staller.node_id}) made no progress" in job.error_message
    # Each job's prefill came from its predecessor, then from the coordinator itself: swallowed both times.
    assert Swallows.fed_by == [Role.PEER, Role.COORDINATOR] * 2
    staller = Node.objects.get(pk=staller.pk)
    assert (staller.recent_failures, staller.failures_total) == (2, 2)
    assert staller.routing_backoff_until >= staller.failures_since + timedelta(seconds=2 * BACKOFF_S)
    # More than SWARM_FAILURES_BEFORE_STRIKE (1) in the window: one strike, on the second job.
    [strike] = Strike.objects.filter(node=staller)
    assert (strike.kind, strike.job_id, strike.evidence["failures"]) == (StrikeKind.FAILURES, second.pk, 2)
    assert_untouched([nodes[0], nodes[2]])


class DropsAtClose(StageServer):
    """Serves every step, then its connection drops when the coordinator asks for its receipt."""

    async def _serve(self, conn, action):
        if isinstance(action, CloseSessions):
            conn.ws.transport.abort()
            return
        await super()._serve(conn, action)


class ForgetsItsSession(Stage):
    """Serves every step, then answers the CLOSE as if it never had the session."""

    def close(self, job, sessions, keep=()):
        raise SessionError(f"unknown session {sessions[0]!r}", code="unknown_session")


@pytest.mark.parametrize(
    "rogue",
    [{"rogue_server": DropsAtClose}, {"rogue_class": ForgetsItsSession}],
    ids=["connection dropped", "session gone"],
)
def test_a_stage_that_drops_before_its_receipt_is_the_jobs_culprit(rogue, nodes_and_keys, heartbeats, monkeypatch):
    nodes, keys, api_key = nodes_and_keys
    dropper = nodes[1]

    [job] = run_jobs(api_key, keys, monkeypatch, 1, rogue=1, **rogue)

    assert (job.state, job.verified, job.completion_tokens) == (JobState.SUCCEEDED, False, PARAMS.max_tokens)
    assert "lost before it sent its receipt" in job.verification_error
    # The customer pays nothing for unverified work; the neighbours' receipts still prove their part,
    # and the platform pays them for it; the dropper gets nothing.
    assert job.charged_amount == 0
    assert sorted(Earning.objects.filter(job=job).values_list("node_id", flat=True)) == [nodes[0].pk, nodes[2].pk]
    assert all(e.amount > 0 for e in Earning.objects.filter(job=job))
    [strike] = Strike.objects.filter(node=dropper)
    assert (strike.kind, strike.job_id) == (StrikeKind.RECEIPT, job.pk)
    assert failures(dropper) == (1, 1)
    assert Node.objects.get(pk=dropper.pk).last_failure == job.verification_error[:255]
    assert_untouched([nodes[0], nodes[2]])


def test_a_stage_that_crashed_before_its_receipt_is_counted_and_unpaid_but_not_struck(
    nodes_and_keys, heartbeats, monkeypatch
):
    # Churn: its agent's heartbeats stop with the connection (a crash), so nothing shows a choice.
    nodes, keys, api_key = nodes_and_keys
    crashed = nodes[1]
    heartbeats.live.discard(crashed.pk)

    [job] = run_jobs(api_key, keys, monkeypatch, 1, rogue=1, rogue_server=DropsAtClose)

    assert (job.state, job.verified, job.charged_amount) == (JobState.SUCCEEDED, False, 0)
    assert sorted(Earning.objects.filter(job=job).values_list("node_id", flat=True)) == [nodes[0].pk, nodes[2].pk]
    assert failures(crashed) == (1, 1)
    assert Node.objects.get(pk=crashed.pk).recent_deliberate == 0
    assert not Strike.objects.exists()
    assert_untouched([nodes[0], nodes[2]])


def test_when_no_stage_answers_for_its_receipt_no_stage_is_blamed(nodes_and_keys, monkeypatch):
    nodes, keys, api_key = nodes_and_keys

    [job] = run_jobs(api_key, keys, monkeypatch, 1, server_class=DropsAtClose)

    # Every stage lost at once is the coordinator's own link more likely than three nodes' fault.
    assert (job.state, job.verified, job.completion_tokens) == (JobState.SUCCEEDED, False, PARAMS.max_tokens)
    assert job.verification_error.startswith("no stage answered CLOSE: ")
    assert job.verification_error.endswith("(lost before it sent its receipt; close_unanswered)")
    assert_untouched(nodes)
