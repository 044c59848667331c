"""The coordinator's side of the data plane: one connection per stage, ring or star routing.

``Pipeline.forward`` takes one session step (token rows of hidden states) and returns the last
stage's output for it. Steps of concurrent sessions issued in the same event-loop turn are
coalesced into one FORWARD frame, so stages see them together and batch them.

- ``ring``: the coordinator sends to the first stage; each stage forwards to its successor
  (with a ticket the coordinator handed it in HELLO); the last returns RESULT straight to the
  coordinator over the coordinator's own connection to it.
- ``star``: the coordinator relays each stage's RESULT to the next stage itself (works when
  agents cannot reach each other).

Hashes of exactly the bytes sent to the first stage and received from the last are kept per
session: they are the transcript that the stages' receipts must match.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field

import websockets
from websockets.asyncio.client import ClientConnection, connect

from worker_agent import wire
from worker_agent.errors import StageError, WireError
from worker_agent.receipts import digest
from worker_agent.wan import WanLink, WanProfile

CONNECT_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 30.0  # HELLO/OPEN/CLOSE answers
STEP_TIMEOUT_S = 120.0  # one step through the whole pipeline


@dataclass(frozen=True)
class StageSpec:
    url: str
    ticket: bytes | None = None  # signed by the control plane (or a local issuer)


@dataclass
class Transcript:
    sent: list[bytes] = field(default_factory=list)  # per step: digest of bytes sent to the first stage
    received: list[bytes] = field(default_factory=list)  # per step: digest of bytes from the last stage


class StageLink:
    """One stage connection: HELLO, request/answer pairs, and a reader dispatching frames."""

    def __init__(self, index: int, spec: StageSpec, pipeline: Pipeline) -> None:
        self.index = index
        self.spec = spec
        self.pipeline = pipeline
        self.ws: ClientConnection | None = None
        self.link: WanLink | None = None
        self.seq = 0
        self.info: dict = {}
        self.bytes_sent = 0
        self._replies: dict[tuple[str, tuple[str, ...]], asyncio.Future] = {}  # (type, sessions) -> waiter
        self._reader: asyncio.Task | None = None

    async def connect(self, job: str, topology: str, next_url: str | None, next_ticket: bytes | None) -> dict:
        self.ws = await asyncio.wait_for(
            connect(self.spec.url, max_size=2 * wire.DEFAULT_MAX_FRAME, compression=None, open_timeout=None),
            CONNECT_TIMEOUT_S,
        )
        self.link = WanLink(self.ws.send, self.pipeline.wan)
        await self.send(
            wire.Hello(job=job, ticket=self.spec.ticket, topology=topology, next_url=next_url, next_ticket=next_ticket)
        )
        frame = wire.decode(await asyncio.wait_for(self.ws.recv(), REPLY_TIMEOUT_S))
        if isinstance(frame.message, wire.Error):
            raise StageError(
                f"stage {self.index} ({self.spec.url}) refused HELLO: {frame.message.message}", code=frame.message.code
            )
        if not isinstance(frame.message, wire.Hello):
            raise StageError(f"stage {self.index} answered HELLO with {type(frame.message).__name__}")
        self.info = frame.message.info
        self._reader = asyncio.create_task(self._read())
        return self.info

    async def send(self, message: wire.Message) -> None:
        assert self.link is not None
        self.seq += 1
        data = wire.encode(message, self.seq)
        self.bytes_sent += len(data)
        await self.link.send(data)

    async def request(self, message: wire.Open | wire.Close) -> wire.Message:
        """Send OPEN or CLOSE and wait for the stage's answer for the same sessions."""
        key = (type(message).__name__, message.sessions)
        future = asyncio.get_running_loop().create_future()
        self._replies[key] = future
        try:
            await self.send(message)
            return await asyncio.wait_for(future, REPLY_TIMEOUT_S)
        except TimeoutError:
            raise StageError(
                f"stage {self.index} did not answer {key[0].upper()} in {REPLY_TIMEOUT_S:g}s", code="stage_timeout"
            ) from None
        finally:
            self._replies.pop(key, None)

    async def _read(self) -> None:
        assert self.ws is not None
        try:
            async for data in self.ws:
                frame = wire.decode(data)
                self.pipeline.bytes_received += frame.size
                self._dispatch(frame.message)
        except (websockets.ConnectionClosed, WireError, OSError) as exc:
            error = StageError(f"stage {self.index} connection lost: {exc}", code="stage_lost")
            self.pipeline.fail_all(error)
            for future in self._replies.values():
                if not future.done():
                    future.set_exception(error)

    def _dispatch(self, message: wire.Message) -> None:
        match message:
            case wire.Result():
                self.pipeline.on_result(self.index, message)
            case wire.Error():
                error = StageError(f"stage {self.index} ({self.spec.url}): {message.message}", code=message.code)
                waiting = [
                    future
                    for (_, sessions), future in self._replies.items()
                    if not future.done() and (message.session is None or message.session in sessions)
                ]
                failed = message.session is not None and self.pipeline.fail_session(message.session, error)
                for future in waiting:
                    future.set_exception(error)
                if not waiting and not failed:
                    self.pipeline.fail_all(error)
            case wire.Open() | wire.Close():
                future = self._replies.get((type(message).__name__, message.sessions))
                if future is not None and not future.done():
                    future.set_result(message)

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self.link is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.link.drain(), 5)
            await self.link.aclose()
        if self.ws is not None:
            await self.ws.close()


class Pipeline:
    def __init__(
        self,
        job: str,
        stages: list[StageSpec],
        *,
        topology: str = "ring",
        wan: WanProfile | None = None,
        dtype: str = "f32",
    ) -> None:
        if topology not in ("ring", "star"):
            raise ValueError(f"topology must be 'ring' or 'star', got {topology!r}")
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        self.job = job
        self.topology = topology
        self.wan = wan or WanProfile()
        self.dtype = dtype
        self.links = [StageLink(i, spec, self) for i, spec in enumerate(stages)]
        self.transcripts: dict[str, Transcript] = {}
        self.bytes_received = 0
        self._waiting: dict[tuple[str, int], asyncio.Future] = {}
        self._outbox: list[tuple[wire.Item, bytes]] = []
        self._flush_scheduled = False
        self._steps: dict[str, int] = {}
        self._session_ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def bytes_sent(self) -> int:
        return sum(link.bytes_sent for link in self.links)

    async def connect(self) -> list[dict]:
        """HELLO every stage; returns each stage's identity (node, key, model, span)."""
        for index, link in enumerate(self.links):
            ring_next = self.links[index + 1].spec if self.topology == "ring" and index + 1 < len(self.links) else None
            await link.connect(
                self.job, self.topology, ring_next.url if ring_next else None, ring_next.ticket if ring_next else None
            )
        return [link.info for link in self.links]

    async def open(self, sessions: list[str]) -> None:
        await asyncio.gather(*(link.request(wire.Open(self.job, tuple(sessions))) for link in self.links))
        for session in sessions:
            self.transcripts[session] = Transcript()
            self._steps[session] = 0

    async def close(self, sessions: list[str]) -> list[dict]:
        """Close sessions everywhere; returns all stages' receipts (wire dicts)."""
        replies = await asyncio.gather(*(link.request(wire.Close(self.job, tuple(sessions))) for link in self.links))
        return [receipt for reply in replies for receipt in reply.receipts]

    def new_session_id(self) -> str:
        return f"s{next(self._session_ids)}"

    async def forward(self, session: str, start: int, count: int, payload: bytes) -> bytes:
        """Run ``count`` token rows of one session through every stage; the last stage's bytes."""
        step = self._steps[session]
        self._steps[session] = step + 1
        future = asyncio.get_running_loop().create_future()
        self._waiting[(session, step)] = future
        self.transcripts[session].sent.append(digest(payload))
        self._outbox.append((wire.Item(session, step, start, count), payload))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(lambda: self._spawn(self._flush()))
        try:
            return await asyncio.wait_for(future, STEP_TIMEOUT_S)
        except TimeoutError:
            raise StageError(
                f"session {session} step {step} got no result in {STEP_TIMEOUT_S:g}s", code="step_timeout"
            ) from None
        finally:
            self._waiting.pop((session, step), None)

    async def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._outbox = self._outbox, []
        if not batch:
            return
        items = tuple(item for item, _ in batch)
        rows = sum(item.count for item in items)
        hidden = len(batch[0][1]) // (batch[0][0].count * wire.DTYPES[self.dtype].itemsize)
        frame = wire.Forward(self.job, items, self.dtype, (rows, hidden), b"".join(p for _, p in batch))
        try:
            await self.links[0].send(frame)
        except Exception as exc:  # the connection is gone: every waiter learns it
            self.fail_all(StageError(f"cannot send to stage 0: {exc}", code="stage_lost"))

    def on_result(self, index: int, result: wire.Result) -> None:
        if self.topology == "star" and index + 1 < len(self.links):
            relay = wire.Forward(result.job, result.items, result.dtype, result.shape, result.payload)
            self._spawn(self._relay(index + 1, relay))
            return
        for item, chunk in zip(result.items, result.item_bytes(), strict=True):
            future = self._waiting.get((item.session, item.step))
            if future is not None and not future.done():
                self.transcripts[item.session].received.append(digest(chunk))
                future.set_result(chunk)

    async def _relay(self, index: int, frame: wire.Forward) -> None:
        try:
            await self.links[index].send(frame)
        except Exception as exc:
            self.fail_all(StageError(f"cannot send to stage {index}: {exc}", code="stage_lost"))

    def fail_session(self, session: str, error: Exception) -> bool:
        failed = False
        for (name, _), future in list(self._waiting.items()):
            if name == session and not future.done():
                future.set_exception(error)
                failed = True
        return failed

    def fail_all(self, error: Exception) -> None:
        for future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(error)

    async def aclose(self) -> None:
        await asyncio.gather(*(link.aclose() for link in self.links), return_exceptions=True)
