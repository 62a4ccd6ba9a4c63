"""Reference policies for the evalfleet environments, in the ``module:function`` callable format.

Each policy maps a float32 observation batch of shape ``(B, *obs_shape)`` to an integer array of
``B`` actions, e.g. ``envs.reference_policies:inventory_heuristic``. They are baselines for the
comparison in an evaluation report: a random policy and a hand-written heuristic per environment,
written for the registered default arguments.

The random policies are pure functions of the observation: each row seeds its own generator from
a hash of the row's bytes, so a batch gives the same actions whatever the batch size, order or
worker, and no global RNG is touched. The flip side: identical observations get identical
actions.
"""

from __future__ import annotations

import hashlib
from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from envs import connect_four as c4
from envs import inventory, recommend

__all__ = [
    "connect_four_heuristic",
    "connect_four_random",
    "inventory_heuristic",
    "inventory_random",
    "recommend_heuristic",
    "recommend_random",
]

Actions = NDArray[np.int64]

RECOMMEND_N_ITEMS: Final = 50
"""Catalogue size the recommend policies act on (the registered default ``n_items``)."""
BOREDOM_AVERSION: Final = 0.25
"""Weight of a topic's boredom against its engagement estimate in :func:`recommend_heuristic`."""
SAFETY_STOCK: Final = 0.4
"""Extra cover of :func:`inventory_heuristic`, as a share of the lead-time demand forecast."""

_N_INVENTORY_ACTIONS: Final = len(inventory.ORDER_LEVELS) * len(inventory.PRICE_LEVELS)
_ORDER_LEVELS: Final = np.asarray(inventory.ORDER_LEVELS)
# Bit of each observation cell (row 0 on top) in the connect_four bitboard layout.
_CELL_BITS: Final = tuple(
    1 << (col * (c4.ROWS + 1) + (c4.ROWS - 1 - row))
    for row in range(c4.ROWS)
    for col in range(c4.COLUMNS)
)


def _as_batch(observations: ArrayLike, name: str) -> NDArray[np.float32]:
    """Flatten a ``(B, *obs_shape)`` batch to ``(B, n)`` float32; reject a lone observation."""
    batch = np.ascontiguousarray(observations, dtype=np.float32)
    if batch.ndim < 2:
        raise ValueError(
            f"{name} expects a batch of shape (B, *obs_shape) (got shape {batch.shape!r}); "
            "wrap a single observation as obs[None]."
        )
    return batch.reshape(batch.shape[0], -1)


def _row_generators(batch: NDArray[np.float32]) -> list[np.random.Generator]:
    """One generator per row, seeded by a hash of the row's bytes."""
    return [
        np.random.default_rng(
            int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little")
        )
        for row in batch
    ]


def recommend_random(observations: ArrayLike) -> Actions:
    """Uniformly random item of the default catalogue."""
    batch = _as_batch(observations, "recommend_random")
    return np.array(
        [rng.integers(RECOMMEND_N_ITEMS) for rng in _row_generators(batch)], dtype=np.int64
    )


def recommend_heuristic(observations: ArrayLike) -> Actions:
    """Best topic by engagement estimate minus boredom; cycle through that topic's items.

    Item ``i`` is dominated by topic ``i % K``, so the topic's items are ``k, k + K, k + 2K, ...``;
    stepping through them with the topic's recommendation count keeps repeats as far apart as
    the catalogue allows.
    """
    batch = _as_batch(observations, "recommend_heuristic")
    k_topics = (batch.shape[1] - 3) // 3
    estimate = batch[:, :k_topics]
    boredom = batch[:, k_topics : 2 * k_topics]
    counts = np.rint(batch[:, 2 * k_topics : 3 * k_topics] * recommend.COUNT_SCALE).astype(np.int64)
    topic = np.argmax(estimate - BOREDOM_AVERSION * boredom, axis=1)
    shown = counts[np.arange(batch.shape[0]), topic]
    per_topic = RECOMMEND_N_ITEMS // k_topics
    actions: Actions = (topic + k_topics * (shown % per_topic)).astype(np.int64)
    return actions


def inventory_random(observations: ArrayLike) -> Actions:
    """Uniformly random (order quantity, price) pair."""
    batch = _as_batch(observations, "inventory_random")
    return np.array(
        [rng.integers(_N_INVENTORY_ACTIONS) for rng in _row_generators(batch)], dtype=np.int64
    )


def inventory_heuristic(observations: ArrayLike) -> Actions:
    """Base-stock ordering with a scarcity price rule.

    Order up to ``(1 + SAFETY_STOCK) * forecast`` of stock on hand plus on order (``forecast``
    is the expected demand until an order placed today has arrived, observation 4), rounding
    the shortfall to the nearest order level. Price high while the position is short of the
    forecast (slows demand until stock arrives), low when stock on hand covers more than four
    days (clears it before holding costs pile up), at the base price otherwise.
    """
    batch = _as_batch(observations, "inventory_heuristic")
    on_hand, on_order, next_day, forecast = batch[:, 0], batch[:, 1], batch[:, 3], batch[:, 4]
    position = on_hand + on_order
    shortfall = (1.0 + SAFETY_STOCK) * forecast - position
    order_level = np.argmin(np.abs(shortfall[:, None] - _ORDER_LEVELS[None, :]), axis=1)
    price_level = np.where(position < forecast, 2, np.where(on_hand > 4.0 * next_day, 0, 1))
    actions: Actions = (order_level * len(inventory.PRICE_LEVELS) + price_level).astype(np.int64)
    return actions


def _bitboards(row: NDArray[np.float32]) -> tuple[int, int]:
    """(agent stones, all stones) of a flat 42-cell observation row."""
    agent = 0
    mask = 0
    for index in np.flatnonzero(row).tolist():
        bit = _CELL_BITS[index]
        mask |= bit
        if row[index] > 0:
            agent |= bit
    return agent, mask


def _most_central(columns: list[int]) -> int:
    return min(columns, key=lambda col: abs(col - c4.COLUMNS // 2))


def connect_four_random(observations: ArrayLike) -> Actions:
    """Uniformly random non-full column (column 0 if the board is full)."""
    batch = _as_batch(observations, "connect_four_random")
    actions = []
    for row, rng in zip(batch, _row_generators(batch), strict=True):
        legal = np.flatnonzero(row[: c4.COLUMNS] == 0)
        actions.append(int(legal[rng.integers(len(legal))]) if len(legal) else 0)
    return np.array(actions, dtype=np.int64)


def connect_four_heuristic(observations: ArrayLike) -> Actions:
    """Win if possible, else block the opponent's win, else the most central safe column.

    A column is safe when the cell it fills is not directly below an opponent's winning cell
    (playing there would hand the opponent that cell).
    """
    batch = _as_batch(observations, "connect_four_heuristic")
    actions = []
    for row in batch:
        agent, mask = _bitboards(row)
        legal = [col for col in range(c4.COLUMNS) if c4.drop(mask, col)]
        if not legal:
            actions.append(0)
            continue
        opponent = agent ^ mask
        wins = c4.winning_moves(agent, mask) or c4.winning_moves(opponent, mask)
        if wins:
            actions.append(_most_central(wins))
            continue
        gifts = c4.winning_cells(opponent, mask) >> 1
        safe = [col for col in legal if not c4.drop(mask, col) & gifts]
        actions.append(_most_central(safe or legal))
    return np.array(actions, dtype=np.int64)
