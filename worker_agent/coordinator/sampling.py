"""Token sampling: the logits' adjustments (bias and repetition penalties), then greedy, or
temperature, top-k, top-p and min-p, reproducible with a seed.

The adjustments act on the raw logits of a position before anything else, in this order:

- ``logit_bias``: ``logits[t] += bias[t]`` for each token named (OpenAI's ``logit_bias``);
- ``repetition_penalty`` r (Hugging Face's and vLLM's): for every token in the prompt or the
  output so far, a positive logit is divided by r and a negative one multiplied by r;
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's formula): for every token the
  output so far holds c > 0 times, ``logits[t] -= c * f + p``.

What "so far" holds at a position is the prompt and the tokens committed before that position,
so a speculative chunk's rows are adjusted exactly as plain decoding would adjust them (each
row's history includes the drafts accepted before it), and the output stays distributed, or
greedy-identical, as without speculation.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

BIAS_RANGE = (-100.0, 100.0)  # a logit_bias value, as OpenAI bounds it
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, as OpenAI bounds them
REPETITION_RANGE = (0.0, 2.0)  # (low, high]: 1 changes nothing


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # fixes the random stream of one generation
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one; 0 = none
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per time the output holds the token
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of seen tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids distinct

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]):
                raise ValueError(f"{name} must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {value}")
        low, high = REPETITION_RANGE
        if not (math.isfinite(self.repetition_penalty) and low < self.repetition_penalty <= high):
            raise ValueError(f"repetition_penalty must be in ({low:g}, {high:g}], got {self.repetition_penalty}")
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError("logit_bias needs distinct non-negative token ids")
        if not all(math.isfinite(b) and BIAS_RANGE[0] <= b <= BIAS_RANGE[1] for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [{BIAS_RANGE[0]:g}, {BIAS_RANGE[1]:g}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted before sampling (a bias or a penalty is set)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.penalizes_output

    @property
    def penalizes_output(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class History:
    """What a position's adjustments look at: the prompt's tokens and the output's counts so far."""

    prompt: Collection[int]
    output: Mapping[int, int]  # token -> times the output holds it

    @classmethod
    def of(cls, prompt: list[int], output: list[int]) -> History:
        return cls(frozenset(prompt), Counter(output))


def adjust(logits: torch.Tensor, params: SamplingParams, history: History | None) -> torch.Tensor:
    """The logits after ``logit_bias`` and the penalties (see the module docstring); a new
    tensor, or ``logits`` itself when nothing adjusts. Token ids past the vocabulary are left
    out (the API refuses them first). (vocab,)"""
    if not params.adjusts:
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long)
        biases = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=out.dtype)
        out.index_add_(0, ids, biases)
    if history is None:
        return out
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*history.prompt, *history.output) if t < vocab}), dtype=torch.long)
        if seen.numel():
            values = out[seen]
            penalty = params.repetition_penalty
            out[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if params.penalizes_output and history.output:
        pairs = [(t, c) for t, c in history.output.items() if t < vocab and c > 0]
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        counts = torch.tensor([c for _, c in pairs], dtype=out.dtype)
        out.index_add_(0, ids, -(counts * params.frequency_penalty + params.presence_penalty))
    return out


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from, after temperature, top-k, top-p and min-p. (vocab,)"""
    scaled = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


class Sampler:
    """Draws tokens from the filtered distribution with the Gumbel-max trick: the token at
    position q is ``argmax(log p + g_q)``, where g_q is Gumbel noise over the vocabulary drawn
    from a generator seeded by (seed, q). That is an exact sample from p, and it depends on the
    seed, the position and p only: not on how many draws came before, how chunks were cut, which
    drafts were proposed, or whether a heal re-ran the prefix. So a seeded request gives the
    same tokens with or without speculation, on any route.

    Verifying a drafter's point-mass guess d is then: accept iff d is the token drawn. Its
    probability is P(argmax(log p + g) = d) = p(d), and given a rejection the token drawn is
    distributed as p with d removed and renormalised: the lossless rule of speculative sampling."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._draws = 0  # positions handed out to callers that name none

    def _gumbel(self, position: int, size: int) -> torch.Tensor:
        key = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key, "big") >> 1)
        uniform = torch.rand(size, generator=generator, dtype=torch.float64).clamp_(min=1e-300)
        return -torch.log(-torch.log(uniform))  # (vocab,)

    def sample(self, logits: torch.Tensor, position: int | None = None, history: History | None = None) -> int:
        """The token at ``position`` (by default the next of a stream of draws) from the logits
        of the position before it, adjusted for ``history`` (the tokens before it). (vocab,)"""
        logits = adjust(logits, self.params, history)
        if self.params.greedy:
            return int(torch.argmax(logits))
        if position is None:
            position, self._draws = self._draws, self._draws + 1
        probs = probabilities(logits, self.params).double()
        return int(torch.argmax(torch.log(probs) + self._gumbel(position, probs.shape[-1])))

    def verify(
        self, logits: torch.Tensor, draft: int | None, position: int | None = None, history: History | None = None
    ) -> tuple[int, bool]:
        """The token this position commits, and whether a drafter's guess ``draft`` (None: no
        guess) was it. Greedy: the argmax. Sampling: the position's Gumbel-max draw, which accepts
        ``d`` with probability p(d) and otherwise follows p with ``d`` removed, renormalised. (vocab,)"""
        token = self.sample(logits, position, history)
        return token, draft is not None and token == draft
