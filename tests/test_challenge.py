"""Seeded spot-challenges: the input, the encoding of an answer, the comparison, the agent's answer."""

from __future__ import annotations

import json
import math

import pytest
import torch

from worker_agent import model as models
from worker_agent.block import Block, WorkItem
from worker_agent.challenge import (
    INPUT_STD,
    MAX_CHALLENGE_TOKENS,
    Comparison,
    challenge_input,
    compare,
    run_challenge,
    session_steps,
    verify_challenge,
)
from worker_agent.cheat import Cheat
from worker_agent.errors import ChallengeError, ChallengeFailed
from worker_agent.kvcache import SessionLimits, SessionStore

pytestmark = pytest.mark.trust

TINY = "tiny-llama"
SMOLLM2 = "smollm2-135m"
SMOLLM2_SPANS = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture(scope="module")
def tiny() -> Block:
    return Block(models.load_block(TINY, 0, 6))


@pytest.fixture(scope="module")
def smollm2_fp32() -> dict[tuple[int, int], Block]:
    return {span: Block(models.load_block(SMOLLM2, *span)) for span in SMOLLM2_SPANS}


def _rows(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)  # (tokens, hidden)


# The input


def test_the_input_is_a_pure_function_of_seed_and_size():
    first = challenge_input(12345, 8, 576)

    assert first.shape == (8, 576)
    assert first.dtype == torch.float32
    assert first.mean().item() == pytest.approx(0.0, abs=0.1 * INPUT_STD)
    assert first.std().item() == pytest.approx(INPUT_STD, rel=0.05)
    assert torch.equal(first, challenge_input(12345, 8, 576))
    assert not torch.equal(first, challenge_input(12346, 8, 576))
    assert torch.equal(challenge_input(2**63 - 1, 1, 4), challenge_input(2**63 - 1, 1, 4))


@pytest.mark.parametrize(
    ("seed", "tokens", "message"),
    [
        (-1, 8, "seed must be an integer in [0, 9223372036854775807], got -1"),
        (2**63, 8, "seed must be an integer in [0, 9223372036854775807], got 9223372036854775808"),
        (1.0, 8, "seed must be an integer in [0, 9223372036854775807], got 1.0"),
        (True, 8, "seed must be an integer in [0, 9223372036854775807], got True"),
        ("7", 8, "seed must be an integer in [0, 9223372036854775807], got '7'"),
        (7, 0, f"tokens must be an integer in [1, {MAX_CHALLENGE_TOKENS}], got 0"),
        (7, MAX_CHALLENGE_TOKENS + 1, f"tokens must be an integer in [1, {MAX_CHALLENGE_TOKENS}], got 65"),
        (7, None, f"tokens must be an integer in [1, {MAX_CHALLENGE_TOKENS}], got None"),
    ],
)
def test_an_invalid_seed_or_token_count_is_refused(seed, tokens, message):
    with pytest.raises(ChallengeError) as refused:
        challenge_input(seed, tokens, 64)

    assert (str(refused.value), refused.value.code) == (message, "challenge_invalid")


# Running it


def test_an_honest_block_passes_against_itself(tiny):
    output = run_challenge(tiny, 99, 8)

    comparison = verify_challenge(output, run_challenge(tiny, 99, 8))

    assert output.shape == (8, 64)
    assert output.dtype == torch.float32
    assert comparison.passed
    assert comparison.failures == ()
    assert comparison.cosine == pytest.approx((1.0,) * 8, abs=1e-12)
    assert comparison.rel_norm == pytest.approx((0.0,) * 8, abs=1e-12)


def test_a_challenge_is_one_prefill_of_a_fresh_session_and_leaves_live_sessions_alone(tiny):
    store = SessionStore(SessionLimits())
    live = store.open("job", "live")
    prompt, step = challenge_input(1, 5, 64), challenge_input(2, 1, 64)
    tiny.forward([WorkItem(live, 0, prompt)])

    challenged = run_challenge(tiny, 99, 8)
    (after,) = tiny.forward([WorkItem(live, 5, step)])

    fresh = SessionStore(SessionLimits()).open("job", "fresh")
    (expected_challenge,) = tiny.forward([WorkItem(fresh, 0, challenge_input(99, 8, 64))])
    clean = SessionStore(SessionLimits()).open("job", "clean")
    tiny.forward([WorkItem(clean, 0, prompt)])
    (expected_after,) = tiny.forward([WorkItem(clean, 5, step)])
    assert torch.equal(challenged, expected_challenge)
    assert torch.equal(after, expected_after)
    assert (len(store), live.length) == (1, 6)


# bfloat16 against a float32 reference, on SmolLM2-135M's real weights (see the module docstring
# of worker_agent/challenge.py): 200 seeds on each span, 8 tokens each, the size the control
# plane sends by default (SWARM_CHALLENGE_TOKENS).
BF16_SEEDS = range(200)


@pytest.fixture
def one_thread():
    """400 small forward passes: on a busy machine a second torch thread mostly waits for the
    first, which made this test several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("span", SMOLLM2_SPANS, ids=lambda span: f"{span[0]}:{span[1]}")
def test_an_honest_bfloat16_block_passes_against_a_float32_reference(span, smollm2_fp32, one_thread):
    bf16 = Block(models.load_block(SMOLLM2, *span, dtype="bfloat16"))
    worst_cosine, worst_rel_norm, failed = 1.0, 0.0, []

    for seed in BF16_SEEDS:
        comparison = compare(run_challenge(bf16, seed, 8), run_challenge(smollm2_fp32[span], seed, 8))
        worst_cosine = min(worst_cosine, comparison.min_cosine)
        worst_rel_norm = max(worst_rel_norm, comparison.max_rel_norm)
        if not comparison.passed:
            failed.append((seed, comparison.failures))

    margins = f"worst cosine {worst_cosine:.6f}, worst relative norm difference {worst_rel_norm:.6f}"
    print(f"bfloat16 vs float32, layers {span[0]}:{span[1]}, {len(BF16_SEEDS)} seeds: {margins}")
    assert failed == [], margins


# Cheats are caught


@pytest.mark.parametrize("mode", ["garbage", "identity", "other-weights"])
def test_a_cheating_tiny_block_fails_on_direction_and_magnitude(tiny, mode):
    reference = run_challenge(tiny, 99, 8)
    answer = run_challenge(tiny, 99, 8, cheat=Cheat.parse(mode))

    with pytest.raises(ChallengeFailed) as failed:
        verify_challenge(answer, reference)

    comparison = failed.value.comparison
    assert failed.value.code == "challenge_failed"
    assert str(failed.value) == "challenge failed: " + "; ".join(comparison.failures)
    assert [reason.split(" ")[0] for reason in comparison.failures] == ["cosine", "relative"]
    assert comparison.min_cosine < 0.5
    assert not comparison.passed


@pytest.mark.parametrize("mode", ["garbage", "identity", "other-weights"])
@pytest.mark.parametrize("span", SMOLLM2_SPANS, ids=lambda span: f"{span[0]}:{span[1]}")
def test_a_cheating_smollm2_block_fails_on_every_token(smollm2_fp32, span, mode):
    block = smollm2_fp32[span]

    with pytest.raises(ChallengeFailed) as failed:
        verify_challenge(run_challenge(block, 4242, 8, cheat=Cheat.parse(mode)), run_challenge(block, 4242, 8))

    comparison = failed.value.comparison
    assert max(comparison.cosine) < 0.99
    assert min(comparison.rel_norm) >= 0.05
    assert comparison.failures[0].endswith("(8 of 8 tokens below)")
    assert comparison.failures[1].endswith("(8 of 8 tokens over)")


def test_a_selective_cheat_is_honest_outside_data_plane_sessions(tiny):
    comparison = verify_challenge(
        run_challenge(tiny, 5, 8, cheat=Cheat.parse("selective:1")), run_challenge(tiny, 5, 8)
    )

    assert comparison.min_cosine == pytest.approx(1.0, abs=1e-12)


# The comparison


def test_compares_each_token_by_direction_and_by_the_difference_of_norms():
    reference = _rows([3.0, 4.0], [1.0, 0.0], [0.0, 2.0])
    output = _rows([3.0, 4.0], [0.0, 1.0], [0.0, 2.2])

    comparison = compare(output, reference)

    assert comparison.cosine == pytest.approx((1.0, 0.0, 1.0))
    assert comparison.rel_norm == pytest.approx((0.0, 0.0, 0.1))
    assert comparison.min_cosine == pytest.approx(0.0)
    assert comparison.max_rel_norm == pytest.approx(0.1)
    assert comparison.failures == (
        "cosine 0.000000 < 0.99 at token 1 (1 of 3 tokens below)",
        "relative norm difference 0.100000 >= 0.05 at token 2 (1 of 3 tokens over)",
    )


def test_the_thresholds_are_inclusive_for_cosine_and_exclusive_for_the_norm():
    at_the_edge = Comparison(cosine=(0.99,), rel_norm=(0.0499999,))
    over = Comparison(cosine=(0.99,), rel_norm=(0.05,))

    assert at_the_edge.passed
    assert not over.passed


def test_an_all_zero_output_token_has_no_direction_and_fails():
    comparison = compare(_rows([0.0, 0.0]), _rows([1.0, 2.0]))

    assert (comparison.cosine, comparison.rel_norm) == ((0.0,), (1.0,))


def test_the_comparison_serializes_to_json_rounded_to_six_places():
    comparison = Comparison(cosine=(0.123456789, 1.0), rel_norm=(0.0, 0.0444444444))

    data = json.loads(json.dumps(comparison.to_dict()))

    assert data == {
        "passed": False,
        "min_cosine": 0.123457,
        "max_rel_norm": 0.044444,
        "required_cosine": 0.99,
        "allowed_rel_norm": 0.05,
        "cosine": [0.123457, 1.0],
        "rel_norm": [0.0, 0.044444],
    }


@pytest.mark.parametrize(
    ("output", "reference", "message", "code"),
    [
        (torch.zeros(2, 3), torch.zeros(2, 4), "output has shape (2, 3), the reference (2, 4)", "challenge_malformed"),
        (torch.zeros(3), torch.zeros(3), "output must be (tokens, hidden), got shape (3,)", "challenge_malformed"),
        (_rows([1.0, math.nan]), _rows([1.0, 1.0]), "output holds non-finite values", "challenge_malformed"),
        (
            _rows([1.0, 1.0]),
            _rows([0.0, 0.0]),
            "the reference holds non-finite values or an all-zero token",
            "challenge_invalid",
        ),
    ],
)
def test_compare_refuses_what_it_cannot_judge(output, reference, message, code):
    with pytest.raises(ChallengeError) as refused:
        compare(output, reference)

    assert (str(refused.value), refused.value.code) == (message, code)


# The encoding of an answer


def test_a_challenge_session_is_a_prefill_then_single_token_steps():
    assert session_steps(8) == [(0, 5), (5, 1), (6, 1), (7, 1)]
    assert session_steps(2) == [(0, 1), (1, 1)]
    assert session_steps(1) == [(0, 1)]


def test_the_session_steps_give_the_rows_of_one_prefill(tiny):
    inputs = challenge_input(31, 8, 64)  # (8, hidden)
    kv = SessionStore(SessionLimits(max_sessions=1, max_tokens=8)).open("chatcmpl-x", "s0")

    rows = [tiny.forward([WorkItem(kv, start, inputs[start : start + count])])[0] for start, count in session_steps(8)]

    comparison = verify_challenge(torch.cat(rows).float(), run_challenge(tiny, 31, 8))
    assert comparison.min_cosine > 0.9999
