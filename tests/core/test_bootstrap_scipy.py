"""``bootstrap_distribution`` draws what ``scipy.stats.bootstrap`` draws, to the bit.

The draws, their batches and the statistics are scipy's; the batches' statistics run on threads
while the next batch is drawn. The reference here is scipy itself, called as evalfleet called it.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from evalfleet import bootstrap
from evalfleet.bootstrap import bootstrap_distribution


def _scipy(x: np.ndarray, seed: int, n_boot: int, with_iqm: bool) -> np.ndarray:
    n = x.size
    cut = n // 4

    def mean(idx, axis=-1):  # type: ignore[no-untyped-def]
        return x[idx].mean(axis=axis)

    def mean_and_iqm(idx, axis=-1):  # type: ignore[no-untyped-def]
        means = mean(idx, axis)
        if not cut:
            return np.stack([means, means])
        return np.stack([means, x[np.sort(idx, axis=axis)[..., cut:n - cut]].mean(axis=axis)])

    result = stats.bootstrap((np.arange(n, dtype=np.int32),), mean_and_iqm if with_iqm else mean,
                             n_resamples=n_boot, batch=max(1, bootstrap.MAX_INDICES_PER_CHUNK // n),
                             vectorized=True, method="percentile", rng=np.random.default_rng(seed))
    return np.asarray(result.bootstrap_distribution, dtype=np.float64)


@pytest.mark.parametrize("n", [2, 3, 7, 500, 20_000])
@pytest.mark.parametrize("with_iqm", [False, True])
def test_the_draws_and_statistics_are_scipys(n: int, with_iqm: bool, monkeypatch) -> None:
    x = np.sort(np.random.default_rng(n).normal(size=n) * 50)
    x[: n // 3] = np.round(x[: n // 3])  # ties, as discrete returns have
    if n == 20_000:  # several uneven batches: 1,000 resamples in batches of 300
        monkeypatch.setattr(bootstrap, "MAX_INDICES_PER_CHUNK", 300 * n)
        n_boot = 1_000
    else:
        n_boot = 2_000
    means, iqms = bootstrap_distribution(x, np.random.default_rng(7), n_boot, with_iqm=with_iqm)
    want = _scipy(x, 7, n_boot, with_iqm)
    if with_iqm:
        np.testing.assert_array_equal(means, want[0])
        np.testing.assert_array_equal(iqms, want[1])
    else:
        np.testing.assert_array_equal(means, want)
        assert iqms is means


@pytest.mark.parametrize("n", [2, 3, 65_537, 2**31 - 1])
def test_an_int32_draw_is_scipys_int64_draw_for_any_sample_size_below_2_31(n: int) -> None:
    # bootstrap_distribution draws int32 indices where scipy draws int64 ones and takes them from
    # the sample (0..n-1 here): the same numbers, from the same stream, only while numpy keeps
    # drawing 32-bit words for ranges below 2**32. A numpy that changes that fails here first.
    wide, narrow = np.random.default_rng(11), np.random.default_rng(11)
    for shape in [(3, 1_000), (1, 7)]:
        np.testing.assert_array_equal(wide.integers(0, n, shape, dtype=np.int64),
                                      narrow.integers(0, n, shape, dtype=np.int32))
    assert wide.integers(0, 2**62) == narrow.integers(0, 2**62)  # the streams stay in step
