# Over 500 lines: the speculation cost model, its online fit and its planner are one model.
"""Choosing how to speculate: which drafter, how many drafts per chunk (K), how many chunks in flight (D).

Speculation over a WAN pipeline trades positions the stages compute for round trips saved. A drafter
proposes K tokens; one chunk carries them through the pipeline, and the target accepts a prefix
of them plus one corrected (or bonus) token. Up to D chunks may be in flight, each drafted on the
assumption that the ones before it are accepted in full; a rejection voids every chunk after it.
Which (drafter, K, D) pays depends on the acceptance rate, the round trip and the compute per
position, all of which drift during a session, so ``Router`` estimates them online from what the
coordinator observes and re-plans every new chain of chunks by maximising ``predicted_rate``.

Everything here is arithmetic on numbers the caller passes in: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

DEFAULT_DRAFTERS: Mapping[str, float] = MappingProxyType({"ngram": 0.0})  # name -> drafting seconds per token
PLAIN_MARGIN = 0.02  # speculation must beat plain decoding by this much: a model's error should not cost a loss
EXPLORE_EVERY = 48  # the most plain plans in a row before a drafter is probed again
EXPLORE_BUDGET = 0.01  # probe sooner where a useless probe costs under this share of plain decoding's rate
TIMING_SMOOTHING = 0.1  # weight of one round trip: WAN jitter needs a longer memory than acceptance does
# How strongly the per-position cost holds to its prior, as a variance of chunk sizes (positions²):
# chunks of nearly one size (K and K+1) cannot separate the round trip from the compute, and must
# not swing the slope; chunks of sizes spread by a few positions or more override the prior.
SLOPE_PRIOR_SPREAD = 1.0
PASS_PRIOR_WEIGHT = 1e-3  # holds the compute per pass to 0 until spacings tell it from the network
# A plan may lose at most EXPLORE_BUDGET to plain decoding at the acceptance's lower bound, this many
# standard errors under the estimate: a drafter's few lucky trials on novel text must not buy chunks
# the other sessions pay for.
ACCEPTANCE_CAUTION = 1.0
# On passes other sessions share, a plan must beat plain decoding by this much at that lower bound:
# there the cost of one more row is off the fitted line (kernels step at row counts), so a thin
# predicted gain is no gain.
SHARED_MARGIN = 0.1


@dataclass(frozen=True)
class Plan:
    """How the next chain of chunks is sent. ``PLAIN`` (no drafter, k=0, depth=1) is plain decoding."""

    drafter: str | None  # the drafter proposing the drafts; None for plain decoding
    k: int  # drafts per chunk
    depth: int  # chunks in flight at once

    def __post_init__(self) -> None:
        if self.k < 0 or self.depth < 1:
            raise ValueError(f"need k >= 0 and depth >= 1, got k={self.k}, depth={self.depth}")
        if (self.drafter is None) != (self.k == 0) or (self.k == 0 and self.depth != 1):
            raise ValueError(f"plain decoding is Plan(None, 0, 1); got {self}")

    @property
    def plain(self) -> bool:
        return self.drafter is None

    def to_json(self) -> dict[str, object]:
        return {"drafter": self.drafter, "k": self.k, "depth": self.depth}


PLAIN = Plan(None, 0, 1)


def expected_committed(a: float, k: int) -> float:
    """Tokens one synchronous round commits with k drafts of per-token acceptance a:
    the accepted prefix plus the corrected or bonus token, sum_{i=0..k} a^i = (1 - a^(k+1)) / (1 - a)."""
    _check_acceptance(a)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return _geometric(a, k + 1)


def _geometric(x: float, n: int) -> float:
    """sum_{i<n} x^i for 0 <= x <= 1, in closed form: the planner prices dozens of plans a round.
    Its relative error, about 1e-16 / (1 - x), stays far under the model's own."""
    return float(n) if x >= 1.0 else (1.0 - x**n) / (1.0 - x)


def predicted_rate(
    a: float,
    k: int,
    depth: int,
    rtt_s: float,
    per_position_s: float,
    draft_s_per_token: float = 0.0,
    *,
    stages: int = 1,
    pass_s: float = 0.0,
) -> float:
    """Committed tokens per second of speculating with (k, depth) at per-token acceptance ``a``.

    A lone chunk of n positions returns after T(n) = rtt_s + pass_s + n * per_position_s, where
    ``pass_s`` is the compute every pass costs whatever its size (reading a stage's weights once on
    a memory-bound device, launching its kernels, framing). The compute is spread over ``stages``
    equal stages, each a server taking one chunk at a time, so chunks sent together leave the
    pipeline spaced by c = (pass_s + k * per_position_s) / stages; drafting a chunk costs the
    coordinator d = k * draft_s_per_token before it can be sent. A chunk voided by a rejection
    still costs its pass on every stage: where ``pass_s`` is most of a pass, pipelining low-acceptance
    drafts holds the stages up for nothing.

    - k = 0 (plain decoding): one token per T(1).
    - depth = 1 (synchronous): a round commits ``expected_committed(a, k)`` tokens (a full accept
      adds the bonus token) in d + T(k+1); the next round starts from the committed tokens.
    - depth > 1 (pipelined), as a renewal process over chains. A chain starts by sending
      ``depth`` chunks (the first also carries the last committed token: k+1 positions) and
      sends one more of k positions each time a chunk comes back fully accepted, so ``depth`` stay
      in flight. Measured from the chain's start, its chunk j returns at
        t_{1 + m*depth + r} = F + r*s + m*P  (0 <= r < depth),
      with s = max(c, d) the spacing of a burst, P = max(d + T(k), depth * s) the time a chunk
      takes to be replaced by its refill (the round trip, or the pipeline's throughput where
      compute binds) and F the first chunk's return, below.
      Each chunk is accepted in full with probability q = a^k; the chain ends at the first
      chunk J with a rejection (P(J = j) = q^(j-1) (1-q)), committing its accepted prefix and the
      corrected token; the chunks sent after J are voided. Their compute is lost, and they
      delay the next chain only where compute binds: they return at t_J + m*s (0 < m < depth),
      ahead of it by at least s >= c on every stage, so its first chunk returns after
      F = max(d + T(k+1), (depth-1)*s + (pass_s + (k+1) * per_position_s) / stages), the second term
      being its wait behind them at the last stage (it is the first term unless compute binds).
      With G = sum_{r<depth} q^r and H = sum_{r<depth} r q^r,
        E[t_J] = F + s * H / G + P * q^depth / ((1-q) G),
      and the chain commits 1/(1-a) tokens on average (its accepted drafts, then one
      correction). Per chunk sent and checked (E[J] = 1/(1-q)) that is
        rate = sum_{i<k} a^i / ((1-q) F + (1-q) s H / G + P q^depth / G),
      a form that stays finite at a = 1 (rate -> depth * k / P).
    """
    _check_acceptance(a)
    if k < 0 or depth < 1 or stages < 1:
        raise ValueError(f"need k >= 0, depth >= 1 and stages >= 1, got {k}, {depth}, {stages}")
    for name, value in (
        ("rtt_s", rtt_s),
        ("per_position_s", per_position_s),
        ("draft_s_per_token", draft_s_per_token),
        ("pass_s", pass_s),
    ):
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if rtt_s + pass_s + per_position_s <= 0.0:
        raise ValueError("a round trip must take some time: rtt_s + pass_s + per_position_s > 0")

    def round_trip(positions: int) -> float:
        return rtt_s + pass_s + positions * per_position_s

    if k == 0:
        return 1.0 / round_trip(1)
    draft = k * draft_s_per_token
    first = draft + round_trip(k + 1)
    if depth == 1:
        return expected_committed(a, k) / first
    q = a**k
    spacing = max((pass_s + k * per_position_s) / stages, draft)
    period = max(draft + round_trip(k), depth * spacing)
    # Where compute binds, a restarted chain's first chunk queues behind the voided ones.
    first = max(first, (depth - 1) * spacing + (pass_s + (k + 1) * per_position_s) / stages)
    g = _geometric(q, depth)
    h = sum(r * q**r for r in range(1, depth))
    per_chunk_s = (1.0 - q) * (first + spacing * h / g) + period * q**depth / g
    return _geometric(a, k) / per_chunk_s


def _check_acceptance(a: float) -> None:
    if not (math.isfinite(a) and 0.0 <= a <= 1.0):
        raise ValueError(f"acceptance must be in [0, 1], got {a}")


def positions_per_token(a: float, k: int, depth: int) -> float:
    """Positions the stages compute per committed token with (k, depth) at acceptance ``a``, in the
    model of ``predicted_rate``. Synchronous rounds send k+1 positions and commit
    ``expected_committed(a, k)``. A pipelined chain sends its first chunk with the last committed
    token (k+1 positions), one more of k per fully accepted chunk, and ``depth - 1`` chunks voided
    after its rejection; it commits sum_{i<k} a^i tokens per chunk checked. 1 for plain decoding."""
    _check_acceptance(a)
    if k == 0:
        return 1.0
    if depth == 1:
        return (k + 1) / expected_committed(a, k)
    q = a**k
    # Per chain, times (1 - q): chunks checked 1/(1-q), voided depth-1, the first position once.
    positions = k + (k * (depth - 1) + 1) * (1.0 - q)
    return positions / _geometric(a, k)


@dataclass(frozen=True)
class Load:
    """The other sessions on a route, as one session's plan sees them."""

    positions: float = 0.0  # positions they put in each pass this session's chunks ride in
    rate: float = 0.0  # tokens per second they commit between them

    def cost(self, extra_positions_per_s: float, per_position_s: float) -> float:
        """Tokens per second the others lose to ``extra_positions_per_s`` more positions in their
        passes: each delays every pass it rides in by ``per_position_s``, and a session committing
        r tokens per second at one per pass loses r * per_position_s tokens per such position."""
        return extra_positions_per_s * per_position_s * self.rate


ALONE = Load()


class Router:
    """Per-session online planner: folds in what each chunk showed, and plans the next chain.

    Acceptance, per drafter. Within a chunk the drafts are Bernoulli trials up to the first
    rejection, so a chunk with ``accepted`` of ``drafted`` accepted shows ``accepted`` successes in
    ``accepted + (1 if rejected else 0)`` trials. The maximum-likelihood estimate over chunks is
    total successes / total trials. Averaging a per-chunk ratio instead is biased low wherever a
    chunk can end in a rejection after some acceptances (K >= 2): at a = 0.9 and K = 8 its
    expectation is 0.77. So the router keeps an exponential moving average of successes and one
    of trials, each trial aging the past by ``1 - smoothing``, and estimates their ratio: the MLE
    over the last ~1/smoothing trials, which weighs a long chunk by its trials. It starts from
    ``prior_acceptance`` worth one trial. Which chunks get observed (those of a chain up to its
    first rejection) depends only on outcomes already seen, so stopping there does not bias the
    estimate either.

    The default, 0.03, keeps about thirty trials in memory, while the prior, worth one trial, is
    outweighed after a few. Weighting by chunk instead (each chunk
    aging the past by 0.9) kept a stream that starts with one-draft chunks near the prior for
    ~20 chunks, which on a 64-token answer is most of it.

    Timing. A lone chunk of n positions comes back after rtt + pass_s + n * per_position_s (the
    network, the compute every pass costs whatever its size, the compute per position); a chunk
    sent together with the one before it queues behind it at the stages and comes back one
    service time of the busiest stage after it, (pass_s + n * per_position_s) / stages. Both
    kinds of observation (``observe_round_trip``, ``observe_spacing``) feed one exponentially
    weighted least-squares fit of (rtt, pass_s, per_position_s), with ``TIMING_SMOOTHING`` the
    weight of one observation. The slope is held to the prior ``per_position_s`` by a ridge of
    ``SLOPE_PRIOR_SPREAD`` positions²: plans that keep K fixed send chunks of only two sizes, one
    apart, which pin the round trip but not the slope. ``pass_s`` is held to 0 by a faint ridge
    until spacings separate it from the network: a round trip alone cannot. A round trip measured
    from sending includes any wait behind chunks sent just before it; the fit absorbs that wait,
    which errs towards caution. Where a pass is mostly fixed compute (a memory-bound stage
    reading its weights), a voided chunk costs nearly what an accepted one does, and the rate
    model stops pipelining drafts that are likely to be rejected.

    Exploration. A drafter whose estimate fell near 0 would never be chosen again and never
    observed again, so a session that turns draftable (repeated text begins) would go unnoticed.
    Every ``explore_every`` rounds at most (fewer where probing is cheap, see ``_probe_interval``:
    every round where a useless probe costs under ``EXPLORE_BUDGET``), a plain round becomes a
    probe of an available drafter (the least recently tried) with the smallest K, one chunk in
    flight: a round that still commits at least one token and costs one extra position. Only
    plain rounds are replaced by probes: a drafter that is beaten by another one is not re-tried
    while speculation goes on.

    Caution. The estimate picks K and depth, but a plan is only chosen where it holds up were the
    acceptance at its lower bound (``acceptance_bound``): alone, losing at most ``EXPLORE_BUDGET``
    to plain decoding; with other sessions in its passes, still beating it by ``SHARED_MARGIN``. A
    new session's prior alone bounds it at 0: over a long round trip alone, where a useless draft
    costs little, it speculates from its first chunk; on passes shared by several streams, where
    drafts cost the others, it waits for evidence (probes).
    """

    def __init__(
        self,
        drafters: Mapping[str, float] = DEFAULT_DRAFTERS,
        *,
        k_choices: Collection[int] = (1, 2, 4, 6, 8, 12, 16, 24, 32),
        depth_choices: Collection[int] = (1, 2, 3, 4),
        prior_acceptance: float = 0.5,
        smoothing: float = 0.03,
        rtt_s: float = 0.05,
        per_position_s: float = 0.002,
        stages: int = 1,
        explore_every: int = EXPLORE_EVERY,
        fixed: Plan | None = None,
        timing: RouteTiming | None = None,
        stand_ins: Collection[str] = (),
    ) -> None:
        """``drafters``: drafting seconds per token of each drafter by name. ``stages``: how many
        stages the route's compute is spread over (1 is the cautious guess: no overlap of chunks).
        ``fixed``: always this plan (for benchmarks), or plain decoding when its drafter has
        nothing to propose. ``timing``: the route's timing estimates, shared with the other
        sessions on the route (a new one from ``rtt_s``, ``per_position_s`` and ``stages`` if
        None): the round trip and the compute are the route's, whoever measured them.
        ``stand_ins``: drafters that propose on weak evidence (a one-token match) where a better one
        has none; on shared passes they are probed only at intervals, never at once (``plan``)."""
        if not drafters and fixed != PLAIN:
            raise ValueError("need at least one drafter (or fixed=PLAIN)")
        for name, cost in drafters.items():
            if not (math.isfinite(cost) and cost >= 0.0):
                raise ValueError(f"drafter {name!r}: cost per token must be finite and >= 0, got {cost}")
        if not k_choices or min(k_choices) < 1:
            raise ValueError(f"k choices must be >= 1, got {tuple(k_choices)}")
        if not depth_choices or min(depth_choices) < 1:
            raise ValueError(f"depth choices must be >= 1, got {tuple(depth_choices)}")
        _check_acceptance(prior_acceptance)
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if explore_every < 1:
            raise ValueError(f"explore_every must be >= 1, got {explore_every}")
        if fixed is not None and fixed.drafter is not None and fixed.drafter not in drafters:
            raise ValueError(f"fixed plan's drafter {fixed.drafter!r} is not one of {sorted(drafters)}")
        unknown = set(stand_ins) - set(drafters)
        if unknown:
            raise ValueError(f"stand-in drafters {sorted(unknown)} are not among {sorted(drafters)}")
        self.drafters = dict(drafters)
        self.stand_ins = frozenset(stand_ins)
        self.k_choices = tuple(sorted(set(k_choices)))
        self.depth_choices = tuple(sorted(set(depth_choices)))
        self.smoothing = smoothing
        self.timing = timing if timing is not None else RouteTiming(rtt_s, per_position_s, stages=stages)
        self.stages = self.timing.stages
        self.explore_every = explore_every
        self.fixed = fixed
        self.last_plan: Plan | None = None
        self.chosen: dict[Plan, int] = {}  # how often each plan was chosen, for reports
        # Moving averages of accepted drafts and of trials (accepted + rejections), per drafter.
        self._successes = dict.fromkeys(self.drafters, prior_acceptance)
        self._trials = dict.fromkeys(self.drafters, 1.0)
        # Plain plans in a row since the last probe or speculative plan, for exploration: a probe
        # comes once the round it would take completes its interval (``_probe_interval``). A new
        # session's drafters are each probed as soon as they can propose (``plan``): text to
        # repeat is found from the first chunk.
        self._plain_streak = 0
        self._rounds = 0
        self._last_tried = dict.fromkeys(self.drafters, 0)  # round of each drafter's latest plan

    def observe(self, drafter: str, drafted: int, accepted: int) -> None:
        """One verified chunk of ``drafted`` drafts whose first ``accepted`` were accepted."""
        self._known(drafter)
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got accepted={accepted}, drafted={drafted}")
        if drafted == 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        keep = 1.0 - self.smoothing
        # Each trial ages what came before by ``keep``: a chunk of one draft counts as one trial,
        # not as much as a chunk of sixteen, so short chunks early on do not hold the estimate
        # near its prior for dozens of rounds.
        decay = keep**trials
        self._successes[drafter] = decay * self._successes[drafter] + accepted
        self._trials[drafter] = decay * self._trials[drafter] + trials

    def observe_round_trip(self, positions: int, seconds: float) -> None:
        """See ``RouteTiming.observe_round_trip``."""
        self.timing.observe_round_trip(positions, seconds)

    def observe_spacing(self, positions: int, seconds: float) -> None:
        """See ``RouteTiming.observe_spacing``."""
        self.timing.observe_spacing(positions, seconds)

    def acceptance(self, drafter: str) -> float:
        """The current estimate of ``drafter``'s per-token acceptance."""
        self._known(drafter)
        return min(1.0, self._successes[drafter] / self._trials[drafter])

    def acceptance_bound(self, drafter: str) -> float:
        """The acceptance a plan must still win at to be chosen: the estimate less ``ACCEPTANCE_CAUTION`` standard
        errors of a rate over the trials in memory, sqrt(a (1 - a) / trials). The prior alone
        (one trial at 0.5) bounds it at 0, so a drafter speculates only once it has shown some
        accepted drafts (a probe, ``_probe_interval``); a run of full accepts on repeated text
        lifts it within a few chunks (0.9 over 30 trials prices at 0.85)."""
        a = self.acceptance(drafter)
        return max(0.0, a - ACCEPTANCE_CAUTION * math.sqrt(a * (1.0 - a) / self._trials[drafter]))

    @property
    def rtt_s(self) -> float:
        return self._timing()[0]

    @property
    def per_position_s(self) -> float:
        return self._timing()[1]

    @property
    def pass_s(self) -> float:
        return self._timing()[2]

    def rate(self, plan: Plan, *, load: Load | None = None) -> float:
        """``predicted_rate`` of ``plan`` under the current estimates, in tokens per second.

        ``load``: the other sessions on the route (``Load``). Their positions ride in the same
        passes as this session's chunks, so every pass costs their compute too; a position this
        session sends beyond what plain decoding would send delays every one of them by its compute
        (``Load.cost``), and that is priced here: with one stream the extra positions of
        speculation are nearly free (a pass of k+1 positions costs little more than one), with
        several the passes are full already and a rejected draft is compute taken from the others."""
        if plan.drafter is None:
            return self._rate(plan, 0.0, load or ALONE)
        return self._rate(plan, self.acceptance(plan.drafter), load or ALONE)

    def _rate(self, plan: Plan, a: float, load: Load, plain: float | None = None) -> float:
        """``rate`` at acceptance ``a``; ``plain``: plain decoding's under ``load``, if known."""
        rtt_s, per_position_s, pass_s = self._timing()
        shared_pass_s = pass_s + load.positions * per_position_s
        if plan.drafter is None:
            single_s = self.timing.single_s()
            if load.positions == 0 and single_s is not None and single_s > 0.0:
                return 1.0 / single_s
            return predicted_rate(0.0, 0, 1, rtt_s, per_position_s, stages=self.stages, pass_s=shared_pass_s)
        rate = predicted_rate(
            a,
            plan.k,
            plan.depth,
            rtt_s,
            per_position_s,
            self.drafters[plan.drafter],
            stages=self.stages,
            pass_s=shared_pass_s,
        )
        if load.rate <= 0.0:
            return rate
        plain = self._rate(PLAIN, 0.0, load) if plain is None else plain
        extra = max(0.0, rate * positions_per_token(a, plan.k, plan.depth) - plain)  # positions/s beyond plain's
        return rate - load.cost(extra, per_position_s)

    def plan(
        self, *, available: Collection[str] | None = None, load: Load | None = None, in_flight: int = 0
    ) -> Plan | None:
        """The plan for the next chunk. ``available``: the drafters with something to propose
        this round (None: all of them); a name this router was not given raises ValueError.
        ``load``: the other sessions sharing the route's passes now (see ``rate``). ``in_flight``:
        the session's chunks already in flight; where the plan keeps no more than that many in
        flight, the answer is None (wait for a result) and nothing is recorded, so ``chosen``
        counts the chunks actually planned."""
        names = sorted(self.drafters) if available is None else sorted(set(available))
        for name in names:
            self._known(name)
        streak = self._plain_streak
        if self.fixed is not None:
            chosen = self.fixed if self.fixed.drafter is None or self.fixed.drafter in names else PLAIN
        else:
            chosen = self._best(names, load)
            probing = False
            if chosen.plain and names:
                # A drafter never tried yet is probed as soon as it has something to propose (the
                # one-token drafter's first probe, rejected at the answer's opening, must not hold
                # back the n-gram drafter's when the text to repeat begins); the others by interval.
                # On passes other sessions share, a stand-in's first probe waits for its interval
                # too: its one-token matches are found in nearly any text, and the row each probe
                # adds to a full pass costs every session in it.
                shared = load is not None and load.positions > 0
                eager = [n for n in names if self._last_tried[n] == 0 and not (shared and n in self.stand_ins)]
                probe = Plan(min(names, key=lambda name: (self._last_tried[name], name)), self.k_choices[0], 1)
                if eager:
                    chosen, probing = Plan(eager[0], self.k_choices[0], 1), True
                elif streak + 1 >= self._probe_interval(probe, load):
                    chosen, probing = probe, True
            streak = streak + 1 if chosen.plain and not probing else 0
        if in_flight >= chosen.depth:
            return None
        self._rounds += 1
        self._plain_streak = streak
        if chosen.drafter is not None:
            self._last_tried[chosen.drafter] = self._rounds
        self.last_plan = chosen
        self.chosen[chosen] = self.chosen.get(chosen, 0) + 1
        return chosen

    def to_json(self) -> dict[str, object]:
        rtt_s, per_position_s, pass_s = self._timing()
        return {
            "acceptance": {name: round(self.acceptance(name), 4) for name in sorted(self.drafters)},
            "rtt_s": round(rtt_s, 6),
            "per_position_s": round(per_position_s, 6),
            "pass_s": round(pass_s, 6),
            "last_plan": self.last_plan.to_json() if self.last_plan is not None else None,
            "plans": {
                ("plain" if plan.plain else f"{plan.drafter} k={plan.k} depth={plan.depth}"): count
                for plan, count in sorted(self.chosen.items(), key=lambda item: -item[1])
            },
        }

    def _best(self, names: list[str], load: Load | None) -> Plan:
        """The plan of the highest rate at the acceptance estimate that beats plain decoding by
        ``PLAIN_MARGIN``, among those that still hold up at the estimate's lower bound
        (``acceptance_bound``): alone, losing at most ``EXPLORE_BUDGET`` to plain decoding there;
        on shared passes, still beating it by ``SHARED_MARGIN``. The estimate picks K and depth; the bound
        keeps a bet on a drafter's few lucky trials (long chunks on passes several streams share)
        from being made."""
        load = load or ALONE
        plain = self._rate(PLAIN, 0.0, load)
        best, best_rate = PLAIN, plain * (1.0 + PLAIN_MARGIN)
        # Alone, a bet that fails costs this session only, and may cost what exploring may; on
        # passes the other sessions share, it costs them too, and must not lose at all.
        floor = plain * (1.0 - EXPLORE_BUDGET) if load.positions == 0 else plain * (1.0 + SHARED_MARGIN)
        ceiling = self._ceiling(load)
        for name in names:
            a, bound = self.acceptance(name), self.acceptance_bound(name)
            if ceiling(a) <= best_rate or ceiling(bound) < floor:
                continue  # no K or depth could be chosen: every plan's rate is under its ceiling
            for k in self.k_choices:
                for depth in self.depth_choices:
                    candidate = Plan(name, k, depth)
                    rate = self._rate(candidate, a, load, plain)
                    if rate > best_rate and self._rate(candidate, bound, load, plain) >= floor:
                        best, best_rate = candidate, rate
        return best

    def _ceiling(self, load: Load) -> Callable[[float], float]:
        """An upper bound on the rate of every speculative plan at acceptance ``a``: 1 / ((1 - a) T(1)),
        T(1) the round trip of one position on passes shared with ``load``. In ``predicted_rate``'s
        model a pipelined chain's time per chunk checked is at least T(1) (1 - q) / (1 - q^depth),
        while it commits sum_{i<k} a^i = (1 - q) / (1 - a) tokens (q = a^k); a synchronous round
        commits (1 - a^(k+1)) / (1 - a) in at least T(1); drafting and the cost to the other
        sessions only lower it. ``_best`` skips a drafter whose ceiling cannot clear its bars: the
        72 plans of two drafters are priced only where one could be chosen (novel text prices none)."""
        rtt_s, per_position_s, pass_s = self._timing()
        one_s = rtt_s + pass_s + load.positions * per_position_s + per_position_s

        def ceiling(a: float) -> float:
            return math.inf if a >= 1.0 else 1.0 / ((1.0 - a) * one_s)

        return ceiling

    def _probe_interval(self, probe: Plan, load: Load | None) -> int:
        """Rounds per probe (the probe's own included). Alone: as few as keep the loss of probing a
        useless drafter (one more position and its drafting, for the same one token) within
        ``EXPLORE_BUDGET``, at most ``explore_every``; over a long WAN round trip that is every
        round, and the estimate cannot stay stuck at a chance run of rejections. On passes shared
        by other sessions: ``explore_every``, since the position a probe adds delays them all."""
        load = load or ALONE
        if load.positions > 0:
            # On passes the other sessions share, what one more position costs is not on the fitted
            # line: the stages' kernels step at row counts (on a CPU, a pass of 5 rows can cost what
            # one of 8 does, half again one of 4), so a probe is priced at its worst: as rarely as
            # exploring allows.
            return self.explore_every
        # Alone: plain decoding at what a one-position step measured, the probe on the fitted line.
        rtt_s, per_position_s, pass_s = self._timing()
        plain_s = self.timing.single_s() or rtt_s + pass_s + per_position_s
        probe_s = max(plain_s, rtt_s + pass_s + (probe.k + 1) * per_position_s)
        probe_s += probe.k * self.drafters[str(probe.drafter)]
        plain, useless = 1.0 / plain_s, 1.0 / probe_s
        loss = 1.0 - useless / plain if plain > 0.0 else 1.0
        return max(1, min(self.explore_every, math.ceil(loss / EXPLORE_BUDGET)))

    def _timing(self) -> tuple[float, float, float]:
        return self.timing.estimate()

    def _known(self, drafter: str) -> None:
        if drafter not in self.drafters:
            raise ValueError(f"unknown drafter {drafter!r}: this router knows {sorted(self.drafters)}")


class RouteTiming:
    """A route's timing, estimated from what its sessions observe (see ``Router``'s docstring,
    Timing): the network's round trip, the compute per position and the compute per pass. One is
    shared by every session of a coordinator on the same route, so a new session plans with what
    the ones before it measured instead of priors."""

    def __init__(self, rtt_s: float = 0.05, per_position_s: float = 0.002, *, stages: int = 1) -> None:
        predicted_rate(0.5, 1, 1, rtt_s, per_position_s, stages=stages)  # validates the priors
        self.stages = stages
        self._prior = (rtt_s, per_position_s, 0.0)
        # Exponentially weighted normal equations of the fit over features (network, pass,
        # positions), one set per kind of observation (round trips, spacings), each aging only
        # with its own kind.
        self._sums = {kind: _NormalEquations() for kind in ("trip", "single", "spacing")}
        self._estimate: tuple[float, float, float] | None = self._prior
        self._single = (0.0, 0.0)  # exponentially weighted (weight, seconds) of one-position round trips

    def observe_round_trip(self, positions: int, seconds: float) -> None:
        """A chunk of ``positions`` positions, sent with nothing in flight ahead of it, came back
        ``seconds`` after it was sent."""
        if positions < 1 or not (math.isfinite(seconds) and seconds >= 0.0):
            return
        if positions == 1:
            keep = 1.0 - TIMING_SMOOTHING
            self._single = (keep * self._single[0] + 1.0, keep * self._single[1] + seconds)
        self._observe("single" if positions == 1 else "trip", (1.0, 1.0, float(positions)), seconds)

    def observe_spacing(self, positions: int, seconds: float) -> None:
        """A chunk of ``positions`` positions, sent together with the one before it, came back
        ``seconds`` after that one: the service time of the route's busiest stage."""
        if positions < 1 or not (math.isfinite(seconds) and seconds >= 0.0):
            return
        self._observe("spacing", (0.0, 1.0, float(positions)), seconds * self.stages)

    def _observe(self, kind: str, features: tuple[float, float, float], seconds: float) -> None:
        keep = 1.0 - TIMING_SMOOTHING
        sums = self._sums[kind]
        sums.weight = keep * sums.weight + 1.0
        for i in range(3):
            sums.moment[i] = keep * sums.moment[i] + features[i] * seconds
            for j in range(3):
                sums.gram[i][j] = keep * sums.gram[i][j] + features[i] * features[j]
        self._estimate = None

    def estimate(self) -> tuple[float, float, float]:
        """(rtt_s, per_position_s, pass_s), the priors before any round trip was observed; solved
        once per observation, however many plans read it."""
        if self._estimate is None:
            self._estimate = self._solve()
        return self._estimate

    def single_s(self) -> float | None:
        """The round trip of a one-position step (plain decoding), as measured; None before any.

        Kept apart from the fit: on a CPU a pass of one row takes the matrix-vector path and one
        of two rows a matrix-matrix one, so a pass of 2 positions can cost half again as much as a
        pass of 1 where the line through chunk sizes 2-33 says a few percent. Plain decoding is
        priced at what it measured, speculation on the line fitted to chunks."""
        weight, seconds = self._single
        return seconds / weight if weight > 0.0 else None

    def _solve(self) -> tuple[float, float, float]:
        # The line is fitted to chunks (2 positions or more) once there are any, else to steps.
        trips = "trip" if self._sums["trip"].weight > 0.0 else "single"
        if self._sums[trips].weight <= 0.0:
            return self._prior
        # Each kind weighs as one: a burst of spacings does not drown the round trips that alone
        # tell the network's share.
        gram = [[0.0] * 3 for _ in range(3)]
        moment = [0.0] * 3
        for kind in (trips, "spacing"):
            sums = self._sums[kind]
            if sums.weight > 0.0:
                for i in range(3):
                    moment[i] += sums.moment[i] / sums.weight
                    for j in range(3):
                        gram[i][j] += sums.gram[i][j] / sums.weight
        gram[1][1] += PASS_PRIOR_WEIGHT  # pass_s -> 0 where nothing separates it from the network
        gram[2][2] += SLOPE_PRIOR_SPREAD  # the slope -> its prior where chunk sizes barely vary
        moment[2] += SLOPE_PRIOR_SPREAD * self._prior[1]
        network, pass_s, slope = _solve3(gram, moment)
        pass_s, slope, network = max(0.0, pass_s), max(0.0, slope), max(0.0, network)
        if network + pass_s + slope <= 0.0:
            return self._prior
        return network, slope, pass_s


@dataclass
class _NormalEquations:
    """Exponentially weighted sums of one kind of timing observation over the features (network,
    pass, positions): their total weight, the 3 x 3 feature products, the feature x seconds products."""

    weight: float = 0.0
    gram: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    moment: list[float] = field(default_factory=lambda: [0.0] * 3)


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float]:
    """x with a @ x = b for a symmetric positive definite 3 x 3 ``a`` (Gaussian elimination)."""
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            return 0.0, 0.0, 0.0
        for r in range(col + 1, 3):
            factor = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= factor * m[col][c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x[0], x[1], x[2]
