"""Stage 6: from the episode table to an ``EvalReport``."""

from __future__ import annotations

import platform
from typing import Any

import numpy as np
import pyarrow as pa

from evalfleet import stats
from evalfleet.models import EndReason, EvalReport, EvalRequest
from evalfleet.sandbox.isolation import isolation_manifest
from evalfleet.worker import sandbox_limits

#: Above this failure rate the evaluation is a harness fault, not a policy result.
FAILURE_ALARM_RATE = 0.05


def versions() -> dict[str, str]:
    """Versions of everything that can change a result."""
    import gymnasium
    import numpy

    from evalfleet import __version__

    out = {
        "evalfleet": __version__,
        "gymnasium": gymnasium.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        out["torch"] = "absent"
    return out


def aggregate(
    request: EvalRequest,
    table: pa.Table,
    *,
    env_spec: dict[str, Any],
    env_spec_hash: str,
    policy: dict[str, Any],
    isolation: str,
    timings: dict[str, float],
    cache: dict[str, Any],
    run_seconds: float,
) -> EvalReport:
    """Statistics, failure accounting, alarms and the reproducibility manifest."""
    reasons = np.asarray(table.column("end_reason").to_pylist(), dtype=object)
    returns = table.column("return").to_numpy()
    lengths = table.column("length").to_numpy()
    ok = np.array([not EndReason(r).is_failure for r in reasons], dtype=bool)
    n = len(reasons)
    failures: dict[str, int] = {}
    for reason in reasons[~ok]:
        failures[reason] = failures.get(reason, 0) + 1
    failure_rate = (n - int(ok.sum())) / n if n else 0.0
    alarms: list[str] = []
    harness_fault = failure_rate > FAILURE_ALARM_RATE
    if harness_fault:
        alarms.append(
            f"failure_rate: {failure_rate:.1%} of episodes failed (> {FAILURE_ALARM_RATE:.0%}); "
            "treat this evaluation as a harness fault, not a policy result"
        )
    good = returns[ok]
    if good.size:
        summary = stats.summarize(good, seed=request.seed).to_dict()
        length_summary = stats.length_stats(lengths[ok])
    else:
        alarms.append("no_completed_episodes: every episode failed")
        nan = float("nan")
        summary = {
            "n": 0, "mean": nan, "var": nan, "std": nan, "stderr": nan, "iqm": nan,
            "median": nan, "min": nan, "max": nan, "percentiles": {},
            "ci": {"low": nan, "high": nan, "level": 0.95, "method": "none"},
            "iqm_ci": {"low": nan, "high": nan, "level": 0.95, "method": "none"},
        }
        length_summary = {"mean": nan, "std": nan, "min": nan, "max": nan, "median": nan}
    success = None
    succ_col = np.asarray(table.column("success").to_pylist(), dtype=object)[ok]
    known = [bool(s) for s in succ_col if s is not None]
    if known:
        wins = sum(known)
        interval = stats.wilson_interval(wins, len(known))
        success = {
            "n": len(known),
            "successes": wins,
            "rate": wins / len(known),
            "ci": {"low": interval.low, "high": interval.high, "level": interval.level,
                   "method": interval.method},
        }
    steps = int(lengths.sum())
    wall = max(run_seconds, 1e-9)
    manifest = {
        "versions": versions(),
        "env": env_spec,
        "policy": policy,
        "protocol": {
            "seed": request.seed,
            "seed_ledger": "splitmix64((seed << 32) | episode_index)",
            "episodes": n,
            "max_steps": request.max_steps,
            "deterministic": request.deterministic,
            "episode_timeout_s": request.episode_timeout_s,
            "step_timeout_s": request.step_timeout_s,
            "bootstrap": {"resamples": 2000, "seed": request.seed},
        },
        "execution": {
            "isolation": isolation,
            "isolation_probe": isolation_manifest(),
            "envs_per_sandbox": request.envs_per_sandbox,
            "sandbox_limits": sandbox_limits(request).as_dict() if isolation != "inprocess" else None,
            "concurrency": request.concurrency,
            "workers": request.workers,
            "dask_address": request.dask_address,
            "device": request.device,
        },
    }
    return EvalReport(
        request_id=request.request_id,
        env_id=request.env,
        env_spec_hash=env_spec_hash,
        policy_sha256=policy["sha256"],
        training_run_id=request.training_run_id,
        step=request.step,
        isolation=isolation,
        episodes=n,
        completed=int(ok.sum()),
        failures=failures,
        failure_rate=failure_rate,
        harness_fault=harness_fault,
        alarms=alarms,
        returns=summary,
        lengths=length_summary,
        success=success,
        env_steps=steps,
        steps_per_second=steps / wall,
        episodes_per_second=n / wall,
        timings=timings,
        cache=cache,
        outputs={},
        manifest=manifest,
    )
