"""Routers that have seen some drafts: a plan must win at the acceptance's lower bound, which the
prior alone (one trial) leaves near 0."""

from __future__ import annotations

from fractions import Fraction

from worker_agent.coordinator.router import Router


def shown(router: Router, acceptance: float, *, drafter: str = "ngram", trials: int = 40) -> Router:
    """``router`` after chunks of ``drafter`` at about ``acceptance`` per draft, ``trials`` trials
    in all: per ``acceptance`` = n/d, one chunk of n drafts all accepted and d - n chunks whose
    first draft is rejected."""
    fraction = Fraction(acceptance).limit_denominator(20)
    accepted, rejected = fraction.numerator, fraction.denominator - fraction.numerator
    for _ in range(max(1, trials // fraction.denominator)):
        if accepted:
            router.observe(drafter, accepted, accepted)
        for _ in range(rejected):
            router.observe(drafter, 1, 0)
    return router
