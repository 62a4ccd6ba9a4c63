"""What every sandbox backend shares: the ``EnvSlots`` protocol and the ``SlotOutcome`` it returns.

The backends (:mod:`evalfleet.sandbox.base` in-process, :mod:`evalfleet.sandbox.process` in
sandbox processes) and the fork server's sandboxes (:mod:`evalfleet.sandbox.forkserver`) import
from here, never from each other.
"""

from __future__ import annotations

import math
import sys
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


#: ``info`` keys read as the episode's success flag, in order (SB3 uses ``is_success``).
SUCCESS_KEYS = ("success", "is_success")

#: Start of the entry ``scalar_info`` puts for a success flag it cannot read:
#: ``unreadable_flag:<key>:<what the value was>`` = 1.0 (see ``unreadable_flag``).
UNREADABLE_FLAG = "unreadable_flag:"


def _number(value: Any) -> float | None:
    """``value`` as a float if it is one number (bool, int or float), else None.

    Python and numpy scalars, and a one-element numpy array or torch tensor of a bool, integer
    or float dtype (``np.array([done])``, ``torch.tensor(done)``): left out, an env's success flag
    of that form read as no answer, on every row, and the success rate disappeared.
    """
    if isinstance(value, bool | int | float | np.bool_ | np.integer | np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return float(value.reshape(-1)[0]) if value.size == 1 and value.dtype.kind in "biuf" else None
    torch = sys.modules.get("torch")  # no env returned a tensor if torch was never imported
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        try:
            return float(value.item())  # a GPU tensor is copied to the host
        except (RuntimeError, TypeError, ValueError):  # a meta tensor has no value
            return None
    return None


def _described(value: Any) -> str:
    """What a value is, briefly: ``str``, ``ndarray(2,) bool``, ``Tensor(2,) torch.bool``."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return type(value).__name__
    return f"{type(value).__name__}{tuple(shape)} {dtype}"


def unreadable_flag(key: str, value: Any) -> str:
    """The entry naming a success flag ``key`` whose ``value`` is not one number."""
    return f"{UNREADABLE_FLAG}{key}:{_described(value)}"


def scalar_info(info: dict[str, Any]) -> dict[str, float]:
    """The one-number entries of an ``info`` dict, as floats (see ``_number``).

    Other entries are left out, but a success flag (``SUCCESS_KEYS``) that is not one number
    (``"yes"``, a 2-element array) is not dropped in silence: an ``unreadable_flag(key, value)``
    entry of 1.0 takes its place, which the episode row keeps among its metrics and the report
    turns into the ``success_unreadable`` alarm. None is no answer, as a missing key.
    """
    out: dict[str, float] = {}
    for key, value in info.items():
        number = _number(value)
        if number is not None:
            out[key] = number
        elif key in SUCCESS_KEYS and value is not None:
            out[unreadable_flag(key, value)] = 1.0
    return out


def obs_shape_error(shape: tuple[int, ...], expected: tuple[int, ...], when: str) -> str:
    """The error text of an observation (``when``: ``"at reset"``, ``"at step k"``) of the wrong shape.

    Written into a float32 row, numpy broadcast a shape-``(1,)`` observation into all 4 elements
    of a ``(4,)`` row: the policy acted on values the env never produced.
    """
    return (f"observation of shape {tuple(shape)} {when}, expected {tuple(expected)}: an "
            "observation of another shape than the observation space's is never broadcast or "
            "reshaped to fit it")


#: Dtypes with finite values past float32's range (written into a float32 row they become inf).
WIDE_FLOATS = frozenset({np.dtype(np.float64), np.dtype(np.longdouble)})


def may_overflow(obs: Any) -> bool:
    """Whether ``obs`` may hold a finite value float32 cannot (a float64 array, a float, a list).

    Cheap, for the step path: a float32 or integer array never does, nor an ``int`` (a Discrete
    observation; one past 3.4e38 is no state of any env).
    """
    if type(obs) is np.ndarray:
        return obs.dtype in WIDE_FLOATS
    return type(obs) is not int


def overflow_text(row: npt.NDArray[np.float32], obs: Any, at: str) -> str | None:
    """Why an observation with finite elements past float32's range cannot be acted on, or None.

    ``row``: ``obs`` as written into the policy's float32 row (same shape). Such an element is
    inf there: fed on, a torch policy's logits had no finite maximum and the env's value was
    counted as the policy's error. An element the env gave as inf is left alone (a Box may allow it).
    """
    inf = np.isinf(row.ravel())
    if not inf.any():
        return None
    try:
        src = np.asarray(obs)
        src = (src if src.dtype.kind in "fiub" else src.astype(np.float64)).ravel()
        over = np.flatnonzero(inf & np.isfinite(src))
    except (TypeError, ValueError, OverflowError):
        return None
    if not over.size:
        return None
    values = ", ".join(f"{float(v):g}" for v in src[over[:3]])
    return (f"observation exceeds float32's range {at} (element(s) {over[:8].tolist()} of {inf.size}: "
            f"{values}): finite, past +-3.4e38, they would reach the policy as inf")


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
