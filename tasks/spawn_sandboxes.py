"""Stage 2: spawn sandboxes (plan the shards that will host them)."""

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalRequest, ShardPlan
from evalfleet.pipeline import Received, plan


@task(name="spawn-sandboxes", cache_policy=NO_CACHE)
def spawn_sandboxes(request: EvalRequest, received: Received, address: str) -> ShardPlan:
    """Fix the episodes by index, their seeds from the ledger, and the shards' env slots."""
    shard_plan = plan(request, received, address)
    get_run_logger().info(
        "%d episodes in %d shards, %d env slots alive at once",
        shard_plan.planned_episodes, len(shard_plan.shards),
        sum(s.slots for s in shard_plan.shards),
    )
    return shard_plan
