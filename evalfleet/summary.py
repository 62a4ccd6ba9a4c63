"""Human-readable summaries of a report: CLI table, Prefect table rows, markdown."""

from __future__ import annotations

import html
import math
from typing import Any

from evalfleet.models import EvalReport


def number(x: float | None) -> str:
    """A reported number with 4 significant digits: a small one never reads as 0.000.

    ``n/a`` for a missing or non-finite one (the suite's tables have those).
    """
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.3e}"


def _dropped(comparison: dict[str, object]) -> str:
    harness = comparison.get("dropped_harness_failures", 0)
    unmatched = comparison.get("dropped_unmatched", 0)
    parts = ([f"{harness} (harness failure on a side)"] if harness else []) + (
        [f"{unmatched} unmatched (no baseline row on the same index and seed)"] if unmatched else [])
    return f"; pairs dropped: {', '.join(parts)}" if parts else ""


def _endings(endings: dict[str, Any]) -> str:
    """``12 terminated, 488 truncated (480 at the step cap 500)``: a capped mean is visible."""
    text = f"{endings['terminated']:,} terminated, {endings['truncated']:,} truncated"
    if endings.get("step_cap"):
        text += f" ({endings['at_step_cap']:,} at the step cap {endings['step_cap']:,})"
    return text


def _device(report: EvalReport) -> str:
    execution = report.manifest.get("execution") or {}
    device = str(execution.get("device", "?"))
    fallback = execution.get("device_fallback")
    return f"{device} (fallback: {fallback})" if fallback else device


def _history(h: dict[str, object]) -> str:
    c = h.get("comparison")
    text = str(h["verdict"])
    if h.get("error"):
        text = f"not compared: history could not be read ({h['error']})"
    elif isinstance(c, dict) and "ci" in c:
        text += (f": {number(c['mean_diff'])}  [{number(c['ci']['low'])}, {number(c['ci']['high'])}] "
                 f"paired over {c['n']} episodes against step {c['baseline'].removeprefix('step ')}; "
                 f"P(improvement) {c['p_improvement']:.3f}{_dropped(c)}")
        if h.get("note"):
            text += f" ({h['note']})"
    elif h.get("note"):
        text += f" ({h['note']})"
    best = h.get("best_step")
    text += (f"; best checkpoint: step {best}" if best is not None else
             "; no best checkpoint under this protocol")
    withheld = h.get("best_withheld")
    if isinstance(withheld, list) and withheld:
        text += f" (this one is never the best: {', '.join(str(w) for w in withheld)})"
    return text


def percent(share: float, digits: int = 2) -> str:
    """``share`` as a percentage that never rounds a part to all or to nothing.

    19,999 of 20,000 episodes scored reads ">99.99%", not "100.00%" beside a harness failure;
    1 failure in 200,000 reads "<0.01%", not "0.00%".
    """
    text = f"{share:.{digits}%}"
    step = 10.0 ** -(digits + 2)
    if 0 < share < 1 and text == f"{1:.{digits}%}":
        return f">{1 - step:.{digits}%}"
    if 0 < share < 1 and text == f"{0:.{digits}%}":
        return f"<{step:.{digits}%}"
    return text


def percent_beyond(share: float, threshold: float, digits: int = 1) -> str:
    """``percent(share, digits)``, with more digits where it would round onto ``threshold``.

    An alarm that says a share is past a threshold must not print the threshold itself: 6 of
    119 episodes unscored read "5.0% ... > 5%, coverage 95.0%" beside the summary's 94.96%; now
    "5.04% ... > 5%, coverage 94.96%". Rounding to nearest never crosses the threshold, so only
    a tie with it needs the digits.
    """
    while digits < 6 and share != threshold and f"{share:.{digits}%}" == f"{threshold:.{digits}%}":
        digits += 1
    return percent(share, digits)


def _episodes_line(report: EvalReport) -> str:
    """Planned, scored (completed + policy failures with a return), and what is left out.

    A policy failure without a return (a forward that never returned before the episode began)
    is no scored episode: the parts add up to the scored count.
    """
    scored_failures = report.scored - report.completed
    unscored = report.policy_failures - scored_failures
    return (f"{report.episodes} planned, {report.scored} scored ({report.completed} completed + "
            f"{scored_failures} ended by the policy), {report.harness_failures} harness failures"
            + (f" and {unscored} policy failures without a return" if unscored > 0 else "")
            + " left out")


def summary_rows(report: EvalReport) -> list[dict[str, str]]:
    """The summary as (metric, value) rows."""
    r = report.returns
    low, high = report.ci
    failures = ", ".join(f"{k}={v}" for k, v in sorted(report.failures.items())) or "none"
    rows = [
        ("env", report.env_id),
        ("policy sha256", report.policy_sha256[:16]),
        ("isolation", report.isolation),
        ("device", _device(report)),
        ("episodes", _episodes_line(report)),
        ("coverage", f"{percent(report.coverage)} ({report.scored}/{report.episodes} episodes scored)"),
        ("mean return ± 95% CI", f"{number(r['mean'])}  [{number(low)}, {number(high)}]"),
        ("std", number(r["std"])),
        ("IQM", f"{number(r['iqm'])}  [{number(r['iqm_ci']['low'])}, {number(r['iqm_ci']['high'])}]"),
        ("min / median / max", f"{number(r['min'])} / {number(r['median'])} / {number(r['max'])}"),
        ("episode length mean", number(report.lengths["mean"])),
        *([("endings", _endings(report.endings))] if report.endings else []),
        ("failures", f"{failures} (rate {percent(report.failure_rate)}: policy "
                     f"{percent(report.policy_failure_rate)}, harness "
                     f"{percent(report.harness_failure_rate)})"),
    ]
    if report.success:
        s = report.success
        # As coverage: 1 success in 3,000 read "0.000  [0.000, 0.002]", 2,999 read "1.000".
        rows.append(("success rate", f"{percent(s['rate'])}  [{percent(s['ci']['low'])}, "
                                     f"{percent(s['ci']['high'])}]"))
    if report.adaptive:
        a = report.adaptive
        # Rounds the target was reached at, but too few episodes to stop early (audit.P_RARE).
        held = [str(r["round"]) for r in a["rounds"]
                if str(r.get("went_on") or "").startswith("minimum ")]
        rows.append(("adaptive", f"{len(a['rounds'])} rounds, CI half-width "
                                 f"{number(a['achieved_halfwidth'])} (target "
                                 f"{number(a['target_halfwidth'])}): {a['stop_reason']}"
                                 + (f"; went on after round {', '.join(held)}: minimum "
                                    f"{a['min_episodes_to_stop']} episodes before an early stop"
                                    if held else "")))
    if report.comparison:
        c = report.comparison
        if "ci" in c:
            rows.append(("vs baseline", f"{number(c['mean_diff'])}  [{number(c['ci']['low'])}, "
                                        f"{number(c['ci']['high'])}] paired over {c['n']} episodes: "
                                        f"{c['verdict']}; P(new > baseline) {c['p_improvement']:.3f}"
                                        f"{_dropped(c)}"))
        else:
            rows.append(("vs baseline", f"{c['verdict']} ({c.get('note', '')})"))
    if report.history and (report.history.get("verdict") or report.history.get("error")):
        rows.append(("vs best checkpoint", _history(report.history)))
    if report.audit is not None:
        skipped = report.audit.get("skipped", 0)
        timeouts = report.audit.get("skipped_policy_timeout", 0)
        why = ("infrastructure failure" if not timeouts else "policy timeout" if timeouts == skipped
               else f"{timeouts} policy timeout, {skipped - timeouts} infrastructure failure")
        rows.append(("determinism audit", f"{report.audit['checked']} re-run compared, "
                                          f"{len(report.audit['mismatches'])} mismatches"
                                          + (f", {skipped} not comparable ({why})"
                                             if skipped else "")))
    if report.step_rewards:
        w = report.step_rewards
        rows.append(("step rewards", f"{number(w['min'])} .. {number(w['max'])}; on min "
                                     f"{w['at_min_fraction']:.1%}, on max {w['at_max_fraction']:.1%} "
                                     f"of {w['steps']} non-final steps"))
    if report.alarms:
        rows.append(("ALARMS", "; ".join(report.alarms)))
    resumed = report.cache.get("resumed") or 0
    rows.append(("cache", f"{report.cache.get('status')} (reused {report.cache.get('reused', 0)}"
                          + (f", {resumed} persisted by an interrupted run)" if resumed else ")")))
    wall = sum(report.timings.values())
    rate = (f"{report.steps_per_second:,.0f} env steps/s in run" if report.steps_per_second is not None
            else "no episodes run" + (" (cache hit)" if report.cache.get("status") == "hit" else ""))
    rows.append(("wall time", f"{wall:.2f} s ({rate})"))
    for key in ("episodes", "report", "mlflow_run_id", "mlflow_error", "mlflow_queued",
                "mlflow_flushed", "prefect_lost"):
        if key in report.outputs:
            rows.append((key if key != "episodes" else "parquet", report.outputs[key]))
    return [{"metric": k, "value": v} for k, v in rows]


def summary_text(report: EvalReport) -> str:
    """A two-column plain-text table for the terminal."""
    rows = summary_rows(report)
    width = max(len(r["metric"]) for r in rows)
    return "\n".join(f"{r['metric']:<{width}}  {r['value']}" for r in rows)


def markdown_cell(text: object) -> str:
    """``text`` safe in a markdown table cell: no raw HTML, no table or line breaks.

    Env ids, alarms and error texts are user data (an env's render error reaches an alarm).
    """
    return html.escape(str(text), quote=False).replace("|", "/").replace("\n", " ")


def summary_markdown(report: EvalReport) -> str:
    """The summary as a markdown table (Prefect artifact, report page)."""
    lines = [f"# evalfleet: {markdown_cell(report.env_id)}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {r['metric']} | {markdown_cell(r['value'])} |" for r in summary_rows(report)]
    return "\n".join(lines) + "\n"
