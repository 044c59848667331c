"""The KV of finished sessions a stage keeps, so that a later session starting with the same
tokens computes only the rest (prefix reuse).

A stage never sees tokens: its coordinator names each prefix by keys (``protocol/prefix.py``) and
the stage keeps and finds KV by those keys alone. At a session's CLOSE the coordinator lists the
keys of its committed sequence; the stage copies the session's cache up to the longest of those
boundaries it holds into a kept prefix, findable by every listed key up to there. At a new
session's OPEN the coordinator lists the keys of its prompt; the stage copies the longest kept
prefix one of them names into the new session's cache (a copy: the kept one stays unchanged for
others, and the new session may truncate and overwrite its own freely).

Bounded and least recently used first: at most ``PrefixLimits.max_entries`` kept prefixes and
``max_positions`` positions over all of them, and in the agent's memory (``kvcache.KVMemory``) they
yield to live sessions: a step that lacks room evicts kept prefixes before it is refused. Thread-safe:
steps grow caches (and so evict) on the compute thread, while OPEN and CLOSE run on the event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from worker_agent.errors import SessionError
from worker_agent.kvcache import KVLayout, KVMemory, KVSession, position_bytes
from worker_agent.protocol.prefix import PrefixKey
from worker_agent.protocol.receipts import ReusedFrom


@dataclass(frozen=True)
class PrefixLimits:
    max_entries: int = 16  # kept prefixes at once on a stage
    max_positions: int = 16384  # positions kept over all of them

    def __post_init__(self) -> None:
        if self.max_entries < 0 or self.max_positions < 0:
            raise ValueError(f"prefix limits must be >= 0, got {self}")


@dataclass(eq=False)
class _Kept:
    """One kept prefix: the first ``length`` positions of a finished session's cache."""

    source: ReusedFrom
    length: int
    layout: KVLayout
    granted: int  # bytes of the memory it holds
    keys: list[torch.Tensor] = field(repr=False)  # per layer: (kv_heads, length, head_dim)
    values: list[torch.Tensor] = field(repr=False)  # per layer: (kv_heads, length, head_dim)
    names: set[bytes] = field(default_factory=set)  # the prefix keys that find it


class PrefixCache:
    """A stage's kept prefixes, by key."""

    def __init__(self, limits: PrefixLimits | None = None, *, memory: KVMemory | None = None) -> None:
        self.limits = limits or PrefixLimits()
        self.memory = memory
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Kept] = OrderedDict()  # id -> entry, least recently used first
        self._index: dict[bytes, tuple[_Kept, int]] = {}  # key -> (the entry holding it, its positions)
        self.positions = 0  # kept over all entries
        self.evicted = 0  # entries dropped for room, over the cache's life
        self._stop = memory.yield_to(self.reclaim) if memory is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, kv: KVSession, keys: Sequence[PrefixKey], source: ReusedFrom) -> int:
        """Keep ``kv``'s first positions, up to the longest key boundary it holds, under every key of
        ``keys`` up to there; returns the positions kept (0: nothing, e.g. no room)."""
        usable = [key for key in keys if 0 < key.positions <= kv.length]
        if not usable or kv.layout is None or not self.limits.max_entries:
            return 0
        length = max(key.positions for key in usable)
        if length > self.limits.max_positions:
            return 0
        with self._lock:
            held = self._index.get(max(usable, key=lambda key: key.positions).key)
            if held is not None and held[1] == length:  # kept already (the same prefix, sent again)
                self._entries.move_to_end(id(held[0]))
                return 0
            while self._entries and (
                len(self._entries) >= self.limits.max_entries or self.positions + length > self.limits.max_positions
            ):
                self._evict_oldest()
        size = length * position_bytes(kv.layout)
        if self.memory is not None:
            try:
                # Outside the lock: making room evicts through ``reclaim``.
                self.memory.grant(size, size, "kept prefix")
            except SessionError:
                return 0
        entry = _Kept(
            source,
            length,
            kv.layout,
            size if self.memory is not None else 0,
            keys=[layer[:, :length].clone() for layer in kv.keys],
            values=[layer[:, :length].clone() for layer in kv.values],
        )
        with self._lock:
            self._entries[id(entry)] = entry
            self.positions += length
            for key in usable:
                if key.positions <= length:
                    self._name(key, entry)
        return length

    def _name(self, key: PrefixKey, entry: _Kept) -> None:
        """Point ``key`` at ``entry`` (the newest copy); an entry no key finds any more is dropped."""
        old = self._index.get(key.key)
        self._index[key.key] = (entry, key.positions)
        entry.names.add(key.key)
        if old is not None and old[0] is not entry:
            old[0].names.discard(key.key)
            if not old[0].names:
                self._drop(old[0])

    def reuse(self, kv: KVSession, keys: Sequence[PrefixKey]) -> tuple[int, ReusedFrom | None]:
        """Copy the longest kept prefix one of ``keys`` names into ``kv``, a session that holds
        nothing yet; returns the positions it now holds and where they came from (0, None: none)."""
        with self._lock:
            for key in sorted(keys, key=lambda key: key.positions, reverse=True):
                held = self._index.get(key.key)
                if held is not None and held[1] == key.positions:
                    entry, positions = held
                    self._entries.move_to_end(id(entry))
                    break
            else:
                return 0, None
        if kv.max_tokens is not None and positions > kv.max_tokens:
            return 0, None
        try:
            # The entry's tensors stay alive through this copy even if making room evicts it.
            kv.reserve(positions, entry.layout)
        except SessionError:
            return 0, None
        for layer, (keys_in, values_in) in enumerate(zip(entry.keys, entry.values, strict=True)):
            kv.keys[layer][:, :positions] = keys_in[:, :positions]
            kv.values[layer][:, :positions] = values_in[:, :positions]
        kv.length = positions
        return positions, entry.source

    def reclaim(self, needed: int) -> None:
        """Evict kept prefixes, least recently used first, until ``needed`` bytes were freed or none is left."""
        freed = 0
        with self._lock:
            while self._entries and freed < needed:
                freed += self._evict_oldest()

    def clear(self) -> None:
        """Drop every kept prefix and stop yielding to the memory (the stage is unloaded)."""
        with self._lock:
            while self._entries:
                self._drop(next(iter(self._entries.values())))
        if self._stop is not None:
            self._stop()
            self._stop = None

    def _evict_oldest(self) -> int:
        entry = next(iter(self._entries.values()))
        self.evicted += 1
        return self._drop(entry)

    def _drop(self, entry: _Kept) -> int:
        """Forget ``entry`` and its keys; returns the bytes of memory it held."""
        del self._entries[id(entry)]
        self.positions -= entry.length
        for name in entry.names:
            if self._index.get(name, (None,))[0] is entry:
                del self._index[name]
        entry.names.clear()
        if self.memory is not None and entry.granted:
            self.memory.release(entry.granted)
        return entry.granted
