"""Error codes of the nodes app (used by the API and the control channel)."""

from __future__ import annotations

from marketplace.errors import DomainError


class NodeError(DomainError):
    code = "node_error"


class InvalidJoinToken(NodeError):
    """``reason``, when a check of the token says why: "unknown", "used" or "expired"."""

    code = "invalid_join_token"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class TooManyTokenChecks(NodeError):
    """Too many failed join token checks from one address within the window; ``retry_after`` in seconds."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class KeyAlreadyRegistered(NodeError):
    code = "key_already_registered"


class InvalidHandshake(NodeError):
    code = "invalid_handshake"


class InvalidReport(NodeError):
    code = "invalid_report"


class NodeNameTaken(NodeError):
    """The provider already has a node of that name."""

    code = "node_name_taken"


class NodeNotAllowed(NodeError):
    code = "node_not_allowed"


class TrustMarkRefused(NodeError):
    """A trust mark that cannot be set or cleared as asked (no reason, an ejected node)."""

    code = "trust_mark_refused"


class InvalidCsr(InvalidReport):
    """A join's certificate signing request the swarm's CA does not sign (answered as any bad report)."""

    code = "invalid_csr"
