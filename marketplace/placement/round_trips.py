"""Round trips measured from both ends: what routing believes of a link, and which reports are false.

Nodes measure their links themselves (each probes the peers and coordinator regions placement
names, ``services.request_probes``) and report them; a node could report less than it measured,
to look near and win routes. A round trip between two nodes is one loop, out one way and back the
other, whichever end times it: each end's report is a measurement of the other's claim. Routing
still prices each direction by its sender's report (``routing``), and honest ends disagree by
their answering delays and jitter, so a report stands unless the other end measured the same link
more than ``tolerance`` times as long, and by more than ``margin_ms``. As evidence for a strike an
end's measurement is the least it reported over several reports, since load on a busy end inflates
what it measures (an honest node would otherwise be struck by its overloaded peers). Then:

- it is clamped (``credible_round_trips``): the hop counts as the other end's measurement divided
  by the tolerance, so a false report buys no more than an honest disagreement could;
- it is a false claim (``false_claims``). Two ends that disagree do not say which one lies: the
  lower report may be deflated, or the higher inflated to frame the other end (which costs the
  framer only its own hop's price). So the reporter is struck (``verification.claims``) only where
  a trusted node contradicts it, or at least ``witnesses`` distinct peers do (``liars``): one
  hostile peer alone cannot get an honest node struck.

A link to a coordinator region has one end (a region does not probe back) and stands as reported.
Pure functions over ``{(source, target): rtt_ms}``; the selectors feed them the stored reports.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

RoundTrips = Mapping[tuple[str, str], float]  # (source, target) -> rtt_ms the source reported


@dataclass(frozen=True)
class FalseRoundTrip:
    """A reported round trip the other end of the link contradicts."""

    node: str  # the node that reported it
    target: str  # the peer it names
    claimed_ms: float  # what it reported
    measured_ms: float  # what the peer reported for the same link


def contradicted(claimed_ms: float, measured_ms: float, *, tolerance: float, margin_ms: float) -> bool:
    """Whether a report of ``claimed_ms`` is false against the other end's ``measured_ms``."""
    return claimed_ms * tolerance < measured_ms and measured_ms - claimed_ms > margin_ms


def credible_round_trips(reports: RoundTrips, *, tolerance: float, margin_ms: float) -> dict[tuple[str, str], float]:
    """Each report, or where the other end contradicts it, that end's measurement / ``tolerance``."""
    credible = dict(reports)
    for (source, target), claimed in reports.items():
        measured = reports.get((target, source))
        if measured is not None and contradicted(claimed, measured, tolerance=tolerance, margin_ms=margin_ms):
            credible[(source, target)] = measured / tolerance
    return credible


def false_claims(
    reports: RoundTrips, *, tolerance: float, margin_ms: float, evidence: RoundTrips | None = None
) -> list[FalseRoundTrip]:
    """The reports the other end of their link contradicts, by reporter and target. ``evidence``:
    what each end's measurement of a link counts as against the other's claim, where it differs
    from its latest report (the least it ever reported, once it reported enough: load only adds
    delay, so a busy end's momentary figure convicts nobody); a link missing from it is no evidence."""
    found = []
    for (source, target), claimed in sorted(reports.items()):
        measured = (evidence if evidence is not None else reports).get((target, source))
        if measured is not None and contradicted(claimed, measured, tolerance=tolerance, margin_ms=margin_ms):
            found.append(FalseRoundTrip(source, target, claimed, measured))
    return found


def liars(false: list[FalseRoundTrip], *, trusted: Collection[str], witnesses: int) -> dict[str, list[FalseRoundTrip]]:
    """The reporters of ``false`` claims that a trusted peer contradicts, or at least ``witnesses``
    distinct peers do, each with the claims that convict it."""
    by_reporter: dict[str, list[FalseRoundTrip]] = {}
    for claim in false:
        by_reporter.setdefault(claim.node, []).append(claim)
    return {
        node: claims
        for node, claims in by_reporter.items()
        if len({c.target for c in claims}) >= witnesses or any(c.target in trusted for c in claims)
    }
