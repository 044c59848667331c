"""What placement and routing may believe of a node's speed: measured, not claimed.

A node reports its speed itself (``swarm-worker bench`` at join, then its heartbeats' per-layer
time under load); nothing stops it from lying. The control plane measures a lower bound of its
own: a passed seeded challenge, timed from its session's first FORWARD to its last RESULT, proves the
node ran ``layers x tokens`` layer-tokens in that time (``verified_layer_tokens_per_s``, the best
such figure). So placement and routing use the *credible* speed:

- a node with a verified speed: its claim, at most ``SWARM_SPEED_VERIFIED_SLACK`` times what it
  proved (a challenge's wall time includes the data plane's round trips and queueing, so the
  proof understates a fast node);
- a node with none yet: its claim, at most ``SWARM_SPEED_CLAIM_OUTLIER`` times the median claim of
  the nodes considered with it, and never more than the slowest proven speed among them when some
  have one. A new node claiming 1e12 is therefore never preferred to a proven one, and its first
  passed challenge lifts the cap to what it showed.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from django.conf import settings

MIN_SPEED = 1e-6  # a node's credible speed is never 0: placement divides by it


def credible_speeds(nodes: Iterable) -> dict[str, float]:
    """Node id -> credible layer-tokens per second, for ``nodes`` considered together (``Node`` rows)."""
    nodes = list(nodes)
    claims = [n.compute_layer_tokens_per_s for n in nodes if n.compute_layer_tokens_per_s > 0]
    verified = [n.verified_layer_tokens_per_s for n in nodes if n.verified_layer_tokens_per_s]
    unverified_cap = settings.SWARM_SPEED_CLAIM_OUTLIER * statistics.median(claims) if claims else MIN_SPEED
    if verified:
        unverified_cap = min(unverified_cap, min(verified))
    speeds = {}
    for node in nodes:
        claim = max(node.compute_layer_tokens_per_s, MIN_SPEED)
        if node.verified_layer_tokens_per_s:
            cap = settings.SWARM_SPEED_VERIFIED_SLACK * node.verified_layer_tokens_per_s
        else:
            cap = unverified_cap
        speeds[node.node_id] = max(min(claim, cap), MIN_SPEED)
    return speeds
