"""Stage 4: run episodes (one coarse task per shard, mapped over the Dask cluster)."""

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFutureList

from evalfleet.models import EvalRequest, PolicyHandle, Shard
from evalfleet.worker import execute_shard


@task(name="run-episodes", cache_policy=NO_CACHE, retries=0)
def run_episodes(shard: Shard, handle: PolicyHandle, request: EvalRequest, isolation: str
                 ) -> pa.Table:
    """Run a shard's episodes with one batched policy forward per step."""
    return execute_shard(shard, handle, request, isolation)


def shard_tables(shards: PrefectFutureList[pa.Table]) -> list[pa.Table]:
    """The run stage's tables; when one shard fails, the others are cancelled.

    They must not outlive the policy's release: a shard left queued would start on a worker that
    joins later, after the policy is gone, and fail with ``PolicyIntegrityError``.
    """
    try:
        return shards.result()
    except BaseException:
        for future in shards:
            wrapped = getattr(future, "wrapped_future", None)
            if wrapped is not None and hasattr(wrapped, "cancel"):
                wrapped.cancel()
        raise
