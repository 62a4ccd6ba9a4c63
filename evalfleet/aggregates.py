"""Aggregate performance over many tasks, the way Agarwal et al. (NeurIPS 2021) define it.

"Deep Reinforcement Learning at the Edge of the Statistical Precipice" and its library rliable
report, over a score matrix of ``runs x tasks`` (here: episodes x suite tasks, usually normalised
scores):

* **mean**: the mean over tasks of each task's mean score;
* **median**: the median over tasks of each task's mean score;
* **IQM**: the interquartile mean of *all* runs x tasks scores pooled: 25% trimmed from each end,
  exactly ``scipy.stats.trim_mean(scores, 0.25, axis=None)``; robust to outliers, unlike the mean,
  and less noisy than the median;
* **optimality gap**: how far the scores fall short of a target ``gamma``, ``mean(max(gamma - s,
  0))``; a score above ``gamma`` counts as ``gamma`` (being better than the target earns nothing);
* **performance profile**: for each threshold ``tau``, the fraction of all runs x tasks scores
  strictly above ``tau`` (the run-score distribution);
* **probability of improvement** of X over Y: the average over tasks of ``P(X_m > Y_m)``, the
  Mann-Whitney U statistic over ``n_x * n_y`` with ties counted one half.

Every figure comes with a 95% percentile interval from a **stratified bootstrap**: each task's runs
are resampled with replacement within that task (tasks are the strata, their set is fixed), as
rliable's ``StratifiedBootstrap``; for the probability of improvement, X's and Y's runs are
resampled independently within each task (rliable's ``StratifiedIndependentBootstrap``).

Two things differ from rliable on purpose. The random numbers come from one
``numpy.random.Generator`` seeded with ``seed`` (rliable takes a seed, then draws from the global
RNG). And tasks may have different numbers of runs (a task's harness failures are left out, or the
suite gives tasks different episode budgets): pass a sequence of 1-D arrays, one per task, instead
of a matrix. The mean and median stay means of task means; the IQM, the optimality gap and the
profile pool all scores, which for equal run counts is exactly the matrix definition. With
ragged counts every task still weighs the same (each of its scores ``1 / (tasks x its runs)``):
pooled unweighted, a task with ten times the episodes of another would decide the IQM alone.

Scores produced anywhere aggregate the same way::

    >>> import numpy as np
    >>> from evalfleet.aggregates import aggregate
    >>> scores = np.array([[0.1, 0.9], [0.3, 1.1], [0.2, 1.0]])  # 3 runs x 2 tasks
    >>> result = aggregate(scores, seed=0, reps=200)
    >>> round(result["mean"]["point"], 6), round(result["optimality_gap"]["point"], 6)
    (0.6, 0.416667)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any, Final, TypedDict, cast

import numpy as np
from numpy.typing import ArrayLike, NDArray

from evalfleet.errors import SuiteError


def _scipy_stats() -> ModuleType:
    """``scipy.stats``, imported on first use (~0.6 s): most processes importing this never need it."""
    import importlib

    return importlib.import_module("scipy.stats")


__all__ = [
    "METRICS",
    "Estimate",
    "Profile",
    "aggregate",
    "normalise",
    "performance_profile",
    "point_estimates",
    "probability_of_improvement",
    "summary",
]

FloatArray = NDArray[np.float64]
Scores = ArrayLike | Sequence[NDArray[np.floating[Any]]]
"""A ``(runs x tasks)`` matrix (array or nested lists), or a list of 1-D numpy arrays, one per task."""

#: The aggregate metrics ``aggregate`` returns, in the paper's order.
METRICS: Final = ("mean", "median", "iqm", "optimality_gap")
#: Coverage of every interval: 95%, percentile method.
CONFIDENCE: Final = 0.95
#: Resampled values held at once (bounds memory whatever the reps, runs and tasks).
_CHUNK_VALUES: Final = 4_000_000


class Estimate(TypedDict):
    """A point estimate and its 95% stratified-bootstrap percentile interval ``[low, high]``."""

    point: float
    ci: list[float]


class Profile(TypedDict):
    """A performance profile: fraction of scores above each ``tau``, with a 95% band."""

    taus: list[float]
    point: list[float]
    low: list[float]
    high: list[float]


def _tasks(scores: Scores, name: str = "scores") -> list[FloatArray]:
    """Validate ``scores`` into one float64 1-D array of run scores per task."""
    ragged = (isinstance(scores, Sequence) and not isinstance(scores, str) and len(scores) > 0
              and all(isinstance(column, np.ndarray) for column in scores))
    if not ragged:
        try:
            matrix = np.asarray(scores, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise SuiteError(
                f"'{name}' must be a (runs x tasks) matrix of numbers, or a list of 1-D numpy "
                f"arrays (one per task) when run counts differ (got {type(scores).__name__}: {err})."
            ) from err
        if matrix.ndim != 2:
            raise SuiteError(
                f"'{name}' must be a (runs x tasks) matrix, 2-D (got shape {matrix.shape!r}); "
                "one task's scores are a column: pass scores[:, None] for a single task."
            )
        columns = [matrix[:, m] for m in range(matrix.shape[1])]
    else:
        columns = []
        for m, column in enumerate(cast(Sequence[FloatArray], scores)):
            arr = np.asarray(column, dtype=np.float64)
            if arr.ndim != 1:
                raise SuiteError(
                    f"'{name}[{m}]' must be a 1-D array of one task's run scores "
                    f"(got shape {arr.shape!r})."
                )
            columns.append(arr)
    if not columns:
        raise SuiteError(f"'{name}' has no tasks (shape 0 along tasks); pass at least one task.")
    for m, arr in enumerate(columns):
        if arr.size == 0:
            raise SuiteError(f"'{name}': task {m} has no runs; every task needs at least one score.")
        if not np.all(np.isfinite(arr)):
            raise SuiteError(
                f"'{name}': task {m} has non-finite scores ({arr[~np.isfinite(arr)][:3].tolist()!r}); "
                "drop or fix them before aggregating."
            )
    return columns


def _check_reps(reps: int) -> None:
    if not isinstance(reps, int | np.integer) or reps < 1:
        raise SuiteError(f"'reps' must be a positive integer (got {reps!r}).")


def _interval(draws: FloatArray) -> list[float]:
    """The 95% percentile interval of bootstrap draws (along axis 0)."""
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(draws, [tail, 100 - tail], axis=0)
    return [float(low), float(high)]


def _stratified(tasks: list[FloatArray], rng: np.random.Generator, reps: int
                ) -> Iterator[list[FloatArray]]:
    """Yield batches of stratified resamples: a list (per task) of ``(batch, n_m)`` arrays."""
    per_rep = sum(t.size for t in tasks)
    batch = max(1, _CHUNK_VALUES // per_rep)
    done = 0
    while done < reps:
        k = min(batch, reps - done)
        yield [t[rng.integers(0, t.size, size=(k, t.size))] for t in tasks]
        done += k


def _task_weights(sizes: Sequence[int]) -> FloatArray | None:
    """Each pooled score's weight, every task weighing ``1 / tasks``; None when run counts are equal.

    With equal counts the pooled scores already weigh each task equally (the matrix definition);
    with ragged ones, pooling unweighted would let the task with the most episodes decide the IQM,
    the optimality gap and the profile.
    """
    if len(set(sizes)) <= 1:
        return None
    return np.concatenate([np.full(n, 1.0 / (len(sizes) * n)) for n in sizes])


def _weighted_iqm(pooled: FloatArray, weights: FloatArray) -> FloatArray:
    """The interquartile mean of each row of ``pooled``: the middle half of the weight, averaged.

    Scores sorted per row carry their weights; the weight below 25% and above 75% is trimmed, a
    score straddling a boundary counting with the part of its weight inside.
    """
    order = np.argsort(pooled, axis=1, kind="stable")
    values = np.take_along_axis(pooled, order, axis=1)
    w = weights[order]
    upper = np.cumsum(w, axis=1)
    inside = np.clip(np.minimum(upper, 0.75) - np.maximum(upper - w, 0.25), 0.0, None)
    return np.asarray((values * inside).sum(axis=1) / inside.sum(axis=1), dtype=np.float64)


def _metrics(resampled: list[FloatArray], gamma: float) -> dict[str, FloatArray]:
    """The four aggregates of each row of a batch of resamples (rows = bootstrap replicates)."""
    task_means = np.stack([r.mean(axis=1) for r in resampled], axis=1)
    pooled = np.concatenate(resampled, axis=1)
    weights = _task_weights([r.shape[1] for r in resampled])
    if weights is None:
        iqm = np.asarray(_scipy_stats().trim_mean(pooled, 0.25, axis=1), dtype=np.float64)
        gap = gamma - np.minimum(pooled, gamma).mean(axis=1)
    else:
        iqm = _weighted_iqm(pooled, weights)
        gap = gamma - np.minimum(pooled, gamma) @ weights
    return {"mean": task_means.mean(axis=1), "median": np.median(task_means, axis=1),
            "iqm": iqm, "optimality_gap": gap}


def point_estimates(scores: Scores, *, gamma: float = 1.0) -> dict[str, float]:
    """The four aggregates of ``scores`` without intervals (see the module docstring)."""
    tasks = _tasks(scores)
    return {k: float(v[0]) for k, v in _metrics([t[None, :] for t in tasks], gamma).items()}


def aggregate(scores: Scores, *, seed: int = 0, reps: int = 2000, gamma: float = 1.0
              ) -> dict[str, Estimate]:
    """Mean, median, IQM and optimality gap of ``scores`` with 95% stratified-bootstrap CIs.

    Args:
        scores: a ``(runs x tasks)`` matrix (``scores[n, m]``: run ``n`` of task ``m``), or one
            1-D array of run scores per task when tasks have different run counts.
        seed: seed of the bootstrap's ``numpy.random.Generator``; one seed, one result.
        reps: bootstrap replicates.
        gamma: the optimality gap's target (1.0 for human- or reference-normalised scores).

    Returns:
        ``{"mean" | "median" | "iqm" | "optimality_gap": {"point": x, "ci": [low, high]}}``.

    Raises:
        SuiteError: ``scores`` is not 2-D (or a sequence of 1-D arrays), has no runs or tasks,
            or holds NaN/inf; ``reps`` is not positive.
    """
    tasks = _tasks(scores)
    _check_reps(reps)
    points = point_estimates(tasks, gamma=gamma)
    rng = np.random.default_rng(seed)
    draws: dict[str, list[FloatArray]] = {k: [] for k in METRICS}
    for resampled in _stratified(tasks, rng, reps):
        for k, v in _metrics(resampled, gamma).items():
            draws[k].append(v)
    return {k: Estimate(point=points[k], ci=_interval(np.concatenate(draws[k]))) for k in METRICS}


def _improvement(x: FloatArray, y: FloatArray) -> FloatArray:
    """P(X > Y) + P(X = Y) / 2 of each row pair of ``x`` (k, n_x) and ``y`` (k, n_y).

    The Mann-Whitney U statistic of x over ``n_x * n_y``, through average ranks (ties count 1/2).
    """
    nx, ny = x.shape[1], y.shape[1]
    ranks = _scipy_stats().rankdata(np.concatenate([x, y], axis=1), method="average", axis=1)
    u = ranks[:, :nx].sum(axis=1) - nx * (nx + 1) / 2
    return np.asarray(u / (nx * ny), dtype=np.float64)


def probability_of_improvement(x_scores: Scores, y_scores: Scores, *, seed: int = 0, reps: int = 2000
                               ) -> Estimate:
    """P(X > Y) averaged over tasks, with its 95% stratified-bootstrap interval.

    For each task ``m``, ``P(X_m > Y_m)`` is the probability that a run of X scores above a run
    of Y on that task, ties counted one half (the Mann-Whitney U statistic over ``n_x * n_y``);
    identical scores give exactly 0.5. X's and Y's runs are resampled independently within each
    task. Both must have the same tasks in the same order; run counts may differ.

    Raises:
        SuiteError: the two have different task counts, or either is invalid (see ``aggregate``).
    """
    xs, ys = _tasks(x_scores, "x_scores"), _tasks(y_scores, "y_scores")
    if len(xs) != len(ys):
        raise SuiteError(
            f"'x_scores' has {len(xs)} tasks and 'y_scores' {len(ys)}: the probability of "
            "improvement compares the two on the same tasks, in the same order."
        )
    _check_reps(reps)
    point = float(np.mean([_improvement(x[None, :], y[None, :])[0] for x, y in zip(xs, ys, strict=True)]))
    rng = np.random.default_rng(seed)
    per_rep = sum(x.size + y.size for x, y in zip(xs, ys, strict=True))
    batch = max(1, _CHUNK_VALUES // per_rep)
    draws: list[FloatArray] = []
    done = 0
    while done < reps:
        k = min(batch, reps - done)
        per_task = [
            _improvement(x[rng.integers(0, x.size, size=(k, x.size))],
                         y[rng.integers(0, y.size, size=(k, y.size))])
            for x, y in zip(xs, ys, strict=True)
        ]
        draws.append(np.mean(per_task, axis=0))
        done += k
    return Estimate(point=point, ci=_interval(np.concatenate(draws)))


def performance_profile(scores: Scores, taus: ArrayLike, *, seed: int = 0, reps: int = 2000
                        ) -> Profile:
    """Fraction of all runs x tasks scores strictly above each ``tau``, with 95% bands.

    The run-score distribution of the paper (rliable's ``use_score_distribution=True``); the band
    at each ``tau`` is the stratified bootstrap's percentile interval.
    """
    tasks = _tasks(scores)
    _check_reps(reps)
    grid = np.asarray(taus, dtype=np.float64).reshape(-1)
    if grid.size == 0 or not np.all(np.isfinite(grid)):
        raise SuiteError(f"'taus' must be a non-empty list of finite thresholds (got {grid.tolist()!r}).")
    pooled = np.concatenate(tasks)
    weights = _task_weights([t.size for t in tasks])
    rng = np.random.default_rng(seed)
    draws: list[FloatArray] = []
    if weights is None:
        point = (pooled[:, None] > grid[None, :]).mean(axis=0)
        for resampled in _stratified(tasks, rng, reps):
            sample = np.sort(np.concatenate(resampled, axis=1), axis=1)
            # Scores > tau = n - (scores <= tau), counted on each sorted row.
            n = sample.shape[1]
            above = np.stack([n - _count_at_most(row, grid) for row in sample])
            draws.append(above / n)
    else:  # each task's scores weigh 1 / tasks in all (``_task_weights``)
        point = weights @ (pooled[:, None] > grid[None, :])
        for resampled in _stratified(tasks, rng, reps):
            sample = np.concatenate(resampled, axis=1)
            draws.append(np.stack([weights @ (row[:, None] > grid[None, :]) for row in sample]))
    band = np.concatenate(draws)
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(band, [tail, 100 - tail], axis=0)
    return Profile(taus=grid.tolist(), point=point.tolist(), low=low.tolist(), high=high.tolist())


def _count_at_most(sorted_row: FloatArray, grid: FloatArray) -> NDArray[np.intp]:
    return np.searchsorted(sorted_row, grid, side="right")


def normalise(scores: ArrayLike, low: float, high: float) -> FloatArray:
    """``(scores - low) / (high - low)``: 0 at ``low`` (e.g. a random policy), 1 at ``high``.

    With ``low`` the random policy's score and ``high`` a reference (human, heuristic, the best
    known) this is the paper's human-normalised score; with a min and max, a min-max scaling.
    """
    if not high != low:
        raise SuiteError(
            f"normalisation needs two different scores (got low={low!r}, high={high!r}); "
            "set the reference (or max) to a score the random (or min) policy does not reach."
        )
    return (np.asarray(scores, dtype=np.float64) - low) / (high - low)


def summary(scores: Scores, *, seed: int = 0, reps: int = 2000, gamma: float = 1.0,
            taus: ArrayLike | None = None) -> dict[str, Any]:
    """``aggregate`` plus a performance profile on ``taus`` (default: 41 points over the scores)."""
    tasks = _tasks(scores)
    pooled = np.concatenate(tasks)
    if taus is None:
        low, high = min(0.0, float(pooled.min())), max(gamma, float(pooled.max()))
        taus = np.linspace(low, high, 41)
    return {"aggregates": aggregate(tasks, seed=seed, reps=reps, gamma=gamma),
            "profile": performance_profile(tasks, taus, seed=seed, reps=reps)}
