"""The coordinator's share of the model, batched across sessions.

Every session of a job needs the embeddings of its next tokens and the LM head over its last
hidden state. Requests made in the same event-loop turn (sessions whose results came back
together) run as one batch in one worker thread: one embedding lookup, one (rows x vocab)
matrix product instead of one per session, which matters because reading the LM head's weights
dominates a decode step's cost here. Their continuations then issue their next pipeline steps in
the same turn, so those travel in one FORWARD frame and the stages batch them too.

The batcher is shared by every coordinator of an event loop (``HeadBatcher.shared``): a
coordinator worker runs all its jobs on one loop, so their decode steps share the head's passes
too, and requests that arrive while a pass runs wait for it and go together in the next one. A
request whose output cannot hold its rows is refused alone, never failing the others' batch.
"""

from __future__ import annotations

import asyncio
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from worker_agent.model import Head
from worker_agent.protocol.wire import DTYPES, tensor_payload

# Each event loop's batchers, by head and wire dtype; they go with their loop.
_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.WeakKeyDictionary[Head, dict[str, HeadBatcher]]]
_shared = weakref.WeakKeyDictionary()


class HeadBatcher:
    @classmethod
    def shared(cls, head: Head, dtype: str) -> HeadBatcher:
        """The running event loop's batcher for ``head`` with ``dtype`` on the wire."""
        by_head = _shared.setdefault(asyncio.get_running_loop(), weakref.WeakKeyDictionary())
        by_dtype = by_head.setdefault(head, {})
        if dtype not in by_dtype:
            by_dtype[dtype] = cls(head, dtype)
        return by_dtype[dtype]

    def __init__(self, head: Head, dtype: str) -> None:
        self.head = head
        self.dtype = dtype
        self.row_bytes = head.embed.embedding_dim * DTYPES[dtype].itemsize
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="head")
        self._embeds: list[tuple[list[int], asyncio.Future]] = []
        self._logits: list[tuple[tuple[bytes, int], asyncio.Future]] = []  # ((last rows' bytes, rows), waiter)
        self._scheduled = False
        self._running = False  # a pass is in the worker thread: new requests wait for the next
        self.batches = 0  # head passes run
        self.rows = 0  # rows they covered (embedding rows + logits rows)

    async def embed(self, token_ids: list[int]) -> bytes:
        """Wire bytes of the embeddings of ``token_ids``. (tokens, hidden)"""
        future = asyncio.get_running_loop().create_future()
        self._embeds.append((token_ids, future))
        self._schedule()
        return await future

    async def logits(self, output: bytes) -> torch.Tensor:
        """Logits of the last row of a stage output. (vocab,)"""
        return (await self.logits_rows(output, 1))[0]

    async def logits_rows(self, output: bytes, rows: int) -> torch.Tensor:
        """Logits of the last ``rows`` rows of a stage output (a speculative chunk's). (rows, vocab)"""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        if len(output) < rows * self.row_bytes or len(output) % self.row_bytes:
            raise ValueError(f"an output of {len(output)} bytes does not hold {rows} rows of {self.row_bytes} bytes")
        future = asyncio.get_running_loop().create_future()
        self._logits.append(((output[-rows * self.row_bytes :], rows), future))
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if not self._scheduled and not self._running:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        embeds, self._embeds = self._embeds, []
        logits, self._logits = self._logits, []
        if not (embeds or logits):
            return
        self._running = True
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._thread, self._run, [ids for ids, _ in embeds], [row for row, _ in logits])
        work.add_done_callback(lambda done: self._finished(done, embeds, logits))

    def _finished(self, done: asyncio.Future, embeds, logits) -> None:
        self._running = False
        self._deliver(done, embeds, logits)
        if self._embeds or self._logits:  # those that came while the pass ran
            self._schedule()

    def _run(self, embeds: list[list[int]], rows: list[tuple[bytes, int]]) -> tuple[list[bytes], list[torch.Tensor]]:
        self.batches += 1
        self.rows += sum(len(ids) for ids in embeds) + sum(count for _, count in rows)
        embedded = []
        if embeds:
            flat = self.head.embed_tokens([token for ids in embeds for token in ids])  # (all tokens, hidden)
            payload = tensor_payload(flat, self.dtype)
            row = self.row_bytes
            offset = 0
            for ids in embeds:
                embedded.append(payload[offset : offset + len(ids) * row])
                offset += len(ids) * row
        scored = []
        if rows:
            counts = [count for _, count in rows]
            joined = bytearray(b"".join(chunk for chunk, _ in rows))
            hidden = torch.frombuffer(joined, dtype=DTYPES[self.dtype]).view(sum(counts), self.head.embed.embedding_dim)
            scored = list(torch.split(self.head.logits(hidden), counts))  # each (rows, vocab)
        return embedded, scored

    @staticmethod
    def _deliver(done: asyncio.Future, embeds, logits) -> None:
        waiters = [future for _, future in embeds] + [future for _, future in logits]
        if done.cancelled() or done.exception() is not None:
            error = done.exception() if not done.cancelled() else asyncio.CancelledError()
            for future in waiters:
                if not future.done():
                    future.set_exception(error)
            return
        embedded, scored = done.result()
        for value, future in zip(embedded + scored, waiters, strict=True):
            if not future.done():
                future.set_result(value)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
