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

Memory: an agent that joined holds its stages' caches in the memory it reported
(``KVMemory``: its ``--memory``, else what it measured, times ``control_protocol.MEMORY_FRACTION``, less the weights
of the blocks it holds), shared by all its stages. A step that would need more is refused before it
runs (``kv_memory_full``), never half computed; placement planned the node's blocks by the same
report and fraction (``marketplace/placement/memory.py``), so an agent that told the truth holds
every session it was placed for, and one that claimed more than it has refuses them. The KV of
finished sessions a stage keeps for reuse (``prefixcache.py``) lives in the same memory but yields
to live sessions: a step that needs room first evicts kept prefixes (``KVMemory.yield_to``), and
is refused only when that is not enough.
"""

from __future__ import annotations

import threading
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
KV_MEMORY_FULL = "kv_memory_full"  # the SessionError code of a step the memory cannot hold


def position_bytes(layout: KVLayout) -> int:
    """Bytes one cached position costs a session on a block of ``layout``: K and V of every layer."""
    return 2 * layout.layers * layout.kv_heads * layout.head_dim * layout.dtype.itemsize


class KVMemory:
    """The memory an agent's stages hold their caches in: ``budget`` bytes (its reported memory
    times MEMORY_FRACTION), less its blocks' weights (``charge``) and its sessions' buffers (``grant``).
    Thread-safe: sessions grow on the compute thread and close on the event loop."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"a memory budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.weights = 0  # bytes of the blocks held
        self.caches = 0  # bytes of the sessions' buffers, kept prefixes included
        self._lock = threading.Lock()
        # Called with the bytes a live session lacks, outside the lock: each frees what it can of
        # what is held only for reuse (kept prefixes), and releases it here.
        self._reclaimers: list[Callable[[int], None]] = []

    @classmethod
    def of(cls, memory_bytes: int, fraction: float) -> KVMemory:
        """The memory of an agent that reports ``memory_bytes``, of which it plans ``fraction`` for
        blocks and caches (``control_protocol.MEMORY_FRACTION``, as placement does)."""
        return cls(int(memory_bytes * fraction))

    @property
    def free(self) -> int:
        return self.budget - self.weights - self.caches

    def charge(self, weights: int) -> None:
        """A block of ``weights`` bytes is loaded (negative: unloaded). The room left may go below
        zero: the block is there, and no session gets room until it goes."""
        with self._lock:
            self.weights += weights

    def yield_to(self, reclaim: Callable[[int], None]) -> Callable[[], None]:
        """Have ``reclaim`` free reusable bytes before a live session is refused for memory; returns
        the call that stops it."""
        self._reclaimers.append(reclaim)
        return lambda: self._reclaimers.remove(reclaim)

    def _make_room(self, needed: int) -> None:
        for reclaim in list(self._reclaimers):
            if needed <= self.free:
                return
            reclaim(needed - self.free)

    def check(self, needed: int, session: str) -> None:
        """Raise ``kv_memory_full`` unless ``needed`` more bytes of cache fit now, once what is kept
        only for reuse made room."""
        if needed > self.free:
            self._make_room(needed)
        self._check(needed, session)

    def _check(self, needed: int, session: str) -> None:
        if needed > self.free:
            raise SessionError(
                f"session {session!r} needs {needed} more bytes of KV cache; this agent's memory holds "
                f"{max(self.free, 0)} more ({self.budget} bytes planned, {self.weights} of weights, "
                f"{self.caches} of caches)",
                code=KV_MEMORY_FULL,
            )

    def grant(self, want: int, need: int, session: str) -> int:
        """Bytes for a growing session: ``want`` if they fit, else ``need`` (raises when not even
        that fits). An exact fit leaves nothing to the doubling growth, so a session never holds
        room the budget of other sessions was planned on."""
        if need > self.free:
            self._make_room(need)
        with self._lock:
            granted = want if want <= self.free else need
            self._check(granted, session)
            self.caches += granted
            return granted

    def release(self, granted: int) -> None:
        with self._lock:
            self.caches -= granted


@dataclass(eq=False)
class KVSession:
    """One session's cache on this stage; compared by identity (it holds tensors)."""

    job: str
    session: str
    max_tokens: int | None = None  # capacity never grows past this (None: no bound)
    memory: KVMemory | None = field(default=None, repr=False)  # where its buffers' bytes come from (None: anywhere)
    granted: int = 0  # bytes of ``memory`` its buffers hold
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
        if self.memory is not None:
            size = position_bytes(layout)
            granted = self.memory.grant(
                (capacity - self.capacity) * size, (positions - self.capacity) * size, self.session
            )
            self.granted += granted
            capacity = self.capacity + granted // size
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

    def __init__(
        self, limits: SessionLimits, *, clock: Callable[[], float] = time.monotonic, memory: KVMemory | None = None
    ) -> None:
        self.limits = limits
        self.memory = memory
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
        kv = KVSession(job, session, max_tokens=self.limits.max_tokens, memory=self.memory, last_used=self._clock())
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

    def check_room(
        self, kv: KVSession, start: int, count: int, *, held: int | None = None, position_bytes: int = 0
    ) -> int:
        """``held``: the positions the session will hold once the steps accepted before this one are
        computed (a speculating coordinator sends its next chunk before the last one came back).
        With ``position_bytes`` (what one position costs on this stage), also that the memory holds
        the positions the session's buffers lack; returns those bytes."""
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
        needed = max(0, start + count - kv.capacity) * position_bytes
        if self.memory is not None and needed:
            self.memory.check(needed, kv.session)
        return needed

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
        kv = self._live.pop(key)
        if kv.memory is not None:
            kv.memory.release(kv.granted)
            kv.granted = 0
        self._evicted[key] = reason
        while len(self._evicted) > self._FORGET_AFTER:
            self._evicted.popitem(last=False)
