"""The ``Evaluator``'s default runner: the evaluation flow on an API and a cluster kept open.

Registered as the ``local`` entry point of the ``evalfleet.runners`` group (``pyproject.toml``),
which is how the Prefect-free core finds it without importing this layer.
"""

from __future__ import annotations

from contextlib import ExitStack

from evalfleet.cluster import fleet_cluster
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.suite import Suite, SuiteReport
from flows.eval import evaluate
from flows.runtime import prefect_api
from flows.suite import evaluate_suite


class LocalFlowRunner:
    """Runs ``flows.eval.evaluate`` on one Prefect API and one Dask cluster kept open.

    The API (``PREFECT_API_URL``, or a local server started once) and the cluster (``dask_address``,
    or a ``LocalCluster`` of ``workers`` processes started once) live until ``close()``: starting
    them per evaluation would cost seconds each time. Call it from one thread only (the
    ``Evaluator``'s worker thread does), since Prefect's settings context is per thread.
    """

    def __init__(self, workers: int = 2, dask_address: str | None = None) -> None:
        self.workers = workers
        self.dask_address = dask_address
        self._stack: ExitStack | None = None
        self._address: str | None = None

    def _open(self) -> str:
        stack = ExitStack()
        try:
            stack.enter_context(prefect_api())
            address = stack.enter_context(fleet_cluster(self.dask_address, self.workers))
        except BaseException:
            stack.close()
            raise
        self._stack, self._address = stack, address
        return address

    def __call__(self, request: EvalRequest) -> EvalReport:
        """Evaluate ``request`` on the kept cluster."""
        address = self._address or self._open()
        return evaluate(request.model_copy(update={"dask_address": address}))

    def suite(self, suite: Suite, request: EvalRequest) -> SuiteReport:
        """Evaluate every task of ``suite`` with ``request``'s policy and protocol on the kept cluster."""
        address = self._address or self._open()
        return evaluate_suite(suite, request.model_copy(update={"dask_address": address}))

    def close(self) -> None:
        """Stop the local cluster and API server this runner started (if any)."""
        stack, self._stack, self._address = self._stack, None, None
        if stack is not None:
            stack.close()
