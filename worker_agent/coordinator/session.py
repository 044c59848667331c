"""One generation stream, as a state machine without I/O.

``GenerationState`` decides what the pipeline must compute next (``next_input``) and folds the
logits that come back into committed tokens (``commit``), deciding when to stop (EOS, a stop
string, the token budget) and which text can be streamed already. The driver in ``job.py``
does the sending and receiving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from worker_agent.coordinator.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # the text ends before the first of these
    eos_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass(frozen=True)
class TokenEvent:
    token_id: int | None  # None: the end of the stream released held-back text, no new token
    text: str  # the text this token made final (may be "" while a stop string is still possible)
    at: float  # seconds since the request started


class GenerationState:
    def __init__(self, request: GenerationRequest, tokenizer, *, clock=time.monotonic) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.sampler = Sampler(request.sampling)
        self.clock = clock
        self.started = clock()
        self.position = 0  # positions the stages hold for this session
        self.pending: list[int] = list(request.prompt_ids)  # tokens not yet sent through the pipeline
        self.generated: list[int] = []
        self.token_times: list[float] = []
        self.text = ""  # text streamed so far
        self.finish_reason: str | None = None  # "stop" or "length"
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def next_input(self) -> tuple[list[int], int]:
        """Token ids to run through the pipeline and the position of the first one."""
        return list(self.pending), self.position

    def rewind(self) -> None:
        """Start over on a fresh route (a heal): its stages hold nothing of this session, so the
        next input is the prompt and every committed token, from position 0. The sampler is not
        touched: the failed step's logits were never sampled."""
        self.pending = list(self.request.prompt_ids) + self.generated
        self.position = 0

    def commit(self, logits: torch.Tensor) -> TokenEvent | None:
        """Fold the last position's logits (vocab,) in: sample, commit, decide whether to stop."""
        self.position += len(self.pending)
        self.steps += 1
        token = self.sampler.sample(logits)
        now = self.clock() - self.started
        if token in self.request.eos_ids:
            self.finish_reason = "stop"
            self.pending = []
            return self._flush(now)
        self.generated.append(token)
        self.token_times.append(now)
        self.pending = [token]
        full = self.tokenizer.decode(self.generated, skip_special_tokens=True)
        for stop in self.request.stop:
            cut = full.find(stop)
            if cut != -1:
                self.finish_reason = "stop"
                return self._emit(token, full[:cut], now)
        if len(self.generated) >= self.request.max_tokens:
            self.finish_reason = "length"
            return self._emit(token, full, now)
        return self._emit(token, self._stable_prefix(full), now)

    def _stable_prefix(self, full: str) -> str:
        """The part of the text no later token can change: not a half-decoded character, not
        the beginning of a stop string."""
        stable = full.rstrip("\ufffd")
        for stop in self.request.stop:
            for size in range(min(len(stop) - 1, len(stable)), 0, -1):
                if stable.endswith(stop[:size]):
                    stable = stable[:-size]
                    break
        return stable if stable.startswith(self.text) else self.text

    def _emit(self, token: int | None, text: str, now: float) -> TokenEvent:
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text = text if text.startswith(self.text) else self.text
        return TokenEvent(token, delta, now)

    def _flush(self, now: float) -> TokenEvent | None:
        """At EOS: release text held back for a possible stop string, if any."""
        full = self.tokenizer.decode(self.generated, skip_special_tokens=True)
        event = self._emit(None, full, now)
        return event if event.text else None
