"""Per-session KV caches of one stage, with limits and idle eviction.

A session is one generation stream of one job. Its cache holds keys and values of this
stage's layers only and never leaves the process: per layer, one preallocated key buffer and
one value buffer, each (kv_heads, capacity, head_dim), of which positions ``[0, length)`` are
valid. Buffers are allocated on the first computed step (an opened session costs nothing),
grow by doubling when a step needs more room (one copy per growth, never past the session's
position limit), and are never shrunk: truncating is O(1), and later steps overwrite what
lies past ``length``.

Limits protect the host: a bounded number of live sessions, a bounded number of positions per
session, and eviction after idling. Using an evicted or unknown session raises
``SessionError`` with a precise code.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from worker_agent.errors import SessionError


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 64  # live sessions at once on this stage
    max_tokens: int = 4096  # positions one session may hold (prompt + generated)
    idle_timeout_s: float = 300.0  # a session untouched this long is evicted

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.max_tokens < 1 or self.idle_timeout_s <= 0:
            raise ValueError(f"session limits must be positive, got {self}")


@dataclass(frozen=True)
class KVLayout:
    """What one session's buffers look like on a given block."""

    layers: int  # decoder layers of the stage
    kv_heads: int  # key/value heads per layer
    head_dim: int  # width of one head
    dtype: torch.dtype
    device: torch.device


MIN_CAPACITY = 64  # positions of a session's first allocation (unless its limit is lower)


@dataclass(eq=False)
class KVSession:
    """One session's cache on this stage; compared by identity (it holds tensors)."""

    job: str
    session: str
    max_tokens: int | None = None  # capacity never grows past this (None: no bound)
    length: int = 0  # positions held: [0, length) of every buffer is valid
    last_used: float = 0.0  # monotonic seconds
    layout: KVLayout | None = field(default=None, repr=False)  # set by the first ``reserve``
    keys: list[torch.Tensor] = field(default_factory=list, repr=False)  # per layer: (kv_heads, capacity, head_dim)
    values: list[torch.Tensor] = field(default_factory=list, repr=False)  # per layer: (kv_heads, capacity, head_dim)

    @property
    def capacity(self) -> int:
        """Positions the buffers can hold without growing; 0 before the first computed step."""
        return self.keys[0].shape[1] if self.keys else 0

    def truncate(self, position: int) -> None:
        """Drop every cached position >= ``position`` (rejected speculative tokens); O(1)."""
        self.length = min(self.length, position)

    def reserve(self, positions: int, layout: KVLayout) -> None:
        """Make the buffers hold at least ``positions`` positions, keeping ``[0, length)``.

        Growing doubles the capacity (at least ``MIN_CAPACITY``), capped at ``max_tokens`` but
        never below ``positions``. Room past ``length`` is left uninitialized: a step writes its
        positions before anything reads them."""
        if self.layout is not None and self.layout != layout:
            raise ValueError(f"session {self.session!r} holds a cache for {self.layout}, not {layout}")
        if positions <= self.capacity:
            return
        capacity = max(2 * self.capacity, MIN_CAPACITY)
        if self.max_tokens is not None:
            capacity = min(capacity, self.max_tokens)
        capacity = max(capacity, positions)
        shape = (layout.kv_heads, capacity, layout.head_dim)
        keys, values = [], []
        for layer in range(layout.layers):
            new_keys = torch.empty(shape, dtype=layout.dtype, device=layout.device)
            new_values = torch.empty(shape, dtype=layout.dtype, device=layout.device)
            if self.keys:
                new_keys[:, : self.length] = self.keys[layer][:, : self.length]
                new_values[:, : self.length] = self.values[layer][:, : self.length]
            keys.append(new_keys)
            values.append(new_values)
        self.layout, self.keys, self.values = layout, keys, values


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
        kv = KVSession(job, session, max_tokens=self.limits.max_tokens, last_used=self._clock())
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
