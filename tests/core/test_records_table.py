"""Episode records become table rows field for field (the return column, metrics, action counts)."""

from __future__ import annotations

from dataclasses import asdict

import pyarrow as pa

from evalfleet.records import EPISODE_SCHEMA, EpisodeRecord, records_to_table


def _record(i: int, **fields: object) -> EpisodeRecord:
    base: dict[str, object] = dict(
        request_id="r", policy_sha256="p" * 64, env_id="E-v0", env_spec_hash="h", episode_index=i,
        seed=1000 + i, episode_return=0.1 * i + 1e-12, length=10 + i, end_reason="terminated",
        error=None, success=None, wall_seconds=0.5, worker="w0", sandbox=f"inproc-{i}",
        isolation="inprocess")
    base.update(fields)
    return EpisodeRecord(**base)  # type: ignore[arg-type]


def test_a_table_holds_every_field_of_every_record_unchanged():
    records = [
        _record(0),
        _record(1, metrics={"clicked": 1.0, "watch_time": 3.25}, action_counts=[4, 0, 7],
                success=True, nonfinal_reward_min=-1.0, nonfinal_reward_max=2.5,
                nonfinal_steps_at_min=3, retried=1, retry_reason="timeout"),
        _record(2, end_reason="policy_error", error="boom", training_run_id="t", step=7),
    ]
    table = records_to_table(records)
    assert table.schema == EPISODE_SCHEMA
    rows = table.to_pylist()
    for record, row in zip(records, rows, strict=True):
        expected = asdict(record)
        expected["return"] = expected.pop("episode_return")
        expected["metrics"] = list(record.metrics.items())
        assert {k: row[k] for k in expected if k in row} == {
            k: v for k, v in expected.items() if k in row}
    assert rows[1]["return"] == 0.1 + 1e-12  # float64, unrounded
    assert rows[1]["metrics"] == [("clicked", 1.0), ("watch_time", 3.25)]
    assert rows[1]["action_counts"] == [4, 0, 7] and rows[0]["action_counts"] is None
    # The same table as one built row by row.
    by_rows = [dict(asdict(r), metrics=list(r.metrics.items())) for r in records]
    for row in by_rows:
        row["return"] = row.pop("episode_return")
    assert table.equals(pa.Table.from_pylist(by_rows, schema=EPISODE_SCHEMA))


def test_no_records_make_an_empty_table_of_the_schema():
    table = records_to_table([])
    assert table.num_rows == 0 and table.schema == EPISODE_SCHEMA
