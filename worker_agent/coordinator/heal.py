"""Healing a request whose stage died or stalled: what failed, and who provides the replacement.

When a stage's connection drops, it sends an ERROR, or a step makes no progress past it for the
stall timeout (``pipeline.py``), the coordinator (``job.py``) asks its ``Healer`` for a route
without that stage, connects it, re-prefills the prompt and the tokens committed so far on it
(one forward pass) and goes on decoding: the client sees one pause, and the output continues
where it stopped. A request heals at most ``max_heals`` times, then fails with a clear error.

Two healers exist:

- the control plane's (``marketplace/flows/runner.py``): it reports the failed node, so routing
  stops using it at once, and answers with a route whose dead span is held by a warm spare or
  another pipeline's stage, with tickets it signs;
- ``SpareHealer`` here, for the CLI (``swarm-coordinator generate --spare URL``): warm spares
  named by URL; the first unused one serving exactly the failed stage's span takes its place.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

from worker_agent.coordinator.pipeline import Pipeline, StageSpec
from worker_agent.errors import StageError, SwarmError
from worker_agent.protocol import wire
from worker_agent.protocol.receipts import StageAssignment

log = logging.getLogger("swarm.coordinator")


@dataclass(frozen=True)
class StageFailure:
    """One stage of a route failed: where, which node (if it said HELLO), what it served, why."""

    stage: int  # route position
    node: str | None  # node id from its HELLO; None if it never answered one
    url: str
    layer_start: int | None  # its span, from its HELLO (None if unknown)
    layer_end: int | None
    code: str
    message: str


def failure_at(pipeline: Pipeline, error: StageError) -> StageFailure:
    """What ``error`` says failed on ``pipeline``, for a healer: the stage, its node and span as its
    HELLO said them, the failure's code and message."""
    assert error.stage is not None
    link = pipeline.links[error.stage]
    return StageFailure(
        stage=error.stage,
        node=link.info.get("node"),
        url=link.spec.url,
        layer_start=link.info.get("layer_start"),
        layer_end=link.info.get("layer_end"),
        code=error.code,
        message=str(error),
    )


@dataclass(frozen=True)
class HealedRoute:
    """The route to go on with: every stage in layer order, the failed one replaced."""

    stages: tuple[StageSpec, ...]
    # The control plane's assignments for the new route; None: taken from the stages' HELLO
    # (no control plane), as at the start.
    assignments: tuple[StageAssignment, ...] | None = None
    # Route positions whose traffic is kept for audits; None: the same positions as before.
    audit_stages: tuple[int, ...] | None = None


class Healer(Protocol):
    async def prepare(self) -> None:
        """Get ready for a failure, in the background once the route is connected: whatever a
        heal would otherwise have to learn after the failure (e.g. the spares' identities)."""
        ...

    async def replace(self, failure: StageFailure, route: Sequence[StageSpec]) -> HealedRoute | None:
        """A route without the failed stage, or None when no replacement is available."""
        ...


async def get_ready(healer: Healer, job: str) -> None:
    """``healer.prepare()``, in the background once a job's route is up; a failure is only logged."""
    try:
        await healer.prepare()
    except Exception as exc:  # a heal then learns what it needs when it happens
        log.warning("job %s: the healer could not get ready: %r", job, exc)


@dataclass
class HealRecord:
    """One heal of one request, in seconds since the request started."""

    stage: int
    node: str | None
    code: str
    message: str
    detected: float  # when the failure was seen
    reconnected: float | None = None  # when the healed route was connected (a replacement found, every stage HELLOed)
    resumed: float | None = None  # when the healed route returned its first result

    @classmethod
    def of(cls, pipeline: Pipeline, error: StageError, detected: float) -> HealRecord:
        """The heal of ``error`` on ``pipeline``, seen ``detected`` seconds into the request."""
        assert error.stage is not None
        return cls(error.stage, pipeline.links[error.stage].info.get("node"), error.code, str(error), detected)

    def resume(self, at: float) -> None:
        if self.resumed is None:
            self.resumed = at

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "node": self.node,
            "code": self.code,
            "message": self.message,
            "detected_s": round(self.detected, 4),
            "reconnected_s": round(self.reconnected, 4) if self.reconnected is not None else None,
            "resumed_s": round(self.resumed, 4) if self.resumed is not None else None,
        }


async def probe_stage(url: str, timeout: float = 10.0) -> dict:
    """PING a stage and return its public identity (node, key, model, span)."""
    async with connect(url, open_timeout=timeout, compression=None) as ws:
        await ws.send(wire.encode(wire.Ping(nonce=1), seq=1))
        frame = wire.decode(await asyncio.wait_for(ws.recv(), timeout))
    if not isinstance(frame.message, wire.Pong):
        raise StageError(f"{url} answered PING with {type(frame.message).__name__}")
    return frame.message.info


class SpareHealer:
    """Warm spares by URL. ``ticket`` signs a ticket for a spare's identity (its PING info), or
    is None when the agents run without tickets."""

    def __init__(self, urls: Sequence[str], *, ticket: Callable[[dict], bytes | None] | None = None) -> None:
        self.unused = list(urls)
        self.ticket = ticket
        self.known: dict[str, dict] = {}  # spares' PING info by URL, learned before any failure
        self.given: set[str] = set()  # spares handed out to take a failed stage's place

    async def _probe_unknown(self) -> None:
        """PING the unused spares not known yet, at once (one round trip, not one per spare), and
        keep what each says of itself; an unreachable one is skipped."""
        urls = [url for url in self.unused if url not in self.known]
        probes = await asyncio.gather(*(probe_stage(url, timeout=5.0) for url in urls), return_exceptions=True)
        for url, info in zip(urls, probes, strict=True):
            if isinstance(info, (OSError, TimeoutError, SwarmError, WebSocketException)):
                log.warning("spare %s cannot be reached: %s", url, info)
            elif isinstance(info, BaseException):
                raise info
            else:
                self.known[url] = info

    async def prepare(self) -> None:
        """Learn every spare's identity now, so that a heal does not wait a PING round for it. A
        spare that changed or died since is found out when the healed route connects (its HELLO
        is checked as any stage's), and that route is healed in turn."""
        await self._probe_unknown()

    async def replace(self, failure: StageFailure, route: Sequence[StageSpec]) -> HealedRoute | None:
        start, end = failure.layer_start, failure.layer_end
        if start is None:  # it never said HELLO: its span is the gap its neighbours leave
            start, end = await self._gap(failure.stage, route)
            if start is None:
                return None
        if failure.url in self.given:
            # A spare handed out on what was known of it failed: what is known of the others may be
            # stale too, so they are asked again (one round trip) rather than tried one by one.
            self.known.clear()
        # Spares not known yet (``prepare`` did not run or did not reach them) are asked now; the
        # first in the order given that serves the span takes the place.
        await self._probe_unknown()
        for url in list(self.unused):
            info = self.known.get(url)
            if info is None or info.get("layer_start") != start or (end is not None and info.get("layer_end") != end):
                continue
            self.unused.remove(url)
            self.given.add(url)
            spec = StageSpec(url, self.ticket(info) if self.ticket else None)
            log.warning(
                "stage %d (%s) failed: %s; spare %s takes its place", failure.stage, failure.url, failure.code, url
            )
            return HealedRoute(tuple(spec if i == failure.stage else s for i, s in enumerate(route)))
        return None

    @staticmethod
    async def _gap(position: int, route: Sequence[StageSpec]) -> tuple[int | None, int | None]:
        """The span of route position ``position`` as its neighbours tell it: from where the previous
        stage ends (0 for the first) to where the next one starts (None for the last: to the
        model's end, which the coordinator checks when it connects). (None, None) when a
        neighbour cannot say."""
        try:
            before = (await probe_stage(route[position - 1].url, timeout=5.0))["layer_end"] if position else 0
            after = (
                (await probe_stage(route[position + 1].url, timeout=5.0))["layer_start"]
                if position + 1 < len(route)
                else None
            )
        except (OSError, TimeoutError, SwarmError, KeyError) as exc:
            log.warning("cannot tell stage %d's span from its neighbours: %s", position, exc)
            return None, None
        return before, after
