"""Each suite task's Prefect summary stays in the artifact catalogue, not only the last one's.

Prefect keeps one latest artifact per key. A suite's tasks share their policy, and every task's
table and markdown artifacts were keyed ``eval-<sha12>``: in the catalogue, each task's summary
replaced the one before (the ``clean`` task's 40/40 scored gave way to the ``failing`` task's).
"""

from __future__ import annotations

import json

import pyarrow as pa
from prefect import flow, get_client
from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

import tests.core.courier as courier
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.report import aggregate
from tasks.suite_stages import publish
from tests.core.test_history import _table


def _report(table: pa.Table, task: str | None) -> EvalReport:
    request = EvalRequest(env=courier.ENV_ID, policy="tests.core.courier:careless",
                          episodes=table.num_rows, suite_task=task)
    return aggregate(request, table, env_spec={"env_id": courier.ENV_ID}, env_spec_hash="spec",
                     policy={"sha256": "5e" * 32}, isolation="inprocess", timings={"run": 1.0},
                     cache={"status": "miss", "key": "5e" * 32}, run_seconds=1.0)


def test_each_suite_task_keeps_its_own_summary_in_the_catalogue(prefect_server):
    table = _table("careless")
    i = table.schema.get_field_index("end_reason")
    failing = table.set_column(i, table.schema.field(i), pa.array(
        ["env_error"] * 4 + table.column("end_reason").to_pylist()[4:], table.schema.field(i).type))
    reports = [_report(table, "clean"), _report(failing, "connect-four[opponent_depth=2]")]

    @flow(name="suite-artifact-keys")
    def suite_stage_7() -> None:
        for report in reports:
            publish(report)

    suite_stage_7()
    with get_client(sync_client=True) as client:  # the catalogue: the latest artifact per key
        latest = client.read_latest_artifacts(artifact_filter=ArtifactCollectionFilter(
            key=ArtifactCollectionFilterKey(like_="eval-5e5e5e5e5e5e%")))
    tables = {a.key: a.data if isinstance(a.data, list) else json.loads(a.data)
              for a in latest if a.type == "table"}
    coverage = {k: next(r["value"] for r in rows if r["metric"] == "coverage") for k, rows in tables.items()}
    assert sorted(coverage.values()) == ["100.00% (40/40 episodes scored)",
                                         "90.00% (36/40 episodes scored)"]
    assert len([a for a in latest if a.type == "markdown"]) == 2
    # Keys Prefect takes (lowercase letters, digits, dashes), each naming its task.
    from tasks.feed_back import artifact_key

    keys = [artifact_key(r) for r in reports]
    assert sorted(tables) == sorted(keys)
    assert keys[0] == "eval-5e5e5e5e5e5e-task-clean"
    assert keys[1].startswith("eval-5e5e5e5e5e5e-task-connect-four-opponent-depth-2-")
    assert artifact_key(_report(table, None)) == "eval-5e5e5e5e5e5e"  # a single evaluation's
