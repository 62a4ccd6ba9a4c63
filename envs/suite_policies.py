"""One policy for all three use-case envs: the reference policy of whichever env a batch is from.

A suite evaluates one policy on many tasks; ``examples/suite.toml`` spans the three envs, whose
observations differ in width (Recommend 18, Inventory 11, ConnectFour 42 with the registered
arguments). These ``module:function`` policies pick the env's reference policy
(``envs.reference_policies``) by that width, e.g. ``--policy envs.suite_policies:heuristic``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike, NDArray

from envs import reference_policies as ref

__all__ = ["heuristic", "random"]

Policy = Callable[[ArrayLike], NDArray[np.int64]]

_HEURISTIC: dict[int, Policy] = {
    18: ref.recommend_heuristic, 11: ref.inventory_heuristic, 42: ref.connect_four_heuristic,
}
_RANDOM: dict[int, Policy] = {
    18: ref.recommend_random, 11: ref.inventory_random, 42: ref.connect_four_random,
}


def _dispatch(table: dict[int, Policy], observations: ArrayLike, name: str) -> NDArray[np.int64]:
    batch = np.asarray(observations, dtype=np.float32)
    width = int(np.prod(batch.shape[1:])) if batch.ndim >= 2 else -1
    policy = table.get(width)
    if policy is None:
        raise ValueError(
            f"{name}: no reference policy for observations of width {width} (shape "
            f"{batch.shape!r}); it knows Recommend (18), Inventory (11) and ConnectFour (42) "
            "with their registered arguments."
        )
    return policy(batch)


def heuristic(observations: ArrayLike) -> NDArray[np.int64]:
    """The hand-written heuristic of the env the batch comes from."""
    return _dispatch(_HEURISTIC, observations, "suite heuristic")


def random(observations: ArrayLike) -> NDArray[np.int64]:
    """The uniformly random policy of the env the batch comes from (seeded by each row)."""
    return _dispatch(_RANDOM, observations, "suite random")
