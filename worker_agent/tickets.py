"""Job tickets: a signed permission for one coordinator to use one node's span for one job.

The control plane (or a local issuer in development) signs a ticket naming the job, the node,
the model and the layer span, with an expiry. A coordinator presents it in HELLO; the agent
serves the session only if ``verify_ticket`` returns, so a stranger who learns a node's address
cannot spend its GPU time, and a ticket for one node or span is useless on another.

Wire form: msgpack ``{"body": bytes, "sig": 64 bytes, "key": 32 bytes}`` where ``body`` is the
msgpack of the ticket fields with sorted keys and ``"v": 1``, and ``sig`` is ed25519 over
``b"swarm-ticket-v1\\0" + body`` by ``key``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from nacl.exceptions import CryptoError
from nacl.signing import SigningKey, VerifyKey

from worker_agent.errors import TicketError

TICKET_VERSION = 1
# Prefixed to the body before signing so a ticket signature can never pass as any other
# signed object (a receipt, a challenge) made with the same key.
SIGNING_CONTEXT = b"swarm-ticket-v1\0"
# A real ticket is ~200 bytes; the cap bounds the work an unauthenticated HELLO can cause.
MAX_TICKET_BYTES = 4096

_BODY_STR_FIELDS = ("job", "node", "model")
_BODY_INT_FIELDS = ("layer_start", "layer_end")
_BODY_KEYS = frozenset({"v", "expires_at", *_BODY_STR_FIELDS, *_BODY_INT_FIELDS})


@dataclass(frozen=True)
class Ticket:
    job: str  # the job id the session belongs to
    node: str  # the node id allowed to serve it (``keys.node_id`` of the node's public key)
    model: str  # the model id the node must have loaded
    layer_start: int  # first layer of the span the node serves (inclusive, 0-based)
    layer_end: int  # end of that span (exclusive)
    expires_at: float  # unix seconds after which the ticket is refused
    issuer_key: bytes  # the signer's 32-byte ed25519 public key


def _invalid(message: str) -> TicketError:
    return TicketError(message, code="ticket_invalid")


def _is_int(value: object) -> bool:
    # bool is an int subclass; a ticket saying layer_start=True is malformed, not layer 1.
    return isinstance(value, int) and not isinstance(value, bool)


def issue_ticket(
    signing_key: SigningKey,
    *,
    job: str,
    node: str,
    model: str,
    layer_start: int,
    layer_end: int,
    ttl_s: float = 600,
    now: float | None = None,
) -> bytes:
    """Sign a ticket for ``node`` to serve ``[layer_start, layer_end)`` of ``model`` for ``job``."""
    for name, value in (("job", job), ("node", node), ("model", model)):
        if not isinstance(value, str) or not value:
            raise _invalid(f"ticket {name} must be a non-empty string, got {value!r}")
    if not (_is_int(layer_start) and _is_int(layer_end) and 0 <= layer_start < layer_end):
        raise _invalid(f"ticket span must satisfy 0 <= layer_start < layer_end, got [{layer_start}, {layer_end})")
    if not (isinstance(ttl_s, int | float) and math.isfinite(ttl_s) and ttl_s > 0):
        raise _invalid(f"ticket ttl_s must be a positive number of seconds, got {ttl_s!r}")
    issued = time.time() if now is None else now
    fields: dict[str, Any] = {
        "v": TICKET_VERSION,
        "job": job,
        "node": node,
        "model": model,
        "layer_start": layer_start,
        "layer_end": layer_end,
        "expires_at": float(issued + ttl_s),
    }
    body = msgpack.packb(dict(sorted(fields.items())), use_bin_type=True)
    sig = signing_key.sign(SIGNING_CONTEXT + body).signature
    return msgpack.packb({"body": body, "sig": sig, "key": bytes(signing_key.verify_key)}, use_bin_type=True)


def ticket_for_stage(signing_key: SigningKey, job: str, stage: Mapping[str, Any], ttl_s: float = 600) -> bytes:
    """A ticket for a stage named by its identity (``node``, ``model``, ``layer_start``,
    ``layer_end``: a PING's info, or any map of those keys)."""
    return issue_ticket(
        signing_key,
        job=job,
        node=stage["node"],
        model=stage["model"],
        layer_start=stage["layer_start"],
        layer_end=stage["layer_end"],
        ttl_s=ttl_s,
    )


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    # msgpack raises a spread of ValueError/TypeError/UnpackException subclasses (and
    # UnicodeDecodeError) on hostile input; any of them means the same thing here.
    except Exception as exc:
        raise _invalid(f"{what} is not valid msgpack: {type(exc).__name__}") from None


def _parse_envelope(blob: object) -> tuple[bytes, bytes, bytes]:
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise _invalid(f"ticket must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) > MAX_TICKET_BYTES:
        raise _invalid(f"ticket is {len(blob)} bytes, more than the {MAX_TICKET_BYTES} allowed")
    outer = _unpack(blob, "ticket")
    if not isinstance(outer, dict) or set(outer) != {"body", "sig", "key"}:
        raise _invalid("ticket must be a map with exactly the keys body, sig, key")
    body, sig, key = outer["body"], outer["sig"], outer["key"]
    if not isinstance(body, bytes):
        raise _invalid("ticket body must be bytes")
    if not isinstance(sig, bytes) or len(sig) != 64:
        raise _invalid("ticket sig must be 64 bytes")
    if not isinstance(key, bytes) or len(key) != 32:
        raise _invalid("ticket key must be 32 bytes")
    return body, sig, key


def _parse_body(body: bytes, key: bytes) -> Ticket:
    fields = _unpack(body, "ticket body")
    if not isinstance(fields, dict) or set(fields) != _BODY_KEYS:
        raise _invalid(f"ticket body must be a map with exactly the keys {sorted(_BODY_KEYS)}")
    version = fields["v"]
    if not _is_int(version) or version != TICKET_VERSION:
        raise _invalid(f"ticket version {version!r} is not supported (expected {TICKET_VERSION})")
    for name in _BODY_STR_FIELDS:
        if not isinstance(fields[name], str):
            raise _invalid(f"ticket {name} must be a string")
    for name in _BODY_INT_FIELDS:
        if not _is_int(fields[name]):
            raise _invalid(f"ticket {name} must be an integer")
    expires_at = fields["expires_at"]
    if not (isinstance(expires_at, float | int) and not isinstance(expires_at, bool)) or not math.isfinite(expires_at):
        raise _invalid("ticket expires_at must be a finite number")
    return Ticket(
        job=fields["job"],
        node=fields["node"],
        model=fields["model"],
        layer_start=fields["layer_start"],
        layer_end=fields["layer_end"],
        expires_at=float(expires_at),
        issuer_key=key,
    )


def verify_ticket(
    blob: bytes,
    trusted_keys: Collection[bytes],
    *,
    node: str,
    model: str,
    layer_start: int,
    layer_end: int,
    now: float | None = None,
) -> Ticket:
    """Return the ticket in ``blob`` if it is well formed, signed by a trusted key, unexpired,
    and for this agent's node, model and span; otherwise raise ``TicketError``.

    Any input whatsoever yields either a ``Ticket`` or a ``TicketError``, never another error.
    """
    ticket = open_ticket(blob, trusted_keys, now=now)
    check_ticket_target(ticket, node=node, model=model, layer_start=layer_start, layer_end=layer_end)
    return ticket


def open_ticket(blob: bytes, trusted_keys: Collection[bytes], *, now: float | None = None) -> Ticket:
    """The ticket in ``blob`` if it is well formed, signed by a trusted key and unexpired, whatever
    it is for (an agent serving several blocks reads which one it names, then ``check_ticket_target``);
    raises ``TicketError`` otherwise, never another error."""
    body, sig, key = _parse_envelope(blob)
    # Checked before the signature so an untrusted sender cannot make us spend a verify on it.
    if key not in {bytes(k) for k in trusted_keys}:
        raise TicketError(f"ticket is signed by an untrusted key {key.hex()}", code="ticket_untrusted")
    try:
        VerifyKey(key).verify(SIGNING_CONTEXT + body, sig)
    except (CryptoError, ValueError, TypeError):
        raise _invalid("ticket signature does not verify") from None
    ticket = _parse_body(body, key)
    current = time.time() if now is None else now
    if ticket.expires_at <= current:
        raise TicketError(f"ticket expired at {ticket.expires_at:.3f}, now is {current:.3f}", code="ticket_expired")
    return ticket


def check_ticket_target(ticket: Ticket, *, node: str, model: str, layer_start: int, layer_end: int) -> None:
    """Raise ``TicketError`` unless ``ticket`` is for this node, model and span."""
    for name, theirs, ours in (("node", ticket.node, node), ("model", ticket.model, model)):
        if theirs != ours:
            raise TicketError(f"ticket is for {name} {theirs!r}, this agent is {ours!r}", code="ticket_mismatch")
    if (ticket.layer_start, ticket.layer_end) != (layer_start, layer_end):
        raise TicketError(
            f"ticket is for layers [{ticket.layer_start}, {ticket.layer_end}), "
            f"this agent serves [{layer_start}, {layer_end})",
            code="ticket_mismatch",
        )
