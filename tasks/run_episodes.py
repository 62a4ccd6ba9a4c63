"""Stage 4: run episodes (one coarse task per shard, mapped over the Dask cluster)."""

import re
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFutureList, as_completed

from evalfleet.cluster import WorkersWatch, forget_results, lost_workers, scheduler_lost
from evalfleet.errors import ClusterLost, WorkerKilled
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


def worker_killed(err: BaseException, position: int | None, plan: Sequence[Shard],
                  finished: int) -> WorkerKilled | None:
    """What a Dask ``KilledWorker`` of the shard at ``position`` means, or None for another error.

    Dask runs a shard whose worker died on other workers, and gives up once it has killed
    several: it is the shard's own code that ends the process (its policy's forward, or an env
    that runs in-process), not the cluster. Passed on as is, the error named a task key and
    nothing to do.
    """
    if type(err).__name__ != "KilledWorker":
        return None
    allowed = getattr(err, "allowed_failures", None)
    try:
        found = re.search(r"on (\d+) different workers", str(err))
    except Exception:  # its text reads attributes a deserialised one may lack
        found = None
    tries = str(allowed + 1) if isinstance(allowed, int) else found.group(1) if found else "several"
    which = "a shard"
    if position is not None and position < len(plan):
        shard = plan[position]
        first, last = min(shard.episode_indices), max(shard.episode_indices)
        which = (f"shard {position + 1} of {len(plan)} (episodes {first}-{last}, "
                 f"{len(shard.episode_indices)} of them)")
    return WorkerKilled(
        f"{which} killed every Dask worker that ran it ({tries} "
        "workers, then Dask gave up): its code ended the worker process (a segfault, abort, "
        "os._exit or SystemExit). The policy always runs in the worker, and so does the env "
        "at --isolation inprocess; in a process or bwrap sandbox an env's crash ends only its "
        f"episode, as a crashed row. {finished} finished shards are persisted in the cache. "
        "Check the policy on that shard's observations (a callable policy's native code, a "
        "torch extension), or run an untrusted env with --isolation process; the same request "
        "runs only the missing episodes again.")


def shard_tables(shards: PrefectFutureList[pa.Table],
                 persist: Callable[[int, pa.Table], object] | None = None,
                 address: str | None = None, plan: Sequence[Shard] = ()) -> list[pa.Table]:
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
    at: int | None = None  # the shard whose result is awaited
    try:
        with watch:
            if persist is None:
                done = list(shards.result())
            else:
                position = {id(future): i for i, future in enumerate(shards)}
                for future in as_completed(list(shards)):
                    i = at = position[id(future)]
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
        killed = worker_killed(err, at, plan, sum(t is not None for t in tables))
        if killed is not None:
            raise killed from err
        raise
