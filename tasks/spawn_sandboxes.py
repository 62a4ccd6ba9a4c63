"""Stage 2: spawn sandboxes (plan the shards that will host them)."""

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalRequest
from evalfleet.pipeline import Planned, Received, plan


@task(name="spawn-sandboxes", cache_policy=NO_CACHE)
def spawn_sandboxes(request: EvalRequest, received: Received, address: str | None) -> Planned:
    """Take what the cache holds; fix the rest by index, seeds from the ledger, shards' env slots."""
    planned = plan(request, received, address)
    get_run_logger().info(
        "cache %s (%d reused); %d episodes to run in %d shards, %d env slots alive at once",
        planned.cache_status, planned.plan.cached_episodes, planned.plan.planned_episodes,
        len(planned.shards), sum(s.slots for s in planned.shards),
    )
    return planned
