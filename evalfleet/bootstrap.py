"""Bootstrap distributions of the mean and the IQM, drawn as :func:`scipy.stats.bootstrap` draws.

The contract every resampling statistic of evalfleet relies on:

* The sample is sorted before resampling, so the result depends on the multiset of returns and
  the seed, never on the order in which episodes finished.
* Randomness comes only from the ``numpy.random.Generator`` passed in (no global RNG); one seed
  gives one result.
* Resamples are drawn in batches of at most ``MAX_INDICES_PER_CHUNK`` indices, which bounds
  memory whatever the number of episodes. Batching does not change the draws: the same seed gives
  the same resamples to every caller, so the mean and IQM intervals of one summary agree with
  those computed on their own.
* The draws, their batches and the statistics are scipy's, to the bit
  (``tests/core/test_bootstrap_scipy.py``): ``scipy.stats.bootstrap`` with ``vectorized=True``,
  ``method="percentile"``. Done here, a batch's statistics run on a thread (numpy releases the
  GIL in them) while the next batch is drawn, and the ~0.7 s import of ``scipy.stats`` is not
  paid by every process that reports.

Intervals are built from these distributions in :mod:`evalfleet.intervals`.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final

import numpy as np
from numpy.typing import NDArray

__all__ = ["MAX_INDICES_PER_CHUNK", "bootstrap_distribution"]

FloatArray = NDArray[np.float64]
IndexArray = NDArray[np.integer]

#: Upper bound on resample indices drawn at once (32 MB of int64 indices, their int32 copy and
#: the gathered floats of one batch).
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

    # scipy resamples the episode indices, not the returns: because x is sorted, sorting the
    # (int32) indices of a resample sorts its values: a quarter less time than sorting the
    # gathered floats at 20k episodes x 2000 resamples.
    def mean(idx: IndexArray, axis: int = -1) -> FloatArray:
        means: FloatArray = x[idx].mean(axis=axis)
        return means

    def mean_and_iqm(idx: IndexArray, axis: int = -1) -> FloatArray:
        means = mean(idx, axis)
        if not cut:
            return np.stack([means, means])
        middle = np.sort(idx, axis=axis)[..., cut : n - cut]
        return np.stack([means, x[middle].mean(axis=axis)])

    statistic = mean_and_iqm if with_iqm else mean
    # scipy draws int64 indices into the sample (here 0..n-1) and takes them. Below 2**31 an
    # int32 draw is the same numbers (numpy's bounded draw takes 32-bit words whatever the dtype,
    # for any range below 2**32) at half the memory traffic, and the take is the identity.
    small = n < 2**31
    sample = np.arange(n, dtype=np.int32 if small else np.int64)
    batch = max(1, MAX_INDICES_PER_CHUNK // n)
    parts: list[FloatArray] = []
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="evalfleet-bootstrap") as pool:
        running: deque[Future[FloatArray]] = deque()
        for k in range(0, n_boot, batch):
            # As scipy.stats.bootstrap: one draw of (batch, n) indices per batch, in order.
            shape = (min(batch, n_boot - k), n)
            idx: IndexArray = (rng.integers(0, n, shape, dtype=np.int32) if small
                               else np.take(sample, rng.integers(0, n, shape, dtype=np.int64)))
            running.append(pool.submit(statistic, idx))
            if len(running) == 2:  # at most two batches computed, one drawn: memory stays bounded
                parts.append(running.popleft().result())
        parts.extend(f.result() for f in running)
    boot = np.concatenate(parts, axis=-1).astype(np.float64, copy=False)
    if with_iqm:
        return boot[0], boot[1]
    return boot, boot
