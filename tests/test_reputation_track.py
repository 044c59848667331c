"""A node's reputation as a rising track: what age alone adds, day by day, until it counts fully."""

from __future__ import annotations

import pytest

from marketplace.verification.reputation import Observations, reputation, rising_track

pytestmark = pytest.mark.trust


def obs(**overrides) -> Observations:
    values = dict(age_days=0.0, online_s=0.0, checks_passed=0, checks_failed=0, challenges_sent=0,
                  challenges_late=0, upheld_strikes=0)  # fmt: skip
    return Observations(**{**values, **overrides})


def test_a_healthy_new_node_rises_from_085_to_1_over_thirty_days():
    new = reputation(obs())

    track = rising_track(new.components)

    assert new.score == pytest.approx(0.85)
    assert (track.full, track.days_left) == (pytest.approx(1.0), 30.0)
    assert track.per_day == pytest.approx(0.005)


def test_the_track_ends_where_the_score_is_after_thirty_days_of_the_same_record():
    ten_days = reputation(obs(age_days=10.0, online_s=10 * 86400.0, checks_passed=3))
    thirty_days = reputation(obs(age_days=30.0, online_s=30 * 86400.0, checks_passed=3))

    track = rising_track(ten_days.components)

    assert track.days_left == pytest.approx(20.0, abs=0.01)  # components are kept to 4 places
    assert track.full == pytest.approx(thirty_days.score)
    assert ten_days.score + track.days_left * track.per_day == pytest.approx(thirty_days.score, abs=1e-4)


def test_failed_checks_and_strikes_lower_the_track_with_the_score():
    struck = reputation(obs(checks_passed=2, checks_failed=2, upheld_strikes=1))

    track = rising_track(struck.components)

    # pass rate (2 + 2) / (4 + 2) squared, halved by the strike: (4/9) / 2 of a full score
    assert track.full == pytest.approx(2 / 9, abs=1e-4)
    assert track.per_day == pytest.approx(2 / 9 * 0.005, abs=1e-6)


def test_a_node_past_thirty_days_has_nothing_left_to_gain_from_age():
    old = reputation(obs(age_days=45.0, online_s=45 * 86400.0))

    track = rising_track(old.components)

    assert (track.days_left, track.full) == (0.0, pytest.approx(old.score))
