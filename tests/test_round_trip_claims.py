"""Round trips are measured from both ends and cross-checked: a node's report of a link that the
other end measured more than SWARM_RTT_CLAIM_TOLERANCE times as long (and by more than the margin)
counts as that measurement / the tolerance in routing, and the node is struck once two peers, or a
trusted one, contradict it; one hostile peer inflating its own report frames nobody. As evidence a
peer's measurement is the least of its reports, once it made SWARM_RTT_EVIDENCE_SAMPLES of them: a
busy peer's inflated figures frame nobody either (``marketplace/placement/round_trips.py``,
``marketplace/verification/claims.py``)."""

from __future__ import annotations

import pytest

from marketplace.nodes.models import Node
from marketplace.placement.round_trips import FalseRoundTrip, credible_round_trips, false_claims, liars
from marketplace.placement.selectors import link_rtts
from marketplace.verification.claims import record_probe_results
from marketplace.verification.models import Strike, StrikeKind

pytest_plugins = ["tests.factories", "tests.control_fixtures"]
pytestmark = pytest.mark.trust

CHECK = {"tolerance": 2.0, "margin_ms": 50.0}


def test_a_report_stands_unless_the_other_end_measured_it_far_longer():
    reports = {
        ("liar", "p"): 40.0,  # p measured 200: clamped to 200 / 2
        ("p", "liar"): 200.0,
        ("a", "b"): 30.0,  # b measured 70: more than twice, but within the margin of jitter
        ("b", "a"): 70.0,
        ("c", "d"): 120.0,  # d measured 200: a far gap, but within the tolerance
        ("d", "c"): 200.0,
        ("liar", "region:local"): 1.0,  # one end only: stands
        ("region:local", "liar"): 1.0,
    }

    assert credible_round_trips(reports, **CHECK) == {**reports, ("liar", "p"): 100.0}
    assert false_claims(reports, **CHECK) == [FalseRoundTrip("liar", "p", 40.0, 200.0)]


def test_as_evidence_an_end_counts_as_the_least_it_measured_and_a_link_without_evidence_convicts_nobody():
    reports = {("x", "p"): 10.0, ("p", "x"): 400.0, ("x", "q"): 10.0, ("q", "x"): 400.0}
    evidence = {("p", "x"): 12.0}  # p measured 12 ms at best; q has not reported enough yet

    assert false_claims(reports, **CHECK, evidence=evidence) == []
    assert false_claims(reports, **CHECK, evidence={("p", "x"): 200.0}) == [FalseRoundTrip("x", "p", 10.0, 200.0)]


def test_a_reporter_is_a_liar_only_when_two_peers_or_a_trusted_one_contradict_it():
    one = [FalseRoundTrip("x", "p", 10.0, 200.0)]
    two = [*one, FalseRoundTrip("x", "q", 10.0, 190.0)]

    assert liars(one, trusted=set(), witnesses=2) == {}
    assert liars(two, trusted=set(), witnesses=2) == {"x": two}
    assert liars(one, trusted={"p"}, witnesses=2) == {"x": one}


def links(node: Node, rtts: dict[Node, float]) -> list[dict]:
    return [{"target": peer.node_id, "rtt_ms": rtt} for peer, rtt in rtts.items()]


def report(node: Node, rtts: dict[Node, float], times: int = 3) -> None:
    """``node``'s agent reports the same round trips ``times`` times (SWARM_RTT_EVIDENCE_SAMPLES: 3)."""
    for _ in range(times):
        assert record_probe_results(node.pk, links(node, rtts)) == []


@pytest.mark.django_db
def test_a_node_claiming_half_its_round_trips_is_clamped_and_struck(provider, make_joined_node, swarm_settings):
    p, q, liar = (make_joined_node(provider, name).node for name in ("gpu-p", "gpu-q", "gpu-liar"))
    # The truth: 200 ms between the liar and each honest node, 20 ms between the honest pair.
    report(p, {q: 20.0, liar: 200.0})
    report(q, {p: 20.0, liar: 210.0})

    struck = record_probe_results(liar.pk, links(liar, {p: 90.0, q: 95.0}))  # "half" its round trips

    assert [(s.node_id, s.kind) for s in struck] == [(liar.pk, StrikeKind.CAPACITY)]
    assert sorted(struck[0].evidence["links"], key=lambda link: link["claimed_ms"]) == [
        {"target": p.node_id, "claimed_ms": 90.0, "measured_ms": 200.0},
        {"target": q.node_id, "claimed_ms": 95.0, "measured_ms": 210.0},
    ]
    rtt = link_rtts([p.node_id, q.node_id, liar.node_id])
    assert (rtt[(liar.node_id, p.node_id)], rtt[(liar.node_id, q.node_id)]) == (100.0, 105.0)
    assert (rtt[(p.node_id, q.node_id)], rtt[(p.node_id, liar.node_id)]) == (20.0, 200.0)
    # Reporting again opens no second strike while one is open.
    assert record_probe_results(liar.pk, links(liar, {p: 90.0, q: 95.0})) == []
    assert Strike.objects.count() == 1


@pytest.mark.django_db
def test_one_peer_inflating_its_report_does_not_get_an_honest_node_struck(provider, make_joined_node, swarm_settings):
    honest, other, framer = (make_joined_node(provider, f"gpu-{name}").node for name in ("honest", "other", "framer"))
    record_probe_results(other.pk, links(other, {honest: 50.0, framer: 50.0}))
    record_probe_results(framer.pk, links(framer, {honest: 500.0, other: 50.0}))  # 50 ms in truth

    assert record_probe_results(honest.pk, links(honest, {other: 50.0, framer: 50.0})) == []

    assert Strike.objects.count() == 0
    # Routing still takes the higher figure: the disagreement buys neither side anything.
    assert link_rtts([honest.node_id, framer.node_id])[(honest.node_id, framer.node_id)] == 250.0


@pytest.mark.django_db
def test_busy_peers_inflated_round_trips_do_not_get_an_honest_node_struck(provider, make_joined_node, swarm_settings):
    honest, p, q = (make_joined_node(provider, f"gpu-{name}").node for name in ("honest", "p", "q"))
    report(p, {honest: 20.0, q: 20.0})
    report(q, {honest: 22.0, p: 20.0})
    # Then both peers' machines are overloaded: their event loops add 400 ms to every probe.
    report(p, {honest: 420.0, q: 410.0}, times=5)
    report(q, {honest: 430.0, p: 415.0}, times=5)

    assert record_probe_results(honest.pk, links(honest, {p: 20.0, q: 21.0})) == []

    assert Strike.objects.count() == 0


@pytest.mark.django_db
def test_a_peers_first_reports_are_not_yet_evidence(provider, make_joined_node, swarm_settings):
    claimant, p, q = (make_joined_node(provider, f"gpu-{name}").node for name in ("claimant", "p", "q"))
    report(p, {claimant: 300.0}, times=2)  # a busy first minute: two reports, both inflated
    report(q, {claimant: 310.0}, times=2)

    assert record_probe_results(claimant.pk, links(claimant, {p: 20.0, q: 20.0})) == []

    assert Strike.objects.count() == 0
