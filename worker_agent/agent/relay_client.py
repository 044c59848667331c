"""The agent's side of a relay: serve peers through a relay when they cannot reach the agent.

    client = RelayClient(("relay.example.org", 443), relay_pass, node_key, ("127.0.0.1", 7001))
    task = asyncio.create_task(client.run())
    await client.registered.wait()
    url = client.public_url(tls=True)      # advertise it: wss://relay.example.org:443

``run`` connects out (so it works behind NAT, or a firewall that allows only outbound connections),
registers with the node's relay pass and a signature of the relay's nonce by the node key, and
keeps the control link alive (PING/PONG). On each CONNECT it opens a new connection to the relay
(the ACCEPT line) and one to the agent's own data server at ``local_data_address``, and splices
them: the agent's websockets server, TLS and mTLS included, serves relayed peers unchanged, and
the relay sees only ciphertext.

``run`` never returns normally: it raises ``RelayLost``, whose ``code`` says why. The link could
not be made or ended: relay_unreachable, relay_lost, ping_timeout, or the code of the relay's
ERROR (replaced, shutdown, pass_expired); the agent picks another relay. The relay refused the
registration: its code (pass_expired, pass_untrusted, pass_wrong_relay, pass_invalid,
bad_signature, relay_full); the agent needs a new pass or another relay. Either way the
connections it spliced are closed and ``registered`` is cleared first.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NoReturn

from nacl.signing import SigningKey

from worker_agent.agent.relay import STREAM_LIMIT, MessageReader, splice, tune
from worker_agent.errors import RelayError, RelayLost
from worker_agent.protocol.relay_pass import register_signature
from worker_agent.protocol.relay_protocol import (
    AGENT_LINE,
    IDLE_TIMEOUT_S,
    PING_INTERVAL_S,
    Challenge,
    Connect,
    Error,
    Liveness,
    Message,
    Ping,
    Pong,
    Register,
    Registered,
    accept_line,
    encode_frame,
)

log = logging.getLogger("swarm.relay_client")

CONNECT_TIMEOUT_S = 10.0  # to open a TCP connection to the relay or to the local data server
HANDSHAKE_TIMEOUT_S = 10.0  # the relay's CHALLENGE, then its answer to REGISTER
SEND_TIMEOUT_S = 10.0  # the relay takes a control frame within this, or the link is dead
CLOSE_TIMEOUT_S = 5.0  # spliced connections end within this once closed


class RelayClient:
    """One agent's link to one relay. ``registered`` is set while the relay has it registered, and
    ``registration`` holds the relay's REGISTERED (the public URLs)."""

    def __init__(
        self,
        relay_address: tuple[str, int],
        pass_bytes: bytes,
        signing_key: SigningKey,
        local_data_address: tuple[str, int],
        *,
        ping_interval_s: float = PING_INTERVAL_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.relay_address = relay_address
        self.pass_bytes = pass_bytes
        self.signing_key = signing_key
        self.local_data_address = local_data_address
        self.ping_interval_s, self.idle_timeout_s = ping_interval_s, idle_timeout_s
        self.registered = asyncio.Event()
        self.registration: Registered | None = None
        self._splices: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()  # both ends of every spliced connection

    def public_url(self, tls: bool) -> str:
        """The URL peers dial to reach this agent through the relay: ``wss://`` for a TLS data
        server (peers check its certificate as ever: the relay routes on the SNI), else ``ws://``."""
        if self.registration is None:
            raise RelayError("the relay has not registered this agent", code="not_registered")
        return self.registration.tls_url if tls else self.registration.plain_url

    async def run(self) -> NoReturn:
        host, port = self.relay_address
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(host, port, limit=STREAM_LIMIT)
        except OSError as exc:  # refused, unreachable, or TimeoutError (an OSError)
            raise RelayLost(f"cannot reach the relay at {host}:{port}: {exc}", code="relay_unreachable") from None
        try:
            tune(writer)
            writer.write(AGENT_LINE)
            inbox = MessageReader(reader)
            await self._register(inbox, writer)
            log.info("registered at relay %s:%s as %s", host, port, self.public_url(tls=True))
            await self._keep(inbox, writer)
        except RelayLost:
            raise
        except RelayError as exc:  # a frame that breaks the relay protocol: this relay cannot be used
            raise RelayLost(f"the relay at {host}:{port} broke the protocol: {exc}", code=exc.code) from None
        except OSError as exc:  # a reset, or a TimeoutError (an OSError) waiting on the relay
            raise RelayLost(f"the link to the relay at {host}:{port} broke: {exc!r}", code="relay_lost") from None
        finally:
            self.registered.clear()
            self.registration = None
            writer.close()
            for spliced in list(self._writers):
                spliced.close()
            if self._splices:
                _, opening = await asyncio.wait(self._splices, timeout=CLOSE_TIMEOUT_S)
                for task in opening:  # still connecting: nothing of theirs is open yet to trip on
                    task.cancel()

    async def _next(self, inbox: MessageReader, timeout_s: float) -> Message:
        async with asyncio.timeout(timeout_s):
            message = await inbox.next()
        if message is None:
            raise RelayLost("the relay closed the control link", code="relay_lost")
        return message

    async def _send(self, writer: asyncio.StreamWriter, message: Message) -> None:
        writer.write(encode_frame(message))
        async with asyncio.timeout(SEND_TIMEOUT_S):
            await writer.drain()

    async def _register(self, inbox: MessageReader, writer: asyncio.StreamWriter) -> None:
        challenge = await self._next(inbox, HANDSHAKE_TIMEOUT_S)
        if not isinstance(challenge, Challenge):
            raise RelayLost(f"the relay began with {challenge.TYPE}, not CHALLENGE", code="unexpected_message")
        signature = register_signature(self.signing_key, challenge.nonce, challenge.relay)
        await self._send(writer, Register(self.pass_bytes, signature))
        answer = await self._next(inbox, HANDSHAKE_TIMEOUT_S)
        if isinstance(answer, Error):
            raise RelayLost(f"the relay refused this agent: {answer.message}", code=answer.code)
        if not isinstance(answer, Registered):
            raise RelayLost(f"the relay answered REGISTER with {answer.TYPE}", code="unexpected_message")
        self.registration = answer
        self.registered.set()

    async def _keep(self, inbox: MessageReader, writer: asyncio.StreamWriter) -> NoReturn:
        loop = asyncio.get_running_loop()
        live = Liveness(loop.time(), ping_interval_s=self.ping_interval_s, idle_timeout_s=self.idle_timeout_s)
        seq = 0
        while True:
            now = loop.time()
            if live.dead(now):
                raise RelayLost(f"nothing heard from the relay for {self.idle_timeout_s:g}s", code="ping_timeout")
            if live.ping_due(now):
                seq += 1
                await self._send(writer, Ping(seq))
            try:
                message = await self._next(inbox, live.wait_s(now))
            except TimeoutError:
                continue
            live.heard(loop.time())
            if isinstance(message, Ping):
                await self._send(writer, Pong(message.seq))
            elif isinstance(message, Connect):
                task = asyncio.create_task(self._serve_peer(message))
                self._splices.add(task)
                task.add_done_callback(self._splices.discard)
            elif isinstance(message, Error):
                raise RelayLost(f"the relay ended the link: {message.message}", code=message.code)
            elif not isinstance(message, Pong):
                raise RelayLost(f"the relay sent {message.TYPE} after REGISTERED", code="unexpected_message")

    async def _serve_peer(self, connect: Connect) -> None:
        """Answer one CONNECT: both connections are opened at once, and if either fails the other is
        closed, so the relay drops the waiting peer at once rather than after its timeout."""
        opened = await asyncio.gather(
            self._open(self.relay_address, accept_line(connect.connection_id, connect.token)),
            self._open(self.local_data_address, b""),
            return_exceptions=True,
        )
        relay, local = opened
        if isinstance(relay, BaseException) or isinstance(local, BaseException):
            for side in opened:
                if not isinstance(side, BaseException):
                    side[1].close()
            log.warning(
                "cannot serve relayed peer %s: %r", connect.peer, relay if isinstance(relay, BaseException) else local
            )
            return
        self._writers.update((relay[1], local[1]))
        try:
            await splice(relay, local)
        finally:
            self._writers.difference_update((relay[1], local[1]))

    async def _open(self, address: tuple[str, int], first: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(*address, limit=STREAM_LIMIT)
        tune(writer)
        if first:
            writer.write(first)
        return reader, writer
