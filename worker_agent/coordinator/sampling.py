"""Token sampling: greedy, temperature, top-k and top-p, reproducible with a seed."""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # fixes the random stream of one generation

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from, after temperature, top-k and top-p. (vocab,)"""
    scaled = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
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

    def sample(self, logits: torch.Tensor, position: int | None = None) -> int:
        """The token at ``position`` (by default the next of a stream of draws) from the logits
        of the position before it. (vocab,)"""
        if self.params.greedy:
            return int(torch.argmax(logits))
        if position is None:
            position, self._draws = self._draws, self._draws + 1
        probs = probabilities(logits, self.params).double()
        return int(torch.argmax(torch.log(probs) + self._gumbel(position, probs.shape[-1])))

    def verify(self, logits: torch.Tensor, draft: int | None, position: int | None = None) -> tuple[int, bool]:
        """The token this position commits, and whether a drafter's guess ``draft`` (None: no
        guess) was it. Greedy: the argmax. Sampling: the position's Gumbel-max draw, which accepts
        ``d`` with probability p(d) and otherwise follows p with ``d`` removed, renormalised. (vocab,)"""
        token = self.sample(logits, position)
        return token, draft is not None and token == draft
