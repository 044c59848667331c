"""Error codes of the nodes app (used by the API and the control channel)."""

from __future__ import annotations

from marketplace.errors import DomainError


class NodeError(DomainError):
    code = "node_error"


class InvalidJoinToken(NodeError):
    code = "invalid_join_token"


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
