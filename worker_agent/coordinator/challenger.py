# Over 500 lines: a challenge job end to end (route, paced stand-ins, grading), one flow.
"""A challenge run as a job: the verifier drives a real job through a route in which the challenged
node serves its own span and every other span is served by a node the verifier trusts
(``TrustedStage``: one that serves customers' jobs too) or by a stand-in.

A stand-in is an ordinary ``Stage`` on an ordinary ``StageServer``, run by the verifier on its own
trusted copy of that span's block. So everything the challenged node sees is made by the code that
makes it for a customer's job (``worker_agent/dev/observed.py`` lists what that is): the job's
``Coordinator`` HELLOs it in ``ring`` topology with a ticket like a job's, a successor's URL and peer
pass where its span is not the last, a predecessor (the stage before it) connects to it as a ring
peer and FORWARDs real activations of the layers before its span, signed as every stage signs what it
sends on; it forwards its outputs to the stage after it and taps them to the coordinator, which
samples from the real final hidden states, drafts and speculates as it does for any request. The
stand-in that feeds the node keeps to the times of the model's recent real jobs (``Pace``, recorded
by ``StepTimes``), so the node's inputs come when they come in a job. A stand-in is still the
verifier's node at the verifier's address (``worker_agent/dev/observed.py`` says what a node can learn
from that); a trusted node is not::

    route = ChallengeRoute("tiny-llama", node=StageAssignment(...), url="ws://...",
                           others=(StandIn(block_0_2, key_a), TrustedStage(StageAssignment(...), "wss://...")))
    run = await run_challenge_job(route, request, job="chatcmpl-...", tickets=sign, issuer_key=pub,
                                  coordinator_key=SigningKey.generate(), timeout_s=60,
                                  pace=Pace(per_token_s=0.08))
    run.material  # the node's exact inputs and outputs, step by step, which its receipt signed

The node's output is graded like an audited stage's: ``run.material`` is checked against the node's
signed receipt here, and the verifier replays it on its trusted block (``audit.recompute``). Its
inputs come from the stage before it, the verifier's or a trusted node, never from the node itself.

A memory challenge is one job of several sessions (``run_challenge_job`` with several requests): it
fills them one after the other, each one's prompt prefilled before the next session opens, so the
node holds all of them at once; then every session decodes, each step attending over its whole
prompt. The node's outputs of those last steps, replayed like any other, show it held every position
it accepted: a cache it dropped, cut short or recomputed from less gives other outputs. A refusal for
room or a session it dropped (``HOLD_CODES``) raises ``HoldRefused`` with the positions it was asked
to hold by then, the refused step's included.

Any failure raises. The node's own (``NodeFailed``, a ``StageError`` or ``ReceiptError`` naming it):
it cannot be reached, refuses, errs, stalls, misses the deadline (``DEADLINE``), signs no receipt or
a false one, or leaves its outputs short. Anything else is the verifier's (``ChallengeError`` with
code ``challenge_verifier``), and says nothing about the node.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import random
import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nacl.signing import SigningKey

from worker_agent.block import Block
from worker_agent.coordinator.job import Coordinator
from worker_agent.coordinator.pipeline import Pipeline, StageSpec
from worker_agent.coordinator.result import GenerationResult
from worker_agent.coordinator.sampling import SamplingParams
from worker_agent.coordinator.speculation import SpeculationSettings
from worker_agent.errors import AuditError, ChallengeError, ReceiptError, StageError, SwarmError
from worker_agent.protocol.audit import AuditMaterial, check_hashes
from worker_agent.protocol.receipts import Receipt, StageAssignment
from worker_agent.protocol.span import Span
from worker_agent.server import StageServer
from worker_agent.stage import Stage

DEADLINE = "challenge_deadline"  # the StageError code of a session that did not end in time
VERIFIER = "challenge_verifier"  # the ChallengeError code of a failure that is not the node's
STAND_IN_START_S = 10.0  # a stand-in's server must be listening within this
# The codes of a stage that cannot hold a session's positions: no room (worker_agent.kvcache), or a
# session it no longer has although its coordinator is still using it.
HOLD_CODES = frozenset(
    {"kv_memory_full", "too_many_sessions", "session_too_long", "session_evicted", "unknown_session"}
)


class NodeFailed(ChallengeError):
    """The challenged node did not serve its span of the job right; ``cause`` is the error seen."""

    code = "challenge_node_failed"

    def __init__(self, message: str, *, cause: SwarmError) -> None:
        super().__init__(message, code=cause.code)
        self.cause = cause


class HoldRefused(NodeFailed):
    """The challenged node refused, or dropped, positions of a memory challenge (``HOLD_CODES``)."""

    def __init__(self, message: str, *, cause: SwarmError, asked: int) -> None:
        super().__init__(message, cause=cause)
        self.asked = asked  # positions its sessions were sent by then, over all of them, the refused step's included


@dataclass(frozen=True)
class StandIn:
    """A span the verifier serves itself in the challenge's route."""

    block: Block  # the verifier's trusted block of the span
    signing_key: SigningKey  # its node key: it signs its receipts and every item it sends on


@dataclass(frozen=True)
class TrustedStage:
    """A span served in the challenge's route by a node the verifier trusts, one that also serves
    customers' jobs: next to it, the challenged node has the neighbours a real job gives it (their
    identities, addresses, load and pace)."""

    assignment: StageAssignment  # the trusted node, its key and its span
    url: str  # its data-plane URL


@dataclass(frozen=True)
class Pace:
    """How fast the model's recent real jobs went, for the stand-in that feeds the node (its
    predecessor, or the last stage when the node is the first). A stand-in is dedicated to one job and
    would answer faster than the shared, loaded stages of real routes, so the node would see its
    inputs come sooner and closer together than in a job. So it holds its outputs back:

    - with ``firsts_s`` and ``gaps_s`` at its position (``StepTimes`` records them for any job), to
      times drawn from the jobs', matched to its own: a session's first output as its own time so far
      ranks among its own first outputs of recent challenges, the same rank among the jobs' first
      outputs (counted from the coordinator beginning to connect); each later output likewise, its
      own gap since its last output ranked among its own recent gaps, the jobs' gap of that rank. The
      node's inputs then come as in the jobs, however each step went (a prefill, a plain step, a
      draft, a chunk sent back to back), as long as the stand-in is the faster;
    - without (or before it has timed enough challenges of its own), each step after a session's
      first by what the rest of the route takes short of ``per_token_s``, on average over the
      session's steps so far: the steps come at the copied job's mean pace, as unevenly as the route
      makes them.

    Holds only delay: where a stand-in is slower than the jobs' stages, the node sees it slower."""

    per_token_s: float  # the copied job's time per token after the first: one decode step around the route
    # Per stage of the jobs' routes, in layer order: its first output of each job's session, in seconds
    # from the coordinator beginning to connect; and the gaps between its outputs of consecutive steps.
    firsts_s: tuple[tuple[float, ...], ...] = ()
    gaps_s: tuple[tuple[float, ...], ...] = ()


class StepTimes:
    """When each stage of a job's route put out each step of a session, as its coordinator sees it (a
    ring stage's tap, the last stage's answer), in seconds from this watch's start. Made on the
    coordinator's pipeline just before it connects, so that the clock starts with its HELLOs::

        coordinator = Coordinator(model, specs, ...)
        times = StepTimes(coordinator.pipeline)
        async with coordinator:
            ...
        times.outputs(session)  # per stage, per step, in seconds

    The outputs of the stage before a node are that node's inputs: the times of recent jobs' are
    what a challenge's stand-in keeps to (``Pace``; ``verification.traffic`` draws them)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._started = time.monotonic()
        self._stages = len(pipeline.links)
        self._outputs: dict[tuple[int, str], dict[int, float]] = {}  # (stage, session) -> step -> seconds
        on_result = pipeline.on_result

        def timed_on_result(index: int, result) -> None:
            now = time.monotonic() - self._started
            for item in result.items:
                self._outputs.setdefault((index, item.session), {}).setdefault(item.step, now)
            on_result(index, result)

        pipeline.on_result = timed_on_result  # type: ignore[method-assign]

    def outputs(self, session: str) -> tuple[tuple[float, ...], ...]:
        """Per stage, in route order, when it put out each step of ``session``, up to the first step
        it did not."""
        outputs = []
        for stage in range(self._stages):
            times = self._outputs.get((stage, session), {})
            outputs.append(tuple(times[step] for step in itertools.takewhile(times.__contains__, itertools.count())))
        return tuple(outputs)


@dataclass(frozen=True)
class ChallengeRoute:
    model: str  # the model id
    node: StageAssignment  # the challenged node: its id, registered key and span
    url: str  # its data-plane URL
    # Every other span of the route, served by a stand-in or a trusted node; with the node's they tile the model.
    others: tuple[StandIn | TrustedStage, ...]


@dataclass(frozen=True)
class ChallengeRequest:
    """What the challenge's job asks for, as a customer's request would (``Coordinator.request_ids``)."""

    prompt_ids: tuple[int, ...]  # the prompt, tokenized as the API tokenizes a customer's
    max_tokens: int  # completion tokens at most
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculate: bool = True  # speculative decoding where it pays, as the API's default


@dataclass(frozen=True)
class ChallengeRun:
    material: AuditMaterial  # the node's inputs and outputs, step by step, as its receipt signed them
    receipt: Receipt  # the node's signed receipt for the session
    # The node's share of the job: per step, from its input leaving the stage before it (or the
    # coordinator) to its output arriving at the coordinator; summed over the steps (and sessions).
    elapsed_s: float
    materials: tuple[AuditMaterial, ...] = ()  # every session's, in order (the first is ``material``)


OWN_TIMES = 200  # a paced stand-in's own recent times its holds are matched by
MIN_OWN_TIMES = 20  # ... and how many it needs before it matches the jobs' times
LATE_GAIN = 0.1  # how much of an output's lateness (at most LATE_STEP_S) the next ones are released earlier
LATE_STEP_S = 0.05


class _OwnTimes:
    """A feeding stand-in's own times over the recent challenges of its span: without holds, how long
    from the coordinator beginning to connect to its first output being computed (``firsts``), and from
    one output going out to the next one being computed (``gaps``); and how long before the time drawn
    for an output it is released, for it to go out then on the whole (``first_early``, ``gap_early``:
    sending takes time, a first output's opening the link to the node too, and an output computed
    after its time goes out late)."""

    def __init__(self) -> None:
        self.firsts: deque[float] = deque(maxlen=OWN_TIMES)
        self.gaps: deque[float] = deque(maxlen=OWN_TIMES)
        self.first_early = 0.0
        self.gap_early = 0.0

    def went_out(self, step: int, late: float) -> None:
        """An output went out ``late`` seconds after its drawn time (early where negative)."""
        change = LATE_GAIN * max(-LATE_STEP_S, min(LATE_STEP_S, late))
        if step == 0:
            self.first_early += change
        else:
            self.gap_early += change


_OWN: dict[Span, _OwnTimes] = {}  # a stand-in's stage -> its times


def _matched(own: float, mine: Sequence[float], theirs: Sequence[float], rng: random.Random) -> float | None:
    """The value of ``theirs`` at ``own``'s rank among ``mine`` (quantile matching); None without
    enough of either."""
    if len(mine) < MIN_OWN_TIMES or not theirs:
        return None
    ranked = sorted(mine)
    rank = (bisect.bisect_left(ranked, own) + rng.random()) / (len(ranked) + 1)
    values = sorted(theirs)
    return values[min(int(rank * len(values)), len(values) - 1)]


class _PacedStage(Stage):
    """The stand-in's stage that feeds the node, holding each session's outputs to a pace (``Pace``).
    Holds are waited out in its compute thread, before the output goes on (and before the link to the
    node opens, as a real stage's first output's time includes opening it); ``_PacedServer`` tells
    it when each output went."""

    def __init__(self, *args, pace: Pace, position: int, successor: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pace, self.successor = pace, successor
        self.firsts = pace.firsts_s[position] if position < len(pace.firsts_s) else ()
        self.gaps = pace.gaps_s[position] if position < len(pace.gaps_s) else ()
        self.own = _OWN.setdefault(self.span, _OwnTimes())
        self.started = time.monotonic()  # when the job's coordinator began to connect (``start``)
        self._random = random.Random()
        self._drawn: dict[tuple[str, str, int], float] = {}  # (job, session, step) -> when it was to go out
        self._sent: dict[tuple[str, str], float] = {}  # (job, session) -> when its last step went out
        # (job, session) -> the time the rest of the route took, summed over its steps so far, and how many
        self._route: dict[tuple[str, str], tuple[float, int]] = {}

    def start(self) -> None:
        """The job's coordinator is about to connect: the first output's time counts from now."""
        self.started = time.monotonic()

    def compute(self, batch):
        started = time.monotonic()
        outputs = super().compute(batch)
        computed = time.monotonic()
        until = 0.0  # the monotonic time the outputs are held until
        keys = []
        for prepared in batch:
            for item in prepared.forward.items:
                key = (prepared.forward.job, item.session)
                keys.append((*key, item.step))
                if item.step == 0:
                    own = computed - self.started
                    drawn = _matched(own, self.own.firsts, self.firsts, self._random)
                    self.own.firsts.append(own)
                    if drawn is not None:
                        self._drawn[(*key, item.step)] = self.started + drawn
                        until = max(until, self.started + drawn - self.own.first_early)
                    continue
                if key not in self._sent:
                    continue  # its step before has not gone out (a chunk sent back to back with it)
                own = computed - self._sent[key]
                drawn = _matched(own, self.own.gaps, self.gaps, self._random)
                self.own.gaps.append(own)
                if drawn is not None:
                    self._drawn[(*key, item.step)] = self._sent[key] + drawn
                    until = max(until, self._sent[key] + drawn - self.own.gap_early)
                else:
                    total, steps = self._route.get(key, (0.0, 0))
                    total, steps = total + started - self._sent[key], steps + 1
                    self._route[key] = (total, steps)
                    until = max(until, started + self.pace.per_token_s - total / steps)
        # The compute thread of this stand-in's own server: waiting here holds up nothing else.
        time.sleep(max(0.0, until - time.monotonic()))
        if not self.successor:  # its outputs are the coordinator's answers, not tapped: gone as good as now
            for key in keys:
                self.went_out(*key)
        return outputs

    def went_out(self, job: str, session: str, step: int) -> None:
        """The step's output went on (to the node, or to the coordinator) now."""
        now = time.monotonic()
        drawn = self._drawn.pop((job, session, step), None)
        if drawn is not None:
            self.own.went_out(step, now - drawn)
        self._sent[(job, session)] = now


class _PacedServer(StageServer):
    """The server of the stand-in that feeds the node: tells its stage when each output went on (a
    tap follows its output to the node; an output to the coordinator is its own answer)."""

    def __init__(self, stage: _PacedStage, **kwargs) -> None:
        super().__init__(stage, **kwargs)
        self.paced = stage

    async def send_tap(self, coordinator, tap) -> None:
        for item in tap.items:
            self.paced.went_out(tap.job, item.session, item.step)
        await super().send_tap(coordinator, tap)


class _StepClock:
    """Times the challenged stage's share of each step from the traffic the coordinator sees: a
    step's input leaves when the stage before it taps it (or the coordinator sends it, at stage 0),
    and its output is back when the challenged stage's tap or RESULT arrives."""

    def __init__(self, challenged: int) -> None:
        self.challenged = challenged
        self._left: dict[tuple[str, int], float] = {}
        self._back: dict[tuple[str, int], float] = {}
        self.asked: dict[str, int] = {}  # session -> positions its steps so far reach

    def watch(self, pipeline: Pipeline) -> None:
        """Wrap the pipeline's send and receive ends of each step with this clock."""
        send, on_result = pipeline.send, pipeline.on_result

        async def timed_send(steps: list[tuple[str, int, int, bytes]]) -> list[int]:
            left = time.perf_counter()
            numbers = await send(steps)
            for (session, start, count, _), step in zip(steps, numbers, strict=True):
                self.asked[session] = max(self.asked.get(session, 0), start + count)
                if self.challenged == 0:
                    self._left.setdefault((session, step), left)
            return numbers

        def timed_on_result(index: int, result) -> None:
            now = time.perf_counter()
            stamps = self._left if index == self.challenged - 1 else self._back if index == self.challenged else None
            if stamps is not None:
                for item in result.items:
                    stamps.setdefault((item.session, item.step), now)
            on_result(index, result)

        pipeline.send = timed_send  # type: ignore[method-assign]
        pipeline.on_result = timed_on_result  # type: ignore[method-assign]

    def elapsed(self, session: str) -> float:
        return sum(
            max(0.0, back - self._left[key])
            for key, back in self._back.items()
            if key[0] == session and key in self._left
        )


async def _serve_stand_ins(
    route: ChallengeRoute,
    issuer_key: bytes,
    host: str,
    peer_tls: ssl.SSLContext | None,
    pace: Pace | None,
    stop: asyncio.Future,
) -> tuple[list[asyncio.Task], list[tuple[StageAssignment, str]], _PacedStage | None]:
    """Start a server for every stand-in; returns their tasks, (assignment, url) of every other
    stage, the trusted ones too, and the stage of the stand-in that keeps to ``pace``, if any."""
    tasks, served, paced = [], [], None
    spans = sorted([_span(other) for other in route.others] + [(route.node.layer_start, route.node.layer_end)])
    # The stage that feeds the node: its predecessor, or the last stage when the node is the first.
    feeder = max(
        route.others,
        key=lambda other: (_span(other)[1] == route.node.layer_start, _span(other)[1]),
        default=None,
    )
    for stand_in in route.others:
        if isinstance(stand_in, TrustedStage):
            served.append((stand_in.assignment, stand_in.url))
            continue
        key, model, trusted = stand_in.signing_key, route.model, [issuer_key]
        if pace is not None and stand_in is feeder:
            position = spans.index(_span(stand_in))
            paced = _PacedStage(
                stand_in.block, pace=pace, position=position, successor=position + 1 < len(spans), model=model,
                signing_key=key, trusted_keys=trusted,
            )  # fmt: skip
            stage: Stage = paced
            server: StageServer = _PacedServer(paced, peer_tls=peer_tls)
        else:
            stage = Stage(stand_in.block, model=model, signing_key=key, trusted_keys=trusted)
            server = StageServer(stage, peer_tls=peer_tls)
        bound = asyncio.get_running_loop().create_future()
        tasks.append(asyncio.create_task(server.serve(host, 0, ready=bound.set_result, stop=stop)))
        port = await asyncio.wait_for(bound, STAND_IN_START_S)
        assignment = StageAssignment(stage.node, stage.node_key, stage.layer_start, stage.layer_end)
        served.append((assignment, f"ws://{host}:{port}"))
    return tasks, served, paced


def _span(stage: StandIn | TrustedStage) -> tuple[int, int]:
    if isinstance(stage, TrustedStage):
        return stage.assignment.layer_start, stage.assignment.layer_end
    return stage.block.weights.layer_start, stage.block.weights.layer_end


def _in_layer_order(
    route: ChallengeRoute, others: Sequence[tuple[StageAssignment, str]]
) -> tuple[list[tuple[StageAssignment, str]], int]:
    """The route's stages in layer order and the challenged node's position; raises ChallengeError
    (the verifier's) unless they tile the model from layer 0 without gap or overlap."""
    stages = sorted([*others, (route.node, route.url)], key=lambda stage: stage[0].layer_start)
    position = 0
    for assignment, _ in stages:
        if assignment.layer_start != position:
            raise ChallengeError(f"the challenge's route does not tile the model at layer {position}", code=VERIFIER)
        position = assignment.layer_end
    return stages, [assignment for assignment, _ in stages].index(route.node)


async def run_challenge_job(
    route: ChallengeRoute,
    request: ChallengeRequest | tuple[ChallengeRequest, ...],
    *,
    job: str,
    tickets: Callable[[StageAssignment], bytes],
    issuer_key: bytes,
    coordinator_key: SigningKey,
    timeout_s: float,
    host: str = "127.0.0.1",
    tls: ssl.SSLContext | None = None,
    peer_tls: ssl.SSLContext | None = None,
    speculation: SpeculationSettings | None = None,
    stall_timeout_s: float = 10.0,
    pace: Pace | None = None,
) -> ChallengeRun:
    """Run ``request`` as job ``job`` through the node and the stand-ins of ``route``, as the
    coordinator holding ``coordinator_key``. ``tickets`` signs each stage's ticket (the stand-ins
    trust ``issuer_key``, which signs them), ``host`` is the address the stand-ins listen on and the
    challenged node reaches its successor at; ``tls`` is the coordinator's client context and
    ``peer_tls`` the one a stand-in reaches a ``wss://`` node with; the stand-ins keep to ``pace``.
    The whole job, from the first connection to the receipts, must end within ``timeout_s``. Several
    requests: a memory challenge, one session each, held at once (see the module)."""
    stop = asyncio.get_running_loop().create_future()
    tasks: list[asyncio.Task] = []
    try:
        tasks, others, paced = await _serve_stand_ins(route, issuer_key, host, peer_tls, pace, stop)
        stages, challenged = _in_layer_order(route, others)
        try:
            # In this task, not a task of its own (as ``asyncio.wait_for`` would run it): a job's
            # coordinator runs in its caller's task, and on a busy event loop the node saw the first
            # input of a job run in a task apart come some 20 ms later than a job's (measured with
            # tests/test_challenge_indistinguishable.py's route).
            async with asyncio.timeout(timeout_s):
                return await _run(
                    route, request, stages, challenged, job, tickets, coordinator_key, tls, speculation,
                    stall_timeout_s, paced,
                )  # fmt: skip
        except TimeoutError:
            cause = StageError("the job did not end by the challenge's deadline", code=DEADLINE, stage=challenged)
            raise NodeFailed(str(cause), cause=cause) from None
    finally:
        if not stop.done():
            stop.set_result(None)
        for task in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, STAND_IN_START_S)


async def _run(
    route: ChallengeRoute,
    request: ChallengeRequest | tuple[ChallengeRequest, ...],
    stages: list[tuple[StageAssignment, str]],
    challenged: int,
    job: str,
    tickets: Callable[[StageAssignment], bytes],
    coordinator_key: SigningKey,
    tls: ssl.SSLContext | None,
    speculation: SpeculationSettings | None,
    stall_timeout_s: float,
    paced: _PacedStage | None,
) -> ChallengeRun:
    assignments = [assignment for assignment, _ in stages]
    specs = [StageSpec(url, tickets(assignment), node=assignment.node) for assignment, url in stages]
    clock = _StepClock(challenged)
    requests = request if isinstance(request, tuple) else (request,)
    coordinator = Coordinator(
        route.model,
        specs,
        job=job,
        topology="ring",
        assignments=assignments,
        audit_stages=(challenged,),
        stall_timeout_s=stall_timeout_s,
        coordinator_key=coordinator_key,
        speculation=speculation,
        tls=tls,
    )
    if paced is not None:
        paced.start()  # the copied times count from the HELLOs, as a job's StepTimes do
    try:
        async with coordinator:
            clock.watch(coordinator.pipeline)
            streams = [
                coordinator.stream(
                    coordinator.request_ids(
                        one.prompt_ids, max_tokens=one.max_tokens, sampling=one.sampling, speculate=one.speculate
                    ),
                    strict=False,
                )
                for one in requests
            ]
            results = await _held(streams)
    except StageError as exc:
        if exc.stage == challenged and exc.code in HOLD_CODES and len(requests) > 1:
            asked = sum(clock.asked.values())
            raise HoldRefused(
                f"the challenged stage did not hold its sessions: {exc}", cause=exc, asked=asked
            ) from None
        if exc.stage == challenged:
            raise NodeFailed(f"the challenged stage failed: {exc}", cause=exc) from None
        raise ChallengeError(f"a stand-in or the coordinator failed: {exc} ({exc.code})", code=VERIFIER) from None
    runs = [_graded(route, result, challenged, clock.elapsed(result.session)) for result in results]
    return ChallengeRun(
        runs[0].material,
        runs[0].receipt,
        sum(run.elapsed_s for run in runs),
        tuple(run.material for run in runs),
    )


async def _held(streams: list) -> list[GenerationResult]:
    """Each stream's result. One stream is read through; several are filled one after the other, each
    up to its first token (its prompt is then held, and no session closes before all are filled), and
    then read through together."""
    firsts: list[GenerationResult | None] = []
    for stream in streams if len(streams) > 1 else []:
        event = await anext(stream)
        firsts.append(event if isinstance(event, GenerationResult) else None)
    firsts += [None] * (len(streams) - len(firsts))

    async def through(stream, result: GenerationResult | None) -> GenerationResult:
        async for event in stream:
            if isinstance(event, GenerationResult):
                result = event
        assert result is not None  # a stream ends with its result
        return result

    outcomes = await asyncio.gather(
        *(through(stream, first) for stream, first in zip(streams, firsts, strict=True)), return_exceptions=True
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return [outcome for outcome in outcomes if isinstance(outcome, GenerationResult)]


def _graded(route: ChallengeRoute, result: GenerationResult, challenged: int, elapsed_s: float) -> ChallengeRun:
    """The node's material, checked against its receipt; raises NodeFailed when it is the node's fault."""
    node = route.node.node
    cause: SwarmError
    # The stages around the node are trusted: a failure that names no one is the node's.
    if result.verification_error and result.verification_culprit in (node, None):
        cause = ReceiptError(f"the node's receipt does not verify: {result.verification_error}", node=node)
        raise NodeFailed(str(cause), cause=cause)
    if result.verification_error:  # a stand-in's receipt: the verifier's own stage broke
        raise ChallengeError(f"a stand-in's receipt failed: {result.verification_error}", code=VERIFIER)
    for gap in result.audit_missing:
        if gap.owed_by == challenged:
            cause = StageError(f"the challenged stage {gap.reason}", code="challenge_outputs_missing", stage=challenged)
            raise NodeFailed(str(cause), cause=cause)
        raise ChallengeError(f"the stand-in before the node {gap.reason}", code=VERIFIER)
    (material,) = result.audits
    receipt = next(receipt for receipt in result.receipts if receipt.node == node)
    try:
        check_hashes(material, receipt)
    except (AuditError, ReceiptError) as exc:
        raise NodeFailed(f"the node's receipt does not cover its traffic: {exc}", cause=exc) from None
    return ChallengeRun(material, receipt, elapsed_s)
