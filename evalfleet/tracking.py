"""MLflow feedback: one run per evaluation with params, ``eval/`` metrics, tags and artifacts."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


#: MLflow's usage telemetry, on by default outside CI, sends events to its servers from every
#: process that imports MLflow: evalfleet's own processes (the CLI, the shared logger, ``serve``)
#: turn it off unless the variable is set (``telemetry_off``). A training process keeps its own.
TELEMETRY_ENV = "MLFLOW_DISABLE_TELEMETRY"


def telemetry_off() -> None:
    """Turn MLflow's telemetry off in this process (and its children) unless the user chose."""
    os.environ.setdefault(TELEMETRY_ENV, "true")


def default_tracking_uri(output: Path) -> str:
    """A SQLite store under the results folder (MLflow's file store is deprecated)."""
    return f"sqlite:///{Path(output).resolve() / 'mlflow.db'}"


def mlflow_client(tracking_uri: str) -> Any:
    """An ``MlflowClient`` on ``tracking_uri``; a new SQLite store starts as a copy of an empty one.

    MLflow builds a new SQLite store by running its schema migrations, ~1 s of CPU, at the
    first stage 7 of every new results folder. Here they run once per MLflow version, into a
    template in ``evalfleet_home()``; a new store is a copy of it. The template holds no
    experiment: MLflow adds its ``Default`` one on open, where it would have (the store's folder
    and the working directory of the moment). If anything fails, MLflow builds the store itself.
    """
    import functools
    import shutil

    from mlflow.tracking import MlflowClient

    from evalfleet.storage import create_new

    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri.removeprefix("sqlite:///"))
        if not db.exists():
            try:
                create_new(db, functools.partial(shutil.copyfile, _store_template()))
            except Exception as err:  # noqa: BLE001 - MLflow makes the store as it always did
                logger.debug("no MLflow store template for %s: %s", db, err)
    return MlflowClient(tracking_uri=tracking_uri)


def _store_template() -> Path:
    """An empty SQLite store of this MLflow version's schema, made on first use."""
    import sqlite3
    from contextlib import closing

    import mlflow
    from mlflow.tracking import MlflowClient

    from evalfleet.server import evalfleet_home
    from evalfleet.storage import atomic_write

    def build(made: str) -> None:
        MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()  # migrated + Default
        with closing(sqlite3.connect(made)) as db:
            db.execute("DELETE FROM experiments")  # MLflow adds its Default where a copy opens
            db.commit()

    path = evalfleet_home() / "mlflow" / f"empty-store-{mlflow.__version__}.db"
    return path if path.exists() else atomic_write(path, build)


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
        # null when nothing ran (a full cache hit): no point is logged, never a 0 or a fake rate
        "eval/fps": report["steps_per_second"],
        "eval/episodes_per_second": report["episodes_per_second"],
    }
    for reason, count in report["failures"].items():
        m[f"eval/failures/{reason}"] = count
    endings = report.get("endings") or {}
    for key in ("terminated", "truncated", "at_step_cap"):
        if key in endings:
            m[f"eval/endings/{key}"] = endings[key]
    if report.get("success"):
        m["eval/success_rate"] = report["success"]["rate"]
        m["eval/success_ci_low"] = report["success"]["ci"]["low"]
        m["eval/success_ci_high"] = report["success"]["ci"]["high"]
        if "rate_unreported_as_failure" in report["success"]:  # beside it, wherever it goes
            m["eval/success_rate_unreported_as_failure"] = report["success"]["rate_unreported_as_failure"]
    # Every alarm line of the report (its own and the history's): a chart of the trainer's run
    # shows at which steps a number came with one.
    m["eval/alarm_count"] = len(report.get("alarms") or [])
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
        # Both by name: a pair dropped for want of a baseline row can bias the difference.
        m["eval/baseline_pairs_dropped_harness"] = c.get("dropped_harness_failures", 0)
        m["eval/baseline_pairs_dropped_unmatched"] = c.get("dropped_unmatched", 0)
        m["eval/baseline_pairs_dropped"] = (c.get("dropped_harness_failures", 0)
                                            + c.get("dropped_unmatched", 0))
    if report.get("step_rewards"):
        r = report["step_rewards"]
        m["eval/step_reward_min"], m["eval/step_reward_max"] = r["min"], r["max"]
        m["eval/step_reward_at_min_fraction"] = r["at_min_fraction"]
        m["eval/step_reward_at_max_fraction"] = r["at_max_fraction"]
    m.update(history_metrics(report.get("history")))
    if report.get("audit"):
        m["eval/audit_checked"] = report["audit"]["checked"]
        m["eval/audit_skipped"] = report["audit"].get("skipped", 0)
        m["eval/audit_mismatches"] = len(report["audit"]["mismatches"])
    m["eval/cache_reused"] = report["cache"].get("reused", 0)
    for stage, seconds in report["timings"].items():
        m[f"eval/time/{stage}"] = seconds
    return {k: float(v) for k, v in m.items() if v is not None}


#: Verdicts as numbers, so a metric chart shows them over steps. Verdicts that compared nothing
#: (``no_paired_episodes``, ``protocol_changed``) get no point: 0.0 would read as "compared, no
#: difference"; the tag ``evalfleet.verdict`` names them.
VERDICT_CODES = {"regression": -1.0, "not_distinguishable": 0.0, "new_best": 1.0, "first": 1.0}


def history_metrics(history: dict[str, Any] | None) -> dict[str, float]:
    """The history section's numbers: verdict, paired difference to the best, action shares."""
    if not history:
        return {}
    m: dict[str, float] = {}
    if history.get("verdict") in VERDICT_CODES:
        m["eval/verdict"] = VERDICT_CODES[history["verdict"]]
    if history.get("best_step") is not None:
        m["eval/best_step"] = history["best_step"]
    c = history.get("comparison") or {}
    if "ci" in c:
        m["eval/best_diff"] = c["mean_diff"]
        m["eval/best_diff_ci_low"] = c["ci"]["low"]
        m["eval/best_diff_ci_high"] = c["ci"]["high"]
        m["eval/best_p_improvement"] = c["p_improvement"]
        m["eval/best_pairs"] = c["n"]
        m["eval/best_pairs_dropped_harness"] = c.get("dropped_harness_failures", 0)
        m["eval/best_pairs_dropped_unmatched"] = c.get("dropped_unmatched", 0)
    cur = history.get("current") or {}
    for i, share in enumerate(cur.get("action_shares") or []):
        m[f"eval/action_share/{i}"] = share
    if cur.get("action_entropy") is not None:
        m["eval/action_entropy"] = cur["action_entropy"]
    outcome = cur.get("outcome") or {}
    if outcome.get("mean") is not None:
        m["eval/outcome"] = outcome["mean"]
    m["eval/history_alarms"] = len(history.get("alarms") or [])
    return m


def history_tags(report: dict[str, Any]) -> dict[str, str]:
    """Tags that make an evaluation findable again by its training run and comparable (pairable)."""
    from evalfleet.history import FLATTERED, TAG_SEEN, TAG_WITHHELD, report_protocol

    tags = {"evalfleet.protocol": report_protocol(report),
            "evalfleet.env_spec_hash": str(report.get("env_spec_hash"))}
    key = (report.get("cache") or {}).get("key")
    if key:
        tags["evalfleet.cache_key"] = str(key)
    history = report.get("history") or {}
    if history.get("verdict"):
        tags["evalfleet.verdict"] = str(history["verdict"])
        flattered = {str(a).split(":", 1)[0] for a in report.get("alarms") or []} & FLATTERED
        if history.get("best_withheld"):
            tags[TAG_WITHHELD] = ",".join(history["best_withheld"])
        # A harness fault is never the best (``history.never_best``), as the history reads it back.
        tags["evalfleet.best"] = str(history.get("best_step") == report.get("step") and not flattered
                                     and not report.get("harness_fault")
                                     and history["verdict"] in ("first", "new_best")).lower()
        tags["evalfleet.best_step"] = str(history.get("best_step"))
    if history.get("outcome_metric"):
        tags["evalfleet.outcome_metric"] = str(history["outcome_metric"])
    if history.get("seen_steps"):  # what the verdict read: ``history.judged_without``
        tags[TAG_SEEN] = str(history["seen_steps"])
    return tags


#: Metrics an evaluation also logs into the trainer's own run (same store), at the training step.
TRAINER_METRICS = ("eval/reward", "eval/reward_ci_low", "eval/reward_ci_high", "eval/success_rate",
                   "eval/success_rate_unreported_as_failure", "eval/failure_rate",
                   "eval/episode_length", "eval/verdict", "eval/outcome", "eval/action_entropy",
                   "eval/alarm_count")


def log_into_trainer_run(client: Any, report: dict[str, Any], metrics: dict[str, float],
                         timestamp: int) -> int:
    """Log the headline eval metrics at ``step`` into the trainer's run when it is in this store.

    The trainer's run then shows the eval curve without code of its own. Returns metrics logged.
    """
    from mlflow.entities import Metric

    run_id, step = report.get("training_run_id"), report.get("step")
    if report.get("suite_task"):  # the suite logs its aggregates there once (``log_suite``)
        return 0
    if not run_id or step is None or not _run_exists(client, run_id):
        return 0
    batch = [Metric(k, metrics[k], timestamp, int(step)) for k in TRAINER_METRICS if k in metrics]
    client.log_batch(run_id, metrics=batch)
    return len(batch)


def alarm_tag(alarm: str) -> str:
    """The MLflow tag that marks a run with ``alarm`` (an alarm line ``name: message``, or a name)."""
    return f"evalfleet.alarm.{alarm.split(':', 1)[0]}"


def log_late_alarms(tracking_uri: str, mlflow_run_id: str, report: dict[str, Any],
                    late: list[str], artifacts: list[Path] | None = None) -> None:
    """Tag alarms raised after the evaluation's MLflow run was logged (a failed callback).

    ``eval/alarm_count`` is logged again, at the step, into that run and the trainer's run, with
    a later timestamp: MLflow's latest value then agrees with report.json. ``late``: the alarm
    lines (``name: message``) added since. ``artifacts`` (report.json and report.html as written
    with them) replace the run's copies, which the run was logged with before. Raises what MLflow
    raises; the caller says so.
    """
    count = float(len(report.get("alarms") or []))
    client, timestamp = _log_late(tracking_uri, mlflow_run_id, "eval/alarm_count", count,
                                  int(report.get("step") or 0), late, artifacts or [])
    log_into_trainer_run(client, report, {"eval/alarm_count": count}, timestamp)


def log_late_suite_alarms(tracking_uri: str, mlflow_run_id: str, count: int, late: list[str],
                          artifacts: list[Path]) -> None:
    """``log_late_alarms`` for a suite's parent run: ``suite/alarm_count`` and ``late``'s tags."""
    _log_late(tracking_uri, mlflow_run_id, "suite/alarm_count", float(count), 0, late, artifacts)


def _log_late(tracking_uri: str, run_id: str, metric: str, count: float, step: int,
              late: list[str], artifacts: list[Path]) -> tuple[Any, int]:
    """Log ``metric`` again (a later timestamp: its latest value), tag ``late``, replace ``artifacts``.

    Returns the client and the timestamp used.
    """
    from mlflow.entities import Metric, RunTag

    _bound_http()
    client = mlflow_client(tracking_uri)
    run = client.get_run(run_id)
    timestamp = max(int(time.time() * 1000), int(run.info.start_time) + 1)
    client.log_batch(run_id, metrics=[Metric(metric, count, timestamp, step)],
                     tags=[RunTag(alarm_tag(a), "true") for a in late])
    _log_files(client, run, artifacts)
    return client, timestamp


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
    adopt: bool = False,
) -> str:
    """Log one evaluation as an MLflow run; returns the run id.

    ``adopt``: a run of this evaluation (its request id) that another process finished logging is
    its run (returned, nothing logged); one it left unfinished is deleted and logged anew.
    """
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    client = mlflow_client(tracking_uri)
    exp_id = _experiment_id(client, tracking_uri, experiment)
    if adopt and (done := _adopted(client, exp_id, str(report["request_id"]))) is not None:
        # Its process may have died before the trainer's point: logged again, the same rows,
        # which the store keeps once.
        log_into_trainer_run(client, report, flatten_metrics(report), int(done.info.start_time))
        return str(done.info.run_id)
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
    tags.update(history_tags(report))
    for alarm in report["alarms"]:
        tags[alarm_tag(alarm)] = "true"
    run = client.create_run(exp_id, tags=tags, run_name=run_name)
    run_id: str = run.info.run_id
    from mlflow.entities import Metric, Param

    step = int(report.get("step") or 0)
    ts = int(run.info.start_time)
    flat = flatten_metrics(report)
    metrics = [Metric(k, v, ts, step) for k, v in flat.items()]
    str_params = [Param(k, str(v)[:6000]) for k, v in params.items()]
    try:
        client.log_batch(run_id, metrics=metrics, params=str_params)
        _log_files(client, run, artifacts)
        client.set_terminated(run_id, "FAILED" if report["harness_fault"] else "FINISHED")
    except BaseException:
        # A retry (``log_or_queue``) or the queue makes the run anew: a half-logged one left
        # RUNNING would be another evaluation of this step to the history's reader.
        with contextlib.suppress(Exception):
            client.delete_run(run_id)
        raise
    try:  # last, once per logged evaluation: a retry above never logs the trainer's point twice
        log_into_trainer_run(client, report, flat, ts)
    except Exception as err:  # the trainer's run may be deleted or read-only: never fatal
        logger.warning("could not log eval metrics into training run %s: %s",
                       report.get("training_run_id"), err)
    return run_id


def _adopted(client: Any, exp_id: str, request_id: str) -> Any:
    """The finished run of ``request_id`` in the experiment (None: none); unfinished ones are deleted."""
    runs = client.search_runs([exp_id], filter_string=f"tags.`evalfleet.request_id` = '{request_id}'")
    for run in runs:
        if run.info.status in ("FINISHED", "FAILED") and run.info.end_time:
            return run
    for run in runs:
        client.delete_run(run.info.run_id)
    return None


def _log_files(client: Any, run: Any, paths: list[Path]) -> None:
    """Log files at the root of ``run``'s artifacts, as ``client.log_artifact`` does.

    The repository comes from the run just created: ``log_artifact`` would read the run back
    from the store (a query) to learn its artifact URI. Directories (and Databricks, whose URIs
    the client rewrites) go through the client.
    """
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo: Any = None
    for path in paths:
        if Path(path).is_dir() or str(client.tracking_uri).startswith("databricks"):
            client.log_artifact(run.info.run_id, str(path))
            continue
        if repo is None:
            repo = get_artifact_repository(run.info.artifact_uri, tracking_uri=client.tracking_uri)
        repo.log_artifact(str(path))


def _experiment_id(client: Any, tracking_uri: str, experiment: str) -> str:
    """The experiment's id, created (artifacts next to a SQLite store) when it does not exist."""
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        return str(exp.experiment_id)
    location = None
    if tracking_uri.startswith("sqlite:///"):
        location = (Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
    return str(client.create_experiment(experiment, artifact_location=location))


def suite_metrics(report: dict[str, Any]) -> dict[str, float]:
    """A suite report's aggregates as ``suite/`` metrics (point, ci_low, ci_high each).

    Also its coverage (the lowest of its tasks'), each task's, its harness fault and alarm count,
    as a single evaluation's run has them.
    """
    m: dict[str, float] = {"suite/tasks": float(len(report["tasks"])),
                           "suite/harness_fault": float(report["harness_fault"]),
                           "suite/alarm_count": len(report.get("alarms") or [])}
    if "coverage" in report:
        m["suite/coverage"] = report["coverage"]
    for key, est in report["aggregates"].items():
        m[f"suite/{key}"], m[f"suite/{key}_ci_low"], m[f"suite/{key}_ci_high"] = (
            est["point"], est["ci"][0], est["ci"][1])
    if report.get("probability_of_improvement"):
        poi = report["probability_of_improvement"]
        m["suite/p_improvement"] = poi["point"]
        m["suite/p_improvement_ci_low"], m["suite/p_improvement_ci_high"] = poi["ci"]
    for i, task in enumerate(report["tasks"]):
        if task.get("score_mean") is not None:
            m[f"suite/task_{i:02d}_score"] = task["score_mean"]
        if "coverage" in task:
            m[f"suite/task_{i:02d}_coverage"] = task["coverage"]
    return {k: float(v) for k, v in m.items()}


def suite_result_metrics(aggregates: dict[str, Any], improvement: dict[str, Any] | None,
                         tasks: int, coverage: float | None = None) -> dict[str, float]:
    """A suite's ``eval/`` numbers, as the trainer sees them.

    The IQM as ``eval/reward`` (with its interval), every aggregate as ``eval/suite/<aggregate>``
    (``_ci_low``/``_ci_high``), the probability of improvement over a baseline when there is one,
    and ``eval/coverage``, the lowest of the tasks' (``SuiteReport.coverage``), when given.
    """
    iqm = aggregates["iqm"]
    out = {"eval/reward": iqm["point"], "eval/reward_ci_low": iqm["ci"][0],
           "eval/reward_ci_high": iqm["ci"][1], "eval/suite/tasks": tasks}
    if coverage is not None:
        out["eval/coverage"] = coverage
    for key, est in aggregates.items():
        out[f"eval/suite/{key}"] = est["point"]
        out[f"eval/suite/{key}_ci_low"], out[f"eval/suite/{key}_ci_high"] = est["ci"]
    if improvement:
        out["eval/suite/p_improvement"] = improvement["point"]
    return {k: float(v) for k, v in out.items()}


def log_suite(
    tracking_uri: str,
    experiment: str,
    report: dict[str, Any],
    params: dict[str, Any],
    artifacts: list[Path],
    run_name: str,
    *,
    training_run_id: str | None = None,
    step: int | None = None,
) -> str:
    """Log a suite as one MLflow parent run; each task's own run becomes its nested child.

    The tasks' runs (``report["tasks"][i]["mlflow_run_id"]``, logged by their own evaluations) get
    the ``mlflow.parentRunId`` tag of the new run, which is how MLflow nests runs. Returns the
    parent's run id. With ``training_run_id`` and ``step``, the suite's ``eval/`` numbers
    (``suite_result_metrics``) go into the trainer's run at that step, once: its tasks log none.
    """
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.entities import Metric, Param, RunTag

    client = mlflow_client(tracking_uri)
    exp_id = _experiment_id(client, tracking_uri, experiment)
    tags = {
        "evalfleet.suite": report["suite"],
        "evalfleet.policy_sha256": report["policy_sha256"],
        "evalfleet.request_id": report["request_id"],
        "evalfleet.harness_fault": str(report["harness_fault"]).lower(),
        "mlflow.runName": run_name,
    }
    from evalfleet.suite import alarm_names

    for name in alarm_names(report.get("alarms") or [], report["request_id"]):  # its tasks' too
        tags[alarm_tag(name)] = "true"
    run = client.create_run(exp_id, tags=tags, run_name=run_name)
    run_id: str = run.info.run_id
    ts = int(run.info.start_time)
    metrics = [Metric(k, v, ts, 0) for k, v in suite_metrics(report).items()]
    client.log_batch(run_id, metrics=metrics,
                     params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    for task in report["tasks"]:  # one write per task run, not one per tag
        if task.get("mlflow_run_id"):
            client.log_batch(task["mlflow_run_id"], tags=[
                RunTag("mlflow.parentRunId", run_id), RunTag("evalfleet.suite_task", task["name"])])
    if training_run_id and step is not None and _run_exists(client, training_run_id):
        try:
            client.log_batch(training_run_id, metrics=[
                Metric(k, v, ts, int(step)) for k, v in suite_result_metrics(
                    report["aggregates"], report.get("probability_of_improvement"),
                    len(report["tasks"]), report.get("coverage")).items()])
        except Exception as err:  # the trainer's run may be read-only: never fatal
            logger.warning("could not log the suite's eval metrics into training run %s: %s",
                           training_run_id, err)
    _log_files(client, run, artifacts)
    client.set_terminated(run_id, "FAILED" if report["harness_fault"] else "FINISHED")
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
    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

    return Retrying(stop=stop_after_attempt(attempts), reraise=True,
                    retry=retry_if_exception(lambda err: permanent_store_error(err) is None),
                    wait=wait_exponential(multiplier=wait_s[0], max=wait_s[1]))


def permanent_store_error(err: BaseException) -> str | None:
    """What about the store makes logging fail however often it is tried; None for anything else.

    A deleted experiment stays deleted: a run queued for it was never logged, by the next
    evaluation or by ``evalfleet mlflow flush``, and the evaluation exited 0.
    """
    text = str(err)
    if "must be in the 'active' state" in text:
        return ("its experiment is deleted in the store: restore it ('mlflow experiments restore') "
                "or pass another --experiment")
    return None


def pending_dir(output: Path) -> Path:
    """Where ``output``'s queued MLflow runs wait for the store to come back."""
    return Path(output) / PENDING_DIR


def log_or_queue(
    output: Path, tracking_uri: str, experiment: str, report: dict[str, Any],
    params: dict[str, Any], artifacts: list[Path], run_name: str, *,
    attempts: int = LOG_ATTEMPTS, wait_s: tuple[float, float] = LOG_WAIT_S, adopt: bool = False,
) -> dict[str, str]:
    """Log the evaluation to MLflow, retried; if the store stays unreachable, queue it.

    ``adopt``: a run of this evaluation another process may have logged is taken as it is
    (``log_evaluation``; the shared logger that died before answering, ``evalfleet.mlflow_logger``).

    Returns the report's outputs to add: ``mlflow_uri`` and ``mlflow_run_id`` once logged, else
    ``mlflow_error`` and ``mlflow_queued`` (the pending file that ``flush_pending`` logs later:
    the next evaluation writing to ``output``, or ``evalfleet mlflow flush``). The Parquet and the
    cache were written before this runs, so nothing of the result depends on it.
    """
    _bound_http()
    try:
        for attempt in _attempts(attempts, wait_s):
            with attempt:
                run_id = log_evaluation(tracking_uri, experiment, report, params, artifacts, run_name,
                                        adopt=adopt)
        return {"mlflow_uri": tracking_uri, "mlflow_run_id": run_id}
    except Exception as err:  # noqa: BLE001 - any store failure queues the run
        error, failure = f"{type(err).__name__}: {err}"[:1000], err
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
    out = {"mlflow_error": error, "mlflow_queued": str(path.resolve())}
    if (why := permanent_store_error(failure)) is not None:
        out["mlflow_permanent"] = why
    return out


def _bound_http() -> None:
    """Bound MLflow's own HTTP retries while evalfleet logs, unless the operator set them.

    Its defaults (7 retries, backoff factor 2: minutes) would multiply with evalfleet's attempts.
    """
    for name, value in MLFLOW_HTTP_BOUNDS.items():
        os.environ.setdefault(name, value)


#: The outcome of a pending file another process is flushing right now (``flush_pending``).
BUSY = "being logged by another process now (left to it)"


def flush_pending(output: Path, tracking_uri: str | None = None, *,
                  wait_s: float = 0.0) -> list[dict[str, str]]:
    """Log every queued run of ``output`` once; returns one outcome per pending file.

    A run that logs is removed from the queue, and its report.json (when still there) gets its
    ``mlflow_run_id``, as do the ``--report`` copies the entry names (``note_report_copy``); one
    that fails again stays queued. ``tracking_uri`` overrides the URI a
    run was queued with (a store that moved). The run is logged from that report.json as it is
    then (``_final_report``), not as it was queued.

    Each file is flushed under an exclusive lock on it (``fcntl.flock``): two processes flushing
    one queue at once (two evaluations' stage 7, ``evalfleet mlflow flush``) each logged the
    same queued run, two MLflow runs of one evaluation. One another process is flushing is left
    to it (``busy``, with ``error`` ``BUSY``) once ``wait_s`` seconds of waiting for it passed;
    one it logged meanwhile is no outcome.
    """
    from evalfleet.storage import report_lock

    _bound_http()
    results = []
    for path in sorted(pending_dir(output).glob("*.json")):
        with _locked(path, wait_s) as held:
            if held is None:  # logged and removed (or queued anew) by another process meanwhile
                continue
            if not held:
                results.append({"pending": str(path), "error": BUSY, "busy": "true"})
                continue
            try:
                entry = json.loads(path.read_text())
                uri = tracking_uri or entry["tracking_uri"]
                artifacts = [Path(a) for a in entry["artifacts"] if Path(a).exists()]
                report_json = _report_json(entry)
                # Held from reading report.json to recording the run there: what stage 7 adds
                # meanwhile (a failed callback's alarm) it logs into the run itself only once
                # report.json names the run (``pipeline.write_report``), so it is in the run either way.
                with report_lock(report_json) if report_json else contextlib.nullcontext():
                    run_id = log_evaluation(uri, entry["experiment"], _final_report(entry, report_json),
                                            entry["params"], artifacts, entry["run_name"])
                    path.unlink(missing_ok=True)  # before the locks are released: no one logs it again
                    if report_json:
                        _note_logged(report_json, uri, run_id)
                    for copy in entry.get("report_copies") or []:  # the CLI's --report, the same way
                        _note_logged(Path(copy), uri, run_id, str(entry["report"]["request_id"]))
            except Exception as err:  # noqa: BLE001 - stays queued for the next flush
                results.append({"pending": str(path),
                                "error": f"{type(err).__name__}: {err}"[:500]})
                continue
        results.append({"pending": str(path), "request_id": str(entry["report"]["request_id"]),
                        "mlflow_run_id": run_id})
    return results


@contextlib.contextmanager
def _locked(path: Path, wait_s: float) -> Iterator[bool | None]:
    """Hold the exclusive lock of pending file ``path`` in the block: True when held.

    False when another process holds it (after ``wait_s`` seconds of trying); None when the file
    is gone, or is no longer the file locked (removed, or queued anew, meanwhile).
    """
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield None
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        yield True if same else None
    finally:
        os.close(fd)  # releases the lock


def _report_json(entry: dict[str, Any]) -> Path | None:
    """The evaluation's report.json among a queued run's artifacts, if it is still there."""
    for name in entry["artifacts"]:
        if Path(name).name == "report.json" and Path(name).exists():
            return Path(name)
    return None


def _final_report(entry: dict[str, Any], report_json: Path | None) -> dict[str, Any]:
    """The report a queued run is logged with: its report.json as it is now, else as queued.

    Stage 7 goes on after queueing the run, and report.json is its truth: a failed callback (and
    a store refusing the run for good) adds an ``output_missing`` alarm after the queueing.
    Logged as queued, the run lacked those alarms' tags and counted one alarm less in
    ``eval/alarm_count`` than report.json. The caller holds ``report_json``'s lock.
    """
    queued: dict[str, Any] = entry["report"]
    if report_json is None:
        return queued
    try:
        final = json.loads(report_json.read_text())
    except (OSError, ValueError) as err:
        logger.warning("%s does not read (%s): logging its run as it was queued", report_json, err)
        return queued
    if not isinstance(final, dict) or final.get("request_id") != queued.get("request_id"):
        return queued  # not this evaluation's report (or not one at all)
    return final


def note_report_copy(queued: Path, copy: Path, write: Callable[[], object], wait_s: float) -> bool:
    """Write a ``--report`` copy of a report whose MLflow run is queued, and name it in the entry.

    The flush that logs the run later records it in the copy as in report.json: before, the copy
    kept ``mlflow_error`` and ``mlflow_queued`` (naming a queue file gone) for good. ``write``
    writes the copy, under the entry's lock (``flush_pending``'s): a flush cannot come between the
    write and the entry naming it. False, and nothing written, when the entry is gone (logged
    meanwhile: report.json names the run) or another process still logs it after ``wait_s``.
    """
    with _locked(queued, wait_s) as held:
        if not held:
            return False
        try:
            entry = json.loads(queued.read_text())
        except (OSError, ValueError) as err:  # the flush will not read it either
            logger.warning("queue entry %s does not read (%s): %s is not named in it", queued, err, copy)
            return False
        write()
        named = str(copy.resolve())
        entry["report_copies"] = [*[c for c in entry.get("report_copies") or [] if c != named], named]
        tmp = queued.with_name(f".{queued.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry, default=str))
        # A new file under the name: one reading it unlocked (``queued_checkpoints``) never sees half
        # of it. A flush waiting on the old one's lock then finds it replaced and leaves it to the
        # next flush (``_locked``); one taking the new one's lock reads it with the copy named.
        os.replace(tmp, queued)
        return True


def _note_logged(path: Path, uri: str, run_id: str, request_id: str | None = None) -> None:
    """Record the late MLflow run in the evaluation's report.json; the caller holds its lock.

    ``request_id``: only if the file is still that evaluation's report (a ``--report`` copy's path
    may hold a later evaluation's by now), else it is left as it is.
    """
    try:
        report = json.loads(path.read_text())
        if request_id is not None and (not isinstance(report, dict)
                                       or report.get("request_id") != request_id):
            return
        outputs = dict(report.get("outputs") or {})
        outputs.pop("mlflow_queued", None)
        error = outputs.pop("mlflow_error", None)  # what queued it, kept as such
        if error:
            outputs["mlflow_queued_after"] = error
        outputs.update(mlflow_uri=uri, mlflow_run_id=run_id,
                       mlflow_logged_late=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        report["outputs"] = outputs
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)
    except (OSError, ValueError) as err:
        logger.warning("logged %s late, but could not update %s: %s", run_id, path, err)
