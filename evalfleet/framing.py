"""Frames out of a sandbox: an env wrapper that packs observation and rendered frame together.

A ``process`` or ``bwrap`` sandbox answers with numeric arrays only (``evalfleet.sandbox.wire``:
never pickle from untrusted code), and sends ``info`` only at an episode's end. To replay an
episode inside a sandbox of the level it was evaluated at and still get its video, the env runs
wrapped in :class:`FramedEnv`, whose observation is one flat uint8 array::

    [obs_n, frame_h, frame_w] as 3 float64 | obs as obs_n float64 | frame as frame_h*frame_w*3 uint8

and :func:`unpack` splits it again on the worker. float64 holds every float32, float64 and
integer observation value exactly, so the policy sees the same float32 row as in the runner.
Packed flat, an observation would lose its shape, so one of another shape than the observation
space's is refused here, in the sandbox, as the runner refuses it (an ``env_error``).
This module imports only numpy, gymnasium, :mod:`evalfleet.environ` and :mod:`evalfleet.sandbox.slots`
(which the fork server has imported): it is what the sandbox has to import.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from evalfleet.environ import exported
from evalfleet.sandbox.slots import obs_shape_error

_HEADER = 3


class RenderFailed(RuntimeError):
    """``render()`` raised or returned no ``(H, W, 3)`` image (inside the sandbox)."""


def rgb_frame(frame: Any) -> npt.NDArray[np.uint8] | None:
    """An ``(H, W, 3)`` uint8 frame from what ``render()`` returned, or None if it is not one."""
    if frame is None:
        return None
    arr = np.asarray(frame)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4) or arr.shape[0] < 2 or arr.shape[1] < 2:
        return None
    if arr.dtype != np.uint8:
        if np.issubdtype(arr.dtype, np.floating) and arr.size and float(np.nanmax(arr)) <= 1.0:
            arr = arr * 255.0
        arr = np.clip(np.nan_to_num(arr), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(arr[:, :, :3])


class FramedEnv(gym.Wrapper[Any, Any, Any, Any]):
    """The wrapped env's observation, plus its rendered frame when ``render``, as one array."""

    def __init__(self, env: gym.Env[Any, Any], render: bool) -> None:
        super().__init__(env)
        self._render = render
        shape = env.observation_space.shape
        self._shape = None if shape is None else tuple(shape)
        self._t = 0

    def _pack(self, obs: Any) -> npt.NDArray[np.uint8]:
        got = np.shape(obs)
        if self._shape is not None and got != self._shape:
            raise ValueError(obs_shape_error(got, self._shape,
                                             f"at step {self._t}" if self._t else "at reset"))
        flat = np.asarray(obs, dtype=np.float64).reshape(-1)
        frame = None
        if self._render:
            try:
                with offscreen():
                    frame = rgb_frame(self.env.render())
            except Exception as err:
                raise RenderFailed(f"{type(err).__name__}: {err}") from err
            if frame is None:
                raise RenderFailed("render() returned no (H, W, 3) image")
        h, w = (frame.shape[0], frame.shape[1]) if frame is not None else (0, 0)
        head = np.array([flat.size, h, w], dtype=np.float64)
        parts = [head.view(np.uint8), flat.view(np.uint8)]
        if frame is not None:
            parts.append(frame.reshape(-1))
        return np.concatenate(parts)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
        """Reset, packing the first observation (and frame)."""
        obs, info = self.env.reset(seed=seed, options=options)
        self._t = 0
        return self._pack(obs), info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """Step, packing the next observation (and frame)."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._t += 1
        return self._pack(obs), reward, terminated, truncated, info


#: What SDL (pygame, the classic-control renderer) is told while evalfleet makes or renders an env
#: for frames: draw off-screen, make no sound (a worker or sandbox has no display).
OFFSCREEN = {"SDL_VIDEODRIVER": "dummy", "SDL_AUDIODRIVER": "dummy"}


@contextmanager
def offscreen() -> Iterator[None]:
    """``OFFSCREEN``'s variables not set already, within the block; the environment as it was after.

    Set for good, they stayed in the long-lived driver and workers after one video: the cache
    key's and the history protocol's environment (``SDL_VIDEODRIVER`` is keyed, an env may read
    it) then changed for every later sandboxed evaluation in that process, a miss and
    ``protocol_changed`` (gate exit 6) with nothing changed by the user, and the sandboxes saw it.
    """
    unset = {k: v for k, v in OFFSCREEN.items() if k not in os.environ}
    if not unset:
        yield
        return
    with exported(unset):
        yield


def framed_thunk(make: Callable[..., gym.Env[Any, Any]], render: bool) -> Callable[[], gym.Env[Any, Any]]:
    """A maker for the sandbox: ``make(render_mode=...)`` wrapped in ``FramedEnv``.

    ``make`` takes the render mode as its only keyword. SDL (pygame, the classic-control
    renderer) is told to draw off-screen while it makes and renders (``offscreen``).
    """

    def thunk() -> gym.Env[Any, Any]:
        if not render:
            return FramedEnv(make(render_mode=None), render)
        with offscreen():
            return FramedEnv(make(render_mode="rgb_array"), render)

    return thunk


def unpack(packed: Any, shape: tuple[int, ...] | None = None
           ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.uint8] | None]:
    """``(obs, frame or None)`` from a ``FramedEnv`` observation; raises ValueError if malformed.

    ``obs`` gets ``shape`` when it has that many elements (the observation space's shape).
    """
    raw = np.ascontiguousarray(np.asarray(packed, dtype=np.uint8).reshape(-1))
    if raw.size < 8 * _HEADER:
        raise ValueError(f"framed observation of {raw.size} bytes has no header")
    n, h, w = (int(x) for x in raw[: 8 * _HEADER].view(np.float64))
    end = 8 * _HEADER + 8 * n
    if n < 0 or h < 0 or w < 0 or raw.size != end + h * w * 3:
        raise ValueError(f"framed observation of {raw.size} bytes does not fit obs {n}, frame {h}x{w}")
    obs = raw[8 * _HEADER : end].view(np.float64).copy()
    if shape is not None and int(np.prod(shape)) == n:
        obs = obs.reshape(shape)
    frame = raw[end:].reshape(h, w, 3).copy() if h and w else None
    return obs, frame
