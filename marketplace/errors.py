"""The control plane's one error vocabulary.

Every app raises subclasses of ``DomainError`` from its ``errors.py``. A domain error says what
went wrong in the domain's own words and nothing about transport:

- ``code``: a stable snake_case string that clients and tests may compare against
  (``insufficient_quota``, ``invalid_join_token``). A class sets its default; a raise site may
  name a finer one (``AuthenticationFailed(..., code="revoked_api_key")``).
- ``message``: a sentence for a person (also ``str(error)``).
- ``param``: the input the error is about (``"amount"``, ``"messages.0.role"``), or None.

No domain error carries an HTTP status: the HTTP edge maps codes to statuses in one place
(``marketplace.api.errors``), and the Channels consumers map them to their own close reasons.
"""

from __future__ import annotations


class DomainError(Exception):
    """A use case refused or failed, named by a stable ``code``."""

    code: str = "domain_error"

    def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
