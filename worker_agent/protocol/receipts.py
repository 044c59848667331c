# Over 500 lines: the receipt, its builder, its two encodings and the transcript share one set of checks.
"""Per-stage signed receipts: the receipt, its builder and its one codec (``coverage.py`` verifies a
job's receipts against its plan and transcripts).

Each stage of a pipeline signs one receipt per job session: who it is (node id and ed25519
key), what it ran (model, layer span), how much (steps, token rows) and, per step, the sha256
of the exact wire bytes it received and sent, folded into a hash chain.

What receipts prove: *attribution and coverage*. Every layer of the model was run by the node
assigned to it, for every step; the stages are linked (stage k sent exactly what stage k+1
received) and the chain starts and ends at the bytes the coordinator itself sent and received.
A node cannot claim work it did not receive, skip a span, or charge for more steps or tokens.

What they do not prove: that the computation was *correct*. A node can sign hashes of garbage
it computed. Correctness is spot-checked elsewhere (seeded challenges, live audits replaying
inputs and outputs whose hashes the node signed here).

A session that began on positions the stage kept from an earlier session (prefix reuse,
``prefix.py``) says so: ``reused`` positions, taken from ``reused_from`` (that session's job, id and
receipt chain head, as the stage signed them when it closed). Its steps start past them, so its
``tokens`` count only what it computed; both fields are absent from a receipt that reused nothing,
which reads as before.

The chain for a session: ``h0 = sha256(CHAIN_SEED + job + b"\\0" + session)`` and
``h_i = sha256(h_{i-1} + in_i + out_i)``; the receipt carries both the list and the head, so a
verifier can check either against the other.

A receipt has two encodings, both written and read here, with one set of checks: ``to_dict`` /
``from_dict`` keep bytes as bytes (the msgpack wire form a stage sends), ``to_json`` /
``from_json`` write them as hex (the form a job stores and the CLI prints). Either refuses a
malformed or oversized receipt with a ``MalformedReceipt`` naming the field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypedDict

import msgpack
from nacl.exceptions import CryptoError
from nacl.signing import SigningKey, VerifyKey

from worker_agent.errors import ReceiptError

RECEIPT_VERSION = 2  # 2: per step, the predecessor's signature over the input (``links``)
CHAIN_SEED = b"swarm-receipt-v1"
# Prefixed to the body before signing so a receipt signature cannot pass as a ticket's.
SIGNING_CONTEXT = b"swarm-receipt-v1\0"
HASH_BYTES = 32

_STR_FIELDS = ("job", "session", "node", "model")
_INT_FIELDS = ("layer_start", "layer_end", "steps", "tokens")
# The fields that go into the body as they are; ``hashes`` becomes a list of lists.
_PLAIN_FIELDS = (*_STR_FIELDS, *_INT_FIELDS, "node_key", "chain_head")
_DICT_KEYS = frozenset({"v", "hashes", "links", "sig", *_PLAIN_FIELDS})
_REUSE_KEYS = frozenset({"reused", "reused_from"})  # both present (reused > 0) or both absent
_SOURCE_KEYS = frozenset({"job", "session", "chain_head"})
_TRANSCRIPT_KEYS = frozenset({"session", "sent", "received"})

# Bounds checked before anything is decoded, so a stored or received receipt cannot make its
# reader allocate without limit. A session's steps are bounded by the model's context (2048
# positions for the registry's models), far below MAX_STEPS.
MAX_STEPS = 1 << 16  # hash pairs in one receipt, and hashes in one transcript list
MAX_ID_CHARS = 1024  # characters in a receipt's job, session, node or model id
# The JSON text of a receipt at its bounds: a step's hash pair is 138 characters as json.dumps
# writes it (two quoted 64-digit strings, brackets, two separators) and its link 132 (a quoted
# 128-digit signature and a separator); the rest is the fixed fields.
MAX_JSON_CHARS = 272 * MAX_STEPS + 4 * MAX_ID_CHARS + 1024
LINK_BYTES = 64  # a predecessor's signature over one step's input (links.py)


class MalformedReceipt(ReceiptError):
    code = "receipt_malformed"


class ReceiptTooLarge(MalformedReceipt):
    """A receipt or transcript past ``MAX_STEPS``, ``MAX_ID_CHARS`` or ``MAX_JSON_CHARS``,
    refused before it is decoded."""

    code = "receipt_too_large"


class BadSignature(ReceiptError):
    """The signature does not verify (code ``receipt_bad_signature``), or a signed chain head
    does not match its hash list (code ``receipt_bad_chain``)."""

    code = "receipt_bad_signature"


class ForeignSigner(ReceiptError):
    code = "receipt_foreign_signer"


class SpanGap(ReceiptError):
    code = "receipt_span_gap"


class SpanOverlap(ReceiptError):
    code = "receipt_span_overlap"


class StepMismatch(ReceiptError):
    code = "receipt_step_mismatch"


class PrefixMismatch(ReceiptError):
    code = "receipt_prefix_mismatch"


class BrokenLink(ReceiptError):
    code = "receipt_broken_link"


class EndpointMismatch(ReceiptError):
    code = "receipt_endpoint_mismatch"


class MissingReceipt(ReceiptError):
    code = "receipt_missing"


class DuplicateReceipt(ReceiptError):
    code = "receipt_duplicate"


def digest(data: bytes | memoryview) -> bytes:
    """sha256 of ``data``: 32 bytes."""
    return hashlib.sha256(data).digest()


def chain_start(job: str, session: str) -> bytes:
    """h0: binds the chain to its job and session so a chain cannot be replayed under another."""
    return digest(CHAIN_SEED + job.encode() + b"\0" + session.encode())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == HASH_BYTES


def _unhex(value: object, what: str, size: int) -> bytes:
    """Exactly ``size`` bytes written as ``2 * size`` hex digits, or MalformedReceipt naming ``what``."""
    if isinstance(value, str) and len(value) == 2 * size:
        try:
            decoded = bytes.fromhex(value)
        except ValueError:
            pass
        else:
            if len(decoded) == size:  # fromhex skips spaces: "00 11..." decodes short
                return decoded
    raise MalformedReceipt(f"{what} must be {2 * size} hex digits ({size} bytes)")


def _json_object(data: object, what: str) -> object:
    """``data`` itself, or the JSON value its text holds, refusing oversized text unread."""
    if not isinstance(data, str | bytes | bytearray):
        return data
    if len(data) > MAX_JSON_CHARS:
        raise ReceiptTooLarge(f"{what} of {len(data)} characters exceeds {MAX_JSON_CHARS}")
    try:
        return json.loads(data)
    # Deep nesting within the bound overflows the parser's stack rather than allocating.
    except (ValueError, RecursionError) as exc:
        raise MalformedReceipt(f"{what} is not valid JSON: {exc}") from None


def _check_bounds(what: str, ids: Mapping[str, object], lists: Mapping[str, object]) -> None:
    """Refuse ids over MAX_ID_CHARS and lists over MAX_STEPS before anything in them is decoded."""
    for name, value in ids.items():
        if isinstance(value, str) and len(value) > MAX_ID_CHARS:
            raise ReceiptTooLarge(f"{what} {name} of {len(value)} characters exceeds {MAX_ID_CHARS}")
    for name, value in lists.items():
        if isinstance(value, list | tuple) and len(value) > MAX_STEPS:
            raise ReceiptTooLarge(f"{what} {name} lists {len(value)} entries, more than {MAX_STEPS}")


@dataclass(frozen=True)
class ReusedFrom:
    """Where a session's reused positions were computed: an earlier session on the same stage."""

    job: str  # that session's job id
    session: str  # its session id
    chain_head: bytes  # the chain head of the receipt the stage signed for it at its close

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "session": self.session, "chain_head": self.chain_head}

    @classmethod
    def parse(cls, d: object, *, hexed: bool) -> ReusedFrom:
        if not isinstance(d, dict) or set(d) != _SOURCE_KEYS:
            raise MalformedReceipt(f"receipt reused_from must be a map with exactly the keys {sorted(_SOURCE_KEYS)}")
        _check_bounds("receipt reused_from", {"job": d["job"], "session": d["session"]}, {})
        head = _unhex(d["chain_head"], "receipt reused_from chain_head", HASH_BYTES) if hexed else d["chain_head"]
        source = cls(d["job"], d["session"], head)
        source.check()
        return source

    def check(self) -> None:
        if not (isinstance(self.job, str) and isinstance(self.session, str) and self.job and self.session):
            raise MalformedReceipt("receipt reused_from job and session must be non-empty strings")
        if not _is_hash(self.chain_head):
            raise MalformedReceipt(f"receipt reused_from chain_head must be {HASH_BYTES} bytes")


@dataclass(frozen=True)
class Receipt:
    job: str  # job id
    session: str  # the coordinator's session id within the job
    node: str  # the signing node's id
    node_key: bytes  # the signing node's 32-byte ed25519 public key
    model: str  # model id
    layer_start: int  # first layer the node ran (inclusive, 0-based)
    layer_end: int  # end of its span (exclusive)
    steps: int  # forward steps in this session
    tokens: int  # token rows processed, summed over steps
    hashes: tuple[tuple[bytes, bytes], ...]  # per step: (sha256 of input bytes, sha256 of output bytes)
    # Per step: the sender's signature over that input (links.py), 64 bytes when a ring predecessor
    # sent it, empty when the coordinator did: the evidence that decides a broken link.
    links: tuple[bytes, ...]
    chain_head: bytes  # last h_i of the chain over ``hashes`` (h0 when steps == 0)
    signature: bytes  # 64-byte ed25519 over SIGNING_CONTEXT + body_bytes()
    reused: int = 0  # positions the session began with, kept from ``reused_from`` (its steps start here)
    reused_from: ReusedFrom | None = None  # where they were computed; None when nothing was reused

    def _body(self) -> dict[str, Any]:
        body = {name: getattr(self, name) for name in _PLAIN_FIELDS}
        if self.reused_from is not None:
            body |= {"reused": self.reused, "reused_from": self.reused_from.to_dict()}
        return {
            **body,
            "v": RECEIPT_VERSION,
            "hashes": [[h_in, h_out] for h_in, h_out in self.hashes],
            "links": list(self.links),
        }

    def body_bytes(self) -> bytes:
        """Canonical msgpack of every field but the signature, keys sorted: what is signed."""
        return msgpack.packb(dict(sorted(self._body().items())), use_bin_type=True)

    def to_dict(self) -> dict[str, Any]:
        """The wire form: a msgpack-friendly dict (bytes stay bytes), signature under ``"sig"``."""
        return {**self._body(), "sig": self.signature}

    def to_json(self) -> dict[str, Any]:
        """The stored form: ``to_dict`` with every bytes value as lowercase hex, ready for JSON."""
        return {
            **self.to_dict(),
            "node_key": self.node_key.hex(),
            "hashes": [[h_in.hex(), h_out.hex()] for h_in, h_out in self.hashes],
            "links": [link.hex() for link in self.links],
            "chain_head": self.chain_head.hex(),
            "sig": self.signature.hex(),
            **(
                {"reused_from": {**self.reused_from.to_dict(), "chain_head": self.reused_from.chain_head.hex()}}
                if self.reused_from is not None
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, d: object) -> Receipt:
        """Parse the wire form (``to_dict``'s output, e.g. after msgpack); raises ``MalformedReceipt``."""
        d = _envelope(d)
        return cls._parse(
            d,
            hashes=tuple(tuple(pair) if isinstance(pair, list | tuple) else pair for pair in d["hashes"]),
            links=tuple(d["links"]),
            node_key=d["node_key"],
            chain_head=d["chain_head"],
            signature=d["sig"],
            **_reuse(d, hexed=False),
        )

    @classmethod
    def from_json(cls, data: object) -> Receipt:
        """Parse the stored form (``to_json``'s output, or its JSON text); raises ``MalformedReceipt``,
        ``ReceiptTooLarge`` for input past the bounds, before any of it is decoded."""
        d = _envelope(_json_object(data, "a receipt's JSON"))
        hashes = []
        for i, pair in enumerate(d["hashes"]):
            if not isinstance(pair, list) or len(pair) != 2:
                raise MalformedReceipt(f"receipt hashes[{i}] must be an (input hash, output hash) pair")
            hashes.append(
                (
                    _unhex(pair[0], f"receipt hashes[{i}][0]", HASH_BYTES),
                    _unhex(pair[1], f"receipt hashes[{i}][1]", HASH_BYTES),
                )
            )
        links = []
        for i, link in enumerate(d["links"]):
            if not isinstance(link, str):
                raise MalformedReceipt(f"receipt links[{i}] must be hex digits")
            links.append(_unhex(link, f"receipt links[{i}]", LINK_BYTES) if link else b"")
        return cls._parse(
            d,
            hashes=tuple(hashes),
            links=tuple(links),
            node_key=_unhex(d["node_key"], "receipt node_key", 32),
            chain_head=_unhex(d["chain_head"], "receipt chain_head", HASH_BYTES),
            signature=_unhex(d["sig"], "receipt sig", 64),
            **_reuse(d, hexed=True),
        )

    @classmethod
    def _parse(cls, d: dict, **decoded: Any) -> Receipt:
        """The receipt of an envelope-checked map whose bytes fields ``decoded`` holds; checks its shape."""
        receipt = cls(**{name: d[name] for name in (*_STR_FIELDS, *_INT_FIELDS)}, **decoded)
        receipt._check_shape()
        return receipt

    def _check_shape(self) -> None:
        for name in _STR_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise MalformedReceipt(f"receipt {name} must be a string")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise MalformedReceipt(f"receipt {name} must be a non-negative integer, got {value!r}")
        if self.layer_start >= self.layer_end:
            raise MalformedReceipt(f"receipt span [{self.layer_start}, {self.layer_end}) is empty")
        if not isinstance(self.node_key, bytes) or len(self.node_key) != 32:
            raise MalformedReceipt("receipt node_key must be 32 bytes")
        if not _is_hash(self.chain_head):
            raise MalformedReceipt(f"receipt chain_head must be {HASH_BYTES} bytes")
        if not isinstance(self.signature, bytes) or len(self.signature) != 64:
            raise MalformedReceipt("receipt signature must be 64 bytes")
        if not isinstance(self.hashes, tuple) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and _is_hash(pair[0]) and _is_hash(pair[1])
            for pair in self.hashes
        ):
            raise MalformedReceipt(f"receipt hashes must be pairs of {HASH_BYTES}-byte digests")
        if self.steps != len(self.hashes):
            raise MalformedReceipt(f"receipt claims {self.steps} steps but lists {len(self.hashes)} hash pairs")
        if not isinstance(self.links, tuple) or len(self.links) != len(self.hashes):
            raise MalformedReceipt("receipt links must list one entry per step")
        if not all(isinstance(link, bytes) and len(link) in (0, LINK_BYTES) for link in self.links):
            raise MalformedReceipt(f"each receipt link must be a {LINK_BYTES}-byte signature or empty")
        if not _is_int(self.reused) or self.reused < 0 or (self.reused > 0) != (self.reused_from is not None):
            raise MalformedReceipt(f"receipt reused must be 0, or > 0 with where it came from; got {self.reused!r}")
        if self.reused_from is not None:
            self.reused_from.check()

    def verify_signature(self) -> None:
        """Raise unless the receipt is well formed, signed by ``node_key``, and its chain head
        matches its hash list."""
        self._check_shape()
        try:
            VerifyKey(self.node_key).verify(SIGNING_CONTEXT + self.body_bytes(), self.signature)
        # An int past 64 bits or an unencodable string cannot have been signed either.
        except (CryptoError, ValueError, TypeError, OverflowError):
            raise BadSignature(
                f"receipt of node {self.node} for session {self.session!r}: signature does not verify"
            ) from None
        head = chain_start(self.job, self.session)
        for h_in, h_out in self.hashes:
            head = digest(head + h_in + h_out)
        if head != self.chain_head:
            raise BadSignature(
                f"receipt of node {self.node} for session {self.session!r}: chain head does not match its hash list",
                code="receipt_bad_chain",
            )


def _reuse(d: dict, *, hexed: bool) -> dict[str, Any]:
    """The reuse fields of an envelope-checked map, decoded (none when it reused nothing)."""
    if "reused" not in d:
        return {}
    return {"reused": d["reused"], "reused_from": ReusedFrom.parse(d["reused_from"], hexed=hexed)}


def _envelope(d: object) -> dict:
    """``d``, once the checks both encodings share before decoding pass: the keys, the version, the bounds."""
    if not isinstance(d, dict) or set(d) not in (_DICT_KEYS, _DICT_KEYS | _REUSE_KEYS):
        raise MalformedReceipt(
            f"a receipt must be a map with exactly the keys {sorted(_DICT_KEYS)}, and {sorted(_REUSE_KEYS)} "
            "when it reused positions"
        )
    if not _is_int(d["v"]) or d["v"] != RECEIPT_VERSION:
        raise MalformedReceipt(f"receipt version {d['v']!r} is not supported (expected {RECEIPT_VERSION})")
    if not isinstance(d["hashes"], list | tuple):
        raise MalformedReceipt("receipt hashes must be a list of (input hash, output hash) pairs")
    if not isinstance(d["links"], list | tuple):
        raise MalformedReceipt("receipt links must be a list of signatures")
    _check_bounds("receipt", {name: d[name] for name in _STR_FIELDS}, {"hashes": d["hashes"], "links": d["links"]})
    return d


class _Identity(TypedDict):
    """The fields of a builder's receipts that its steps do not change."""

    job: str
    session: str
    node: str
    node_key: bytes
    model: str
    layer_start: int
    layer_end: int


class ReceiptBuilder:
    """Accumulates one stage's steps for one session; ``sign`` snapshots them into a Receipt."""

    def __init__(
        self,
        *,
        job: str,
        session: str,
        node: str,
        node_key: bytes,
        model: str,
        layer_start: int,
        layer_end: int,
    ) -> None:
        self._identity: _Identity = {
            "job": job,
            "session": session,
            "node": node,
            "node_key": node_key,
            "model": model,
            "layer_start": layer_start,
            "layer_end": layer_end,
        }
        self._hashes: list[tuple[bytes, bytes]] = []
        self._links: list[bytes] = []
        self._tokens = 0
        self._reused = 0
        self._reused_from: ReusedFrom | None = None
        # Validate the identity now rather than at sign time, hours of serving later.
        self._snapshot(bytes(HASH_BYTES))._check_shape()
        self._head = chain_start(job, session)

    @property
    def steps(self) -> int:
        return len(self._hashes)

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def reused(self) -> int:
        return self._reused

    def reuse(self, positions: int, source: ReusedFrom | None) -> None:
        """The session begins with ``positions`` positions kept from ``source`` (0 and None: none).
        Set when the session opens, and cut to its first step's start when that step truncates them."""
        if self._hashes:
            raise MalformedReceipt("reused positions are set before the session's first step")
        if not _is_int(positions) or positions < 0 or (positions > 0) != (source is not None):
            raise MalformedReceipt(f"reused positions must be 0, or > 0 with their source; got {positions!r}")
        self._reused, self._reused_from = positions, source

    def add_step(self, input_hash: bytes, output_hash: bytes, tokens: int, link: bytes = b"") -> None:
        """Record one step: the digests of the exact input and output wire bytes, its token rows, and
        the sender's signature over the input (``link``; empty when the coordinator sent it)."""
        if not isinstance(link, bytes) or len(link) not in (0, LINK_BYTES):
            raise MalformedReceipt(f"a step's link must be a {LINK_BYTES}-byte signature or empty")
        if not (_is_hash(input_hash) and _is_hash(output_hash)):
            raise MalformedReceipt(f"step hashes must be {HASH_BYTES}-byte sha256 digests")
        if not _is_int(tokens) or tokens < 0:
            raise MalformedReceipt(f"step tokens must be a non-negative integer, got {tokens!r}")
        self._hashes.append((input_hash, output_hash))
        self._links.append(link)
        self._tokens += tokens
        self._head = digest(self._head + input_hash + output_hash)

    def _snapshot(self, chain_head: bytes) -> Receipt:
        return Receipt(
            **self._identity,
            steps=self.steps,
            tokens=self._tokens,
            hashes=tuple(self._hashes),
            links=tuple(self._links),
            chain_head=chain_head,
            signature=bytes(64),
            reused=self._reused,
            reused_from=self._reused_from,
        )

    def sign(self, signing_key: SigningKey) -> Receipt:
        """A receipt for the steps so far; the builder keeps accumulating afterwards."""
        if bytes(signing_key.verify_key) != self._identity["node_key"]:
            raise ForeignSigner(f"the signing key is not node {self._identity['node']}'s key")
        unsigned = self._snapshot(self._head)
        signature = signing_key.sign(SIGNING_CONTEXT + unsigned.body_bytes()).signature
        return replace(unsigned, signature=signature)


@dataclass(frozen=True)
class StageAssignment:
    node: str  # node id assigned to the span
    node_key: bytes  # that node's registered 32-byte public key
    layer_start: int  # first layer (inclusive)
    layer_end: int  # end of the span (exclusive)

    @classmethod
    def from_json(cls, d: object) -> StageAssignment:
        """The assignment a JSON stage map names: ``node``, ``node_key`` (hex), ``layer_start`` and
        ``layer_end``; other keys (a route's ``url``, a HELLO's ``model``) are not its business.
        A malformed one is the planner's fault, not a node's: it raises the base ReceiptError."""
        if not isinstance(d, Mapping) or not {"node", "node_key", "layer_start", "layer_end"} <= set(d):
            raise ReceiptError("a stage assignment must be a map with node, node_key, layer_start and layer_end")
        if not isinstance(d["node"], str) or not 0 < len(d["node"]) <= MAX_ID_CHARS:
            raise ReceiptError(f"a stage assignment's node must be 1-{MAX_ID_CHARS} characters, got {d['node']!r}")
        for name in ("layer_start", "layer_end"):
            if not _is_int(d[name]) or d[name] < 0:
                raise ReceiptError(f"stage {d['node']}'s {name} must be a non-negative integer, got {d[name]!r}")
        try:
            node_key = _unhex(d["node_key"], f"stage {d['node']}'s node_key", 32)
        except MalformedReceipt as exc:
            raise ReceiptError(str(exc)) from None
        return cls(d["node"], node_key, d["layer_start"], d["layer_end"])


@dataclass(frozen=True)
class SessionTranscript:
    session: str  # session id
    sent: tuple[bytes, ...]  # per step: sha256 of the tensor bytes the coordinator sent to the first stage
    received: tuple[bytes, ...]  # per step: sha256 of the tensor bytes it received from the last stage
    start: int = 0  # the position its first step started at: the positions every stage reused (prefix.py)

    def to_json(self) -> dict[str, Any]:
        """The stored form: the session and both hash lists as hex (and ``start`` when not 0)."""
        return {
            "session": self.session,
            "sent": [h.hex() for h in self.sent],
            "received": [h.hex() for h in self.received],
            **({"start": self.start} if self.start else {}),
        }

    @classmethod
    def from_json(cls, data: object) -> SessionTranscript:
        """Parse ``to_json``'s output (or its JSON text); raises ``MalformedReceipt``, ``ReceiptTooLarge``
        for input past the bounds, before any of it is decoded."""
        d = _json_object(data, "a transcript's JSON")
        if not isinstance(d, dict) or set(d) - {"start"} != _TRANSCRIPT_KEYS:
            raise MalformedReceipt(
                f"a transcript must be a map with exactly the keys {sorted(_TRANSCRIPT_KEYS)}, and optionally start"
            )
        start = d.get("start", 0)
        if not _is_int(start) or start < 0:
            raise MalformedReceipt(f"transcript start must be a non-negative integer, got {start!r}")
        _check_bounds("transcript", {"session": d["session"]}, {"sent": d["sent"], "received": d["received"]})
        if not isinstance(d["session"], str):
            raise MalformedReceipt("transcript session must be a string")
        lists = {}
        for name in ("sent", "received"):
            if not isinstance(d[name], list):
                raise MalformedReceipt(f"transcript {name} must be a list of hex digests")
            lists[name] = tuple(_unhex(h, f"transcript {name}[{i}]", HASH_BYTES) for i, h in enumerate(d[name]))
        return cls(d["session"], lists["sent"], lists["received"], start)
