"""A success flag given as a one-element array or tensor is read; one that is no number is an alarm.

``scalar_info`` kept only Python and numpy scalars: ``info["is_success"] = torch.tensor(win)``
and ``info["success"] = np.array([win])`` were dropped, every row's ``success`` was None and the
report's success rate disappeared (a plain loop reads 0.40 on the planted ``InfoSuccess``), with
no word of why. The sandbox computes the same ``info`` and sends it over the wire: both levels
must agree.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import gymnasium as gym
import pyarrow as pa
import pytest

from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.policy import LoadedPolicy
from evalfleet.records import records_to_table
from evalfleet.report import aggregate
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox import open_slots
from evalfleet.seeds import SeedLedger
from tests.core import quirky_envs as qe

LEVELS = ["inprocess", pytest.param("process", marks=pytest.mark.slow)]
N = 10


def _table(kwargs: dict[str, Any], level: str) -> pa.Table:
    resolved = resolve_env(qe.INFO_SUCCESS, kwargs, None)
    policy = LoadedPolicy(qe.one, gym.spaces.Discrete(2), is_torch=False, deterministic=True,
                          device="cpu")
    box = open_slots(level, env_thunk(qe.INFO_SUCCESS, kwargs, None), 4, episode_timeout_s=60.0,
                     env_spec=resolved.fingerprint.as_dict())
    ledger = SeedLedger(0)
    try:
        records = run_shard([(i, ledger.seed(i)) for i in range(N)], box, policy,
                            EpisodeContext("r", "s", qe.INFO_SUCCESS, "h", "w"))
    finally:
        box.close()
    return records_to_table(records).sort_by("episode_index")


def _report(table: pa.Table) -> EvalReport:
    request = EvalRequest(env=qe.INFO_SUCCESS, policy="x", episodes=table.num_rows, seed=0)
    return aggregate(request, table, env_spec={"env_id": qe.INFO_SUCCESS}, env_spec_hash="spec",
                     policy={"sha256": "ab" * 32}, isolation="inprocess", timings={"run": 1.0},
                     cache={"status": "miss"}, run_seconds=1.0)


def _plain_wins(seeds: list[int]) -> list[bool]:
    wins = []
    for seed in seeds:
        env = gym.make(qe.INFO_SUCCESS, disable_env_checker=True)
        obs, _ = env.reset(seed=seed)
        done = False
        while not done:
            obs, _, terminated, truncated, _ = env.step(1)
            done = terminated or truncated
        wins.append(qe.win_of(obs))
    return wins


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kwargs", [{"mode": "torch", "key": "is_success"}, {"mode": "arr1"},
                                    {"mode": "torch"}], ids=["torch-is_success", "array", "torch"])
def test_a_one_element_array_or_tensor_is_a_flag(level: str, kwargs: dict[str, Any]) -> None:
    table = _table(kwargs, level)
    wins = _plain_wins(table.column("seed").to_pylist())
    assert sum(wins) == 4  # the plain loop's 0.40
    assert table.column("success").to_pylist() == wins
    assert table.column("metrics").to_pylist() == [[]] * N
    report = _report(table)
    assert report.success is not None and report.success["rate"] == 0.4
    assert not [a for a in report.alarms if a.startswith("success_")]


@pytest.mark.parametrize("level", LEVELS)
def test_a_flag_that_is_no_number_is_named_in_its_row_and_an_alarm(level: str) -> None:
    for mode, what in (("str", "str"), ("arr2", "ndarray(2,) bool")):
        table = _table({"mode": mode}, level)
        assert table.column("success").to_pylist() == [None] * N
        # Each row says which flag could not be read, and what it was.
        assert table.column("metrics").to_pylist() == [[(f"unreadable_flag:success:{what}", 1.0)]] * N
        report = _report(table)
        assert report.success is None
        assert (f"success_unreadable: {N} of {N} episodes put a success flag in their final info "
                f"that is not one number ('success' as {what}: {N}); those rows have no success (a "
                "bool, a number, or a one-element array or tensor of one is read)") in report.alarms


def test_reading_flags_imports_no_torch() -> None:
    code = ("import sys, numpy as np\n"
            "from evalfleet.sandbox.slots import scalar_info\n"
            "out = scalar_info({'success': np.array([True]), 'x': 'text', 'is_success': [1]})\n"
            "assert 'torch' not in sys.modules\n"
            "print(sorted(out.items()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ("[('success', 1.0), ('unreadable_flag:is_success:list', 1.0)]")

