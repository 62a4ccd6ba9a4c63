"""The suite flow: the seven stages for every task of a suite, in one flow run on one cluster.

``python flows/eval.py --suite suite.toml`` (or ``evaluate_suite``). Each task runs the stages of
``flows/eval.py`` under its own cache key, its task runs named ``stage[task]`` in the Prefect UI;
the policy goes to the workers once for the whole suite; a last stage aggregates across tasks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from typing import Any, TypeVar

import dask
import pyarrow as pa
from prefect import flow, task, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner

from evalfleet.audit import RoundSchedule
from evalfleet.cluster import fleet_cluster, installed, worker_slots
from evalfleet.errors import SuiteError
from evalfleet.models import EvalReport, EvalRequest, PolicyHandle
from evalfleet.pipeline import Received, episode_cache, lookup, receive, store_in_cache
from evalfleet.suite import Suite, SuiteReport, baseline_requests, task_requests
from evalfleet.suite_report import build_suite_report, suite_feed_back, suite_markdown
from flows.runtime import prefect_api
from tasks.aggregate import aggregate
from tasks.collect_rewards import collect_rewards
from tasks.distribute_policy import distribute_policy
from tasks.feed_back import feed_back
from tasks.receive_weights import checked_before, receive_weights
from tasks.run_episodes import run_episodes, shard_tables
from tasks.spawn_sandboxes import spawn_sandboxes

T = TypeVar("T", bound=Any)


@flow(name="evalfleet-suite", flow_run_name="suite-{suite.name}-{base.request_id}", log_prints=False)
def suite_flow(suite: Suite, base: EvalRequest, address: str | None) -> SuiteReport:
    """Evaluate ``base.policy`` (and ``base.baseline``) on every task of ``suite``, then aggregate."""
    t0 = time.perf_counter()
    requests = task_requests(suite, base)
    reports, tables = run_tasks(suite, requests, address)
    theirs = None
    if base.baseline:  # the same tasks and seeds, each cached under the baseline's own key
        theirs = run_tasks(suite, baseline_requests(requests, base.baseline, base.baseline_factory),
                           address)[1]
    return aggregate_suite(suite, base, reports, tables, theirs, time.perf_counter() - t0)


def run_tasks(suite: Suite, requests: list[EvalRequest], address: str | None
              ) -> tuple[list[EvalReport], list[pa.Table]]:
    """Stages 1-7 of each task (as ``eval_flow``); the policy is distributed once for them all.

    Pipelined: task k's shards are submitted, then every earlier task whose shards have all
    finished is collected, aggregated and written, while the cluster runs the rest. A task's
    ``run_episodes`` time is therefore from its submission to its collection.
    """
    handle: PolicyHandle | None = None
    reports: list[EvalReport] = []
    tables: list[pa.Table] = []
    started: list[tuple[Any, ...]] = []
    warmed: set[tuple[str, str]] = set()  # (env id, isolation) whose sandbox origin is up
    # The worker slots shared out between the tasks, which overlap: fewer, larger shards, since
    # every shard costs a Prefect task run (~0.1-0.3 s to submit on a loaded machine).
    per_task = max(1, worker_slots(address) // len(requests)) if address and requests else None
    with ExitStack() as keep:
        try:
            for item, request in zip(suite.tasks, requests, strict=True):
                stage = _named(item.name)
                received = stage(receive_weights)(request)                                 # 1
                keep.enter_context(episode_cache(request).exclusive(received.cache_key))
                origin = (request.env, received.isolation)
                planned = stage(spawn_sandboxes)(request, received, address, request.episodes,
                                                 warm=origin not in warmed, max_shards=per_task)  # 2
                if planned.shards:
                    warmed.add(origin)
                if handle is None or (planned.shards and address and handle.plugin_name is None):
                    handle = keep.enter_context(installed(
                        stage(distribute_policy)(request, received, planned, address), address))  # 3
                mine = handle.model_copy(update={"distributed_at": time.time()})
                with dask.annotate(resources=gpu(received)):
                    shards = stage(run_episodes).map(planned.shards, unmapped(mine), unmapped(request),
                                                     unmapped(received.isolation))          # 4
                started.append((item, request, received, planned, mine, shards))
                while len(reports) < len(started) - 1 and _finished(started[len(reports)][-1]):
                    _finish(*started[len(reports)], reports, tables)
            while len(reports) < len(started):
                _finish(*started[len(reports)], reports, tables)
        except BaseException:
            for *_, shards in started:  # none may outlive the policy's release
                for future in shards:
                    wrapped = getattr(future, "wrapped_future", None)
                    if wrapped is not None and hasattr(wrapped, "cancel"):
                        wrapped.cancel()
            raise
    return reports, tables


def _finished(shards: Any) -> bool:
    """True when every shard future of a task is done (without waiting)."""
    return all(getattr(getattr(f, "wrapped_future", None), "done", lambda: False)() for f in shards)


def _finish(item: Any, request: EvalRequest, received: Received, planned: Any, mine: PolicyHandle,
            shards: Any, reports: list[EvalReport], tables: list[pa.Table]) -> None:
    """Stages 5-7 of one task whose shards were submitted."""
    stage = _named(item.name)
    collected = stage(collect_rewards)(shard_tables(shards), mine, planned)               # 5
    store_in_cache(request, received, collected)
    report = stage(aggregate)(request, received, RoundSchedule(request), collected)      # 6
    reports.append(stage(feed_back)(request, received, report, collected))               # 7
    tables.append(collected.table)


def _named(task_name: str) -> Callable[[T], T]:
    """``stage(task)``: the task with its runs named ``stage-name[task name]`` in the Prefect UI."""
    def named(stage: T) -> T:
        return stage.with_options(task_run_name=f"{stage.name}[{task_name}]")  # type: ignore[attr-defined,no-any-return]
    return named


def gpu(received: Received) -> dict[str, int]:
    """Dask resources of the run stage: a GPU worker when inference runs on CUDA (as eval_flow)."""
    return {"GPU": 1} if received.device.startswith("cuda") else {}


@task(name="aggregate-suite", cache_policy=NO_CACHE)
def aggregate_suite(suite: Suite, base: EvalRequest, reports: list[EvalReport], tables: list[pa.Table],
                    baseline_tables: list[pa.Table] | None, seconds: float) -> SuiteReport:
    """Aggregates across tasks, plots, report page, JSON, MLflow parent run, Prefect artifact."""
    final = suite_feed_back(build_suite_report(suite, base, reports, tables, baseline_tables, seconds),
                            base)
    create_markdown_artifact(suite_markdown(final, pictures=True),
                             key=f"suite-{final.policy_sha256[:12]}",
                             description=f"evalfleet suite {suite.name}")
    return final


def evaluate_suite(suite: Suite, base: EvalRequest) -> SuiteReport:
    """Run ``suite_flow`` with one Prefect API and one Dask cluster for every task.

    Every task's stage 1 (env, kwargs, policy against the env's spaces) runs here first, so a bad
    suite fails before anything is spawned. A suite the cache answers whole starts no cluster.
    """
    mine = task_requests(suite, base)
    groups = [mine] + ([baseline_requests(mine, base.baseline, base.baseline_factory)]
                       if base.baseline else [])
    checked = [(r, receive(r)) for group in groups for r in group]
    for group in groups:  # one group holds all its tasks' cache locks at once
        same_as(suite, [rec.cache_key for r, rec in checked if r in group])
    hit = all(lookup(r, rec).status == "hit" for r, rec in checked)
    cluster = nullcontext(None) if hit else fleet_cluster(base.dask_address, base.workers)
    with checked_before(*checked), prefect_api(wait=False) as api, cluster as address:
        api.wait()
        runner = DaskTaskRunner(address=address) if address else ThreadPoolTaskRunner()
        return suite_flow.with_options(task_runner=runner)(suite, base, address)


def same_as(suite: Suite, keys: list[str]) -> None:
    """Raise ``SuiteError`` when two tasks are the same evaluation (the same cache key)."""
    seen: dict[str, str] = {}
    for item, key in zip(suite.tasks, keys, strict=True):
        if key in seen:
            raise SuiteError(
                f"suite tasks {seen[key]!r} and {item.name!r} are the same evaluation (same env, "
                "kwargs, steps and policy: one cache key); remove one of them."
            )
        seen[key] = item.name
