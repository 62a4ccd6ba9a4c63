"""The seven-stage flow end to end: real Prefect server, real Dask cluster, real MLflow, Parquet."""

import json
import os
import subprocess
import sys

import httpx
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from evalfleet.models import EvalRequest
from evalfleet.pipeline import outcome_table
from evalfleet.records import EPISODE_SCHEMA
from evalfleet.storage import read_episodes
from flows.eval import evaluate
from tests.dask_processes import external_cluster

pytestmark = pytest.mark.slow


def _request(tmp_path, **fields):
    base = dict(episodes=40, concurrency=16, workers=2, output=tmp_path / "results",
                policy=os.path.join(os.path.dirname(__file__), "..", "..", "evalfleet", "data",
                                    "cartpole_mlp.pt"))
    base.update(fields)
    return EvalRequest.build(**base)


def test_flow_end_to_end(prefect_server, tmp_path):
    request = _request(tmp_path, training_run_id="trainer-42", step=7)
    report = evaluate(request)

    assert report.episodes == 40 and report.completed == 40 and report.failures == {}
    table = read_episodes(report.outputs["episodes"])
    assert table.schema.equals(EPISODE_SCHEMA, check_metadata=False)
    assert table.column("episode_index").to_pylist() == list(range(40))
    # every row names the training checkpoint it was evaluated for
    assert set(table.column("training_run_id").to_pylist()) == {"trainer-42"}
    assert set(table.column("step").to_pylist()) == {7}
    returns = table.column("return").to_pylist()
    assert report.returns["mean"] == pytest.approx(sum(returns) / 40, rel=1e-12)
    low, high = report.ci
    assert low <= report.mean <= high
    assert set(table.column("worker").to_pylist()) == {"0", "1"}  # both workers ran shards
    assert set(report.timings) >= {"receive_weights", "spawn_sandboxes", "run_episodes",
                                   "collect_rewards", "aggregate", "feed_back"}
    saved = json.loads(open(report.outputs["report"]).read())
    assert saved["policy_sha256"] == report.policy_sha256
    assert saved["manifest"]["versions"]["gymnasium"]

    client = MlflowClient(tracking_uri=report.outputs["mlflow_uri"])
    run = client.get_run(report.outputs["mlflow_run_id"])
    assert run.data.metrics["eval/reward"] == pytest.approx(report.mean)
    assert run.data.metrics["eval/episodes"] == 40
    assert run.data.tags["evalfleet.policy_sha256"] == report.policy_sha256
    assert run.data.tags["evalfleet.training_run_id"] == "trainer-42"
    assert run.data.tags["evalfleet.step"] == "7"
    assert run.data.params["seed"] == "0"
    # Where inference ran, as the report says, beside what was asked ('auto' read as a device before)
    assert run.data.params["device"] == report.manifest["execution"]["device"] != "auto"
    assert run.data.params["device_requested"] == "auto"
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"episodes.parquet", "report.json", "report.html", "returns_hist.png",
            "lengths_hist.png", "return_by_episode.png", "actions.png"} <= names
    html = open(report.outputs["report_html"]).read()
    assert "data:image/png;base64," in html and f"{report.mean:.4g}" in html

    # the Prefect run: named after the env and request, completed, with the summary artifact
    api = prefect_server
    runs = httpx.post(f"{api}/flow_runs/filter", json={
        "flow_runs": {"name": {"any_": [f"CartPole-v1-{request.request_id}"]}}}).json()
    assert len(runs) == 1 and runs[0]["state_type"] == "COMPLETED"
    arts = httpx.post(f"{api}/artifacts/filter", json={
        "artifacts": {"key": {"any_": [f"eval-{report.policy_sha256[:12]}"]}}}).json()
    assert arts and arts[0]["type"] == "table"
    assert any(row["metric"] == "episodes" for row in json.loads(arts[0]["data"])
               if isinstance(row, dict))
    progress = httpx.post(f"{api}/artifacts/filter", json={
        "artifacts": {"key": {"any_": [f"progress-{request.request_id}"]}}}).json()
    assert progress and progress[0]["type"] == "progress" and progress[0]["data"] == 100.0


def test_same_table_whatever_the_worker_count_and_on_rerun(prefect_server, tmp_path):
    tables = []
    for workers, concurrency in ((1, 40), (2, 16), (2, 16)):
        report = evaluate(_request(tmp_path, workers=workers, concurrency=concurrency, seed=11))
        tables.append(outcome_table(read_episodes(report.outputs["episodes"])))
    assert tables[0].equals(tables[1]), "1 worker vs 2 workers differ"
    assert tables[1].equals(tables[2]), "same request twice differs"


def test_users_own_env_module_syntax(prefect_server, tmp_path):
    report = evaluate(_request(tmp_path, env="tests.flows.user_envs:Warehouse-v0",
                               policy="tests.flows.user_envs:toward_goal", episodes=30))
    assert report.completed == 30
    assert report.success is not None and report.success["rate"] == 1.0
    assert report.manifest["policy"]["format"] == "callable"


def test_existing_scheduler_via_dask_address(prefect_server, tmp_path):
    with external_cluster(2, name="ext") as address:
        report = evaluate(_request(tmp_path, dask_address=address, episodes=24, seed=11))
        table = read_episodes(report.outputs["episodes"])
        assert table.num_rows == 24
        assert all(w.startswith("ext") for w in table.column("worker").to_pylist())
        local = evaluate(_request(tmp_path, episodes=24, seed=11))
        assert outcome_table(table).equals(outcome_table(read_episodes(local.outputs["episodes"])))


def test_cli_help_documents_every_option():
    out = subprocess.run([sys.executable, "flows/eval.py", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for option in ("--env", "--env-kwargs", "--policy", "--episodes", "--concurrency", "--seed",
                   "--max-steps", "--workers", "--dask-address", "--output", "--report",
                   "--mlflow-uri", "--training-run-id", "--step", "--device", "--isolation"):
        assert option in out, option


def test_cli_run_and_bad_input(prefect_server, tmp_path):
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "flows/eval.py", "--episodes", "12", "--concurrency", "6", "--output",
         str(tmp_path / "out"), "--report", str(report_path), "--quiet"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mean return ± 95% CI" in done.stdout and "parquet" in done.stdout
    data = json.loads(report_path.read_text())
    assert data["episodes"] == 12
    assert pq.read_table(data["outputs"]["episodes"]).num_rows == 12

    bad = subprocess.run([sys.executable, "flows/eval.py", "--episodes", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "'episodes' must be a positive integer (got 0)" in bad.stderr


def test_cli_without_a_server_starts_one_api_for_every_process(tmp_path, monkeypatch):
    """`python flows/eval.py` with no PREFECT_API_URL: the shared local server, workers report to it."""
    import sqlite3

    from evalfleet.server import read_state, stop_server

    home = tmp_path / "prefect-home"
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "efhome"))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    try:
        done = subprocess.run(
            [sys.executable, "flows/eval.py", "--episodes", "10", "--concurrency", "6", "--output",
             str(tmp_path / "out"), "--quiet", "--no-cache"],
            capture_output=True, text=True, timeout=300, env=env,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "mean return ± 95% CI" in done.stdout
        server = read_state()
        assert server is not None  # it stays up for the next evaluation
    finally:
        stop_server()
    assert not list(home.glob("*.db"))  # no ephemeral server in the evaluation's processes
    dbs = list((tmp_path / "efhome" / "prefect").glob("*.db"))
    assert len(dbs) == 1, dbs  # one database: the shared server's
    with sqlite3.connect(dbs[0]) as db:
        flows = db.execute("SELECT state_type FROM flow_run").fetchall()
        tasks = dict(db.execute("SELECT name, state_type FROM task_run").fetchall())
    assert flows == [("COMPLETED",)]
    # The run stage's task runs executed on the Dask workers and reported to the same server.
    runs = [name for name in tasks if name.startswith("run-episodes")]
    assert runs and all(tasks[name] == "COMPLETED" for name in runs), tasks
    assert {n.rsplit("-", 1)[0] for n in tasks} >= {
        "receive-weights", "spawn-sandboxes", "distribute-policy", "run-episodes",
        "collect-rewards", "aggregate", "feed-back"}


#: Calls of ``counted_linear`` in this process: each is one stage-1 load of the policy here.
BUILT: list[int] = []


def counted_linear():
    """A CartPole state_dict's factory that counts how often this process builds it."""
    import torch

    BUILT.append(1)
    return torch.nn.Linear(4, 2)


def test_stage_one_runs_once_and_the_flow_alone_still_runs_it(prefect_server, tmp_path):
    import torch
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.eval import eval_flow

    torch.manual_seed(0)
    path = tmp_path / "linear.pt"
    torch.save(torch.nn.Linear(4, 2).state_dict(), path)
    request = _request(tmp_path, policy=str(path), episodes=8, workers=1, concurrency=8,
                       policy_factory=f"{__name__}:counted_linear")
    miss = evaluate(request)  # workers build it in their own processes
    BUILT.clear()
    hit = evaluate(request.model_copy(update={"request_id": "hit"}))  # nothing runs but stage 1
    assert hit.cache["status"] == "hit" and hit.mean == miss.mean
    assert len(BUILT) == 1, f"stage 1 loaded the policy {len(BUILT)} times for one evaluation"
    BUILT.clear()
    alone = eval_flow.with_options(task_runner=ThreadPoolTaskRunner())(
        request.model_copy(update={"request_id": "alone"}), None)  # as a deployment would
    assert alone.cache["status"] == "hit" and alone.mean == miss.mean
    assert len(BUILT) == 1


def test_a_retry_under_the_same_request_id_leaves_none_of_the_first_attempts_review_files(
        prefect_server, tmp_path):
    # A retried flow run (same parameters: same request id) that records no trajectories and
    # runs no adaptive rounds left the first attempt's trajectories, round plot and videos in
    # the folder, read as its own.
    request = _request(tmp_path, episodes=8, concurrency=8, workers=1, request_id="retried00001",
                       audit=False, cache="off")
    folder = tmp_path / "results" / "runs" / "retried00001"
    (folder / "plots").mkdir(parents=True)
    (folder / "plots" / "ci_halfwidth_by_round.png").write_bytes(b"first attempt")
    (folder / "videos").mkdir()
    (folder / "videos" / "episode_3.mp4").write_bytes(b"first attempt")
    (folder / "trajectories.parquet").write_bytes(b"first attempt")
    report = evaluate(request)
    assert report.outputs["folder"] == str(folder.resolve())
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert "trajectories.parquet" not in left and not (folder / "videos").exists()
    assert "plots/ci_halfwidth_by_round.png" not in left
    assert {"episodes.parquet", "report.json", "report.html"} <= set(left)
