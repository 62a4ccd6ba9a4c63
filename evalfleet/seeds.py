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


#: The second word of an episode's action-sampling seed: ``[seed, ACTION_STREAM]`` is another
#: SeedSequence than gymnasium's ``np_random`` (``SeedSequence(seed)``), so the draws that pick
#: sampled actions are not the env's own random numbers.
ACTION_STREAM = 0xAC7

#: The rule above, named in the cache key: a change of it changes the sampled episodes.
ACTION_SAMPLER = f"pcg64([seed, 0x{ACTION_STREAM:X}]) float64 inverse-cdf"


def action_rng(seed: int) -> np.random.Generator:
    """The generator that samples episode ``seed``'s actions under ``--stochastic``.

    ``np.random.default_rng(seed)`` is bit for bit the generator gymnasium seeds an env's
    ``np_random`` with on ``reset(seed=seed)``: a policy's uniform draws would then be the env's,
    and a sampled action correlated with the env's noise (a coin-flip env matched every time).
    """
    return np.random.default_rng([seed, ACTION_STREAM])


def fresh_global_rng() -> None:
    """Seed numpy's global ``np.random`` state from the OS, as a freshly started process has it.

    Processes forked from one server (the local workers, ``process`` sandboxes) inherit its
    state: an env drawing from ``np.random`` rather than the ``np_random`` that ``reset(seed=)``
    seeds got the same numbers in every sandbox, and a spread of zero. Python's ``random`` is
    reseeded at fork by CPython itself; numpy's is not. Unseeded draws stay what they are in a
    plain loop, unreproducible, which the determinism audit reports.
    """
    np.random.seed()
