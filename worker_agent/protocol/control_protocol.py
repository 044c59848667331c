# Over 500 lines: the control channel's whole message vocabulary and codec, one table.
"""The control channel's messages and their JSON codec (sans-I/O: no sockets, no asyncio).

Agents and the control plane talk over one WebSocket (``/ws/agent/``) in JSON text frames, each
an object with a ``type``. ``decode`` bounds a frame's size before it parses it, checks the
version, the type and every field's type and range, and returns a frozen dataclass;
``encode`` checks a message the same way (construction validates) and writes it. Anything
wrong raises ``ProtocolError`` with a stable ``code``::

    frame_too_large   the frame is over MAX_FRAME_CHARS characters
    bad_json          the frame is not valid JSON
    not_a_message     the frame is not a JSON object with a string ``type``
    bad_version       ``v`` names a version this side does not speak
    unknown_type      ``type`` names no message of this protocol
    missing_field     a required field is absent
    bad_field         a field has the wrong type or is out of range
    invalid_report    an agent's report (heartbeat load, probe results) is malformed

The handshake: the control plane sends ``Nonce`` (wire type ``challenge`` with a ``nonce``),
the agent answers ``Auth`` (its node id and ``control_signature`` over the nonce), the control
plane answers ``Welcome`` (which tells the agent the address its channel came from) or ``Error``
and closes. Then, agent -> control plane: ``Heartbeat``, ``Ready``, ``Failed``, ``ProbeResult``;
control plane -> agent: ``Assign``, ``Release``, ``Drain``, ``Stop``, ``Probe``, ``UseRelay`` (the
data URL it reported could not be reached from the control plane: serve through one of these
relays) and ``Error``. Seeded spot-checks travel the data plane as ordinary sessions.

Version 1 is the wire as it was before a version existed: frames carry no ``v`` and a frame
without one is version 1, so older and newer peers interoperate. The join signature (HTTP
registration) and the control-channel handshake signature live here too, so the control plane
verifies them without importing the agent's runtime.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, ClassVar, cast

from nacl.signing import SigningKey

from worker_agent import checkpoints
from worker_agent.errors import SwarmError
from worker_agent.protocol.keys import public_key_bytes
from worker_agent.protocol.span import Span

# Of the memory_bytes an agent reports at join, the share placement plans for weights and KV caches,
# and the share the agent then holds them in (``kvcache.KVMemory``); the rest is left to activations,
# the runtime and the allocator's slack.
MEMORY_FRACTION = 0.8
PROTOCOL_VERSION = 1  # written as ``v`` only from version 2 on: a frame without ``v`` is version 1
MAX_FRAME_CHARS = 8 * 1024 * 1024  # characters in one text frame
MAX_TEXT_CHARS = 64 * 1024  # characters of free text (an error message, a stop reason)
MAX_NAME_CHARS = 256  # characters of a name: node id, model, probe target
MAX_URL_CHARS = 2048  # characters of a URL
MAX_CODE_CHARS = 64  # characters of an error code
MAX_ADDRESS_CHARS = 64  # characters of an IP address, or of a relay's host:port
MAX_PASS_CHARS = 2048  # hex characters of a relay pass (a pass is about 200 bytes)
MAX_RELAYS = 16  # relays offered at once
MAX_ITEMS = 1024  # entries in a list: assignments, probe targets, probe results
MAX_ID = 2**63 - 1  # database ids are positive 64-bit integers
MAX_JOB_CHARS = 128  # characters of a job id, as the data plane bounds it (wire._MAX_ID)
MAX_LAYER = 100_000  # layer indexes a span may name
MAX_REPORT = 1e15  # largest number in a report: fits the control plane's columns
NONCE_BYTES = 32  # bytes of the handshake nonce

JOIN_CONTEXT = b"swarm-join-v1\0"  # signed at join: context || token || 0 || public key
CONTROL_CONTEXT = b"swarm-control-v1\0"  # signed per connection: context || nonce || node id

FRAME_TOO_LARGE = "frame_too_large"
BAD_JSON = "bad_json"
NOT_A_MESSAGE = "not_a_message"
BAD_VERSION = "bad_version"
UNKNOWN_TYPE = "unknown_type"
MISSING_FIELD = "missing_field"
BAD_FIELD = "bad_field"
INVALID_REPORT = "invalid_report"
FRAMING_CODES = frozenset({FRAME_TOO_LARGE, BAD_JSON, NOT_A_MESSAGE, BAD_VERSION})  # no message to answer

# A heartbeat's load state saying the agent is stopping: the control plane routes it nothing more
# and answers with a Drain, after which the agent refuses new jobs (``control.Agent.stop``).
LEAVING = "leaving"


class ProtocolError(SwarmError):
    """A control-channel frame or message that breaks the protocol. ``kind`` is the wire type
    the frame claimed (None when it named none), so a receiver can answer in kind."""

    code = BAD_FIELD

    def __init__(self, message: str, *, code: str, kind: str | None = None) -> None:
        super().__init__(message, code=code)
        self.kind = kind


class MessageType(StrEnum):
    CHALLENGE = "challenge"  # control plane -> agent: the handshake nonce
    AUTH = "auth"
    WELCOME = "welcome"
    ERROR = "error"
    HEARTBEAT = "heartbeat"
    ASSIGN = "assign"
    RELEASE = "release"
    USE_RELAY = "use_relay"
    DRAIN = "drain"
    STOP = "stop"
    PROBE = "probe"
    PROBE_RESULT = "probe_result"
    READY = "ready"
    FAILED = "failed"


def join_signature(signing_key: SigningKey, token: str) -> str:
    """The agent's proof, at join, that it holds the key it registers (hex)."""
    public = public_key_bytes(signing_key)
    return signing_key.sign(JOIN_CONTEXT + token.encode() + b"\0" + public).signature.hex()


def control_signature(signing_key: SigningKey, nonce: bytes, node: str) -> str:
    """The agent's answer to one connection's nonce (hex): a replay on another connection fails."""
    return signing_key.sign(CONTROL_CONTEXT + nonce + node.encode()).signature.hex()


# --- field checks ---------------------------------------------------------------------------------


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"{name} must be an integer in [{low}, {high}], got {_show(value)}", code=BAD_FIELD)
    return value


def _number(name: str, value: object, *, low: float = 0.0, high: float = MAX_REPORT, code: str = BAD_FIELD) -> float:
    # Same wording as the control plane's report checks, so either side's refusal reads the same.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < low:
        raise ProtocolError(f"{name} must be a number >= {low}, got {_show(value)}", code=code)
    if value > high:
        raise ProtocolError(f"{name} must be at most {high:g}, got {_show(value)}", code=code)
    return value


def _text(name: str, value: object, max_chars: int, *, empty: bool = False, code: str = BAD_FIELD) -> str:
    if not isinstance(value, str) or (not value and not empty) or len(value) > max_chars:
        what = "a string" if empty else "a non-empty string"
        raise ProtocolError(f"{name} must be {what} of at most {max_chars} characters, got {_show(value)}", code=code)
    return value


def _span(start: object, end: object) -> None:
    start = _int("layer_start", start, 0, MAX_LAYER - 1)
    _int("layer_end", end, start + 1, MAX_LAYER)


def _items(owner: Any, name: str, part: type) -> None:
    """Coerce a list field to a tuple of ``part`` (frozen messages hold tuples)."""
    value = getattr(owner, name)
    if not isinstance(value, list | tuple) or len(value) > MAX_ITEMS:
        raise ProtocolError(f"{name} must be a list of at most {MAX_ITEMS} entries, got {_show(value)}", code=BAD_FIELD)
    if not all(isinstance(item, part) for item in value):
        raise ProtocolError(f"{name} must hold {part.__name__} entries, got {_show(value)}", code=BAD_FIELD)
    object.__setattr__(owner, name, tuple(value))


def _job_ids(owner: Any) -> None:
    """Coerce ``owner.jobs`` to a tuple of job ids (at most MAX_ITEMS, each a non-empty string), if any."""
    jobs = owner.jobs
    if jobs is None:
        return
    if not isinstance(jobs, list | tuple) or len(jobs) > MAX_ITEMS:
        raise ProtocolError(f"jobs must be a list of at most {MAX_ITEMS} job ids, got {_show(jobs)}", code=BAD_FIELD)
    for job in jobs:
        _text("a job id", job, MAX_JOB_CHARS)
    object.__setattr__(owner, "jobs", tuple(jobs))


# --- messages -------------------------------------------------------------------------------------


class _Part:
    """A value with a JSON form: fields by name, None omitted unless listed in ``_keep_none``."""

    _keep_none: ClassVar[tuple[str, ...]] = ()

    def _wire(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and f.name not in self._keep_none:
                continue
            out[f.name] = _plain(value)
        return out

    @classmethod
    def _from_wire(cls, obj: Mapping[str, Any]) -> Any:
        """Build from a JSON object: known fields by name (others ignored, for newer peers)."""
        kwargs = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in obj:
                kwargs[f.name] = obj[f.name]
            elif f.default is MISSING and f.default_factory is MISSING:
                kind = getattr(cls, "TYPE", cls.__name__)
                raise ProtocolError(f"{kind} needs the field {f.name!r}", code=MISSING_FIELD, kind=kind)
        return cls(**kwargs)


def _plain(value: Any) -> Any:
    if isinstance(value, Message):
        return to_wire(value)
    if isinstance(value, _Part):
        return value._wire()
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


class Message(_Part):
    TYPE: ClassVar[MessageType]


@dataclass(frozen=True)
class Nonce(Message):
    """Control plane -> agent, first frame of a connection: sign this to authenticate."""

    TYPE: ClassVar = MessageType.CHALLENGE
    nonce: bytes  # NONCE_BYTES fresh random bytes, hex on the wire; single use

    def __post_init__(self) -> None:
        if not isinstance(self.nonce, bytes) or len(self.nonce) != NONCE_BYTES:
            raise ProtocolError(f"nonce must be {NONCE_BYTES} bytes, got {_show(self.nonce)}", code=BAD_FIELD)

    @classmethod
    def _from_wire(cls, obj: Mapping[str, Any]) -> Nonce:
        if "nonce" not in obj:
            raise ProtocolError("challenge needs the field 'nonce'", code=MISSING_FIELD)
        text = obj["nonce"]
        try:
            raw = bytes.fromhex(text) if isinstance(text, str) else None
        except ValueError:
            raw = None
        if raw is None or len(raw) != NONCE_BYTES:
            raise ProtocolError(f"nonce must be {2 * NONCE_BYTES} hex characters, got {_show(text)}", code=BAD_FIELD)
        return cls(nonce=raw)


@dataclass(frozen=True)
class Auth(Message):
    """Agent -> control plane: the answer to the nonce."""

    TYPE: ClassVar = MessageType.AUTH
    node: str  # the agent's node id (named after its public key)
    signature: str  # control_signature over the connection's nonce, hex

    def __post_init__(self) -> None:
        _text("node", self.node, MAX_NAME_CHARS)
        _text("signature", self.signature, MAX_NAME_CHARS)


@dataclass(frozen=True)
class Assign(Message):
    """Control plane -> agent: load this block and serve it, then report Ready or Failed.

    A catalog model comes with its content hash and the URL of its file manifest: the agent
    fetches the files its block needs from there and checks them against the hash
    (``worker_agent.agent.fetch``). A registry model comes without either: the agent builds it."""

    TYPE: ClassVar = MessageType.ASSIGN
    assignment: int  # the control plane's id of the assignment, echoed in Ready/Failed/Release
    model: str  # a registry id, or a catalog model ref ``name@<first 16 hex of content_hash>``
    layer_start: int  # first decoder layer of the block, inclusive
    layer_end: int  # last decoder layer of the block, exclusive
    content_hash: str | None = None  # a catalog model's content hash: 64 lowercase hex digits
    source: str | None = None  # its manifest's URL: absolute (http/https) or relative to the control plane
    # The node's block of the model this one replaces (nothing new is routed to it), if any, and the
    # jobs routed to it before and still open as this is sent: should the agent drain that block to
    # make room for this one, it takes their HELLOs first, as a release's (``Release.jobs``).
    supersedes: int | None = None
    jobs: tuple[str, ...] | None = None  # None: no list (sent without one, as before)

    def __post_init__(self) -> None:
        _int("assignment", self.assignment, 1, MAX_ID)
        _text("model", self.model, MAX_NAME_CHARS)
        _span(self.layer_start, self.layer_end)
        if self.supersedes is not None:
            _int("supersedes", self.supersedes, 1, MAX_ID)
        _job_ids(self)
        if (self.content_hash is None) != (self.source is None):
            raise ProtocolError("content_hash and source come together, or not at all", code=BAD_FIELD)
        if self.content_hash is not None:
            _text("source", self.source, MAX_URL_CHARS)
            if not isinstance(self.content_hash, str) or not checkpoints.ref_matches(self.model, self.content_hash):
                raise ProtocolError(
                    f"a catalog model's content_hash must be 64 lowercase hex digits that model "
                    f"{_show(self.model)} names (name@<its first 16>), got {_show(self.content_hash)}",
                    code=BAD_FIELD,
                )

    @property
    def span(self) -> Span:
        """The block to load: the model as sent (a registry id or catalog ref) and its layers."""
        return Span(self.model, self.layer_start, self.layer_end)


@dataclass(frozen=True)
class Welcome(Message):
    """Control plane -> agent: the handshake succeeded."""

    TYPE: ClassVar = MessageType.WELCOME
    node: str  # the node id the channel is authenticated as
    state: str  # the node's state on the control plane (active, draining, ...)
    heartbeat_interval_s: float  # seconds between the agent's heartbeats
    ticket_key: str  # the control plane's ed25519 public key that signs job tickets, 64 hex characters
    assignments: tuple[Assign, ...] = ()  # the node's live assignments, to resume after a reconnect
    # The IP address the control plane sees this channel come from (the agent's, or its NAT
    # router's): the host of the data URL an agent advertises when it was given none.
    seen_address: str | None = None

    def __post_init__(self) -> None:
        _text("node", self.node, MAX_NAME_CHARS)
        if self.seen_address is not None:
            _text("seen_address", self.seen_address, MAX_ADDRESS_CHARS)
        _text("state", self.state, MAX_CODE_CHARS)
        _number("heartbeat_interval_s", self.heartbeat_interval_s, low=0.001, high=86400.0)
        try:
            key = bytes.fromhex(self.ticket_key) if isinstance(self.ticket_key, str) else b""
        except ValueError:
            key = b""
        if len(key) != 32:
            raise ProtocolError(f"ticket_key must be 64 hex characters, got {_show(self.ticket_key)}", code=BAD_FIELD)
        _items(self, "assignments", Assign)

    @classmethod
    def _from_wire(cls, obj: Mapping[str, Any]) -> Welcome:
        welcome = super()._from_wire({**obj, "assignments": ()})
        assignments = obj.get("assignments", [])
        if not isinstance(assignments, list) or len(assignments) > MAX_ITEMS:
            raise ProtocolError(f"assignments must be a list of at most {MAX_ITEMS} entries", code=BAD_FIELD)
        return replace(welcome, assignments=tuple(from_wire(item) for item in assignments))


@dataclass(frozen=True)
class Error(Message):
    """Either way: a refusal. The control plane closes the channel after one during the handshake."""

    TYPE: ClassVar = MessageType.ERROR
    code: str  # stable machine-readable code
    message: str  # what was wrong, for people

    def __post_init__(self) -> None:
        _text("code", self.code, MAX_CODE_CHARS)
        _text("message", self.message, MAX_TEXT_CHARS, empty=True)


def error(code: str, message: str) -> Error:
    """An Error whose message is cut to the protocol's limit (it may quote a peer's input)."""
    return Error(code=code, message=message[:MAX_TEXT_CHARS])


@dataclass(frozen=True)
class Load(_Part):
    """An agent's load in a heartbeat; every field optional. Unknown keys are dropped."""

    sessions: float | None = None  # open sessions (KV caches), count
    tokens_served: float | None = None  # tokens the block processed since it was loaded, count
    uptime_s: float | None = None  # seconds the agent has been up
    queue: float | None = None  # work items waiting, count
    layer_ms: float | None = None  # measured milliseconds per layer per token since the last heartbeat
    model: str | None = None  # the model being served
    state: str | None = None  # idle, serving, draining or LEAVING

    def __post_init__(self) -> None:
        for name in ("sessions", "tokens_served", "uptime_s", "queue", "layer_ms"):
            if getattr(self, name) is not None:
                _number(name, getattr(self, name), code=INVALID_REPORT)
        for name in ("model", "state"):
            if getattr(self, name) is not None:
                _text(name, getattr(self, name), MAX_NAME_CHARS, empty=True, code=INVALID_REPORT)

    @classmethod
    def _from_wire(cls, obj: object) -> Load:
        if not isinstance(obj, Mapping):
            raise ProtocolError("load must be an object", code=INVALID_REPORT, kind=MessageType.HEARTBEAT)
        present = {f.name: obj[f.name] for f in fields(cls) if f.name in obj}
        for name, value in present.items():
            if value is None:  # a null is a malformed report, not an absent one
                what = "number >= 0.0" if name not in ("model", "state") else "string"
                raise ProtocolError(f"{name} must be a {what}, got None", code=INVALID_REPORT)
        return cls(**present)


@dataclass(frozen=True)
class Heartbeat(Message):
    """Agent -> control plane, every heartbeat_interval_s: alive, and how loaded."""

    TYPE: ClassVar = MessageType.HEARTBEAT
    load: Load = field(default_factory=Load)  # the agent's load report

    def __post_init__(self) -> None:
        if not isinstance(self.load, Load):
            raise ProtocolError("load must be an object", code=INVALID_REPORT)

    @classmethod
    def _from_wire(cls, obj: Mapping[str, Any]) -> Heartbeat:
        return cls(load=Load._from_wire(obj.get("load", {})))


@dataclass(frozen=True)
class Release(Message):
    """Control plane -> agent: stop serving this assignment (the placement moved on)."""

    TYPE: ClassVar = MessageType.RELEASE
    assignment: int  # the assignment to stop serving; another one is ignored
    model: str  # its model, for the agent's log
    # The jobs the control plane routed to the block before it let the block go and that had not
    # ended then: the block takes their coordinators' HELLOs, however late they come (within
    # ``Agent.expected_jobs_s``), and no other job's (the newest MAX_ITEMS of them). None: no list.
    jobs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _int("assignment", self.assignment, 1, MAX_ID)
        _text("model", self.model, MAX_NAME_CHARS)
        _job_ids(self)


@dataclass(frozen=True)
class Drain(Message):
    """Control plane -> agent: finish the sessions in flight, take no new placement."""

    TYPE: ClassVar = MessageType.DRAIN


@dataclass(frozen=True)
class Stop(Message):
    """Control plane -> agent: exit (ejected, or the node was deleted)."""

    TYPE: ClassVar = MessageType.STOP
    reason: str = ""  # why, for the agent's log

    def __post_init__(self) -> None:
        _text("reason", self.reason, MAX_TEXT_CHARS, empty=True)


@dataclass(frozen=True)
class ProbeTarget(_Part):
    """One link to measure."""

    _keep_none: ClassVar = ("url",)
    target: str  # a node id, or ``region:<name>`` for a coordinator region
    url: str | None = None  # ws:// data plane of a node, http(s):// probe URL of a region; None: the control plane

    def __post_init__(self) -> None:
        _text("target", self.target, MAX_NAME_CHARS)
        if self.url is not None:
            _text("url", self.url, MAX_URL_CHARS)

    @classmethod
    def _from_wire(cls, obj: object) -> ProbeTarget:
        if not isinstance(obj, Mapping):
            raise ProtocolError(f"a probe target must be an object, got {_show(obj)}", code=BAD_FIELD)
        return super()._from_wire(obj)


@dataclass(frozen=True)
class Probe(Message):
    """Control plane -> agent: measure the links to these targets, answer with ProbeResult."""

    TYPE: ClassVar = MessageType.PROBE
    model: str  # the model whose placement asked for it
    targets: tuple[ProbeTarget, ...] = ()  # the links to measure

    def __post_init__(self) -> None:
        _text("model", self.model, MAX_NAME_CHARS)
        _items(self, "targets", ProbeTarget)

    @classmethod
    def _from_wire(cls, obj: Mapping[str, Any]) -> Probe:
        targets = obj.get("targets", [])
        if not isinstance(targets, list) or len(targets) > MAX_ITEMS:
            raise ProtocolError(f"targets must be a list of at most {MAX_ITEMS} entries", code=BAD_FIELD)
        probe = super()._from_wire({**obj, "targets": ()})
        return cls(model=probe.model, targets=tuple(ProbeTarget._from_wire(t) for t in targets))


@dataclass(frozen=True)
class LinkResult(_Part):
    """One measured link."""

    target: str  # as in the ProbeTarget
    rtt_ms: float  # best round trip, milliseconds
    uplink_mbps: float | None = None  # measured upload rate, megabits per second; None: not measured

    def __post_init__(self) -> None:
        if not isinstance(self.target, str):
            raise ProtocolError("each measurement needs a target", code=INVALID_REPORT)
        _text("target", self.target, MAX_NAME_CHARS, code=INVALID_REPORT)
        _number("rtt_ms", self.rtt_ms, code=INVALID_REPORT)
        if self.uplink_mbps is not None:
            _number("uplink_mbps", self.uplink_mbps, code=INVALID_REPORT)

    @classmethod
    def _from_wire(cls, obj: object) -> LinkResult:
        if not isinstance(obj, Mapping) or not isinstance(obj.get("target"), str):
            raise ProtocolError("each measurement needs a target", code=INVALID_REPORT)
        # The values are checked in __post_init__: a missing or non-numeric rtt_ms is refused there.
        return cls(target=obj["target"], rtt_ms=cast(float, obj.get("rtt_ms")), uplink_mbps=obj.get("uplink_mbps"))


@dataclass(frozen=True)
class ProbeResult(Message):
    """Agent -> control plane: the links it could measure (an unreachable target is left out)."""

    TYPE: ClassVar = MessageType.PROBE_RESULT
    results: tuple[LinkResult, ...] = ()  # one per measured target

    def __post_init__(self) -> None:
        if not isinstance(self.results, list | tuple) or len(self.results) > MAX_ITEMS:
            raise ProtocolError(f"results must be a list of at most {MAX_ITEMS} measurements", code=INVALID_REPORT)
        _items(self, "results", LinkResult)

    @classmethod
    def _from_wire(cls, obj: Mapping[str, Any]) -> ProbeResult:
        results = obj.get("results")
        if not isinstance(results, list) or len(results) > MAX_ITEMS:
            raise ProtocolError(f"results must be a list of at most {MAX_ITEMS} measurements", code=INVALID_REPORT)
        return cls(results=tuple(LinkResult._from_wire(result) for result in results))


@dataclass(frozen=True)
class Ready(Message):
    """Agent -> control plane: the assigned block is loaded and served."""

    TYPE: ClassVar = MessageType.READY
    assignment: int  # the assignment from Assign
    url: str  # the agent's data-plane WebSocket URL

    def __post_init__(self) -> None:
        _int("assignment", self.assignment, 1, MAX_ID)
        _text("url", self.url, MAX_URL_CHARS)


@dataclass(frozen=True)
class Failed(Message):
    """Agent -> control plane: the assigned block could not be loaded or served."""

    TYPE: ClassVar = MessageType.FAILED
    assignment: int  # the assignment from Assign
    error: str  # why, for the provider's page

    def __post_init__(self) -> None:
        _int("assignment", self.assignment, 1, MAX_ID)
        _text("error", self.error, MAX_TEXT_CHARS, empty=True)


@dataclass(frozen=True)
class RelayOffer(_Part):
    """A relay an unreachable agent may serve through."""

    id: str  # the relay's id, as its passes name it
    address: str  # host:port the agent connects out to (the one port the relay serves everything on)

    def __post_init__(self) -> None:
        _text("id", self.id, MAX_NAME_CHARS)
        _text("address", self.address, MAX_ADDRESS_CHARS)
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ProtocolError(f"address must be host:port, got {_show(self.address)}", code=BAD_FIELD)

    @classmethod
    def _from_wire(cls, obj: object) -> RelayOffer:
        if not isinstance(obj, Mapping):
            raise ProtocolError(f"a relay offer must be an object, got {_show(obj)}", code=BAD_FIELD)
        return super()._from_wire(obj)


@dataclass(frozen=True)
class UseRelay(Message):
    """Control plane -> agent: the data URL it reported could not be reached from the control
    plane; serve through the nearest of these relays and report Ready again at the relay's URL."""

    TYPE: ClassVar = MessageType.USE_RELAY
    reason: str  # why the data URL could not be reached, for the provider's log
    relay_pass: str  # hex of the relay pass the control plane signed for this node (relay_protocol)
    relays: tuple[RelayOffer, ...] = ()  # nearest first is the agent's to measure

    def __post_init__(self) -> None:
        _text("reason", self.reason, MAX_TEXT_CHARS, empty=True)
        _text("relay_pass", self.relay_pass, MAX_PASS_CHARS)
        try:
            bytes.fromhex(self.relay_pass)
        except ValueError:
            raise ProtocolError("relay_pass must be hex", code=BAD_FIELD) from None
        _items(self, "relays", RelayOffer)
        if not 1 <= len(self.relays) <= MAX_RELAYS:
            raise ProtocolError(f"relays must list 1 to {MAX_RELAYS} relays", code=BAD_FIELD)

    @classmethod
    def _from_wire(cls, obj: Mapping[str, Any]) -> UseRelay:
        relays = obj.get("relays", [])
        if not isinstance(relays, list) or not 1 <= len(relays) <= MAX_RELAYS:
            raise ProtocolError(f"relays must be a list of 1 to {MAX_RELAYS} relays", code=BAD_FIELD)
        offers = tuple(RelayOffer._from_wire(relay) for relay in relays)
        return replace(super()._from_wire({**obj, "relays": [offers[0]]}), relays=offers)


# --- the codec ------------------------------------------------------------------------------------

_CLASSES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Auth,
        Welcome,
        Error,
        Heartbeat,
        Assign,
        Release,
        UseRelay,
        Drain,
        Stop,
        Probe,
        ProbeResult,
        Ready,
        Failed,
    )
}


def to_wire(message: Message) -> dict[str, Any]:
    """The message as the JSON object sent on the wire (what the channel layer carries)."""
    if not isinstance(message, Message):
        raise ProtocolError(f"not a control message: {_show(message)}", code=NOT_A_MESSAGE)
    return {"type": str(message.TYPE), **message._wire()}


def encode(message: Message) -> str:
    """One text frame. Raises ProtocolError (frame_too_large) rather than send what decode refuses."""
    text = json.dumps(to_wire(message), allow_nan=False)
    if len(text) > MAX_FRAME_CHARS:
        raise ProtocolError(
            f"a {message.TYPE} frame would hold {len(text)} characters, over the limit of {MAX_FRAME_CHARS}",
            code=FRAME_TOO_LARGE,
            kind=message.TYPE,
        )
    return text


def from_wire(obj: object) -> Message:
    """The message a parsed JSON object holds; raises ProtocolError."""
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError("messages are JSON objects with a type", code=NOT_A_MESSAGE)
    kind = obj["type"]
    version = obj.get("v", 1)
    if isinstance(version, bool) or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {_show(version)} is not spoken here (this side speaks {PROTOCOL_VERSION})",
            code=BAD_VERSION,
            kind=kind,
        )
    # The handshake nonce keeps the wire type it always had, "challenge".
    cls = Nonce if kind == MessageType.CHALLENGE else _CLASSES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown type {kind!r}", code=UNKNOWN_TYPE, kind=kind)
    try:
        return cls._from_wire(obj)
    except ProtocolError as exc:
        exc.kind = kind
        raise


def decode(text: str) -> Message:
    """Parse one text frame; its size is checked before any parsing. Raises ProtocolError."""
    if not isinstance(text, str):
        raise ProtocolError("the control channel speaks JSON text frames", code=NOT_A_MESSAGE)
    if len(text) > MAX_FRAME_CHARS:
        raise ProtocolError(
            f"a frame holds {len(text)} characters, over the limit of {MAX_FRAME_CHARS}", code=FRAME_TOO_LARGE
        )
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"a frame is not valid JSON ({exc})", code=BAD_JSON) from None
    return from_wire(obj)
