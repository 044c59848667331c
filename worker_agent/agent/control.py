# Over 500 lines: Agent is one control channel's loop, whose parts share the channel's state.
"""The agent's side of the control plane: join once, then hold the control channel.

    SWARM_JOIN_TOKEN=swj_... swarm-worker join --control-plane http://127.0.0.1:8000

Joining registers the node key (proving possession with a signature over the one-time token;
``joining.py`` reads the token and checks it before the benchmark), the hardware and a measured
benchmark, and saves ``<key>.join.json`` so that a restarted agent reconnects without a token.
The join's answer names the control plane's ticket-signing key, which the agent pins in that
file: a control channel whose Welcome names another key is refused (logged as an error), so
whoever can reach or impersonate the channel cannot make the agent trust their tickets. In
production give ``--control-plane https://...``: the join then runs over TLS and the control
channel is ``wss://`` (a join answered over HTTPS that names a plain ``ws://`` channel is
refused), both checked against the system's CA store (``SSL_CERT_FILE`` names another bundle).
With TLS on the data plane (``--tls auto``) the join also sends a CSR for the agent's TLS key and
pins the swarm CA the answer names, with the node certificate it issued (``tls.py``). The control
channel (a WebSocket) opens with a
signed answer to the server's fresh nonce; over it the agent sends heartbeats with its load and
receives assignments (model + layer span: it loads that block and serves it on its data-plane
port, then reports ``ready``; the files of a catalog model's block are fetched from the control
plane first and checked against its content hash, ``fetch.py``), drain, stop and probe requests
(RTT and uplink to peers). Seeded spot-challenges do not come this way: they arrive on the data
plane as ordinary sessions of a ticketed job (``coordinator/challenger.py``), so the agent serves
them as it serves any job.

Every message is built and parsed by ``control_protocol`` (typed, versioned, bounded); a frame
it refuses is logged and dropped.

Re-placement is make before break. An agent assigned another block keeps serving the blocks it
holds for the jobs in flight while it loads the new one, all on one data-plane port
(``server.py``), as long as old and new layers together fit its cap (``--max-layers``). When they
do not, it drains the oldest block first: no new job on it, its jobs in flight end (each at most
until its ticket expires, at its job's deadline: ``StageServer.unload_stage``), then it is unloaded
and the new one loaded. A ``release`` of a block does the
same without a new one: no new job, unloaded once its jobs end. The control plane sends it once
the block that supersedes it reports ready. Either way the block first takes new jobs for
``LATE_JOBS_S`` more: the control plane stopped routing to it before telling the agent, and a job
routed to it just before is still on its way. A ``release`` also names the jobs the control plane
routed to the block and that had not ended: the block takes their coordinators' HELLOs however
late they come (up to ``EXPECTED_JOBS_S``), and no other job's. Heartbeats report the primary block
(the newest one still taking jobs).

A stopping agent (SIGTERM, Ctrl-C) tells the control plane first (a heartbeat whose state is
``leaving``) and waits for its answer, a Drain, sent once nothing new is routed to it; then it
closes the channel, takes late jobs for ``LATE_JOBS_S`` and drains (``Agent.shut_down``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import ssl
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import websockets
from websockets.asyncio.client import connect

from worker_agent import __version__
from worker_agent.agent import fetch, probes
from worker_agent.agent.joining import JoinError, backoff_delay, request_json
from worker_agent.agent.parts import Parts
from worker_agent.agent.relayed import RelayKeeper
from worker_agent.errors import SwarmError
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol import tls
from worker_agent.protocol.control_protocol import ProtocolError, control_signature, join_signature
from worker_agent.protocol.keys import node_id, public_key_bytes
from worker_agent.protocol.span import Span

if TYPE_CHECKING:
    from collections.abc import Callable

    from worker_agent.kvcache import KVMemory
    from worker_agent.server import StageServer
    from worker_agent.stage import Stage

log = logging.getLogger("swarm.agent")

HTTP_TIMEOUT_S = 30.0
MAX_BACKOFF_S = 30.0  # the control channel's reconnect waits are drawn from at most [0, this]
# How long a released or displaced block waits for a job in flight that came without a ticket (an
# insecure-open stage) to end; a ticketed job is waited for until its ticket expires.
DRAIN_TIMEOUT_S = 60.0
LEAVE_ANSWER_S = 5.0  # how long a stopping agent waits for the control plane to take it off routing
# How long a block keeps taking new jobs once the control plane routes nothing more to it (it
# released the block, or answered the agent's stop): a job routed to it just before that moment is
# still on its way (admitted, its coordinator starting), and is served rather than refused.
LATE_JOBS_S = 2.0
# How long a released block waits for the coordinators of the jobs its Release names (routed to it
# before the release, not yet here): a job's coordinator says HELLO within seconds of its admission,
# or it is queued behind others or never comes; past this the block goes without it.
EXPECTED_JOBS_S = 120.0
SHUTDOWN_DRAIN_S = 30.0  # how long a stopping agent waits for its jobs in flight to end


@dataclass(frozen=True)
class JoinState:
    control_plane: str
    node: str
    control_url: str
    heartbeat_interval_s: float
    # The control plane's ticket-signing public key (64 hex characters), pinned from the join's
    # answer: the control channel's Welcome must name this key. Empty in a state saved before keys
    # were pinned (the agent then trusts the Welcome's key and says so; join again to pin it).
    ticket_key: str = ""
    # With TLS on the data plane (``tls.py``): the swarm CA's certificate, pinned from the join's
    # answer (the only anchor the data plane trusts), and the node certificate it issued for the
    # agent's TLS key (PEM both). Empty: joined without TLS.
    ca_certificate: str = ""
    node_certificate: str = ""

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> JoinState | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


@dataclass
class Serving:
    """A block the agent holds."""

    assignment: int  # the control plane's id of the assignment it serves (a re-placement back onto
    # the same span hands the loaded block over to the new assignment)
    stage: Stage  # the loaded block, its sessions and its counters
    weight_bytes: int = 0  # what its weights take of the agent's memory (``kvcache.KVMemory``)
    unloading: asyncio.Task | None = None  # set once released: drains, then unloads the block

    @property
    def key(self) -> Span:
        return self.stage.span

    @property
    def layers(self) -> int:
        return self.stage.span.layers


def hardware_report(
    device: str, max_layers: int | None, dtype: str = "float32", *, memory_bytes: int | None = None
) -> dict:
    """What the agent tells the control plane of its machine at join. ``dtypes`` lists the dtypes
    its device runs, the one it serves in (``dtype``) first: placement sizes its blocks by it.
    ``memory_bytes``: the memory its owner gives it (``--memory``), reported instead of the device's
    (its total) or the host's (what is available now); the agent holds its blocks and caches in what
    it reports (``kvcache.KVMemory``)."""
    import torch

    # Both load torch, which the agent imports only when it needs it (this report, a benchmark).
    from worker_agent.kvcache import SessionLimits

    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        report: dict[str, Any] = {
            "device": "cuda",
            "device_name": props.name,
            "memory_bytes": int(props.total_memory),
            "dtypes": ["float32", "float16", "bfloat16"],
        }
    else:
        report = {
            "device": "cpu",
            "device_name": f"{psutil.cpu_count()} CPU threads",
            "memory_bytes": int(psutil.virtual_memory().available),
            "dtypes": ["float32", "bfloat16"],
        }
    report["dtypes"] = [dtype, *(d for d in report["dtypes"] if d != dtype)]
    if memory_bytes is not None:
        report["memory_bytes"] = int(memory_bytes)
    report["max_positions"] = SessionLimits().max_tokens  # positions a session may hold on its stages
    report["max_sessions"] = SessionLimits().max_sessions  # sessions its stages hold at once
    if max_layers:
        report["max_layers"] = max_layers
    return report


def measure_compute(model: str, *, dtype: str, device: str, layers: int = 2, steps: int = 16) -> float:
    """Decode throughput of a small block of ``model`` in layer-tokens per second (batch 1)."""
    import torch

    # Imported here: the agent registers and holds its channel before it loads torch.
    from worker_agent import model as models
    from worker_agent.block import Block, WorkItem
    from worker_agent.kvcache import SessionLimits, SessionStore

    block = Block(models.load_block(model, 0, min(layers, models.n_layers(model)), dtype=dtype, device=device))
    store = SessionStore(SessionLimits(max_sessions=1))
    kv = store.open("bench", "s")
    generator = torch.Generator().manual_seed(0)
    block.forward([WorkItem(kv, 0, torch.randn(16, block.hidden_size, generator=generator))])
    started = time.perf_counter()
    for step in range(steps):
        block.forward([WorkItem(kv, 16 + step, torch.randn(1, block.hidden_size, generator=generator))])
    elapsed = time.perf_counter() - started
    return len(block.weights.layers) * steps / elapsed


def _post_json(url: str, body: dict) -> dict:
    """POST the join; ``joining.Unreachable`` when it may be tried again, ``joining.Refused`` when not."""
    return request_json(url, body, what="the join", timeout=HTTP_TIMEOUT_S)


def register(
    control_plane: str,
    token: str,
    signing_key,
    *,
    hardware: dict,
    compute: float,
    data_url: str,
    tls_key: tls.TlsKey | None = None,
) -> JoinState:
    """Join; with ``tls_key`` (a wss:// data plane) ask the swarm's CA to certify that key, and
    pin the CA the answer names once its node certificate checks out (``tls.check_issued``)."""
    base = control_plane.rstrip("/")
    node = node_id(public_key_bytes(signing_key))
    body = {
        "token": token,
        "public_key": public_key_bytes(signing_key).hex(),
        "signature": join_signature(signing_key, token),
        "hardware": hardware,
        "benchmark": {"layer_tokens_per_s": compute},
        "data_url": data_url,
        "agent_version": __version__,
    }
    if tls_key is not None:
        body["csr"] = tls.make_csr(tls_key, node)
    reply = _post_json(f"{base}/api/v1/agents/register", body)
    if reply.get("node") != node:
        raise JoinError(f"the control plane registered node {reply.get('node')!r}, not this key's")
    ticket_key = reply.get("ticket_key")
    if not (isinstance(ticket_key, str) and re.fullmatch(r"[0-9a-f]{64}", ticket_key)):
        raise JoinError(f"the control plane's join answer names no valid ticket key: {ticket_key!r}")
    if base.startswith("https://") and not str(reply["control_url"]).startswith("wss://"):
        raise JoinError(f"the control plane answered over HTTPS with a plain control channel {reply['control_url']!r}")
    state = JoinState(base, node, reply["control_url"], float(reply["heartbeat_interval_s"]), ticket_key)
    if tls_key is None:
        return state
    ca, certificate = reply.get("ca_certificate"), reply.get("node_certificate")
    try:
        tls.check_issued(str(certificate), ca=str(ca), node=node, key=tls_key)
    except SwarmError as exc:
        raise JoinError(f"the control plane's join answer carries no usable certificate: {exc}") from None
    return replace(state, ca_certificate=str(ca), node_certificate=str(certificate))


class Agent:
    """Holds the control channel and serves whatever block the control plane assigns."""

    def __init__(
        self,
        signing_key,
        state: JoinState,
        *,
        host: str,
        port: int,
        advertise_url: str | None,
        dtype: str = "float32",
        device: str = "cpu",
        parts: Parts | None = None,
        max_layers: int | None = None,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        shutdown_drain_s: float = SHUTDOWN_DRAIN_S,
        late_jobs_s: float = LATE_JOBS_S,
        expected_jobs_s: float = EXPECTED_JOBS_S,
        tls: ssl.SSLContext | None = None,
        peer_tls: ssl.SSLContext | None = None,
        port_chosen: bool = True,
        rng: random.Random | None = None,
        status_path: Path | None = None,
        memory_bytes: int | None = None,
    ) -> None:
        """``memory_bytes``: the memory it holds its blocks and caches in (what it measured or was
        given at start, not what a ``claim-memory`` cheat reports); None: no bound."""
        self.signing_key = signing_key
        self.state = state
        self.host, self.port = host, port
        # The URL its owner gave (--advertise-url), else None: the agent then advertises the address
        # the control plane sees it connect from (Welcome.seen_address), at its data port.
        self.advertise_url = advertise_url
        self.seen_address: str | None = None
        self.relay_url: str | None = None  # while the agent is served through a relay (``relayed``)
        self._relay: RelayKeeper | None = None
        self._relay_task: asyncio.Task | None = None
        self._ws = None  # the control channel while it is up: where a relay's new URL is reported
        # False when the port was picked free at start (no --port, no --advertise-url): if another
        # process takes it before the first block is served, the agent serves on a new free port and
        # reports that URL in Ready instead of failing every assignment.
        self.port_chosen = port_chosen
        # Written at each heartbeat the control plane took: what ``swarm-worker health`` reads.
        self.status_path = status_path
        self.dtype, self.device = dtype, device
        self.parts = parts or Parts()  # what its stages are built from: the product's unless a test tool's
        self.trusted_key: bytes | None = None
        self.max_layers = max_layers  # the owner's cap on layers held at once (all blocks); None: no cap
        self.drain_timeout_s = drain_timeout_s
        self.shutdown_drain_s = shutdown_drain_s
        self.late_jobs_s = late_jobs_s  # how long a block let go still takes jobs routed to it just before
        self.expected_jobs_s = expected_jobs_s  # how long it waits for the jobs its Release names
        self.tls = tls  # the data plane's certificate (wss://); None: plain ws://
        # The node's certificate as a client (``tls.Identity.client_context``): to its ring
        # successors and the peers it measures. None: a wss:// peer is checked by the system's store.
        self.peer_tls = peer_tls
        self.rng = rng or random.Random()  # draws the reconnect waits (jitter: agents do not retry in step)
        self.blocks: dict[int, Serving] = {}  # assignment -> block held, oldest first
        self.server: StageServer | None = None  # the data-plane port, while a block is held
        self._server_stop: asyncio.Future | None = None
        self._server_task: asyncio.Task | None = None
        self._released: set[int] = set()  # released before (or while) they loaded: never to serve
        self.draining = False
        self.drain_told = asyncio.Event()  # the control plane sent a Drain: it routes nothing new here
        self.stopped = asyncio.Event()
        self.hurry = asyncio.Event()  # set on a second stop signal: stop now, jobs in flight or not
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.memory: KVMemory | None = None
        if memory_bytes is not None:
            from worker_agent.kvcache import KVMemory  # loads torch, which the control channel does without

            self.memory = KVMemory.of(memory_bytes, protocol.MEMORY_FRACTION)
        if self.parts.warning:
            log.warning("\n%s", self.parts.warning)

    @property
    def data_url(self) -> str:
        """Where peers reach this agent's data plane: through its relay, else the URL its owner
        gave, else the address the control plane sees it at (all interfaces are bound)."""
        if self.relay_url is not None:
            return self.relay_url
        if self.advertise_url is not None:
            return self.advertise_url
        scheme = "wss" if self.tls is not None else "ws"
        host = self.seen_address or self.host
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{self.port}"

    def _ticket_key(self, offered: str) -> bytes:
        """The ticket-signing key to trust: the Welcome's, which must be the one pinned at join."""
        pinned = self.state.ticket_key
        if not pinned:
            log.warning(
                "no ticket key was pinned at join; trusting the control channel's %s (join again to pin it)", offered
            )
            return bytes.fromhex(offered)
        if offered.lower() != pinned.lower():
            log.error(
                "the control channel names ticket key %s, not the %s pinned at join: refusing it", offered, pinned
            )
            raise SwarmError(
                "the control channel's ticket key is not the one pinned at join", code="ticket_key_mismatch"
            )
        return bytes.fromhex(pinned)

    async def run(self) -> None:
        """Stay connected until told to stop, reconnecting after a wait drawn with full jitter
        (``joining.backoff_delay``): agents that lost the control plane together, as when it
        restarts, come back spread out instead of all at once, again and again."""
        attempt = 0  # connections lost since the channel was last up: the backoff's exponent
        while not self.stopped.is_set():
            delay = None
            try:
                async with connect(self.state.control_url, open_timeout=HTTP_TIMEOUT_S) as ws:
                    attempt = 0
                    session = asyncio.create_task(self._session(ws))
                    stopping = asyncio.create_task(self.stopped.wait())
                    try:
                        await asyncio.wait({session, stopping}, return_when=asyncio.FIRST_COMPLETED)
                        if stopping.done() and not session.done():
                            await self._announce_leaving(ws)
                    finally:
                        stopping.cancel()
                        if not session.done():
                            session.cancel()
                            with contextlib.suppress(asyncio.CancelledError):
                                await session
                    if not session.cancelled():
                        session.result()  # re-raise what ended the session
            except (TimeoutError, OSError, websockets.WebSocketException, SwarmError) as exc:
                delay = backoff_delay(attempt, self.rng, cap_s=MAX_BACKOFF_S)
                log.warning("control channel lost: %s; reconnecting in %.1fs", exc, delay)
            if self.stopped.is_set():
                break
            if delay is None:
                delay = backoff_delay(attempt, self.rng, cap_s=MAX_BACKOFF_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), delay)
            attempt += 1
        await self.shut_down()

    async def _announce_leaving(self, ws) -> None:
        """Tell the control plane this agent is stopping (a heartbeat whose state is ``leaving``) and
        wait, up to LEAVE_ANSWER_S or a second stop signal, for its answer: a Drain, sent once no
        new job is routed here. Only then does the agent refuse new jobs (``shut_down``): a job
        routed here between the stop signal and that moment would otherwise be refused and healed."""
        try:
            await ws.send(protocol.encode(protocol.Heartbeat(load=protocol.Load(state=protocol.LEAVING))))
            hurry = asyncio.ensure_future(self.hurry.wait())
            answer = asyncio.ensure_future(self.drain_told.wait())
            try:
                await asyncio.wait({hurry, answer}, timeout=LEAVE_ANSWER_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                hurry.cancel()
                answer.cancel()
        except (OSError, websockets.WebSocketException) as exc:
            log.warning("could not tell the control plane this agent is stopping: %s", exc)
            return
        if not self.drain_told.is_set() and not self.hurry.is_set():
            log.warning("the control plane did not answer this agent's stop within %gs", LEAVE_ANSWER_S)

    async def shut_down(self) -> None:
        """Close the data plane once the jobs in flight have ended (a restart cuts no request), up to
        ``shutdown_drain_s`` or a second stop signal. ``run`` calls it once the control plane took
        the agent off routing (``_announce_leaving``) and the channel closed: jobs routed here just
        before are still taken for ``late_jobs_s``, then no new job is."""
        if self.server is not None and self.shutdown_drain_s > 0 and not self.hurry.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.hurry.wait(), min(self.late_jobs_s, self.shutdown_drain_s))
            if self.server is not None:  # not closed meanwhile (its last block unloaded)
                await self.server.drain(timeout=self.shutdown_drain_s, hurry=self.hurry)
        if self._relay_task is not None:
            self._relay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._relay_task
        await self._stop_serving()

    def stop(self) -> None:
        """A stop signal: the first stops gracefully (jobs in flight end first), a second at once."""
        if self.stopped.is_set():
            self.hurry.set()
        self.stopped.set()

    @property
    def serving(self) -> Serving | None:
        """The primary block: the newest one still taking jobs, else the newest; None if none."""
        blocks = list(self.blocks.values())
        live = [block for block in blocks if block.unloading is None]
        newest_first = live or blocks
        return newest_first[-1] if newest_first else None

    async def _session(self, ws) -> None:
        hello = protocol.decode(await asyncio.wait_for(ws.recv(), HTTP_TIMEOUT_S))
        if not isinstance(hello, protocol.Nonce):
            raise SwarmError(f"the control plane opened with {hello.TYPE}, not a nonce", code="handshake")
        signature = control_signature(self.signing_key, hello.nonce, self.state.node)
        await ws.send(protocol.encode(protocol.Auth(node=self.state.node, signature=signature)))
        welcome = protocol.decode(await asyncio.wait_for(ws.recv(), HTTP_TIMEOUT_S))
        if not isinstance(welcome, protocol.Welcome):
            reason = welcome.message if isinstance(welcome, protocol.Error) else f"a {welcome.TYPE} message"
            raise SwarmError(f"control plane refused the handshake: {reason}", code="handshake")
        self.trusted_key = self._ticket_key(welcome.ticket_key)
        if welcome.seen_address:
            self.seen_address = welcome.seen_address
        log.info(
            "control channel up as %s (state %s); the control plane sees this agent at %s",
            welcome.node,
            welcome.state,
            welcome.seen_address or "an address it did not say",
        )
        self._ws = ws
        heartbeat = asyncio.create_task(self._heartbeats(ws, welcome.heartbeat_interval_s))
        try:
            for assignment in welcome.assignments:
                await self._assign(ws, assignment)
            # The welcome lists every live assignment: a block it leaves out was released while the
            # channel was down (the release was pushed to nobody).
            listed = {assignment.assignment for assignment in welcome.assignments}
            for block in list(self.blocks.values()):
                if block.assignment not in listed:
                    self._release(block.assignment)
            async for raw in ws:
                try:
                    message = protocol.decode(raw)
                except ProtocolError as exc:
                    # Nothing to answer: a frame the control plane cannot have built through the codec.
                    log.warning("control plane sent a frame this agent refuses: %s (%s)", exc, exc.code)
                    continue
                await self._on_message(ws, message)
                if isinstance(message, protocol.Stop):
                    return  # told to stop: ``run`` shuts down (a stop signal keeps the channel for the leave)
        finally:
            self._ws = None
            heartbeat.cancel()

    async def _heartbeats(self, ws, interval: float) -> None:
        # (stage, compute seconds, tokens) at the previous heartbeat
        last: tuple[Stage | None, float, int] = (None, 0.0, 0)
        while True:
            if self.stopped.is_set():
                state = protocol.LEAVING  # every heartbeat after a stop signal keeps it off routing
            else:
                state = "draining" if self.draining else "serving" if self.serving else "idle"
            load = protocol.Load(state=state)
            if self.serving is not None:
                stage = self.serving.stage
                layer_ms = None
                if last[0] is stage and stage.tokens_served > last[2]:
                    # Measured speed under real load, for the control plane's rebalancing.
                    layer_tokens = (stage.tokens_served - last[2]) * stage.span.layers
                    layer_ms = 1000 * (stage.compute_seconds - last[1]) / layer_tokens
                load = protocol.Load(
                    state=state,
                    sessions=len(stage.store),
                    tokens_served=stage.tokens_served,
                    model=stage.model,
                    layer_ms=layer_ms,
                )
                last = (stage, stage.compute_seconds, stage.tokens_served)
            await ws.send(protocol.encode(protocol.Heartbeat(load=load)))
            if self.status_path is not None:
                write_status(self.status_path, node=self.state.node, state=state, interval_s=interval)
            await asyncio.sleep(interval)

    async def _on_message(self, ws, message: protocol.Message) -> None:
        match message:
            case protocol.Assign():
                asyncio.create_task(self._assign(ws, message))  # noqa: RUF006 - tracked via self.serving
            case protocol.Release(assignment=assignment, jobs=jobs):
                self._release(assignment, jobs or ())
            case protocol.Drain():
                self.draining = True
                self.drain_told.set()
            case protocol.Stop(reason=reason):
                log.warning("stopping: %s", reason or "asked by the control plane")
                self.stopped.set()
            case protocol.Probe(targets=targets):
                results = await self._probe(targets)
                await ws.send(protocol.encode(protocol.ProbeResult(results=results)))
            case protocol.UseRelay():
                self._use_relay(message)
            case protocol.Error(code=code, message=text):
                log.warning("control plane says: %s (%s)", text, code)
            case _:
                log.warning("ignoring a %s message: the control plane does not send those", message.TYPE)

    async def _assign(self, ws, message: protocol.Assign) -> None:
        # Imported when a block is assigned: joining and the handshake need no torch.
        from worker_agent import model as models
        from worker_agent.block import Block

        async with self._lock:
            assignment = message.assignment
            model = message.model
            ready = protocol.encode(protocol.Ready(assignment=assignment, url=self.data_url))
            if assignment in self.blocks:  # the channel reconnected and the assignment came again
                await ws.send(ready)
                return
            if assignment in self._released:
                return
            key = Span(models.model_name(model), message.layer_start, message.layer_end)
            same = next((block for block in self.blocks.values() if block.key == key), None)
            if same is not None and same.unloading is None:
                # Placed back onto a span still held (its release had not come yet): no reload.
                del self.blocks[same.assignment]
                same.assignment = assignment
                self.blocks[assignment] = same
                await ws.send(ready)
                log.info("serving %s again, as assignment %s", key, assignment)
                return
            if same is not None and same.unloading is not None:  # unloading: a live one was handled above
                await same.unloading  # the port serves one stage per span: let the released one go first
            routed: dict[int, tuple[str, ...]] = {}
            if message.supersedes is not None and message.jobs is not None:
                routed[message.supersedes] = message.jobs
            await self._make_room(key.layers, routed)
            log.info("assigned %s (assignment %s)", key, assignment)
            try:
                if message.content_hash is not None:
                    await asyncio.to_thread(self._fetch, message)
                weights = await asyncio.to_thread(
                    models.load_block, model, key.start, key.end, dtype=self.dtype, device=self.device
                )
            except SwarmError as exc:
                log.warning("assignment %d refused: %s (%s)", assignment, exc, exc.code)
                await ws.send(protocol.encode(_failed(assignment, str(exc))))
                return
            if assignment in self._released:  # released while it loaded
                return
            stage = self.parts.make_stage(
                Block(weights),
                model=models.model_name(model),
                signing_key=self.signing_key,
                trusted_keys=[self.trusted_key] if self.trusted_key else [],
                memory=self.memory,
            )
            weight_bytes = sum(t.numel() * t.element_size() for t in weights.layers.parameters())
            if self.memory is not None:
                self.memory.charge(weight_bytes)
            if self.server is None:
                error = await self._start_server(lambda: self.parts.make_server(stage, peer_tls=self.peer_tls))
                if error is not None:
                    log.warning("assignment %d failed: %s", assignment, error)
                    await ws.send(protocol.encode(_failed(assignment, error)))
                    if self.memory is not None:
                        self.memory.charge(-weight_bytes)
                    return
            else:
                self.server.add_stage(stage)
            self.blocks[assignment] = Serving(assignment=assignment, stage=stage, weight_bytes=weight_bytes)
            await ws.send(protocol.encode(protocol.Ready(assignment=assignment, url=self.data_url)))
            held = ", ".join(f"{b.stage.layer_start}:{b.stage.layer_end}" for b in self.blocks.values())
            log.info("serving %s at %s (holding %s)", key, self.data_url, held)

    def _use_relay(self, offer: protocol.UseRelay) -> None:
        """The control plane could not reach this agent's data URL: serve through a relay."""
        log.warning(
            "the control plane cannot reach this agent at %s: %s; serving through a relay (%s)",
            self.data_url,
            offer.reason,
            ", ".join(f"{relay.id} at {relay.address}" for relay in offer.relays),
        )
        if self._relay is not None:
            self._relay.renew(offer)
            if self.relay_url is not None:
                self._report_url()  # already relayed: report the relay's URL again
            return
        loopback = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        self._relay = RelayKeeper(
            offer,
            signing_key=self.signing_key,
            local_address=(loopback, self.port),
            tls=self.tls is not None,
            on_url=self._relay_moved,
            rng=self.rng,
        )
        self._relay_task = asyncio.create_task(self._relay.run())

    def _relay_moved(self, url: str | None) -> None:
        self.relay_url = url
        if url is not None:
            self._report_url()

    def _report_url(self) -> None:
        """Report every block held at the current data URL (a relay's, or again after one left)."""
        if self._ws is None:
            return  # the channel is down: the Welcome's assignments are reported at the new URL
        ws = self._ws
        for block in list(self.blocks.values()):
            if block.unloading is None:
                ready = protocol.encode(protocol.Ready(assignment=block.assignment, url=self.data_url))
                task = asyncio.create_task(ws.send(ready))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _fetch(self, message: protocol.Assign) -> None:
        """The files a catalog model's block needs, fetched from the control plane or found in the
        cache, each checked against the assigned content hash (``fetch.ensure_block_files``)."""
        url = fetch.manifest_url(self.state.control_plane, message.source or "")
        fetch.ensure_block_files(url, message.span, message.content_hash or "")

    async def _start_server(self, make_server: Callable[[], StageServer]) -> str | None:
        """Serve the data plane on ``self.port``; the reason when it cannot. A port picked free at
        start and taken since is given up for a new free one, and the advertised URL follows it."""
        loop = asyncio.get_running_loop()
        for port in (self.port, 0) if not self.port_chosen else (self.port,):
            server = make_server()  # a server that failed to start has shut its executor down
            stop, bound = loop.create_future(), loop.create_future()
            task = asyncio.create_task(server.serve(self.host, port, ready=bound.set_result, stop=stop, tls=self.tls))
            await asyncio.wait([bound, task], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                if port != self.port:
                    log.warning("port %d was taken since start: serving on port %d", self.port, bound.result())
                    self.port = bound.result()
                self.server, self._server_stop, self._server_task = server, stop, task
                return None
            error = f"cannot serve on port {self.port}: {task.exception()}"
        return error

    async def _make_room(self, layers: int, routed: dict[int, tuple[str, ...]] | None = None) -> None:
        """Unload the oldest blocks, each once its jobs in flight end, until ``layers`` more fit the cap.
        ``routed``: by assignment, the jobs routed to a block before the control plane moved on from
        it, which that block takes however late they come (as a release's). The control plane names
        every such job (it routes and supersedes a block under one lock), so a block named there is
        drained at once rather than after ``late_jobs_s``: a heal waiting for the new block waits
        no longer than the load."""
        for block in list(self.blocks.values()):
            held = sum(b.layers for b in self.blocks.values())
            if not self.max_layers or held + layers <= self.max_layers:
                return
            log.info(
                "%d layers held and %d more do not fit the cap of %d: draining layers %d:%d first",
                held,
                layers,
                self.max_layers,
                block.stage.layer_start,
                block.stage.layer_end,
            )
            jobs = (routed or {}).get(block.assignment)
            if jobs and self.server is not None:
                self.server.expect_jobs(block.key, jobs)
            await self._unload(block, late_s=0.0 if jobs is not None else None)

    def _release(self, assignment: int, jobs: tuple[str, ...] = ()) -> None:
        """Take no new job on the block but ``jobs`` (routed to it before the release), and unload
        it once its jobs in flight end."""
        block = self.blocks.get(assignment)
        if block is None:
            self._released.add(assignment)  # perhaps loading now: it must not be served
            return
        if jobs and self.server is not None:
            self.server.expect_jobs(block.key, jobs)
        task = asyncio.create_task(self._close_port_when_empty(self._unload(block)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _close_port_when_empty(self, unloading: asyncio.Task) -> None:
        await unloading
        async with self._lock:
            if not self.blocks:  # nothing left to serve: the port closes, as before any assignment
                await self._stop_serving()

    def _unload(self, block: Serving, *, late_s: float | None = None) -> asyncio.Task:
        """The task that drains and unloads ``block``, started on the first call: the block takes
        the jobs still on their way for ``late_s`` (``late_jobs_s`` by default), then no new job,
        and goes once its jobs end."""
        if block.unloading is None:
            late = self.late_jobs_s if late_s is None else late_s
            block.unloading = asyncio.create_task(self._drain_and_unload(block, late))
        return block.unloading

    async def _drain_and_unload(self, block: Serving, late_s: float) -> None:
        cut = 0
        # The control plane released the block before telling this agent: a job it routed here just
        # before is on its way, and is taken (unless the agent is told to stop at once).
        if late_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.hurry.wait(), late_s)
        if self.server is not None:
            cut = await self.server.unload_stage(
                block.key, timeout=self.drain_timeout_s, expected_s=self.expected_jobs_s
            )
        if self.blocks.get(block.assignment) is block:
            del self.blocks[block.assignment]
            if self.memory is not None:
                self.memory.charge(-block.weight_bytes)
        if cut:
            log.warning("unloaded %s, cutting off %d jobs still open past their deadlines", block.key, cut)
        else:
            log.info("unloaded %s (assignment %s)", block.key, block.assignment)

    async def _stop_serving(self) -> None:
        """Close the data-plane port and forget every block."""
        stop, task = self._server_stop, self._server_task
        if self.memory is not None:
            self.memory.charge(-sum(block.weight_bytes for block in self.blocks.values()))
        self.blocks.clear()
        self.server, self._server_stop, self._server_task = None, None, None
        if stop is not None and not stop.done():
            stop.set_result(None)
        if task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, 10)

    async def _probe(self, targets: tuple[protocol.ProbeTarget, ...]) -> tuple[protocol.LinkResult, ...]:
        return await probes.measure(targets, self.state.control_plane, tls=self.peer_tls)


def write_status(path: Path, *, node: str, state: str, interval_s: float) -> None:
    """Record that the control channel is up now (atomically: a reader never sees half a file)."""
    status = {"node": node, "state": state, "at": time.time(), "heartbeat_interval_s": interval_s}
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(status))
    partial.replace(path)


def read_health(path: Path, *, max_age_s: float | None = None, now: float | None = None) -> str | None:
    """Why the agent whose status is at ``path`` is not healthy (its control channel has not been up
    within ``max_age_s``, by default three heartbeat intervals), or None when it is."""
    try:
        status = json.loads(path.read_text())
        at, interval = float(status["at"]), float(status["heartbeat_interval_s"])
    except FileNotFoundError:
        return f"no status at {path}: the agent has not reached the control plane yet"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable status at {path}: {exc}"
    age = (time.time() if now is None else now) - at
    limit = 3 * interval if max_age_s is None else max_age_s
    if age > limit:
        return f"the control channel was last up {age:.0f} s ago (more than {limit:g} s)"
    return None


def _failed(assignment: int, error: str) -> protocol.Failed:
    return protocol.Failed(assignment=assignment, error=error[: protocol.MAX_TEXT_CHARS])
