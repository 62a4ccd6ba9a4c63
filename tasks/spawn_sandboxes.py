"""Stage 2: spawn sandboxes (plan the shards, start their fork servers on the workers)."""

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalRequest
from evalfleet.pipeline import Collected, Planned, Received, plan, spawn


@task(name="spawn-sandboxes", cache_policy=NO_CACHE)
def spawn_sandboxes(
    request: EvalRequest, received: Received, address: str | None, episodes: int,
    prior: Collected | None = None, warm: bool = True, max_shards: int | None = None,
) -> Planned:
    """Take what the cache holds, shard the rest by index, start the sandboxes' origin per worker.

    Episodes get their seeds from the ledger; each worker's fork server (``process``, ``bwrap``)
    or env import (``inprocess``) is started here, so the run stage only runs episodes.
    """
    planned = plan(request, received, address, episodes, prior, max_shards)
    # warm=False: the workers' sandbox origin for this env and level is already up (a suite's
    # earlier task); warming again would queue behind the shards already running.
    planned = spawn(request, received, address, planned) if warm else planned
    get_run_logger().info(
        "episodes 0..%d: cache %s (%d reused); %d to run in %d shards (+audit), %d env slots at "
        "once; %s sandboxes ready on %d workers",
        episodes - 1, planned.cache_status, planned.cached.num_rows, planned.plan.planned_episodes,
        len([s for s in planned.shards if not s.audit]), sum(s.slots for s in planned.shards),
        received.isolation, len(planned.warmed),
    )
    return planned
