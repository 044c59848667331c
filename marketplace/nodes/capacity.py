"""What placement and routing may believe of a node's speed and memory: measured, not claimed.

Memory (``credible_memory``): the node's report, no more than a failed memory challenge left
credible (``memory_limit_bytes``, ``verification.claims``). A passed one proves a lower bound
only, which caps nothing: a node asked to hold its blocks' budget shows nothing of the memory
it was not asked to use.

Speed:

A node reports its speed itself (``swarm-worker bench`` at join, then its heartbeats' per-layer
time under load); nothing stops it from lying. The control plane measures a lower bound of its
own: a passed seeded challenge, timed from its session's first FORWARD to its last RESULT, proves the
node ran ``layers x tokens`` layer-tokens in that time (``verified_layer_tokens_per_s``, the best
such figure). So placement and routing use the *credible* speed (``assess``), over the nodes
considered together:

- a node with a verified speed: its claim, at most ``SWARM_SPEED_VERIFIED_SLACK`` times what it
  proved (a challenge's wall time includes the data plane's round trips and queueing, so the
  proof understates a fast node);
- a node with none yet, claiming at most ``SWARM_SPEED_CLAIM_OUTLIER`` times the median claim of
  the *other* nodes (its own claim cannot drag that median up): its claim, never more than the
  slowest proven speed among them when some have one. Honest nodes' spread stays within that
  factor, and their heartbeats' speeds under load keep counting for rebalancing;
- a node with none yet claiming more: the claim is *in doubt* until a challenge measures the
  node. It counts for nothing: the node counts as the slowest in sight (the claims, the proven
  speeds), and placement and routing use it only where nothing else serves (``allocation.place``
  admits it to a pipeline only when the others cannot hold the model; routing takes a chain
  through it only when none avoids it). A new node claiming 1e12 therefore gets no pipeline of its
  own and wins no request before it is measured; its first passed challenge makes its speed
  count, up to the slack over what it showed.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from django.conf import settings

MIN_SPEED = 1e-6  # a node's credible speed is never 0: placement divides by it


@dataclass(frozen=True)
class Credence:
    """What may be believed of the speeds of some nodes considered together."""

    speeds: dict[str, float]  # node id -> credible layer-tokens per second, > 0
    in_doubt: frozenset[str]  # node ids whose unmeasured claim is far past the others' (see the module)


def assess(nodes: Iterable) -> Credence:
    """The credible speeds of ``nodes`` (``Node`` rows, or anything with ``node_id``,
    ``compute_layer_tokens_per_s`` and ``verified_layer_tokens_per_s``), and the claims in doubt."""
    nodes = list(nodes)
    claims = sorted(n.compute_layer_tokens_per_s for n in nodes if n.compute_layer_tokens_per_s > 0)
    verified = [n.verified_layer_tokens_per_s for n in nodes if n.verified_layer_tokens_per_s]
    proven_floor = min(verified, default=None)
    speeds, in_doubt = {}, set()
    for node in nodes:
        claim = max(node.compute_layer_tokens_per_s, MIN_SPEED)
        if node.verified_layer_tokens_per_s:
            speeds[node.node_id] = min(claim, settings.SWARM_SPEED_VERIFIED_SLACK * node.verified_layer_tokens_per_s)
            continue
        others = _median_without(claims, node.compute_layer_tokens_per_s)
        if others is not None and claim > settings.SWARM_SPEED_CLAIM_OUTLIER * others:
            in_doubt.add(node.node_id)
            cap = min(claims[0], claim)  # the slowest claim in sight: its own lifts it above no other node
        else:
            cap = claim
        if proven_floor is not None:
            cap = min(cap, proven_floor)
        speeds[node.node_id] = max(cap, MIN_SPEED)
    return Credence(speeds=speeds, in_doubt=frozenset(in_doubt))


def credible_speeds(nodes: Iterable) -> dict[str, float]:
    """Node id -> credible layer-tokens per second, for ``nodes`` considered together (``assess``)."""
    return assess(nodes).speeds


def credible_memory(node) -> int:
    """The memory placement may plan with on ``node`` (a ``Node``, or anything with
    ``memory_bytes`` and ``memory_limit_bytes``): its report, capped by what it failed to hold."""
    limit = node.memory_limit_bytes
    return node.memory_bytes if limit is None else min(node.memory_bytes, limit)


def _median_without(claims: Sequence[float], own: float) -> float | None:
    """The median of the sorted positive ``claims`` with one ``own`` left out (all of them when
    ``own`` is not among them: a node that claimed nothing); None when no other claim is left."""
    rest = list(claims)
    if own in rest:
        rest.remove(own)
    return statistics.median(rest) if rest else None
