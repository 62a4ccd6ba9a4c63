"""The headline counts what the policy broke and leaves out what the harness broke (coverage).

Planted cases: a policy that emits an invalid action exactly on the seeds where its return would
be lowest (``tests.flows.headline_envs``), an env that raises on some seeds, and fixed tables.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

import tests.flows.headline_envs as hurdles
from evalfleet import stats
from evalfleet.audit import RoundSchedule, compare_with_baseline
from evalfleet.client import result_from_report
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.records import EpisodeRecord, records_to_table
from evalfleet.report import aggregate
from evalfleet.review import report_markdown
from evalfleet.scoring import outcomes
from evalfleet.summary import summary_rows, summary_text
from evalfleet.tracking import flatten_metrics
from tests.core.episodes import run_in_process

ENV = "tests.flows.headline_envs:Hurdles-v0"
N = 200


def _run(policy_ref: str, env_kwargs: dict[str, object] | None = None, n: int = N) -> pa.Table:
    return run_in_process(ENV, policy_ref, n, kwargs=env_kwargs)


def _report(table: pa.Table) -> EvalReport:
    request = EvalRequest(env=ENV, policy="x", episodes=table.num_rows, seed=0)
    return aggregate(request, table, env_spec={"env_id": ENV}, env_spec_hash="spec",
                     policy={"sha256": "ab" * 32}, isolation="inprocess", timings={"run": 1.0},
                     cache={"status": "miss"}, run_seconds=1.0)


def _col(table: pa.Table, name: str) -> np.ndarray:
    return np.asarray(table.column(name).to_pylist())


def test_policy_failures_on_the_hardest_seeds_count_in_every_headline_figure():
    honest = _run("tests.flows.headline_envs:steady")
    broken = _run("tests.flows.headline_envs:breaks_on_hard_seeds")
    reasons = _col(broken, "end_reason")
    failed = reasons == "invalid_action"
    # The plant: exactly the seeds with the lowest honest returns end in an invalid action.
    honest_returns = _col(honest, "return")
    assert 30 < failed.sum() < 90
    assert set(np.flatnonzero(failed)) == set(np.argsort(honest_returns)[: failed.sum()])
    # The runner records what the policy produced up to the failure: two steps, their rewards.
    assert (_col(broken, "length")[failed] == hurdles.BREAK_STEP).all()
    assert _col(broken, "return")[failed] == pytest.approx(
        honest_returns[failed] * hurdles.BREAK_STEP / hurdles.STEPS, rel=1e-12)

    report = _report(broken)
    returns = _col(broken, "return")
    truth = stats.summarize(returns, seed=0).to_dict()
    completed_only = float(returns[~failed].mean())
    assert completed_only > truth["mean"] + 0.1  # what leaving them out would have claimed
    assert report.returns == truth  # mean, var, std, stderr, CI, IQM, percentiles, min, max
    assert report.mean == pytest.approx(returns.mean(), rel=1e-12)
    assert report.lengths == stats.length_stats(_col(broken, "length"))
    assert report.lengths["min"] == hurdles.BREAK_STEP
    wins = int(sum(s is True for s in broken.column("success").to_pylist()))
    assert report.success is not None
    assert (report.success["n"], report.success["successes"]) == (N, wins)
    assert report.success["rate"] == wins / N
    assert (report.scored, report.policy_failures, report.harness_failures) == (N, failed.sum(), 0)
    assert report.coverage == 1.0 and report.harness_failure_rate == 0.0
    assert report.policy_failure_rate == failed.sum() / N
    assert not report.harness_fault
    assert [a.split(":")[0] for a in report.alarms] == ["policy_failures"]
    assert f"invalid_action={failed.sum()}" in report.alarms[0]


def test_harness_failures_are_left_out_and_coverage_is_stated_exactly():
    table = _run("tests.flows.headline_envs:breaks_on_hard_seeds", {"broken_above": 0.85})
    reasons = _col(table, "end_reason")
    harness, policy = reasons == "env_error", reasons == "invalid_action"
    assert harness.sum() > 10 and policy.sum() > 30
    report = _report(table)
    scored = ~harness
    assert report.scored == int(scored.sum()) == N - int(harness.sum())
    assert report.coverage == report.scored / N  # exactly, not approximately
    assert report.returns == stats.summarize(_col(table, "return")[scored], seed=0).to_dict()
    assert report.success is not None and report.success["n"] == report.scored
    assert (report.policy_failures, report.harness_failures) == (policy.sum(), harness.sum())
    assert report.harness_fault  # > 5% of planned episodes could not be scored
    alarm = next(a for a in report.alarms if a.startswith("harness_failures"))
    assert f"env_error={harness.sum()}" in alarm and f"coverage {report.coverage:.1%}" in alarm


def test_adaptive_rounds_look_at_the_scored_episodes():
    table = _run("tests.flows.headline_envs:breaks_on_hard_seeds", n=40)
    schedule = RoundSchedule(EvalRequest(policy="x", episodes=40, target_ci_halfwidth=1e-9,
                                         max_episodes=40))
    schedule.next_episodes(table)
    assert schedule.rounds[0]["mean"] == pytest.approx(_col(table, "return").mean(), rel=1e-12)


def _row(i: int, ret: float, reason: str = "terminated", seed: int | None = None,
         success: bool | None = None) -> EpisodeRecord:
    return EpisodeRecord("r", "p" * 64, "e", "s", i, 100 + i if seed is None else seed, ret, 3,
                         reason, None if reason == "terminated" else "x", success, 0.0, "w", "x",
                         "inprocess")


def test_a_policy_failure_row_without_a_finite_return_is_flagged_not_hidden():
    rows = [_row(i, float(i), success=i % 2 == 0) for i in range(18)]
    rows += [_row(18, math.nan, "policy_error"), _row(19, 1.5, "invalid_action", success=True)]
    report = _report(records_to_table(rows))
    assert report.scored == 19 and report.coverage == 19 / 20 and report.policy_failures == 2
    assert report.mean == pytest.approx((sum(range(18)) + 1.5) / 19, rel=1e-12)
    # The invalid action counts as a failure to succeed, whatever its row says.
    assert report.success is not None and report.success["successes"] == 9
    assert report.success["n"] == 19
    assert any(a.startswith("policy_failure_returns_missing: 1 episodes") for a in report.alarms)
    assert not report.harness_fault  # 5% exactly is not above the threshold


def test_paired_comparison_drops_harness_pairs_and_keeps_policy_failures():
    new = records_to_table([
        _row(0, 10.0), _row(1, 2.0, "invalid_action"), _row(2, 0.0, "env_error"), _row(3, 7.0),
        _row(4, 9.0), _row(5, 4.0, "policy_timeout"), _row(6, 8.0), _row(7, 6.0, seed=999),
    ])
    base = records_to_table([
        _row(0, 9.0), _row(1, 5.0), _row(2, 6.0), _row(3, 0.0, "crashed"),
        _row(4, 1.0, "policy_error"), _row(5, 5.0), _row(6, 8.0), _row(7, 6.0),
    ])
    c = compare_with_baseline(new, base, seed=0, source="fixed")
    pairs = {0: (10.0, 9.0), 1: (2.0, 5.0), 4: (9.0, 1.0), 5: (4.0, 5.0), 6: (8.0, 8.0)}
    assert c["n"] == 5
    assert c["dropped_harness_failures"] == 2 and c["dropped_unmatched"] == 1  # index 7: seed
    assert c["policy_failures"] == {"new": 2, "baseline": 1}
    diffs = [a - b for a, b in pairs.values()]
    assert c["mean_diff"] == pytest.approx(sum(diffs) / 5, rel=1e-12)
    assert c["mean_new"] == pytest.approx(sum(a for a, _ in pairs.values()) / 5, rel=1e-12)
    # Both sides follow the same rule: swapping them mirrors the result.
    back = compare_with_baseline(base, new, seed=0, source="fixed")
    assert back["n"] == 5 and back["mean_diff"] == pytest.approx(-c["mean_diff"], rel=1e-12)
    assert back["policy_failures"] == {"new": 1, "baseline": 2}


def test_coverage_on_every_surface_built_from_the_report():
    table = _run("tests.flows.headline_envs:breaks_on_hard_seeds", {"broken_above": 0.85})
    report = _report(table)
    text = f"{report.coverage:.2%} ({report.scored}/{N} episodes scored)"
    assert {"metric": "coverage", "value": text} in summary_rows(report)
    assert text in summary_text(report)
    assert f"| coverage | {text} |" in report_markdown(report, [])
    metrics = flatten_metrics(report.model_dump(mode="json"))
    assert metrics["eval/coverage"] == report.coverage
    assert metrics["eval/policy_failure_rate"] == report.policy_failure_rate
    result = result_from_report(report, step=3)
    assert result["eval/coverage"] == report.coverage and result["eval/reward"] == report.mean
    # One meaning per key on every surface: the MLflow run's eval/episodes is the planned count.
    assert (result["eval/episodes"], result["eval/scored"]) == (N, report.scored)
    assert (metrics["eval/episodes"], metrics["eval/scored"]) == (N, report.scored)
    assert report.scored < N
    dumped = report.model_dump(mode="json")
    assert dumped["coverage"] == report.coverage and dumped["scored"] == report.scored


def test_outcomes_treat_an_unknown_end_reason_as_a_harness_failure():
    kinds = outcomes(records_to_table([_row(0, 1.0), _row(1, 1.0, "cosmic_ray")]))
    assert kinds.scored.tolist() == [True, False] and kinds.harness.tolist() == [False, True]


def test_row_kinds_classify_each_row_as_its_reason_does_across_chunks_and_nulls():
    # Classified once per distinct reason and looked up per row: every reason, in every chunk,
    # in any order, must come out as it does alone; a null or unknown reason is the harness's.
    from evalfleet.audit import reward_integrity
    from evalfleet.models import EndReason
    from evalfleet.scoring import _kind, row_kinds

    names = [r.value for r in EndReason] + ["cosmic_ray", None]
    rng = np.random.default_rng(3)
    rows = [names[i] for i in rng.integers(0, len(names), 500)]
    chunked = pa.chunked_array([pa.array(rows[:123], pa.string()), pa.array(rows[123:], pa.string())])
    assert row_kinds(chunked).tolist() == [_kind(r) if r else "harness" for r in rows]
    assert row_kinds(pa.chunked_array([], pa.string())).tolist() == []
    # The reward audit reads completed rows the same way (it raised on an unknown reason before).
    table = records_to_table([_row(0, 1.0), _row(1, 1.0, "cosmic_ray")])
    assert reward_integrity(table) == []


def test_a_success_flag_reported_on_some_endings_only_raises_an_alarm():
    # An env that sets info["success"] only when it succeeds: the silent (truncated) episodes
    # must not vanish from the success rate without a word.
    rows = [EpisodeRecord("r", "ab" * 32, ENV, "s", i, i, float(i), 10, reason, None, flag,
                          0.1, "w", "0", "inprocess")
            for i, (reason, flag) in enumerate([("terminated", True)] * 3 + [("truncated", None)] * 7)]
    report = _report(records_to_table(rows))
    assert report.success is not None
    assert report.success["rate"] == 1.0 and report.success["unreported"] == 7
    assert report.success["rate_unreported_as_failure"] == pytest.approx(0.3)
    assert any(a.startswith("success_partially_reported: 7 of 10") for a in report.alarms)
    # every completed episode reporting its flag raises nothing
    full = [EpisodeRecord("r", "ab" * 32, ENV, "s", i, i, 1.0, 10, "terminated", None, i < 4, 0.1, "w",
                          "0", "inprocess") for i in range(10)]
    quiet = _report(records_to_table(full))
    assert quiet.success is not None and quiet.success["unreported"] == 0
    assert not any("success_partially" in a for a in quiet.alarms)


def _stage6(table: pa.Table, baseline: pa.Table, audit_rows: pa.Table) -> EvalReport:
    """Stage 6 (``pipeline.summarize``) of an evaluation of ``table`` against ``baseline``."""
    from types import SimpleNamespace

    from evalfleet.pipeline import Collected, summarize

    request = EvalRequest(env=ENV, policy="x", episodes=table.num_rows, seed=0, cache="off",
                          baseline="sha256:" + "ee" * 6)
    received = SimpleNamespace(env_spec={"env_id": ENV}, env_spec_hash="spec", isolation="inprocess",
                               artifact=SimpleNamespace(summary=lambda: {"sha256": "ab" * 32}),
                               cache_key="k", cache_ingredients={}, seconds=0.0, device="cpu",
                               device_fallback=None)
    collected = Collected(table=table, fresh=table, audit_rows=audit_rows, run_seconds=1.0,
                          seconds=0.0, plan_cached=0, plan_seconds=0.0, cache_status="off",
                          cache_corrupt=False)
    return summarize(request, received, RoundSchedule(request), collected,  # type: ignore[arg-type]
                     (baseline, "sha256:" + "ee" * 6))


def test_dropped_pairs_show_on_every_surface_by_name():
    new = records_to_table([_row(i, float(i % 7)) for i in range(30)] + [_row(30, 1.0, "crashed")])
    # A baseline read back from a cache: the episodes its policy broke are not there.
    base = records_to_table([_row(i, float(i % 5)) for i in range(31) if i % 6])
    crashed = records_to_table([_row(0, math.nan, "crashed"), _row(1, math.nan, "timeout")])
    report = _stage6(new, base, crashed)
    c = report.comparison
    assert c is not None
    assert (c["n"], c["dropped_unmatched"], c["dropped_harness_failures"]) == (25, 5, 1)
    names = [a.split(":", 1)[0] for a in report.alarms]
    assert "baseline_pairs_unmatched" in names and "determinism_audit_incomplete" in names
    assert next(a for a in report.alarms if a.startswith("baseline_pairs_unmatched")).startswith(
        "baseline_pairs_unmatched: 5 episodes had no row of the baseline (sha256:eeeeeeeeeeee)")
    metrics = flatten_metrics(report.model_dump(mode="json"))
    assert metrics["eval/baseline_pairs_dropped_unmatched"] == 5.0
    assert metrics["eval/baseline_pairs_dropped_harness"] == 1.0
    assert metrics["eval/baseline_pairs_dropped"] == 6.0
    assert report.audit == {"checked": 0, "mismatches": [], "skipped": 2}
    assert metrics["eval/audit_checked"] == 0.0 and metrics["eval/audit_skipped"] == 2.0
    text = summary_text(report)
    assert ("pairs dropped: 1 (harness failure on a side), 5 unmatched (no baseline row on the same "
            "index and seed)") in text
    assert "0 re-run compared, 0 mismatches, 2 not comparable (infrastructure failure)" in text


def test_a_comparison_missing_the_baselines_failed_seeds_raises_an_alarm():
    # The baseline's env timed out on a third of the seeds, the hardest ones: those pairs are left
    # out and the new policy looks worse over the easy rest. Before, only the count said so.
    from evalfleet.history import alarm_lines

    hard = set(range(0, 100, 3))
    new = records_to_table([_row(i, 0.0 if i in hard else 0.9) for i in range(100)])
    base = records_to_table([_row(i, 0.0, "timeout") if i in hard else _row(i, 1.0)
                             for i in range(100)])
    report = _stage6(new, base, records_to_table([]))
    c = report.comparison
    assert c is not None and (c["n"], c["dropped_harness_failures"]) == (66, 34)
    assert c["dropped_harness_baseline"] == 34 and c["verdict"] == "worse"
    alarm = next(a for a in report.alarms if a.startswith("baseline_pairs_harness"))
    assert alarm.startswith("baseline_pairs_harness: 34 of 100 pairs (34.0%; > 5%) were left out "
                            "of the paired comparison with sha256:eeeeeeeeeeee because the "
                            "harness failed on a side (34 on its run only, 0 on this one only, 0 "
                            "on both")
    assert "stands on the other 66 pairs" in alarm
    # The same against the training run's best checkpoint.
    assert any(line.startswith("history_pairs_harness: 34 of 100 pairs")
               for line in alarm_lines({"comparison": c}))
    # Failed on both sides (the env breaks on those seeds whoever plays): counted as both. Before,
    # they read as the baseline's alone ("34 on its run, 0 on this one").
    both = records_to_table([_row(i, 0.0, "env_error") if i in hard else _row(i, 0.9)
                             for i in range(100)])
    c2 = _stage6(both, base, records_to_table([])).comparison
    assert c2 is not None and c2["dropped_harness_both"] == 34
    assert "(0 on its run only, 0 on this one only, 34 on both" in alarm_lines({"comparison": c2})[0]
    # A few failed pairs (5%) leave the comparison as it is.
    few = records_to_table([_row(i, 0.0, "timeout") if i < 5 else _row(i, 1.0) for i in range(100)])
    assert not [a for a in _stage6(new, few, records_to_table([])).alarms if "pairs_harness" in a]


def test_coverage_short_of_all_never_reads_100_percent():
    # One harness failure in 20,000: the summary said "coverage 100.00%" beside it.
    report = _report(_run("tests.flows.headline_envs:steady", n=20))
    short = report.model_copy(update={"episodes": 20_000, "scored": 19_999, "harness_failures": 1,
                                      "coverage": 19_999 / 20_000, "failure_rate": 1 / 20_000,
                                      "harness_failure_rate": 1 / 20_000})
    rows = {row["metric"]: row["value"] for row in summary_rows(short)}
    assert rows["coverage"] == ">99.99% (19999/20000 episodes scored)"
    assert "rate 0.01%: policy 0.00%, harness 0.01%" in rows["failures"]
    tiny = short.model_copy(update={"episodes": 200_000, "scored": 199_999,
                                    "coverage": 199_999 / 200_000, "failure_rate": 1 / 200_000,
                                    "harness_failure_rate": 1 / 200_000})
    rows = {row["metric"]: row["value"] for row in summary_rows(tiny)}
    assert rows["coverage"].startswith(">99.99% ")
    assert "rate <0.01%: policy 0.00%, harness <0.01%" in rows["failures"]


def test_summary_numbers_never_read_as_something_else():
    """1 success in 3,000 read "0.000  [0.000, 0.002]" (none), 2,999 read "1.000"; the
    episodes line said "18 scored (17 completed + 3 ended by the policy)" with two of the three
    without a return; an alarm's HTML went raw into the Prefect artifact's table."""
    def value(report: EvalReport, metric: str) -> str:
        return next(r["value"] for r in summary_rows(report) if r["metric"] == metric)

    rare = _report(records_to_table([_row(i, 1.0, success=i == 0) for i in range(3000)]))
    assert value(rare, "success rate").startswith("0.03%  [0.01%, 0.19%]")
    common = _report(records_to_table([_row(i, 1.0, success=i != 0) for i in range(3000)]))
    assert value(common, "success rate").startswith("99.97%  [99.81%, 99.99%]")
    rows = [_row(i, float(i)) for i in range(17)] + [_row(17, 2.0, "policy_error")]
    rows += [_row(18, math.nan, "policy_error"), _row(19, math.nan, "policy_error")]
    line = value(_report(records_to_table(rows)), "episodes")
    assert line == ("20 planned, 18 scored (17 completed + 1 ended by the policy), 0 harness "
                    "failures and 2 policy failures without a return left out")
    from evalfleet.summary import summary_markdown

    hostile = rare.model_copy(update={"alarms": ["recording_incomplete: <img src=x onerror=alert(1)>"]})
    text = summary_markdown(hostile)
    assert "<img" not in text and "&lt;img src=x onerror=alert(1)&gt;" in text
    from evalfleet.suite_report import number

    assert number(2.5e-4) == "0.00025" and number(None) == "n/a" and number(0.731) == "0.731"


def test_an_adaptive_evaluations_mlflow_params_name_the_episodes_it_ran():
    # The param 'episodes' was the first round's size (32) beside a metric and report of 200.
    from evalfleet.pipeline import mlflow_params

    request = EvalRequest.build(env=ENV, policy="x.pt", episodes=32, target_ci_halfwidth=0.5,
                                max_episodes=400)
    table = records_to_table([_row(i, float(i % 7)) for i in range(200)])
    report = aggregate(request, table, env_spec={"env_id": ENV}, env_spec_hash="spec",
                       policy={"sha256": "ab" * 32}, isolation="inprocess", timings={},
                       cache={"status": "miss"}, run_seconds=1.0)
    params = mlflow_params(request, report)
    assert (params["episodes"], params["first_round_episodes"]) == (200, 32) == (
        flatten_metrics(report.model_dump(mode="json"))["eval/episodes"], request.episodes)
    assert params["target_ci_halfwidth"] == 0.5


def test_the_manifest_names_no_local_worker_count_for_an_external_cluster():
    """``--workers`` sizes a local cluster; with ``--dask-address`` it was recorded all the same."""
    table = _run("tests.flows.headline_envs:steady", n=4)
    local = _report(table)
    assert local.manifest["execution"]["workers"] == 2
    request = EvalRequest(env=ENV, policy="x", episodes=4, seed=0, dask_address="tcp://127.0.0.1:1")
    external = aggregate(request, table, env_spec={"env_id": ENV}, env_spec_hash="spec",
                         policy={"sha256": "ab" * 32}, isolation="inprocess", timings={"run": 1.0},
                         cache={"status": "miss"}, run_seconds=1.0)
    assert external.manifest["execution"]["workers"] is None
    assert external.manifest["execution"]["dask_address"] == "tcp://127.0.0.1:1"
