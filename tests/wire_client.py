"""A raw data-plane client for tests: one frame at a time, no coordinator logic in between.

It lets a test say exactly what an agent receives (including frames no real coordinator would
send) and read exactly what comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgpack
from nacl.signing import SigningKey
from websockets.asyncio.client import ClientConnection, connect

from worker_agent.protocol import wire
from worker_agent.protocol.tickets import prove_coordinator

REPLY_TIMEOUT_S = 30.0


def raw_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """A frame from a hand-written header, to send what ``wire.encode`` would never produce."""
    return msgpack.packb(header, use_bin_type=True) + payload


def forward_header(seq: int, job: str, items: list[list], *, rows: int, hidden: int, dtype: str = "f32") -> dict:
    """The header of a FORWARD frame; ``items`` are ``[session, step, start, count]`` lists."""
    return {"v": 1, "type": "FORWARD", "seq": seq, "job": job, "dtype": dtype, "shape": [rows, hidden], "items": items}


class RawClient:
    """One WebSocket to an agent; counts its own outgoing seq like a coordinator does."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.seq = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    async def send(self, message: wire.Message, *, seq: int | None = None) -> int:
        """Encode and send; ``seq`` overrides the counter (which then stays where it was)."""
        used = self.next_seq() if seq is None else seq
        await self.ws.send(wire.encode(message, used))
        return used

    async def send_raw(self, data: bytes | str) -> None:
        """Send bytes as a binary frame, or a str as a text frame."""
        await self.ws.send(data)

    async def recv_frame(self) -> wire.Frame:
        return wire.decode(await asyncio.wait_for(self.ws.recv(), REPLY_TIMEOUT_S))

    async def recv(self) -> wire.Message:
        return (await self.recv_frame()).message

    async def hello(
        self,
        job: str,
        ticket: bytes | None,
        *,
        role: str = "coordinator",
        topology: str = "star",
        key: SigningKey | None = None,
        next_url: str | None = None,
        next_ticket: bytes | None = None,
        proof: bytes | None = None,
    ) -> wire.Message:
        """Say HELLO; with ``key`` (the job's coordinator key) it carries a fresh proof of that key,
        and a peer's carries ``proof`` (its signature over its pass, ``links.peer_proof``)."""
        if key is not None and ticket is not None:
            proof = prove_coordinator(key, ticket)
        hello = wire.Hello(
            job=job,
            role=role,
            ticket=ticket,
            topology=topology,
            proof=proof,
            next_url=next_url,
            next_ticket=next_ticket,
        )
        await self.send(hello)
        return await self.recv()

    async def ping(self, nonce: int) -> wire.Message:
        """A round trip that also proves nothing else was queued before its answer."""
        await self.send(wire.Ping(nonce))
        return await self.recv()


@contextlib.asynccontextmanager
async def raw_client(url: str) -> AsyncIterator[RawClient]:
    ws = await asyncio.wait_for(connect(url, max_size=None, compression=None), REPLY_TIMEOUT_S)
    try:
        yield RawClient(ws)
    finally:
        await ws.close()
