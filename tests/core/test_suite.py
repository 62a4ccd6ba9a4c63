"""Suite files: parsing, grid expansion, normalisation, per-task requests, clear errors."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from evalfleet.errors import RequestError, SuiteError
from evalfleet.models import EvalRequest
from evalfleet.records import EPISODE_SCHEMA
from evalfleet.suite import load_suite, parse_suite, task_requests, task_scores

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "suite.toml"


def _suite(**task):
    return parse_suite({"suite": {"episodes": 10}, "task": [{"env": "CartPole-v1", **task}]}, "s.toml")


def test_grid_expands_into_named_tasks_with_merged_kwargs() -> None:
    suite = parse_suite({
        "suite": {"name": "c4", "episodes": 50, "max_steps": 42},
        "task": [{"name": "c4", "env": "evalfleet/ConnectFour-v0", "kwargs": {"opponent": "negamax"},
                  "grid": {"opponent_depth": [1, 2, 3], "agent_first": [True, False]}},
                 {"env": "CartPole-v1", "episodes": 7, "max_steps": 100}],
    })
    assert [t.name for t in suite.tasks] == [
        "c4[opponent_depth=1,agent_first=true]", "c4[opponent_depth=1,agent_first=false]",
        "c4[opponent_depth=2,agent_first=true]", "c4[opponent_depth=2,agent_first=false]",
        "c4[opponent_depth=3,agent_first=true]", "c4[opponent_depth=3,agent_first=false]",
        "CartPole-v1"]
    assert suite.tasks[3].env_kwargs == {"opponent": "negamax", "opponent_depth": 2, "agent_first": False}
    assert (suite.tasks[0].episodes, suite.tasks[0].max_steps) == (50, 42)
    assert (suite.tasks[-1].episodes, suite.tasks[-1].max_steps) == (7, 100)
    assert suite.name == "c4" and not suite.normalised


def test_normalisation_random_reference_min_max_and_per_grid_point() -> None:
    suite = parse_suite({"suite": {"episodes": 5}, "task": [
        {"env": "CartPole-v1", "normalise": {"random": 20, "reference": 500}},
        {"name": "p", "env": "Pendulum-v1", "normalise": {"min": -1600, "max": 0}},
        {"name": "g", "env": "CartPole-v1", "grid": {"max_episode_steps": [100, 200]},
         "normalise": [{"random": 10, "reference": 100}, {"random": 10, "reference": 200}]},
    ]})
    assert suite.normalised
    assert [(t.normalisation.low, t.normalisation.high) for t in suite.tasks] == [
        (20, 500), (-1600, 0), (10, 100), (10, 200)]
    assert suite.tasks[1].normalisation.kind == "min/max"
    table = EPISODE_SCHEMA.empty_table()
    rows = {name: [] for name in table.column_names}
    for i, ret in enumerate([20.0, 500.0, 260.0]):
        for name in rows:
            rows[name].append(None)
        rows["return"][-1], rows["end_reason"][-1], rows["episode_index"][-1] = ret, "truncated", i
    scores = task_scores(suite.tasks[0], pa.Table.from_pydict(rows, schema=EPISODE_SCHEMA))
    np.testing.assert_allclose(scores, [0.0, 1.0, 0.5])


def test_task_requests_are_single_evaluations_with_the_base_protocol(tmp_path) -> None:
    suite = _suite(grid={"max_episode_steps": [50, 60]})
    base = EvalRequest.build(policy="envs.suite_policies:heuristic", seed=7, output=tmp_path,
                             request_id="abc", baseline="x.pt")
    requests = task_requests(suite, base)
    assert [r.request_id for r in requests] == ["abc-t00", "abc-t01"]
    assert [r.env_kwargs for r in requests] == [{"max_episode_steps": 50}, {"max_episode_steps": 60}]
    assert all(r.seed == 7 and r.episodes == 10 and r.baseline is None for r in requests)


def test_the_shipped_example_parses() -> None:
    suite = load_suite(EXAMPLE)
    envs = {t.env for t in suite.tasks}
    assert envs == {"evalfleet/Recommend-v0", "evalfleet/Inventory-v0", "evalfleet/ConnectFour-v0"}
    assert len(suite.tasks) == 6 and suite.normalised


@pytest.mark.parametrize(("data", "match"), [
    ({"task": []}, "no tasks"),
    ({"tasks": [{"env": "CartPole-v1"}]}, r"unknown top-level key\(s\) \['tasks'\]"),
    ({"suite": {"episodes": 5, "epsiodes": 5}, "task": [{"env": "CartPole-v1"}]},
     r"\[suite\] has unknown key\(s\) \['epsiodes'\]"),
    ({"task": [{"env": "CartPole-v1"}]}, "'episodes' is missing"),
    ({"task": [{"env": "CartPole-v1", "episodes": 0}]}, r"task 1 \(CartPole-v1\): 'episodes' must be a "
     r"positive integer \(got 0\)"),
    ({"task": [{"env": "CartPole-v1", "episodes": 5, "kwarg": {}}]}, r"unknown key\(s\) \['kwarg'\]"),
    ({"task": [{"episodes": 5}]}, "'env' must be a Gymnasium id"),
    ({"task": [{"env": "CartPole-v1", "episodes": 5, "grid": {"a": []}}]},
     "'grid.a' must be a non-empty list"),
    ({"task": [{"env": "CartPole-v1", "episodes": 5, "grid": {"a": [1]}, "kwargs": {"a": 2}}]},
     "both in 'kwargs' and 'grid'"),
    ({"task": [{"env": "CartPole-v1", "episodes": 5, "normalise": {"random": 1}}]},
     r"'normalise' must be a table \{ random = R, reference = S \}"),
    ({"task": [{"env": "CartPole-v1", "episodes": 5, "normalise": {"min": 3, "max": 3}}]},
     "needs min != max"),
    ({"task": [{"env": "CartPole-v1", "episodes": 5, "grid": {"a": [1, 2]},
                "normalise": [{"min": 0, "max": 1}]}]}, "list of 1 tables but the grid expands into 2"),
    ({"task": [{"env": "CartPole-v1", "episodes": 5}, {"env": "CartPole-v1", "episodes": 6}]},
     r"task names \['CartPole-v1'\] appear twice"),
    ({"suite": {"episodes": 10**12}, "task": [{"env": "CartPole-v1"}]},
     r"\[suite\]: 'episodes' must be at most 100,000,000 \(got 1,000,000,000,000\)"),
    ({"task": [{"env": "CartPole-v1", "episodes": 10**9}]},
     r"task 1 \(CartPole-v1\): 'episodes' must be at most 100,000,000"),
    # TOML has nan and inf: the env got them, the report null.
    ({"task": [{"env": "CartPole-v1", "episodes": 5, "kwargs": {"a": {"b": float("nan")}}}]},
     r"'kwargs\['a'\]\['b'\]' must be a finite number \(got nan\)"),
    ({"task": [{"env": "CartPole-v1", "episodes": 5, "grid": {"a": [1.0, float("-inf")]}}]},
     r"'grid\['a'\]\[1\]' must be a finite number \(got -inf\)"),
])
def test_bad_suites_say_what_is_wrong(data, match) -> None:
    with pytest.raises(SuiteError, match=match) as info:
        parse_suite(data, "bad.toml")
    assert isinstance(info.value, RequestError) and "bad.toml" in str(info.value)


def test_bad_files(tmp_path) -> None:
    with pytest.raises(SuiteError, match="does not exist"):
        load_suite(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[[task]\nenv = 1\n")
    with pytest.raises(SuiteError, match="is not valid TOML"):
        load_suite(broken)


def test_a_task_the_request_model_rejects_names_the_task(tmp_path) -> None:
    suite = _suite(name="big", max_steps=5)
    bad = suite.model_copy(update={"tasks": [suite.tasks[0].model_copy(update={"episodes": -1})]})
    with pytest.raises(SuiteError, match="suite task 'big': 'episodes' must be a positive integer"):
        task_requests(bad, EvalRequest.build(policy="envs.suite_policies:heuristic", output=tmp_path))


def test_a_task_whose_two_step_caps_disagree_is_refused_by_name(tmp_path) -> None:
    suite = parse_suite({"suite": {"episodes": 5, "max_steps": 500},
                         "task": [{"env": "CartPole-v1", "grid": {"max_episode_steps": [100]}}]})
    with pytest.raises(SuiteError, match=r"suite task 'CartPole-v1\[max_episode_steps=100\]': "
                       r"'max_steps' \(500\) and env_kwargs' 'max_episode_steps' \(100\) both cap"):
        task_requests(suite, EvalRequest.build(policy="envs.suite_policies:heuristic",
                                               output=tmp_path))


def test_options_a_suite_cannot_honour_are_refused(tmp_path) -> None:
    suite = _suite()
    adaptive = EvalRequest.build(policy="envs.suite_policies:heuristic", output=tmp_path,
                                 target_ci_halfwidth=1.0, max_episodes=1000)
    with pytest.raises(SuiteError, match="adaptive mode"):
        task_requests(suite, adaptive)
    hashed = EvalRequest.build(policy="envs.suite_policies:heuristic", output=tmp_path,
                               baseline="sha256:" + "abc" * 4)
    with pytest.raises(SuiteError, match="baseline must be a policy file"):
        task_requests(suite, hashed)


def _episodes(returns: np.ndarray, reasons: list[str]) -> pa.Table:
    from evalfleet.records import EpisodeRecord, records_to_table
    from evalfleet.seeds import SeedLedger

    ledger = SeedLedger(0)
    return records_to_table([
        EpisodeRecord("r", "ab" * 32, "CartPole-v1", "spec", i, ledger.seed(i), float(returns[i]),
                      10, reasons[i], None, None, 0.1, "w", "s", "inprocess")
        for i in range(len(returns))])


def _report(table: pa.Table, request_id: str):
    from evalfleet.report import aggregate

    request = EvalRequest(env="CartPole-v1", policy="x", episodes=table.num_rows, seed=0,
                          request_id=request_id)
    return aggregate(request, table, env_spec={"env_id": "CartPole-v1"}, env_spec_hash="spec",
                     policy={"sha256": "ab" * 32}, isolation="inprocess", timings={"run": 1.0},
                     cache={"status": "miss"}, run_seconds=1.0)


def test_the_baselines_harness_faults_and_alarms_are_the_suites() -> None:
    """A baseline whose episodes mostly crashed makes the comparison a harness fault, not a
    clean P(improvement) on the 40% of its episodes that ran."""
    from evalfleet.suite_report import build_suite_report

    suite = parse_suite({"suite": {"episodes": 100, "reps": 100},
                         "task": [{"env": "CartPole-v1", "normalise": {"random": 0, "reference": 1}}]})
    base = EvalRequest(env="CartPole-v1", policy="x", baseline="y", episodes=100, seed=0)
    rng = np.random.default_rng(0)
    mine = _episodes(rng.random(100), ["terminated"] * 100)
    theirs = _episodes(np.r_[np.zeros(60), rng.random(40)], ["crashed"] * 60 + ["terminated"] * 40)
    their_report = _report(theirs, "base-task")
    assert their_report.harness_fault

    report = build_suite_report(suite, base, [_report(mine, "mine-task")], [mine], [theirs],
                                baseline_reports=[their_report])
    assert report.harness_fault
    assert any(a.startswith("baseline base-task: ") for a in report.alarms), report.alarms


def test_a_score_interval_is_low_to_high_when_the_normalisation_runs_downward() -> None:
    # { min = 0, max = -100 }: lower returns score higher. The return's interval was mapped
    # end to end, so the score's 'low' came out above its 'high'.
    from evalfleet.records import EpisodeRecord, records_to_table
    from evalfleet.report import aggregate
    from evalfleet.suite import task_row

    suite = parse_suite({"suite": {"episodes": 40}, "task": [
        {"env": "CartPole-v1", "normalise": {"min": 0, "max": -100}}]})
    task = suite.tasks[0]
    table = records_to_table([
        EpisodeRecord("r", "p" * 64, "e", "s", i, i, -float(i % 9), 3, "terminated", None, None,
                      0.0, "w", "x", "inprocess") for i in range(40)])
    report = aggregate(EvalRequest(policy="x:y", episodes=40), table, env_spec={},
                       env_spec_hash="h", policy={"sha256": "p" * 64}, isolation="inprocess",
                       timings={}, cache={}, run_seconds=1.0)
    row = task_row(task, report, task_scores(task, table))
    low, high = row["score_ci"]
    assert low < row["score_mean"] < high
    assert (low, high) == pytest.approx(sorted(-c / 100 for c in report.ci))


def test_a_suite_is_refused_at_once_for_a_nan_gamma_a_huge_grid_or_a_scalar_head():
    task = {"env": "CartPole-v1", "episodes": 5}
    # A NaN gamma ran every task, then failed on an internal parameter's name ('taus').
    with pytest.raises(SuiteError, match=r"\[suite\] 'gamma' must be a finite number \(got nan\)"):
        parse_suite({"suite": {"gamma": float("nan")}, "task": [task]})
    # A 1000 x 1000 grid was expanded (minutes, gigabytes) before the task cap was checked.
    with pytest.raises(SuiteError, match=r"1000000 tasks after grid expansion, more than 200"):
        parse_suite({"task": [{**task, "grid": {"a": list(range(1000)), "b": list(range(1000))}}]})
    with pytest.raises(SuiteError, match=r"'suite' must be a \[suite\] table of settings \(got 5\)"):
        parse_suite({"suite": 5, "task": [task]})


def test_nearly_equal_bounds_are_refused_and_a_far_out_score_is_an_alarm() -> None:
    """Bounds of -1.0 and -0.999 made one task's mean score 366.7 and the suite's mean 122.8 with
    an IQM of 0.54, exit 0 and no alarm. Bounds equal but for rounding are refused; bounds that
    are merely close leave a score far outside [0, 1], which is an alarm naming the task."""
    from evalfleet.suite_report import build_suite_report

    with pytest.raises(SuiteError, match=r"'normalise' needs random != reference \(got 1.0 and "):
        _suite(normalise={"random": 1.0, "reference": 1.0 + 1e-12})
    suite = parse_suite({"suite": {"episodes": 50, "reps": 100}, "task": [
        {"name": "close", "env": "CartPole-v1", "normalise": {"random": -1.0, "reference": -0.999}},
        {"name": "fine", "env": "Acrobot-v1", "normalise": {"random": -500, "reference": -60}}]})
    base = EvalRequest(env="CartPole-v1", policy="x", episodes=50, seed=0)
    rng = np.random.default_rng(0)
    close = _episodes(-0.6 + 0.1 * rng.random(50), ["terminated"] * 50)
    fine = _episodes(-100 - 50 * rng.random(50), ["terminated"] * 50)
    report = build_suite_report(suite, base, [_report(close, "close"), _report(fine, "fine")],
                                [close, fine])
    (alarm,) = [a for a in report.alarms if a.startswith("score_out_of_range:")]
    assert "task 'close' has a mean normalised score of 4" in alarm
    assert "random/reference = -1 / -0.999" in alarm


@pytest.mark.parametrize("reps", [1, 99, 100_001, 1_000_000_000])
def test_bootstrap_resamples_outside_what_an_interval_needs_are_refused(reps) -> None:
    # reps = 1 gave every aggregate a zero-width "95% CI" (the IQM's, [0.691, 0.691], not even
    # holding its point 0.694); reps = 1e9 ran every task, then died in a MemoryError, exit 1.
    task = {"env": "CartPole-v1", "episodes": 8, "normalise": {"min": 0, "max": 500}}
    with pytest.raises(SuiteError, match=rf"\[suite\] 'reps' \(bootstrap resamples of every "
                       rf"aggregate's 95% interval\) must be between 100 and 100,000 \(got {reps:,}\)"):
        parse_suite({"suite": {"reps": reps}, "task": [task]}, "reps.toml")
    assert [parse_suite({"suite": {"reps": r}, "task": [task]}).reps for r in (100, 100_000)] == [
        100, 100_000]


@pytest.mark.parametrize("gamma", [-5, 0, 0.0])
def test_an_optimality_gap_target_at_or_below_the_random_policy_is_refused(gamma) -> None:
    # gamma = -5: the gap mean(max(gamma - score, 0)) was 0 for any policy, exit 0.
    task = {"env": "CartPole-v1", "episodes": 4, "normalise": {"min": 0, "max": 500}}
    with pytest.raises(SuiteError, match=rf"gamma.toml: \[suite\] 'gamma' \(the optimality gap's "
                       rf"target score\) must be > 0, .* \(got {gamma!r}\)"):
        parse_suite({"suite": {"gamma": gamma}, "task": [task]}, "gamma.toml")
    assert parse_suite({"suite": {"gamma": 0.5}, "task": [task]}).gamma == 0.5


@pytest.mark.parametrize("name", ["", "  ", 7])
def test_a_task_name_that_is_empty_is_refused_not_replaced_by_the_env_id(name) -> None:
    # name = "" named the task 'CartPole-v1' without a word.
    with pytest.raises(SuiteError, match=r"task 1 \(.*\): 'name' must be a non-empty string "
                       rf"\(got {name!r}\)"):
        _suite(name=name)
    assert _suite().tasks[0].name == "CartPole-v1"  # no name at all: the env id's, as documented


def test_a_tasks_harness_failures_show_on_every_suite_surface(tmp_path) -> None:
    """A task that lost its 3 best of 100 episodes to the env (env_error) moved the suite's mean
    (0.4475 against 0.4636 with nothing dropped) while the summary and the page said
    'episodes 100' and 'No alarms.', the MLflow run and the Evaluator result had no coverage:
    only suite_report.json's 'scored' knew."""
    from mlflow.tracking import MlflowClient

    from evalfleet.cli import EXIT_HARNESS_FAULT, EXIT_OK, build_parser, run_suite
    from evalfleet.client import suite_result
    from evalfleet.suite_report import build_suite_report, suite_markdown, suite_page
    from evalfleet.tracking import log_suite, suite_metrics

    suite = parse_suite({"suite": {"episodes": 100, "reps": 100}, "task": [
        {"name": "flaky-a", "env": "CartPole-v1", "normalise": {"min": 0, "max": 1}},
        {"name": "flaky-b", "env": "Acrobot-v1", "normalise": {"min": 0, "max": 1}}]})
    base = EvalRequest(env="CartPole-v1", policy="x", baseline="y", episodes=100, seed=0,
                       request_id="cov")
    returns = np.random.default_rng(0).random(100)
    best = np.argsort(returns)[-3:]
    lost = ["env_error" if i in best else "terminated" for i in range(100)]
    flaky, fine = _episodes(returns, lost), _episodes(returns, ["terminated"] * 100)
    theirs = _episodes(returns / 2, ["crashed"] * 2 + ["terminated"] * 98)
    reports = [_report(flaky, "cov-t00"), _report(fine, "cov-t01")]
    report = build_suite_report(suite, base, reports, [flaky, fine], [fine, theirs],
                                baseline_reports=[_report(fine, "cov-t00-baseline"),
                                                  _report(theirs, "cov-t01-baseline")])

    assert (report.tasks[0]["scored"], report.tasks[0]["coverage"]) == (97, 0.97)
    assert (report.tasks[1]["coverage"], report.coverage) == (1.0, 0.97)
    assert report.baseline["task_coverage"] == [1.0, 0.98] and not report.harness_fault
    assert [a for a in report.alarms if a.startswith("task_coverage")] == [
        "task_coverage: task 'flaky-a' scored 97 of 100 episodes (coverage 97.0%; left out: "
        "env_error=3); its score and the suite's aggregates stand on the scored episodes only: "
        "see the task's report",
        "task_coverage: the baseline on task 'flaky-b' scored 98 of 100 episodes (coverage 98.0%; "
        "left out: crashed=2); its score and the suite's aggregates stand on the scored episodes "
        "only: see the task's report"]
    assert "| flaky-a | 97/100 (97.0%) |" in suite_markdown(report)
    assert "| flaky-b | 100/100 |" in suite_markdown(report)
    page = suite_page(report, {}, tmp_path / "report.html").read_text()
    assert "97/100 (97.0%)" in page and "No alarms." not in page and "task_coverage" in page
    assert report.model_dump(mode="json")["coverage"] == 0.97

    metrics = suite_metrics(report.model_dump(mode="json"))
    assert (metrics["suite/coverage"], metrics["suite/task_00_coverage"],
            metrics["suite/task_01_coverage"], metrics["suite/harness_fault"]) == (0.97, 0.97, 1.0, 0.0)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = log_suite(uri, "evalfleet", report.model_dump(mode="json"), {}, [], "suite-cov")
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.metrics["suite/coverage"] == 0.97
    assert run.data.tags["evalfleet.alarm.task_coverage"] == "true"
    assert suite_result(report, 3)["eval/coverage"] == 0.97

    # Exit codes as for single evaluations: 97% scored is exit 0 (its coverage shown), more than
    # 5% left out is the harness fault (exit 3), naming the task and its coverage.
    args = build_parser().parse_args(["--suite", str(EXAMPLE), "--output", str(tmp_path / "cli")])
    assert run_suite(lambda suite, request: report, args) == EXIT_OK
    worse = _episodes(returns, ["env_error"] * 8 + ["terminated"] * 92)
    faulted = build_suite_report(suite, base, [_report(worse, "cov-t00"), reports[1]], [worse, fine])
    assert faulted.harness_fault and faulted.coverage == 0.92
    assert run_suite(lambda suite, request: faulted, args) == EXIT_HARNESS_FAULT


INVENTORY = {"env": "evalfleet/Inventory-v0", "episodes": 6}


def test_a_task_spelled_twice_is_refused() -> None:
    """Inventory with kwargs {}, { demand_scale = 20.0 } (its default) and { demand_scale = 20 }:
    three cache keys, three runs of one evaluation with the same returns, counted as three
    independent tasks (the mean's interval ~sqrt(3) too narrow), exit 0 and no alarm."""
    inventory = INVENTORY
    with pytest.raises(SuiteError, match=r"^suite tasks 'float' and 'int' are the same evaluation "
                       r"\(s6.toml: same env, kwargs and step cap; numbers compare by value, 20 and "
                       r"20.0 are one\): counted twice, .*; remove one of them\.$"):
        parse_suite({"task": [{"name": "float", "kwargs": {"demand_scale": 20.0}, **inventory},
                              {"name": "int", "kwargs": {"demand_scale": 20}, **inventory}]}, "s6.toml")
    with pytest.raises(SuiteError, match="suite tasks 'a' and 'b' are the same evaluation"):
        parse_suite({"task": [{"name": "a", "kwargs": {"x": [1.0, {"y": 2}]}, **inventory},
                              {"name": "b", "kwargs": {"x": [1, {"y": 2.0}]}, **inventory}]})
    assert len(parse_suite({"task": [{"name": "a", "kwargs": {"x": 2.5}, **inventory},
                                     {"name": "b", "kwargs": {"x": 2}, **inventory},
                                     {"name": "c", "kwargs": {"x": True}, **inventory},
                                     {"name": "d", **inventory, "max_steps": 9}]}).tasks) == 4


def test_tasks_with_identical_episodes_are_an_alarm() -> None:
    # {} and { demand_scale = 20.0 } are one evaluation too: only their episodes can tell.
    from evalfleet.suite_report import build_suite_report

    inventory = INVENTORY
    suite = parse_suite({"suite": {"reps": 100}, "task": [
        {"name": "inv-default", **inventory}, {"name": "inv-explicit", **inventory,
                                               "kwargs": {"demand_scale": 20.0}},
        {"name": "recommend", "env": "evalfleet/Recommend-v0", "episodes": 6},
        {"name": "inv-longer", **inventory, "episodes": 8, "kwargs": {"demand_scale": 20.5}}]})
    returns = np.array([9770.6, 6178.7, 9318.5, 8095.0, 6969.7, 5939.5, 7000.0, 7100.0])
    same = _episodes(returns[:6], ["truncated"] * 6)
    other = _episodes(returns[:6] + 1.0, ["truncated"] * 6)
    longer = _episodes(returns, ["truncated"] * 8)  # its first 6 episodes are the same
    tables = [same, _episodes(returns[:6], ["truncated"] * 6), other, longer]
    base = EvalRequest(env="CartPole-v1", policy="x", episodes=6, seed=0)
    report = build_suite_report(suite, base, [_report(t, f"t{i}") for i, t in enumerate(tables)], tables)
    assert [a for a in report.alarms if a.startswith("identical_tasks")] == [
        "identical_tasks: tasks 'inv-default', 'inv-explicit', 'inv-longer' have identical episodes "
        "(return, length and ending of each of their 6 common seeds): if they are one evaluation (a "
        "kwarg spelled out at its default value, an alias of the env), the aggregates count it 3 "
        "times as independent tasks, with 3x its weight and intervals too narrow; keep one of them"]
    assert "identical_tasks" in report.alarm_names
    different = build_suite_report(suite, base, [_report(t, f"t{i}") for i, t in enumerate(tables)],
                                   [same, other, _episodes(returns[:6] - 1.0, ["truncated"] * 6),
                                    _episodes(returns + 2.0, ["truncated"] * 8)])
    assert not [a for a in different.alarms if a.startswith("identical_tasks")]


def test_too_few_episodes_a_task_make_the_aggregate_intervals_an_alarm() -> None:
    """One episode a task gave 'mean 1.031 [1.031, 1.031]' and 'P(improvement) 0.75 [0.75, 0.75]'
    beside the tasks' own wide intervals, exit 0, no alarm; at 2-5 a task the nominal 95% covered
    76-88%. The project's rule for small samples (no verdict below stats.MIN_PAIRS = 10 pairs)
    marks them."""
    from evalfleet.suite_report import build_suite_report

    suite = parse_suite({"suite": {"reps": 100}, "task": [
        {"name": "one", "env": "CartPole-v1", "episodes": 1},
        {"name": "two", "env": "Acrobot-v1", "episodes": 1}]})
    base = EvalRequest(env="CartPole-v1", policy="x", baseline="y", episodes=1, seed=0)
    tables = [_episodes(np.array([3.0]), ["terminated"]), _episodes(np.array([5.0]), ["terminated"])]
    theirs = [_episodes(np.array([1.0]), ["terminated"]), _episodes(np.array([2.0]), ["terminated"])]
    report = build_suite_report(suite, base, [_report(t, f"t{i}") for i, t in enumerate(tables)],
                                tables, theirs)
    assert report.aggregates["mean"] == {"point": 4.0, "ci": [4.0, 4.0]}  # the zero-width interval
    assert [a for a in report.alarms if a.startswith("aggregate_intervals_unreliable")] == [
        "aggregate_intervals_unreliable: tasks with fewer than 10 scored episodes ('one' 1, 'two' 1, "
        "the baseline's 'one' 1, the baseline's 'two' 1): the aggregates' and P(improvement)'s 95% "
        "intervals resample episodes within each task and cover far less than 95% at so few (zero "
        "width at 1 a task; ~76% at 2, ~88% at 5, simulated); read their points, not their "
        "intervals, or run at least 10 episodes a task ('episodes' in the suite file)"]

    # 10 scored a task, the policy's and the baseline's: no alarm; 9 scored of 10 (a crash): one.
    rng = np.random.default_rng(0)
    ten = [_episodes(rng.random(10), ["terminated"] * 10) for _ in range(2)]
    crashed = _episodes(rng.random(10), ["crashed"] + ["terminated"] * 9)
    reports = [_report(t, f"t{i}") for i, t in enumerate(ten)]
    assert not [a for a in build_suite_report(suite, base, reports, ten, ten).alarms
                if a.startswith("aggregate_intervals_unreliable")]
    (alarm,) = [a for a in build_suite_report(suite, base, reports, ten, [ten[0], crashed]).alarms
                if a.startswith("aggregate_intervals_unreliable")]
    assert "(the baseline's 'two' 9)" in alarm


def test_policy_failures_that_flatter_a_task_scored_lower_is_better_are_an_alarm() -> None:
    """Task 'c' normalises random = 20, reference = 0 (lower returns are better). The policy broke
    (invalid action at step 0, partial return 0) on its 6 seeds with u > 0.8: each scored the
    reference's 1.0, the task's score rose above its completed episodes', and no alarm said so
    (the task's report compares returns, where 0 is below the completed ones)."""
    from evalfleet.suite_report import build_suite_report

    suite = parse_suite({"suite": {"name": "planted", "reps": 100}, "task": [
        {"name": "a", "env": "CartPole-v1", "episodes": 20, "normalise": {"random": 0.0, "reference": 10.0}},
        {"name": "c", "env": "Acrobot-v1", "episodes": 30, "normalise": {"random": 20.0, "reference": 0.0}},
    ]})
    base = EvalRequest(env="CartPole-v1", policy="x", baseline="y", episodes=30, seed=0)
    u = (np.arange(30) + 0.5) / 30
    broke = u > 0.8
    reasons = ["invalid_action" if b else "terminated" for b in broke]
    mine_c = _episodes(np.where(broke, 0.0, 3.0 * (1.0 + 4.0 * u)), reasons)
    # Task 'a' (higher is better): the same breaks score 0 there, below the rest: no alarm.
    mine_a = _episodes(np.where(broke, 0.0, 5.0 + u)[:20], reasons[:20])
    theirs_c = _episodes(np.where(u < 0.1, 0.0, 12.0 * u),
                         ["policy_error" if x < 0.1 else "truncated" for x in u])
    theirs_a = _episodes(5.0 + u[:20], ["terminated"] * 20)
    tables, theirs = [mine_a, mine_c], [theirs_a, theirs_c]
    report = build_suite_report(suite, base, [_report(t, f"t{i:02d}") for i, t in enumerate(tables)],
                                tables, theirs)
    scores = 1.0 - 3.0 * (1.0 + 4.0 * u) / 20.0
    assert report.tasks[1]["score_mean"] == pytest.approx((broke.sum() + scores[~broke].sum()) / 30)
    assert report.tasks[1]["score_mean"] > scores[~broke].mean()  # the breaks raised the score
    flattered = [a for a in report.alarms if "policy_failures_flatter" in a]
    their_scores = 1.0 - 12.0 * u / 20.0
    assert flattered == [
        f"policy_failures_flatter: task 'c': 6 episodes ended by the policy count with their partial "
        f"return (mean score 1), above the completed episodes' mean score "
        f"({scores[~broke].mean():.4g}): the task's normalisation runs downward (random/reference "
        "= 20 / 0: lower returns are better), so ending early scores higher, and the task's score "
        "and the suite's aggregates may overstate this policy. Fix the policy's failures (see the "
        "task's report) and evaluate again",
        f"policy_failures_flatter: the baseline on task 'c': 3 episodes ended by the policy count "
        f"with their partial return (mean score 1), above the completed episodes' mean score "
        f"({their_scores[u >= 0.1].mean():.4g}): the task's normalisation runs downward "
        "(random/reference = 20 / 0: lower returns are better), so ending early scores higher, and "
        "the task's score and the suite's aggregates may overstate this policy. Fix the policy's "
        "failures (see the task's report) and evaluate again"]

    # Breaks that score below the completed episodes ask for nothing, in either direction.
    fine = _episodes(np.where(broke, 40.0, 3.0 * (1.0 + 4.0 * u)), reasons)
    report = build_suite_report(suite, base, [_report(t, f"t{i:02d}") for i, t in enumerate([mine_a, fine])],
                                [mine_a, fine])
    assert not [a for a in report.alarms if a.startswith("policy_failures_flatter")]
