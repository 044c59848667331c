"""Job tickets, coordinator proofs and peer passes: who may use one node's span for one job.

Three signed objects, each with its own signing context so none can pass as another:

- a **ticket** (signed by the control plane, or a local issuer in development) names the job, the
  node, the model, the layer span, the job's coordinator public key (a fresh ed25519 key per job)
  and an expiry that follows the job's timeout. It is not a bearer token: whoever presents it as
  a coordinator must also prove the key it names;
- a **coordinator proof** (signed by the job's coordinator key) is that proof: a signature over
  the ticket's digest, a timestamp and a random nonce. The digest binds it to the one stage the
  ticket names, the timestamp (within ``PROOF_WINDOW_S``) and the nonce (remembered by the stage,
  ``ProofNonces``) keep it from being replayed;
- a **peer pass** (signed by the job's coordinator key) lets the previous stage of a ring
  connect to its successor as ``peer``: it names the job and the successor (node, model, span)
  and expires with the successor's ticket. A stage accepts it only while that job's coordinator,
  holding the same key, is connected, and a peer may only FORWARD into sessions the coordinator
  opened; so a pass a predecessor kept is worth nothing once the job ends.

Wire form of each: msgpack ``{"body": bytes, "sig": 64 bytes, "key": 32 bytes}`` where ``body``
is the msgpack of the fields with sorted keys and ``sig`` is ed25519 over ``context + body`` by
``key``. A proof is msgpack ``{"at": float, "nonce": 16 bytes, "sig": 64 bytes}``.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from nacl.exceptions import CryptoError
from nacl.signing import SigningKey, VerifyKey

from worker_agent.errors import TicketError
from worker_agent.protocol.span import Span

TICKET_VERSION = 2
# 2: names the sender's node key, whose signatures the successor checks (links.py); 3: and its
# issue order, so a successor tells a healed route's pass from the one it replaced.
PEER_PASS_VERSION = 3
# Prefixed to the body before signing so a ticket signature can never pass as any other
# signed object (a receipt, a challenge, a peer pass) made with the same key.
SIGNING_CONTEXT = b"swarm-ticket-v2\0"
PEER_PASS_CONTEXT = b"swarm-peer-pass-v1\0"
PROOF_CONTEXT = b"swarm-coordinator-proof-v1\0"
# A real ticket is ~250 bytes; the cap bounds the work an unauthenticated HELLO can cause.
MAX_TICKET_BYTES = 4096
MAX_PROOF_BYTES = 256
# How far a proof's timestamp may be from the stage's clock (seconds, either way): room for clock
# skew between a coordinator and the agents, short enough that the nonces to remember stay few.
PROOF_WINDOW_S = 120.0
NONCE_BYTES = 16

_STR_FIELDS = ("job", "node", "model")
_INT_FIELDS = ("layer_start", "layer_end")
_TICKET_KEYS = frozenset({"v", "expires_at", "coordinator_key", *_STR_FIELDS, *_INT_FIELDS})
_PASS_KEYS = frozenset({"v", "expires_at", "sender_key", "order", *_STR_FIELDS, *_INT_FIELDS})


@dataclass(frozen=True)
class Ticket:
    job: str  # the job id the session belongs to
    node: str  # the node id allowed to serve it (``keys.node_id`` of the node's public key)
    model: str  # the model id the node must have loaded
    layer_start: int  # first layer of the span the node serves (inclusive, 0-based)
    layer_end: int  # end of that span (exclusive)
    expires_at: float  # unix seconds after which the ticket is refused (the job's deadline)
    coordinator_key: bytes  # the job's coordinator's 32-byte ed25519 public key
    issuer_key: bytes  # the signer's 32-byte ed25519 public key

    @property
    def span(self) -> Span:
        """The stage the ticket is for."""
        return Span(self.model, self.layer_start, self.layer_end)


@dataclass(frozen=True)
class PeerPass:
    job: str  # the job whose sessions the peer may forward into
    node: str  # the successor stage's node id the pass is for
    model: str  # the successor's model id
    layer_start: int  # the successor's span (inclusive, 0-based)
    layer_end: int  # end of that span (exclusive)
    expires_at: float  # unix seconds; the successor's ticket's expiry
    coordinator_key: bytes  # the job's coordinator's public key, which signed the pass
    # The node key of the stage the pass was handed to (the successor's predecessor): every item it
    # forwards must carry its signature by this key (links.py). Empty: the coordinator did not know
    # it (no control plane assignments); the successor then records no link evidence.
    sender_key: bytes = b""
    # When the coordinator issued it (its own clock in nanoseconds, strictly increasing): a ring
    # successor admits a peer whose pass is older than the newest it has admitted for the job
    # never again, so a predecessor the route was healed away from cannot push its replacement out.
    order: int = 0

    @property
    def span(self) -> Span:
        """The successor's stage the pass is for."""
        return Span(self.model, self.layer_start, self.layer_end)


def _invalid(message: str) -> TicketError:
    return TicketError(message, code="ticket_invalid")


def _is_int(value: object) -> bool:
    # bool is an int subclass; a ticket saying layer_start=True is malformed, not layer 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: object) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool) and math.isfinite(value)


def _pack(fields: dict[str, Any]) -> bytes:
    return msgpack.packb(dict(sorted(fields.items())), use_bin_type=True)


def _sign(signing_key: SigningKey, context: bytes, fields: dict[str, Any]) -> bytes:
    body = _pack(fields)
    sig = signing_key.sign(context + body).signature
    return msgpack.packb({"body": body, "sig": sig, "key": bytes(signing_key.verify_key)}, use_bin_type=True)


def issue_ticket(
    signing_key: SigningKey,
    *,
    job: str,
    node: str,
    model: str,
    layer_start: int,
    layer_end: int,
    coordinator_key: bytes,
    ttl_s: float = 600,
    expires_at: float | None = None,
    now: float | None = None,
) -> bytes:
    """Sign a ticket for ``node`` to serve ``[layer_start, layer_end)`` of ``model`` for ``job``,
    to the coordinator holding ``coordinator_key``'s private half; it expires at ``expires_at``
    (unix seconds), or ``ttl_s`` seconds from ``now``."""
    for name, value in (("job", job), ("node", node), ("model", model)):
        if not isinstance(value, str) or not value:
            raise _invalid(f"ticket {name} must be a non-empty string, got {value!r}")
    if not (_is_int(layer_start) and _is_int(layer_end) and 0 <= layer_start < layer_end):
        raise _invalid(f"ticket span must satisfy 0 <= layer_start < layer_end, got [{layer_start}, {layer_end})")
    if not isinstance(coordinator_key, bytes) or len(coordinator_key) != 32:
        raise _invalid("ticket coordinator_key must be a 32-byte ed25519 public key")
    if expires_at is None:
        if not (_is_time(ttl_s) and ttl_s > 0):
            raise _invalid(f"ticket ttl_s must be a positive number of seconds, got {ttl_s!r}")
        expires_at = (time.time() if now is None else now) + ttl_s
    elif not _is_time(expires_at):
        raise _invalid(f"ticket expires_at must be a finite number, got {expires_at!r}")
    fields: dict[str, Any] = {
        "v": TICKET_VERSION,
        "job": job,
        "node": node,
        "model": model,
        "layer_start": layer_start,
        "layer_end": layer_end,
        "coordinator_key": coordinator_key,
        "expires_at": float(expires_at),
    }
    return _sign(signing_key, SIGNING_CONTEXT, fields)


def ticket_for_stage(
    signing_key: SigningKey,
    job: str,
    stage: Mapping[str, Any],
    *,
    coordinator_key: bytes,
    ttl_s: float = 600,
    expires_at: float | None = None,
) -> bytes:
    """A ticket for a stage named by its identity (``node``, ``model``, ``layer_start``,
    ``layer_end``: a PING's info, or any map of those keys)."""
    return issue_ticket(
        signing_key,
        job=job,
        node=stage["node"],
        model=stage["model"],
        layer_start=stage["layer_start"],
        layer_end=stage["layer_end"],
        coordinator_key=coordinator_key,
        ttl_s=ttl_s,
        expires_at=expires_at,
    )


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    # msgpack raises a spread of ValueError/TypeError/UnpackException subclasses (and
    # UnicodeDecodeError) on hostile input; any of them means the same thing here.
    except Exception as exc:
        raise _invalid(f"{what} is not valid msgpack: {type(exc).__name__}") from None


def _parse_envelope(blob: object, what: str = "ticket") -> tuple[bytes, bytes, bytes]:
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise _invalid(f"{what} must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) > MAX_TICKET_BYTES:
        raise _invalid(f"{what} is {len(blob)} bytes, more than the {MAX_TICKET_BYTES} allowed")
    outer = _unpack(blob, what)
    if not isinstance(outer, dict) or set(outer) != {"body", "sig", "key"}:
        raise _invalid(f"{what} must be a map with exactly the keys body, sig, key")
    body, sig, key = outer["body"], outer["sig"], outer["key"]
    if not isinstance(body, bytes):
        raise _invalid(f"{what} body must be bytes")
    if not isinstance(sig, bytes) or len(sig) != 64:
        raise _invalid(f"{what} sig must be 64 bytes")
    if not isinstance(key, bytes) or len(key) != 32:
        raise _invalid(f"{what} key must be 32 bytes")
    return body, sig, key


def _verify_sig(key: bytes, context: bytes, body: bytes, sig: bytes, what: str) -> None:
    try:
        VerifyKey(key).verify(context + body, sig)
    except (CryptoError, ValueError, TypeError):
        raise _invalid(f"{what} signature does not verify") from None


def _parse_fields(body: bytes, keys: frozenset[str], version: int, what: str) -> dict[str, Any]:
    fields = _unpack(body, f"{what} body")
    if not isinstance(fields, dict) or set(fields) != keys:
        raise _invalid(f"{what} body must be a map with exactly the keys {sorted(keys)}")
    if not _is_int(fields["v"]) or fields["v"] != version:
        raise _invalid(f"{what} version {fields['v']!r} is not supported (expected {version})")
    for name in _STR_FIELDS:
        if not isinstance(fields[name], str):
            raise _invalid(f"{what} {name} must be a string")
    for name in _INT_FIELDS:
        if not _is_int(fields[name]):
            raise _invalid(f"{what} {name} must be an integer")
    if not fields["model"] or not 0 <= fields["layer_start"] < fields["layer_end"]:
        # What the issuer checks (``issue_ticket``): a signed stage that names no stage is malformed.
        raise _invalid(f"{what} must name a model and a span 0 <= layer_start < layer_end")
    if not _is_time(fields["expires_at"]):
        raise _invalid(f"{what} expires_at must be a finite number")
    return fields


def _check_unexpired(expires_at: float, now: float | None, what: str) -> None:
    current = time.time() if now is None else now
    if expires_at <= current:
        raise TicketError(f"{what} expired at {expires_at:.3f}, now is {current:.3f}", code="ticket_expired")


def read_ticket(blob: bytes) -> Ticket:
    """The ticket in ``blob`` if it is well formed and its signature verifies by the key it carries,
    whoever that is and whenever it expires: for a coordinator reading the tickets its own issuer
    signed. Never use it to admit anyone (``open_ticket`` checks the issuer and the expiry)."""
    body, sig, key = _parse_envelope(blob)
    _verify_sig(key, SIGNING_CONTEXT, body, sig, "ticket")
    fields = _parse_fields(body, _TICKET_KEYS, TICKET_VERSION, "ticket")
    coordinator_key = fields["coordinator_key"]
    if not isinstance(coordinator_key, bytes) or len(coordinator_key) != 32:
        raise _invalid("ticket coordinator_key must be 32 bytes")
    return Ticket(
        job=fields["job"],
        node=fields["node"],
        model=fields["model"],
        layer_start=fields["layer_start"],
        layer_end=fields["layer_end"],
        expires_at=float(fields["expires_at"]),
        coordinator_key=coordinator_key,
        issuer_key=key,
    )


def verify_ticket(
    blob: bytes,
    trusted_keys: Collection[bytes],
    *,
    node: str,
    span: Span,
    now: float | None = None,
) -> Ticket:
    """Return the ticket in ``blob`` if it is well formed, signed by a trusted key, unexpired,
    and for this agent's node and stage (model and layer span); otherwise raise ``TicketError``.

    Any input whatsoever yields either a ``Ticket`` or a ``TicketError``, never another error.
    """
    ticket = open_ticket(blob, trusted_keys, now=now)
    check_ticket_target(ticket, node=node, span=span)
    return ticket


def open_ticket(blob: bytes, trusted_keys: Collection[bytes], *, now: float | None = None) -> Ticket:
    """The ticket in ``blob`` if it is well formed, signed by a trusted key and unexpired, whatever
    it is for (an agent serving several blocks reads which one it names, then ``check_ticket_target``);
    raises ``TicketError`` otherwise, never another error."""
    _, _, key = _parse_envelope(blob)
    # Checked before the signature so an untrusted sender cannot make us spend a verify on it.
    if key not in {bytes(k) for k in trusted_keys}:
        raise TicketError(f"ticket is signed by an untrusted key {key.hex()}", code="ticket_untrusted")
    ticket = read_ticket(blob)
    _check_unexpired(ticket.expires_at, now, "ticket")
    return ticket


def check_ticket_target(ticket: Ticket | PeerPass, *, node: str, span: Span) -> None:
    """Raise ``TicketError`` unless ``ticket`` (or a peer pass) is for this node and stage (model and span)."""
    for name, theirs, ours in (("node", ticket.node, node), ("model", ticket.model, span.model)):
        if theirs != ours:
            raise TicketError(f"ticket is for {name} {theirs!r}, this agent is {ours!r}", code="ticket_mismatch")
    if (ticket.layer_start, ticket.layer_end) != (span.start, span.end):
        raise TicketError(
            f"ticket is for layers [{ticket.layer_start}, {ticket.layer_end}), "
            f"this agent serves [{span.start}, {span.end})",
            code="ticket_mismatch",
        )


def _ticket_digest(blob: bytes) -> bytes:
    return hashlib.sha256(bytes(blob)).digest()


def prove_coordinator(
    coordinator_key: SigningKey, ticket: bytes, *, now: float | None = None, nonce: bytes | None = None
) -> bytes:
    """The proof, sent in HELLO next to ``ticket``, that the sender holds the coordinator key the
    ticket names."""
    at = float(time.time() if now is None else now)
    nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
    sig = coordinator_key.sign(PROOF_CONTEXT + _ticket_digest(ticket) + _pack({"at": at, "nonce": nonce})).signature
    return msgpack.packb({"at": at, "nonce": nonce, "sig": sig}, use_bin_type=True)


class ProofNonces:
    """The nonces of the coordinator proofs a stage accepted within the proof window: a proof is
    accepted once. Only proofs whose signature verified are remembered, so a stranger cannot fill it."""

    def __init__(self, window_s: float = PROOF_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: dict[bytes, float] = {}  # nonce -> the proof's timestamp

    def remember(self, nonce: bytes, at: float, *, now: float) -> None:
        """Record ``nonce``; raise ``TicketError`` if it was accepted before."""
        for old, stamp in list(self._seen.items()):
            if stamp < now - 2 * self.window_s:  # outside the window either way: refused on its timestamp
                del self._seen[old]
        if nonce in self._seen:
            raise TicketError("this coordinator proof was used before", code="proof_replayed")
        self._seen[nonce] = at


def check_coordinator_proof(
    proof: object, ticket_blob: bytes, ticket: Ticket, *, now: float, nonces: ProofNonces
) -> None:
    """Raise ``TicketError`` unless ``proof`` is a fresh, unused signature by the coordinator key
    ``ticket`` names over that very ticket (``ticket_blob``)."""
    if proof is None:
        raise TicketError("HELLO as coordinator carries no proof of the job's coordinator key", code="proof_missing")
    if not isinstance(proof, bytes) or len(proof) > MAX_PROOF_BYTES:
        raise TicketError("coordinator proof must be a small byte string", code="proof_invalid")
    fields = _unpack(proof, "coordinator proof")
    if not isinstance(fields, dict) or set(fields) != {"at", "nonce", "sig"}:
        raise TicketError("coordinator proof must be a map with the keys at, nonce, sig", code="proof_invalid")
    at, nonce, sig = fields["at"], fields["nonce"], fields["sig"]
    if not _is_time(at) or not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise TicketError("coordinator proof at or nonce is malformed", code="proof_invalid")
    if not isinstance(sig, bytes) or len(sig) != 64:
        raise TicketError("coordinator proof sig must be 64 bytes", code="proof_invalid")
    if abs(now - at) > nonces.window_s:
        raise TicketError(
            f"coordinator proof is dated {at:.3f}, more than {nonces.window_s:g}s from now ({now:.3f})",
            code="proof_stale",
        )
    signed = PROOF_CONTEXT + _ticket_digest(ticket_blob) + _pack({"at": float(at), "nonce": nonce})
    try:
        VerifyKey(ticket.coordinator_key).verify(signed, sig)
    except (CryptoError, ValueError, TypeError):
        raise TicketError(
            "coordinator proof is not signed by the coordinator key the ticket names", code="proof_invalid"
        ) from None
    nonces.remember(nonce, float(at), now=now)


_last_order = 0


def _next_order() -> int:
    """A pass's issue order: this process's clock in nanoseconds, strictly increasing."""
    global _last_order
    _last_order = max(time.time_ns(), _last_order + 1)
    return _last_order


def issue_peer_pass(coordinator_key: SigningKey, successor_ticket: bytes, sender_key: bytes = b"") -> bytes:
    """A pass for the previous ring stage to forward into the sessions this coordinator opens on
    the stage ``successor_ticket`` is for; it names that stage and the sender's node key (whose
    signature every forwarded item must carry, and which must sign the pass to open a connection
    with it: ``links.peer_proof``), is ordered after every pass issued before it, and expires with
    the successor's ticket."""
    if not isinstance(sender_key, bytes) or len(sender_key) not in (0, 32):
        raise _invalid("a peer pass's sender key is 32 bytes, or empty when it is not known")
    ticket = read_ticket(successor_ticket)
    if ticket.coordinator_key != bytes(coordinator_key.verify_key):
        raise _invalid("the successor's ticket names another coordinator key than this coordinator's")
    fields: dict[str, Any] = {
        "v": PEER_PASS_VERSION,
        "job": ticket.job,
        "node": ticket.node,
        "model": ticket.model,
        "layer_start": ticket.layer_start,
        "layer_end": ticket.layer_end,
        "expires_at": ticket.expires_at,
        "sender_key": sender_key,
        "order": _next_order(),
    }
    return _sign(coordinator_key, PEER_PASS_CONTEXT, fields)


def open_peer_pass(blob: bytes, *, now: float | None = None) -> PeerPass:
    """The peer pass in ``blob`` if it is well formed, its signature verifies by the key it carries,
    and it is unexpired; the caller checks that key is the live job's coordinator key. Raises
    ``TicketError`` otherwise, never another error."""
    body, sig, key = _parse_envelope(blob, "peer pass")
    _verify_sig(key, PEER_PASS_CONTEXT, body, sig, "peer pass")
    fields = _parse_fields(body, _PASS_KEYS, PEER_PASS_VERSION, "peer pass")
    sender_key = fields["sender_key"]
    if not isinstance(sender_key, bytes) or len(sender_key) not in (0, 32):
        raise _invalid("peer pass sender_key must be 32 bytes or empty")
    if not _is_int(fields["order"]) or fields["order"] < 0:
        raise _invalid("peer pass order must be a non-negative integer")
    peer_pass = PeerPass(
        job=fields["job"],
        node=fields["node"],
        model=fields["model"],
        layer_start=fields["layer_start"],
        layer_end=fields["layer_end"],
        expires_at=float(fields["expires_at"]),
        coordinator_key=key,
        sender_key=sender_key,
        order=fields["order"],
    )
    _check_unexpired(peer_pass.expires_at, now, "peer pass")
    return peer_pass
