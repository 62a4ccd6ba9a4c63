"""Bootstrap distributions of the mean and the IQM, drawn by :func:`scipy.stats.bootstrap`.

The contract every resampling statistic of evalfleet relies on:

* The sample is sorted before resampling, so the result depends on the multiset of returns and
  the seed, never on the order in which episodes finished.
* Randomness comes only from the ``numpy.random.Generator`` passed in (no global RNG); one seed
  gives one result.
* Resamples are drawn in batches of at most ``MAX_INDICES_PER_CHUNK`` indices, which bounds
  memory whatever the number of episodes. Batching does not change the draws: the same seed gives
  the same resamples to every caller, so the mean and IQM intervals of one summary agree with
  those computed on their own.

Intervals are built from these distributions in :mod:`evalfleet.intervals`.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import NDArray
from scipy import stats as scipy_stats

__all__ = ["MAX_INDICES_PER_CHUNK", "bootstrap_distribution"]

FloatArray = NDArray[np.float64]

#: Upper bound on resample indices drawn at once (int64: 32 MB, plus the gathered and sorted
#: floats of one batch).
MAX_INDICES_PER_CHUNK: Final = 4_000_000


def bootstrap_distribution(
    x: FloatArray, rng: np.random.Generator, n_boot: int, *, with_iqm: bool
) -> tuple[FloatArray, FloatArray]:
    """Return the bootstrap means and, if ``with_iqm``, IQMs (else the means again) of sorted x.

    The IQM is the mean of the middle 50%, ``n // 4`` values cut from each end of a sorted
    resample (``scipy.stats.trim_mean(resample, 0.25)``). A resample's mean is taken over the
    resample as drawn, so it is bit-identical whether or not the IQMs are wanted.
    """
    n = x.size
    if n == 1:
        # scipy refuses a one-value sample; every resample of it is that value.
        ones = np.full(n_boot, x[0], dtype=np.float64)
        return ones, ones
    cut = n // 4

    def mean(sample: FloatArray, axis: int = -1) -> FloatArray:
        means: FloatArray = sample.mean(axis=axis)
        return means

    def mean_and_iqm(sample: FloatArray, axis: int = -1) -> FloatArray:
        middle = np.sort(sample, axis=axis)[..., cut : n - cut] if cut else sample
        return np.stack([sample.mean(axis=axis), middle.mean(axis=axis)])

    result = scipy_stats.bootstrap(
        (x,),
        mean_and_iqm if with_iqm else mean,
        n_resamples=n_boot,
        batch=max(1, MAX_INDICES_PER_CHUNK // n),
        vectorized=True,
        method="percentile",
        rng=rng,
    )
    boot = np.asarray(result.bootstrap_distribution, dtype=np.float64)
    if with_iqm:
        return boot[0], boot[1]
    return boot, boot
