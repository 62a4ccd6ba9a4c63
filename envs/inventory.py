"""Inventory and pricing of one product under seasonal demand (``evalfleet/Inventory-v0``)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Final

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from numpy.typing import NDArray

from envs import _render

# Action grid, shared with the reference policies:
# action = order_level * len(PRICE_LEVELS) + price_level.
ORDER_LEVELS: Final = (0.0, 0.5, 1.0, 2.0, 4.0)
"""Order quantities in multiples of ``demand_scale`` (rounded to whole units)."""
PRICE_LEVELS: Final = (0.8, 1.0, 1.2)
"""Prices in multiples of ``BASE_PRICE``."""

BASE_PRICE: Final = 10.0
UNIT_COST: Final = 5.0
ORDER_FIXED_COST: Final = 10.0
HOLDING_COST: Final = 0.1
STOCKOUT_PENALTY: Final = 2.0
PRICE_ELASTICITY: Final = 2.0
CAPACITY_DAYS: Final = 10.0
MAX_LOST_FEATURE: Final = 5.0
SUCCESS_MARGIN_SHARE: Final = 0.7

_N_ACTIONS: Final = len(ORDER_LEVELS) * len(PRICE_LEVELS)
_TWO_PI: Final = 2.0 * math.pi
_HISTORY_DAYS: Final = 60


class InventoryEnv(gym.Env[NDArray[np.float32], np.int64]):
    """Daily ordering and pricing of one product with lead times and lost sales.

    ## Description
    A shop sells one product. Each day the agent chooses how much to reorder from its supplier
    and at which price to sell. Demand is Poisson with mean
    ``demand_scale * season(day) * (price / BASE_PRICE) ** -PRICE_ELASTICITY`` where
    ``season(day) = (1 + a sin(2 pi (day + w0) / 7)) * (1 + a sin(2 pi (day + y0) / 365))`` has a
    weekly and an annual cycle of amplitude ``a = seasonality``. Orders arrive after
    ``lead_time`` days; unmet demand is lost. Stock beyond the warehouse capacity
    (``CAPACITY_DAYS * demand_scale`` units) is written off on arrival.

    Order of events in a day: the order is placed and paid, the order placed ``lead_time`` days
    ago arrives (with ``lead_time=0`` today's order arrives at once), demand is drawn and served
    from stock, holding cost is charged on what is left.

    ## Action Space
    ``Discrete(15)``: ``action = 3 * order_level + price_level``.

    | order_level | quantity ordered         | price_level | price              |
    |-------------|--------------------------|-------------|--------------------|
    | 0           | 0                        | 0           | 0.8 * BASE_PRICE   |
    | 1           | round(0.5 * demand_scale)| 1           | 1.0 * BASE_PRICE   |
    | 2           | round(1.0 * demand_scale)| 2           | 1.2 * BASE_PRICE   |
    | 3           | round(2.0 * demand_scale)|             |                    |
    | 4           | round(4.0 * demand_scale)|             |                    |

    ## Observation Space
    ``Box(float32, shape=(11,))``; quantities are in units of ``demand_scale`` (one average
    day of demand at the reference price), so one policy fits every scale.

    | Num | Observation                                                  | Min | Max              |
    |-----|--------------------------------------------------------------|-----|------------------|
    | 0   | stock on hand                                                | 0   | CAPACITY_DAYS    |
    | 1   | stock on order (all outstanding orders)                      | 0   | 4 * max(L, 1)    |
    | 2   | order arriving next day                                      | 0   | 4                |
    | 3   | expected demand next day at the base price                   | 0   | (1 + a)^2        |
    | 4   | expected demand over the next L + 1 days at the base price   | 0   | (L + 1)(1 + a)^2 |
    | 5-6 | sin, cos of the weekly phase of the next day                 | -1  | 1                |
    | 7-8 | sin, cos of the annual phase of the next day                 | -1  | 1                |
    | 9   | fraction of the horizon left                                 | 0   | 1                |
    | 10  | sales lost on the last day (clipped)                         | 0   | MAX_LOST_FEATURE |

    ``L`` is ``lead_time``, ``a`` is ``seasonality``.

    ## Rewards
    The day's profit: ``revenue - ordering cost - holding cost - stock-out penalty`` with revenue
    ``price * units sold``, ordering cost ``ORDER_FIXED_COST`` (if anything is ordered)
    ``+ UNIT_COST * quantity``, holding cost ``HOLDING_COST`` per unit left at the end of the day,
    and penalty ``STOCKOUT_PENALTY`` per unit of lost sales (lost goodwill). ``info`` breaks it
    down: ``"revenue"``, ``"ordering_cost"``, ``"holding_cost"``, ``"stockout_cost"``, with
    ``"demand"``, ``"sales"``, ``"lost_sales"``, ``"arrived"`` (units received) and
    ``"written_off"`` (units beyond capacity).

    ## Starting State
    Day phases ``w0`` and ``y0`` are drawn uniformly, stock on hand uniformly in
    ``[demand_scale, 3 * demand_scale]``, and every pipeline slot holds ``round(demand_scale)``
    units (steady replenishment). ``reset(options={"on_hand": int, "pipeline": [int, ...]})``
    overrides stock and pipeline (the pipeline must have ``lead_time`` entries, next arrival first).

    ## Episode End
    Truncated after ``horizon`` days (the env truncates itself, and the registered
    ``max_episode_steps`` equals the default horizon; pass ``max_episode_steps=horizon`` to
    ``gymnasium.make`` when changing it). ``info`` of the last day adds ``"profit"`` (total over
    the episode), ``"stockout_days"`` (days with lost sales) and ``"success"``:
    ``stockout_days == 0 and profit > profit_threshold``.

    ## Arguments
    ```python
    gymnasium.make("evalfleet/Inventory-v0", horizon=90, lead_time=3, demand_scale=20.0,
                   seasonality=0.3, profit_threshold=None, render_mode=None)
    ```
    * ``horizon``: days per episode.
    * ``lead_time``: days between placing an order and receiving it (0 = same day).
    * ``demand_scale``: mean daily demand at the base price and neutral season.
    * ``seasonality``: amplitude ``a`` in [0, 1) of the weekly and annual cycles.
    * ``profit_threshold``: total profit to beat for success; None means
      ``0.7 * (BASE_PRICE - UNIT_COST) * demand_scale * horizon``: 70% of the margin of selling
      the average demand at the base price.
    * ``render_mode``: None or ``"rgb_array"`` (240x320x3 uint8: stock/demand chart).

    ## Version History
    * v0: Initial version.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(
        self,
        horizon: int = 90,
        lead_time: int = 3,
        demand_scale: float = 20.0,
        seasonality: float = 0.3,
        profit_threshold: float | None = None,
        render_mode: str | None = None,
    ) -> None:
        if horizon < 1:
            raise ValueError(f"'horizon' must be >= 1 day (got {horizon!r}).")
        if lead_time < 0:
            raise ValueError(f"'lead_time' must be >= 0 days (got {lead_time!r}).")
        if not demand_scale >= 1.0:
            raise ValueError(f"'demand_scale' must be >= 1 unit per day (got {demand_scale!r}).")
        if not 0.0 <= seasonality < 1.0:
            raise ValueError(f"'seasonality' must be in [0, 1) (got {seasonality!r}).")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"Unknown render_mode {render_mode!r}. Choose None or 'rgb_array'.")
        self.horizon = horizon
        self.lead_time = lead_time
        self.demand_scale = float(demand_scale)
        self.seasonality = float(seasonality)
        self.profit_threshold = (
            SUCCESS_MARGIN_SHARE * (BASE_PRICE - UNIT_COST) * self.demand_scale * horizon
            if profit_threshold is None
            else float(profit_threshold)
        )
        self.render_mode = render_mode
        self.capacity = int(round(CAPACITY_DAYS * self.demand_scale))
        self._order_quantities = tuple(
            int(round(level * self.demand_scale)) for level in ORDER_LEVELS
        )
        self._prices = tuple(level * BASE_PRICE for level in PRICE_LEVELS)
        # Mean demand multiplier of each price level.
        self._price_response = tuple(level**-PRICE_ELASTICITY for level in PRICE_LEVELS)

        self.action_space = spaces.Discrete(_N_ACTIONS)
        peak = (1.0 + self.seasonality) ** 2
        max_order = max(self._order_quantities) / self.demand_scale
        high = np.array(
            [
                self.capacity / self.demand_scale,  # CAPACITY_DAYS up to rounding
                max_order * max(lead_time, 1),  # always 0 without lead time; keep low < high
                max_order,
                peak,
                peak * (lead_time + 1),
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                MAX_LOST_FEATURE,
            ],
            dtype=np.float32,
        )
        low = np.zeros_like(high)
        low[5:9] = -1.0
        self.observation_space = spaces.Box(low, high, dtype=np.float32)

        self._day = 0
        self._on_hand = 0
        self._pipeline: deque[int] = deque()
        self._week_phase = 0
        self._year_phase = 0
        self._last_lost = 0
        self._profit = 0.0
        self._stockout_days = 0
        self._price_level = 1
        self._history: deque[tuple[int, int, int]] = deque(maxlen=_HISTORY_DAYS)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[NDArray[np.float32], dict[str, Any]]:
        """Draw the calendar phases and opening stock; ``options`` may fix stock and pipeline."""
        super().reset(seed=seed)
        options = options or {}
        self._week_phase = int(self.np_random.integers(7))
        self._year_phase = int(self.np_random.integers(365))
        opening = int(
            self.np_random.integers(round(self.demand_scale), round(3 * self.demand_scale) + 1)
        )
        self._on_hand = int(options.get("on_hand", opening))
        pipeline = [
            int(q) for q in options.get("pipeline", [round(self.demand_scale)] * self.lead_time)
        ]
        if (
            not 0 <= self._on_hand <= self.capacity
            or len(pipeline) != self.lead_time
            or not all(0 <= q <= max(self._order_quantities) for q in pipeline)
        ):
            raise ValueError(
                f"options must give 'on_hand' in 0..{self.capacity} and a 'pipeline' of "
                f"{self.lead_time} quantities in 0..{max(self._order_quantities)} "
                f"(got on_hand={self._on_hand!r}, pipeline={pipeline!r})."
            )
        self._pipeline = deque(pipeline)
        self._day = 0
        self._last_lost = 0
        self._profit = 0.0
        self._stockout_days = 0
        self._price_level = 1
        self._history.clear()
        return self._observation(), {}

    def step(
        self, action: np.int64 | int
    ) -> tuple[NDArray[np.float32], float, bool, bool, dict[str, Any]]:
        """Place the day's order, set the price, serve the day's demand."""
        order_level, price_level = divmod(int(action), len(PRICE_LEVELS))
        if not 0 <= order_level < len(ORDER_LEVELS):
            raise ValueError(f"'action' must be in 0..{_N_ACTIONS - 1} (got {action!r}).")
        quantity = self._order_quantities[order_level]
        price = self._prices[price_level]
        self._price_level = price_level

        self._pipeline.append(quantity)
        arrived = self._pipeline.popleft()
        stock = self._on_hand + arrived
        written_off = max(0, stock - self.capacity)
        stock -= written_off
        mean_demand = (
            self.demand_scale * self._season(self._day) * self._price_response[price_level]
        )
        demand = int(self.np_random.poisson(mean_demand))
        sales = min(demand, stock)
        lost = demand - sales
        stock -= sales

        revenue = price * sales
        ordering_cost = (ORDER_FIXED_COST + UNIT_COST * quantity) if quantity else 0.0
        holding_cost = HOLDING_COST * stock
        stockout_cost = STOCKOUT_PENALTY * lost
        profit = revenue - ordering_cost - holding_cost - stockout_cost

        self._on_hand = stock
        self._last_lost = lost
        self._profit += profit
        self._stockout_days += lost > 0
        self._day += 1
        self._history.append((stock, demand, lost))
        truncated = self._day >= self.horizon
        info: dict[str, Any] = {
            "demand": demand,
            "sales": sales,
            "lost_sales": lost,
            "arrived": arrived,
            "written_off": written_off,
            "revenue": revenue,
            "ordering_cost": ordering_cost,
            "holding_cost": holding_cost,
            "stockout_cost": stockout_cost,
        }
        if truncated:
            info["profit"] = self._profit
            info["stockout_days"] = self._stockout_days
            info["success"] = self._stockout_days == 0 and self._profit > self.profit_threshold
        return self._observation(), profit, False, truncated, info

    def render(self) -> NDArray[np.uint8] | None:
        """Chart of the last 60 days: stock left (blue), demand (black ticks), stock-outs (red)."""
        if self.render_mode is None:
            gym.logger.warn("render() called without a render_mode; pass render_mode='rgb_array'.")
            return None
        return self._draw()

    def _season(self, day: int) -> float:
        a = self.seasonality
        weekly = 1.0 + a * math.sin(_TWO_PI * (day + self._week_phase) / 7.0)
        annual = 1.0 + a * math.sin(_TWO_PI * (day + self._year_phase) / 365.0)
        return weekly * annual

    def _observation(self) -> NDArray[np.float32]:
        scale = self.demand_scale
        day = self._day
        pipeline = self._pipeline
        week_angle = _TWO_PI * ((day + self._week_phase) % 7) / 7.0
        year_angle = _TWO_PI * ((day + self._year_phase) % 365) / 365.0
        return np.array(
            [
                self._on_hand / scale,
                sum(pipeline) / scale,
                (pipeline[0] if pipeline else 0) / scale,
                self._season(day),
                sum(self._season(day + ahead) for ahead in range(self.lead_time + 1)),
                math.sin(week_angle),
                math.cos(week_angle),
                math.sin(year_angle),
                math.cos(year_angle),
                max(0.0, 1.0 - day / self.horizon),
                min(self._last_lost / scale, MAX_LOST_FEATURE),
            ],
            dtype=np.float32,
        )

    def _draw(self) -> NDArray[np.uint8]:
        frame = _render.blank_frame()
        _render.draw_text(frame, 6, 8, f"DAY {self._day}/{self.horizon}")
        profit = f"PROFIT {self._profit:.0f}"
        _render.draw_text(frame, 6, _render.FRAME_WIDTH - 8 - _render.text_width(profit), profit)
        price = self._prices[self._price_level]
        _render.draw_text(frame, 24, 8, f"PRICE {price:.2f}  ON ORDER {sum(self._pipeline)}")
        _render.draw_text(frame, 42, 8, f"STOCKOUT DAYS {self._stockout_days}", _render.RED)

        top, left, height, width = 62, 10, 146, 300
        _render.fill_rect(frame, top, left, height, width, _render.LIGHT_GREY)
        day_width = width // _HISTORY_DAYS
        peak = max([4.0 * self.demand_scale] + [max(s, d) for s, d, _ in self._history])
        for i, (stock, demand, lost) in enumerate(self._history):
            x = left + i * day_width
            bar_height = int(round(height * stock / peak))
            _render.fill_rect(
                frame, top + height - bar_height, x, bar_height, day_width - 1, _render.BLUE
            )
            demand_y = top + height - int(round(height * demand / peak))
            _render.fill_rect(frame, demand_y - 1, x, 2, day_width, _render.BLACK)
            if lost:
                _render.fill_rect(frame, top + height + 2, x, 6, day_width, _render.RED)

        _render.draw_text(frame, 222, 10, "STOCK", _render.BLUE)
        _render.draw_text(frame, 222, 70, "DEMAND", _render.BLACK)
        _render.draw_text(frame, 222, 138, "LOST SALES", _render.RED)
        return frame
