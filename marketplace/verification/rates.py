"""How often to check a node: derived from what it stands to gain by cheating and to lose if caught.

Pure functions, no ORM.

The model. A node earns ``E`` dollars a day. Suppose it cheats on a fraction ``f`` of its work
(skips the compute and returns something cheap): its gain is at most ``f * E`` a day (it keeps the
pay for work it did not do). Checks arrive as a Poisson process of ``n`` a day, and each one looks at
a piece of work that is cheated with probability ``f``, so cheating is detected at rate ``n * f`` a
day and the expected time until it is caught is ``1 / (n * f)`` days. The expected gain before it is
caught is therefore

    gain = f * E * 1 / (n * f) = E / n           (independent of f)

When caught, the node loses ``L``: its pending earnings (an upheld strike claws back everything
still inside the challenge window, about ``E * window_days``) plus its share of future income, since
``strikes_to_eject`` upheld strikes eject it: ``E * horizon_days / strikes_to_eject``, where the
horizon is the days of income the node can expect to keep earning, scaled by its age and reputation
(a new or distrusted node has little future to lose). Cheating does not pay when ``L >= k * gain``
for a safety factor ``k``:

    n >= k * E / L = k / (window_days + horizon_days / strikes_to_eject)

so the required rate does not depend on how much the node earns, only on how much of its income is
at stake, and it is highest for new and low-reputation nodes. ``n`` is then clamped to configured
bounds and split:

- live audits carry the guarantee, because only they see live traffic (a node can answer
  challenges honestly and cheat on jobs): the audit fraction of the node's sessions is
  ``n / sessions_per_day``, at least a floor, and a new node's fraction is at least
  ``new_node_fraction``;
- seeded challenges run at ``n`` a day too (at least a floor): they cost nothing to the customer,
  catch nodes that cheat everywhere even while idle, and measure reliability.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RateParams:
    safety: float = 2.0  # k: expected loss must exceed the expected gain this many times over
    window_days: float = 1.0  # the challenge window: pending earnings at stake
    horizon_days: float = 30.0  # future income at stake for an established, fully trusted node
    strikes_to_eject: int = 3
    new_node_days: float = 7.0  # younger than this: a new node
    challenges_min_per_day: float = 24.0
    challenges_max_per_day: float = 1440.0
    audit_min_fraction: float = 0.02
    new_node_fraction: float = 0.25


@dataclass(frozen=True)
class CheckRate:
    checks_per_day: float  # n from the formula, before clamping
    challenges_per_day: float
    audit_fraction: float  # share of the node's sessions whose stage is audited, 0..1
    explanation: str


def check_rate(*, age_days: float, reputation: float, sessions_per_day: float, params: RateParams) -> CheckRate:
    """The challenge rate and audit fraction for one node (see the module docstring)."""
    if not all(math.isfinite(x) for x in (age_days, reputation, sessions_per_day)):
        raise ValueError("age_days, reputation and sessions_per_day must be finite")
    trust = min(max(reputation, 0.0), 1.0)
    maturity = min(max(age_days, 0.0) / params.new_node_days, 1.0) if params.new_node_days > 0 else 1.0
    horizon = params.horizon_days * maturity * trust
    at_stake_days = params.window_days + horizon / params.strikes_to_eject
    n = params.safety / max(at_stake_days, 1e-9)
    challenges = min(max(n, params.challenges_min_per_day), params.challenges_max_per_day)
    fraction = n / sessions_per_day if sessions_per_day > 0 else 1.0
    fraction = max(fraction, params.audit_min_fraction)
    if age_days < params.new_node_days:
        fraction = max(fraction, params.new_node_fraction)
    fraction = min(fraction, 1.0)
    explanation = (
        f"at stake: {params.window_days:g} day(s) of pending pay + {horizon:.1f} day(s) of future income / "
        f"{params.strikes_to_eject} strikes = {at_stake_days:.2f} day(s) of income; "
        f"required checks n = k / at_stake = {params.safety:g} / {at_stake_days:.2f} = {n:.2f} per day; "
        f"challenges {challenges:.1f} per day; audits on {fraction:.1%} of {sessions_per_day:.0f} sessions per day"
    )
    return CheckRate(n, challenges, fraction, explanation)
