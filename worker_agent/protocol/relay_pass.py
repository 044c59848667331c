"""Relay passes and the REGISTER signature (sans-I/O).

A **relay pass**, signed by the control plane's ticket key, lets one node register at a relay: it
names the node, its public key, the relay it is good at (or ``*``: any relay trusting the issuer)
and an expiry. Wire form, as tickets: msgpack ``{"body": bytes, "sig": 64 bytes, "key": 32
bytes}``, ``body`` the msgpack of ``{"v": 1, "node", "node_key" (32 bytes), "relay", "expires_at"}``
with sorted keys, ``sig`` ed25519 over ``RELAY_PASS_CONTEXT + body``: the signing context keeps a
ticket signed by the same key from passing as a pass. REGISTER (``relay_protocol.Register``) also
carries the node key's signature over the link's nonce and the relay's id (``register_signature``).
Refusals raise ``RelayError`` (pass_invalid, pass_untrusted, pass_expired, pass_wrong_relay,
bad_signature), never another error.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import msgpack
from nacl.exceptions import CryptoError
from nacl.signing import SigningKey, VerifyKey

from worker_agent.errors import RelayError
from worker_agent.protocol.relay_protocol import MAX_NAME_CHARS, MAX_PASS_BYTES, valid_node

PASS_VERSION = 1
RELAY_PASS_CONTEXT = b"swarm-relay-pass-v1\0"
# The agent's REGISTER signature: context || nonce || relay id, so it is worth nothing on another
# link or at another relay, and cannot pass for any other object its node key signs.
REGISTER_CONTEXT = b"swarm-relay-register-v1\0"


def _refuse(message: str, code: str) -> RelayError:
    return RelayError(message, code=code)


@dataclass(frozen=True)
class RelayPass:
    node: str  # the node id the pass is for (one DNS label: its certificate names <node>.swarm)
    node_key: bytes  # that node's 32-byte ed25519 public key; REGISTER must be signed by it
    relay: str  # the relay id it is good at, or "*" for any relay that trusts the issuer
    expires_at: float  # unix seconds; the relay refuses it after, and ends a link registered with it
    issuer_key: bytes  # the 32-byte key that signed it (one the relay trusts)


_PASS_KEYS = frozenset({"v", "node", "node_key", "relay", "expires_at"})


def _pass_key(node_public_key: bytes | str) -> bytes:
    if isinstance(node_public_key, str):
        try:
            node_public_key = bytes.fromhex(node_public_key)
        except ValueError:
            raise _refuse("node_public_key must be 64 hex characters or 32 bytes", "pass_invalid") from None
    if not isinstance(node_public_key, bytes) or len(node_public_key) != 32:
        raise _refuse("node_public_key must be a 32-byte ed25519 public key", "pass_invalid")
    return node_public_key


def sign_relay_pass(
    signing_key: SigningKey, node: str, node_public_key: bytes | str, relay: str, expires_at: float
) -> bytes:
    """A pass for ``node`` (public key: 32 bytes or 64 hex characters) to register at relay ``relay``
    (or ``"*"``: any relay trusting ``signing_key``) until ``expires_at`` (unix seconds)."""
    if not valid_node(node):
        raise _refuse(f"node must be one lower-case DNS label, got {node!r}", "pass_invalid")
    if not isinstance(relay, str) or not 0 < len(relay) <= MAX_NAME_CHARS:
        raise _refuse("relay must be a relay id or '*'", "pass_invalid")
    if isinstance(expires_at, bool) or not isinstance(expires_at, int | float) or not math.isfinite(expires_at):
        raise _refuse("expires_at must be a finite number of unix seconds", "pass_invalid")
    fields_ = {"v": PASS_VERSION, "node": node, "node_key": _pass_key(node_public_key), "relay": relay}
    body = msgpack.packb(dict(sorted({**fields_, "expires_at": float(expires_at)}.items())), use_bin_type=True)
    sig = signing_key.sign(RELAY_PASS_CONTEXT + body).signature
    return msgpack.packb({"body": body, "sig": sig, "key": bytes(signing_key.verify_key)}, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # as decode_message: any msgpack failure means one thing
        raise _refuse("the relay pass is not valid msgpack", "pass_invalid") from None


def verify_relay_pass(
    data: bytes, trusted_keys: Collection[bytes], relay_id: str, now: float | None = None
) -> RelayPass:
    """The pass in ``data`` if it is well formed, signed by one of ``trusted_keys``, unexpired at
    ``now`` (unix seconds) and for relay ``relay_id`` (or ``"*"``). Raises RelayError otherwise
    (pass_invalid, pass_untrusted, pass_expired, pass_wrong_relay), never another error."""
    if not isinstance(data, bytes) or len(data) > MAX_PASS_BYTES:
        raise _refuse(f"the relay pass must be at most {MAX_PASS_BYTES} bytes", "pass_invalid")
    outer = _unpack(data)
    if not isinstance(outer, dict) or set(outer) != {"body", "sig", "key"}:
        raise _refuse("the relay pass must be a map with exactly the keys body, sig, key", "pass_invalid")
    body, sig, key = outer["body"], outer["sig"], outer["key"]
    if not (isinstance(body, bytes) and isinstance(sig, bytes) and len(sig) == 64 and isinstance(key, bytes)):
        raise _refuse("the relay pass's body, sig or key is malformed", "pass_invalid")
    # Checked before the signature so that an untrusted sender cannot make the relay spend a verify.
    if key not in {bytes(k) for k in trusted_keys}:
        raise _refuse(f"the relay pass is signed by an untrusted key {key.hex()[:64]}", "pass_untrusted")
    try:
        VerifyKey(key).verify(RELAY_PASS_CONTEXT + body, sig)
    except (CryptoError, ValueError, TypeError):
        raise _refuse("the relay pass's signature does not verify", "pass_invalid") from None
    fields_ = _unpack(body)
    if not isinstance(fields_, dict) or set(fields_) != _PASS_KEYS or fields_["v"] != PASS_VERSION:
        raise _refuse(
            f"the relay pass body must be version {PASS_VERSION} with the keys {sorted(_PASS_KEYS)}", "pass_invalid"
        )
    node, node_key, relay, expires_at = (fields_[k] for k in ("node", "node_key", "relay", "expires_at"))
    if not (valid_node(node) and isinstance(node_key, bytes) and len(node_key) == 32 and isinstance(relay, str)):
        raise _refuse("the relay pass's node, node_key or relay is malformed", "pass_invalid")
    if isinstance(expires_at, bool) or not isinstance(expires_at, int | float) or not math.isfinite(expires_at):
        raise _refuse("the relay pass's expires_at is malformed", "pass_invalid")
    current = time.time() if now is None else now
    if expires_at <= current:
        raise _refuse(f"the relay pass expired at {expires_at:.3f}, now is {current:.3f}", "pass_expired")
    if relay not in ("*", relay_id):
        raise _refuse(f"the relay pass is for relay {relay[:80]!r}, this is {relay_id!r}", "pass_wrong_relay")
    return RelayPass(node, node_key, relay, float(expires_at), key)


def register_signature(signing_key: SigningKey, nonce: bytes, relay_id: str) -> bytes:
    """REGISTER's signature: the node key over one link's nonce and the relay's id."""
    return signing_key.sign(REGISTER_CONTEXT + nonce + relay_id.encode()).signature


def check_register_signature(node_key: bytes, nonce: bytes, relay_id: str, signature: bytes) -> None:
    """Raise RelayError(bad_signature) unless ``signature`` is ``node_key``'s REGISTER signature."""
    try:
        VerifyKey(node_key).verify(REGISTER_CONTEXT + nonce + relay_id.encode(), signature)
    except (CryptoError, ValueError, TypeError):
        raise _refuse("REGISTER is not signed by the node key its pass names", "bad_signature") from None
