"""Adaptive rounds, the determinism audit and the paired baseline through the real flow."""

import numpy as np
import pytest
import torch

from evalfleet.models import EvalRequest
from flows.eval import evaluate

pytestmark = pytest.mark.slow


def _linear(path, w):
    net = torch.nn.Linear(4, 2)
    with torch.no_grad():
        net.weight.zero_()
        net.bias.zero_()
        net.weight[1] = torch.tensor(w)
    torch.jit.save(torch.jit.script(net), str(path))
    return str(path)


def test_high_variance_policy_gets_more_episodes(prefect_server, tmp_path, example_policy):
    steady = _linear(tmp_path / "steady.pt", [0.0, 0.0, 1.0, 0.5])  # always 500: std 0
    reports = {}
    for name, policy in (("steady", steady), ("varied", example_policy)):
        reports[name] = evaluate(EvalRequest.build(
            policy=policy, episodes=30, concurrency=15, target_ci_halfwidth=25.0, max_episodes=240,
            output=tmp_path / "out"))
    low, high = reports["steady"], reports["varied"]
    # Returns with no spread never stop early (issue 13: 30 equal returns do not show the spread
    # to come); rounds double up to the cap, and the report's interval is the Bonferroni one.
    assert low.adaptive["stop_reason"] == "max episodes reached"
    assert [r["episodes"] for r in low.adaptive["rounds"]] == [30, 60, 120, 240]
    assert "Bonferroni over 4 looks" in low.returns["ci"]["method"]
    assert low.returns["ci"]["low"] < 500.0 < low.returns["ci"]["high"]
    assert "Bonferroni" in high.returns["ci"]["method"]
    assert high.episodes > 30 and len(high.adaptive["rounds"]) >= 2
    assert high.adaptive["achieved_halfwidth"] <= 25.0 or high.episodes == 240
    assert [r["episodes"] for r in high.adaptive["rounds"]] == sorted(
        r["episodes"] for r in high.adaptive["rounds"])


def test_nondeterministic_env_is_flagged_and_not_cached(prefect_server, tmp_path):
    # inprocess: one global RNG per worker (forked sandboxes would each start from the same state)
    report = evaluate(EvalRequest.build(
        env="tests.flows.user_envs:Flaky-v0", policy="tests.flows.user_envs:toward_goal",
        episodes=100, concurrency=20, isolation="inprocess", output=tmp_path / "out"))
    assert report.audit["checked"] == 2
    assert any(a.startswith("non_deterministic_env") for a in report.alarms), report.alarms
    again = evaluate(EvalRequest.build(
        env="tests.flows.user_envs:Flaky-v0", policy="tests.flows.user_envs:toward_goal",
        episodes=100, concurrency=20, isolation="inprocess", output=tmp_path / "out"))
    assert again.cache["status"] == "miss"  # a non-reproducible table was never stored

    steady = evaluate(EvalRequest.build(
        env="tests.flows.user_envs:Warehouse-v0", policy="tests.flows.user_envs:toward_goal",
        episodes=100, concurrency=20, output=tmp_path / "out"))
    assert steady.audit == {"checked": 2, "mismatches": []}
    assert not any(a.startswith("non_deterministic_env") for a in steady.alarms)


def _returns(report):
    import pyarrow.parquet as pq

    rows = pq.read_table(report.outputs["episodes"]).sort_by("episode_index").to_pylist()
    return np.array([r["return"] for r in rows]), [r["seed"] for r in rows]


def test_paired_baseline_from_a_file_and_from_the_cache(prefect_server, tmp_path, example_policy):
    # Planted pair: the bundled policy balances CartPole (hundreds of steps); all-zero logits
    # always push left, so the pole falls within about 10 steps on every seed.
    worse = _linear(tmp_path / "worse.pt", [0.0, 0.0, 0.0, 0.0])
    common = dict(episodes=60, concurrency=20, seed=2, output=tmp_path / "out")
    base_report = evaluate(EvalRequest.build(policy=worse, **common))
    report = evaluate(EvalRequest.build(policy=example_policy, baseline=worse, **common))
    c = report.comparison
    assert c["n"] == 60 and c["baseline_policy_sha256"] == base_report.policy_sha256
    new, new_seeds = _returns(report)
    base, base_seeds = _returns(base_report)
    assert new_seeds == base_seeds  # common random numbers: the same seed for each index
    assert base.max() < 20 and new.min() > base.max()
    assert c["mean_diff"] == pytest.approx(float(np.mean(new - base)), rel=1e-12)
    assert c["mean_diff"] > 300  # the bundled policy averages about 380 on these seeds
    assert c["verdict"] == "better" and c["p_improvement"] == 1.0
    assert 0 < c["ci"]["low"] <= c["mean_diff"] <= c["ci"]["high"]
    swapped = evaluate(EvalRequest.build(policy=worse, baseline=example_policy, **common)).comparison
    assert swapped["verdict"] == "worse" and swapped["p_improvement"] == 0.0
    assert swapped["mean_diff"] == pytest.approx(-c["mean_diff"], rel=1e-12)
    by_hash = evaluate(EvalRequest.build(
        policy=example_policy, baseline=f"sha256:{base_report.policy_sha256[:16]}", **common))
    assert by_hash.comparison["mean_diff"] == c["mean_diff"]
    assert by_hash.comparison["ci"] == c["ci"]


def test_a_hash_baseline_missing_episodes_fails_before_anything_runs(prefect_server, tmp_path,
                                                                     example_policy):
    """The cache holds 10 of the 20 episodes to pair on: a clear error, and the evaluated policy
    never ran (no run folder, no cache entry of its own), not an error after its evaluation."""
    from evalfleet.errors import RequestError
    from evalfleet.pipeline import episode_cache

    worse = _linear(tmp_path / "worse.pt", [0.0, 0.0, 0.0, 0.0])
    common = dict(concurrency=10, seed=2, output=tmp_path / "out")
    base_report = evaluate(EvalRequest.build(policy=worse, episodes=10, **common))
    request = EvalRequest.build(policy=example_policy, episodes=20,
                                baseline=f"sha256:{base_report.policy_sha256[:16]}", **common)
    with pytest.raises(RequestError, match="the cache holds 10 of the 20 episodes to pair on"):
        evaluate(request)
    # An adaptive run pairs on every episode it runs, up to --max-episodes: its first round was
    # checked alone, and 40 episodes ran before the exit 2, with no report.
    adaptive = request.model_copy(update={"episodes": 10, "target_ci_halfwidth": 0.01,
                                          "max_episodes": 40})
    with pytest.raises(RequestError, match="the cache holds 10 of the 40 episodes to pair on"):
        evaluate(adaptive)
    assert [p.name for p in (tmp_path / "out" / "runs").iterdir()] == [base_report.request_id]
    stored = {e.get("policy_sha256") for e in episode_cache(request).entries()}
    assert stored == {base_report.policy_sha256}


def test_trajectories_videos_and_failure_clusters(prefect_server, tmp_path):
    import pyarrow.parquet as pq

    report = evaluate(EvalRequest.build(
        env="evalfleet/ConnectFour-v0", policy="envs.reference_policies:connect_four_heuristic",
        episodes=40, concurrency=20, record_trajectories=5, record_video=2, output=tmp_path / "out"))
    assert report.success is not None and 0.0 <= report.success["rate"] <= 1.0
    traj = pq.read_table(report.outputs["trajectories"])
    assert len(set(traj.column("episode_index").to_pylist())) == 5
    episodes = pq.read_table(report.outputs["episodes"]).to_pylist()
    by_index = {r["episode_index"]: r for r in episodes}
    for idx in set(traj.column("episode_index").to_pylist()):
        steps = [r for r in traj.to_pylist() if r["episode_index"] == idx]
        assert sum(s["reward"] for s in steps) == by_index[idx]["return"]
        assert len(steps) == by_index[idx]["length"]
    videos = list((tmp_path / "out" / "runs" / report.request_id / "videos").iterdir())
    assert len(videos) == 2 and all(v.stat().st_size > 1000 for v in videos)


def test_clipped_reward_alarm_reaches_report_mlflow_and_summary(prefect_server, tmp_path):
    import json

    from mlflow.tracking import MlflowClient

    from evalfleet.summary import summary_text

    report = evaluate(EvalRequest.build(
        env="tests.flows.user_envs:ClippedWarehouse-v0", policy="tests.flows.user_envs:toward_goal",
        episodes=120, concurrency=20, output=tmp_path / "out"))
    clipped = [a for a in report.alarms if a.startswith("reward_clipped")]
    assert len(clipped) == 1 and "[-1.0, 1.0]" in clipped[0], report.alarms
    w = report.step_rewards
    assert w["min"] == -1.0 and w["max"] == 1.0 and 0.25 < w["at_min_fraction"] + w["at_max_fraction"] < 0.4
    on_disk = json.loads(open(report.outputs["report"]).read())
    assert on_disk["step_rewards"] == w and clipped[0] in on_disk["alarms"]
    run = MlflowClient(report.outputs["mlflow_uri"]).get_run(report.outputs["mlflow_run_id"])
    assert run.data.tags["evalfleet.alarm.reward_clipped"] == "true"
    assert run.data.metrics["eval/step_reward_at_max_fraction"] == w["at_max_fraction"]
    assert "reward_clipped" in summary_text(report) and "step rewards" in summary_text(report)


def test_failure_clusters_name_the_planted_bug(prefect_server, tmp_path):
    """RaiseOnStep fails at step 5 of the seeds that are 3 mod 10: one cluster, those episodes."""
    import inspect

    from evalfleet.seeds import SeedLedger
    from tests.sandbox import faulty_envs

    seeds = [SeedLedger(4).seed(i) for i in range(80)]
    planted = [i for i, s in enumerate(seeds) if faulty_envs.is_faulty(s)]
    assert 3 <= len(planted) < 80
    lines, first = inspect.getsourcelines(faulty_envs.RaiseOnStep.fault)
    line = first + next(n for n, text in enumerate(lines) if "raise RuntimeError" in text)
    report = evaluate(EvalRequest.build(
        env=faulty_envs.env_id("RaiseOnStep"), policy="tests.sandbox.faulty_envs:balance",
        episodes=80, concurrency=20, seed=4, isolation="inprocess", output=tmp_path / "out"))
    assert report.failures == {"env_error": len(planted)}
    [cluster] = report.failure_clusters
    assert cluster["reason"] == "env_error"
    assert cluster["signature"] == f"RuntimeError at faulty_envs.py:{line}"
    assert cluster["count"] == len(planted)
    assert cluster["example_indices"] == planted[:5]
    assert cluster["example_seeds"] == [seeds[i] for i in planted[:5]]
    error = f"RuntimeError: deliberate failure at step 5 (at faulty_envs.py:{line})"
    assert cluster["example_error"] == error
