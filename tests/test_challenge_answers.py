"""Challenges on the control plane: opening one for a serving node, checking what the node's part of
the challenge's job was (its inputs and outputs, kept by the coordinator) against the trusted float32
recompute, failing late, wrong or malformed answers with a strike and its evidence, and failing a node
whose data plane is unreachable, refuses or stays silent. Honest and cheating agents answering over a
real data plane: ``test_adversarial_agents.py`` and ``test_challenge_jobs.py``."""

from __future__ import annotations

import asyncio
import re
import threading
from datetime import timedelta

import pytest
import torch
from django.utils import timezone
from websockets.asyncio.server import serve

from marketplace.nodes.tickets import TICKET_MARGIN_S, issuer_key, issuer_public_key
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.verification import challenges as challenge_checks
from marketplace.verification.errors import NotChallengeable
from marketplace.verification.models import Challenge, CheckState, Strike, StrikeKind, StrikeState
from marketplace.verification.verifier import FALLBACK_DTYPE, trusted_block
from tests.challenge_fixtures import block_outputs, material
from worker_agent.block import WorkItem
from worker_agent.kvcache import KVSession
from worker_agent.protocol import wire
from worker_agent.protocol.span import Span
from worker_agent.protocol.tickets import open_peer_pass, verify_ticket

pytest_plugins = ["tests.factories"]
pytestmark = [pytest.mark.trust, pytest.mark.django_db]

MODEL = "tiny-llama"


@pytest.fixture
def serving(settings, provider, make_joined_node):
    """A node serving layers 2:4 of tiny-llama (its assignment is ready)."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.SWARM_VERIFIER = "inline"
    joined = make_joined_node(provider, "gpu-1")
    Assignment.objects.create(
        node=joined.node,
        model=MODEL,
        generation=1,
        pipeline=0,
        position=1,
        layer_start=2,
        layer_end=4,
        state=AssignmentState.READY,
        ready_at=timezone.now(),
    )
    return joined.node


def answer(challenge: Challenge, outputs=None, **span):
    """The challenged node's material: honest float32 outputs unless ``outputs`` makes them."""
    where = {"layer_start": challenge.layer_start, "layer_end": challenge.layer_end, **span}
    return material(node=challenge.node.node_id, model=challenge.model, outputs=outputs, **where)


def test_challenge_is_sent_for_the_ready_span(serving, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        challenge = challenge_checks.send_challenge(serving, tokens=4, seed=1234)

    assert len(callbacks) == 2  # its session runs once this commits, and the provider's page is told

    assert challenge.span == Span(MODEL, 2, 4)
    assert (challenge.seed, challenge.tokens, challenge.state) == (1234, 4, CheckState.SENT)
    assert challenge.deadline_at > challenge.sent_at


def test_honest_answer_passes_with_per_token_metrics(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.open_challenge(serving, tokens=4, seed=7)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_output(challenge.pk, honest := answer(challenge), elapsed_ms=3.5)

    challenge.refresh_from_db()
    assert challenge.state == CheckState.PASSED
    assert len(challenge.metrics["cosine"]) == honest.tokens
    assert challenge.metrics["min_cosine"] >= 0.9999
    assert challenge.elapsed_ms == 3.5
    assert Strike.objects.count() == 0
    # Timed by the verifier over the node's share of the job's steps: a speed the node proved.
    serving.refresh_from_db()
    assert serving.verified_layer_tokens_per_s == pytest.approx(2 * honest.tokens / 0.0035)


def test_bfloat16_answer_passes_against_the_float32_verifier(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.open_challenge(serving, tokens=8, seed=99)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_output(
            challenge.pk, answer(challenge, block_outputs(MODEL, 2, 4, "bfloat16")), elapsed_ms=3.5
        )

    challenge.refresh_from_db()
    assert challenge.state == CheckState.PASSED
    assert Strike.objects.count() == 0


def test_wrong_answer_fails_and_opens_a_strike_with_evidence(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.open_challenge(serving, tokens=4, seed=5)
    skipped = answer(challenge, lambda inputs, steps: inputs)  # identity: skipped its layers
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_output(challenge.pk, skipped, elapsed_ms=3.5)

    challenge.refresh_from_db()
    assert challenge.state == CheckState.FAILED
    assert challenge.reason.startswith("output disagrees with the trusted recompute: cosine ")
    strike = Strike.objects.get()
    assert (strike.node_id, strike.kind, strike.state, strike.challenge_id) == (
        serving.pk,
        StrikeKind.CHALLENGE,
        StrikeState.OPEN,
        challenge.pk,
    )
    assert strike.evidence["seed"] == "5"
    assert strike.evidence["cosine"] == challenge.metrics["cosine"]
    assert strike.evidence["min_cosine"] < 0.99


def test_material_of_another_span_fails(serving):
    challenge = challenge_checks.open_challenge(serving, tokens=4, seed=5)
    challenge_checks.record_challenge_output(
        challenge.pk, answer(challenge, layer_start=0, layer_end=2), elapsed_ms=3.5
    )

    challenge.refresh_from_db()
    assert challenge.state == CheckState.FAILED
    node = serving.node_id
    assert challenge.reason == (
        f"malformed answer: the material is of ('{node}', '{MODEL}', 0, 2), not ('{node}', '{MODEL}', 2, 4)"
    )
    assert Strike.objects.filter(challenge=challenge).count() == 1


def test_no_answer_by_the_deadline_expires_and_strikes(serving):
    challenge = challenge_checks.open_challenge(serving, tokens=4, seed=5)

    assert challenge_checks.expire_challenges(challenge.deadline_at - timedelta(seconds=1)) == []
    assert challenge_checks.expire_challenges(challenge.deadline_at + timedelta(seconds=1)) == [challenge.pk]

    challenge.refresh_from_db()
    assert challenge.state == CheckState.EXPIRED
    assert challenge.reason == "no answer within the deadline"
    assert Strike.objects.get().evidence["state"] == CheckState.EXPIRED


def test_late_answer_counts_as_expired(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.open_challenge(serving, tokens=4, seed=5)
    Challenge.objects.filter(pk=challenge.pk).update(deadline_at=timezone.now() - timedelta(seconds=1))
    challenge_checks.record_challenge_output(challenge.pk, answer(challenge), elapsed_ms=3.5)

    challenge.refresh_from_db()
    assert (challenge.state, challenge.reason) == (CheckState.EXPIRED, "answered after the deadline")
    assert Strike.objects.count() == 1


def test_a_decided_challenge_takes_no_second_outcome(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.open_challenge(serving, tokens=4, seed=5)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_output(challenge.pk, answer(challenge), elapsed_ms=3.5)
    before = list(Challenge.objects.values())

    zeros = answer(challenge, lambda inputs, steps: torch.zeros_like(inputs))
    challenge_checks.record_challenge_output(challenge.pk, zeros, elapsed_ms=1.0)
    challenge_checks.fail_challenge(challenge.pk, "too late to matter")

    assert list(Challenge.objects.values()) == before
    assert Strike.objects.count() == 0


def test_node_without_a_ready_block_is_not_challenged(provider, make_joined_node):
    node = make_joined_node(provider, "idle").node

    with pytest.raises(NotChallengeable):
        challenge_checks.send_challenge(node)
    assert Challenge.objects.count() == 0


@pytest.fixture
def serving_smollm2(settings, provider, make_joined_node):
    """A node serving layers 20:30 of smollm2-135m."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.SWARM_VERIFIER = "inline"
    node = make_joined_node(provider, "gpu-s").node
    Assignment.objects.create(
        node=node, model="smollm2-135m", generation=1, pipeline=0, position=2, layer_start=20, layer_end=30,
        state=AssignmentState.READY, ready_at=timezone.now(),
    )  # fmt: skip
    return node


def rounded_past_the_threshold(inputs: torch.Tensor, steps) -> torch.Tensor:
    """An answer as an honest bfloat16 node gives it when rounding pushes one token's norm just past
    the float32 threshold: the verifier's own bfloat16 rows, with the token where bfloat16 and float32
    disagree most in norm rescaled to sit just beyond 0.05 from float32, on bfloat16's side of it.

    Built from both references in this process, so it holds on any machine and thread count."""
    reference = verifier_rows(inputs, steps, "float32").double()
    bf16 = verifier_rows(inputs, steps, FALLBACK_DTYPE).double()
    ratio = bf16.norm(dim=1) / reference.norm(dim=1)  # (tokens,)
    token = int((ratio - 1).abs().argmax())
    q = float(ratio[token])
    # q > 1: aim at (1.05 + (q - 1) / 2) x ‖float32‖, over 0.05 from float32 and under 0.05 from
    # bfloat16; q < 1 mirrors it below.
    target = 1.05 + (q - 1) / 2 if q > 1 else 0.95 - (1 - q) / 2
    rows = bf16.clone()  # (tokens, hidden)
    rows[token] *= target / q
    return rows.float()


def verifier_rows(inputs: torch.Tensor, steps, dtype: str) -> torch.Tensor:
    """The verifier's own block of layers 20:30 in ``dtype`` on the inputs, in one pass as it
    recomputes contiguous steps: (tokens, hidden) float32."""
    block = trusted_block(Span("smollm2-135m", 20, 30), dtype)
    (rows,) = block.forward([WorkItem(KVSession("verifier", "s0"), 0, inputs)])
    return rows.to(torch.float32)


def test_honest_bfloat16_rounding_past_a_threshold_passes_against_the_bfloat16_reference(
    serving_smollm2, django_capture_on_commit_callbacks
):
    challenge = challenge_checks.open_challenge(serving_smollm2, tokens=8, seed=1589)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_output(
            challenge.pk, answer(challenge, rounded_past_the_threshold), elapsed_ms=3.5
        )

    challenge.refresh_from_db()
    assert (challenge.state, challenge.metrics["reference"]) == (CheckState.PASSED, "bfloat16")
    assert max(challenge.metrics["rel_norm"]) < 0.05
    assert Strike.objects.count() == 0


def test_a_wrong_answer_fails_against_both_references(serving_smollm2, django_capture_on_commit_callbacks):
    challenge = challenge_checks.open_challenge(serving_smollm2, tokens=8, seed=1589)
    skipped = answer(challenge, lambda inputs, steps: inputs)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_output(challenge.pk, skipped, elapsed_ms=3.5)

    challenge.refresh_from_db()
    assert (challenge.state, challenge.metrics["reference"]) == (CheckState.FAILED, "float32")
    assert Strike.objects.filter(challenge=challenge).count() == 1


class FakeDataPlane:
    """A data-plane port that answers every frame with ``reply`` (None: never answers)."""

    def __init__(self, reply: wire.Message | None) -> None:
        self.reply = reply
        self.loop = asyncio.new_event_loop()
        self.hellos: list[wire.Hello] = []
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(self._start())
        self.url = f"ws://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    async def _start(self):
        return await serve(self._handle, "127.0.0.1", 0)

    async def _handle(self, ws) -> None:
        async for data in ws:
            message = wire.decode(data).message
            if isinstance(message, wire.Hello):
                self.hellos.append(message)
            if self.reply is not None:
                await ws.send(wire.encode(self.reply, 1))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def data_plane(serving, settings, tmp_path):
    """Points the serving node's ready assignment at a fake data plane answering with ``reply``."""
    settings.SWARM_TICKET_KEY_PATH = tmp_path / "ticket.key"
    issuer_key.cache_clear()
    started = []

    def make(reply: wire.Message | None) -> FakeDataPlane:
        fake = FakeDataPlane(reply)
        started.append(fake)
        Assignment.objects.filter(node=serving).update(data_url=fake.url)
        return fake

    yield make
    for fake in started:
        fake.stop()
    issuer_key.cache_clear()


def test_unreachable_data_plane_fails_the_challenge(serving, settings, tmp_path):
    settings.SWARM_TICKET_KEY_PATH = tmp_path / "ticket.key"
    issuer_key.cache_clear()
    Assignment.objects.filter(node=serving).update(data_url="ws://127.0.0.1:9")
    challenge = challenge_checks.open_challenge(serving, tokens=4, seed=5)

    challenge = challenge_checks.run_challenge(challenge.pk)

    assert challenge.state == CheckState.FAILED
    # Stage 1 of the challenge's job: the verifier's stand-in serves layers 0:2 before it.
    assert challenge.reason.startswith("the challenged stage failed: stage 1 (ws://127.0.0.1:9) cannot be reached")
    assert challenge.reason.endswith("(stage_unreachable)")
    strike = Strike.objects.get()
    assert (strike.node_id, strike.kind, strike.challenge_id) == (serving.pk, StrikeKind.CHALLENGE, challenge.pk)
    issuer_key.cache_clear()


def test_refused_hello_fails_the_challenge_and_the_hello_looks_like_a_job(serving, data_plane, settings):
    fake = data_plane(wire.Error(code="ticket_invalid", message="no such job", fatal=True))
    challenge = challenge_checks.open_challenge(serving, tokens=4, seed=5)

    challenge = challenge_checks.run_challenge(challenge.pk)

    assert challenge.state == CheckState.FAILED
    assert challenge.reason.endswith("refused HELLO: no such job (ticket_invalid)")
    assert Strike.objects.filter(node=serving, challenge=challenge).count() == 1
    # What the node saw: a job's coordinator HELLO, in ring topology with a successor to forward to
    # (the verifier's stand-in for layers 4:6) and its peer pass, for a chat completion's job id, with
    # a signed ticket that expires with a job's deadline.
    (hello,) = fake.hellos
    assert (hello.role, hello.topology) == ("coordinator", "ring")
    assert re.fullmatch(r"ws://127\.0\.0\.1:[0-9]+", hello.next_url)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", hello.job)
    ticket = verify_ticket(hello.ticket, [issuer_public_key()], node=serving.node_id, span=Span(MODEL, 2, 4))
    assert (ticket.job, ticket.issuer_key) == (hello.job, issuer_public_key())
    lifetime = ticket.expires_at - challenge.sent_at.timestamp()
    assert settings.SWARM_JOB_TIMEOUT_S < lifetime < settings.SWARM_JOB_TIMEOUT_S + TICKET_MARGIN_S + 60
    successor = open_peer_pass(hello.next_ticket)
    assert (successor.job, successor.layer_start, successor.layer_end) == (hello.job, 4, 6)
    assert successor.node == challenge_checks.stand_in_node(Span(MODEL, 4, 6))


def test_silent_data_plane_fails_the_challenge_at_its_deadline(serving, data_plane, settings):
    settings.SWARM_CHALLENGE_DEADLINE_S = 1.0
    data_plane(None)
    challenge = challenge_checks.open_challenge(serving, tokens=4, seed=5)

    challenge = challenge_checks.run_challenge(challenge.pk)

    assert (challenge.state, challenge.reason) == (
        CheckState.EXPIRED,
        "no answer within the deadline: the job did not end by the challenge's deadline (challenge_deadline)",
    )
    assert Strike.objects.filter(node=serving, challenge=challenge).count() == 1
