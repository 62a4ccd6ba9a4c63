"""Stage 4: run episodes (one coarse task per shard, mapped over the Dask cluster)."""

from collections.abc import Callable, Iterable
from contextlib import nullcontext

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFutureList, as_completed

from evalfleet.cluster import WorkersWatch, forget_results, lost_workers, scheduler_lost
from evalfleet.errors import ClusterLost
from evalfleet.models import EvalRequest, PolicyHandle, Shard
from evalfleet.worker import execute_shard


@task(name="run-episodes", cache_policy=NO_CACHE, retries=0)
def run_episodes(shard: Shard, handle: PolicyHandle, request: EvalRequest, isolation: str
                 ) -> pa.Table:
    """Run a shard's episodes with one batched policy forward per step."""
    return execute_shard(shard, handle, request, isolation)


def release(futures: Iterable[object]) -> None:
    """Cancel ``futures`` on the Dask cluster: queued ones never run, finished ones are forgotten.

    Returns once the scheduler has taken the release in (``forget_results``).
    """
    forget_results([getattr(future, "wrapped_future", None) for future in futures])


def shard_tables(shards: PrefectFutureList[pa.Table],
                 persist: Callable[[int, pa.Table], object] | None = None,
                 address: str | None = None) -> list[pa.Table]:
    """The run stage's tables, in plan order; when one shard fails, the others are cancelled.

    Once every table is in, the shards' results are released on the cluster.

    ``persist(position, table)`` runs as each shard finishes (not when all have): what finished
    survives a driver killed later. Cancelled shards must not outlive the policy's release: a
    shard left queued would start on a worker that joins later, after the policy is gone, and
    fail with ``PolicyIntegrityError``.
    """
    def cancel() -> None:
        release(shards)

    tables: list[pa.Table | None] = [None] * len(shards)
    watch = WorkersWatch(address, cancel) if address else nullcontext(None)
    try:
        with watch:
            if persist is None:
                done = list(shards.result())
            else:
                position = {id(future): i for i, future in enumerate(shards)}
                for future in as_completed(list(shards)):
                    i = position[id(future)]
                    tables[i] = table = future.result()
                    persist(i, table)
                done = [t for t in tables if t is not None]
        # The tables are here now: the scheduler forgets them. Held there, a worker that stops
        # (done_with) lost them, and the scheduler ran the shard again on a worker still up,
        # after the policy's release: a task run that had completed ended Failed, with an ERROR
        # line in a quiet CLI's output.
        cancel()
        return done
    except BaseException as err:
        cancel()
        if isinstance(watch, WorkersWatch) and watch.lost:
            raise ClusterLost(lost_workers(watch.lost, tables)) from err
        if persist is not None and isinstance(err, Exception) and scheduler_lost(err):
            done = [t for t in tables if t is not None]
            raise ClusterLost(
                f"the Dask scheduler was lost during the run stage, after {len(done)} of "
                f"{len(shards)} shards finished; their {sum(t.num_rows for t in done)} episodes "
                "are persisted in the cache. Bring the cluster back (or drop --dask-address) and "
                "run the same request again: only the missing episodes run."
            ) from err
        raise
