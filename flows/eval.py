"""The evaluation flow: seven stages, in order. ``python flows/eval.py --help`` for the CLI."""

from __future__ import annotations

from contextlib import nullcontext

import dask
from prefect import flow, unmapped
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner

from evalfleet.cluster import fleet_cluster
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import episode_cache, lookup, receive
from flows.runtime import prefect_api
from tasks.aggregate import aggregate
from tasks.collect_rewards import collect_rewards
from tasks.distribute_policy import distribute_policy
from tasks.feed_back import feed_back
from tasks.receive_weights import receive_weights
from tasks.run_episodes import run_episodes
from tasks.spawn_sandboxes import spawn_sandboxes


@flow(name="evalfleet-eval", flow_run_name="{request.env}-{request.request_id}", log_prints=False)
def eval_flow(request: EvalRequest, address: str | None) -> EvalReport:
    """Evaluate ``request.policy`` on ``request.env`` over the Dask cluster at ``address``."""
    received = receive_weights(request)                                        # 1 receive weights
    with episode_cache(request).exclusive(received.cache_key):                 # one run per key
        planned = spawn_sandboxes(request, received, address)                  # 2 spawn sandboxes
        handle = distribute_policy(request, received, planned, address)        # 3 distribute policy
        with dask.annotate(resources={"GPU": 1} if request.wants_gpu else {}):
            shards = run_episodes.map(planned.shards, unmapped(handle), unmapped(request),
                                      unmapped(received.isolation))            # 4 run episodes
        collected = collect_rewards(shards.result(), handle, planned, address)  # 5 collect rewards
        report = aggregate(request, received, planned, collected)              # 6 aggregate
        return feed_back(request, received, report, collected)                 # 7 feed back


def evaluate(request: EvalRequest) -> EvalReport:
    """Run ``eval_flow`` with one Prefect API and a Dask cluster (local unless an address).

    Stage 1's checks run once here first, so bad input fails before anything is spawned; a request
    the cache answers whole starts no cluster at all.
    """
    hit = lookup(request, receive(request)).status == "hit"
    cluster = nullcontext(None) if hit else fleet_cluster(request.dask_address, request.workers)
    with prefect_api(), cluster as address:
        runner = DaskTaskRunner(address=address) if address else ThreadPoolTaskRunner()
        return eval_flow.with_options(task_runner=runner)(request, address)


if __name__ == "__main__":
    from evalfleet.cli import run_cli

    raise SystemExit(run_cli(evaluate))
