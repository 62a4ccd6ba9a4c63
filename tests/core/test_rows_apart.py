"""A torch policy whose rows depend on the other rows of its batch is refused, never padded.

``module.eval()`` does not reach into a graph traced in training mode: BatchNorm's batch
statistics (and Dropout's masks) are baked in. Such a CartPole controller gave row 0 a logit of
0.09 alone and 7.9 in a batch of 8; its mean return was 9.25 at ``--concurrency 1`` with no
alarm (the same weights traced in eval mode: 239.8). The block check saw the rows move and padded
every block to 256 rows of copies, which fed the BatchNorm statistics and hid it.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import envs  # noqa: F401  (registers the environments)
from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.errors import PolicyError
from evalfleet.policy import CALLABLE_ROWS_CHECK_S, load_policy, pad_rows, receive_policy
from evalfleet.records import records_to_table
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.seeds import SeedLedger
from tests.conftest import EXAMPLE_POLICY

CARTPOLE = gym.make("CartPole-v1")
#: The rows the check runs (``policy.check_rows``): the first 8 of 256 uniform in [0, 1), seed 0.
ROWS = np.random.default_rng(0).random((256, 4), dtype=np.float32)[:8]


def _batch_norm_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 2))


def _dropout_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                               torch.nn.Linear(64, 2))


class _BatchScaled(torch.nn.Module):
    """Normalises each observation feature over the batch: a row's logits follow the others."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x - x.mean(0)) / (x.std(0, unbiased=False) + 1e-3))


def _traced(net: torch.nn.Module, train: bool) -> torch.jit.ScriptModule:
    net.train(train)
    example = torch.from_numpy(np.random.default_rng(1).random((8, 4), dtype=np.float32))
    return torch.jit.trace(net, example, check_trace=False)


def _save(module: torch.jit.ScriptModule, tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    torch.jit.save(module, str(path))
    return str(path)


PLANTED = {
    "batchnorm_traced_in_train_mode": lambda: _traced(_batch_norm_net(), train=True),
    "dropout_traced_in_train_mode": lambda: _traced(_dropout_net(), train=True),
    "normalised_over_the_batch": lambda: torch.jit.script(_BatchScaled().eval()),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_policy_whose_rows_depend_on_the_batch_is_refused_at_stage_one(tmp_path, name) -> None:
    path = _save(PLANTED[name](), tmp_path, f"{name}.pt")
    with pytest.raises(PolicyError) as caught:
        receive_policy(path, None, CARTPOLE.observation_space, CARTPOLE.action_space)
    text = str(caught.value)
    assert text.startswith(f"policy {path!r}: a row's outputs depend on the other rows of its batch: "
                           "row 0's outputs alone are [")
    assert "in a batch of 8 rows [" in text
    assert "BatchNorm or Dropout in training mode in a traced or scripted module" in text
    assert "normalisation over the batch" in text
    assert "Call module.eval() before torch.jit.trace" in text
    moved = float(re.search(r"a difference of ([0-9.e+-]+) relative", text).group(1))  # type: ignore[union-attr]
    assert moved > 1e-2  # far above the 1e-4 allowed, let alone a kernel's last bits
    assert "at most 0.0001 is allowed" in text


def test_the_refusal_shows_row_zero_alone_and_in_the_batch(tmp_path) -> None:
    traced = _traced(_batch_norm_net(), train=True)
    path = _save(traced, tmp_path, "bn.pt")
    with torch.no_grad():
        alone = traced(torch.from_numpy(np.repeat(ROWS[:1], 8, axis=0)))[0].numpy()
        together = traced(torch.from_numpy(ROWS))[0].numpy()
    assert np.abs(alone - together).max() > 0.1
    with pytest.raises(PolicyError) as caught:
        receive_policy(path, None, CARTPOLE.observation_space, CARTPOLE.action_space)
    assert (f"row 0's outputs alone are {np.array2string(alone, precision=4)}, in a batch of 8 rows "
            f"{np.array2string(together, precision=4)}") in str(caught.value)


def test_the_same_weights_traced_in_eval_mode_pass(tmp_path) -> None:
    path = _save(_traced(_batch_norm_net(), train=False), tmp_path, "bn_eval.pt")
    art = receive_policy(path, None, CARTPOLE.observation_space, CARTPOLE.action_space)
    assert art.output_kind == "logits"


def _mlp(sizes: tuple[int, ...]) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


@pytest.mark.parametrize("hidden", [(16,), (64, 64), (256, 256), (512,)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_mlps_pass(tmp_path, hidden, deterministic) -> None:
    path = _save(torch.jit.script(_mlp((4, *hidden, 2))), tmp_path, "mlp.pt")
    art = receive_policy(path, None, CARTPOLE.observation_space, CARTPOLE.action_space,
                         deterministic=deterministic)
    assert art.output_kind == "logits"
    box = gym.make("Pendulum-v1")
    path = _save(torch.jit.script(_mlp((3, *hidden, 1))), tmp_path, "box.pt")
    assert receive_policy(path, None, box.observation_space, box.action_space).output_kind == "actions"


def test_a_state_dict_with_batch_norm_passes_its_factory_module_is_put_in_eval_mode(tmp_path) -> None:
    path = tmp_path / "bn_sd.pt"
    torch.save(_batch_norm_net().state_dict(), path)
    art = receive_policy(str(path), f"{__name__}:_batch_norm_net", CARTPOLE.observation_space,
                         CARTPOLE.action_space)
    assert art.format == "state_dict"


@pytest.mark.parametrize("env_id,policy", [
    ("CartPole-v1", EXAMPLE_POLICY),
    ("evalfleet/Recommend-v0", "envs.reference_policies:recommend_heuristic"),
    ("evalfleet/Inventory-v0", "envs.reference_policies:inventory_heuristic"),
    ("evalfleet/ConnectFour-v0", "envs.reference_policies:connect_four_heuristic"),
])
def test_the_bundled_example_and_the_reference_policies_pass(env_id, policy) -> None:
    env = gym.make(env_id)
    receive_policy(policy, None, env.observation_space, env.action_space)


def test_the_block_check_refuses_rows_that_depend_on_the_batch_instead_of_padding() -> None:
    def below_the_top(x: np.ndarray) -> np.ndarray:
        return x[:, :2] - x[:, :2].max(axis=0)

    together = np.array2string(ROWS[0, :2] - ROWS[:, :2].max(axis=0), precision=4)
    with pytest.raises(ValueError) as caught:
        pad_rows(below_the_top, (4,))
    assert (f"row 0's outputs alone are [0. 0.], in a batch of 8 rows {together} "
            "(a difference of ") in str(caught.value)


def test_a_policy_loaded_unchecked_ends_its_episodes_as_the_policys_error(tmp_path) -> None:
    # As a worker loads it (stage 1 is the driver's): the first forward refuses, not pads.
    path = _save(_traced(_batch_norm_net(), train=True), tmp_path, "bn.pt")
    resolved = resolve_env("CartPole-v1", {}, None)
    policy = load_policy("torchscript", Path(path).read_bytes(), None, path, resolved.action_space)
    ledger = SeedLedger(0)
    records = run_shard([(i, ledger.seed(i)) for i in range(6)],
                        InProcessSlots(env_thunk("CartPole-v1", {}, None), 3), policy,
                        EpisodeContext("r", "sha", "CartPole-v1", "s", "w"))
    table = records_to_table(records)
    assert table.column("end_reason").to_pylist() == ["policy_error"] * 6
    assert table.column("length").to_pylist() == [0] * 6
    assert all("a row's outputs depend on the other rows of its batch" in e
               for e in table.column("error").to_pylist())


def push_against_the_batch(obs: np.ndarray) -> np.ndarray:
    """A callable CartPole controller that centres the pole angle on its batch's mean."""
    return ((obs[:, 2] - obs[:, 2].mean()) > 0).astype(np.int64)


_calls = [0]


def push_by_call_count(obs: np.ndarray) -> np.ndarray:
    """A callable that changes with its calls, not with its batch: the audit's to report."""
    _calls[0] += 1
    return np.full(len(obs), _calls[0] % 2, dtype=np.int64)


def push_alone(obs: np.ndarray) -> np.ndarray:
    """Each row on its own."""
    return (obs[:, 2] > 0).astype(np.int64)


def test_a_callable_whose_rows_depend_on_the_batch_is_refused_at_stage_one() -> None:
    # Its actions followed --concurrency: the same request scored differently with the number
    # of envs a shard runs at once, with no alarm (the check ran for torch policies only).
    source = f"{__name__}:push_against_the_batch"
    with pytest.raises(PolicyError) as caught:
        receive_policy(source, None, CARTPOLE.observation_space, CARTPOLE.action_space)
    assert str(caught.value).startswith(
        f"policy {source!r}: a row's outputs depend on the other rows of its batch: "
        "row 2's outputs alone are [0], in a batch of 8 rows [1]")
    assert "normalisation over the batch in forward (x - x.mean(0))" in str(caught.value)


@pytest.mark.parametrize("name", ["push_alone", "push_by_call_count"])
def test_callables_with_rows_apart_or_that_change_per_call_pass_stage_one(name) -> None:
    art = receive_policy(f"{__name__}:{name}", None, CARTPOLE.observation_space, CARTPOLE.action_space)
    assert art.format == "callable" and art.output_kind == "actions"


def push_hanging_off_zero(obs: np.ndarray) -> np.ndarray:
    """Each row on its own, but any row away from the dummy batch's zeros hangs (for 60 s)."""
    if obs.any():
        threading.Event().wait(60)
    return (obs[:, 2] > 0).astype(np.int64)


def test_a_callable_that_hangs_on_the_check_rows_is_not_waited_for() -> None:
    t0 = time.perf_counter()
    art = receive_policy(f"{__name__}:push_hanging_off_zero", None, CARTPOLE.observation_space,
                         CARTPOLE.action_space)
    assert art.format == "callable"
    assert time.perf_counter() - t0 < CALLABLE_ROWS_CHECK_S + 5
