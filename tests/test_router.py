"""The speculation router: its rate model against a discrete-event simulation of a WAN pipeline,
its online choices against the best fixed plan, and its bookkeeping.

The simulation is a ring of three stages and the coordinator: each hop takes RTT/4 one way, each
stage is a FIFO server computing a chunk of n positions in (pass_s + n * per_position_s) / 3
(pass_s: the compute a pass costs whatever its size), and drafts are accepted per position with a
seeded Bernoulli stream. Every plan run on the same seed meets the
same acceptable positions, so comparisons between plans are paired and need few tokens.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest

from worker_agent.coordinator.router import (
    EXPLORE_EVERY,
    PLAIN,
    Load,
    Plan,
    Router,
    RouteTiming,
    expected_committed,
    positions_per_token,
    predicted_rate,
)

from .router_fixtures import shown

pytestmark = pytest.mark.dataplane

STAGES = 3
K_CHOICES = (1, 2, 4, 6, 8, 12, 16)
DEPTH_CHOICES = (1, 2, 3, 4)


@dataclass
class _Chunk:
    chain: int  # the chain that sent it: a result of an earlier chain is void
    first: int  # the token index its first draft is for
    drafts: int  # 0 for a plain decoding round
    positions: int
    sent: float  # seconds
    back: float  # when its result reaches the coordinator
    alone: bool  # nothing was in flight when it was sent: its round trip times the route


@dataclass
class _Run:
    tokens: int
    seconds: float
    plans: Counter[Plan] = field(default_factory=Counter)  # chains started, by plan

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


class _Ring:
    """Coordinator -> stage 1 -> ... -> stage S -> coordinator, every stage a FIFO server. All chunks
    take the same path through servers that keep order, so each chunk's return time is fixed
    when it is sent, and results come back in the order chunks were sent."""

    def __init__(self, rtt_s: float, per_position_s: float, pass_s: float = 0.0) -> None:
        self.hop_s = rtt_s / (STAGES + 1)
        self.stage_s_per_position = per_position_s / STAGES
        self.stage_s_per_pass = pass_s / STAGES
        self.free_at = [0.0] * STAGES

    def send(self, at: float, positions: int) -> float:
        t = at
        for stage, free_at in enumerate(self.free_at):
            t = max(t + self.hop_s, free_at) + self.stage_s_per_pass + positions * self.stage_s_per_position
            self.free_at[stage] = t
        return t + self.hop_s


class _Target:
    """Whether the target accepts the draft for each token index: Bernoulli(a), drawn once."""

    def __init__(self, a: float, seed: int) -> None:
        self.a = a
        self.rng = random.Random(seed)
        self.accepts: list[bool] = []

    def accepted_prefix(self, first: int, drafts: int) -> int:
        while len(self.accepts) < first + drafts:
            self.accepts.append(self.rng.random() < self.a)
        n = 0
        while n < drafts and self.accepts[first + n]:
            n += 1
        return n


def _simulate(
    a: float,
    rtt_s: float,
    per_position_s: float,
    router: Router,
    *,
    tokens: int,
    seed: int = 0,
    pass_s: float = 0.0,
) -> _Run:
    """Decode ``tokens`` tokens with ``router`` planning each chain; the router observes what the
    coordinator does: the round trip of a chunk sent alone, the spacing of chunks sent together,
    and every verified chunk's accepted drafts."""
    ring, target = _Ring(rtt_s, per_position_s, pass_s), _Target(a, seed)
    in_flight: deque[_Chunk] = deque()  # results return in send order: this is the event queue
    run = _Run(0, 0.0)
    chain, plan, next_first = 0, PLAIN, 0

    def send(now: float, first: int, drafts: int, positions: int) -> None:
        alone = not in_flight
        in_flight.append(_Chunk(chain, first, drafts, positions, now, ring.send(now, positions), alone))

    def start_chain(now: float) -> None:
        nonlocal chain, plan, next_first
        chain += 1
        plan = router.plan()
        run.plans[plan] += 1
        if plan.plain:
            send(now, run.tokens, 0, 1)
            return
        for j in range(plan.depth):  # the first chunk also carries the last committed token
            send(now, run.tokens + j * plan.k, plan.k, plan.k + 1 if j == 0 else plan.k)
        next_first = run.tokens + plan.depth * plan.k

    start_chain(0.0)
    previous: _Chunk | None = None
    while run.tokens < tokens:
        chunk = in_flight.popleft()
        now = run.seconds = chunk.back
        if chunk.alone:
            router.observe_round_trip(chunk.positions, chunk.back - chunk.sent)
        elif previous is not None and previous.sent == chunk.sent:
            router.observe_spacing(chunk.positions, chunk.back - previous.back)
        previous = chunk
        if chunk.chain != chain:
            continue  # voided by a rejection before it: it only occupied the stages
        if chunk.drafts == 0:
            run.tokens += 1
            start_chain(now)
            continue
        accepted = target.accepted_prefix(chunk.first, chunk.drafts)
        router.observe(str(plan.drafter), chunk.drafts, accepted)
        if accepted < chunk.drafts:
            run.tokens += accepted + 1  # the accepted drafts and the corrected token
            start_chain(now)
        elif not any(other.chain == chain for other in in_flight):
            run.tokens += chunk.drafts + 1  # the last chunk in flight: its bonus token too
            start_chain(now)
        else:
            # Accepted whole with the chain's later chunks in flight: the router re-plans the
            # chain's next chunks as the engine asks it (only the chain's drafter is available).
            run.tokens += chunk.drafts
            flying = sum(1 for other in in_flight if other.chain == chain)
            refill = router.plan(available=[str(plan.drafter)], in_flight=flying)
            if refill is not None and not refill.plain:
                plan = refill
                for _ in range(refill.depth - flying):
                    send(now, next_first, refill.k, refill.k)
                    next_first += refill.k
    return run


def _fixed(k: int, depth: int) -> Router:
    return Router(fixed=Plan("ngram", k, depth) if k else PLAIN)


def _gain(a: float, rtt_s: float, *, tokens: int = 10_000, seed: int = 0) -> float:
    """Pipelining's gain, D=4 over D=1 at K=8, with 1 ms of compute per position."""
    pipelined = _simulate(a, rtt_s, 0.001, _fixed(8, 4), tokens=tokens, seed=seed).rate
    synchronous = _simulate(a, rtt_s, 0.001, _fixed(8, 1), tokens=tokens, seed=seed).rate
    return pipelined / synchronous


def test_expected_committed_counts_the_accepted_prefix_and_one_more():
    assert expected_committed(0.5, 1) == 1.5
    assert expected_committed(0.5, 3) == 1.875
    assert expected_committed(0.8, 8) == pytest.approx((1 - 0.8**9) / 0.2, rel=1e-12)
    assert expected_committed(0.0, 8) == 1.0
    assert expected_committed(0.37, 0) == 1.0
    assert expected_committed(1.0, 8) == 9.0


def test_expected_committed_rejects_impossible_arguments():
    for a, k in ((1.5, 4), (-0.1, 4), (math.nan, 4), (0.5, -1)):
        with pytest.raises(ValueError):
            expected_committed(a, k)


def test_predicted_rate_reduces_to_plain_and_synchronous_rounds():
    assert predicted_rate(0.9, 0, 1, 0.2, 0.002) == pytest.approx(1 / 0.202)
    assert predicted_rate(0.9, 8, 1, 0.2, 0.002) == pytest.approx(expected_committed(0.9, 8) / 0.218)
    assert predicted_rate(0.9, 8, 1, 0.2, 0.002, 0.01) == pytest.approx(expected_committed(0.9, 8) / 0.298)


def test_predicted_rate_at_full_acceptance_keeps_depth_chunks_per_round_trip():
    assert predicted_rate(1.0, 8, 4, 0.2, 0.003, stages=3) == pytest.approx(4 * 8 / 0.224)


def test_predicted_rate_at_full_acceptance_is_bounded_by_the_busiest_stage():
    # One stage computes everything: 4 chunks queue there for 4 * 0.96 s, longer than a round trip.
    assert predicted_rate(1.0, 16, 4, 0.02, 0.06, stages=1) == pytest.approx(16 / 0.96)


def test_predicted_rate_rejects_impossible_arguments():
    for args in ((1.1, 8, 4, 0.2, 0.002), (0.5, 8, 0, 0.2, 0.002), (0.5, 8, 4, -0.2, 0.002), (0.5, 8, 4, 0, 0)):
        with pytest.raises(ValueError):
            predicted_rate(*args)


@pytest.mark.parametrize("rtt_s", [0.38, 1.14])
def test_pipelining_gain_crosses_ten_percent_near_acceptance_078(rtt_s):
    scan = [round(0.70 + 0.02 * i, 2) for i in range(9)]
    gains = [_gain(a, rtt_s) for a in scan]
    above = next(i for i, gain in enumerate(gains) if gain >= 1.10)
    lo, hi = scan[above - 1], scan[above]
    crossover = lo + (hi - lo) * (1.10 - gains[above - 1]) / (gains[above] - gains[above - 1])
    at_080 = gains[scan.index(0.80)]

    assert crossover == pytest.approx(0.78, abs=0.03), f"crossover {crossover:.3f}, gain at 0.80 {at_080:.3f}"
    assert 1.10 < at_080 < 1.20, f"gain at 0.80 {at_080:.3f}"


@pytest.mark.parametrize("rtt_s", [0.38, 1.14])
def test_pipelining_gains_over_twice_at_acceptance_097(rtt_s):
    gains = [_gain(0.97, rtt_s, seed=seed) for seed in range(3)]
    gain = sum(gains) / len(gains)

    assert 2.0 < gain < 2.8, f"gain at 0.97: {gain:.3f} (seeds: {[round(g, 3) for g in gains]})"


def test_pipelining_never_loses():
    gains = {a: _gain(a, 0.38, tokens=4_000) for a in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97)}

    assert min(gains.values()) >= 0.98, f"gains by acceptance: {gains}"


def _relative_errors(rtt_s: float, per_position_s: float, grid: list[tuple[float, int, int]]) -> dict:
    off = {}
    for a, k, depth in grid:
        simulated = _simulate(a, rtt_s, per_position_s, _fixed(k, depth), tokens=20_000, seed=1).rate
        predicted = predicted_rate(a, k, depth, rtt_s, per_position_s, stages=STAGES)
        off[(a, k, depth)] = round(predicted / simulated - 1, 4)
    return off


def test_predicted_rate_agrees_with_the_simulation():
    grid = [(a, k, depth) for a in (0.5, 0.8, 0.95) for k in (2, 8, 16) for depth in (1, 2, 4)]

    off = _relative_errors(0.2, 0.002, grid)

    assert max(abs(error) for error in off.values()) < 0.05, f"relative error by (a, k, depth): {off}"


def test_predicted_rate_agrees_with_the_simulation_where_compute_binds():
    # 20 ms round trips, 10 ms per position: four chunks of 16 keep every stage busy.
    grid = [(a, k, depth) for a in (0.5, 0.95) for k in (8, 16) for depth in (2, 4)]

    off = _relative_errors(0.02, 0.01, grid)

    assert max(abs(error) for error in off.values()) < 0.05, f"relative error by (a, k, depth): {off}"


# Within 5% of the best fixed plan, but at a = 0.97 within 8%: there the router drifts to K = 32
# (its acceptance estimate runs above the truth on long accepted runs) where K = 16 is best, as it
# did before plans were gated by the acceptance's lower bound (0.932-0.965 of the best over seeds).
@pytest.mark.parametrize(
    ("a", "within"), [(0.3, 0.05), (0.5, 0.05), (0.7, 0.05), (0.8, 0.05), (0.9, 0.05), (0.97, 0.08)]
)
def test_online_router_comes_within_five_percent_of_the_best_fixed_plan(a, within):
    rtt_s, per_position_s, tokens = 0.2, 0.002, 3_000
    fixed = {(k, depth): _simulate(a, rtt_s, per_position_s, _fixed(k, depth), tokens=tokens).rate
             for k in K_CHOICES for depth in DEPTH_CHOICES}  # fmt: skip
    best_plan = max(fixed, key=fixed.__getitem__)
    router = Router(stages=STAGES)

    online = _simulate(a, rtt_s, per_position_s, router, tokens=tokens).rate

    assert online >= (1 - within) * fixed[best_plan], (
        f"online {online:.2f} tok/s = {online / fixed[best_plan]:.3f} of best fixed {best_plan}: "
        f"{fixed[best_plan]:.2f}; router ended at {router.to_json()}"
    )


def test_online_router_decodes_plainly_where_speculation_does_not_pay():
    router = Router(stages=STAGES)

    run = _simulate(0.3, 0.001, 0.002, router, tokens=1_500)

    chains = sum(run.plans.values())
    assert run.plans[PLAIN] / chains > 0.85, f"plans: {run.plans.most_common(4)}"


def test_observe_rejects_impossible_counts_and_unknown_drafters():
    router = Router()

    for drafter, drafted, accepted in (("ngram", 4, 5), ("ngram", 4, -1), ("draft", 4, 2)):
        with pytest.raises(ValueError):
            router.observe(drafter, drafted, accepted)

    assert router.acceptance("ngram") == 0.5


def test_full_accepts_drive_the_estimate_to_one_and_rejections_to_zero():
    router = Router()

    for _ in range(100):
        router.observe("ngram", 8, 8)
    high = router.acceptance("ngram")
    for _ in range(300):  # one trial each: 300 trials age the accepted past by 0.97^300
        router.observe("ngram", 8, 0)

    assert high > 0.999
    assert router.acceptance("ngram") < 0.001


def test_acceptance_is_accepted_drafts_over_trials_not_a_mean_of_ratios():
    router = Router(smoothing=1.0)

    router.observe("ngram", 8, 3)  # 3 accepted, then a rejection: 4 trials

    assert router.acceptance("ngram") == 0.75


def test_a_drafter_with_nothing_to_propose_is_never_chosen():
    router = Router({"ngram": 0.0, "draft": 0.001})
    for _ in range(50):
        router.observe("ngram", 8, 8)
        router.observe("draft", 8, 8)

    assert router.plan().drafter == "ngram"  # equal acceptance: the free drafter wins
    assert router.plan(available={"draft"}).drafter == "draft"
    assert router.plan(available=()) == PLAIN


def test_fixed_plan_is_honoured_whatever_is_observed():
    router = Router(fixed=Plan("ngram", 8, 4))
    for _ in range(50):
        router.observe("ngram", 8, 0)

    assert [router.plan() for _ in range(3)] == [Plan("ngram", 8, 4)] * 3
    assert router.plan(available=()) == PLAIN


def test_a_rejected_drafter_is_probed_after_the_stated_plain_rounds():
    router = Router(rtt_s=0.0001, per_position_s=0.002)  # a probe costs half of a plain round here
    for _ in range(100):
        router.observe("ngram", 8, 0)

    plans = [router.plan() for _ in range(2 * EXPLORE_EVERY + 2)]

    probe = Plan("ngram", 1, 1)
    # A new session probes at once, then one round in EXPLORE_EVERY, the probe's own included.
    assert [i for i, plan in enumerate(plans) if plan != PLAIN] == [0, EXPLORE_EVERY, 2 * EXPLORE_EVERY]
    assert plans[EXPLORE_EVERY] == probe


def test_a_stand_in_waits_for_its_interval_on_shared_passes_but_not_alone():
    drafters = {"ngram": 0.0, "ngram1": 0.0}
    shared = Load(positions=3, rate=30.0)

    def probes(load: Load | None, available: set[str]) -> list[int]:
        router = Router(drafters, rtt_s=0.0001, per_position_s=0.002, stand_ins={"ngram1"})
        plans = [router.plan(available=available, load=load) for _ in range(EXPLORE_EVERY + 1)]
        return [i for i, plan in enumerate(plans) if plan != PLAIN]

    # Only the one-token stand-in has something to propose (an answer's opening).
    assert probes(None, {"ngram1"}) == [0, EXPLORE_EVERY]  # alone: probed at once
    assert probes(shared, {"ngram1"}) == [EXPLORE_EVERY - 1]  # shared: its interval, the probe's round included
    # A real match is probed at once, shared or not.
    assert probes(shared, {"ngram", "ngram1"})[0] == 0
    with pytest.raises(ValueError, match="stand-in"):
        Router(drafters, stand_ins={"draft"})


def test_probes_come_every_round_where_they_cost_under_one_percent():
    router = Router(rtt_s=0.2, per_position_s=0.002)
    for _ in range(100):
        router.observe("ngram", 8, 0)

    plans = [router.plan() for _ in range(6)]

    assert plans == [Plan("ngram", 1, 1)] * 6


def test_accepted_probes_bring_speculation_back():
    router = Router(rtt_s=0.2, per_position_s=0.002, stages=STAGES)
    for _ in range(100):
        router.observe("ngram", 8, 0)

    plans = []
    for _ in range(40):
        plan = router.plan()
        plans.append(plan)
        if plan.drafter is not None:
            router.observe(plan.drafter, plan.k, plan.k)

    assert plans[-1].depth == 4 and plans[-1].k >= 4, f"last plans: {plans[-5:]}"


def test_round_trips_fit_the_latency_and_the_cost_per_position():
    router = Router(rtt_s=0.05, per_position_s=0.002)

    for _ in range(50):
        router.observe_round_trip(1, 0.202)
        router.observe_round_trip(17, 0.234)
    for garbage in (math.nan, math.inf, -1.0):
        router.observe_round_trip(9, garbage)

    assert router.rtt_s == pytest.approx(0.2, abs=1e-9)
    assert router.per_position_s == pytest.approx(0.002, abs=1e-12)


def test_round_trips_of_one_size_move_the_latency_not_the_slope():
    router = Router(rtt_s=0.05, per_position_s=0.002)

    router.observe_round_trip(9, 0.3)

    assert router.per_position_s == pytest.approx(0.002)
    assert router.rtt_s == pytest.approx(0.282)


def test_snapshot_reports_estimates_and_the_last_plan():
    router = Router(fixed=Plan("ngram", 8, 4), rtt_s=0.1, per_position_s=0.001)
    router.observe("ngram", 8, 3)
    router.plan()

    assert router.to_json() == {
        # 3 accepted then a rejection: 4 trials, each aging the prior (0.5, one trial) by 0.97.
        "acceptance": {"ngram": round((0.97**4 * 0.5 + 3) / (0.97**4 + 4), 4)},
        "rtt_s": 0.1,
        "per_position_s": 0.001,
        "pass_s": 0.0,
        "last_plan": {"drafter": "ngram", "k": 8, "depth": 4},
        "plans": {"ngram k=8 depth=4": 1},
    }


def test_other_sessions_in_the_passes_price_speculation_out_where_compute_binds():
    # A short round trip and a costly position: one stream gains from drafts at acceptance 0.6,
    # but with three other streams in every pass each extra position delays all of them.
    router = shown(Router(rtt_s=0.01, per_position_s=0.01, prior_acceptance=0.6, stages=3), 0.6)
    others = Load(positions=3, rate=3 / (0.01 + 4 * 0.01))

    alone, crowded = router.plan(), router.plan(load=others)

    assert not alone.plain
    assert crowded.plain
    assert router.rate(alone, load=others) < router.rate(PLAIN, load=others)


def test_the_others_positions_lengthen_every_pass_a_chunk_rides_in():
    router = Router(rtt_s=0.1, per_position_s=0.01, stages=3)

    assert router.rate(PLAIN, load=Load(positions=4)) == pytest.approx(1 / (0.1 + 5 * 0.01))
    assert router.rate(PLAIN) == pytest.approx(1 / (0.1 + 0.01))


def test_the_cost_to_others_is_their_rate_times_the_compute_of_the_extra_positions():
    assert Load(positions=2, rate=20.0).cost(50.0, 0.004) == pytest.approx(50.0 * 0.004 * 20.0)


def test_positions_per_token_is_one_for_plain_and_full_acceptance_and_more_below():
    assert positions_per_token(0.3, 0, 1) == 1.0
    assert positions_per_token(1.0, 8, 1) == 1.0
    # At a = 0.5, k = 1, depth 1: a chunk of 2 positions commits 1.5 tokens on average.
    assert positions_per_token(0.5, 1, 1) == pytest.approx(2 / 1.5)
    assert positions_per_token(0.5, 4, 3) > positions_per_token(0.5, 4, 1)


# A pass that is mostly fixed compute (a memory-bound stage reads its weights once per pass) over a
# short round trip: the regime of CPU stages on one host, where a voided chunk costs nearly what an
# accepted one does.
PASS_BOUND = {"rtt_s": 0.002, "per_position_s": 0.0005, "pass_s": 0.045}


def test_predicted_rate_agrees_with_the_simulation_where_each_pass_costs_fixed_compute():
    grid = [(a, k, depth) for a in (0.3, 0.8, 0.95) for k in (1, 4, 8) for depth in (1, 2, 4)]
    off = {}
    for a, k, depth in grid:
        simulated = _simulate(
            a,
            PASS_BOUND["rtt_s"],
            PASS_BOUND["per_position_s"],
            _fixed(k, depth),
            tokens=20_000,
            seed=1,
            pass_s=PASS_BOUND["pass_s"],
        ).rate
        predicted = predicted_rate(a, k, depth, **PASS_BOUND, stages=STAGES)
        off[(a, k, depth)] = round(predicted / simulated - 1, 4)

    assert max(abs(error) for error in off.values()) < 0.05, f"relative error by (a, k, depth): {off}"


def test_spacings_of_chunks_sent_together_separate_the_pass_from_the_network():
    router = Router(stages=STAGES)

    _simulate(0.9, 0.2, 0.002, router, tokens=2_000, pass_s=0.03)

    assert router.pass_s == pytest.approx(0.03, rel=0.1)
    assert router.rtt_s == pytest.approx(0.2, rel=0.1)


@pytest.mark.parametrize("a", [0.3, 0.6, 0.9])
def test_online_router_comes_within_five_percent_of_the_best_fixed_plan_where_passes_bind(a):
    tokens = 3_000
    fixed = {
        (k, depth): _simulate(
            a,
            PASS_BOUND["rtt_s"],
            PASS_BOUND["per_position_s"],
            _fixed(k, depth),
            tokens=tokens,
            pass_s=PASS_BOUND["pass_s"],
        ).rate
        for k in (0, *K_CHOICES)
        for depth in DEPTH_CHOICES
        if k or depth == 1
    }
    best_plan = max(fixed, key=fixed.__getitem__)
    router = Router(stages=STAGES)

    online = _simulate(
        a, PASS_BOUND["rtt_s"], PASS_BOUND["per_position_s"], router, tokens=tokens, pass_s=PASS_BOUND["pass_s"]
    ).rate

    assert online >= 0.95 * fixed[best_plan], (
        f"online {online:.2f} tok/s = {online / fixed[best_plan]:.3f} of best fixed {best_plan}: "
        f"{fixed[best_plan]:.2f}; router ended at {router.to_json()}"
    )


def test_low_acceptance_is_not_pipelined_once_the_pass_cost_is_seen():
    router = Router(stages=STAGES, prior_acceptance=0.25)
    for _ in range(5):
        router.observe_round_trip(1, 0.047)
        router.observe_round_trip(2, 0.0475)
        router.observe_spacing(2, 0.0153)

    plan = router.plan()

    assert router.pass_s == pytest.approx(0.045, rel=0.1)
    assert plan.depth == 1, router.to_json()


def test_sessions_on_one_route_share_its_timing_but_not_their_acceptance():
    timing = RouteTiming(stages=STAGES)
    first, second = Router(timing=timing), Router(timing=timing)

    first.observe_round_trip(1, 0.3)
    first.observe_round_trip(9, 0.316)
    first.observe("ngram", 8, 8)

    assert second.rtt_s == first.rtt_s == pytest.approx(0.298, abs=0.002)
    assert second.acceptance("ngram") == 0.5  # its own prior: what text the other session drafts says nothing
    assert first.acceptance("ngram") > 0.9


def test_plain_steps_are_priced_at_what_they_measured_not_at_the_chunk_line():
    # A CPU route at no network round trip: a one-row pass takes the matrix-vector path (46 ms),
    # chunks of 2 to 17 positions lie on another line (66 ms + 3.7 ms a position). On that line a
    # one-position step would cost 70 ms, and a chunk of one draft at acceptance 0.3 would look
    # like a gain of a quarter; against the 46 ms measured it is a loss.
    def route(acceptance: float) -> Router:
        router = shown(Router(timing=RouteTiming(stages=STAGES), prior_acceptance=acceptance), acceptance)
        for _ in range(10):
            router.observe_round_trip(1, 0.046)
            for positions in (2, 5, 9, 17):
                router.observe_round_trip(positions, 0.066 + 0.0037 * positions)
        return router

    cautious, confident = route(0.3), route(0.95)

    assert cautious.timing.single_s() == pytest.approx(0.046)
    assert cautious.plan(available=()) == PLAIN
    assert cautious.plan() == Plan("ngram", 1, 1)  # a new session's first probe
    assert [cautious.plan() for _ in range(3)] == [PLAIN] * 3
    assert not confident.plan().plain


@pytest.mark.parametrize("load", [Load(), Load(positions=3, rate=40.0)])
@pytest.mark.parametrize("rtt_s, per_position_s", [(0.0005, 0.004), (0.05, 0.002), (0.3, 0.001)])
def test_no_plan_outruns_the_ceiling_its_acceptance_sets(load, rtt_s, per_position_s):
    # The planner skips a drafter whose ceiling cannot clear its bars, so the ceiling must bound
    # every plan it would otherwise have priced, at every acceptance, K and depth.
    router = Router({"ngram": 0.0, "slow": 0.0005}, rtt_s=rtt_s, per_position_s=per_position_s, stages=3)
    ceiling = router._ceiling(load)

    plans = [Plan(name, k, depth) for name in router.drafters for k in router.k_choices for depth in (1, 2, 3, 4)]
    for a in (0.0, 0.05, 0.3, 0.6, 0.9, 0.99, 0.999):
        for plan in plans:
            assert router._rate(plan, a, load) <= ceiling(a) * (1 + 1e-12), (a, plan)


def test_a_drafter_that_cannot_clear_the_bars_is_not_priced_at_all(monkeypatch):
    # Novel text on shared passes: the lower bound of a drafter's acceptance sits near 0, where no
    # plan can beat plain decoding by the shared margin. The planner answers plain without pricing
    # any of its plans (a round's plan had cost a session about 0.4 ms, on the cores the stages use).
    router = shown(Router(rtt_s=0.001, per_position_s=0.004, stages=3), 0.02)
    priced, rate = [], router._rate

    def recorded(plan, *args, **kwargs):
        priced.append(plan)
        return rate(plan, *args, **kwargs)

    monkeypatch.setattr(router, "_rate", recorded)

    assert router._best(["ngram"], Load(positions=3, rate=40.0)) == PLAIN
    assert priced == [PLAIN]  # plain decoding's own rate, the bars' base
