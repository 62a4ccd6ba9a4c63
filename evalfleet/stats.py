"""Statistics of evaluation returns: summaries, confidence intervals, paired comparisons.

The public face of the statistics: :func:`summarize`, :func:`mean_ci`, :func:`iqm_ci`,
:func:`paired_comparison` and friends validate their input, sort it (so nothing depends on the
order in which episodes finished) and compute the point estimates. The interval methods live in
:mod:`evalfleet.intervals` (the reported ``"auto"`` interval of the mean is described there) and
the resampling in :mod:`evalfleet.bootstrap`; both are re-exported here.

Deterministic: every function that resamples takes a ``seed`` and builds its own
``np.random.default_rng(seed)``; nothing touches the global RNG. With one seed, :func:`mean_ci`,
:func:`iqm_ci` and :func:`summarize` see the same resamples and their intervals agree exactly.
A sample whose values are all equal (including a single episode) gets a degenerate bootstrap
interval ``[c, c]``; no NaN ever comes out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Final, Literal, cast

import numpy as np
from numpy.typing import ArrayLike, NDArray

from evalfleet.bootstrap import bootstrap_distribution
from evalfleet.intervals import (
    METHOD_BCA,
    METHOD_BCA_FALLBACK,
    METHOD_CONSTANT_BOUNDED,
    METHOD_CONSTANT_UNIT,
    METHOD_PERCENTILE,
    METHOD_SKEW_T_OR_T,
    METHOD_T,
    METHOD_TWO_VALUES,
    METHOD_WILSON,
    SAME_VALUE_RTOL,
    Interval,
    StatsInputError,
    auto_interval,
    bca_interval,
    check_int,
    check_level,
    distinct_values,
    has_spread,
    normal_quantile,
    percentile_interval,
    t_interval,
    wilson_interval,
)

__all__ = [
    "METHOD_BCA",
    "METHOD_BCA_FALLBACK",
    "METHOD_CONSTANT_BOUNDED",
    "METHOD_CONSTANT_UNIT",
    "METHOD_PERCENTILE",
    "METHOD_SKEW_T_OR_T",
    "METHOD_T",
    "METHOD_TWO_VALUES",
    "METHOD_WILSON",
    "MIN_PAIRS",
    "Interval",
    "PairedComparison",
    "ReturnStats",
    "StatsInputError",
    "has_spread",
    "iqm",
    "iqm_ci",
    "length_stats",
    "mean_ci",
    "needed_episodes",
    "paired_comparison",
    "summarize",
    "wilson_interval",
]

FloatArray = NDArray[np.float64]
MeanCIMethod = Literal["auto", "percentile", "bca", "t"]
Bounds = tuple[float, float]

#: Largest accepted magnitude of a value: squares and cubes of deviations stay far from overflow.
MAX_ABS_VALUE: Final = 1e100
_MIN_BOOT: Final = 100
_PERCENTILES: Final = (("p5", 5.0), ("p25", 25.0), ("p50", 50.0), ("p75", 75.0), ("p95", 95.0))
_MEAN_CI_METHODS: Final = ("auto", "percentile", "bca", "t")
#: Fewest episode pairs from which :func:`paired_comparison` gives a verdict. Below it the level
#: of the interval depends on the shape of the differences: in simulations of two identical
#: policies, 3-5 pairs gave 7-15% false verdicts at a nominal 5% (normal to skewed differences),
#: 10 pairs at most 6.8% on symmetric ones (normal, t with 3 df, 0/1 and 0..2 returns); and with 10
#: pairs a difference of one sign on every pair has probability 2**-9 when the policies are equal.
MIN_PAIRS: Final = 10


# --------------------------------------------------------------------------------------------
# Result types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReturnStats:
    """Summary of the returns of one evaluation."""

    n: int
    """Number of episodes."""
    mean: float
    """Sample mean."""
    var: float
    """Sample variance with ``ddof=1``; ``0.0`` when ``n == 1``."""
    std: float
    """Square root of ``var``."""
    stderr: float
    """Standard error of the mean, ``std / sqrt(n)``."""
    ci: Interval
    """Confidence interval of the mean."""
    iqm: float
    """Interquartile mean: the mean of the middle 50% (see :func:`iqm`)."""
    iqm_ci: Interval
    """Percentile-bootstrap confidence interval of the IQM."""
    median: float
    """Median (equal to ``percentiles["p50"]``)."""
    min: float
    """Smallest return."""
    max: float
    """Largest return."""
    percentiles: dict[str, float]
    """``"p5"``, ``"p25"``, ``"p50"``, ``"p75"``, ``"p95"`` (linear interpolation)."""

    def to_dict(self) -> dict[str, object]:
        """Return the fields as a JSON-ready dict; intervals become nested dicts."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PairedComparison:
    """A new policy against a baseline evaluated on the same seeds (common random numbers)."""

    n: int
    """Number of episode pairs."""
    mean_new: float
    """Mean return of the new policy."""
    mean_baseline: float
    """Mean return of the baseline policy."""
    mean_diff: float
    """Mean of the per-episode differences ``new - baseline``."""
    ci: Interval
    """Confidence interval of ``mean_diff`` over the episode pairs (see :func:`paired_comparison`)."""
    p_improvement: float
    """Fraction of episodes where new beats baseline; ties count half."""
    verdict: str
    """``"better"`` or ``"worse"`` when ``ci`` excludes 0, else ``"not distinguishable"``;
    ``"too few pairs"`` below :data:`MIN_PAIRS` pairs, whatever ``ci`` says."""
    unpaired_ci: Interval
    """Interval of ``mean_new - mean_baseline`` as if the two samples were independent
    (two-sample bootstrap); shows how much the pairing narrows ``ci``."""

    def to_dict(self) -> dict[str, object]:
        """Return the fields as a JSON-ready dict; intervals become nested dicts."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def summarize(
    values: ArrayLike,
    *,
    seed: int,
    level: float = 0.95,
    n_boot: int = 2000,
    method: str = "auto",
    bounds: Bounds | None = None,
) -> ReturnStats:
    """Summarize the returns of one evaluation.

    Args:
        values: One return per episode (1-D, finite).
        seed: Seed of the bootstrap generator.
        level: Confidence level of both intervals.
        n_boot: Number of bootstrap resamples (at least 100).
        method: Interval of the mean: ``"auto"`` (valid at small n and for proportions, see
            :mod:`evalfleet.intervals`), ``"percentile"`` or ``"bca"`` (bootstrap) or ``"t"``
            (Student t). The IQM interval is always a percentile bootstrap.
        bounds: Declared ``(low, high)`` range of a return, if known (e.g. ``(0, 1)`` for a
            success reward); only ``"auto"`` uses it, to bound a constant sample exactly and to
            clip the interval.

    Returns:
        The summary. ``ci`` equals ``mean_ci(values, seed=seed, ...)`` and ``iqm_ci`` equals
        ``iqm_ci(values, seed=seed, ...)`` exactly: they share one set of resamples.
    """
    x = _sorted_returns(values, "returns")
    check_level(level)
    n_boot = _check_n_boot(n_boot)
    seed = _check_seed(seed)
    mean_method = _check_mean_ci_method(method)
    checked_bounds = _check_bounds(bounds, x)

    n = int(x.size)
    mean = _mean_of_sorted(x)
    var, std = _spread_of_sorted(x, mean)
    iqm_value = _iqm_of_sorted(x)

    boot_means, boot_iqms = _bootstrap(x, seed, n_boot, with_iqm=True)
    ci = _mean_interval(x, mean, boot_means, level, mean_method, checked_bounds)
    iqm_interval = percentile_interval(boot_iqms, iqm_value, level, METHOD_PERCENTILE)

    percentiles = {
        key: float(v) for (key, _), v in zip(_PERCENTILES, _percentiles_of(x), strict=True)
    }
    return ReturnStats(
        n=n,
        mean=mean,
        var=var,
        std=std,
        stderr=std / math.sqrt(n),
        ci=ci,
        iqm=iqm_value,
        iqm_ci=iqm_interval,
        median=percentiles["p50"],
        min=float(x[0]),
        max=float(x[-1]),
        percentiles=percentiles,
    )


def mean_ci(
    values: ArrayLike,
    *,
    seed: int,
    level: float = 0.95,
    n_boot: int = 2000,
    method: str = "auto",
    bounds: Bounds | None = None,
) -> Interval:
    """Return a confidence interval of the mean of ``values``.

    Args:
        values: One return per episode (1-D, finite).
        seed: Seed of the bootstrap generator (unused by ``"auto"`` and ``"t"``).
        level: Confidence level in (0, 1).
        n_boot: Number of bootstrap resamples (at least 100).
        bounds: Declared ``(low, high)`` range of a return, used by ``"auto"`` only.
        method: ``"auto"`` (the reported interval: the hull of skewness-corrected and plain t,
            the hull of Clopper-Pearson and t for two-valued returns, an exact bound for a
            constant sample; see :mod:`evalfleet.intervals`), ``"percentile"`` (bootstrap
            percentile), ``"bca"`` (bias-corrected and accelerated bootstrap; falls back to
            percentile, and says so in ``method``, when the bootstrap distribution is
            degenerate) or ``"t"`` (Student t, no resampling).
    """
    x = _sorted_returns(values, "returns")
    check_level(level)
    n_boot = _check_n_boot(n_boot)
    seed = _check_seed(seed)
    mean_method = _check_mean_ci_method(method)
    checked_bounds = _check_bounds(bounds, x)

    mean = _mean_of_sorted(x)
    if mean_method in ("t", "auto"):
        # Analytic: no resamples drawn.
        return _mean_interval(x, mean, np.empty(0), level, mean_method, checked_bounds)
    boot_means, _ = _bootstrap(x, seed, n_boot, with_iqm=False)
    return _mean_interval(x, mean, boot_means, level, mean_method, checked_bounds)


def iqm(values: ArrayLike) -> float:
    """Return the interquartile mean: the mean of the middle 50% of the sorted values.

    Same definition as rliable, i.e. ``scipy.stats.trim_mean(values, 0.25)``: with ``n`` values,
    ``n // 4`` are cut from each end and the rest are averaged. So ``arange(1, 9)`` gives
    ``mean(3, 4, 5, 6) = 4.5``, and fewer than 4 values give the plain mean.
    """
    return _iqm_of_sorted(_sorted_returns(values, "returns"))


def iqm_ci(
    values: ArrayLike,
    *,
    seed: int,
    level: float = 0.95,
    n_boot: int = 2000,
) -> Interval:
    """Return a percentile-bootstrap confidence interval of the interquartile mean."""
    x = _sorted_returns(values, "returns")
    check_level(level)
    n_boot = _check_n_boot(n_boot)
    seed = _check_seed(seed)

    _, boot_iqms = _bootstrap(x, seed, n_boot, with_iqm=True)
    return percentile_interval(boot_iqms, _iqm_of_sorted(x), level, METHOD_PERCENTILE)


def paired_comparison(
    new: ArrayLike,
    baseline: ArrayLike,
    *,
    seed: int,
    level: float = 0.95,
    n_boot: int = 2000,
) -> PairedComparison:
    """Compare a new policy with a baseline evaluated on the same episode seeds.

    ``new[i]`` and ``baseline[i]`` must be the returns of episode ``i`` (same seed) under each
    policy. The interval of the differences keeps the correlation the shared seeds induce, so
    ``ci`` is usually much narrower than ``unpaired_ci``.

    When the differences take three or more values, ``ci`` is the headline's interval of the
    mean, ``mean_ci(new - baseline, method="auto")``: the hull of the skew-corrected and the
    Student t interval, so a verdict needs both to exclude 0. On -1/0/+1
    differences where most pairs tie, the sample skewness follows the sign of the mean
    difference and the skew correction pushes the interval away from 0: for two identical
    policies with 0/1 returns it alone gave 5.6-7.5% false verdicts at a nominal 5% (100 pairs,
    8% or 16% discordant; 500 pairs, 1-8%), the hull the t interval's 3.7-5.1%. (Identical
    policies give symmetric differences, where the skew correction only adds noise; it still
    guards the level of ``ci`` when a real difference is skewed.)

    With one or two values ``ci`` is the t interval: the exact branches of ``"auto"`` assumed the
    sample's values are the only possible ones, which a difference of two policies' returns never
    is (ties and wins seen, losses possible); on 0/1 returns with 4% discordant pairs out of 100
    they gave 23% false verdicts, the t interval 4%. (The percentile bootstrap used before gave
    23% false verdicts at 3 pairs of normal returns, 10% at 10.) Below :data:`MIN_PAIRS` pairs
    the verdict is ``"too few pairs"``.
    """
    new_arr = _finite_returns(new, "new")
    base_arr = _finite_returns(baseline, "baseline")
    if new_arr.size != base_arr.size:
        raise StatsInputError(
            f"new and baseline must hold one return per shared episode seed "
            f"(got {new_arr.size} and {base_arr.size} values); evaluate both policies on the "
            "same seeds"
        )
    check_level(level)
    n_boot = _check_n_boot(n_boot)
    seed = _check_seed(seed)

    raw = new_arr - base_arr
    # Differences within float rounding of the pair's returns are ties, as equal returns are
    # one value in the headline (``SAME_VALUE_RTOL``): two policies whose actions differ in
    # their last bits got "better" with a CI of [2.4e-16, 2.7e-16], and the gate exited 4. Per
    # pair: a tolerance from the whole sample's largest return made one pair at 1e13 turn 99
    # differences of ~1 into ties (mean difference 0, "not distinguishable").
    tol = SAME_VALUE_RTOL * np.maximum(np.abs(new_arr), np.abs(base_arr))
    rounded = np.where(np.abs(raw) <= tol, 0.0, raw)
    diffs = np.sort(rounded)
    sorted_new = np.sort(new_arr)
    sorted_base = np.sort(base_arr)

    mean_diff = _mean_of_sorted(diffs)
    mean_new = _mean_of_sorted(sorted_new)
    mean_base = _mean_of_sorted(sorted_base)

    ci = _paired_interval(diffs, mean_diff, level)
    # The unpaired interval resamples each sample independently (two-sample bootstrap).
    rng = np.random.default_rng(seed)
    boot_new, _ = bootstrap_distribution(sorted_new, rng, n_boot, with_iqm=False)
    boot_base, _ = bootstrap_distribution(sorted_base, rng, n_boot, with_iqm=False)
    unpaired_diff = mean_new - mean_base
    if _is_constant(sorted_new) and _is_constant(sorted_base):
        unpaired_ci = Interval(unpaired_diff, unpaired_diff, level, METHOD_PERCENTILE)
    else:
        unpaired_ci = percentile_interval(
            boot_new - boot_base, unpaired_diff, level, METHOD_PERCENTILE
        )

    wins = int(np.count_nonzero(rounded > 0.0))
    ties = int(np.count_nonzero(rounded == 0.0))
    if diffs.size < MIN_PAIRS:
        verdict = "too few pairs"
    elif ci.low > 0.0:
        verdict = "better"
    elif ci.high < 0.0:
        verdict = "worse"
    else:
        verdict = "not distinguishable"
    return PairedComparison(
        n=int(diffs.size),
        mean_new=mean_new,
        mean_baseline=mean_base,
        mean_diff=mean_diff,
        ci=ci,
        p_improvement=(wins + 0.5 * ties) / diffs.size,
        verdict=verdict,
        unpaired_ci=unpaired_ci,
    )


def length_stats(lengths: ArrayLike) -> dict[str, float]:
    """Return the ``mean``, ``std``, ``min``, ``max`` and ``median`` of episode lengths.

    ``std`` uses ``ddof=1`` and is 0 for a single episode, as in :class:`ReturnStats`.
    """
    x = _sorted_returns(lengths, "lengths")
    if x[0] < 0:
        raise StatsInputError(
            f"lengths must be non-negative step counts (got {float(x[0])!r}); "
            "pass the number of steps of each episode"
        )
    mean = _mean_of_sorted(x)
    return {
        "mean": mean,
        "std": _spread_of_sorted(x, mean)[1],
        "min": float(x[0]),
        "max": float(x[-1]),
        "median": float(np.median(x)),
    }


def needed_episodes(std: float, target_halfwidth: float, level: float = 0.95) -> int:
    """Estimate how many episodes make the CI half-width of the mean at most ``target_halfwidth``.

    Normal approximation: ``n = ceil((z * std / target_halfwidth) ** 2)`` with ``z`` the
    two-sided quantile of ``level``. Never less than 2, the fewest episodes from which a
    standard deviation can be estimated. Adaptive evaluation uses it to size the next round.
    """
    std = float(std)
    target_halfwidth = float(target_halfwidth)
    if not (math.isfinite(std) and std >= 0.0):
        raise StatsInputError(
            f"std must be a finite non-negative number (got {std!r}); "
            "pass the standard deviation of the returns seen so far"
        )
    if not (math.isfinite(target_halfwidth) and target_halfwidth > 0.0):
        raise StatsInputError(
            f"target_halfwidth must be a finite positive number (got {target_halfwidth!r}); "
            "pass the largest acceptable CI half-width, in return units"
        )
    check_level(level)
    z = normal_quantile(0.5 + level / 2.0)
    estimate = (z * std / target_halfwidth) ** 2
    if not math.isfinite(estimate):
        raise StatsInputError(
            f"std={std!r} with target_halfwidth={target_halfwidth!r} needs more episodes than can "
            "be counted; raise target_halfwidth"
        )
    # The tolerance keeps an estimate like 4.000000000000001 (pure rounding) at 4.
    return max(2, math.ceil(estimate * (1.0 - 1e-12)))


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _finite_returns(values: ArrayLike, name: str) -> FloatArray:
    """Convert to a 1-D float64 array, rejecting empty, non-finite and absurdly large values."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise StatsInputError(
            f"{name} must be a 1-D sequence of numbers (got {type(values).__name__}: {err}); "
            "pass a list or 1-D array of floats"
        ) from err
    if arr.ndim != 1:
        raise StatsInputError(
            f"{name} must be 1-D, one value per episode (got shape {arr.shape!r}); "
            "pass one evaluation at a time"
        )
    if arr.size == 0:
        raise StatsInputError(
            f"{name} must not be empty (got 0 values); run at least one episode before aggregating"
        )
    bad = ~np.isfinite(arr)
    if bad.any():
        i = int(np.argmax(bad))
        more = int(np.count_nonzero(bad)) - 1
        extra = f" and {more} more" if more else ""
        raise StatsInputError(
            f"{name} must be finite (got {float(arr[i])!r} at index {i}{extra}); "
            "record those episodes as failures (invalid_reward) and leave them out of the returns"
        )
    _check_magnitude(arr, name)
    return arr


def _check_magnitude(arr: FloatArray, name: str) -> None:
    big = np.abs(arr) > MAX_ABS_VALUE
    if big.any():
        i = int(np.argmax(big))
        raise StatsInputError(
            f"{name} must have magnitude at most {MAX_ABS_VALUE:g} (got {float(arr[i])!r} at index "
            f"{i}); rescale the rewards, such values overflow the variance"
        )


def _sorted_returns(values: ArrayLike, name: str) -> FloatArray:
    return np.sort(_finite_returns(values, name))


def _check_n_boot(n_boot: int) -> int:
    n_boot = check_int(n_boot, "n_boot")
    if n_boot < _MIN_BOOT:
        raise StatsInputError(
            f"n_boot must be at least {_MIN_BOOT} (got {n_boot!r}); the 2.5% tail of fewer "
            "resamples is a handful of points. Use 2000 for reports"
        )
    return n_boot


def _check_seed(seed: int) -> int:
    seed = check_int(seed, "seed")
    if seed < 0:
        raise StatsInputError(
            f"seed must be a non-negative integer (got {seed!r}); take it from the seed ledger"
        )
    return seed


def _check_mean_ci_method(method: str) -> MeanCIMethod:
    if method in _MEAN_CI_METHODS:
        return cast(MeanCIMethod, method)
    raise StatsInputError(
        f"Unknown method {method!r}. Choose 'auto', 'percentile', 'bca' or 't'."
    )


def _check_bounds(bounds: Bounds | None, x: FloatArray) -> Bounds | None:
    if bounds is None:
        return None
    try:
        low, high = (float(b) for b in bounds)
    except (TypeError, ValueError) as err:
        raise StatsInputError(
            f"bounds must be a pair (low, high) of numbers (got {bounds!r}); pass e.g. (0, 1)"
        ) from err
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise StatsInputError(
            f"bounds must be finite with low < high (got {bounds!r}); pass the smallest and "
            "largest return an episode can have, or None"
        )
    if x[0] < low or x[-1] > high:
        raise StatsInputError(
            f"returns lie outside the declared bounds {bounds!r} (got min {float(x[0])!r}, max "
            f"{float(x[-1])!r}); fix the declared range or the reward"
        )
    return low, high


# --------------------------------------------------------------------------------------------
# Point estimates (all on sorted arrays, so they do not depend on episode order)
# --------------------------------------------------------------------------------------------


def _clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _mean_of_sorted(x: FloatArray) -> float:
    # Rounding can put a mean a few ulps outside [min, max] (three 0.1s average to
    # 0.10000000000000002); clipping also makes the mean of a constant sample exact.
    return _clip(float(np.mean(x)), float(x[0]), float(x[-1]))


def _spread_of_sorted(x: FloatArray, mean: float) -> tuple[float, float]:
    """Return the sample variance (ddof=1) and standard deviation; both 0 for one value."""
    n = x.size
    scale = max(mean - float(x[0]), float(x[-1]) - mean)
    if n < 2 or scale == 0.0:
        return 0.0, 0.0
    # Deviations scaled to [-1, 1]: squares neither underflow for tiny spreads nor overflow.
    u = (x - mean) / scale
    # Corrected two-pass formula: the second term removes the rounding error left in `mean`.
    s = float(u.sum())
    v = max(0.0, (float(u @ u) - s * s / n) / (n - 1))
    return scale * scale * v, scale * math.sqrt(v)


def _iqm_of_sorted(x: FloatArray) -> float:
    cut = x.size // 4  # scipy.stats.trim_mean(x, 0.25): int(0.25 * n) from each end
    return _mean_of_sorted(x[cut : x.size - cut])


def _percentiles_of(x: FloatArray) -> list[float]:
    qs = np.percentile(x, [q for _, q in _PERCENTILES])
    return [float(v) for v in qs]


# --------------------------------------------------------------------------------------------
# Intervals of the mean
# --------------------------------------------------------------------------------------------


def _bootstrap(
    x: FloatArray, seed: int, n_boot: int, *, with_iqm: bool
) -> tuple[FloatArray, FloatArray]:
    return bootstrap_distribution(x, np.random.default_rng(seed), n_boot, with_iqm=with_iqm)


def _is_constant(x: FloatArray) -> bool:
    return bool(x[0] == x[-1])


def _paired_interval(diffs: FloatArray, mean: float, level: float) -> Interval:
    """Interval of the mean difference: ``"auto"`` on 3+ values, else t.

    ``"auto"`` is there the hull of the skew-corrected and the plain t interval; see
    :func:`paired_comparison` for why.
    """
    if distinct_values(diffs) < 3:
        return _mean_interval(diffs, mean, np.empty(0), level, "t")
    return _mean_interval(diffs, mean, np.empty(0), level, "auto")


def _mean_interval(
    x: FloatArray,
    mean: float,
    boot_means: FloatArray,
    level: float,
    method: MeanCIMethod,
    bounds: Bounds | None = None,
) -> Interval:
    if method == "t":
        return t_interval(x, mean, _spread_of_sorted(x, mean)[1], level)
    if method == "auto":
        return auto_interval(x, mean, _spread_of_sorted(x, mean)[1], level, bounds)
    if _is_constant(x):
        # Resampled means of a constant can differ from it by rounding; the answer is exact.
        name = METHOD_BCA if method == "bca" else METHOD_PERCENTILE
        return Interval(low=mean, high=mean, level=level, method=name)
    if method == "bca":
        return bca_interval(x, mean, boot_means, level)
    return percentile_interval(boot_means, mean, level, METHOD_PERCENTILE)
