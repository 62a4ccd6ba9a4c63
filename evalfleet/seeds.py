"""The seed ledger: episode ``i`` of an evaluation always gets ``ledger(seed, i)``.

The seed of an episode depends only on the evaluation's base seed and the episode's index, never on
which worker or slot runs it, so results are independent of the cluster's shape. The mapping is the
splitmix64 finaliser applied to ``(base_seed << 32) | index``: a bijection on 64-bit integers, so
distinct ``(base_seed, index)`` pairs never share a seed, and neighbouring base seeds do not share
episodes the way ``base_seed + index`` schemes do.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from evalfleet.errors import RequestError

MAX_BASE_SEED = 2**31 - 1
MAX_EPISODES = 2**32

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class SeedLedger:
    """Maps episode indices of one evaluation to environment reset seeds."""

    def __init__(self, base_seed: int) -> None:
        if not 0 <= base_seed <= MAX_BASE_SEED:
            raise RequestError(
                f"'seed' must be an integer in [0, {MAX_BASE_SEED}] (got {base_seed!r}); "
                "pass a non-negative 31-bit seed."
            )
        self.base_seed = base_seed

    def seeds(self, indices: npt.ArrayLike) -> npt.NDArray[np.uint64]:
        """Seeds for the given episode indices (vectorised)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= MAX_EPISODES):
            raise RequestError(f"episode indices must lie in [0, 2**32) (got {idx.min()}..{idx.max()})")
        with np.errstate(over="ignore"):
            x = (np.uint64(self.base_seed) << np.uint64(32)) | idx.astype(np.uint64)
            return _splitmix64(x)

    def seed(self, index: int) -> int:
        """The seed of one episode, as a Python int ready for ``env.reset(seed=...)``."""
        return int(self.seeds([index])[0])


def ledger(base_seed: int, index: int) -> int:
    """Shorthand for ``SeedLedger(base_seed).seed(index)``."""
    return SeedLedger(base_seed).seed(index)
