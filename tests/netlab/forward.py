"""A TCP forwarder on a thread of its own: it accepts on one address and pipes each connection to one
upstream, so that a network namespace reaches a service that listens only on the root namespace's
loopback (PostgreSQL, Redis) across a veth, as it would reach it on another host.

It runs in the test process rather than as a helper process (socat), so that it dies with that
process: a killed run leaves no forwarder to reap.
"""

from __future__ import annotations

import asyncio
import threading

CHUNK_BYTES = 64 * 1024
CONNECT_TIMEOUT_S = 5.0  # to the upstream, on the same machine: only a dead service takes this long
START_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0


class ForwarderError(Exception):
    """The forwarder could not start or stop."""


class TcpForwarder:
    """Listens on ``listen_host`` at a port the kernel picks (``port``, known once ``start`` returns)
    and relays each accepted connection to ``upstream``, byte for byte, both ways.

    An end of stream on one side half-closes the other (as a TCP proxy must, for clients that shut
    their sending side down and wait for the reply); an error on either side drops both, as a reset.
    ``close`` stops listening and drops every open relay.
    """

    def __init__(self, listen_host: str, upstream: tuple[str, int], name: str) -> None:
        self.listen_host = listen_host
        self.upstream = upstream
        self.port = 0
        self._ready = threading.Event()
        self._error: OSError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._relays: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()  # both ends of every open relay
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise ForwarderError(f"forwarder {self._thread.name} did not start within {START_TIMEOUT_S}s")
        if self._error is not None:
            raise ForwarderError(f"forwarder {self._thread.name} cannot listen on {self.listen_host}: {self._error}")

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        assert self._loop is not None and self._stop is not None  # set before the thread signals ready
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            raise ForwarderError(f"forwarder {self._thread.name} did not stop within {STOP_TIMEOUT_S}s")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            server = await asyncio.start_server(self._relay, self.listen_host, 0)
        except OSError as exc:
            self._error = exc
            self._ready.set()
            return
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            # Closing the transports ends each relay's pipes (end of stream, or a reset on write),
            # where cancelling a relay's task would trip asyncio's streams in Python 3.11.
            for writer in self._writers:
                writer.close()
            await asyncio.gather(*self._relays, return_exceptions=True)
            await server.wait_closed()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        relay = asyncio.current_task()
        assert relay is not None  # asyncio.start_server runs each connection's callback in a task
        self._relays.add(relay)
        writers = {client_writer}
        self._writers.add(client_writer)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            writers.add(upstream_writer)
            self._writers.add(upstream_writer)
            async with asyncio.TaskGroup() as pipes:
                pipes.create_task(_pipe(client_reader, upstream_writer))
                pipes.create_task(_pipe(upstream_reader, client_writer))
        except* OSError:
            pass  # upstream down or slow (TimeoutError is an OSError) or a side reset: drop both, as a router would
        finally:
            for writer in writers:
                writer.close()
            self._writers -= writers
            self._relays.discard(relay)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(CHUNK_BYTES):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
