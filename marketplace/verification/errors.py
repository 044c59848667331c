"""Error codes of the verification app (challenges, audits, strikes)."""

from __future__ import annotations

from marketplace.errors import DomainError


class VerificationError(DomainError):
    code = "verification_error"


class NotChallengeable(VerificationError):
    """The node serves no ready block to challenge."""

    code = "not_challengeable"


class StrikeDecisionRefused(VerificationError):
    """An admin decision that is not allowed: not staff, no reason for an overturn, already decided."""

    code = "strike_decision_refused"
