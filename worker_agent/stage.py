"""A serving stage's state and rules, without I/O.

The server (``server.py``) feeds decoded frames in and sends what comes out; everything it
decides lives here: who may talk to this stage (tickets), which sessions exist, in which
order their steps must come, what each step computed (receipts), and the stage's identity.
The one heavy call, ``compute``, runs the layer block and is meant for a worker thread.

Prefix reuse (``prefixcache.py``): a session may open on positions kept from an earlier one, named
by the keys its OPEN offers; its receipt says how many and from where, and its first step, which
may start below them (its coordinator starts every stage at the fewest any of them holds), cuts them
to where it starts. A CLOSE may list the keys under which the session's cache is kept.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace

import torch

from worker_agent.block import Block, WorkItem
from worker_agent.errors import SessionError, WireError
from worker_agent.kvcache import KVMemory, KVSession, SessionLimits, SessionStore, position_bytes
from worker_agent.prefixcache import PrefixCache, PrefixLimits
from worker_agent.protocol.keys import node_id, public_key_bytes
from worker_agent.protocol.links import BadLink, sign_link, verify_link
from worker_agent.protocol.prefix import PrefixKey
from worker_agent.protocol.receipts import ReceiptBuilder, ReusedFrom, digest
from worker_agent.protocol.span import Span
from worker_agent.protocol.wire import Forward, Item, tensor_payload


@dataclass
class _StageSession:
    kv: KVSession
    receipt: ReceiptBuilder
    next_step: int = 0  # the step index the next FORWARD item of this session must carry
    held: int = 0  # positions its cache holds once every step accepted so far is computed
    source: ReusedFrom | None = None  # where the positions it opened with came from (prefix reuse)


@dataclass(frozen=True)
class Prepared:
    """A validated FORWARD, ready for ``compute``; sessions already advanced their step counter."""

    forward: Forward
    work: tuple[WorkItem, ...]
    input_hashes: tuple[bytes, ...]
    sessions: tuple[_StageSession, ...] = field(repr=False)
    links: tuple[bytes, ...] = ()  # per item: its sender's signature (checked), empty from a coordinator


@dataclass(frozen=True)
class Output:
    """The stage's output for one prepared FORWARD, as the frame that carries it on."""

    items: tuple[Item, ...]
    dtype: str
    shape: tuple[int, int]
    payload: bytes


class Stage:
    def __init__(
        self,
        block: Block,
        *,
        model: str,
        signing_key,
        trusted_keys: Collection[bytes] = (),
        insecure_open: bool = False,
        limits: SessionLimits | None = None,
        memory: KVMemory | None = None,
        prefix_limits: PrefixLimits | None = None,
    ) -> None:
        """``memory``: the agent's memory its sessions' caches are held in (``kvcache.KVMemory``);
        None: no bound but ``limits``. ``prefix_limits``: how much finished sessions' KV it keeps
        for reuse (``prefixcache.py``), in that memory and yielding to live sessions."""
        self.block = block
        self.model = model
        self.signing_key = signing_key
        self.node_key = public_key_bytes(signing_key)
        self.node = node_id(self.node_key)
        self.trusted_keys = frozenset(trusted_keys)
        self.insecure_open = insecure_open
        self.store = SessionStore(limits or SessionLimits(), memory=memory)
        self.prefixes = PrefixCache(prefix_limits, memory=memory)
        self._sessions: dict[tuple[str, str], _StageSession] = {}
        self.started = time.time()
        self.steps_served = 0
        self.tokens_served = 0
        self.compute_seconds = 0.0  # wall time spent in the block's forward passes

    @property
    def layer_start(self) -> int:
        return self.block.weights.layer_start

    @property
    def layer_end(self) -> int:
        return self.block.weights.layer_end

    @property
    def span(self) -> Span:
        """Which stage this is: the model and the layers it serves (an agent's key for it)."""
        return Span(self.model, self.layer_start, self.layer_end)

    def info(self) -> dict:
        """Public identity and load, sent in HELLO and PONG replies."""
        return {
            "node": self.node,
            "node_key": self.node_key.hex(),
            "model": self.model,
            "layer_start": self.layer_start,
            "layer_end": self.layer_end,
            "hidden_size": self.block.hidden_size,
            "dtype": str(self.block.weights.dtype).removeprefix("torch."),
            "sessions": len(self.store),
            "tokens_served": self.tokens_served,
            "uptime_s": round(time.time() - self.started, 1),
        }

    def open(
        self, job: str, sessions: tuple[str, ...], offers: tuple[tuple[PrefixKey, ...], ...] = ()
    ) -> tuple[int, ...]:
        """Open all the sessions or none: every check runs before anything changes. ``offers``: per
        session, the keys of its prompt's prefixes (none: no reuse); returns per session the
        positions it holds already, kept from an earlier session."""
        self.evict_idle()
        self.store.check_can_open(job, sessions)
        reused = []
        for index, session in enumerate(sessions):
            kv = self.store.open(job, session)
            receipt = ReceiptBuilder(
                job=job,
                session=session,
                node=self.node,
                node_key=self.node_key,
                model=self.model,
                layer_start=self.layer_start,
                layer_end=self.layer_end,
            )
            positions, source = self.prefixes.reuse(kv, offers[index]) if index < len(offers) else (0, None)
            receipt.reuse(positions, source)
            self._sessions[(job, session)] = _StageSession(kv, receipt, held=positions, source=source)
            reused.append(positions)
        return tuple(reused)

    def prepare(self, forward: Forward, sender_key: bytes | None = None) -> Prepared:
        """Validate a FORWARD against the sessions; raises SessionError/WireError, changing nothing.

        ``sender_key``: the frame came from a ring predecessor whose pass names this key, so every
        item must carry its signature over its bytes (links.py). Otherwise (the coordinator sent it,
        or a pass names no key) the items' signatures are not checked here. Either way the receipt
        keeps each item's signature as the evidence of what was received."""
        if forward.shape[1] != self.block.hidden_size:
            raise WireError(f"hidden size {forward.shape[1]} != {self.block.hidden_size}", code="bad_shape")
        states, needed = [], 0
        size = position_bytes(self.block.layout)
        for item in forward.items:
            self.store.get(forward.job, item.session)  # raises unknown/evicted
            state = self._sessions[(forward.job, item.session)]
            if item.step != state.next_step:
                code = "replayed_seq" if item.step < state.next_step else "step_gap"
                raise SessionError(
                    f"session {item.session!r} expects step {state.next_step}, got {item.step}", code=code
                )
            needed += self.store.check_room(state.kv, item.start, item.count, held=state.held, position_bytes=size)
            states.append(state)
        if self.store.memory is not None and needed:  # the frame's sessions together
            self.store.memory.check(needed, ", ".join(sorted({item.session for item in forward.items})))
        hashes = tuple(digest(chunk) for chunk in forward.item_bytes())
        if sender_key:
            for item, item_hash in zip(forward.items, hashes, strict=True):
                try:
                    verify_link(sender_key, item.sig, forward.job, item.session, item.step, item_hash)
                except BadLink as exc:
                    raise WireError(f"refused from the ring predecessor: {exc}", code=exc.code) from None
        # Kept as evidence either way: the coordinator relays a predecessor's signed output when that
        # predecessor withheld it (and in star), and a receipt verifier checks every link it reads.
        links = tuple(item.sig for item in forward.items)
        tensor = forward.tensor()
        work, row = [], 0
        for item, state in zip(forward.items, states, strict=True):
            if state.next_step == 0 and item.start < state.receipt.reused:
                # The first step truncates what the session opened with: it reused only what lies before.
                state.receipt.reuse(item.start, state.source if item.start else None)
            work.append(WorkItem(state.kv, item.start, tensor[row : row + item.count]))
            row += item.count
            state.next_step += 1
            state.held = item.start + item.count
        return Prepared(forward, tuple(work), hashes, tuple(states), links)

    def compute(self, batch: list[Prepared]) -> list[list[torch.Tensor]]:
        """Run the block over every item of every prepared frame (worker thread): items of different
        sessions at once, a session's later steps (speculative chunks sent back to back) in later
        waves, since each one extends or truncates the cache the one before it left."""
        flat = [work for prepared in batch for work in prepared.work]
        waves: list[list[int]] = []  # item indices; a session appears at most once per wave
        seen: dict[int, int] = {}  # id(session's cache) -> items of it so far
        for index, work in enumerate(flat):
            wave = seen.get(id(work.session), 0)
            seen[id(work.session)] = wave + 1
            if wave == len(waves):
                waves.append([])
            waves[wave].append(index)
        started = time.perf_counter()
        outputs: list[torch.Tensor] = [None] * len(flat)  # type: ignore[list-item]
        for members in waves:
            results = self.block.forward([flat[index] for index in members])
            for member, result in zip(members, results, strict=True):
                outputs[member] = result
        self.compute_seconds += time.perf_counter() - started
        grouped, index = [], 0
        for prepared in batch:
            grouped.append(outputs[index : index + len(prepared.work)])
            index += len(prepared.work)
        return grouped

    def finish(self, prepared: Prepared, outputs: list[torch.Tensor]) -> Output:
        """Serialize outputs in the frame's dtype, record each step in the session's receipt, and
        sign each output item (links.py): the successor, the tap and the RESULT all carry it."""
        forward = prepared.forward
        dtype = forward.dtype
        chunks = [tensor_payload(out, dtype) for out in outputs]
        items = []
        for state, item, chunk, in_hash, link in zip(
            prepared.sessions, forward.items, chunks, prepared.input_hashes, prepared.links, strict=True
        ):
            out_hash = digest(chunk)
            state.receipt.add_step(in_hash, out_hash, item.count, link)
            items.append(replace(item, sig=sign_link(self.signing_key, forward.job, item.session, item.step, out_hash)))
            self.steps_served += 1
            self.tokens_served += item.count
        return Output(tuple(items), dtype, forward.shape, b"".join(chunks))

    def close(self, job: str, sessions: tuple[str, ...], keep: tuple[tuple[PrefixKey, ...], ...] = ()) -> list[dict]:
        """Close sessions and return their signed receipts (as wire dicts); all or none. ``keep``: per
        session, the keys of its committed sequence's prefixes its cache may be kept under."""
        for session in sessions:
            self.store.get(job, session)  # raises unknown/evicted before anything is closed
        receipts = []
        for index, session in enumerate(sessions):
            kv = self.store.close(job, session)
            state = self._sessions.pop((job, session))
            receipt = state.receipt.sign(self.signing_key)
            receipts.append(receipt.to_dict())
            if index < len(keep) and keep[index]:
                self.prefixes.keep(kv, keep[index], ReusedFrom(job, session, receipt.chain_head))
        return receipts

    def drop_job(self, job: str) -> int:
        """Forget every session of a job whose coordinator went away; returns how many."""
        closed = self.store.close_job(job)
        for kv in closed:
            self._sessions.pop((job, kv.session), None)
        return len(closed)

    def evict_idle(self) -> int:
        evicted = self.store.evict_idle()
        for kv in evicted:
            self._sessions.pop((kv.job, kv.session), None)
        return len(evicted)
