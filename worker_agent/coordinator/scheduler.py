"""The coordinator's job-level scheduler: what every session of the job sends next, and how it is batched.

Each step the engine (``engine.py``) hands ``plan`` a view of every session it runs (its router,
the drafters that have something to propose, its chunks in flight, the positions it keeps in each
pass) and gets back a ``StepPlan``: which sessions send now, each with its plan (drafter, K drafts
per chunk, chunks in flight), and the frames they go in. It is plain arithmetic on what it is
given: no I/O, no clock, no randomness (the routers' exploration is counted, not drawn).

Pricing under load. A session's chunk rides in a pass together with every other session's
positions, so its round trip is priced with theirs (``Load.positions``), and a position it adds
beyond plain decoding delays each of them (``Load.cost``, through ``Router.rate``). Where the
passes are compute-bound, several streams' drafts cost more than they commit and the routers
choose plain decoding or a smaller K; with one stream over a long round trip the extra positions
are nearly free and speculation goes deep. Every plan must beat plain decoding by
``router.PLAIN_MARGIN`` at that price, so speculation is chosen only where it is predicted to win.

Batching. The chunks of one step go in frames: frame j holds the j-th chunk of every session
sending now (plain steps are all in frame 0), so all sessions' steps reach the stages together
and are computed in one pass, and a session's pipelined chunks reach them one frame apart, each
computed and passed on before the next. A session appears at most once per frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker_agent.coordinator.router import Load, Plan, Router


@dataclass(frozen=True)
class SessionView:
    """One session as the scheduler sees it."""

    key: int  # the engine's handle of the session
    router: Router  # its acceptance estimates, the route's timing and its exploration state
    ready: tuple[str, ...]  # the drafters with something to propose now (only the chain's own while chunks fly)
    in_flight: int  # its chunks sent and not yet folded
    positions: int  # positions it keeps in each pass: its chunks' size on average, 1 when decoding plainly


@dataclass(frozen=True)
class Send:
    """A session sending now: ``chunks`` chunks of its ``plan`` (drafted by ``plan.drafter``)."""

    key: int
    plan: Plan
    chunks: int  # chunks to send this step: 1 for a plain step, up to depth - in_flight when drafting


@dataclass(frozen=True)
class StepPlan:
    sends: tuple[Send, ...]

    @property
    def frames(self) -> int:
        """Frames this step sends: one per chunk of the session sending the most chunks."""
        return max((send.chunks for send in self.sends), default=0)

    def frame(self, index: int) -> tuple[int, ...]:
        """The sessions with a chunk in frame ``index``, in the order of ``sends``."""
        return tuple(send.key for send in self.sends if send.chunks > index)


def load_on(view: SessionView, views: Sequence[SessionView]) -> Load:
    """The load the other sessions put on ``view``'s passes: their positions per pass, and the
    tokens per second they commit, each at its plain rate under the same passes (a cautious
    figure: the others' own drafts commit more, and lose more to a delay)."""
    others = [other for other in views if other.key != view.key]
    positions = float(sum(other.positions for other in others))
    if not others:
        return Load()
    plain = view.router.rate(Plan(None, 0, 1), load=Load(positions=positions))
    return Load(positions=positions, rate=plain * len(others))


def plan(views: Sequence[SessionView]) -> StepPlan:
    """The next step: every session whose plan keeps more chunks in flight than it has sends now.

    A session with chunks in flight continues only its chain (its view's ``ready`` names only the
    chain's drafter); one whose plan keeps no more chunks in flight than it has waits for a result."""
    sends: list[Send] = []
    for view in views:
        chosen = view.router.plan(available=view.ready, load=load_on(view, views), in_flight=view.in_flight)
        if chosen is None:
            continue
        chunks = 1 if chosen.plain else chosen.depth - view.in_flight
        sends.append(Send(view.key, chosen, chunks))
    return StepPlan(tuple(sends))
