"""Seeded generators of hostile inputs, shared by the ``fuzz`` test and ``bench/fuzz.py``.

- ``frames``: data-plane frames, mutations of valid ones (truncations, bit flips, huge
  declared lengths, deeply nested containers, wrong field types, random bytes, text frames);
- ``control_messages``: control-channel text frames of every message type, mutated alike;
- ``api_requests``: HTTP requests (method, path, JSON body or query) for the public API.

Everything comes from ``random.Random(seed)``: the same seed gives the same inputs.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import random
import struct
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
from nacl.signing import SigningKey
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from worker_agent.protocol import wire
from worker_agent.protocol.control_protocol import control_signature
from worker_agent.protocol.tickets import prove_coordinator

HIDDEN = 64  # tiny-llama's hidden size


def _weird(rng: random.Random, depth: int = 0) -> Any:
    """A value of a random type, sometimes absurd: huge ints, long strings, nested containers."""
    choice = rng.randrange(14 if depth < 3 else 9)
    match choice:
        case 0:
            return None
        case 1:
            return rng.choice([True, False])
        case 2:
            return rng.randint(-(2**63), 2**64 - 1)
        case 3:
            return rng.choice([0, -1, 1, 2**31, 2**63, 2**64 - 1, -(2**63)])
        case 4:
            return rng.choice([0.0, -0.0, 1e308, float("nan"), float("inf"), 3.5])
        case 5:
            return "x" * rng.choice([0, 1, 129, 300, 5000])
        case 6:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        case 7:
            return rng.choice(["", "HELLO", "FORWARD", "ring", "star", "coordinator", "peer", "\x00", "é" * 10])
        case 8:
            return rng.choice(["s0", "job-1", "f32", "f64", "bf16"])
        case 9 | 10:
            return [_weird(rng, depth + 1) for _ in range(rng.randrange(6))]
        case _:
            return {str(_weird(rng, depth + 1))[:20]: _weird(rng, depth + 1) for _ in range(rng.randrange(5))}


def _valid_headers(rng: random.Random, job: str, ticket: bytes | None) -> tuple[dict, bytes]:
    kind = rng.choice(["HELLO", "OPEN", "FORWARD", "FORWARD", "CLOSE", "PING", "PONG", "ERROR", "RESULT"])
    header: dict[str, Any] = {"v": 1, "type": kind, "seq": 0}
    payload = b""
    match kind:
        case "HELLO":
            header |= {"job": job, "role": "coordinator", "ticket": ticket, "topology": "star", "info": {}}
        case "OPEN" | "CLOSE":
            header |= {"job": job, "sessions": [f"f{rng.randrange(4)}"]}
        case "FORWARD" | "RESULT":
            rows = rng.randint(1, 3)
            header |= {
                "job": job,
                "dtype": "f32",
                "shape": [rows, HIDDEN],
                "items": [[f"f{rng.randrange(4)}", 0, 0, rows]],
            }
            payload = struct.pack(f"<{rows * HIDDEN}f", *(rng.uniform(-1, 1) for _ in range(rows * HIDDEN)))
        case "PING" | "PONG":
            header |= {"nonce": rng.randrange(2**31), "info": {}}
        case "ERROR":
            header |= {"code": "x", "message": "y"}
    return header, payload


def _huge_length(rng: random.Random) -> bytes:
    """A container or string header that declares up to 4 GiB of content it does not carry."""
    marker = rng.choice([b"\xdd", b"\xdf", b"\xdb", b"\xc6", b"\xc9\x00"])  # array32 map32 str32 bin32 ext32
    return marker + rng.choice([2**32 - 1, 2**31, 2**20, 70_000]).to_bytes(4, "big") + b"\x90" * rng.randrange(64)


def _nested(rng: random.Random) -> bytes:
    depth = rng.choice([10, 100, 1000, 5000, 7000])
    return rng.choice([b"\x91", b"\x81\xa1k"]) * depth + b"\xc0"


def frames(seed: int, job: str, ticket: bytes | None, seqs: Iterator[int]) -> Iterator[tuple[bytes | str, bool]]:
    """An endless seeded stream of data-plane frames, each with whether it was built from a
    HELLO (which may close the connection); each is built from a valid frame whose seq is the
    next of ``seqs`` (the sender's counter), then mutated."""
    rng = random.Random(seed)
    while True:
        header, payload = _valid_headers(rng, job, ticket)
        header["seq"] = next(seqs)
        yield _mutate(rng, header, payload), header.get("type") == "HELLO"


def _mutate(rng: random.Random, header: dict, payload: bytes) -> bytes | str:
    """One mutation of a valid frame."""
    mutation = rng.randrange(12)
    if mutation == 0:  # a valid frame, left as it is
        return msgpack.packb(header, use_bin_type=True) + payload
    elif mutation == 1:  # truncated anywhere
        data = msgpack.packb(header, use_bin_type=True) + payload
        return data[: rng.randrange(len(data))]
    elif mutation == 2:  # a few bits flipped
        data = bytearray(msgpack.packb(header, use_bin_type=True) + payload)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    elif mutation == 3:
        return _huge_length(rng)
    elif mutation == 4:
        return _nested(rng)
    elif mutation in (5, 6):  # a field of the wrong type, missing, or an extra one
        key = rng.choice([*header, "extra"])
        if rng.random() < 0.2:
            header.pop(key, None)
        else:
            header[key] = _weird(rng)
        return msgpack.packb(header, use_bin_type=True) + payload
    elif mutation == 7:  # a header that is not a map, or a map with odd keys
        return msgpack.packb(rng.choice([_weird(rng), {1: 2}, [header]]), use_bin_type=True)
    elif mutation == 8:  # tensor bytes that do not match the shape, or bytes after a frame that carries none
        return msgpack.packb(header, use_bin_type=True) + bytes(rng.randrange(1, 600))
    elif mutation == 9:  # random bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    elif mutation == 10:  # a text frame
        return rng.choice(["", "{}", "HELLO", "\x00" * 10])
    else:  # a bomb: many small containers up to a few KiB
        count = rng.choice([100, 1000, 2000])
        return b"\xdd" + count.to_bytes(4, "big") + rng.choice([b"\x90", b"\x80", b"\xa0"]) * count


CONTROL_TYPES = [
    "auth",
    "heartbeat",
    "ready",
    "failed",
    "probe_result",
    "challenge_result",
    "assign",
    "welcome",
    "probe",
    "sync",
]


def _control_valid(rng: random.Random, peers: list[str]) -> dict:
    kind = rng.choice(CONTROL_TYPES)
    match kind:
        case "heartbeat":
            return {"type": kind, "load": {"queue": rng.randrange(5), "sessions": rng.randrange(5)}}
        case "ready":
            return {"type": kind, "assignment": rng.randrange(1, 100), "url": "ws://127.0.0.1:9100"}
        case "failed":
            return {"type": kind, "assignment": rng.randrange(1, 100), "error": "boom"}
        case "probe_result":
            targets = [*peers, "region:local", "node-invented", "region:nowhere"]
            return {
                "type": kind,
                "results": [{"target": rng.choice(targets), "rtt_ms": rng.uniform(0, 500)} for _ in range(5)],
            }
        case "challenge_result":
            return {"type": kind, "challenge": rng.randrange(1, 100), "error": "no", "code": "not_serving"}
        case _:
            return {"type": kind}


def control_messages(seed: int, peers: list[str]) -> Iterator[str]:
    """An endless seeded stream of control-channel text frames (valid and mutated messages)."""
    rng = random.Random(seed)
    while True:
        message = _control_valid(rng, peers)
        mutation = rng.randrange(6)
        if mutation == 0:
            yield json.dumps(message)
        elif mutation in (1, 2):
            key = rng.choice([*message, "v", "extra"])
            message[key] = _weird(rng)
            yield json.dumps(message, default=repr)
        elif mutation == 3:
            text = json.dumps(message)
            yield text[: rng.randrange(len(text) + 1)]
        elif mutation == 4:
            yield "[" * rng.choice([10, 1000, 100_000]) + "]" * rng.choice([0, 10])
        else:
            yield json.dumps(_weird(rng), default=repr)


def api_requests(seed: int) -> Iterator[tuple[str, str, Any]]:
    """An endless seeded stream of (method, path, body) for the public HTTP API: a JSON value
    (or raw text) for POST, a query dict for GET."""
    rng = random.Random(seed)
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    completion = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
    register = {
        "token": "swj_x",
        "public_key": "00" * 32,
        "signature": "00" * 64,
        "hardware": {"device": "cpu", "memory_bytes": 1, "max_layers": 1},
        "benchmark": {"layer_tokens_per_s": 1.0},
        "data_url": "ws://127.0.0.1:9100",
    }
    posts = [("/v1/chat/completions", chat), ("/v1/completions", completion), ("/api/v1/agents/register", register)]
    gets = ["/v1/models", "/api/v1/nodes/", "/api/v1/keys/", "/api/v1/billing/transactions", "/api/v1/billing/usage"]
    while True:
        if rng.random() < 0.25:
            query = {rng.choice(["limit", "offset", "page", "since", "x"]): str(_weird(rng))[:200]}
            yield "GET", rng.choice(gets), query
            continue
        path, base = rng.choice(posts)
        body = json.loads(json.dumps(base))
        mutation = rng.randrange(7)
        if mutation == 0:
            yield "POST", path, body
        elif mutation in (1, 2, 3):
            target = body
            if "messages" in body and rng.random() < 0.5:
                target = body["messages"][0]
            key = rng.choice([*target, "seed", "temperature", "n", "stop", "stream", "top_p", "role"])
            target[key] = _weird(rng)
            yield "POST", path, json.dumps(body, default=repr)
        elif mutation == 4:
            depth = rng.choice([100, 1000, 10_000])
            yield "POST", path, "[" * depth + "]" * depth
        elif mutation == 5:
            text = json.dumps(body)
            yield "POST", path, text[: rng.randrange(len(text) + 1)]
        else:
            yield "POST", path, json.dumps(_weird(rng), default=repr)


@dataclass
class FrameStats:
    sent: int = 0  # frames sent, the sentinels left out
    answers: int = 0  # frames the agent sent back
    closed: int = 0  # connections the agent closed (a refused HELLO, a frame over its cap)
    hangs: int = 0  # windows whose sentinel PING was not answered within the bound
    slowest_window_s: float = 0.0  # longest wait for a window's sentinel answer

    def add(self, other: FrameStats) -> None:
        self.sent += other.sent
        self.answers += other.answers
        self.closed += other.closed
        self.hangs += other.hangs
        self.slowest_window_s = max(self.slowest_window_s, other.slowest_window_s)


async def fuzz_connection(
    url: str,
    *,
    job: str,
    ticket: bytes,
    key: SigningKey,
    seed: int,
    count: int,
    hello: bool,
    window: int = 200,
    hang_s: float = 30.0,
) -> FrameStats:
    """Send ``count`` fuzzed frames to the agent at ``url`` in windows, each closed by a PING
    sentinel whose answer (a PONG, or an ERROR referring to it) proves everything before it was
    dealt with. ``hello``: say a valid HELLO first on every connection (frames after HELLO), as
    the coordinator holding ``key``, the key ``ticket`` names."""
    stats = FrameStats()
    seqs = itertools.count(1)
    source = frames(seed, job, ticket, seqs)
    pending: tuple[bytes | str, bool] | None = None
    ws = None
    while stats.sent < count:
        if ws is None:
            ws = await connect(url, max_size=None, compression=None, open_timeout=hang_s)
            if hello:
                hello_frame = wire.Hello(job=job, ticket=ticket, topology="star", proof=prove_coordinator(key, ticket))
                await ws.send(wire.encode(hello_frame, next(seqs)))
                assert isinstance(wire.decode(await asyncio.wait_for(ws.recv(), hang_s)).message, wire.Hello)
        # A frame built from a HELLO travels alone: its refusal closes the connection, and the
        # frames behind it would go unread.
        batch: list[bytes | str] = []
        while len(batch) < min(window, count - stats.sent):
            data, alone = next(source) if pending is None else pending
            pending = None
            if alone and batch:
                pending = (data, alone)
                break
            batch.append(data)
            if alone:
                break
        sentinel, nonce = next(seqs), seed * 1_000_000 + stats.sent
        started = time.monotonic()
        try:
            for data in batch:
                await ws.send(data)
            await ws.send(wire.encode(wire.Ping(nonce), sentinel))
            fresh = False
            while True:
                reply = await asyncio.wait_for(ws.recv(), hang_s)
                stats.answers += 1
                message = wire.decode(reply).message
                if isinstance(message, wire.Pong) and message.nonce == nonce:
                    break
                if isinstance(message, wire.Error) and (message.ref == sentinel or message.fatal):
                    # Refused HELLO (the connection closes), or a fuzzed seq moved the replay
                    # guard past ours: start afresh on a new connection.
                    stats.closed += message.fatal
                    fresh = True
                    break
            if fresh:
                ws.transport.abort()
                ws = None
        except ConnectionClosed:
            stats.closed += 1
            ws = None
        except TimeoutError:
            stats.hangs += 1
            ws.transport.abort()
            ws = None
        stats.sent += len(batch)
        stats.slowest_window_s = max(stats.slowest_window_s, time.monotonic() - started)
    if ws is not None:
        await ws.close()
    return stats


async def answers_ping(url: str, timeout: float = 30.0) -> bool:
    """The agent at ``url`` answers a PING on a new connection within ``timeout``."""
    async with connect(url, max_size=wire.MAX_HEADER, compression=None, open_timeout=timeout) as ws:
        await ws.send(wire.encode(wire.Ping(7), 1))
        message = wire.decode(await asyncio.wait_for(ws.recv(), timeout)).message
    return isinstance(message, wire.Pong) and message.nonce == 7


@dataclass
class ControlStats:
    sent: int = 0  # messages sent after the handshake
    errors: int = 0  # error messages the control plane answered with
    closed: int = 0  # channels it closed (a frame that is no message at all, a flood)
    hangs: int = 0  # sentinels not answered within the bound
    slowest_window_s: float = 0.0


async def fuzz_control_channel(
    ws_url: str, *, key, node_id: str, peers: list[str], seed: int, count: int, window: int = 20, hang_s: float = 30.0
) -> ControlStats:
    """Send ``count`` fuzzed messages on an authenticated control channel, in windows closed by
    an unknown-type sentinel whose error answer proves the window was read."""
    stats = ControlStats()
    source = control_messages(seed, peers)
    ws = None
    while stats.sent < count:
        if ws is None:
            ws = await connect(ws_url, open_timeout=hang_s, max_size=None)
            nonce = bytes.fromhex(json.loads(await asyncio.wait_for(ws.recv(), hang_s))["nonce"])
            auth = {"type": "auth", "node": node_id, "signature": control_signature(key, nonce, node_id)}
            await ws.send(json.dumps(auth))
            welcome = json.loads(await asyncio.wait_for(ws.recv(), hang_s))
            assert welcome["type"] == "welcome", welcome
        batch = [next(source) for _ in range(min(window, count - stats.sent))]
        marker = f"sentinel-{stats.sent}"
        started = time.monotonic()
        try:
            for text in batch:
                await ws.send(text)
            await ws.send(json.dumps({"type": marker}))
            while True:
                answer = json.loads(await asyncio.wait_for(ws.recv(), hang_s))
                if answer.get("type") == "error":
                    stats.errors += 1
                    if marker in answer.get("message", ""):
                        break
        except ConnectionClosed:
            stats.closed += 1
            ws = None
        except TimeoutError:
            stats.hangs += 1
            ws.transport.abort()
            ws = None
        stats.sent += len(batch)
        stats.slowest_window_s = max(stats.slowest_window_s, time.monotonic() - started)
    if ws is not None:
        await ws.close()
    return stats


@dataclass
class ApiStats:
    sent: int = 0
    by_status: dict[int, int] | None = None  # HTTP status -> count
    server_errors: list[tuple[str, str, int, str]] | None = None  # (path, body, status, answer) of each 5xx
    hangs: int = 0  # requests not answered within the bound
    slowest_s: float = 0.0

    def __post_init__(self) -> None:
        self.by_status = self.by_status or {}
        self.server_errors = self.server_errors or []


def fuzz_api(base_url: str, *, api_key: str, seed: int, count: int, timeout_s: float = 30.0) -> ApiStats:
    """Send ``count`` fuzzed requests to the HTTP API; counts answers by status and keeps every 5xx.
    503 (no capacity to serve a valid request) is a deliberate answer and counted apart."""
    stats = ApiStats()
    parts = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    for method, path, body in itertools.islice(api_requests(seed), count):
        headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        if method == "GET":
            target, payload = f"{path}?{urllib.parse.urlencode(body)}", None
        else:
            target = path
            payload = (body if isinstance(body, str) else json.dumps(body)).encode("utf-8", "surrogatepass")
        started = time.monotonic()
        try:
            conn.request(method, target, body=payload, headers=headers)
            response = conn.getresponse()
            answer = response.read(4096)
            response.read()
            status = response.status
        except TimeoutError:
            stats.hangs += 1
            conn.close()
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
            continue
        except (http.client.HTTPException, ConnectionError):
            conn.close()
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
            status, answer = 0, b"connection dropped"
        finally:
            stats.sent += 1
            stats.slowest_s = max(stats.slowest_s, time.monotonic() - started)
        stats.by_status[status] = stats.by_status.get(status, 0) + 1
        if (status >= 500 and status != 503) or status == 0:
            shown = payload.decode("utf-8", "replace")[:300] if payload else target[:300]
            stats.server_errors.append((path, shown, status, answer.decode("utf-8", "replace")[:300]))
    conn.close()
    return stats
