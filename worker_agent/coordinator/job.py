# Over 500 lines: Coordinator connects, streams, heals and verifies over one set of sessions.
"""A coordinator job: one pipeline of stages, any number of concurrent generation sessions.

    key = SigningKey.generate()  # the job's coordinator key; each stage's ticket names its public half
    async with Coordinator("smollm2-135m", [StageSpec(url, ticket), ...], coordinator_key=key) as coordinator:
        result = await coordinator.generate(coordinator.request("Hello", chat=True))

``request`` tokenizes a text prompt; ``request_ids`` takes one tokenized already (the control
plane tokenizes at admission, once, and hands the coordinator the ids).

Each session opens a KV cache on every stage, prefills, decodes (one token per pass, or, where
its router finds that speculation pays, chunks of drafts verified in one pass with several in
flight: ``session.py``, ``router.py``, ``speculation.py``), closes, and collects the stages'
signed receipts, which are verified (``verify_job``) against the stages' assigned spans and this
coordinator's own transcript before the result is reported.

With ``audit_stages`` (stage indices, chosen by the control plane) every session's result also
carries those stages' exact traffic as ``AuditMaterial``, for a trusted replay (``audit.py``);
the coordinator itself keeps none of it once the session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field

from nacl.signing import SigningKey

from worker_agent import model as models
from worker_agent.coordinator import prefix
from worker_agent.coordinator.drafters import Drafter
from worker_agent.coordinator.grammar import Constraint, JsonGrammar
from worker_agent.coordinator.head import HeadBatcher
from worker_agent.coordinator.heal import Healer, HealRecord, StageFailure
from worker_agent.coordinator.pipeline import STALL_TIMEOUT_S, CloseIncomplete, Pipeline, StageSpec
from worker_agent.coordinator.result import GenerationResult
from worker_agent.coordinator.router import PLAIN, Router, RouteTiming
from worker_agent.coordinator.sampling import SamplingParams
from worker_agent.coordinator.session import Chunk, GenerationRequest, GenerationState, TokenEvent
from worker_agent.coordinator.speculation import SpeculationSettings
from worker_agent.errors import ReceiptError, StageError
from worker_agent.protocol.coverage import JobVerification, verify_job
from worker_agent.protocol.keys import node_id
from worker_agent.protocol.links import Misconduct
from worker_agent.protocol.receipts import (
    BadSignature,
    MalformedReceipt,
    MissingReceipt,
    Receipt,
    SessionTranscript,
    StageAssignment,
)
from worker_agent.protocol.transport import DirectLink, LinkFactory

log = logging.getLogger("swarm.coordinator")
MAX_HEALS = 2  # heals one request may go through before it fails
HEALED_CLOSE_S = 2.0  # how long closing a job waits for the connections of routes it healed away from


def encode_prompt(tokenizer, prompt: str | list[dict], *, chat: bool) -> tuple[int, ...]:
    """A prompt's token ids: a string, or with ``chat=True`` chat messages ([{role, content}], a
    string being one user message) put through the model's chat template."""
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    return tuple(tokenizer(prompt)["input_ids"])


@dataclass
class _InFlight:
    """A chunk sent and not yet folded: its step's task and when it left and came back."""

    chunk: Chunk
    task: asyncio.Future
    sent: float  # event-loop time it was sent
    alone: bool  # nothing was in flight ahead of it: its round trip times the route
    burst: int  # the planning round that sent it: chunks of one burst are sent together
    drafter: str | None  # the drafter of its drafts; None for a plain step
    back: float = field(default=0.0)  # event-loop time its result arrived

    def arrived(self, task: asyncio.Future) -> None:
        self.back = asyncio.get_running_loop().time()


class Coordinator:
    def __init__(
        self,
        model: str,
        stages: list[StageSpec],
        *,
        job: str | None = None,
        topology: str = "ring",
        transport: LinkFactory = DirectLink,
        assignments: list[StageAssignment] | None = None,
        audit_stages: Collection[int] = (),
        healer: Healer | None = None,
        max_heals: int = MAX_HEALS,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        coordinator_key: SigningKey | None = None,
        speculation: SpeculationSettings | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.model = model
        self.tls = tls  # the swarm's client context for every route of the job (``Pipeline``'s ``tls``)
        self.speculation = speculation or SpeculationSettings()
        self._streams = 0  # sessions streaming now
        self._timing: RouteTiming | None = None  # the route's round trip and compute, shared by its sessions
        # The job's coordinator key: the stages' tickets name its public half, and every HELLO
        # (a heal's included) proves it. None only with agents that take no tickets.
        self.coordinator_key = coordinator_key
        self.model_id = models.model_name(model)
        self.job = job or f"job-{uuid.uuid4().hex[:16]}"
        self.topology = topology
        self.transport = transport  # makes the links of every route's stage connections, healed ones too
        self.stall_timeout_s = stall_timeout_s
        self._session_ids = itertools.count()  # shared by every route the job heals onto: ids never repeat
        self._peer_passes: dict[tuple[bytes, bytes], bytes] = {}  # likewise: a kept pair keeps its pass
        self.misconduct: list[Misconduct] = []  # breaches proven by their nodes' own signatures
        self.hidden_size = models.load_config(model).hidden_size  # the registry's, never a stage's word
        self.pipeline = self._pipeline(stages, audit_stages)
        self.pipeline.assignments = assignments
        self._assignments_from_hello = assignments is None
        self.healer = healer
        self.max_heals = max_heals
        self._heal_lock = asyncio.Lock()
        self._healed_away: list[Pipeline] = []  # routes left behind by heals, closing in the background
        self._closing: set[asyncio.Task] = set()
        self._preparing: asyncio.Task | None = None  # the healer getting ready, once the route is up
        self.head = models.load_head(model)
        self.tokenizer = models.load_tokenizer(model)
        self.n_layers = models.n_layers(model)
        self.receipts: list[Receipt] = []
        self._batcher: HeadBatcher | None = None

    @property
    def batcher(self) -> HeadBatcher:
        """The event loop's head batcher (shared with the loop's other coordinators)."""
        if self._batcher is None:
            self._batcher = HeadBatcher.shared(self.head, self.pipeline.dtype)
        return self._batcher

    def _pipeline(self, stages: list[StageSpec], audit_stages: Collection[int]) -> Pipeline:
        return Pipeline(
            self.job,
            stages,
            topology=self.topology,
            transport=self.transport,
            audit_stages=audit_stages,
            stall_timeout_s=self.stall_timeout_s,
            session_ids=self._session_ids,
            model=self.model_id,
            hidden_size=self.hidden_size,
            coordinator_key=self.coordinator_key,
            tls=self.tls,
            peer_passes=self._peer_passes,
            misconduct=self.misconduct,
        )

    async def __aenter__(self) -> Coordinator:
        try:
            try:
                await self._connect()
            except StageError as exc:  # a stage of the route is gone already: heal before the first token
                if not self._can_heal(exc):
                    raise
                await self._heal(self.pipeline, exc)
        except BaseException:
            await self.aclose()
            raise
        if self.healer is not None:  # ready for a failure before one happens, not after
            self._preparing = asyncio.create_task(self._prepare_healer(self.healer))
        return self

    async def _prepare_healer(self, healer: Healer) -> None:
        try:
            await healer.prepare()
        except Exception as exc:  # a heal then learns what it needs when it happens
            log.warning("job %s: the healer could not get ready: %r", self.job, exc)

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._preparing is not None:
            self._preparing.cancel()
        await self.pipeline.aclose()
        if self._closing:
            _, pending = await asyncio.wait(self._closing, timeout=HEALED_CLOSE_S)
            for task in pending:
                task.cancel()

    async def _connect(self) -> None:
        infos = await self.pipeline.connect()
        self._check_stages(infos)

    def _can_heal(self, exc: StageError) -> bool:
        return self.healer is not None and exc.stage is not None

    async def _heal(self, failed: Pipeline, exc: StageError) -> None:
        """Replace ``failed`` (the current route, whose stage ``exc.stage`` failed) by a connected
        route from the healer; a no-op when another session healed it already. A replacement that
        fails to connect is healed in turn, up to ``max_heals`` times; raises a StageError when no
        replacement is available or the bound is reached."""
        async with self._heal_lock:
            if self.pipeline is not failed:
                return
            error, attempts = exc, 0
            while True:
                attempts += 1
                if attempts > self.max_heals or not self._can_heal(error):
                    raise error
                await self._replace(self.pipeline, error)
                try:
                    await self._connect()
                    return
                except StageError as again:
                    error = again

    async def _replace(self, failed: Pipeline, error: StageError) -> None:
        assert self.healer is not None and error.stage is not None
        link = failed.links[error.stage]
        failure = StageFailure(
            stage=error.stage,
            node=link.info.get("node"),
            url=link.spec.url,
            layer_start=link.info.get("layer_start"),
            layer_end=link.info.get("layer_end"),
            code=error.code,
            message=str(error),
        )
        healed = await self.healer.replace(failure, [link.spec for link in failed.links])
        if healed is None:
            raise StageError(
                f"{error}; no replacement for stage {error.stage} is available", code=error.code, stage=error.stage
            )
        log.warning(
            "job %s: stage %d (%s) failed (%s); healed onto a new route",
            self.job,
            error.stage,
            link.spec.url,
            error.code,
        )
        if healed.assignments is None and not self._assignments_from_hello:
            # Fail closed: a route the control plane assigned is never swapped for the stages' own word.
            raise StageError(
                f"{error}; the healer named no assignments for its route", code=error.code, stage=error.stage
            )
        stages = list(healed.stages)
        audit = healed.audit_stages
        if audit is None:
            audit = tuple(stage for stage in failed.audit_stages if stage < len(stages))
        self.pipeline = self._pipeline(stages, audit)
        # None without a control plane: taken again from the new route's HELLOs.
        self.pipeline.assignments = list(healed.assignments) if healed.assignments is not None else None
        task = asyncio.ensure_future(failed.aclose())  # its survivors drop the job's old sessions
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _check_stages(self, infos: list[dict]) -> None:
        """The stages must serve this model and cover its layers in order, without gap or overlap."""
        position = 0
        for index, info in enumerate(infos):
            if info.get("model") != self.model_id:
                raise StageError(
                    f"stage {index} serves {info.get('model')!r}, not {self.model_id!r}",
                    code="wrong_model",
                    stage=index,
                )
            if info.get("layer_start") != position:
                raise StageError(
                    f"stage {index} starts at layer {info.get('layer_start')}, expected {position}",
                    code="bad_route",
                    stage=index,
                )
            if node_id(bytes.fromhex(info["node_key"])) != info.get("node"):
                raise StageError(
                    f"stage {index} reports a node id that is not its key's", code="bad_route", stage=index
                )
            position = info["layer_end"]
        if position != self.n_layers:
            raise StageError(f"the stages cover layers 0:{position} of {self.n_layers}", code="bad_route")
        if self.pipeline.assignments is None:  # no control plane: the stages' own HELLO is all there is to go by
            self.pipeline.assignments = [StageAssignment.from_json(info) for info in infos]

    def request(
        self,
        prompt: str | list[dict],
        *,
        chat: bool = False,
        max_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: tuple[str, ...] = (),
        speculate: bool = True,
    ) -> GenerationRequest:
        """Tokenize a prompt (a string, or chat messages with ``chat=True``) into a request."""
        ids = encode_prompt(self.tokenizer, prompt, chat=chat)
        return self.request_ids(ids, max_tokens=max_tokens, sampling=sampling, stop=stop, speculate=speculate)

    def request_ids(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: tuple[str, ...] = (),
        speculate: bool = True,
        logprobs: int | None = None,
        grammar: JsonGrammar | None = None,
        prefix_salt: bytes | None = None,
    ) -> GenerationRequest:
        """A request for a prompt tokenized already (``encode_prompt`` with this model's tokenizer);
        ``prefix_salt``: its account's, for prefix reuse (None: none)."""
        eos = self.tokenizer.eos_token_id
        return GenerationRequest(
            tuple(prompt_ids),
            max_tokens=max_tokens,
            sampling=sampling or SamplingParams(),
            stop=stop,
            eos_ids=frozenset([eos] if eos is not None else []),
            speculate=speculate,
            logprobs=logprobs,
            grammar=grammar,
            prefix_salt=prefix_salt,
        )

    async def stream(
        self, request: GenerationRequest, *, strict: bool = True
    ) -> AsyncGenerator[TokenEvent | GenerationResult, None]:
        """Yield each committed token as it comes, then the verified result. Receipts that fail
        verification raise (``strict``), or are reported in the result's ``verification_error``."""
        started = time.monotonic()
        constraint = None
        if request.grammar is not None:
            constraint = Constraint(request.grammar, self.tokenizer, self.head.lm_head.out_features)
        state = GenerationState(request, self.tokenizer, constraint=constraint)
        heals: list[HealRecord] = []
        pipeline = self.pipeline
        session = pipeline.new_session_id()
        closed = False
        drafters = self.speculation.drafters(self.model) if request.speculate else {}
        router = self._router(request, drafters)
        cached = 0  # prompt positions the session's stages held already (prefix reuse)
        self._streams += 1  # the sessions sharing the route's compute, which the routers price in
        try:
            while True:
                try:
                    # Prefix reuse hook: offered on the first route only (a healed one starts over from 0).
                    offered = prefix.offer(request, session, self.model_id) if not heals else None
                    cached = (await pipeline.open([session], offered))[session]
                    if cached:
                        state.start_at(cached)
                    async for event in self._decode(pipeline, session, state, router, drafters, heals, started):
                        yield event
                    break
                except StageError as exc:
                    if not self._can_heal(exc):
                        raise
                    if len(heals) >= self.max_heals:
                        raise StageError(
                            f"{exc} (the request was healed {len(heals)} times already, the most allowed)",
                            code=exc.code,
                        ) from exc
                    assert exc.stage is not None
                    link = pipeline.links[exc.stage]
                    heals.append(
                        HealRecord(exc.stage, link.info.get("node"), exc.code, str(exc), time.monotonic() - started)
                    )
                    pipeline.forget(session)
                    await self._heal(pipeline, exc)
                    heals[-1].reconnected = time.monotonic() - started
                    # The new route holds nothing of this session: it starts over, under a new id.
                    pipeline = self.pipeline
                    session = pipeline.new_session_id()
                    state.rewind()
                    cached = 0
            replies: list[tuple[dict, ...]] | None = None
            partial: list[tuple[dict, ...]] | None = None
            verification, verification_error, culprit = None, "", None
            try:
                replies = await pipeline.close_by_stage([session], prefix.keep(state, session, self.model_id))
                closed = True
            except StageError as exc:
                # Every token is out, and a stage's receipt did not come: its session was gone, or its
                # connection dropped or went silent before it answered CLOSE. The client has its
                # answer; the job cannot be verified, and the stage that owed the receipt is its
                # culprit (none when no stage answered: then the coordinator's own link is likelier).
                if strict:
                    raise
                verification_error = f"{exc} (lost before it sent its receipt; {exc.code})"
                culprit = pipeline.node_at(exc.stage) if exc.stage is not None else None
                partial = exc.replies if isinstance(exc, CloseIncomplete) else None
            audits, audit_missing = await pipeline.take_audits(session)
            receipts: list[Receipt] = []
            if partial is not None:  # the receipts that did come are the others' proof of their part
                receipts, _ = self._own_receipts(pipeline, session, partial)
            if replies is not None:
                receipts, refused = self._own_receipts(pipeline, session, replies)
                try:
                    if refused is not None:
                        raise refused
                    receipts, verification = self._verify(pipeline, session, receipts)
                except ReceiptError as exc:
                    if strict:
                        raise
                    # The receipts that are their signers' own stay: they are the evidence that
                    # decides the failure, and pay the stages whose work still verifies.
                    verification_error, culprit = f"{exc} ({exc.code})", exc.node
        finally:
            self._streams -= 1
            pipeline.forget(session)
            if not closed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pipeline.close([session]), 5)
        yield GenerationResult(
            session=session,
            text=state.text,
            token_ids=state.generated,
            prompt_tokens=len(request.prompt_ids),
            finish_reason=state.finish_reason or "length",
            token_times=state.token_times,
            elapsed=time.monotonic() - started,
            steps=state.steps,
            receipts=receipts,
            verification=verification,
            verification_error=verification_error,
            audits=audits,
            audit_missing=audit_missing,
            heals=heals,
            verification_culprit=culprit,
            drafted=state.drafted,
            accepted=state.accepted,
            speculation=state.speculation,
            cached_tokens=cached,
        )

    def _router(self, request: GenerationRequest, drafters: dict[str, Drafter]) -> Router:
        """The session's router: plain decoding when speculation is off, else over its drafters,
        with the fixed (drafter, K, depth) of the coordinator's settings if any."""
        costs = {name: drafter.cost_s_per_token for name, drafter in drafters.items()}
        if not (self.speculation.enabled and request.speculate and costs):
            return Router({}, fixed=PLAIN)
        stages = len(self.pipeline.links)
        if self._timing is None or self._timing.stages != stages:
            self._timing = RouteTiming(stages=stages)
        return Router(costs, fixed=self.speculation.fixed_plan(costs), timing=self._timing)

    async def _decode(
        self,
        pipeline: Pipeline,
        session: str,
        state: GenerationState,
        router: Router,
        drafters: dict[str, Drafter],
        heals: list[HealRecord],
        started: float,
    ) -> AsyncIterator[TokenEvent]:
        """Run one session on ``pipeline`` until it is done: send chunks as the router plans them
        (up to ``depth`` in flight), fold their results in send order, yield committed tokens.
        Chunks still in flight at the end (voided by a rejection or the stream's end) are awaited
        all the same: the stages computed and signed them, and the transcript must say so."""
        loop = asyncio.get_running_loop()
        flight: deque[_InFlight] = deque()
        bursts = itertools.count()
        previous: _InFlight | None = None  # the chunk folded last
        chain_drafter: str | None = None  # the drafter of the chain in flight
        try:
            while not state.done:
                burst = next(bursts)
                while True:
                    # Planned again for every chunk: a chain that keeps being accepted grows its K
                    # and depth as the acceptance estimate rises, without waiting for a rejection.
                    # A chain keeps the drafter that began it: a later chunk is worth what the chunks
                    # before it are (it is void if they are rejected), and another drafter's match
                    # on their drafts would be judged by an estimate they never earned.
                    ready = self._ready(drafters, state)
                    if state.in_flight:
                        ready = [name for name in ready if name == chain_drafter]
                    plan = router.plan(available=ready, sharing=self._streams, in_flight=state.in_flight)
                    if plan is None:
                        break  # as many chunks in flight as the plan keeps: wait for a result
                    if not state.in_flight:
                        chain_drafter = plan.drafter
                    drafts: list[int] = []
                    if plan.k and plan.drafter is not None and state.room_for_drafts():
                        drafter_used = drafters[plan.drafter]
                        drafts = await self._draft(drafter_used, state, min(plan.k, state.room_for_drafts()))
                    made = state.next_chunk(drafts)
                    if made is None:
                        break
                    chunk, tokens = made
                    payload = await self.batcher.embed(tokens)
                    entry = _InFlight(
                        chunk,
                        asyncio.ensure_future(pipeline.forward(session, chunk.start, chunk.count, payload)),
                        sent=loop.time(),
                        alone=len(flight) == 0,
                        burst=burst,
                        drafter=plan.drafter if drafts else None,
                    )
                    entry.task.add_done_callback(entry.arrived)
                    flight.append(entry)
                    if not drafts:
                        break  # a plain step: nothing is built on it before it comes back
                entry = flight.popleft()
                chunk = entry.chunk
                output = await entry.task
                entry.back = entry.back or loop.time()
                # Only a chunk sent with nothing ahead of it times a round trip: one sent behind
                # others also waits for them at every stage. One sent together with the chunk
                # before it (the same burst) times the busiest stage's service instead.
                if entry.alone:
                    router.observe_round_trip(chunk.count, entry.back - entry.sent)
                elif previous is not None and previous.burst == entry.burst:
                    router.observe_spacing(chunk.count, entry.back - previous.back)
                previous = entry
                rows = state.rows_needed(chunk)
                logits = await self.batcher.logits_rows(output, rows) if rows else None
                if heals and heals[-1].resumed is None:
                    heals[-1].resumed = time.monotonic() - started
                fold = state.fold(chunk, logits)
                if fold.drafted and entry.drafter is not None:
                    router.observe(entry.drafter, fold.drafted, fold.accepted)
                for event in fold.events:
                    yield event
            while flight:  # void chunks: their results are part of what the stages signed
                entry = flight.popleft()
                await entry.task
                state.fold(entry.chunk, None)
        finally:
            for entry in flight:
                entry.task.cancel()
            if flight:
                await asyncio.gather(*(entry.task for entry in flight), return_exceptions=True)
            state.speculation = router.to_json()

    @staticmethod
    def _ready(drafters: dict[str, Drafter], state: GenerationState) -> list[str]:
        """The drafters with something to propose this round (a stand-in only where the drafter it
        stands in for has nothing)."""
        if not state.room_for_drafts():
            return []
        context = state.draft_context()
        for drafter in drafters.values():
            drafter.observe(state.committed)
        ready = {name for name, drafter in drafters.items() if drafter.ready(context)}
        return sorted(name for name in ready if drafters[name].only_without not in ready)

    @staticmethod
    async def _draft(drafter: Drafter, state: GenerationState, k: int) -> list[int]:
        """Up to ``k`` drafts; ``_ready`` has fed the drafter the committed tokens this round."""
        context = state.draft_context()
        if drafter.cost_s_per_token:  # a model: off the event loop
            return await asyncio.to_thread(drafter.propose, context, k)
        return drafter.propose(context, k)

    @staticmethod
    def _own_receipts(
        pipeline: Pipeline, session: str, replies: list[tuple[dict, ...]]
    ) -> tuple[list[Receipt], ReceiptError | None]:
        """The stages' receipts for the session, in route order, and the first refusal: each stage's
        CLOSE reply must hold exactly its own receipt, readable and validly signed; anything else is
        that stage's doing (the ReceiptError names its node) and leaves its receipt out."""
        assignments = pipeline.assignments or []
        receipts: list[Receipt] = []
        refused: ReceiptError | None = None
        for index, reply in enumerate(replies):
            node = assignments[index].node if index < len(assignments) else None
            where = f"stage {index} (node {node})"
            try:
                try:
                    decoded = [Receipt.from_dict(raw) for raw in reply]
                except ReceiptError as exc:
                    raise MalformedReceipt(f"{where} sent an unreadable receipt: {exc}", node=node) from None
                if len(decoded) != 1 or (decoded[0].session, decoded[0].node) != (session, node):
                    raise MissingReceipt(f"{where} did not send its own receipt for session {session!r}", node=node)
                try:
                    decoded[0].verify_signature()
                except ReceiptError as exc:
                    raise BadSignature(f"{where}: {exc}", node=node) from None
            except ReceiptError as exc:
                refused = refused or exc
                continue
            receipts.append(decoded[0])
        return receipts, refused

    @property
    def assignments(self) -> list[StageAssignment] | None:
        """The current route's assignments."""
        return self.pipeline.assignments

    def _verify(
        self, pipeline: Pipeline, session: str, receipts: list[Receipt]
    ) -> tuple[list[Receipt], JobVerification]:
        """The session's receipts in route order (stage 0 first), once they prove its work; raises a
        ReceiptError subclass otherwise. The control plane stores them in this order and its audits
        find a stage's receipt by position.

        A healed request is proven by its last session alone: the route it healed onto re-ran the
        prompt and every committed token, so that session's receipts cover every layer of every
        position exactly once, each by the node assigned it on the healed route. The session it
        left is not verified: its dead stage never signed for it."""
        transcript = pipeline.transcripts[session]
        assignments = pipeline.assignments or []
        verification = verify_job(
            job=self.job,
            model=self.model_id,
            n_layers=self.n_layers,
            assignments=assignments,
            receipts=receipts,
            transcripts=[
                SessionTranscript(session, tuple(transcript.sent), tuple(transcript.received), transcript.start)
            ],
        )
        # Verified: each assigned node signed exactly one receipt for this session.
        position = {assignment.node: index for index, assignment in enumerate(assignments)}
        receipts = sorted(receipts, key=lambda receipt: position[receipt.node])
        self.receipts.extend(receipts)
        return receipts, verification

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = None
        async for event in self.stream(request):
            if isinstance(event, GenerationResult):
                result = event
        assert result is not None
        return result
