"""The seven stages as plain functions: what each Prefect task in ``tasks/`` calls.

Each function takes and returns small typed values; the Prefect layer only wires them together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from evalfleet import cluster
from evalfleet.cache import EpisodeCache, Lookup, cache_key, default_cache_dir, key_ingredients
from evalfleet.envspec import resolve_env
from evalfleet.models import EvalReport, EvalRequest, PolicyHandle, Shard, ShardPlan
from evalfleet.planning import plan_shards
from evalfleet.policy import PolicyArtifact, receive_policy
from evalfleet.records import EPISODE_SCHEMA, OUTCOME_COLUMNS, concat_sorted
from evalfleet.report import aggregate, versions
from evalfleet.sandbox.isolation import resolve_isolation
from evalfleet.storage import run_dir, write_episodes, write_json
from evalfleet.tracking import default_tracking_uri, log_evaluation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Received:
    """Stage 1 output: the validated policy and env, and the isolation level that will be used."""

    artifact: PolicyArtifact
    env_spec: dict[str, Any]
    env_spec_hash: str
    isolation: str
    cache_key: str
    cache_ingredients: dict[str, Any]
    seconds: float


@dataclass(frozen=True)
class Planned:
    """Stage 2 output: shards for the episodes to run, and the rows the cache already holds."""

    plan: ShardPlan
    cached: pa.Table
    cache_status: str
    cache_corrupt: bool

    @property
    def shards(self) -> list[Shard]:
        """The shards to map the run stage over (empty on a full cache hit)."""
        return self.plan.shards


@dataclass(frozen=True)
class Collected:
    """Stage 5 output: the episode table and how long running took."""

    table: pa.Table
    fresh: pa.Table
    run_seconds: float
    seconds: float


def receive(request: EvalRequest) -> Received:
    """Stage 1: validate env, isolation and policy before anything is spawned."""
    t0 = time.perf_counter()
    env = resolve_env(request.env, request.env_kwargs, request.max_steps)
    isolation = resolve_isolation(request.isolation)
    artifact = receive_policy(
        request.policy, request.policy_factory, env.observation_space, env.action_space,
        deterministic=request.deterministic,
    )
    ingredients = key_ingredients(
        artifact.summary(), env.fingerprint.as_dict(), request.seed, request.max_steps,
        request.deterministic, versions(),
    )
    return Received(artifact, env.fingerprint.as_dict(), env.fingerprint.spec_hash, isolation,
                    cache_key(ingredients), ingredients, time.perf_counter() - t0)


def episode_cache(request: EvalRequest) -> EpisodeCache:
    """The request's episode cache."""
    return EpisodeCache(request.cache_dir or default_cache_dir(request.output))


def lookup(request: EvalRequest, received: Received) -> Lookup:
    """What the cache holds for ``request`` ('off' and 'refresh' see an empty cache)."""
    indices = range(request.episodes)
    if request.cache != "use":
        return Lookup(received.cache_key, EPISODE_SCHEMA.empty_table(), list(indices))
    return episode_cache(request).lookup(received.cache_key, indices)


def plan(request: EvalRequest, received: Received, address: str | None) -> Planned:
    """Stage 2: fix episodes by index, take what the cache holds, shard the rest over the workers."""
    t0 = time.perf_counter()
    found = lookup(request, received)
    slots = cluster.worker_slots(address) if found.missing and address else 1
    if found.missing and address is None:
        raise RuntimeError("episodes are missing from the cache but no Dask cluster was given")
    shard_plan = plan_shards(
        request.request_id, request.seed, found.missing, request.concurrency, slots,
        total_episodes=request.episodes,
    ).model_copy(update={
        "cached_episodes": found.stored.num_rows,
        "cache_key": received.cache_key,
        "seconds": time.perf_counter() - t0,
    })
    return Planned(shard_plan, found.stored, found.status if request.cache == "use" else request.cache,
                   found.corrupt)


def distribute(request: EvalRequest, received: Received, address: str | None) -> PolicyHandle:
    """Stage 3: one copy of the policy per worker."""
    return cluster.distribute(received.artifact, address, request.device, request.deterministic)


def collect(
    tables: list[pa.Table], handle: PolicyHandle, planned: Planned, address: str | None
) -> Collected:
    """Stage 5: one table, one row per episode (cached + run), in episode order."""
    t0 = time.perf_counter()
    run_seconds = time.time() - handle.distributed_at
    cluster.release(handle, address)
    fresh = concat_sorted(tables)
    if fresh.num_rows != planned.plan.planned_episodes:
        raise RuntimeError(
            f"run stage returned {fresh.num_rows} rows for {planned.plan.planned_episodes} planned "
            "episodes; this is a harness bug, please report it with the request"
        )
    table = concat_sorted([planned.cached, fresh])
    return Collected(table, fresh, run_seconds, time.perf_counter() - t0)


def summarize(
    request: EvalRequest, received: Received, planned: Planned, collected: Collected
) -> EvalReport:
    """Stage 6: statistics, failures and alarms over the episode table."""
    t0 = time.perf_counter()
    timings = {
        "receive_weights": received.seconds,
        "spawn_sandboxes": planned.plan.seconds,
        "run_episodes": collected.run_seconds,
        "collect_rewards": collected.seconds,
    }
    report = aggregate(
        request,
        collected.table,
        env_spec=received.env_spec,
        env_spec_hash=received.env_spec_hash,
        policy=received.artifact.summary(),
        isolation=received.isolation,
        timings=timings,
        cache={"status": planned.cache_status, "key": received.cache_key,
               "reused": planned.plan.cached_episodes, "computed": planned.plan.planned_episodes,
               "corrupt_entry_recomputed": planned.cache_corrupt},
        run_seconds=collected.run_seconds,
    )
    return report.model_copy(
        update={"timings": dict(timings, aggregate=time.perf_counter() - t0)}
    )


def feed_back(
    request: EvalRequest, received: Received, report: EvalReport, collected: Collected
) -> EvalReport:
    """Stage 7: Parquet first (it must survive any other sink failing), cache, JSON, then MLflow."""
    t0 = time.perf_counter()
    folder = run_dir(request.output, request.request_id)
    parquet = write_episodes(collected.table, folder / "episodes.parquet")
    if request.cache != "off" and (collected.fresh.num_rows or request.cache == "refresh"):
        episode_cache(request).store(received.cache_key, collected.table, received.cache_ingredients,
                                     replace=request.cache == "refresh")
    outputs = {"folder": str(folder.resolve()), "episodes": str(parquet.resolve())}
    report_path = folder / "report.json"
    write_json(report.model_dump(mode="json"), report_path)
    outputs["report"] = str(report_path.resolve())
    tracking_uri = request.mlflow_uri or default_tracking_uri(request.output)
    try:
        run_id = log_evaluation(
            tracking_uri,
            request.experiment,
            report.model_dump(mode="json"),
            params=mlflow_params(request, report),
            artifacts=[parquet, report_path],
            run_name=f"eval-{request.env.rsplit(':', 1)[-1]}-{report.policy_sha256[:12]}",
        )
        outputs["mlflow_uri"] = tracking_uri
        outputs["mlflow_run_id"] = run_id
    except Exception as err:  # a failing sink never loses the Parquet already written
        logger.error("MLflow logging failed (%s); results are in %s", err, folder)
        outputs["mlflow_error"] = f"{type(err).__name__}: {err}"
    timings = dict(report.timings, feed_back=time.perf_counter() - t0)
    final = report.model_copy(update={"outputs": outputs, "timings": timings})
    write_json(final.model_dump(mode="json"), report_path)
    return final


def mlflow_params(request: EvalRequest, report: EvalReport) -> dict[str, Any]:
    """The request's protocol and execution settings as MLflow params."""
    return {
        "env": request.env,
        "env_kwargs": request.env_kwargs,
        "policy": request.policy,
        "policy_sha256": report.policy_sha256,
        "episodes": request.episodes,
        "concurrency": request.concurrency,
        "seed": request.seed,
        "max_steps": request.max_steps,
        "deterministic": request.deterministic,
        "isolation": report.isolation,
        "device": request.device,
        "episode_timeout_s": request.episode_timeout_s,
    }


def outcome_table(table: pa.Table) -> pa.Table:
    """The columns that must be equal across reruns and cluster shapes."""
    return table.select(list(OUTCOME_COLUMNS))


__all__ = [
    "EPISODE_SCHEMA",
    "Collected",
    "Received",
    "collect",
    "distribute",
    "feed_back",
    "outcome_table",
    "plan",
    "receive",
    "summarize",
]
