"""Stage 7's replays run on a worker of ``evaluate()``'s own cluster, before its workers stop.

The driver of a default run then never imports torch: stage 1 checks the policy in a child of
the workers' fork server, the run stage and the replays run on the workers. What the replays
produce (the action plot, trajectories, the replay-vs-row comparison) is in the report as
before. Each case runs in a fresh interpreter, as ``python flows/eval.py`` does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent("""
    import json, sys
    from evalfleet.models import EvalRequest
    from flows.eval import evaluate

    report = evaluate(EvalRequest.build(**json.loads(sys.argv[1])))
    print(json.dumps({"torch_in_driver": "torch" in sys.modules,
                      "report": report.model_dump(mode="json")}))
""")


def _run(fields: dict[str, object]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(fields)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def _evaluate(tmp_path: Path, **fields: object) -> dict[str, Any]:
    fields.update(output=str(tmp_path / "out"), cache="off", workers=2)
    return _run(fields)


def test_a_default_run_replays_on_a_worker_and_its_driver_imports_no_torch(
        prefect_server, tmp_path, example_policy):
    answer = _evaluate(tmp_path, policy=example_policy, episodes=8, record_trajectories=3)
    assert answer["torch_in_driver"] is False
    report = answer["report"]
    assert isinstance(report, dict)
    outputs = report["outputs"]
    # What only replays produce: the action distribution and the trajectories asked for.
    assert Path(outputs["folder"], "plots", "actions.png").stat().st_size > 0
    steps = pq.read_table(outputs["trajectories"])
    assert len(set(steps.column("episode_index").to_pylist())) == 3
    # Each trajectory has as many steps as its episode's row: the replay matched the run.
    episodes = pq.read_table(outputs["episodes"]).to_pylist()
    lengths = {r["episode_index"]: r["length"] for r in episodes}
    for index in set(steps.column("episode_index").to_pylist()):
        assert steps.column("episode_index").to_pylist().count(index) == lengths[index]
    assert not report["alarms"], report["alarms"]
    assert "review_error" not in outputs


def test_a_cache_hit_with_recordings_asked_replays_them_without_a_cluster(prefect_server,
                                                                         tmp_path, example_policy):
    fields = dict(policy=example_policy, episodes=8, output=str(tmp_path / "out"), workers=2,
                  cache_dir=str(tmp_path / "cache"))
    first = _run(fields)
    assert first["report"]["cache"]["status"] == "miss"
    again = _run(dict(fields, record_trajectories=2))  # answered by the cache: no cluster
    report = again["report"]
    assert report["cache"]["status"] == "hit"
    steps = pq.read_table(report["outputs"]["trajectories"])
    assert len(set(steps.column("episode_index").to_pylist())) == 2
    assert not report["alarms"], report["alarms"]
