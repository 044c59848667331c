# Over 500 lines: a relay's whole wire (routes, messages, frames, passes), one sans-I/O table.
"""A relay's wire rules, messages and passes (sans-I/O: no sockets, no asyncio).

An agent that cannot accept connections (behind a home router's NAT, or a firewall that lets only
outbound HTTPS out) keeps a control link open to a relay; its peers connect to the relay, which
splices their TCP byte stream to a data connection the agent opens back to it. TLS stays end to
end: the relay routes on the ClientHello's server name and forwards ciphertext, never a key.

One TCP port serves everything, so a relay on 443 is reachable from such a firewall. ``classify``
reads the first bytes of a connection (at most ``MAX_PREFIX_BYTES``; the adapter bounds the time)
and names it:

- a TLS ClientHello (record type 0x16) whose SNI is ``<node>.swarm``: a peer of that node
  (``PeerRoute``). Everything read so far is forwarded to the agent first, verbatim;
- ``GET /relay/<node>[/...|?...] HTTP/1.x``: a plain ``ws://`` peer of a node without TLS, routed on
  the path, forwarded the same way;
- ``SWARM-RELAY/1 AGENT\\n``: an agent's control link (``AgentRoute``);
- ``SWARM-RELAY/1 ACCEPT <connection id> <token hex>\\n``: an agent's data connection answering a
  CONNECT (``AcceptRoute``); after the line, raw bytes are spliced with the waiting peer.

On a control link, after the line, both sides send frames: a 4-byte big-endian length, then a
msgpack map ``{"v": 1, "type": ..., <fields>}`` of at most ``MAX_FRAME_BYTES``. The relay sends
CHALLENGE; the agent answers REGISTER (a relay pass and its node key's signature over the nonce
and the relay's id); the relay answers REGISTERED (the public URLs peers should use) or ERROR and
closes. Then the relay sends CONNECT for each waiting peer, and either side PINGs (answered by
PONG); a side that hears nothing for ``IDLE_TIMEOUT_S`` drops the link. A second registration of
the same node replaces the first (a reconnect); the relay ends a link when its pass expires.

The relay pass REGISTER carries, and REGISTER's signature, are ``relay_pass.py``'s.

Errors raise ``RelayError`` with one of these codes (ERROR frames carry them)::

    unknown_protocol  the first bytes are no ClientHello, relay GET or relay line
    prefix_timeout    no decision in time       prefix_incomplete  the connection closed before one
    bad_client_hello  a malformed or fragmented ClientHello       no_sni  a ClientHello without SNI
    not_swarm_name    an SNI or path that names no swarm node     bad_request_line  a bad relay GET
    bad_line          a malformed relay line                      bad_version  an unknown version
    frame_too_large   bad_frame  unknown_type  bad_field          a control frame breaks the rules
    unexpected_message  a valid message out of turn
    pass_invalid  pass_untrusted  pass_expired  pass_wrong_relay  the relay pass is refused
    bad_signature     REGISTER is not signed by the key the pass names
    relay_full        the relay holds its maximum of agents
    unknown_node      no agent is registered for the node a peer asked for
    too_many_pending  the agent has its maximum of unanswered CONNECTs
    connect_timeout   the agent did not answer a CONNECT in time
    agent_lost        the agent's link ended while a peer waited   bad_accept  unknown id or token
    register_timeout  no REGISTER in time
    replaced  shutdown  ping_timeout                              why the relay ended a link
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import ClassVar

import msgpack

from worker_agent.errors import RelayError
from worker_agent.protocol.tls import SWARM_DOMAIN

PROTOCOL_VERSION = 1

MAX_TLS_RECORD = 2**14  # bytes of one TLS plaintext record (RFC 8446 5.1): a ClientHello fits one
MAX_PREFIX_BYTES = 5 + MAX_TLS_RECORD  # bytes read before a connection is classified
MAX_REQUEST_LINE = 8192  # bytes of a relay GET's request line
MAX_LINE_BYTES = 128  # bytes of a SWARM-RELAY line, its newline included
MAX_FRAME_BYTES = 64 * 1024  # bytes of one control frame's payload
MAX_PASS_BYTES = 1024  # bytes of a relay pass (a real one is ~200)
MAX_NAME_CHARS = 256  # characters of a relay id or a peer address
MAX_URL_CHARS = 2048
MAX_CODE_CHARS = 64
MAX_MESSAGE_CHARS = 1024
NONCE_BYTES = 32
CONNECTION_ID_CHARS = 16  # hex characters of a CONNECT's id
TOKEN_BYTES = 16  # bytes of a CONNECT's one-time token
PING_INTERVAL_S = 15.0  # each side pings this often
IDLE_TIMEOUT_S = 45.0  # a link that is silent this long (three missed pings) is dropped

LINE_MAGIC = b"SWARM-RELAY/"
AGENT_LINE = b"SWARM-RELAY/1 AGENT\n"
_HTTP_MAGIC = b"GET "
_RELAY_PATH = b"/relay/"
_TLS_HANDSHAKE = 0x16
_CLIENT_HELLO = 0x01
_SNI_EXTENSION = 0x0000
_HOST_NAME = 0x00
# A node id is one DNS label (its certificate names <node>.swarm): lower case, digits, inner hyphens.
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_NODE_RE = re.compile(_LABEL)
_HOST_RE = re.compile(rf"(?:{_LABEL}\.)*{_LABEL}")
_CONNECTION_ID_RE = re.compile(rf"[0-9a-f]{{{CONNECTION_ID_CHARS}}}")
_TOKEN_RE = re.compile(rf"[0-9a-f]{{{2 * TOKEN_BYTES}}}")


def _refuse(message: str, code: str) -> RelayError:
    return RelayError(message, code=code)


def valid_node(node: object) -> bool:
    """Whether ``node`` can be routed: one lower-case DNS label."""
    return isinstance(node, str) and _NODE_RE.fullmatch(node) is not None


# --- classifying a connection ---------------------------------------------------------------------


@dataclass(frozen=True)
class PeerRoute:
    node: str  # the node whose agent the peer wants
    tls: bool  # routed on a ClientHello's SNI (True) or a plain GET's path (False)


@dataclass(frozen=True)
class AgentRoute:
    consumed: int  # bytes of the prefix the line took; any after it are the agent's first frames


@dataclass(frozen=True)
class AcceptRoute:
    connection_id: str  # the id of the CONNECT it answers
    token: bytes  # that CONNECT's one-time token
    consumed: int  # bytes of the prefix the line took; any after it are spliced to the peer


Route = PeerRoute | AgentRoute | AcceptRoute


def classify(prefix: bytes) -> Route | None:
    """What the connection that began with ``prefix`` is; None while more bytes are needed to tell.
    Raises RelayError when it is nothing the relay serves. Each kind has its own bound (a TLS record,
    MAX_REQUEST_LINE, MAX_LINE_BYTES), none over MAX_PREFIX_BYTES: past it, a decision was made."""
    if not prefix:
        return None
    if prefix[0] == _TLS_HANDSHAKE:
        return _classify_tls(prefix)
    if _starts_as(prefix, _HTTP_MAGIC):
        return _classify_http(prefix)
    if _starts_as(prefix, LINE_MAGIC):
        return _classify_line(prefix)
    raise _refuse("the connection begins with no ClientHello, relay GET or relay line", "unknown_protocol")


def _starts_as(prefix: bytes, magic: bytes) -> bool:
    return prefix[: len(magic)] == magic[: len(prefix)]


def _classify_tls(prefix: bytes) -> PeerRoute | None:
    if len(prefix) < 5:
        return None
    length = int.from_bytes(prefix[3:5], "big")
    if prefix[1] != 3 or prefix[2] > 4 or not 0 < length <= MAX_TLS_RECORD:
        raise _refuse("a TLS handshake record with a bad version or length", "bad_client_hello")
    if len(prefix) < 5 + length:
        return None
    host = client_hello_sni(prefix[5 : 5 + length])
    if host is None:
        raise _refuse("the ClientHello names no server (no SNI)", "no_sni")
    return PeerRoute(node_from_hostname(host), tls=True)


def node_from_hostname(host: str) -> str:
    """The node a ``<node>.swarm`` name is for; RelayError(not_swarm_name) for any other name."""
    suffix = "." + SWARM_DOMAIN
    node = host[: -len(suffix)] if host.endswith(suffix) else ""
    if not valid_node(node):
        raise _refuse(f"{host[:80]!r} names no swarm node", "not_swarm_name")
    return node


class _Cursor:
    """Reads a TLS structure; reading past its end is a malformed ClientHello, never an IndexError."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, size: int) -> bytes:
        if size > self.left:
            raise _refuse("the ClientHello is truncated inside a declared length", "bad_client_hello")
        self.at += size
        return self.data[self.at - size : self.at]

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def vector(self, length_size: int) -> bytes:
        return self.take(self.uint(length_size))


def client_hello_sni(fragment: bytes) -> str | None:
    """The host name in the SNI of the ClientHello that fills ``fragment`` (one TLS record's body),
    lower case; None when it carries no SNI. Raises RelayError(bad_client_hello) when anything is
    malformed, a declared length disagrees with the bytes, or the ClientHello spans records."""
    hello = _Cursor(fragment)
    if hello.uint(1) != _CLIENT_HELLO:
        raise _refuse("the first handshake message is not a ClientHello", "bad_client_hello")
    if hello.uint(3) != hello.left:
        raise _refuse("a ClientHello that is not exactly its record (split or followed)", "bad_client_hello")
    hello.take(2 + 32)  # legacy_version, random
    if len(hello.vector(1)) > 32:
        raise _refuse("a ClientHello session id over 32 bytes", "bad_client_hello")
    suites = hello.vector(2)
    if not suites or len(suites) % 2:
        raise _refuse("a ClientHello with a bad cipher suite list", "bad_client_hello")
    if not hello.vector(1):
        raise _refuse("a ClientHello with no compression method", "bad_client_hello")
    if not hello.left:
        return None  # no extensions at all: legal before TLS 1.3
    extensions = _Cursor(hello.vector(2))
    if hello.left:
        raise _refuse("bytes after a ClientHello's extensions", "bad_client_hello")
    seen: set[int] = set()
    host = None
    while extensions.left:
        kind, body = extensions.uint(2), extensions.vector(2)
        if kind in seen:  # RFC 8446 4.2: an extension appears once; two SNIs could route two ways
            raise _refuse(f"a ClientHello repeats extension {kind}", "bad_client_hello")
        seen.add(kind)
        if kind == _SNI_EXTENSION:
            host = _server_name(body)
    return host


def _server_name(body: bytes) -> str:
    outer = _Cursor(body)
    names = _Cursor(outer.vector(2))
    if outer.left or not names.left:
        raise _refuse("a malformed server_name extension", "bad_client_hello")
    host = None
    while names.left:
        kind, raw = names.uint(1), names.vector(2)
        if kind != _HOST_NAME:
            continue  # no other name type is defined; each is length-prefixed, so skipped safely
        if host is not None:
            raise _refuse("a server_name extension with two host names", "bad_client_hello")
        try:
            host = raw.decode("ascii").lower()
        except UnicodeDecodeError:
            raise _refuse("a server name that is not ASCII", "bad_client_hello") from None
        if len(host) > 253 or not _HOST_RE.fullmatch(host):
            raise _refuse("a server name that is not a DNS host name", "bad_client_hello")
    if host is None:
        raise _refuse("a server_name extension without a host name", "bad_client_hello")
    return host


def _classify_http(prefix: bytes) -> PeerRoute | None:
    end = prefix.find(b"\r\n", 0, MAX_REQUEST_LINE + 2)
    if end < 0:
        if len(prefix) > MAX_REQUEST_LINE:
            raise _refuse(f"a request line over {MAX_REQUEST_LINE} bytes", "bad_request_line")
        return None
    parts = prefix[:end].split(b" ")
    if len(parts) != 3 or parts[0] != b"GET" or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1"):
        raise _refuse("a malformed request line", "bad_request_line")
    target = parts[1]
    if not target.startswith(_RELAY_PATH):
        raise _refuse("a GET outside /relay/<node>", "bad_request_line")
    node = re.split(rb"[/?]", target[len(_RELAY_PATH) :], maxsplit=1)[0].decode("ascii", "replace")
    if not valid_node(node):
        raise _refuse(f"the path names no node: {node[:80]!r}", "not_swarm_name")
    return PeerRoute(node, tls=False)


def _classify_line(prefix: bytes) -> AgentRoute | AcceptRoute | None:
    end = prefix.find(b"\n", 0, MAX_LINE_BYTES)
    if end < 0:
        if len(prefix) >= MAX_LINE_BYTES:
            raise _refuse(f"a relay line over {MAX_LINE_BYTES} bytes", "bad_line")
        return None
    try:
        parts = prefix[:end].removesuffix(b"\r").decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise _refuse("a relay line that is not ASCII", "bad_line") from None
    if parts[0] != f"SWARM-RELAY/{PROTOCOL_VERSION}":
        raise _refuse(f"relay protocol {parts[0][len(LINE_MAGIC) :][:16]!r} is not spoken here", "bad_version")
    if parts[1:] == ["AGENT"]:
        return AgentRoute(consumed=end + 1)
    if (
        len(parts) == 4
        and parts[1] == "ACCEPT"
        and _CONNECTION_ID_RE.fullmatch(parts[2])
        and _TOKEN_RE.fullmatch(parts[3])
    ):
        return AcceptRoute(parts[2], bytes.fromhex(parts[3]), consumed=end + 1)
    raise _refuse("a malformed relay line", "bad_line")


def accept_line(connection_id: str, token: bytes) -> bytes:
    """The first bytes of an agent's data connection answering CONNECT ``connection_id``."""
    return f"SWARM-RELAY/{PROTOCOL_VERSION} ACCEPT {connection_id} {token.hex()}\n".encode("ascii")


# --- control-link messages ------------------------------------------------------------------------


class MessageType(StrEnum):
    CHALLENGE = "challenge"  # relay -> agent, the first frame of a control link
    REGISTER = "register"  # agent -> relay, the answer
    REGISTERED = "registered"  # relay -> agent, the link is up
    CONNECT = "connect"  # relay -> agent, a peer waits: open a data connection
    PING = "ping"  # either way
    PONG = "pong"  # either way, the answer
    ERROR = "error"  # either way, then the sender closes


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise _refuse(f"{name} must be {rule}, got {shown}", "bad_field")


def _text(name: str, value: object, max_chars: int) -> None:
    ok = isinstance(value, str) and 0 < len(value) <= max_chars
    _check(ok, name, value, f"a non-empty string of at most {max_chars} characters")


def _blob(name: str, value: object, *, size: int | None = None, max_size: int = MAX_FRAME_BYTES) -> None:
    ok = isinstance(value, bytes) and (len(value) == size if size is not None else 0 < len(value) <= max_size)
    _check(ok, name, value, f"{size} bytes" if size is not None else f"1 to {max_size} bytes")


def _number(name: str, value: object) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    _check(ok, name, value, "a finite number >= 0")


def _seq(value: object) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
    _check(ok, "seq", value, "an integer in [0, 2**63)")


@dataclass(frozen=True)
class Challenge:
    TYPE: ClassVar[MessageType] = MessageType.CHALLENGE
    nonce: bytes  # NONCE_BYTES random bytes, fresh per link, that the agent signs
    relay: str  # the relay's id: what a pass must name, and what the agent signs with the nonce

    def __post_init__(self) -> None:
        _blob("nonce", self.nonce, size=NONCE_BYTES)
        _text("relay", self.relay, MAX_NAME_CHARS)


@dataclass(frozen=True)
class Register:
    TYPE: ClassVar[MessageType] = MessageType.REGISTER
    relay_pass: bytes  # a relay pass from the control plane (wire form above)
    signature: bytes  # 64 bytes: ed25519 by the pass's node key over REGISTER_CONTEXT + nonce + relay id

    def __post_init__(self) -> None:
        _blob("relay_pass", self.relay_pass, max_size=MAX_PASS_BYTES)
        _blob("signature", self.signature, size=64)


@dataclass(frozen=True)
class Registered:
    TYPE: ClassVar[MessageType] = MessageType.REGISTERED
    node: str  # the node the link serves, as its pass names it
    tls_url: str  # what a peer of a TLS node dials: wss://<relay host>:<port> (SNI <node>.swarm routes)
    plain_url: str  # what a peer of a node without TLS dials: ws://<relay host>:<port>/relay/<node>
    ping_interval_s: float  # seconds between the relay's PINGs
    idle_timeout_s: float  # seconds of silence after which the relay drops the link
    expires_at: float  # unix seconds: the pass's expiry, when the relay ends the link

    def __post_init__(self) -> None:
        _check(valid_node(self.node), "node", self.node, "a node id (one lower-case DNS label)")
        _text("tls_url", self.tls_url, MAX_URL_CHARS)
        _text("plain_url", self.plain_url, MAX_URL_CHARS)
        for name in ("ping_interval_s", "idle_timeout_s", "expires_at"):
            _number(name, getattr(self, name))


@dataclass(frozen=True)
class Connect:
    TYPE: ClassVar[MessageType] = MessageType.CONNECT
    connection_id: str  # CONNECTION_ID_CHARS hex characters, echoed in the ACCEPT line
    token: bytes  # TOKEN_BYTES random bytes, echoed (hex) in the ACCEPT line: a stranger cannot take the peer
    peer: str  # the peer's address as the relay sees it ("host:port"), for the agent's logs

    def __post_init__(self) -> None:
        ok = isinstance(self.connection_id, str) and _CONNECTION_ID_RE.fullmatch(self.connection_id) is not None
        _check(ok, "connection_id", self.connection_id, f"{CONNECTION_ID_CHARS} lower-case hex characters")
        _blob("token", self.token, size=TOKEN_BYTES)
        _text("peer", self.peer, MAX_NAME_CHARS)


@dataclass(frozen=True)
class Ping:
    TYPE: ClassVar[MessageType] = MessageType.PING
    seq: int  # the sender's counter, echoed by PONG

    def __post_init__(self) -> None:
        _seq(self.seq)


@dataclass(frozen=True)
class Pong:
    TYPE: ClassVar[MessageType] = MessageType.PONG
    seq: int  # the PING's seq

    def __post_init__(self) -> None:
        _seq(self.seq)


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[MessageType] = MessageType.ERROR
    code: str  # one of the codes listed at the top
    message: str  # for a person; never a secret

    def __post_init__(self) -> None:
        _text("code", self.code, MAX_CODE_CHARS)
        _text("message", self.message, MAX_MESSAGE_CHARS)

    @classmethod
    def of(cls, error: RelayError) -> Error:
        return cls(error.code, str(error)[:MAX_MESSAGE_CHARS] or error.code)


Message = Challenge | Register | Registered | Connect | Ping | Pong | Error
_TYPES: dict[str, type[Message]] = {
    cls.TYPE.value: cls for cls in (Challenge, Register, Registered, Connect, Ping, Pong, Error)
}


def encode_frame(message: Message) -> bytes:
    """The frame (length prefix included) that carries ``message``."""
    body = {name.name: getattr(message, name.name) for name in fields(message)}
    payload = msgpack.packb({"v": PROTOCOL_VERSION, "type": message.TYPE.value, **body}, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise _refuse(f"a {message.TYPE} frame of {len(payload)} bytes", "frame_too_large")
    return len(payload).to_bytes(4, "big") + payload


def decode_message(payload: bytes) -> Message:
    """The message in one frame's payload; RelayError for anything else."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    # msgpack raises a spread of ValueError/TypeError/UnpackException subclasses (and
    # UnicodeDecodeError) on hostile input; any of them means the same thing here.
    except Exception as exc:
        raise _refuse(f"a control frame that is not msgpack: {type(exc).__name__}", "bad_frame") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise _refuse("a control frame that is not a map with a string type", "bad_frame")
    version = raw.get("v")
    if isinstance(version, bool) or version != PROTOCOL_VERSION:
        raise _refuse(f"control frame version {version!r} is not spoken here", "bad_version")
    cls = _TYPES.get(raw["type"])
    if cls is None:
        raise _refuse(f"unknown control message type {raw['type'][:40]!r}", "unknown_type")
    names = {name.name for name in fields(cls)}
    if set(raw) != names | {"v", "type"}:
        raise _refuse(f"a {cls.TYPE} frame must have exactly the fields {sorted(names)}", "bad_field")
    return cls(**{name: raw[name] for name in names})


class FrameDecoder:
    """Splits a control link's byte stream into messages. A declared length over MAX_FRAME_BYTES is
    refused from its 4-byte header, before any of the frame is kept."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= 4:
            length = int.from_bytes(self._buffer[:4], "big")
            if not 0 < length <= MAX_FRAME_BYTES:
                raise _refuse(f"a control frame declares {length} bytes (1 to {MAX_FRAME_BYTES})", "frame_too_large")
            if len(self._buffer) < 4 + length:
                break
            payload = bytes(self._buffer[4 : 4 + length])
            del self._buffer[: 4 + length]
            messages.append(decode_message(payload))
        return messages


class Liveness:
    """When a link's side should PING, and when it should give up, from when it last heard anything."""

    def __init__(self, now: float, *, ping_interval_s: float, idle_timeout_s: float) -> None:
        self.ping_interval_s, self.idle_timeout_s = ping_interval_s, idle_timeout_s
        self.heard_at = now  # clock seconds
        self.next_ping = now + ping_interval_s

    def heard(self, now: float) -> None:
        self.heard_at = now

    def dead(self, now: float) -> bool:
        return now - self.heard_at >= self.idle_timeout_s

    def ping_due(self, now: float) -> bool:
        """True once per interval: the caller sends a PING."""
        if now < self.next_ping:
            return False
        self.next_ping = now + self.ping_interval_s
        return True

    def wait_s(self, now: float) -> float:
        """How long the side may wait for bytes before it must act (ping, or give up)."""
        return max(0.0, min(self.next_ping, self.heard_at + self.idle_timeout_s) - now)


def public_urls(host: str, port: int, node: str) -> tuple[str, str]:
    """(tls_url, plain_url) of ``node`` behind the relay at ``host``:``port``."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 literal
    return f"wss://{shown}:{port}", f"ws://{shown}:{port}/relay/{node}"
