"""Drafters: cheap guesses of the next tokens, for the pipeline to verify in one pass.

A drafter proposes up to ``k`` tokens that continue a context (the committed tokens, then any
drafts already in flight). Its proposals are point masses: the verifier accepts a draft ``d``
with the target's probability ``p(d)`` (``Sampler.verify``), which keeps the output distributed
exactly as the target's whatever the drafter proposes; a bad drafter costs speed, never quality.

- ``NgramDrafter`` (prompt lookup, no model): the longest suffix of the context (up to
  ``max_n`` tokens, at least ``min_n``) that occurred earlier in the committed tokens proposes
  what followed that occurrence. Repeated, quoted, templated and edited text is drafted
  verbatim. An index of n-grams to their latest occurrence is kept as tokens are committed, so a
  proposal costs a few dictionary lookups whatever the context's length. A session runs two:
  ``ngram`` (matches of 2 to 8 tokens) and ``ngram1`` (a match of the last token alone, used
  only where ``ngram`` has none). After the model strays from the text it copies (a word
  changed, a comma added), one shared token is often all there is to rejoin it by; in novel
  text the same one-token matches are mostly noise. The router keeps an acceptance estimate
  per drafter name, so it learns which of the two each session's text rewards.
- ``ModelDrafter``: a small model run at the coordinator (any registry model or checkpoint that
  shares the target's tokenizer), greedy, on its own KV cache, which follows the context: what
  the context still shares with the cache is kept, the rest cropped and recomputed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from functools import cache
from typing import Protocol

import torch
from transformers import DynamicCache

from worker_agent import model as models
from worker_agent.errors import ModelError

NGRAM_MAX_N = 8  # a longer match tells apart the repeats of a phrase that recurs in the text
NGRAM_MIN_N = 2  # one shared token says little: ``ngram1`` takes those matches, with its own estimate


@cache
def _draft_model(name: str, target: str):
    """A draft model, checked to share the target's tokenizer: its token ids must mean the same."""
    from transformers import AutoModelForCausalLM  # lazy: only a coordinator with a draft model needs it

    ours, theirs = models.load_tokenizer(target), models.load_tokenizer(name)
    if ours.get_vocab() != theirs.get_vocab():
        raise ModelError(f"draft model {name!r} does not share the tokenizer of {target!r}")
    model = AutoModelForCausalLM.from_pretrained(models.resolve_checkpoint(name), dtype=torch.float32)
    model.eval()
    return model


class Drafter(Protocol):
    name: str
    cost_s_per_token: float  # the coordinator's time to draft one token (the router weighs it)
    only_without: str | None  # the drafter this one stands in for: offered only where that one is not

    def ready(self, context: Sequence[int]) -> bool:
        """Whether ``propose`` would propose anything for ``context`` (cheap: asked every round)."""

    def observe(self, committed: Sequence[int]) -> None:
        """Learn the committed tokens (prompt + output so far); they only ever grow."""

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``context`` (possibly none)."""


class NgramDrafter:
    cost_s_per_token = 0.0

    def __init__(
        self,
        *,
        max_n: int = NGRAM_MAX_N,
        min_n: int = NGRAM_MIN_N,
        name: str = "ngram",
        only_without: str | None = None,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.name, self.only_without = name, only_without
        self.tokens: list[int] = []  # the committed tokens seen so far
        # n-gram -> the index just past its latest occurrence that has a token after it
        self._index: dict[tuple[int, ...], int] = {}

    def observe(self, committed: Sequence[int]) -> None:
        for token in committed[len(self.tokens) :]:
            end = len(self.tokens)  # the n-grams ending here now have a continuation: ``token``
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self._index[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def ready(self, context: Sequence[int]) -> bool:
        return self._follows(context) is not None

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        follows = self._follows(context) if k >= 1 else None
        return [] if follows is None else self.tokens[follows : follows + k]

    def _follows(self, context: Sequence[int]) -> int | None:
        """Where the continuation of the context's longest indexed suffix starts, if any."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            follows = self._index.get(tuple(context[len(context) - n :]))
            if follows is not None:
                return follows
        return None


def ngram_drafters() -> dict[str, NgramDrafter]:
    """A session's model-free drafters: ``ngram`` and, where it has no match, ``ngram1``."""
    return {
        "ngram": NgramDrafter(),
        "ngram1": NgramDrafter(min_n=1, max_n=1, name="ngram1", only_without="ngram"),
    }


class ModelDrafter:
    name = "draft"
    only_without: str | None = None

    def __init__(self, model, *, cost_s_per_token: float = 0.005) -> None:
        """``model``: a causal LM (``transformers``) on the coordinator's device, in eval mode."""
        self.model = model
        self.cost_s_per_token = cost_s_per_token  # replaced by the measured cost after each proposal
        self._cached: list[int] = []  # the tokens the cache holds, in order
        self._cache: DynamicCache | None = None
        self._lock = threading.Lock()  # proposals run in a worker thread; one at a time

    @classmethod
    def load(cls, name: str, *, target: str) -> ModelDrafter:
        """A drafter running model ``name`` (loaded once per process) for target model ``target``."""
        return cls(_draft_model(name, target))

    def observe(self, committed: Sequence[int]) -> None:
        """Nothing to learn ahead: the cache follows whatever context the next proposal gets."""

    def ready(self, context: Sequence[int]) -> bool:
        return bool(context)

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if k < 1 or not context:
            return []
        with self._lock:
            started = time.perf_counter()
            shared = 0
            for cached, token in zip(self._cached, context, strict=False):
                if cached != token:
                    break
                shared += 1
            shared = min(shared, len(context) - 1)  # the last context token is fed again: its logits are needed
            if self._cache is None or shared == 0:
                self._cache, shared = DynamicCache(), 0
            elif shared < len(self._cached):
                self._cache.crop(shared - len(self._cached))  # a negative count: how many positions to drop
            feed = list(context[shared:])
            self._cached = list(context[:shared])
            drafts: list[int] = []
            while len(drafts) < k:
                ids = torch.tensor([feed])  # (1, tokens)
                positions = torch.arange(len(self._cached), len(self._cached) + len(feed)).unsqueeze(0)
                out = self.model(input_ids=ids, past_key_values=self._cache, use_cache=True, position_ids=positions)
                self._cached.extend(feed)
                token = int(torch.argmax(out.logits[0, -1]))
                drafts.append(token)
                feed = [token]
            # The last draft was never fed: the cache holds the context and drafts[:-1].
            took = time.perf_counter() - started
            self.cost_s_per_token = took / len(drafts)
            return drafts
