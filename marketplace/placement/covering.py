"""Bin covering for the pipeline count: the most disjoint groups of nodes whose layer capacities
each reach the model's ``L`` layers, from the fewest nodes. ``allocation.choose_pipeline_count``
ranks the nodes and picks the exact DP or the greedy; these work on the capacities alone (a list
sorted largest first, capped at ``L``) and return groups of indices into it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from fractions import Fraction


def _add(value: int, cap: int, n_layers: int) -> int:
    """One item into the sequential bin-covering state ``value = covered * L + fill``."""
    fill = value % n_layers
    return value + cap if fill + cap < n_layers else (value // n_layers + 1) * n_layers


def exact_groups(caps: list[int], n_layers: int) -> list[list[int]]:
    """Exact s*(k) for every k and the groups of the best k (indices into ``caps``, sorted desc).

    ``cover(S)``, the most disjoint groups of items of ``S`` each summing to >= L, is the best, over
    all orders of ``S``, of filling one open bin at a time and closing it once it reaches L (an
    optimal grouping laid out group after group closes at least as many bins). The DP keeps, per
    multiset of items (a count per distinct capacity), the lexicographically largest (closed
    bins, open fill): one more closed bin beats any fill below L. ``s*(k)`` is then the shortest
    prefix ``s`` of the items sorted by capacity with ``cover(prefix_s) >= k`` (exchange argument:
    swapping a used node for a larger unused one never uncovers a group). At that minimal ``s``
    the best order closes exactly k bins with nothing left open, or a shorter prefix would do.
    """
    values = sorted(set(caps), reverse=True)
    counts = [caps.count(v) for v in values]
    strides = [math.prod(c + 1 for c in counts[:t]) for t in range(len(values))]
    states = strides[-1] * (counts[-1] + 1)
    best, last = [0] * states, [0] * states  # value = closed * L + fill; last class added
    digits = [0] * len(values)  # the state's count of each class, kept as an odometer
    classes = list(enumerate(zip(values, strides, strict=True)))
    for state in range(1, states):
        t = 0
        while digits[t] == counts[t]:
            digits[t] = 0
            t += 1
        digits[t] += 1
        top = arg = -1
        for t, (value, stride) in classes:
            if digits[t]:
                candidate = _add(best[state - stride], value, n_layers)
                if candidate > top:
                    top, arg = candidate, t
        best[state], last[state] = top, arg
    prefix_states, state = [0], 0
    for t, count in enumerate(counts):
        for _ in range(count):
            state += strides[t]
            prefix_states.append(state)
    covered = [best[s] // n_layers for s in prefix_states]
    fewest = {k: bisect.bisect_left(covered, k) for k in range(1, covered[-1] + 1)}  # k -> s*(k)
    k = max(fewest, key=lambda k: (Fraction(k * k, fewest[k]), k))
    state, sequence = prefix_states[fewest[k]], []
    while state:
        sequence.append(last[state])
        state -= strides[last[state]]
    first_of = {v: caps.index(v) for v in values}
    taken = dict.fromkeys(range(len(values)), 0)
    groups, group, fill = [], [], 0
    for t in reversed(sequence):
        group.append(first_of[values[t]] + taken[t])
        taken[t] += 1
        fill += values[t]
        if fill >= n_layers:
            groups.append(sorted(group))
            group, fill = [], 0
    return groups


def lpt(caps: list[int], n_layers: int, k: int) -> list[list[int]] | None:
    """Greedy 1, LPT: each next-largest node joins the open pipeline missing the most layers; None
    when the nodes run out before ``k`` pipelines are covered."""
    heap = [(-n_layers, b) for b in range(k)]
    groups: list[list[int]] = [[] for _ in range(k)]
    for i, cap in enumerate(caps):
        deficit, b = heapq.heappop(heap)
        groups[b].append(i)
        if -deficit > cap:
            heapq.heappush(heap, (deficit + cap, b))
        elif not heap:
            return groups
    return None


def lpt_used(runs: Sequence[tuple[int, int]], n_layers: int, k: int) -> int | None:
    """How many nodes :func:`lpt` takes for ``k`` pipelines (None: it runs out), without
    building them, in O(distinct capacities + L) rather than O(n log k).

    Which pipeline a node joins decides only its group, not the count: LPT's open pipelines differ
    by their deficits alone. So this keeps a count of open pipelines per deficit, and takes a run of
    equal capacities (``runs``: (capacity, count), largest first) a batch at a time: the nodes of
    the run go to the pipelines at the largest deficit, as many at once as there are. A pipeline
    left open lands below that deficit, so the largest deficit only ever goes down."""
    open_at = [0] * (n_layers + 1)  # open_at[d]: open pipelines missing d layers
    open_at[n_layers] = k
    top, closed, used = n_layers, 0, 0
    for cap, count in runs:
        while count:
            while not open_at[top]:
                top -= 1
            take = min(open_at[top], count)
            open_at[top] -= take
            if top > cap:
                open_at[top - cap] += take
            elif closed + take == k:
                return used + take
            else:
                closed += take
            used += take
            count -= take
    return None


def best_fit_groups(caps: list[int], n_layers: int) -> Iterator[list[int]]:
    """Greedy 2: pipeline after pipeline, take the largest node left, or, once a node left can
    close the pipeline, the smallest such node (the least memory wasted past ``n_layers``); until
    the nodes left cannot close one more. The first k pipelines are its answer for k."""
    pool = sorted((cap, -i) for i, cap in enumerate(caps))
    while True:
        group, deficit = [], n_layers
        while deficit > 0:
            if not pool:
                return
            j = bisect.bisect_left(pool, (deficit, -len(caps))) if pool[-1][0] >= deficit else len(pool) - 1
            cap, minus_i = pool.pop(j)
            group.append(-minus_i)
            deficit -= cap
        yield sorted(group)


def greedy_groups(caps: list[int], n_layers: int) -> list[list[int]]:
    """Branch and bound over k, with the better of two greedy bin coverings as s(k).

    ``LB(k) = max(k, shortest prefix whose sum reaches k*L)`` bounds s*(k) below, so k is skipped
    when ``k**2 / LB(k)`` cannot beat the best score found; k runs from the largest feasible down,
    and since ``k**2 / LB(k) <= k`` the search stops once the best score reaches k. The search
    compares node counts only: best fit's come from one run for every k, LPT's from
    :func:`lpt_used`; the winner's pipelines are built once at the end.
    """
    prefix = list(itertools.accumulate(caps))
    best_fit_used = list(itertools.accumulate(len(g) for g in best_fit_groups(caps, n_layers)))
    runs = [(cap, len(list(same))) for cap, same in itertools.groupby(caps)]
    best: tuple[int, int, bool] | None = None  # (k, nodes used, whether by LPT)
    for k in range(min(len(caps), prefix[-1] // n_layers), 0, -1):
        if best is not None and k * best[1] <= best[0] ** 2:
            break
        lower = max(k, bisect.bisect_left(prefix, k * n_layers) + 1)
        if best is not None and k * k * best[1] <= best[0] ** 2 * lower:
            continue
        by_best_fit = best_fit_used[k - 1] if k <= len(best_fit_used) else None
        for used, by_lpt in ((lpt_used(runs, n_layers, k), True), (by_best_fit, False)):
            if used is not None and (best is None or k * k * best[1] > best[0] ** 2 * used):
                best = (k, used, by_lpt)
    assert best is not None  # k = 1 always succeeds: the capacities sum to >= L
    k, _, by_lpt = best
    groups = lpt(caps, n_layers, k) if by_lpt else list(itertools.islice(best_fit_groups(caps, n_layers), k))
    assert groups is not None  # lpt_used counted it
    return groups
