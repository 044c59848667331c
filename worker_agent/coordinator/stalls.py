"""Who stalled a step, decided from what the coordinator saw itself (sans-I/O).

``StallWatch`` keeps, for each step in flight, how many stages have put out a usable part of it
(in ring, every stage but the last taps its output to the coordinator; in star the coordinator
relays each output on itself) and when the last of them did. Its caller, the pipeline, feeds it
each usable output and asks it, once a step has made no progress for the stall timeout, what to
do (``stalled``):

- the first stage with no output for the step is the one to look at. Stage 0, and any stage in
  star, had its input from the coordinator itself: it is blamed (``Blame``);
- in ring, any later stage had its input from its predecessor only, whose tap says it put an
  output out, but a predecessor can tap an output and withhold it from its successor. So the
  coordinator first hands the stage that tapped output over its own link (``Relay``) and waits
  another stall timeout; a stage that still puts out nothing is blamed. Neither neighbour can
  frame the other: the blame rests on the coordinator's own delivery;
- a stage relayed its input once is ``disputed`` for the rest of the route: each later output of
  its predecessor is relayed to it as it comes (``output`` returns the relay), so a predecessor
  withholding every forward costs the job one stall, not one per step. A stage that gets a step
  twice refuses the second copy, which the pipeline does not count against it.

A usable output is one of the route's dtype and width; in star, under its stage's own signature
too. The pipeline decides that before it feeds it here. A ring tap's signature is checked before a
relay hands it on (``Pipeline._forged_tap``): a forged tap is blamed on the stage that tapped it.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker_agent.protocol import wire

Key = tuple[str, int]  # (session, step)


@dataclass(frozen=True)
class Relay:
    """Hand ``forward`` to ``stage`` over the coordinator's own link to it."""

    stage: int  # route position of the stage that is to compute it
    forward: wire.Forward  # its predecessor's output for one step: one item, its bytes and signature


@dataclass(frozen=True)
class Blame:
    """``stage`` put out nothing for the step, though it had its input from the coordinator."""

    stage: int  # route position


@dataclass
class _Step:
    moved_at: float  # when the step last made progress (event-loop seconds)
    reached: int = 0  # stages that have put out a usable part of it so far, in route order
    output: wire.Forward | None = None  # the last of those parts (ring): what a stall relays
    relayed_to: int | None = None  # the stage a stall relayed it to, if any


class StallWatch:
    """The progress of one route's steps in flight; see the module's docstring."""

    def __init__(self, job: str, stages: int, *, ring: bool) -> None:
        self.job = job
        self.stages = stages
        self.ring = ring
        self._steps: dict[Key, _Step] = {}
        self.disputed: set[int] = set()  # stages relayed an input by a stall: relayed every one since

    def start(self, key: Key, now: float) -> None:
        """A step was sent to the first stage at ``now``."""
        self._steps[key] = _Step(now)

    def end(self, key: Key) -> None:
        """The step is done (answered, failed or abandoned): forget it."""
        self._steps.pop(key, None)

    def moved_at(self, key: Key) -> float:
        """When the step, started and not ended, last made progress."""
        return self._steps[key].moved_at

    def waiting_on(self, key: Key) -> int:
        """The stage the step, started and not ended, waits on: the first that put out nothing for it."""
        return min(self._steps[key].reached, self.stages - 1)

    def output(self, index: int, item: wire.Item, dtype: str, chunk: bytes, now: float) -> Relay | None:
        """Stage ``index`` put out a usable ``chunk`` (one item's bytes, ``dtype``) for a step, at
        ``now``: progress. Returns the relay to make now when its successor is disputed."""
        step = self._steps.get((item.session, item.step))
        if step is None or index + 1 <= step.reached:
            return None
        step.reached, step.moved_at = index + 1, now
        if not self.ring:
            return None
        width = len(chunk) // (item.count * wire.DTYPES[dtype].itemsize)
        step.output = wire.Forward(self.job, (item,), dtype, (item.count, width), chunk)
        return Relay(index + 1, step.output) if index + 1 in self.disputed else None

    def stalled(self, key: Key, now: float) -> Relay | Blame:
        """The step made no progress for the stall timeout, at ``now``: relay its last output to the
        next stage, or blame that stage (see the module's docstring)."""
        step = self._steps[key]
        stage = min(step.reached, self.stages - 1)
        if not self.ring or step.output is None or step.relayed_to == stage:
            return Blame(stage)
        step.relayed_to, step.moved_at = stage, now
        self.disputed.add(stage)
        return Relay(stage, step.output)
