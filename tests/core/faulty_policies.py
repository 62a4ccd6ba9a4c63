"""Callable CartPole policies with planted faults ('tests.core.faulty_policies:...').

Each faulty policy is a clean one plus a fault that fires when an observation row of the batch
satisfies a condition (the cart far to the right) that only some episodes ever reach.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from tests.conftest import EXAMPLE_POLICY

#: Set by the tests once they are done: a hung forward then returns (its result is discarded).
RELEASE = threading.Event()

#: Cart positions past which the faults fire (reached by 5 of the first 24 ledger seeds with
#: ``angle``, 3 of the first 16 with ``mlp``).
ANGLE_FAR, MLP_FAR = 0.22, 0.45

_MLP = torch.jit.load(EXAMPLE_POLICY)


def angle(obs: np.ndarray) -> np.ndarray:
    """Push toward the pole's lean: episodes of 25-71 steps."""
    return (obs[:, 2] > 0).astype(np.int64)


def mlp(obs: np.ndarray) -> np.ndarray:
    """The bundled TorchScript MLP, argmax: a float32 matmul whose batch size varies."""
    with torch.inference_mode():
        return _MLP(torch.from_numpy(np.ascontiguousarray(obs))).argmax(1).numpy()


def angle_raises_far(obs: np.ndarray) -> np.ndarray:
    """``angle``, raising for the whole batch when one row's cart is past ``ANGLE_FAR``."""
    if (obs[:, 0] > ANGLE_FAR).any():
        raise RuntimeError(f"cart past {ANGLE_FAR}")
    return angle(obs)


def mlp_raises_far(obs: np.ndarray) -> np.ndarray:
    """``mlp``, raising for the whole batch when one row's cart is past ``MLP_FAR``."""
    if (obs[:, 0] > MLP_FAR).any():
        raise RuntimeError(f"cart past {MLP_FAR}")
    return mlp(obs)


def angle_misshapes_far(obs: np.ndarray) -> np.ndarray:
    """``angle``, one action short for a batch with a row past ``ANGLE_FAR`` (alone: shape (1, 2))."""
    actions = angle(obs)
    if (obs[:, 0] > ANGLE_FAR).any():
        return actions[:-1] if len(actions) > 1 else np.ones((1, 2), dtype=np.int64)
    return actions


def angle_hangs_far(obs: np.ndarray) -> np.ndarray:
    """``angle``, hanging (until ``RELEASE``) when one row's cart is past ``ANGLE_FAR``."""
    if (obs[:, 0] > ANGLE_FAR).any():
        RELEASE.wait(120)
    return angle(obs)


def release() -> None:
    """Let hung forwards of this process return (called on Dask workers by ``client.run``)."""
    RELEASE.set()


def far(obs: np.ndarray, threshold: float) -> bool:
    """The fault condition on one observation."""
    return bool(np.asarray(obs, dtype=np.float32)[0] > threshold)
