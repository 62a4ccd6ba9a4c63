"""Episode records and the one declared Parquet/Arrow schema of the episode table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

import pyarrow as pa

#: Version of ``EPISODE_SCHEMA``; part of the cache key, so entries of another schema never hit.
SCHEMA_VERSION = "4"

#: Largest ``Discrete`` action space whose per-episode action counts are recorded.
MAX_COUNTED_ACTIONS = 64

#: One row per episode, failures included. Declared once; every writer and reader uses it.
EPISODE_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("policy_sha256", pa.string(), nullable=False),
        pa.field("env_id", pa.string(), nullable=False),
        pa.field("env_spec_hash", pa.string(), nullable=False),
        pa.field("episode_index", pa.int64(), nullable=False),
        pa.field("seed", pa.uint64(), nullable=False),
        pa.field("return", pa.float64(), nullable=False),
        pa.field("length", pa.int64(), nullable=False),
        pa.field("end_reason", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("success", pa.bool_()),
        pa.field("wall_seconds", pa.float64(), nullable=False),
        pa.field("worker", pa.string(), nullable=False),
        pa.field("sandbox", pa.string(), nullable=False),
        pa.field("isolation", pa.string(), nullable=False),
        pa.field("retried", pa.int64(), nullable=False),
        pa.field("metrics", pa.map_(pa.string(), pa.float64())),
        pa.field("nonfinal_reward_min", pa.float64()),
        pa.field("nonfinal_reward_max", pa.float64()),
        pa.field("nonfinal_steps_at_min", pa.int64(), nullable=False),
        pa.field("nonfinal_steps_at_max", pa.int64(), nullable=False),
        pa.field("training_run_id", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("action_counts", pa.list_(pa.int64())),
        pa.field("retry_reason", pa.string()),
    ],
    metadata={"evalfleet.schema_version": SCHEMA_VERSION},
)

#: Columns that depend only on (policy, env, protocol, index): equal across reruns and cluster shapes.
OUTCOME_COLUMNS = ("episode_index", "seed", "return", "length", "end_reason", "error", "success",
                   "nonfinal_reward_min", "nonfinal_reward_max", "nonfinal_steps_at_min",
                   "nonfinal_steps_at_max")


@dataclass(slots=True)
class EpisodeRecord:
    """One finished episode (or failed attempt at one).

    ``return`` is a Python keyword, hence ``episode_return`` here and ``return`` in the table.
    ``nonfinal_reward_min``/``_max`` are the extremes of the rewards of the episode's steps before
    its last one (None when there are none; a last step's reward is often a terminal bonus of its
    own kind) and ``nonfinal_steps_at_min``/``_max`` how many of those steps returned exactly
    those values: what the clip-boundary audit reads. ``training_run_id`` and ``step`` name the
    training checkpoint an evaluation's table was written for (``stamp_evaluation``); they are
    not outcomes, so cached rows hold None and each evaluation stamps its own.
    ``action_counts`` counts, for a ``Discrete`` action space of at most ``MAX_COUNTED_ACTIONS``
    actions, how often the episode took each action (index 0 = the space's ``start``); None for
    other spaces. It is what the history's action-distribution alarms read.
    ``retried`` counts the fresh-sandbox retries the episode took after harness failures (timeout,
    crashed, oom) and ``retry_reason`` is the end reason of the last failed attempt (None when none failed).
    """

    request_id: str
    policy_sha256: str
    env_id: str
    env_spec_hash: str
    episode_index: int
    seed: int
    episode_return: float
    length: int
    end_reason: str
    error: str | None
    success: bool | None
    wall_seconds: float
    worker: str
    sandbox: str
    isolation: str
    retried: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    nonfinal_reward_min: float | None = None
    nonfinal_reward_max: float | None = None
    nonfinal_steps_at_min: int = 0
    nonfinal_steps_at_max: int = 0
    training_run_id: str | None = None
    step: int | None = None
    action_counts: list[int] | None = None
    retry_reason: str | None = None


#: ``EPISODE_SCHEMA`` column of each ``EpisodeRecord`` field that has one.
_COLUMN_OF = {f.name: "return" if f.name == "episode_return" else f.name
              for f in fields(EpisodeRecord)}


def records_to_table(records: Iterable[EpisodeRecord]) -> pa.Table:
    """Build an Arrow table of ``EPISODE_SCHEMA`` from records, column by column.

    Read field by field, not through ``dataclasses.asdict``: its deep copy of every row's
    action counts took a fifth of a Recommend-v0 shard's CPU (1.1 of 4.8 s for 3,000 episodes).
    """
    records = list(records)
    columns: dict[str, list[object]] = {
        column: [getattr(r, name) for r in records] for name, column in _COLUMN_OF.items()
        if column != "metrics" and column in EPISODE_SCHEMA.names}
    columns["metrics"] = [list(r.metrics.items()) for r in records]
    return pa.table([pa.array(columns.get(f.name, [None] * len(records)), type=f.type)
                     for f in EPISODE_SCHEMA], schema=EPISODE_SCHEMA)


def stamp_evaluation(table: pa.Table, request_id: str, training_run_id: str | None,
                     step: int | None) -> pa.Table:
    """``table`` with every row tagged with the evaluation's request id, training run id and step.

    Rows from the cache carry the request id of the evaluation that ran them; in this
    evaluation's ``episodes.parquet`` they are its own, so rows join to its report by it (a row's
    ``worker``, ``sandbox`` and ``wall_seconds`` still say where and how it ran).
    """
    n = table.num_rows
    table = table.set_column(table.schema.get_field_index("request_id"), "request_id",
                             pa.array([request_id] * n, pa.string()))
    table = table.set_column(table.schema.get_field_index("training_run_id"), "training_run_id",
                             pa.array([training_run_id] * n, pa.string()))
    return table.set_column(table.schema.get_field_index("step"), "step", pa.array([step] * n, pa.int64()))


def empty_episodes() -> pa.Table:
    """An episode table with no rows.

    Not ``EPISODE_SCHEMA.empty_table()``: pyarrow imports pandas for it (~0.2-0.3 s), paid on a
    cold stage 1's path before the workers' fork server starts.
    """
    return pa.Table.from_batches([], schema=EPISODE_SCHEMA)


def concat_sorted(tables: Sequence[pa.Table]) -> pa.Table:
    """Concatenate shard tables and sort by episode index (the table's canonical order)."""
    if not tables:
        return empty_episodes()
    table = pa.concat_tables([t.cast(EPISODE_SCHEMA) for t in tables])
    return table.sort_by("episode_index")
