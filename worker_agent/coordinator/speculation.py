"""A coordinator's speculation settings and the drafters they name.

    settings = SpeculationSettings()                                 # the router decides, n-gram drafter
    settings = SpeculationSettings(draft_model="tiny-llama")         # ... with a draft model as well
    settings = SpeculationSettings(drafter="ngram", k=8, depth=4)    # one fixed plan (benchmarks)
    settings = SpeculationSettings(enabled=False)                    # plain decoding, one token per step

Without a fixed ``k`` each session's ``Router`` picks the drafter, K and depth per chain from the
acceptance it measures and the round trip it sees, and decodes plainly when speculation does not
pay. A draft model must share the target's tokenizer: its ids are the target's ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from worker_agent.coordinator.drafters import Drafter, ModelDrafter, ngram_drafters
from worker_agent.coordinator.router import PLAIN, Plan

DRAFTERS = ("ngram", "draft")
MAX_K = 32  # drafts per chunk
MAX_DEPTH = 8  # chunks in flight per session


@dataclass(frozen=True)
class SpeculationSettings:
    enabled: bool = True
    drafter: str | None = None  # only this drafter ("ngram": both n-gram ones, or "draft"); None: whichever pays
    k: int | None = None  # a fixed number of drafts per chunk (0: plain decoding); None: the router's
    depth: int | None = None  # with ``k``: chunks in flight (default 1, synchronous verification)
    draft_model: str | None = None  # registry id or checkpoint folder of the draft model, if any

    def __post_init__(self) -> None:
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.drafter == "draft" and self.draft_model is None:
            raise ValueError("the 'draft' drafter needs a draft model (--draft-model)")
        if self.k is not None and not 0 <= self.k <= MAX_K:
            raise ValueError(f"k must be in [0, {MAX_K}], got {self.k}")
        if self.depth is not None and not 1 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"depth must be in [1, {MAX_DEPTH}], got {self.depth}")
        if self.depth is not None and self.k is None:
            raise ValueError("depth is fixed only together with k")

    def drafters(self, target: str) -> dict[str, Drafter]:
        """New drafters for one session (each keeps per-stream state: an n-gram index, a KV cache)."""
        if not self.enabled:
            return {}
        made: dict[str, Drafter] = {}
        if self.drafter in (None, "ngram"):
            made.update(ngram_drafters())
        if self.draft_model is not None and self.drafter in (None, "draft"):
            made["draft"] = ModelDrafter.load(self.draft_model, target=target)
        return made

    def fixed_plan(self, drafters: Mapping[str, float]) -> Plan | None:
        """The plan every chain uses when ``k`` is fixed; None lets the router choose."""
        if not self.enabled or self.k == 0 or not drafters:
            return PLAIN
        if self.k is None:
            return None
        name = self.drafter or next(iter(drafters))
        return Plan(name, self.k, self.depth or 1)
