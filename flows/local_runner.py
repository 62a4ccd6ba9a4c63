"""The ``Evaluator``'s default runner: the evaluation flow on an API and a cluster kept open.

Registered as the ``local`` entry point of the ``evalfleet.runners`` group (``pyproject.toml``),
which is how the Prefect-free core finds it without importing this layer.
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import ExitStack

from evalfleet.cluster import fleet_cluster
from evalfleet.errors import ClusterLost
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import receive_unloaded
from evalfleet.sandbox.forkclient import shutdown_unused_fork_servers
from evalfleet.suite import Suite, SuiteReport
from flows.eval import evaluate
from flows.runtime import prefect_api, worker_modules
from flows.suite import evaluate_suite
from flows.warm import FeedBackLane, evaluate_warm


class LocalFlowRunner:
    """Runs ``flows.eval.evaluate`` on one Prefect API and one Dask cluster kept open.

    The API (``PREFECT_API_URL``, or a local server started once) and the cluster (``dask_address``,
    or a ``LocalCluster`` of ``workers`` processes started once) live until ``close()``: starting
    them per evaluation would cost seconds each time. Call it from one thread only (the
    ``Evaluator``'s worker thread does), since Prefect's settings context is per thread.

    With ``warm=True`` (the default) an evaluation takes the fast path (``flows.warm``): its report
    comes back after stage 6, and stage 7 (files, MLflow, Prefect artifacts) follows on a
    background lane; ``final_report(request_id)`` is its future, ``drain()`` and ``close()`` wait
    for it. ``warm=False`` runs the whole ``evaluate()`` flow per call.
    """

    def __init__(self, workers: int = 2, dask_address: str | None = None, warm: bool = True) -> None:
        self.workers = workers
        self.dask_address = dask_address
        self.warm = warm
        self._stack: ExitStack | None = None
        self._address: str | None = None
        self._lane = FeedBackLane()

    def _open(self) -> str:
        stack = ExitStack()
        try:
            stack.enter_context(prefect_api())
            address = stack.enter_context(fleet_cluster(  # the Evaluator's policies are torch
                self.dask_address, self.workers, worker_modules(torch=True)))
        except BaseException:
            stack.close()
            raise
        self._stack, self._address = stack, address
        return address

    def __call__(self, request: EvalRequest) -> EvalReport:
        """Evaluate ``request`` on the kept cluster."""
        if self._address is None and self.dask_address is None:
            # Stage 1 but the policy's check, before the first call opens a server and cluster:
            # an unknown env, bad kwargs or a folder that is a file fail with nothing started.
            receive_unloaded(request)
        address = self._address or self._open()
        try:
            if self.warm:
                return evaluate_warm(request.model_copy(update={"dask_address": address}), address,
                                     self._lane)
            return evaluate(request.model_copy(update={"dask_address": address}))
        except ClusterLost:  # the kept cluster is unusable: the next evaluation starts afresh
            stack, self._stack, self._address = self._stack, None, None
            if stack is not None:
                stack.close()
            raise

    def suite(self, suite: Suite, request: EvalRequest) -> SuiteReport:
        """Evaluate every task of ``suite`` with ``request``'s policy and protocol on the kept cluster."""
        address = self._address or self._open()
        return evaluate_suite(suite, request.model_copy(update={"dask_address": address}))

    def final_report(self, request_id: str) -> Future[EvalReport] | None:
        """The future report of ``request_id`` once its stage 7 ran (None: not a fast-path run)."""
        return self._lane.result(request_id)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every evaluation's stage 7 (files, MLflow, artifacts) has finished."""
        self._lane.drain(timeout)

    def close(self) -> None:
        """Finish pending stage 7s, then stop the local cluster and API server this runner started."""
        try:
            self._lane.close()
        finally:
            stack, self._stack, self._address = self._stack, None, None
            try:
                if stack is not None:
                    stack.close()
            finally:  # the replays' sandboxes of stage 7 ran here: nothing they started outlives us
                # but what another runner of this process is replaying in (it stops them itself).
                shutdown_unused_fork_servers()
