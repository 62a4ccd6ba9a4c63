"""The evaluation flow: seven stages, in order. ``python flows/eval.py --help`` for the CLI."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import pyarrow as pa
from prefect import flow, tags, unmapped

from evalfleet.audit import RoundSchedule
from evalfleet.cluster import annotated, done_with, fleet_cluster, idle_fork_server_stopped, installed
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import (
    Collected,
    Received,
    baseline_after_run,
    baseline_request,
    cached_baseline,
    check_hash_baseline,
    history_claim,
    key_held,
    names_own_hash,
    receive_baseline,
    received_before_flow,
    same_policy,
    shard_persister,
    store_in_cache,
)
from evalfleet.sandbox.isolation import probe_in_background
from evalfleet.storage import read_episodes
from flows.api_ledger import api_ledger, kept, run_recorded, settle
from flows.progress import watch
from flows.reaper import driver_tag, reap_quietly, untagged_tasks
from flows.runtime import Ahead, prefect_api, task_runner, worker_preload
from tasks.aggregate import aggregate
from tasks.collect_rewards import collect_rewards
from tasks.distribute_policy import distribute_policy
from tasks.feed_back import feed_back, replays_ahead
from tasks.receive_weights import checked_before, receive_weights
from tasks.run_episodes import run_episodes, shard_tables
from tasks.spawn_sandboxes import spawn_sandboxes

if TYPE_CHECKING:  # the suite flow is imported when a suite is asked for
    from evalfleet.suite import Suite, SuiteReport


@flow(name="evalfleet-eval", flow_run_name="{request.env}-{request.request_id}", log_prints=False)
def eval_flow(request: EvalRequest, address: str | None) -> EvalReport:
    """Evaluate ``request.policy`` on ``request.env`` over the Dask cluster at ``address``."""
    with untagged_tasks():  # the driver tag names the flow run; on a task run it costs a slot
        return kept(stages(request, address))  # the result, even if Prefect loses the end


def stages(request: EvalRequest, address: str | None) -> EvalReport:
    """The seven stages of ``eval_flow``, each a task run (stage 4 one per shard)."""
    received = receive_weights(request)                                          # 1 receive weights
    schedule, collected = RoundSchedule(request), None
    with key_held(request, received.cache_key):                                  # one run per key
        planned = spawn_sandboxes(request, received, address, request.episodes)  # 2 spawn sandboxes
        handle = distribute_policy(request, received, planned, address)          # 3 distribute policy
        with installed(handle, address), annotated(gpu(received)), \
                watch(request, address):                                         # progress
            while planned is not None:                                           # rounds (adaptive)
                shards = run_episodes.map(planned.shards, unmapped(handle), unmapped(request),
                                          unmapped(received.isolation))          # 4 run episodes
                tables = shard_tables(shards, shard_persister(request, received, planned), address,
                                      planned.shards)
                collected = collect_rewards(tables, handle, planned, collected)  # 5 collect
                more = schedule.next_episodes(collected.table)
                planned = spawn_sandboxes(request, received, address, more, collected) if more else None
        if collected is not None:  # stage 7's replays, on a worker: torch is imported there
            collected = replays_ahead(request, received, collected, address, gpu(received))
        store_in_cache(request, received, collected)  # not if replays differ; before the lock goes
    # The baseline runs with no lock held: its nested evaluation takes its own key's lock (and
    # stops evaluate()'s workers when it is done: nothing here runs on them after it).
    baseline = baseline_episodes(request, received, collected, address)
    done_with(address)  # evaluate()'s own workers stop while stages 6-7 run here
    report = aggregate(request, received, schedule, collected, baseline)         # 6 aggregate
    return feed_back(request, received, report, collected)                       # 7 feed back


def gpu(received: Received) -> dict[str, int]:
    """Dask resources the run stage asks for: a GPU worker when inference runs on CUDA.

    Stage 1 checked that the cluster has one (``place_inference``), so this never waits forever.
    """
    return {"GPU": 1} if received.device.startswith("cuda") else {}


def baseline_episodes(
    request: EvalRequest, received: Received, collected: Collected | None, address: str | None
) -> tuple[pa.Table, str] | None:
    """The baseline's episodes on the same seeds: from the cache by hash, or a nested evaluation.

    The evaluation ran: an error here is ``BaselineUnavailable`` (exit 7), never a refused request.
    """
    if request.baseline is None or collected is None:
        return None
    episodes = collected.table.num_rows
    with baseline_after_run():
        if request.baseline.startswith("sha256:"):
            # Stage 1 (check_hash_baseline) decided: its own hash is itself only where the cache
            # held no other key of that hash. Not read again: an entry of the hash another run
            # stored meanwhile would fail an evaluation whose episodes all ran.
            if names_own_hash(request, received):
                return collected.table, request.baseline
            return cached_baseline(request, received, episodes)
        if same_policy(request, received):  # the same key: its episodes are these, nothing to wait for
            return collected.table, request.baseline
        flow_run = eval_flow.with_options(task_runner=task_runner(address))
        with tags(driver_tag()):
            report = run_recorded(lambda: flow_run(baseline_request(request, episodes), address),
                                  "the baseline's flow run")
        return read_episodes(report.outputs["episodes"]), request.baseline


def evaluate(request: EvalRequest) -> EvalReport:
    """Run ``eval_flow`` with one Prefect API and a Dask cluster (local unless an address).

    Stage 1 runs here, before the flow, so bad input fails before anything is spawned; the flow's
    stage 1 records its result. A request the cache answers whole starts no cluster at all.
    """
    # The claim: a later step of the training run judged meanwhile waits for this one's verdict.
    # The fork server: one stage 1 started for a cluster that did not follow is stopped.
    with history_claim(request), idle_fork_server_stopped():
        # A miss starts the workers' fork server and checks the policy in a child of it, and
        # stages 6-7's imports start meanwhile; a TorchScript hit loads no policy.
        ahead = Ahead(request)
        received, hit = received_before_flow(request, on_miss=ahead)
        check_hash_baseline(request, received)  # a 'sha256:' baseline's episodes, or an error
        checked = [(request, received)]
        if request.baseline and not request.baseline.startswith("sha256:"):  # its stage 1
            checked.append(receive_baseline(request))
        probe_in_background()  # the report's sandbox manifest (~1 s of child processes)
        cluster = nullcontext(None) if hit else fleet_cluster(
            request.dask_address, request.workers, worker_preload(received), single_use=True)
        with checked_before(*checked), prefect_api(wait=False) as api, cluster as address, \
                api_ledger() as ledger:  # what the Prefect API fails to record: in the report
            api.wait()  # the cluster started while the server booted
            ahead.join()
            reap_quietly()  # flow runs of killed drivers end Crashed
            flow_run = eval_flow.with_options(task_runner=task_runner(address))
            with tags(driver_tag()):
                report = run_recorded(lambda: flow_run(request, address), "the flow run")
            return settle(report, ledger)


def evaluate_suite(suite: Suite, base: EvalRequest) -> SuiteReport:
    """``flows.suite.evaluate_suite``, imported when a suite is asked for (it pulls matplotlib)."""
    from flows.suite import evaluate_suite as run

    return run(suite, base)


if __name__ == "__main__":
    from evalfleet.cli import exit_now, run_cli

    exit_now(run_cli(evaluate, evaluate_suite=evaluate_suite))
