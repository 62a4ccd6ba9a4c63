"""A suite's result: aggregates over its tasks, plots, the report page, JSON and MLflow.

Called once every task's own evaluation finished (each wrote its own report, Parquet and MLflow
run, as a single evaluation does). Prefect-free; ``flows/suite.py`` wires it.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from evalfleet.aggregates import normalise
from evalfleet.models import EvalReport, EvalRequest, with_missing
from evalfleet.plots import SUITE_PLOT_FILES, render_suite_plots, suite_figures
from evalfleet.review import _data_uri, _templates
from evalfleet.scoring import outcomes
from evalfleet.stats import MIN_PAIRS
from evalfleet.storage import run_dir, write_json
from evalfleet.suite import (
    Suite,
    SuiteReport,
    alarm_names,
    improvement,
    suite_aggregates,
    task_row,
    task_scores,
)
from evalfleet.summary import number, percent
from evalfleet.tracking import default_tracking_uri, log_suite

__all__ = ["MIN_TASK_EPISODES", "Aggregated", "aggregate_and_draw", "build_suite_report",
           "coverage_alarms", "few_episodes_alarms", "flattering_score_alarms",
           "identical_task_alarms", "suite_feed_back",
           "suite_markdown", "suite_page"]

logger = logging.getLogger(__name__)

_LABELS = {"mean": "mean", "median": "median", "iqm": "IQM", "optimality_gap": "optimality gap"}
_CAPTIONS = {
    "performance_profile": "Performance profile: fraction of all episodes (over every task) whose "
    "score is above each threshold, with 95% bands.",
    "aggregate_intervals": "Aggregate metrics with 95% stratified-bootstrap intervals.",
    "task_scores": "Per-task mean scores with their 95% CIs.",
}


@dataclass(frozen=True)
class Aggregated:
    """A suite's aggregates and its pictures, computed before its tasks' stage 7 finished.

    ``aggregate_and_draw`` makes it (on a Dask worker, while the flow logs the tasks' runs);
    ``build_suite_report(..., aggregated=)`` and ``suite_feed_back(..., pictures=)`` use it.
    """

    report: SuiteReport
    """The suite report from the tasks' stage-6 reports (the numbers; no outputs yet)."""
    pictures: dict[str, bytes] = field(default_factory=dict)
    """PNG bytes by ``SUITE_PLOT_FILES`` key (empty when drawing failed)."""
    error: str = ""
    """Why drawing failed, if it did (pictures never cost the numbers)."""


def aggregate_and_draw(
    suite: Suite, base: EvalRequest, reports: Sequence[EvalReport], tables: Sequence[pa.Table],
    baseline_tables: Sequence[pa.Table] | None = None,
) -> Aggregated:
    """The suite's aggregates (bootstrap CIs) and its figures as PNG bytes, in one call.

    Needs only what stages 5 and 6 produced, so it runs beside stage 7 (on an idle worker): the
    bytes, not files, come back, so a worker on another host works too.
    """
    report = build_suite_report(suite, base, reports, tables, baseline_tables)
    try:
        pictures = {}
        for key, fig in suite_figures(report.model_dump(mode="json")).items():
            buf = io.BytesIO()
            fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})  # as plots._save
            pictures[key] = buf.getvalue()
    except Exception as err:  # pictures must never cost the numbers
        return Aggregated(report, {}, f"{type(err).__name__}: {err}")
    return Aggregated(report, pictures)


#: A task whose mean normalised score lies further than this from [0, 1] (in units of its
#: random-to-reference span) raises ``score_out_of_range``: bounds that are nearly equal, swapped
#: or on another scale than the returns make one task outweigh every other in the aggregates.
SCORE_RANGE_ALARM = 10.0


def score_range_alarms(suite: Suite, scores: Sequence[np.ndarray]) -> list[str]:
    """``score_out_of_range`` for each normalised task whose mean score is far outside [0, 1]."""
    alarms = []
    for task, s in zip(suite.tasks, scores, strict=True):
        n = task.normalisation
        if n is None or not s.size:
            continue
        mean = float(s.mean())
        if mean > 1.0 + SCORE_RANGE_ALARM or mean < -SCORE_RANGE_ALARM:
            alarms.append(
                f"score_out_of_range: task {task.name!r} has a mean normalised score of {mean:.4g} "
                f"(bounds {n.kind} = {n.low:g} / {n.high:g}, span {n.high - n.low:.4g}); one task this "
                "far outside [0, 1] outweighs the others in the suite's mean: check its 'normalise' "
                "bounds against the returns the task gives (its mean return is in the task rows)")
    return alarms


#: Fewest scored episodes of a task (the policy's or the baseline's) behind the aggregates'
#: intervals without ``aggregate_intervals_unreliable``: ``stats.MIN_PAIRS``, the fewest pairs a
#: paired comparison gives a verdict on. The stratified percentile bootstrap resamples within each
#: task: at 1 episode a task every "95% CI" had zero width, and with 4 tasks of N(mu, 1) scores the
#: mean's covered 76% at 2 episodes a task, 88% at 5, 92% at 10 (300 simulations each).
MIN_TASK_EPISODES = MIN_PAIRS


def few_episodes_alarms(suite: Suite, scores: Sequence[np.ndarray],
                        baseline_tables: Sequence[pa.Table] | None = None) -> list[str]:
    """``aggregate_intervals_unreliable`` when a task has fewer than ``MIN_TASK_EPISODES`` scored."""
    few = [f"{t.name!r} {s.size}" for t, s in zip(suite.tasks, scores, strict=True)
           if s.size < MIN_TASK_EPISODES]
    if baseline_tables:
        for task, table in zip(suite.tasks, baseline_tables, strict=True):
            scored = int(outcomes(table).scored.sum())
            if scored < MIN_TASK_EPISODES:
                few.append(f"the baseline's {task.name!r} {scored}")
    if not few:
        return []
    which = "the aggregates' and P(improvement)'s" if baseline_tables else "the aggregates'"
    return [f"aggregate_intervals_unreliable: tasks with fewer than {MIN_TASK_EPISODES} scored "
            f"episodes ({', '.join(few)}): {which} 95% intervals resample episodes within each task "
            "and cover far less than 95% at so few (zero width at 1 a task; ~76% at 2, ~88% at 5, "
            "simulated); read their points, not their intervals, or run at least "
            f"{MIN_TASK_EPISODES} episodes a task ('episodes' in the suite file)"]


def coverage_alarms(suite: Suite, tables: Sequence[pa.Table],
                    baseline_tables: Sequence[pa.Table] | None = None) -> list[str]:
    """``task_coverage`` for each task, the policy's or the baseline's, with episodes left out.

    A task's score and every aggregate stand on its scored episodes only: episodes the harness
    lost (the env raised on its hardest or easiest seeds) move the suite's headline, below the
    harness fault's 5% too, as they move a single evaluation's (whose summary states coverage).
    """
    alarms = []
    groups = [("", tables)] + ([("the baseline on ", baseline_tables)] if baseline_tables else [])
    for who, group in groups:
        for task, table in zip(suite.tasks, group, strict=True):
            kinds = outcomes(table)
            scored = int(kinds.scored.sum())
            if scored == kinds.planned:
                continue
            reasons = Counter(table.column("end_reason").to_numpy(zero_copy_only=False)[~kinds.scored])
            alarms.append(
                f"task_coverage: {who}task {task.name!r} scored {scored} of {kinds.planned} episodes "
                f"(coverage {percent(kinds.coverage, 1)}; left out: "
                f"{', '.join(f'{k}={v}' for k, v in sorted(reasons.items()))}); its score and the "
                "suite's aggregates stand on the scored episodes only: see the task's report")
    return alarms


def flattering_score_alarms(suite: Suite, tables: Sequence[pa.Table],
                            baseline_tables: Sequence[pa.Table] | None = None) -> list[str]:
    """``policy_failures_flatter`` for each task whose policy failures score above its completed episodes.

    ``report.flattering_failures`` on the normalised scores: a failure counts with its partial
    return, and on a task whose normalisation runs downward (``high < low``: lower returns are
    better) a partial return below the completed ones scores above them, which the task's own
    report, comparing returns, cannot see: 5 invalid actions at step 0 of 30 episodes scored the
    reference's 1.0 each and raised the task's score from 0.641 to 0.701. Only such tasks are
    checked here: elsewhere scores order as returns do and the task's report raised the alarm.
    """
    alarms = []
    groups = [("", tables)] + ([("the baseline on ", baseline_tables)] if baseline_tables else [])
    for who, group in groups:
        for task, table in zip(suite.tasks, group, strict=True):
            n = task.normalisation
            kinds = outcomes(table)
            failed = kinds.policy & kinds.scored
            if n is None or n.high > n.low or not failed.any() or not kinds.completed.any():
                continue  # (no completed episode: the task's report says so, in either direction)
            scores = normalise(table.column("return").to_numpy(zero_copy_only=False), n.low, n.high)
            partial, done = float(scores[failed].mean()), float(scores[kinds.completed].mean())
            if partial <= done:
                continue
            alarms.append(
                f"policy_failures_flatter: {who}task {task.name!r}: {int(failed.sum())} episodes "
                f"ended by the policy count with their partial return (mean score {partial:.4g}), "
                f"above the completed episodes' mean score ({done:.4g}): the task's normalisation "
                f"runs downward ({n.kind} = {n.low:g} / {n.high:g}: lower returns are better), so "
                "ending early scores higher, and the task's score and the suite's aggregates may "
                "overstate this policy. Fix the policy's failures (see the task's report) and "
                "evaluate again")
    return alarms


def identical_task_alarms(suite: Suite, tables: Sequence[pa.Table]) -> list[str]:
    """``identical_tasks`` for each group of tasks whose episodes are identical, seed by seed.

    Return, length and ending of every episode index both ran (the same seeds in every task).
    Kwargs compared before anything ran catch a spelling (``20`` and ``20.0``), not a kwarg spelled
    out at its default value nor an alias of the env: such tasks are one evaluation, counted once
    per task in every aggregate, as if independent (the mean's interval ~sqrt(3) too narrow for 3).
    """
    def episodes(table: pa.Table) -> tuple[np.ndarray, ...]:
        order = np.argsort(table.column("episode_index").to_numpy(), kind="stable")
        return tuple(table.column(c).to_numpy(zero_copy_only=False)[order]
                     for c in ("episode_index", "return", "length", "end_reason"))

    groups: list[tuple[tuple[np.ndarray, ...], list[int]]] = []
    for i, table in enumerate(tables):
        mine = episodes(table)
        for theirs, members in groups:
            n = min(mine[0].size, theirs[0].size)
            if n and all(np.array_equal(a[:n], b[:n], equal_nan=a.dtype.kind == "f")
                         for a, b in zip(mine, theirs, strict=True)):
                members.append(i)
                break
        else:
            groups.append((mine, [i]))
    alarms = []
    for _, members in groups:
        if len(members) > 1:
            names = ", ".join(repr(suite.tasks[i].name) for i in members)
            common = min(tables[i].num_rows for i in members)
            alarms.append(
                f"identical_tasks: tasks {names} have identical episodes (return, length and ending "
                f"of each of their {common} common seeds): if they are one evaluation (a kwarg "
                f"spelled out at its default value, an alias of the env), the aggregates count it "
                f"{len(members)} times as independent tasks, with {len(members)}x its weight and "
                "intervals too narrow; keep one of them")
    return alarms


def build_suite_report(
    suite: Suite, base: EvalRequest, reports: Sequence[EvalReport], tables: Sequence[pa.Table],
    baseline_tables: Sequence[pa.Table] | None = None, seconds: float = 0.0, *,
    aggregated: Aggregated | None = None, baseline_reports: Sequence[EvalReport] = (),
) -> SuiteReport:
    """Aggregate the tasks' scored episodes (and the baseline's, on the same tasks and seeds).

    ``aggregated`` (from ``aggregate_and_draw`` on the same episodes) supplies the aggregates, so
    the bootstrap is not run twice; the task rows, alarms and outputs come from ``reports``.
    The baseline's own alarms and harness faults (``baseline_reports``) are the suite's too: its
    aggregates and P(improvement) stand on what of its episodes was scored.
    """
    scores = [task_scores(t, table) for t, table in zip(suite.tasks, tables, strict=True)]
    baseline, poi = None, None
    if aggregated is not None:
        done = aggregated.report
        summary: dict[str, Any] = {"aggregates": done.aggregates, "profile": done.profile}
        baseline, poi = done.baseline, done.probability_of_improvement
    else:
        summary = suite_aggregates(suite, scores, base.seed)
    if baseline_tables is not None and aggregated is None:
        theirs = [task_scores(t, table) for t, table in zip(suite.tasks, baseline_tables, strict=True)]
        baseline = {"policy": base.baseline, **suite_aggregates(suite, theirs, base.seed),
                    "task_means": [float(s.mean()) for s in theirs]}
        poi = improvement(scores, theirs, base.seed, suite.reps)
    alarms = [f"{r.request_id}: {a}" for r in reports for a in r.alarms]
    alarms += [f"baseline {r.request_id}: {a}" for r in baseline_reports for a in r.alarms]
    if not suite.normalised:
        alarms.append("suite_not_normalised: some tasks have no 'normalise'; raw returns of "
                      "different scales are aggregated together")
    alarms += score_range_alarms(suite, scores)
    alarms += coverage_alarms(suite, tables, baseline_tables)
    alarms += flattering_score_alarms(suite, tables, baseline_tables)
    alarms += identical_task_alarms(suite, tables)
    alarms += few_episodes_alarms(suite, scores, baseline_tables)
    if baseline is not None and baseline_tables is not None:
        baseline = {**baseline, "task_coverage": [outcomes(t).coverage for t in baseline_tables]}
    return SuiteReport(
        suite=suite.name, request_id=base.request_id,
        policy_sha256=reports[0].policy_sha256 if reports else "",
        normalised=suite.normalised,
        tasks=[task_row(t, r, s) for t, r, s in zip(suite.tasks, reports, scores, strict=True)],
        aggregates=summary["aggregates"], profile=summary["profile"], gamma=suite.gamma,
        baseline=baseline, probability_of_improvement=poi, alarms=alarms,
        harness_fault=any(r.harness_fault for r in [*reports, *baseline_reports]),
        coverage=min((r.coverage for r in reports), default=1.0), seconds=seconds,
    )




def _estimate(est: Mapping[str, Any]) -> str:
    return f"{number(est['point'])} [{number(est['ci'][0])}, {number(est['ci'][1])}]"


def _scored(task: Mapping[str, Any]) -> str:
    """``scored/episodes``, with the coverage when episodes were left out (as a single summary)."""
    if "scored" not in task:
        return str(task["episodes"])
    scored, planned = task["scored"], task["episodes"]
    text = f"{scored}/{planned}"
    return text if scored == planned else f"{text} ({percent(scored / planned, 1)})"


def suite_markdown(report: SuiteReport, *, pictures: bool = False) -> str:
    """The suite's aggregates and tasks as Markdown; ``pictures`` embeds the plots (PNG data URIs).

    The Prefect artifact has the pictures; the terminal summary does not.
    """
    lines = [f"# Suite `{report.suite}`: {len(report.tasks)} tasks",
             "", "| policy | " + " | ".join(_LABELS.values()) + " |", "|---" * (len(_LABELS) + 1) + "|"]
    rows = [("policy", report.aggregates)]
    if report.baseline:
        rows.append(("baseline", report.baseline["aggregates"]))
    for name, agg in rows:
        lines.append(f"| {name} | " + " | ".join(_estimate(agg[k]) for k in _LABELS) + " |")
    if report.probability_of_improvement:
        lines += ["", f"P(improvement over baseline): {_estimate(report.probability_of_improvement)}"]
    lines += ["", "| task | scored / episodes | mean return [95% CI] | mean score | cache |",
              "|---|---:|---|---:|---|"]
    for t in report.tasks:
        lines.append(f"| {t['name']} | {_scored(t)} | {number(t['mean_return'])} [{number(t['ci'][0])}, "
                     f"{number(t['ci'][1])}] | {number(t['score_mean'])} | {t['cache']} |")
    lines += [f"- ALARM {a}" for a in report.alarms]
    if pictures:
        for key, caption in _CAPTIONS.items():
            path = report.outputs.get(f"plot_{key}")
            if path and Path(path).exists():
                lines += ["", f"![{caption}]({_data_uri(Path(path), 'image/png')})"]
    return "\n".join(lines) + "\n"


def suite_page(report: SuiteReport, plots: Mapping[str, Path], out_path: Path) -> Path:
    """Write the suite's self-contained HTML page (plots embedded) to ``out_path``."""
    rows = [("policy", report.aggregates)] + (
        [("baseline", report.baseline["aggregates"])] if report.baseline else [])
    tasks = [{"name": t["name"], "env": t["env"], "kwargs": t["env_kwargs"], "episodes": _scored(t),
              "returns": f"{number(t['mean_return'])} [{number(t['ci'][0])}, {number(t['ci'][1])}]",
              "score": f"{number(t['score_mean'])} [{number(t['score_ci'][0])}, {number(t['score_ci'][1])}]",
              "cache": t["cache"], "report": t["report"]} for t in report.tasks]
    page = _templates().get_template("suite.html.j2").render(
        title=f"evalfleet suite — {report.suite}", report=report,
        metrics=[{"label": v} for v in _LABELS.values()],
        aggregate_rows=[{"name": n, "cells": [_estimate(a[k]) for k in _LABELS]} for n, a in rows],
        tasks=tasks,
        plots=[{"key": k, "caption": _CAPTIONS[k], "src": _data_uri(Path(p), "image/png")}
               for k, p in plots.items()],
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out_path)
    return out_path


def suite_feed_back(report: SuiteReport, base: EvalRequest, pictures: Aggregated | None = None
                    ) -> SuiteReport:
    """Plots, report.html, suite_report.json, then the MLflow parent run (a failing sink is noted).

    ``pictures``: the figures ``aggregate_and_draw`` already drew, written as they are.
    """
    t0 = time.perf_counter()
    folder = run_dir(base.output, f"suite-{base.request_id}")
    outputs = {"folder": str(folder.resolve())}
    files: list[Path] = []
    missing: list[str] = []  # outputs asked for and not produced: alarms, and a failed run
    plots: dict[str, Path] = {}
    try:
        if pictures is not None and pictures.error:
            raise RuntimeError(pictures.error)
        plots = (_write_pictures(pictures.pictures, folder / "plots") if pictures is not None
                 else render_suite_plots(report.model_dump(mode="json"), folder / "plots"))
        page = suite_page(report, plots, folder / "report.html")
        files += [*plots.values(), page]
        outputs["report_html"] = str(page.resolve())
        outputs.update({f"plot_{k}": str(p.resolve()) for k, p in plots.items()})
    except Exception as err:  # pictures must never cost the numbers
        logger.error("suite plots failed (%s); results are in %s", err, folder)
        outputs["review_error"] = f"{type(err).__name__}: {err}"
        missing.append(f"the suite's figures and report.html: {outputs['review_error']}")
    path = folder / "suite_report.json"
    outputs["report"] = str(path.resolve())
    write_json(report.model_copy(update={"outputs": outputs}).model_dump(mode="json"), path)
    uri = base.mlflow_uri or default_tracking_uri(base.output)
    try:
        outputs["mlflow_run_id"] = log_suite(
            uri, base.experiment, report.model_dump(mode="json"),
            params={"suite": report.suite, "tasks": len(report.tasks), "seed": base.seed,
                    "policy": base.policy, "baseline": base.baseline, "gamma": report.gamma},
            artifacts=[*files, path], run_name=f"suite-{report.suite}-{report.policy_sha256[:12]}",
            training_run_id=base.training_run_id, step=base.step)
        outputs["mlflow_uri"] = uri
    except Exception as err:  # a failing sink never loses the files already written
        logger.error("MLflow logging of the suite failed (%s); results are in %s", err, folder)
        outputs["mlflow_error"] = f"{type(err).__name__}: {err}"
        missing.append(f"the suite's MLflow parent run: {outputs['mlflow_error']}")
    final = report.model_copy(update={"outputs": outputs, "alarms": with_missing(report.alarms, missing),
                                      "seconds": report.seconds + time.perf_counter() - t0})
    if missing and "report_html" in outputs:  # the parent run's alarm, after the page: shown there too
        suite_page(final, plots, folder / "report.html")
    write_json(final.model_dump(mode="json"), path)
    if base.callback_url:  # last, so the trainer gets the MLflow run id; never raises
        from evalfleet.callback import send_report_callback

        logged = len(final.alarms)  # what the MLflow parent run holds
        outcome = send_report_callback(base.callback_url, final.model_dump(mode="json"))
        alarms = final.alarms if outcome.startswith("delivered") else with_missing(
            final.alarms, [f"the callback to the trainer: {outcome}"])
        final = final.model_copy(update={"outputs": {**final.outputs, "callback": outcome},
                                         "alarms": alarms})
        write_json(final.model_dump(mode="json"), path)
        if len(final.alarms) > logged:  # the page and the parent run show it too, as a task's do
            shown = [suite_page(final, plots, folder / "report.html")] if "report_html" in outputs else []
            if "mlflow_run_id" in final.outputs:
                final = suite_late_alarms_logged(final, final.alarms[logged:], [path, *shown])
                write_json(final.model_dump(mode="json"), path)
    return final


def suite_late_alarms_logged(report: SuiteReport, late: list[str],
                             artifacts: Sequence[Path]) -> SuiteReport:
    """The suite once the alarms raised after its MLflow parent run was logged are logged there too.

    As ``pipeline.late_alarms_logged`` for an evaluation: the run gets their alarm tags and
    ``suite/alarm_count`` again (a later timestamp, so its latest value agrees with
    suite_report.json), and ``artifacts`` (suite_report.json and report.html, written with
    them) replace its copies. A store gone since is stated in ``outputs['mlflow_alarms_error']``.
    """
    from evalfleet.tracking import log_late_suite_alarms

    run_id = report.outputs["mlflow_run_id"]
    try:
        log_late_suite_alarms(report.outputs["mlflow_uri"], run_id, len(report.alarms),
                              alarm_names(late, report.request_id), list(artifacts))
    except Exception as err:  # the store went away since: logged and stated, never fatal
        logger.error("could not log the late alarms into the suite's MLflow run %s: %s", run_id, err)
        return report.model_copy(update={"outputs": {
            **report.outputs, "mlflow_alarms_error": f"{type(err).__name__}: {err}"[:1000]}})
    return report


def _write_pictures(pictures: Mapping[str, bytes], out_dir: Path) -> dict[str, Path]:
    """Write PNG bytes by ``SUITE_PLOT_FILES`` key to ``out_dir``; returns ``{key: path}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, png in pictures.items():
        out[key] = out_dir / SUITE_PLOT_FILES[key]
        out[key].write_bytes(png)
    return out
