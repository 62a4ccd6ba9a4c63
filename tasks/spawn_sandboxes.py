"""Stage 2: spawn sandboxes (plan the shards that will host them)."""

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalRequest
from evalfleet.pipeline import Collected, Planned, Received, plan


@task(name="spawn-sandboxes", cache_policy=NO_CACHE)
def spawn_sandboxes(
    request: EvalRequest, received: Received, address: str | None, episodes: int,
    prior: Collected | None = None,
) -> Planned:
    """Take what the cache holds; fix the rest by index, seeds from the ledger, shards' env slots."""
    planned = plan(request, received, address, episodes, prior)
    get_run_logger().info(
        "episodes 0..%d: cache %s (%d reused); %d to run in %d shards (+audit), %d env slots at once",
        episodes - 1, planned.cache_status, planned.cached.num_rows, planned.plan.planned_episodes,
        len([s for s in planned.shards if not s.audit]), sum(s.slots for s in planned.shards),
    )
    return planned
