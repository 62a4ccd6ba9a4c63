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
webhook: by default ``flows.eval.evaluate`` on one local cluster and one Prefect API kept open for
the evaluator's lifetime (``LocalFlowRunner``), or a deployment on a Prefect server
(``DeploymentRunner``), or any ``runner(request) -> EvalReport`` you pass.

Weights cross into the evaluation as a file: a state_dict plus ``policy_factory`` when one is
given, else the module compiled to TorchScript. ``trigger_eval`` only copies the weights off the
training device (a non-blocking copy on CUDA); serialising, hashing and evaluating happen on one
background thread, where ``on_result`` runs too.

This module never imports Prefect: the flow is imported lazily by ``LocalFlowRunner``.
"""

from __future__ import annotations

import contextvars
import copy
import hashlib
import importlib
import io
import logging
import os
import queue
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from evalfleet.errors import EvalfleetError, PolicyError
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.storage import read_episodes, run_dir

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

logger = logging.getLogger(__name__)

BUSY_POLICIES = ("error", "queue", "skip")
#: Request fields the evaluator sets itself; pass them through its own arguments instead.
_OWN_FIELDS = ("policy", "policy_factory", "episodes", "env", "device", "step",
               "training_run_id", "request_id")

Runner = Callable[[EvalRequest], EvalReport]
Result = dict[str, Any]


class EvaluatorBusy(EvalfleetError):
    """``trigger_eval`` with ``busy_policy='error'`` while an evaluation is still pending."""


class EvaluationFailed(EvalfleetError):
    """An evaluation did not produce a report; the cause is chained (``__cause__``)."""


class EvaluatorClosed(EvalfleetError):
    """The evaluator was shut down; create a new one."""


# ----------------------------------------------------------------------------------- runners


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
        from evalfleet.cluster import fleet_cluster

        # Imported by name: the core depends on the flow layer only at run time, never at import.
        runtime = importlib.import_module("flows.runtime")
        stack = ExitStack()
        try:
            stack.enter_context(runtime.prefect_api())
            address = stack.enter_context(fleet_cluster(self.dask_address, self.workers))
        except BaseException:
            stack.close()
            raise
        self._stack, self._address = stack, address
        return address

    def __call__(self, request: EvalRequest) -> EvalReport:
        """Evaluate ``request`` on the kept cluster."""
        evaluate: Runner = importlib.import_module("flows.eval").evaluate
        address = self._address or self._open()
        return evaluate(request.model_copy(update={"dask_address": address}))

    def close(self) -> None:
        """Stop the local cluster and API server this runner started (if any)."""
        stack, self._stack, self._address = self._stack, None, None
        if stack is not None:
            stack.close()


class DeploymentRunner:
    """Runs each evaluation as a flow run of a served deployment, over Prefect's REST API.

    The report is read from ``report.json`` under the request's ``output`` folder, so that folder
    must be shared between this process and the deployment's (same host, or a shared volume);
    the ``Evaluator`` makes it absolute before sending.
    """

    FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")

    def __init__(
        self,
        api_url: str | None = None,
        deployment: str = "evalfleet-service/evaluate",
        *,
        timeout_s: float = 1800.0,
        poll_s: float = 0.5,
    ) -> None:
        url = api_url or os.environ.get("PREFECT_API_URL", "")
        if not url:
            raise EvalfleetError(
                "DeploymentRunner needs a Prefect API: pass api_url='http://HOST:4200/api' or set "
                "PREFECT_API_URL (start one with 'evalfleet serve')."
            )
        if deployment.count("/") != 1:
            raise EvalfleetError(
                f"'deployment' must look like 'flow-name/deployment-name' (got {deployment!r})."
            )
        self.api_url = url.rstrip("/")
        self.deployment = deployment
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._deployment_id: str | None = None

    def _get(self, client: httpx.Client, path: str) -> Any:
        response = client.get(f"{self.api_url}{path}")
        response.raise_for_status()
        return response.json()

    def trigger(self, client: httpx.Client, request: EvalRequest) -> str:
        """Create the flow run; returns its id. Idempotent per ``request.request_id``."""
        if self._deployment_id is None:
            flow_name, name = self.deployment.split("/")
            self._deployment_id = str(self._get(client, f"/deployments/name/{flow_name}/{name}")["id"])
        response = client.post(
            f"{self.api_url}/deployments/{self._deployment_id}/create_flow_run",
            json={"parameters": {"request": request.model_dump(mode="json")},
                  "idempotency_key": f"evalfleet-{request.request_id}",
                  "tags": ["evalfleet", "client"]},
        )
        response.raise_for_status()
        return str(response.json()["id"])

    def __call__(self, request: EvalRequest) -> EvalReport:
        """Trigger the deployment and block (bounded by ``timeout_s``) until its report exists."""
        with httpx.Client(timeout=30) as client:
            flow_run_id = self.trigger(client, request)
            deadline = time.monotonic() + self.timeout_s
            while True:
                state = self._get(client, f"/flow_runs/{flow_run_id}").get("state") or {}
                if state.get("type") in self.FINAL:
                    break
                if time.monotonic() > deadline:
                    raise EvaluationFailed(
                        f"flow run {flow_run_id} not finished after {self.timeout_s:.0f} s (state "
                        f"{state.get('name')!r}); is 'evalfleet serve' running for {self.deployment!r}?"
                    )
                time.sleep(self.poll_s)
        if state.get("type") != "COMPLETED":
            raise EvaluationFailed(
                f"flow run {flow_run_id} ended {state.get('name')!r}: {state.get('message')}"
            )
        path = run_dir(request.output, request.request_id) / "report.json"
        try:
            return EvalReport.model_validate_json(path.read_text())
        except OSError as err:
            raise EvaluationFailed(
                f"flow run {flow_run_id} completed but {path} cannot be read ({err}); the output "
                "folder must be shared between this process and the deployment."
            ) from err

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own HTTP client."""


# ------------------------------------------------------------------------ weights → policy file


def factory_ref(factory: str | Callable[..., Any]) -> str:
    """``'module:function'`` for a policy factory given as a string or a module-level function.

    A function defined in the script being run (module ``__main__``) is referred to by the
    script's importable name, so that workers can import it (the script must guard its
    training code with ``if __name__ == "__main__":``).
    """
    if isinstance(factory, str):
        if factory.count(":") != 1:
            raise PolicyError(f"'policy_factory' must look like 'module:function' (got {factory!r}).")
        return factory
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", "")
    if not module or not qualname or "<" in qualname or "." in qualname:
        raise PolicyError(
            f"'policy_factory' {factory!r} must be a module-level function (workers import it by "
            "name); lambdas, closures and methods cannot be imported."
        )
    if module == "__main__":
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        if spec is not None and spec.name and spec.name != "__main__":
            module = spec.name  # python -m pkg.script
        else:
            script = Path(getattr(main, "__file__", "") or "")
            if not script.name or str(script.resolve().parent) not in {
                str(Path(p or ".").resolve()) for p in sys.path
            }:
                raise PolicyError(
                    f"'policy_factory' {qualname!r} lives in __main__ and its script's folder is "
                    "not importable; move it into a module or pass 'module:function'."
                )
            module = script.stem
    return f"{module}:{qualname}"


@dataclass
class _Snapshot:
    """Weights copied off the training device at trigger time (maybe still in flight on CUDA)."""

    state: dict[str, torch.Tensor]
    module: torch.nn.Module | None
    events: list[Any]

    def ready(self) -> dict[str, torch.Tensor]:
        """The CPU tensors, after any pending device→host copy has landed."""
        for event in self.events:
            event.synchronize()
        self.events = []
        return self.state


def snapshot_weights(weights: Any) -> _Snapshot:
    """Copy an ``nn.Module``'s or a state_dict's tensors to CPU without waiting on the device.

    CUDA tensors are copied with ``non_blocking=True`` behind a recorded event (the worker thread
    waits on the event, the training thread does not); the copy is ordered before any later
    optimizer step on the same stream, so it sees exactly the weights of this step.
    """
    import torch

    module = weights if isinstance(weights, torch.nn.Module) else None
    source = weights.state_dict() if module is not None else weights
    if not isinstance(source, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in source.items()
    ):
        raise PolicyError(
            f"weights must be an nn.Module or a state_dict (str -> Tensor); got "
            f"{type(weights).__name__}."
        )
    state: dict[str, torch.Tensor] = {}
    devices: set[torch.device] = set()
    for name, tensor in source.items():
        t = tensor.detach()
        if t.is_cuda:
            devices.add(t.device)
            state[name] = t.to("cpu", non_blocking=True)
        else:
            state[name] = t.clone()
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return _Snapshot(state, module, events)


class PolicyWriter:
    """Turns weight snapshots into content-addressed policy files under ``folder``.

    With a factory the file is the state_dict (``torch.save``); without one, the module is
    compiled to TorchScript once and each snapshot is loaded into the compiled copy.
    """

    def __init__(self, folder: Path, factory: str | None) -> None:
        self.folder = Path(folder)
        self.factory = factory
        self._scripted: Any = None
        self._scripted_for: int | None = None

    def write(self, snapshot: _Snapshot) -> Path:
        """Write the snapshot; returns the file path (named by its sha256)."""
        import torch

        state = snapshot.ready()
        buffer = io.BytesIO()
        if self.factory is not None:
            torch.save(state, buffer)
        else:
            if snapshot.module is None:
                raise PolicyError(
                    "a state_dict needs 'policy_factory' ('module:function' building the "
                    "nn.Module); or pass the nn.Module itself."
                )
            with warnings.catch_warnings():
                # torch 2.13 deprecates TorchScript; it is still evalfleet's self-contained format.
                warnings.simplefilter("ignore", DeprecationWarning)
                torch.jit.save(self._script(snapshot.module, state), buffer)
        blob = buffer.getvalue()
        digest = hashlib.sha256(blob).hexdigest()
        path = self.folder / f"{digest}.pt"
        if not path.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
            os.replace(tmp, path)
        return path

    def _script(self, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> Any:
        import torch

        if self._scripted is None or self._scripted_for != id(module):
            # The structure is copied once; the values come from each snapshot below.
            template = copy.deepcopy(module).to("cpu").eval()
            try:
                self._scripted = torch.jit.script(template)
            except Exception as err:
                raise PolicyError(
                    f"cannot compile {type(module).__name__} to TorchScript ({type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''}); pass policy_factory="
                    "'module:function' so the weights travel as a state_dict instead."
                ) from err
            self._scripted_for = id(module)
        self._scripted.load_state_dict(state)
        return self._scripted


# ---------------------------------------------------------------------------------- evaluator


def result_from_report(report: EvalReport, step: int | None) -> Result:
    """The result dict: TorchRL-style ``eval/...`` keys plus the full report under ``report``."""
    return {
        "eval/reward": report.mean,
        "eval/coverage": report.coverage,
        "eval/reward_ci_low": report.ci[0],
        "eval/reward_ci_high": report.ci[1],
        "eval/episode_length": float(report.lengths["mean"]),
        "eval/fps": float(report.steps_per_second),
        "eval/step": step,
        "eval/episodes": report.scored,
        "eval/failure_rate": report.failure_rate,
        "eval/policy_failure_rate": report.policy_failure_rate,
        "report": report,
    }


@dataclass
class _Job:
    request: EvalRequest
    snapshot: _Snapshot
    future: Future[Result]


class Evaluator:
    """Evaluate training weights on the fleet, blocking (``evaluate``) or not (``trigger_eval``).

    Args:
        env: Gymnasium id of the evaluation env (``'module:EnvId-v0'`` imports ``module`` first).
        policy_factory: ``'module:function'`` or a module-level function building the
            ``nn.Module``; weights then travel as a state_dict. Without it an ``nn.Module`` is
            compiled to TorchScript, and a bare state_dict is refused.
        num_episodes: Episodes per evaluation.
        busy_policy: What ``trigger_eval`` does while an evaluation is pending: ``'error'``
            raises ``EvaluatorBusy``, ``'queue'`` runs requests in order, ``'skip'`` drops the new
            request (logged, counted in ``skipped``, returns None).
        on_result: Called with each result dict on the background thread (exceptions are logged).
        metrics_fn: Extra metrics from the episode table (one row per episode, the Parquet
            schema); merged into the result dict.
        device: Where workers run the policy: ``'cpu'``, ``'cuda[:N]'`` or ``'auto'``.
        training_run_id: The trainer's run id (an MLflow run id nests the evaluation runs under it).
        runner: ``runner(request) -> EvalReport``; default ``LocalFlowRunner``.
        **request_fields: Any other ``EvalRequest`` field (``seed``, ``env_kwargs``, ``workers``,
            ``dask_address``, ``output``, ``mlflow_uri``, ``experiment``, ``max_steps``, ...).
    """

    def __init__(
        self,
        env: str = "CartPole-v1",
        policy_factory: str | Callable[..., Any] | None = None,
        num_episodes: int = 100,
        *,
        busy_policy: str = "error",
        on_result: Callable[[Result], None] | None = None,
        metrics_fn: Callable[[pa.Table], Mapping[str, float]] | None = None,
        device: str = "cpu",
        training_run_id: str | None = None,
        runner: Runner | None = None,
        **request_fields: Any,
    ) -> None:
        if not isinstance(env, str):
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
        self.factory = factory_ref(policy_factory) if policy_factory is not None else None
        fields = dict(request_fields)
        fields["output"] = Path(fields.get("output", "results")).resolve()
        # Validate every field now, before any thread, cluster or server exists.
        self._template = EvalRequest.build(
            env=env, episodes=num_episodes, device=device, training_run_id=training_run_id,
            policy="(set per evaluation)", policy_factory=self.factory, **fields,
        )
        self.busy_policy = busy_policy
        self.on_result = on_result
        self.metrics_fn = metrics_fn
        self.skipped = 0
        self._runner: Runner | None = runner
        self._writer = PolicyWriter(self._template.output / "policies", self.factory)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._triggered: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
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

    def shutdown(self, wait: bool = True, timeout: float | None = 600.0) -> None:
        """Stop accepting work, optionally let pending evaluations finish, release the cluster.

        With ``wait=False`` queued evaluations are cancelled; a running one still finishes in
        the background (a running Dask evaluation cannot be interrupted safely).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
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
        self._thread.join(timeout if wait else 10.0)
        if self._thread.is_alive():
            logger.warning("evaluator thread still busy after shutdown(); it exits when the "
                           "running evaluation ends")

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown(wait=exc is None)

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EvaluatorClosed("this Evaluator was shut down; create a new one.")

    def _submit(self, weights: Any, step: int | None) -> _Job:
        snapshot = snapshot_weights(weights)
        if snapshot.module is None and self.factory is None:
            raise PolicyError(
                "a state_dict needs 'policy_factory' ('module:function' building the nn.Module); "
                "or pass the nn.Module itself."
            )
        request = self._template.model_copy(
            update={"step": step, "request_id": uuid.uuid4().hex[:16]}
        )
        job = _Job(request, snapshot, Future())
        self._in_flight += 1
        self._jobs.put(job)
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
            self._runner = LocalFlowRunner(request.workers, request.dask_address)
        report = self._runner(request)
        result = result_from_report(report, request.step)
        if self.metrics_fn is not None:
            table = read_episodes(Path(report.outputs["episodes"]))
            result.update(self.metrics_fn(table))
        return result

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
                    except Exception:
                        logger.exception("on_result raised for step %s", job.request.step)
                with self._lock:
                    self._in_flight -= 1
                job.future.set_result(result)
        finally:
            close = getattr(self._runner, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    logger.exception("closing the evaluation runner failed")


__all__ = [
    "BUSY_POLICIES",
    "DeploymentRunner",
    "EvaluationFailed",
    "Evaluator",
    "EvaluatorBusy",
    "EvaluatorClosed",
    "LocalFlowRunner",
    "PolicyWriter",
    "Runner",
    "factory_ref",
    "result_from_report",
    "snapshot_weights",
]
