"""The relay server: peers reach agents that cannot accept connections (wire rules: ``relay_protocol.py``).

    swarm-relay --host 0.0.0.0 --port 443 --public-host relay.example.org --trust-key CONTROL_PLANE_KEY.pub

It prints ``READY relay=<id> port=<port>`` on stdout once it listens, logs one line per agent
registered or lost and per refused connection (never a pass, a token or a signature), and stops
on SIGTERM or SIGINT: each agent gets ERROR ``shutdown``, every connection is closed.

For a peer of a registered node the relay sends CONNECT over the agent's control link, waits
(``connect_timeout_s``) for the agent's ACCEPT connection with that CONNECT's id and one-time
token, writes it the bytes it read from the peer, then splices the two (``splice``). Every byte
passes through ``Relay.forward``, which a test subclass overrides to record or alter the stream.
The relay never holds a TLS key: it sees ClientHellos and ciphertext, and a byte it changed
fails the peers' TLS record check instead of reaching them.

Bounds: the prefix read (``MAX_PREFIX_BYTES``, ``prefix_timeout_s``), REGISTER within
``REGISTER_TIMEOUT_S``, ``max_agents``, ``max_pending`` unanswered CONNECTs per agent, control
frames of ``MAX_FRAME_BYTES``, links silent for ``idle_timeout_s`` dropped, every write to a control
link within ``SEND_TIMEOUT_S``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial

from worker_agent import logs
from worker_agent.errors import RelayError
from worker_agent.logs import add_log_options
from worker_agent.protocol.keys import KeyFileError, load_verify_key
from worker_agent.protocol.relay_pass import RelayPass, check_register_signature, verify_relay_pass
from worker_agent.protocol.relay_protocol import (
    CONNECTION_ID_CHARS,
    IDLE_TIMEOUT_S,
    MAX_FRAME_BYTES,
    MAX_PREFIX_BYTES,
    NONCE_BYTES,
    PING_INTERVAL_S,
    TOKEN_BYTES,
    AcceptRoute,
    AgentRoute,
    Challenge,
    Connect,
    Error,
    FrameDecoder,
    Liveness,
    Message,
    PeerRoute,
    Ping,
    Pong,
    Register,
    Registered,
    Route,
    classify,
    encode_frame,
    public_urls,
)

log = logging.getLogger("swarm.relay")

PREFIX_TIMEOUT_S = 10.0  # a connection names what it is within this
REGISTER_TIMEOUT_S = 10.0  # an agent answers CHALLENGE within this
CONNECT_TIMEOUT_S = 10.0  # an agent answers CONNECT with its ACCEPT connection within this
SEND_TIMEOUT_S = 10.0  # a control link takes a frame within this, or is dead
SHUTDOWN_TIMEOUT_S = 5.0  # connection handlers end within this once their sockets are closed
MAX_AGENTS = 1000
MAX_PENDING_CONNECTS = 64  # per agent: CONNECTs sent and not yet answered
CHUNK_BYTES = 256 * 1024  # bytes one splice read takes at most
# A splice's buffers: one read may bring a whole activation frame, and a writer waits only past
# this, so a burst crosses without a pause. The kernel's socket buffers are left to autotune.
STREAM_LIMIT = 1024 * 1024
WRITE_HIGH_WATER = 1024 * 1024

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Direction(StrEnum):
    TO_AGENT = "to_agent"  # bytes from the peer, on their way to the agent
    TO_PEER = "to_peer"  # bytes from the agent, on their way to the peer


def tune(writer: asyncio.StreamWriter) -> None:
    """TCP_NODELAY, so a small frame leaves at once rather than after the other end's delayed ACK,
    and a write buffer of WRITE_HIGH_WATER before the writer waits."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, forward: Callable[[bytes], bytes]) -> None:
    while data := await reader.read(CHUNK_BYTES):
        writer.write(forward(data))
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


def _same(data: bytes) -> bytes:
    return data


async def splice(
    left: Streams,
    right: Streams,
    *,
    to_right: Callable[[bytes], bytes] = _same,
    to_left: Callable[[bytes], bytes] = _same,
) -> None:
    """Pipe two connections into each other (each chunk through ``to_right``/``to_left``) until both
    directions have ended, then close both. An end of stream half-closes the other side (a peer may
    shut its sending side and wait for the answer); an error on either side closes both."""
    try:
        async with asyncio.TaskGroup() as pipes:
            pipes.create_task(_pipe(left[0], right[1], to_right))
            pipes.create_task(_pipe(right[0], left[1], to_left))
    except* OSError:
        pass  # a reset or a broken pipe on either side: both are closed below, as a router would
    finally:
        left[1].close()
        right[1].close()


class MessageReader:
    """A control link's incoming messages, one at a time (a read may bring several frames)."""

    def __init__(self, reader: asyncio.StreamReader, leftover: bytes = b"") -> None:
        self._reader = reader
        self._decoder = FrameDecoder()
        self._ready: deque[Message] = deque(self._decoder.feed(leftover))

    async def next(self) -> Message | None:
        """The next message, None at the end of the stream; RelayError for a frame that breaks the
        rules. Cancelling it (a timeout) loses no bytes: they stay in the reader."""
        while not self._ready:
            data = await self._reader.read(MAX_FRAME_BYTES)
            if not data:
                return None
            self._ready.extend(self._decoder.feed(data))
        return self._ready.popleft()


def _address(writer: asyncio.StreamWriter) -> str:
    peername = writer.get_extra_info("peername")
    return f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else "?"


@dataclass
class _Pending:
    token: bytes  # the CONNECT's one-time token, which the ACCEPT line must carry
    accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]]


@dataclass
class _AgentLink:
    relay_pass: RelayPass
    writer: asyncio.StreamWriter
    address: str  # the agent's address as the relay sees it
    pending: dict[str, _Pending] = field(default_factory=dict)  # connection id -> its waiting peer
    ending: RelayError | None = None  # why the relay ended the link, once it did

    async def send(self, message: Message) -> None:
        self.writer.write(encode_frame(message))
        async with asyncio.timeout(SEND_TIMEOUT_S):
            await self.writer.drain()

    def end(self, error: RelayError) -> None:
        """Tell the agent why, then close: the transport sends what it holds before the FIN."""
        if self.ending is None and not self.writer.is_closing():
            self.ending = error
            self.writer.write(encode_frame(Error.of(error)))
        self.writer.close()


class Relay:
    """One relay: ``serve`` runs it until cancelled. ``agents`` maps each registered node to its link."""

    def __init__(
        self,
        *,
        relay_id: str,
        public_host: str,
        trusted_keys: Collection[bytes],
        public_port: int | None = None,
        max_agents: int = MAX_AGENTS,
        max_pending: int = MAX_PENDING_CONNECTS,
        ping_interval_s: float = PING_INTERVAL_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        prefix_timeout_s: float = PREFIX_TIMEOUT_S,
    ) -> None:
        self.relay_id = relay_id
        self.public_host = public_host
        self.public_port = public_port  # None: the port it listens on
        self.trusted_keys = frozenset(bytes(key) for key in trusted_keys)
        self.max_agents, self.max_pending = max_agents, max_pending
        self.ping_interval_s, self.idle_timeout_s = ping_interval_s, idle_timeout_s
        self.connect_timeout_s, self.prefix_timeout_s = connect_timeout_s, prefix_timeout_s
        self.agents: dict[str, _AgentLink] = {}
        self._pending: dict[str, _Pending] = {}  # connection id -> its waiting peer, over all agents
        self._writers: set[asyncio.StreamWriter] = set()  # every open connection, to close at shutdown
        self._handlers: set[asyncio.Task] = set()

    def forward(self, connection: str, direction: Direction, data: bytes) -> bytes:
        """The bytes to send on for ``data`` read from one side of ``connection`` (a CONNECT's id):
        the same bytes. Tests override it to record or alter a stream."""
        return data

    async def serve(self, host: str, port: int, *, ready: Callable[[int], None] | None = None) -> None:
        """Listen on ``host``:``port`` (0: any free port, passed to ``ready``) until cancelled."""
        server = await asyncio.start_server(self._handle, host, port, limit=STREAM_LIMIT)
        bound = server.sockets[0].getsockname()[1]
        if self.public_port is None:
            self.public_port = bound
        if ready is not None:
            ready(bound)
        try:
            await server.serve_forever()
        finally:
            await self._shutdown(server)

    async def _shutdown(self, server: asyncio.Server) -> None:
        server.close()
        for link in list(self.agents.values()):
            link.end(RelayError("the relay is shutting down", code="shutdown"))
        # Closing the transports ends every handler (end of stream, or a reset on write), where
        # cancelling them would trip asyncio's streams in Python 3.11.
        for writer in list(self._writers):
            writer.close()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=SHUTDOWN_TIMEOUT_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), SHUTDOWN_TIMEOUT_S)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None  # asyncio.start_server runs each connection's callback in a task
        self._handlers.add(handler)
        self._writers.add(writer)
        address = _address(writer)
        handed_over = False
        try:
            tune(writer)
            route, prefix = await self._read_prefix(reader)
            if isinstance(route, PeerRoute):
                await self._peer(route, prefix, (reader, writer), address)
            elif isinstance(route, AgentRoute):
                await self._agent(prefix[route.consumed :], reader, writer, address)
            else:
                handed_over = self._accept(route, prefix[route.consumed :], reader, writer)
        except RelayError as exc:
            log.info("refused connection from %s: %s (%s)", address, exc.code, exc)
        except OSError:
            pass  # the connection reset or broke: nothing to answer
        finally:
            if not handed_over:
                writer.close()
                self._writers.discard(writer)
            self._handlers.discard(handler)

    async def _read_prefix(self, reader: asyncio.StreamReader) -> tuple[Route, bytes]:
        prefix = b""
        try:
            async with asyncio.timeout(self.prefix_timeout_s):
                while (route := classify(prefix)) is None:
                    chunk = await reader.read(MAX_PREFIX_BYTES - len(prefix))
                    if not chunk:
                        raise RelayError("the connection closed before it said what it is", code="prefix_incomplete")
                    prefix += chunk
        except TimeoutError:
            raise RelayError(f"no decision within {self.prefix_timeout_s:g}s", code="prefix_timeout") from None
        return route, prefix

    async def _peer(self, route: PeerRoute, prefix: bytes, peer: Streams, address: str) -> None:
        link = self.agents.get(route.node)
        if link is None:
            raise RelayError(f"no agent is registered for node {route.node}", code="unknown_node")
        if len(link.pending) >= self.max_pending:
            raise RelayError(f"node {route.node} has {self.max_pending} connections waiting", code="too_many_pending")
        connection_id, token = secrets.token_hex(CONNECTION_ID_CHARS // 2), secrets.token_bytes(TOKEN_BYTES)
        pending = _Pending(token, asyncio.get_running_loop().create_future())
        self._pending[connection_id] = link.pending[connection_id] = pending
        agent = None
        try:
            await link.send(Connect(connection_id, token, address))
            async with asyncio.timeout(self.connect_timeout_s):
                agent = await pending.accepted
        except TimeoutError:
            raise RelayError(f"node {route.node} did not answer CONNECT in time", code="connect_timeout") from None
        except OSError:
            raise RelayError(f"the control link of node {route.node} broke", code="agent_lost") from None
        finally:
            del self._pending[connection_id]
            link.pending.pop(connection_id, None)
            if not pending.accepted.done():
                pending.accepted.cancel()
            elif agent is None and not pending.accepted.cancelled() and pending.accepted.exception() is None:
                pending.accepted.result()[1].close()  # accepted just as the wait gave up
        agent_reader, agent_writer, leftover = agent
        log.debug("splicing %s to node %s (%s)", address, route.node, connection_id)
        try:
            agent_writer.write(self.forward(connection_id, Direction.TO_AGENT, prefix))
            if leftover:
                peer[1].write(self.forward(connection_id, Direction.TO_PEER, leftover))
            await splice(
                peer,
                (agent_reader, agent_writer),
                to_right=partial(self.forward, connection_id, Direction.TO_AGENT),
                to_left=partial(self.forward, connection_id, Direction.TO_PEER),
            )
        finally:
            agent_writer.close()
            self._writers.discard(agent_writer)

    def _accept(
        self, route: AcceptRoute, leftover: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Hand an ACCEPT connection to the peer waiting for it (which then owns it)."""
        pending = self._pending.get(route.connection_id)
        # compare_digest: how long a wrong token takes to refuse says nothing of the right one.
        if pending is None or not hmac.compare_digest(pending.token, route.token) or pending.accepted.done():
            raise RelayError("an ACCEPT for no waiting peer, or with another token", code="bad_accept")
        pending.accepted.set_result((reader, writer, leftover))
        return True

    async def _agent(
        self, leftover: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str
    ) -> None:
        nonce = os.urandom(NONCE_BYTES)
        inbox = MessageReader(reader, leftover)
        writer.write(encode_frame(Challenge(nonce, self.relay_id)))
        try:
            try:
                async with asyncio.timeout(REGISTER_TIMEOUT_S):
                    register = await inbox.next()
            except TimeoutError:
                raise RelayError(f"no REGISTER within {REGISTER_TIMEOUT_S:g}s", code="register_timeout") from None
            relay_pass = self._admit(register, nonce)
        except RelayError as exc:
            writer.write(encode_frame(Error.of(exc)))  # flushed by the close that follows
            raise
        link = _AgentLink(relay_pass, writer, address)
        node = relay_pass.node
        previous, self.agents[node] = self.agents.get(node), link
        if previous is not None:
            previous.end(RelayError("a newer registration of this node replaced this link", code="replaced"))
        log.info("agent registered node=%s from=%s until=%.0f", node, address, relay_pass.expires_at)
        reason = "closed by the agent"
        try:
            tls_url, plain_url = public_urls(self.public_host, self.public_port or 0, node)
            registered = Registered(
                node, tls_url, plain_url, self.ping_interval_s, self.idle_timeout_s, relay_pass.expires_at
            )
            await link.send(registered)
            reason = await self._keep(link, inbox) or reason
        except RelayError as exc:
            reason = f"{exc.code} ({exc})"
            link.end(exc)
        except OSError as exc:
            reason = f"the link broke ({type(exc).__name__})"
        finally:
            if self.agents.get(node) is link:
                del self.agents[node]
            lost = RelayError(f"the control link of node {node} ended", code="agent_lost")
            for pending in link.pending.values():
                if not pending.accepted.done():
                    pending.accepted.set_exception(lost)
            if link.ending is not None:
                reason = f"{link.ending.code} ({link.ending})"
            log.info("agent lost node=%s from=%s: %s", node, address, reason)

    def _admit(self, register: Message | None, nonce: bytes) -> RelayPass:
        if not isinstance(register, Register):
            raise RelayError("a control link must answer CHALLENGE with REGISTER", code="unexpected_message")
        relay_pass = verify_relay_pass(register.relay_pass, self.trusted_keys, self.relay_id, time.time())
        check_register_signature(relay_pass.node_key, nonce, self.relay_id, register.signature)
        if relay_pass.node not in self.agents and len(self.agents) >= self.max_agents:
            raise RelayError(f"this relay holds its maximum of {self.max_agents} agents", code="relay_full")
        return relay_pass

    async def _keep(self, link: _AgentLink, inbox: MessageReader) -> str | None:
        """Serve a registered link until it ends: None when the agent closed it, a reason when it
        said ERROR; raises RelayError when the relay ends it (silence, expiry, a broken rule)."""
        loop = asyncio.get_running_loop()
        live = Liveness(loop.time(), ping_interval_s=self.ping_interval_s, idle_timeout_s=self.idle_timeout_s)
        seq = 0
        while True:
            now, left_s = loop.time(), link.relay_pass.expires_at - time.time()
            if left_s <= 0:
                raise RelayError("the relay pass expired", code="pass_expired")
            if live.dead(now):
                raise RelayError(f"nothing heard for {self.idle_timeout_s:g}s", code="ping_timeout")
            if live.ping_due(now):
                seq += 1
                await link.send(Ping(seq))
            try:
                async with asyncio.timeout(min(live.wait_s(now), left_s)):
                    message = await inbox.next()
            except TimeoutError:
                continue
            if message is None:
                return None
            live.heard(loop.time())
            if isinstance(message, Ping):
                await link.send(Pong(message.seq))
            elif isinstance(message, Error):
                return f"the agent said {message.code} ({message.message})"
            elif not isinstance(message, Pong):
                raise RelayError(f"{message.TYPE} is not an agent's message after REGISTER", code="unexpected_message")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-relay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: every interface)")
    parser.add_argument("--port", type=int, default=7700, help="the one TCP port for agents and peers (default 7700)")
    parser.add_argument("--public-host", required=True, help="the host name or IP peers reach this relay at")
    parser.add_argument("--public-port", type=int, default=None, help="the port peers reach it at (default: --port)")
    parser.add_argument(
        "--trust-key",
        action="append",
        required=True,
        help="a control plane's relay-pass key: 64 hex characters or a key file (repeatable)",
    )
    parser.add_argument("--id", default=None, help="the relay id passes name (default: PUBLIC_HOST:PUBLIC_PORT)")
    parser.add_argument("--max-agents", type=int, default=MAX_AGENTS, help=f"default {MAX_AGENTS}")
    add_log_options(parser)
    return parser


async def _run(relay: Relay, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def ready(bound: int) -> None:
        print(f"READY relay={relay.relay_id} port={bound}", flush=True)

    serving = asyncio.create_task(relay.serve(host, port, ready=ready))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving  # re-raises an OSError from listening


def main(argv: list[str] | None = None, relay_class: Callable[..., Relay] | None = None) -> int:
    """The ``swarm-relay`` command; ``relay_class`` (tests) makes the relay instead of ``Relay``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.configure(args.log_format, args.log_level)
    try:
        trusted = [load_verify_key(key) for key in args.trust_key]
    except KeyFileError as exc:
        parser.error(str(exc))
    public_port = args.public_port or args.port
    relay = (relay_class or Relay)(
        relay_id=args.id or f"{args.public_host}:{public_port}",
        public_host=args.public_host,
        public_port=public_port or None,
        trusted_keys=trusted,
        max_agents=args.max_agents,
    )
    try:
        asyncio.run(_run(relay, args.host, args.port))
    except OSError as exc:
        print(f"swarm-relay: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    log.info("relay %s stopped", relay.relay_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
