"""Stage 6: from the episode table to an ``EvalReport``."""

from __future__ import annotations

import platform
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from evalfleet import stats
from evalfleet.cache import environment_digest
from evalfleet.models import FAILURE_ALARM_RATE, EndReason, EvalReport, EvalRequest
from evalfleet.provenance import RECORD_MARK, SOURCE_PREFIX, code_version
from evalfleet.sandbox.isolation import isolation_manifest, promised
from evalfleet.sandbox.limits import sandbox_limits
from evalfleet.sandbox.slots import UNREADABLE_FLAG
from evalfleet.scoring import Outcomes, outcomes
from evalfleet.summary import percent_beyond

#: Above this share of episodes ended by the policy (invalid actions, errors or hangs in its
#: forward) the ``policy_failures`` alarm asks to look: the headline already counts them, but a
#: policy that breaks often usually has a wiring bug (action-space drift, a device mismatch).
POLICY_FAILURE_ALARM_RATE = 0.05


_METRIC_ITEMS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.float64())]))


def unreadable_success(table: pa.Table) -> str | None:
    """The ``success_unreadable`` alarm, when episodes put a success flag that is not one number.

    ``scalar_info`` leaves such a flag out of the row (its ``success`` is None) and puts an
    ``unreadable_flag:<key>:<what>`` metric in its place: without this alarm, an env whose flag
    is a string or a multi-element array lost its success rate, with no word of why.
    """
    if "metrics" not in table.column_names or not table.num_rows:
        return None
    # Map keys read through a list of structs: a sliced map array's ``keys`` ignore the slice.
    names = pc.struct_field(pc.list_flatten(table.column("metrics").cast(_METRIC_ITEMS)), "key")
    found = pc.filter(names, pc.starts_with(names, UNREADABLE_FLAG)).to_pylist()
    if not found:
        return None
    kinds = Counter(tuple(str(name)[len(UNREADABLE_FLAG):].split(":", 1)) for name in found)
    listed = ", ".join(f"{kind[0]!r} as {kind[-1]}: {n}" for kind, n in sorted(kinds.items()))
    return (f"success_unreadable: {len(found)} of {table.num_rows} episodes put a success flag in "
            f"their final info that is not one number ({listed}); those rows have no success "
            "(a bool, a number, or a one-element array or tensor of one is read)")


def flattering_failures(returns: np.ndarray[Any, Any], kinds: Outcomes) -> str | None:
    """The ``policy_failures_flatter`` alarm, when the policy's failures raise the headline.

    They count with their partial return: a lower bound of the episode's where rewards are
    positive, but where they are negative (a cost per step) ending early scores higher, so a
    policy that breaks on its hardest seeds would look better for it. Raised at any count, when
    the failures' partial returns average above the completed episodes' returns, or when no
    episode completed at all.
    """
    failed = kinds.policy & kinds.scored
    if not failed.any():
        return None
    if not kinds.completed.any():  # nothing to compare with: the headline is partial sums only
        return (f"policy_failures_flatter: all {int(failed.sum())} scored episodes were ended by "
                f"the policy and count with their partial return (mean "
                f"{float(returns[failed].mean()):.4g}): no episode completed, so the headline "
                "and any comparison say nothing of the policy (with negative rewards, ending "
                "early scores higher); --gate does not pass it. Fix the policy's failures (see "
                "failures in the report) and evaluate again")
    partial, done = float(returns[failed].mean()), float(returns[kinds.completed].mean())
    if partial <= done:
        return None
    return (f"policy_failures_flatter: {int(failed.sum())} episodes ended by the policy count with "
            f"their partial return (mean {partial:.4g}), above the completed episodes' mean "
            f"({done:.4g}): with negative rewards, ending early scores higher, so the headline "
            "and any comparison may overstate this policy; --gate does not pass it. Fix the "
            "policy's failures (see failures in the report) and evaluate again")


def _by_reason(reasons: np.ndarray[Any, Any]) -> str:
    counts: dict[str, int] = {}
    for reason in reasons:
        counts[str(reason)] = counts.get(str(reason), 0) + 1
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"


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
        "python_implementation": platform.python_implementation(),
    }
    out["torch"] = torch_version()
    return out


def harness_versions() -> dict[str, str]:
    """``versions()``, with evalfleet's own code version after its version number.

    A development checkout keeps its version number while its code changes; its source then
    identifies it (``evalfleet.provenance``), so an edited runner never reuses stale episodes. A
    built install is identified by its installed-file record likewise (a wheel rebuilt under
    the same version). What the cache key names, and what the report's manifest states: it
    stated ``0.1.0`` for every checkout, whatever code computed its numbers.
    """
    out = versions()
    _, code = code_version("evalfleet")
    for mark in (f"+{SOURCE_PREFIX}", RECORD_MARK):
        if mark in code:
            out["evalfleet"] = f"{out['evalfleet']}{code[code.index(mark):]}"
            break
    return out


def torch_version() -> str:
    """The installed torch's ``torch.__version__``, without importing it (~1 s) when it is not.

    Read from the ``torch/version.py`` that ``torch.__version__`` comes from, not from the
    package metadata: PyPI's CUDA wheels say ``2.11.0`` there and ``2.11.0+cu130`` in
    ``torch.__version__``, so the cache key would depend on whether this process had imported
    torch (the in-loop ``Evaluator`` has, the CLI has not), and each would miss the other's
    episodes. A torch without that file is imported.
    """
    import importlib.util
    import re
    import sys

    if "torch" in sys.modules:
        return str(sys.modules["torch"].__version__)
    spec = importlib.util.find_spec("torch")  # finds the package; imports nothing
    if spec is None:
        return "absent"
    for folder in spec.submodule_search_locations or ():
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        found = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if found:
            return found.group(1)
    try:
        import torch
    except ImportError:
        return "absent"
    return str(torch.__version__)


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
    ran: pa.Table | None = None,
    environment: dict[str, Any] | None = None,
) -> EvalReport:
    """Statistics, failure accounting, alarms and the reproducibility manifest.

    ``ran``: the rows that ran within ``run_seconds`` (``Collected.fresh``; None: all of
    ``table``); throughput is theirs, and None when none ran (a full cache hit).
    ``environment``: the cache key's ``environment`` ingredient (``cache.env_environment``); its
    digest is the manifest protocol's ``environment_sha256``, part of the history's protocol.

    Every headline figure (mean, var/std/stderr, CI, IQM, percentiles, min/max, episode lengths,
    success rate) is computed over the *scored* episodes of ``evalfleet.scoring``: completed ones
    and those a failure of the policy ended (with their partial return, their length up to the
    end and success false). Harness failures are left out and reported as ``coverage``.
    """
    reasons = np.asarray(table.column("end_reason").to_pylist(), dtype=object)
    returns = np.asarray(table.column("return").to_numpy(zero_copy_only=False), dtype=np.float64)
    lengths = table.column("length").to_numpy()
    kinds = outcomes(table)
    scored = kinds.scored
    n = len(reasons)
    failures: dict[str, int] = {}
    for reason in reasons[~kinds.completed]:
        failures[reason] = failures.get(reason, 0) + 1
    n_policy, n_harness = int(kinds.policy.sum()), int(kinds.harness.sum())
    failure_rate = (n - int(kinds.completed.sum())) / n if n else 0.0
    policy_rate = n_policy / n if n else 0.0
    harness_rate = n_harness / n if n else 0.0
    coverage = kinds.coverage
    alarms: list[str] = []
    # What the policy caused is a result, not a harness fault: only unscored episodes count here.
    unscored_rate = (n - int(scored.sum())) / n if n else 0.0
    harness_fault = unscored_rate > FAILURE_ALARM_RATE
    if harness_fault:
        alarms.append(
            f"harness_failures: {percent_beyond(unscored_rate, FAILURE_ALARM_RATE)} of episodes "
            f"could not be scored ({_by_reason(reasons[~scored])}; > {FAILURE_ALARM_RATE:.0%}, "
            f"coverage {percent_beyond(coverage, 1 - FAILURE_ALARM_RATE)}); treat this evaluation "
            "as a harness fault, not a policy result"
        )
    if policy_rate > POLICY_FAILURE_ALARM_RATE:
        alarms.append(
            f"policy_failures: {percent_beyond(policy_rate, POLICY_FAILURE_ALARM_RATE)} of "
            "episodes were ended by the policy "
            f"({_by_reason(reasons[kinds.policy])}; > {POLICY_FAILURE_ALARM_RATE:.0%}); they "
            "count in every headline figure with their partial return and success false"
        )
    flatter = flattering_failures(returns, kinds)
    if flatter:
        alarms.append(flatter)
    unscorable = int(kinds.unscorable.sum())
    if unscorable:
        never = int((kinds.unscorable & (lengths == 0)).sum())
        alarms.append(
            f"policy_failure_returns_missing: {unscorable} episodes ended by the policy have no "
            f"finite return in their row ({never} never started: a policy forward hung in their "
            "shard first) and are left out of the statistics (coverage drops)"
        )
    good = returns[scored]
    if good.size:
        summary = stats.summarize(good, seed=request.seed).to_dict()
        length_summary: dict[str, float | None] = dict(stats.length_stats(lengths[scored]))
    else:
        alarms.append("no_scored_episodes: every episode failed in the harness")
        nan = float("nan")
        summary = {
            "n": 0, "mean": nan, "var": nan, "std": nan, "stderr": nan, "iqm": nan,
            "median": nan, "min": nan, "max": nan, "percentiles": {},
            "ci": {"low": nan, "high": nan, "level": 0.95, "method": "none"},
            "iqm_ci": {"low": nan, "high": nan, "level": 0.95, "method": "none"},
        }
        length_summary = {"mean": nan, "std": nan, "min": nan, "max": nan, "median": nan}
    success = None
    succ_all = np.asarray(table.column("success").to_pylist(), dtype=object)
    # An env defines success when a completed episode reports it; an episode the policy broke
    # never succeeded, whatever its row says.
    if any(s is not None for s in succ_all[kinds.completed]):
        known = [bool(s) for s in succ_all[kinds.completed] if s is not None]
        unreported = int(kinds.completed.sum()) - len(known)
        known += [False] * int((scored & kinds.policy).sum())
        wins = sum(known)
        interval = stats.wilson_interval(wins, len(known))
        success = {
            "n": len(known),
            "successes": wins,
            "rate": wins / len(known),
            "ci": {"low": interval.low, "high": interval.high, "level": interval.level,
                   "method": interval.method},
            "unreported": unreported,
        }
        if unreported:
            # An env that puts the flag only on some endings (often only on success) would make
            # the rate over reporting episodes look better than it is: say so, and give the rate
            # with the silent episodes counted as failures next to it.
            success["rate_unreported_as_failure"] = wins / (len(known) + unreported)
            alarms.append(
                f"success_partially_reported: {unreported} of {int(kinds.completed.sum())} completed "
                "episodes put no 'success'/'is_success' in their final info; the success rate is over "
                f"the {len(known)} that did ({wins / len(known):.3f}; "
                f"{success['rate_unreported_as_failure']:.3f} if the silent ones failed)"
            )
    unreadable = unreadable_success(table)
    if unreadable:
        alarms.append(unreadable)
    steps = int(lengths.sum())
    steps_per_second, episodes_per_second = throughput(table if ran is None else ran, run_seconds)
    endings = _endings(reasons, lengths, env_spec.get("max_episode_steps"))
    manifest = {
        "versions": harness_versions(),
        "env": env_spec,
        "policy": policy,
        "protocol": {
            "seed": request.seed,
            "seed_ledger": "splitmix64((seed << 32) | episode_index)",
            "episodes": n,
            # The effective cap (the history's protocol): an explicit --max-steps equal to the
            # registered cap is the same protocol as none.
            "max_steps": env_spec.get("max_episode_steps", request.max_steps),
            "max_steps_requested": request.max_steps,
            "deterministic": request.deterministic,
            "episode_timeout_s": request.episode_timeout_s,
            "step_timeout_s": request.step_timeout_s,
            "policy_timeout_s": request.policy_timeout_s,
            "bootstrap": {"resamples": 2000, "seed": request.seed},
            # What the env saw (isolation class, --sandbox-env values, --sandbox-read contents),
            # as the cache key has it: the history pairs only evaluations under the same.
            **({} if environment is None else {"environment_sha256": environment_digest(environment)}),
        },
        "execution": execution_manifest(request, isolation),
    }
    return EvalReport(
        request_id=request.request_id,
        env_id=request.env,
        env_spec_hash=env_spec_hash,
        policy_sha256=policy["sha256"],
        training_run_id=request.training_run_id,
        step=request.step,
        suite_task=request.suite_task,
        isolation=isolation,
        episodes=n,
        completed=int(kinds.completed.sum()),
        failures=failures,
        failure_rate=failure_rate,
        harness_fault=harness_fault,
        scored=int(scored.sum()),
        policy_failures=n_policy,
        harness_failures=n_harness,
        coverage=coverage,
        policy_failure_rate=policy_rate,
        harness_failure_rate=harness_rate,
        alarms=alarms,
        returns=summary,
        lengths=length_summary,
        endings=endings,
        success=success,
        env_steps=steps,
        steps_per_second=steps_per_second,
        episodes_per_second=episodes_per_second,
        timings=timings,
        cache=cache,
        outputs={},
        manifest=manifest,
    )


def execution_manifest(request: EvalRequest, isolation: str) -> dict[str, Any]:
    """How ``request`` runs its episodes: the manifest's ``execution`` (this machine's probe too)."""
    return {
        "isolation": isolation,
        "isolation_probe": isolation_manifest(),
        "envs_per_sandbox": request.envs_per_sandbox,
        # ``required``: what each sandbox had to apply, or refuse to run env code (the probe's).
        "sandbox_limits": (sandbox_limits(request, promised(isolation)).as_dict()
                           if isolation != "inprocess" else None),
        "concurrency": request.concurrency,
        # ``--workers`` sizes a local cluster only: an external one has the workers it has.
        "workers": None if request.dask_address else request.workers,
        "dask_address": request.dask_address,
        "device": request.device,
    }


def throughput(ran: pa.Table, run_seconds: float) -> tuple[float | None, float | None]:
    """Env steps and episodes per second of the rows that ran within ``run_seconds``.

    Only those: a top-up's cached rows took none of that time (200 cached episodes beside 20 run
    in 0.98 s read 93,629 steps/s for a real 8,690). None when nothing ran (a full cache hit):
    no rate was measured, and 0 or a number would read as one.
    """
    if not ran.num_rows:
        return None, None
    wall = max(run_seconds, 1e-9)
    return int(pc.sum(ran.column("length")).as_py() or 0) / wall, ran.num_rows / wall


def _endings(reasons: np.ndarray, lengths: np.ndarray, step_cap: Any) -> dict[str, Any]:
    """How the completed episodes ended: terminated, or truncated (and how many at the step cap).

    A mean over episodes the step cap cut short measures the cap as much as the policy: the
    summary says how many there were, so a capped return is never read as a policy's own.
    """
    truncated = reasons == EndReason.TRUNCATED.value
    cap = int(step_cap) if isinstance(step_cap, int | float) and step_cap else None
    return {
        "terminated": int((reasons == EndReason.TERMINATED.value).sum()),
        "truncated": int(truncated.sum()),
        "at_step_cap": int((truncated & (lengths >= cap)).sum()) if cap else 0,
        "step_cap": cap,
    }


def curve_so_far(report: EvalReport) -> list[dict[str, Any]]:
    """The training run's curve up to this evaluation: earlier checkpoints' rows, then this one.

    Empty without a history (no training run id and step) or when it could not be read.
    """
    from evalfleet.history import report_curve_row

    history = report.history or {}
    if not history or "curve" not in history:
        return []
    rows = [*history["curve"], report_curve_row(report.model_dump(mode="json"))]
    return sorted(rows, key=lambda r: int(r["step"]))
