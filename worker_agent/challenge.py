"""Seeded spot-challenges: does a node really run the layers it is paid for?

Receipts prove which node handled which bytes, not that it computed them correctly. A
challenge checks the computation: the control plane, acting as a job's coordinator, sends an input
derived from a seed through the node's data plane as one ordinary session (``session_steps``: a
prefill, then single-token decode steps; ``coordinator/challenger.py``); a trusted verifier
recomputes the same block on the same input and compares the outputs token by token::

    x = challenge_input(seed, tokens, hidden_size)        # the session's input rows
    output = (await run_challenge_session(...)).output    # what the node's data plane returned
    verify_challenge(output, run_challenge(trusted_block, seed, tokens))  # raises ChallengeFailed

The input is Gaussian, (tokens, hidden) with every entry drawn from N(0, INPUT_STD**2) by
``torch.Generator().manual_seed(seed)``. Why this distribution:

- Every decoder layer starts with an RMSNorm, so what attention and the MLP see depends on the
  direction of each row; a Gaussian row points in a uniformly random direction, which no node
  can have special-cased or precomputed.
- The scale matters through the residual connections, so it is that of a real residual stream
  in mid-network: INPUT_STD = 6 gives rows of norm about 6 * sqrt(hidden), 144 for SmolLM2-135M,
  whose residual rows have norms of about 140 entering layer 10 and 220 entering layer 20 on
  ordinary English text (``output_hidden_states=True``). A node that skips its layers and returns
  its input is still far off: what ten layers add is of the same order as what comes in.
- At a smaller scale the checks turn flaky for honest nodes: with a standard normal input
  (norm 24), a bfloat16 block misses a float32 reference, on one token, in 40 of the tests'
  200 seeds on SmolLM2-135M layers 0:10, 1 on 10:20 and 2 on 20:30 (rerun the bfloat16 test of
  ``tests/test_challenge.py`` with INPUT_STD = 1).

Comparison (``compare``), per token row, in float64: cosine similarity (direction) and the
relative difference of the norms ``|‖out‖ - ‖ref‖| / ‖ref‖`` (magnitude). Together they bound
both; a token passes with cosine >= 0.99 and relative norm difference < 0.05. An honest node
running the block in bfloat16 passes against a float32 reference on the 200 seeds the tests try
(``pytest tests/test_challenge.py -k bfloat16 -s`` prints the worst margins), but not always:
over seeds 0..1799, one challenge of layers 20:30 missed by a relative norm difference of 0.053
on one token of 8, so one failed challenge alone is weak evidence against a bfloat16 node.
Outputs of noise, of skipped layers or of other weights miss by far, on every token. The
node never learns it was a challenge: the session looks like a job's (``worker_agent.coordinator.challenger``).

Everything here but ``run_challenge`` is pure; ``run_challenge`` uses a throwaway KV session of
its own, so it never disturbs the node's live sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker_agent.audit import per_token_metrics
from worker_agent.block import Block, WorkItem
from worker_agent.errors import ChallengeError, ChallengeFailed
from worker_agent.kvcache import SessionLimits, SessionStore

if TYPE_CHECKING:
    from worker_agent.cheat import Cheat

MAX_CHALLENGE_TOKENS = 64  # keeps a challenge a few milliseconds of work and its answer small
INPUT_STD = 6.0  # standard deviation of every input entry: a mid-network residual stream's scale
MAX_SEED = 2**63  # seeds are in [0, MAX_SEED): what torch.Generator.manual_seed takes as an int64
DECODE_STEPS = 3  # single-token steps after the prefill, as a generating session sends them
MIN_COSINE = 0.99
MAX_REL_NORM = 0.05


def _check_int(name: str, value: object, low: int, high: int) -> int:
    """``low <= value <= high``, rejecting bools (which Python counts as ints)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ChallengeError(f"{name} must be an integer in [{low}, {high}], got {value!r}", code="challenge_invalid")
    return value


def check_challenge(seed: int, tokens: int) -> None:
    """Raise ChallengeError (``challenge_invalid``) unless (seed, tokens) is a valid challenge."""
    _check_int("seed", seed, 0, MAX_SEED - 1)
    _check_int("tokens", tokens, 1, MAX_CHALLENGE_TOKENS)


def challenge_input(seed: int, tokens: int, hidden_size: int) -> torch.Tensor:
    """The challenge's input hidden states, (tokens, hidden) float32, a pure function of its arguments."""
    check_challenge(seed, tokens)
    _check_int("hidden_size", hidden_size, 1, 1 << 20)
    generator = torch.Generator().manual_seed(seed)
    return INPUT_STD * torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float32)  # (tokens, hidden)


def session_steps(tokens: int) -> list[tuple[int, int]]:
    """How a challenge of ``tokens`` rows travels as a session: (start position, rows) per FORWARD,
    a prefill of all but the last ``DECODE_STEPS`` rows, then one row per step as a generating
    session decodes. Causal attention makes the rows' outputs those of one prefill of all of them."""
    _check_int("tokens", tokens, 1, MAX_CHALLENGE_TOKENS)
    decode = min(DECODE_STEPS, tokens - 1)
    prefill = tokens - decode
    return [(0, prefill)] + [(prefill + i, 1) for i in range(decode)]


def run_challenge(block: Block, seed: int, tokens: int, cheat: Cheat | None = None) -> torch.Tensor:
    """Run ``block`` on the challenge input as one prefill (positions 0..tokens-1) of a fresh
    session; returns (tokens, hidden) float32 on the CPU. ``cheat`` is for tests only."""
    hidden = challenge_input(seed, tokens, block.hidden_size)  # (tokens, hidden)
    store = SessionStore(SessionLimits(max_sessions=1, max_tokens=tokens))
    kv = store.open("challenge", f"seed-{seed}")
    item = WorkItem(kv, 0, hidden)
    (output,) = cheat.forward(block, [item], live=False) if cheat is not None else block.forward([item])
    return output.detach().to("cpu", torch.float32)


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
