"""The in-loop client: evaluate a training policy without stopping training.

The API has the shape of TorchRL's ``Evaluator``::

    with Evaluator(env="CartPole-v1", policy_factory=build_policy, num_episodes=100,
                   busy_policy="queue", on_result=log) as evaluator:
        for step in range(updates):
            train_one_update(model)
            evaluator.trigger_eval(model, step)      # returns at once; training goes on
            for result in iter(evaluator.poll, None):
                print(result["eval/reward"])
        evaluator.wait(timeout=600)

Every evaluation goes through the same seven-stage flow and Dask cluster as the CLI and the
webhook, run by a ``Runner`` (``evalfleet.runners``): by default the flow on one local cluster and
one Prefect API kept open for the evaluator's lifetime (the ``local`` entry point of the
``evalfleet.runners`` group, ``flows.local_runner.LocalFlowRunner``), or a deployment on a Prefect
server (``deployments.runner.DeploymentRunner``), or any ``runner(request) -> EvalReport`` you pass.

Weights cross into the evaluation as a file (``evalfleet.snapshots``): a state_dict plus
``policy_factory`` when one is given, else the module compiled to TorchScript. ``trigger_eval``
only copies the weights off the training device (a non-blocking copy on CUDA); serialising,
hashing and evaluating happen on one background thread, where ``on_result`` runs too.

This module imports neither Prefect nor the flow layer: the default runner is found by entry
point and imported on that background thread.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from evalfleet.claims import wait_s
from evalfleet.errors import EvalfleetError, OutputsMissing, PolicyError, SuiteError
from evalfleet.models import EvalReport, EvalRequest, check_training_pair
from evalfleet.runners import EvaluationFailed, Runner, find_runner, load_runner
from evalfleet.snapshots import PolicyWriter, WeightSnapshot, factory_ref, snapshot_weights
from evalfleet.storage import read_episodes

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

BUSY_POLICIES = ("error", "queue", "skip")
#: Request fields the evaluator sets itself; pass them through its own arguments instead.
_OWN_FIELDS = ("policy", "policy_factory", "episodes", "env", "device", "step",
               "training_run_id", "request_id")

Result = dict[str, Any]


class EvaluatorBusy(EvalfleetError):
    """``trigger_eval`` with ``busy_policy='error'`` while an evaluation is still pending."""


class EvaluatorClosed(EvalfleetError):
    """The evaluator was shut down; create a new one."""


# ---------------------------------------------------------------------------------- evaluator


def _number(value: float | None) -> float:
    """A report number that JSON may have nulled (nothing scored) as the NaN it was."""
    return float("nan") if value is None else float(value)


def result_from_report(report: EvalReport, step: int | None) -> Result:
    """The result dict: TorchRL-style ``eval/...`` keys plus the full report under ``report``."""
    return {
        "eval/reward": report.mean,
        "eval/coverage": report.coverage,
        "eval/reward_ci_low": report.ci[0],
        "eval/reward_ci_high": report.ci[1],
        "eval/episode_length": _number(report.lengths["mean"]),
        # None when nothing ran (a full cache hit): no rate was measured.
        "eval/fps": None if report.steps_per_second is None else float(report.steps_per_second),
        "eval/step": step,
        "eval/episodes": report.episodes,  # planned, as the MLflow run's metric of that name
        "eval/scored": report.scored,  # the episodes behind eval/reward
        "eval/failure_rate": report.failure_rate,
        "eval/policy_failure_rate": report.policy_failure_rate,
        "report": report,
        **history_result(report),
    }


def history_result(report: EvalReport) -> Result:
    """The history's keys of a result: verdict, best checkpoint's step and weights hash; alarms.

    ``eval/verdict`` is None for an evaluation without a training run id and step.
    ``eval/alarms`` names every alarm of the evaluation (the report's, then the history's):
    a harness fault, policy failures, a determinism mismatch are alarms of the result too.
    """
    h = report.history or {}
    names = [a.split(":", 1)[0] for a in report.alarms] + [a["alarm"] for a in h.get("alarms") or []]
    return {
        "eval/verdict": h.get("verdict"),
        "eval/best_step": h.get("best_step"),
        "eval/best_policy_sha256": h.get("best_policy_sha256"),
        "eval/alarms": list(dict.fromkeys(names)),
        "eval/harness_fault": report.harness_fault,
    }


def suite_result(report: Any, step: int | None) -> Result:
    """A suite's result dict: ``eval/suite/<aggregate>`` with its interval, IQM as ``eval/reward``.

    Also the probability of improvement over a baseline when there is one, ``eval/coverage`` (the
    lowest of the tasks'), ``eval/harness_fault`` and ``eval/alarms`` (the suite's and its tasks',
    by name, as ``history_result``'s), and the suite report under ``report``.
    """
    from evalfleet.tracking import suite_result_metrics

    out: Result = dict(suite_result_metrics(report.aggregates, report.probability_of_improvement,
                                            len(report.tasks), report.coverage))
    out.update({"eval/suite/tasks": len(report.tasks), "eval/step": step,
                "eval/alarms": report.alarm_names, "eval/harness_fault": report.harness_fault,
                "report": report})
    return out


@dataclass
class _Job:
    request: EvalRequest
    snapshot: WeightSnapshot
    future: Future[Result]


class Evaluator:
    """Evaluate training weights on the fleet, blocking (``evaluate``) or not (``trigger_eval``).

    Args:
        env: Gymnasium id of the evaluation env (``'module:EnvId-v0'`` imports ``module`` first);
            default ``'CartPole-v1'``.
        policy_factory: ``'module:function'`` or a module-level function building the
            ``nn.Module``; weights then travel as a state_dict. Without it an ``nn.Module`` is
            compiled to TorchScript, and a bare state_dict is refused.
        num_episodes: Episodes per evaluation (default 100).
        busy_policy: What ``trigger_eval`` does while an evaluation is pending: ``'error'``
            raises ``EvaluatorBusy``, ``'queue'`` runs requests in order, ``'skip'`` drops the new
            request (logged, counted in ``skipped``, returns None).
        on_result: Called with each result dict on the background thread; what it raises
            (``SystemExit`` too) is logged, and raised by the next ``flush()`` or ``shutdown()``
            as ``OutputsMissing``.
        metrics_fn: Extra metrics from the episode table (one row per episode, the Parquet
            schema); merged into the result dict. Refused with ``suite`` (one table per task).
        device: Where workers run the policy: ``'cpu'``, ``'cuda[:N]'`` or ``'auto'``.
        training_run_id: The trainer's run id (an MLflow run id nests the evaluation runs under it).
        runner: ``runner(request) -> EvalReport``; default: the ``local`` runner registered in
            the ``evalfleet.runners`` entry point group (the flow on a local cluster).
        suite: A suite file (``suite.toml``, see ``evalfleet.suite``): each evaluation runs every
            task of the suite (its tasks set the env, episodes, kwargs and step cap: ``env``,
            ``num_episodes``, ``env_kwargs`` and ``max_steps`` are refused with it) and the
            result holds the suite's aggregates (``eval/suite/iqm``, ...; ``eval/reward`` is the
            IQM), ``eval/coverage`` (the lowest task's), ``eval/harness_fault`` and
            ``eval/alarms``; an output it could not produce (its MLflow run, a task's) is raised
            by the next ``flush()`` or ``shutdown()`` as ``OutputsMissing``. Needs a runner with a
            ``suite(suite, request)`` method, as the default one has.
        **request_fields: Any other ``EvalRequest`` field (``seed``, ``env_kwargs``, ``workers``,
            ``dask_address``, ``output``, ``mlflow_uri``, ``experiment``, ``max_steps``, ...).
    """

    def __init__(
        self,
        env: str | None = None,
        policy_factory: str | Callable[..., Any] | None = None,
        num_episodes: int | None = None,
        *,
        busy_policy: str = "error",
        on_result: Callable[[Result], None] | None = None,
        metrics_fn: Callable[[pa.Table], Mapping[str, float]] | None = None,
        device: str = "cpu",
        training_run_id: str | None = None,
        runner: Runner | None = None,
        suite: str | Path | None = None,
        **request_fields: Any,
    ) -> None:
        if env is not None and not isinstance(env, str):
            raise TypeError(
                f"'env' must be a Gymnasium id string (got {type(env).__name__}): workers build "
                "their own env instances by id, e.g. 'CartPole-v1' or 'my_pkg.envs:Maze-v0'."
            )
        if busy_policy not in BUSY_POLICIES:
            raise ValueError(
                f"Unknown busy_policy {busy_policy!r}. Choose 'error', 'queue', or 'skip'."
            )
        clash = sorted(set(request_fields) & set(_OWN_FIELDS))
        if clash:
            raise TypeError(
                f"{', '.join(map(repr, clash))} are set by the Evaluator itself; use its own "
                "arguments (env, policy_factory, num_episodes, device, training_run_id) and the "
                "'step' of each call."
            )
        if suite is not None:
            from evalfleet.suite import refuse_task_settings

            # The suite's tasks set these: Evaluator(suite=..., env="Acrobot-v1", num_episodes=50)
            # ran the suite file's envs and budgets, without a word.
            given = [name for name, value in (("env", env), ("num_episodes", num_episodes))
                     if value is not None] + [name for name in ("env_kwargs", "max_steps")
                                              if name in request_fields]
            refuse_task_settings(list(map(repr, given)), "'suite'", f"the suite file {str(suite)!r}")
            if metrics_fn is not None:  # it was never called: the result lacked its keys, silently
                raise SuiteError(
                    f"'metrics_fn' cannot be used with 'suite' (got {metrics_fn!r}): it computes "
                    "metrics from one evaluation's episode table, and a suite has one per task. "
                    "Drop it; to compute a metric per task, read each task's table in on_result: "
                    "evalfleet.storage.read_episodes(Path(row['episodes_file'])) for row in "
                    "result['report'].tasks.")
        env = "CartPole-v1" if env is None else env
        num_episodes = 100 if num_episodes is None else num_episodes
        self.factory = factory_ref(policy_factory) if policy_factory is not None else None
        if self.factory is not None:  # a factory that cannot be imported fails here, not at step 1
            from evalfleet.policy import import_object

            if not callable(import_object(self.factory, "policy_factory")):
                raise PolicyError(f"policy_factory {self.factory!r} is not callable: pass the "
                                  "function that builds the nn.Module for a state_dict.")
        fields = dict(request_fields)
        fields["output"] = Path(fields.get("output", "results")).resolve()
        # Validate every field now, before any thread, cluster or server exists.
        # Each call sets its step; the template is checked as such a call (step 0) would be, or
        # an option that needs a step (outcome_metric) could never be used.
        self._template = EvalRequest.build(
            env=env, episodes=num_episodes, device=device, training_run_id=training_run_id,
            policy="(set per evaluation)", policy_factory=self.factory,
            **({"step": 0} if training_run_id is not None else {}), **fields,
        ).model_copy(update={"step": None})
        if training_run_id is not None:  # every call's stage 7 waits this long for earlier steps
            wait_s()
        from evalfleet.suite import load_suite

        self.suite = load_suite(suite) if suite is not None else None  # a bad suite fails here
        if suite is not None and runner is not None and not callable(getattr(runner, "suite", None)):
            # Accepted here, it failed on every trigger: the training loop learnt of it at its first
            # checkpoint. (A runner found by entry point is loaded at the first call, checked there.)
            raise SuiteError(
                f"the runner {runner!r} cannot run suites: it has no suite(suite, request) method. "
                "Use the default runner (leave 'runner' out), give the runner a suite method, or "
                "drop 'suite'.")
        self.busy_policy = busy_policy
        self.on_result = on_result
        self.metrics_fn = metrics_fn
        self.skipped = 0
        self.best_step: int | None = None
        """Training step of the best checkpoint as the latest result's history says it (its
        ``eval/best_step``; needs training_run_id): None when that result could establish none
        (protocol changed, history unreadable, a step evaluated with two policies, a withheld
        first). A result never keeps an older best the history no longer stands by."""
        self.best_policy_sha256: str | None = None
        """Weights hash of that checkpoint (the latest result's ``eval/best_policy_sha256``)."""
        self._runner: Runner | None = runner
        # Found now (metadata only, nothing imported) so a missing runner fails before any thread.
        self._default_runner = find_runner() if runner is None else None
        self._writer = PolicyWriter(self._template.output / "policies", self.factory)
        self._structure: tuple[Any, ...] | None = None  # that of the latest snapshot queued
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._triggered: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        self._unraised: list[str] = []  # on_result failures for flush()/shutdown() to raise
        self._close_error: BaseException | None = None
        # The worker thread runs in a copy of the creator's context: context-local settings (e.g.
        # a Prefect API URL set with temporary_settings) would otherwise not reach it.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._work,),
                                        name="evalfleet-evaluator", daemon=True)
        self._thread.start()

    # -- public API --------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Evaluations submitted and not finished yet (queued or running)."""
        with self._lock:
            return self._in_flight

    def trigger_eval(self, weights: Any, step: int | None = None) -> str | None:
        """Start evaluating ``weights`` in the background; returns its request id at once.

        Only the device→host copy of the weights happens on the calling thread. Returns None
        when ``busy_policy='skip'`` dropped the request.
        """
        with self._lock:
            self._check_open()
            if self._in_flight and self.busy_policy != "queue":
                if self.busy_policy == "error":
                    raise EvaluatorBusy(
                        f"an evaluation is still pending ({self._in_flight} in flight); use "
                        "busy_policy='queue' or 'skip', or call wait() before triggering again."
                    )
                self.skipped += 1
                logger.warning("skipped evaluation of step %s: %d evaluation(s) still pending "
                               "(busy_policy='skip')", step, self._in_flight)
                return None
            job = self._submit(weights, step)
            self._triggered.append(job)
        return job.request.request_id

    def evaluate(self, weights: Any, step: int | None = None, timeout: float | None = None
                 ) -> Result:
        """Evaluate ``weights`` and block until the result (after any pending evaluations).

        The result is returned here, not through ``poll``/``wait``; ``on_result`` still sees it.
        """
        with self._lock:
            self._check_open()
            job = self._submit(weights, step)
        return self._result(job, timeout)

    def poll(self) -> Result | None:
        """The oldest finished, not yet returned ``trigger_eval`` result; None if none is ready.

        A triggered evaluation that failed raises its error here, once: an ``EvalfleetError``
        (``EvaluationFailed`` wrapping anything that is not one).
        """
        with self._lock:
            if not self._triggered or not self._triggered[0].future.done():
                return None
            job = self._triggered.popleft()
        return self._result(job, 0)

    def wait(self, timeout: float | None = None) -> Result | None:
        """Block until the oldest triggered evaluation finishes and return its result.

        Returns None when nothing was triggered; raises ``TimeoutError`` after ``timeout``
        seconds (the evaluation keeps running: call ``wait`` again).
        """
        with self._lock:
            if not self._triggered:
                return None
            job = self._triggered[0]
        try:
            return self._result(job, timeout)
        finally:
            with self._lock:
                if job.future.done() and self._triggered and self._triggered[0] is job:
                    self._triggered.popleft()

    def final_report(self, request_id: str) -> Future[EvalReport] | None:
        """The future final report of ``request_id``: with its files written and MLflow run id.

        Results come back as soon as their numbers are known: the Parquet is written by then, and
        ``result['report'].outputs`` says where report.json, the plots and page, and the MLflow
        run will be (``outputs['feed_back'] == 'pending'``) once the runner's background step has
        run. None for a runner that returns only finished reports (its report is final).
        """
        final = getattr(self._runner, "final_report", None)
        found = final(request_id) if callable(final) else None
        return found if isinstance(found, Future) else None

    def flush(self, timeout: float | None = None) -> None:
        """Block until the files and records of every returned result are complete.

        ``shutdown`` flushes too (its runner's ``close`` waits for the background step). Raises
        ``TimeoutError`` if that takes longer than ``timeout`` seconds, and ``OutputsMissing``
        naming each evaluation whose files, MLflow run or callback could not be produced, and each
        ``on_result`` call that raised (each once; ``shutdown`` raises those not raised yet, and
        so does a ``flush`` after a ``shutdown`` that raised ``TimeoutError``).
        """
        with self._lock:
            closed = self._closed
        if closed:  # the runner's close() finishes stage 7 and keeps what it raised for shutdown()
            self.shutdown(timeout=timeout)
            return
        drain = getattr(self._runner, "drain", None)
        missing: OutputsMissing | None = None
        if callable(drain):
            try:
                drain(timeout)
            except OutputsMissing as err:
                missing = err
        self._raise_missing(missing)

    def _raise_missing(self, missing: OutputsMissing | None) -> None:
        """Raise ``missing`` (the runner's), what its ``close`` raised and ``on_result``'s errors, as one."""
        with self._lock:
            closing, self._close_error = self._close_error, None
            if closing is not None and not isinstance(closing, OutputsMissing):
                raise closing  # on its own: the next flush() or shutdown() raises the rest
            problems, self._unraised = self._unraised, []
        found = [str(err) for err in (closing, missing) if err is not None]
        if not found and not problems:
            return
        text = "; ".join(found)
        if problems:
            text = (f"{text}; " if text else "results were returned, but not everything asked for "
                    "with them was produced: ") + "; ".join(problems)
        raise OutputsMissing(text)

    def shutdown(self, wait: bool = True, timeout: float | None = 600.0) -> None:
        """Stop accepting work, optionally let pending evaluations finish, release the cluster.

        With ``wait=False`` queued evaluations are cancelled; a running one still finishes in
        the background (a running Dask evaluation cannot be interrupted safely). Raises
        ``TimeoutError`` when the evaluations or their stage 7 are still running after ``timeout``
        seconds (10 s with ``wait=False``): call ``shutdown()`` or ``flush()`` again, which raise
        what they could not produce.
        """
        with self._lock:
            closing, self._closed = not self._closed, True
        if closing:
            if not wait:
                while True:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None and job.future.cancel():
                        with self._lock:
                            self._in_flight -= 1
            self._jobs.put(None)
        limit = timeout if wait else 10.0
        self._thread.join(limit)
        if self._thread.is_alive():
            raise TimeoutError(
                f"the evaluator is still running after {limit} s (evaluations, or their stage 7: "
                "files, MLflow, callbacks); call shutdown() or flush() again to wait on and raise "
                "what they could not produce."
            )
        # What the runner's close raised (a failed stage 7, an output not produced) and what
        # on_result raised reach the caller: a result's missing parts are never only a log line.
        self._raise_missing(None)

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.shutdown()
            return
        try:  # the block's own exception is the one to see
            self.shutdown(wait=False)
        except Exception as err:
            logger.error("shutting the Evaluator down after %s: %s", type(exc).__name__, err)

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EvaluatorClosed("this Evaluator was shut down; create a new one.")

    def _submit(self, weights: Any, step: int | None) -> _Job:
        # The training thread copies only what the policy file will hold; the module's structure
        # only when it changed since the previous call (the writer keeps that one's copy).
        snapshot = snapshot_weights(weights, extras=self.factory is None, structure=self._structure)
        if snapshot.module is None and self.factory is None:
            raise PolicyError(
                "a state_dict needs 'policy_factory' ('module:function' building the nn.Module); "
                "or pass the nn.Module itself."
            )
        # Validated again: model_copy checks nothing, and a step of 'abc' reached the runner.
        request = EvalRequest.build(**{**self._template.model_dump(), "step": step,
                                       "request_id": uuid.uuid4().hex[:16]})
        if request.training_run_id is not None:
            # A call without its step got no history and no verdict. Without a training run id
            # the step only labels the result (eval/step): that pair stays half.
            check_training_pair(request)
        job = _Job(request, snapshot, Future())
        self._in_flight += 1
        self._jobs.put(job)
        self._structure = snapshot.structure
        return job

    def _result(self, job: _Job, timeout: float | None) -> Result:
        try:
            return job.future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"evaluation of step {job.request.step} not finished after {timeout} s; it is "
                "still running: call wait() again or poll() later."
            ) from None
        except EvalfleetError:
            raise
        except Exception as err:
            raise EvaluationFailed(
                f"evaluation of step {job.request.step} ({job.request.request_id}) failed: "
                f"{type(err).__name__}: {err}"
            ) from err

    def _run(self, job: _Job) -> Result:
        path = self._writer.write(job.snapshot)
        request = job.request.model_copy(update={"policy": str(path)})
        if self._runner is None:
            entry = self._default_runner or find_runner()
            self._runner = load_runner(entry, request.workers, request.dask_address)
        if self.suite is not None:
            return self._run_suite(request)
        report = self._runner(request)
        result = result_from_report(report, request.step)
        # Always the latest result's: kept when a result had none, it named a best the history no
        # longer stood by (a protocol change, an unreadable history, a withheld best).
        self.best_step = result["eval/best_step"]
        self.best_policy_sha256 = result["eval/best_policy_sha256"]
        if self.metrics_fn is not None:
            table = read_episodes(Path(report.outputs["episodes"]))
            result.update(self.metrics_fn(table))
        return result

    def _run_suite(self, request: EvalRequest) -> Result:
        run_suite = getattr(self._runner, "suite", None)
        if not callable(run_suite):
            raise EvaluationFailed(
                f"the runner {self._runner!r} cannot run suites: it has no suite(suite, request) "
                "method; use the default runner or drop 'suite'."
            )
        report = run_suite(self.suite, request)
        missing = report.missing_outputs
        if missing:  # raised by the next flush() or shutdown(), as a single evaluation's
            logger.error("suite %s (step %s): outputs missing: %s", report.request_id, request.step,
                         "; ".join(missing))
            with self._lock:
                self._unraised.append(f"suite {report.request_id} (step {request.step}): "
                                      + "; ".join(missing))
        return suite_result(report, request.step)

    def _work(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                if not job.future.set_running_or_notify_cancel():
                    continue
                try:
                    result = self._run(job)
                except BaseException as err:
                    logger.error("evaluation of step %s failed: %s", job.request.step, err)
                    with self._lock:
                        self._in_flight -= 1
                    job.future.set_exception(err)
                    continue
                if self.on_result is not None:
                    try:
                        self.on_result(result)
                    except BaseException as err:  # SystemExit too: the result still comes back
                        logger.exception("on_result raised for step %s", job.request.step)
                        with self._lock:
                            self._unraised.append(f"on_result raised for step {job.request.step}: "
                                                  f"{type(err).__name__}: {err}")
                with self._lock:
                    self._in_flight -= 1
                job.future.set_result(result)
        finally:
            close = getattr(self._runner, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as err:  # shutdown() or flush() raises it in the caller's thread
                    logger.error("closing the evaluation runner: %s", err)
                    with self._lock:
                        self._close_error = err


__all__ = [
    "BUSY_POLICIES",
    "EvaluationFailed",
    "Evaluator",
    "EvaluatorBusy",
    "EvaluatorClosed",
    "PolicyWriter",
    "Result",
    "Runner",
    "factory_ref",
    "history_result",
    "result_from_report",
    "snapshot_weights",
    "suite_result",
]
