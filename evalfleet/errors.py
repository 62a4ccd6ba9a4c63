"""The errors evalfleet raises.

Hierarchy::

    EvalfleetError
    ├── RequestError          a request field is invalid (raised before anything is spawned)
    │   ├── EnvSpecError      the environment cannot be made or does not fit the protocol
    │   ├── PolicyError       the policy cannot be loaded or does not fit the env's spaces
    │   └── SuiteError        a suite file, or a score matrix given to ``aggregates``, is invalid
    ├── IsolationUnavailable  the requested sandbox level cannot be had on this machine
    ├── PolicyIntegrityError  a worker received policy bytes whose sha256 does not match
    ├── CacheCorruptError     a stored cache entry failed verification
    ├── CacheLockTimeout      a cache key stayed locked by another evaluation for too long
    ├── ServerError           the shared local Prefect server could not be started or stopped
    ├── ClusterLost           the Dask scheduler went away during the run stage
    └── BaselineUnavailable   the baseline's episodes, found at stage 1, could not be had after the run

    Stopped (a BaseException, like KeyboardInterrupt: no ``except Exception`` swallows it)
                              the process was asked to stop (SIGTERM) while it worked or waited

Messages say what was expected, what came (``!r``) and what to do next.
"""

from __future__ import annotations


class EvalfleetError(Exception):
    """Base class of every error evalfleet raises on purpose."""


class RequestError(EvalfleetError, ValueError):
    """A request is invalid; raised before any worker is touched."""


class EnvSpecError(RequestError):
    """The environment id, kwargs or spec cannot be used."""


class PolicyError(RequestError):
    """The policy cannot be loaded, or its outputs do not fit the action space."""


class SuiteError(RequestError):
    """A suite (``suite.toml``) or a score matrix for ``evalfleet.aggregates`` cannot be used."""


class IsolationUnavailable(EvalfleetError):
    """The requested isolation level needs something this machine does not allow."""


class SandboxUnconfined(EvalfleetError):
    """A worker's sandbox could not apply the confinement its level promised; it ran no env code.

    The promise is the driver's isolation probe, which the report's manifest states (Landlock,
    the sandbox's namespaces): a worker without one (a kernel without Landlock, say) would have
    run the env with less. A harness fault of that worker, not of the request.
    """


class PolicyIntegrityError(EvalfleetError):
    """Policy bytes that arrived on a worker do not hash to the expected sha256."""


class CacheCorruptError(EvalfleetError):
    """A cache entry is truncated, unreadable or does not match its manifest."""


class CacheLockTimeout(EvalfleetError, TimeoutError):
    """Another evaluation held a cache key's lock for longer than the wait allows."""


class ServerError(EvalfleetError):
    """The shared local Prefect server could not be started, reached or stopped."""


class ClusterLost(EvalfleetError):
    """The Dask scheduler was lost mid-run; the shards that finished are persisted in the cache."""


class WorkerKilled(EvalfleetError):
    """A shard's code (its policy, or an in-process env) killed each Dask worker that ran it."""


class OutputsMissing(EvalfleetError):
    """Results came back, but outputs asked for with them were not all produced.

    The numbers stand (Parquet and the cache are written before anything else); what failed is
    named per evaluation: its stage 7 (report.json, plots, MLflow run, Prefect artifacts), an
    output it could not produce, or the ``on_result`` callback given to the ``Evaluator``.
    """


class Stopped(BaseException):
    """The process received a termination signal; raised where it was, so cleanup runs."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class BaselineUnavailable(EvalfleetError):
    """The baseline's episodes could not be had once the evaluation had run.

    Stage 1 found them (``pipeline.check_hash_baseline``, the baseline's own stage 1); what
    changed meanwhile (the cache, the baseline's file) is no fault of the request, and the
    evaluated policy's episodes ran: not ``RequestError``'s "nothing was spawned".
    """


class StaleWorkerCode(EvalfleetError):
    """A Dask worker runs other code than the evaluation's cache key names.

    A long-lived worker keeps the modules it imported: an env, factory or helper file edited
    since (or another install on that machine) would run under a key that names the new code.
    """
