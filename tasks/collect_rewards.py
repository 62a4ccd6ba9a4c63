"""Stage 5: collect rewards."""

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import PolicyHandle
from evalfleet.pipeline import Collected, Planned, collect


@task(name="collect-rewards", cache_policy=NO_CACHE)
def collect_rewards(
    shard_tables: list[Any], handle: PolicyHandle, planned: Planned, prior: Collected | None = None
) -> Collected:
    """Gather earlier rounds', cached and fresh rows into one Arrow table, one row per episode."""
    return collect(shard_tables, handle, planned, prior)
