"""Stage 5: collect rewards."""

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import PolicyHandle, ShardPlan
from evalfleet.pipeline import Collected, collect


@task(name="collect-rewards", cache_policy=NO_CACHE)
def collect_rewards(
    shard_tables: list[Any], handle: PolicyHandle, plan: ShardPlan, address: str
) -> Collected:
    """Gather the shards' rows into one Arrow table, one row per planned episode."""
    return collect(shard_tables, handle, plan.planned_episodes, address)
