"""Bounded frames against hostile peers, on the real wire protocol.

An agent decodes only small frames before a HELLO and never unpacks a header beyond the wire's
limits, and it decodes large frames off its event loop: a msgpack bomb costs it no memory to
speak of and PINGs keep being answered. A coordinator and a ring stage read only a small HELLO
from a stage, and a stage's oversize or malformed frame is blamed on that stage. Link probes
refuse large replies and URLs a target cannot have.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psutil
import pytest
import torch
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from tests.live import wait_for
from tests.wire_client import forward_header, raw_client, raw_frame
from worker_agent.agent.probes import probe_link, probe_url
from worker_agent.coordinator.pipeline import Pipeline, StageSpec
from worker_agent.dev.local import LocalSwarm
from worker_agent.errors import StageError
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol import wire

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"
HIDDEN = 64
SCENARIO_TIMEOUT_S = 120.0
MIB = 1024 * 1024
# The swarm's log line: UTC time to the millisecond, level, logger, request and job ids, message.
UTC_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) \S+ request=\S+ job=\S+ ")
RSS_BOUND = 200 * MIB  # growth an agent may show after the attack: generous, far below the bomb's


@pytest.fixture(scope="module")
def agent():
    with LocalSwarm(MODEL, [(0, 6)], threads=1) as swarm:
        yield swarm


def _run(coro: Awaitable[Any]) -> Any:
    async def bounded():
        return await asyncio.wait_for(coro, SCENARIO_TIMEOUT_S)

    return asyncio.run(bounded())


def agent_lines(swarm: LocalSwarm) -> list[str]:
    return swarm.agents[0].log_path.read_text().splitlines()


def wait_for_lines(swarm: LocalSwarm, pattern: str, count: int, timeout_s: float = 30.0) -> list[str]:
    """The agent's log lines matching ``pattern``, once there are ``count`` (its lines reach the
    file as it writes them, a little after its answers)."""
    found: list[str] = []

    def logged() -> bool:
        found[:] = [line for line in agent_lines(swarm) if re.search(pattern, line)]
        return len(found) >= count

    wait_for(logged, timeout_s, f"an agent log line matching {pattern!r}", 0.1)
    return found


def _rss(swarm: LocalSwarm) -> int:
    return psutil.Process(swarm.agents[0].process.pid).memory_info().rss


def _bomb_header(size: int) -> bytes:
    """A msgpack header of about ``size`` bytes that unpacks into a vast tree of empty lists:
    ``size`` one-byte empty arrays, 64 to a list, each list about 74x its bytes in memory."""
    inner = b"\xdc" + (64).to_bytes(2, "big") + b"\x90" * 64  # array16 of 64 empty arrays
    count = size // len(inner)
    return b"\xdd" + count.to_bytes(4, "big") + inner * count  # array32 of those


def test_a_msgpack_bomb_before_hello_is_refused_without_unpacking_it(agent):
    """Given an agent, when a stranger sends bombs of every size before any HELLO (just under the
    HELLO limit, just under the library's pre-HELLO cap, 40 MiB), then the small ones are refused
    (malformed, too_large) and the 40 MiB one closes the connection, the agent's RSS grows by
    less than 200 MiB, and a PING on the same connection is still answered."""
    before = _rss(agent)
    large_bomb = _bomb_header(900 * 1024)

    async def attack():
        async with raw_client(agent.urls[0]) as client:
            await client.send_raw(_bomb_header(wire.MAX_HELLO_FRAME - 100))
            small = await client.recv()
            await client.send_raw(large_bomb)
            large = await client.recv()
            pong = await client.ping(1)
        ws = await connect(agent.urls[0], max_size=None, compression=None)
        # The agent stops reading at its cap: the rest of the send can only fail, once the agent
        # drops the connection.
        sender = asyncio.create_task(ws.send(_bomb_header(40 * MIB)))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        with contextlib.suppress(ConnectionClosed):
            await sender
        async with raw_client(agent.urls[0]) as client:
            after = await client.ping(2)
        return small, large, pong, closed.value, after

    small, large, pong, closed, after = _run(attack())

    assert small == wire.Error("malformed", "header must be a msgpack map")  # unpacked within the limits
    assert large == wire.Error(
        "too_large", f"frame of {len(large_bomb)} bytes exceeds the limit of {wire.MAX_HELLO_FRAME}"
    )
    assert (type(pong), pong.nonce) == (wire.Pong, 1)
    assert closed.rcvd is not None and closed.rcvd.code == 1009  # message too big, never read whole
    assert (type(after), after.nonce) == (wire.Pong, 2)
    assert _rss(agent) - before < RSS_BOUND


def test_a_header_bomb_after_hello_is_refused_within_the_header_limits(agent):
    """Given a coordinator past HELLO, when it sends a 900 KiB frame whose header is a bomb,
    then it is refused as too_large (its array is longer than any header holds), a 60 KiB bomb is
    refused as malformed after a bounded unpack, and the agent grows by less than 200 MiB."""
    job = f"bomb-{uuid.uuid4().hex[:8]}"
    before = _rss(agent)

    async def attack():
        async with raw_client(agent.urls[0]) as client:
            hello = await client.hello(job, agent.tickets(job)[0], key=agent.coordinator_key(job))
            assert isinstance(hello, wire.Hello)
            refusals = []
            for size in (900 * 1024, 60 * 1024):
                await client.send_raw(_bomb_header(size))
                refusals.append(await client.recv())
            return refusals, await client.ping(3)

    (long, short), pong = _run(attack())

    assert long == wire.Error(
        "too_large", f"header is over the wire's limits: {900 * 1024 // 67} exceeds max_array_len(4096)"
    )
    assert (short.code, short.message) == ("malformed", "header must be a msgpack map")
    assert pong.nonce == 3
    assert _rss(agent) - before < RSS_BOUND


def test_too_many_items_in_one_frame_are_refused(agent):
    job = f"items-{uuid.uuid4().hex[:8]}"
    count = wire.MAX_ITEMS + 1

    async def attack():
        async with raw_client(agent.urls[0]) as client:
            await client.hello(job, agent.tickets(job)[0], key=agent.coordinator_key(job))
            seq = client.next_seq()
            items = [[f"s{i}", 0, 0, 1] for i in range(count)]
            header = forward_header(seq, job, items, rows=count, hidden=HIDDEN)
            await client.send_raw(raw_frame(header, bytes(count * HIDDEN * 4)))
            forward = await client.recv()
            await client.send(wire.Open(job, tuple(f"s{i}" for i in range(count))))
            return seq, forward, await client.recv()

    seq, forward, opened = _run(attack())

    assert forward == wire.Error("too_large", f"a frame carries at most {wire.MAX_ITEMS} items, got {count}", ref=seq)
    assert (opened.code, opened.message) == (
        "too_large",
        f"field 'sessions' names at most {wire.MAX_ITEMS} sessions, got {count}",
    )
    # The agent's lines about it are in the swarm's one format: UTC time, then the job's id.
    refusals = wait_for_lines(agent, rf"WARNING swarm\.\S+ request=- job={job} .*too_large", 2)
    assert len(refusals) == 2, refusals
    assert all(UTC_LINE.match(line) for line in refusals), refusals


def test_pings_are_answered_while_large_frames_are_decoded(agent):
    """Given a coordinator sending six 8 MiB FORWARDs whose last float is NaN (each one must be
    read whole to be refused), when a second connection pings all along, then PONGs come back
    between the refusals rather than after all of them, and memory stays bounded."""
    job = f"large-{uuid.uuid4().hex[:8]}"
    rows = 8 * MIB // (HIDDEN * 4)
    hidden = torch.zeros(rows, HIDDEN)  # (rows, hidden)
    hidden[-1, -1] = float("nan")
    before = _rss(agent)

    async def attack():
        events: list[str] = []
        done = asyncio.Event()
        async with raw_client(agent.urls[0]) as heavy, raw_client(agent.urls[0]) as light:
            await heavy.hello(job, agent.tickets(job)[0], key=agent.coordinator_key(job))
            await heavy.send(wire.Open(job, ("s0",)))
            assert isinstance(await heavy.recv(), wire.Open)
            payload = wire.tensor_payload(hidden, "f32")

            async def pinger():
                nonce = 100
                while not done.is_set():
                    nonce += 1
                    pong = await light.ping(nonce)
                    assert pong.nonce == nonce
                    events.append("pong")

            task = asyncio.create_task(pinger())
            for _ in range(6):
                seq = heavy.next_seq()
                header = forward_header(seq, job, [["s0", 0, 0, rows]], rows=rows, hidden=HIDDEN)
                await heavy.send_raw(raw_frame(header, payload))
            for _ in range(6):
                error = await heavy.recv()
                assert (type(error), error.code) == (wire.Error, "non_finite")
                events.append("error")
            done.set()
            await task
        return events

    events = _run(attack())

    first_error, last_error = events.index("error"), len(events) - 1 - events[::-1].index("error")
    assert "pong" in events[first_error:last_error]
    assert _rss(agent) - before < RSS_BOUND


@contextlib.asynccontextmanager
async def hostile_stage(answer: Callable[[ServerConnection, wire.Frame], Awaitable[None]]) -> AsyncIterator[str]:
    """A stage server that answers each frame with ``answer``; yields its URL."""

    async def handle(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for data in ws:
                await answer(ws, wire.decode(data))

    async with serve(handle, "127.0.0.1", 0, max_size=None, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}"


def _identity(node: str) -> dict:
    return {"node": node, "model": MODEL, "layer_start": 0, "layer_end": 6, "hidden_size": HIDDEN}


async def _honest(ws: ServerConnection, frame: wire.Frame) -> None:
    match frame.message:
        case wire.Hello():
            await ws.send(wire.encode(wire.Hello(job=frame.message.job, role="stage", info=_identity("ok")), 1))
        case wire.Open():
            await ws.send(wire.encode(frame.message, 2))


def _oversize_hello(size: int) -> Callable[[ServerConnection, wire.Frame], Awaitable[None]]:
    async def answer(ws: ServerConnection, frame: wire.Frame) -> None:
        info = _identity("hostile") | {"padding": b"\x00" * size}
        await ws.send(wire.encode(wire.Hello(job="j", role="stage", info=info), 1))

    return answer


async def _small_bomb(ws: ServerConnection, frame: wire.Frame) -> None:
    await ws.send(_bomb_header(wire.MAX_HELLO_FRAME - 100))


async def _bomb_result(ws: ServerConnection, frame: wire.Frame) -> None:
    match frame.message:
        case wire.Hello():
            await ws.send(wire.encode(wire.Hello(job=frame.message.job, role="stage", info=_identity("bad")), 1))
        case wire.Open():
            await ws.send(wire.encode(frame.message, 2))
        case wire.Forward():
            await ws.send(_bomb_header(900 * 1024))


@pytest.mark.parametrize(
    ("answer", "code"),
    [
        (_oversize_hello(16 * MIB), "stage_too_large"),  # closed by the library at the HELLO limit
        (_small_bomb, "stage_malformed"),  # unpacked within the limits, and not a map
    ],
)
def test_an_oversize_hello_reply_is_refused_and_blamed_on_its_stage(answer, code):
    """Given a route whose second stage answers HELLO with a large frame, when the coordinator
    connects, then it raises a StageError naming stage 1 and grows by far less than the frame."""
    before = psutil.Process().memory_info().rss

    async def scenario():
        async with hostile_stage(_honest) as good, hostile_stage(answer) as bad:
            pipeline = Pipeline("j", [StageSpec(good), StageSpec(bad)], topology="star")
            try:
                with pytest.raises(StageError) as raised:
                    await pipeline.connect()
            finally:
                await pipeline.aclose()
            return raised.value

    error = _run(scenario())

    assert (error.stage, error.code) == (1, code)
    assert psutil.Process().memory_info().rss - before < RSS_BOUND


def test_a_malformed_result_is_blamed_on_the_stage_that_sent_it():
    """Given a star route whose second stage answers a FORWARD with a header bomb, when the
    coordinator runs a step, then the step fails with a StageError naming stage 1."""

    async def scenario():
        async with hostile_stage(_honest) as good, hostile_stage(_bomb_result) as bad:
            pipeline = Pipeline("j", [StageSpec(bad), StageSpec(good)], topology="star")
            try:
                await pipeline.connect()
                await pipeline.open(["s0"])
                with pytest.raises(StageError) as raised:
                    (step,) = await pipeline.send([("s0", 0, 1, wire.tensor_payload(torch.zeros(1, HIDDEN), "f32"))])
                    await pipeline.result("s0", step, 1)
            finally:
                await pipeline.aclose()
            return raised.value

    error = _run(scenario())

    assert (error.stage, error.code) == (0, "stage_too_large")


def test_a_ring_successors_oversize_hello_is_reported_against_the_successor(agent):
    """Given a ring job on the agent whose successor answers the agent's peer HELLO with 16 MiB,
    when a step is forwarded, then the agent refuses the reply without reading it and tells the
    coordinator the successor is unreachable (blamed on the next stage)."""
    job = f"ring-{uuid.uuid4().hex[:8]}"
    before = _rss(agent)

    async def scenario():
        async with hostile_stage(_oversize_hello(16 * MIB)) as successor, raw_client(agent.urls[0]) as client:
            ticket = agent.tickets(job)[0]
            hello = await client.hello(
                job, ticket, topology="ring", key=agent.coordinator_key(job), next_url=successor, next_ticket=b"t"
            )
            assert isinstance(hello, wire.Hello)
            await client.send(wire.Open(job, ("s0",)))
            assert isinstance(await client.recv(), wire.Open)
            hidden = torch.zeros(1, HIDDEN)
            await client.send(
                wire.Forward(job, (wire.Item("s0", 0, 0, 1),), "f32", (1, HIDDEN), hidden.numpy().tobytes())
            )
            return await client.recv()

    error = _run(scenario())

    assert (type(error), error.code, error.job) == (wire.Error, "next_unreachable", job)
    assert _rss(agent) - before < RSS_BOUND


@pytest.mark.parametrize(
    ("target", "url", "expected"),
    [
        ("node-1", "ws://10.0.0.7:9100", "ws://10.0.0.7:9100"),
        ("node-1", "wss://agent.example:443/x", "wss://agent.example:443/x"),
        ("node-1", "ws://10.0.0.7", None),  # a data plane names its port
        ("node-1", "http://10.0.0.7:9100", None),  # a node is probed on its data plane only
        ("node-1", "file:///etc/passwd", None),
        ("node-1", "ws://user:pw@10.0.0.7:9100", None),
        ("node-1", "ws://10.0.0.7:99999", None),
        ("node-1", None, None),
        ("region:eu", "https://eu.example/healthz", "https://eu.example/healthz"),
        ("region:eu", "ws://10.0.0.7:9100", None),
        ("region:eu", None, "http://cp.example:8000/healthz"),
    ],
)
def test_probes_go_only_to_urls_their_target_can_have(target, url, expected):
    assert probe_url(protocol.ProbeTarget(target=target, url=url), "http://cp.example:8000/") == expected


def test_a_probe_refuses_a_huge_reply():
    """Given a peer answering the probe's PING with 32 MiB, the probe fails at the reply limit
    without reading it whole."""

    async def huge(ws: ServerConnection, frame: wire.Frame) -> None:
        await ws.send(wire.encode(wire.Pong(1, {"padding": "x"}), 1) + bytes(32 * MIB))

    async def scenario():
        async with hostile_stage(huge) as url:
            with pytest.raises(ConnectionClosed) as closed:
                await probe_link(url, timeout=10)
            return closed.value

    closed = _run(scenario())

    assert closed.sent is not None and closed.sent.code == 1009


def test_a_probe_of_an_honest_agent_still_measures_rtt_and_uplink(agent):
    before = agent_lines(agent)

    measured = _run(probe_link(agent.urls[0], timeout=10))

    assert set(measured) == {"rtt_ms", "uplink_mbps"}
    assert measured["rtt_ms"] > 0 and measured["uplink_mbps"] > 0
    # Its padded PING is a frame the agent reads before a HELLO, answered with a PONG: no refusal.
    assert not [line for line in agent_lines(agent)[len(before) :] if "WARNING" in line or "ERROR" in line]
