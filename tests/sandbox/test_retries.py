"""Infrastructure retries: a harness failure is retried on a fresh sandbox, within a budget.

Sandboxed shards in this process (no Dask): a host that crashes a seed's first attempt only ends
``ok`` with ``retried`` = 1; an env that always crashes ends ``crashed`` with ``retried`` = the
budget and lowers coverage; a deterministic ``env_error`` is never retried.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from evalfleet.errors import RequestError
from evalfleet.models import EvalRequest
from evalfleet.records import records_to_table
from evalfleet.sandbox.limits import SandboxLimits
from evalfleet.scoring import outcomes

from . import faulty_envs as fe
from .test_process_slots import run_direct

EPISODES, SLOTS = 20, 4


@pytest.fixture
def marker_dir() -> Iterator[str]:
    """A folder any uid may write (sandboxes run under uids of their own)."""
    path = tempfile.mkdtemp(prefix="evalfleet-crash-once-", dir="/tmp")
    os.chmod(path, 0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_flaky_host_is_retried_once_and_ends_ok(marker_dir: str) -> None:
    records, _ = run_direct("process", fe.env_id("CrashOnce"), EPISODES, SLOTS,
                            kwargs={"marker_dir": marker_dir},
                            limits=SandboxLimits(writable=(marker_dir,)))
    faulty = [r for r in records if fe.is_faulty(r.seed)]
    assert faulty, "the seed ledger gave no faulty seed: pick another base seed"
    for r in faulty:
        assert r.end_reason in ("terminated", "truncated"), r
        assert (r.retried, r.retry_reason) == (1, "crashed"), r
    assert sorted(os.listdir(marker_dir)) == sorted(str(r.seed) for r in faulty)
    clean, _ = run_direct("inprocess", "CartPole-v1", EPISODES, SLOTS)
    for r, ref in zip(records, clean, strict=True):
        assert (r.episode_return, r.length) == (ref.episode_return, ref.length), r.episode_index
        if not fe.is_faulty(r.seed):
            assert (r.retried, r.retry_reason) == (0, None)
    assert outcomes(records_to_table(records)).coverage == 1.0


def test_always_crashing_episode_uses_the_budget_and_lowers_coverage() -> None:
    records, _ = run_direct("process", fe.env_id("Segfault"), EPISODES, SLOTS)
    faulty = [r for r in records if fe.is_faulty(r.seed)]
    assert faulty
    for r in faulty:
        assert (r.end_reason, r.retried, r.retry_reason) == ("crashed", 2, "crashed"), r
        assert "signal 11" in (r.error or "")
    cov = outcomes(records_to_table(records)).coverage
    assert cov == pytest.approx((EPISODES - len(faulty)) / EPISODES)


def test_env_error_is_not_retried() -> None:
    records, box = run_direct("process", fe.env_id("RaiseOnStep"), EPISODES, SLOTS)
    faulty = [r for r in records if fe.is_faulty(r.seed)]
    assert faulty
    for r in faulty:
        assert (r.end_reason, r.retried, r.retry_reason) == ("env_error", 0, None), r


def test_budget_and_backoff_are_honoured() -> None:
    """Budget 3 with a 0.1 s backoff: 3 retries, waited 0.1 + 0.2 + 0.4 s at least."""
    import evalfleet.runner as runner_module

    calls: list[float] = []
    real = runner_module.ShardRun.schedule_retry

    def spy(self: runner_module.ShardRun, slot: int, reason: str) -> bool:
        calls.append(time.monotonic())
        return real(self, slot, reason)

    runner_module.ShardRun.schedule_retry = spy  # type: ignore[method-assign]
    try:
        from evalfleet.envspec import env_thunk, resolve_env
        from evalfleet.policy import LoadedPolicy
        from evalfleet.runner import EpisodeContext, run_shard
        from evalfleet.sandbox import open_slots
        from evalfleet.seeds import SeedLedger

        env = fe.env_id("Segfault")
        resolved = resolve_env(env, {}, None)
        seeds = [s for s in SeedLedger(0).seeds(range(60)) if fe.is_faulty(int(s))][:1]
        from gymnasium import spaces
        policy = LoadedPolicy(fe.balance, spaces.Discrete(2), is_torch=False, deterministic=True,
                              device="cpu")
        box = open_slots("process", env_thunk(env, {}, None), 1, episode_timeout_s=30.0,
                         env_spec=resolved.fingerprint.as_dict())
        try:
            [row] = run_shard([(0, int(seeds[0]))], box, policy,
                              EpisodeContext("t", "0" * 64, env, resolved.fingerprint.spec_hash, "w"),
                              retry_budget=3, retry_backoff_s=0.1)
        finally:
            box.close()
    finally:
        runner_module.ShardRun.schedule_retry = real  # type: ignore[method-assign]
    assert (row.end_reason, row.retried) == ("crashed", 3)
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert len(calls) == 4 and all(g >= w for g, w in zip(gaps, (0.1, 0.2, 0.4), strict=True)), gaps


@pytest.mark.parametrize("budget", [-1, 11])
def test_bad_budget_is_refused_before_anything_runs(budget: int) -> None:
    with pytest.raises(RequestError, match="'retry_budget' must be an integer from 0 to 10"):
        EvalRequest.build(policy="x:y", retry_budget=budget)


def test_request_default_budget_is_two() -> None:
    assert EvalRequest.build(policy="x:y").retry_budget == 2
