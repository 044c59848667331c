# Over 500 lines: the material, its checks against the receipts and its replay are one audit, read whole.
"""Live audits: one stage's recorded traffic, checked against its receipt and replayed.

Receipts prove coverage, not correct computation: a node can sign hashes of garbage. A live
audit catches that. For an audited session the coordinator keeps, per step, the exact wire
bytes one stage received and sent (``AuditMaterial``), whose sha256 the stage already signed in
its receipt. A trusted verifier then

1. ``check_hashes``: the material is the traffic the receipt covers: same job, session, node,
   model and span, the same steps and token rows, and the sha256 of every input and output equal
   to the signed (input hash, output hash) pair of that step;
2. ``replay``: runs the inputs, step by step, through a trusted copy of the block on a fresh
   throwaway KV cache, and compares every output token row with the recorded one: cosine
   similarity >= ``min_cosine`` and ``abs(|out| - |ref|) / |ref|`` < ``max_rel_norm``, in float64.

A session that began on positions its stages kept from an earlier session (prefix reuse) starts
its steps past them, on a cache the audited stage did not compute in this session. Its material
carries the reused prompt tokens (``prefix``); the verifier rebuilds that cache with its own trusted
layers: it embeds the tokens, runs them through the layers before the stage (``prefix_inputs``) and
the stage's block, and then replays the steps on it. The stage is held to its steps' outputs
given the right prefix: a stage that reused a wrong or corrupted prefix fails the replay.

``verify_audit`` does both::

    material = AuditMaterial.from_bytes(blob)
    block = Block(load_block(material.model, material.layer_start, material.layer_end))
    report = verify_audit(material, receipt, block)      # raises AuditFailed unless honest
    print(report.to_dict())
    # with material.prefix: verify_audit(..., prefix=prefix_inputs(material, head, block_before))

Nodes cannot tell audited traffic apart: in ring topology every stage also sends each output to
its coordinator (a tap), for every session, and in star topology the coordinator relays every
output itself; which sessions and stages are kept is the coordinator's own choice.

Errors (trust code fails closed: it raises, it never returns False)::

    AuditError (errors.py)   code audit_malformed: material that does not parse or is inconsistent
                             in itself; audit_wrong_block: a trusted block that cannot replay it
    └── AuditFailed          a node is at fault (``.upstream``: the audited stage's predecessor,
                             which sent the recorded inputs; otherwise the audited node): code
                             audit_hash_mismatch, the material is not what the receipts signed;
                             audit_forged_tap, the predecessor's copy of its output (its tap)
                             is not what its receipt, or its signature on the audited stage's
                             input (links.py), says it sent; audit_mismatch, the replay's outputs
                             differ from the recorded ones (``.report`` says where)

Who owes which bytes: in ring topology an audited stage's inputs are its predecessor's tap and its
outputs its own tap (or, for the last stage, its result). So an input that is not what the
predecessor signed as its output is the predecessor's forgery, never the audited node's fault;
an input that is what the predecessor signed but not what the audited node signed it received
means the audited node's receipt lies.

A receipt that does not verify raises its own ``ReceiptError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from worker_agent.block import Block, WorkItem
from worker_agent.cpu import MODEL_CPU
from worker_agent.errors import AuditError
from worker_agent.kvcache import KVSession
from worker_agent.protocol import wire
from worker_agent.protocol.links import signed_by
from worker_agent.protocol.receipts import Receipt, digest

if TYPE_CHECKING:
    from worker_agent.model import Head

AUDIT_VERSION = 1
DEFAULT_MIN_COSINE = 0.99
DEFAULT_MAX_REL_NORM = 0.05

_STR_FIELDS = ("job", "session", "node", "model", "dtype")
_INT_FIELDS = ("stage", "layer_start", "layer_end", "hidden_size")
_KEYS = frozenset({"v", *_STR_FIELDS, *_INT_FIELDS, "steps", "inputs", "outputs"})


class AuditFailed(AuditError):
    """The node's signed traffic is not what the receipt says, or not what its block computes."""

    code = "audit_hash_mismatch"

    def __init__(
        self, message: str, *, code: str | None = None, report: AuditReport | None = None, upstream: bool = False
    ) -> None:
        super().__init__(message, code=code)
        self.report = report
        self.upstream = upstream  # the audited stage's predecessor is at fault, not the audited node


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class AuditMaterial:
    """One stage's exact traffic for one session; validated on construction (``AuditError``)."""

    job: str  # job id
    session: str  # session id within the job
    stage: int  # index of the stage in the pipeline, 0-based
    node: str  # node id of the stage, as its HELLO said
    model: str  # model id
    layer_start: int  # first layer of the stage's span (inclusive)
    layer_end: int  # end of the span (exclusive)
    dtype: str  # wire dtype of every input and output, a key of wire.DTYPES
    hidden_size: int  # columns of every tensor
    steps: tuple[tuple[int, int], ...]  # per step: (position of the first token, token rows)
    inputs: tuple[bytes, ...]  # per step: the tensor bytes the stage received, rows x hidden
    outputs: tuple[bytes, ...]  # per step: the tensor bytes the stage sent, rows x hidden
    # The prompt tokens of the positions the session began with (prefix reuse): its first step
    # starts at len(prefix). Empty when it reused nothing.
    prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in _STR_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise AuditError(f"audit material {name} must be a non-empty string, got {value!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise AuditError(f"audit material {name} must be a non-negative integer, got {value!r}")
        if self.layer_start >= self.layer_end:
            raise AuditError(f"audit material span [{self.layer_start}, {self.layer_end}) is empty")
        if self.dtype not in wire.DTYPES:
            raise AuditError(f"audit material dtype {self.dtype!r} is not one of {sorted(wire.DTYPES)}")
        if self.hidden_size < 1:
            raise AuditError("audit material hidden_size must be positive")
        if not isinstance(self.steps, tuple) or not self.steps:
            raise AuditError("audit material needs a non-empty tuple of steps")
        for step in self.steps:
            if not (
                isinstance(step, tuple)
                and len(step) == 2
                and all(_is_int(n) for n in step)
                and step[0] >= 0
                and step[1] >= 1
            ):
                raise AuditError(f"each audit step is (start >= 0, count >= 1), got {step!r}")
        if not isinstance(self.prefix, tuple) or not all(_is_int(t) and 0 <= t < 1 << 31 for t in self.prefix):
            raise AuditError("audit material prefix must be a tuple of token ids")
        if self.prefix and self.steps[0][0] != len(self.prefix):
            raise AuditError(
                f"audit material's first step starts at {self.steps[0][0]}, not after its {len(self.prefix)} "
                "reused positions"
            )
        row = self.hidden_size * wire.DTYPES[self.dtype].itemsize
        for name in ("inputs", "outputs"):
            chunks = getattr(self, name)
            if not isinstance(chunks, tuple) or len(chunks) != len(self.steps):
                raise AuditError(f"audit material {name} must be a tuple of {len(self.steps)} byte strings")
            for index, (chunk, (_, count)) in enumerate(zip(chunks, self.steps, strict=True)):
                if not isinstance(chunk, bytes):
                    raise AuditError(f"audit material {name}[{index}] must be bytes, got {type(chunk).__name__}")
                if len(chunk) != count * row:
                    raise AuditError(
                        f"audit material {name}[{index}] has {len(chunk)} bytes; {count} rows of "
                        f"{self.hidden_size} {self.dtype} need {count * row}"
                    )
                if not bool(torch.isfinite(self.tensor(chunk, count)).all()):
                    raise AuditError(f"audit material {name}[{index}] holds NaN or Inf")

    @property
    def tokens(self) -> int:
        """Token rows over all steps."""
        return sum(count for _, count in self.steps)

    def tensor(self, chunk: bytes, count: int) -> torch.Tensor:
        """One step's bytes as a (count, hidden) tensor in the wire dtype."""
        flat = torch.frombuffer(bytearray(chunk), dtype=wire.DTYPES[self.dtype])
        return flat.view(count, self.hidden_size)

    def to_bytes(self) -> bytes:
        """Versioned msgpack, keys sorted: the same material always gives the same bytes."""
        body: dict[str, Any] = {name: getattr(self, name) for name in (*_STR_FIELDS, *_INT_FIELDS)}
        body |= {
            "v": AUDIT_VERSION,
            "steps": [list(step) for step in self.steps],
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
        }
        if self.prefix:  # absent where nothing was reused: such material reads as it always did
            body["prefix"] = list(self.prefix)
        return msgpack.packb(dict(sorted(body.items())), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> AuditMaterial:
        """Parse ``to_bytes``'s output; raises ``AuditError`` on anything else."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise AuditError(f"audit material must be bytes, got {type(data).__name__}")
        try:
            body = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        except Exception as exc:
            raise AuditError(f"audit material is not valid msgpack: {exc.__class__.__name__}") from None
        if not isinstance(body, dict) or set(body) - {"prefix"} != _KEYS:
            raise AuditError(f"audit material must be a map with exactly the keys {sorted(_KEYS)} (and prefix)")
        if not _is_int(body["v"]) or body["v"] != AUDIT_VERSION:
            raise AuditError(f"audit material version {body['v']!r} is not supported (expected {AUDIT_VERSION})")
        body.setdefault("prefix", [])
        for name in ("steps", "inputs", "outputs", "prefix"):
            if not isinstance(body[name], list):
                raise AuditError(f"audit material {name} must be a list")
        return cls(
            **{name: body[name] for name in (*_STR_FIELDS, *_INT_FIELDS)},
            steps=tuple(tuple(step) if isinstance(step, list) else step for step in body["steps"]),
            inputs=tuple(body["inputs"]),
            outputs=tuple(body["outputs"]),
            prefix=tuple(body["prefix"]),
        )


@dataclass(frozen=True)
class AuditReport:
    """What a replay found, per token row in step order."""

    job: str
    session: str
    stage: int  # index of the audited stage in the pipeline
    node: str  # node id of the audited stage
    steps: int  # steps replayed
    tokens: int  # token rows compared
    cosine: tuple[float, ...]  # per row: cosine similarity of the recorded output with the replay's
    rel_norm: tuple[float, ...]  # per row: abs(|recorded| - |replayed|) / |replayed|
    min_cosine: float  # threshold: every row's cosine must be >= this
    max_rel_norm: float  # threshold: every row's rel_norm must be < this
    first_failure: tuple[int, int] | None  # (step, row within the step) of the first row out of bounds

    @property
    def passed(self) -> bool:
        return self.first_failure is None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: floats rounded to 6 places, a non-finite value as None."""
        step, row = self.first_failure or (None, None)
        return {
            "job": self.job,
            "session": self.session,
            "stage": self.stage,
            "node": self.node,
            "steps": self.steps,
            "tokens": self.tokens,
            "passed": self.passed,
            "min_cosine": self.min_cosine,
            "max_rel_norm": self.max_rel_norm,
            "worst_cosine": _round(min(self.cosine, default=1.0)),
            "worst_rel_norm": _round(max(self.rel_norm, default=0.0)),
            "first_failure": None if step is None else {"step": step, "token": row},
            "cosine": [_round(value) for value in self.cosine],
            "rel_norm": [_round(value) for value in self.rel_norm],
        }


def _round(value: float) -> float | None:
    return round(value, 6) if math.isfinite(value) else None


def per_token_metrics(output: torch.Tensor, reference: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per row of two (rows, hidden) tensors, in float64: the cosine similarity of ``output``
    with ``reference``, and ``abs(|output| - |reference|) / |reference|``.

    A zero row is similar only to a zero row (cosine 1, relative norm 0); against a zero
    reference any other row has relative norm inf. Raises ValueError on shapes that differ or
    are not two-dimensional.
    """
    if output.dim() != 2 or tuple(output.shape) != tuple(reference.shape):
        raise ValueError(
            f"per-token comparison needs two (rows, hidden) tensors of one shape, got "
            f"{tuple(output.shape)} and {tuple(reference.shape)}"
        )
    out = output.detach().to("cpu", torch.float64)
    ref = reference.detach().to("cpu", torch.float64)
    dots = (out * ref).sum(dim=-1).tolist()  # (rows,)
    out_norms = out.norm(dim=-1).tolist()
    ref_norms = ref.norm(dim=-1).tolist()
    cosines, rel_norms = [], []
    for dot, out_norm, ref_norm in zip(dots, out_norms, ref_norms, strict=True):
        if ref_norm == 0:
            cosines.append(1.0 if out_norm == 0 else 0.0)
            rel_norms.append(0.0 if out_norm == 0 else math.inf)
        elif out_norm == 0:
            cosines.append(0.0)
            rel_norms.append(1.0)
        else:
            cosines.append(max(-1.0, min(1.0, dot / (out_norm * ref_norm))))
            rel_norms.append(abs(out_norm - ref_norm) / ref_norm)
    return tuple(cosines), tuple(rel_norms)


def check_hashes(material: AuditMaterial, receipt: Receipt, upstream: Receipt | None = None) -> None:
    """Raise ``AuditFailed`` unless ``material`` is exactly the traffic that ``receipt`` signs for;
    a receipt that does not verify raises its ``ReceiptError``. With ``upstream`` (the receipt of
    the stage before, which sent the recorded inputs as its tap), each input is first checked
    against what that stage signed as its output: a difference is its forgery (audit_forged_tap,
    ``.upstream``), not the audited node's fault."""
    if not isinstance(material, AuditMaterial) or not isinstance(receipt, Receipt):
        raise AuditFailed("check_hashes takes an AuditMaterial and a Receipt")
    receipt.verify_signature()
    if upstream is not None:
        _check_upstream(material, upstream)
    where = f"stage {material.stage} (node {material.node}) of session {material.session!r}"
    for name in ("job", "session", "node", "model", "layer_start", "layer_end"):
        if getattr(receipt, name) != getattr(material, name):
            raise AuditFailed(
                f"{where}: the receipt's {name} is {getattr(receipt, name)!r}, the material's "
                f"{getattr(material, name)!r}"
            )
    if receipt.reused != len(material.prefix):
        raise AuditFailed(
            f"{where}: the receipt says the session reused {receipt.reused} positions, the material "
            f"{len(material.prefix)}"
        )
    if receipt.steps != len(material.steps) or receipt.tokens != material.tokens:
        raise AuditFailed(
            f"{where}: the receipt signs {receipt.steps} steps, {receipt.tokens} tokens; the material holds "
            f"{len(material.steps)} steps, {material.tokens} tokens"
        )
    pairs = zip(receipt.hashes, material.inputs, material.outputs, strict=True)
    for step, ((signed_in, signed_out), sent_in, sent_out) in enumerate(pairs):
        if digest(sent_in) != signed_in:
            link = receipt.links[step]
            if upstream is not None and signed_by(
                upstream.node_key, link, receipt.job, receipt.session, step, signed_in
            ):
                # The predecessor tapped one output and signed another to the audited stage: its doing.
                raise AuditFailed(
                    f"stage {material.stage - 1} (node {upstream.node}) of session {material.session!r} step {step}: "
                    "its tap is not what it signed it sent the audited stage",
                    code="audit_forged_tap",
                    upstream=True,
                )
            raise AuditFailed(f"{where} step {step}: the recorded input is not what the node signed")
        if digest(sent_out) != signed_out:
            raise AuditFailed(f"{where} step {step}: the recorded output is not what the node signed")


def _check_upstream(material: AuditMaterial, upstream: Receipt) -> None:
    if not isinstance(upstream, Receipt):
        raise AuditFailed("the upstream receipt must be a Receipt")
    upstream.verify_signature()
    where = f"stage {material.stage - 1} (node {upstream.node}) of session {material.session!r}"
    if (upstream.job, upstream.session, upstream.layer_end) != (material.job, material.session, material.layer_start):
        raise AuditError(f"{where}: its receipt is not for the stage before the audited one", code="audit_malformed")
    if upstream.steps != len(material.steps):
        raise AuditFailed(
            f"{where}: it signs {upstream.steps} steps, the audited stage's traffic holds {len(material.steps)}",
            code="audit_forged_tap",
            upstream=True,
        )
    for step, ((_, signed_out), tapped) in enumerate(zip(upstream.hashes, material.inputs, strict=True)):
        if digest(tapped) != signed_out:
            raise AuditFailed(
                f"{where} step {step}: its tap (the audited stage's recorded input) is not the output it signed",
                code="audit_forged_tap",
                upstream=True,
            )


def _check_thresholds(min_cosine: float, max_rel_norm: float) -> None:
    if not (math.isfinite(min_cosine) and -1 <= min_cosine <= 1):
        raise ValueError(f"min_cosine must be in [-1, 1], got {min_cosine!r}")
    if not (math.isfinite(max_rel_norm) and max_rel_norm > 0):
        raise ValueError(f"max_rel_norm must be a positive number, got {max_rel_norm!r}")


def _check_block(material: AuditMaterial, block: Block) -> None:
    """A block that cannot stand for the audited stage is the verifier's mistake, not the node's."""
    weights = block.weights
    span = (weights.layer_start, weights.layer_end)
    if span != (material.layer_start, material.layer_end) or block.hidden_size != material.hidden_size:
        raise AuditError(
            f"the trusted block runs layers [{span[0]}, {span[1]}) with hidden size {block.hidden_size}; the "
            f"material is for [{material.layer_start}, {material.layer_end}) with hidden size {material.hidden_size}",
            code="audit_wrong_block",
        )


def prefix_inputs(material: AuditMaterial, head: Head, before: Block | None) -> torch.Tensor:
    """What the audited stage received for the material's reused prompt tokens, recomputed by
    trusted parts: ``head`` embeds them and ``before`` (layers [0, the stage's start); None for the
    first stage) runs them, each passing through the wire dtype as a pipeline's hops do.
    (len(prefix), hidden)"""
    if not material.prefix:
        raise AuditError("the material reused no positions: there is no prefix to recompute")
    if (before is None) != (material.layer_start == 0) or (
        before is not None and (before.weights.layer_start, before.weights.layer_end) != (0, material.layer_start)
    ):
        raise AuditError(
            f"the prefix of a stage starting at layer {material.layer_start} needs the trusted layers before it",
            code="audit_wrong_block",
        )
    rows = len(material.prefix)
    hidden = material.tensor(wire.tensor_payload(head.embed_tokens(list(material.prefix)), material.dtype), rows)
    if before is not None:
        (hidden,) = before.forward([WorkItem(KVSession(material.job, "prefix"), 0, hidden)])  # (rows, hidden)
        hidden = material.tensor(wire.tensor_payload(hidden, material.dtype), rows)
    return hidden


def recompute(material: AuditMaterial, block: Block, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """What ``block`` (trusted, same span) computes on the material's inputs, step by step on a fresh
    KV cache, as the stage's rows came out of the wire dtype: (tokens, hidden), one row per recorded
    output row. Raises ``AuditError`` when the block cannot stand for the stage or a step starts past
    what the cache holds.

    When each step starts where the one before it ended (no step computed a position again, as a
    rolled-back draft does), every input row goes through the block in one causal pass: each
    position's output depends on the same inputs as in the stage's step by step, and one pass of
    n rows costs far less than n passes of one (the verifier's work, per audited stage). Otherwise
    the steps are replayed one by one, on the cache as the stage held it.

    ``prefix`` (``prefix_inputs``), needed when the material reused positions: the stage's inputs for
    them, which the block runs first to rebuild the cache the session began with."""
    with MODEL_CPU.measure("replay"):
        return _recompute(material, block, prefix)


def _recompute(material: AuditMaterial, block: Block, prefix: torch.Tensor | None) -> torch.Tensor:
    _check_block(material, block)
    kv = KVSession(material.job, material.session)  # throwaway: dropped when this returns
    if material.prefix:
        if prefix is None or tuple(prefix.shape) != (len(material.prefix), material.hidden_size):
            raise AuditError(f"replaying this material needs the inputs of its {len(material.prefix)} reused positions")
        block.forward([WorkItem(kv, 0, prefix)])
    passes = [
        (start, count, material.tensor(sent, count))
        for (start, count), sent in zip(material.steps, material.inputs, strict=True)
    ]
    if _contiguous(material.steps, len(material.prefix)):
        passes = [(len(material.prefix), material.tokens, torch.cat([rows for _, _, rows in passes]))]
    replayed = []
    for index, (start, count, rows) in enumerate(passes):
        if start > kv.length:
            raise AuditError(f"audit step {index} starts at position {start}, past the {kv.length} held")
        (computed,) = block.forward([WorkItem(kv, start, rows)])  # (count, hidden)
        # Through the wire dtype, as the stage serializes it, so that honest bytes compare equal.
        replayed.append(material.tensor(wire.tensor_payload(computed, material.dtype), count))
    return torch.cat(replayed)  # (tokens, hidden)


def recorded_outputs(material: AuditMaterial) -> torch.Tensor:
    """The stage's output rows as recorded, all steps in order: (tokens, hidden)."""
    return torch.cat(
        [material.tensor(sent, count) for (_, count), sent in zip(material.steps, material.outputs, strict=True)]
    )


def replay(
    material: AuditMaterial,
    block: Block,
    *,
    prefix: torch.Tensor | None = None,
    min_cosine: float = DEFAULT_MIN_COSINE,
    max_rel_norm: float = DEFAULT_MAX_REL_NORM,
) -> AuditReport:
    """``recompute`` the material on ``block`` and compare every recorded output row with the
    replay's; raises ``AuditError`` as ``recompute`` does."""
    _check_thresholds(min_cosine, max_rel_norm)
    reference = recompute(material, block, prefix)
    sent_out = recorded_outputs(material)
    cosines, rel_norms = per_token_metrics(sent_out, reference)
    first_failure = None
    rows = [(step, row) for step, (_, count) in enumerate(material.steps) for row in range(count)]
    for (step, row), cosine, rel_norm in zip(rows, cosines, rel_norms, strict=True):
        if not (cosine >= min_cosine and rel_norm < max_rel_norm):
            first_failure = (step, row)
            break
    return AuditReport(
        job=material.job,
        session=material.session,
        stage=material.stage,
        node=material.node,
        steps=len(material.steps),
        tokens=material.tokens,
        cosine=tuple(cosines),
        rel_norm=tuple(rel_norms),
        min_cosine=min_cosine,
        max_rel_norm=max_rel_norm,
        first_failure=first_failure,
    )


def _contiguous(steps: tuple[tuple[int, int], ...], first: int) -> bool:
    """Whether each step starts at the position where the one before it ended, the first at ``first``."""
    position = first
    for start, count in steps:
        if start != position:
            return False
        position += count
    return True


def verify_audit(
    material: AuditMaterial,
    receipt: Receipt,
    block: Block,
    *,
    upstream: Receipt | None = None,
    prefix: torch.Tensor | None = None,
    min_cosine: float = DEFAULT_MIN_COSINE,
    max_rel_norm: float = DEFAULT_MAX_REL_NORM,
) -> AuditReport:
    """``check_hashes``, then ``replay`` (on ``prefix``'s rebuilt cache, when the session reused one);
    raises ``AuditFailed`` (audit_mismatch, with ``.report``) when any output row is out of bounds, and
    returns the report when every row passes."""
    check_hashes(material, receipt, upstream)
    report = replay(material, block, prefix=prefix, min_cosine=min_cosine, max_rel_norm=max_rel_norm)
    if report.first_failure is not None:  # not passed
        step, row = report.first_failure
        index = sum(count for _, count in material.steps[:step]) + row
        raise AuditFailed(
            f"stage {material.stage} (node {material.node}) of session {material.session!r}: step {step} token "
            f"{row} has cosine {report.cosine[index]:.6f} (min {min_cosine}) and relative norm "
            f"{report.rel_norm[index]:.6f} (max {max_rel_norm}) against the trusted replay",
            code="audit_mismatch",
            report=report,
        )
    return report
