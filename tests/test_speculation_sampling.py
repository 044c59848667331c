"""Speculative sampling is lossless: continuations are distributed exactly as the target's.

The target is ``tiny-llama`` (its full model, in this process) with its logits cut to its first
64 token ids (sampling over the full 49,152 would make 20,000 samples per case take minutes),
sampled with temperature 1 and top-k 4, so the first three tokens after a prompt have at most
4^3 = 64 outcomes whose exact probabilities follow from the model's logits. Each sample runs the coordinator's own state
machine (``GenerationState``: chunks, ``Sampler.verify``, voiding, the bonus token) with the
logits of each chunk row computed from the model, for plain decoding and for speculation with a
good drafter (the target's own argmax) and a bad one (a token the target never samples here).

Bound: for n samples over m outcomes, the total variation between the empirical and the true
distribution has mean at most sqrt((m - 1) / n) / 2, and by McDiarmid's inequality exceeds it
by t with probability at most exp(-2 n t^2). With n = 20,000, m = 64 and a failure probability
of 1e-6 per check, the bound is 0.0281 + 0.0186 = 0.0467. Plain sampling draws from the same
``probabilities``, so the exact distribution is plain sampling's. A rule that accepts every draft
(not lossless) lands far outside the bound, which ``test_a_rule_that_keeps_every_draft_is_caught``
shows.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import cache

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker_agent import model as models
from worker_agent.coordinator.sampling import SamplingParams, probabilities
from worker_agent.coordinator.session import GenerationRequest, GenerationState

pytestmark = pytest.mark.dataplane

PROMPT = (1, 17, 42, 8, 61, 16)
VOCAB = 64  # the target's logits are cut to its first 64 ids, so 20,000 samples take seconds, not minutes
SAMPLES = 20_000
OUTCOMES = 4**3
DELTA = 1e-6
TV_BOUND = math.sqrt((OUTCOMES - 1) / SAMPLES) / 2 + math.sqrt(math.log(1 / DELTA) / (2 * SAMPLES))
PARAMS = SamplingParams(temperature=1.0, top_k=4)


@cache
def target():
    return AutoModelForCausalLM.from_pretrained(models.resolve_checkpoint("tiny-llama"), dtype=torch.float32).eval()


@cache
def logits_after(tokens: tuple[int, ...]) -> torch.Tensor:
    """The target's logits for the token after ``tokens``, over the first VOCAB ids. (VOCAB,)"""
    with torch.inference_mode():
        return target()(torch.tensor([tokens])).logits[0, -1, :VOCAB].float()


def exact_distribution() -> dict[tuple[int, ...], float]:
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        grown = {}
        for prefix, mass in dist.items():
            probs = probabilities(logits_after(PROMPT + prefix), PARAMS)
            for token in torch.nonzero(probs).flatten().tolist():
                grown[(*prefix, token)] = mass * float(probs[token])
        dist = grown
    return dist


def good_drafter(context: list[int], k: int) -> list[int]:
    """The target's own greedy continuation: accepted often."""
    drafts: list[int] = []
    for _ in range(k):
        drafts.append(int(torch.argmax(logits_after(tuple(context + drafts)))))
    return drafts


def bad_drafter(context: list[int], k: int) -> list[int]:
    """The target's least likely token, outside its top 4: p(draft) = 0, always rejected."""
    drafts: list[int] = []
    for _ in range(k):
        drafts.append(int(torch.argmin(logits_after(tuple(context + drafts)))))
    return drafts


def sample(drafter, *, k: int, depth: int, seed: int, keep_every_draft: bool = False) -> tuple[int, ...]:
    """One continuation of 3 tokens, run through GenerationState like the coordinator runs it."""
    request = GenerationRequest(PROMPT, max_tokens=3, sampling=SamplingParams(1.0, top_k=4, seed=seed))
    state = GenerationState(request, tokenizer=_Tokenizer())
    if keep_every_draft:
        plain_verify = state.sampler.verify
        state.sampler.verify = lambda logits, draft, position, history=None: (
            (draft, True) if draft is not None else plain_verify(logits, None, position, history)
        )
    flight = []
    while not state.done:
        while state.in_flight < depth:
            drafts = drafter(state.draft_context(), min(k, state.room_for_drafts())) if k else []
            made = state.next_chunk(drafts)
            if made is None:
                break
            flight.append(made)
            if not drafts:
                break
        chunk, _ = flight.pop(0)
        rows = state.rows_needed(chunk)
        logits = None
        if rows:
            # Chain token i sits at position chain_start + i and sees every token before it.
            before = state.committed[: state.chain_start]
            last = chunk.first + chunk.count
            logits = torch.stack([logits_after(tuple(before + state.chain[: i + 1])) for i in range(last - rows, last)])
        state.fold(chunk, logits)
    return tuple(state.generated)


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(0x4E00 + i % 2000) for i in ids)


def total_variation(counts: Counter, exact: dict[tuple[int, ...], float]) -> float:
    keys = set(counts) | set(exact)
    n = sum(counts.values())
    return 0.5 * sum(abs(counts[key] / n - exact.get(key, 0.0)) for key in keys)


def run(drafter, samples: int = SAMPLES, **kwargs) -> Counter:
    return Counter(sample(drafter, seed=seed, **kwargs) for seed in range(samples))


@pytest.mark.parametrize(
    ("drafter", "k", "depth"),
    [(good_drafter, 2, 1), (good_drafter, 1, 3), (bad_drafter, 1, 2)],
    ids=["good-sync", "good-pipelined", "bad-pipelined"],
)
def test_speculative_sampling_keeps_the_targets_distribution(drafter, k, depth):
    exact = exact_distribution()
    assert len(exact) == OUTCOMES and math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)

    counts = run(drafter, k=k, depth=depth)

    tv = total_variation(counts, exact)
    assert tv <= TV_BOUND, f"total variation {tv:.4f} > {TV_BOUND:.4f}"


def test_a_rule_that_keeps_every_draft_is_caught():
    exact = exact_distribution()

    counts = run(good_drafter, 2_000, k=2, depth=1, keep_every_draft=True)

    # Even with a tenth of the samples (a looser bound), the distortion is far outside it.
    loose = math.sqrt((OUTCOMES - 1) / 2_000) / 2 + math.sqrt(math.log(1 / DELTA) / (2 * 2_000))
    assert total_variation(counts, exact) > 2 * loose
