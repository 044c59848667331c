"""One generation stream, as a state machine without I/O.

``GenerationState`` decides what the pipeline must compute next and folds what comes back into
committed tokens, deciding when to stop (EOS, a stop string, the token budget) and which text can
be streamed already. The engine (``engine.py``) does the sending and receiving.

The stream is a chain of tokens sent past what the stages hold: at first the prompt, then the
last committed token, each time followed by the drafts of a drafter (none in plain decoding).
``next_chunk`` sends the chain's unsent tokens as one chunk (one FORWARD step), and with drafts
more chunks may follow before the first comes back (pipelined verification). ``fold`` takes a
chunk's logits in send order: the row of each chain token verifies the token after it (a draft:
``Sampler.verify``), or, past the chain's end, samples the next token (the bonus). A rejected
draft commits the verifier's token instead, voids every later chunk in flight (their results are
still awaited, for the transcript, and then ignored) and starts a new chain from it; the next
chunk then starts at its position, which makes the stages drop the rejected positions' KV.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from worker_agent.coordinator.grammar import Constraint, Grammar
from worker_agent.coordinator.sampling import History, Sampler, SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # the text ends before the first of these
    eos_ids: frozenset[int] = frozenset()
    speculate: bool = True  # False: plain decoding whatever the coordinator's settings
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest (k <= 20)
    grammar: Grammar | None = None  # the output must follow it (JSON of a schema, a tool call): grammar.py
    # The customer account's prefix salt (protocol/prefix.py): the stages may reuse the KV of its
    # earlier requests' prefixes and keep this one's. None: no reuse.
    prefix_salt: bytes | None = None

    @classmethod
    def of(
        cls, prompt_ids: Sequence[int], eos_id: int | None, *, sampling: SamplingParams | None = None, **fields
    ) -> GenerationRequest:
        """A request for ``prompt_ids`` ending at ``eos_id`` (the tokenizer's, if any); ``sampling``
        None is the defaults; ``fields`` as the dataclass takes them."""
        eos = frozenset([eos_id] if eos_id is not None else [])
        return cls(tuple(prompt_ids), sampling=sampling or SamplingParams(), eos_ids=eos, **fields)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")


MAX_TOP_LOGPROBS = 20  # alternatives a token's log-probabilities may list, as OpenAI allows


@dataclass(frozen=True)
class TokenEvent:
    token_id: int | None  # None: the end of the stream released held-back text, no new token
    text: str  # the text this token made final (may be "" while a stop string is still possible)
    at: float  # seconds since the request started
    # When the request asks for them: the token's log-probability under the model (the log-softmax
    # of the target model's logits at its position, before any bias or penalty) and the likeliest
    # tokens there, (token id, log-probability), most likely first.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class Chunk:
    """One step in flight: chain tokens [first, first + count) at position ``start``."""

    id: int
    first: int  # index in the chain of its first token
    count: int
    start: int  # the position of its first token
    void: bool = False  # built on a continuation that was rejected: its result is ignored


@dataclass(frozen=True)
class Fold:
    """What one chunk's result did."""

    events: list[TokenEvent]
    drafted: int  # drafts it verified (rows whose next token was a draft)
    accepted: int  # how many of them were accepted, in order, before the first rejection


class GenerationState:
    def __init__(
        self, request: GenerationRequest, tokenizer, *, clock=time.monotonic, constraint: Constraint | None = None
    ) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.constraint = constraint  # the request's grammar, when it has one (built by the coordinator)
        self.sampler = Sampler(request.sampling)
        self.clock = clock
        self.started = clock()
        self.generated: list[int] = []
        self.token_times: list[float] = []
        self.text = ""  # text streamed so far
        self.finish_reason: str | None = None  # "stop" or "length"
        self.steps = 0  # chunks whose results were folded in (void ones included)
        self.drafted = 0  # drafts verified, over the whole stream
        self.accepted = 0  # drafts accepted
        self.cached = 0  # prompt positions the stages held already when the session opened (prefix reuse)
        self.speculation: dict = {}  # the router's last view (acceptance, round trip, plan), for reports
        self._decoded = ""  # the decoded text of every generated token (held-back text included)
        self._stable_text = ""  # the part of it made of whole characters that no later token changes
        self._pending_text = ""  # the rest: bytes of a character not complete yet
        self._prefix = self._read = 0  # indices into generated: see _decode_tail
        self._reset_chain(list(request.prompt_ids), 0)
        self._chunk_ids = 0
        adjusts = request.sampling.adjusts
        self._prompt_set = frozenset(request.prompt_ids) if adjusts else frozenset()
        self._output_counts: Counter[int] | None = Counter() if adjusts else None  # kept only when read

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def committed(self) -> list[int]:
        """The prompt and every generated token."""
        return list(self.request.prompt_ids) + self.generated

    @property
    def position(self) -> int:
        """Positions the stages hold for this session that are committed (the chain starts here)."""
        return self.chain_start

    @property
    def in_flight(self) -> int:
        return len(self.chunks)

    @property
    def drafts_in_flight(self) -> int:
        """Drafts sent or appended past the committed tokens, not yet verified."""
        return len(self.chain) - self.chain_committed

    def _reset_chain(self, tokens: list[int], start: int) -> None:
        self.chain = tokens  # tokens past what the stages hold committed; the first ``chain_committed`` are committed
        self.chain_start = start  # the position of chain[0]
        self.chain_committed = len(tokens)
        self.sent = 0  # chain tokens sent so far
        self.chunks: deque[Chunk] = deque()

    def start_at(self, held: int) -> None:
        """Begin past the prompt's first ``held`` positions, which the stages hold already (prefix
        reuse): the first chunk sends only the rest. Only before anything was sent, and at least
        one prompt token is left to send (its logits give the first output token)."""
        if self.sent or self.steps or not 0 <= held < len(self.request.prompt_ids):
            raise ValueError(f"cannot start at position {held} of a {len(self.request.prompt_ids)}-token prompt now")
        self._reset_chain(list(self.request.prompt_ids[held:]), held)
        self.cached = held

    def room_for_drafts(self) -> int:
        """Drafts that may still be appended: never past the token budget (the bonus included)."""
        left = self.request.max_tokens - len(self.generated) - self.drafts_in_flight - 1
        return max(0, left)

    def draft_context(self) -> list[int]:
        """What a drafter continues: the committed tokens, then the drafts appended so far."""
        return self.committed + self.chain[self.chain_committed :]

    def next_chunk(self, drafts: list[int] = ()) -> tuple[Chunk, list[int]] | None:  # type: ignore[assignment]
        """Append ``drafts`` to the chain and send its unsent tokens as one chunk; None when there
        is nothing to send (every chain token is in flight and no draft came)."""
        if self.done:
            return None
        drafts = list(drafts[: self.room_for_drafts()])
        if self.constraint is not None and drafts:  # cut at the first draft the grammar refuses
            pending = self.chain[self.chain_committed :]  # drafts appended before, not verified yet
            valid = self.constraint.valid_prefix(pending + drafts) - len(pending)
            drafts = drafts[: max(0, valid)]
        self.chain.extend(drafts)
        count = len(self.chain) - self.sent
        if count == 0:
            return None
        self._chunk_ids += 1
        chunk = Chunk(self._chunk_ids, self.sent, count, self.chain_start + self.sent)
        tokens = self.chain[self.sent :]
        self.sent = len(self.chain)
        self.chunks.append(chunk)
        return chunk, tokens

    def rows_needed(self, chunk: Chunk) -> int:
        """How many of the chunk's last rows ``fold`` needs logits of: rows of committed tokens
        (a prompt's) predict nothing new, except the last of them."""
        first_useful = max(chunk.first, self.chain_committed - 1) if not chunk.void else chunk.first + chunk.count
        return max(0, chunk.first + chunk.count - first_useful)

    def rewind(self) -> None:
        """Start over on a fresh route (a heal): its stages hold nothing of this session, so the
        next input is the prompt and every committed token, from position 0. Drafts in flight are
        dropped; the sampler is not touched: the lost chunks' logits were never sampled."""
        self._reset_chain(self.committed, 0)
        self.cached = 0  # the healed route computes every position again

    def fold(self, chunk: Chunk, logits: torch.Tensor | None) -> Fold:
        """Fold a chunk's result in: ``logits`` holds its last ``rows_needed(chunk)`` rows. (rows, vocab)

        Chunks come back in the order they were sent; a void one (or any after the stream ended)
        changes nothing."""
        self.steps += 1
        if chunk.void:  # no longer among the chunks in flight: a rejection or the stream's end voided it
            return Fold([], 0, 0)
        head = self.chunks.popleft()
        assert head is chunk, "chunks are folded in the order they were sent"
        rows = self.rows_needed(chunk)
        assert logits is not None and logits.shape[0] == rows, "fold needs the rows rows_needed() names"
        first = chunk.first + chunk.count - rows
        events: list[TokenEvent] = []
        drafted = accepted = 0
        for offset in range(rows):
            index = first + offset  # this row's chain token; it predicts chain[index + 1]
            draft = self.chain[index + 1] if index + 1 < len(self.chain) else None
            row = logits[offset] if self.constraint is None else self.constraint.apply(logits[offset])
            token, ok = self.sampler.verify(row, draft, self.chain_start + index + 1, self._history())
            if draft is not None:
                drafted += 1
                accepted += ok
            event = self._commit(token, self._logprobs(logits[offset], token))
            if event is not None:
                events.append(event)
            if draft is not None and ok:
                self.chain_committed += 1
                if self.done:
                    break
                continue
            # A rejection or a bonus: the chain ends here and a new one starts from ``token``.
            for later in self.chunks:
                later.void = True
            self._reset_chain([token], self.chain_start + index + 1)
            break
        if self.done:  # nothing built past the end counts
            for later in self.chunks:
                later.void = True
            self.chunks = deque()
        self.drafted += drafted
        self.accepted += accepted
        return Fold(events, drafted, accepted)

    def _history(self) -> History | None:
        """What the next position's adjustments look at (None when the request sets none)."""
        if self._output_counts is None:
            return None
        return History(self._prompt_set, self._output_counts)

    def _logprobs(self, logits: torch.Tensor, token: int) -> tuple[float, tuple[tuple[int, float], ...]] | None:
        """The token's log-probability at this row and the likeliest alternatives, if asked for. (vocab,)"""
        if self.request.logprobs is None:
            return None
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logprobs, self.request.logprobs) if self.request.logprobs else None
        alternatives = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        return float(logprobs[token]), alternatives

    def _commit(
        self, token: int, logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None
    ) -> TokenEvent | None:
        """Commit one token: EOS ends the stream, a stop string cuts the text, the budget stops it."""
        now = self.clock() - self.started
        if token in self.request.eos_ids:
            self.finish_reason = "stop"
            return self._flush(now)
        self.generated.append(token)
        self.token_times.append(now)
        if self._output_counts is not None:
            self._output_counts[token] += 1
        if self.constraint is not None:
            self.constraint.consume(token)
        self._decode_tail()
        full = self._decoded
        for stop in self.request.stop:
            # Only the end can hold a new match: what was streamed was checked already.
            cut = full.find(stop, max(0, len(self.text) - len(stop)))
            if cut != -1:
                self.finish_reason = "stop"
                return self._emit(token, full[:cut], now, logprobs)
        if self.constraint is not None and self.constraint.stopped:  # the JSON is complete
            self.finish_reason = "stop"
            return self._emit(token, full, now, logprobs)
        if len(self.generated) >= self.request.max_tokens:
            self.finish_reason = "length"
            return self._emit(token, full, now, logprobs)
        return self._emit(token, self._stable_prefix(full), now, logprobs)

    def _decode_tail(self) -> None:
        """Extend the decoded text by the newest token, decoding a few tokens only (O(1) per token):
        the text of generated[prefix:] minus that of generated[prefix:read], so a tokenizer that
        treats a sequence's first token specially does it alike on both sides. Bytes that do not
        make a whole character yet stay pending until the tokens that complete it come."""
        before = self.tokenizer.decode(self.generated[self._prefix : self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.generated[self._prefix :], skip_special_tokens=True)
        new = after[len(before) :] if after.startswith(before) else ""
        if new and not after.endswith("\ufffd"):
            self._stable_text += new
            self._pending_text = ""
            self._prefix, self._read = self._read, len(self.generated)
        else:
            self._pending_text = new
        self._decoded = self._stable_text + self._pending_text

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

    def _emit(
        self, token: int | None, text: str, now: float, logprobs: tuple[float, tuple] | None = None
    ) -> TokenEvent:
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text = text if text.startswith(self.text) else self.text
        if logprobs is None:
            return TokenEvent(token, delta, now)
        return TokenEvent(token, delta, now, logprobs[0], logprobs[1])

    def _flush(self, now: float) -> TokenEvent | None:
        """At EOS: release text held back for a possible stop string, if any."""
        event = self._emit(None, self._decoded, now)
        return event if event.text else None
