"""The rules of one incoming data-plane connection, without I/O (after python-websockets' sans-I/O core).

``Connection`` takes what arrives on one WebSocket (raw frames, or frames already decoded) and
returns one typed action per frame for the asyncio adapter (``server.py``) to carry out: refuse
with an ERROR, accept a HELLO, answer a PING, or hand OPEN/FORWARD/CLOSE to the stage. It owns
every rule that depends only on the connection itself:

- the per-connection limits: frame size and the stage's hidden size, checked by ``wire.decode``;
  before a HELLO is accepted only small frames (``Limits.max_frame_before_hello``) are decoded at
  all, so an unauthenticated peer cannot make the agent unpack anything large;
- the replay guard: each frame's seq must be above the last one accepted (gaps are allowed);
- HELLO first: only PING and HELLO are answered before a HELLO has been accepted;
- admission: an agent may serve several stages on one port (a new block loads while the old one
  finishes its jobs); the HELLO's ticket (or peer pass) names which one (model and layer span), is
  verified against that stage (node, model, layer span) at the time it is fed with, and the
  connection is bound to its job, node, model and span, so to that stage alone for its whole life.
  A stage being released takes no new job: only a HELLO for a job already open on it (a ring peer,
  a coordinator reconnecting) is admitted. Without tickets (``--insecure-open``) a HELLO binds to
  the primary stage, the first of the admissions;
- who is the coordinator: a ``coordinator`` HELLO carries a ticket from a trusted issuer and a
  fresh proof (``tickets.check_coordinator_proof``) that it holds the coordinator key the ticket
  names. While a job is live here, a coordinator HELLO for it must prove that same key (the job's
  coordinator reconnecting after a heal); any other key is refused (``job_taken``);
- roles: a ``coordinator`` may open, forward and close; a ring ``peer`` may only forward, only
  for a job whose coordinator is connected here, and only with a peer pass signed by that job's
  coordinator key for this stage;
- one ring peer per job, proven: a pass naming a sender is admitted only with that sender's
  signature over it (``links.check_peer_proof``, else ``peer_unproven``), so a pass is nobody
  else's to use. The stage remembers the newest pass it admitted for each job (``PeerRecord``).
  The same pass with the same proof is the sender reconnecting: its new connection replaces the
  old one (the adapter closes it), which a frozen half of a connection could otherwise hold
  forever. The same pass with another valid proof is refused (``peer_twice``) with both proofs as
  evidence for the job's coordinator: an honest sender's proof never changes. A newer pass
  (another sender, or the same one re-pointed) replaces the old connection: the route was
  healed. An older pass is refused (``peer_stale``): the predecessor the route was healed away
  from cannot push its replacement out;
- job binding: a frame for another job than the one bound is refused;
- expiry: a connection's grant ends when its ticket (or peer pass) expires, with the job's deadline;
- which refusals keep the connection usable (every bad frame) and which close it (a failed HELLO,
  a frame after the grant expired).

What the stage says about sessions (unknown, evicted, out of order, full) stays in ``stage.py``;
the adapter turns those errors into refusals with ``refused``.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from worker_agent.errors import SwarmError, TicketError, WireError
from worker_agent.protocol import wire
from worker_agent.protocol.links import BadLink, check_peer_proof, second_connection_evidence
from worker_agent.protocol.span import Span
from worker_agent.protocol.tickets import (
    PeerPass,
    ProofNonces,
    Ticket,
    check_coordinator_proof,
    check_ticket_target,
    open_peer_pass,
    open_ticket,
)


@dataclass(frozen=True)
class PeerRecord:
    """The newest peer pass a stage admitted for a job, and the proof its sender gave with it."""

    order: int  # the pass's issue order (tickets.PeerPass.order)
    pass_digest: bytes  # sha256 of the pass's bytes: the same pass presented again
    proof: bytes  # the sender's signature over the pass (links.peer_proof); empty: no sender named


class SecondPeerConnection(TicketError):
    """A pass's sender opened a second connection under a proof it made outside the protocol."""

    def __init__(self, message: str, evidence: bytes) -> None:
        super().__init__(message, code="peer_twice")
        self.evidence = evidence  # both proofs (links.second_connection_evidence), for the coordinator


class Role(enum.StrEnum):
    """Who is on the other end of a connection, as its HELLO said."""

    COORDINATOR = "coordinator"  # the job's coordinator: opens, forwards and closes sessions
    PEER = "peer"  # the previous stage of a ring: only forwards its outputs


class State(enum.Enum):
    AWAITING_HELLO = "awaiting_hello"  # only PING and HELLO are served
    BOUND = "bound"  # a HELLO was accepted; frames of the bound job are served
    CLOSED = "closed"  # a fatal refusal was returned; the adapter closes the socket


@dataclass(frozen=True)
class Limits:
    """What one frame may be, checked before anything else reads it."""

    max_frame: int = wire.DEFAULT_MAX_FRAME  # bytes in one frame, header included; more is refused as too_large
    max_frame_before_hello: int = wire.MAX_HELLO_FRAME  # the same, while no HELLO has been accepted
    hidden_size: int | None = None  # width of this stage's hidden states; a FORWARD of another is bad_shape


@dataclass(frozen=True)
class Admission:
    """This stage's identity, against which a HELLO's ticket is verified."""

    node: str  # this node's id (``keys.node_id`` of its public key)
    span: Span  # the model this stage has loaded and the layers it serves: which of the agent's stages
    trusted_keys: frozenset[bytes]  # 32-byte ed25519 keys whose tickets are accepted
    insecure_open: bool = False  # development only: accept a HELLO without a ticket
    accepting: bool = True  # False while the stage is released: a HELLO must be for a job open on it
    # While released: the jobs the control plane routed here before it let the stage go (its
    # Release names them), whose coordinators' first HELLO may come after the release.
    expected: frozenset[str] = frozenset()
    # Jobs whose coordinator is connected to this stage, each with that coordinator's public key
    # (None on an insecure-open stage): a live view, read here, never changed; None: the
    # connection's ``coordinated_jobs``.
    jobs: Mapping[str, bytes | None] | None = field(default=None, compare=False, repr=False)
    # Jobs a ring peer was admitted for, each with the newest pass admitted and its proof: a live
    # view, read here, never changed; None: no peer was admitted for any job.
    peers: Mapping[str, PeerRecord] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Binding:
    """What an accepted HELLO bound the connection to, for the rest of its life."""

    job: str  # the only job whose frames this connection may send
    role: Role  # what the connection may do with that job
    node: str  # the node the ticket names (this one)
    span: Span  # the model and layers the ticket names (this stage's): the stage the connection is bound to
    expires_at: float | None  # unix seconds the ticket (or peer pass) expires at; None on an insecure-open stage
    coordinator_key: bytes | None = None  # the job's coordinator key the ticket or pass names; None if insecure-open
    # A peer: the node key its pass names, which must sign every item it forwards (links.py); empty: none named.
    sender_key: bytes = b""
    peer: PeerRecord | None = None  # a peer: its pass and proof, remembered by the stage once admitted


class ActionKind(enum.StrEnum):
    REFUSE = "refuse"
    ACCEPT_HELLO = "accept_hello"
    PONG = "pong"
    OPEN = "open"
    FORWARD = "forward"
    CLOSE = "close"


@dataclass(frozen=True)
class Refuse:
    """Answer with an ERROR frame; with ``close``, close the connection once it is sent."""

    code: str  # stable error code, e.g. "replayed_seq", "wrong_job", "ticket_expired"
    message: str  # for humans
    ref: int | None  # seq of the refused frame, when it could be read
    job: str | None = None  # the job the refused frame named, if any
    session: str | None = None  # the first session the refused frame named, if any
    close: bool = False  # a refused HELLO or an expired grant: the connection is closed after the ERROR
    # peer_twice: the two proofs, which the adapter also hands the job's coordinator (who judges them)
    evidence: bytes | None = None
    kind: ActionKind = field(default=ActionKind.REFUSE, init=False)

    def to_wire(self) -> wire.Error:
        return wire.Error(self.code, self.message, ref=self.ref, job=self.job, session=self.session, fatal=self.close)


@dataclass(frozen=True)
class AcceptHello:
    """Register the connection for its job and answer with the stage's own HELLO."""

    hello: wire.Hello  # the accepted HELLO: topology, and in a ring the successor's url and ticket
    binding: Binding  # what the connection is now bound to
    kind: ActionKind = field(default=ActionKind.ACCEPT_HELLO, init=False)


@dataclass(frozen=True)
class ReplyPong:
    """Answer a PING with a PONG carrying the stage's identity and load."""

    nonce: int  # echoed from the PING
    kind: ActionKind = field(default=ActionKind.PONG, init=False)


@dataclass(frozen=True)
class OpenSessions:
    """Open sessions on the stage (all or none) and echo the OPEN."""

    ref: int  # seq of the OPEN frame
    job: str  # the bound job
    sessions: tuple[str, ...]  # session ids to open
    prefixes: tuple[wire.PrefixKeys, ...] = ()  # per session: its prompt's prefix keys (none: no reuse)
    kind: ActionKind = field(default=ActionKind.OPEN, init=False)


@dataclass(frozen=True)
class Dispatch:
    """Hand a FORWARD to the stage to be validated and queued for the next batch."""

    ref: int  # seq of the FORWARD frame
    forward: wire.Forward  # the frame, of the bound job
    kind: ActionKind = field(default=ActionKind.FORWARD, init=False)

    @property
    def job(self) -> str:
        return self.forward.job


@dataclass(frozen=True)
class CloseSessions:
    """Close sessions on the stage (all or none) and answer with their signed receipts."""

    ref: int  # seq of the CLOSE frame
    job: str  # the bound job
    sessions: tuple[str, ...]  # session ids to close
    keep: tuple[wire.PrefixKeys, ...] = ()  # per session: the keys its cache may be kept under
    kind: ActionKind = field(default=ActionKind.CLOSE, init=False)


Action = Refuse | AcceptHello | ReplyPong | OpenSessions | Dispatch | CloseSessions


class Connection:
    """One incoming data-plane connection's state: feed it frames, carry out what it returns."""

    def __init__(
        self,
        admission: Admission | Sequence[Admission],
        limits: Limits,
        *,
        coordinated_jobs: Mapping[str, bytes | None] | None = None,
        nonces: ProofNonces | None = None,
    ) -> None:
        # The stages a HELLO may bind to, the primary first. Read when the HELLO comes, so a server
        # may hand over a sequence it keeps up to date as stages come and go.
        self.admissions: Sequence[Admission] = (admission,) if isinstance(admission, Admission) else admission
        self.limits = limits
        # Jobs whose coordinator is connected to this stage, with its key (read, never changed,
        # here): a ring peer may only join one of them, a second coordinator only with that key.
        self.coordinated_jobs: Mapping[str, bytes | None] = coordinated_jobs if coordinated_jobs is not None else {}
        # The coordinator proofs accepted so far (shared by a server's connections): each is good once.
        self.nonces = nonces if nonces is not None else ProofNonces()
        self.state = State.AWAITING_HELLO
        self.binding: Binding | None = None
        self.last_seq = 0  # the highest seq accepted so far; 0 before the first frame

    @property
    def role(self) -> Role | None:
        return self.binding.role if self.binding is not None else None

    @property
    def max_frame(self) -> int:
        """The largest frame decoded now: small until a HELLO is accepted."""
        return self.limits.max_frame if self.binding is not None else self.limits.max_frame_before_hello

    def decode(self, data: bytes | str) -> wire.Frame | Refuse:
        """One WebSocket message decoded within the connection's limits, or its refusal. Changes
        nothing, so an adapter may run it off its event loop for a large frame."""
        try:
            return wire.decode(data, max_frame=self.max_frame, hidden_size=self.limits.hidden_size)
        except WireError as exc:
            raw = data if isinstance(data, bytes) else b""
            return Refuse(exc.code, str(exc), ref=wire.peek_seq(raw))

    def receive_data(self, data: bytes | str, *, now: float) -> Action:
        """Decode one WebSocket message (``now``: unix seconds) and act on it."""
        frame = self.decode(data)
        return frame if isinstance(frame, Refuse) else self.receive_frame(frame, now=now)

    def receive_frame(self, frame: wire.Frame, *, now: float) -> Action:
        """Act on one decoded frame; ``now`` (unix seconds) is when it arrived, for the ticket's expiry."""
        if self.state is State.CLOSED:
            raise RuntimeError("this connection was closed by a fatal refusal; feed it no more frames")
        if frame.seq <= self.last_seq:
            return Refuse("replayed_seq", f"seq {frame.seq} is not above {self.last_seq}", ref=frame.seq)
        self.last_seq = frame.seq
        message = frame.message
        if isinstance(message, wire.Hello):
            return self._hello(message, frame.seq, now)
        expires_at = self.binding.expires_at if self.binding is not None else None
        if expires_at is not None and now >= expires_at and not isinstance(message, wire.Ping):
            # The grant dies with the job's deadline, even on a connection opened before it.
            self.state = State.CLOSED
            message_text = f"the ticket this connection was admitted with expired at {expires_at:.3f}"
            return Refuse("ticket_expired", message_text, ref=frame.seq, job=getattr(message, "job", None), close=True)
        try:
            return self._dispatch(message, frame.seq)
        except SwarmError as exc:
            return Refuse(exc.code, str(exc), ref=frame.seq, job=getattr(message, "job", None), session=_first(message))

    def _dispatch(self, message: wire.Message, seq: int) -> Action:
        match message:
            case wire.Ping():
                return ReplyPong(message.nonce)
            case _ if self.binding is None:
                raise TicketError("send HELLO with a job ticket first", code="ticket_missing")
            # A RESULT is a FORWARD subclass, but only stages send it, and never to a stage.
            case wire.Forward() if type(message) is wire.Forward:
                self._check_job(message.job)
                return Dispatch(seq, message)
            case _ if self.binding.role is not Role.COORDINATOR:
                raise WireError(f"a peer stage may only send FORWARD, not {type(message).__name__}", code="not_allowed")
            case wire.Open():
                self._check_job(message.job)
                return OpenSessions(seq, message.job, message.sessions, message.prefixes)
            case wire.Close():
                self._check_job(message.job)
                return CloseSessions(seq, message.job, message.sessions, message.keep)
        raise WireError(f"a stage does not accept {type(message).__name__} frames", code="not_allowed")

    def _check_job(self, job: str) -> None:
        assert self.binding is not None
        if job != self.binding.job:
            raise TicketError(f"this connection is bound to job {self.binding.job!r}, not {job!r}", code="wrong_job")

    def _hello(self, hello: wire.Hello, seq: int, now: float) -> Action:
        """Bind the connection, or refuse and close it: a stranger gets one try per connection."""
        try:
            binding = self._admit(hello, now)
        except TicketError as exc:
            self.state = State.CLOSED
            evidence = exc.evidence if isinstance(exc, SecondPeerConnection) else None
            return Refuse(exc.code, str(exc), ref=seq, job=hello.job, close=True, evidence=evidence)
        self.state, self.binding = State.BOUND, binding
        return AcceptHello(hello, binding)

    def _admit(self, hello: wire.Hello, now: float) -> Binding:
        if self.binding is not None:
            raise TicketError("this connection already said HELLO", code="hello_twice")
        if hello.role not in tuple(Role):
            raise TicketError(f"a stage does not accept HELLO as {hello.role!r}", code="not_allowed")
        binding, stage = self._verify(hello, now)
        jobs = stage.jobs if stage.jobs is not None else self.coordinated_jobs
        if binding.role is Role.PEER and hello.job not in jobs:
            raise TicketError(f"no coordinator has opened job {hello.job!r} here", code="unknown_job")
        if binding.coordinator_key is not None and hello.job in jobs and jobs[hello.job] != binding.coordinator_key:
            if binding.role is Role.PEER:
                raise TicketError(
                    f"the peer pass is not signed by job {hello.job!r}'s coordinator", code="ticket_untrusted"
                )
            raise TicketError(f"job {hello.job!r} is live here under another coordinator key", code="job_taken")
        bound = stage.peers.get(hello.job) if stage.peers is not None else None
        if binding.peer is not None and bound is not None:
            _check_newest(hello.job, binding.peer, bound)
        if not stage.accepting and hello.job not in jobs and hello.job not in stage.expected:
            raise TicketError(
                f"{stage.span.model} layers [{stage.span.start}, {stage.span.end}) is being released here "
                "and takes no new job",
                code="stage_draining",
            )
        return binding

    def _verify(self, hello: wire.Hello, now: float) -> tuple[Binding, Admission]:
        """The binding a HELLO's ticket or peer pass grants, and the stage it binds to; raises
        TicketError (fails closed)."""
        stages = tuple(self.admissions)
        if not stages:
            raise TicketError("this agent serves no block now", code="not_serving")
        primary = stages[0]
        if primary.insecure_open:
            us = primary
            return Binding(hello.job, Role(hello.role), us.node, us.span, None), us
        if hello.ticket is None:
            raise TicketError(
                "HELLO carries no job ticket and this agent is not --insecure-open", code="ticket_missing"
            )
        grant: Ticket | PeerPass
        if hello.role == Role.PEER:
            grant = open_peer_pass(hello.ticket, now=now)
            # A pass is signed by the job's coordinator, not an issuer: the stage is the one it names.
            us = next((s for s in stages if s.span == grant.span), primary)
        else:
            ticket = open_ticket(hello.ticket, frozenset().union(*(s.trusted_keys for s in stages)), now=now)
            grant = ticket
            # The stage the ticket names, trusting its issuer; else the primary, which refuses it below.
            us = next((s for s in stages if s.span == ticket.span and ticket.issuer_key in s.trusted_keys), primary)
            if ticket.issuer_key not in us.trusted_keys:
                untrusted = ticket.issuer_key.hex()
                raise TicketError(f"ticket is signed by an untrusted key {untrusted}", code="ticket_untrusted")
        check_ticket_target(grant, node=us.node, span=us.span)
        if grant.job != hello.job:
            raise TicketError(f"ticket is for job {grant.job!r}, HELLO says {hello.job!r}", code="ticket_mismatch")
        peer: PeerRecord | None = None
        if hello.role == Role.COORDINATOR:
            # Last: a proof's nonce is remembered only once everything else about the HELLO held.
            assert isinstance(grant, Ticket)  # a coordinator's grant is always a ticket (the branch above)
            check_coordinator_proof(hello.proof, hello.ticket, grant, now=now, nonces=self.nonces)
        else:
            assert isinstance(grant, PeerPass)
            peer = PeerRecord(grant.order, hashlib.sha256(hello.ticket).digest(), b"")
            if grant.sender_key:
                try:
                    check_peer_proof(grant.sender_key, hello.ticket, hello.proof)
                except BadLink as exc:
                    raise TicketError(str(exc), code=exc.code) from None
                assert hello.proof is not None  # checked just above
                peer = replace(peer, proof=hello.proof)
        return Binding(
            grant.job,
            Role(hello.role),
            grant.node,
            grant.span,
            grant.expires_at,
            grant.coordinator_key,
            grant.sender_key if isinstance(grant, PeerPass) else b"",
            peer,
        ), us


def _check_newest(job: str, peer: PeerRecord, bound: PeerRecord) -> None:
    """Raise TicketError unless a peer with ``peer``'s pass may take the job's ring peer place from
    the one admitted with ``bound`` (the rules in the module's docstring)."""
    if peer.pass_digest == bound.pass_digest:
        if peer.proof != bound.proof:
            raise SecondPeerConnection(
                f"job {job!r}'s ring peer opened a second connection under another signature of its pass",
                second_connection_evidence(bound.proof, peer.proof),
            )
        return  # the sender reconnecting
    if peer.order < bound.order:
        raise TicketError(
            f"job {job!r}'s route was healed onto a newer pass than this one: its sender is no longer the ring peer",
            code="peer_stale",
        )


def refused(action: OpenSessions | Dispatch | CloseSessions, exc: SwarmError) -> Refuse:
    """The refusal of a frame the stage turned down (unknown session, step out of order, ...):
    the connection stays usable."""
    match action:
        case Dispatch():
            session = action.forward.items[0].session if action.forward.items else None
        case _:
            session = action.sessions[0] if action.sessions else None
    return Refuse(exc.code, str(exc), ref=action.ref, job=action.job, session=session)


def _first(message: wire.Message) -> str | None:
    """The first session a frame names, for the ERROR that refuses it."""
    if isinstance(message, wire.Forward) and message.items:
        return message.items[0].session
    if isinstance(message, wire.Open | wire.Close) and message.sessions:
        return message.sessions[0]
    return None
