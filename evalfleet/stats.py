"""Statistics of evaluation returns: summaries, confidence intervals, paired comparisons.

Everything here is plain numpy (no scipy) and deterministic: every function that resamples takes a
``seed`` and builds its own ``np.random.default_rng(seed)``; nothing touches the global RNG.

The reported interval of the mean (``method="auto"``, the default) must hold its level at the
small counts of a first adaptive round (16-32 episodes) and for 0/1-type returns, where bootstrap
percentile intervals cover only 91-93% and a sample with no success gives ``[0, 0]``:

* three or more distinct values: Student t with Hall's (1992) skewness correction, the skewness
  bias-adjusted (``G1``); analytic, so it needs no resamples and no seed;
* two distinct values ``a < b``: the Clopper-Pearson interval of the share at ``b``, mapped onto
  ``[a, b]`` (the returns are a scaled binomial);
* one value ``c`` (a constant sample): never zero width while ``n`` is finite. With declared
  ``bounds`` the exact bound for any distribution on them: if the mean were further than
  ``u = 1 - (alpha/2)**(1/n)`` of the range from ``c``, ``n`` equal returns would have had
  probability below ``alpha/2``. Without bounds nothing in the sample gives a scale, so the same
  ``u`` is taken in units of ``max(1, |c|)``, and the method name says so.

Bootstrap conventions, shared by every resampling function:

* The values are sorted before resampling, so the result depends on the multiset of returns and
  the seed, never on the order in which episodes finished.
* Resamples are drawn in chunks of at most ``_MAX_INDICES_PER_CHUNK`` indices, which bounds memory
  whatever the number of episodes. The same seed therefore gives the same indices to
  :func:`mean_ci`, :func:`iqm_ci` and :func:`summarize`, and their intervals agree exactly.
* Every interval contains its point estimate (see :func:`_containing`).
* A sample whose values are all equal (including a single episode) has the degenerate interval
  ``[c, c]``; no NaN ever comes out.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal, cast

import numpy as np
from numpy.typing import ArrayLike, NDArray

from evalfleet.errors import EvalfleetError

__all__ = [
    "Interval",
    "PairedComparison",
    "ReturnStats",
    "StatsInputError",
    "iqm",
    "iqm_ci",
    "length_stats",
    "mean_ci",
    "needed_episodes",
    "paired_comparison",
    "summarize",
    "wilson_interval",
]

logger = logging.getLogger(__name__)

FloatArray = NDArray[np.float64]
MeanCIMethod = Literal["auto", "percentile", "bca", "t"]

#: Upper bound on resample indices drawn at once (int32: 16 MB, plus 32 MB of gathered floats).
_MAX_INDICES_PER_CHUNK: Final = 4_000_000
#: Largest accepted magnitude of a value: squares and cubes of deviations stay far from overflow.
_MAX_ABS: Final = 1e100
_MIN_BOOT: Final = 100
_PERCENTILES: Final = (("p5", 5.0), ("p25", 25.0), ("p50", 50.0), ("p75", 75.0), ("p95", 95.0))
_MEAN_CI_METHODS: Final = ("auto", "percentile", "bca", "t")

METHOD_PERCENTILE: Final = "bootstrap-percentile"
METHOD_BCA: Final = "bootstrap-bca"
#: BCa was asked for but its corrections were undefined; the percentile interval was returned.
METHOD_BCA_FALLBACK: Final = "bootstrap-percentile (bca degenerate)"
METHOD_WILSON: Final = "wilson"
METHOD_T: Final = "t"
#: ``method="auto"`` on three or more distinct values.
METHOD_SKEW_T: Final = "skew-corrected t (Hall)"
#: ``method="auto"`` on exactly two distinct values.
METHOD_TWO_VALUES: Final = "clopper-pearson (two values)"
#: ``method="auto"`` on a constant sample with declared bounds.
METHOD_CONSTANT_BOUNDED: Final = "exact bound (constant sample, declared bounds)"
#: ``method="auto"`` on a constant sample without bounds: the scale is an assumption.
METHOD_CONSTANT_UNIT: Final = "exact bound at scale max(1, |value|) (constant sample, no bounds)"
Bounds = tuple[float, float]


class StatsInputError(EvalfleetError, ValueError):
    """Values, level, seed or resample count given to a statistics function are unusable."""


# --------------------------------------------------------------------------------------------
# Result types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """A two-sided confidence interval."""

    low: float
    """Lower bound."""
    high: float
    """Upper bound (``high >= low``)."""
    level: float
    """Confidence level, e.g. ``0.95``."""
    method: str
    """How it was computed: one of the ``METHOD_*`` names of this module, e.g.
    ``"skew-corrected t (Hall)"``, ``"bootstrap-percentile"``, ``"wilson"``, ``"t"``, or
    ``"bootstrap-percentile (bca degenerate)"`` when BCa fell back."""

    def __post_init__(self) -> None:
        """Reject bounds that are not finite or out of order."""
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low <= self.high):
            raise StatsInputError(
                f"Interval bounds must be finite with low <= high "
                f"(got low={self.low!r}, high={self.high!r}); check the values it was built from"
            )
        _check_level(self.level)

    @property
    def halfwidth(self) -> float:
        """Half the width, ``(high - low) / 2``: the "±" of the interval."""
        return (self.high - self.low) / 2.0

    def to_dict(self) -> dict[str, object]:
        """Return the fields as a JSON-ready dict."""
        return dataclasses.asdict(self)


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
    """Confidence interval of ``mean_diff``, from a paired bootstrap over episodes."""
    p_improvement: float
    """Fraction of episodes where new beats baseline; ties count half."""
    verdict: str
    """``"better"`` or ``"worse"`` when ``ci`` excludes 0, else ``"not distinguishable"``."""
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
            the module docstring), ``"percentile"`` or ``"bca"`` (bootstrap) or ``"t"``
            (Student t). The IQM interval is always a percentile bootstrap.
        bounds: Declared ``(low, high)`` range of a return, if known (e.g. ``(0, 1)`` for a
            success reward); only ``"auto"`` uses it, to bound a constant sample exactly and to
            clip the interval.

    Returns:
        The summary. ``ci`` equals ``mean_ci(values, seed=seed, ...)`` and ``iqm_ci`` equals
        ``iqm_ci(values, seed=seed, ...)`` exactly: they share one set of resamples.
    """
    x = _sorted_returns(values, "returns")
    _check_level(level)
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
    iqm_interval = _percentile_interval(boot_iqms, iqm_value, level, METHOD_PERCENTILE)

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
        method: ``"auto"`` (the reported interval: skewness-corrected t, Clopper-Pearson for
            two-valued returns, an exact bound for a constant sample; see the module
            docstring), ``"percentile"`` (bootstrap percentile), ``"bca"`` (bias-corrected and
            accelerated bootstrap; falls back to percentile, and says so in ``method``, when the
            bootstrap distribution is degenerate) or ``"t"`` (Student t, no resampling).
    """
    x = _sorted_returns(values, "returns")
    _check_level(level)
    n_boot = _check_n_boot(n_boot)
    seed = _check_seed(seed)
    mean_method = _check_mean_ci_method(method)
    checked_bounds = _check_bounds(bounds, x)

    mean = _mean_of_sorted(x)
    if mean_method == "t":
        return _t_interval(x, mean, level)
    if mean_method == "auto":
        return _auto_interval(x, mean, level, checked_bounds)
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
    _check_level(level)
    n_boot = _check_n_boot(n_boot)
    seed = _check_seed(seed)

    _, boot_iqms = _bootstrap(x, seed, n_boot, with_iqm=True)
    return _percentile_interval(boot_iqms, _iqm_of_sorted(x), level, METHOD_PERCENTILE)


def wilson_interval(successes: int, n: int, level: float = 0.95) -> Interval:
    """Return the Wilson score interval of a success rate ``successes / n``.

    Unlike the normal ("Wald") interval it stays inside [0, 1] and is not degenerate at 0 or n
    successes, which matters for the small counts of success-rate metrics.
    """
    n = _check_int(n, "n")
    successes = _check_int(successes, "successes")
    if n < 1:
        raise StatsInputError(
            f"n must be at least 1 (got {n!r}); a success rate needs at least one episode"
        )
    if not 0 <= successes <= n:
        raise StatsInputError(
            f"successes must be between 0 and n={n} (got {successes!r}); "
            "count each episode at most once"
        )
    _check_level(level)

    z = _norm_ppf(0.5 + level / 2.0)
    p = successes / n
    z2_n = z * z / n
    center = (p + z2_n / 2.0) / (1.0 + z2_n)
    half = z / (1.0 + z2_n) * math.sqrt(p * (1.0 - p) / n + z2_n / (4.0 * n))
    # At 0 or n successes one bound equals p exactly in theory; pin it so rounding cannot
    # push p outside the interval.
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return _containing(low, high, p, level, METHOD_WILSON)


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
    policy. Resampling whole episodes keeps the correlation the shared seeds induce, so ``ci`` is
    usually much narrower than ``unpaired_ci``. ``ci`` equals
    ``mean_ci(new - baseline, seed=seed, ...)`` exactly.
    """
    new_arr = _finite_returns(new, "new")
    base_arr = _finite_returns(baseline, "baseline")
    if new_arr.size != base_arr.size:
        raise StatsInputError(
            f"new and baseline must hold one return per shared episode seed "
            f"(got {new_arr.size} and {base_arr.size} values); evaluate both policies on the "
            "same seeds"
        )
    _check_level(level)
    n_boot = _check_n_boot(n_boot)
    seed = _check_seed(seed)

    diffs = np.sort(new_arr - base_arr)
    sorted_new = np.sort(new_arr)
    sorted_base = np.sort(base_arr)

    mean_diff = _mean_of_sorted(diffs)
    mean_new = _mean_of_sorted(sorted_new)
    mean_base = _mean_of_sorted(sorted_base)

    # One generator: the paired resamples first (so `ci` matches mean_ci on the differences),
    # then independent resamples of each sample for the unpaired interval.
    rng = np.random.default_rng(seed)
    boot_diff, _ = _bootstrap_rng(diffs, rng, n_boot, with_iqm=False)
    ci = _mean_interval(diffs, mean_diff, boot_diff, level, "percentile")
    boot_new, _ = _bootstrap_rng(sorted_new, rng, n_boot, with_iqm=False)
    boot_base, _ = _bootstrap_rng(sorted_base, rng, n_boot, with_iqm=False)
    unpaired_diff = mean_new - mean_base
    if _is_constant(sorted_new) and _is_constant(sorted_base):
        unpaired_ci = Interval(unpaired_diff, unpaired_diff, level, METHOD_PERCENTILE)
    else:
        unpaired_ci = _percentile_interval(
            boot_new - boot_base, unpaired_diff, level, METHOD_PERCENTILE
        )

    wins = int(np.count_nonzero(new_arr > base_arr))
    ties = int(np.count_nonzero(new_arr == base_arr))
    if ci.low > 0.0:
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
    _check_level(level)
    z = _norm_ppf(0.5 + level / 2.0)
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
    big = np.abs(arr) > _MAX_ABS
    if big.any():
        i = int(np.argmax(big))
        raise StatsInputError(
            f"{name} must have magnitude at most {_MAX_ABS:g} (got {float(arr[i])!r} at index "
            f"{i}); rescale the rewards, such values overflow the variance"
        )


def _sorted_returns(values: ArrayLike, name: str) -> FloatArray:
    return np.sort(_finite_returns(values, name))


def _check_level(level: float) -> None:
    if isinstance(level, bool) or not (isinstance(level, numbers.Real) and 0.0 < level < 1.0):
        raise StatsInputError(
            f"level must be a number strictly between 0 and 1 (got {level!r}); "
            "use e.g. 0.95 for a 95% interval"
        )


def _check_int(value: object, name: str) -> int:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError as err:
        raise StatsInputError(
            f"{name} must be an integer (got {value!r}); pass a whole number"
        ) from err


def _check_n_boot(n_boot: int) -> int:
    n_boot = _check_int(n_boot, "n_boot")
    if n_boot < _MIN_BOOT:
        raise StatsInputError(
            f"n_boot must be at least {_MIN_BOOT} (got {n_boot!r}); the 2.5% tail of fewer "
            "resamples is a handful of points. Use 2000 for reports"
        )
    return n_boot


def _check_seed(seed: int) -> int:
    seed = _check_int(seed, "seed")
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
# Bootstrap
# --------------------------------------------------------------------------------------------


def _bootstrap(
    x: FloatArray, seed: int, n_boot: int, *, with_iqm: bool
) -> tuple[FloatArray, FloatArray]:
    return _bootstrap_rng(x, np.random.default_rng(seed), n_boot, with_iqm=with_iqm)


def _resample_chunks(rng: np.random.Generator, n: int, n_boot: int) -> Iterator[NDArray[np.int_]]:
    """Yield index matrices of shape (rows, n), ``n_boot`` rows in all."""
    rows_per_chunk = max(1, _MAX_INDICES_PER_CHUNK // n)
    # int32 indices draw and sort about twice as fast as int64.
    dtype = np.int32 if n < 2**31 else np.int64
    for start in range(0, n_boot, rows_per_chunk):
        rows = min(rows_per_chunk, n_boot - start)
        yield rng.integers(0, n, size=(rows, n), dtype=dtype)


def _bootstrap_rng(
    x: FloatArray, rng: np.random.Generator, n_boot: int, *, with_iqm: bool
) -> tuple[FloatArray, FloatArray]:
    """Return the bootstrap means and, if ``with_iqm``, IQMs (else the means again) of sorted x.

    The means are taken over the unsorted gather so that they are bit-identical whether or not
    the IQMs are wanted; the IQMs need sorted resamples, and because ``x`` is sorted, sorting
    the indices sorts the resampled values (cheaper than sorting floats).
    """
    n = x.size
    cut = n // 4
    means = np.empty(n_boot, dtype=np.float64)
    iqms = np.empty(n_boot, dtype=np.float64) if with_iqm else means
    row = 0
    for idx in _resample_chunks(rng, n, n_boot):
        rows = idx.shape[0]
        means[row : row + rows] = x[idx].mean(axis=1)
        if with_iqm:
            if cut:
                idx.sort(axis=1)
                iqms[row : row + rows] = x[idx[:, cut : n - cut]].mean(axis=1)
            else:
                iqms[row : row + rows] = means[row : row + rows]
        row += rows
    return means, iqms


def _is_constant(x: FloatArray) -> bool:
    return bool(x[0] == x[-1])


def _containing(low: float, high: float, estimate: float, level: float, method: str) -> Interval:
    """Build an interval widened, if needed, to contain its point estimate.

    Percentile bounds come from the bootstrap distribution, not from the estimate; with few or
    very skewed values the estimate can sit just outside them (e.g. a sample mean in a
    2.5% tail when most resamples miss one large outlier). Reports and adaptive stopping assume
    ``low <= estimate <= high``, so the nearer bound is moved onto the estimate.
    """
    return Interval(
        low=min(float(low), estimate), high=max(float(high), estimate), level=level, method=method
    )


def _percentile_interval(boot: FloatArray, estimate: float, level: float, method: str) -> Interval:
    alpha = 1.0 - level
    low, high = np.quantile(boot, [alpha / 2.0, 1.0 - alpha / 2.0])
    return _containing(float(low), float(high), estimate, level, method)


def _mean_interval(
    x: FloatArray,
    mean: float,
    boot_means: FloatArray,
    level: float,
    method: MeanCIMethod,
    bounds: Bounds | None = None,
) -> Interval:
    if method == "t":
        return _t_interval(x, mean, level)
    if method == "auto":
        return _auto_interval(x, mean, level, bounds)
    if _is_constant(x):
        # Resampled means of a constant can differ from it by rounding; the answer is exact.
        name = METHOD_BCA if method == "bca" else METHOD_PERCENTILE
        return Interval(low=mean, high=mean, level=level, method=name)
    if method == "bca":
        return _bca_interval(x, mean, boot_means, level)
    return _percentile_interval(boot_means, mean, level, METHOD_PERCENTILE)


def _bca_interval(x: FloatArray, mean: float, boot_means: FloatArray, level: float) -> Interval:
    """Bias-corrected and accelerated bootstrap interval of the mean (Efron 1987).

    Bias correction ``z0 = Φ⁻¹(share of bootstrap means below the estimate)``, counting ties as
    half (discrete returns tie often). Acceleration from the jackknife, in closed form for the
    mean: the leave-one-out means are ``(n·m − x_i)/(n − 1)``, so
    ``a = Σd³ / (6 (Σd²)^{3/2})`` with ``d = x − m``: O(n), no n² jackknife.
    """
    below = np.count_nonzero(boot_means < mean) + 0.5 * np.count_nonzero(boot_means == mean)
    share = float(below) / boot_means.size
    reason = ""
    if not 0.0 < share < 1.0:
        reason = f"every bootstrap mean lies on one side of the estimate (share {share})"
    else:
        z0 = _norm_ppf(share)
        d = x - mean
        d = d / float(np.max(np.abs(d)))  # scale-free; keeps the cubes far from overflow
        ss = float(d @ d)
        accel = float(d @ (d * d)) / (6.0 * ss**1.5)
        alpha = 1.0 - level
        quantiles = []
        for z in (_norm_ppf(alpha / 2.0), _norm_ppf(1.0 - alpha / 2.0)):
            denom = 1.0 - accel * (z0 + z)
            if denom <= 0.0:
                reason = f"acceleration {accel:.3g} is too large for level {level}"
                break
            quantiles.append(_norm_cdf(z0 + (z0 + z) / denom))
        if not reason:
            low, high = np.quantile(boot_means, quantiles)
            return _containing(float(low), float(high), mean, level, METHOD_BCA)
    logger.debug("BCa interval degenerate (%s); using the percentile interval", reason)
    return _percentile_interval(boot_means, mean, level, METHOD_BCA_FALLBACK)


def _auto_interval(x: FloatArray, mean: float, level: float, bounds: Bounds | None) -> Interval:
    """The reported interval of the mean: see the module docstring for the three cases."""
    n = x.size
    alpha = 1.0 - level
    distinct = 1 + int(np.count_nonzero(x[1:] != x[:-1]))
    if distinct == 1:
        c = float(x[0])
        # Exact for any distribution: P(n returns all equal c) <= alpha/2 beyond this share.
        share = -math.expm1(math.log(alpha / 2.0) / n)
        if bounds is None:
            scale = max(1.0, abs(c)) * share
            return Interval(c - scale, c + scale, level, METHOD_CONSTANT_UNIT)
        low, high = bounds
        return Interval(
            c - (c - low) * share, c + (high - c) * share, level, METHOD_CONSTANT_BOUNDED
        )
    if distinct == 2:
        a, b = float(x[0]), float(x[-1])
        k = int(n - np.searchsorted(x, b))
        p_low, p_high = _clopper_pearson(k, n, level)
        # Same formula for the mean itself, so an estimate at a or b maps exactly.
        return _containing(a + (b - a) * p_low, a + (b - a) * p_high, mean, level, METHOD_TWO_VALUES)
    low, high = _skew_t_bounds(x, mean, level)
    if bounds is not None:
        low, high = max(low, bounds[0]), min(high, bounds[1])
    return _containing(low, high, mean, level, METHOD_SKEW_T)


def _skew_t_bounds(x: FloatArray, mean: float, level: float) -> tuple[float, float]:
    """Student t with Hall's (1992) cubic transformation removing the skewness term.

    ``T = sqrt(n)(mean - mu)/s`` has an Edgeworth skewness term of order ``gamma/sqrt(n)``;
    ``g(T) = T + a T^2 + a^2 T^3 / 3 + b`` with ``a = gamma/(3 sqrt n)``, ``b = gamma/(6 sqrt n)``
    removes it and is monotone (``g' = (1 + aT)^2``), so ``-q <= g(T) <= q`` inverts in closed
    form. The sample skewness is bias-adjusted (``G1``): at n = 16 the raw one is too small and
    the interval covered 94.0% of 50 + Exponential(40) samples instead of 94.5%.
    """
    n = x.size
    _, std = _spread_of_sorted(x, mean)
    d = x - mean
    d = d / float(np.max(np.abs(d)))  # scale-free; the cubes stay far from overflow
    m2 = float(d @ d) / n
    m3 = float(d @ (d * d)) / n
    gamma = m3 / (m2 * math.sqrt(m2)) * math.sqrt(n * (n - 1.0)) / (n - 2.0)
    a = gamma / (3.0 * math.sqrt(n))
    b = gamma / (6.0 * math.sqrt(n))
    q = _t_isf_cached(round((1.0 - level) / 2.0, 15), n - 1)

    def inverse(z: float) -> float:
        u = 3.0 * a * (z - b)
        if a == 0.0:
            return z - b
        if u > -1.0:
            return math.expm1(math.log1p(u) / 3.0) / a  # accurate for small a
        return (float(np.cbrt(1.0 + u)) - 1.0) / a

    stderr = std / math.sqrt(n)
    return mean - stderr * inverse(q), mean - stderr * inverse(-q)


@functools.lru_cache(maxsize=4096)
def _t_isf_cached(q: float, df: int) -> float:
    if df >= 200:
        # Cornish-Fisher in 1/df: relative error below 1e-9 for q >= 1e-5 at df = 200, and the
        # exact inversion costs milliseconds at the many df values adaptive looks meet.
        return _cornish_fisher_t(q, df)
    return _t_isf(q, df)


def _cornish_fisher_t(q: float, df: int) -> float:
    """Student t quantile (upper tail ``q``) by its Cornish-Fisher expansion in ``1/df``."""
    z = -_norm_ppf(q)
    z2 = z * z
    g1 = (z2 + 1.0) * z / 4.0
    g2 = ((5.0 * z2 + 16.0) * z2 + 3.0) * z / 96.0
    g3 = (((3.0 * z2 + 19.0) * z2 + 17.0) * z2 - 15.0) * z / 384.0
    g4 = ((((79.0 * z2 + 776.0) * z2 + 1482.0) * z2 - 1920.0) * z2 - 945.0) * z / 92160.0
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


@functools.lru_cache(maxsize=4096)
def _clopper_pearson(k: int, n: int, level: float) -> tuple[float, float]:
    """Exact binomial interval of ``k / n``: beta quantiles, ``alpha/2`` in each tail."""
    alpha = 1.0 - level
    low = 0.0 if k == 0 else _beta_ppf(alpha / 2.0, k, n - k + 1)
    high = 1.0 if k == n else _beta_ppf(1.0 - alpha / 2.0, k + 1, n - k)
    return low, high


def _beta_ppf(p: float, a: float, b: float) -> float:
    """Quantile of Beta(a, b): Newton on the regularized incomplete beta, kept in a bracket."""
    log_norm = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    lo, hi = 0.0, 1.0
    x = a / (a + b)
    for _ in range(200):
        cdf = _betainc(a, b, x, 1.0 - x)
        if cdf < p:
            lo = x
        else:
            hi = x
        density = math.exp(log_norm + (a - 1.0) * math.log(x) + (b - 1.0) * math.log1p(-x))
        step = x - (cdf - p) / density if density > 0.0 else -1.0
        new_x = step if lo < step < hi else 0.5 * (lo + hi)
        if abs(new_x - x) <= 1e-15 * x or hi - lo <= 1e-300:
            return new_x
        x = new_x
    return x  # pragma: no cover - Newton converges in a handful of steps


def _t_interval(x: FloatArray, mean: float, level: float) -> Interval:
    n = x.size
    if n == 1 or _is_constant(x):
        return Interval(low=mean, high=mean, level=level, method=METHOD_T)
    stderr = _spread_of_sorted(x, mean)[1] / math.sqrt(n)
    half = _t_isf((1.0 - level) / 2.0, n - 1) * stderr
    return _containing(mean - half, mean + half, mean, level, METHOD_T)


# --------------------------------------------------------------------------------------------
# Distribution functions (numpy/math only)
# --------------------------------------------------------------------------------------------

# Acklam's rational approximation of the normal quantile (relative error < 1.2e-9), refined
# below by one Halley step to full double precision.
_A: Final = (
    -3.969683028665376e01,
    2.209460984245205e02,
    -2.759285104469687e02,
    1.383577518672690e02,
    -3.066479806614716e01,
    2.506628277459239e00,
)
_B: Final = (
    -5.447609879822406e01,
    1.615858368580409e02,
    -1.556989798598866e02,
    6.680131188771972e01,
    -1.328068155288572e01,
)
_C: Final = (
    -7.784894002430293e-03,
    -3.223964580411365e-01,
    -2.400758277161838e00,
    -2.549732539343734e00,
    4.374664141464968e00,
    2.938163982698783e00,
)
_D: Final = (
    7.784695709041462e-03,
    3.224671290700398e-01,
    2.445134137142996e00,
    3.754408661907416e00,
)
_P_LOW: Final = 0.02425


def _norm_cdf(z: float) -> float:
    """Return the standard normal CDF at ``z``."""
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def _norm_ppf(p: float) -> float:
    """Return the standard normal quantile of ``p``, for ``0 < p < 1``."""
    if not 0.0 < p < 1.0:
        raise StatsInputError(f"probability must be in (0, 1) (got {p!r})")
    if p > 0.5:
        # 1 - p is exact for p in [0.5, 1]; the lower tail is where erfc is accurate.
        return -_norm_ppf(1.0 - p)
    if p < _P_LOW:
        q = math.sqrt(-2.0 * math.log(p))
        num = ((((_C[0] * q + _C[1]) * q + _C[2]) * q + _C[3]) * q + _C[4]) * q + _C[5]
        x = num / ((((_D[0] * q + _D[1]) * q + _D[2]) * q + _D[3]) * q + 1.0)
    else:
        q = p - 0.5
        r = q * q
        num = (((((_A[0] * r + _A[1]) * r + _A[2]) * r + _A[3]) * r + _A[4]) * r + _A[5]) * q
        x = num / (((((_B[0] * r + _B[1]) * r + _B[2]) * r + _B[3]) * r + _B[4]) * r + 1.0)
    e = _norm_cdf(x) - p
    u = e * math.sqrt(2.0 * math.pi) * math.exp(x * x / 2.0)
    return x - u / (1.0 + x * u / 2.0)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 20_000):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            return h
    return h  # pragma: no cover - converges in O(sqrt(a)) steps for the arguments used here


def _betainc(a: float, b: float, x: float, y: float) -> float:
    """Regularized incomplete beta ``I_x(a, b)``, with ``y = 1 - x`` passed in for precision."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y)
    )
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, y) / b


def _t_sf(t: float, df: int) -> float:
    """Upper-tail probability of Student's t at ``t >= 0``."""
    t2 = t * t
    return 0.5 * _betainc(df / 2.0, 0.5, df / (df + t2), t2 / (df + t2))


def _t_isf(q: float, df: int) -> float:
    """Student t quantile with upper-tail probability ``q`` in (0, 0.5), ``df >= 1``."""
    if df == 1:
        return math.tan(math.pi * (0.5 - q))
    if df == 2:
        p = 1.0 - q
        return (2.0 * p - 1.0) / math.sqrt(2.0 * p * q)
    if df >= 10_000:
        return _cornish_fisher_t(q, df)  # the next term is below 1e-14 here
    z = -_norm_ppf(q)
    # Newton on the tail probability, safeguarded by bisection; t quantiles exceed z.
    log_norm = math.lgamma((df + 1) / 2.0) - math.lgamma(df / 2.0) - 0.5 * math.log(df * math.pi)
    lo, hi = z, 2.0 * z
    while _t_sf(hi, df) > q:
        lo, hi = hi, 2.0 * hi
    t = 0.5 * (lo + hi)
    for _ in range(200):
        tail = _t_sf(t, df)
        if tail > q:
            lo = t
        else:
            hi = t
        density = math.exp(log_norm - (df + 1) / 2.0 * math.log1p(t * t / df))
        step = t + (tail - q) / density
        new_t = step if lo < step < hi else 0.5 * (lo + hi)
        if abs(new_t - t) <= 1e-15 * t:
            return new_t
        t = new_t
    return t  # pragma: no cover - Newton converges in a handful of steps
