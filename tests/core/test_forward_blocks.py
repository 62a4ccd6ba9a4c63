"""A row's action depends on its observation alone, not on how many rows share its forward.

Math libraries pick their kernels by a batch's row count, and the same row's outputs differ in
the last bits between counts. Unpadded, a torch Pendulum policy gave other returns with 3 slots
than with 16 (so the episode table changed with the worker count and concurrency), and a default
run with `--concurrency 7` raised false `non_deterministic_env` and `replay_nondeterminism`
alarms: replays (one row) did not reproduce their rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from evalfleet.policy import FORWARD_ROWS, PAD_ROWS, forward_in_blocks, load_policy, pad_rows
from tests.core.episodes import run_in_process


def _mlp(inputs: int, outputs: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(inputs, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, outputs))


class _Pendulum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp(3, 1)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.tanh(self.net(obs))


@pytest.fixture(scope="module")
def pendulum_policy(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("policy") / "pendulum.pt"
    torch.jit.save(torch.jit.script(_Pendulum()), str(path))
    return str(path)


def _torch_fn(path: str) -> object:
    import gymnasium as gym

    payload = Path(path).read_bytes()
    return load_policy("torchscript", payload, None, path, gym.spaces.Box(-2.0, 2.0, (1,), np.float32))


def test_each_row_is_the_same_at_any_batch_size(pendulum_policy: str) -> None:
    policy = _torch_fn(pendulum_policy)
    obs = np.random.default_rng(1).normal(size=(600, 3)).astype(np.float32)
    whole = policy.act(obs)  # type: ignore[attr-defined]
    for size in (1, 2, 3, 5, 7, 250, 255, 256, 257, 300, 513):
        got = np.concatenate([policy.act(obs[i:i + size]) for i in range(0, 600, size)])  # type: ignore[attr-defined]
        assert np.array_equal(got, whole), f"batches of {size} rows changed an output row"


def test_the_episode_table_does_not_depend_on_the_slot_count(pendulum_policy: str) -> None:
    tables = {slots: run_in_process("Pendulum-v1", pendulum_policy, 24, slots=slots)
              for slots in (1, 3, 16)}
    returns = {slots: t.column("return").to_pylist() for slots, t in tables.items()}
    assert returns[3] == returns[16] == returns[1]
    assert len(set(returns[16])) > 10  # varied episodes, so the comparison means something


def test_blocks_pad_to_the_multiple_and_drop_the_padding() -> None:
    seen: list[int] = []

    def run(x: np.ndarray) -> np.ndarray:
        seen.append(len(x))
        return x.sum(axis=1, keepdims=True)

    obs = np.arange(2 * (FORWARD_ROWS + 3), dtype=np.float32).reshape(-1, 2)
    out = forward_in_blocks(run, obs, PAD_ROWS)
    assert seen == [FORWARD_ROWS, PAD_ROWS]
    assert np.array_equal(out[:, 0], obs.sum(axis=1))
    seen.clear()
    forward_in_blocks(run, obs[:5], FORWARD_ROWS)
    assert seen == [FORWARD_ROWS]


def test_a_row_count_dependent_policy_pads_every_block_to_full_size() -> None:
    def by_count(x: np.ndarray) -> np.ndarray:  # adds the batch's size: never the same across counts
        return x[:, :1] + len(x)

    def row_wise(x: np.ndarray) -> np.ndarray:
        return x[:, :1] * 2.0

    def raises(x: np.ndarray) -> np.ndarray:
        raise IndexError("embedding index out of range")

    assert pad_rows(by_count, (3,)) == FORWARD_ROWS
    assert pad_rows(raises, (3,)) == FORWARD_ROWS
    assert pad_rows(row_wise, (3,)) == PAD_ROWS
    out = forward_in_blocks(by_count, np.zeros((5, 3), np.float32), FORWARD_ROWS)
    assert out[:, 0].tolist() == [float(FORWARD_ROWS)] * 5


def test_a_policy_that_returns_no_row_per_observation_is_an_error() -> None:
    with pytest.raises(ValueError, match="one output row per observation row"):
        forward_in_blocks(lambda x: x[:1], np.zeros((3, 2), np.float32), PAD_ROWS)


def test_a_policy_error_names_the_real_rows_not_the_padding() -> None:
    def narrow(x: np.ndarray) -> np.ndarray:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({len(x)}x4 and 8x2)")

    with pytest.raises(RuntimeError, match=r"\(3x4 and 8x2\)"):
        forward_in_blocks(narrow, np.zeros((3, 4), np.float32), PAD_ROWS)
