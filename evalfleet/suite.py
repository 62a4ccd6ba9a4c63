"""Evaluation suites: one policy over many tasks, read from a ``suite.toml``.

A suite file::

    [suite]
    name = "use-cases"          # optional; default: the file's stem
    episodes = 200              # optional defaults for every task
    max_steps = 500
    gamma = 1.0                 # optimality-gap target of normalised scores
    reps = 2000                 # bootstrap resamples of every interval, 100 to 100,000
    task_review = false         # each task's replays, plots and report.html (default: off)

    [[task]]
    name = "connect-four"       # optional; default: the env id's name
    env = "evalfleet/ConnectFour-v0"
    kwargs = { opponent = "negamax" }
    grid = { opponent_depth = [1, 2, 3] }     # expands into 3 tasks
    episodes = 100
    max_steps = 42
    normalise = { random = -1.0, reference = -0.71 }   # or { min = ..., max = ... }, or a
                                # list of such tables, one per grid point in expansion order

Each expanded task is an ordinary evaluation request (same cache key as ``--env ... --env-kwargs
...`` would give), named ``connect-four[opponent_depth=2]``. Everything is validated here, before
anything is spawned: a bad suite raises ``SuiteError`` naming the task and the field.

A task's score is its episode return (the scored episodes: completed and policy-attributable
failures, as every headline); normalised ``(return - random) / (reference - random)``, or
``(return - min) / (max - min)``. Without normalisation raw returns are aggregated, which mixes
scales: the suite report says so.
"""

from __future__ import annotations

import itertools
import json
import math
import tomllib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from evalfleet.aggregates import normalise, probability_of_improvement, summary
from evalfleet.errors import RequestError, SuiteError
from evalfleet.models import (
    MAX_EPISODES,
    OUTPUT_MISSING,
    RECORDING_INCOMPLETE,
    EvalReport,
    EvalRequest,
    non_finite_path,
)
from evalfleet.scoring import scored_returns
from evalfleet.stats import _MIN_BOOT

__all__ = [
    "Normalisation",
    "Suite",
    "SuiteReport",
    "SuiteTask",
    "alarm_names",
    "load_suite",
    "parse_suite",
    "refuse_task_settings",
    "suite_aggregates",
    "task_requests",
    "task_scores",
]

_SUITE_KEYS: Final = ("name", "episodes", "max_steps", "gamma", "reps", "task_review")
_TASK_KEYS: Final = ("name", "env", "kwargs", "grid", "episodes", "max_steps", "normalise")
_NORMALISE_KEYS: Final = ({"random", "reference"}, {"min", "max"})
#: Most tasks a grid may expand into (a typo like 1000 values should not spawn 1000 evaluations).
MAX_TASKS: Final = 200
#: Fewest bootstrap resamples of the aggregates' intervals: the statistics' own floor. With
#: ``reps = 1`` every "95% CI" was one resample, zero width, and the IQM's did not even hold its
#: point estimate (0.694 outside [0.691, 0.691] on 8 CartPole episodes).
MIN_REPS: Final = _MIN_BOOT
#: Most bootstrap resamples: past it the intervals gain nothing and the draws outgrow memory
#: (``reps = 1_000_000_000``, a typo for 1000, ran every task, then died in a MemoryError, exit 1:
#: the performance profile alone keeps 41 floats per resample, 328 GB). 100,000 keep ~35 MB.
MAX_REPS: Final = 100_000


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Normalisation(_Frozen):
    """How a task's returns become scores: 0 at ``low``, 1 at ``high``."""

    low: float = Field(description="Score 0: the random policy's mean return, or the min.")
    high: float = Field(description="Score 1: the reference (e.g. heuristic) return, or the max.")
    kind: str = Field(description="'random/reference' or 'min/max', as the suite file said.")


class SuiteTask(_Frozen):
    """One expanded task of a suite: an env with fixed kwargs, an episode budget and a step cap."""

    name: str = Field(description="Unique within the suite; grid values in brackets.")
    env: str = Field(description="Gymnasium id, as ``--env``.")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="Kwargs for gym.make.")
    episodes: int = Field(description="Episodes 0..episodes-1, seeded by the suite's seed ledger.")
    max_steps: int | None = Field(None, description="Step cap; None = the env's registered one.")
    normalisation: Normalisation | None = Field(None, description="None: raw returns are scores.")


class Suite(_Frozen):
    """A parsed, expanded suite."""

    name: str
    tasks: list[SuiteTask]
    gamma: float = Field(1.0, description="Optimality-gap target of the (normalised) scores.")
    reps: int = Field(2000, description="Bootstrap replicates of every aggregate interval.")
    source: str = Field("", description="Where the suite was read from.")
    task_review: bool = Field(
        False, description="Each task's own replays, plots and report.html (stage 7's review); "
        "off by default: the suite's page shows every task, and a review costs ~1-2 s per task."
    )

    @property
    def normalised(self) -> bool:
        """True when every task has a normalisation (scores comparable across tasks)."""
        return all(t.normalisation is not None for t in self.tasks)


class SuiteReport(_Frozen):
    """What a suite evaluation tells its users; serialised as suite_report.json."""

    suite: str
    request_id: str
    policy_sha256: str
    normalised: bool
    tasks: list[dict[str, Any]]
    aggregates: dict[str, Any]
    profile: dict[str, Any]
    gamma: float
    baseline: dict[str, Any] | None = None
    probability_of_improvement: dict[str, Any] | None = None
    alarms: list[str] = []
    harness_fault: bool = False
    coverage: float = Field(1.0, description="The lowest coverage (scored / planned episodes) of "
                            "the policy's tasks: each task weighs the same in the aggregates.")
    seconds: float = 0.0
    outputs: dict[str, str] = {}

    @property
    def missing_outputs(self) -> list[str]:
        """Outputs asked for and not produced: the suite's own and its tasks' (as ``EvalReport``'s).

        Its ``output_missing`` alarms, its tasks' (``'<task request id>: what'``), and its tasks'
        ``recording_incomplete`` alarms, whole. The CLI exits 5 (3 for a recording) and
        ``Evaluator.flush`` raises ``OutputsMissing``.
        """
        prefix = f"{OUTPUT_MISSING}: "
        return [a.replace(prefix, "", 1) for a in self.alarms
                if a.startswith(prefix) or f": {prefix}" in a] + [
            a for a in self.alarms if f"{RECORDING_INCOMPLETE}: " in a]

    @property
    def alarm_names(self) -> list[str]:
        """Every alarm's name, once, in order: a task's (``'<its request id>: name: ...'``) by its own."""
        return alarm_names(self.alarms, self.request_id)


def alarm_names(alarms: list[str], request_id: str) -> list[str]:
    """The names of a suite's ``alarms`` (``request_id``: the suite's), each once, in order.

    A task's alarm is ``'<task request id>: <name>: ...'`` (``'baseline ...'`` for the baseline's);
    task request ids are ``{request_id}-t{index}``, letters, digits and ``'._-'``.
    """
    names = []
    for alarm in alarms:
        body = alarm.removeprefix("baseline ")
        if body.startswith(f"{request_id}-t"):
            body = body.split(": ", 1)[-1]
        names.append(body.split(":", 1)[0])
    return list(dict.fromkeys(names))


def _fail(where: str, message: str) -> SuiteError:
    return SuiteError(f"suite {where}: {message}")


def _positive_int(value: Any, where: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(where, f"'{name}' must be a positive integer (got {value!r}).")
    return value


def _episodes(value: Any, where: str) -> int:
    episodes = _positive_int(value, where, "episodes")
    if episodes > MAX_EPISODES:  # as a single request's: the plan holds every episode at once
        raise _fail(where, f"'episodes' must be at most {MAX_EPISODES:,} (got {episodes:,}).")
    return episodes


def _normalisation(value: Any, where: str) -> Normalisation | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) not in _NORMALISE_KEYS:
        raise _fail(where, "'normalise' must be a table { random = R, reference = S } or "
                    f"{{ min = A, max = B }} (got {value!r}).")
    low_key, high_key = ("random", "reference") if "random" in value else ("min", "max")
    low, high = value[low_key], value[high_key]
    for key, number in ((low_key, low), (high_key, high)):
        if isinstance(number, bool) or not isinstance(number, int | float) or not np.isfinite(number):
            raise _fail(where, f"'normalise.{key}' must be a finite number (got {number!r}).")
    if abs(high - low) <= 1e-9 * max(1.0, abs(low), abs(high)):
        raise _fail(where, f"'normalise' needs {low_key} != {high_key} (got {low!r} and {high!r}): "
                    "scores would divide by (nearly) zero; use the return of a policy that does "
                    "better.")
    return Normalisation(low=float(low), high=float(high), kind=f"{low_key}/{high_key}")


def _grid(value: Any, where: str) -> list[dict[str, Any]]:
    if value is None:
        return [{}]
    if not isinstance(value, dict) or not value:
        raise _fail(where, f"'grid' must be a non-empty table of kwarg = [values] (got {value!r}).")
    for key, values in value.items():
        if not isinstance(values, list) or not values:
            raise _fail(where, f"'grid.{key}' must be a non-empty list of values, e.g. "
                        f"{key} = [1, 2, 3] (got {values!r}).")
    keys = list(value)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*value.values())]


def _label(values: dict[str, Any]) -> str:
    return ",".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items())


def _by_value(value: Any) -> Any:
    """``value`` with every integral float as an int (TOML's ``20`` and ``20.0`` are one kwarg)."""
    if isinstance(value, dict):
        return {k: _by_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_by_value(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def parse_suite(data: dict[str, Any], source: str = "<suite>") -> Suite:
    """Validate a suite's TOML data and expand its grids into tasks (raises ``SuiteError``)."""
    known = {"suite", "task"}
    if set(data) - known:
        raise _fail(source, f"unknown top-level key(s) {sorted(set(data) - known)!r}; a suite has "
                    "a [suite] table and [[task]] entries.")
    head = data.get("suite", {})
    if not isinstance(head, dict):
        raise _fail(source, f"'suite' must be a [suite] table of settings (got {head!r}); "
                    f"allowed keys: {', '.join(_SUITE_KEYS)}.")
    if set(head) - set(_SUITE_KEYS):
        extra = sorted(set(head) - set(_SUITE_KEYS))
        raise _fail(source, f"[suite] has unknown key(s) {extra!r}; allowed: {', '.join(_SUITE_KEYS)}.")
    entries = data.get("task")
    if not isinstance(entries, list) or not entries:
        raise _fail(source, "no tasks: add at least one [[task]] with an 'env'.")
    default_episodes = _episodes(head["episodes"], f"{source} [suite]") \
        if "episodes" in head else None
    default_steps = head.get("max_steps")
    gamma = head.get("gamma", 1.0)
    if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not math.isfinite(gamma):
        raise _fail(source, f"[suite] 'gamma' must be a finite number (got {gamma!r}).")
    # The optimality gap is mean(max(gamma - score, 0)), and a normalised score is 0 at the random
    # policy's return (or the min): a target at or below it is met by every policy that does no
    # worse than random. gamma = -5 made the gap 0 for any CartPole policy, as if each were optimal.
    if gamma <= 0:
        raise _fail(source, f"[suite] 'gamma' (the optimality gap's target score) must be > 0, above "
                    f"the random policy's normalised score of 0 (got {gamma!r}): at or below it a "
                    "policy no better than random has a gap of 0. Use 1 (the reference's score, the "
                    "default), or a higher target; for raw returns, normalise the tasks "
                    "({ min = A, max = B }) first.")
    planned = 0  # tasks after grid expansion, counted before any grid is expanded
    for entry in entries:
        grid = entry.get("grid") if isinstance(entry, dict) else None
        sizes = [len(v) for v in grid.values() if isinstance(v, list)] if isinstance(grid, dict) else []
        planned += math.prod(sizes) if sizes else 1
    if planned > MAX_TASKS:
        raise _fail(source, f"{planned} tasks after grid expansion, more than {MAX_TASKS}; "
                    "split the suite or shrink its grids.")
    tasks: list[SuiteTask] = []
    for i, entry in enumerate(entries):
        where = f"{source} task {i + 1}"
        if not isinstance(entry, dict):
            raise _fail(where, f"must be a table (got {entry!r}).")
        extra = sorted(set(entry) - set(_TASK_KEYS))
        if extra:
            raise _fail(where, f"unknown key(s) {extra!r}; allowed: {', '.join(_TASK_KEYS)}.")
        env = entry.get("env")
        if not isinstance(env, str) or not env:
            raise _fail(where, f"'env' must be a Gymnasium id such as 'CartPole-v1' (got {env!r}).")
        where = f"{source} task {i + 1} ({entry.get('name', env)})"
        # An empty name fell back to the env id: the task was not named what the file said.
        if "name" in entry and (not isinstance(entry["name"], str) or not entry["name"].strip()):
            raise _fail(where, f"'name' must be a non-empty string (got {entry['name']!r}); give the "
                        "task a name, or drop 'name' to name it after its env id.")
        kwargs = entry.get("kwargs", {})
        if not isinstance(kwargs, dict):
            raise _fail(where, f"'kwargs' must be a table of gym.make kwargs (got {kwargs!r}).")
        episodes = entry.get("episodes", default_episodes)
        if episodes is None:
            raise _fail(where, "'episodes' is missing: set it on the task or in [suite].")
        episodes = _episodes(episodes, where)
        steps = entry.get("max_steps", default_steps)
        if steps is not None:
            steps = _positive_int(steps, where, "max_steps")
        base = str(entry.get("name") or env.rsplit(":", 1)[-1].rsplit("/", 1)[-1])
        points = _grid(entry.get("grid"), where)
        for name, values in (("kwargs", kwargs), ("grid", entry.get("grid") or {})):
            bad = non_finite_path(values, "")
            if bad is not None:  # TOML has nan and inf; gym.make would get them, the report null
                raise _fail(where, f"'{name}{bad[0]}' must be a finite number (got {bad[1]}): "
                            "NaN and inf are not JSON, so the cache key, the report and MLflow's "
                            "params could not hold what the env receives.")
        overlap = sorted(set(points[0]) & set(kwargs))
        if overlap:
            raise _fail(where, f"{overlap!r} are both in 'kwargs' and 'grid'; keep each in one.")
        norms = entry.get("normalise")
        if isinstance(norms, list):  # one per grid point, in expansion order
            if len(norms) != len(points):
                raise _fail(where, f"'normalise' is a list of {len(norms)} tables but the grid "
                            f"expands into {len(points)} tasks; give one table per grid point "
                            "(last key varies fastest), or one table for all.")
        else:
            norms = [norms] * len(points)
        for point, norm in zip(points, norms, strict=True):
            name = f"{base}[{_label(point)}]" if point else base
            tasks.append(SuiteTask(name=name, env=env, env_kwargs={**kwargs, **point},
                                   episodes=episodes, max_steps=steps,
                                   normalisation=_normalisation(norm, f"{where} {name}")))
    dupes = sorted(n for n, k in Counter(t.name for t in tasks).items() if k > 1)
    if dupes:
        raise _fail(source, f"task names {dupes!r} appear twice; give the tasks distinct 'name's.")
    same: dict[str, str] = {}
    for task in tasks:  # as flows.suite.same_as, before anything runs, numbers by value
        key = json.dumps([task.env, _by_value(task.env_kwargs), task.max_steps], sort_keys=True)
        if key in same:
            raise SuiteError(
                f"suite tasks {same[key]!r} and {task.name!r} are the same evaluation ({source}: "
                f"same env, kwargs and step cap; numbers compare by value, 20 and 20.0 are one): "
                "counted twice, it would weigh twice in every aggregate and narrow its intervals "
                "as if it were two tasks; remove one of them.")
        same[key] = task.name
    if len(tasks) > MAX_TASKS:
        raise _fail(source, f"{len(tasks)} tasks after grid expansion, more than {MAX_TASKS}; "
                    "split the suite or shrink its grids.")
    reps = _positive_int(head.get("reps", 2000), f"{source} [suite]", "reps")
    if not MIN_REPS <= reps <= MAX_REPS:
        raise _fail(source, f"[suite] 'reps' (bootstrap resamples of every aggregate's 95% interval) "
                    f"must be between {MIN_REPS} and {MAX_REPS:,} (got {reps:,}): fewer leave the "
                    "interval's 2.5% tails a handful of resamples, more gain nothing and outgrow "
                    "memory. Use 2000 (the default), or drop 'reps'.")
    review = head.get("task_review", False)
    if not isinstance(review, bool):
        raise _fail(source, f"[suite] 'task_review' must be true or false (got {review!r}).")
    return Suite(name=str(head.get("name") or Path(source).stem), tasks=tasks, gamma=float(gamma),
                 reps=reps, source=source, task_review=review)


def load_suite(path: str | Path) -> Suite:
    """Read and validate ``path`` (a suite.toml); raises ``SuiteError`` with the reason."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError as err:
        raise SuiteError(f"suite file {str(p)!r} does not exist; pass --suite PATH/TO/suite.toml.") from err
    except tomllib.TOMLDecodeError as err:
        raise SuiteError(f"suite file {str(p)!r} is not valid TOML: {err}.") from err
    return parse_suite(data, str(p))


def refuse_task_settings(given: Sequence[str], with_: str, suite_name: str) -> None:
    """Refuse what each task of a suite sets for itself, given beside the suite (``SuiteError``).

    ``task_requests`` takes every task's env, env kwargs, episodes and step cap from the suite:
    given with one, each was ignored without a word (asked for 7 episodes capped at 20 through
    the webhook, a suite ran 3 at cap 500). The CLI (``--suite``), the ``Evaluator``
    (``suite=``) and the webhook receiver (a body's ``suite``) refuse them here, each naming
    ``given`` in its own spelling; ``with_`` names the suite's option, ``suite_name`` the suite.
    """
    if given:
        raise SuiteError(
            f"{', '.join(given)} cannot be used with {with_}: {suite_name} sets each task's env, "
            "env kwargs, episodes and step cap, so they would be ignored. Drop them, or set them in "
            "the suite ('env', 'kwargs', 'episodes', 'max_steps' of a [[task]]; 'episodes' and "
            "'max_steps' of [suite] for every task).")


def task_requests(suite: Suite, base: EvalRequest) -> list[EvalRequest]:
    """One request per task: ``base``'s protocol with the task's env, kwargs, episodes, step cap.

    Request ids are ``{base id}-t{index}``; the id is not part of the cache key, so each task is
    cached exactly as the same single evaluation. Adaptive mode and a paired baseline belong to the
    suite as a whole: the tasks run a fixed number of episodes and no nested baseline.
    """
    if base.target_ci_halfwidth is not None:
        raise SuiteError("a suite runs each task's fixed number of episodes; adaptive mode "
                         "(--target-ci-halfwidth) is for single evaluations: drop it, or set the "
                         "tasks' 'episodes' in the suite file.")
    if base.baseline is not None and base.baseline.startswith("sha256:"):
        raise SuiteError(f"a suite's baseline must be a policy file or 'module:function' (got "
                         f"{base.baseline!r}): it is evaluated on every task, under its own keys.")
    out = []
    for i, task in enumerate(suite.tasks):
        fields = dict(base.model_dump(), env=task.env, env_kwargs=task.env_kwargs,
                      episodes=task.episodes, max_steps=task.max_steps,
                      request_id=f"{base.request_id}-t{i:02d}", target_ci_halfwidth=None,
                      max_episodes=None, baseline=None, baseline_factory=None, callback_url=None,
                      review=suite.task_review, suite_task=task.name)
        try:
            out.append(EvalRequest.build(**fields))
        except RequestError as err:
            raise SuiteError(f"suite task {task.name!r}: {err}") from err
    return out


def baseline_requests(requests: list[EvalRequest], baseline: str, factory: str | None
                      ) -> list[EvalRequest]:
    """The tasks' requests for the baseline policy: same envs, seeds and protocol.

    Not a checkpoint of the training run (as ``pipeline.baseline_request``): no step, so no task
    history takes the baseline, logged after the policy, as the step's evaluation.
    """
    return [r.model_copy(update={"policy": baseline, "policy_factory": factory,
                                 "request_id": f"{r.request_id}-baseline", "step": None})
            for r in requests]


def task_scores(task: SuiteTask, table: pa.Table) -> np.ndarray[Any, np.dtype[np.float64]]:
    """The task's scores: its scored episodes' returns, normalised when the task says how."""
    returns = scored_returns(table)
    if task.normalisation is None:
        return returns
    return normalise(returns, task.normalisation.low, task.normalisation.high)


def task_row(task: SuiteTask, report: EvalReport, scores: np.ndarray[Any, np.dtype[np.float64]]
             ) -> dict[str, Any]:
    """One task's line of the suite report."""
    n = task.normalisation
    return {
        "name": task.name, "env": task.env, "env_kwargs": task.env_kwargs,
        "episodes": report.episodes, "scored": report.scored, "coverage": report.coverage,
        "harness_failures": report.harness_failures, "mean_return": report.mean,
        "ci": list(report.ci), "normalisation": n.model_dump() if n else None,
        "score_mean": float(scores.mean()) if scores.size else None,
        # sorted: a normalisation whose high is below its low (lower returns are better) flips it
        "score_ci": sorted((c - n.low) / (n.high - n.low) for c in report.ci) if n else list(report.ci),
        "cache": report.cache.get("status"), "harness_fault": report.harness_fault,
        "request_id": report.request_id, "report": report.outputs.get("report", ""),
        "episodes_file": report.outputs.get("episodes", ""),
        "mlflow_run_id": report.outputs.get("mlflow_run_id", ""),
    }


def suite_aggregates(suite: Suite, scores: list[np.ndarray[Any, np.dtype[np.float64]]], seed: int
                     ) -> dict[str, Any]:
    """Aggregates and the performance profile of per-task scores (``aggregates.summary``)."""
    empty = [t.name for t, s in zip(suite.tasks, scores, strict=True) if s.size == 0]
    if empty:
        raise SuiteError(f"suite tasks {empty!r} have no scored episodes (all failed in the "
                         "harness): nothing to aggregate; see their reports.")
    return summary(scores, seed=seed, reps=suite.reps, gamma=suite.gamma)


def improvement(x: list[np.ndarray[Any, np.dtype[np.float64]]],
                y: list[np.ndarray[Any, np.dtype[np.float64]]], seed: int, reps: int) -> dict[str, Any]:
    """Probability of improvement of the policy (x) over the baseline (y), task by task."""
    return dict(probability_of_improvement(x, y, seed=seed, reps=reps))
