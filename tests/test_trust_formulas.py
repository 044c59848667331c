"""The pure trust formulas: how often a node is checked, its reputation, and how a job's pay is split."""

from __future__ import annotations

import pytest

from marketplace.payouts.services import split
from marketplace.verification.rates import RateParams, check_rate
from marketplace.verification.reputation import Observations, reputation

pytestmark = pytest.mark.trust

PARAMS = RateParams(safety=2.0, window_days=1.0, horizon_days=30.0, strikes_to_eject=3, new_node_days=7.0,
                    challenges_min_per_day=24.0, challenges_max_per_day=1440.0, audit_min_fraction=0.02,
                    new_node_fraction=0.25)  # fmt: skip


def test_an_established_trusted_node_needs_k_over_its_stake_checks_a_day():
    rate = check_rate(age_days=30, reputation=1.0, sessions_per_day=1000, params=PARAMS)

    # at stake: 1 day pending + 30 days / 3 strikes = 11 days of income; n = 2 / 11
    assert rate.checks_per_day == pytest.approx(2 / 11)
    assert rate.challenges_per_day == 24.0  # the floor
    assert rate.audit_fraction == 0.02  # n / 1000 sessions is below the floor
    assert "n = k / at_stake = 2 / 11.00 = 0.18 per day" in rate.explanation


def test_a_new_node_has_little_at_stake_and_is_checked_most():
    new = check_rate(age_days=0, reputation=1.0, sessions_per_day=4, params=PARAMS)
    old = check_rate(age_days=30, reputation=1.0, sessions_per_day=4, params=PARAMS)

    assert new.checks_per_day == pytest.approx(2.0)  # only one day of pending pay at stake
    assert new.audit_fraction == 0.5  # 2 checks over 4 sessions
    assert old.audit_fraction == pytest.approx(max(2 / 11 / 4, 0.02))
    assert new.audit_fraction > old.audit_fraction


def test_low_reputation_raises_the_rate_and_a_young_node_keeps_the_new_node_floor():
    trusted = check_rate(age_days=30, reputation=1.0, sessions_per_day=100, params=PARAMS)
    doubtful = check_rate(age_days=30, reputation=0.2, sessions_per_day=100, params=PARAMS)
    young = check_rate(age_days=3, reputation=1.0, sessions_per_day=1000, params=PARAMS)

    assert doubtful.checks_per_day == pytest.approx(2 / (1 + 30 * 0.2 / 3))
    assert doubtful.checks_per_day > trusted.checks_per_day
    assert young.audit_fraction == 0.25


def test_audit_fraction_is_at_most_one_and_without_traffic_every_session_counts():
    assert check_rate(age_days=0, reputation=0.0, sessions_per_day=1, params=PARAMS).audit_fraction == 1.0
    assert check_rate(age_days=30, reputation=1.0, sessions_per_day=0, params=PARAMS).audit_fraction == 1.0


def test_rates_refuse_non_finite_inputs():
    with pytest.raises(ValueError, match="must be finite"):
        check_rate(age_days=float("nan"), reputation=1.0, sessions_per_day=1, params=PARAMS)


def obs(**overrides) -> Observations:
    values = dict(age_days=30.0, online_s=30 * 86400.0, checks_passed=100, checks_failed=0, challenges_sent=50,
                  challenges_late=0, upheld_strikes=0)  # fmt: skip
    return Observations(**{**values, **overrides})


def test_a_perfect_month_old_node_scores_one():
    rep = reputation(obs())

    assert rep.score == pytest.approx(1.0)
    assert rep.components == {"uptime": 1.0, "check_pass_rate": 1.0, "reliability": 1.0, "age": 1.0,
                              "upheld_strikes": 0}  # fmt: skip
    assert rep.explanation[0] == "uptime 100.0% of the time since joining (weight 35%)"


def test_a_new_node_starts_above_the_placement_threshold():
    rep = reputation(obs(age_days=0.0, online_s=0.0, checks_passed=0, challenges_sent=0))
    loading = reputation(obs(age_days=600 / 86400, online_s=0.0, checks_passed=0, challenges_sent=0))

    assert rep.score == pytest.approx(0.35 + 0.25 + 0.25)  # full uptime and reliability by default, no age
    # Ten minutes loading its block before the first heartbeat keep it well above the threshold.
    assert loading.components["uptime"] == round(3600 / 4200, 4)
    assert loading.score > 0.75


def test_failed_checks_and_upheld_strikes_pull_the_score_down():
    failing = reputation(obs(checks_passed=8, checks_failed=4))
    struck = reputation(obs(upheld_strikes=1))

    assert failing.components["check_pass_rate"] == round(10 / 14, 4)
    assert failing.score == pytest.approx((10 / 14) ** 2)
    assert struck.score == pytest.approx(0.5)
    assert struck.explanation[-1] == "1 upheld strike(s): each halves the score"


def test_late_answers_lower_reliability_and_half_uptime_lowers_the_score():
    rep = reputation(obs(challenges_sent=10, challenges_late=6, online_s=15 * 86400.0))

    assert rep.components["reliability"] == 0.5
    uptime = (15 * 86400 + 3600) / (30 * 86400 + 3600)  # with the prior hour online
    assert rep.components["uptime"] == round(uptime, 4)
    assert rep.score == pytest.approx(0.35 * uptime + 0.25 * 0.5 + 0.15 + 0.25)


@pytest.mark.parametrize(
    ("pool", "weights", "shares"),
    [
        (100, {"a": 1, "b": 1, "c": 1}, {"a": 34, "b": 33, "c": 33}),
        (10, {"a": 20, "b": 10}, {"a": 7, "b": 3}),
        (7, {"a": 0, "b": 5}, {"a": 0, "b": 7}),
        (0, {"a": 1}, {"a": 0}),
        (5, {"a": 0}, {"a": 0}),
        (1_000_000_007, {"x": 10, "y": 20, "z": 30}, {"x": 166_666_668, "y": 333_333_336, "z": 500_000_003}),
    ],
)
def test_split_is_proportional_and_sums_to_the_pool(pool, weights, shares):
    assert split(pool, weights) == shares
    if sum(weights.values()):
        assert sum(split(pool, weights).values()) == pool
