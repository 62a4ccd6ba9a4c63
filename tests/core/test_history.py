"""Feed back across training: verdicts, best checkpoint and alarms on real MLflow stores.

Episodes come from the real runner on the planted ``Courier`` env (``tests.core.courier``);
each "evaluation" is stage 7's history step (``pipeline.with_history``) followed by the real
MLflow logging (``tracking.log_evaluation``) into a SQLite store in a temporary folder, with a
real episode cache: what the flow does, without the cluster.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

import tests.core.courier as courier
from evalfleet.cache import EpisodeCache
from evalfleet.cli import (
    EXIT_GATE_UNDECIDED,
    EXIT_OK,
    EXIT_REGRESSION,
    gate,
    history_table,
    run_history,
)
from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.history import (
    ACTION_TV_THRESHOLD,
    LENGTH_SHIFT_RATIO,
    alarm_lines,
    checkpoints,
    curve_row,
    drift_alarms,
)
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import mlflow_params, with_history
from evalfleet.policy import load_policy, receive_policy
from evalfleet.records import EpisodeRecord, records_to_table
from evalfleet.report import aggregate
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.seeds import SeedLedger
from evalfleet.storage import write_episodes
from evalfleet.summary import summary_text
from evalfleet.tracking import log_evaluation, log_or_queue

EPISODES = 40



def _episodes(policy_name: str, seed: int = 0) -> object:
    resolved = resolve_env(courier.ENV_ID, {}, None)
    ref = f"tests.core.courier:{policy_name}"
    art = receive_policy(ref, None, resolved.observation_space, resolved.action_space)
    policy = load_policy(art.format, art.payload, None, art.source, resolved.action_space)
    ledger = SeedLedger(seed)
    backend = InProcessSlots(env_thunk(courier.ENV_ID, {}, None), 8)
    try:
        records = run_shard([(i, ledger.seed(i)) for i in range(EPISODES)], backend, policy,
                            EpisodeContext("r", policy_name, courier.ENV_ID, "spec", "w0"))
    finally:
        backend.close()
    return records_to_table(records).sort_by("episode_index")


_TABLES: dict[tuple[str, int], object] = {}


def _table(policy_name: str, seed: int = 0):
    if (policy_name, seed) not in _TABLES:
        _TABLES[(policy_name, seed)] = _episodes(policy_name, seed)
    return _TABLES[(policy_name, seed)]


def evaluate_checkpoint(tmp: Path, policy_name: str, step: int, *, seed: int = 0,
                        outcome_metric: str | None = None, run: str, table=None,
                        uri: str | None = None, request_id: str | None = None,
                        environment: dict | None = None) -> EvalReport:
    """Stage 6 and 7 of one evaluation of ``policy_name`` (or ``table``) at ``step``, on the real
    stores. ``uri``: the MLflow store, logged to as stage 7 does (queued when it does not answer);
    by default ``tmp``'s SQLite store, logged to directly. ``request_id``: another evaluation of
    the same weights and step (by default the request id is made of them). ``environment``: the
    cache key's ``environment`` ingredient, as stage 6 passes it (None: a report of an evalfleet
    that did not record it)."""
    table = _table(policy_name, seed) if table is None else table
    request = checkpoint_request(tmp, policy_name, step, seed=seed, outcome_metric=outcome_metric,
                                 run=run, episodes=table.num_rows, uri=uri, request_id=request_id)
    return log_checkpoint(tmp, request, judge_checkpoint(tmp, request, policy_name, table,
                                                         environment=environment), table)


def checkpoint_request(tmp: Path, policy_name: str, step: int, *, seed: int = 0,
                       outcome_metric: str | None = None, run: str, episodes: int = EPISODES,
                       uri: str | None = None, request_id: str | None = None) -> EvalRequest:
    """The request ``evaluate_checkpoint`` evaluates."""
    return EvalRequest(env=courier.ENV_ID, policy=f"tests.core.courier:{policy_name}",
                       episodes=episodes, seed=seed, output=tmp, training_run_id=run,
                       step=step, outcome_metric=outcome_metric, cache_dir=tmp / "cache",
                       request_id=request_id or f"{run}-{policy_name}-{step}-{seed}",
                       mlflow_uri=uri)


def judge_checkpoint(tmp: Path, request: EvalRequest, policy_name: str, table,
                     environment: dict | None = None) -> EvalReport:
    """``evaluate_checkpoint``'s stage 6 and history read (the verdict), nothing logged yet."""
    step, seed, run = request.step, request.seed, request.training_run_id
    sha = f"{policy_name}-{step}".encode().hex().ljust(64, "0")[:64]  # same weights, same hash
    where = "" if environment is None else "/" + json.dumps(environment, sort_keys=True)
    key = hashlib.sha256(f"{run}/{policy_name}/{step}/{seed}{where}".encode()).hexdigest()
    EpisodeCache(tmp / "cache").store(key, table, {"policy": {"sha256": sha}})
    extra = {} if environment is None else {"environment": environment}
    report = aggregate(request, table, env_spec={"env_id": courier.ENV_ID}, env_spec_hash="spec",
                       policy={"sha256": sha}, isolation="inprocess", timings={"run": 1.0},
                       cache={"status": "miss", "key": key}, run_seconds=1.0, **extra)
    return with_history(request, report, table)


def log_checkpoint(tmp: Path, request: EvalRequest, report: EvalReport, table) -> EvalReport:
    """``evaluate_checkpoint``'s MLflow run of a judged ``report`` (``judge_checkpoint``)."""
    uri = request.mlflow_uri
    folder = tmp / "runs" / request.request_id
    parquet = write_episodes(table, folder / "episodes.parquet")
    if uri is not None:
        outputs = log_or_queue(tmp, uri, "evalfleet", report.model_dump(mode="json"),
                               params=mlflow_params(request, report), artifacts=[parquet],
                               run_name=request.request_id, attempts=1, wait_s=(0.0, 0.0))
        return report.model_copy(update={"outputs": outputs})
    log_evaluation(f"sqlite:///{tmp / 'mlflow.db'}", "evalfleet", report.model_dump(mode="json"),
                   mlflow_params(request, report), [parquet], run_name=request.request_id)
    return report


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One MLflow store and cache for the module (a new SQLite store costs seconds to create);
    every test keeps to training run ids of its own."""
    return tmp_path_factory.mktemp("history")


def test_first_checkpoint_then_an_honest_improvement_is_new_best_and_raises_nothing(store):
    first = evaluate_checkpoint(store, "careless", 100, run="honest")
    assert first.verdict == "first"
    assert first.history["best_step"] == 100 and first.history["alarms"] == []
    better = evaluate_checkpoint(store, "careful", 200, run="honest")
    h = better.history
    assert h["verdict"] == "new_best"
    assert h["compared_with"]["step"] == 100
    c = h["comparison"]
    assert c["n"] == EPISODES and c["ci"]["low"] > 0 and c["p_improvement"] > 0.5
    assert c["mean_diff"] == pytest.approx(better.mean - first.mean)
    assert h["best_step"] == 200 and h["best_policy_sha256"] == better.policy_sha256
    assert h["alarms"] == [], h["alarms"]
    assert not [a for a in better.alarms if ":" in a and a.split(":")[0] in (
        "reward_outcome_divergence", "action_distribution_shift", "episode_length_shift",
        "failure_rate_jump")]
    # The curve so far holds the earlier step; MLflow tags make both findable by run and step.
    assert [r["step"] for r in h["curve"]] == [100]
    found = checkpoints(f"sqlite:///{store / 'mlflow.db'}", "honest")
    assert [(c.step, c.verdict, c.best) for c in found] == [(100, "first", True),
                                                           (200, "new_best", True)]


def test_a_gamed_reward_raises_reward_outcome_divergence_with_its_statistic(store):
    evaluate_checkpoint(store, "careless", 100, run="gamed")
    gamed = evaluate_checkpoint(store, "tip_farmer", 200, run="gamed")
    assert gamed.mean > 13.0  # the reward went up...
    assert gamed.success["rate"] == 0.0  # ...and nothing was delivered
    alarms = {a["alarm"]: a for a in gamed.history["alarms"]}
    div = alarms["reward_outcome_divergence"]
    assert div["steps"] == [100, 200] and div["outcome"] == "success rate"
    assert div["value"] == pytest.approx(-0.75)  # success 0.75 -> 0.0, paired over 40 episodes
    assert div["return_ci"][0] > 0 and div["outcome_ci"][1] < 0
    assert "threshold" in div and "falls" in div["message"]
    shift = alarms["action_distribution_shift"]
    assert shift["value"] == pytest.approx(1.0) and shift["value"] > ACTION_TV_THRESHOLD
    assert shift["shares"][1] == [0.0, 0.0, 1.0]
    # The string alarms carry it to the summary, MLflow tags and the callback.
    assert any(a.startswith("reward_outcome_divergence: return rose") for a in gamed.alarms)
    run = MlflowClient(f"sqlite:///{store / 'mlflow.db'}").search_runs(
        [MlflowClient(f"sqlite:///{store / 'mlflow.db'}").get_experiment_by_name("evalfleet")
         .experiment_id], "tags.`evalfleet.step` = '200'")[0]
    assert run.data.tags["evalfleet.alarm.reward_outcome_divergence"] == "true"
    assert run.data.metrics["eval/history_alarms"] == 2.0


def test_a_named_info_outcome_metric_is_watched_instead_of_success(store):
    evaluate_checkpoint(store, "careless", 1, outcome_metric="progress", run="info-metric")
    gamed = evaluate_checkpoint(store, "tip_farmer", 2, outcome_metric="progress", run="info-metric")
    div = next(a for a in gamed.history["alarms"] if a["alarm"] == "reward_outcome_divergence")
    assert div["outcome"] == "progress"
    careless = _table("careless")
    progress = [dict(m)["progress"] for m in careless.column("metrics").to_pylist()]
    assert div["value"] == pytest.approx(-float(np.mean(progress)))
    assert gamed.history["current"]["outcome"] == {"name": "progress", "mean": 0.0, "n": EPISODES}


def test_a_named_outcome_no_episode_reports_is_an_output_missing_not_a_silent_no_alarm(store):
    # Planted: a typo of the key. Before, the reward-hacking check fell silent (no pairs, no
    # alarm, exit 0) while the return rose and the real key fell.
    evaluate_checkpoint(store, "careless", 1, outcome_metric="progres", run="typo")
    gamed = evaluate_checkpoint(store, "tip_farmer", 2, outcome_metric="progres", run="typo")
    assert gamed.history["current"]["outcome"]["keys_seen"] == ["progress"]
    (line,) = [a for a in gamed.alarms if a.startswith("output_missing: ")]
    assert "outcome 'progres' (--outcome-metric)" in line and "keys seen: progress" in line
    assert gamed.missing_outputs
    assert not any(a.startswith("output_missing") for a in evaluate_checkpoint(
        store, "tip_farmer", 3, outcome_metric="progress", run="typo-fixed").alarms)


def test_regression_is_judged_against_the_best_checkpoint_and_gates(store, capsys):
    evaluate_checkpoint(store, "careful", 10, run="regress")
    worse = evaluate_checkpoint(store, "careless", 20, run="regress")
    assert worse.verdict == "regression"
    assert worse.history["comparison"]["ci"]["high"] < 0
    assert worse.history["best_step"] == 10
    # Step 30 (the same weights as 20) is compared with the best (10), not the previous (20).
    again = evaluate_checkpoint(store, "careless", 30, run="regress")
    assert again.verdict == "regression" and again.history["compared_with"]["step"] == 10
    assert again.history["previous_step"] == 20 and again.history["alarms"] == []
    assert gate(again) == EXIT_REGRESSION
    assert "regression against the best checkpoint (step 10)" in capsys.readouterr().err
    best = evaluate_checkpoint(store, "careful", 40, run="regress")
    assert best.verdict == "not_distinguishable"  # the same returns as step 10, pair by pair
    assert gate(best) == EXIT_OK


def test_other_seeds_are_another_protocol_never_paired_nor_passed_as_first(store):
    # Nothing earlier on the same seeds: before, the verdict was 'first', tagged best and passed
    # by --gate, though the checkpoint (a worse policy) was never compared with steps 10 and 15.
    evaluate_checkpoint(store, "careful", 10, seed=0, run="seeds")
    evaluate_checkpoint(store, "careless", 15, seed=0, run="seeds")
    other = evaluate_checkpoint(store, "careless", 20, seed=1, run="seeds")
    h = other.history
    assert h is not None and other.verdict == "protocol_changed"
    assert (h["best_step"], h["comparison"], h["other_protocol_steps"]) == (None, None, [10, 15])
    assert h["note"].startswith("2 earlier checkpoints of this training run (steps 10, 15) were "
                                "evaluated under another protocol")
    assert any(a.startswith("history_protocol_changed: 2 earlier checkpoints") for a in other.alarms)
    assert gate(other) == EXIT_GATE_UNDECIDED
    runs = {c.step: c for c in checkpoints(f"sqlite:///{store / 'mlflow.db'}", "seeds")}
    assert (runs[20].verdict, runs[20].best) == ("protocol_changed", False)
    # The next checkpoint on the new seeds is compared with that one: a series of its own.
    after = evaluate_checkpoint(store, "careful", 30, seed=1, run="seeds")
    assert after.verdict == "new_best" and after.history["compared_with"]["step"] == 20
    assert "no best checkpoint under this protocol" in summary_text(other)


def _gain(table, gain: float):
    """``table`` as an env reading its reward scale from a variable (``HUNT_GAIN``) returns it."""
    import pyarrow as pa

    scaled = pa.array([r * gain for r in table.column("return").to_pylist()], pa.float64())
    return table.set_column(table.schema.get_field_index("return"), "return", scaled)


@pytest.mark.parametrize("change", ["granted_value", "isolation", "read_contents"])
def test_other_env_inputs_are_another_protocol_never_a_new_best_nor_passed(store, tmp_path, change):
    """Planted (audit finding: history protocol): the protocol id was env spec, seed, step cap and
    determinism only. Step 2, a worse policy run where its env saw ``HUNT_GAIN=3`` (granted by
    ``--sandbox-env``, inherited in-process, or read from a ``--sandbox-read`` folder), was paired
    with step 1 (gain 1): ``new_best`` +16.55, tagged best, ``--gate`` exit 0; step 3, step 1's
    policy again, was then a ``regression`` (exit 4). The env's inputs (the cache key's
    ``environment`` ingredient) are now part of the protocol."""
    from evalfleet.cache import env_environment
    from evalfleet.history import report_protocol

    data = tmp_path / "calib"
    data.mkdir()
    (data / "gain.txt").write_text("1")
    one = {"granted_value": env_environment("process", ["HUNT_GAIN"], {"HUNT_GAIN": "1"}),
           "isolation": env_environment("process", [], {"HUNT_GAIN": "3"}),
           "read_contents": env_environment("process", [], {}, read=[str(data)])}[change]
    (data / "gain.txt").write_text("3")
    three = {"granted_value": env_environment("process", ["HUNT_GAIN"], {"HUNT_GAIN": "3"}),
             "isolation": env_environment("inprocess", [], {"HUNT_GAIN": "3"}),
             "read_contents": env_environment("process", [], {}, read=[str(data)])}[change]
    assert one != three
    run = f"env-inputs-{change}"
    first = evaluate_checkpoint(store, "careful", 1, run=run, environment=one)
    assert first.verdict == "first"
    worse = _gain(_table("careless"), 3.0)
    assert np.mean(worse.column("return").to_pylist()) > first.mean  # by return, the "best"
    step2 = evaluate_checkpoint(store, "careless", 2, run=run, table=worse, environment=three)
    assert step2.verdict == "protocol_changed", step2.history
    assert step2.history["best_step"] is None and step2.history["other_protocol_steps"] == [1]
    assert "what the env sees of the environment" in step2.history["note"]
    assert gate(step2) == EXIT_GATE_UNDECIDED
    assert step2.manifest["protocol"]["environment_sha256"] != first.manifest["protocol"][
        "environment_sha256"]
    assert report_protocol(step2.model_dump(mode="json")) != report_protocol(first.model_dump(mode="json"))
    # Step 3, step 1's policy under step 1's inputs, is compared with step 1, not step 2.
    step3 = evaluate_checkpoint(store, "careful", 3, run=run, environment=one)
    assert step3.verdict == "not_distinguishable" and step3.history["compared_with"]["step"] == 1
    assert step3.history["comparison"]["mean_diff"] == 0.0 and gate(step3) == EXIT_OK
    runs = {c.step: c for c in checkpoints(f"sqlite:///{store / 'mlflow.db'}", run)}
    assert (runs[2].verdict, runs[2].best) == ("protocol_changed", False)


def test_a_checkpoint_logged_before_the_protocol_had_the_env_inputs_is_another_protocol(store):
    """A row an older evalfleet logged has no ``environment_sha256`` in its report: its protocol
    tag is the id it was given then, and re-reading its report.json gives the same id (no
    crash, no error). Under which env inputs it ran is unknown, so the next checkpoint that
    records them is ``protocol_changed`` (gate exit 6, once), never paired with it: pairing on
    an unknown would let the hole through at the upgrade. The checkpoint after it is compared."""
    from evalfleet.cache import env_environment
    from evalfleet.history import protocol_id, report_protocol

    old = evaluate_checkpoint(store, "careful", 1, run="before-env-inputs")  # no environment
    assert "environment_sha256" not in old.manifest["protocol"]
    saved = json.loads(old.model_dump_json())
    assert report_protocol(saved) == protocol_id("spec", 0, None, True)  # the id it was tagged with
    [row] = checkpoints(f"sqlite:///{store / 'mlflow.db'}", "before-env-inputs")
    assert (row.protocol, row.verdict, row.best) == (report_protocol(saved), "first", True)
    inputs = env_environment("inprocess", [], {})
    new = evaluate_checkpoint(store, "careless", 2, run="before-env-inputs", environment=inputs)
    assert new.verdict == "protocol_changed" and new.history["other_protocol_steps"] == [1]
    assert gate(new) == EXIT_GATE_UNDECIDED
    after = evaluate_checkpoint(store, "careful", 3, run="before-env-inputs", environment=inputs)
    assert after.verdict == "new_best" and after.history["compared_with"]["step"] == 2


def test_earlier_episodes_come_from_mlflow_when_the_cache_lost_them(store):
    evaluate_checkpoint(store, "careless", 10, run="lost-cache")
    key = hashlib.sha256(b"lost-cache/careless/10/0").hexdigest()
    assert EpisodeCache(store / "cache").remove(key)
    better = evaluate_checkpoint(store, "careful", 20, run="lost-cache")
    assert better.verdict == "new_best" and better.history["comparison"]["n"] == EPISODES


def test_eval_metrics_land_in_the_trainers_own_run_at_the_step(store):
    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("training")
    trainer = client.create_run(exp).info.run_id
    evaluate_checkpoint(store, "careless", 100, run=trainer)
    evaluate_checkpoint(store, "careful", 200, run=trainer)
    history = client.get_metric_history(trainer, "eval/reward")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (100, pytest.approx(float(np.mean(_table("careless").column("return").to_numpy())))),
        (200, pytest.approx(float(np.mean(_table("careful").column("return").to_numpy())))),
    ]
    assert [m.value for m in client.get_metric_history(trainer, "eval/verdict")] == [1.0, 1.0]


def test_history_command_prints_the_rows_and_saves_a_plot(store, capsys):
    evaluate_checkpoint(store, "careless", 100, run="cli")
    evaluate_checkpoint(store, "careful", 200, run="cli")
    evaluate_checkpoint(store, "tip_farmer", 300, run="cli")
    evaluate_checkpoint(store, "careless", 50, run="another-run")
    import argparse

    plot = store / "h.png"
    args = argparse.Namespace(training_run_id="cli", output=str(store), mlflow_uri=None,
                              plot=str(plot), json=False)
    assert run_history(args) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["step", "return", "95%"]
    rows = [line.split() for line in out[1:4]]
    assert [r[0] for r in rows] == ["100", "200", "300"]
    assert rows[0][1] == format(np.mean(_table("careless").column("return").to_numpy()), ".4g")
    assert [r[4] for r in rows] == ["0.750", "1.000", "0.000"]  # success rate
    assert rows[0][7:9] == ["first", "*"] and rows[1][7:9] == ["new_best", "*"]
    assert out[3].endswith("action_distribution_shift, reward_outcome_divergence")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    args.json, args.training_run_id = True, "another-run"
    assert run_history(args) == EXIT_OK
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [50]


def _rows(lengths, reasons=None, counts=None):
    reasons = reasons or ["terminated"] * len(lengths)
    return records_to_table([
        EpisodeRecord("r", "p", "e", "s", i, 1000 + i, float(n), int(n), reasons[i], None, True,
                      0.0, "w", "b", "inprocess", action_counts=counts)
        for i, n in enumerate(lengths)])


def test_length_shift_and_failure_jump_have_thresholds_and_steps():
    old = _rows([10 + i % 3 for i in range(60)])
    new = _rows([30 + i % 3 for i in range(60)])
    alarms = {a["alarm"]: a for a in drift_alarms(new, old, (5, 6), seed=0)}
    length = alarms["episode_length_shift"]
    assert length["value"] == pytest.approx(20 / 11) and length["value"] > LENGTH_SHIFT_RATIO
    assert length["steps"] == [5, 6]
    failing = _rows([10 + i % 3 for i in range(60)],
                    reasons=["policy_error" if i % 4 == 0 else "terminated" for i in range(60)])
    jump = {a["alarm"]: a for a in drift_alarms(failing, old, (5, 6), seed=0)}["failure_rate_jump"]
    assert jump["value"] == pytest.approx(0.25) and jump["threshold"].startswith("> 0.05")
    slight = _rows([10 + i % 3 for i in range(60)],
                   reasons=["policy_error" if i == 0 else "terminated" for i in range(60)])
    assert drift_alarms(slight, old, (5, 6), seed=0) == []


def test_entropy_collapse_without_a_large_distance():
    old = _rows([10] * 20, counts=[1, 1, 8])
    new = _rows([10] * 20, counts=[0, 0, 10])
    alarm = drift_alarms(new, old, (1, 2), seed=0)[0]
    assert alarm["alarm"] == "action_distribution_shift"
    assert alarm["statistic"] == "action entropy (nats)" and alarm["value"] == 0.0


def test_curve_row_and_table_of_a_checkpoint_without_success(store):
    evaluate_checkpoint(store, "careless", 7, run="curve")
    [cp] = checkpoints(f"sqlite:///{store / 'mlflow.db'}", "curve")
    row = curve_row(cp)
    assert row["step"] == 7 and row["verdict"] == "first" and row["episodes"] == EPISODES
    text = history_table([dict(row, success_rate=None)])
    assert text.splitlines()[1].split()[4] == "-"


def test_the_table_names_each_steps_protocol_and_says_when_a_curve_mixes_them():
    """A curve of steps under two protocols read as one comparable series: nothing said which
    steps were never compared with the others (the verdict column alone showed protocol_changed)."""
    base = {"reward": 9.5, "reward_ci_low": 9.0, "reward_ci_high": 10.0, "success_rate": None,
            "failure_rate": 0.0, "episode_length": 20.0, "alarms": [], "best": False}
    rows = [dict(base, step=1, verdict="first", best=True, protocol="389a35f6f22dff53"),
            dict(base, step=2, verdict="protocol_changed", protocol="d71fa41da475fa81"),
            dict(base, step=3, verdict="regression", protocol="389a35f6f22dff53")]
    lines = history_table(rows).splitlines()
    assert lines[0].split()[-2:] == ["protocol", "alarms"]
    assert [line.split()[-2] for line in lines[1:4]] == ["389a35f6", "d71fa41d", "389a35f6"]
    assert lines[4].startswith("2 protocols on this curve")
    assert "2 protocols" not in history_table([rows[0], rows[2]])


def test_report_page_shows_the_curve_so_far_verdict_and_alarm_table(store, tmp_path):
    from evalfleet.plots import render_history
    from evalfleet.report import curve_so_far
    from evalfleet.review import report_page

    evaluate_checkpoint(store, "careless", 1, run="page")
    gamed = evaluate_checkpoint(store, "tip_farmer", 2, run="page")
    rows = curve_so_far(gamed)
    assert [(r["step"], r["verdict"]) for r in rows] == [(1, "first"), (2, "new_best")]
    assert rows[1]["alarms"] == ["reward_outcome_divergence", "action_distribution_shift"]
    plot = render_history(rows, tmp_path / "history.png")
    page = report_page(gamed, [], {"history": plot}, tmp_path / "report.html").read_text()
    assert "Training run so far" in page and 'alt="history"' in page
    assert "<strong>new best</strong>" in page and "(step 1)" in page
    assert "<td>reward_outcome_divergence</td>" in page and "<td>1 → 2</td>" in page
    failed = gamed.model_copy(update={"history": {"error": "OSError: gone", "verdict": None,
                                                  "alarms": []}})
    text = report_page(failed, [], {}, tmp_path / "r2.html").read_text()
    assert "history could not be read: OSError: gone" in text


def test_evaluator_result_carries_verdict_alarms_and_the_best_checkpoint(store, tmp_path):
    import torch

    from evalfleet.client import Evaluator

    first = evaluate_checkpoint(store, "careful", 1, run="client")
    gamed = evaluate_checkpoint(store, "tip_farmer", 2, run="client")
    worse = evaluate_checkpoint(store, "careless", 3, run="client")
    reports = iter([first, gamed, worse])
    with Evaluator(env="CartPole-v1", num_episodes=4, output=tmp_path,
                   runner=lambda request: next(reports)) as ev:
        results = [ev.evaluate(torch.nn.Linear(4, 2), step=s) for s in (1, 2, 3)]
    assert [r["eval/verdict"] for r in results] == ["first", "new_best", "regression"]
    # The gamed step 2 is new_best by its return, but its reward may be gamed: the best stays 1.
    assert [r["eval/best_step"] for r in results] == [1, 1, 1]
    assert results[1]["eval/alarms"] == ["reward_outcome_divergence", "action_distribution_shift"]
    assert (ev.best_step, ev.best_policy_sha256) == (1, first.policy_sha256)


def test_history_figure_plots_the_rows_it_is_given():
    from evalfleet.plots import history_figure

    rows = [dict(step=10, reward=1.0, reward_ci_low=0.5, reward_ci_high=1.5, success_rate=0.5,
                 success_ci_low=0.3, success_ci_high=0.7, failure_rate=0.0, episode_length=20.0,
                 verdict="first", alarms=[]),
            dict(step=20, reward=3.0, reward_ci_low=2.0, reward_ci_high=4.0, success_rate=None,
                 success_ci_low=None, success_ci_high=None, failure_rate=0.1, episode_length=35.0,
                 verdict="regression", alarms=["episode_length_shift"])]
    ret, success, fails, length = history_figure(rows).axes
    assert list(ret.lines[0].get_ydata()) == [1.0, 3.0]
    assert {t.get_text() for t in ret.get_legend().get_texts()} >= {"first", "regression", "alarm"}
    assert list(fails.lines[0].get_ydata()) == [0.0, 0.1] and fails.get_ylim()[0] == 0.0
    assert list(length.lines[0].get_xdata()) == [10.0, 20.0]
    assert list(length.lines[0].get_ydata()) == [20.0, 35.0]
    assert success.lines[0].get_ydata()[0] == 0.5


def test_a_baseline_evaluation_is_no_checkpoint_of_the_training_run(tmp_path):
    from evalfleet.pipeline import baseline_request

    request = EvalRequest(env=courier.ENV_ID, policy="tests.core.courier:careful", output=tmp_path,
                          training_run_id="t", step=5, baseline="tests.core.courier:careless")
    other = baseline_request(request, 10)
    assert (other.training_run_id, other.step) == ("t", None)
    table = _table("careless")
    report = aggregate(other, table, env_spec={}, env_spec_hash="spec", policy={"sha256": "b" * 64},
                       isolation="inprocess", timings={}, cache={}, run_seconds=1.0)
    assert with_history(other, report, table).history is None  # no MLflow read, no verdict


def _broken_on(indices: range, n: int = 200, name: str = "p") -> object:
    """Returns ~ Normal(100, 5) on seed-ledger seeds; the policy raises on ``indices`` (return 10)."""
    normal = np.random.default_rng(0).normal(100, 5, n)
    ledger = SeedLedger(0)
    return records_to_table([
        EpisodeRecord("r", name, "e", "s", i, ledger.seed(i), 10.0 if i in indices else float(normal[i]),
                      10, "policy_error" if i in indices else "terminated",
                      "RuntimeError" if i in indices else None, None, 0.1, "w", "b", "inprocess")
        for i in range(n)])


def test_the_best_checkpoints_policy_failures_are_paired_not_dropped(store):
    # Both checkpoints break on 20 of 200 seeds (other seeds): equally good. The cache keeps no
    # policy_error row, so pairing on it alone dropped the best's failures and kept the new one's:
    # a false 'regression' (-10.0, CI [-14.6, -6.0]) and a false failure_rate_jump.
    best = evaluate_checkpoint(store, "careful", 1000, run="broken", table=_broken_on(range(20)))
    new = evaluate_checkpoint(store, "careful", 2000, run="broken", table=_broken_on(range(20, 40)))
    h = new.history
    assert h["verdict"] == "not_distinguishable"
    c = h["comparison"]
    assert (c["n"], c["dropped_unmatched"], c["dropped_harness_failures"]) == (200, 0, 0)
    assert c["policy_failures"] == {"new": 20, "baseline": 20}
    assert c["mean_diff"] == pytest.approx(new.mean - best.mean, abs=1e-9)
    assert c["ci"]["low"] < 0 < c["ci"]["high"]
    assert h["alarms"] == [] and not [a for a in new.alarms if a.startswith("history_")]


def test_a_partial_cache_without_the_artifact_gives_no_verdict_and_the_gate_fails_closed(store,
                                                                                         capsys):
    from evalfleet.history import Checkpoint, assess, episodes_of

    n = 200
    cache = EpisodeCache(store / "cache")
    key = hashlib.sha256(b"partial/best").hexdigest()
    assert cache.store(key, _broken_on(range(20)), {"policy": {}}) == 180
    cp = Checkpoint("no-such-run", 1000, "req", "cd" * 32, key, "proto",
                    {"eval/reward": 91.0, "eval/episodes": float(n)}, "first", True, False)
    uri = f"sqlite:///{store / 'mlflow.db'}"
    h = assess(_broken_on(range(20, 40)), step=2000, seed=0, earlier=[cp],
               episodes=lambda c: episodes_of(c, cache, uri, range(n)))
    assert h["verdict"] == "no_paired_episodes" and h["comparison"] is None
    assert h["note"] == ("the episodes of the best checkpoint (step 1000) are neither whole in the "
                         "cache nor in MLflow")
    assert h["alarms"] == [] and h["alarms_note"].startswith("episodes of the previous checkpoint")
    assert alarm_lines(h) == [
        "history_not_compared: no verdict against the best checkpoint (step 1000): the episodes of "
        "the best checkpoint (step 1000) are neither whole in the cache nor in MLflow; re-evaluate "
        "the best checkpoint on the same seeds and episode count, or compare with --baseline"]
    report = evaluate_checkpoint(store, "careful", 5, run="gate-closed").model_copy(
        update={"history": h})
    assert gate(report) == EXIT_GATE_UNDECIDED == 6
    err = capsys.readouterr().err
    assert "could not be compared with the best earlier checkpoint of training run 'gate-closed'" in err
    assert "verdict 'no_paired_episodes'" in err and "(exit 6)" in err


def test_an_unreadable_history_is_an_alarm_and_the_gate_fails_closed(store, tmp_path, capsys):
    from evalfleet.summary import summary_text

    report = evaluate_checkpoint(store, "careful", 5, run="unreadable")
    (tmp_path / "a-file").write_text("")  # a store under a file: unreadable
    request = EvalRequest(env=courier.ENV_ID, policy="tests.core.courier:careful", output=tmp_path,
                          training_run_id="unreadable", step=6,
                          mlflow_uri=f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}")
    failed = with_history(request, report.model_copy(update={"alarms": []}), _table("careful"))
    assert failed.history["verdict"] is None
    assert failed.history["error"].startswith("FileExistsError: ")
    assert failed.alarms == alarm_lines(failed.history)
    assert failed.alarms[0].startswith("history_unavailable: the training run's history could not "
                                       "be read (FileExistsError: ")
    assert "not compared: history could not be read (FileExistsError" in summary_text(failed)
    assert gate(failed) == EXIT_GATE_UNDECIDED
    assert "history could not be read (FileExistsError" in capsys.readouterr().err
    # Too few pairs is no verdict either.
    few = report.model_copy(update={"history": {
        "verdict": "no_paired_episodes", "note": "3 paired episodes: a verdict needs at least 10",
        "compared_with": {"step": 4}, "alarms": []}})
    assert gate(few) == EXIT_GATE_UNDECIDED


def test_a_pass_resting_on_pairs_the_comparison_left_out_is_no_pass(store, capsys):
    report = evaluate_checkpoint(store, "careful", 5, run="left-out")
    history = {"verdict": "not_distinguishable", "best_step": 4, "alarms": [],
               "comparison": {"baseline": "step 4", "n": 60, "dropped_unmatched": 0,
                              "dropped_harness_failures": 40, "dropped_harness_baseline": 40}}
    lines = alarm_lines(history)
    assert [a.split(":")[0] for a in lines] == ["history_pairs_harness"]
    passed = report.model_copy(update={"history": history, "alarms": []})
    assert gate(passed) == EXIT_OK  # without the alarm (as before): a pass
    left_out = report.model_copy(update={"history": history, "alarms": lines})
    assert gate(left_out) == EXIT_GATE_UNDECIDED
    assert "verdict 'not_distinguishable' with history_pairs_harness" in capsys.readouterr().err


def test_a_sha256_baseline_is_the_whole_table_or_a_clear_error(store, tmp_path):
    from types import SimpleNamespace

    from evalfleet.errors import RequestError
    from evalfleet.pipeline import cached_baseline

    ing = {"policy": {"sha256": "ee" * 32}, "env": {"x": 1}, "protocol": {"seed": 0}}
    table = _broken_on(range(20), name="ee" * 32)
    key = hashlib.sha256(b"sha-baseline").hexdigest()
    EpisodeCache(tmp_path / "cache").store(key, table, ing)
    request = EvalRequest(env=courier.ENV_ID, policy="x", baseline="sha256:" + "ee" * 8,
                          cache_dir=tmp_path / "cache", output=tmp_path, episodes=200)
    received = SimpleNamespace(cache_ingredients=dict(ing, policy={"sha256": "ff" * 32}))
    with pytest.raises(RequestError) as err:
        cached_baseline(request, received, 200)  # type: ignore[arg-type]
    assert str(err.value).startswith(
        f"baseline 'sha256:{'ee' * 8}': the cache holds 180 of the 200 episodes to pair on; 20 are "
        "missing (indices 0, 1, 2, 3, 4, ...): episodes the baseline's policy runtime")
    assert "pass the baseline policy file instead" in str(err.value)
    # The evaluation logged under the same key holds them all: its episodes.parquet is used.
    report = aggregate(request.model_copy(update={"baseline": None}), table, env_spec={},
                       env_spec_hash="spec", policy={"sha256": "ee" * 32}, isolation="inprocess",
                       timings={}, cache={"status": "miss", "key": key}, run_seconds=1.0)
    parquet = write_episodes(table, tmp_path / "run" / "episodes.parquet")
    log_evaluation(f"sqlite:///{tmp_path / 'mlflow.db'}", "evalfleet", report.model_dump(mode="json"),
                   {}, [parquet], run_name="baseline")
    whole, source = cached_baseline(request, received, 200)  # type: ignore[arg-type]
    assert source == "sha256:" + "ee" * 8 and whole.num_rows == 200
    assert whole.column("end_reason").to_pylist().count("policy_error") == 20


def test_a_sha256_baseline_names_one_cached_policy_or_is_refused(store, tmp_path):
    # Two cached checkpoints share a prefix: the first in key order was paired before, silently,
    # and a bare 'sha256:' (or a few digits) named the evaluated policy itself.
    from types import SimpleNamespace

    from evalfleet.errors import RequestError
    from evalfleet.pipeline import cached_baseline, same_policy

    ing = {"env": {"x": 1}, "protocol": {"seed": 0}}
    cache = EpisodeCache(tmp_path / "cache")
    for sha in ("ab" * 8 + "1" * 48, "ab" * 8 + "2" * 48):
        cache.store(hashlib.sha256(sha.encode()).hexdigest(),
                    _broken_on(range(0), name=sha), dict(ing, policy={"sha256": sha}))
    received = SimpleNamespace(cache_ingredients=dict(ing, policy={"sha256": "ff" * 32}),
                               artifact=SimpleNamespace(sha256="ff" * 32))
    request = EvalRequest(env=courier.ENV_ID, policy="x", baseline="sha256:" + "ab" * 8,
                          cache_dir=tmp_path / "cache", output=tmp_path, episodes=200)
    with pytest.raises(RequestError, match=r"matches 2 policies under this evaluation's "
                       r"protocol \(abababababababab, abababababababab\): give more"):
        cached_baseline(request, received, 200)  # type: ignore[arg-type]
    one = request.model_copy(update={"baseline": "sha256:" + "ab" * 8 + "2" * 4})
    whole, _ = cached_baseline(one, received, 200)  # type: ignore[arg-type]
    assert set(whole.column("policy_sha256").to_pylist()) == {"ab" * 8 + "2" * 48}
    for short in ("sha256:", "sha256:ff", "sha256:" + "f" * 11, "sha256:" + "g" * 12):
        with pytest.raises(RequestError, match="at least 12 hex digits"):
            EvalRequest.build(env=courier.ENV_ID, policy="x", baseline=short)
    assert not same_policy(one, received)  # type: ignore[arg-type]


def test_a_sha256_baseline_cached_under_two_versions_of_its_imported_code_is_refused(tmp_path):
    # A callable's file (its hash) stayed the same while a helper module it imports changed: two
    # entries, one hash. The first in key order was paired before, silently: maybe the stale one.
    from types import SimpleNamespace

    from evalfleet.errors import RequestError
    from evalfleet.pipeline import cached_baseline

    ing = {"env": {"x": 1}, "protocol": {"seed": 0}}
    sha = "cd" * 32
    cache = EpisodeCache(tmp_path / "cache")
    for helper in ("gain 0.5", "gain 0"):
        policy = {"sha256": sha, "code": {"gainmod": helper}}
        cache.store(hashlib.sha256(helper.encode()).hexdigest(), _broken_on(range(0), name=sha),
                    dict(ing, policy=policy))
    received = SimpleNamespace(cache_ingredients=dict(ing, policy={"sha256": "ff" * 32}),
                               artifact=SimpleNamespace(sha256="ff" * 32))
    request = EvalRequest(env=courier.ENV_ID, policy="x", baseline="sha256:" + sha[:16],
                          cache_dir=tmp_path / "cache", output=tmp_path, episodes=200)
    with pytest.raises(RequestError, match=r"the cache holds 2 evaluations of policy "
                       r"cdcdcdcdcdcdcdcd under this protocol, run with different versions of "
                       r"the code it imports"):
        cached_baseline(request, received, 200)  # type: ignore[arg-type]


def test_a_sha256_baseline_that_also_names_the_evaluated_policy_is_refused(store, tmp_path):
    # The prefix matched the evaluated policy, so the comparison was with itself (a difference
    # of exactly 0, no alarm), while a cached checkpoint under the same protocol shares it.
    from types import SimpleNamespace

    from evalfleet.errors import RequestError
    from evalfleet.pipeline import same_policy

    ing = {"env": {"x": 1}, "protocol": {"seed": 0}}
    cached, evaluated = "ab" * 8 + "1" * 48, "ab" * 8 + "3" * 48
    EpisodeCache(tmp_path / "cache").store(hashlib.sha256(b"c").hexdigest(),
                                           _broken_on(range(0), name=cached),
                                           dict(ing, policy={"sha256": cached}))
    received = SimpleNamespace(cache_ingredients=dict(ing, policy={"sha256": evaluated}),
                               artifact=SimpleNamespace(sha256=evaluated))
    request = EvalRequest(env=courier.ENV_ID, policy="x", baseline="sha256:" + "ab" * 8,
                          cache_dir=tmp_path / "cache", output=tmp_path, episodes=200)
    with pytest.raises(RequestError, match=r"matches 2 policies under this evaluation's protocol "
                       r"\(abababababababab, abababababababab, the evaluated policy among them\)"):
        same_policy(request, received)  # type: ignore[arg-type]
    whole = request.model_copy(update={"baseline": "sha256:" + evaluated})
    assert same_policy(whole, received)  # type: ignore[arg-type]
    other = request.model_copy(update={"baseline": "sha256:" + cached[:20]})
    assert not same_policy(other, received)  # type: ignore[arg-type]


def test_a_sha256_baseline_of_its_own_hash_cached_with_other_imported_code_is_refused_at_stage_1(
        tmp_path):
    """Planted (audit finding: sha256 self-baseline): a callable's hash is its module's source; the
    helper module it imports (``THRESH``) is keyed apart. The cache held that hash's evaluation with
    ``THRESH = 0.0`` (CartPole 500); with ``THRESH = 5.0`` the baseline ``sha256:`` of its own hash
    was taken for itself: a difference of exactly 0 against a policy scoring 9.6, exit 0. It is
    itself only when every cached entry of the hash under this protocol has its cache key."""
    from types import SimpleNamespace

    from evalfleet.errors import RequestError
    from evalfleet.pipeline import check_hash_baseline, same_policy

    ing = {"env": {"x": 1}, "protocol": {"seed": 0}}
    sha = "5d" * 32
    before = {"sha256": sha, "code": {"huntcall": "source-sha256:aa", "huntcfg": "source-sha256:00"}}
    now = dict(before, code={"huntcall": "source-sha256:aa", "huntcfg": "source-sha256:50"})
    old_key, new_key = (hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()
                        for p in (before, now))
    cache = EpisodeCache(tmp_path / "cache")
    cache.store(old_key, _broken_on(range(0), name=sha), dict(ing, policy=before))
    received = SimpleNamespace(cache_ingredients=dict(ing, policy=now), cache_key=new_key,
                               artifact=SimpleNamespace(sha256=sha))
    request = EvalRequest(env=courier.ENV_ID, policy="huntcall:act", baseline="sha256:" + sha[:16],
                          cache_dir=tmp_path / "cache", output=tmp_path, episodes=30)
    for check in (same_policy, check_hash_baseline):
        with pytest.raises(RequestError) as err:
            check(request, received)  # type: ignore[arg-type]
        text = str(err.value)
        assert text.startswith(
            f"baseline 'sha256:{sha[:16]}' names the evaluated policy's own hash ({sha[:16]}), but "
            f"the cache holds 1 evaluation of that hash under this protocol with another cache key "
            f"({old_key[:12]}; this evaluation's is {new_key[:12]}): the code of 'huntcfg' differs")
        assert "difference of exactly 0" in text and "drop --baseline" in text
    # The entry of its own key (the same code, evaluated before): itself, its episodes reused.
    cache.remove(old_key)
    cache.store(new_key, _broken_on(range(0), name=sha), dict(ing, policy=now))
    assert same_policy(request, received)  # type: ignore[arg-type]
    check_hash_baseline(request, received)  # type: ignore[arg-type]
    # Both: one of them is not this policy, whichever the prefix was meant for.
    cache.store(old_key, _broken_on(range(0), name=sha), dict(ing, policy=before))
    with pytest.raises(RequestError, match=r"holds 1 evaluation of that hash under this protocol "
                       rf"with another cache key \({old_key[:12]};"):
        same_policy(request, received)  # type: ignore[arg-type]


def test_earlier_checkpoints_that_were_all_harness_faults_give_no_pass(store, capsys):
    """Step 10's evaluation lost 3 of 40 episodes to the harness (a harness fault) but its 37
    scored ones beat step 20 on every seed. Step 20 was the run's 'first' checkpoint, and the
    gate passed it: no comparison, no alarm. Now: no verdict, an alarm, and the gate fails closed."""
    import pyarrow as pa

    careful = _table("careful")
    reasons = careful.column("end_reason").to_pylist()
    reasons[:3] = ["env_error"] * 3
    faulty = careful.set_column(careful.schema.get_field_index("end_reason"), "end_reason",
                                pa.array(reasons, careful.schema.field("end_reason").type))
    earlier = evaluate_checkpoint(store, "careful", 10, run="faulty-first", table=faulty)
    assert earlier.harness_fault
    later = evaluate_checkpoint(store, "careless", 20, run="faulty-first")
    assert later.verdict == "no_paired_episodes" and later.history["best_step"] is None
    assert "every earlier checkpoint of this training run (steps 10) was a harness fault" in (
        later.history["note"])
    assert any(a.startswith("history_not_compared: no verdict against the best checkpoint: every "
                            "earlier checkpoint") for a in later.alarms), later.alarms
    assert gate(later) == EXIT_GATE_UNDECIDED
    assert "could not be compared with the best earlier checkpoint" in capsys.readouterr().err


def _with_column(table, name: str, values: list) -> object:
    import pyarrow as pa

    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))


def test_episodes_that_stop_reporting_the_outcome_are_an_alarm_no_best_and_no_pass(store, capsys):
    # Planted: the env puts 'success' only in the final info of a delivery, so a policy that
    # farms tips until the step cap ends every episode with none. Before, the outcome check had
    # no pairs and fell silent: new_best, tagged best, and the gate passed it.
    evaluate_checkpoint(store, "careless", 100, run="quiet")
    farmer = _table("tip_farmer")
    quiet = _with_column(farmer, "success", [None] * farmer.num_rows)
    gamed = evaluate_checkpoint(store, "tip_farmer", 200, run="quiet", table=quiet)
    h = gamed.history
    assert h["verdict"] == "new_best"  # the return rose...
    alarm = next(a for a in h["alarms"] if a["alarm"] == "outcome_unreported")
    assert (alarm["value"], alarm["silent"], alarm["reported_before"]) == (1.0, EPISODES, EPISODES)
    assert alarm["steps"] == [100, 200]
    assert "reward_outcome_divergence" not in {a["alarm"] for a in h["alarms"]}
    assert any(a.startswith("outcome_unreported: success rate was reported on 40 seeds at step 100")
               for a in gamed.alarms)
    # ...but it is no best checkpoint, and the gate does not pass it.
    assert h["best_step"] == 100 and h["best_withheld"] == ["outcome_unreported"]
    assert gate(gamed) == EXIT_GATE_UNDECIDED
    assert "with outcome_unreported" in capsys.readouterr().err
    found = checkpoints(f"sqlite:///{store / 'mlflow.db'}", "quiet")
    assert [(c.step, c.best) for c in found] == [(100, True), (200, False)]
    later = evaluate_checkpoint(store, "careful", 300, run="quiet")
    assert later.history["compared_with"]["step"] == 100


def test_a_gamed_reward_is_never_the_best_checkpoint_and_the_gate_does_not_pass(store):
    evaluate_checkpoint(store, "careless", 100, run="gamed-gate")
    gamed = evaluate_checkpoint(store, "tip_farmer", 200, run="gamed-gate")
    assert gamed.history["verdict"] == "new_best"
    assert gamed.history["best_step"] == 100
    assert gamed.history["best_withheld"] == ["reward_outcome_divergence"]
    assert gate(gamed) == EXIT_GATE_UNDECIDED
    later = evaluate_checkpoint(store, "careful", 300, run="gamed-gate")
    assert later.history["compared_with"]["step"] == 100


def test_returns_equal_up_to_float_rounding_are_no_regression(store):
    # Planted: the same episodes with every return one ulp lower (continuous actions differing
    # in their last bits). Before, the zero-width interval of the differences was "worse": a
    # regression, exit 4.
    evaluate_checkpoint(store, "careful", 1, run="ulp")
    table = _table("careful")
    lower = [float(np.nextafter(r, -np.inf)) for r in table.column("return").to_pylist()]
    same = evaluate_checkpoint(store, "careful", 2, run="ulp", table=_with_column(table, "return", lower))
    c = same.history["comparison"]
    assert same.history["verdict"] == "not_distinguishable"
    assert c["mean_diff"] == 0.0 and c["ci"]["low"] == c["ci"]["high"] == 0.0
    assert gate(same) == EXIT_OK


def test_the_trainers_run_gets_the_alarm_count_and_the_pessimistic_success_rate(store):
    # Planted: the env reports 'success' only on a delivery. The rate over reporting episodes is
    # 1.0; before, that alone reached the trainer's charts, with no alarm there.
    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = MlflowClient(uri)
    trainer = client.create_run(client.create_experiment("training-partial")).info.run_id
    table = _table("careless")
    partial = _with_column(table, "success", [s or None for s in table.column("success").to_pylist()])
    report = evaluate_checkpoint(store, "careless", 1, run=trainer, table=partial)
    assert report.success["rate"] == 1.0
    metrics = client.get_run(trainer).data.metrics
    wins = sum(bool(s) for s in table.column("success").to_pylist())
    assert metrics["eval/success_rate"] == 1.0
    assert metrics["eval/success_rate_unreported_as_failure"] == pytest.approx(wins / EPISODES)
    assert metrics["eval/alarm_count"] == len(report.alarms) >= 1


def test_an_outcome_that_only_does_not_rise_stays_advisory(store):
    # An honest gain in efficiency: every return one higher (the goal reached sooner), the same
    # success rate (two seeds swap). reward_outcome_divergence says so, but the checkpoint is
    # the best and passes: only an outcome that falls, or goes unreported, withholds them.
    evaluate_checkpoint(store, "careless", 1, run="efficient")
    table = _table("careless")
    success = table.column("success").to_pylist()
    won, lost = success.index(True), success.index(False)
    success[won], success[lost] = False, True
    faster = _with_column(_with_column(table, "return", [r + 1.0 for r in table.column(
        "return").to_pylist()]), "success", success)
    better = evaluate_checkpoint(store, "careless", 2, run="efficient", table=faster)
    [div] = [a for a in better.history["alarms"] if a["alarm"] == "reward_outcome_divergence"]
    assert div["falls"] is False and "does not rise" in div["message"]
    assert better.history["verdict"] == "new_best" and better.history["best_step"] == 2
    assert "best_withheld" not in better.history
    assert gate(better) == EXIT_OK


def test_a_checkpoint_evaluated_after_a_later_step_never_lets_a_regression_pass(store, capsys):
    # Planted: step 10 (careless) is evaluated first, then step 5 (careful, much better), e.g. a
    # re-run of a failed evaluation. Before, step 5 was 'first' and tagged best, step 20
    # (careless again) was judged against step 10: not_distinguishable, and the gate passed it.
    uri = f"sqlite:///{store / 'mlflow.db'}"
    assert evaluate_checkpoint(store, "careless", 10, run="late").verdict == "first"
    late = evaluate_checkpoint(store, "careful", 5, run="late")
    h = late.history
    assert (h["verdict"], h["best_step"], h["later_steps"]) == ("first", None, [10])
    assert h["note"] == "no earlier checkpoint of this training run, but later ones were evaluated before it"
    [line] = [a for a in late.alarms if a.startswith("history_out_of_order: ")]
    assert line.startswith("history_out_of_order: step 5 was evaluated after later checkpoints of "
                           "this training run were logged (step 10): it is judged against the "
                           "earlier steps only and is not tagged best")
    assert gate(late) == EXIT_GATE_UNDECIDED
    assert "so it does not pass: history_out_of_order: step 5 was evaluated" in capsys.readouterr().err
    found = {c.step: c for c in checkpoints(uri, "late")}
    assert (found[5].verdict, found[5].best, found[5].alarms) == ("first", False, ("history_out_of_order",))
    # Step 10 was judged best without step 5: the best is undecided, and the gate fails closed.
    after = evaluate_checkpoint(store, "careless", 20, run="late")
    h = after.history
    assert (h["verdict"], h["compared_with"], h["best_step"]) == ("no_paired_episodes", None, None)
    assert h["unsettled_best"] == {"late_steps": [5], "stale_steps": [10]}
    assert h["previous_step"] == 10
    [line] = [a for a in after.alarms if a.startswith("history_")]
    assert line.startswith("history_out_of_order: checkpoints of this training run were evaluated "
                           "out of step order: step 5 after step 10. The lower step was judged best")
    assert "Evaluate step 10 again" in line
    assert gate(after) == EXIT_GATE_UNDECIDED
    assert "verdict 'no_paired_episodes'" not in capsys.readouterr().err  # the alarm says why
    # Step 10 evaluated again (the same weights) is judged with step 5: a regression. Step 20
    # had seen these weights at step 10 already, so this one is not late.
    again = evaluate_checkpoint(store, "careless", 10, run="late", request_id="late-careless-10-b")
    h = again.history
    assert (h["verdict"], h["compared_with"]["step"], h["best_step"]) == ("regression", 5, 5)
    assert "later_steps" not in h and not [a for a in again.alarms if a.startswith("history_")]
    assert gate(again) == EXIT_REGRESSION
    # Now the run's best is step 5, and the next step is judged against it.
    last = evaluate_checkpoint(store, "careless", 30, run="late")
    h = last.history
    assert (h["verdict"], h["compared_with"]["step"], h["best_step"]) == ("regression", 5, 5)
    assert h["comparison"]["ci"]["high"] < 0
    assert gate(last) == EXIT_REGRESSION
    assert "regression against the best checkpoint (step 5)" in capsys.readouterr().err
    # Stores written before: both tagged best, the lower step logged after the higher one.
    from evalfleet.history import Checkpoint, unsettled_best

    hi = Checkpoint("r10", 10, "a", "aa" * 32, None, "p", {}, "first", True, False, start_time=1)
    lo = Checkpoint("r5", 5, "b", "bb" * 32, None, "p", {}, "first", True, False, start_time=2)
    assert unsettled_best([lo, hi], [lo, hi])["late_steps"] == [5]
    retried = Checkpoint("r5-before", 5, "c", "bb" * 32, None, "p", {}, "first", True, False)
    assert unsettled_best([lo, hi], [retried, lo, hi]) is None  # step 10 saw these weights


def test_a_step_evaluated_with_two_policies_gives_no_verdict_whichever_finished_last(store, capsys):
    from evalfleet.client import history_result

    # Planted: step 5 evaluated with the careful weights and, by another request, the careless
    # ones. Before, the history kept whichever evaluation was logged last: step 6 (careless) was
    # a regression (exit 4) in one order and not_distinguishable (exit 0) in the other, no alarm.
    uri = f"sqlite:///{store / 'mlflow.db'}"
    for run, order in (("twice-a", ("careful", "careless")), ("twice-b", ("careless", "careful"))):
        evaluate_checkpoint(store, "careless", 1, run=run)
        first = evaluate_checkpoint(store, order[0], 5, run=run)
        assert not [a for a in first.alarms if a.startswith("history_")]
        second = evaluate_checkpoint(store, order[1], 5, run=run)
        h = second.history
        assert (h["verdict"], h["best_step"], h["compared_with"]) == ("no_paired_episodes", None, None)
        assert h["ambiguous_steps"] == [5]
        shas = sorted([first.policy_sha256, second.policy_sha256])
        [line] = [a for a in second.alarms if a.startswith("history_")]
        assert line.startswith("history_step_ambiguous: step 5 of this training run was evaluated "
                               f"with different weights (step 5: {shas[0][:12]} (")
        assert "this evaluation" in line and "Delete the MLflow runs of the wrong weights" in line
        assert gate(second) == EXIT_GATE_UNDECIDED
        # The next step: the same verdict and exit code whichever of the two finished last.
        after = evaluate_checkpoint(store, "careless", 6, run=run)
        h = after.history
        assert (h["verdict"], h["best_step"], h["ambiguous_steps"]) == ("no_paired_episodes", None, [5])
        assert any(a.startswith("history_step_ambiguous: step 5 of this training run was evaluated")
                   for a in after.alarms)
        assert gate(after) == EXIT_GATE_UNDECIDED
        assert "step 5 of this training run was evaluated with different weights" in (
            capsys.readouterr().err)
        found = {c.step: c for c in checkpoints(uri, run)}
        assert (found[6].verdict, found[6].best) == ("no_paired_episodes", False)
        assert "history_step_ambiguous" in found[6].alarms  # the MLflow run's alarm tag
        assert "history_step_ambiguous" in history_result(after)["eval/alarms"]  # the Evaluator's
        assert "history_step_ambiguous: step 5" in summary_text(after)
    # Deleting the run of the wrong weights (careless, in twice-b) and evaluating step 5 again
    # settles it: step 7 is judged against step 5.
    client = MlflowClient(uri)
    [wrong] = client.search_runs(
        [client.get_experiment_by_name("evalfleet").experiment_id],
        "tags.`evalfleet.training_run_id` = 'twice-b' and tags.`evalfleet.step` = '5' and "
        f"tags.`evalfleet.policy_sha256` = '{first.policy_sha256}'")
    client.delete_run(wrong.info.run_id)
    fixed = evaluate_checkpoint(store, "careful", 5, run="twice-b", request_id="twice-b-careful-5-b")
    assert fixed.verdict == "new_best" and not [a for a in fixed.alarms if a.startswith("history_")]
    settled = evaluate_checkpoint(store, "careless", 7, run="twice-b")
    assert (settled.verdict, settled.history["compared_with"]["step"]) == ("regression", 5)
    assert gate(settled) == EXIT_REGRESSION
    # The same weights evaluated twice at a step (a retry) are no ambiguity.
    evaluate_checkpoint(store, "careless", 1, run="retry")
    evaluate_checkpoint(store, "careful", 5, run="retry")
    again = evaluate_checkpoint(store, "careful", 5, run="retry", request_id="retry-careful-5-b")
    assert again.verdict == "new_best" and not [a for a in again.alarms if a.startswith("history_")]
    assert evaluate_checkpoint(store, "careless", 6, run="retry").verdict == "regression"


def test_a_failed_callback_reaches_the_mlflow_run_and_the_trainers_alarm_count(store, monkeypatch):
    # Planted: the trainer's callback answers 503. Before, report.json had the output_missing
    # alarm, while the eval run had no such tag and eval/alarm_count in both runs was one less.
    from types import SimpleNamespace

    from evalfleet.pipeline import feed_back
    from tests.callback_receiver import callback_receiver

    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = MlflowClient(uri)
    trainer = client.create_run(client.create_experiment("training-callback")).info.run_id

    def busy(body: dict) -> None:  # answered 503; at step 2 the store loses the eval run first
        if body["step"] == 2:
            client.delete_run(body["outputs"]["mlflow_run_id"])

    def stage_7(step: int, url: str) -> EvalReport:
        table = _table("careless")
        request = EvalRequest(env=courier.ENV_ID, policy="tests.core.courier:careless",
                              episodes=table.num_rows, output=store, cache_dir=store / "cache",
                              training_run_id=trainer, step=step, mlflow_uri=uri,
                              request_id=f"callback-{step}", callback_url=url)
        report = aggregate(request, table, env_spec={"env_id": courier.ENV_ID}, env_spec_hash="spec",
                           policy={"sha256": "cb" * 32}, isolation="inprocess", timings={"run": 1.0},
                           cache={"status": "hit", "key": "cb" * 32}, run_seconds=1.0)
        collected = SimpleNamespace(table=table, fresh=table.slice(0, 0), replays=None,  # no review
                                    resumed=0)
        return feed_back(request, None, report, collected)  # type: ignore[arg-type]

    with callback_receiver(monkeypatch, 503, "history-callback-secret", busy) as (url, _):
        final = stage_7(1, url)
        latest = client.get_run(trainer).data.metrics["eval/alarm_count"]  # MLflow's latest value
        lost = stage_7(2, url)
    assert final.outputs["callback"].startswith("failed after 1 attempt")
    [line] = [a for a in final.alarms if a.startswith("output_missing: ")]
    assert line.startswith("output_missing: the callback to the trainer: failed after 1 attempt")
    count = len(final.alarms)
    assert json.loads(Path(final.outputs["report"]).read_text())["alarms"] == final.alarms
    run = client.get_run(final.outputs["mlflow_run_id"])
    assert run.data.tags["evalfleet.alarm.output_missing"] == "true"
    assert run.data.metrics["eval/alarm_count"] == count
    assert latest == count
    points = client.get_metric_history(trainer, "eval/alarm_count")
    assert max((p for p in points if p.step == 1), key=lambda p: p.timestamp).value == count
    assert "mlflow_alarms_error" not in final.outputs
    # Logging the late alarm failed (the run is gone): the evaluation ends, and says so.
    assert lost.outputs["callback"].startswith("failed after 1 attempt")
    assert lost.outputs["mlflow_alarms_error"].startswith("MlflowException: ")
    assert json.loads(Path(lost.outputs["report"]).read_text())["outputs"]["mlflow_alarms_error"] == (
        lost.outputs["mlflow_alarms_error"])
