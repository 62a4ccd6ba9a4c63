"""Tests of evalfleet.stats: exact values, validation, and Hypothesis properties.

The Hypothesis strategies live in this file only.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from evalfleet import bootstrap, intervals, stats
from evalfleet.errors import EvalfleetError
from evalfleet.stats import (
    Interval,
    ReturnStats,
    StatsInputError,
    iqm,
    iqm_ci,
    length_stats,
    mean_ci,
    needed_episodes,
    paired_comparison,
    summarize,
    wilson_interval,
)

# Property tests use few resamples: the properties hold for any n_boot >= 100.
N_BOOT = 200

# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

seeds = st.integers(min_value=0, max_value=2**32 - 1)
mean_ci_methods = st.sampled_from(["auto", "percentile", "bca", "t"])
# Shift-equivariant methods: BCa's bias correction counts bootstrap means equal to the estimate,
# and a shift can turn such a tie into a rounding-level inequality.
shift_methods = st.sampled_from(["percentile", "t"])


def returns_lists(bound: float = 1e6, max_size: int = 60) -> st.SearchStrategy[list[float]]:
    """Episode returns: arbitrary floats mixed with small integers, so ties are common."""
    arbitrary = st.floats(min_value=-bound, max_value=bound, allow_nan=False)
    tied = st.integers(min_value=-5, max_value=5).map(float)
    return st.lists(st.one_of(arbitrary, tied), min_size=1, max_size=max_size)


@st.composite
def paired_returns(draw: st.DrawFn) -> tuple[list[float], list[float]]:
    """Returns of a new and a baseline policy on the same episode seeds."""
    pairs = draw(
        st.lists(
            st.tuples(
                st.floats(min_value=-1e4, max_value=1e4, allow_nan=False),
                st.floats(min_value=-1e4, max_value=1e4, allow_nan=False),
            ),
            min_size=1,
            max_size=40,
        )
    )
    return [p[0] for p in pairs], [p[1] for p in pairs]


def all_intervals(s: ReturnStats) -> list[tuple[str, Interval, float]]:
    return [("ci", s.ci, s.mean), ("iqm_ci", s.iqm_ci, s.iqm)]


# ---------------------------------------------------------------------------------------------
# Exact values
# ---------------------------------------------------------------------------------------------


def test_moments_of_a_known_sample() -> None:
    x = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]  # mean 5, sum of squared deviations 32
    s = summarize(x, seed=0)
    assert s.n == 8
    assert s.mean == 5.0
    assert s.var == pytest.approx(32 / 7, rel=1e-15)
    assert s.std == pytest.approx(math.sqrt(32 / 7), rel=1e-15)
    assert s.stderr == pytest.approx(math.sqrt(32 / 7) / math.sqrt(8), rel=1e-15)
    assert (s.min, s.max, s.median) == (2.0, 9.0, 4.5)


def test_percentiles_use_linear_interpolation() -> None:
    s = summarize(np.arange(1.0, 10.0), seed=0)  # 1..9: position q/100 * 8
    assert s.percentiles == pytest.approx(
        {"p5": 1.4, "p25": 3.0, "p50": 5.0, "p75": 7.0, "p95": 8.6}, rel=1e-15
    )
    assert s.median == s.percentiles["p50"]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        # scipy.stats.trim_mean(x, 0.25) cuts int(0.25 * n) values from each end.
        (np.arange(1, 9), 4.5),  # n=8, cut 2: mean(3, 4, 5, 6)
        ([1.0, 2.0, 3.0, 4.0, 100.0], 3.0),  # n=5, cut 1: mean(2, 3, 4)
        ([100.0, 2.0, 1.0, 4.0, 3.0], 3.0),  # order does not matter
        ([1.0, 2.0, 30.0], 11.0),  # n=3, cut 0: plain mean
        ([7.0], 7.0),
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 1000], 4.5),  # n=10, cut 2: mean(2..7)
        ([-50, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 500], 35 / 6),  # n=12, cut 3: mean(3, 4, 5, 6, 8, 9)
    ],
)
def test_iqm_matches_trim_mean_quarter(values: list[float], expected: float) -> None:
    assert iqm(values) == pytest.approx(expected, rel=1e-15)
    assert summarize(values, seed=1).iqm == pytest.approx(expected, rel=1e-15)


def test_wilson_interval_textbook_value() -> None:
    ci = wilson_interval(8, 10)
    assert (round(ci.low, 4), round(ci.high, 4)) == (0.4902, 0.9433)
    assert ci.method == "wilson"
    assert ci.level == 0.95


def test_wilson_interval_edges_and_symmetry() -> None:
    zero, full = wilson_interval(0, 10), wilson_interval(10, 10)
    assert zero.low == 0.0 and zero.high > 0.0
    assert full.high == 1.0 and full.low < 1.0
    low2, high8 = wilson_interval(2, 10), wilson_interval(8, 10)
    assert low2.low == pytest.approx(1 - high8.high, abs=1e-15)
    assert low2.high == pytest.approx(1 - high8.low, abs=1e-15)


def test_t_interval_matches_known_quantiles() -> None:
    x = np.arange(1.0, 11.0)  # mean 5.5, std sqrt(110/12), df 9
    stderr = math.sqrt(110 / 12) / math.sqrt(10)
    ci = mean_ci(x, seed=0, method="t")
    assert ci.method == "t"
    assert ci.low == pytest.approx(5.5 - 2.2621571627982055 * stderr, rel=1e-13)
    assert ci.high == pytest.approx(5.5 + 2.2621571627982055 * stderr, rel=1e-13)
    # df = 1: t quantile is tan(0.475 pi); mean 1, stderr 1.
    ci1 = mean_ci([0.0, 2.0], seed=0, method="t")
    assert ci1.halfwidth == pytest.approx(math.tan(0.475 * math.pi), rel=1e-13)


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        (0.5, 0.0),
        (0.9, 1.2815515655446006),
        (0.975, 1.9599639845400539),
        (0.995, 2.5758293035489005),
        (1e-10, -6.3613409024040562),
    ],
)
def test_normal_quantile_reference_values(p: float, expected: float) -> None:
    # References from mpmath at 40 digits.
    assert intervals.normal_quantile(p) == pytest.approx(expected, rel=1e-14, abs=1e-15)


@pytest.mark.parametrize(
    ("q", "df", "expected"),
    [
        (0.025, 1, 12.706204736174707),
        (0.025, 2, 4.302652729749464),
        (0.025, 3, 3.1824463052837095),
        (0.005, 5, 4.0321429835552281),
        (1e-8, 4, 131.59473694062355),
        (0.4, 50, 0.25469934298858811),
        (0.025, 1000, 1.9623390808264085),
        (0.025, 9999, 1.9602012636213577),
        (0.025, 10000, 1.9602012398906262),
        (0.025, 10**6, 1.959966356814107),
    ],
)
def test_t_quantile_reference_values(q: float, df: int, expected: float) -> None:
    # References from mpmath (regularized incomplete beta) at 40 digits.
    assert intervals._t_upper_quantile(q, df) == pytest.approx(expected, rel=1e-13)


def test_needed_episodes_normal_approximation() -> None:
    assert needed_episodes(1.0, 0.1) == 385  # (1.96 * 1 / 0.1)^2 = 384.15
    assert needed_episodes(2.0, 0.1) == 1537  # four times the variance
    assert needed_episodes(1.0, 0.1, level=0.99) == 664  # (2.5758 / 0.1)^2 = 663.49
    assert needed_episodes(0.0, 0.1) == 2
    # Exactly (z * std / h)^2 = 4: rounding must not bump it to 5.
    assert needed_episodes(1.0, intervals.normal_quantile(0.975) / 2) == 4


# ---------------------------------------------------------------------------------------------
# Degenerate samples
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["percentile", "bca", "t"])
def test_constant_sample_gives_degenerate_interval(method: str) -> None:
    s = summarize([0.1] * 7, seed=3, method=method)
    assert (s.mean, s.var, s.std, s.stderr) == (0.1, 0.0, 0.0, 0.0)
    assert (s.ci.low, s.ci.high) == (0.1, 0.1)
    assert (s.iqm, s.iqm_ci.low, s.iqm_ci.high) == (0.1, 0.1, 0.1)
    assert s.ci.method in {"bootstrap-percentile", "bootstrap-bca", "t"}


def test_single_episode() -> None:
    s = summarize([-3.5], seed=0)
    assert (s.n, s.mean, s.var, s.std, s.stderr) == (1, -3.5, 0.0, 0.0, 0.0)
    # One episode bounds nothing: 0.975 of the scale max(1, 3.5) each side.
    assert (s.ci.low, s.ci.high) == pytest.approx((-3.5 - 3.4125, -3.5 + 3.4125), rel=1e-12)
    assert s.ci.method == stats.METHOD_CONSTANT_UNIT
    assert (s.iqm_ci.low, s.iqm_ci.high) == (-3.5, -3.5)
    assert length_stats([17]) == {
        "mean": 17.0,
        "std": 0.0,
        "min": 17.0,
        "max": 17.0,
        "median": 17.0,
    }


def test_interval_is_widened_to_contain_the_estimate() -> None:
    # One outlier, narrow level: the raw percentile bounds sit below the sample mean (104.5).
    x = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 1000], dtype=float)
    boot, _ = stats._bootstrap(x, 0, 1000, with_iqm=False)
    raw_high = float(np.quantile(boot, 0.51))
    assert raw_high < 104.5
    ci = mean_ci(x, seed=0, n_boot=1000, level=0.02, method="percentile")
    assert ci.high == 104.5
    assert ci.low == pytest.approx(float(np.quantile(boot, 0.49)))


def test_std_is_accurate_for_tiny_spreads() -> None:
    # Squared deviations of 1e-200 underflow; the scaled computation keeps full precision.
    assert summarize([0.0, 1e-200, 3e-200], seed=0).std == pytest.approx(
        1e-200 * math.sqrt(7 / 3), rel=1e-14
    )


# ---------------------------------------------------------------------------------------------
# The reported interval (method="auto"): small n, proportions, constant samples
# ---------------------------------------------------------------------------------------------


def test_sixteen_zero_returns_do_not_give_a_zero_width_interval() -> None:
    # Issue 13: 16 episodes of a 0/1 reward with no success gave [0, 0]; p = 0.1 is 18.5% likely.
    ci = summarize([0.0] * 16, seed=0).ci
    assert ci.low < 0.1 < ci.high
    assert ci.high == pytest.approx(1 - 0.025 ** (1 / 16), rel=1e-12)  # 0.2059
    assert ci.method == stats.METHOD_CONSTANT_UNIT


def test_constant_sample_with_declared_bounds_gets_the_exact_one_sided_bound() -> None:
    ci = mean_ci([0.0] * 16, seed=0, bounds=(0, 500))
    assert (ci.low, ci.method) == (0.0, stats.METHOD_CONSTANT_BOUNDED)
    assert ci.high == pytest.approx(500 * (1 - 0.025 ** (1 / 16)), rel=1e-12)  # 102.95
    top = mean_ci([500.0] * 16, seed=0, bounds=(0, 500))
    assert top.high == 500.0 and top.low == pytest.approx(500 - ci.high, rel=1e-12)


def test_two_valued_returns_get_the_hull_of_clopper_pearson_and_t() -> None:
    # Clopper-Pearson reference: scipy.stats.binomtest(1, 16).proportion_ci(method="exact") is
    # (0.0015811117227692, 0.3023207384345610); it reaches further up, the t interval further down.
    x = [0.0] * 15 + [1.0]
    ci, t = mean_ci(x, seed=0), mean_ci(x, seed=0, method="t")
    assert ci.method == stats.METHOD_TWO_VALUES
    assert ci.low == t.low < 0.0015811117227692
    assert ci.high == pytest.approx(0.3023207384345610, rel=1e-9)
    scaled = mean_ci([10.0] * 15 + [510.0], seed=0)
    assert (scaled.low, scaled.high) == pytest.approx((10 + 500 * ci.low, 10 + 500 * ci.high))
    # Declared bounds clip the t side: 0/1 successes keep the Clopper-Pearson interval's width.
    bounded = mean_ci(x, seed=0, bounds=(0, 1))
    assert bounded.low == 0.0 and bounded.high == ci.high


def _coverage(draw: Callable[[np.random.Generator], np.ndarray], mu: float, sims: int) -> float:
    rng = np.random.default_rng(2024)
    hits = 0
    for i in range(sims):
        ci = mean_ci(draw(rng), seed=i)
        hits += ci.low <= mu <= ci.high
    return hits / sims


def test_a_sample_showing_two_of_three_possible_returns_keeps_the_level() -> None:
    # Win/draw/loss returns (+1/0/-1): 31 draws and one win used to get Clopper-Pearson mapped
    # onto [0, 1], which excludes every mean below 0.0008 although losses are possible.
    ci = mean_ci([0.0] * 31 + [1.0], seed=0)
    assert ci.low < 0.0 < ci.high
    # P = (0.05, 0.9, 0.05), n = 16: the reported interval covered 49.5% (two-valued samples,
    # 50% of them, almost never covered the true mean 0).
    probs = (0.05, 0.9, 0.05)
    coverage = _coverage(lambda g: g.choice([1.0, 0.0, -1.0], size=16, p=probs), 0.0, 3000)
    assert coverage >= 0.93, coverage


def test_two_episodes_of_a_continuous_return_keep_the_level() -> None:
    # Any two distinct returns went to the two-values branch: an interval inside [min, max],
    # which covers the mean of two normal returns 50% of the time. Student t with 1 df: 95%.
    ci = mean_ci([95.0, 112.0], seed=0)
    assert (ci.low, ci.high) == pytest.approx((-4.5031, 211.5031), abs=1e-3)
    coverage = _coverage(lambda g: g.normal(100.0, 20.0, 2), 100.0, 3000)
    assert coverage >= 0.93, coverage


def test_success_rates_stay_narrow_under_the_two_values_hull() -> None:
    # 3 successes in 32: Clopper-Pearson [0.0198, 0.2502]; the hull adds t's lower side only.
    x = [0.0] * 29 + [1.0] * 3
    low, high = intervals.clopper_pearson(3, 32, 0.95)
    free, bounded = mean_ci(x, seed=0), mean_ci(x, seed=0, bounds=(0, 1))
    assert free.high == bounded.high == pytest.approx(high, rel=1e-12)
    assert free.low == pytest.approx(-0.01297, abs=1e-4) and bounded.low == 0.0
    assert free.high - free.low < 1.15 * (high - low)
    assert bounded.high - bounded.low < 1.1 * (high - low)


def test_returns_equal_up_to_rounding_are_a_constant_sample() -> None:
    # 0.1 + 0.2 == 0.30000000000000004: the sample was "two-valued" with a 3e-17-wide interval.
    exact = mean_ci([0.3] * 16, seed=0)
    jitter = mean_ci([0.3] * 15 + [0.1 + 0.2], seed=0)
    assert jitter.method == exact.method == stats.METHOD_CONSTANT_UNIT
    assert (jitter.low, jitter.high) == pytest.approx((exact.low, exact.high), rel=1e-12)
    bounded = mean_ci([0.3] * 15 + [0.1 + 0.2], seed=0, bounds=(0, 1))
    assert bounded.method == stats.METHOD_CONSTANT_BOUNDED and bounded.halfwidth > 0.1
    # The tolerance is relative to the sample's magnitude: small returns that differ are distinct.
    assert intervals.distinct_values(np.array([1e-9, 2e-9])) == 2
    assert intervals.distinct_values(np.array([1e-9, 1.5e-9, 2e-9])) == 3
    assert intervals.distinct_values(np.array([0.0, 1e-300])) == 2
    assert intervals.distinct_values(np.array([0.0, 0.0])) == 1
    assert intervals.distinct_values(np.sort(np.array([0.3, 0.1 + 0.2, 1.0, 1.0]))) == 2
    assert mean_ci([1e-9] * 15 + [2e-9], seed=0).method == stats.METHOD_TWO_VALUES
    assert not stats.has_spread(np.array([0.3, 0.1 + 0.2, 0.3]))
    assert stats.has_spread(np.array([2e-9, 1e-9])) and not stats.has_spread(np.array([5.0]))


def test_skew_corrected_t_is_the_t_interval_on_symmetric_returns() -> None:
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    auto, t = mean_ci(x, seed=0), mean_ci(x, seed=0, method="t")
    assert auto.method == stats.METHOD_SKEW_T_OR_T
    assert (auto.low, auto.high) == pytest.approx((t.low, t.high), rel=1e-12)


def test_skew_corrected_t_reaches_further_into_the_long_tail() -> None:
    x = 50 + np.random.default_rng(3).exponential(40.0, size=16)
    auto, t = mean_ci(x, seed=0), mean_ci(x, seed=0, method="t")
    mean = float(x.mean())
    assert auto.high - mean > mean - auto.low
    assert auto.high > t.high


def test_declared_bounds_clip_and_are_checked() -> None:
    ci = mean_ci([0.0, 0.2, 0.9, 1.0, 0.0, 0.0], seed=0, bounds=(0.0, 1.0))
    assert 0.0 <= ci.low and ci.high <= 1.0
    with pytest.raises(StatsInputError, match=r"outside the declared bounds \(0, 1\)"):
        mean_ci([0.0, 2.0, 1.0], seed=0, bounds=(0, 1))
    with pytest.raises(StatsInputError, match=r"low < high"):
        mean_ci([0.0, 1.0, 0.5], seed=0, bounds=(1, 0))


# ---------------------------------------------------------------------------------------------
# BCa
# ---------------------------------------------------------------------------------------------


def test_bca_moves_the_interval_towards_the_long_tail() -> None:
    x = np.random.default_rng(11).exponential(1.0, size=50)
    pct = mean_ci(x, seed=4, method="percentile")
    bca = mean_ci(x, seed=4, method="bca")
    assert bca.method == "bootstrap-bca"
    assert bca.low > pct.low and bca.high > pct.high


def test_bca_falls_back_to_percentile_when_acceleration_is_too_large() -> None:
    # One success in 100: acceleration ~0.164, so 1 - a(z0 + z) <= 0 at a 1 - 1e-9 level.
    x = [0.0] * 99 + [1.0]
    level = 1 - 1e-9
    bca = mean_ci(x, seed=0, level=level, method="bca")
    assert bca.method == "bootstrap-percentile (bca degenerate)"
    pct = mean_ci(x, seed=0, level=level, method="percentile")
    assert (bca.low, bca.high) == (pct.low, pct.high)


# ---------------------------------------------------------------------------------------------
# Paired comparison
# ---------------------------------------------------------------------------------------------


def test_paired_comparison_detects_a_small_improvement_under_large_seed_variance() -> None:
    rng = np.random.default_rng(2)
    base = rng.normal(0.0, 10.0, size=200)  # per-seed difficulty dominates the returns
    new = base + 1.0 + rng.normal(0.0, 0.1, size=200)
    cmp = paired_comparison(new, base, seed=5)
    assert cmp.verdict == "better"
    assert cmp.mean_diff == pytest.approx(1.0, abs=0.05)
    assert cmp.p_improvement == 1.0
    assert cmp.ci.halfwidth < cmp.unpaired_ci.halfwidth / 10
    # Unpaired, the same data cannot tell the policies apart.
    assert cmp.unpaired_ci.low < 0.0 < cmp.unpaired_ci.high


def test_paired_comparison_of_pure_noise_is_not_distinguishable() -> None:
    rng = np.random.default_rng(3)
    base = rng.normal(0.0, 1.0, size=200)
    new = rng.normal(0.0, 1.0, size=200)
    cmp = paired_comparison(new, base, seed=6)
    assert cmp.verdict == "not distinguishable"
    assert cmp.ci.low < 0.0 < cmp.ci.high


def test_paired_comparison_worse_and_identical() -> None:
    base = np.random.default_rng(4).normal(size=50)
    assert paired_comparison(base - 1.0, base, seed=0).verdict == "worse"
    same = paired_comparison(base, base, seed=0)
    assert same.verdict == "not distinguishable"
    assert (same.ci.low, same.ci.high, same.p_improvement) == (0.0, 0.0, 0.5)


def test_paired_comparison_of_constant_samples_is_degenerate() -> None:
    cmp = paired_comparison([0.3] * 10, [0.2] * 10, seed=0)  # differences 0.09999999999999998
    assert cmp.ci.low == cmp.ci.high == cmp.mean_diff == 0.3 - 0.2
    assert cmp.ci.method == stats.METHOD_T
    assert cmp.unpaired_ci.low == cmp.unpaired_ci.high == cmp.mean_new - cmp.mean_baseline
    assert cmp.verdict == "better"


def test_paired_ci_is_the_hull_of_the_headline_and_the_t_interval() -> None:
    rng = np.random.default_rng(5)
    base = rng.normal(size=30)
    new = base + rng.normal(0.2, 0.5, size=30)
    cmp = paired_comparison(new, base, seed=9)
    auto = mean_ci(new - base, seed=9, method="auto")
    t = mean_ci(new - base, seed=9, method="t")
    assert auto.method == stats.METHOD_SKEW_T_OR_T  # the headline is that hull itself
    assert (cmp.ci.low, cmp.ci.high) == (auto.low, auto.high)
    assert auto.low <= t.low and auto.high >= t.high
    assert cmp.ci.method == stats.METHOD_SKEW_T_OR_T


def test_sparse_disagreements_need_the_t_interval_too_for_a_verdict() -> None:
    # 0/1 returns, 500 pairs: 10 where only the new policy succeeds, 3 where only the baseline
    # does. The exact sign test gives p = 0.092; the skew-corrected t alone said "better".
    base = np.zeros(500)
    base[10:13] = 1.0
    new = base.copy()
    new[:10], new[10:13] = 1.0, 0.0
    cmp = paired_comparison(new, base, seed=0)
    assert cmp.verdict == "not distinguishable", cmp.ci
    assert cmp.ci.low < 0.0 < cmp.ci.high


def test_identical_policies_with_sparse_disagreements_get_few_false_verdicts() -> None:
    # Two identical 0/1 policies on 500 shared seeds, 2% of pairs discordant (either way): the
    # skew-corrected t alone gave 6.8% false "better"/"worse" verdicts at a nominal 5%.
    rng = np.random.default_rng(0)
    sims, wrong = 2000, 0
    for s in range(sims):
        base = (rng.random(500) < 0.5).astype(float)
        new = np.where(rng.random(500) < 0.02, 1.0 - base, base)
        cmp = paired_comparison(new, base, seed=s, n_boot=100)
        wrong += cmp.verdict in ("better", "worse")
    assert wrong / sims <= 0.055, wrong / sims


def test_paired_verdict_needs_min_pairs() -> None:
    # Three pairs whose differences all favour the new policy: a t-test gives p = 0.038 and the
    # percentile bootstrap [0.5, 1.0] ("better"); below MIN_PAIRS there is no verdict.
    cmp = paired_comparison([101.0, 97.0, 104.0], [100.0, 96.5, 103.0], seed=0)
    assert stats.MIN_PAIRS == 10
    assert cmp.verdict == "too few pairs"
    assert cmp.mean_diff == pytest.approx(2.5 / 3) and cmp.ci.method == stats.METHOD_T
    assert (cmp.ci.low, cmp.ci.high) == pytest.approx((0.1162245450, 1.5504421216))
    # Two pairs used to give "better" from a percentile bootstrap of [1.0, 2.5].
    assert paired_comparison([5.0, 7.0], [4.0, 4.5], seed=0).verdict == "too few pairs"


def test_paired_verdict_holds_its_level_on_equal_policies_at_few_pairs() -> None:
    # Two identical policies (the differences are symmetric about 0): the verdict must be
    # wrong about 5% of the time. The percentile bootstrap was wrong 9.8% of the time at 10
    # pairs of normal returns and 34% on 0/1 returns with 30% discordant pairs.
    rng = np.random.default_rng(2)
    normal = wrong_01 = 0
    sims = 400
    for s in range(sims):
        new = rng.normal(100, 20, 10)
        normal += paired_comparison(new, new + rng.normal(0, 10, 10), seed=s).verdict != (
            "not distinguishable")
        base = (rng.random(10) < 0.5).astype(float)
        flip = rng.random(10) < 0.3
        other = np.where(flip, 1.0 - base, base)
        wrong_01 += paired_comparison(other, base, seed=s).verdict != "not distinguishable"
    assert normal / sims < 0.075, normal / sims
    assert wrong_01 / sims < 0.075, wrong_01 / sims


# ---------------------------------------------------------------------------------------------
# Consistency, serialization, speed
# ---------------------------------------------------------------------------------------------


def test_summarize_shares_resamples_with_mean_ci_and_iqm_ci() -> None:
    x = np.random.default_rng(6).gamma(2.0, size=333)
    for method in ("auto", "percentile", "bca", "t"):
        s = summarize(x, seed=8, method=method)
        assert s.ci == mean_ci(x, seed=8, method=method)
        assert s.iqm_ci == iqm_ci(x, seed=8)


def test_chunk_size_does_not_change_results(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(7).normal(size=1001)
    reference = summarize(x, seed=5, n_boot=1000, method="bca")
    # 7007 indices per chunk: 7 rows each, last chunk shorter, odd index counts.
    monkeypatch.setattr(bootstrap, "MAX_INDICES_PER_CHUNK", 7007)
    assert summarize(x, seed=5, n_boot=1000, method="bca") == reference


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1001])
def test_bootstrap_draws_plain_index_resamples_of_the_sorted_sample(n: int) -> None:
    # The contract, written out without scipy: row r of the resamples is
    # sorted_x[rng.integers(0, n, (n_boot, n))[r]]; the IQM cuts n // 4 from each end, and is the
    # mean itself below 4 values.
    x = np.sort(np.random.default_rng(n).normal(size=n))
    idx = np.random.default_rng(17).integers(0, n, size=(300, n))
    cut = n // 4
    means = x[idx].mean(axis=1)
    iqms = np.sort(x[idx], axis=1)[:, cut : n - cut].mean(axis=1) if cut else means
    got_means, got_iqms = bootstrap.bootstrap_distribution(
        x, np.random.default_rng(17), 300, with_iqm=True
    )
    assert np.array_equal(got_means, means) and np.array_equal(got_iqms, iqms)
    only_means, _ = bootstrap.bootstrap_distribution(
        x, np.random.default_rng(17), 300, with_iqm=False
    )
    assert np.array_equal(only_means, means)


@pytest.mark.parametrize("method", ["percentile", "bca"])
def test_bootstrap_intervals_agree_with_scipy_stats_bootstrap(method: str) -> None:
    # Same seed, same resamples: scipy's own interval (its BCa with a generic jackknife) matches.
    from scipy import stats as scipy_stats

    x = np.random.default_rng(11).exponential(1.0, size=50)
    ours = mean_ci(x, seed=4, method=method)
    theirs = scipy_stats.bootstrap(
        (np.sort(x),), np.mean, n_resamples=2000, method=method, rng=np.random.default_rng(4)
    ).confidence_interval
    assert (ours.low, ours.high) == pytest.approx((theirs.low, theirs.high), rel=1e-12)


@pytest.mark.parametrize(("k", "n"), [(1, 16), (15, 16), (3, 50), (1, 20_000), (19_999, 20_000)])
def test_clopper_pearson_agrees_with_scipy_binomtest(k: int, n: int) -> None:
    from scipy import stats as scipy_stats

    low, high = intervals.clopper_pearson(k, n, 0.95)
    exact = scipy_stats.binomtest(k, n).proportion_ci(0.95, method="exact")
    assert (low, high) == pytest.approx((exact.low, exact.high), rel=1e-9)


def test_stats_reexports_the_interval_names() -> None:
    # audit.py, report.py and the tests import these from evalfleet.stats.
    for name in stats.__all__:
        assert hasattr(stats, name), name
    assert stats.Interval is intervals.Interval
    assert stats.StatsInputError is intervals.StatsInputError
    assert stats.wilson_interval is intervals.wilson_interval
    assert stats.METHOD_SKEW_T_OR_T == intervals.METHOD_SKEW_T_OR_T == (
        "hull of skew-corrected t (Hall) and t")


def test_to_dict_is_json_ready() -> None:
    s = summarize([1.0, 2.0, 4.0, 8.0], seed=0)
    d = s.to_dict()
    assert json.loads(json.dumps(d)) == d
    ci, percentiles = d["ci"], d["percentiles"]
    assert isinstance(ci, dict) and Interval(**ci) == s.ci
    assert isinstance(percentiles, dict)
    assert set(percentiles) == {"p5", "p25", "p50", "p75", "p95"}
    cmp = paired_comparison([1.0, 2.0, 3.0], [0.5, 2.5, 2.0], seed=0)
    dc = cmp.to_dict()
    assert json.loads(json.dumps(dc)) == dc
    paired_ci, unpaired_ci = dc["ci"], dc["unpaired_ci"]
    assert isinstance(paired_ci, dict) and Interval(**paired_ci) == cmp.ci
    assert isinstance(unpaired_ci, dict) and Interval(**unpaired_ci) == cmp.unpaired_ci


def test_halfwidth() -> None:
    assert Interval(1.0, 4.0, 0.9, "t").halfwidth == 1.5


def test_summarize_20k_episodes_is_fast() -> None:
    x = np.random.default_rng(8).normal(size=20_000)
    start = time.perf_counter()
    summarize(x, seed=0, n_boot=2000)
    # About 0.5 s on 2 slow cores; the bound only catches an accidental per-resample loop.
    assert time.perf_counter() - start < 5.0


def test_length_stats() -> None:
    got = length_stats([40, 10, 30, 20])
    assert got == pytest.approx(
        {"mean": 25.0, "std": math.sqrt(500 / 3), "min": 10.0, "max": 40.0, "median": 25.0},
        rel=1e-15,
    )


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def test_non_finite_returns_are_rejected_with_their_index() -> None:
    with pytest.raises(StatsInputError, match=r"returns must be finite \(got nan at index 3\)"):
        summarize([1.0, 2.0, 3.0, float("nan"), 5.0], seed=0)
    with pytest.raises(StatsInputError, match=r"got -inf at index 0 and 1 more"):
        mean_ci([-math.inf, 1.0, math.inf], seed=0)
    with pytest.raises(StatsInputError, match=r"baseline must be finite"):
        paired_comparison([1.0, 2.0], [1.0, math.nan], seed=0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: summarize([], seed=0), r"returns must not be empty \(got 0 values\)"),
        (lambda: summarize([[1.0, 2.0]], seed=0), r"must be 1-D, .*got shape \(1, 2\)"),
        (lambda: summarize(["a"], seed=0), r"returns must be a 1-D sequence of numbers"),
        (lambda: summarize([1e300], seed=0), r"magnitude at most 1e\+100"),
        (lambda: summarize([1.0], seed=0, level=1.0), r"level must be .* \(got 1.0\)"),
        (lambda: summarize([1.0], seed=0, level=0), r"level must be"),
        (lambda: mean_ci([1.0], seed=0, level=math.nan), r"level must be"),
        (lambda: mean_ci([1.0], seed=0, level=True), r"level must be"),
        (lambda: mean_ci([1.0], seed=0, n_boot=99), r"n_boot must be at least 100 \(got 99\)"),
        (lambda: mean_ci([1.0], seed=0, n_boot=1000.0), r"n_boot must be an integer"),  # type: ignore[arg-type]
        (lambda: iqm_ci([1.0], seed=-1), r"seed must be a non-negative integer \(got -1\)"),
        (
            lambda: mean_ci([1.0], seed=0, method="basic"),
            r"Unknown method 'basic'. Choose 'auto', 'percentile', 'bca' or 't'.",
        ),
        (lambda: wilson_interval(11, 10), r"successes must be between 0 and n=10 \(got 11\)"),
        (lambda: wilson_interval(0, 0), r"n must be at least 1 \(got 0\)"),
        (lambda: wilson_interval(2.5, 10), r"successes must be an integer \(got 2.5\)"),  # type: ignore[arg-type]
        (lambda: paired_comparison([1.0], [1.0, 2.0], seed=0), r"got 1 and 2 values"),
        (lambda: length_stats([3, -1]), r"lengths must be non-negative .*got -1.0"),
        (lambda: needed_episodes(-1.0, 0.1), r"std must be a finite non-negative number"),
        (lambda: needed_episodes(1.0, 0.0), r"target_halfwidth must be a finite positive"),
        (lambda: needed_episodes(1e300, 1e-300), r"raise target_halfwidth"),
        (lambda: Interval(2.0, 1.0, 0.95, "t"), r"low <= high"),
    ],
)
def test_invalid_inputs_are_rejected(call: Callable[[], object], message: str) -> None:
    with pytest.raises(StatsInputError, match=message) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, EvalfleetError)


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------

prop = settings(deadline=None, max_examples=100)


@prop
@given(values=returns_lists(), seed=seeds, method=mean_ci_methods, data=st.data())
def test_episode_order_does_not_matter(
    values: list[float], seed: int, method: str, data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(values))
    assert summarize(shuffled, seed=seed, n_boot=N_BOOT, method=method) == summarize(
        values, seed=seed, n_boot=N_BOOT, method=method
    )


@prop
@given(values=returns_lists(), seed=seeds, method=mean_ci_methods)
def test_estimates_lie_in_range_and_intervals_contain_them(
    values: list[float], seed: int, method: str
) -> None:
    s = summarize(values, seed=seed, n_boot=N_BOOT, method=method)
    assert s.min <= s.iqm <= s.max
    assert s.min <= s.mean <= s.max
    assert s.min <= s.median <= s.max
    assert list(s.percentiles.values()) == sorted(s.percentiles.values())
    assert s.var >= 0.0 and s.std >= 0.0 and s.stderr >= 0.0
    for name, interval, estimate in all_intervals(s):
        assert interval.low <= estimate <= interval.high, name
        assert interval.level == 0.95
    for number in (s.mean, s.var, s.std, s.iqm, s.ci.low, s.ci.high):
        assert math.isfinite(number)


@prop
@given(values=returns_lists(), seed=seeds, method=mean_ci_methods)
def test_same_seed_same_intervals(values: list[float], seed: int, method: str) -> None:
    first = summarize(values, seed=seed, n_boot=N_BOOT, method=method)
    assert summarize(values, seed=seed, n_boot=N_BOOT, method=method) == first
    assert mean_ci(values, seed=seed, n_boot=N_BOOT, method=method) == first.ci
    assert iqm_ci(values, seed=seed, n_boot=N_BOOT) == first.iqm_ci


@prop
@given(data_seed=seeds, n=st.integers(min_value=10, max_value=200), a=seeds, b=seeds)
def test_different_seeds_give_different_bootstrap_intervals(
    data_seed: int, n: int, a: int, b: int
) -> None:
    assume(a != b)
    x = np.random.default_rng(data_seed).normal(size=n)  # continuous: no exact ties
    first = mean_ci(x, seed=a, n_boot=N_BOOT, method="percentile")
    assert first != mean_ci(x, seed=b, n_boot=N_BOOT, method="percentile")
    assert iqm_ci(x, seed=a, n_boot=N_BOOT) != iqm_ci(x, seed=b, n_boot=N_BOOT)


@prop
@given(
    values=returns_lists(bound=1e3),
    shift=st.floats(min_value=-1e3, max_value=1e3),
    seed=seeds,
    method=shift_methods,
)
def test_shifting_returns_shifts_location_statistics(
    values: list[float], shift: float, seed: int, method: str
) -> None:
    x = np.asarray(values)
    base = summarize(x, seed=seed, n_boot=N_BOOT, method=method)
    moved = summarize(x + shift, seed=seed, n_boot=N_BOOT, method=method)
    tol = 1e-6 * max(1.0, float(np.max(np.abs(x))), abs(shift))
    pairs = [
        (moved.mean, base.mean),
        (moved.median, base.median),
        (moved.iqm, base.iqm),
        (moved.min, base.min),
        (moved.max, base.max),
        (moved.ci.low, base.ci.low),
        (moved.ci.high, base.ci.high),
        (moved.iqm_ci.low, base.iqm_ci.low),
        (moved.iqm_ci.high, base.iqm_ci.high),
        *((moved.percentiles[k], base.percentiles[k]) for k in base.percentiles),
    ]
    for got, before in pairs:
        assert got == pytest.approx(before + shift, abs=tol)
    assert moved.std == pytest.approx(base.std, abs=tol)


@prop
@given(
    values=returns_lists(),
    k=st.floats(min_value=1e-3, max_value=1e3),
    seed=seeds,
)
def test_scaling_returns_scales_spread(values: list[float], k: float, seed: int) -> None:
    # A constant sample's interval assumes a scale of max(1, |value|): not scale-equivariant.
    assume(len(set(values)) > 1)
    x = np.asarray(values)
    base = summarize(x, seed=seed, n_boot=N_BOOT)
    scaled = summarize(x * k, seed=seed, n_boot=N_BOOT)
    # Sums of n terms round to about n·eps·k·max|x| whatever their value: a mean that cancels to
    # 0.0 unscaled can come out 1e-14 scaled ([1, 2, -3] × 85.3). The 1e-300 covers subnormals.
    tol = 1e-12 * k * float(np.max(np.abs(x))) * len(x) + 1e-300
    assert scaled.std == pytest.approx(k * base.std, rel=1e-9, abs=tol)
    assert scaled.stderr == pytest.approx(k * base.stderr, rel=1e-9, abs=tol)
    assert scaled.mean == pytest.approx(k * base.mean, rel=1e-9, abs=tol)
    assert scaled.ci.halfwidth == pytest.approx(k * base.ci.halfwidth, rel=1e-6, abs=tol)


@prop
@example(pair=([0.0, 0.0, 1.0], [0.0, 1.778508549239415e-10, 178.0]), seed=0, data=None)
@example(pair=([0.0, 0.0], [178.0, 1.778508549239415e-10]), seed=0, data=None)
@given(pair=paired_returns(), seed=seeds, data=st.data())
def test_paired_comparison_properties(
    pair: tuple[list[float], list[float]], seed: int, data: st.DataObject
) -> None:
    new, base = pair
    cmp = paired_comparison(new, base, seed=seed, n_boot=N_BOOT)
    assert cmp.ci.low <= cmp.mean_diff <= cmp.ci.high
    assert cmp.unpaired_ci.low <= cmp.mean_new - cmp.mean_baseline <= cmp.unpaired_ci.high
    assert 0.0 <= cmp.p_improvement <= 1.0
    expected = "better" if cmp.ci.low > 0 else "worse" if cmp.ci.high < 0 else "not distinguishable"
    if len(new) < stats.MIN_PAIRS:
        expected = "too few pairs"
    assert cmp.verdict == expected
    # Differences within float rounding of the pair's returns are ties (``paired_comparison``).
    raw = np.asarray(new) - np.asarray(base)
    tol = stats.SAME_VALUE_RTOL * np.maximum(np.abs(new), np.abs(base))
    diffs = np.where(np.abs(raw) <= tol, 0.0, raw)
    t = mean_ci(diffs, seed=seed, n_boot=N_BOOT, method="t")
    if intervals.distinct_values(np.sort(diffs)) < 3:
        assert cmp.ci == t
    else:
        auto = mean_ci(diffs, seed=seed, n_boot=N_BOOT, method="auto")
        assert cmp.ci == auto and auto.low <= t.low and auto.high >= t.high
    # Reordering the episode pairs changes nothing.
    order = data.draw(st.permutations(range(len(new)))) if data else list(range(len(new)))[::-1]
    reordered = paired_comparison(
        [new[i] for i in order], [base[i] for i in order], seed=seed, n_boot=N_BOOT
    )
    assert reordered == cmp


@prop
@given(
    n=st.integers(min_value=1, max_value=100_000),
    share=st.floats(min_value=0.0, max_value=1.0),
    level=st.floats(min_value=0.5, max_value=0.9999),
)
def test_wilson_interval_contains_the_rate(n: int, share: float, level: float) -> None:
    successes = round(share * n)
    ci = wilson_interval(successes, n, level=level)
    assert 0.0 <= ci.low <= successes / n <= ci.high <= 1.0
    assert ci.level == level


def test_sparse_win_draw_loss_returns_keep_the_level_at_a_hundred_episodes() -> None:
    """A 5% win and a 5% loss among draws: the skew-corrected t alone covered 93.1% (its sample
    skewness follows the chance imbalance of wins and losses); the hull with plain t holds 95%."""
    rng = np.random.default_rng(2024)
    covered = 0
    sims = 3000
    for _ in range(sims):
        x = rng.choice([-1.0, 0.0, 1.0], size=100, p=[0.05, 0.9, 0.05])
        ci = mean_ci(x, seed=0)
        covered += ci.low <= 0.0 <= ci.high
    assert covered / sims >= 0.945, covered / sims


def test_paired_differences_within_float_rounding_are_ties_not_a_verdict():
    # 0.3 against 0.1 + 0.2 (one ulp apart): before, a zero-width CI at -5.6e-17, "worse".
    same = stats.paired_comparison([0.3] * 20, [0.1 + 0.2] * 20, seed=0)
    assert same.verdict == "not distinguishable"
    assert (same.mean_diff, same.ci.low, same.ci.high, same.p_improvement) == (0.0, 0.0, 0.0, 0.5)
    mixed = stats.paired_comparison([0.3] * 15 + [0.1 + 0.2] * 5, [0.1 + 0.2] * 20, seed=0)
    assert mixed.verdict == "not distinguishable"
    # A real difference, however small against the returns' spread, is still one.
    x = np.random.default_rng(0).normal(size=50)
    assert stats.paired_comparison(x + 1e-9, x, seed=0).verdict == "better"


def test_one_huge_pair_does_not_turn_the_other_pairs_differences_into_ties():
    # The new policy is better by ~1 on 99 pairs; on one seed both return 1e13. The tolerance
    # was 1e-12 of the sample's largest return (10) for every pair: mean_diff 0, CI [0, 0],
    # 'not distinguishable', P(improvement) 0.5.
    from scipy.stats import ttest_1samp

    rng = np.random.default_rng(0)
    base = rng.normal(100, 10, 100)
    new = base + 1.0 + rng.normal(0, 0.2, 100)
    base[0] = new[0] = 1e13
    cmp = stats.paired_comparison(new, base, seed=0)
    d = new - base
    assert cmp.mean_diff == pytest.approx(d.mean(), rel=1e-12) and cmp.mean_diff > 0.97
    t = ttest_1samp(d, 0.0).confidence_interval(0.95)
    assert cmp.ci.low <= t.low and cmp.ci.high >= t.high and cmp.ci.low > 0.9
    assert cmp.verdict == "better"
    assert cmp.p_improvement == pytest.approx((99 + 0.5) / 100)
