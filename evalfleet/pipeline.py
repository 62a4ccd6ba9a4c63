"""The seven stages as plain functions: what each Prefect task in ``tasks/`` calls.

Each function takes and returns small typed values; the Prefect layer only wires them together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from evalfleet import cluster
from evalfleet.audit import (
    RoundSchedule,
    audit_sample,
    compare_with_baseline,
    determinism_audit,
    reward_integrity,
    step_rewards,
)
from evalfleet.cache import EpisodeCache, Lookup, cache_key, default_cache_dir, key_ingredients
from evalfleet.envspec import resolve_env
from evalfleet.errors import RequestError
from evalfleet.models import EvalReport, EvalRequest, PolicyHandle, Shard, ShardPlan
from evalfleet.planning import plan_shards
from evalfleet.plots import render_plots
from evalfleet.policy import PolicyArtifact, load_policy, receive_policy
from evalfleet.records import EPISODE_SCHEMA, OUTCOME_COLUMNS, concat_sorted
from evalfleet.redaction import redact_json, redact_table
from evalfleet.replay import record_episodes, replay_inputs
from evalfleet.report import aggregate, versions
from evalfleet.review import choose_episodes, cluster_failures, report_page
from evalfleet.sandbox.isolation import resolve_isolation
from evalfleet.seeds import SeedLedger
from evalfleet.storage import run_dir, write_episodes, write_json, write_table
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
    audit_rows: pa.Table
    run_seconds: float
    seconds: float
    plan_cached: int
    plan_seconds: float
    cache_status: str
    cache_corrupt: bool


def receive(request: EvalRequest) -> Received:
    """Stage 1: validate env, isolation and policy before anything is spawned."""
    t0 = time.perf_counter()
    env = resolve_env(request.env, request.env_kwargs, request.max_steps)
    isolation = resolve_isolation(request.isolation, env.fingerprint.entry_point)
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


def lookup(request: EvalRequest, received: Received, indices: Sequence[int] | None = None) -> Lookup:
    """What the cache holds for ``request`` ('off' and 'refresh' see an empty cache)."""
    indices = range(request.episodes) if indices is None else indices
    if request.cache != "use":
        return Lookup(received.cache_key, EPISODE_SCHEMA.empty_table(), list(indices))
    return episode_cache(request).lookup(received.cache_key, indices)


def plan(
    request: EvalRequest, received: Received, address: str | None, episodes: int,
    prior: Collected | None = None,
) -> Planned:
    """Stage 2: fix episodes ``0..episodes-1`` by index and shard what remains to run.

    Rows that the cache or earlier rounds hold are reused; the rest is split over the worker
    slots, plus one determinism-audit shard.
    """
    t0 = time.perf_counter()
    have = set(prior.table.column("episode_index").to_pylist()) if prior is not None else set()
    wanted = [i for i in range(episodes) if i not in have]
    found = lookup(request, received, wanted)
    round_indices = sorted(set(found.missing) | set(found.stored.column("episode_index").to_pylist()))
    # Audit rounds that run something; a full cache hit was audited when it was computed.
    audit = audit_sample(round_indices, request.seed) if request.audit and found.missing else []
    work = len(found.missing) + len(audit)
    slots = cluster.worker_slots(address) if work and address else 1
    if work and address is None:
        raise RuntimeError("episodes are missing from the cache but no Dask cluster was given")
    shard_plan = plan_shards(
        request.request_id, request.seed, found.missing, request.concurrency, slots,
        total_episodes=episodes,
    )
    shards = list(shard_plan.shards)
    if audit:
        ledger = SeedLedger(request.seed)
        shards.append(Shard(shard_id=len(shards), episode_indices=audit,
                            seeds=[ledger.seed(i) for i in audit],
                            slots=min(len(audit), request.concurrency), audit=True))
    shard_plan = shard_plan.model_copy(update={
        "shards": shards,
        "cached_episodes": found.stored.num_rows + (prior.plan_cached if prior else 0),
        "cache_key": received.cache_key,
        "seconds": time.perf_counter() - t0 + (prior.plan_seconds if prior else 0.0),
    })
    return Planned(shard_plan, found.stored, found.status if request.cache == "use" else request.cache,
                   found.corrupt)


def distribute(request: EvalRequest, received: Received, address: str | None) -> PolicyHandle:
    """Stage 3: one copy of the policy per worker."""
    return cluster.distribute(received.artifact, address, request.device, request.deterministic)


def collect(
    tables: list[pa.Table], handle: PolicyHandle, planned: Planned, prior: Collected | None = None
) -> Collected:
    """Stage 5: one table, one row per episode (earlier rounds + cached + run), in episode order."""
    t0 = time.perf_counter()
    run_seconds = time.time() - handle.distributed_at
    fresh = concat_sorted([t for t, s in zip(tables, planned.shards, strict=True) if not s.audit])
    audit_rows = concat_sorted([t for t, s in zip(tables, planned.shards, strict=True) if s.audit])
    expected = sum(len(s.episode_indices) for s in planned.shards if not s.audit)
    if fresh.num_rows != expected:
        raise RuntimeError(
            f"run stage returned {fresh.num_rows} rows for {expected} planned "
            "episodes; this is a harness bug, please report it with the request"
        )
    parts = [planned.cached, fresh] + ([prior.table] if prior else [])
    return Collected(
        # Once more here (rows are scrubbed on the workers too): nothing below writes a secret.
        table=redact_table(concat_sorted(parts)),
        fresh=redact_table(concat_sorted([fresh] + ([prior.fresh] if prior else []))),
        audit_rows=concat_sorted([audit_rows] + ([prior.audit_rows] if prior else [])),
        run_seconds=run_seconds,
        seconds=time.perf_counter() - t0 + (prior.seconds if prior else 0.0),
        plan_cached=planned.plan.cached_episodes,
        plan_seconds=planned.plan.seconds,
        cache_status=planned.cache_status,
        cache_corrupt=planned.cache_corrupt or (prior.cache_corrupt if prior else False),
    )


def summarize(
    request: EvalRequest, received: Received, schedule: RoundSchedule, collected: Collected,
    baseline: tuple[pa.Table, str] | None = None,
) -> EvalReport:
    """Stage 6: statistics, failures, audits, alarms and the comparison with a baseline."""
    t0 = time.perf_counter()
    timings = {
        "receive_weights": received.seconds,
        "spawn_sandboxes": collected.plan_seconds,
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
        cache={"status": cache_status(request, collected), "key": received.cache_key,
               "reused": collected.plan_cached, "computed": collected.fresh.num_rows,
               "corrupt_entry_recomputed": collected.cache_corrupt},
        run_seconds=collected.run_seconds,
    )
    alarms = list(report.alarms) + reward_integrity(collected.table)
    audit = determinism_audit(collected.table, collected.audit_rows) if request.audit else None
    if audit and audit["mismatches"]:
        seeds = ", ".join(str(m["seed"]) for m in audit["mismatches"][:5])
        alarms.append(
            f"non_deterministic_env: {len(audit['mismatches'])} of {audit['checked']} re-run "
            f"episodes differ (seeds {seeds}); results are not reproducible"
        )
    comparison = None
    if baseline is not None:
        comparison = compare_with_baseline(collected.table, baseline[0], request.seed, baseline[1])
    return report.model_copy(update={
        "timings": dict(timings, aggregate=time.perf_counter() - t0),
        "alarms": alarms,
        "audit": audit,
        "adaptive": schedule.summary(),
        "comparison": comparison,
        "step_rewards": step_rewards(collected.table),
    })


class _SkipReview(Exception):
    """Raised to skip the review step on purpose."""


#: Episodes replayed for the action-distribution plot when nothing more is asked for.
ACTION_SAMPLE = 16


def review(
    request: EvalRequest, received: Received, report: EvalReport, table: pa.Table, folder: Path
) -> tuple[EvalReport, list[Path]]:
    """Failure clusters, replays (trajectories, videos, actions), plots and the report page."""
    clusters = cluster_failures(table)
    files: list[Path] = []
    notes: list[str] = []
    actions = None
    videos: dict[int, Path] = {}
    if received.isolation == "inprocess":
        k = max(request.record_trajectories, request.record_video, ACTION_SAMPLE)
        chosen = choose_episodes(table, k, seed=request.seed)
        episodes, expected, reasons = replay_inputs(table, chosen)
        env = resolve_env(request.env, request.env_kwargs, request.max_steps)
        art = received.artifact
        policy = load_policy(art.format, art.payload, art.factory, art.source, env.action_space,
                             device="cpu", deterministic=request.deterministic)
        result = record_episodes(
            request.env, request.env_kwargs, request.max_steps, policy, episodes,
            video_dir=folder / "videos" if request.record_video else None,
            trajectories=request.record_trajectories > 0, expected=expected, end_reasons=reasons,
            video_for=chosen[: request.record_video],
            trajectories_for=chosen[: request.record_trajectories],
        )
        if result.trajectories is not None and result.trajectories.num_rows:
            files.append(write_table(result.trajectories, folder / "trajectories.parquet"))
        videos = dict(result.videos)
        files += list(videos.values())
        actions = dict(result.actions, note="replayed: worst, best, failed, then a seeded sample")
        notes += result.notes()
        if result.mismatches:
            report = report.model_copy(update={"alarms": [*report.alarms, (
                f"replay_nondeterminism: {len(result.mismatches)} replayed episodes differ from "
                "their rows")]})
    elif request.record_trajectories or request.record_video:
        notes.append(f"trajectories and videos are replayed in the flow process, which would run "
                     f"the env with less isolation than '{received.isolation}': skipped")
    adaptive = report.adaptive or {}
    plots = render_plots(table, folder / "plots", actions=actions, rounds=adaptive.get("rounds"),
                         ci=report.ci if report.completed else None,
                         target_halfwidth=adaptive.get("target_halfwidth"))
    report = report.model_copy(update={"failure_clusters": clusters})
    page = report_page(report, clusters, plots, folder / "report.html", videos=videos, notes=notes)
    return report, [*files, *plots.values(), page]


def review_files_by_name(files: list[Path]) -> dict[str, Path]:
    """The review outputs a user looks for by name."""
    named = {"report.html": "report_html", "trajectories.parquet": "trajectories"}
    return {named[p.name]: p for p in files if p.name in named}


def cache_status(request: EvalRequest, collected: Collected) -> str:
    """'hit', 'partial' or 'miss' over all rounds; 'off' / 'refresh' when the cache was bypassed."""
    if request.cache != "use":
        return request.cache
    if not collected.fresh.num_rows:
        return "hit"
    return "partial" if collected.plan_cached else "miss"


def feed_back(
    request: EvalRequest, received: Received, report: EvalReport, collected: Collected
) -> EvalReport:
    """Stage 7: Parquet first (it must survive any other sink failing), cache, JSON, then MLflow."""
    t0 = time.perf_counter()
    report = scrubbed(report)
    folder = run_dir(request.output, request.request_id)
    parquet = write_episodes(collected.table, folder / "episodes.parquet")
    deterministic = not (report.audit and report.audit["mismatches"])
    if (request.cache != "off" and deterministic
            and (collected.fresh.num_rows or request.cache == "refresh")):
        episode_cache(request).store(received.cache_key, collected.table, received.cache_ingredients,
                                     replace=request.cache == "refresh")
    outputs = {"folder": str(folder.resolve()), "episodes": str(parquet.resolve())}
    artifacts = [parquet]
    try:
        # A full cache hit was reviewed when it was computed; re-plotting it costs ~1.5 s per request.
        if collected.fresh.num_rows == 0 and not (request.record_trajectories or request.record_video):
            raise _SkipReview("cache hit: no new episodes to review")
        report, review_files = review(request, received, report, collected.table, folder)
        artifacts += review_files
        outputs.update({k: str(v.resolve()) for k, v in review_files_by_name(review_files).items()})
    except _SkipReview as why:
        outputs["review"] = f"skipped ({why})"
    except Exception as err:  # plots and replays must never cost the results
        logger.error("review step failed (%s); results are in %s", err, folder)
        outputs["review_error"] = f"{type(err).__name__}: {err}"
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
            artifacts=[*artifacts, report_path],
            run_name=f"eval-{request.env.rsplit(':', 1)[-1]}-{report.policy_sha256[:12]}",
        )
        outputs["mlflow_uri"] = tracking_uri
        outputs["mlflow_run_id"] = run_id
    except Exception as err:  # a failing sink never loses the Parquet already written
        logger.error("MLflow logging failed (%s); results are in %s", err, folder)
        outputs["mlflow_error"] = f"{type(err).__name__}: {err}"
    timings = dict(report.timings, feed_back=time.perf_counter() - t0)
    final = scrubbed(report.model_copy(update={"outputs": outputs, "timings": timings}))
    write_json(final.model_dump(mode="json"), report_path)
    if request.callback_url:  # last, so the trainer gets the MLflow run id; never raises
        from evalfleet.callback import send_report_callback

        outcome = send_report_callback(request.callback_url, final.model_dump(mode="json"))
        final = scrubbed(final.model_copy(update={"outputs": {**final.outputs, "callback": outcome}}))
        write_json(final.model_dump(mode="json"), report_path)
    return final


def scrubbed(report: EvalReport) -> EvalReport:
    """``report`` with every secret value known to this process replaced (see ``redaction``)."""
    data = report.model_dump(mode="json")
    clean = redact_json(data)
    return report if clean == data else EvalReport.model_validate(clean)


def baseline_request(request: EvalRequest, episodes: int) -> EvalRequest:
    """The baseline's evaluation: same env, seeds and protocol; its own run and cache entry."""
    return request.model_copy(update={
        "policy": request.baseline, "policy_factory": request.baseline_factory, "baseline": None,
        "episodes": episodes, "target_ci_halfwidth": None, "max_episodes": None,
        "request_id": f"{request.request_id}-baseline", "callback_url": None,
    })


def cached_baseline(request: EvalRequest, received: Received, episodes: int) -> tuple[pa.Table, str]:
    """Episodes of a baseline given as 'sha256:HEX', found in the cache under the same protocol."""
    ref = str(request.baseline)
    prefix = ref.removeprefix("sha256:").lower()
    cache = episode_cache(request)
    for entry in cache.entries():
        ing = cache.ingredients(str(entry["key"]))
        if not str(entry.get("policy_sha256") or "").startswith(prefix) or ing is None:
            continue
        same = {k: v for k, v in ing.items() if k != "policy"}
        mine = {k: v for k, v in received.cache_ingredients.items() if k != "policy"}
        if same == mine:
            return cache.lookup(str(entry["key"]), range(episodes)).stored, ref
    raise RequestError(
        f"baseline {ref!r}: no cached episodes of a policy with that hash under this env and "
        f"protocol in {cache.root}; pass the baseline policy file instead."
    )


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
