"""The job-level scheduler, driven with plain data: routers with known estimates, no sockets, no model."""

from __future__ import annotations

import pytest

from worker_agent.coordinator.router import Load, Plan, Router, RouteTiming
from worker_agent.coordinator.scheduler import SessionView, load_on, plan

from .router_fixtures import shown

pytestmark = pytest.mark.dataplane


def _router(
    *, rtt_s: float, per_position_s: float, acceptance: float = 0.5, timing: RouteTiming | None = None
) -> Router:
    router = Router(rtt_s=rtt_s, per_position_s=per_position_s, prior_acceptance=acceptance, stages=3, timing=timing)
    return shown(router, acceptance)


def _view(key: int, router: Router, *, in_flight: int = 0, positions: int = 1, ready=("ngram",)) -> SessionView:
    return SessionView(key, router, tuple(ready), in_flight, positions)


def test_one_stream_over_a_long_round_trip_sends_a_burst_of_chunks_one_per_frame():
    router = _router(rtt_s=0.6, per_position_s=0.001, acceptance=0.95)

    step = plan([_view(0, router)])

    (send,) = step.sends
    assert send.plan.drafter == "ngram" and send.plan.depth > 1
    assert send.chunks == send.plan.depth
    assert step.frames == send.plan.depth
    assert [step.frame(i) for i in range(step.frames)] == [(0,)] * send.plan.depth


def test_streams_sharing_compute_bound_passes_decode_plainly_in_one_frame():
    timing = RouteTiming(0.01, 0.01, stages=3)
    routers = [_router(rtt_s=0.01, per_position_s=0.01, acceptance=0.6, timing=timing) for _ in range(4)]

    views = [_view(key, router) for key, router in enumerate(routers)]
    first, second = plan(views), plan(views)

    assert [send.plan for send in first.sends] == [Plan("ngram", 1, 1)] * 4  # new sessions probe together
    assert [send.plan for send in second.sends] == [Plan(None, 0, 1)] * 4
    assert first.frames == second.frames == 1
    assert second.frame(0) == (0, 1, 2, 3)


def test_the_same_stream_alone_on_that_route_speculates():
    router = _router(rtt_s=0.01, per_position_s=0.01, acceptance=0.6)

    (send,) = plan([_view(0, router)]).sends

    assert not send.plan.plain


def test_a_session_with_as_many_chunks_in_flight_as_its_plan_keeps_waits():
    router = Router(fixed=Plan("ngram", 4, 2))

    step = plan([_view(0, router, in_flight=2), _view(1, Router(fixed=Plan("ngram", 4, 2)), in_flight=1)])

    assert [(send.key, send.chunks) for send in step.sends] == [(1, 1)]
    assert step.frame(0) == (1,)


def test_a_session_whose_drafters_have_nothing_decodes_plainly():
    router = _router(rtt_s=0.6, per_position_s=0.001, acceptance=0.95)

    (send,) = plan([_view(0, router, ready=())]).sends

    assert send.plan.plain and send.chunks == 1


def test_the_others_load_is_their_positions_and_their_rate_at_plain_decoding():
    routers = [_router(rtt_s=0.1, per_position_s=0.01) for _ in range(3)]
    views = [_view(0, routers[0]), _view(1, routers[1], positions=9), _view(2, routers[2], positions=300)]

    load = load_on(views[0], views)

    assert load.positions == 309
    assert load.rate == pytest.approx(2 / (0.1 + (1 + 309) * 0.01))
    assert load_on(views[0], views[:1]) == Load()


def test_repeated_text_reaches_long_chunks_within_a_few_chunks():
    router = Router(rtt_s=0.3, per_position_s=0.002, stages=3)  # a new session: its prior alone
    plans = []
    for _ in range(4):
        (send,) = plan([_view(0, router, in_flight=0)]).sends
        plans.append(send.plan)
        if send.plan.drafter is not None:
            for _ in range(send.chunks):
                router.observe("ngram", send.plan.k, send.plan.k)  # every draft accepted

    assert plans[0].drafter == "ngram" and plans[0].k <= 2  # over a long round trip it drafts at once
    assert plans[-1].k >= 16 and plans[-1].depth >= 2


def test_novel_text_stops_drafting_within_a_few_chunks():
    timing = RouteTiming(0.05, 0.01, stages=3)
    routers = [_router(rtt_s=0.05, per_position_s=0.01, acceptance=0.5, timing=timing) for _ in range(4)]
    rounds_drafting = 0
    for _ in range(6):
        step = plan([_view(key, router) for key, router in enumerate(routers)])
        for send in step.sends:
            if send.plan.drafter is not None:
                rounds_drafting += 1
                routers[send.key].observe("ngram", send.plan.k, 0)  # the first draft rejected

    assert rounds_drafting <= 4  # at most one probing chunk per stream
    assert all(send.plan.plain for send in plan([_view(k, r) for k, r in enumerate(routers)]).sends)


def test_a_plan_step_is_pure_arithmetic_on_its_views():
    def fresh() -> list[SessionView]:
        timing = RouteTiming(0.2, 0.003, stages=3)
        return [_view(key, _router(rtt_s=0.2, per_position_s=0.003, acceptance=0.8, timing=timing)) for key in range(3)]

    assert plan(fresh()) == plan(fresh())
