"""The suite flow: the seven stages for every task of a suite, in one flow run on one cluster.

``python flows/eval.py --suite suite.toml`` (or ``evaluate_suite``). Each task runs the stages of
``flows/eval.py`` under its own cache key, one task run per stage named ``stage[tasks]`` in the UI;
the policy goes to the workers once for the whole suite; a last stage aggregates across tasks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from typing import Any, NamedTuple, TypeVar

import dask
import pyarrow as pa
from prefect import flow, get_run_logger, tags, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFutureList
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote
from prefect_dask import DaskTaskRunner

from evalfleet.callback import check_callback
from evalfleet.claims import wait_s
from evalfleet.cluster import client_for, fleet_cluster, installed, worker_slots
from evalfleet.errors import SuiteError
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import (
    Collected,
    Received,
    check_suite_sandbox_options,
    key_held,
    lookup,
    receive,
    store_in_cache,
    unaudited,
)
from evalfleet.sandbox.isolation import probe_in_background
from evalfleet.suite import Suite, SuiteReport, baseline_requests, task_requests
from evalfleet.suite_report import (
    Aggregated,
    aggregate_and_draw,
    build_suite_report,
    suite_feed_back,
    suite_markdown,
)
from flows.api_ledger import api_ledger, best_effort, kept, run_recorded, settle
from flows.reaper import driver_tag, reap_quietly, untagged_tasks
from flows.runtime import prefect_api, worker_modules
from tasks.distribute_policy import distribute_policy
from tasks.receive_weights import checked_before
from tasks.run_episodes import shard_tables
from tasks.suite_stages import (
    aggregate_all,
    collect_all,
    feed_back_all,
    receive_all,
    run_group,
    share_out,
    spawn_all,
    tables_of,
)

T = TypeVar("T", bound=Any)


@flow(name="evalfleet-suite", flow_run_name="suite-{suite.name}-{base.request_id}", log_prints=False)
def suite_flow(suite: Suite, base: EvalRequest, address: str | None) -> SuiteReport:
    """Evaluate ``base.policy`` (and ``base.baseline``) on every task of ``suite``, then aggregate."""
    with untagged_tasks():  # the driver tag names the flow run; on a task run it costs a slot
        return kept(suite_stages(suite, base, address))


def suite_stages(suite: Suite, base: EvalRequest, address: str | None) -> SuiteReport:
    """The stages of ``suite_flow``: each stage one task run for all the tasks."""
    t0 = time.perf_counter()
    stage = _named(", ".join(item.name for item in suite.tasks))
    mine = run_tasks(suite, task_requests(suite, base), address)
    theirs = None
    if base.baseline:  # the same tasks and seeds, each cached under the baseline's own key
        theirs = run_tasks(suite, baseline_requests(mine.requests, base.baseline,
                                                    base.baseline_factory), address)
    # The aggregates and figures need only stages 5-6: an idle worker draws them during stage 7.
    drawn = draw_beside(suite, base, mine, theirs, address)
    for done in (mine, theirs):
        if done is not None:                                                               # 7
            done.reports[:] = stage(feed_back_all)(*(quote(x) for x in done[:4]))
    return aggregate_suite(suite, base, quote(mine.reports), quote(tables_of(mine.collected)),
                           quote(tables_of(theirs.collected) if theirs else None),
                           time.perf_counter() - t0, quote(drawn),
                           quote(theirs.reports if theirs else []))


class Ran(NamedTuple):
    """Stages 1-6 of a suite's tasks: what stage 7 and the suite's aggregates take."""

    requests: list[EvalRequest]
    received: list[Received]
    reports: list[EvalReport]
    collected: list[Collected]


def run_tasks(suite: Suite, requests: list[EvalRequest], address: str | None) -> Ran:
    """Stages 1-6 of each task (as ``eval_flow``), each stage one task run for all the tasks.

    A Prefect task run costs ~0.1-0.5 s: per task and stage it was most of a small suite's time.
    The run stage is one task run per worker slot over all tasks' shards (named after the tasks
    it runs); the policy is distributed once. Each task keeps its own cache key and lock,
    results, files and MLflow run. Large inputs are quoted: Prefect would otherwise walk every
    episode index and table looking for futures (~0.1 s per stage).
    """
    names = ", ".join(item.name for item in suite.tasks)
    stage = _named(names)
    received = stage(receive_all)(requests)                                               # 1
    # The worker slots shared out between the tasks, which run at once: fewer, larger shards,
    # since every shard costs a Prefect task run.
    per_task = max(1, worker_slots(address) // len(requests)) if address and requests else None
    with ExitStack() as keep:
        for request, rec in zip(requests, received, strict=True):  # one run per key
            keep.enter_context(key_held(request, rec.cache_key))
        planned = stage(spawn_all)(requests, quote(received), address, per_task)          # 2
        first = next((i for i, p in enumerate(planned) if p.shards), 0)
        handle = keep.enter_context(installed(stage(distribute_policy)(
            requests[first], quote(received[first]), quote(planned[first]), address), address))  # 3
        mine = handle.model_copy(update={"distributed_at": time.time()})
        shares = share_out(planned, worker_slots(address) if address else 1)
        isolation = [r.isolation for r in received]
        with dask.annotate(resources=gpu(received[first])):
            futures = [_named(", ".join(sorted({suite.tasks[i].name for i, _ in share})))(run_group)
                       .submit(share, mine, requests, isolation)
                       for share in shares]                                                # 4
        tables: list[list[Any]] = [[] for _ in requests]
        by_shard: dict[tuple[int, int], Any] = {}
        for share, table_list in zip(shares, shard_tables(PrefectFutureList(futures)), strict=True):
            for (i, shard), table in zip(share, table_list, strict=True):
                by_shard[(i, id(shard))] = table
        for i, plan in enumerate(planned):  # each task's tables in its shards' order
            tables[i] = [by_shard[(i, id(shard))] for shard in plan.shards]
        mines = [mine] * len(requests)
        collected = stage(collect_all)(quote(tables), mines, quote(planned))              # 5
        for request, rec, coll in zip(requests, received, collected, strict=True):
            store_in_cache(request, rec, coll)
    reports = stage(aggregate_all)(quote(requests), quote(received), quote(collected))    # 6
    return Ran(requests, received, reports, collected)


def draw_beside(suite: Suite, base: EvalRequest, mine: Ran, theirs: Ran | None,
                address: str | None) -> Future[Aggregated] | Any:
    """``aggregate_and_draw`` started on a worker (raw Dask: the workers idle during stage 7).

    Without a cluster it runs on a thread; either way ``.result()`` gives the ``Aggregated``.
    """
    args = (suite, base, mine.reports, tables_of(mine.collected),
            tables_of(theirs.collected) if theirs else None)
    if address:
        return client_for(address).submit(aggregate_and_draw, *args, pure=False)
    pool = ThreadPoolExecutor(max_workers=1)
    drawn = pool.submit(aggregate_and_draw, *args)
    pool.shutdown(wait=False)  # the thread finishes its one call, then ends
    return drawn


def _named(task_name: str) -> Callable[[T], T]:
    """``stage(task)``: the task with its runs named ``stage-name[task names]`` in the Prefect UI."""
    def named(stage: T) -> T:
        return stage.with_options(task_run_name=f"{stage.name}[{task_name}]")  # type: ignore[attr-defined,no-any-return]
    return named


def gpu(received: Received) -> dict[str, int]:
    """Dask resources of the run stage: a GPU worker when inference runs on CUDA (as eval_flow)."""
    return {"GPU": 1} if received.device.startswith("cuda") else {}


@task(name="aggregate-suite", cache_policy=NO_CACHE)
def aggregate_suite(suite: Suite, base: EvalRequest, reports: list[EvalReport], tables: list[pa.Table],
                    baseline_tables: list[pa.Table] | None, seconds: float,
                    drawn: Future[Aggregated] | Any = None,
                    baseline_reports: list[EvalReport] | None = None) -> SuiteReport:
    """Aggregates across tasks, plots, report page, JSON, MLflow parent run, Prefect artifact.

    ``drawn``: the aggregates and figures ``draw_beside`` started; when it failed (a lost worker),
    they are computed here instead, and an error in the numbers is raised from here.
    """
    done = None
    if drawn is not None:
        try:
            done = drawn.result()
        except Exception as err:  # noqa: BLE001 - recomputed below, which raises what is real
            get_run_logger().warning("suite aggregates on the worker failed (%s); computing here", err)
    report = build_suite_report(suite, base, reports, tables, baseline_tables, seconds, aggregated=done,
                                baseline_reports=baseline_reports or [])
    final = suite_feed_back(report, base, done)
    markdown = suite_markdown(final, pictures=True)
    with best_effort("the suite's artifact"):  # the UI's copy: the result is written above
        create_markdown_artifact(markdown, key=f"suite-{final.policy_sha256[:12]}",
                                 description=f"evalfleet suite {suite.name}")
    return final


def evaluate_suite(suite: Suite, base: EvalRequest) -> SuiteReport:
    """Run ``suite_flow`` with one Prefect API and one Dask cluster for every task.

    Every task's stage 1 (env, kwargs, policy against the env's spaces) runs here first, so a bad
    suite fails before anything is spawned. A suite the cache answers whole starts no cluster.
    """
    if base.callback_url:  # the suite's report goes there: it must be signable and reachable
        check_callback(base.callback_url)
    if base.training_run_id is not None and base.step is not None:
        wait_s()  # each task's stage 7 waits for earlier steps this long: a bad value fails now
    mine = task_requests(suite, base)
    groups = [mine] + ([baseline_requests(mine, base.baseline, base.baseline_factory)]
                       if base.baseline else [])
    checked = [(r, receive(r)) for group in groups for r in group]
    check_suite_sandbox_options(base, checked)
    probe_in_background()  # the reports' sandbox manifest (~1 s of child processes), meanwhile
    for group in groups:  # one group holds all its tasks' cache locks at once
        same_as(suite, [rec.cache_key for r, rec in checked if r in group])
    # Rows no audit covered are no hit when audited: the audit runs on the cluster.
    found = [(r, lookup(r, rec)) for r, rec in checked]
    hit = all(f.status == "hit" and not unaudited(r, f) for r, f in found)
    torch = any(rec.artifact.format != "callable" for _, rec in checked)
    cluster = nullcontext(None) if hit else fleet_cluster(
        base.dask_address, base.workers, worker_modules(torch))
    with checked_before(*checked), prefect_api(wait=False) as api, cluster as address, \
            api_ledger() as ledger:
        api.wait()
        reap_quietly()  # flow runs of killed drivers end Crashed
        runner = DaskTaskRunner(address=address) if address else ThreadPoolTaskRunner()
        with tags(driver_tag()):  # the reaper's mark: this driver process, on this host
            report = run_recorded(lambda: suite_flow.with_options(task_runner=runner)(
                suite, base, address), "the suite's flow run")
        return settle(report, ledger)


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
