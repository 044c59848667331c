"""Grading a challenge: the node's output rows against the trusted recompute, token by token.

A challenge is a job the verifier runs through the challenged node and stand-ins of its own
(``worker_agent/coordinator/challenger.py``); the coordinator keeps the node's exact inputs and
outputs, step by step, as ``AuditMaterial`` (the node signed their hashes in its receipt). The
verifier runs the same inputs through its trusted copy of the block (``audit.recompute``) and
compares the rows::

    comparison = grade(material, trusted_block)   # per-token cosine and relative norm difference
    comparison.passed, comparison.failures

Comparison (``compare``), per token row, in float64: cosine similarity (direction) and the
relative difference of the norms ``|‖out‖ - ‖ref‖| / ‖ref‖`` (magnitude). Together they bound
both; a token passes with cosine >= 0.99 and relative norm difference < 0.05. An honest node
running the block in bfloat16 can miss a float32 reference on a token now and then (the verifier
then compares against its bfloat16 copy too: ``marketplace/verification/verifier.py``); outputs of
noise, of skipped layers or of other weights miss by far, on every token.

The inputs are real activations of a prompt drawn like real traffic, so nothing here can tell a
node the session was a challenge; the rows' statistics are those of any job's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_agent.block import Block
from worker_agent.errors import ChallengeError, ChallengeFailed
from worker_agent.protocol.audit import AuditMaterial, per_token_metrics, recompute, recorded_outputs

MIN_COSINE = 0.99
MAX_REL_NORM = 0.05


@dataclass(frozen=True)
class Comparison:
    """Per-token agreement of a node's output with the trusted reference."""

    cosine: tuple[float, ...]  # cosine similarity of each token's output and reference rows
    rel_norm: tuple[float, ...]  # |‖out‖ - ‖ref‖| / ‖ref‖ of each token
    required_cosine: float = MIN_COSINE  # a token passes with cosine >= this ...
    allowed_rel_norm: float = MAX_REL_NORM  # ... and rel_norm < this

    @property
    def min_cosine(self) -> float:
        return min(self.cosine)

    @property
    def max_rel_norm(self) -> float:
        return max(self.rel_norm)

    @property
    def failures(self) -> tuple[str, ...]:
        """Why it fails, worst token first per criterion; empty when it passes."""
        reasons = []
        if self.min_cosine < self.required_cosine:
            token = self.cosine.index(self.min_cosine)
            bad = sum(value < self.required_cosine for value in self.cosine)
            reasons.append(
                f"cosine {self.min_cosine:.6f} < {self.required_cosine} at token {token} "
                f"({bad} of {len(self.cosine)} tokens below)"
            )
        if self.max_rel_norm >= self.allowed_rel_norm:
            token = self.rel_norm.index(self.max_rel_norm)
            bad = sum(value >= self.allowed_rel_norm for value in self.rel_norm)
            reasons.append(
                f"relative norm difference {self.max_rel_norm:.6f} >= {self.allowed_rel_norm} at token {token} "
                f"({bad} of {len(self.rel_norm)} tokens over)"
            )
        return tuple(reasons)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "min_cosine": round(self.min_cosine, 6),
            "max_rel_norm": round(self.max_rel_norm, 6),
            "required_cosine": self.required_cosine,
            "allowed_rel_norm": self.allowed_rel_norm,
            "cosine": [round(value, 6) for value in self.cosine],
            "rel_norm": [round(value, 6) for value in self.rel_norm],
        }


def compare(
    output: torch.Tensor, reference: torch.Tensor, *, min_cosine: float = MIN_COSINE, max_rel_norm: float = MAX_REL_NORM
) -> Comparison:
    """Per-token cosine and relative norm difference of ``output`` against ``reference``."""
    if output.dim() != 2 or output.shape[0] < 1:
        raise ChallengeError(
            f"output must be (tokens, hidden), got shape {tuple(output.shape)}", code="challenge_malformed"
        )
    if output.shape != reference.shape:
        raise ChallengeError(
            f"output has shape {tuple(output.shape)}, the reference {tuple(reference.shape)}",
            code="challenge_malformed",
        )
    out = output.detach().to("cpu", torch.float64)  # (tokens, hidden)
    ref = reference.detach().to("cpu", torch.float64)  # (tokens, hidden)
    if not torch.isfinite(out).all():
        raise ChallengeError("output holds non-finite values", code="challenge_malformed")
    if not torch.isfinite(ref).all() or not (ref.norm(dim=1) > 0).all():
        # The trusted side is broken, not the node: no verdict either way.
        raise ChallengeError("the reference holds non-finite values or an all-zero token", code="challenge_invalid")
    # An all-zero output row has no direction: it gets cosine 0, which fails.
    cosine, rel_norm = per_token_metrics(out, ref)
    return Comparison(cosine=cosine, rel_norm=rel_norm, required_cosine=min_cosine, allowed_rel_norm=max_rel_norm)


def verify_challenge(
    output: torch.Tensor, reference: torch.Tensor, *, min_cosine: float = MIN_COSINE, max_rel_norm: float = MAX_REL_NORM
) -> Comparison:
    """The comparison when every token passes; otherwise raises ChallengeFailed carrying it."""
    comparison = compare(output, reference, min_cosine=min_cosine, max_rel_norm=max_rel_norm)
    if not comparison.passed:
        raise ChallengeFailed("challenge failed: " + "; ".join(comparison.failures), comparison=comparison)
    return comparison


def grade(
    material: AuditMaterial, block: Block, *, min_cosine: float = MIN_COSINE, max_rel_norm: float = MAX_REL_NORM
) -> Comparison:
    """The node's recorded output rows compared with what the trusted ``block`` (the same span)
    computes on the recorded inputs; raises ChallengeError for rows that cannot be judged."""
    return compare(recorded_outputs(material), recompute(material, block), min_cosine=min_cosine,
                   max_rel_norm=max_rel_norm)  # fmt: skip
