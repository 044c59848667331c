# Over 500 lines: StageServer is the I/O of one connection state machine (hello, open, forward, peers), read whole.
"""The stage server: puts ``Stage`` on WebSockets (asyncio, ``websockets``).

One connection per coordinator job (role ``coordinator``) plus, in ring topology, one from the
previous stage (role ``peer``). Decoded FORWARD frames go to a single compute loop, which takes
everything that has arrived since its last pass and runs it as one batch (continuous batching
of concurrent sessions), then hands each output to its job's sender task, which sends it on: to
the successor stage (ring), or back to the coordinator (the last ring stage, or every stage in star
topology). One job's connection waiting (a successor being connected to, a reader that does not
drain) holds up that job alone.

A ring stage that is not the last also sends each output it forwarded to its coordinator, as a
RESULT with the same bytes (a tap), right after the successor send so the critical path is not
delayed. Every session is tapped, so a stage cannot tell which sessions the coordinator keeps for
a live audit (``audit.py``); in star topology the coordinator sees every output anyway.

The per-connection rules (HELLO first, tickets, roles, job binding, the replay guard, which
refusals close the connection) live in the sans-I/O core ``connection.py``; this module feeds it
each frame and carries out the action it returns. Bad frames are answered with an ERROR frame
(code, message, ref = the frame's seq) and the connection stays open; only a failed HELLO closes it.

A ring peer's refused frame is answered to that peer alone, never to the coordinator: a stage's word
about its neighbour is only a claim, and the job must not fail on one (the coordinator sees for
itself which stage put out nothing for a step, and relays its predecessor's tap to it before it
blames it: ``coordinator/pipeline.py``). Likewise the ERRORs a successor answers this stage's
forwards with are logged here, not passed on. Only this stage's own failure on a frame it took
(its compute failed) reaches the coordinator, which blames this stage for it. A job has one ring
peer connection at a stage: a second one from the same sender is refused at its HELLO
(``connection.py``).

Several stages on one port (make before break): an agent re-placed onto another span loads the
new block while the old one finishes its jobs in flight. ``add_stage`` puts a stage on the port,
``retire_stage`` stops it taking new jobs, and ``unload_stage`` waits until its jobs have ended
(each at most until its ticket expires), then drops it and closes whatever connection is still
bound to it. Stages are keyed by their ``Span`` (model and layers); a HELLO's ticket names the key
and the connection talks to that stage only: its sessions, its receipts, its ring successor and
its taps. The newest stage still taking jobs is the primary: PONG reports it, and without tickets a
HELLO binds to it.

Each stage has its own job table, queue and compute loop, so a batch never mixes blocks; the
loops share one compute thread, because the blocks share one CPU or GPU and running them at
once would only make each slower.

Over the swarm's TLS (``tls.py``) the port is served with the node's certificate and takes only
clients with a certificate from the swarm CA (``serve``'s ``tls``), and a ring stage reaches its
successor with its own certificate, checking the successor's names the node its peer pass names
(``peer_tls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import websockets
from nacl.signing import SigningKey
from prometheus_client import Counter
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

from worker_agent import logs
from worker_agent.errors import SessionError, SwarmError, WireError
from worker_agent.metrics import AgentMetrics, BlockLoad
from worker_agent.protocol import wire
from worker_agent.protocol.connection import (
    AcceptHello,
    Action,
    Admission,
    CloseSessions,
    Connection,
    Dispatch,
    Limits,
    OpenSessions,
    PeerRecord,
    Refuse,
    ReplyPong,
    Role,
    refused,
)
from worker_agent.protocol.keys import node_id
from worker_agent.protocol.links import peer_proof
from worker_agent.protocol.span import Span
from worker_agent.protocol.tickets import ProofNonces, open_peer_pass
from worker_agent.protocol.tls import connect_options
from worker_agent.protocol.transport import DirectLink, LinkFactory
from worker_agent.stage import Output, Prepared, Stage

log = logging.getLogger("swarm.worker")

HELLO_TIMEOUT_S = 10.0  # a peer stage must answer HELLO within this
SHUTDOWN_DRAIN_S = 30.0  # a server stopped by a signal lets its jobs in flight end for this long first
PEER_CLOSE_S = 5.0  # how long dropping a successor's connection may take, in the background
# What the WebSocket library buffers of one message before a HELLO is accepted: room for a link
# probe's PING (256 KiB, refused as too large with an ERROR whose arrival times the uplink); a
# larger message closes the connection (1009) before it is even read whole.
MAX_MESSAGE_BEFORE_HELLO = 1024 * 1024
OFF_LOOP_DECODE_BYTES = 1024 * 1024  # frames at least this large are decoded in a thread: heartbeats go on
SWEEP_INTERVAL_S = 5.0  # how often idle sessions are looked for


class Conn:
    """One WebSocket with its own outgoing seq counter and link (``transport.py``)."""

    def __init__(
        self,
        ws: ServerConnection | ClientConnection,
        transport: LinkFactory,
        core: Connection | None = None,
        *,
        sent: Counter | None = None,
    ) -> None:
        self.ws = ws
        self.link = transport(ws.send)
        self.seq_out = 0
        self.sent = sent  # counts the bytes of each frame sent
        self.core = core  # the rules of an incoming connection; None on one this stage opened
        self.slot: StageSlot | None = None  # the stage an accepted HELLO bound it to

    @property
    def role(self) -> Role | None:
        return self.core.role if self.core is not None else None

    async def send(self, message: wire.Message) -> None:
        self.seq_out += 1
        data = wire.encode(message, self.seq_out)
        if self.sent is not None:
            self.sent.inc(len(data))
        await self.link.send(data)

    async def aclose(self) -> None:
        await self.link.aclose()


@dataclass
class JobRoute:
    """Where a job's outputs go, as its coordinator's HELLO said."""

    coordinator: Conn
    topology: str
    next_url: str | None
    next_ticket: bytes | None  # the successor's peer pass
    coordinator_key: bytes | None = None  # the key the job's coordinator proved; None if insecure-open
    # This node's key, which signs the successor's peer pass to open a connection with it (links.py)
    signing_key: SigningKey | None = None
    peer: Conn | None = None
    peer_ready: asyncio.Future | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)
    # Its computed outputs waiting for its sender task (``StageServer._hand_on``), in step order.
    outbox: asyncio.Queue[Output] | None = None
    # Unix seconds its coordinator's ticket expires at (its job's deadline, plus a margin): a stage
    # being unloaded serves the job until then. None without a ticket (an insecure-open stage).
    expires_at: float | None = None


class CoordinatorKeys(Mapping[str, bytes | None]):
    """A live view of a stage's jobs as the connection core reads them: job -> its coordinator's key."""

    def __init__(self, jobs: dict[str, JobRoute]) -> None:
        self._jobs = jobs

    def __getitem__(self, job: str) -> bytes | None:
        return self._jobs[job].coordinator_key

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)


def sender_of(conn: Conn) -> str:
    """The node a ring peer's pass names as its sender, for the log; "unnamed" without one."""
    binding = conn.core.binding if conn.core is not None else None
    return node_id(binding.sender_key) if binding is not None and binding.sender_key else "unnamed"


@dataclass
class StageSlot:
    """One stage on the port and what the server keeps for it."""

    stage: Stage
    jobs: dict[str, JobRoute] = field(default_factory=dict)  # job -> its route, while its coordinator is here
    queue: asyncio.Queue[tuple[Conn, Prepared]] = field(default_factory=asyncio.Queue)  # FORWARDs to batch
    conns: set[Conn] = field(default_factory=set)  # incoming connections bound to this stage
    peers: dict[str, Conn] = field(default_factory=dict)  # job -> its ring predecessor's connection
    # job -> the newest peer pass admitted for it and its proof, kept while the job's coordinator is
    # here, also when that peer's connection is gone: an older pass is never admitted again.
    peer_records: dict[str, PeerRecord] = field(default_factory=dict)
    accepting: bool = True  # False once retired: HELLOs only for jobs already open here
    # Jobs routed here before the stage was let go whose coordinator has not said HELLO yet
    # (``expect_jobs``): taken while retired; ``arrived`` is set while none is still to come.
    expected: set[str] = field(default_factory=set)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no job is open here
    compute: asyncio.Task | None = None  # its compute loop, while the server runs

    def __post_init__(self) -> None:
        self.idle.set()
        self.arrived.set()

    def came(self, job: str) -> None:
        """``job``'s coordinator said HELLO here: it is no longer to come."""
        self.expected.discard(job)
        if not self.expected:
            self.arrived.set()


class StageServer:
    def __init__(
        self,
        stage: Stage | None = None,
        *,
        transport: LinkFactory = DirectLink,
        max_frame: int = wire.DEFAULT_MAX_FRAME,
        max_batch: int = 32,
        peer_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.transport = transport  # makes each connection's link: straight to the socket unless a test tool's
        # The swarm's client context a ring stage reaches its successor with (its node certificate;
        # the successor's must name the node its peer pass names). None: a wss:// successor is
        # checked against the system's store and its URL's host.
        self.peer_tls = peer_tls
        self.max_frame = max_frame
        self.max_batch = max_batch
        self.slots: dict[Span, StageSlot] = {}  # oldest first
        # What a HELLO may bind to, the primary first: one list kept up to date in place, which
        # every connection's core reads when its HELLO comes.
        self._admissions: list[Admission] = []
        self._nonces = ProofNonces()  # coordinator proofs accepted on this port: each is good once
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._closing: set[asyncio.Task] = set()  # successor connections being dropped
        self._running = False
        self.batches_run = 0
        self.largest_batch = 0
        self.metrics = AgentMetrics(self._block_loads)  # answered at GET /metrics on this port
        if stage is not None:
            self.add_stage(stage)

    @property
    def primary(self) -> StageSlot | None:
        """The newest stage still taking jobs (else the newest stage), or None without stages."""
        slots = list(self.slots.values())
        accepting = [slot for slot in slots if slot.accepting]
        newest = accepting or slots
        return newest[-1] if newest else None

    def add_stage(self, stage: Stage) -> None:
        """Serve ``stage`` on this port too; it becomes the primary."""
        key = stage.span
        if key in self.slots:
            raise SwarmError(f"{key} is served here already", code="stage_exists")
        slot = StageSlot(stage)
        self.slots[key] = slot
        if self._running:
            slot.compute = asyncio.create_task(self._compute_loop(slot))
        self._update_admissions()

    def expect_jobs(self, key: Span, jobs: Iterable[str]) -> None:
        """The control plane routed ``jobs`` to this stage before letting it go: it takes their
        coordinators' HELLOs once retired too, until ``unload_stage``'s wait for them ends."""
        slot = self.slots.get(key)
        if slot is None:
            return
        slot.expected.update(job for job in jobs if job not in slot.jobs)
        if slot.expected:
            slot.arrived.clear()
        self._update_admissions()

    def retire_stage(self, key: Span) -> None:
        """Take no new job on this stage; the jobs open on it go on."""
        slot = self.slots.get(key)
        if slot is not None and slot.accepting:
            slot.accepting = False
            self._update_admissions()
            log.info("%s takes no new job (%d open)", key, len(slot.jobs))

    async def drain(self, *, timeout: float, hurry: asyncio.Event | None = None) -> int:
        """Take no new job on any stage and wait up to ``timeout`` s (or until ``hurry`` is set) for
        the jobs in flight to end; returns how many were still open at the bound."""
        for key in list(self.slots):
            self.retire_stage(key)
        open_jobs = sum(len(slot.jobs) for slot in self.slots.values())
        if open_jobs:
            log.warning("stopping: %d job(s) in flight may finish first (up to %gs; stop again to stop now)",
                        open_jobs, timeout)  # fmt: skip

        async def all_idle() -> None:
            for slot in list(self.slots.values()):
                await slot.idle.wait()

        waiters: set[asyncio.Task] = {asyncio.create_task(all_idle())}
        if hurry is not None:
            waiters.add(asyncio.create_task(hurry.wait()))
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in waiters:
            task.cancel()
        cut = sum(len(slot.jobs) for slot in self.slots.values())
        if cut:
            log.warning("stopping with %d job(s) still open", cut)
        return cut

    async def unload_stage(self, key: Span, *, timeout: float, expected_s: float = 0.0) -> int:
        """Retire the stage, wait for its jobs to end, then drop it and close the connections still
        bound to it; returns how many jobs were cut off. Make before break: a job routed here before
        the stage was let go is served to its end. The jobs still to come (``expect_jobs``) are waited
        for up to ``expected_s`` s (a coordinator that has not come by then is not coming), and each
        job is waited for until its ticket expires (its job's deadline: past it, its coordinator has
        given up), one without a ticket ``timeout`` s; a job still open then is cut off."""
        slot = self.slots.get(key)
        if slot is None:
            return 0
        self.retire_stage(key)
        if slot.expected:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(slot.arrived.wait(), expected_s)
            if slot.expected:
                log.warning("%s: %d job(s) routed here before its release never came",
                            key, len(slot.expected))  # fmt: skip
            slot.expected.clear()
            slot.arrived.set()
            self._update_admissions()
        untimed_until = time.time() + timeout
        while not slot.idle.is_set():
            left = max((untimed_until if r.expires_at is None else r.expires_at for r in slot.jobs.values()),
                       default=0.0) - time.time()  # fmt: skip
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(slot.idle.wait(), left)
        cut = len(slot.jobs)
        if self.slots.get(key) is not slot:
            return cut
        del self.slots[key]
        self._update_admissions()
        slot.stage.prefixes.clear()  # its kept prefixes' memory goes back to the agent's other blocks
        if slot.compute is not None:
            slot.compute.cancel()
        for job, route in list(slot.jobs.items()):
            await self._end_job(slot, job, route.coordinator)
        for conn in list(slot.conns):
            with contextlib.suppress(Exception):
                await conn.aclose()
                await asyncio.wait_for(conn.ws.close(1001, "stage unloaded"), 1)
        log.info("unloaded %s (%d jobs cut off)", key, cut)
        return cut

    def _block_loads(self) -> list[BlockLoad]:
        return [BlockLoad(key, len(slot.jobs), len(slot.stage.store)) for key, slot in list(self.slots.items())]

    def _update_admissions(self) -> None:
        primary = self.primary
        ordered = ([primary] if primary is not None else []) + [s for s in self.slots.values() if s is not primary]
        self._admissions[:] = [
            Admission(
                node=slot.stage.node,
                span=slot.stage.span,
                trusted_keys=slot.stage.trusted_keys,
                insecure_open=slot.stage.insecure_open,
                accepting=slot.accepting,
                expected=frozenset(slot.expected),
                jobs=CoordinatorKeys(slot.jobs),
                peers=slot.peer_records,
            )
            for slot in ordered
        ]

    async def serve(
        self,
        host: str,
        port: int,
        *,
        ready: Callable[[int], None] | None = None,
        stop: asyncio.Future | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """Serve until ``stop`` resolves, or (without ``stop``) until cancelled or SIGTERM/SIGINT;
        over TLS (``wss://``) with ``tls``, a server context holding the agent's certificate (and,
        from ``tls.Identity.server_context``, requiring a swarm client certificate)."""
        loop = asyncio.get_running_loop()
        hurry: asyncio.Event | None = None
        if stop is None:
            # A first signal stops gracefully (jobs in flight end first, up to SHUTDOWN_DRAIN_S), a
            # second at once.
            stop, hurry = loop.create_future(), asyncio.Event()

            def on_signal() -> None:
                if stop.done():
                    hurry.set()
                else:
                    stop.set_result(None)

            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, on_signal)
        self._running = True
        for slot in self.slots.values():
            slot.compute = asyncio.create_task(self._compute_loop(slot))
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
                ssl=tls,
                process_request=lambda _, request: self.metrics.answer(request),
            ) as server:
                bound = next(iter(server.sockets)).getsockname()[1]
                if ready is not None:
                    ready(bound)
                await stop
                if hurry is not None:
                    await self.drain(timeout=SHUTDOWN_DRAIN_S, hurry=hurry)
        finally:
            self._running = False
            for slot in self.slots.values():
                if slot.compute is not None:
                    slot.compute.cancel()
            sweeper.cancel()
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _handle(self, ws: ServerConnection) -> None:
        core = Connection(self._admissions, self._limits(), nonces=self._nonces)
        conn = Conn(ws, self.transport, core, sent=self.metrics.bytes_out)
        _cap_messages(ws, min(MAX_MESSAGE_BEFORE_HELLO, self.max_frame * 2))
        received = self.metrics.bytes_in
        try:
            async for data in ws:
                received.inc(len(data))
                if len(data) >= OFF_LOOP_DECODE_BYTES:
                    frame = await asyncio.to_thread(core.decode, data)
                else:
                    frame = core.decode(data)
                action = frame if isinstance(frame, Refuse) else core.receive_frame(frame, now=time.time())
                if not await self._act(conn, action):
                    break
        except websockets.ConnectionClosed:
            pass
        finally:
            await conn.aclose()
            slot = conn.slot
            if slot is not None:
                slot.conns.discard(conn)
                if core.binding is not None and core.binding.role is Role.COORDINATOR:
                    await self._end_job(slot, core.binding.job, conn)
                if core.binding is not None and slot.peers.get(core.binding.job) is conn:
                    del slot.peers[core.binding.job]

    def _limits(self) -> Limits:
        # Frames are decoded before a HELLO says which stage they are for: the hidden size is
        # checked here when every stage has the same one, and by the stage itself anyway.
        sizes = {slot.stage.block.hidden_size for slot in self.slots.values()}
        return Limits(max_frame=self.max_frame, hidden_size=sizes.pop() if len(sizes) == 1 else None)

    async def _act(self, conn: Conn, action: Action) -> bool:
        """Carry out what the connection's core decided about one frame; False closes the connection."""
        match action:
            case Refuse():
                await self._refuse(conn, action.to_wire())
                if action.evidence is not None and action.job is not None:
                    await self._report(action.job, wire.Error(action.code, action.message, job=action.job,
                                                              evidence=action.evidence))  # fmt: skip
                return not action.close
            case ReplyPong():
                primary = self.primary
                await conn.send(wire.Pong(action.nonce, primary.stage.info() if primary is not None else {}))
            case AcceptHello():
                slot = self.slots.get(action.binding.span)
                if slot is None:  # unloaded between the admission list and now
                    gone = wire.Error("not_serving", "that block is no longer served here", fatal=True)
                    await self._refuse(conn, gone)
                    return False
                await self._accept(conn, slot, action)
            case _:
                try:
                    await self._serve(conn, action)
                except SwarmError as exc:  # the stage turned the frame down; the connection stays usable
                    await self._refuse(conn, refused(action, exc).to_wire())
        return True

    async def _serve(self, conn: Conn, action: OpenSessions | Dispatch | CloseSessions) -> None:
        slot = conn.slot
        if slot is None or self.slots.get(slot.stage.span) is not slot:
            raise SwarmError("the block this connection was bound to is no longer served here", code="not_serving")
        stage = slot.stage
        match action:
            case Dispatch():
                binding = conn.core.binding if conn.core is not None else None
                # A ring predecessor's items must carry its signature (links.py); the coordinator's need none.
                sender = binding.sender_key if binding is not None and binding.role is Role.PEER else None
                slot.queue.put_nowait((conn, stage.prepare(action.forward, sender_key=sender)))
            case OpenSessions():
                reused = stage.open(action.job, action.sessions, action.prefixes)
                await conn.send(wire.Open(action.job, action.sessions, reused=reused if any(reused) else ()))
            case CloseSessions():
                receipts = stage.close(action.job, action.sessions, action.keep)
                await conn.send(wire.Close(action.job, action.sessions, tuple(receipts)))

    async def _accept(self, conn: Conn, slot: StageSlot, action: AcceptHello) -> None:
        hello = action.hello
        # The rest of this connection's task serves the job: its lines name it.
        logs.bind(job_id=hello.job)
        # Raised before the HELLO is answered: a coordinator or peer sends nothing more until then.
        _cap_messages(conn.ws, self.max_frame * 2)
        conn.slot = slot
        slot.conns.add(conn)
        if action.binding.role is Role.COORDINATOR:
            if hello.job in slot.expected:
                slot.came(hello.job)
                self._update_admissions()
            old = slot.jobs.get(hello.job)
            # The core admitted a second coordinator HELLO for a live job only with the same key.
            if old is not None:  # the coordinator reconnected: keep sessions, reroute outputs
                old.coordinator = conn
                if (old.topology, old.next_url, old.next_ticket) != (hello.topology, hello.next_url, hello.next_ticket):
                    await self._repoint(old, hello)
            else:
                slot.jobs[hello.job] = JobRoute(
                    conn,
                    hello.topology,
                    hello.next_url,
                    hello.next_ticket,
                    action.binding.coordinator_key,
                    slot.stage.signing_key,
                    expires_at=action.binding.expires_at,
                )
                slot.idle.clear()
        else:
            # The core admitted a peer while another is bound to the job only for a newer pass (the
            # route was healed onto a new predecessor) or the same pass and proof (its sender
            # reconnecting): either way the old connection goes.
            old_peer = slot.peers.get(hello.job)
            slot.peers[hello.job] = conn
            if action.binding.peer is not None:
                slot.peer_records[hello.job] = action.binding.peer
            if old_peer is not None:
                log.info("job %s: ring peer %s replaces %s", hello.job, sender_of(conn), sender_of(old_peer))
                self._drop_peer(old_peer)
        await conn.send(wire.Hello(job=hello.job, role="stage", topology=hello.topology, info=slot.stage.info()))

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
            self._drop_peer(peer)

    def _drop_peer(self, peer: Conn) -> None:
        """Close a connection to or from a ring neighbour in the background: a frozen one never
        answers the closing handshake, and nothing this stage serves may wait on it."""

        async def close() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(peer.aclose(), PEER_CLOSE_S)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(peer.ws.close(), PEER_CLOSE_S)

        task = asyncio.create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _refuse(self, conn: Conn, error: wire.Error) -> None:
        """Refuse a frame to the connection that sent it, and to it alone, a ring peer's too: were the
        coordinator told, it could only take this stage's word against its neighbour's, and no job may
        fail on a claim."""
        self._log_error(conn, error, "refusing")
        with contextlib.suppress(websockets.ConnectionClosed, RuntimeError):
            await conn.send(error)
            if error.fatal:
                await conn.link.drain()

    async def _report(self, job: str, error: wire.Error) -> None:
        """Hand the job's coordinator a refusal with its evidence (a ring peer's second connection),
        for it to judge: the stage's word alone blames nobody."""
        route = next((slot.jobs[job] for slot in self.slots.values() if job in slot.jobs), None)
        if route is None:
            return
        log.warning("job %s: reporting %s to its coordinator", job, error.code)
        with contextlib.suppress(websockets.ConnectionClosed, RuntimeError):
            await route.coordinator.send(error)

    async def _error(self, conn: Conn, error: wire.Error) -> None:
        """Report this stage's own failure on the work a frame from ``conn`` asked for: to the job's
        coordinator, also when a ring peer sent the frame (the stage blames only itself here)."""
        self._log_error(conn, error, "failed on")
        target = conn
        route = conn.slot.jobs.get(error.job or "") if conn.role is Role.PEER and conn.slot is not None else None
        if route is not None:
            target = route.coordinator
        with contextlib.suppress(websockets.ConnectionClosed, RuntimeError):
            await target.send(error)
            if error.fatal:
                await target.link.drain()

    def _log_error(self, conn: Conn, error: wire.Error, what: str) -> None:
        log.warning(
            "job %s: %s frame %s from %s: %s (%s)",
            error.job or "-",
            what,
            error.ref,
            f"ring peer {sender_of(conn)}" if conn.role is Role.PEER else conn.role or "unauthenticated",
            error.message,
            error.code,
        )
        self.metrics.errors.labels(error.code).inc()

    async def _compute_loop(self, slot: StageSlot) -> None:
        loop = asyncio.get_running_loop()
        stage, queue = slot.stage, slot.queue
        held: list[tuple[Conn, Prepared]] = []  # frames put off to a later pass, in arrival order
        layer_tokens = self.metrics.layer_tokens.labels(stage.model)
        layers = stage.layer_end - stage.layer_start
        while True:
            waiting = held or [await queue.get()]
            while not queue.empty() and len(waiting) < self.max_batch:
                waiting.append(queue.get_nowait())
            batch, held = one_step_per_session(waiting)
            self.batches_run += 1
            items = sum(len(p.work) for _, p in batch)
            self.largest_batch = max(self.largest_batch, items)
            self.metrics.batch_items.observe(items)
            try:
                results = await loop.run_in_executor(self._executor, stage.compute, [p for _, p in batch])
            except Exception as exc:  # a failed batch must not kill the stage
                log.exception("compute failed")
                # A cache the memory could not grow (``kvcache.KVMemory``) keeps its code: the
                # coordinator tells a refusal for memory from a broken stage by it.
                code = exc.code if isinstance(exc, SessionError) else "compute_failed"
                for conn, prepared in batch:
                    await self._error(conn, wire.Error(code, f"compute failed: {exc}", job=prepared.forward.job))
                continue
            finished = []
            for (conn, prepared), outputs in zip(batch, results, strict=True):
                try:
                    finished.append((prepared.forward.job, stage.finish(prepared, outputs)))
                    layer_tokens.inc(layers * sum(item.count for item in prepared.forward.items))
                except Exception as exc:  # one step failing must not stop the loop that serves every job
                    log.exception("finishing a step failed")
                    code = exc.code if isinstance(exc, SwarmError) else "compute_failed"
                    await self._error(conn, wire.Error(code, f"step failed: {exc}", job=prepared.forward.job))
            for job, output in merge_outputs(finished):
                self._hand_on(slot, job, output)

    def _hand_on(self, slot: StageSlot, job: str, output: Output) -> None:
        """Queue ``output`` for its job's sender task, which sends the job's outputs on in order
        (``_send_on``). The compute loop serves every job and waits on no job's connection: a new
        job's first output waits for its successor's HELLO (up to HELLO_TIMEOUT_S on a loaded
        host), and a connection that does not drain waits for its reader. Sent from the loop, one
        job's wait held up every other job's outputs, and their coordinators blamed this stage for
        a stall it did not cause."""
        route = slot.jobs.get(job)
        if route is None:  # the coordinator left while this was computing
            return
        if route.outbox is None:
            route.outbox = asyncio.Queue()
            task = asyncio.create_task(self._send_loop(slot, job, route.outbox))
            route.tasks.add(task)  # cancelled at the job's end, with whatever it still holds
        route.outbox.put_nowait(output)

    async def _send_loop(self, slot: StageSlot, job: str, outbox: asyncio.Queue[Output]) -> None:
        while True:
            output = await outbox.get()
            try:
                await self._send_on(slot, job, output)
            except Exception:  # one output failing to go must not stop the job's next ones
                log.exception("job %s: sending an output on failed", job)

    async def _send_on(self, slot: StageSlot, job: str, output: Output) -> None:
        route = slot.jobs.get(job)
        if route is None:  # the coordinator left while this was computing
            return
        result = wire.Result(job, output.items, output.dtype, output.shape, output.payload)
        tap = route.topology == "ring" and bool(route.next_url)
        try:
            if tap:
                peer = await self._peer(job, route)
                await peer.send(wire.Forward(job, output.items, output.dtype, output.shape, output.payload))
            else:
                await route.coordinator.send(result)
        except (TimeoutError, SwarmError, OSError, websockets.WebSocketException) as exc:
            reason = f"cannot reach the next stage {route.next_url}: {_reason(exc)}"
            error = exc if isinstance(exc, SwarmError) else SwarmError(reason, code="next_unreachable")
            await self._error(route.coordinator, wire.Error(error.code, str(error), job=job))
            return
        if tap:
            # A coordinator that went away is _end_job's business, not an error to report.
            with contextlib.suppress(websockets.ConnectionClosed, RuntimeError):
                await self.send_tap(route.coordinator, result)

    async def send_tap(self, coordinator: Conn, tap: wire.Result) -> None:
        """Send the coordinator its copy of an output this stage forwarded to its ring successor."""
        await coordinator.send(tap)

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
        assert next_url is not None  # only a ring stage with a successor connects to one (``_send_on``)
        try:
            tls = connect_options(next_url, _successor(next_ticket) if self.peer_tls else None, self.peer_tls)
            # The successor only ever answers with its HELLO and ERRORs: nothing large.
            ws = await asyncio.wait_for(
                connect(next_url, max_size=wire.MAX_HEADER, compression=None, **tls), HELLO_TIMEOUT_S
            )
            peer = Conn(ws, self.transport, sent=self.metrics.bytes_out)
            proof = peer_proof(route.signing_key, next_ticket) if route.signing_key and next_ticket else None
            await peer.send(wire.Hello(job=job, role="peer", ticket=next_ticket, topology="ring", proof=proof))
            reply = wire.decode(await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT_S), max_frame=wire.MAX_HELLO_FRAME)
            if isinstance(reply.message, wire.Error):
                # Reported as the successor's fault; the coordinator checks that claim itself.
                refusal = reply.message
                raise SwarmError(
                    f"next stage refused HELLO: {refusal.message} ({refusal.code})", code="next_unreachable"
                )
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
            # The successor's ERRORs about our frames are its word, logged here and not passed on:
            # the coordinator judges a step that did not get through by what each stage put out.
            async for data in ws:
                self.metrics.bytes_in.inc(len(data))
                with contextlib.suppress(WireError):
                    frame = wire.decode(data, max_frame=wire.MAX_HEADER)
                    if isinstance(frame.message, wire.Error):
                        refusal = frame.message
                        log.warning("job %s: the next stage refused frame %s: %s (%s)",
                                    job, refusal.ref, refusal.message, refusal.code)  # fmt: skip

    async def _end_job(self, slot: StageSlot, job: str, conn: Conn) -> None:
        route = slot.jobs.get(job)
        if route is None or route.coordinator is not conn:
            return
        del slot.jobs[job]
        slot.peer_records.pop(job, None)
        if not slot.jobs:
            slot.idle.set()
        dropped = slot.stage.drop_job(job)
        if dropped:
            log.info("job %s: coordinator left, dropped %d open sessions", job, dropped)
        for task in route.tasks:
            task.cancel()
        if route.peer is not None:
            self._drop_peer(route.peer)
        # A ring peer's connection stays: it is bound to this job, whose sessions are gone, so it can
        # forward into nothing unless the job's own coordinator (same key: a heal that closed its old
        # connection first) opens sessions again; a new peer HELLO finds no job here.

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            evicted = sum(slot.stage.evict_idle() for slot in list(self.slots.values()))
            if evicted:
                log.info("evicted %d idle sessions", evicted)


def _reason(exc: BaseException) -> str:
    """What went wrong, for a message: a timeout's text is empty."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {HELLO_TIMEOUT_S:g}s"
    return str(exc) or type(exc).__name__


def _successor(peer_pass: bytes | None) -> str | None:
    """The node a ring successor's peer pass is for: the one the job's coordinator, whose HELLO
    handed it over, signed it for. Raises TicketError for a pass that does not open."""
    return open_peer_pass(peer_pass).node if peer_pass is not None else None


def _cap_messages(ws: ServerConnection | ClientConnection, max_size: int) -> None:
    """Set the largest message the WebSocket library reads whole on this connection from now on
    (websockets reads the limit afresh for each incoming frame)."""
    ws.protocol.max_message_size = max_size


def one_step_per_session(frames: list[tuple[Conn, Prepared]]) -> tuple[list, list]:
    """Split queued FORWARDs into this pass's batch and the ones put off to the next: a frame whose
    sessions already have a step in the batch (a speculating coordinator's next chunk) waits, and
    so does every later frame sharing a session with a frame that waits, so each session's steps
    keep their order. Each pass then sends its outputs on as soon as it is computed: the next
    stage works on a session's chunk while this one computes the chunk after it."""
    batch, held = [], []
    busy: set[tuple[str, str]] = set()  # (job, session) with a step in this batch
    blocked: set[tuple[str, str]] = set()  # ... with a step put off
    for conn, prepared in frames:
        sessions = {(prepared.forward.job, item.session) for item in prepared.forward.items}
        if sessions & (busy | blocked):
            held.append((conn, prepared))
            blocked |= sessions
        else:
            batch.append((conn, prepared))
            busy |= sessions
    return batch, held


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
