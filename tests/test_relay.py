"""Relays (``worker_agent/relay*.py``): peers reach an agent that cannot accept connections.

On loopback, in the test's event loop: an agent's data server (a websockets echo server, over
mTLS with a throwaway swarm CA and a certificate for ``<node>.swarm``, or plain), a ``Relay`` and
the agent's ``RelayClient``; peers connect to the URL the relay gave the agent.

- a peer reaches the agent through the relay over TLS (mTLS) or plain ``ws://``, content intact;
- the relay forwards only TLS records, and the payloads never appear in what it forwarded; a byte
  it flips fails the link and is never delivered;
- registrations with a bad pass or nonce signature are refused with their exact code; unknown
  nodes and malformed prefixes are closed; the relay keeps serving after each;
- reconnects replace a registration, silent links are dropped, a relay that stops ends the
  client's ``run`` with ``RelayLost``; the ``swarm-relay`` command prints READY and stops on SIGTERM;
- the sans-I/O rules (``relay_protocol``) against truncated, oversize and hostile inputs.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import datetime as dt
import functools
import logging
import random
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgpack
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from nacl.signing import SigningKey
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from worker_agent.agent.relay import Direction, MessageReader, Relay
from worker_agent.agent.relay_client import RelayClient
from worker_agent.errors import RelayError, RelayLost
from worker_agent.protocol.keys import node_id, public_key_bytes
from worker_agent.protocol.relay_pass import register_signature, sign_relay_pass, verify_relay_pass
from worker_agent.protocol.relay_protocol import (
    AGENT_LINE,
    MAX_FRAME_BYTES,
    AcceptRoute,
    AgentRoute,
    Challenge,
    Connect,
    Error,
    FrameDecoder,
    Liveness,
    PeerRoute,
    Ping,
    Pong,
    Register,
    Registered,
    accept_line,
    classify,
    decode_message,
    encode_frame,
    public_urls,
)
from worker_agent.protocol.tickets import issue_ticket
from worker_agent.protocol.tls import PEM, Identity, connect_options, key_pem, node_hostname

pytestmark = pytest.mark.dataplane

LOOPBACK = "127.0.0.1"
RELAY_ID = "relay-test"
WAIT_S = 5.0  # every await in these tests is bounded by this
ISSUER = SigningKey(b"\x01" * 32)  # the control plane's pass key
PATTERN = (b"SWARM-PLAINTEXT-PATTERN-0123456789-" * 200)[:4096]
TENSOR = array.array("f", [i * 0.001 - 1.5 for i in range(1024)]).tobytes()  # a float32 activation's bytes


# --- a throwaway swarm CA ---------------------------------------------------------------------------


@functools.cache
def swarm_ca() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test swarm CA")])
    certificate = (
        _builder(name, name, key.public_key(), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_ca_usage(), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, certificate


def _builder(subject: x509.Name, issuer: x509.Name, public_key, issuer_public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_public_key), critical=False)
    )


def _ca_usage() -> x509.KeyUsage:
    flags = dict.fromkeys(
        ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement"),
        False,
    )
    return x509.KeyUsage(**flags, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False)


def identity(common_name: str, dns_name: str | None = None) -> Identity:
    """A member of the test swarm: a certificate from its CA (naming ``dns_name``) and its key."""
    ca_key, ca = swarm_ca()
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]),
        ca.subject,
        key.public_key(),
        ca_key.public_key(),
    ).add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    if dns_name:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
    pem = builder.sign(ca_key, hashes.SHA256()).public_bytes(PEM).decode()
    return Identity(ca.public_bytes(PEM).decode(), pem, key_pem(key))


# --- a relayed agent ----------------------------------------------------------------------------------


class RecordingRelay(Relay):
    """Keeps every byte it forwards, per direction."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.seen = {Direction.TO_AGENT: bytearray(), Direction.TO_PEER: bytearray()}

    def forward(self, connection: str, direction: Direction, data: bytes) -> bytes:
        self.seen[direction] += data
        return data


class FlippingRelay(Relay):
    """Flips the last bit of the next chunk it forwards in ``armed``'s direction."""

    armed: Direction | None = None

    def forward(self, connection: str, direction: Direction, data: bytes) -> bytes:
        if direction == self.armed:
            self.armed = None
            return data[:-1] + bytes([data[-1] ^ 0x01])
        return data


def relay_pass(
    node_key: SigningKey, *, issuer: SigningKey = ISSUER, relay: str = RELAY_ID, ttl_s: float = 600
) -> bytes:
    node = node_id(public_key_bytes(node_key))
    return sign_relay_pass(issuer, node, public_key_bytes(node_key), relay, time.time() + ttl_s)


async def start_relay(relay: Relay) -> tuple[asyncio.Task, int]:
    bound = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(relay.serve(LOOPBACK, 0, ready=bound.set_result))
    return task, await asyncio.wait_for(bound, WAIT_S)


async def stop(*tasks: asyncio.Task) -> list:
    for task in tasks:
        task.cancel()
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)


@dataclass
class Relayed:
    relay: Relay
    port: int  # the relay's
    node: str
    node_key: SigningKey
    client: RelayClient
    running: asyncio.Task  # the client's run()
    data_port: int  # the agent's own data server's
    received: list[bytes]  # every message the agent's data server received, in order
    tls: bool

    async def peer(self, client: RelayClient | None = None) -> ClientConnection:
        """A peer that connects as the coordinator would: to the URL the relay gave ``client`` (the
        agent's), checking the node's certificate."""
        url = (client or self.client).public_url(tls=self.tls)
        context = identity("coordinator").client_context() if self.tls else None
        options = connect_options(url, self.node, context)
        return await connect(url, compression=None, open_timeout=WAIT_S, **options)


@contextlib.asynccontextmanager
async def relayed_agent(relay_class: type[Relay] = Relay, *, tls: bool = True, **options) -> AsyncIterator[Relayed]:
    node_key = SigningKey.generate()
    node = node_id(public_key_bytes(node_key))
    received: list[bytes] = []

    async def echo(ws: ServerConnection) -> None:
        async for message in ws:
            received.append(message)
            await ws.send(message)

    context = identity(node, node_hostname(node)).server_context() if tls else None
    async with serve(echo, LOOPBACK, 0, ssl=context, compression=None) as server:
        relay = relay_class(relay_id=RELAY_ID, public_host=LOOPBACK, trusted_keys=[public_key_bytes(ISSUER)], **options)
        relay_task, port = await start_relay(relay)
        data_port = server.sockets[0].getsockname()[1]
        client = RelayClient((LOOPBACK, port), relay_pass(node_key), node_key, (LOOPBACK, data_port))
        client_task = asyncio.create_task(client.run())
        try:
            await asyncio.wait_for(client.registered.wait(), WAIT_S)
            yield Relayed(relay, port, node, node_key, client, client_task, data_port, received, tls)
        finally:
            await stop(client_task, relay_task)


async def round_trip(ws: ClientConnection, message: bytes) -> bytes:
    await asyncio.wait_for(ws.send(message), WAIT_S)
    return await asyncio.wait_for(ws.recv(), WAIT_S)


async def closed_after(port: int, data: bytes, *, half_close: bool = False) -> bytes:
    """What the relay answers ``data`` with before it closes the connection (b"" if nothing); with
    ``half_close`` the test's side ends its stream after ``data``."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(data)
        if half_close:
            writer.write_eof()
        return await asyncio.wait_for(reader.read(), WAIT_S)
    except ConnectionResetError:  # closed with our bytes unread: the kernel answers with a reset
        return b""
    finally:
        writer.close()


def tls_records(stream: bytes) -> list[tuple[int, int]]:
    """(content type, length) of each TLS record ``stream`` is made of; fails on anything else."""
    records, at = [], 0
    while at < len(stream):
        assert len(stream) - at >= 5, "a partial record header"
        kind, version, length = stream[at], stream[at + 1 : at + 3], int.from_bytes(stream[at + 3 : at + 5], "big")
        assert 20 <= kind <= 23, f"content type {kind} at byte {at}"
        assert version in (b"\x03\x01", b"\x03\x03"), f"record version {version.hex()} at byte {at}"
        assert 0 < length <= 2**14 + 256 and at + 5 + length <= len(stream), f"record length {length} at byte {at}"
        records.append((kind, length))
        at += 5 + length
    return records


def real_client_hello(server_name: str) -> bytes:
    """The first flight of a real TLS client (this Python's OpenSSL) for ``server_name``."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


# --- through the relay --------------------------------------------------------------------------------


def test_peer_reaches_a_tls_agent_through_the_relay_with_content_intact():
    async def scenario() -> None:
        async with relayed_agent() as agent:
            assert agent.client.public_url(tls=True) == f"wss://{LOOPBACK}:{agent.port}"
            async with await agent.peer() as ws:
                assert await round_trip(ws, PATTERN) == PATTERN
                assert await round_trip(ws, TENSOR) == TENSOR
                assert await round_trip(ws, b"\x00" * 300_000) == b"\x00" * 300_000
            assert agent.received == [PATTERN, TENSOR, b"\x00" * 300_000]

    asyncio.run(scenario())


def test_relay_forwards_only_tls_records_and_never_the_plaintext():
    async def scenario() -> RecordingRelay:
        async with relayed_agent(RecordingRelay) as agent:
            async with await agent.peer() as ws:
                assert await round_trip(ws, PATTERN) == PATTERN
                assert await round_trip(ws, TENSOR) == TENSOR
            relay = agent.relay
            assert isinstance(relay, RecordingRelay)
            await asyncio.sleep(0.1)  # the close's last records
            return relay

    relay = asyncio.run(scenario())
    for direction in Direction:
        seen = bytes(relay.seen[direction])
        records = tls_records(seen)
        assert {kind for kind, _ in records} <= {20, 21, 22, 23}
        assert sum(length for kind, length in records if kind == 23) > len(PATTERN) + len(TENSOR)
        for payload in (PATTERN, TENSOR):
            assert all(payload[at : at + 32] not in seen for at in range(0, len(payload) - 32, 32))
    assert relay.seen[Direction.TO_AGENT][0] == 22  # the ClientHello went first, verbatim


@pytest.mark.parametrize("direction", list(Direction))
def test_a_byte_flipped_by_the_relay_fails_the_link_and_is_never_delivered(direction):
    async def scenario() -> None:
        async with relayed_agent(FlippingRelay) as agent:
            relay = agent.relay
            assert isinstance(relay, FlippingRelay)
            async with await agent.peer() as ws:
                assert await round_trip(ws, b"before") == b"before"
                relay.armed = direction
                with pytest.raises(ConnectionClosed):
                    await round_trip(ws, PATTERN)
            assert relay.armed is None  # it did flip one
            expected = [b"before"] if direction is Direction.TO_AGENT else [b"before", PATTERN]
            assert agent.received == expected  # whatever the agent got is what the peer sent

    asyncio.run(scenario())


def test_plain_ws_peer_is_routed_by_its_relay_path():
    async def scenario() -> None:
        async with relayed_agent(tls=False) as agent:
            url = agent.client.public_url(tls=False)
            assert url == f"ws://{LOOPBACK}:{agent.port}/relay/{agent.node}"
            async with await agent.peer() as ws:
                assert await round_trip(ws, PATTERN) == PATTERN
            async with connect(url + "/any/path?x=1", compression=None, open_timeout=WAIT_S) as ws:
                assert await round_trip(ws, TENSOR) == TENSOR
            assert agent.received == [PATTERN, TENSOR]

    asyncio.run(scenario())


# --- registration ------------------------------------------------------------------------------------


def _expired(key: SigningKey) -> tuple[bytes, SigningKey]:
    return relay_pass(key, ttl_s=-1), key


def _untrusted(key: SigningKey) -> tuple[bytes, SigningKey]:
    return relay_pass(key, issuer=SigningKey.generate()), key


def _nonce_by_another_key(key: SigningKey) -> tuple[bytes, SigningKey]:
    return relay_pass(key), SigningKey.generate()


def _for_another_relay(key: SigningKey) -> tuple[bytes, SigningKey]:
    return relay_pass(key, relay="relay-elsewhere"), key


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (_expired, "pass_expired"),
        (_untrusted, "pass_untrusted"),
        (_nonce_by_another_key, "bad_signature"),
        (_for_another_relay, "pass_wrong_relay"),
    ],
)
def test_registration_is_refused_with_its_code_and_the_relay_keeps_serving(make, code, caplog):
    caplog.set_level(logging.INFO, logger="swarm.relay")

    async def scenario() -> None:
        async with relayed_agent() as agent:
            pass_bytes, signing_key = make(SigningKey.generate())
            refused = RelayClient((LOOPBACK, agent.port), pass_bytes, signing_key, (LOOPBACK, agent.data_port))
            with pytest.raises(RelayLost) as caught:
                await asyncio.wait_for(refused.run(), WAIT_S)
            assert caught.value.code == code
            assert not refused.registered.is_set()
            assert set(agent.relay.agents) == {agent.node}
            async with await agent.peer() as ws:
                assert await round_trip(ws, b"still served") == b"still served"

    asyncio.run(scenario())
    assert len([r for r in caplog.records if r.getMessage().startswith("refused connection")]) == 1
    assert f": {code} (" in caplog.text


def test_a_second_registration_of_a_node_replaces_the_first():
    async def scenario() -> None:
        async with relayed_agent() as agent:
            first = agent.relay.agents[agent.node]
            again = RelayClient(
                (LOOPBACK, agent.port), relay_pass(agent.node_key), agent.node_key, (LOOPBACK, agent.data_port)
            )
            running = asyncio.create_task(again.run())
            await asyncio.wait_for(again.registered.wait(), WAIT_S)
            assert agent.relay.agents[agent.node] is not first
            with pytest.raises(RelayLost) as caught:
                await asyncio.wait_for(agent.running, WAIT_S)
            assert caught.value.code == "replaced"
            async with await agent.peer(again) as ws:
                assert await round_trip(ws, b"via the new link") == b"via the new link"
            (ended,) = await stop(running)
            assert isinstance(ended, asyncio.CancelledError)

    asyncio.run(scenario())


def test_a_full_relay_refuses_a_new_node_but_takes_a_reconnect():
    async def scenario() -> None:
        async with relayed_agent(max_agents=1) as agent:
            other = SigningKey.generate()
            refused = RelayClient((LOOPBACK, agent.port), relay_pass(other), other, (LOOPBACK, agent.data_port))
            with pytest.raises(RelayLost) as caught:
                await asyncio.wait_for(refused.run(), WAIT_S)
            assert caught.value.code == "relay_full"
            key = agent.node_key
            again = RelayClient((LOOPBACK, agent.port), relay_pass(key), key, (LOOPBACK, agent.data_port))
            running = asyncio.create_task(again.run())
            await asyncio.wait_for(again.registered.wait(), WAIT_S)
            assert set(agent.relay.agents) == {agent.node}
            await stop(running)

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def raw_agent(port: int, key: SigningKey) -> AsyncIterator[MessageReader]:
    """An agent's control link driven by hand, registered; yields what the relay sends next."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(AGENT_LINE)
        inbox = MessageReader(reader)
        challenge = await asyncio.wait_for(inbox.next(), WAIT_S)
        assert isinstance(challenge, Challenge) and challenge.relay == RELAY_ID
        writer.write(encode_frame(Register(relay_pass(key), register_signature(key, challenge.nonce, RELAY_ID))))
        registered = await asyncio.wait_for(inbox.next(), WAIT_S)
        assert isinstance(registered, Registered) and registered.node == node_id(public_key_bytes(key))
        yield inbox
    finally:
        writer.close()


def test_relay_drops_an_agent_link_that_goes_silent():
    async def scenario() -> None:
        relay = Relay(
            relay_id=RELAY_ID,
            public_host=LOOPBACK,
            trusted_keys=[public_key_bytes(ISSUER)],
            ping_interval_s=0.1,
            idle_timeout_s=0.35,
        )
        relay_task, port = await start_relay(relay)
        heard = []
        async with raw_agent(port, SigningKey.generate()) as inbox:
            while (message := await asyncio.wait_for(inbox.next(), WAIT_S)) is not None:
                heard.append(message)  # answered with silence
        assert all(isinstance(message, Ping) for message in heard[:-1]) and len(heard) >= 3
        assert isinstance(heard[-1], Error) and heard[-1].code == "ping_timeout"
        assert relay.agents == {}
        await stop(relay_task)

    asyncio.run(scenario())


def test_a_peer_whose_agent_never_accepts_is_closed_after_the_connect_timeout(caplog):
    caplog.set_level(logging.INFO, logger="swarm.relay")

    async def scenario() -> None:
        relay = Relay(
            relay_id=RELAY_ID, public_host=LOOPBACK, trusted_keys=[public_key_bytes(ISSUER)], connect_timeout_s=0.3
        )
        relay_task, port = await start_relay(relay)
        key = SigningKey.generate()
        node = node_id(public_key_bytes(key))
        async with raw_agent(port, key) as inbox:
            peer = asyncio.create_task(closed_after(port, real_client_hello(node_hostname(node))))
            connect = await asyncio.wait_for(inbox.next(), WAIT_S)
            assert isinstance(connect, Connect) and connect.peer.startswith(f"{LOOPBACK}:")
            assert await asyncio.wait_for(peer, WAIT_S) == b""  # the CONNECT is never answered
            late = accept_line(connect.connection_id, connect.token)  # its token is now worth nothing
            assert await closed_after(port, late) == b""
            assert relay.agents[node].pending == {}
        await stop(relay_task)

    asyncio.run(scenario())
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused connection")]
    assert [re.search(r": (\w+) \(", line).group(1) for line in refused] == ["connect_timeout", "bad_accept"]


def test_relay_ends_a_link_when_its_pass_expires():
    async def scenario() -> None:
        relay = Relay(relay_id=RELAY_ID, public_host=LOOPBACK, trusted_keys=[public_key_bytes(ISSUER)])
        relay_task, port = await start_relay(relay)
        key = SigningKey.generate()
        client = RelayClient((LOOPBACK, port), relay_pass(key, ttl_s=0.5), key, (LOOPBACK, 9))
        with pytest.raises(RelayLost) as caught:
            await asyncio.wait_for(client.run(), WAIT_S)
        assert caught.value.code == "pass_expired"
        assert relay.agents == {}
        await stop(relay_task)

    asyncio.run(scenario())


def test_an_end_of_stream_crosses_the_relay_both_ways():
    async def scenario() -> None:
        async def count_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request = await reader.read()  # until the peer's end of stream, which must cross the relay
            writer.write(b"got %d bytes" % len(request))
            writer.write_eof()
            await reader.read()  # until the peer closes too
            writer.close()

        local = await asyncio.start_server(count_then_answer, LOOPBACK, 0)
        relay = Relay(relay_id=RELAY_ID, public_host=LOOPBACK, trusted_keys=[public_key_bytes(ISSUER)])
        relay_task, port = await start_relay(relay)
        key = SigningKey.generate()
        client = RelayClient((LOOPBACK, port), relay_pass(key), key, (LOOPBACK, local.sockets[0].getsockname()[1]))
        running = asyncio.create_task(client.run())
        await asyncio.wait_for(client.registered.wait(), WAIT_S)
        request = f"GET /relay/{node_id(public_key_bytes(key))}/ HTTP/1.1\r\n\r\n".encode() + PATTERN
        assert await closed_after(port, request, half_close=True) == b"got %d bytes" % len(request)
        await stop(running, relay_task)
        local.close()

    asyncio.run(scenario())


def test_stopping_the_relay_ends_the_client_run_with_relay_lost():
    async def scenario() -> None:
        relay = Relay(relay_id=RELAY_ID, public_host=LOOPBACK, trusted_keys=[public_key_bytes(ISSUER)])
        relay_task, port = await start_relay(relay)
        key = SigningKey.generate()
        client = RelayClient((LOOPBACK, port), relay_pass(key), key, (LOOPBACK, 9))
        running = asyncio.create_task(client.run())
        await asyncio.wait_for(client.registered.wait(), WAIT_S)
        await stop(relay_task)
        with pytest.raises(RelayLost) as caught:
            await asyncio.wait_for(running, WAIT_S)
        assert caught.value.code == "shutdown"
        assert not client.registered.is_set()
        with pytest.raises(RelayError):
            client.public_url(tls=True)
        with pytest.raises(RelayLost) as unreachable:
            await asyncio.wait_for(client.run(), WAIT_S)
        assert unreachable.value.code == "relay_unreachable"

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("sends", "code"),
    [
        (b"\xff\xff\xff\xff", "frame_too_large"),
        (encode_frame(Ping(1)), "unexpected_message"),
        (b"", "relay_lost"),
    ],
)
def test_a_relay_that_breaks_the_protocol_ends_the_run_with_relay_lost(sends, code):
    async def scenario() -> None:
        async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(sends)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(hostile, LOOPBACK, 0)
        key = SigningKey.generate()
        client = RelayClient((LOOPBACK, server.sockets[0].getsockname()[1]), relay_pass(key), key, (LOOPBACK, 9))
        with pytest.raises(RelayLost) as caught:
            await asyncio.wait_for(client.run(), WAIT_S)
        assert caught.value.code == code
        server.close()

    asyncio.run(scenario())


# --- hostile connections -----------------------------------------------------------------------------


def test_unknown_nodes_and_malformed_prefixes_are_closed_and_the_relay_keeps_serving(caplog):
    caplog.set_level(logging.INFO, logger="swarm.relay")
    hostile = [  # (the code the relay logs, what a connection sends)
        ("unknown_node", real_client_hello(node_hostname("node-0000000000000000"))),
        ("not_swarm_name", real_client_hello("example.com")),
        ("bad_client_hello", b"\x16\x03\x01\x00\x10\x02" + bytes(15)),
        ("bad_client_hello", b"\x16\x03\x01\x40\x01"),  # a record over 2**14 bytes, refused on its header
        ("bad_client_hello", b"\x16\x03\x01\x40\x00" + b"\x01" * 2**14),  # the largest prefix read, no hello
        ("bad_request_line", b"GET /relay/" + b"a" * 20_000),
        ("bad_line", b"SWARM-RELAY/1 " + b"x" * 200),
        ("bad_accept", accept_line("0" * 16, bytes(16))),
        ("unknown_protocol", b"\x00\x01hello"),
        ("prefix_timeout", b"\x16\x03"),
        ("prefix_incomplete", b"\x16\x03"),  # and the peer's end of stream
    ]

    async def scenario() -> None:
        async with relayed_agent(prefix_timeout_s=0.5) as agent:
            for code, data in hostile:
                assert await closed_after(agent.port, data, half_close=code == "prefix_incomplete") == b""
            async with await agent.peer() as ws:
                assert await round_trip(ws, b"still served") == b"still served"

    asyncio.run(scenario())
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused connection")]
    assert [re.search(r": (\w+) \(", line).group(1) for line in refused] == [code for code, _ in hostile]


def test_swarm_relay_command_prints_ready_serves_and_stops_on_sigterm():
    key = SigningKey.generate()
    command = [sys.executable, "-m", "worker_agent.agent.relay", "--host", LOOPBACK, "--port", "0"]
    command += ["--public-host", LOOPBACK, "--trust-key", public_key_bytes(ISSUER).hex(), "--id", RELAY_ID]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            line = process.stdout.readline()
            ready = re.fullmatch(rf"READY relay={RELAY_ID} port=(\d+)\n", line)
            assert ready, line

            async def scenario() -> None:
                client = RelayClient((LOOPBACK, int(ready.group(1))), relay_pass(key), key, (LOOPBACK, 9))
                running = asyncio.create_task(client.run())
                await asyncio.wait_for(client.registered.wait(), WAIT_S)
                process.send_signal(signal.SIGTERM)
                with pytest.raises(RelayLost) as caught:
                    await asyncio.wait_for(running, WAIT_S)
                assert caught.value.code == "shutdown"

            asyncio.run(scenario())
            assert process.wait(WAIT_S) == 0
            logged = process.stderr.read()
        finally:
            if process.poll() is None:
                process.kill()
    node = node_id(public_key_bytes(key))
    # One line per event, in the swarm's format (UTC time, level, logger, ids), no secret.
    lines = [LOG_LINE.fullmatch(line) for line in logged.splitlines()]
    assert all(lines), logged
    messages = [line.group(1) for line in lines]
    assert [re.sub(r"(from=127\.0\.0\.1:)\d+|(until=)\d+", r"\1\2N", message) for message in messages] == [
        f"agent registered node={node} from=127.0.0.1:N until=N",
        f"agent lost node={node} from=127.0.0.1:N: shutdown (the relay is shutting down)",
        f"relay {RELAY_ID} stopped",
    ]


LOG_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO swarm\.relay request=- job=- (.*)")


# --- sans-I/O: classifying prefixes -----------------------------------------------------------------


def _vector(size: int, data: bytes) -> bytes:
    return len(data).to_bytes(size, "big") + data


def hello(extensions: list[tuple[int, bytes]] | None, *, session_id: bytes = b"", suites: bytes = b"\x13\x01") -> bytes:
    """A hand-made ClientHello record with these extensions (None: no extension block)."""
    body = b"\x03\x03" + bytes(32) + _vector(1, session_id) + _vector(2, suites) + _vector(1, b"\x00")
    if extensions is not None:
        body += _vector(2, b"".join(kind.to_bytes(2, "big") + _vector(2, data) for kind, data in extensions))
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + _vector(2, handshake)


def sni(*names: tuple[int, bytes]) -> tuple[int, bytes]:
    return 0, _vector(2, b"".join(bytes([kind]) + _vector(2, name) for kind, name in names))


def refusal(prefix: bytes) -> str:
    with pytest.raises(RelayError) as caught:
        classify(prefix)
    return caught.value.code


def test_real_client_hello_routes_on_its_sni_and_every_truncation_asks_for_more():
    data = real_client_hello("node-abc.swarm")
    assert classify(data) == PeerRoute("node-abc", tls=True)
    assert all(classify(data[:size]) is None for size in range(len(data)))


def test_hand_made_client_hellos_route_or_are_refused_with_their_code():
    assert classify(hello([(10, b"\x00\x02\x00\x17"), sni((0, b"Node-1.SWARM"))])) == PeerRoute("node-1", tls=True)
    assert classify(hello([sni((7, b"opaque"), (0, b"node-1.swarm"))])) == PeerRoute("node-1", tls=True)
    assert refusal(hello(None)) == "no_sni"
    assert refusal(hello([(10, b"\x00\x02\x00\x17")])) == "no_sni"
    assert refusal(hello([sni((0, b"example.com"))])) == "not_swarm_name"
    assert refusal(hello([sni((0, b"a.node-1.swarm"))])) == "not_swarm_name"
    assert refusal(hello([sni((0, b"-x.swarm"))])) == "bad_client_hello"
    assert refusal(hello([sni((0, b"n\xc3\xb6de.swarm"))])) == "bad_client_hello"
    assert refusal(hello([sni((0, b"node-1.swarm"), (0, b"node-2.swarm"))])) == "bad_client_hello"
    assert refusal(hello([sni((0, b"node-1.swarm")), sni((0, b"node-2.swarm"))])) == "bad_client_hello"
    assert refusal(hello([(0, b"")])) == "bad_client_hello"
    assert refusal(hello([(0, b"\x00\x00")])) == "bad_client_hello"
    assert refusal(hello([sni((0, b"node-1.swarm"))], session_id=bytes(33))) == "bad_client_hello"
    assert refusal(hello([sni((0, b"node-1.swarm"))], suites=b"\x13")) == "bad_client_hello"
    assert refusal(hello([sni((0, b"x" * 300 + b".swarm"))])) == "bad_client_hello"


def test_client_hellos_with_lying_lengths_are_refused():
    good = bytearray(hello([sni((0, b"node-1.swarm"))]))
    assert refusal(b"\x16\x03\x01\x00\x00") == "bad_client_hello"  # an empty record
    assert refusal(b"\x16\x03\x01\x40\x01") == "bad_client_hello"  # a record over 2**14
    assert refusal(b"\x16\x02\x00\x00\x10") == "bad_client_hello"  # SSL 2 / a bad version
    handshake_type = bytearray(good)
    handshake_type[5] = 2
    assert refusal(bytes(handshake_type)) == "bad_client_hello"
    fragmented = bytearray(good)
    fragmented[8] += 1  # the ClientHello says it is longer than its record: it spans records
    assert refusal(bytes(fragmented)) == "bad_client_hello"
    overshoot = bytearray(good)
    overshoot[-len(b"node-1.swarm") - 3] += 1  # the host name's length runs past the extension
    assert refusal(bytes(overshoot)) == "bad_client_hello"
    trailing = bytearray(good + b"\x00")
    trailing[3:5] = (int.from_bytes(good[3:5], "big") + 1).to_bytes(2, "big")
    assert refusal(bytes(trailing)) == "bad_client_hello"


def test_random_and_mutated_prefixes_never_raise_anything_but_relay_error():
    rng = random.Random(7)
    good = hello([(10, b"\x00\x02\x00\x17"), sni((0, b"node-1.swarm"))])
    samples = [rng.randbytes(rng.randrange(1, 600)) for _ in range(1000)]
    for _ in range(3000):
        mutated = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        samples.append(bytes(mutated[: rng.randrange(1, len(mutated) + 1)]))
    for sample in samples:
        with contextlib.suppress(RelayError):
            route = classify(sample)
            assert route is None or isinstance(route, PeerRoute | AgentRoute | AcceptRoute)


def test_relay_gets_route_on_their_path_and_lines_name_agents_and_accepts():
    assert classify(b"GET /relay/node-1 HTTP/1.1\r\nHost: x\r\n") == PeerRoute("node-1", tls=False)
    assert classify(b"GET /relay/node-1/deep/path HTTP/1.1\r\n") == PeerRoute("node-1", tls=False)
    assert classify(b"GET /relay/node-1?x=1 HTTP/1.1\r\n") == PeerRoute("node-1", tls=False)
    assert classify(b"GET /relay/node-1 HTTP/1.1") is None
    assert classify(b"GE") is None
    assert refusal(b"GET /other HTTP/1.1\r\n") == "bad_request_line"
    assert refusal(b"GET /relay/Node_1 HTTP/1.1\r\n") == "not_swarm_name"
    assert refusal(b"GET /relay/node-1 SPDY/3\r\n") == "bad_request_line"
    assert refusal(b"GET /relay/" + b"a" * 9000) == "bad_request_line"
    assert refusal(b"POST /relay/node-1 HTTP/1.1\r\n") == "unknown_protocol"
    assert classify(AGENT_LINE + b"\x00\x00") == AgentRoute(consumed=len(AGENT_LINE))
    token = bytes(range(16))
    line = accept_line("0123456789abcdef", token)
    assert line == b"SWARM-RELAY/1 ACCEPT 0123456789abcdef 000102030405060708090a0b0c0d0e0f\n"
    assert classify(line + b"spliced") == AcceptRoute("0123456789abcdef", token, consumed=len(line))
    assert classify(AGENT_LINE[:-1]) is None
    assert refusal(b"SWARM-RELAY/2 AGENT\n") == "bad_version"
    assert refusal(b"SWARM-RELAY/1 ACCEPT 0123 00\n") == "bad_line"
    assert refusal(b"SWARM-RELAY/1 AGENT \n") == "bad_line"
    assert refusal(b"SWARM-RELAY/1 \xff\n") == "bad_line"
    assert refusal(b"SWARM-RELAY/1 " + b"A" * 200) == "bad_line"


# --- sans-I/O: frames, messages, passes ------------------------------------------------------------


MESSAGES = [
    Challenge(bytes(range(32)), RELAY_ID),
    Register(b"p" * 100, bytes(64)),
    Registered("node-1", "wss://h:1", "ws://h:1/relay/node-1", 15.0, 45.0, 1e9),
    Connect("0123456789abcdef", bytes(16), "192.0.2.1:5000"),
    Ping(1),
    Pong(2**63 - 1),
    Error("unknown_node", "no agent"),
]


def test_every_message_round_trips_whole_and_byte_by_byte():
    stream = b"".join(encode_frame(message) for message in MESSAGES)
    assert FrameDecoder().feed(stream) == MESSAGES
    decoder = FrameDecoder()
    assert [message for at in range(len(stream)) for message in decoder.feed(stream[at : at + 1])] == MESSAGES


def frame_refusal(data: bytes) -> str:
    with pytest.raises(RelayError) as caught:
        FrameDecoder().feed(data)
    return caught.value.code


def test_hostile_frames_are_refused_with_their_code():
    def frame(obj) -> bytes:
        payload = msgpack.packb(obj, use_bin_type=True)
        return len(payload).to_bytes(4, "big") + payload

    assert frame_refusal((MAX_FRAME_BYTES + 1).to_bytes(4, "big")) == "frame_too_large"  # from the header alone
    assert frame_refusal(b"\xff\xff\xff\xff") == "frame_too_large"
    assert frame_refusal(bytes(4)) == "frame_too_large"
    assert FrameDecoder().feed(encode_frame(Ping(1))[:-1]) == []
    assert frame_refusal(b"\x00\x00\x00\x01\xc1") == "bad_frame"
    assert frame_refusal(frame([1, 2])) == "bad_frame"
    assert frame_refusal(frame({"v": 2, "type": "ping", "seq": 1})) == "bad_version"
    assert frame_refusal(frame({"v": True, "type": "ping", "seq": 1})) == "bad_version"
    assert frame_refusal(frame({"v": 1, "type": "shell", "seq": 1})) == "unknown_type"
    assert frame_refusal(frame({"v": 1, "type": "ping"})) == "bad_field"
    assert frame_refusal(frame({"v": 1, "type": "ping", "seq": 1, "extra": 0})) == "bad_field"
    assert frame_refusal(frame({"v": 1, "type": "ping", "seq": -1})) == "bad_field"
    assert frame_refusal(frame({"v": 1, "type": "ping", "seq": True})) == "bad_field"
    assert frame_refusal(frame({"v": 1, "type": "challenge", "nonce": bytes(31), "relay": "r"})) == "bad_field"
    assert (
        frame_refusal(frame({"v": 1, "type": "connect", "connection_id": "../x", "token": bytes(16), "peer": "p"}))
        == "bad_field"
    )
    with pytest.raises(RelayError) as caught:
        decode_message(
            msgpack.packb(
                {
                    "v": 1,
                    "type": "registered",
                    "node": "Node_1",
                    "tls_url": "u",
                    "plain_url": "u",
                    "ping_interval_s": 1.0,
                    "idle_timeout_s": 1.0,
                    "expires_at": 1.0,
                }
            )
        )
    assert caught.value.code == "bad_field"


def test_relay_pass_round_trips_and_fails_closed():
    node_key = SigningKey.generate()
    node = node_id(public_key_bytes(node_key))
    trusted = [public_key_bytes(ISSUER)]
    signed = sign_relay_pass(ISSUER, node, public_key_bytes(node_key).hex(), RELAY_ID, 2000.0)
    granted = verify_relay_pass(signed, trusted, RELAY_ID, now=1000.0)
    assert (granted.node, granted.node_key, granted.relay, granted.expires_at) == (
        node,
        public_key_bytes(node_key),
        RELAY_ID,
        2000.0,
    )
    assert granted.issuer_key == public_key_bytes(ISSUER)
    anywhere = sign_relay_pass(ISSUER, node, public_key_bytes(node_key), "*", 2000.0)
    assert verify_relay_pass(anywhere, trusted, "any-relay", now=1000.0).relay == "*"

    def code(data: bytes, now: float = 1000.0, relay_id: str = RELAY_ID) -> str:
        with pytest.raises(RelayError) as caught:
            verify_relay_pass(data, trusted, relay_id, now=now)
        return caught.value.code

    assert code(signed, now=2000.0) == "pass_expired"
    assert code(signed, relay_id="other") == "pass_wrong_relay"
    assert (
        code(sign_relay_pass(SigningKey.generate(), node, public_key_bytes(node_key), RELAY_ID, 2000.0))
        == "pass_untrusted"
    )
    tampered = bytearray(signed)
    tampered[signed.index(node.encode())] ^= 0x01
    assert code(bytes(tampered)) == "pass_invalid"
    ticket = issue_ticket(ISSUER, job="j", node=node, model="m", layer_start=0, layer_end=1, coordinator_key=bytes(32))
    assert code(ticket) == "pass_invalid"  # the same key's ticket is no pass: another signing context
    assert code(b"\x00" * 2000) == "pass_invalid"
    assert code(b"\xc1") == "pass_invalid"
    with pytest.raises(RelayError):
        sign_relay_pass(ISSUER, "Node_1", public_key_bytes(node_key), RELAY_ID, 2000.0)


def test_liveness_pings_each_interval_and_gives_up_after_the_idle_timeout():
    live = Liveness(100.0, ping_interval_s=15.0, idle_timeout_s=45.0)
    assert (live.ping_due(100.0), live.wait_s(100.0)) == (False, 15.0)
    assert (live.ping_due(115.0), live.ping_due(115.0), live.wait_s(115.0)) == (True, False, 15.0)
    live.heard(120.0)
    assert (live.dead(164.9), live.dead(165.0)) == (False, True)


def test_public_urls_bracket_ipv6_hosts():
    assert public_urls("relay.example.org", 443, "node-1") == (
        "wss://relay.example.org:443",
        "ws://relay.example.org:443/relay/node-1",
    )
    assert public_urls("2001:db8::1", 7700, "node-1") == (
        "wss://[2001:db8::1]:7700",
        "ws://[2001:db8::1]:7700/relay/node-1",
    )
