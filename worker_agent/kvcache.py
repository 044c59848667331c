"""Per-session KV caches of one stage, with limits and idle eviction.

A session is one generation stream of one job. Its cache holds keys and values of this
stage's layers only and never leaves the process. Limits protect the host: a bounded number
of live sessions, a bounded number of positions per session, and eviction after idling.
Using an evicted or unknown session raises ``SessionError`` with a precise code.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import DynamicCache

from worker_agent.errors import SessionError


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 64  # live sessions at once on this stage
    max_tokens: int = 4096  # positions one session may hold (prompt + generated)
    idle_timeout_s: float = 300.0  # a session untouched this long is evicted

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.max_tokens < 1 or self.idle_timeout_s <= 0:
            raise ValueError(f"session limits must be positive, got {self}")


@dataclass
class KVSession:
    job: str
    session: str
    cache: DynamicCache = field(default_factory=DynamicCache)
    length: int = 0  # positions held in the cache
    last_used: float = 0.0  # monotonic seconds

    def truncate(self, position: int) -> None:
        """Drop every cached position >= ``position`` (rejected speculative tokens)."""
        if position < self.length:
            self.cache.crop(position - self.length)  # a negative count: how many positions to drop
            self.length = position


SessionKey = tuple[str, str]  # (job, session)


class SessionStore:
    """The live sessions of one stage. Not thread-safe: one owner drives it."""

    _FORGET_AFTER = 4096  # how many evicted ids are remembered to tell "evicted" from "unknown"

    def __init__(self, limits: SessionLimits, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._live: dict[SessionKey, KVSession] = {}
        self._evicted: OrderedDict[SessionKey, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def open(self, job: str, session: str) -> KVSession:
        key = (job, session)
        if key in self._live:
            raise SessionError(f"session {session!r} of job {job!r} is already open", code="session_exists")
        if key in self._evicted:
            raise SessionError(f"session {session!r} was closed or evicted; open a new one", code="session_reused")
        self.evict_idle()
        if len(self._live) >= self.limits.max_sessions:
            raise SessionError(
                f"this stage already holds {self.limits.max_sessions} sessions (its limit)", code="too_many_sessions"
            )
        kv = KVSession(job, session, last_used=self._clock())
        self._live[key] = kv
        return kv

    def check_can_open(self, job: str, sessions: tuple[str, ...]) -> None:
        """Raise the error ``open`` would raise for any of ``sessions``, changing nothing."""
        if len(set(sessions)) != len(sessions):
            raise SessionError("a session is listed twice", code="session_exists")
        for session in sessions:
            key = (job, session)
            if key in self._live:
                raise SessionError(f"session {session!r} of job {job!r} is already open", code="session_exists")
            if key in self._evicted:
                raise SessionError(f"session {session!r} was closed or evicted; open a new one", code="session_reused")
        if len(self._live) + len(sessions) > self.limits.max_sessions:
            raise SessionError(
                f"this stage holds {len(self._live)} sessions; {len(sessions)} more would pass its limit of "
                f"{self.limits.max_sessions}",
                code="too_many_sessions",
            )

    def get(self, job: str, session: str) -> KVSession:
        key = (job, session)
        kv = self._live.get(key)
        if kv is None:
            reason = self._evicted.get(key)
            if reason is not None:
                raise SessionError(f"session {session!r} of job {job!r} was {reason}", code="session_evicted")
            raise SessionError(f"unknown session {session!r} of job {job!r}", code="unknown_session")
        kv.last_used = self._clock()
        return kv

    def check_room(self, kv: KVSession, start: int, count: int, *, held: int | None = None) -> None:
        """``held``: the positions the session will hold once the steps accepted before this one are
        computed (a speculating coordinator sends its next chunk before the last one came back)."""
        held = kv.length if held is None else held
        if start > held:
            raise SessionError(
                f"session {kv.session!r} holds {held} positions; cannot start at {start}", code="position_gap"
            )
        if start + count > self.limits.max_tokens:
            raise SessionError(
                f"session {kv.session!r} would reach {start + count} positions (limit {self.limits.max_tokens})",
                code="session_too_long",
            )

    def close(self, job: str, session: str) -> KVSession:
        kv = self.get(job, session)
        self._forget((job, session), "closed")
        return kv

    def close_job(self, job: str) -> list[KVSession]:
        keys = [key for key in self._live if key[0] == job]
        closed = [self._live[key] for key in keys]
        for key in keys:
            self._forget(key, "closed")
        return closed

    def evict_idle(self) -> list[KVSession]:
        deadline = self._clock() - self.limits.idle_timeout_s
        stale = [key for key, kv in self._live.items() if kv.last_used < deadline]
        evicted = [self._live[key] for key in stale]
        for key in stale:
            self._forget(key, f"evicted after idling {self.limits.idle_timeout_s:g}s")
        return evicted

    def _forget(self, key: SessionKey, reason: str) -> None:
        del self._live[key]
        self._evicted[key] = reason
        while len(self._evicted) > self._FORGET_AFTER:
            self._evicted.popitem(last=False)
