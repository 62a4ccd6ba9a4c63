"""A suite's stages 1, 2, 5, 6 and 7: one Prefect task run per stage for all of a suite's tasks.

A Prefect task run costs ~0.1 s on Dask (``stack-facts.md``); a suite of ten tasks paid it ~60
times. Each of these runs does the single evaluation's stage for every task, in task order, with
the same core functions (each task under its own cache key); its run name lists the tasks.
"""

import contextvars
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from evalfleet.audit import RoundSchedule
from evalfleet.models import EvalReport, EvalRequest, PolicyHandle, Shard
from evalfleet.pipeline import Collected, Planned, Received, collect, plan, spawn, summarize
from evalfleet.pipeline import feed_back as write_results
from evalfleet.review import report_markdown
from evalfleet.summary import summary_rows
from evalfleet.worker import execute_shard
from flows.api_ledger import best_effort
from tasks.feed_back import artifact_key
from tasks.receive_weights import receive_weights


@task(name="receive-weights", cache_policy=NO_CACHE)
def receive_all(requests: Sequence[EvalRequest]) -> list[Received]:
    """Stage 1 of every task (checked before the flow when ``evaluate_suite`` started it)."""
    return [receive_weights.fn(request) for request in requests]


@task(name="spawn-sandboxes", cache_policy=NO_CACHE)
def spawn_all(requests: Sequence[EvalRequest], received: Sequence[Received], address: str | None,
              max_shards: int | None) -> list[Planned]:
    """Stage 2 of every task; the sandbox origin of an (env, isolation) is warmed once."""
    warmed: set[tuple[str, str]] = set()
    out: list[Planned] = []
    for request, rec in zip(requests, received, strict=True):
        planned = plan(request, rec, address, request.episodes, None, max_shards)
        origin = (request.env, rec.isolation)
        planned = spawn(request, rec, address, planned) if origin not in warmed else planned
        if planned.shards:  # warming again would queue behind the shards already running
            warmed.add(origin)
        get_run_logger().info(
            "%s: cache %s (%d reused); %d to run in %d shards", request.env, planned.cache_status,
            planned.cached.num_rows, planned.plan.planned_episodes, len(planned.shards))
        out.append(planned)
    return out


@task(name="collect-rewards", cache_policy=NO_CACHE)
def collect_all(tables: Sequence[list[Any]], handles: Sequence[PolicyHandle],
                planned: Sequence[Planned]) -> list[Collected]:
    """Stage 5 of every task: its shards' tables into one table, one row per episode."""
    return [collect(t, h, p) for t, h, p in zip(tables, handles, planned, strict=True)]


@task(name="aggregate", cache_policy=NO_CACHE)
def aggregate_all(requests: Sequence[EvalRequest], received: Sequence[Received],
                  collected: Sequence[Collected]) -> list[EvalReport]:
    """Stage 6 of every task: statistics, failure accounting, audits and alarms."""
    return [summarize(r, rec, RoundSchedule(r), c, None)
            for r, rec, c in zip(requests, received, collected, strict=True)]


@task(name="feed-back", cache_policy=NO_CACHE)
def feed_back_all(requests: Sequence[EvalRequest], received: Sequence[Received],
                  reports: Sequence[EvalReport], collected: Sequence[Collected]) -> list[EvalReport]:
    """Stage 7 of every task: its Parquet, report.json, MLflow run and Prefect artifacts.

    A task's two Prefect artifacts (~40 ms of API calls) go out on a thread while the next task
    writes its files and MLflow run: the API server, not this process, does most of that work.
    """
    out: list[EvalReport] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        sent = []
        for request, rec, report, coll in zip(requests, received, reports, collected, strict=True):
            final = write_results(request, rec, report, coll)
            # The thread runs in this task run's context: the artifacts belong to it, as before.
            sent.append(pool.submit(contextvars.copy_context().run, publish, final))
            out.append(final)
        for done in sent:
            done.result()
    return out


def publish(final: EvalReport) -> None:
    """A task's Prefect artifacts, as a single evaluation's stage 7 makes them."""
    key = artifact_key(final)  # the task's own: one key per task keeps each task's summary
    rows, markdown = summary_rows(final), report_markdown(final, final.failure_clusters)
    with best_effort(f"{final.request_id}'s summary artifact"):
        create_table_artifact(rows, key=key, description=f"evalfleet {final.env_id}")
    with best_effort(f"{final.request_id}'s report artifact"):
        create_markdown_artifact(markdown, key=f"{key}-report")


def tables_of(collected: Sequence[Collected]) -> list[pa.Table]:
    """Each task's episode table."""
    return [c.table for c in collected]


@task(name="run-episodes", cache_policy=NO_CACHE, retries=0)
def run_group(entries: Sequence[tuple[int, Shard]], handle: PolicyHandle,
              requests: Sequence[EvalRequest], isolation: Sequence[str]) -> list[pa.Table]:
    """Stage 4 for a share of the suite's shards (of several tasks), one after the other.

    One task run per worker slot, not per shard: each costs ~0.1-0.5 s to submit from the flow,
    which a suite of many small tasks paid once per shard, one after the other.
    """
    return [execute_shard(shard, handle, requests[i], isolation[i]) for i, shard in entries]


def share_out(planned: Sequence[Planned], groups: int) -> list[list[tuple[int, Shard]]]:
    """Every task's shards as ``(task index, shard)``, in ``groups`` shares of balanced episodes."""
    entries = [(i, s) for i, p in enumerate(planned) for s in p.shards]
    shares: list[list[tuple[int, Shard]]] = [[] for _ in range(max(1, min(groups, len(entries))))]
    load = [0] * len(shares)
    for entry in sorted(entries, key=lambda e: -len(e[1].episode_indices)):
        k = load.index(min(load))
        shares[k].append(entry)
        load[k] += len(entry[1].episode_indices)
    return [share for share in shares if share]
