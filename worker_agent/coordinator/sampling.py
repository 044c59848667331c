"""Token sampling: greedy, temperature, top-k and top-p, reproducible with a seed."""

from __future__ import annotations

import math
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
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def sample(self, logits: torch.Tensor) -> int:
        """One token id from the logits of one position. (vocab,)"""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = probabilities(logits, self.params)
        return int(torch.multinomial(probs, 1, generator=self.generator))
