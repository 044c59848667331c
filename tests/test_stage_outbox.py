"""A stage's compute loop serves every job and waits on none of their connections.

Each job's outputs go out in order on a sender task of its own (``StageServer._hand_on``). Here
one stage (tiny-llama, in process, the real wire protocol) serves two jobs: job A's ring successor
accepts the TCP connection and never answers its WebSocket handshake (a successor on a starved host,
or one that withholds its HELLO), job B is the last stage of its ring and answers its coordinator.
Job B's result must come back at once while job A's output waits for its successor, and A's
coordinator then hears why (``next_unreachable``). Sent from the compute loop itself, A's wait held
up B's output for the whole HELLO timeout, and B's coordinator blamed this stage for a stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from tests.wire_client import raw_client
from worker_agent import model as models
from worker_agent import server as stage_server
from worker_agent.block import Block
from worker_agent.protocol import wire
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.server import StageServer
from worker_agent.stage import Stage

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"
HELLO_TIMEOUT_S = 6.0  # the successor's HELLO wait, shortened for the test


async def tarpit() -> tuple[asyncio.Server, int]:
    """A TCP server that accepts and never says a word: a WebSocket handshake to it hangs."""
    held: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda reader, writer: held.append(writer), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def one_step(client, job: str, hidden: int) -> None:
    """Open session ``s`` of ``job`` and send its first step: two token rows."""
    await client.send(wire.Open(job, ("s",)))
    assert isinstance(await client.recv(), wire.Open)
    payload = bytes(2 * hidden * 4)  # two rows of zeros, float32
    await client.send(wire.Forward(job, (wire.Item("s", 0, 0, 2),), "f32", (2, hidden), payload))


def test_a_job_whose_successor_never_answers_holds_up_no_other_job(monkeypatch):
    monkeypatch.setattr(stage_server, "HELLO_TIMEOUT_S", HELLO_TIMEOUT_S)

    async def scenario() -> tuple[wire.Message, float, wire.Message, float]:
        stage = Stage(
            Block(models.load_block(MODEL, 0, 6)), model=MODEL, signing_key=generate_signing_key(), insecure_open=True
        )
        hidden = models.load_config(MODEL).hidden_size
        pit, pit_port = await tarpit()
        bound = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(StageServer(stage).serve("127.0.0.1", 0, ready=bound.set_result))
        url = f"ws://127.0.0.1:{await asyncio.wait_for(bound, 30)}"
        try:
            async with raw_client(url) as a, raw_client(url) as b:
                await a.hello("job-a", None, topology="ring", next_url=f"ws://127.0.0.1:{pit_port}")
                await b.hello("job-b", None, topology="ring")  # no successor: it answers its coordinator
                started = time.monotonic()

                async def timed(receive) -> tuple[wire.Message, float]:
                    message = await receive()
                    return message, time.monotonic() - started

                await one_step(a, "job-a", hidden)
                refused = asyncio.create_task(timed(a.recv))  # A's output cannot go on: its coordinator hears why
                await one_step(b, "job-b", hidden)
                answer, answered_s = await timed(b.recv)
                refusal, refused_s = await refused
                return answer, answered_s, refusal, refused_s
        finally:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
            pit.close()

    answer, answered_s, refusal, refused_s = asyncio.run(asyncio.wait_for(scenario(), 120))

    assert isinstance(answer, wire.Result) and answer.job == "job-b"
    assert isinstance(refusal, wire.Error) and refusal.code == "next_unreachable"
    assert refusal.message.endswith(f"no answer within {HELLO_TIMEOUT_S:g}s")
    # B's answer came before A's wait for its successor ended: it did not wait behind it.
    assert answered_s < refused_s
