"""Aggregates over a (runs x tasks) score matrix, checked against the paper's definitions."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from evalfleet.aggregates import (
    aggregate,
    normalise,
    performance_profile,
    point_estimates,
    probability_of_improvement,
)
from evalfleet.errors import RequestError, SuiteError

# 3 runs x 2 tasks. Task means 0.2 and 1.0; pooled sorted 0.1 0.2 0.3 0.9 1.0 1.1.
SMALL = np.array([[0.1, 0.9], [0.3, 1.1], [0.2, 1.0]])


def rliable_points(scores: np.ndarray, gamma: float = 1.0) -> dict[str, float]:
    """rliable's metrics.py, verbatim in numpy."""
    task_means = np.mean(scores, axis=0)
    return {
        "mean": float(np.mean(task_means)),
        "median": float(np.median(task_means)),
        "iqm": float(stats.trim_mean(scores, proportiontocut=0.25, axis=None)),
        "optimality_gap": float(gamma - np.mean(np.minimum(scores, gamma))),
    }


def test_hand_computed_points() -> None:
    out = aggregate(SMALL, seed=0, reps=100)
    assert out["mean"]["point"] == pytest.approx(0.6)
    assert out["median"]["point"] == pytest.approx(0.6)
    # 25% of 6 scores = 1 cut from each end: mean(0.2, 0.3, 0.9, 1.0).
    assert out["iqm"]["point"] == pytest.approx(0.6)
    # max(1 - s, 0): 0.9 + 0.1 + 0.7 + 0 + 0.8 + 0 = 2.5, over 6.
    assert out["optimality_gap"]["point"] == pytest.approx(2.5 / 6)
    assert set(out) == {"mean", "median", "iqm", "optimality_gap"}
    for value in out.values():
        assert set(value) == {"point", "ci"} and len(value["ci"]) == 2


def test_points_match_rliable_on_a_random_matrix() -> None:
    scores = np.random.default_rng(7).gamma(2.0, 0.5, size=(13, 6))
    for gamma in (1.0, 0.5):
        ours = point_estimates(scores, gamma=gamma)
        for key, value in rliable_points(scores, gamma).items():
            assert ours[key] == pytest.approx(value, abs=1e-12), key


def test_median_is_of_task_means_not_of_all_scores() -> None:
    # Task means 3, 1, 2: median 2; the median of the 9 scores pooled is 1.
    scores = np.array([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [9.0, 1.0, 2.0]])
    assert point_estimates(scores)["median"] == pytest.approx(2.0)
    assert float(np.median(scores)) == pytest.approx(1.0)


def test_iqm_is_robust_to_an_outlier_the_mean_is_not() -> None:
    spoiled = SMALL.copy()
    spoiled[1, 1] = 1000.0
    clean, bad = point_estimates(SMALL), point_estimates(spoiled)
    assert bad["iqm"] == pytest.approx(clean["iqm"])
    assert bad["mean"] > 100 * clean["mean"]


def test_optimality_gap_ignores_scores_above_gamma() -> None:
    above = SMALL.copy()
    above[1:, 1] = [50.0, 5.0]  # the scores at or above gamma = 1 (1.1 and 1.0) go up
    assert point_estimates(above)["optimality_gap"] == pytest.approx(
        point_estimates(SMALL)["optimality_gap"])
    assert point_estimates(above, gamma=10.0)["optimality_gap"] == pytest.approx(
        np.mean(np.maximum(10.0 - above, 0)))
    assert point_estimates(np.full((3, 2), 2.0))["optimality_gap"] == 0.0


def test_bootstrap_resamples_runs_within_each_task() -> None:
    # Each task constant: any stratified resample has task means 0 and 1 exactly, so every
    # interval collapses to its point. Resampling all scores pooled would not.
    scores = np.array([[0.0, 1.0]] * 5)
    out = aggregate(scores, seed=3, reps=500)
    assert out["mean"] == {"point": 0.5, "ci": [0.5, 0.5]}
    assert out["median"]["ci"] == [0.5, 0.5]
    assert out["iqm"]["ci"] == [0.5, 0.5]
    assert out["optimality_gap"]["ci"] == [0.5, 0.5]


def test_bootstrap_matches_a_plain_stratified_loop() -> None:
    scores = np.random.default_rng(1).normal(size=(8, 4))
    reps = 300
    rng = np.random.default_rng(5)
    idx = [rng.integers(0, 8, size=(reps, 8)) for _ in range(4)]
    draws = {k: [] for k in ("mean", "median", "iqm", "optimality_gap")}
    for r in range(reps):
        resample = np.stack([scores[idx[m][r], m] for m in range(4)], axis=1)
        for k, v in rliable_points(resample).items():
            draws[k].append(v)
    out = aggregate(scores, seed=5, reps=reps)
    for k, v in draws.items():
        assert out[k]["ci"] == pytest.approx(list(np.percentile(v, [2.5, 97.5])), abs=1e-12), k
        assert out[k]["ci"][0] <= out[k]["point"] <= out[k]["ci"][1]


def test_seeded_reproducibility() -> None:
    scores = np.random.default_rng(2).normal(size=(10, 3))
    assert aggregate(scores, seed=11) == aggregate(scores, seed=11)
    assert aggregate(scores, seed=11)["mean"]["ci"] != aggregate(scores, seed=12)["mean"]["ci"]
    x, y = scores, scores + 0.3
    assert probability_of_improvement(x, y, seed=4) == probability_of_improvement(x, y, seed=4)


def test_ragged_tasks_are_means_of_task_means() -> None:
    tasks = [np.array([0.0, 1.0]), np.array([2.0, 2.0, 2.0, 2.0])]
    out = aggregate(tasks, seed=0, reps=200)
    assert out["mean"]["point"] == pytest.approx(1.25)  # (0.5 + 2) / 2, not 9 / 6
    assert out["median"]["point"] == pytest.approx(1.25)


def test_probability_of_improvement_by_hand() -> None:
    # Task 0: x = 1, 2, 3 vs y = 0, 2, 2: 1 + (1 + 2 * 0.5) + 3 = 6 of 9 pairs. Task 1: 0 of 4.
    x = [np.array([1.0, 2.0, 3.0]), np.array([0.0, 0.0])]
    y = [np.array([0.0, 2.0, 2.0]), np.array([1.0, 1.0])]
    out = probability_of_improvement(x, y, reps=200)
    assert out["point"] == pytest.approx((6 / 9 + 0) / 2)
    assert 0.0 <= out["ci"][0] <= out["point"] <= out["ci"][1] <= 1.0


def test_probability_of_improvement_matches_mann_whitney() -> None:
    rng = np.random.default_rng(9)
    x, y = rng.integers(0, 5, size=(12, 3)).astype(float), rng.integers(0, 5, size=(9, 3)).astype(float)
    expected = np.mean([stats.mannwhitneyu(x[:, m], y[:, m], alternative="greater").statistic / (12 * 9)
                        for m in range(3)])
    assert probability_of_improvement(x, y, reps=50)["point"] == pytest.approx(expected)


def test_identical_scores_improve_with_probability_one_half() -> None:
    scores = np.random.default_rng(3).normal(size=(6, 4))
    out = probability_of_improvement(scores, scores.copy(), reps=400)
    assert out["point"] == 0.5
    assert out["ci"][0] < 0.5 < out["ci"][1]
    assert probability_of_improvement(np.ones((3, 2)), np.ones((5, 2)), reps=50)["point"] == 0.5
    better = probability_of_improvement(scores + 100, scores, reps=50)
    assert better == {"point": 1.0, "ci": [1.0, 1.0]}


def test_performance_profile_counts_scores_strictly_above_tau() -> None:
    profile = performance_profile(SMALL, [0.0, 0.2, 1.0, 1.1], seed=0, reps=300)
    assert profile["point"] == pytest.approx([1.0, 4 / 6, 1 / 6, 0.0])
    assert profile["taus"] == [0.0, 0.2, 1.0, 1.1]
    for low, point, high in zip(profile["low"], profile["point"], profile["high"], strict=True):
        assert 0.0 <= low <= point <= high <= 1.0
    wide = performance_profile(np.random.default_rng(0).normal(size=(20, 5)), np.linspace(-2, 2, 9))
    assert all(a >= b for a, b in zip(wide["point"], wide["point"][1:], strict=False))


def test_normalise() -> None:
    assert normalise([29.39, 132.53, 200.0], 29.39, 132.53).tolist() == pytest.approx(
        [0.0, 1.0, (200 - 29.39) / (132.53 - 29.39)])
    with pytest.raises(SuiteError, match="two different scores"):
        normalise([1.0], 2.0, 2.0)


@pytest.mark.parametrize(("scores", "match"), [
    (np.zeros(5), r"must be a \(runs x tasks\) matrix, 2-D \(got shape \(5,\)\)"),
    (np.zeros((2, 3, 4)), r"2-D \(got shape \(2, 3, 4\)\)"),
    (np.zeros((3, 0)), "has no tasks"),
    (np.zeros((0, 3)), "task 0 has no runs"),
    (np.array([[1.0, np.nan]]), "task 1 has non-finite scores"),
    ([np.zeros((2, 2))], r"'scores\[0\]' must be a 1-D array"),
    ([[1.0, 2.0], [3.0]], "list of 1-D numpy arrays"),
])
def test_bad_matrices_give_a_clear_error(scores: object, match: str) -> None:
    with pytest.raises(SuiteError, match=match) as info:
        aggregate(scores, reps=10)  # type: ignore[arg-type]
    assert isinstance(info.value, RequestError)


def test_probability_of_improvement_needs_the_same_tasks() -> None:
    with pytest.raises(SuiteError, match="'x_scores' has 3 tasks and 'y_scores' 2"):
        probability_of_improvement(np.zeros((4, 3)), np.zeros((4, 2)))
    with pytest.raises(SuiteError, match="'reps' must be a positive integer"):
        aggregate(SMALL, reps=0)


def test_ragged_tasks_weigh_the_same_in_the_pooled_aggregates() -> None:
    """A suite with 1,000 episodes on one task and 100 on another: pooled unweighted, the IQM
    (the suite's headline, ``eval/reward``) was the big task's alone (0.99 for tasks at ~1 and
    ~0). Each task now weighs the same: the task of 1,000 episodes that repeat 100 scores ten
    times aggregates exactly as its 100 scores do."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(1.0, 0.1, 100), rng.normal(0.0, 0.1, 100)
    ragged, even = point_estimates([np.repeat(a, 10), b]), point_estimates([a, b])
    for k in ("iqm", "optimality_gap", "mean", "median"):
        assert ragged[k] == pytest.approx(even[k], rel=1e-12, abs=1e-12), k
    assert even["iqm"] == pytest.approx(stats.trim_mean(np.concatenate([a, b]), 0.25), rel=1e-12)
    assert 0.4 < ragged["iqm"] < 0.6
    taus = [-0.5, 0.5, 1.5]
    assert performance_profile([np.repeat(a, 10), b], taus, reps=20)["point"] == pytest.approx(
        performance_profile([a, b], taus, reps=20)["point"], abs=1e-12)
    lo, hi = aggregate([np.repeat(a, 10), b], seed=1, reps=300)["iqm"]["ci"]
    assert lo < ragged["iqm"] < hi and hi - lo < 0.2
