"""The stage server: puts ``Stage`` on WebSockets (asyncio, ``websockets``).

One connection per coordinator job (role ``coordinator``) plus, in ring topology, one from the
previous stage (role ``peer``). Decoded FORWARD frames go to a single compute loop, which takes
everything that has arrived since its last pass and runs it as one batch (continuous batching
of concurrent sessions), then sends each output on: to the successor stage (ring), or back to
the coordinator (the last ring stage, or every stage in star topology).

A ring stage that is not the last also sends each output it forwarded to its coordinator, as a
RESULT with the same bytes (a tap), right after the successor send so the critical path is not
delayed. Every session is tapped, so a stage cannot tell which sessions the coordinator keeps for
a live audit (``audit.py``); in star topology the coordinator sees every output anyway.

The per-connection rules (HELLO first, tickets, roles, job binding, the replay guard, which
refusals close the connection) live in the sans-I/O core ``connection.py``; this module feeds it
each frame and carries out the action it returns. Bad frames are answered with an ERROR frame
(code, message, ref = the frame's seq) and the connection stays open; only a failed HELLO closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import websockets
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

from worker_agent import wire
from worker_agent.connection import (
    AcceptHello,
    Action,
    Admission,
    CloseSessions,
    Connection,
    Dispatch,
    Limits,
    OpenSessions,
    Refuse,
    ReplyPong,
    Role,
    refused,
)
from worker_agent.errors import SwarmError, WireError
from worker_agent.stage import Output, Prepared, Stage
from worker_agent.wan import WanLink, WanProfile

log = logging.getLogger("swarm.worker")

HELLO_TIMEOUT_S = 10.0  # a peer stage must answer HELLO within this
SWEEP_INTERVAL_S = 5.0  # how often idle sessions are looked for


class Conn:
    """One WebSocket with its own outgoing seq counter and WAN link."""

    def __init__(
        self, ws: ServerConnection | ClientConnection, wan: WanProfile, core: Connection | None = None
    ) -> None:
        self.ws = ws
        self.link = WanLink(ws.send, wan)
        self.seq_out = 0
        self.core = core  # the rules of an incoming connection; None on one this stage opened

    @property
    def role(self) -> Role | None:
        return self.core.role if self.core is not None else None

    async def send(self, message: wire.Message) -> None:
        self.seq_out += 1
        await self.link.send(wire.encode(message, self.seq_out))

    async def aclose(self) -> None:
        await self.link.aclose()


@dataclass
class JobRoute:
    """Where a job's outputs go, as its coordinator's HELLO said."""

    coordinator: Conn
    topology: str
    next_url: str | None
    next_ticket: bytes | None
    peer: Conn | None = None
    peer_ready: asyncio.Future | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)


class StageServer:
    def __init__(
        self,
        stage: Stage,
        *,
        wan: WanProfile | None = None,
        max_frame: int = wire.DEFAULT_MAX_FRAME,
        max_batch: int = 32,
    ) -> None:
        self.stage = stage
        self.wan = wan or WanProfile()
        self.max_frame = max_frame
        self.max_batch = max_batch
        self.jobs: dict[str, JobRoute] = {}
        self._queue: asyncio.Queue[tuple[Conn, Prepared]] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.batches_run = 0
        self.largest_batch = 0

    async def serve(
        self, host: str, port: int, *, ready: Callable[[int], None] | None = None, stop: asyncio.Future | None = None
    ) -> None:
        """Serve until ``stop`` resolves, or (without ``stop``) until cancelled or SIGTERM/SIGINT."""
        loop = asyncio.get_running_loop()
        if stop is None:
            stop = loop.create_future()
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
        compute = asyncio.create_task(self._compute_loop())
        sweeper = asyncio.create_task(self._sweep_loop())
        try:
            # The library's own cap is a backstop well above ours, so that an oversize frame
            # still reaches decode() and gets a proper ERROR instead of a dropped connection.
            async with serve(
                self._handle,
                host,
                port,
                max_size=self.max_frame * 2,
                compression=None,
                ping_interval=20,
                ping_timeout=60,
            ) as server:
                bound = next(iter(server.sockets)).getsockname()[1]
                if ready is not None:
                    ready(bound)
                await stop
        finally:
            compute.cancel()
            sweeper.cancel()
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _handle(self, ws: ServerConnection) -> None:
        core = Connection(self._admission(), self._limits(), coordinated_jobs=self.jobs)
        conn = Conn(ws, self.wan, core)
        try:
            async for data in ws:
                if not await self._act(conn, core.receive_data(data, now=time.time())):
                    break
        except websockets.ConnectionClosed:
            pass
        finally:
            await conn.aclose()
            if core.binding is not None and core.binding.role is Role.COORDINATOR:
                await self._end_job(core.binding.job, conn)

    def _admission(self) -> Admission:
        stage = self.stage
        return Admission(
            node=stage.node,
            model=stage.model,
            layer_start=stage.layer_start,
            layer_end=stage.layer_end,
            trusted_keys=stage.trusted_keys,
            insecure_open=stage.insecure_open,
        )

    def _limits(self) -> Limits:
        return Limits(max_frame=self.max_frame, hidden_size=self.stage.block.hidden_size)

    async def _act(self, conn: Conn, action: Action) -> bool:
        """Carry out what the connection's core decided about one frame; False closes the connection."""
        match action:
            case Refuse():
                await self._error(conn, action.to_wire())
                return not action.close
            case ReplyPong():
                await conn.send(wire.Pong(action.nonce, self.stage.info()))
            case AcceptHello():
                await self._accept(conn, action)
            case _:
                try:
                    await self._serve(conn, action)
                except SwarmError as exc:  # the stage turned the frame down; the connection stays usable
                    await self._error(conn, refused(action, exc).to_wire())
        return True

    async def _serve(self, conn: Conn, action: OpenSessions | Dispatch | CloseSessions) -> None:
        match action:
            case Dispatch():
                self._queue.put_nowait((conn, self.stage.prepare(action.forward)))
            case OpenSessions():
                self.stage.open(action.job, action.sessions)
                await conn.send(wire.Open(action.job, action.sessions))
            case CloseSessions():
                receipts = self.stage.close(action.job, action.sessions)
                await conn.send(wire.Close(action.job, action.sessions, tuple(receipts)))

    async def _accept(self, conn: Conn, action: AcceptHello) -> None:
        hello = action.hello
        if action.binding.role is Role.COORDINATOR:
            old = self.jobs.get(hello.job)
            if old is not None:  # the coordinator reconnected: keep sessions, reroute outputs
                old.coordinator = conn
                if (old.topology, old.next_url, old.next_ticket) != (hello.topology, hello.next_url, hello.next_ticket):
                    await self._repoint(old, hello)
            else:
                self.jobs[hello.job] = JobRoute(conn, hello.topology, hello.next_url, hello.next_ticket)
        await conn.send(wire.Hello(job=hello.job, role="stage", topology=hello.topology, info=self.stage.info()))

    async def _repoint(self, route: JobRoute, hello: wire.Hello) -> None:
        """A healed route: the coordinator's new HELLO names another successor (its old one died).
        Outputs from now on go to the new one; the connection to the old one is dropped."""
        log.info("job %s: successor re-pointed from %s to %s", hello.job, route.next_url, hello.next_url)
        peer, ready = route.peer, route.peer_ready
        route.topology, route.next_url, route.next_ticket = hello.topology, hello.next_url, hello.next_ticket
        route.peer, route.peer_ready = None, None
        if ready is not None and not ready.done():
            ready.set_exception(SwarmError("the job's route was re-pointed", code="next_unreachable"))
            ready.exception()  # retrieved: nobody may be waiting on it
        if peer is not None:
            with contextlib.suppress(Exception):
                await peer.aclose()
                await asyncio.wait_for(peer.ws.close(), 1)

    async def _error(self, conn: Conn, error: wire.Error) -> None:
        log.warning(
            "refusing frame %s from %s: %s (%s)", error.ref, conn.role or "unauthenticated", error.message, error.code
        )
        target = conn
        route = self.jobs.get(error.job or "") if conn.role is Role.PEER else None
        if route is not None:  # a ring peer's bad frame is the coordinator's business
            target = route.coordinator
        with contextlib.suppress(websockets.ConnectionClosed, RuntimeError):
            await target.send(error)
            if error.fatal:
                await target.link.drain()

    async def _compute_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < self.max_batch:
                batch.append(self._queue.get_nowait())
            self.batches_run += 1
            self.largest_batch = max(self.largest_batch, sum(len(p.work) for _, p in batch))
            try:
                results = await loop.run_in_executor(self._executor, self.stage.compute, [p for _, p in batch])
            except Exception as exc:  # a failed batch must not kill the stage
                log.exception("compute failed")
                for conn, prepared in batch:
                    await self._error(
                        conn, wire.Error("compute_failed", f"compute failed: {exc}", job=prepared.forward.job)
                    )
                continue
            finished = []
            for (conn, prepared), outputs in zip(batch, results, strict=True):
                try:
                    finished.append((prepared.forward.job, self.stage.finish(prepared, outputs)))
                except Exception as exc:  # one step failing must not stop the loop that serves every job
                    log.exception("finishing a step failed")
                    code = exc.code if isinstance(exc, SwarmError) else "compute_failed"
                    await self._error(conn, wire.Error(code, f"step failed: {exc}", job=prepared.forward.job))
            for job, output in merge_outputs(finished):
                await self._send_on(job, output)

    async def _send_on(self, job: str, output: Output) -> None:
        route = self.jobs.get(job)
        if route is None:  # the coordinator left while this was computing
            return
        frame_args = dict(job=job, items=output.items, dtype=output.dtype, shape=output.shape, payload=output.payload)
        tap = route.topology == "ring" and bool(route.next_url)
        try:
            if tap:
                peer = await self._peer(job, route)
                await peer.send(wire.Forward(**frame_args))
            else:
                await route.coordinator.send(wire.Result(**frame_args))
        except (TimeoutError, SwarmError, OSError, websockets.WebSocketException) as exc:
            error = (
                exc
                if isinstance(exc, SwarmError)
                else SwarmError(f"cannot reach the next stage {route.next_url}: {exc}", code="next_unreachable")
            )
            await self._error(route.coordinator, wire.Error(error.code, str(error), job=job))
            return
        if tap:
            # A coordinator that went away is _end_job's business, not an error to report.
            with contextlib.suppress(websockets.ConnectionClosed, RuntimeError):
                await route.coordinator.send(wire.Result(**frame_args))

    async def _peer(self, job: str, route: JobRoute) -> Conn:
        """The connection to this job's ring successor, opened on first use."""
        if route.peer_ready is None:
            route.peer_ready = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._connect_peer(job, route))
            route.tasks.add(task)
        return await asyncio.shield(route.peer_ready)

    async def _connect_peer(self, job: str, route: JobRoute) -> None:
        ready = route.peer_ready
        assert ready is not None
        next_url, next_ticket = route.next_url, route.next_ticket
        try:
            ws = await asyncio.wait_for(
                connect(next_url, max_size=self.max_frame * 2, compression=None), HELLO_TIMEOUT_S
            )
            peer = Conn(ws, self.wan)
            await peer.send(wire.Hello(job=job, role="peer", ticket=next_ticket, topology="ring"))
            reply = wire.decode(await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT_S), max_frame=self.max_frame)
            if isinstance(reply.message, wire.Error):
                raise SwarmError(f"next stage refused HELLO: {reply.message.message}", code=reply.message.code)
        except Exception as exc:
            if not ready.done():
                ready.set_exception(exc)
            if route.peer_ready is ready:
                route.peer_ready = None  # the next output tries again
            return
        if route.peer_ready is not ready:  # re-pointed meanwhile: this successor is no longer wanted
            await peer.aclose()
            await ws.close()
            return
        route.peer = peer
        ready.set_result(peer)
        with contextlib.suppress(websockets.ConnectionClosed):
            async for data in ws:  # the successor's ERRORs about our frames reach the coordinator
                with contextlib.suppress(WireError):
                    frame = wire.decode(data, max_frame=self.max_frame)
                    if isinstance(frame.message, wire.Error):
                        with contextlib.suppress(websockets.ConnectionClosed, RuntimeError):
                            await route.coordinator.send(frame.message)

    async def _end_job(self, job: str, conn: Conn) -> None:
        route = self.jobs.get(job)
        if route is None or route.coordinator is not conn:
            return
        del self.jobs[job]
        dropped = self.stage.drop_job(job)
        if dropped:
            log.info("job %s: coordinator left, dropped %d open sessions", job, dropped)
        for task in route.tasks:
            task.cancel()
        if route.peer is not None:
            await route.peer.aclose()
            await route.peer.ws.close()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            evicted = self.stage.evict_idle()
            if evicted:
                log.info("evicted %d idle sessions", evicted)


def merge_outputs(finished: list[tuple[str, Output]]) -> list[tuple[str, Output]]:
    """One frame per job and dtype for a batch's outputs, so that what was computed together
    travels on together (a session never appears twice in one frame)."""
    merged: dict[tuple[str, str], list[list[Output]]] = {}
    for job, output in finished:
        groups = merged.setdefault((job, output.dtype), [[]])
        sessions = {item.session for out in groups[-1] for item in out.items}
        if sessions & {item.session for item in output.items}:
            groups.append([])
        groups[-1].append(output)
    frames = []
    for (job, dtype), groups in merged.items():
        for group in groups:
            items = tuple(item for out in group for item in out.items)
            rows = sum(out.shape[0] for out in group)
            payload = b"".join(out.payload for out in group)
            frames.append((job, Output(items, dtype, (rows, group[0].shape[1]), payload)))
    return frames
