"""Challenges on the control plane: sending one to a serving node, checking its answer against the
trusted float32 recompute, failing late, refused or wrong answers with a strike and its evidence,
and refusing answers that are not this node's to give (nothing changes)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from django.utils import timezone

from marketplace.placement.models import Assignment, AssignmentState
from marketplace.verification import challenges as challenge_checks
from marketplace.verification.errors import InvalidAnswer, NotChallengeable
from marketplace.verification.models import Challenge, CheckState, Strike, StrikeKind, StrikeState
from marketplace.verification.verifier import FALLBACK_DTYPE, trusted_block
from worker_agent import challenge as challenges
from worker_agent import model as models
from worker_agent.block import Block

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


def answer(challenge: Challenge, output: torch.Tensor) -> dict:
    return {
        "type": "challenge_result",
        "challenge": challenge.pk,
        "output": challenges.encode_output(output),
        "tokens": challenge.tokens,
        "hidden_size": output.shape[1],
        "elapsed_ms": 3.5,
    }


def honest_output(challenge: Challenge, dtype: str = "float32") -> torch.Tensor:
    block = Block(models.load_block(MODEL, challenge.layer_start, challenge.layer_end, dtype=dtype))
    return challenges.run_challenge(block, challenge.seed, challenge.tokens)


def test_challenge_is_sent_for_the_ready_span(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.send_challenge(serving, tokens=4, seed=1234)

    assert (challenge.model, challenge.layer_start, challenge.layer_end) == (MODEL, 2, 4)
    assert (challenge.seed, challenge.tokens, challenge.state) == (1234, 4, CheckState.SENT)
    assert challenge.deadline_at > challenge.sent_at


def test_honest_answer_passes_with_per_token_metrics(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.send_challenge(serving, tokens=4, seed=7)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_answer(serving.pk, answer(challenge, honest_output(challenge)))

    challenge.refresh_from_db()
    assert challenge.state == CheckState.PASSED
    assert len(challenge.metrics["cosine"]) == 4
    assert challenge.metrics["min_cosine"] >= 0.9999
    assert challenge.elapsed_ms == 3.5
    assert Strike.objects.count() == 0
    # Timed by the control plane from sending to the right answer: a speed the node proved.
    took = (challenge.answered_at - challenge.sent_at).total_seconds()
    serving.refresh_from_db()
    assert serving.verified_layer_tokens_per_s == pytest.approx(2 * 4 / took)


def test_bfloat16_answer_passes_against_the_float32_verifier(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.send_challenge(serving, tokens=8, seed=99)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_answer(serving.pk, answer(challenge, honest_output(challenge, "bfloat16")))

    challenge.refresh_from_db()
    assert challenge.state == CheckState.PASSED
    assert Strike.objects.count() == 0


def test_wrong_answer_fails_and_opens_a_strike_with_evidence(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.send_challenge(serving, tokens=4, seed=5)
    inputs = challenges.challenge_input(challenge.seed, challenge.tokens, 64)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_answer(serving.pk, answer(challenge, inputs))  # identity: skipped its layers

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


def test_answer_refused_by_the_node_fails(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.send_challenge(serving, tokens=4, seed=5)
    challenge_checks.record_challenge_answer(
        serving.pk, {"type": "challenge_result", "challenge": challenge.pk, "error": "not serving", "code": "x"}
    )

    challenge.refresh_from_db()
    assert challenge.state == CheckState.FAILED
    assert challenge.reason == "the node refused: not serving (x)"
    assert Strike.objects.filter(challenge=challenge).count() == 1


def test_malformed_output_fails(serving):
    challenge = challenge_checks.send_challenge(serving, tokens=4, seed=5)
    challenge_checks.record_challenge_answer(
        serving.pk, {"type": "challenge_result", "challenge": challenge.pk, "output": "AAAA"}
    )

    challenge.refresh_from_db()
    assert challenge.state == CheckState.FAILED
    assert challenge.reason.startswith("malformed answer:")
    assert Strike.objects.filter(challenge=challenge).count() == 1


def test_no_answer_by_the_deadline_expires_and_strikes(serving):
    challenge = challenge_checks.send_challenge(serving, tokens=4, seed=5)

    assert challenge_checks.expire_challenges(challenge.deadline_at - timedelta(seconds=1)) == []
    assert challenge_checks.expire_challenges(challenge.deadline_at + timedelta(seconds=1)) == [challenge.pk]

    challenge.refresh_from_db()
    assert challenge.state == CheckState.EXPIRED
    assert challenge.reason == "no answer within the deadline"
    assert Strike.objects.get().evidence["state"] == CheckState.EXPIRED


def test_late_answer_counts_as_expired(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.send_challenge(serving, tokens=4, seed=5)
    Challenge.objects.filter(pk=challenge.pk).update(deadline_at=timezone.now() - timedelta(seconds=1))
    challenge_checks.record_challenge_answer(serving.pk, answer(challenge, honest_output(challenge)))

    challenge.refresh_from_db()
    assert (challenge.state, challenge.reason) == (CheckState.EXPIRED, "answered after the deadline")
    assert Strike.objects.count() == 1


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"challenge": "1"}, "challenge_result needs the integer id of the challenge"),
        ({"challenge": 10_000}, "challenge 10000 was not sent to this node"),
        ({"output": 5}, "challenge_result needs the output as a base64 string"),
    ],
)
def test_invalid_answers_are_refused_and_change_nothing(serving, message, error):
    challenge = challenge_checks.send_challenge(serving, tokens=4, seed=5)
    before = list(Challenge.objects.values())

    with pytest.raises(InvalidAnswer, match=error):
        challenge_checks.record_challenge_answer(
            serving.pk, {"type": "challenge_result", "challenge": challenge.pk, **message}
        )

    assert list(Challenge.objects.values()) == before
    assert Strike.objects.count() == 0


def test_another_nodes_answer_is_refused(serving, second_provider, make_joined_node):
    challenge = challenge_checks.send_challenge(serving, tokens=4, seed=5)
    other = make_joined_node(second_provider, "gpu-x").node

    with pytest.raises(InvalidAnswer, match=f"challenge {challenge.pk} was not sent to this node"):
        challenge_checks.record_challenge_answer(other.pk, answer(challenge, honest_output(challenge)))
    challenge.refresh_from_db()
    assert challenge.state == CheckState.SENT


def test_second_answer_is_refused(serving, django_capture_on_commit_callbacks):
    challenge = challenge_checks.send_challenge(serving, tokens=4, seed=5)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_answer(serving.pk, answer(challenge, honest_output(challenge)))

    with pytest.raises(InvalidAnswer, match=f"challenge {challenge.pk} is already passed"):
        challenge_checks.record_challenge_answer(serving.pk, answer(challenge, honest_output(challenge)))


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


def rounded_past_the_threshold(challenge: Challenge) -> torch.Tensor:
    """An answer as an honest bfloat16 node gives it when rounding pushes one token's norm just past
    the float32 threshold: the verifier's own bfloat16 rows, with the token where bfloat16 and float32
    disagree most in norm rescaled to sit just beyond 0.05 from float32, on bfloat16's side of it.

    Built from both references in this process, so it holds on any machine and thread count."""
    span = ("smollm2-135m", challenge.layer_start, challenge.layer_end)
    reference = challenges.run_challenge(trusted_block(*span), challenge.seed, challenge.tokens).double()
    bf16 = challenges.run_challenge(trusted_block(*span, FALLBACK_DTYPE), challenge.seed, challenge.tokens).double()
    ratio = bf16.norm(dim=1) / reference.norm(dim=1)  # (tokens,)
    token = int((ratio - 1).abs().argmax())
    q = float(ratio[token])
    # q > 1: aim at (1.05 + (q - 1) / 2) x ‖float32‖, over 0.05 from float32 and under 0.05 from
    # bfloat16; q < 1 mirrors it below.
    target = 1.05 + (q - 1) / 2 if q > 1 else 0.95 - (1 - q) / 2
    rows = bf16.clone()  # (tokens, hidden)
    rows[token] *= target / q
    return rows.float()


def test_honest_bfloat16_rounding_past_a_threshold_passes_against_the_bfloat16_reference(
    serving_smollm2, django_capture_on_commit_callbacks
):
    challenge = challenge_checks.send_challenge(serving_smollm2, tokens=8, seed=1589)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_answer(
            serving_smollm2.pk, answer(challenge, rounded_past_the_threshold(challenge))
        )

    challenge.refresh_from_db()
    assert (challenge.state, challenge.metrics["reference"]) == (CheckState.PASSED, "bfloat16")
    assert max(challenge.metrics["rel_norm"]) < 0.05
    assert Strike.objects.count() == 0


def test_a_wrong_answer_fails_against_both_references(serving_smollm2, django_capture_on_commit_callbacks):
    challenge = challenge_checks.send_challenge(serving_smollm2, tokens=8, seed=1589)
    skipped = challenges.challenge_input(challenge.seed, challenge.tokens, 576)
    with django_capture_on_commit_callbacks(execute=True):
        challenge_checks.record_challenge_answer(serving_smollm2.pk, answer(challenge, skipped))

    challenge.refresh_from_db()
    assert (challenge.state, challenge.metrics["reference"]) == (CheckState.FAILED, "float32")
    assert Strike.objects.filter(challenge=challenge).count() == 1
