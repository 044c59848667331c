"""A node cannot tell a challenge from a customer's job by anything it observes.

Over the wire: an honest node serves layers 2:4 of tiny-llama, a middle span, in a StageServer that
records every HELLO, OPEN and FORWARD it accepts (``worker_agent.dev.observed``). Customers' jobs reach
it as the control plane's runner sends them: a Coordinator over a ring of three stages, with tickets
expiring with the job's deadline. Challenges reach it as the control plane runs them
(``worker_agent.coordinator.challenger``, the request drawn by ``verification.traffic`` from the jobs
served so far), with trusted nodes (the other two stages, which serve the customers too) around it,
or, in a second run, the verifier's own stand-ins. Both kinds run interleaved at random, a few at a
time, so they share the machine's load alike. SESSIONS of each kind are shared among WORLDS such
routes, each in a process of its own (one per core), each with its observed node; requests ask for a
few tokens (1 to COMPLETION_TOKENS), as short requests of the traffic do, so that 1,000 of each kind
take about a minute. A gradient-boosted classifier is trained on the features of every session the
nodes saw (``FEATURES``, and which node saw it) and scored out of fold: its ROC AUC must be at most
0.6. The same classifier separates the challenges this replaced (one-stage star sessions of Gaussian
rows, as the node saw them) from the same jobs with an AUC near 1, so the check can fail.

The stand-ins' run: the stand-in that feeds the node keeps to the times of the recent jobs
(``challenger.Pace``), which the test records of each job as the runner does (``StepTimes``, kept
with the job as ``traffic.kept_step_outputs`` keeps them, and read back by ``recent_shapes``). What
stand-ins cannot hide is not in the features (``observed.py``): their node ids and keys, the same at
every challenge, and the verifier's address.

At scale, without sockets: 1,000 customers' requests and 1,000 challenges' requests, as the node
sees what they decide (job id, prompt activations and lengths, completion length) through the same
tokenizing, drawing and layer code; the classifier's AUC must be at most 0.6 there too.

The customers' prompts and the challenges' prompt pool are two halves of one corpus, as an operator
writes SWARM_CHALLENGE_PROMPTS like their traffic: no text is in both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch
from nacl.signing import SigningKey
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold, cross_val_predict

from marketplace.nodes.tickets import issuer_key, issuer_public_key, job_ticket_expiry, ticket_for
from marketplace.verification.traffic import (
    RECENT_JOBS,
    TrafficShape,
    challenge_job_id,
    chat_turns,
    draw_request,
    kept_step_outputs,
)
from tests.challenge_fixtures import django_process
from worker_agent import model as models
from worker_agent.block import Block, WorkItem
from worker_agent.coordinator import pipeline
from worker_agent.coordinator.challenger import (
    MIN_OWN_TIMES,
    ChallengeRoute,
    StandIn,
    StepTimes,
    TrustedStage,
    run_challenge_job,
)
from worker_agent.coordinator.job import Coordinator, encode_prompt
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.coordinator.sampling import SamplingParams
from worker_agent.coordinator.speculation import SpeculationSettings
from worker_agent.dev.observed import FEATURES, Observer, SessionView, row_statistics
from worker_agent.kvcache import KVSession
from worker_agent.protocol import wire
from worker_agent.protocol.connection import AcceptHello, Dispatch, OpenSessions
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.protocol.receipts import StageAssignment
from worker_agent.protocol.span import Span
from worker_agent.server import StageServer
from worker_agent.stage import Stage

# Alone (``make test`` runs it after the rest): the timing a node observes of the verifier's stand-ins
# is only the verifier's own when no other test worker shares the machine with them.
pytestmark = [pytest.mark.trust, pytest.mark.alone]

MODEL = "tiny-llama"
SPANS = [(0, 2), (2, 4), (4, 6)]
NODE = 1  # the observed node's position: a middle span, with a predecessor and a successor
SESSIONS = 1000  # of each kind, over the wire
WORLDS = 2  # routes the sessions are shared among, each in a process of its own: one per core
AT_ONCE = 16  # sessions in flight at a time on each route
COMPLETION_TOKENS = 4  # the most a customer's request asks for
WARM_UP = 2 * AT_ONCE  # jobs run before any is observed
WARM_UP_CHALLENGES = 2 * MIN_OWN_TIMES  # and challenges, after them
MAX_AUC = 0.6
# The machine is shared with the rest of the suite, AT_ONCE sessions a route: what is measured here
# is what the node sees, not how fast it is, so no step is called stalled early (by the stall
# timeout, or by a PING answered late by a stage busy with the others' sessions).
STALL_TIMEOUT_S = 60.0
FOLDS = 5

# Texts of the kind customers send, many (a few dozen would give each half a vocabulary of its own).
# The customers' prompts are made of one half, the challenges' prompt pool is the other (as an
# operator writes SWARM_CHALLENGE_PROMPTS like their traffic): no text is in both.
TEMPLATES = (
    "How do I get started with {}?",
    "Can you explain {} in simple words?",
    "What are the most common mistakes people make with {}?",
    "Write a short poem about {}.",
    "Give me three tips for {}.",
    "What is the history of {}?",
    "Why do so many people care about {}?",
    "Summarize the pros and cons of {} in a few bullet points.",
    "I have a question about {}: where should I begin?",
    "Help me write an email to a friend about {}.",
    "What would a beginner need to know about {}?",
    "Compare {} with something similar and say which is better.",
    "Tell me a fun fact about {}.",
    "Plan a weekend around {} for two people.",
    "What books would you recommend about {}?",
    "Here is a quick overview of {}. Let me know which part you want me to go into.",
    "Great question! {} takes a little practice, but it is easy to learn.",
    "There are a few things to keep in mind about {}, and the most important one is consistency.",
    "Is {} worth the money for a student?",
    "Explain {} to a ten-year-old.",
)
TOPICS = (
    "baking sourdough bread", "learning the guitar", "saving for retirement", "running a marathon",
    "growing tomatoes on a balcony", "the French Revolution", "black holes", "Python decorators",
    "training a puppy", "writing a cover letter", "electric cars", "the water cycle", "chess openings",
    "meditation", "home insurance", "the Roman Empire", "machine learning", "knitting a scarf",
    "traveling in Japan", "public speaking", "climate change", "photosynthesis", "the stock market",
    "making pasta from scratch", "learning Spanish", "volcanoes", "SQL joins", "birdwatching",
    "painting with watercolors", "the Olympic Games", "renting a first apartment", "honeybees",
    "quantum computing", "camping in the rain", "healthy breakfasts", "jazz music", "the Moon landing",
    "budget travel", "indoor plants", "solar panels",
)  # fmt: skip
CORPUS = tuple(template.format(topic) for template in TEMPLATES for topic in TOPICS)


class ObservingServer(StageServer):
    """A stage server that records what its stage accepts, where the stage reads it."""

    def __init__(self, *args, observer: Observer, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.observer = observer

    async def _act(self, conn, action) -> bool:
        now = time.time()
        match action:
            case AcceptHello():
                self.observer.hello(action.hello, role=action.binding.role, now=now)
            case Dispatch():
                self.observer.frame(action.forward, role=str(conn.role), now=now)
            case OpenSessions():
                self.observer.frame(wire.Open(action.job, action.sessions), role=str(conn.role), now=now)
        return await super()._act(conn, action)


def customer_requests(rng: random.Random, texts: list[str], count: int) -> list[tuple[TrafficShape, str | list[dict]]]:
    """The customers' requests, made of ``texts``: (shape, prompt). Mostly chats of one to three
    turns, a sixth completions, a tenth further choices of an n > 1 request; each message of a drawn
    number of words, texts after one another (few prompts alike, as in real traffic); completions of
    1 to COMPLETION_TOKENS tokens."""

    def message() -> str:
        words: list[str] = []
        length = int(rng.lognormvariate(2.5, 0.7)) + 1
        while len(words) < length:
            words += rng.choice(texts).split()
        return " ".join(words[:length])

    requests = []
    for _ in range(count):
        kind = "cmpl" if rng.random() < 1 / 6 else "chatcmpl"
        choice = f"-{rng.randint(1, 3)}" if rng.random() < 0.1 else ""
        if kind == "cmpl":
            prompt: str | list[dict] = message()
        else:
            prompt = []
            for _ in range(rng.choice((0, 0, 0, 1, 2))):
                prompt += [{"role": "user", "content": message()}, {"role": "assistant", "content": message()}]
            prompt.append({"role": "user", "content": message()})
        shape = TrafficShape(
            f"{kind}-{'0' * 32}{choice}",
            prompt_tokens=0,  # set once tokenized
            completion_tokens=rng.randint(1, COMPLETION_TOKENS),
            temperature=rng.choice((0.0, 0.7, 1.0)),
            speculation=rng.random() < 0.9,
            turns=chat_turns(prompt),  # what the control plane reads of its stored messages
        )
        requests.append((shape, prompt))
    return requests


def ticket(job: str, stage: StageAssignment, coordinator_key: SigningKey, expires_at: float) -> bytes:
    return ticket_for(
        job=job,
        node=stage.node,
        span=Span(MODEL, stage.layer_start, stage.layer_end),
        coordinator_key=bytes(coordinator_key.verify_key),
        expires_at=expires_at,
    )


async def _serve(stage: Stage, server_class=StageServer, **kwargs) -> tuple[asyncio.Task, str]:
    bound = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server_class(stage, **kwargs).serve("127.0.0.1", 0, ready=bound.set_result))
    return task, f"ws://127.0.0.1:{await asyncio.wait_for(bound, 30)}"


@dataclasses.dataclass(frozen=True)
class Seen:
    """A session as one of the observed nodes saw it."""

    node: int  # which of the WORLDS observed nodes
    view: SessionView

    def features(self) -> dict[str, float]:
        """Its FEATURES, and the node that saw it (each node knows itself): OBSERVED."""
        return {**self.view.features(), "node": float(self.node)}


OBSERVED = (*FEATURES, "node")


def observe(seed: int, neighbours: str) -> tuple[list[Seen], list[Seen]]:
    """SESSIONS jobs and SESSIONS challenges as the observed nodes saw them: WORLDS routes, each with
    an observed node of its own, each in a process of its own (``observe_world``), share them."""
    from django.conf import settings

    issuer_key()  # the ticket key, made once for every process to read
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch's threads
    start = (settings.SETTINGS_MODULE, {"SWARM_TICKET_KEY_PATH": settings.SWARM_TICKET_KEY_PATH})
    jobs: list[Seen] = []
    challenges: list[Seen] = []
    with ProcessPoolExecutor(WORLDS, mp_context=context, initializer=django_process, initargs=start) as pool:
        worlds = [pool.submit(observe_world, seed + world, neighbours, SESSIONS // WORLDS) for world in range(WORLDS)]
        for world, future in enumerate(worlds):
            seen_jobs, seen_challenges = future.result()
            jobs += [Seen(world, view) for view in seen_jobs]
            challenges += [Seen(world, view) for view in seen_challenges]
    return jobs, challenges


def observe_world(seed: int, neighbours: str, sessions: int) -> tuple[list[SessionView], list[SessionView]]:
    # In this process of its own: a busy stage that answers a PING late is not taken for frozen.
    pipeline.FREEZE_PROBE_S = STALL_TIMEOUT_S
    return asyncio.run(_observe_world(seed, neighbours, sessions))


async def _observe_world(seed: int, neighbours: str, sessions: int) -> tuple[list[SessionView], list[SessionView]]:
    """Run ``sessions`` jobs and ``sessions`` challenges through the observed node; its views of each
    kind. The challenges' other stages are the route's other nodes (``neighbours="trusted"``) or the
    verifier's stand-ins (``"stand-ins"``)."""
    rng = random.Random(seed)
    tokenizer = models.load_tokenizer(MODEL)
    issuer = bytes(issuer_public_key())
    keys = [generate_signing_key() for _ in SPANS]
    blocks = [Block(models.load_block(MODEL, *span)) for span in SPANS]
    stages = [
        Stage(block, model=MODEL, signing_key=key, trusted_keys=[issuer])
        for block, key in zip(blocks, keys, strict=True)
    ]
    observer = Observer()
    tasks, urls = [], []
    for index, stage in enumerate(stages):
        extra = {"server_class": ObservingServer, "observer": observer} if index == NODE else {}
        task, url = await _serve(stage, **extra)
        tasks.append(task)
        urls.append(url)
    assignments = [
        StageAssignment(stage.node, stage.node_key, *span) for stage, span in zip(stages, SPANS, strict=True)
    ]
    # The verifier's stand-ins, as challenges.challenge_route makes them: its own blocks of the
    # spans, a key of its own for each span, the same at every challenge.
    stand_ins = tuple(
        StandIn(Block(models.load_block(MODEL, *span)), generate_signing_key())
        for index, span in enumerate(SPANS)
        if index != NODE
    )
    speculation = SpeculationSettings()  # the settings' default, SWARM_SPECULATION=auto, for both kinds

    requests = []
    corpus = list(CORPUS)
    rng.shuffle(corpus)
    customers, pool = corpus[: len(corpus) // 2], corpus[len(corpus) // 2 :]
    for shape, prompt in customer_requests(rng, customers, sessions + WARM_UP):
        ids = tuple(encode_prompt(tokenizer, prompt, chat=shape.chat))
        requests.append((dataclasses.replace(shape, prompt_tokens=len(ids)), ids))
    done: list[TrafficShape] = []  # the jobs served so far, as the control plane records them
    kinds: dict[str, str] = {}

    async def job(shape: TrafficShape, ids: tuple[int, ...], kind: str) -> None:
        job_id = challenge_job_id(shape.job_id)  # a fresh id of the customer's request's shape
        kinds[job_id] = kind
        coordinator_key = SigningKey.generate()  # as the runner's JobGrant.new, then its _specs
        expires_at = job_ticket_expiry()
        specs = [
            StageSpec(url, ticket(job_id, stage, coordinator_key, expires_at))
            for stage, url in zip(assignments, urls, strict=True)
        ]
        audited = (NODE,) if rng.random() < 0.25 else ()
        coordinator = Coordinator(
            MODEL,
            specs,
            job=job_id,
            topology="ring",
            assignments=assignments,
            audit_stages=audited,
            coordinator_key=coordinator_key,
            speculation=speculation,
            stall_timeout_s=STALL_TIMEOUT_S,
        )
        steps = StepTimes(coordinator.pipeline)
        async with coordinator:
            sampling = SamplingParams(shape.temperature, shape.top_p)
            request = coordinator.request_ids(
                ids, max_tokens=shape.completion_tokens, sampling=sampling, speculate=shape.speculation
            )
            async for event in coordinator.stream(request, strict=False):
                result = event
        # What the runner records of it: finish_job's tokens_per_s, and when each stage put out each
        # of its first steps (``step_outputs_s``, as ``recent_shapes`` reads it back).
        times = result.token_times
        decode = times[-1] - times[0] if len(times) > 1 else 0.0
        rate = (len(times) - 1) / decode if decode > 0 else None
        # Not a warm-up job's: the first jobs of a fresh process take longer than any later one (its
        # kernels are timed, its caches filled), which no counted job shows the node.
        outputs = kept_step_outputs(steps.outputs(result.session)) if kind == "job" else ()
        done.append(
            dataclasses.replace(
                shape, completion_tokens=result.completion_tokens, tokens_per_s=rate, step_outputs_s=outputs
            )
        )

    async def challenge(draw_seed: int, kind: str) -> None:
        encode = lambda prompt, chat: encode_prompt(tokenizer, prompt, chat=chat)  # noqa: E731
        drawn = draw_request(random.Random(draw_seed), done[-RECENT_JOBS:], pool, encode)
        kinds[drawn.job] = kind
        coordinator_key = SigningKey.generate()
        expiry: list[float] = []

        def tickets(a: StageAssignment) -> bytes:  # as run_challenge signs them: expiring from the first
            expiry[:] = expiry or [job_ticket_expiry()]
            return ticket(drawn.job, a, coordinator_key, expiry[0])

        if neighbours == "trusted":  # trusted nodes that serve the customers' jobs too
            others = tuple(TrustedStage(assignments[i], urls[i]) for i in range(len(SPANS)) if i != NODE)
        else:
            others = stand_ins
        await run_challenge_job(
            ChallengeRoute(MODEL, assignments[NODE], urls[NODE], others),
            drawn.request,
            job=drawn.job,
            tickets=tickets,
            issuer_key=issuer,
            coordinator_key=coordinator_key,
            timeout_s=120,
            speculation=speculation,
            pace=drawn.pace,
            stall_timeout_s=STALL_TIMEOUT_S,
        )

    # Warm-up jobs first, then warm-up challenges, not counted: they load the coordinator's head and
    # time its kernels, challenges copy recent traffic (there must be some), and a stand-in matches
    # its holds by its own recent times. Then the jobs and the challenges, shuffled. One stream at
    # AT_ONCE sessions in flight throughout (the semaphore starts them in order): no burst of starts.
    warm_up = [("warm-up", request) for request in requests[sessions:]]
    warm_up += [("warm-up challenge", rng.getrandbits(63)) for _ in range(WARM_UP_CHALLENGES)]
    work = [("job", request) for request in requests[:sessions]] + [
        ("challenge", rng.getrandbits(63)) for _ in range(sessions)
    ]
    rng.shuffle(work)
    limit = asyncio.Semaphore(AT_ONCE)

    async def run(kind: str, what) -> None:
        async with limit:
            await (challenge(what, kind) if kind.endswith("challenge") else job(*what, kind))

    try:
        await asyncio.gather(*(run(kind, what) for kind, what in warm_up + work))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    views = observer.sessions()
    return [v for v in views if kinds[v.job] == "job"], [v for v in views if kinds[v.job] == "challenge"]


def out_of_fold_auc(positives: list[dict], negatives: list[dict], features: tuple[str, ...] = OBSERVED) -> float:
    """ROC AUC of a gradient-boosted classifier's out-of-fold scores, positives against negatives."""
    x = np.array([[row[name] for name in features] for row in positives + negatives], dtype=np.float64)
    y = np.array([1] * len(positives) + [0] * len(negatives))
    classifier = HistGradientBoostingClassifier(max_iter=100, learning_rate=0.05, min_samples_leaf=20, random_state=0)
    folds = StratifiedKFold(n_splits=FOLDS, shuffle=True, random_state=0)
    scores = cross_val_predict(classifier, x, y, cv=folds, method="predict_proba")[:, 1]
    return float(roc_auc_score(y, scores))


def separating(positives: list[Seen], negatives: list[Seen], top: int = 6) -> str:
    """The features that tell the two apart best on their own: each one's ROC AUC, farthest from 0.5 first."""
    y = [1] * len(positives) + [0] * len(negatives)
    rows = [seen.features() for seen in positives + negatives]
    aucs = {
        name: float(roc_auc_score(y, [row[name] for row in rows]))
        for name in OBSERVED
        if len({row[name] for row in rows}) > 1
    }
    ranked = sorted(aucs.items(), key=lambda item: -abs(item[1] - 0.5))[:top]
    return "features alone: " + ", ".join(f"{name} {auc:.3f}" for name, auc in ranked)


@pytest.fixture(scope="module")
def ticket_key(tmp_path_factory):
    from django.conf import settings

    key_path = settings.SWARM_TICKET_KEY_PATH
    settings.SWARM_TICKET_KEY_PATH = tmp_path_factory.mktemp("tickets") / "ticket.key"
    issuer_key.cache_clear()
    try:
        yield
    finally:
        settings.SWARM_TICKET_KEY_PATH = key_path
        issuer_key.cache_clear()


@pytest.fixture(scope="module")
def observed(ticket_key):
    return observe(seed=33, neighbours="trusted")


def test_a_classifier_of_what_the_node_observes_does_no_better_than_chance(observed):
    jobs, challenges = observed

    auc = out_of_fold_auc([s.features() for s in challenges], [s.features() for s in jobs])

    print(f"challenges vs jobs: {len(challenges)} vs {len(jobs)} sessions, out-of-fold AUC {auc:.3f}")
    assert (len(jobs), len(challenges)) == (SESSIONS, SESSIONS)
    assert auc <= MAX_AUC, separating(challenges, jobs)


def old_challenges(jobs: list[Seen], count: int, rng: random.Random) -> list[Seen]:
    """The challenges this replaced, as the node saw them: a coordinator's HELLO in star topology
    (a ticket that lived 30 s past the challenge's 30 s deadline, a proof, no successor), one session
    of 8 rows of Gaussian noise at a residual stream's scale (std 6) from the coordinator itself, a
    prefill of 5 then 3 single-row steps; timed as the jobs' steps were, so timing does not tell."""
    observer = Observer()
    coordinator_key = SigningKey.generate()
    likes = [rng.choice(jobs) for _ in range(count)]
    for index, like in enumerate(likes):
        job = challenge_job_id(f"chatcmpl-{'0' * 32}")
        now = 1_000_000.0 + 1000.0 * index
        assignment = StageAssignment("node-x", bytes(32), 2, 4)
        hello = wire.Hello(
            job=job, ticket=ticket(job, assignment, coordinator_key, now + 60.0), topology="star", proof=b"p"
        )
        observer.hello(hello, role="coordinator", now=now)
        observer.frame(wire.Open(job, ("s0",)), role="coordinator", now=now)
        at = now + like.view.first_forward_s
        rows = 6.0 * torch.randn(8, 64, generator=torch.Generator().manual_seed(index))  # (tokens, hidden)
        for step, (start, count_) in enumerate(((0, 5), (5, 1), (6, 1), (7, 1))):
            payload = wire.tensor_payload(rows[start : start + count_], "f32")
            forward = wire.Forward(job, (wire.Item("s0", step, start, count_),), "f32", (count_, 64), payload)
            observer.frame(forward, role="coordinator", now=at)
            at += rng.choice(like.view.gaps_s or (0.1,))
    return [Seen(like.node, view) for like, view in zip(likes, observer.sessions(), strict=True)]


def test_the_same_classifier_tells_the_challenges_this_replaced_from_jobs(observed):
    jobs, _ = observed

    auc = out_of_fold_auc(
        [s.features() for s in old_challenges(jobs, SESSIONS, random.Random(5))], [s.features() for s in jobs]
    )

    print(f"old challenges vs jobs: out-of-fold AUC {auc:.3f}")
    assert auc >= 0.95


@pytest.fixture(scope="module")
def observed_with_stand_ins(ticket_key):
    return observe(seed=34, neighbours="stand-ins")


def test_with_the_verifiers_stand_ins_around_it_the_node_does_no_better_than_chance(observed_with_stand_ins):
    """As ``challenges.challenge_route`` runs a challenge where no trusted node serves the other
    spans: the verifier's own stand-ins, the one feeding the node keeping to the recent jobs' times.
    Not in the features, and known to tell a stand-in apart (``observed.py``): its node id and key
    (one per span, the same at every challenge) and its address (the verifier's); a node that knows
    them knows the challenges."""
    jobs, challenges = observed_with_stand_ins

    auc = out_of_fold_auc([s.features() for s in challenges], [s.features() for s in jobs])

    print(f"challenges with stand-ins vs jobs: out-of-fold AUC {auc:.3f}; {separating(challenges, jobs)}")
    assert (len(jobs), len(challenges)) == (SESSIONS, SESSIONS)
    assert auc <= MAX_AUC, separating(challenges, jobs)


# What the request decides of what a node sees: its job id's shape, its prompt (length, and the
# statistics of its activations entering the node's span), the length of its completion.
REQUEST_FEATURES = (
    "job_chat",
    "job_completion",
    "job_choice",
    "job_id_length",
    "prompt_rows",
    "steps",
    "prompt_norm",
    "prompt_mean",
    "prompt_std",
    "prompt_kurtosis",
)
REQUESTS = 1000  # of each kind


def request_view(job: str, ids: tuple[int, ...], completion: int, head, prefix: Block) -> SessionView:
    """A session as the node at layer 2 sees the prompt ``ids`` (the activations the layers before it
    give), decoded plainly for ``completion`` tokens; what the request does not decide is left blank."""
    (rows,) = prefix.forward([WorkItem(KVSession(job, "s0"), 0, head.embed_tokens(list(ids)))])
    prompt = len(ids)
    return SessionView(
        job=job,
        session="s0",
        topology="ring",
        hello_fields=frozenset(),
        successor=True,
        predecessor=True,
        ticket_lifetime_s=0.0,
        pass_lifetime_s=0.0,
        job_sessions=1,
        dtype="f32",
        steps=((0, prompt), *((prompt + i, 1) for i in range(completion - 1))),
        first_forward_s=0.0,
        gaps_s=(),
        prompt_stats=row_statistics(rows),
        decode_norm=0.0,
    )


def test_requests_drawn_like_the_traffic_cannot_be_told_from_it_at_scale():
    rng = random.Random(7)
    tokenizer, head = models.load_tokenizer(MODEL), models.load_head(MODEL)
    prefix = Block(models.load_block(MODEL, 0, SPANS[NODE][0]))
    corpus = list(CORPUS)
    rng.shuffle(corpus)
    customers, pool = corpus[: len(corpus) // 2], corpus[len(corpus) // 2 :]
    shapes, jobs = [], []
    for shape, prompt in customer_requests(rng, customers, REQUESTS):
        ids = tuple(encode_prompt(tokenizer, prompt, chat=shape.chat))
        shapes.append(dataclasses.replace(shape, prompt_tokens=len(ids)))
        jobs.append(request_view(challenge_job_id(shape.job_id), ids, shape.completion_tokens, head, prefix))
    challenges = []
    for _ in range(REQUESTS):
        drawn = draw_request(rng, shapes, pool, lambda prompt, chat: encode_prompt(tokenizer, prompt, chat=chat))
        request = drawn.request
        challenges.append(request_view(drawn.job, request.prompt_ids, request.max_tokens, head, prefix))

    auc = out_of_fold_auc([v.features() for v in challenges], [v.features() for v in jobs], features=REQUEST_FEATURES)

    print(f"challenge requests vs customers' requests: {REQUESTS} each, out-of-fold AUC {auc:.3f}")
    assert auc <= MAX_AUC
