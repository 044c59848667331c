"""Grading a challenge: the node's recorded outputs against the trusted recompute of its inputs,
which are real activations of a prompt; and the per-token comparison."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from marketplace.verification.prompts import DEFAULT_POOL
from tests.challenge_fixtures import block_outputs, material
from worker_agent import model as models
from worker_agent.block import Block, WorkItem
from worker_agent.dev.cheat import Cheat
from worker_agent.errors import ChallengeError, ChallengeFailed
from worker_agent.kvcache import KVSession
from worker_agent.protocol import wire
from worker_agent.protocol.audit import recompute, recorded_outputs
from worker_agent.protocol.challenge import Comparison, compare, grade, verify_challenge

pytestmark = pytest.mark.trust

TINY = "tiny-llama"
SMOLLM2 = "smollm2-135m"
SMOLLM2_SPANS = [(0, 10), (10, 20), (20, 30)]
NODE = "node-under-test"


@pytest.fixture(scope="module")
def tiny() -> Block:
    return Block(models.load_block(TINY, 2, 4))


@pytest.fixture(scope="module")
def smollm2_fp32() -> dict[tuple[int, int], Block]:
    return {span: Block(models.load_block(SMOLLM2, *span)) for span in SMOLLM2_SPANS}


def _rows(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)  # (tokens, hidden)


def cheated(block: Block, mode: str):
    """Outputs as a node with the cheat ``mode`` gives them, step by step on one session."""
    cheat = Cheat.parse(mode)

    def run(inputs: torch.Tensor, steps) -> torch.Tensor:
        kv = KVSession("chatcmpl-x", "s0")
        rows = [cheat.forward(block, [WorkItem(kv, start, inputs[start : start + count])])[0] for start, count in steps]
        return torch.cat(rows).to(torch.float32)

    return run


# Grading


def test_an_honest_node_passes_on_every_token(tiny):
    honest = material(node=NODE, model=TINY, layer_start=2, layer_end=4)

    comparison = grade(honest, tiny)

    assert comparison.passed
    assert comparison.failures == ()
    assert len(comparison.cosine) == honest.tokens
    assert min(comparison.cosine) > 0.999999
    assert max(comparison.rel_norm) < 1e-5


def test_a_rolled_back_draft_is_replayed_on_the_cache_as_the_node_held_it(tiny):
    honest = material(node=NODE, model=TINY, layer_start=2, layer_end=4)
    prefill = honest.steps[0][1]
    # A speculative chunk of 2 rows at the prefill's end, of which the second was rejected: the next
    # step computes that position again, on another input row.
    other = torch.randn(1, honest.hidden_size, generator=torch.Generator().manual_seed(3)) * 5
    inputs = honest.tensor(honest.inputs[0], prefill)
    steps = ((0, prefill - 1), (prefill - 1, 2), (prefill, 1))
    rows = [inputs[: prefill - 1], torch.cat([inputs[prefill - 1 :], other]), other]
    kv = KVSession("chatcmpl-x", "s0")
    outputs = [tiny.forward([WorkItem(kv, start, chunk)])[0] for (start, _), chunk in zip(steps, rows, strict=True)]
    rolled = dataclasses.replace(
        honest,
        steps=steps,
        inputs=tuple(wire.tensor_payload(chunk, "f32") for chunk in rows),
        outputs=tuple(wire.tensor_payload(out, "f32") for out in outputs),
    )

    assert grade(rolled, tiny).passed
    # Replayed in one pass instead, the position computed twice would be compared with the wrong row.
    zeroed = dataclasses.replace(rolled, outputs=(*rolled.outputs[:2], bytes(len(rolled.outputs[2]))))
    last, rows_in_all = prefill + 1, prefill + 2
    assert grade(zeroed, tiny).failures == (
        f"cosine 0.000000 < 0.99 at token {last} (1 of {rows_in_all} tokens below)",
        f"relative norm difference 1.000000 >= 0.05 at token {last} (1 of {rows_in_all} tokens over)",
    )


@pytest.mark.parametrize("mode", ["garbage", "identity", "other-weights"])
def test_a_cheating_tiny_node_fails_on_direction_and_magnitude(tiny, mode):
    answer = material(node=NODE, model=TINY, layer_start=2, layer_end=4, outputs=cheated(tiny, mode))

    with pytest.raises(ChallengeFailed) as failed:
        verify_challenge(recorded_outputs(answer), recompute(answer, tiny))

    comparison = failed.value.comparison
    assert comparison == grade(answer, tiny)
    assert failed.value.code == "challenge_failed"
    assert str(failed.value) == "challenge failed: " + "; ".join(comparison.failures)
    assert [reason.split(" ")[0] for reason in comparison.failures] == ["cosine", "relative"]
    assert comparison.min_cosine < 0.9  # the residual stream keeps an identity answer near its input: far enough


# bfloat16 against a float32 reference, on SmolLM2-135M's real weights and real activations: every
# span, each of these prompts of the default pool. The verifier compares with its bfloat16 copy
# before it fails an answer (marketplace/verification/verifier.py), so an honest bfloat16 node must
# pass against one reference or the other.
BF16_PROMPTS = DEFAULT_POOL[:8]


@pytest.fixture
def one_thread():
    """Many small forward passes: on a busy machine a second torch thread mostly waits for the
    first, which made this test several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("span", SMOLLM2_SPANS, ids=lambda span: f"{span[0]}:{span[1]}")
def test_an_honest_bfloat16_node_passes_against_the_verifiers_references(span, smollm2_fp32, one_thread):
    bf16_block = Block(models.load_block(SMOLLM2, *span, dtype="bfloat16"))
    worst_cosine, worst_rel_norm, failed = 1.0, 0.0, []

    for prompt in BF16_PROMPTS:
        answer = material(
            node=NODE, model=SMOLLM2, layer_start=span[0], layer_end=span[1], prompt=prompt,
            outputs=block_outputs(SMOLLM2, *span, "bfloat16"),
        )  # fmt: skip
        comparison = grade(answer, smollm2_fp32[span])
        worst_cosine = min(worst_cosine, comparison.min_cosine)
        worst_rel_norm = max(worst_rel_norm, comparison.max_rel_norm)
        if not comparison.passed and not grade(answer, bf16_block).passed:
            failed.append((prompt, comparison.failures))

    margins = f"worst cosine {worst_cosine:.6f}, worst relative norm difference {worst_rel_norm:.6f}"
    print(f"bfloat16 vs float32, layers {span[0]}:{span[1]}, {len(BF16_PROMPTS)} prompts: {margins}")
    assert failed == [], margins


@pytest.mark.parametrize("mode", ["garbage", "identity", "other-weights"])
@pytest.mark.parametrize("span", SMOLLM2_SPANS, ids=lambda span: f"{span[0]}:{span[1]}")
def test_a_cheating_smollm2_node_fails_on_every_token(smollm2_fp32, span, mode):
    block = smollm2_fp32[span]
    answer = material(node=NODE, model=SMOLLM2, layer_start=span[0], layer_end=span[1], outputs=cheated(block, mode))

    comparison = grade(answer, block)

    assert max(comparison.cosine) < 0.99
    assert min(comparison.rel_norm) >= 0.05
    assert comparison.failures[0].endswith(f"({answer.tokens} of {answer.tokens} tokens below)")
    assert comparison.failures[1].endswith(f"({answer.tokens} of {answer.tokens} tokens over)")


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
