"""The in-loop evaluation's fast path: the result first, the report's files and records after.

``evaluate()`` runs the seven stages as a Prefect flow of Dask-mapped tasks: right for a CLI run
or a deployment, but each task run costs tens of milliseconds of API calls and serialisation, and
stage 7 (plots, the HTML page, replays, MLflow, Prefect artifacts) takes seconds. A training loop
waits only for the numbers. ``evaluate_warm`` runs stages 1-6 in this process on the kept cluster
(the run stage as raw Dask tasks, one per shard) and returns the report at once, with Parquet
written and ``outputs`` saying where the rest will land; a ``FeedBackLane`` then runs stage 7 as
the ``evalfleet-feed-back`` Prefect flow (its task writes the same files, MLflow run and Prefect
artifacts as ``eval_flow``'s), in order, on one background thread. ``drain()`` waits for it.

Adaptive and paired requests (rounds, a baseline) take ``evaluate()``, unchanged.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path

import dask
import pyarrow as pa
from distributed import as_completed
from prefect import flow

from evalfleet.audit import RoundSchedule
from evalfleet.cluster import WorkersWatch, client_for, installed, lost_workers
from evalfleet.errors import ClusterLost, OutputsMissing
from evalfleet.models import OUTPUT_MISSING, RECORDING_INCOMPLETE, EvalReport, EvalRequest
from evalfleet.pipeline import (
    Collected,
    Received,
    collect,
    distribute,
    key_held,
    plan,
    receive,
    release_history_claim,
    scrubbed,
    shard_persister,
    spawn,
    store_in_cache,
    summarize,
    take_history_claim,
    with_history,
)
from evalfleet.records import stamp_evaluation
from evalfleet.storage import run_dir, write_episodes
from evalfleet.tracking import default_tracking_uri
from evalfleet.worker import execute_shard
from flows.api_ledger import api_ledger, kept, run_recorded, settle
from flows.eval import evaluate, gpu
from tasks.feed_back import feed_back

logger = logging.getLogger(__name__)

#: Evaluations whose stage 7 the background flow run picks up, by request id (in-process only:
#: the episode table never travels as a flow parameter).
_waiting: dict[str, tuple[EvalRequest, Received, EvalReport, Collected]] = {}
_waiting_lock = threading.Lock()


def warm_eligible(request: EvalRequest) -> bool:
    """Requests the fast path serves: a fixed episode count, no baseline."""
    return request.target_ci_halfwidth is None and request.baseline is None


def evaluate_warm(request: EvalRequest, address: str, lane: FeedBackLane) -> EvalReport:
    """Stages 1-6 here and on the cluster at ``address``; stage 7 queued on ``lane``.

    The returned report is the one ``evaluate()`` returns before its stage 7, with Parquet
    written and ``outputs`` naming where report.json, the review files and the MLflow run will be
    (``outputs['feed_back']`` is ``'pending'`` until the lane has run; ``lane.result(request_id)``
    gives the final report).
    """
    if not warm_eligible(request):
        return evaluate(request.model_copy(update={"dask_address": address}))
    # The claim is the lane's once stage 7 is queued (``recorded_feed_back`` releases it). Held
    # by a context manager handed on with ``ExitStack.pop_all()``, it was released at once: the
    # popped stack, dropped, closed the claim's generator, and a later step of the run read its
    # history before this one's MLflow run was logged.
    take_history_claim(request)
    try:
        return stages_here(request, address, lane)
    except BaseException:
        release_history_claim(request)
        raise


def stages_here(request: EvalRequest, address: str, lane: FeedBackLane) -> EvalReport:
    """``evaluate_warm``'s stages 1-6, and stage 7 queued on ``lane``."""
    received = receive(request)                                                  # 1
    schedule = RoundSchedule(request)
    with key_held(request, received.cache_key):
        planned = plan(request, received, address, request.episodes)             # 2
        planned = spawn(request, received, address, planned)
        handle = distribute(request, received, address if planned.shards else None)  # 3
        with installed(handle, address):
            tables = []
            if planned.shards:                                                   # 4
                client = client_for(address)
                with dask.annotate(resources=gpu(received)):
                    futures = [client.submit(execute_shard, shard, handle, request,
                                             received.isolation, pure=False)
                               for shard in planned.shards]
                persist = shard_persister(request, received, planned)
                position = {f.key: i for i, f in enumerate(futures)}
                done: list[pa.Table | None] = [None] * len(futures)
                with WorkersWatch(address, lambda: client.cancel(futures)) as watch:
                    try:  # each shard persisted as it finishes: a killed trainer loses none
                        for future in as_completed(futures, loop=client.loop):
                            i = position[future.key]
                            done[i] = table = future.result()
                            persist(i, table)
                        tables = [t for t in done if t is not None]
                    except BaseException as err:
                        client.cancel(futures)  # none may outlive the policy's release
                        if watch.lost:
                            raise ClusterLost(lost_workers(watch.lost, done)) from err
                        raise
            collected = collect(tables, handle, planned)                         # 5
        schedule.next_episodes(collected.table)
        store_in_cache(request, received, collected)
    report = summarize(request, received, schedule, collected)                   # 6
    if request.training_run_id is not None and request.step is not None:
        # The verdict and alarms are numbers training acts on: they come with the result. The
        # run's earlier checkpoints are compared once their own stage 7 has logged them.
        lane.wait()  # what went missing there is raised by flush(), not by this evaluation
        report = with_history(request, report, collected.table)
    folder = run_dir(request.output, request.request_id)
    parquet = write_episodes(stamp_evaluation(collected.table, request.request_id,
                                              request.training_run_id,
                                              request.step), folder / "episodes.parquet")
    outputs = {
        "folder": str(folder.resolve()),
        "episodes": str(parquet.resolve()),
        "report": str((folder / "report.json").resolve()),
        "mlflow_uri": request.mlflow_uri or default_tracking_uri(request.output),
        "feed_back": "pending",
    }
    report = scrubbed(report.model_copy(update={"outputs": outputs}))
    lane.submit(request, received, report, collected)                            # 7, after
    return report


@flow(name="evalfleet-feed-back", flow_run_name="{request.env}-{request.request_id}",
      log_prints=False)
def feed_back_flow(request: EvalRequest) -> EvalReport:
    """Stage 7 of an evaluation whose stages 1-6 ran on the fast path: files, MLflow, artifacts."""
    with _waiting_lock:
        request, received, report, collected = _waiting.pop(request.request_id)
    return kept(feed_back(request, received, report, collected))


def recorded_feed_back(request: EvalRequest) -> EvalReport:
    """``feed_back_flow``: a Prefect API lost on the way costs its UI, not its report."""
    try:
        with api_ledger() as ledger:
            return settle(run_recorded(lambda: feed_back_flow(request), "the feed-back flow run"),
                          ledger)
    finally:  # logged or queued (or failed): later steps of the run may be judged now
        release_history_claim(request)


#: Niceness added to the feed-back lane's thread (Linux: a thread's own scheduling priority).
LANE_NICENESS = 19


def lower_this_threads_priority(by: int = LANE_NICENESS) -> bool:
    """Make the calling thread yield the CPU to the rest of the process and to the workers.

    Stage 7 (plots, the report page, MLflow) of one evaluation runs while the next one's episodes
    step: with the local cluster's workers on this machine's cores, at equal priority it took
    ~3 CPU-s of a 4,000-episode Acrobot run stage from them. At a higher niceness it still runs
    at full speed on an idle core. Linux only (elsewhere ``setpriority`` of a thread id would
    renice the whole process): False where nothing changed.

    Threads this one starts inherit the niceness, so Prefect's process-wide event loop thread
    (which the driver's own API calls go through) is started first, at the caller's priority.
    """
    if sys.platform != "linux":
        return False
    try:
        from prefect._internal.concurrency.threads import get_global_loop
    except ImportError:  # another Prefect layout: its loop may start at the lane's priority
        pass
    else:
        get_global_loop()
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + by)
    except OSError:
        return False
    return True


class FeedBackLane:
    """Runs queued stage-7 flows one at a time on a background thread, in submission order.

    The thread runs at a lower priority (``lower_this_threads_priority``): the next
    evaluation's run stage comes first.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="evalfleet-feed-back",
                                        initializer=lower_this_threads_priority)
        self._futures: dict[str, Future[EvalReport]] = {}
        self._problems: list[str] = []  # not yet raised by drain()
        self._problems_lock = threading.Lock()

    def submit(self, request: EvalRequest, received: Received, report: EvalReport,
               collected: Collected) -> Future[EvalReport]:
        """Queue stage 7 of ``request``; the future gives the final report."""
        with _waiting_lock:
            _waiting[request.request_id] = (request, received, report, collected)
        # The thread must see this caller's Prefect settings (API URL), not the process defaults.
        context = contextvars.copy_context()
        future = self._pool.submit(context.run, self._run_and_check, request, report)
        self._futures[request.request_id] = future
        future.add_done_callback(lambda f: release_history_claim(request))  # cancelled, too
        return future

    def _run_and_check(self, request: EvalRequest, returned: EvalReport) -> EvalReport:
        """Run stage 7 of ``request``, noting what it lacked before its future completes.

        Not a done-callback: ``concurrent.futures`` wakes the waiters of ``drain()`` before it
        runs those, so a failure noted there could be missed by the drain that waited on it.
        """
        try:
            final = recorded_feed_back(request)
        except BaseException as err:  # what the future would carry
            self._check(request, returned, None, err)
            raise
        self._check(request, returned, final, None)
        return final

    def result(self, request_id: str) -> Future[EvalReport] | None:
        """The future final report of ``request_id`` (None if it never went through the lane)."""
        return self._futures.get(request_id)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every queued stage 7 has finished; ``TimeoutError`` after ``timeout`` s."""
        pending = [f for f in self._futures.values() if not f.done()]
        _, running = wait_for(pending, timeout)
        if running:
            raise TimeoutError(f"stage 7 (files, MLflow, artifacts) of {len(running)} evaluations "
                               f"still running after {timeout} s; call flush() again to wait on")

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every queued stage 7 has finished, at most ``timeout`` seconds in all.

        Raises ``TimeoutError`` when some are still running after it, and ``OutputsMissing``
        naming each evaluation whose stage 7 failed, could not produce an output asked for, or
        found an alarm (a harness fault) its returned result lacked (each is raised once: a
        later drain raises only new ones).
        """
        self.wait(timeout)
        with self._problems_lock:
            problems, self._problems = self._problems, []
        if problems:
            raise OutputsMissing("results were returned, but their stage 7 did not end as they "
                                 "said: " + "; ".join(problems))

    def close(self) -> None:
        """Finish what is queued, then stop the thread; raises what ``drain`` raises."""
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)

    def _check(self, request: EvalRequest, returned: EvalReport, final: EvalReport | None,
               err: BaseException | None) -> None:
        """Note what the next ``drain()`` raises: a failed stage 7 (``err``), or what ``final`` lacked.

        An output it could not produce, an alarm or a harness fault it found that the
        ``returned`` result did not carry. Stage 7 replays episodes: ``recording_incomplete``
        (a harness fault) and ``replay_nondeterminism`` come from there, after the numbers.
        """
        folder = Path(run_dir(request.output, request.request_id))
        if err is not None:
            logger.error("feed back of %s failed: %s; the episodes are in %s", request.request_id,
                         err, folder)
            problems = [f"stage 7 failed ({type(err).__name__}: {err}; the episodes are in "
                        f"{folder})"]
        else:
            assert final is not None
            problems = list(final.missing_outputs)
            had = {a.split(":", 1)[0] for a in returned.alarms}
            late = [a for a in final.alarms if a.split(":", 1)[0] not in had
                    and a.split(":", 1)[0] not in (OUTPUT_MISSING, RECORDING_INCOMPLETE)]
            if late:
                problems.append("alarms the returned result did not carry: " + "; ".join(late))
            if final.harness_fault and not returned.harness_fault:
                problems.append("the evaluation is a harness fault (the returned result said not)")
        if problems:
            with self._problems_lock:
                self._problems.append(f"{request.request_id}: {'; '.join(problems)}")
