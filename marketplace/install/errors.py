"""Error codes of the install app."""

from __future__ import annotations

from marketplace.errors import DomainError


class WheelsUnavailable(DomainError):
    """The agent's wheel could not be built, or a model's wheel could not be fetched."""

    code = "agent_wheels_unavailable"
