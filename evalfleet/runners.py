"""What runs one evaluation for the ``Evaluator``: a ``Runner``, and how the default one is found.

A runner is any ``runner(request) -> EvalReport``, with an optional ``close()`` the evaluator calls
once at shutdown. Two ship with evalfleet, both above the core because both talk to Prefect:

- ``flows.local_runner.LocalFlowRunner``: the seven-stage flow on one Prefect API and one Dask
  cluster kept open for the evaluator's lifetime (the default);
- ``deployments.runner.DeploymentRunner``: a flow run of the served deployment.

The core names no module of those layers. The default runner is looked up through the
``evalfleet.runners`` entry point group (``local`` in evalfleet's ``pyproject.toml``), the way a
plugin is: another package can register its own ``local`` and the Evaluator uses it unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from evalfleet.errors import EvalfleetError
from evalfleet.models import EvalReport, EvalRequest

logger = logging.getLogger(__name__)

#: ``runner(request) -> EvalReport``: runs one evaluation and returns its report.
Runner = Callable[[EvalRequest], EvalReport]
#: ``factory(workers, dask_address) -> Runner``: what an ``evalfleet.runners`` entry point names.
RunnerFactory = Callable[[int, "str | None"], Runner]

#: The entry point group runners are registered in.
RUNNER_GROUP = "evalfleet.runners"
#: The entry point the ``Evaluator`` uses when it is given no runner.
LOCAL_RUNNER = "local"


class EvaluationFailed(EvalfleetError):
    """An evaluation did not produce a report; the cause is chained (``__cause__``)."""


class RunnerNotFound(EvalfleetError):
    """No runner is registered under the requested entry point name."""


def find_runner(name: str = LOCAL_RUNNER) -> EntryPoint:
    """The entry point ``name`` of the ``evalfleet.runners`` group, without importing it.

    Only the installed packages' metadata is read here (no flow or Prefect import), so the
    ``Evaluator`` can check at construction that its default runner exists.
    """
    found = entry_points(group=RUNNER_GROUP, name=name)
    if not found:
        raise RunnerNotFound(
            f"no evaluation runner {name!r} is registered in the {RUNNER_GROUP!r} entry point group "
            f"(found: {sorted(ep.name for ep in entry_points(group=RUNNER_GROUP)) or 'none'}). "
            "evalfleet registers 'local' in its pyproject.toml: install or refresh the package "
            "('pip install -e .' in the checkout) so its metadata has it, or pass runner=... "
            "(e.g. deployments.runner.DeploymentRunner)."
        )
    chosen = sorted(found, key=lambda ep: ep.value)[0]
    if len({ep.value for ep in found}) > 1:
        logger.warning("several %r runners are registered (%s); using %s", name,
                       ", ".join(sorted(ep.value for ep in found)), chosen.value)
    return chosen


def load_runner(entry_point: EntryPoint, workers: int, dask_address: str | None) -> Runner:
    """Import ``entry_point``'s factory and build a runner for ``workers`` / ``dask_address``."""
    factory = entry_point.load()
    if not callable(factory):
        raise RunnerNotFound(
            f"entry point {entry_point.name}={entry_point.value!r} of {RUNNER_GROUP!r} must name a "
            f"callable (workers, dask_address) -> runner (got {type(factory).__name__})."
        )
    runner: Runner = factory(workers, dask_address)
    return runner


__all__ = [
    "LOCAL_RUNNER",
    "RUNNER_GROUP",
    "EvaluationFailed",
    "Runner",
    "RunnerFactory",
    "RunnerNotFound",
    "find_runner",
    "load_runner",
]
