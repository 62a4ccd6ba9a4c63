"""A simulated user session fed one recommendation per step (``evalfleet/Recommend-v0``)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Final

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from numpy.typing import NDArray

from envs import _render

# User model. Utility of item i for the user:
#   AFFINITY_WEIGHT * (n_features * <u, x_i> - 1) - BOREDOM_WEIGHT * <b, x_i>
#   - REPEAT_PENALTY * exp(-(steps since i was last shown) / REPEAT_MEMORY) + BIAS + noise
BIAS: Final = 1.0
AFFINITY_WEIGHT: Final = 1.5
BOREDOM_WEIGHT: Final = 4.0
BOREDOM_DECAY: Final = 0.7
REPEAT_PENALTY: Final = 3.0
REPEAT_MEMORY: Final = 4.0
PREFERENCE_CONCENTRATION: Final = 0.3
"""Dirichlet concentration of user preferences: below 1, most users favour one or two topics."""
DOMINANT_TOPIC_WEIGHT: Final = 0.6
"""Share of an item's topic mix on its dominant topic ``i % n_features``."""
DISSATISFACTION_DECAY: Final = 0.8
CHURN_BASE: Final = 0.002
CHURN_GAIN: Final = 0.5
CHURN_EXPONENT: Final = 4
ESTIMATE_PRIOR_MEAN: Final = 0.6
"""Optimistic prior of the per-topic engagement estimate: untried topics look worth a try."""
ESTIMATE_PRIOR_WEIGHT: Final = 1.0
COUNT_SCALE: Final = 100.0

_HISTORY_LEN: Final = 20


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


class RecommendEnv(gym.Env[NDArray[np.float32], np.int64]):
    """One user's session on a video platform, one recommendation per step.

    ## Description
    The catalogue holds ``n_items`` items. Item ``i`` has a latent topic mix ``x_i`` over
    ``n_features`` topics (a point of the simplex whose dominant topic is ``i % n_features``,
    weight at least ``DOMINANT_TOPIC_WEIGHT``), a duration in minutes and a latent quality. The
    catalogue is generated from ``catalogue_seed`` and is the same in every episode.

    Each episode draws a user from the population: a preference vector ``u`` over topics
    (Dirichlet with ``PREFERENCE_CONCENTRATION``) and an initial dissatisfaction. The user's
    utility for an item grows with ``<u, x_i>`` and shrinks with boredom (``b``, an exponentially
    decayed mix of the topics recently recommended, so similar items lose appeal) and with a
    penalty for items shown in the last few steps (repeats). Gaussian noise of scale
    ``user_noise`` is added. The user clicks with probability ``sigmoid(utility)`` and watches
    ``sigmoid(utility + quality)`` of the item. Dissatisfaction is an exponential average of
    ``1 - engagement`` (engagement = clicked * fraction watched) and the user leaves with
    probability ``CHURN_BASE + CHURN_GAIN * dissatisfaction ** CHURN_EXPONENT`` after each step
    (steeply convex: a content user rarely leaves, a bored one soon does).

    ## Action Space
    ``Discrete(n_items)``: the item to recommend.

    ## Observation Space
    ``Box(0, 1, (3 * n_features + 3,), float32)``, a fixed-size summary of what the platform has
    logged (the user's latent preferences are not observed). With ``K = n_features``:

    | Index       | Observation                                                              |
    |-------------|--------------------------------------------------------------------------|
    | 0 .. K-1    | engagement estimate per topic: topic-weighted mean engagement, shrunk    |
    |             | towards an optimistic prior ``ESTIMATE_PRIOR_MEAN``                      |
    | K .. 2K-1   | boredom per topic (``b``): decayed share of recent recommendations       |
    | 2K .. 3K-1  | recommendations so far whose dominant topic is k, / ``COUNT_SCALE``,     |
    |             | clipped to 1                                                             |
    | 3K          | satisfaction: ``1 - dissatisfaction``                                    |
    | 3K + 1      | 1 if the last recommendation was clicked                                 |
    | 3K + 2      | fraction of the last recommendation watched (0 if not clicked)           |

    ## Rewards
    Engagement of the step: minutes watched, ``clicked * fraction * duration`` (durations are
    2 to 10 minutes).

    ## Starting State
    A fresh user drawn from ``self.np_random``: no history, zero boredom, the prior estimate for
    every topic, initial dissatisfaction uniform in [0.1, 0.4].

    ## Episode End
    Terminated when the user churns; truncated by the registered ``max_episode_steps=100``
    (the session cap). ``info`` of every step holds ``"clicked"`` (bool), ``"watch_time"``
    (minutes) and ``"churn_probability"``.

    ## Arguments
    ```python
    gymnasium.make("evalfleet/Recommend-v0", n_items=50, n_features=5, user_noise=0.5,
                   catalogue_seed=0, render_mode=None)
    ```
    * ``n_items``: catalogue size (at least ``n_features``).
    * ``n_features``: number of latent topics.
    * ``user_noise``: standard deviation of the noise on the user's utility.
    * ``catalogue_seed``: seed of the catalogue (topic mixes, durations, qualities).
    * ``render_mode``: None or ``"rgb_array"`` (240x320x3 uint8: recent recommendations,
      per-topic preference/estimate/boredom bars, satisfaction).

    ## Version History
    * v0: Initial version.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(
        self,
        n_items: int = 50,
        n_features: int = 5,
        user_noise: float = 0.5,
        catalogue_seed: int = 0,
        render_mode: str | None = None,
    ) -> None:
        if n_features < 1:
            raise ValueError(f"'n_features' must be >= 1 (got {n_features!r}).")
        if n_items < n_features:
            raise ValueError(
                f"'n_items' must be >= n_features={n_features} so every topic has an item "
                f"(got {n_items!r})."
            )
        if not user_noise >= 0:
            raise ValueError(f"'user_noise' must be >= 0 (got {user_noise!r}).")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"Unknown render_mode {render_mode!r}. Choose None or 'rgb_array'.")
        self.n_items = n_items
        self.n_features = n_features
        self.user_noise = float(user_noise)
        self.catalogue_seed = catalogue_seed
        self.render_mode = render_mode

        # The catalogue has its own generator: it must not change with the episode seed.
        catalogue_rng = np.random.default_rng(catalogue_seed)
        dominant = np.arange(n_items) % n_features
        mix = (1.0 - DOMINANT_TOPIC_WEIGHT) * catalogue_rng.dirichlet(
            np.full(n_features, 0.5), size=n_items
        )
        mix[np.arange(n_items), dominant] += DOMINANT_TOPIC_WEIGHT
        self.item_topics: NDArray[np.float64] = mix
        self.item_durations: NDArray[np.float64] = catalogue_rng.uniform(2.0, 10.0, size=n_items)
        self.item_quality: NDArray[np.float64] = catalogue_rng.normal(0.0, 0.5, size=n_items)
        # Plain-Python copies for the per-step hot path (tiny vectors: numpy calls would dominate).
        self._mix_rows: list[list[float]] = mix.tolist()
        self._durations: list[float] = self.item_durations.tolist()
        self._quality: list[float] = self.item_quality.tolist()
        self._dominant: list[int] = dominant.tolist()

        self.action_space = spaces.Discrete(n_items)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(3 * n_features + 3,), dtype=np.float32)

        self._preference: list[float] = [1.0 / n_features] * n_features
        self._boredom: list[float] = [0.0] * n_features
        self._engagement_sum: list[float] = [0.0] * n_features
        self._exposure: list[float] = [0.0] * n_features
        self._counts: list[int] = [0] * n_features
        self._last_shown: dict[int, int] = {}
        self._dissatisfaction = 0.0
        self._last_clicked = 0.0
        self._last_fraction = 0.0
        self._step = 0
        self._total_watch = 0.0
        self._churn_probability = 0.0
        # (item, fraction watched or -1 if skipped) of the latest steps, for render().
        self._history: deque[tuple[int, float]] = deque(maxlen=_HISTORY_LEN)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[NDArray[np.float32], dict[str, Any]]:
        """Draw a new user from the population; the catalogue stays as it is."""
        super().reset(seed=seed)
        k = self.n_features
        self._preference = self.np_random.dirichlet(np.full(k, PREFERENCE_CONCENTRATION)).tolist()
        self._dissatisfaction = float(self.np_random.uniform(0.1, 0.4))
        self._boredom = [0.0] * k
        self._engagement_sum = [0.0] * k
        self._exposure = [0.0] * k
        self._counts = [0] * k
        self._last_shown = {}
        self._last_clicked = 0.0
        self._last_fraction = 0.0
        self._step = 0
        self._total_watch = 0.0
        self._churn_probability = CHURN_BASE + CHURN_GAIN * self._dissatisfaction**CHURN_EXPONENT
        self._history.clear()
        return self._observation(), {}

    def step(
        self, action: np.int64 | int
    ) -> tuple[NDArray[np.float32], float, bool, bool, dict[str, Any]]:
        """Show item ``action``; the user may click, watch part of it, and leave."""
        item = int(action)
        if not 0 <= item < self.n_items:
            raise ValueError(f"'action' must be an item in 0..{self.n_items - 1} (got {action!r}).")
        mix = self._mix_rows[item]
        affinity = (
            self.n_features * sum(p * x for p, x in zip(self._preference, mix, strict=True)) - 1.0
        )
        boredom = sum(b * x for b, x in zip(self._boredom, mix, strict=True))
        utility = BIAS + AFFINITY_WEIGHT * affinity - BOREDOM_WEIGHT * boredom
        last = self._last_shown.get(item)
        if last is not None:
            utility -= REPEAT_PENALTY * math.exp((last - self._step) / REPEAT_MEMORY)
        utility += self.user_noise * float(self.np_random.standard_normal())
        click_draw, churn_draw = self.np_random.random(2).tolist()

        clicked = click_draw < _sigmoid(utility)
        fraction = _sigmoid(utility + self._quality[item]) if clicked else 0.0
        watch_time = fraction * self._durations[item]

        decay = BOREDOM_DECAY
        self._boredom = [
            decay * b + (1.0 - decay) * x for b, x in zip(self._boredom, mix, strict=True)
        ]
        self._engagement_sum = [
            s + fraction * x for s, x in zip(self._engagement_sum, mix, strict=True)
        ]
        self._exposure = [e + x for e, x in zip(self._exposure, mix, strict=True)]
        self._counts[self._dominant[item]] += 1
        self._last_shown[item] = self._step
        keep = DISSATISFACTION_DECAY
        self._dissatisfaction = keep * self._dissatisfaction + (1.0 - keep) * (1.0 - fraction)
        self._churn_probability = CHURN_BASE + CHURN_GAIN * self._dissatisfaction**CHURN_EXPONENT
        self._last_clicked = 1.0 if clicked else 0.0
        self._last_fraction = fraction
        self._step += 1
        self._total_watch += watch_time
        self._history.append((item, fraction if clicked else -1.0))

        terminated = churn_draw < self._churn_probability
        info = {
            "clicked": clicked,
            "watch_time": watch_time,
            "churn_probability": self._churn_probability,
        }
        return self._observation(), watch_time, terminated, False, info

    def render(self) -> NDArray[np.uint8] | None:
        """Recent recommendations, per-topic preference/estimate/boredom, and satisfaction."""
        if self.render_mode is None:
            gym.logger.warn("render() called without a render_mode; pass render_mode='rgb_array'.")
            return None
        return self._draw()

    def _estimates(self) -> list[float]:
        prior = ESTIMATE_PRIOR_WEIGHT * ESTIMATE_PRIOR_MEAN
        return [
            (s + prior) / (e + ESTIMATE_PRIOR_WEIGHT)
            for s, e in zip(self._engagement_sum, self._exposure, strict=True)
        ]

    def _observation(self) -> NDArray[np.float32]:
        counts = [min(1.0, c / COUNT_SCALE) for c in self._counts]
        return np.array(
            self._estimates()
            + self._boredom
            + counts
            + [1.0 - self._dissatisfaction, self._last_clicked, self._last_fraction],
            dtype=np.float32,
        )

    def _draw(self) -> NDArray[np.uint8]:
        frame = _render.blank_frame()
        _render.draw_text(frame, 6, 8, f"STEP {self._step}")
        watched = f"WATCHED {self._total_watch:.0f} MIN"
        _render.draw_text(frame, 6, _render.FRAME_WIDTH - 8 - _render.text_width(watched), watched)

        # Strip of recent recommendations: topic colour on top, fraction watched below.
        _render.draw_text(frame, 26, 8, "RECENT", _render.GREY)
        cell = 15
        for i, (item, fraction) in enumerate(self._history):
            left = 8 + i * cell
            colour = _render.PALETTE[self._dominant[item] % len(_render.PALETTE)]
            _render.fill_rect(frame, 42, left, 12, cell - 2, colour)
            _render.fill_rect(frame, 56, left, 24, cell - 2, _render.LIGHT_GREY)
            if fraction < 0:
                _render.fill_rect(frame, 66, left + 2, 4, cell - 6, _render.RED)
            else:
                filled = int(round(24 * fraction))
                _render.fill_rect(frame, 56 + 24 - filled, left, filled, cell - 2, _render.GREEN)

        # Per topic: latent preference (black), platform's estimate (topic colour), boredom (grey).
        _render.draw_text(frame, 90, 8, "PREFERENCE", _render.BLACK)
        _render.draw_text(frame, 90, 100, "ESTIMATE", _render.PALETTE[0])
        _render.draw_text(frame, 90, 174, "BOREDOM", _render.GREY)
        estimates = self._estimates()
        max_pref = max(self._preference) or 1.0
        rows = min(self.n_features, 6)
        for k in range(rows):
            top = 108 + k * 16
            colour = _render.PALETTE[k % len(_render.PALETTE)]
            _render.fill_rect(frame, top, 8, 12, 12, colour)
            _render.bar(frame, top, 28, 4, 280, self._preference[k] / max_pref, _render.BLACK)
            _render.bar(frame, top + 4, 28, 4, 280, estimates[k], colour)
            _render.bar(frame, top + 8, 28, 4, 280, self._boredom[k], _render.GREY)

        satisfaction = 1.0 - self._dissatisfaction
        _render.draw_text(frame, 206, 8, "SATISFACTION")
        _render.bar(
            frame,
            206,
            110,
            10,
            100,
            satisfaction,
            _render.GREEN if satisfaction > 0.5 else _render.RED,
        )
        churn = f"CHURN {100 * self._churn_probability:.0f}%"
        _render.draw_text(frame, 224, 8, churn, _render.RED)
        return frame
