"""Application-level WAN emulation for outgoing WebSocket frames (tests and benchmarks only).

The kernel's ``netem`` qdisc is not available where this project runs, so wide-area conditions
are emulated in the sender: every outgoing frame is held back until the moment a real link would
have delivered it. The model, per link and per direction:

* **Latency** is one-way. Each side wraps only its *own* outgoing sends, so a request/answer
  round trip between two nodes costs ``2 * latency_ms``; ``rtt=50ms`` is shorthand for
  ``latency_ms=25``.
* **Jitter** adds a uniform sample from ``[-jitter_ms, +jitter_ms]`` to each frame's latency;
  the total delay is clamped at zero.
* **Bandwidth** is a serialization delay on the sender's uplink: a frame of ``n`` bytes occupies
  the uplink for ``n * 8 / (bandwidth_mbps * 1e6)`` seconds and starts only once the previous
  frame has left, so a burst of frames queues up behind itself. ``0`` means unlimited.
* **Drops.** Frames travel over TCP, which never loses a frame; a lost segment shows up as a
  retransmission delay instead. Each frame is "lost" with probability ``drop``, costing
  ``max(200 ms, 3 * latency)`` per loss; a retransmission can be lost again with the same
  probability, up to ``MAX_RETRANSMISSIONS`` times.
* **Order** is FIFO like a TCP stream: a frame is never delivered before the one sent ahead of
  it, so jitter shows up as head-of-line blocking, never as reordering.

``LinkSchedule`` is the sans-I/O core (profile + random source + a "now" in, delivery time out);
``WanLink`` puts it on asyncio around any ``async send(bytes)``, for example a websockets
connection::

    link = WanLink(websocket.send, WanProfile.parse("rtt=50ms,bandwidth_mbps=100"))
    await link.send(frame)      # returns once queued, like a socket buffer
    await link.drain()          # waits until everything queued was handed to websocket.send
    await link.aclose()

A ``StageServer``, ``Pipeline`` or ``Coordinator`` takes it as its ``transport``
(``worker_agent/protocol/transport.py``), in place of the product's ``DirectLink``::

    StageServer(stage, transport=WanProfile.parse("rtt=50ms").transport())

The agent and the coordinator take the same spec through the dev entry points, which run their
commands with it substituted in, for example ``python -m worker_agent.dev.agent --wan "rtt=50ms"
serve ...`` or ``python -m worker_agent.dev.coordinator --wan
"latency_ms=25,jitter_ms=2,bandwidth_mbps=100,drop=0.01,seed=1" generate ...``; an empty spec is
the null profile, whose sends go straight through.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from types import TracebackType

from worker_agent.protocol.transport import LinkFactory

# TCP's minimum retransmission timeout (RFC 6298 allows 1 s; Linux uses 200 ms).
MIN_RETRANSMIT_S = 0.2
# How many times one frame may be "lost" again; beyond this a real connection would be stalled
# for long enough that the emulation stops being informative.
MAX_RETRANSMISSIONS = 5

_NUMERIC_FIELDS = ("latency_ms", "jitter_ms", "bandwidth_mbps", "drop")
_DURATION_KEYS = ("latency_ms", "jitter_ms")


@dataclass(frozen=True)
class WanProfile:
    """Conditions of one direction of one link. All zero (the default) is the null profile."""

    latency_ms: float = 0.0  # one-way base delay, milliseconds
    jitter_ms: float = 0.0  # spread of the delay, uniform in [-jitter_ms, +jitter_ms], milliseconds
    bandwidth_mbps: float = 0.0  # sender's uplink in megabits (1e6 bits) per second; 0 = unlimited
    drop: float = 0.0  # probability in [0, 1) that a frame is lost once and must be retransmitted
    seed: int | None = None  # seed of the jitter/drop random source; None = nondeterministic

    def __post_init__(self) -> None:
        for name in _NUMERIC_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"WanProfile.{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"WanProfile.{name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"WanProfile.{name} must be >= 0, got {value!r}")
            # Normalised to float so that equal profiles compare and print the same however
            # they were built (25 vs 25.0).
            object.__setattr__(self, name, float(value))
        if self.drop >= 1:
            raise ValueError(
                f"WanProfile.drop must be a probability in [0, 1), got {self.drop!r}: "
                "a TCP link never loses a frame for good"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"WanProfile.seed must be an int or None, got {self.seed!r}")

    @property
    def is_null(self) -> bool:
        """True when the profile changes nothing, so sends can bypass the emulation entirely."""
        return all(getattr(self, name) == 0 for name in _NUMERIC_FIELDS)

    @property
    def retransmit_penalty_s(self) -> float:
        """Extra delay, in seconds, that one lost frame costs."""
        return max(MIN_RETRANSMIT_S, 3 * self.latency_ms / 1000)

    @classmethod
    def parse(cls, spec: str) -> WanProfile:
        """Build a profile from a CLI spec such as ``"latency_ms=25,jitter_ms=2,drop=0.01,seed=1"``.

        ``rtt=50ms`` sets the one-way latency to half the round trip. Durations (``rtt``,
        ``latency_ms``, ``jitter_ms``) take an optional ``ms`` or ``s`` suffix; bare numbers are
        milliseconds. An empty spec is the null profile. Raises ValueError on an unknown or
        repeated key, a malformed value, or a value the profile refuses.
        """
        values: dict[str, float] = {}
        seed: int | None = None
        seen: set[str] = set()
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            if not sep or not raw:
                raise ValueError(f"bad WAN spec {spec!r}: expected key=value, got {item!r}")
            if key in seen:
                raise ValueError(f"bad WAN spec {spec!r}: {key!r} given twice")
            seen.add(key)
            if key == "rtt":
                values["latency_ms"] = _parse_duration_ms(spec, key, raw) / 2
            elif key in _DURATION_KEYS:
                values[key] = _parse_duration_ms(spec, key, raw)
            elif key in ("bandwidth_mbps", "drop"):
                values[key] = _parse_float(spec, key, raw)
            elif key == "seed":
                try:
                    seed = int(raw)
                except ValueError:
                    raise ValueError(f"bad WAN spec {spec!r}: seed must be an integer, got {raw!r}") from None
            else:
                known = ", ".join(["rtt", *(f.name for f in fields(cls))])
                raise ValueError(f"bad WAN spec {spec!r}: unknown key {key!r} (known: {known})")
        if {"rtt", "latency_ms"} <= seen:
            raise ValueError(f"bad WAN spec {spec!r}: give either rtt or latency_ms, not both")
        try:
            return cls(
                latency_ms=values.get("latency_ms", 0.0),
                jitter_ms=values.get("jitter_ms", 0.0),
                bandwidth_mbps=values.get("bandwidth_mbps", 0.0),
                drop=values.get("drop", 0.0),
                seed=seed,
            )
        except ValueError as exc:
            raise ValueError(f"bad WAN spec {spec!r}: {exc}") from None

    def transport(self) -> LinkFactory:
        """Makes each connection's link hold its frames back by this profile (a ``WanLink`` each)."""
        return functools.partial(WanLink, profile=self)

    def to_spec(self) -> str:
        """The inverse of ``parse``: only non-default fields, latency always as ``latency_ms``."""
        parts = [
            f"{name}={_format_number(getattr(self, name))}" for name in _NUMERIC_FIELDS if getattr(self, name) != 0
        ]
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        return ",".join(parts)


def _parse_float(spec: str, key: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"bad WAN spec {spec!r}: {key} must be a number, got {raw!r}") from None


def _parse_duration_ms(spec: str, key: str, raw: str) -> float:
    if raw.endswith("ms"):
        return _parse_float(spec, key, raw[:-2].strip())
    if raw.endswith("s"):
        return _parse_float(spec, key, raw[:-1].strip()) * 1000
    return _parse_float(spec, key, raw)


def _format_number(value: float) -> str:
    # Integral values print without ".0" for readable flags; anything else uses repr, which is
    # the shortest text that parses back to the same float.
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class LinkSchedule:
    """Sans-I/O core: decides when each frame sent on one link is delivered.

    Times are seconds on any monotonic clock the caller chooses; nothing here sleeps or reads
    a clock, so a test can drive it with plain numbers.
    """

    def __init__(self, profile: WanProfile, rng: random.Random | None = None) -> None:
        self.profile = profile
        self._rng = rng if rng is not None else random.Random(profile.seed)
        self._null = profile.is_null
        self._latency_s = profile.latency_ms / 1000
        self._jitter_s = profile.jitter_ms / 1000
        self._bits_per_s = profile.bandwidth_mbps * 1e6
        self._uplink_free_at = -math.inf  # when the last frame finished leaving the uplink
        self._last_delivery = -math.inf  # when the last frame arrived; FIFO floor for the next
        self.retransmissions = 0  # total emulated losses, for benchmarks and tests

    def schedule(self, now: float, nbytes: int) -> float:
        """Absolute delivery time, in seconds, of a frame of ``nbytes`` bytes queued at ``now``."""
        if nbytes < 0:
            raise ValueError(f"a frame cannot have a negative size, got {nbytes}")
        if self._null:
            return now
        profile = self.profile
        start = max(now, self._uplink_free_at)
        if self._bits_per_s > 0:
            self._uplink_free_at = start + nbytes * 8 / self._bits_per_s
        else:
            self._uplink_free_at = start
        delay = self._latency_s
        # Random draws only happen for the features in use, so a seeded run of a profile keeps
        # the same sequence whatever else is configured as zero.
        if self._jitter_s > 0:
            delay = max(0.0, delay + self._rng.uniform(-self._jitter_s, self._jitter_s))
        if profile.drop > 0:
            for _ in range(MAX_RETRANSMISSIONS):
                if self._rng.random() >= profile.drop:
                    break
                delay += profile.retransmit_penalty_s
                self.retransmissions += 1
        # TCP delivers in order: a frame that would overtake its predecessor waits for it.
        delivery = max(self._uplink_free_at + delay, self._last_delivery)
        self._last_delivery = delivery
        return delivery


class WanLink:
    """Wraps an ``async send(bytes)`` so that each frame arrives when ``LinkSchedule`` says.

    ``send`` returns as soon as the frame is queued; one background task per link hands frames
    to the wrapped send in order at their delivery times. An exception from the wrapped send
    (say the connection closed) ends the link: it is kept and raised by every later ``send``
    and ``drain``, and the frames queued behind it are discarded, as a dead TCP connection
    would. ``aclose`` does not raise it, because it runs in ``finally`` blocks where raising
    would mask the exception already unwinding; read ``error`` there if needed.

    With a null profile ``send`` awaits the wrapped send directly: no queue, no task, no timer.
    """

    def __init__(
        self,
        send: Callable[[bytes], Awaitable[None]],
        profile: WanProfile,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        # ``clock`` and ``sleep`` must measure the same time; asyncio.sleep follows the event
        # loop's clock, which is time.monotonic unless the loop was built otherwise.
        self.profile = profile
        self.schedule = LinkSchedule(profile, rng)
        self.frames_sent = 0  # frames the wrapped send accepted
        self.bytes_sent = 0  # payload bytes of those frames
        self._send = send
        self._null = profile.is_null
        self._clock = clock
        self._sleep = sleep
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._wakeup = asyncio.Event()  # set when the queue gains a frame
        self._idle = asyncio.Event()  # set when nothing is queued or being handed over
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._error: Exception | None = None
        self._closed = False
        self._discarded_on_close = 0

    @property
    def error(self) -> Exception | None:
        """The exception that ended the link, if the wrapped send raised one."""
        return self._error

    @property
    def pending(self) -> int:
        """Frames queued and not yet handed to the wrapped send."""
        return len(self._queue)

    async def send(self, data: bytes) -> None:
        """Queue ``data`` for delivery at its scheduled time; raise an earlier delivery error."""
        if self._closed:
            raise RuntimeError("send on a closed WanLink")
        if self._null:
            await self._send(data)
            self.frames_sent += 1
            self.bytes_sent += len(data)
            return
        if self._error is not None:
            raise self._error
        # The frame is sent later: take a private copy so a caller reusing a mutable buffer
        # cannot change what goes out, as a kernel socket buffer would guarantee.
        payload = data if isinstance(data, bytes) else bytes(data)
        self._queue.append((self.schedule.schedule(self._clock(), len(payload)), payload))
        self._idle.clear()
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._deliver(), name="wan-link-delivery")

    async def drain(self) -> None:
        """Wait until every queued frame was handed to the wrapped send; raise its error if any."""
        await self._idle.wait()
        if self._error is not None:
            raise self._error
        if self._discarded_on_close:
            raise RuntimeError(f"WanLink closed with {self._discarded_on_close} frame(s) undelivered")

    async def aclose(self) -> None:
        """Stop delivering: cancel the delivery task and discard what is still queued."""
        self._closed = True
        task, self._task = self._task, None
        try:
            if task is not None:
                task.cancel()
                # asyncio.wait does not re-raise the task's cancellation, but does propagate a
                # cancellation of aclose itself.
                await asyncio.wait({task})
        finally:
            self._discarded_on_close += len(self._queue)
            self._queue.clear()
            self._idle.set()

    async def __aenter__(self) -> WanLink:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _deliver(self) -> None:
        try:
            while True:
                if not self._queue:
                    self._idle.set()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                deliver_at, data = self._queue[0]
                # The event loop may fire a timer up to one clock tick early; check again so a
                # frame is never handed over before its scheduled time.
                while (wait := deliver_at - self._clock()) > 0:
                    await self._sleep(wait)
                self._queue.popleft()
                await self._send(data)
                self.frames_sent += 1
                self.bytes_sent += len(data)
        except Exception as exc:  # CancelledError is not an Exception: aclose ends the task cleanly
            self._error = exc
            self._queue.clear()
            self._idle.set()
