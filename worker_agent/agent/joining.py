"""Joining a control plane, up to the control channel: where the join token comes from, the checks
made before the speed benchmark, and trying an unreachable control plane again.

    SWARM_JOIN_TOKEN=swj_... swarm-worker join --control-plane https://HOST
    swarm-worker join --control-plane https://HOST --token-file /run/secrets/swarm-join-token

The token comes from the environment or a file, never from the command line, where ``ps`` shows
it to every user of the machine. Before the benchmark (seconds on a GPU, tens of seconds on a
CPU) the agent asks the control plane's ``/healthz`` and ``POST /api/v1/agents/check-token``,
which checks the token without using it up, so a wrong URL or token fails at once.

A call that got no answer, a 5xx or a 429 is tried again after a wait drawn uniformly from
``[0, min(cap, base * 2**attempt)]`` (exponential backoff with full jitter): agents that lost the
control plane together do not all come back at the same instant. Any other 4xx (a bad token) is
final.
"""

from __future__ import annotations

import http.client
import json
import random
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from worker_agent.errors import SwarmError

T = TypeVar("T")

TOKEN_ENV = "SWARM_JOIN_TOKEN"
HTTP_TIMEOUT_S = 30.0
BACKOFF_BASE_S = 1.0  # the first retry waits up to this long
BACKOFF_CAP_S = 30.0  # no wait is drawn from a longer range
JOIN_TRIES = 8  # calls in all, the first included: the 7 waits add up to 45 s on average, 91 s at most
MAX_DETAIL_CHARS = 300  # of a control plane's message quoted in an error


class JoinError(SwarmError):
    """Joining failed; the message is one line for the machine's owner."""

    code = "join_failed"


class Unreachable(JoinError):
    """No answer, a 5xx or a 429: worth trying again, after ``retry_after`` s when the control
    plane named a wait."""

    code = "control_plane_unreachable"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Refused(JoinError):
    """The control plane answered with a 4xx: final. ``code`` is the control plane's error code
    (``invalid_join_token``, ...), ``reason`` its finer reason when it gave one, ``status`` the
    HTTP status."""

    def __init__(self, message: str, *, code: str, status: int, reason: str | None = None) -> None:
        super().__init__(message, code=code)
        self.status = status
        self.reason = reason


def read_token(token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The join token: the stripped contents of ``token_file`` if given, else ``$SWARM_JOIN_TOKEN``;
    None without either (an agent that joined before reconnects without one)."""
    if token_file is None:
        return environ.get(TOKEN_ENV, "").strip() or None
    try:
        token = Path(token_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not text"
        raise JoinError(f"cannot read the join token file {token_file}: {reason}", code="token_file") from None
    if not token or len(token.split()) != 1:
        raise JoinError(f"the join token file {token_file} must hold the token alone", code="token_file")
    return token


def backoff_delay(
    attempt: int, rng: random.Random, *, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S
) -> float:
    """Seconds to wait before retry number ``attempt + 1`` (``attempt`` counts from 0): full jitter,
    uniform in ``[0, min(cap_s, base_s * 2**attempt)]``."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(attempt, 60)))  # 2**60 s is past any cap


@dataclass(frozen=True)
class Retry:
    """How a call that found the control plane unreachable is tried again."""

    tries: int = JOIN_TRIES  # calls in all, the first included
    base_s: float = BACKOFF_BASE_S
    cap_s: float = BACKOFF_CAP_S


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def retrying(
    call: Callable[[], T],
    retry: Retry,
    *,
    rng: random.Random,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] = _say,
) -> T:
    """``call()``, tried again after a jittered backoff each time it raises ``Unreachable``, up to
    ``retry.tries`` calls; the last ``Unreachable`` is raised, naming the tries. Other errors pass."""
    attempt = 0
    while True:
        try:
            return call()
        except Unreachable as exc:
            attempt += 1
            if attempt >= retry.tries:
                tries = f"{retry.tries} tries" if retry.tries > 1 else "1 try"
                raise Unreachable(f"{exc} (gave up after {tries})") from None
            delay = backoff_delay(attempt - 1, rng, base_s=retry.base_s, cap_s=retry.cap_s)
            if exc.retry_after is not None:
                delay = max(delay, min(exc.retry_after, retry.cap_s))
            say(f"{exc}; trying again in {delay:.1f}s ({attempt + 1} of {retry.tries})")
            sleep(delay)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:MAX_DETAIL_CHARS]


def _refusal(url: str, what: str, exc: urllib.error.HTTPError) -> JoinError:
    """The error for an HTTP error answer: ``Unreachable`` for a 5xx or 429, else ``Refused``
    with the control plane's own code and message (its error body is OpenAI's shape)."""
    raw = exc.read(64 * 1024)
    if exc.code >= 500 or exc.code == 429:
        retry_after = exc.headers.get("Retry-After", "") if exc.headers else ""
        wait = float(retry_after) if retry_after.isdigit() else None
        return Unreachable(f"the control plane at {url} answered {exc.code} {exc.reason}", retry_after=wait)
    try:
        error = json.loads(raw)["error"]
        message, code, reason = str(error["message"]), str(error["code"] or ""), error.get("reason")
    except (ValueError, KeyError, TypeError):
        message, code, reason = f"{exc.code} {exc.reason}", "", None
    return Refused(
        f"the control plane refused {what}: {_one_line(message)}",
        code=code or f"http_{exc.code}",
        status=exc.code,
        reason=reason if isinstance(reason, str) else None,
    )


def request_json(url: str, body: dict | None = None, *, what: str, timeout: float = HTTP_TIMEOUT_S) -> dict:
    """GET ``url`` (``body`` None) or POST ``body`` to it as JSON; the answer's JSON object.
    Raises ``Unreachable`` (no answer, 5xx, 429: worth trying again), ``Refused`` (another 4xx:
    final) or ``JoinError`` (an answer that is not a JSON object). ``what`` names the request in
    a refusal ("the join")."""
    request = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise _refusal(url, what, exc) from None
    except urllib.error.URLError as exc:
        raise Unreachable(f"cannot reach the control plane at {url}: {_one_line(str(exc.reason))}") from None
    except (OSError, http.client.HTTPException) as exc:  # timeouts and connections cut mid-answer
        detail = _one_line(str(exc)) or type(exc).__name__
        raise Unreachable(f"cannot reach the control plane at {url}: {detail}") from None
    try:
        reply = json.loads(raw)
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        raise JoinError(f"{url} did not answer with JSON: is it a swarm control plane?", code="not_a_control_plane")
    return reply


def preflight(
    control_plane: str,
    token: str,
    retry: Retry,
    *,
    rng: random.Random,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] = _say,
) -> dict:
    """Before the benchmark: the control plane answers at ``control_plane`` (``/healthz``, tried
    again while unreachable) and would take ``token`` now (``check-token``, which does not use it
    up). Returns the check's answer; raises ``Refused`` for a bad token (``reason``: unknown, used,
    expired), ``Unreachable`` once the tries are spent, ``JoinError`` for a URL that is not a
    control plane's."""
    base = control_plane.rstrip("/")
    try:
        retrying(lambda: request_json(f"{base}/healthz", what="the health check"), retry, rng=rng, sleep=sleep, say=say)
    except Refused as exc:
        raise JoinError(
            f"{base} does not look like a swarm control plane: GET /healthz answered {exc.status}",
            code="not_a_control_plane",
        ) from None
    try:
        return retrying(
            lambda: request_json(f"{base}/api/v1/agents/check-token", {"token": token}, what="the join token"),
            retry,
            rng=rng,
            sleep=sleep,
            say=say,
        )
    except Refused as exc:
        if exc.status != 404 or not exc.code.startswith("http_"):
            raise
        # A control plane older than the check: the join itself will say whether the token is good.
        say("this control plane cannot check a join token before the join: it is checked at the join")
        return {}
