# Over 500 lines: StageLink and Pipeline, the coordinator's two halves of the data plane, read together.
"""The coordinator's side of the data plane: one connection per stage, ring or star routing.

``Pipeline.send`` sends one batch of steps (each one session's token rows of hidden states) as
one FORWARD frame, so the stages compute them together; ``Pipeline.result`` waits for one step's
output from the last stage. Which steps go together is the coordinator's scheduler's choice
(``scheduler.py``), never this module's.

- ``ring``: the coordinator sends to the first stage; each stage forwards to its successor
  (with a peer pass the coordinator signed for that successor and handed it in HELLO: it lets
  the stage forward into this job's sessions there, nothing else); the last returns RESULT straight to the
  coordinator over the coordinator's own connection to it. Every other stage also sends the
  coordinator a copy of each output it forwarded, as a RESULT (a tap): it never completes a
  step, and is kept only for audited stages.
- ``star``: the coordinator relays each stage's RESULT to the next stage itself (works when
  agents cannot reach each other).

A step that stalls is blamed on the first stage with no usable output for it (the coordinator's
own observation, never a stage's word about its neighbour). Every output is signed by its stage
(``links.py``); a ring tap's signature is checked where the tap is used as the stage's word (kept
for an audit, or handed to its successor after a stall, when a forgery is blamed on the stage that
tapped it), not for every tap as it comes. In ring, that stage is first relayed its
predecessor's tap over the coordinator's own link, and from then on every tap of that predecessor,
so that a predecessor withholding its forwards can neither frame its successor nor stall the job
again. A stage's claim that it cannot reach its successor is checked with a PING of the successor.

Each HELLO as coordinator carries the stage's ticket and a fresh proof, signed by the job's
coordinator key (``coordinator_key``, the key the tickets name), that this is the job's coordinator.
With the swarm's TLS (``tls``, ``worker_agent/protocol/tls.py``) a ``wss://`` stage is reached only once its
certificate, from the swarm CA, names the node its spec names: nothing is sent to anyone else.

Hashes of exactly the bytes sent to the first stage and received from the last are kept per
session: they are the transcript that the stages' receipts must match.

Live audits (``audit.py``): for the stage indices in ``audit_stages`` the pipeline keeps, for
every session, each step's exact input and output bytes of those stages: the bytes sent to
stage 0, the taps (ring) or relayed RESULTs (star) in between, and the bytes received from the
last stage. Every session of every job is tapped alike, so a stage cannot tell which sessions
are kept. ``take_audits`` hands a closed session's material over and forgets it.

Prefix reuse (``protocol/prefix.py``): ``open`` may offer each session's prompt prefix keys; every
stage answers how many positions it holds already, and the session starts at the fewest of them
(a stage holding more is cut to it by the first step), which its transcript records as ``start``.
An audited stage's material then carries the reused prompt tokens, from which the verifier rebuilds
the stage's cache before it replays. ``close_by_stage`` may list the keys each stage keeps the
session's cache under.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

import websockets
from nacl.signing import SigningKey
from websockets.asyncio.client import ClientConnection, connect

from worker_agent.coordinator.stalls import Relay, StallWatch
from worker_agent.errors import AuditError, StageError, WireError
from worker_agent.protocol import wire
from worker_agent.protocol.audit import AuditMaterial
from worker_agent.protocol.links import Misconduct, proves_second_connection, signed_by
from worker_agent.protocol.prefix import PrefixKey
from worker_agent.protocol.receipts import StageAssignment, digest
from worker_agent.protocol.tickets import issue_peer_pass, prove_coordinator
from worker_agent.protocol.tls import connect_options
from worker_agent.protocol.transport import DirectLink, Link, LinkFactory

CONNECT_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 30.0  # HELLO/OPEN/CLOSE answers
STALL_TIMEOUT_S = 10.0  # a step that makes no progress through the stages this long has stalled
STALL_PER_ROW_S = 0.02  # and this much more per token row of the step (a long prefill computes longer)
# A stage sends its tap before it can see the CLOSE that follows the step, and on the same
# connection as its answer to that CLOSE, so taps are nearly always in by then; this covers a
# tap still in flight behind a slow send.
TAP_GRACE_S = 2.0
PROBE_TIMEOUT_S = 5.0  # a stage said to be unreachable must answer the coordinator's PING within this
# A step that made no progress this long has the stage it waits on PINGed over the coordinator's own
# link: one that does not answer within FREEZE_PROBE_S is frozen (stalled), long before the stall timeout.
FREEZE_SUSPECT_S = 1.5
FREEZE_PROBE_S = 3.0
CLOSE_TOO_LARGE = 1009  # WebSocket close code: a message over the size limit
OFF_LOOP_DECODE_BYTES = 1024 * 1024  # a stage's frames at least this large are decoded in a thread

log = logging.getLogger("swarm.coordinator")


@dataclass(frozen=True)
class StageSpec:
    url: str
    ticket: bytes | None = None  # signed by the control plane (or a local issuer)
    # The node the control plane routed this stage to: over a pipeline's swarm TLS, its certificate
    # must name it (``tls.connect_options``). None: not checked (ws://, or no swarm TLS).
    node: str | None = None


@dataclass
class Transcript:
    sent: list[bytes] = field(default_factory=list)  # per step: digest of bytes sent to the first stage
    received: list[bytes] = field(default_factory=list)  # per step: digest of bytes from the last stage
    start: int = 0  # the position of its first step: the positions every stage held already (prefix reuse)


@dataclass(frozen=True)
class AuditGap:
    """An audited stage's material that cannot be had: whose bytes are missing or unusable."""

    session: str
    stage: int  # the audited stage
    owed_by: int  # the stage that owed the bytes: the audited one (its outputs) or its predecessor (its tap)
    reason: str


@dataclass
class _Capture:
    """One audited session's traffic at the boundaries its audited stages need: boundary ``b``
    is what stage ``b`` received, boundary ``len(stages)`` what the last stage returned."""

    boundaries: dict[int, dict[int, bytes]]  # boundary -> step -> tensor bytes of that step
    prefix: tuple[int, ...] = ()  # the prompt tokens whose positions the stages held already
    steps: list[tuple[int, int]] = field(default_factory=list)  # per step issued: (start, count)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set on every new chunk

    def put(self, boundary: int, step: int, chunk: bytes) -> None:
        by_step = self.boundaries.get(boundary)
        # The first copy of a step counts, as it is the one that completed the step or was tapped.
        if by_step is not None and 0 <= step < len(self.steps) and step not in by_step:
            by_step[step] = chunk
            self.arrived.set()

    def has(self, boundary: int) -> bool:
        return all(step in self.boundaries[boundary] for step in range(len(self.steps)))

    def complete(self) -> bool:
        return all(self.has(boundary) for boundary in self.boundaries)


class CloseIncomplete(StageError):
    """A CLOSE that some stages answered and one (``stage``) did not: ``replies`` holds each stage's
    receipts in route order, empty for those that sent none, so the ones that came are kept."""

    def __init__(self, message: str, *, code: str, stage: int | None, replies: list[tuple[dict, ...]]) -> None:
        super().__init__(message, code=code, stage=stage)
        self.replies = replies


class StageLink:
    """One stage connection: HELLO, request/answer pairs, and a reader dispatching frames."""

    def __init__(self, index: int, spec: StageSpec, pipeline: Pipeline) -> None:
        self.index = index
        self.spec = spec
        self.pipeline = pipeline
        self.ws: ClientConnection | None = None
        self.link: Link | None = None
        self.seq = 0
        self.info: dict = {}
        self.bytes_sent = 0
        self._replies: dict[tuple[str, tuple[str, ...]], asyncio.Future] = {}  # (type, sessions) -> waiter
        self._pongs: dict[int, asyncio.Future] = {}  # PING nonce -> waiter
        self._reader: asyncio.Task | None = None
        # Seqs of the FORWARDs the coordinator relayed to this stage from its predecessor's tap
        # (``stalls.py``): a refusal of one as a step it had already is no failure.
        self.relayed: set[int] = set()

    async def connect(self, job: str, topology: str, next_url: str | None, next_ticket: bytes | None) -> dict:
        """HELLO the stage; ``next_ticket`` is the peer pass for its ring successor, if any."""
        key = self.pipeline.coordinator_key
        proof = prove_coordinator(key, self.spec.ticket) if key is not None and self.spec.ticket is not None else None
        tls = connect_options(self.spec.url, self.spec.node, self.pipeline.tls)
        try:
            self.ws = await asyncio.wait_for(
                # Until the stage's HELLO is in, nothing larger than a HELLO is read from it.
                connect(self.spec.url, max_size=wire.MAX_HELLO_FRAME, compression=None, open_timeout=None, **tls),
                CONNECT_TIMEOUT_S,
            )
            self.link = self.pipeline.transport(self.ws.send)
            await self.send(
                wire.Hello(
                    job=job,
                    ticket=self.spec.ticket,
                    topology=topology,
                    next_url=next_url,
                    next_ticket=next_ticket,
                    proof=proof,
                )
            )
            reply = await asyncio.wait_for(self.ws.recv(), REPLY_TIMEOUT_S)
        except websockets.ConnectionClosed as exc:
            too_large = exc.sent is not None and exc.sent.code == CLOSE_TOO_LARGE
            raise StageError(
                f"stage {self.index} ({self.spec.url}) "
                + (f"answered HELLO with a frame over {wire.MAX_HELLO_FRAME} bytes" if too_large else f"closed: {exc}"),
                code="stage_too_large" if too_large else "stage_unreachable",
                stage=self.index,
            ) from None
        except (OSError, TimeoutError, websockets.WebSocketException) as exc:
            raise StageError(
                f"stage {self.index} ({self.spec.url}) cannot be reached: {exc or type(exc).__name__}",
                code="stage_unreachable",
                stage=self.index,
            ) from None
        try:
            # A stage's HELLO is its identity: a few hundred bytes. Anything large is refused
            # before it is unpacked, and blamed on the stage that sent it.
            frame = wire.decode(reply, max_frame=wire.MAX_HELLO_FRAME)
        except WireError as exc:
            raise StageError(
                f"stage {self.index} ({self.spec.url}) answered HELLO with a bad frame: {exc}",
                code=f"stage_{exc.code}",
                stage=self.index,
            ) from None
        if isinstance(frame.message, wire.Error):
            raise StageError(
                f"stage {self.index} ({self.spec.url}) refused HELLO: {frame.message.message}",
                code=frame.message.code,
                stage=self.index,
            )
        if not isinstance(frame.message, wire.Hello):
            raise StageError(f"stage {self.index} answered HELLO with {type(frame.message).__name__}", stage=self.index)
        self.info = frame.message.info
        # The stage sends nothing unasked, and nothing is asked before this returns.
        self.ws.protocol.max_message_size = 2 * wire.DEFAULT_MAX_FRAME
        self._reader = asyncio.create_task(self._read())
        return self.info

    async def send(self, message: wire.Message) -> None:
        assert self.link is not None
        self.seq += 1
        data = wire.encode(message, self.seq)
        self.bytes_sent += len(data)
        await self.link.send(data)

    async def request(self, message: wire.Open | wire.Close, timeout: float = REPLY_TIMEOUT_S) -> wire.Message:
        """Send OPEN or CLOSE and wait for the stage's answer for the same sessions."""
        key = (type(message).__name__, message.sessions)
        future = asyncio.get_running_loop().create_future()
        self._replies[key] = future
        try:
            try:
                await self.send(message)
            except (websockets.ConnectionClosed, OSError) as exc:
                raise StageError(
                    f"stage {self.index} connection lost: {exc}", code="stage_lost", stage=self.index
                ) from None
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise StageError(
                f"stage {self.index} did not answer {key[0].upper()} in {timeout:g}s",
                code="stage_timeout",
                stage=self.index,
            ) from None
        finally:
            self._replies.pop(key, None)

    async def ping(self, timeout: float) -> None:
        """PING the stage over this link; raises a StageError unless it answers within ``timeout``."""
        nonce = self.seq + 1
        future = asyncio.get_running_loop().create_future()
        self._pongs[nonce] = future
        try:
            await self.send(wire.Ping(nonce))
            await asyncio.wait_for(future, timeout)
        except (TimeoutError, OSError, RuntimeError, websockets.ConnectionClosed):
            raise StageError(
                f"stage {self.index} did not answer PING in {timeout:g}s", code="stage_timeout", stage=self.index
            ) from None
        finally:
            self._pongs.pop(nonce, None)

    async def relay(self, frame: wire.Forward) -> None:
        """Send the stage a FORWARD of its predecessor's output (its tap), remembered as relayed."""
        self.relayed.add(self.seq + 1)  # the seq ``send`` gives it
        await self.send(frame)

    async def _read(self) -> None:
        assert self.ws is not None
        try:
            async for data in self.ws:
                if len(data) >= OFF_LOOP_DECODE_BYTES:
                    frame = await asyncio.to_thread(wire.decode, data)
                else:
                    frame = wire.decode(data)
                self.pipeline.bytes_received += frame.size
                self._dispatch(frame.message)
        except WireError as exc:  # a stage that sends a malformed or oversize frame is to blame
            error = StageError(
                f"stage {self.index} sent a bad frame: {exc}", code=f"stage_{exc.code}", stage=self.index
            )
            self._fail(error)
            await self.ws.close(1008, "bad frame")
        except (websockets.ConnectionClosed, OSError) as exc:
            self._fail(StageError(f"stage {self.index} connection lost: {exc}", code="stage_lost", stage=self.index))

    def _fail(self, error: StageError) -> None:
        """Every step and request waiting on this stage fails with ``error``."""
        self.pipeline.fail_all(error)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(error)

    def _dispatch(self, message: wire.Message) -> None:
        match message:
            case wire.Result():
                self.pipeline.on_result(self.index, message)
            case wire.Pong():
                pong = self._pongs.get(message.nonce)
                if pong is not None and not pong.done():
                    pong.set_result(None)
            case wire.Error() if message.ref in self.relayed and message.code in ("replayed_seq", "step_gap"):
                # A relayed step it had already, or whose earlier step its predecessor's own frame
                # still has to bring: it owes its output all the same, and the stall watch waits for it.
                pass
            case wire.Error() if message.code == "next_unreachable" and self.index + 1 < len(self.pipeline.links):
                self.pipeline.judge_unreachable(self.index, message)
            case wire.Error() if message.code == "peer_twice" and self.index > 0:
                # Not a failure of this stage's: what it refused, with the evidence, for the
                # coordinator to judge; the job goes on.
                self.pipeline.judge_second_connection(self.index, message)
            case wire.Error():
                # Every other ERROR on this link is the stage's own refusal of what the coordinator
                # sent it, or its own failure: a stage never passes its neighbours' word on.
                error = StageError(
                    f"stage {self.index} ({self.spec.url}): {message.message}",
                    code=message.code,
                    stage=self.index,
                )
                waiting = [
                    future
                    for (_, sessions), future in self._replies.items()
                    if not future.done() and (message.session is None or message.session in sessions)
                ]
                failed = message.session is not None and self.pipeline.fail_session(message.session, error)
                for future in waiting:
                    future.set_exception(error)
                if not waiting and not failed:
                    self.pipeline.fail_all(error)
            case wire.Open() | wire.Close():
                pending = self._replies.get((type(message).__name__, message.sessions))
                if pending is not None and not pending.done():
                    pending.set_result(message)

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self.link is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.link.drain(), 5)
            await self.link.aclose()
        if self.ws is not None:
            await self.ws.close()


class Pipeline:
    def __init__(
        self,
        job: str,
        stages: list[StageSpec],
        *,
        topology: str = "ring",
        transport: LinkFactory = DirectLink,
        dtype: str = "f32",
        audit_stages: Collection[int] = (),
        stall_timeout_s: float = STALL_TIMEOUT_S,
        session_ids: Iterator[int] | None = None,
        model: str | None = None,
        hidden_size: int | None = None,
        coordinator_key: SigningKey | None = None,
        tls: ssl.SSLContext | None = None,
        peer_passes: dict[tuple[bytes, bytes], bytes] | None = None,
        misconduct: list[Misconduct] | None = None,
    ) -> None:
        if topology not in ("ring", "star"):
            raise ValueError(f"topology must be 'ring' or 'star', got {topology!r}")
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        for spec in stages:
            connect_options(spec.url, spec.node, tls)  # a wss:// stage of unknown node fails here, not later
        for index in audit_stages:
            if isinstance(index, bool) or not (isinstance(index, int) and 0 <= index < len(stages)):
                raise ValueError(f"audit stage {index!r} is not a stage index in 0..{len(stages) - 1}")
        self.job = job
        self.topology = topology
        self.transport = transport  # makes each stage connection's link (``transport.py``)
        self.dtype = dtype
        self.links = [StageLink(i, spec, self) for i, spec in enumerate(stages)]
        self.transcripts: dict[str, Transcript] = {}
        self.bytes_received = 0
        self._waiting: dict[tuple[str, int], asyncio.Future] = {}
        self._steps: dict[str, int] = {}
        self._session_ids = session_ids if session_ids is not None else itertools.count()
        self.stall_timeout_s = stall_timeout_s
        # How far each step in flight got through the stages, and what to do when one stalls.
        self._stalls = StallWatch(job, len(stages), ring=topology == "ring")
        self._tasks: set[asyncio.Task] = set()
        self._probes: dict[int, asyncio.Task[bool]] = {}  # stage index -> its liveness PING in flight
        self.audit_stages = tuple(sorted(set(audit_stages)))  # stage indices whose traffic is kept
        # Who is assigned each span of this route, as the coordinator knows it (from the control
        # plane, or from the stages' HELLO without one): its sessions' receipts are verified against it.
        self.assignments: list[StageAssignment] | None = None
        self.model = model  # the model id, as the coordinator knows it (audit material)
        self.hidden_size = hidden_size  # its hidden size: every tensor's width; a tap of another is dropped
        self._captures: dict[str, _Capture] = {}  # audited session -> its traffic so far
        # The job's coordinator key, which the tickets name: it proves this is their coordinator and
        # signs the ring peers' passes. None only for agents without tickets (--insecure-open).
        self.coordinator_key = coordinator_key
        # The swarm's client context (``tls.Identity.client_context``): a wss:// stage must show a
        # certificate from the swarm CA naming its spec's node, and is shown this coordinator's.
        # None: a wss:// stage is checked against the system's store and its URL's host.
        self.tls = tls
        # The job's peer passes, shared by every route it heals onto: (successor's ticket, sender
        # key) -> pass. A stage whose successor and own key did not change keeps its pass, so its
        # peer connection stays; a new pair gets a newer pass, which takes the successor's peer place.
        self._peer_passes = peer_passes if peer_passes is not None else {}
        self.misconduct = misconduct if misconduct is not None else []  # proven by the culprits' own keys

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def bytes_sent(self) -> int:
        return sum(link.bytes_sent for link in self.links)

    async def connect(self) -> list[dict]:
        """HELLO every stage, all at once (a route's set-up, and a heal's, costs one round trip, not
        one per stage); returns each stage's identity (node, key, model, span). When stages fail,
        the first of them in route order is the error; the others' connections stay for aclose()."""

        async def hello(index: int, link: StageLink) -> dict:
            ring_next = self.links[index + 1].spec if self.topology == "ring" and index + 1 < len(self.links) else None
            return await link.connect(
                self.job, self.topology, ring_next.url if ring_next else None, self._peer_pass(index, ring_next)
            )

        outcomes = await asyncio.gather(
            *(hello(index, link) for index, link in enumerate(self.links)), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return [link.info for link in self.links]

    def _peer_pass(self, index: int, successor: StageSpec | None) -> bytes | None:
        """The pass stage ``index`` presents to its ring ``successor``: only for this job, only to
        forward, and only items signed by the key assigned to stage ``index`` (links.py)."""
        if successor is None or successor.ticket is None or self.coordinator_key is None:
            return None
        key = (successor.ticket, self._node_key(index))
        if key not in self._peer_passes:
            self._peer_passes[key] = issue_peer_pass(self.coordinator_key, successor.ticket, key[1])
        return self._peer_passes[key]

    def judge_second_connection(self, index: int, error: wire.Error) -> None:
        """Stage ``index`` refused a second peer connection of its predecessor's, handing over two
        different proofs over one pass: if both are that predecessor's signatures over the pass
        this coordinator issued it, the predecessor signed outside the protocol (links.py) and is
        reported; else the claim is only its word, and nothing comes of it."""
        sender = index - 1
        successor = self.links[index].spec
        sender_key = self._node_key(sender)
        issued = self._peer_passes.get((successor.ticket, sender_key)) if successor.ticket is not None else None
        node = self.node_at(sender)
        if issued is None or node is None or not proves_second_connection(sender_key, issued, error.evidence):
            log.warning("job %s: stage %d reports a second peer connection without proof", self.job, index)
            return
        reason = f"stage {sender} opened a second connection to stage {index} under a second signature of its pass"
        log.warning("job %s: %s (node %s)", self.job, reason, node)
        assert error.evidence is not None  # proven just above
        self.misconduct.append(Misconduct(node, "peer_twice", reason, error.evidence))

    def _node_key(self, index: int) -> bytes:
        """The node key assigned to stage ``index``, as the control plane said; empty without one."""
        assignments = self.assignments
        return assignments[index].node_key if assignments is not None and index < len(assignments) else b""

    def _signed(self, index: int, output: wire.Forward) -> bool:
        """Whether every item of stage ``index``'s output carries its signature over its bytes: an
        answer, a star output or a kept tap that does not is not the stage's word, and is treated as
        never sent (an audit counts its bytes missing, owed by that stage)."""
        key = self._node_key(index)
        if not key:
            return True  # no control plane assignments: nothing to check the signatures against
        return all(
            signed_by(key, item.sig, output.job, item.session, item.step, digest(chunk))
            for item, chunk in zip(output.items, output.item_bytes(), strict=True)
        )

    def _forged_tap(self, relay: Relay) -> StageError | None:
        """The error blaming the stage before ``relay.stage`` when the tap about to be handed on is
        not under its signature: a tap is progress as soon as it comes, and its signature is checked
        only where it is used as that stage's word (see ``on_result``)."""
        tapped = relay.stage - 1
        if self._signed(tapped, relay.forward):
            return None
        item = relay.forward.items[0]
        return StageError(
            f"session {item.session} step {item.step}: stage {tapped} (node {self.node_at(tapped)}) tapped an "
            "output its own signature does not cover",
            code="stage_bad_output",
            stage=tapped,
        )

    async def open(
        self, sessions: list[str], prompts: Mapping[str, tuple[tuple[int, ...], tuple[PrefixKey, ...]]] | None = None
    ) -> dict[str, int]:
        """Open sessions on every stage; returns per session the position its first step starts at.

        ``prompts``: per session, its prompt and the keys of the prompt's prefixes (``prefix.offer_keys``);
        a session without them starts at 0. A stage's answer naming positions it was not offered
        is its fault (``stage_bad_reply``)."""
        timeout = min(REPLY_TIMEOUT_S, self.stall_timeout_s)
        prompts = prompts or {}
        offers = tuple(prompts.get(session, ((), ()))[1] for session in sessions)
        message = wire.Open(self.job, tuple(sessions), prefixes=offers if any(offers) else ())
        replies = await asyncio.gather(*(link.request(message, timeout) for link in self.links))
        starts = {}
        for position, session in enumerate(sessions):
            offered = {key.positions for key in offers[position]}
            start = None
            for index, reply in enumerate(replies):
                assert isinstance(reply, wire.Open)
                held = reply.reused[position] if reply.reused else 0
                if held and held not in offered:
                    raise StageError(
                        f"stage {index} says session {session} holds {held} positions, which were not offered",
                        code="stage_bad_reply",
                        stage=index,
                    )
                start = held if start is None else min(start, held)
            starts[session] = start or 0
            self.transcripts[session] = Transcript(start=starts[session])
            self._steps[session] = 0
            if self.audit_stages:
                needed = {b for stage in self.audit_stages for b in (stage, stage + 1)}
                prefix = prompts[session][0][: starts[session]] if starts[session] else ()
                self._captures[session] = _Capture({b: {} for b in sorted(needed)}, prefix=prefix)
        return starts

    async def close(self, sessions: list[str]) -> list[dict]:
        """Close sessions everywhere; returns all stages' receipts (wire dicts)."""
        return [receipt for reply in await self.close_by_stage(sessions) for receipt in reply]

    async def close_by_stage(
        self, sessions: list[str], keep: Mapping[str, tuple[PrefixKey, ...]] | None = None
    ) -> list[tuple[dict, ...]]:
        """Close sessions everywhere; returns each stage's receipts (wire dicts), in route order.
        ``keep``: per session, the keys each stage may keep its cache under (``prefix.keep_keys``).

        A stage whose receipts do not come (its connection dropped, it refused or did not answer the
        CLOSE) raises the StageError blaming the first such stage in route order; when no stage of
        several answered, it blames none (``stage`` None): the coordinator's own link is likelier."""
        kept = tuple((keep or {}).get(session, ()) for session in sessions)
        message = wire.Close(self.job, tuple(sessions), keep=kept if any(kept) else ())
        replies = await asyncio.gather(*(link.request(message) for link in self.links), return_exceptions=True)
        failed = [reply for reply in replies if isinstance(reply, BaseException)]
        if failed and len(failed) == len(replies) > 1:
            raise StageError(f"no stage answered CLOSE: {failed[0]}", code="close_unanswered")
        if failed:
            first = failed[0]
            answered = [() if isinstance(reply, BaseException) else _receipts(reply) for reply in replies]
            if isinstance(first, StageError):
                raise CloseIncomplete(str(first), code=first.code, stage=first.stage, replies=answered)
            raise first
        return [_receipts(reply) for reply in replies if not isinstance(reply, BaseException)]

    def new_session_id(self) -> str:
        return f"s{next(self._session_ids)}"

    async def send(self, steps: list[tuple[str, int, int, bytes]]) -> list[int]:
        """Send one batch of steps, each (session, start position, token rows, payload), as one
        FORWARD frame to the first stage; returns each step's index in its session. A session
        appears at most once per batch: its next step needs this one's keys. Each step's output is
        then awaited with ``result``; a lost connection fails them there."""
        loop = asyncio.get_running_loop()
        items: list[wire.Item] = []
        for session, start, count, payload in steps:
            step = self._steps[session]
            self._steps[session] = step + 1
            self._waiting[(session, step)] = loop.create_future()
            self._stalls.start((session, step), loop.time())
            self.transcripts[session].sent.append(digest(payload))
            capture = self._captures.get(session)
            if capture is not None:
                capture.steps.append((start, count))
                capture.put(0, step, payload)
            items.append(wire.Item(session, step, start, count))
        if len({item.session for item in items}) != len(items):
            raise ValueError("a batch holds at most one step per session")
        rows = sum(item.count for item in items)
        frame = wire.Forward(
            self.job, tuple(items), self.dtype, (rows, self.width(steps)), b"".join(s[3] for s in steps)
        )
        try:
            await self.links[0].send(frame)
        except Exception as exc:  # the connection is gone: every waiter learns it
            self.fail_all(StageError(f"cannot send to stage 0: {exc}", code="stage_lost", stage=0))
        return [item.step for item in items]

    def width(self, steps: list[tuple[str, int, int, bytes]]) -> int:
        """The hidden size of a batch's rows: the model's, else what the first step's bytes hold."""
        if self.hidden_size is not None:
            return self.hidden_size
        _, _, count, payload = steps[0]
        return len(payload) // (count * wire.DTYPES[self.dtype].itemsize)

    async def result(self, session: str, step: int, count: int) -> bytes:
        """The last stage's output for step ``step`` (of ``count`` token rows) of ``session``.

        A step that makes no progress for the stall timeout (no stage puts out its part: in ring
        each stage but the last taps its output to the coordinator, in star the coordinator relays
        it) raises a StageError (``stage_stalled``) blaming the first stage that did not answer. In
        ring that stage is first handed its predecessor's output by the coordinator itself
        (``stalls.py``) and blamed only if it then puts out nothing for another stall timeout: a
        predecessor that taps an output but withholds it from its successor cannot frame it.

        A frozen stage is found sooner: once the step made no progress for FREEZE_SUSPECT_S, the
        stage it waits on is PINGed over the coordinator's own link (``_liveness``), and one that
        does not answer within FREEZE_PROBE_S while the step still made no progress is blamed
        (``stage_stalled``). A stage that answers is busy, and has the whole stall timeout."""
        future = self._waiting[(session, step)]
        stall = self.stall_timeout_s + STALL_PER_ROW_S * count
        key, loop = (session, step), asyncio.get_running_loop()
        probe: asyncio.Task[bool] | None = None
        probed: float | None = None  # the progress (``moved_at``) whose silence was probed
        try:
            while True:
                # The stall is counted from the step's last progress (a stage putting its part out).
                moved = self._stalls.moved_at(key)
                wake = moved + stall
                if probe is None and probed != moved:
                    wake = min(wake, moved + FREEZE_SUSPECT_S)
                waiting = {future} if probe is None else {future, probe}
                await asyncio.wait(waiting, timeout=max(wake - loop.time(), 0.0), return_when=asyncio.FIRST_COMPLETED)
                if future.done():
                    return future.result()
                if probe is not None and probe.done():
                    answered, probe = probe.result(), None
                    if not answered and self._stalls.moved_at(key) == probed:
                        frozen = self._stalls.waiting_on(key)
                        raise StageError(
                            f"session {session} step {step}: stage {frozen} (node {self.node_at(frozen)}) made no "
                            f"progress in {loop.time() - moved:.1f}s and did not answer PING in {FREEZE_PROBE_S:g}s",
                            code="stage_stalled",
                            stage=frozen,
                        )
                    continue  # it answered (busy, not frozen), or the step moved meanwhile
                idle = loop.time() - self._stalls.moved_at(key)
                if idle < stall:
                    if probe is None and idle >= FREEZE_SUSPECT_S and probed != self._stalls.moved_at(key):
                        # No progress for a while: is the stage it waits on alive at all?
                        probed = self._stalls.moved_at(key)
                        probe = self._liveness(self._stalls.waiting_on(key))
                    continue  # a stage put its part out meanwhile, or the probe is out: slow, not stalled
                verdict = self._stalls.stalled(key, loop.time())
                if isinstance(verdict, Relay):
                    forged = self._forged_tap(verdict)
                    if forged is not None:
                        raise forged
                    log.warning(
                        "job %s session %s step %d: stage %d put out nothing; handing it stage %d's output",
                        self.job,
                        session,
                        step,
                        verdict.stage,
                        verdict.stage - 1,
                    )
                    await self._relay(verdict.stage, verdict.forward)
                    continue
                blamed = verdict.stage
                raise StageError(
                    f"session {session} step {step}: stage {blamed} (node {self.node_at(blamed)}) made no "
                    f"progress in {stall:.1f}s",
                    code="stage_stalled",
                    stage=blamed,
                ) from None
        finally:
            self._waiting.pop((session, step), None)
            self._stalls.end((session, step))
            if not future.done():
                future.cancel()

    def _liveness(self, index: int) -> asyncio.Task[bool]:
        """Whether stage ``index`` answers a PING within FREEZE_PROBE_S: one probe at a time per stage,
        shared by every step waiting on it. A stage computes off its event loop, so a busy one
        answers; a frozen process, or a host gone silent, does not."""
        running = self._probes.get(index)
        if running is None or running.done():

            async def ping() -> bool:
                try:
                    await self.links[index].ping(FREEZE_PROBE_S)
                except StageError:
                    return False
                return True

            running = self._probes[index] = asyncio.ensure_future(ping())
            self._tasks.add(running)
            running.add_done_callback(self._tasks.discard)
        return running

    def node_at(self, index: int) -> str | None:
        """The node at route position ``index``: the control plane's assignment, else its HELLO's word."""
        assignments = self.assignments
        if assignments is not None and index < len(assignments):
            return assignments[index].node
        return self.links[index].info.get("node")

    def judge_unreachable(self, index: int, error: wire.Error) -> None:
        """Stage ``index`` says it cannot reach its ring successor: only its word. The coordinator
        PINGs the successor over its own link: silent, the successor is to blame
        (``next_unreachable``); answering, the claimant is (``next_unconfirmed``), having put out
        nothing for the steps it did not pass on. Either way the route's steps fail."""

        async def judge() -> None:
            successor = index + 1
            try:
                await self.links[successor].ping(min(PROBE_TIMEOUT_S, self.stall_timeout_s))
            except StageError:
                blamed, code, verdict = successor, "next_unreachable", "and it does not answer the coordinator either"
            else:
                blamed, code, verdict = index, "next_unconfirmed", "but it answers the coordinator"
            message = f"stage {index} says it cannot reach stage {successor} ({error.message}), {verdict}"
            self.fail_all(StageError(message, code=code, stage=blamed))

        self._spawn(judge())

    def on_result(self, index: int, result: wire.Result) -> None:
        """Stage ``index``'s output: the step's answer from the last stage, otherwise a ring tap
        (kept for audits only, never an answer) or a star output to relay on. An answer of another
        dtype or width than the route's fails the route's steps, blaming the last stage."""
        shaped = result.dtype == self.dtype and (self.hidden_size is None or result.shape[1] == self.hidden_size)
        if index + 1 < len(self.links):
            # Only a usable output is progress: one of another width or not under the stage's own
            # signature is nothing the next stage could be handed. A ring tap's signature is checked
            # only where the tap is used as the stage's word: kept for an audit (here), or handed to
            # its successor after a stall (``_forged_tap``), which blames a forgery on the stage that
            # tapped it. The rest are read for progress and timing alone: a check of every tap was an
            # ed25519 verification and a hash per stage and step (about 0.15 ms of the coordinator's
            # CPU per token on three stages). A star output is relayed, so it is checked as it comes.
            usable = shaped and (self.topology == "ring" or self._signed(index, result))
            now = asyncio.get_running_loop().time()
            for item, chunk in zip(result.items, result.item_bytes() if usable else (), strict=False):
                relay = self._stalls.output(index, item, result.dtype, chunk, now)
                if relay is not None:  # its successor is disputed: the coordinator hands it this too
                    self._spawn(self._relay_tap(relay))
            # A tap of another dtype or width, or not under the stage's signature, is not the stage's
            # output as the next stage takes it: it is not kept, and the audit it was owed to counts
            # it missing, owed by this stage.
            if self._captures and usable:
                for item, chunk in zip(result.items, result.item_bytes(), strict=True):
                    if item.session in self._captures and (
                        self.topology == "star" or self._signed(index, _single(result, item, chunk))
                    ):
                        self._capture(item, index + 1, chunk)
            if self.topology == "star":
                forward = wire.Forward(result.job, result.items, result.dtype, result.shape, result.payload)
                self._spawn(self._relay(index + 1, forward))
            return
        if not (shaped and self._signed(index, result)):
            width = f"{self.hidden_size}" if self.hidden_size is not None else "the route's width"
            what = (
                "with bytes its own signature does not cover"
                if shaped
                else f"{result.dtype} rows {result.shape[1]} wide, not {self.dtype} x {width}"
            )
            self.fail_all(StageError(f"stage {index} answered {what}", code="stage_bad_output", stage=index))
            return
        for item, chunk in zip(result.items, result.item_bytes(), strict=True):
            future = self._waiting.get((item.session, item.step))
            if future is not None and not future.done():
                self.transcripts[item.session].received.append(digest(chunk))
                self._capture(item, index + 1, chunk)
                future.set_result(chunk)

    def _capture(self, item: wire.Item, boundary: int, chunk: bytes) -> None:
        capture = self._captures.get(item.session)
        if capture is not None:
            capture.put(boundary, item.step, chunk)

    async def take_audits(
        self, session: str, *, grace_s: float = TAP_GRACE_S
    ) -> tuple[list[AuditMaterial], list[AuditGap]]:
        """A closed session's audit material, one per audited stage, and for the audited stages
        whose traffic did not all arrive (within ``grace_s``) or does not make valid material, who
        owed it (``AuditGap``): a stage's inputs are its predecessor's tap, its outputs its own.
        The pipeline forgets the session's traffic either way."""
        capture = self._captures.get(session)
        if capture is None or not capture.steps:
            self.forget(session)
            return [], []
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace_s
            while not capture.complete() and (left := deadline - loop.time()) > 0:
                capture.arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(capture.arrived.wait(), left)
            materials: list[AuditMaterial] = []
            missing: list[AuditGap] = []
            for stage in self.audit_stages:
                steps = len(capture.steps)
                if stage > 0 and not capture.has(stage):
                    gap = AuditGap(
                        session,
                        stage,
                        stage - 1,
                        f"its tap of {steps} steps (stage {stage}'s inputs) did not all arrive",
                    )
                elif not capture.has(stage + 1):
                    gap = AuditGap(session, stage, stage, f"its outputs of {steps} steps did not all arrive")
                else:
                    try:
                        materials.append(self._material(session, stage, capture))
                        continue
                    except AuditError as exc:
                        gap = AuditGap(session, stage, stage, f"its traffic does not make valid material: {exc}")
                log.warning(
                    "job %s session %s: no audit material for stage %d: stage %d %s",
                    self.job,
                    session,
                    stage,
                    gap.owed_by,
                    gap.reason,
                )
                missing.append(gap)
            return materials, missing
        finally:
            self.forget(session)

    def _material(self, session: str, stage: int, capture: _Capture) -> AuditMaterial:
        """The material of one audited stage. Nothing in it comes from the stage's own word: the
        node and span are the assignment's, the model and hidden size the coordinator's."""
        if self.assignments is None or self.model is None or self.hidden_size is None:
            raise AuditError("the pipeline knows no assignments, model or hidden size to audit against")
        assigned = self.assignments[stage]
        steps = range(len(capture.steps))
        return AuditMaterial(
            job=self.job,
            session=session,
            stage=stage,
            node=assigned.node,
            model=self.model,
            layer_start=assigned.layer_start,
            layer_end=assigned.layer_end,
            dtype=self.dtype,
            hidden_size=self.hidden_size,
            steps=tuple(capture.steps),
            inputs=tuple(capture.boundaries[stage][step] for step in steps),
            outputs=tuple(capture.boundaries[stage + 1][step] for step in steps),
            prefix=capture.prefix,
        )

    def forget(self, session: str) -> None:
        """Drop whatever audit traffic is kept for ``session``."""
        self._captures.pop(session, None)

    async def _relay_tap(self, relay: Relay) -> None:
        """Hand a disputed stage its predecessor's tap, once it is found under that stage's signature."""
        forged = self._forged_tap(relay)
        if forged is not None:
            self.fail_all(forged)
            return
        await self._relay(relay.stage, relay.forward)

    async def _relay(self, index: int, frame: wire.Forward) -> None:
        link = self.links[index]
        try:
            # In ring the stage may have had the step from its predecessor already (``StageLink.relay``).
            await (link.relay(frame) if self.topology == "ring" else link.send(frame))
        except Exception as exc:
            self.fail_all(StageError(f"cannot send to stage {index}: {exc}", code="stage_lost", stage=index))

    def fail_session(self, session: str, error: Exception) -> bool:
        failed = False
        for (name, _), future in list(self._waiting.items()):
            if name == session and not future.done():
                future.set_exception(error)
                failed = True
        return failed

    def fail_all(self, error: Exception) -> None:
        for future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(error)

    async def aclose(self) -> None:
        await asyncio.gather(*(link.aclose() for link in self.links), return_exceptions=True)


def _single(result: wire.Result, item: wire.Item, chunk: bytes) -> wire.Forward:
    """One item of a stage's output, as a frame of its own (its signature is over that item alone)."""
    return wire.Forward(result.job, (item,), result.dtype, (item.count, result.shape[1]), chunk)


def _receipts(reply: wire.Message) -> tuple[dict, ...]:
    """The receipts of a stage's answer to CLOSE (``StageLink.request`` answers a CLOSE with one)."""
    assert isinstance(reply, wire.Close)
    return reply.receipts
