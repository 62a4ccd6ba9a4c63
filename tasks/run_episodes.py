"""Stage 4: run episodes (one coarse task per shard, mapped over the Dask cluster)."""

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalRequest, PolicyHandle, Shard
from evalfleet.worker import execute_shard


@task(name="run-episodes", cache_policy=NO_CACHE, retries=0)
def run_episodes(shard: Shard, handle: PolicyHandle, request: EvalRequest, isolation: str
                 ) -> pa.Table:
    """Run a shard's episodes with one batched policy forward per step."""
    return execute_shard(shard, handle, request, isolation)
