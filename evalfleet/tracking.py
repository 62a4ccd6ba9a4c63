"""MLflow feedback: one run per evaluation with params, ``eval/`` metrics, tags and artifacts."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def default_tracking_uri(output: Path) -> str:
    """A SQLite store under the results folder (MLflow's file store is deprecated)."""
    return f"sqlite:///{Path(output).resolve() / 'mlflow.db'}"


def flatten_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The report's numbers as ``eval/...`` metrics."""
    r = report["returns"]
    m: dict[str, float] = {
        "eval/reward": r["mean"],
        "eval/reward_std": r["std"],
        "eval/reward_var": r["var"],
        "eval/reward_stderr": r["stderr"],
        "eval/reward_ci_low": r["ci"]["low"],
        "eval/reward_ci_high": r["ci"]["high"],
        "eval/reward_iqm": r["iqm"],
        "eval/reward_median": r["median"],
        "eval/reward_min": r["min"],
        "eval/reward_max": r["max"],
        "eval/episode_length": report["lengths"]["mean"],
        "eval/episodes": report["episodes"],
        "eval/failure_rate": report["failure_rate"],
        "eval/coverage": report["coverage"],
        "eval/scored": report["scored"],
        "eval/policy_failure_rate": report["policy_failure_rate"],
        "eval/harness_failure_rate": report["harness_failure_rate"],
        "eval/harness_fault": float(report["harness_fault"]),
        "eval/fps": report["steps_per_second"],
        "eval/episodes_per_second": report["episodes_per_second"],
    }
    for reason, count in report["failures"].items():
        m[f"eval/failures/{reason}"] = count
    if report.get("success"):
        m["eval/success_rate"] = report["success"]["rate"]
        m["eval/success_ci_low"] = report["success"]["ci"]["low"]
        m["eval/success_ci_high"] = report["success"]["ci"]["high"]
    if report.get("adaptive"):
        m["eval/adaptive_rounds"] = len(report["adaptive"]["rounds"])
        m["eval/ci_halfwidth"] = report["adaptive"]["achieved_halfwidth"]
    if report.get("comparison") and "ci" in report["comparison"]:
        c = report["comparison"]
        m["eval/baseline_diff"] = c["mean_diff"]
        m["eval/baseline_diff_ci_low"] = c["ci"]["low"]
        m["eval/baseline_diff_ci_high"] = c["ci"]["high"]
        m["eval/p_improvement"] = c["p_improvement"]
        m["eval/baseline_pairs"] = c["n"]
        m["eval/baseline_pairs_dropped"] = c.get("dropped_harness_failures", 0)
    if report.get("step_rewards"):
        r = report["step_rewards"]
        m["eval/step_reward_min"], m["eval/step_reward_max"] = r["min"], r["max"]
        m["eval/step_reward_at_min_fraction"] = r["at_min_fraction"]
        m["eval/step_reward_at_max_fraction"] = r["at_max_fraction"]
    if report.get("audit"):
        m["eval/audit_checked"] = report["audit"]["checked"]
        m["eval/audit_mismatches"] = len(report["audit"]["mismatches"])
    m["eval/cache_reused"] = report["cache"].get("reused", 0)
    for stage, seconds in report["timings"].items():
        m[f"eval/time/{stage}"] = seconds
    return {k: float(v) for k, v in m.items() if v is not None}


def _run_exists(client: Any, run_id: str) -> bool:
    try:
        client.get_run(run_id)
    except Exception:  # MLflow raises its own exception type for unknown ids
        return False
    return True


def log_evaluation(
    tracking_uri: str,
    experiment: str,
    report: dict[str, Any],
    params: dict[str, Any],
    artifacts: list[Path],
    run_name: str,
) -> str:
    """Log one evaluation as an MLflow run; returns the run id."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        location = None
        if tracking_uri.startswith("sqlite:///"):
            db = Path(tracking_uri.removeprefix("sqlite:///"))
            location = (db.parent / "mlartifacts").resolve().as_uri()
        exp_id = client.create_experiment(experiment, artifact_location=location)
    else:
        exp_id = exp.experiment_id
    tags = {
        "evalfleet.policy_sha256": report["policy_sha256"],
        "evalfleet.env_id": report["env_id"],
        "evalfleet.request_id": report["request_id"],
        "evalfleet.isolation": report["isolation"],
        "evalfleet.harness_fault": str(report["harness_fault"]).lower(),
        "mlflow.runName": run_name,
    }
    if report.get("training_run_id"):
        tags["evalfleet.training_run_id"] = report["training_run_id"]
        if _run_exists(client, report["training_run_id"]):
            tags["mlflow.parentRunId"] = report["training_run_id"]  # nests under the trainer's run
    if report.get("step") is not None:
        tags["evalfleet.step"] = str(report["step"])
    if report.get("comparison"):
        tags["evalfleet.baseline_verdict"] = str(report["comparison"].get("verdict"))
    for alarm in report["alarms"]:
        tags[f"evalfleet.alarm.{alarm.split(':', 1)[0]}"] = "true"
    run = client.create_run(exp_id, tags=tags, run_name=run_name)
    run_id: str = run.info.run_id
    from mlflow.entities import Metric, Param

    step = int(report.get("step") or 0)
    ts = int(run.info.start_time)
    metrics = [Metric(k, v, ts, step) for k, v in flatten_metrics(report).items()]
    str_params = [Param(k, str(v)[:6000]) for k, v in params.items()]
    client.log_batch(run_id, metrics=metrics, params=str_params)
    for path in artifacts:
        client.log_artifact(run_id, str(path))
    client.set_terminated(run_id, "FAILED" if report["harness_fault"] else "FINISHED")
    del mlflow
    return run_id


#: Folder under the results folder holding MLflow runs not logged yet (one JSON file each).
PENDING_DIR = "mlflow-pending"
#: Attempts at logging one evaluation before it is queued, and the waits between them (s).
LOG_ATTEMPTS = 3
LOG_WAIT_S = (0.5, 4.0)
#: MLflow's HTTP client settings while evalfleet logs (each attempt then ends within ~a minute).
MLFLOW_HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
                      "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


def _attempts(attempts: int, wait_s: tuple[float, float]) -> Any:
    from tenacity import Retrying, stop_after_attempt, wait_exponential

    return Retrying(stop=stop_after_attempt(attempts), reraise=True,
                    wait=wait_exponential(multiplier=wait_s[0], max=wait_s[1]))


def pending_dir(output: Path) -> Path:
    """Where ``output``'s queued MLflow runs wait for the store to come back."""
    return Path(output) / PENDING_DIR


def log_or_queue(
    output: Path, tracking_uri: str, experiment: str, report: dict[str, Any],
    params: dict[str, Any], artifacts: list[Path], run_name: str, *,
    attempts: int = LOG_ATTEMPTS, wait_s: tuple[float, float] = LOG_WAIT_S,
) -> dict[str, str]:
    """Log the evaluation to MLflow, retried; if the store stays unreachable, queue it.

    Returns the report's outputs to add: ``mlflow_uri`` and ``mlflow_run_id`` once logged, else
    ``mlflow_error`` and ``mlflow_queued`` (the pending file that ``flush_pending`` logs later:
    the next evaluation writing to ``output``, or ``evalfleet mlflow flush``). The Parquet and the
    cache were written before this runs, so nothing of the result depends on it.
    """
    # MLflow's own HTTP retries (7, backoff factor 2: minutes) would multiply with ours; bounded
    # here unless the operator chose other values.
    for name, value in MLFLOW_HTTP_BOUNDS.items():
        os.environ.setdefault(name, value)
    try:
        for attempt in _attempts(attempts, wait_s):
            with attempt:
                run_id = log_evaluation(tracking_uri, experiment, report, params, artifacts, run_name)
        return {"mlflow_uri": tracking_uri, "mlflow_run_id": run_id}
    except Exception as err:  # noqa: BLE001 - any store failure queues the run
        error = f"{type(err).__name__}: {err}"[:1000]
    entry = {"tracking_uri": tracking_uri, "experiment": experiment, "report": report,
             "params": {k: str(v) for k, v in params.items()},
             "artifacts": [str(Path(a).resolve()) for a in artifacts], "run_name": run_name,
             "error": error, "queued": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    folder = pending_dir(output)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{report['request_id']}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(entry, default=str))
    os.replace(tmp, path)
    logger.error("MLflow logging failed after %d attempts (%s); queued as %s: the next evaluation "
                 "writing to %s, or 'evalfleet mlflow flush --output %s', logs it", attempts,
                 error, path, output, output)
    return {"mlflow_error": error, "mlflow_queued": str(path.resolve())}


def flush_pending(output: Path, tracking_uri: str | None = None) -> list[dict[str, str]]:
    """Log every queued run of ``output`` once; returns one outcome per pending file.

    A run that logs is removed from the queue, and its report.json (when still there) gets its
    ``mlflow_run_id``; one that fails again stays queued. ``tracking_uri`` overrides the URI a
    run was queued with (a store that moved).
    """
    results = []
    for path in sorted(pending_dir(output).glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            uri = tracking_uri or entry["tracking_uri"]
            artifacts = [Path(a) for a in entry["artifacts"] if Path(a).exists()]
            run_id = log_evaluation(uri, entry["experiment"], entry["report"], entry["params"],
                                    artifacts, entry["run_name"])
        except Exception as err:  # noqa: BLE001 - stays queued for the next flush
            results.append({"pending": str(path), "error": f"{type(err).__name__}: {err}"[:500]})
            continue
        path.unlink(missing_ok=True)
        _note_logged(entry, uri, run_id)
        results.append({"pending": str(path), "request_id": str(entry["report"]["request_id"]),
                        "mlflow_run_id": run_id})
    return results


def _note_logged(entry: dict[str, Any], uri: str, run_id: str) -> None:
    """Record the late MLflow run in the evaluation's report.json, if it is among the artifacts."""
    for name in entry["artifacts"]:
        if Path(name).name != "report.json" or not Path(name).exists():
            continue
        try:
            report = json.loads(Path(name).read_text())
            outputs = dict(report.get("outputs") or {})
            outputs.pop("mlflow_queued", None)
            outputs.update(mlflow_uri=uri, mlflow_run_id=run_id,
                           mlflow_logged_late=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            report["outputs"] = outputs
            tmp = Path(name).with_name(".report.json.tmp")
            tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
            os.replace(tmp, name)
        except (OSError, ValueError) as err:
            logger.warning("logged %s late, but could not update %s: %s", run_id, name, err)
