"""What every sandbox backend shares: the ``EnvSlots`` protocol and the ``SlotOutcome`` it returns.

The backends (:mod:`evalfleet.sandbox.base` in-process, :mod:`evalfleet.sandbox.process` in
sandbox processes) and the fork server's sandboxes (:mod:`evalfleet.sandbox.forkserver`) import
from here, never from each other.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from evalfleet.redaction import redact


@dataclass(slots=True)
class SlotOutcome:
    """What one reset or step of one slot produced.

    ``failure`` is set (to an ``EndReason`` value) when the env could not produce a step; the
    slot's env is then unusable until ``recreate``.
    """

    obs: Any = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    error: str | None = None


def scalar_info(info: dict[str, Any]) -> dict[str, float]:
    """The scalar (bool/int/float) entries of an ``info`` dict, as floats.

    A 0-d numpy array of a number (``flag.numpy()`` of a 0-d torch tensor, ``np.asarray(x)``) is
    a scalar too: left out, an env's ``is_success`` of that form read as no answer.
    """
    out: dict[str, float] = {}
    for key, value in info.items():
        if isinstance(value, bool | int | float | np.bool_ | np.integer | np.floating) or (
                isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf"):
            out[key] = float(value)
    return out


def obs_shape_error(shape: tuple[int, ...], expected: tuple[int, ...], when: str) -> str:
    """The error text of an observation (``when``: ``"at reset"``, ``"at step k"``) of the wrong shape.

    Written into a float32 row, numpy broadcast a shape-``(1,)`` observation into all 4 elements
    of a ``(4,)`` row: the policy acted on values the env never produced.
    """
    return (f"observation of shape {tuple(shape)} {when}, expected {tuple(expected)}: an "
            "observation of another shape than the observation space's is never broadcast or "
            "reshaped to fit it")


#: Most characters of an error text in a row.
ERROR_CHARS = 500


def error_text(err: BaseException) -> str:
    """``Type: message (at file:line)`` — short and groupable by signature."""
    tb = traceback.extract_tb(err.__traceback__)
    where = redact(f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})") if tb else ""
    # Scrubbed before it is cut: a secret cut in half would no longer match. The message is cut,
    # never the location: failure clusters group by type and location, and a long message (an
    # array's repr) cut at the end lost it, so one bug became a cluster per episode.
    text = redact(f"{type(err).__name__}: {err}")
    room = ERROR_CHARS - len(where)
    return (text if len(text) <= room else f"{text[:room - 3]}...") + where


def is_finite(x: float) -> bool:
    """True for a finite float (rewards must be)."""
    return math.isfinite(x)


class EnvSlots(Protocol):
    """``n`` env instances at one isolation level, reset and stepped by slot number."""

    isolation: str
    n: int

    def reset(self, slot: int, seed: int) -> SlotOutcome:
        """Reset ``slot``'s env with exactly ``seed``."""

    def reset_many(self, items: Sequence[tuple[int, int]]) -> list[SlotOutcome]:
        """Reset several ``(slot, seed)`` pairs (in parallel where the backend can)."""

    def step_many(self, slots: Sequence[int], actions: Sequence[Any]) -> list[SlotOutcome]:
        """Step several slots, one action each (in parallel where the backend can)."""

    def sandbox_name(self, slot: int) -> str:
        """A label for the sandbox hosting ``slot`` (for the episode row)."""

    def close(self) -> None:
        """Release every env instance and process."""


@runtime_checkable
class BatchEnvSlots(EnvSlots, Protocol):
    """``EnvSlots`` that also step many slots with arrays in and out: the runner's fast path.

    ``step_batch(slots, actions, obs_out)`` steps each slot of ``slots`` (ascending slot numbers)
    with its row of ``actions`` — int64 action indices for a ``Discrete`` space (each env gets
    ``int(a)``), rows of the space's dtype for a ``Box`` space (each env gets the row array) —
    exactly as ``step_many`` would. It writes the observation of every row whose episode goes on
    into ``obs_out[slot]`` (one whose shape is not exactly the row's fails its row as
    ``env_error``, ``obs_shape_error``'s text: never broadcast) and returns the float64 rewards
    (one per row) and, keyed by row position, a ``SlotOutcome`` for every row that terminated,
    truncated or failed.
    """

    def step_batch(
        self,
        slots: npt.NDArray[np.intp],
        actions: npt.NDArray[Any],
        obs_out: npt.NDArray[np.float32],
    ) -> tuple[npt.NDArray[np.float64], dict[int, SlotOutcome]]:
        """Step ``slots`` with ``actions``; observations into ``obs_out``, rewards and ends out."""
