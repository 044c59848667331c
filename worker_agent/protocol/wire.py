# Over 500 lines: one codec, each frame type's encoding and validation side by side.
"""The data-plane wire codec between the coordinator and the stages (sans-I/O).

A frame is one binary WebSocket message: a msgpack map (the header) immediately followed by
the raw little-endian bytes of at most one tensor. No pickle anywhere. ``decode`` validates
everything a peer controls and raises ``WireError`` with a stable code; the server answers
such a frame with an ERROR frame and keeps the connection when that is safe.

Frame types (``MsgType``) and their replies:

- HELLO     coordinator -> stage: the job ticket and a proof of the job's coordinator key; the
            stage answers HELLO with its identity. A stage also says HELLO to its ring successor
            (role ``peer``) with the peer pass the coordinator gave it for that successor.
- OPEN      open sessions (KV caches) for the job; answered with OPEN. Per session, an OPEN may
            offer the keys of its prompt's prefixes (``prefix.py``), and the answer says how many
            positions each session holds already, kept from an earlier session (prefix reuse).
- FORWARD   hidden states of one or many tokens of one or many sessions.
- RESULT    a stage's output, to the coordinator: the last stage's (the step's answer) and, in
            ring topology, every other stage's too (a tap, so live audits can replay any stage).
- CLOSE     close sessions; answered with CLOSE carrying the stage's signed receipts. Per session,
            a CLOSE may list the keys under which the stage may keep the session's cache.
- PING/PONG liveness and the stage's identity and load.
- ERROR     code + message, referring to the frame (``ref``) that caused it.
"""

from __future__ import annotations

import enum
import math
import sys
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgpack
import torch

from worker_agent.errors import WireError
from worker_agent.protocol.prefix import KEY_BYTES, MAX_KEYS, PrefixKey

VERSION = 1
DEFAULT_MAX_FRAME = 64 * 1024 * 1024  # bytes in one frame, header included
MAX_HEADER = 64 * 1024  # bytes of msgpack header: a CLOSE's receipts are the largest legitimate one
MAX_EVIDENCE = 1024  # bytes of an ERROR's evidence
MAX_HELLO_FRAME = 8 * 1024  # bytes in a frame before HELLO, and in a stage's HELLO reply (tickets, identity)
# Zero bytes a PING may carry, before a HELLO too: the uplink probe times a padded PING's PONG.
MAX_PING_PAD = 256 * 1024
MAX_ITEMS = 1024  # sessions named in one frame: FORWARD/RESULT items, OPEN/CLOSE sessions and receipts
_MAX_ID = 128  # characters in a job or session id
SIG_BYTES = 64  # an item's sender signature (links.py)
# The header is unpacked with every container and string bounded, so a hostile header cannot
# grow into more than a few MiB of Python objects (64 KiB of empty lists is about 4 MiB):
# strings and bytes fit in the header, a map is a receipt or an identity (a few dozen keys), an
# array is a frame's items or a receipt's per-step hashes (at most MAX_HEADER / 69 bytes a pair).
_UNPACK_LIMITS = dict(
    max_buffer_size=MAX_HEADER,
    max_str_len=MAX_HEADER,
    max_bin_len=MAX_HEADER,
    max_array_len=4096,
    max_map_len=64,
    max_ext_len=0,
)

if sys.byteorder != "little":  # raw tensor bytes are little-endian on the wire
    raise ImportError("the wire codec needs a little-endian host")


class MsgType(enum.StrEnum):
    HELLO = "HELLO"
    OPEN = "OPEN"
    FORWARD = "FORWARD"
    RESULT = "RESULT"
    CLOSE = "CLOSE"
    PING = "PING"
    PONG = "PONG"
    ERROR = "ERROR"


DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {value: key for key, value in DTYPES.items()}


@dataclass(frozen=True)
class Item:
    """One session's slice of a FORWARD/RESULT tensor: ``count`` consecutive token rows."""

    session: str
    step: int  # 0-based index of this forward step within the session
    start: int  # position of the first token; below the session's length truncates the cache
    count: int  # token rows of this session in the tensor
    # The sender's signature over this item (links.py): 64 bytes from a stage, empty from a coordinator.
    sig: bytes = b""


@dataclass(frozen=True)
class Hello:
    job: str
    role: str = "coordinator"  # "coordinator", "peer" (the previous ring stage) or "stage" (a reply)
    ticket: bytes | None = None  # signed job ticket (tickets.py); None only on --insecure-open agents
    topology: str = "star"  # "ring" or "star"
    next_url: str | None = None  # ring: where this stage sends its output; None = back to coordinator
    next_ticket: bytes | None = None  # ring: the successor's peer pass (tickets.py), presented by this stage
    proof: bytes | None = None  # coordinator: proof it holds the job's coordinator key (tickets.prove_coordinator)
    info: dict[str, Any] = field(default_factory=dict)  # the stage's reply: node, key, model, span


PrefixKeys = tuple[PrefixKey, ...]  # one session's prefix keys, by strictly increasing positions


@dataclass(frozen=True)
class Open:
    job: str
    sessions: tuple[str, ...]
    # The coordinator's: per session (all or none), the keys of its prompt's prefixes, at most MAX_KEYS.
    prefixes: tuple[PrefixKeys, ...] = ()
    # The stage's reply: per session, the positions it holds already (a kept prefix); empty: none.
    reused: tuple[int, ...] = ()


@dataclass(frozen=True)
class Forward:
    job: str
    items: tuple[Item, ...]
    dtype: str  # key of DTYPES
    shape: tuple[int, int]  # (token rows over all items, hidden size)
    payload: bytes  # rows * hidden * itemsize raw little-endian bytes

    def item_bytes(self) -> list[bytes]:
        """Each item's exact slice of the payload, as hashed in receipts."""
        row = self.shape[1] * DTYPES[self.dtype].itemsize
        slices, offset = [], 0
        for item in self.items:
            slices.append(self.payload[offset : offset + item.count * row])
            offset += item.count * row
        return slices

    def tensor(self) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(self.payload), dtype=DTYPES[self.dtype])
        return flat.view(self.shape)  # (rows, hidden)


@dataclass(frozen=True)
class Result(Forward):
    pass


@dataclass(frozen=True)
class Close:
    job: str
    sessions: tuple[str, ...]
    receipts: tuple[dict[str, Any], ...] = ()  # the stage's reply: Receipt.to_dict() per session
    # The coordinator's: per session (all or none), the keys under which the stage may keep the
    # session's cache (its committed tokens' prefixes), at most MAX_KEYS.
    keep: tuple[PrefixKeys, ...] = ()


@dataclass(frozen=True)
class Ping:
    nonce: int
    pad: int = 0  # zero bytes after the header (at most MAX_PING_PAD): an uplink probe


@dataclass(frozen=True)
class Pong:
    nonce: int
    info: dict[str, Any] = field(default_factory=dict)  # node, key, model, span, load


@dataclass(frozen=True)
class Error:
    code: str  # stable identifier, e.g. "bad_shape", "unknown_session", "ticket_expired"
    message: str  # for humans
    ref: int | None = None  # seq of the frame this answers, when known
    job: str | None = None
    session: str | None = None
    fatal: bool = False  # the sender closes the connection after this frame
    # What the refusal rests on, for the job's coordinator to check itself, never to take on the
    # stage's word: peer_twice carries the two proofs (links.py). At most MAX_EVIDENCE bytes.
    evidence: bytes | None = None


Message = Hello | Open | Forward | Result | Close | Ping | Pong | Error
_TYPE_OF: dict[type, MsgType] = {
    Hello: MsgType.HELLO,
    Open: MsgType.OPEN,
    Forward: MsgType.FORWARD,
    Result: MsgType.RESULT,
    Close: MsgType.CLOSE,
    Ping: MsgType.PING,
    Pong: MsgType.PONG,
    Error: MsgType.ERROR,
}


def tensor_payload(tensor: torch.Tensor, dtype: str) -> bytes:
    """Raw bytes of a (rows, hidden) tensor in the wire dtype."""
    data = tensor.detach().to("cpu", DTYPES[dtype]).contiguous()
    return data.view(torch.uint8).numpy().tobytes()


def encode(message: Message, seq: int) -> bytes:
    """One frame: msgpack header, then the tensor bytes for FORWARD/RESULT."""
    header: dict[str, Any] = {"v": VERSION, "type": str(_TYPE_OF[type(message)]), "seq": seq}
    payload = b""
    match message:
        case Hello():
            header.update(
                job=message.job,
                role=message.role,
                ticket=message.ticket,
                topology=message.topology,
                next_url=message.next_url,
                next_ticket=message.next_ticket,
                proof=message.proof,
                info=message.info,
            )
        case Open():
            header.update(job=message.job, sessions=list(message.sessions))
            if message.prefixes:  # absent, not empty, where there are none: older peers read on
                header["prefixes"] = _keys_out(message.prefixes)
            if message.reused:
                header["reused"] = list(message.reused)
        case Forward():  # and Result
            header.update(
                job=message.job,
                dtype=message.dtype,
                shape=list(message.shape),
                items=[[i.session, i.step, i.start, i.count, *([i.sig] if i.sig else [])] for i in message.items],
            )
            payload = message.payload
        case Close():
            header.update(job=message.job, sessions=list(message.sessions), receipts=list(message.receipts))
            if message.keep:
                header["keep"] = _keys_out(message.keep)
        case Ping():
            header.update(nonce=message.nonce)
            payload = bytes(message.pad)
        case Pong():
            header.update(nonce=message.nonce, info=message.info)
        case Error():
            header.update(
                code=message.code,
                message=message.message,
                ref=message.ref,
                job=message.job,
                session=message.session,
                fatal=message.fatal,
            )
            if message.evidence is not None:  # absent, not nil, where there is none: older peers read on
                header["evidence"] = message.evidence
    return msgpack.packb(header, use_bin_type=True) + payload


@dataclass(frozen=True)
class Frame:
    seq: int
    message: Message
    size: int  # bytes on the wire


def peek_seq(frame: bytes) -> int | None:
    """Best-effort seq of a frame that failed to decode, for the ERROR's ``ref``."""
    try:
        header = _unpack_header(frame)[0]
        seq = header.get("seq") if isinstance(header, dict) else None
        return seq if _is_int(seq) else None
    except Exception:
        return None


def _a_probe(frame: bytes | bytearray | memoryview) -> bool:
    """Whether a frame over the connection's size limit is a padded PING within its own limit
    (only its first MAX_HEADER bytes are read to tell)."""
    if len(frame) > MAX_HEADER + MAX_PING_PAD:
        return False
    try:
        header = _unpack_header(frame)[0]
    except Exception:
        return False
    return isinstance(header, dict) and header.get("type") == str(MsgType.PING)


def _unpack_header(frame: bytes | bytearray | memoryview) -> tuple[Any, int]:
    """The header and its length in bytes; only its first MAX_HEADER bytes are ever read, within
    ``_UNPACK_LIMITS``. Raises msgpack.OutOfData when no whole header lies within them."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    unpacker.feed(memoryview(frame)[:MAX_HEADER])
    header = unpacker.unpack()
    return header, unpacker.tell()


def decode(
    frame: bytes | bytearray | memoryview | str, *, max_frame: int = DEFAULT_MAX_FRAME, hidden_size: int | None = None
) -> Frame:
    """Parse and validate one frame (a text frame is refused); raise WireError (with a precise code) on anything off."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise WireError("text frames are not accepted; send binary frames", code="malformed")
    if len(frame) > max_frame and not _a_probe(frame):
        raise WireError(f"frame of {len(frame)} bytes exceeds the limit of {max_frame}", code="too_large")
    frame = bytes(frame)
    try:
        header, offset = _unpack_header(frame)
    except msgpack.OutOfData:
        if len(frame) > MAX_HEADER:
            raise WireError(f"header exceeds {MAX_HEADER} bytes", code="too_large") from None
        raise WireError("header is not valid msgpack: OutOfData", code="malformed") from None
    except ValueError as exc:
        if "exceeds max_" not in str(exc):  # msgpack's words for a string or container over a limit
            raise WireError(f"header is not valid msgpack: {exc.__class__.__name__}", code="malformed") from exc
        raise WireError(f"header is over the wire's limits: {exc}", code="too_large") from None
    except Exception as exc:
        raise WireError(f"header is not valid msgpack: {exc.__class__.__name__}", code="malformed") from exc
    if not isinstance(header, dict):
        raise WireError("header must be a msgpack map", code="malformed")
    version = header.get("v")
    if version != VERSION:
        raise WireError(f"unsupported protocol version {version!r} (this side speaks {VERSION})", code="bad_version")
    seq = _int(header, "seq", minimum=0)
    try:
        kind = MsgType(header.get("type", ""))  # a missing type is as unknown as any other
    except ValueError:
        raise WireError(f"unknown frame type {header.get('type')!r}", code="unknown_type") from None
    payload = frame[offset:]
    if kind is MsgType.PING:
        if len(payload) > MAX_PING_PAD:
            raise WireError(f"a PING carries at most {MAX_PING_PAD} bytes of padding", code="too_large")
        if payload.count(0) != len(payload):
            raise WireError("a PING's padding is zero bytes", code="malformed")
    elif payload and kind not in (MsgType.FORWARD, MsgType.RESULT):
        raise WireError(f"{kind} frames carry no tensor bytes", code="malformed")
    return Frame(seq, _parse(kind, header, payload, hidden_size), len(frame))


def _parse(kind: MsgType, h: dict, payload: bytes, hidden_size: int | None) -> Message:
    match kind:
        case MsgType.HELLO:
            topology = _str(h, "topology")
            if topology not in ("ring", "star"):
                raise WireError(f"topology must be 'ring' or 'star', got {topology!r}", code="malformed")
            role = _str(h, "role")
            if role not in ("coordinator", "peer", "stage"):
                raise WireError(f"role must be 'coordinator', 'peer' or 'stage', got {role!r}", code="malformed")
            return Hello(
                job=_id(h, "job"),
                role=role,
                ticket=_opt(h, "ticket", bytes),
                topology=topology,
                next_url=_opt(h, "next_url", str),
                next_ticket=_opt(h, "next_ticket", bytes),
                proof=_opt(h, "proof", bytes),
                info=_opt(h, "info", dict) or {},
            )
        case MsgType.OPEN:
            sessions = _ids(h, "sessions")
            return Open(
                job=_id(h, "job"),
                sessions=sessions,
                prefixes=_keys_in(h, "prefixes", len(sessions)),
                reused=_reused(h, len(sessions)),
            )
        case MsgType.FORWARD | MsgType.RESULT:
            return _parse_tensor_frame(kind, h, payload, hidden_size)
        case MsgType.CLOSE:
            receipts = _opt(h, "receipts", list) or []
            if len(receipts) > MAX_ITEMS:
                raise WireError(f"a CLOSE carries at most {MAX_ITEMS} receipts", code="too_large")
            if not all(isinstance(r, dict) for r in receipts):
                raise WireError("receipts must be maps", code="malformed")
            sessions = _ids(h, "sessions")
            return Close(
                job=_id(h, "job"), sessions=sessions, receipts=tuple(receipts), keep=_keys_in(h, "keep", len(sessions))
            )
        case MsgType.PING:
            return Ping(nonce=_int(h, "nonce"), pad=len(payload))
        case MsgType.PONG:
            return Pong(nonce=_int(h, "nonce"), info=_opt(h, "info", dict) or {})
        case MsgType.ERROR:
            return Error(
                code=_str(h, "code"),
                message=_str(h, "message"),
                ref=_opt(h, "ref", int),
                job=_opt(h, "job", str),
                session=_opt(h, "session", str),
                fatal=bool(_opt(h, "fatal", bool)),
                evidence=_evidence(h),
            )
    raise WireError(f"unknown frame type {kind!r}", code="unknown_type")  # pragma: no cover


def _parse_tensor_frame(kind: MsgType, h: dict, payload: bytes, hidden_size: int | None) -> Forward:
    dtype = _str(h, "dtype")
    if dtype not in DTYPES:
        raise WireError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}", code="bad_dtype")
    shape = h.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(_is_int(n) and n > 0 for n in shape)):
        raise WireError(f"shape must be [rows, hidden] of positive ints, got {shape!r}", code="bad_shape")
    rows, hidden = shape
    if hidden_size is not None and hidden != hidden_size:
        raise WireError(f"hidden size {hidden} does not match this stage's {hidden_size}", code="bad_shape")
    raw_items = h.get("items")
    if not isinstance(raw_items, list) or not raw_items:
        raise WireError("items must be a non-empty list", code="malformed")
    if len(raw_items) > MAX_ITEMS:
        raise WireError(f"a frame carries at most {MAX_ITEMS} items, got {len(raw_items)}", code="too_large")
    items = []
    for raw in raw_items:
        if not (
            isinstance(raw, list)
            and len(raw) in (4, 5)
            and isinstance(raw[0], str)
            and all(_is_int(n) for n in raw[1:4])
            and (len(raw) == 4 or (isinstance(raw[4], bytes) and len(raw[4]) == SIG_BYTES))
        ):
            raise WireError(
                f"each item is [session, step, start, count] or [..., {SIG_BYTES}-byte signature], got {raw!r:.200}",
                code="malformed",
            )
        session, step, start, count = raw[:4]
        if not 0 < len(session) <= _MAX_ID or step < 0 or start < 0 or count < 1:
            raise WireError(f"item {raw[:4]!r} is out of range", code="malformed")
        items.append(Item(session, step, start, count, raw[4] if len(raw) == 5 else b""))
    if len({item.session for item in items}) != len(items):
        raise WireError("a session appears twice in one frame", code="malformed")
    if sum(item.count for item in items) != rows:
        raise WireError(f"items cover {sum(i.count for i in items)} rows but shape says {rows}", code="bad_shape")
    expected = rows * hidden * DTYPES[dtype].itemsize
    if len(payload) != expected:
        raise WireError(f"tensor has {len(payload)} bytes, shape {shape} {dtype} needs {expected}", code="bad_shape")
    cls = Forward if kind == MsgType.FORWARD else Result
    message = cls(job=_id(h, "job"), items=tuple(items), dtype=dtype, shape=(rows, hidden), payload=payload)
    if not bool(torch.isfinite(message.tensor()).all()):
        raise WireError("tensor holds NaN or Inf", code="non_finite")
    return message


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(h: dict, key: str, *, minimum: int | None = None) -> int:
    value = h.get(key)
    if not _is_int(value) or (minimum is not None and value < minimum):
        raise WireError(f"field {key!r} must be an integer, got {value!r}", code="malformed")
    return value


def _str(h: dict, key: str) -> str:
    value = h.get(key)
    if not isinstance(value, str):
        raise WireError(f"field {key!r} must be a string, got {type(value).__name__}", code="malformed")
    return value


def _id(h: dict, key: str) -> str:
    value = _str(h, key)
    if not 0 < len(value) <= _MAX_ID or not value.isprintable():
        raise WireError(f"field {key!r} must be 1-{_MAX_ID} printable characters", code="malformed")
    return value


def _ids(h: dict, key: str) -> tuple[str, ...]:
    values = h.get(key)
    if not isinstance(values, list) or not values:
        raise WireError(f"field {key!r} must be a non-empty list of ids", code="malformed")
    if len(values) > MAX_ITEMS:
        raise WireError(f"field {key!r} names at most {MAX_ITEMS} sessions, got {len(values)}", code="too_large")
    return tuple(_id({key: value}, key) for value in values)


def _opt(h: dict, key: str, kind: type) -> Any:
    value = h.get(key)
    if value is not None and not isinstance(value, kind):
        raise WireError(f"field {key!r} must be {kind.__name__} or nil, got {type(value).__name__}", code="malformed")
    if kind is int and isinstance(value, bool):
        raise WireError(f"field {key!r} must be an integer", code="malformed")
    return value


def _keys_out(per_session: tuple[PrefixKeys, ...]) -> list[list[list]]:
    return [[[key.positions, key.key] for key in keys] for keys in per_session]


def _keys_in(h: dict, name: str, sessions: int) -> tuple[PrefixKeys, ...]:
    """Per session, its prefix keys: ``[[positions, key], ...]`` with positions >= 1 strictly
    increasing and each key KEY_BYTES bytes, at most MAX_KEYS a session; absent: none."""
    raw = _opt(h, name, list)
    if raw is None:
        return ()
    if len(raw) != sessions:
        raise WireError(f"field {name!r} lists {len(raw)} sessions' keys for {sessions} sessions", code="malformed")
    out = []
    for keys in raw:
        if not isinstance(keys, list):
            raise WireError(f"field {name!r} holds a list of keys per session", code="malformed")
        if len(keys) > MAX_KEYS:
            raise WireError(
                f"field {name!r} lists at most {MAX_KEYS} keys a session, got {len(keys)}", code="too_large"
            )
        parsed, last = [], 0
        for pair in keys:
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and _is_int(pair[0])
                and isinstance(pair[1], bytes)
                and len(pair[1]) == KEY_BYTES
            ):
                raise WireError(
                    f"each prefix key in {name!r} is [positions, {KEY_BYTES}-byte key], got {pair!r:.200}",
                    code="malformed",
                )
            if pair[0] <= last or pair[0] >= 1 << 31:
                raise WireError(f"prefix positions in {name!r} must increase from 1, got {pair[0]}", code="malformed")
            last = pair[0]
            parsed.append(PrefixKey(pair[0], pair[1]))
        out.append(tuple(parsed))
    return tuple(out)


def _reused(h: dict, sessions: int) -> tuple[int, ...]:
    raw = _opt(h, "reused", list)
    if raw is None:
        return ()
    if len(raw) != sessions or not all(_is_int(n) and 0 <= n < 1 << 31 for n in raw):
        raise WireError(f"field 'reused' must list {sessions} non-negative positions", code="malformed")
    return tuple(raw)


def _evidence(h: dict) -> bytes | None:
    evidence = _opt(h, "evidence", bytes)
    if evidence is not None and len(evidence) > MAX_EVIDENCE:
        raise WireError(f"an ERROR's evidence is at most {MAX_EVIDENCE} bytes", code="too_large")
    return evidence


def finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))
