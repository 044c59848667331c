"""The coordinator's engine: one step loop that carries out the scheduler's plans for every session of a job.

    engine = Engine(head_runner)
    run = Run(pipeline, session, state, router, drafters)
    engine.add(run)
    async for event in run.events():   # TokenEvents, until the session is done or failed
        ...

Each turn of the loop (``_turn``):

1. asks the scheduler (``scheduler.plan``) what every session sends now, given its router, the
   drafters with something to propose and its chunks in flight;
2. drafts each sending session's chunks and appends them to its state (``GenerationState.next_chunk``);
3. embeds every chunk's tokens in one head pass, and sends the step's frames (frame j: the j-th
   chunk of every sending session, one FORWARD per route), so the stages compute all sessions'
   steps of a frame in one pass;
4. waits until some session's oldest chunk is back (or a session joins), computes the logits of
   every such chunk in one head pass and folds them in, in send order per session
   (``GenerationState.fold``), handing the committed tokens to that session's reader.

The timing each frame shows (a frame sent with nothing in flight on its route times a round
trip of its positions; the later frames of one step time the busiest stage's service) and the
acceptance each chunk shows go to the routers the scheduler plans with. Chunks voided by a
rejection or by the stream's end are awaited all the same: the stages computed and signed them,
and the transcript must say so. A session whose step fails (a StageError: a stage gone, stalled,
refusing) is dropped from the loop with its chunks in flight, and its reader gets the error; the
coordinator heals it and adds it again on the new route.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from worker_agent.coordinator import scheduler
from worker_agent.coordinator.drafters import Drafter
from worker_agent.coordinator.head import HeadRunner
from worker_agent.coordinator.pipeline import Pipeline
from worker_agent.coordinator.router import Router
from worker_agent.coordinator.session import Chunk, GenerationState, TokenEvent
from worker_agent.cpu import MODEL_CPU

log = logging.getLogger("swarm.coordinator")


@dataclass
class _Frame:
    """One FORWARD frame sent: the positions it carried, when it left, and when its chunks came back."""

    pipeline: Pipeline
    positions: int
    sent: float  # event-loop time it was sent
    alone: bool  # none of its sessions had a chunk in flight ahead of it: its round trip times the route
    step: int  # the engine turn that sent it
    index: int  # its place among that turn's frames
    waiting: int  # chunks of it not back yet
    previous: _Frame | None = None  # the frame sent just before it in the same step, on the same route
    prefill: bool = False  # it carries a session's first chunk (a prompt): its round trip times no decode step
    back: float = 0.0  # event-loop time its last chunk came back
    observed: bool = False


@dataclass
class _InFlight:
    chunk: Chunk
    task: asyncio.Future[bytes]
    frame: _Frame
    drafter: str | None  # the drafter of its drafts; None for a plain step


def _measured_proposal(drafter: Drafter, context: list[int], k: int) -> list[int]:
    with MODEL_CPU.measure("drafting"):
        return drafter.propose(context, k)


def ready_drafters(drafters: dict[str, Drafter], state: GenerationState, chain: str | None = None) -> list[str]:
    """The drafters with something to propose now (a stand-in only where the drafter it stands in
    for has nothing); while chunks fly, only ``chain``, the drafter of the chain in flight: a later
    chunk is worth what the chunks before it are, and another drafter's match on their drafts would
    be judged by an estimate they never earned."""
    if not state.room_for_drafts():
        return []
    context = state.draft_context()
    for drafter in drafters.values():
        drafter.observe(state.committed)
    ready = {name for name, drafter in drafters.items() if drafter.ready(context)}
    names = sorted(name for name in ready if drafters[name].only_without not in ready)
    if state.in_flight:
        names = [name for name in names if name == chain]
    return names


class Run:
    """One session on the engine: its state, router and drafters, its chunks in flight, and the
    queue its reader takes committed tokens from."""

    _keys = itertools.count()

    def __init__(
        self,
        pipeline: Pipeline,
        session: str,
        state: GenerationState,
        router: Router,
        drafters: dict[str, Drafter],
    ) -> None:
        self.key = next(self._keys)
        self.pipeline = pipeline
        self.session = session
        self.state = state
        self.router = router
        self.drafters = drafters
        self.flight: deque[_InFlight] = deque()
        self.chain_drafter: str | None = None  # the drafter of the chain in flight
        self.on_fold: list = []  # callbacks run once, at the first chunk folded (a heal's resumption)
        # True while its reader waits for a token: only then does it send more (its reader's pace
        # holds it back, as a generator's would; a challenge holds a session after its first token).
        self.asking = False
        self.wake: Callable[[], None] = lambda: None  # the engine's, once added
        self._queue: asyncio.Queue[TokenEvent | BaseException | None] = asyncio.Queue()

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The session's committed tokens as they fold; ends when it is done, raises its failure."""
        while True:
            if self._queue.empty():
                self.asking = True
                self.wake()
            try:
                item = await self._queue.get()
            finally:
                self.asking = False
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def view(self) -> scheduler.SessionView:
        return scheduler.SessionView(
            self.key,
            self.router,
            tuple(ready_drafters(self.drafters, self.state, self.chain_drafter)),
            self.state.in_flight,
            self._positions(),
        )

    def _positions(self) -> int:
        if self.state.sent == 0 and not self.state.in_flight:
            return len(self.state.chain)  # its next chunk is a prefill
        plan = self.router.last_plan
        return 1 if plan is None or plan.plain else plan.k + 1

    async def draft(self, name: str, k: int) -> list[int]:
        drafter, context = self.drafters[name], self.state.draft_context()
        if drafter.cost_s_per_token:  # a model: off the event loop
            return await asyncio.to_thread(_measured_proposal, drafter, context, k)
        return _measured_proposal(drafter, context, k)

    def put(self, item: TokenEvent | BaseException | None) -> None:
        self._queue.put_nowait(item)


class Engine:
    def __init__(self, head: HeadRunner) -> None:
        self.head = head
        self._runs: dict[int, Run] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._turns = itertools.count()
        self._tasks: set[asyncio.Future] = set()

    def add(self, run: Run) -> None:
        """Run a session (opened on its pipeline) until it is done or fails."""
        self._runs[run.key] = run
        run.wake = self._wake.set
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.ensure_future(self._loop())

    def drop(self, run: Run, error: BaseException | None = None) -> None:
        """Stop running ``run``: its chunks in flight are cancelled; its reader gets ``error`` if any."""
        if self._runs.pop(run.key, None) is None:
            return
        tasks = [entry.task for entry in run.flight]
        run.flight.clear()
        for task in tasks:
            task.cancel()
        if tasks:  # retrieve their outcomes, so none is reported as never retrieved
            gathered = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
            self._tasks.add(gathered)
            gathered.add_done_callback(self._tasks.discard)
        if error is not None:
            run.put(error)

    async def aclose(self) -> None:
        for run in list(self._runs.values()):
            self.drop(run, asyncio.CancelledError())
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    async def _loop(self) -> None:
        try:
            while self._runs:
                await self._turn()
        except Exception as exc:  # a fault of the engine's own: no reader is left waiting on it
            log.exception("the coordinator's engine failed")
            for run in list(self._runs.values()):
                self.drop(run, exc)

    async def _turn(self) -> None:
        self._wake.clear()
        await asyncio.sleep(0)  # the readers of what the last fold committed ask for more first
        await self._send(
            scheduler.plan([run.view() for run in self._runs.values() if run.asking and not run.state.done])
        )
        await self._wait()
        await self._fold()

    async def _send(self, plan: scheduler.StepPlan) -> None:
        """Draft, embed and send the step's chunks, frame by frame."""
        frames: list[list[tuple[Run, Chunk, list[int], str | None]]] = [[] for _ in range(plan.frames)]
        prefills: set[int] = set()  # the runs sending their prompt now
        for send in plan.sends:
            run = self._runs[send.key]
            if not run.state.in_flight:
                run.chain_drafter = send.plan.drafter
            for index in range(send.chunks):
                drafts: list[int] = []
                room = run.state.room_for_drafts()
                if send.plan.drafter is not None and room:
                    drafts = await run.draft(send.plan.drafter, min(send.plan.k, room))
                made = run.state.next_chunk(drafts)
                if made is None:
                    break
                if made[0].start == 0 or run.state.steps == 0:  # a prompt (a heal's re-prefill included)
                    prefills.add(run.key)
                frames[index].append((run, *made, send.plan.drafter if drafts else None))
                if not drafts:
                    break  # a plain step: nothing is built on it before it comes back
        chunks = [entry for frame in frames for entry in frame]
        payloads = iter(await self.head.embed([tokens for _, _, tokens, _ in chunks]))
        step = next(self._turns)
        loop = asyncio.get_running_loop()
        previous: dict[int, _Frame] = {}  # the step's last frame on each route
        for index, frame in enumerate(frames):
            by_pipeline: dict[int, list[tuple[Run, Chunk, bytes, str | None]]] = {}
            for run, chunk, _, drafter in frame:
                by_pipeline.setdefault(id(run.pipeline), []).append((run, chunk, next(payloads), drafter))
            for entries in by_pipeline.values():
                if not all(run.key in self._runs for run, *_ in entries):
                    continue  # dropped while drafting; its reader knows why
                pipeline = entries[0][0].pipeline
                alone = not any(run.flight for run, *_ in entries)
                positions = sum(chunk.count for _, chunk, _, _ in entries)
                sent = _Frame(pipeline, positions, loop.time(), alone, step, index, 0, previous.get(id(pipeline)))
                sent.prefill = any(run.key in prefills for run, *_ in entries)
                previous[id(pipeline)] = sent
                steps = await pipeline.send(
                    [(run.session, c.start, c.count, payload) for run, c, payload, _ in entries]
                )
                for (run, chunk, _, drafter), number in zip(entries, steps, strict=True):
                    task = asyncio.ensure_future(pipeline.result(run.session, number, chunk.count))
                    task.add_done_callback(functools.partial(self._back, sent))
                    sent.waiting += 1
                    run.flight.append(_InFlight(chunk, task, sent, drafter))

    def _back(self, frame: _Frame, _: asyncio.Future) -> None:
        frame.waiting -= 1
        frame.back = asyncio.get_running_loop().time()

    async def _wait(self) -> None:
        """Until some session's oldest chunk is back, or a session joins."""
        heads = [run.flight[0].task for run in self._runs.values() if run.flight]
        if any(task.done() for task in heads):
            return
        waker: asyncio.Future = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait([*heads, waker], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waker.cancel()

    async def _fold(self) -> None:
        """Fold in every session's oldest chunk that is back, in one head pass, until none is."""
        while True:
            ready: list[tuple[Run, _InFlight, bytes]] = []
            for run in list(self._runs.values()):
                if not (run.flight and run.flight[0].task.done()):
                    continue
                entry = run.flight.popleft()
                try:
                    ready.append((run, entry, entry.task.result()))
                except (asyncio.CancelledError, Exception) as exc:
                    self.drop(run, exc if isinstance(exc, Exception) else asyncio.CancelledError())
            if not ready:
                break
            rows = [run.state.rows_needed(entry.chunk) for run, entry, _ in ready]
            wanted = [(output, count) for (_, _, output), count in zip(ready, rows, strict=True) if count]
            logits = iter(await self.head.logits(wanted))
            for (run, entry, _), count in zip(ready, rows, strict=True):
                self._observe(run, entry)
                with MODEL_CPU.measure("sampling"):
                    fold = run.state.fold(entry.chunk, next(logits) if count else None)
                if fold.drafted and entry.drafter is not None:
                    run.router.observe(entry.drafter, fold.drafted, fold.accepted)
                for callback in run.on_fold:
                    callback()
                run.on_fold.clear()
                for event in fold.events:
                    run.put(event)
        for run in list(self._runs.values()):
            if run.state.done and not run.flight:
                run.state.speculation = run.router.to_json()
                del self._runs[run.key]
                run.put(None)

    @staticmethod
    def _observe(run: Run, entry: _InFlight) -> None:
        """Time the route by the frame whose chunk this is, once all of it is back: a frame sent with
        nothing in flight ahead of it times a round trip (unless it carries a prompt); a later frame
        of the same step, one service of the busiest stage after the frame before it."""
        frame = entry.frame
        if frame.waiting or frame.observed:
            return
        frame.observed = True
        # A prompt's pass is no decode step's: one long prefill would pass for the network's round
        # trip in a fit with no chunk yet, and price every draft out.
        if frame.alone and not frame.prefill:
            run.router.observe_round_trip(frame.positions, frame.back - frame.sent)
        elif frame.previous is not None and frame.previous.waiting == 0:
            run.router.observe_spacing(frame.positions, frame.back - frame.previous.back)
