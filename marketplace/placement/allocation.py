# Over 500 lines: the planner's pure rules over its value types (NodeCapacity, Stage), which place() composes.
"""Layer allocation: how many pipelines, which nodes in each, and which layers each node hosts.

A model of ``L`` decoder layers is served by ``k`` disjoint pipelines; each pipeline is a chain of
stages, a stage being one node hosting a contiguous block of layers, and together a pipeline's
stages cover ``[0, L)``. Three decisions, after Parallax:

1. the number of pipelines ``k`` and their members (:func:`choose_pipeline_count`), from the
   nodes' memory (``max_layers``) alone: more pipelines serve more requests at once, more stages
   per pipeline add a network hop per token;
2. the layer split inside a pipeline (:func:`water_fill`), proportional to the members' compute
   and capped by their memory, so that every stage takes about the same time per token;
3. when to redo it (:func:`needs_rebalance`): the coefficient of variation of per-layer load.

Spares (nodes no pipeline needs) keep a warm copy of a loaded stage's block, ready for healing;
when a pipeline member leaves, :func:`repair` puts a spare holding its span in its place. With
fewer spares than spans, they go where a loss is likeliest and costliest (:func:`span_needs`:
the holders' failure rates times the layers a heal would otherwise load), and
:func:`spare_moves` says which spare to move once churn has left a span held once with no spare
while another is held more often than it needs.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from marketplace.placement import covering
from marketplace.placement.errors import PlacementError

# Above this many multiset states the exact pipeline-count DP gives way to the greedy; 2**16
# covers every instance of 16 nodes or fewer (and larger ones whose capacities repeat).
EXACT_STATES = 1 << 16
DEFAULT_MIN_REPUTATION = 0.5
# Failures per hour of a node with no record: what ``candidates.loss_rate`` gives a new node under
# the default prior (SWARM_LOSS_PRIOR_FAILURES = 1 in SWARM_LOSS_PRIOR_HOURS = 24, one a day).
UNKNOWN_LOSS_RATE = 1.0 / 24.0

Span = tuple[int, int]  # (layer_start, layer_end) of a block, end exclusive


@dataclass(frozen=True)
class NodeCapacity:
    """What placement knows of one node."""

    node: str  # node id
    compute: float  # relative throughput, layer-tokens/s from the agent's benchmark; > 0
    max_layers: int  # decoder layers that fit in the node's memory; >= 1
    reputation: float = 1.0  # below the placement threshold the node is kept off pipelines
    # Its unmeasured speed claim is far past the others' (``nodes.capacity``): kept off pipelines
    # like a node under the reputation threshold, until a challenge measures it.
    in_doubt: bool = False
    # Failures per hour expected of it (``candidates.loss_rate``): how likely its stage is to be
    # lost, which draws a warm spare to the span it holds (``span_needs``); finite, >= 0.
    loss_rate: float = UNKNOWN_LOSS_RATE

    def __post_init__(self) -> None:
        if not isinstance(self.node, str) or not self.node:
            raise PlacementError(f"node id must be a non-empty string, got {self.node!r}")
        if not (math.isfinite(self.compute) and self.compute > 0):
            raise PlacementError(f"{self.node}: compute must be finite and > 0, got {self.compute!r}")
        if isinstance(self.max_layers, bool) or not isinstance(self.max_layers, int) or self.max_layers < 1:
            raise PlacementError(f"{self.node}: max_layers must be an int >= 1, got {self.max_layers!r}")
        if not math.isfinite(self.reputation):
            raise PlacementError(f"{self.node}: reputation must be finite, got {self.reputation!r}")
        if not (math.isfinite(self.loss_rate) and self.loss_rate >= 0):
            raise PlacementError(f"{self.node}: loss_rate must be finite and >= 0, got {self.loss_rate!r}")


@dataclass(frozen=True)
class Stage:
    """One node hosting layers ``[layer_start, layer_end)``."""

    node: str
    layer_start: int  # first layer hosted, inclusive
    layer_end: int  # end of the block, exclusive

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_end:
            raise PlacementError(f"{self.node}: bad span {self.layer_start}:{self.layer_end}")

    @property
    def layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class PipelinePlan:
    """The chosen number of pipelines and their members (node ids, largest memory first)."""

    k: int  # number of disjoint pipelines
    pipelines: tuple[tuple[str, ...], ...]  # members of each pipeline
    stages_total: int  # s(k): nodes used over all pipelines
    score: float  # k**2 / stages_total, the quantity maximised
    spares: tuple[str, ...]  # nodes in no pipeline, largest memory first
    exact: bool = True  # False when s(k) came from the greedy (more than EXACT_STATES states)


@dataclass(frozen=True)
class Placement:
    """The outcome of :func:`place`: the stages of every pipeline and the spares' warm blocks."""

    n_layers: int
    plan: PipelinePlan
    pipelines: tuple[tuple[Stage, ...], ...]  # each covers [0, n_layers) in order
    spares: tuple[Stage, ...]  # warm blocks of nodes that carry no pipeline load

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Every load-bearing stage, pipeline after pipeline."""
        return tuple(stage for pipeline in self.pipelines for stage in pipeline)


def _check_layers(n_layers: int) -> None:
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise PlacementError(f"n_layers must be an int >= 1, got {n_layers!r}")


def _check_unique(nodes: Sequence[NodeCapacity]) -> None:
    if not nodes:
        raise PlacementError("no nodes to place on")
    ids = [n.node for n in nodes]
    if len(set(ids)) != len(ids):
        raise PlacementError("duplicate node ids")


def water_fill(nodes: Sequence[NodeCapacity], n_layers: int) -> dict[str, int]:
    """Split ``n_layers`` over ``nodes`` in proportion to compute, capped by memory.

    Continuous shares: ``x_i = min(cap_i, lam * c_i)`` with the water level ``lam`` chosen so that
    ``sum x_i = L``. ``G(lam) = sum min(cap_i, lam * c_i)`` is continuous and non-decreasing, so
    the level is found by sorting the nodes by their saturation level ``t_i = cap_i / c_i``: with
    the first ``j`` nodes saturated, ``lam_j = (L - sum_{i<j} cap_i) / sum_{i>=j} c_i``, and the
    answer is the smallest ``j`` with ``lam_j <= t_j``. This is the fixed point of "cap the
    saturated nodes, share the rest in proportion among the others, repeat", in O(n log n).

    Integers by largest remainder: every node gets ``floor(x_i)`` (``<= cap_i``), and the
    ``L - sum floor(x_i)`` layers left go one each to the largest fractional parts, ties to the
    smaller node id. Those nodes have ``floor(x_i) < x_i <= cap_i``, so caps hold, and since the
    fractional parts are each < 1 and sum to the layers left, there are always enough of them.
    Shares are computed in exact rational arithmetic, so ties are real ties.

    Zero layers: a node's result is 0 exactly when its share is below 1 and it loses the
    remainder round, which must happen to someone when there are more nodes than layers. Every
    node appears in the result; callers drop the zeros (:func:`spans_for` makes no stage for them).

    Raises PlacementError when ``sum cap_i < L``.
    """
    _check_layers(n_layers)
    _check_unique(nodes)
    if sum(n.max_layers for n in nodes) < n_layers:
        raise PlacementError(f"{len(nodes)} nodes hold {sum(n.max_layers for n in nodes)} layers, need {n_layers}")
    compute = {n.node: Fraction(n.compute) for n in nodes}
    by_level = sorted(nodes, key=lambda n: (n.max_layers / compute[n.node], n.node))
    suffix_compute = list(itertools.accumulate(reversed([compute[n.node] for n in by_level])))[::-1]
    shares: dict[str, Fraction] = {n.node: Fraction(n.max_layers) for n in nodes}
    saturated_layers = 0
    for j, node in enumerate(by_level):
        level = (n_layers - saturated_layers) / suffix_compute[j]
        if level <= node.max_layers / compute[node.node]:
            for rest in by_level[j:]:
                shares[rest.node] = level * compute[rest.node]
            break
        saturated_layers += node.max_layers
    layers = {n.node: math.floor(shares[n.node]) for n in nodes}
    left = n_layers - sum(layers.values())
    for node in sorted(nodes, key=lambda n: (layers[n.node] - shares[n.node], n.node))[:left]:
        layers[node.node] += 1
    return layers


def spans_for(order: Sequence[str], layers: Mapping[str, int]) -> list[Stage]:
    """Contiguous stages from layer 0 in the given node order; a node with 0 layers gets no stage."""
    if len(set(order)) != len(order):
        raise PlacementError("duplicate node in stage order")
    if any(layers.get(node, 0) > 0 for node in set(layers) - set(order)):
        raise PlacementError("layers given to a node missing from the order")
    stages, start = [], 0
    for node in order:
        if node not in layers or layers[node] < 0:
            raise PlacementError(f"{node}: no layer count, or a negative one")
        if layers[node]:
            stages.append(Stage(node, start, start + layers[node]))
            start += layers[node]
    return stages


def _as_nodes(capacities: Sequence[int | NodeCapacity]) -> list[NodeCapacity]:
    """Bare capacities become nodes named by their index ("0", "1", ...) with equal compute."""
    return [c if isinstance(c, NodeCapacity) else NodeCapacity(str(i), 1.0, c) for i, c in enumerate(capacities)]


def choose_pipeline_count(capacities: Sequence[int] | Sequence[NodeCapacity], n_layers: int) -> PipelinePlan:
    """Choose k, the number of disjoint pipelines, maximising ``k**2 / s*(k)`` (ties: larger k).

    A pipeline is a set of nodes whose ``max_layers`` sum to >= ``n_layers`` (a node's capacity
    counts up to ``n_layers``); ``s*(k)`` is the fewest nodes that can form k pipelines at once.
    Throughput grows with k while every extra stage costs a hop per token, whence Parallax's
    ``k**2 / s``: k pipelines of ``s/k`` stages each.

    Nodes are ranked by capacity (largest first, then compute, then id); by the exchange argument
    the nodes used can always be taken as a prefix of that ranking. Exact (multiset DP, see
    ``covering.exact_groups``) when the instance has at most ``EXACT_STATES`` states, which includes
    every instance of 16 nodes or fewer. Above that ``s(k)`` is the fewer nodes of two greedy bin
    coverings (``covering.greedy_groups``): LPT (next-largest node into the pipeline missing the
    most layers) and best fit (close each pipeline with the smallest node that does): exact for k = 1
    and whenever every node covers a pipeline alone, an upper bound on s*(k) otherwise
    (``bench/placement.py`` counts how often it matches the exact score on small random
    instances); ``exact`` says which path ran. Bare integer capacities name their nodes by
    index: "0", "1", ...

    Raises PlacementError when all nodes together cannot hold ``n_layers``.
    """
    _check_layers(n_layers)
    nodes = _as_nodes(capacities)
    _check_unique(nodes)
    ranked = sorted(nodes, key=lambda n: (-min(n.max_layers, n_layers), -n.compute, n.node))
    caps = [min(n.max_layers, n_layers) for n in ranked]
    if sum(caps) < n_layers:
        raise PlacementError(f"{len(nodes)} nodes hold {sum(caps)} layers, need {n_layers}")
    exact = math.prod(caps.count(v) + 1 for v in set(caps)) <= EXACT_STATES
    groups = covering.exact_groups(caps, n_layers) if exact else covering.greedy_groups(caps, n_layers)
    used = {i for group in groups for i in group}
    stages_total = len(used)
    return PipelinePlan(
        k=len(groups),
        pipelines=tuple(tuple(ranked[i].node for i in group) for group in groups),
        stages_total=stages_total,
        score=len(groups) ** 2 / stages_total,
        spares=tuple(n.node for i, n in enumerate(ranked) if i not in used),
        exact=exact,
    )


def place(
    nodes: Sequence[NodeCapacity],
    n_layers: int,
    *,
    min_reputation: float = DEFAULT_MIN_REPUTATION,
    spares_per_pipeline: int = 0,
    max_stages: int = 8,
) -> Placement:
    """Pipelines, their stages and the spares' warm blocks for a model of ``n_layers`` layers.

    1. Nodes with ``reputation >= min_reputation`` and no speed claim in doubt are trusted. Only
       when the trusted nodes cannot hold the model together are the others admitted, just until
       the layers fit: low-reputation nodes first, highest reputation first (then most memory,
       then id), then nodes whose claim is in doubt; the rest are spares. A node claiming a speed
       no challenge has measured thus gets no pipeline of its own while the others can serve.
    2. :func:`choose_pipeline_count` over the admitted nodes gives k and each pipeline's minimal
       members. Of the admitted nodes left over, up to ``spares_per_pipeline`` per pipeline are
       kept as spares (largest first); the rest join the pipelines, each to the one with the
       least compute so far, while it has fewer than ``max_stages`` stages: a provider's node
       earns only on the serving path, and more stages split the per-token compute further.
    3. Each pipeline's ``n_layers`` are water-filled over its members (:func:`water_fill`), in
       the member order of the plan; a member the split leaves at 0 layers becomes a spare.
    4. A spare keeps a warm copy of a stage's span: among the spans it can hold (``layers <=
       max_layers``) the one with the fewest replicas so far (the pipeline stages holding exactly
       that span plus the spares given it: a span that two pipelines hold is less in need than
       one held once), then the greatest need (:func:`span_needs`: the holders' ``loss_rate``
       times the span's layers, the likeliest and costliest loss), then the most loaded (layers /
       compute of its slowest holder), then the earliest pipeline and layer. Spares spread over
       the spans instead of piling on one. A spare too small for any stage holds the first
       ``max_layers`` layers of the most loaded stage, a partial block that still shortens a heal.
    Spares are taken trusted first, each by capacity (largest first), compute, then id.
    """
    _check_layers(n_layers)
    _check_unique(nodes)
    trusted = [n for n in nodes if n.reputation >= min_reputation and not n.in_doubt]
    doubtful = sorted(
        (n for n in nodes if n.reputation < min_reputation or n.in_doubt),
        key=lambda n: (n.in_doubt, -n.reputation, -n.max_layers, n.node),
    )
    admitted, missing = list(trusted), n_layers - sum(min(n.max_layers, n_layers) for n in trusted)
    for node in doubtful:
        if missing <= 0:
            break
        admitted.append(node)
        missing -= min(node.max_layers, n_layers)
    if missing > 0:
        raise PlacementError(f"{len(nodes)} nodes cannot hold {n_layers} layers")
    plan = choose_pipeline_count(admitted, n_layers)
    by_id = {n.node: n for n in nodes}
    groups = [list(members) for members in plan.pipelines]
    used = {m for members in groups for m in members}
    extra = sorted((n for n in admitted if n.node not in used), key=lambda n: (-n.max_layers, -n.compute, n.node))
    extra = extra[spares_per_pipeline * len(groups) :]
    # The open pipelines by (compute so far, index): the lightest, then the earliest, takes the next.
    lightest = [(sum(by_id[m].compute for m in g), i) for i, g in enumerate(groups) if len(g) < max_stages]
    heapq.heapify(lightest)
    for node in extra:
        if not lightest:
            break
        _, i = heapq.heappop(lightest)
        groups[i].append(node.node)
        if len(groups[i]) < max_stages:
            heapq.heappush(lightest, (sum(by_id[m].compute for m in groups[i]), i))
    pipelines, idle = [], []
    for members in groups:
        layers = water_fill([by_id[m] for m in members], n_layers)
        pipelines.append(tuple(spans_for(members, layers)))
        idle += [by_id[m] for m in members if layers[m] == 0]
    in_pipelines = {m for members in groups for m in members}
    rank = {n.node: (n.reputation < min_reputation or n.in_doubt, -n.max_layers, -n.compute, n.node) for n in nodes}
    idle = sorted(idle + [n for n in nodes if n.node not in in_pipelines], key=lambda n: rank[n.node])
    loaded = sorted(  # time per token of each stage, in units of 1/compute: layers / compute
        ((p, stage) for p, pipeline in enumerate(pipelines) for stage in pipeline),
        key=lambda ps: (-ps[1].layers / by_id[ps[1].node].compute, ps[0], ps[1].layer_start),
    )
    loss_rates = {n.node: n.loss_rate for n in nodes}
    # Spans in the order of their most loaded holder, the last tie-break.
    spares = warm_spares(idle, [stage for _, stage in loaded], loss_rates)
    return Placement(n_layers=n_layers, plan=plan, pipelines=tuple(pipelines), spares=spares)


def span_needs(stages: Sequence[Stage], loss_rates: Mapping[str, float]) -> dict[Span, float]:
    """How much each span of ``stages`` is in need of a warm spare: how likely it is to lose a
    holder (failures per hour, summed over the stages holding exactly it: ``loss_rates`` gives each
    node's ``NodeCapacity.loss_rate``) times what that loss costs, the time a heal waits for a
    node to load the span, which grows with its layers:

        need(span) = layers(span) * sum_{stages s holding exactly span} loss_rate(s.node)

    Spares are not holders here: a spare's loss fails no request. Sums are exact (``math.fsum``),
    so that two spans whose holders' rates are equal tie exactly. Raises PlacementError for a
    stage whose node has no loss rate."""
    rates: dict[Span, list[float]] = {}
    for stage in stages:
        if stage.node not in loss_rates:
            raise PlacementError(f"{stage.node}: no loss rate for its stage")
        rates.setdefault((stage.layer_start, stage.layer_end), []).append(loss_rates[stage.node])
    return {(start, end): (end - start) * math.fsum(held) for (start, end), held in rates.items()}


def warm_spares(
    nodes: Sequence[NodeCapacity], stages: Sequence[Stage], loss_rates: Mapping[str, float]
) -> tuple[Stage, ...]:
    """Warm blocks for ``nodes``, in their order: each copies the span of ``stages`` it can hold
    (``layers <= max_layers``) with the fewest replicas so far (the stages and spares holding
    exactly it), then the greatest need (:func:`span_needs`, from each stage's node's
    ``loss_rates``), the earliest in ``stages``' order on a tie; a node too small for any holds
    the first ``max_layers`` layers of the first stage, a partial block that still shortens a heal.

    Replicas come first: a job on a span held twice can route to the other holder, and a spare of
    a span held once is what spares a heal the load. Among spans held alike, the need puts a spare
    where a loss is likeliest and its heal longest."""
    replicas: dict[Span, int] = {}  # span -> stages and spares holding exactly it
    for stage in stages:
        span = (stage.layer_start, stage.layer_end)
        replicas[span] = replicas.get(span, 0) + 1
    need = span_needs(stages, loss_rates)
    spans = list(replicas)
    spares = []
    for node in nodes:
        fits = [i for i, (start, end) in enumerate(spans) if end - start <= node.max_layers]
        if fits:
            i = min(fits, key=lambda i: (replicas[spans[i]], -need[spans[i]], i))
            replicas[spans[i]] += 1
            spares.append(Stage(node.node, *spans[i]))
        else:
            start = stages[0].layer_start
            spares.append(Stage(node.node, start, start + node.max_layers))
    return tuple(spares)


@dataclass(frozen=True)
class SpareMove:
    """A warm spare loading another span: ``before`` is its block now, ``after`` the one it loads."""

    before: Stage
    after: Stage  # same node


def spare_moves(
    stages: Sequence[Stage],
    spares: Sequence[Stage],
    max_layers: Mapping[str, int],
    loss_rates: Mapping[str, float],
) -> list[SpareMove]:
    """The moves of one spare that spread the spares where they help most, best first.

    A lone span is a span of ``stages`` held by one stage and no spare. A spare may move onto a
    lone span it can hold (``layers <= max_layers``; a spare whose node is not in ``max_layers``
    stays) when its own span, even without it, has strictly more replicas than the lone span
    (two or more: a job on it can route to another holder). Lone spans come by need
    (:func:`span_needs`, highest first), then by span; for each, the spares of the spans with the
    most replicas first, then of the least need, then by node id.

    A spare on a span held only by it and one stage never moves: the move would only swap which
    span is lone, and the next sweep would swap it back. Every move thus turns a lone span into a
    span with a spare and leaves its old span with two replicas or more, never a lone one: the
    number of lone spans falls with each, so moves end, and none undoes another."""
    replicas: dict[Span, int] = {}
    for block in [*stages, *spares]:
        span = (block.layer_start, block.layer_end)
        replicas[span] = replicas.get(span, 0) + 1
    need = span_needs(stages, loss_rates)  # its keys: the spans a stage holds
    lone = sorted((span for span in need if replicas[span] == 1), key=lambda span: (-need[span], span))
    moves = []
    for start, end in lone:
        movers = [
            spare
            for spare in spares
            if spare.node in max_layers
            and end - start <= max_layers[spare.node]
            and replicas[(spare.layer_start, spare.layer_end)] - 1 > replicas[(start, end)]
        ]
        movers.sort(
            key=lambda s: (
                -replicas[(s.layer_start, s.layer_end)],
                need.get((s.layer_start, s.layer_end), 0.0),
                s.node,
            )
        )
        moves += [SpareMove(before=spare, after=Stage(spare.node, start, end)) for spare in movers]
    return moves


def carry_spares(
    spares: Sequence[Stage], before: Sequence[Sequence[Stage]], after: Sequence[Sequence[Stage]]
) -> tuple[Stage, ...]:
    """The spares' blocks once the pipelines' stages were laid out again in another ring order
    (same members, same layer counts, other spans): each spare follows the stage it copies (the
    first whose span starts where the spare's does and contains it), so it still holds a block
    that some stage serves, or the same leading part of it."""
    moved = {stage.node: stage for pipeline in after for stage in pipeline}
    copied = [stage for pipeline in before for stage in pipeline]
    carried = []
    for spare in spares:
        source = next(
            (s for s in copied if s.layer_start == spare.layer_start and s.layer_end >= spare.layer_end), None
        )
        target = moved.get(source.node) if source is not None else None
        if target is None:
            carried.append(spare)
            continue
        carried.append(Stage(spare.node, target.layer_start, target.layer_start + spare.layers))
    return tuple(carried)


@dataclass(frozen=True)
class Repair:
    """The outcome of :func:`repair`: the pipelines made whole again by spares."""

    pipelines: tuple[tuple[Stage, ...], ...]  # each covers [0, n_layers) in order
    promoted: tuple[Stage, ...]  # spares that now serve on a pipeline, with the span they held
    spares: tuple[Stage, ...]  # spares left as they were


def repair(pipelines: Sequence[Sequence[Stage]], spares: Sequence[Stage], n_layers: int) -> Repair | None:
    """Make every pipeline whole again with the spares' warm blocks, moving no surviving stage.

    ``pipelines`` hold the stages still served (a departed member leaves a gap); each gap is
    filled by a chain of unused spares whose spans tile it exactly, tried in the order given
    (callers put the ready ones first), so a spare that holds a departed stage's span takes its
    place and nobody loads a new block. None when a gap cannot be tiled that way, when stages
    overlap, or when no pipeline is left: then only a fresh :func:`place` can cover the model.
    """
    _check_layers(n_layers)
    free = list(spares)
    whole, promoted = [], []
    for members in pipelines:
        stages = sorted(members, key=lambda s: s.layer_start)
        if not stages:
            continue
        filled, position = [], 0
        for stage in [*stages, None]:
            end = n_layers if stage is None else stage.layer_start
            if end < position:
                return None
            if end > position:
                chain = _tile(position, end, free)
                if chain is None:
                    return None
                for spare in chain:
                    free.remove(spare)
                filled += chain
                promoted += chain
            if stage is not None:
                filled.append(stage)
                position = stage.layer_end
        whole.append(tuple(filled))
    if not whole:
        return None
    return Repair(pipelines=tuple(whole), promoted=tuple(promoted), spares=tuple(free))


def _tile(start: int, end: int, spares: Sequence[Stage]) -> list[Stage] | None:
    """The first chain of ``spares`` (tried in their order) covering exactly ``[start, end)``.

    A chain's spans start at increasing layers, so it never uses a spare twice; a layer from which
    no chain reaches ``end`` is remembered, which keeps the search linear in the spares."""
    dead_ends: set[int] = set()

    def chain_from(position: int) -> list[Stage] | None:
        if position == end:
            return []
        if position in dead_ends:
            return None
        for spare in spares:
            if spare.layer_start == position and spare.layer_end <= end:
                rest = chain_from(spare.layer_end)
                if rest is not None:
                    return [spare, *rest]
        dead_ends.add(position)
        return None

    return chain_from(start)


def per_layer_load(stages: Sequence[Stage], n_layers: int, compute: Mapping[str, float]) -> list[float]:
    """Each layer's time per token in steady state, from the stages that host it.

    A node of ``compute`` c (layer-tokens/s) hosting a stage of m layers passes c/m tokens/s, and
    that rate serves each of its layers; a layer hosted by several stages (several pipelines)
    is served at the sum of their rates. ``load_j = 1 / sum_{stages s hosting j} c_s / m_s``.
    With a proportional split (m_s ~ c_s) every layer's load is equal: the CV is 0 exactly when
    no stage is a bottleneck, whatever the nodes' individual speeds.
    """
    _check_layers(n_layers)
    rate = [0.0] * n_layers
    for stage in stages:
        speed = compute.get(stage.node)
        if speed is None or not (math.isfinite(speed) and speed > 0):
            raise PlacementError(f"{stage.node}: no valid compute for its stage")
        if stage.layer_end > n_layers:
            raise PlacementError(f"{stage.node}: stage ends at {stage.layer_end} > {n_layers} layers")
        for layer in range(stage.layer_start, stage.layer_end):
            rate[layer] += speed / stage.layers
    if 0.0 in rate:
        raise PlacementError(f"layer {rate.index(0.0)} is hosted by no stage")
    return [1.0 / r for r in rate]


def layer_load_cv(per_layer_load: Sequence[float]) -> float:
    """Coefficient of variation of per-layer load: population std / mean (0 when all loads are 0).

    ``mu = sum x_j / L``, ``sigma = sqrt(sum (x_j - mu)**2 / L)``, ``CV = sigma / mu``. Loads are
    one number per layer, e.g. :func:`per_layer_load`, or measured per-layer latencies.
    """
    loads = [float(x) for x in per_layer_load]
    if not loads:
        raise PlacementError("no per-layer loads")
    if not all(math.isfinite(x) and x >= 0 for x in loads):
        raise PlacementError("per-layer loads must be finite and >= 0")
    mean = math.fsum(loads) / len(loads)
    if mean == 0:
        return 0.0
    return math.sqrt(math.fsum((x - mean) ** 2 for x in loads) / len(loads)) / mean


def throughput(pipelines: Iterable[Sequence[Stage]], compute: Mapping[str, float]) -> float:
    """Predicted tokens/s of a set of pipelines: each passes as many tokens per second as its slowest
    stage (compute c_s layer-tokens/s over m_s layers: c_s / m_s), and pipelines add up."""
    total = 0.0
    for stages in pipelines:
        if not stages:
            continue
        rates = []
        for stage in stages:
            speed = compute.get(stage.node)
            if speed is None or not (math.isfinite(speed) and speed > 0):
                raise PlacementError(f"{stage.node}: no valid compute for its stage")
            rates.append(speed / stage.layers)
        total += min(rates)
    return total


def pays_to_replace(current: float, proposed: float, margin: float) -> bool:
    """Adopt a new placement only when its predicted throughput beats the current one by ``margin``
    (0.15: 15 % more tokens/s); a placement serving nothing is always worth replacing. Measurement
    noise moves both figures alike and stays under the margin, so it never re-places."""
    if current <= 0:
        return proposed > 0
    return proposed >= current * (1.0 + margin)


def needs_rebalance(per_layer_load: Sequence[float], threshold: float = 0.25) -> bool:
    """Parallax's trigger: rebalance when the per-layer load's CV is strictly above ``threshold``."""
    return layer_load_cv(per_layer_load) > threshold
