"""A node's reputation: one score in [0, 1] from what the control plane has observed, with the
explanation a provider sees. Pure functions, no ORM.

    score = pass_factor * (0.35 * uptime + 0.25 * reliability + 0.15 * age + 0.25)
    pass_factor = check_pass_rate ** 2 * 0.5 ** upheld_strikes

- uptime: the share of time since joining that the node was heartbeating (from a prior of one
  hour online);
- check pass rate: passed challenges and audits over all decided ones, smoothed with a prior of
  two passes so that one early failure does not zero a node (squared: correctness matters most);
- reliability: the share of challenges answered before their deadline (latency reliability);
- age: days since joining over 30, capped at 1;
- every upheld strike halves the score.

A new node starts at 0.85 (no age yet: it rises to 1.00 over 30 days, ``rising_track``), above
placement's trust threshold (0.5); a node that fails a third of its checks falls under it and is
kept off load-bearing pipeline positions.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_PASSES = 2.0
# Uptime starts from an hour of full uptime, so the minutes between joining and the first heartbeat
# (loading the block) do not make a new node look unreliable.
PRIOR_UPTIME_S = 3600.0
AGE_FULL_DAYS = 30.0


@dataclass(frozen=True)
class Observations:
    age_days: float
    online_s: float  # seconds heartbeating since joining
    checks_passed: int  # challenges and audits
    checks_failed: int  # failed or expired
    challenges_sent: int  # decided challenges (passed, failed or expired)
    challenges_late: int  # expired: no answer before the deadline
    upheld_strikes: int


@dataclass(frozen=True)
class Reputation:
    score: float
    components: dict[str, float]
    explanation: list[str]

    def to_dict(self) -> dict:
        return {"score": round(self.score, 4), "components": self.components, "explanation": self.explanation}


def reputation(obs: Observations) -> Reputation:
    lifetime_s = max(obs.age_days * 86400.0, 0.0)
    uptime = min((obs.online_s + PRIOR_UPTIME_S) / (lifetime_s + PRIOR_UPTIME_S), 1.0)
    decided = obs.checks_passed + obs.checks_failed
    pass_rate = (obs.checks_passed + PRIOR_PASSES) / (decided + PRIOR_PASSES)
    reliability = (obs.challenges_sent - obs.challenges_late + PRIOR_PASSES) / (obs.challenges_sent + PRIOR_PASSES)
    age = min(max(obs.age_days, 0.0) / AGE_FULL_DAYS, 1.0)
    pass_factor = pass_rate**2 * 0.5**obs.upheld_strikes
    score = pass_factor * (0.35 * uptime + 0.25 * reliability + 0.15 * age + 0.25)
    components = {
        "uptime": round(uptime, 4),
        "check_pass_rate": round(pass_rate, 4),
        "reliability": round(reliability, 4),
        "age": round(age, 4),
        "upheld_strikes": obs.upheld_strikes,
    }
    explanation = [
        f"uptime {uptime:.1%} of the time since joining (weight 35%)",
        f"challenge and audit pass rate {pass_rate:.1%} ({obs.checks_passed} passed, {obs.checks_failed} failed; "
        "squared, it multiplies the score)",
        f"latency reliability {reliability:.1%} of challenges answered in time (weight 25%)",
        f"age {obs.age_days:.1f} days ({age:.0%} of the {AGE_FULL_DAYS:g} days that count fully; weight 15%)",
    ]
    if obs.upheld_strikes:
        explanation.append(f"{obs.upheld_strikes} upheld strike(s): each halves the score")
    return Reputation(min(max(score, 0.0), 1.0), components, explanation)


@dataclass(frozen=True)
class Track:
    """Where a node's score is heading as it ages, everything else staying as it is now."""

    full: float  # the score once age counts fully
    days_left: float  # until age counts fully
    per_day: float  # what each further day of age adds to the score


def rising_track(components: dict) -> Track:
    """From a computed reputation's components (``Reputation.components``): age is the one part
    every node lacks at first and gains by the day alone, 0.15 / 30 a day times the pass factor,
    which is why a healthy new node starts at 0.85 and reaches 1.00 after 30 days."""
    pass_factor = components["check_pass_rate"] ** 2 * 0.5 ** components["upheld_strikes"]
    rest = 0.35 * components["uptime"] + 0.25 * components["reliability"] + 0.25
    age = min(max(components["age"], 0.0), 1.0)
    return Track(
        full=min(pass_factor * (rest + 0.15), 1.0),
        days_left=(1.0 - age) * AGE_FULL_DAYS,
        per_day=pass_factor * 0.15 / AGE_FULL_DAYS,
    )
