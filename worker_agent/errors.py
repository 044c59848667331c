"""The worker agent's exception hierarchy.

Every error the agent or the coordinator raises on purpose derives from ``SwarmError`` and
carries a stable machine-readable ``code`` (sent in ERROR frames) next to its human message::

    SwarmError
    ├── ModelError      a model or layer span is malformed (``Span``) or cannot be loaded as asked
    ├── WireError       a frame is malformed, too large, of a wrong dtype/shape, non-finite, ...
    ├── SessionError    an unknown, evicted or over-limit session
    ├── TicketError     a job ticket is missing, forged, untrusted, expired or for someone else
    ├── ReceiptError    a receipt or a job's set of receipts fails verification
    ├── StageError      a stage answered with an ERROR frame, or did not answer in time
    ├── AuditError      live-audit material is malformed, or a stage's traffic fails its audit
    ├── TlsError        a data-plane certificate or key is missing, unreadable, expired or not the swarm's
    ├── RelayError      a relay refused an agent or a connection, or a relay link broke the relay's wire rules
    │   └── RelayLost   an agent's link to its relay ended, or was refused or never came up: pick another relay
    └── ChallengeError  a spot-challenge is invalid, or its answer is malformed
        └── ChallengeFailed  a well-formed answer disagrees with the trusted recompute

Trust code (tickets, receipts, challenges) fails closed: it raises, it never returns False.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class. ``code`` is the stable identifier used on the wire and in logs."""

    code = "error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class ModelError(SwarmError):
    code = "model"


class WireError(SwarmError):
    code = "bad_frame"


class SessionError(SwarmError):
    code = "session"


class TicketError(SwarmError):
    code = "ticket_invalid"


class ReceiptError(SwarmError):
    """``node``: the node to blame, when the failure is unambiguously one node's (it sent no
    receipt, a receipt not its own or badly signed, or one that contradicts the coordinator's own
    record of what it sent that node or received from it); None when it cannot be told."""

    code = "receipt_invalid"

    def __init__(self, message: str, *, code: str | None = None, node: str | None = None) -> None:
        super().__init__(message, code=code)
        self.node = node


class StageError(SwarmError):
    """``stage``: the route position of the stage to blame (it died, stalled or refused), when known."""

    code = "stage"

    def __init__(self, message: str, *, code: str | None = None, stage: int | None = None) -> None:
        super().__init__(message, code=code)
        self.stage = stage


class AuditError(SwarmError):
    code = "audit_malformed"


class TlsError(SwarmError):
    code = "tls"


class RelayError(SwarmError):
    """The codes are listed in ``relay_protocol.py``; an agent refused by a relay gets the relay's code."""

    code = "relay"


class RelayLost(RelayError):
    """How ``RelayClient.run`` ends; ``code`` says why: ``relay_unreachable``, ``relay_lost`` (the link
    closed or broke), ``ping_timeout``, or the code of the relay's ERROR: a refusal (``pass_expired``,
    ``bad_signature``, ...) or the end of a registered link (``replaced``, ``shutdown``, ``pass_expired``)."""

    code = "relay_lost"


class ChallengeError(SwarmError):
    """``challenge_invalid`` (a bad request) or ``challenge_malformed`` (a bad answer)."""

    code = "challenge_invalid"


class ChallengeFailed(ChallengeError):
    """The node's answer disagrees with the trusted recompute; ``comparison`` says by how much."""

    code = "challenge_failed"

    def __init__(self, message: str, *, comparison) -> None:
        super().__init__(message)
        self.comparison = comparison
