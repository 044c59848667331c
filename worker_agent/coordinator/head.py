"""The coordinator's share of the model, for a whole batch of steps at once.

Every session of a job needs the embeddings of its next tokens and the LM head over its last
hidden states. The engine (``engine.py``) asks for all of a step's embeddings in one call and all
of its logits in one call: one embedding lookup and one (rows x vocab) matrix product for every
session of the step, which matters because reading the LM head's weights dominates a decode
step's cost here. The work runs in the process's one head thread, so the passes of the jobs a
coordinator worker runs at once take turns instead of competing for the cores.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from worker_agent.cpu import MODEL_CPU
from worker_agent.model import Head
from worker_agent.protocol.wire import DTYPES, tensor_payload

_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="head")


class HeadRunner:
    def __init__(self, head: Head, dtype: str) -> None:
        self.head = head
        self.dtype = dtype
        self.row_bytes = head.embed.embedding_dim * DTYPES[dtype].itemsize
        self.passes = 0  # head passes run
        self.rows = 0  # rows they covered (embedding rows + logits rows)

    async def embed(self, token_ids: list[list[int]]) -> list[bytes]:
        """Wire bytes of the embeddings of each list of tokens, in one pass. Each (tokens, hidden)."""
        if not token_ids:
            return []
        return await asyncio.get_running_loop().run_in_executor(_THREAD, self._embed, token_ids)

    async def logits(self, outputs: list[tuple[bytes, int]]) -> list[torch.Tensor]:
        """Logits of the last ``rows`` rows of each stage output (bytes, rows), in one pass. Each
        (rows, vocab). An output that cannot hold its rows raises ValueError before anything runs."""
        for output, rows in outputs:
            if rows < 1:
                raise ValueError(f"rows must be >= 1, got {rows}")
            if len(output) < rows * self.row_bytes or len(output) % self.row_bytes:
                raise ValueError(
                    f"an output of {len(output)} bytes does not hold {rows} rows of {self.row_bytes} bytes"
                )
        if not outputs:
            return []
        return await asyncio.get_running_loop().run_in_executor(_THREAD, self._logits, outputs)

    def _embed(self, token_ids: list[list[int]]) -> list[bytes]:
        with MODEL_CPU.measure("embed"):
            return self._embed_now(token_ids)

    def _embed_now(self, token_ids: list[list[int]]) -> list[bytes]:
        self.passes += 1
        self.rows += sum(len(ids) for ids in token_ids)
        flat = self.head.embed_tokens([token for ids in token_ids for token in ids])  # (all tokens, hidden)
        payload = tensor_payload(flat, self.dtype)
        embedded, offset = [], 0
        for ids in token_ids:
            embedded.append(payload[offset : offset + len(ids) * self.row_bytes])
            offset += len(ids) * self.row_bytes
        return embedded

    def _logits(self, outputs: list[tuple[bytes, int]]) -> list[torch.Tensor]:
        with MODEL_CPU.measure("head"):
            return self._logits_now(outputs)

    def _logits_now(self, outputs: list[tuple[bytes, int]]) -> list[torch.Tensor]:
        self.passes += 1
        counts = [rows for _, rows in outputs]
        self.rows += sum(counts)
        joined = bytearray(b"".join(output[-rows * self.row_bytes :] for output, rows in outputs))
        hidden = torch.frombuffer(joined, dtype=DTYPES[self.dtype]).view(sum(counts), self.head.embed.embedding_dim)
        return list(torch.split(self.head.logits(hidden), counts))  # each (rows, vocab)
