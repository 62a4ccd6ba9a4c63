"""Typed request, plan and report models shared by every stage.

All models are frozen pydantic v2 models: they cross process boundaries (Prefect task results,
Dask task arguments, JSON reports) and must never be mutated on the way.
"""

from __future__ import annotations

import json
import logging
import math
import re
import uuid
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from evalfleet.errors import RequestError
from evalfleet.seeds import MAX_BASE_SEED

ISOLATION_LEVELS = ("inprocess", "process", "bwrap", "auto")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CACHE_MODES = ("use", "off", "refresh")
#: Fewest hex digits a 'sha256:' baseline may name a cached policy by (a short one may match several).
MIN_HASH_PREFIX = 12
_HASH_PREFIX = re.compile(rf"[0-9a-fA-F]{{{MIN_HASH_PREFIX},64}}")
_INFO_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]{0,127}")
_RUN_ID = re.compile(r"[A-Za-z0-9._\-:/@+]{1,256}")
#: Largest finite timeout, seconds (about 11.6 days); inf is no limit. A longer wait overflowed
#: where the shards wait (threading's TIMEOUT_MAX, ~292 years, for a forward; epoll's int
#: milliseconds, ~24.8 days, for a sandbox's answer) once the cluster was up.
MAX_TIMEOUT_S = 1_000_000.0
#: Above this share of planned episodes left unscored (harness failures) the evaluation is a
#: harness fault, not a policy result (``report.aggregate``; the CLI's and Prefect's texts).
FAILURE_ALARM_RATE = 0.05
#: Shortest policy timeout, seconds. Below it no forward returns in time (handing a batch to the
#: forward's thread and waking the watch takes about a millisecond before any model runs): every
#: episode ended as policy_timeout at step 0, scored as the policy's fault, and the run exited 0.
MIN_POLICY_TIMEOUT_S = 0.01
#: Largest sandbox address-space limit, MiB: 128 TiB, the whole user address space of x86-64
#: Linux (a larger limit limits nothing). Past 2^43 MiB the byte count overflowed setrlimit's
#: rlim_t in every sandbox, and every episode 'crashed' after the cluster was up.
MAX_SANDBOX_MEMORY_MB = 128 * 1024 * 1024
#: Most episodes one evaluation may run (``episodes``, ``max_episodes``, a suite task's). The
#: driver plans every episode's index and seed at once: 10^8 is a few GiB of plan, 1e12 died of a
#: bare MemoryError. The webhook's own cap is lower (100,000 per delivery).
MAX_EPISODES = 100_000_000
#: Largest training step: MLflow's steps and the Parquet 'step' column are int64. A larger one
#: was accepted, its episodes ran, and stage 7 failed with OverflowError (exit 1, no report).
MAX_STEP = 2**63 - 1
#: A request id names the evaluation's folder (``OUTPUT/runs/<id>``) and files beside it, so it
#: is a plain file name: no '/', no '..', not hidden. Generated ids are 16 hex digits; a suite's
#: tasks add '-tNN' and a baseline '-baseline' to theirs.
MAX_REQUEST_ID = 128
_REQUEST_ID = re.compile(rf"[A-Za-z0-9_\-][A-Za-z0-9._\-]{{0,{MAX_REQUEST_ID - 1}}}")
#: The integer fields: a bool is an int to Python and pydantic, and episodes=True ran one episode.
_INT_FIELDS = ("episodes", "concurrency", "seed", "max_steps", "workers", "envs_per_sandbox",
               "sandbox_memory_mb", "step", "max_episodes", "record_trajectories", "record_video",
               "retry_budget", "shard_episodes")


class EndReason(StrEnum):
    """Why an episode ended. Every episode row carries exactly one."""

    TERMINATED = "terminated"
    TRUNCATED = "truncated"
    ENV_ERROR = "env_error"
    POLICY_ERROR = "policy_error"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    OOM = "oom"
    INVALID_REWARD = "invalid_reward"
    INVALID_ACTION = "invalid_action"
    POLICY_TIMEOUT = "policy_timeout"

    @property
    def is_failure(self) -> bool:
        """True for every reason except a normal termination or truncation."""
        return self not in (EndReason.TERMINATED, EndReason.TRUNCATED)

    @property
    def is_policy_attributable(self) -> bool:
        """Failures the evaluated policy caused: they count in every headline figure.

        An episode the policy broke (an invalid action, an exception or a hang in its forward)
        is what the policy produced: its return up to the end, success false.
        """
        return self in (EndReason.INVALID_ACTION, EndReason.POLICY_ERROR, EndReason.POLICY_TIMEOUT)

    @property
    def is_harness_failure(self) -> bool:
        """Failures of the env, the sandbox or the infrastructure: excluded, stated as coverage."""
        return self.is_failure and not self.is_policy_attributable

    @property
    def is_infrastructural(self) -> bool:
        """Failures caused by the sandbox rather than the env's logic (retried, never cached)."""
        return self in (EndReason.TIMEOUT, EndReason.CRASHED, EndReason.OOM)


#: Most fresh-sandbox retries one episode may get (a crash loop must not run for ever).
MAX_RETRY_BUDGET = 10


#: MLflow tracking URI schemes MLflow itself knows (plugins add theirs through the
#: ``mlflow.tracking_store`` entry points). A path without a scheme is a file store.
MLFLOW_SCHEMES = frozenset({"file", "sqlite", "postgresql", "mysql", "mssql", "http", "https",
                            "databricks", "databricks-uc", "uc"})


def check_tracking_uri(uri: str) -> None:
    """Refuse an MLflow tracking URI whose scheme no store serves, before anything runs.

    Such a run could never be logged: it was queued for a store that will never answer, and
    the evaluation exited 0.
    """
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else (
        uri.split(":", 1)[0].lower() if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri) else "")
    if not uri.strip():
        raise RequestError("'mlflow_uri' is empty: leave it out for the store under --output.")
    if not scheme or scheme in MLFLOW_SCHEMES:
        return
    from importlib.metadata import entry_points

    plugins = {ep.name.lower() for ep in entry_points(group="mlflow.tracking_store")}
    if scheme not in plugins:
        raise RequestError(
            f"'mlflow_uri' {uri!r}: no MLflow store serves the scheme {scheme!r}. Use e.g. "
            "'sqlite:///path/mlflow.db', 'http://host:5000' or a folder path "
            f"(known: {', '.join(sorted(MLFLOW_SCHEMES | plugins))}).")


def check_training_pair(request: EvalRequest) -> None:
    """Refuse a training run id without a step, or a step without one, as a user gives them.

    The history finds a run's checkpoints by both: with one alone the evaluation silently got no
    history and no verdict. Not a model check: the code makes such requests on purpose (a
    baseline's has no step; an ``Evaluator`` without a run id labels results by step).
    """
    if (request.training_run_id is None) != (request.step is None):
        raise RequestError(
            f"'training_run_id' ({request.training_run_id!r}) and 'step' ({request.step!r}) go "
            "together: the history compares a training run's checkpoints by both, and with one "
            "alone this evaluation would get no history and no verdict. Pass both "
            "(--training-run-id RUN --step N), or neither.")


class _NonFinite(ValueError):
    """A NaN or Infinity constant in JSON text (``json.loads``'s ``parse_constant``)."""


def _no_constant(name: str) -> Any:
    raise _NonFinite(name)


def non_finite_path(value: Any, where: str) -> tuple[str, str] | None:
    """``(path, value)`` of the first non-finite float in ``value`` (dicts, lists), else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, repr(value)
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list | tuple) else ())
    for key, item in items:
        found = non_finite_path(item, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


def _non_finite_kwarg(value: str, where: str) -> str:
    at = f" at {where}" if where else ""
    return (f"'env_kwargs' must hold finite numbers (got {value}{at}): NaN and Infinity are not "
            "JSON, so the cache key, the report and MLflow's params could not hold what the env "
            "receives (the report showed null). Pass a finite number, or null for None.")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EvalRequest(_Frozen):
    """One evaluation: which policy, on which env, under which protocol, run where."""

    env: str = Field("CartPole-v1", description="Gymnasium id; 'module:EnvId-v0' imports module.")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="Kwargs for gym.make.")
    policy: str = Field(
        "", description="TorchScript file, state_dict file (+policy_factory) or 'module:function'."
    )
    policy_factory: str | None = Field(None, description="'module:function' building the nn.Module.")
    episodes: int = Field(500, description="Number of episodes (indices 0..episodes-1).")
    concurrency: int = Field(500, description="Environment instances alive at once, cluster-wide.")
    seed: int = Field(0, description="Base seed of the seed ledger.")
    max_steps: int | None = Field(None, description="Episode step cap; None = env's registered one.")
    deterministic: bool = Field(True, description="argmax actions (True) or sampled (False).")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda[:N]' for policy inference.")
    isolation: str = Field(
        "auto", description="Sandbox level: inprocess, process, bwrap, or auto (envs shipped with "
        "gymnasium or evalfleet inprocess, any other env in process sandboxes)."
    )
    sandbox_env_allow: list[str] = Field(
        default_factory=list, description="Environment variables sandboxes see besides the "
        "allow-list of evalfleet.sandbox.environment (names; the values are the worker's)."
    )
    sandbox_read: list[str] = Field(
        default_factory=list, description="Absolute paths process sandboxes may also read "
        "(an env's data outside its package); they read only what running the env needs else."
    )
    sandbox_write: list[str] = Field(
        default_factory=list, description="Absolute paths process sandboxes may also write, "
        "beside their own folder."
    )
    episode_timeout_s: float = Field(
        60.0, description="Seconds one episode may spend inside its env's reset/step calls "
        "(process/bwrap sandboxes; a single step is also cut off after step_timeout_s)."
    )
    step_timeout_s: float = Field(10.0, description="Wall-clock limit of one env step in a sandbox.")
    policy_timeout_s: float = Field(
        30.0, description="Wall-clock limit of one batched policy forward (a shard's first: 4x, "
        "for CUDA set-up and JIT warm-up); past it the shard's episodes end as policy_timeout."
    )
    envs_per_sandbox: int = Field(1, description="Env instances per sandbox process (process/bwrap).")
    sandbox_memory_mb: int = Field(1024, description="Address-space limit of one sandbox process.")
    workers: int = Field(2, description="Local Dask worker processes when no dask_address is given.")
    dask_address: str | None = Field(None, description="Existing Dask scheduler to use instead.")
    output: Path = Field(Path("results"), description="Results folder (Parquet, report, MLflow).")
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI; default under output.")
    experiment: str = Field("evalfleet", description="MLflow experiment name.")
    training_run_id: str | None = Field(None, description="Trainer's run id, tagged everywhere.")
    step: int | None = Field(None, description="Training step of the evaluated weights.")
    suite_task: str | None = Field(
        None, description="Set by a suite on its tasks' requests (the task's name): the suite, not "
        "each task, logs the trainer's eval/* metrics into its MLflow run."
    )
    cache: str = Field("use", description="'use' the cache, ignore it ('off'), or 'refresh' it.")
    cache_dir: Path | None = Field(
        None, description="Cache root; default $EVALFLEET_CACHE_DIR or output/cache."
    )
    target_ci_halfwidth: float | None = Field(
        None, description="Adaptive mode: add rounds until the 95% CI half-width is at most this."
    )
    max_episodes: int | None = Field(None, description="Adaptive mode: never more episodes than this.")
    baseline: str | None = Field(
        None, description="Baseline policy (file, module:function or 'sha256:HEX' in the cache)."
    )
    baseline_factory: str | None = Field(None, description="Factory for a state_dict baseline.")
    audit: bool = Field(True, description="Re-run 2% of episodes (at least 2) to check determinism.")
    record_trajectories: int = Field(0, description="Store every step of K chosen episodes (Parquet).")
    record_video: int = Field(0, description="Render K chosen episodes to MP4/GIF (envs that render).")
    callback_url: str | None = Field(None, description="URL the report is POSTed to (HMAC-signed).")
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:16])
    outcome_metric: str | None = Field(
        None, description="Task outcome the history's reward-hacking alarm watches: a numeric key "
        "of the env's final info (e.g. 'profit', 'win'); None = the success rate."
    )
    review: bool = Field(
        True, description="Stage 7 replays episodes and writes plots and report.html; False "
        "writes only Parquet, report.json, MLflow and Prefect artifacts (suite tasks by default: "
        "the suite's page shows them), unless recordings are asked for."
    )
    retry_budget: int = Field(
        2, description="Fresh-sandbox retries (same seed) of an episode a harness failure ended "
        "(timeout, crashed, oom); what still fails is left out and lowers coverage."
    )
    retry_backoff_s: float = Field(
        0.2, description="Wait before an episode's first retry; doubles for each later one."
    )
    shard_episodes: int | None = Field(
        None, description="Most episodes in one shard: finished shards persist at once, so a "
        "killed evaluation loses at most the shards running. None: max(1024, 4 x a shard's env "
        "slots), which keeps one shard per worker for small evaluations."
    )

    @field_validator("env_kwargs", mode="before")
    @classmethod
    def _parse_kwargs(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                # NaN and Infinity are not JSON, but json.loads takes them: the env got NaN (truthy:
                # a flag such as CartPole's sutton_barto_reward turned on) and the report null.
                value = json.loads(value, parse_constant=_no_constant) if value.strip() else {}
            except _NonFinite as err:
                raise RequestError(_non_finite_kwarg(str(err), "")) from None
            except json.JSONDecodeError as err:
                raise RequestError(
                    f"'env_kwargs' must be a JSON object (got {value!r}: {err.msg} at column "
                    f"{err.colno}); pass e.g. '{{\"max_episode_steps\": 200}}'."
                ) from err
        if not isinstance(value, dict):
            raise RequestError(
                f"'env_kwargs' must be a JSON object / dict (got {type(value).__name__}: {value!r})."
            )
        where = non_finite_path(value, "")
        if where is not None:
            raise RequestError(_non_finite_kwarg(where[1], where[0]))
        return value

    @field_validator(*_INT_FIELDS, mode="before")
    @classmethod
    def _no_bool(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool):
            raise RequestError(f"'{info.field_name}' must be an integer, not a bool (got {value!r}).")
        return value

    @field_validator("output", "cache_dir", mode="before")
    @classmethod
    def _no_empty_path(cls, value: Any, info: ValidationInfo) -> Any:
        # Path("") is the current folder: results (or the cache) went wherever the run started.
        if isinstance(value, str) and not value.strip():
            raise RequestError(
                f"'{info.field_name}' is empty: name a folder, e.g. 'results'"
                + (", or leave it out for OUTPUT/cache." if info.field_name == "cache_dir" else "."))
        return value

    @field_validator("request_id")
    @classmethod
    def _safe_request_id(cls, value: str) -> str:
        if not _REQUEST_ID.fullmatch(value):
            raise RequestError(
                f"'request_id' must be 1-{MAX_REQUEST_ID} letters, digits or '._-', not starting "
                f"with '.' (got {value!r}): it names the run's folder, OUTPUT/runs/<id>. Leave it "
                "out for a generated one.")
        return value

    @field_validator("callback_url")
    @classmethod
    def _http_callback(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            parts = urlsplit(value)
            host = parts.hostname
        except ValueError:  # e.g. an unclosed '[' of an IPv6 address
            host = None
        if not host or parts.scheme not in ("http", "https"):
            raise RequestError(
                f"'callback_url' must be an http(s) URL such as 'https://trainer:8080/evalfleet' "
                f"(got {value!r}): the report is POSTed there. Leave it out for no callback.")
        return value

    @model_validator(mode="after")
    def _check(self) -> EvalRequest:
        for name in ("episodes", "concurrency", "workers", "envs_per_sandbox", "sandbox_memory_mb"):
            value = getattr(self, name)
            if value <= 0:
                raise RequestError(f"'{name}' must be a positive integer (got {value!r}).")
        for name in ("episodes", "max_episodes"):
            value = getattr(self, name)
            if value is not None and value > MAX_EPISODES:
                raise RequestError(
                    f"'{name}' must be at most {MAX_EPISODES:,} (got {value:,}): the driver plans "
                    "every episode's index and seed in memory. Split the run into evaluations with "
                    "different --seed values.")
        if self.sandbox_memory_mb > MAX_SANDBOX_MEMORY_MB:
            raise RequestError(
                f"'sandbox_memory_mb' must be at most {MAX_SANDBOX_MEMORY_MB} MiB (128 TiB, the "
                f"whole address space of a 64-bit process; got {self.sandbox_memory_mb!r}): a "
                "larger limit does not fit the sandboxes' RLIMIT_AS. Pass the MiB a sandbox may "
                "use, e.g. 4096.")
        if not 0 <= self.seed <= MAX_BASE_SEED:
            raise RequestError(
                f"'seed' must be an integer in [0, {MAX_BASE_SEED}] (got {self.seed!r}): the seed "
                "ledger derives each episode's seed from it.")
        if self.step is not None and self.step < 0:
            raise RequestError(f"'step' must be a training step >= 0 (got {self.step!r}).")
        if self.step is not None and self.step > MAX_STEP:
            raise RequestError(
                f"'step' must be a training step from 0 to {MAX_STEP} (2^63 - 1: MLflow's steps and "
                f"the episodes' 'step' column are int64; got {self.step!r}).")
        if not self.experiment.strip():
            raise RequestError("'experiment' is empty: name the MLflow experiment, e.g. 'evalfleet'.")
        if self.mlflow_uri is not None:
            check_tracking_uri(self.mlflow_uri)
        if self.max_steps is not None and self.max_steps <= 0:
            raise RequestError(
                f"'max_steps' must be a positive integer or None (got {self.max_steps!r})."
            )
        kwarg_cap = self.env_kwargs.get("max_episode_steps")
        if isinstance(kwarg_cap, bool) or not isinstance(kwarg_cap, int | None) or (
                kwarg_cap is not None and kwarg_cap <= 0):
            # gym.make took true as a cap of 1 (a bool is an int), and --max-steps 1 "agreed" with it.
            raise RequestError(
                f"env_kwargs' 'max_episode_steps' must be a positive integer (got {kwarg_cap!r}): "
                "it caps every episode at that many steps. Pass e.g. {\"max_episode_steps\": 200}, "
                "or --max-steps 200.")
        if self.max_steps is not None and "max_episode_steps" in self.env_kwargs and (
                kwarg_cap != self.max_steps):
            # Both cap the episode: max_steps won, and the report's kwargs showed the other cap.
            raise RequestError(
                f"'max_steps' ({self.max_steps}) and env_kwargs' 'max_episode_steps' "
                f"({kwarg_cap!r}) both cap the episode and disagree: give the cap once, as "
                "--max-steps N or as max_episode_steps in --env-kwargs.")
        if self.isolation not in ISOLATION_LEVELS:
            raise RequestError(
                f"Unknown isolation {self.isolation!r}. Choose one of {', '.join(ISOLATION_LEVELS)}."
            )
        for name in self.sandbox_env_allow:
            if not _ENV_NAME.fullmatch(name):
                raise RequestError(
                    f"'sandbox_env_allow' entries must be environment variable names such as "
                    f"'MY_ENV_DATA_DIR' (got {name!r})."
                )
        for name in ("sandbox_read", "sandbox_write"):
            for path in getattr(self, name):
                if not path.startswith("/"):
                    raise RequestError(
                        f"'{name}' entries must be absolute paths such as '/data/my-env' "
                        f"(got {path!r}).")
            if getattr(self, name) and self.isolation == "bwrap":
                raise RequestError(
                    f"'{name}' applies to process sandboxes; a bwrap jail shows only its own "
                    "binds (the system, the interpreter, site-packages, the env's packages). "
                    "Use isolation 'process', or ship the env's data inside its package.")
        if self.cache not in CACHE_MODES:
            raise RequestError(f"Unknown cache mode {self.cache!r}. Choose one of {', '.join(CACHE_MODES)}.")
        if self.target_ci_halfwidth is not None:
            if not (math.isfinite(self.target_ci_halfwidth) and self.target_ci_halfwidth > 0):
                raise RequestError(
                    f"'target_ci_halfwidth' must be a finite number > 0 (got "
                    f"{self.target_ci_halfwidth!r})."
                )
            if self.max_episodes is None:
                raise RequestError(
                    "adaptive evaluation needs a cap: pass --max-episodes M with --target-ci-halfwidth."
                )
        if self.max_episodes is not None and self.max_episodes < self.episodes:
            raise RequestError(
                f"'max_episodes' ({self.max_episodes}) must be >= 'episodes' ({self.episodes})."
            )
        self._check_asked_for()
        # NaN passed '<= 0' checks (every episode then timed out); inf means no limit, and every
        # wait takes it as such (a wait of inf seconds, or of 1e10, overflowed).
        for name in ("step_timeout_s", "policy_timeout_s", "episode_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and (value <= MAX_TIMEOUT_S or value == math.inf)):
                raise RequestError(
                    f"'{name}' must be > 0 and at most {MAX_TIMEOUT_S:.0f} seconds (about 11.6 "
                    f"days), or inf for no limit (got {value!r}).")
        if self.policy_timeout_s < MIN_POLICY_TIMEOUT_S:
            raise RequestError(
                f"'policy_timeout_s' must be at least {MIN_POLICY_TIMEOUT_S} seconds (got "
                f"{self.policy_timeout_s!r}): no policy forward returns that fast, so every episode "
                "would end as policy_timeout at step 0 and count as the policy's failure. It is in "
                "seconds: pass e.g. 0.5 for 500 ms, or leave it out (30).")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise RequestError(
                f"Unknown device {self.device!r}. Choose 'auto', 'cpu', 'cuda' or 'cuda:N'."
            )
        if not self.policy:
            raise RequestError("'policy' is empty: pass a policy file path or 'module:function'.")
        if self.outcome_metric is not None and not _INFO_KEY.fullmatch(self.outcome_metric):
            raise RequestError(
                f"'outcome_metric' must name a numeric key of the env's final info, such as "
                f"'profit' or 'win' (got {self.outcome_metric!r}); leave it out to watch the "
                "success rate."
            )
        if self.training_run_id is not None and not _RUN_ID.fullmatch(self.training_run_id):
            raise RequestError(
                f"'training_run_id' must be 1-256 letters, digits or '._-:/@+' "
                f"(got {self.training_run_id!r}): the history finds evaluations by it in MLflow."
            )
        return self

    def _check_asked_for(self) -> None:
        """Options that would do nothing, or give less than they ask for, refused before any run."""
        if self.max_episodes is not None and self.target_ci_halfwidth is None:
            raise RequestError(
                f"'max_episodes' ({self.max_episodes}) caps an adaptive evaluation and does nothing "
                "alone: pass --target-ci-halfwidth H with it (rounds of episodes until the 95% CI "
                "half-width is at most H), or drop it and set --episodes.")
        if self.baseline_factory is not None and self.baseline is None:
            raise RequestError(
                f"'baseline_factory' ({self.baseline_factory!r}) builds the module of a state_dict "
                "baseline, but no baseline was given: pass --baseline FILE with it, or drop it.")
        if self.outcome_metric is not None and (self.training_run_id is None or self.step is None):
            raise RequestError(
                f"'outcome_metric' ({self.outcome_metric!r}) names what the reward-hacking alarm "
                "watches across a training run's checkpoints, and this evaluation is on none "
                f"(training_run_id {self.training_run_id!r}, step {self.step!r}): pass "
                "--training-run-id and --step with it, or drop it.")
        # An adaptive evaluation may stop after its first round: only those episodes are sure.
        # Bounded by max_episodes, 10 trajectories and 6 videos were asked for and 4 of each
        # written (the first round's 4) with no alarm.
        cap = self.episodes
        for name in ("record_trajectories", "record_video"):
            k = getattr(self, name)
            if k < 0:
                raise RequestError(f"'{name}' must be >= 0 (got {k!r}).")
            if k > cap:
                sure = (" for sure (an adaptive one may stop after its first round of "
                        f"--episodes {cap})" if self.max_episodes is not None else "")
                raise RequestError(
                    f"'{name}' asks for {k} recorded episodes, but this evaluation runs {cap}"
                    f"{sure}: ask for at most {cap}, or run more episodes.")

    @model_validator(mode="after")
    def _check_retries(self) -> EvalRequest:
        if not 0 <= self.retry_budget <= MAX_RETRY_BUDGET:
            raise RequestError(
                f"'retry_budget' must be an integer from 0 to {MAX_RETRY_BUDGET} (got "
                f"{self.retry_budget!r}); 0 turns infrastructure retries off."
            )
        if self.shard_episodes is not None and self.shard_episodes <= 0:
            raise RequestError(
                f"'shard_episodes' must be a positive integer or None (got {self.shard_episodes!r})."
            )
        if not 0 <= self.retry_backoff_s <= 60:
            raise RequestError(
                f"'retry_backoff_s' must be between 0 and 60 seconds (got {self.retry_backoff_s!r})."
            )
        return self

    @model_validator(mode="after")
    def _check_hash_baseline(self) -> EvalRequest:
        ref = self.baseline
        if ref is not None and ref.startswith("sha256:") and not _HASH_PREFIX.fullmatch(
                ref[len("sha256:"):]):
            raise RequestError(
                f"a 'sha256:' baseline names a cached policy by at least {MIN_HASH_PREFIX} hex "
                f"digits of its sha256 (got {ref!r}); copy it from a report's policy_sha256 or "
                "from 'evalfleet cache ls'.")
        return self

    @classmethod
    def build(cls, **fields: Any) -> EvalRequest:
        """Validate ``fields`` into a request; every problem becomes one clear ``RequestError``."""
        try:
            return cls(**fields)
        except ValidationError as err:
            problems = []
            for e in err.errors():
                where = ".".join(str(p) for p in e["loc"]) or "request"
                msg = str(e["msg"]).removeprefix("Value error, ")
                if msg.startswith("'") or not e["loc"]:  # a whole-request check names its field
                    problems.append(msg)
                else:
                    problems.append(f"'{where}': {msg} (got {e.get('input')!r})")
            raise RequestError("; ".join(problems)) from None

    @property
    def wants_gpu(self) -> bool:
        """True when inference must run on a CUDA device."""
        return self.device.startswith("cuda")


class Shard(_Frozen):
    """Episodes one run-stage task executes, with how many env instances it keeps alive."""

    shard_id: int
    episode_indices: list[int]
    seeds: list[int]
    slots: int
    audit: bool = False


class ShardPlan(_Frozen):
    """Stage-2 output: the shards, plus what the cache already answered."""

    request_id: str
    shards: list[Shard]
    total_episodes: int
    planned_episodes: int
    cached_episodes: int = 0
    cache_key: str | None = None
    seconds: float = 0.0


class PolicyHandle(_Frozen):
    """What a worker needs to fetch, verify and load the policy once."""

    sha256: str
    format: str
    factory: str | None
    plugin_name: str | None
    nbytes: int
    device: str
    deterministic: bool
    distributed_at: float
    code: tuple[tuple[str, str], ...] = ()
    """``(top-level module, code version)`` the cache key names (``Received.expected_code``):
    a worker running other code refuses the shard (``StaleWorkerCode``)."""
    factory_sha256: str | None = None
    """The sha256 of a state_dict factory's source (``PolicyArtifact.factory_sha256``): with
    ``factory`` and ``code``, what decides the module that the same bytes load into."""
    sandbox_required: tuple[str, ...] | None = None
    """The confinement each sandbox must apply (``Received.sandbox_required``: the driver's
    probe, which the report states); a sandbox that cannot refuses to run env code. None: the
    worker's own probe's."""


class EvalReport(_Frozen):
    """Everything an evaluation tells its users; serialised as report.json."""

    request_id: str
    env_id: str
    env_spec_hash: str
    policy_sha256: str
    training_run_id: str | None
    step: int | None
    isolation: str
    episodes: int
    completed: int
    failures: dict[str, int]
    failure_rate: float
    harness_fault: bool
    # Headline accounting (evalfleet.scoring): scored = completed + policy-attributable failures,
    # the episodes every headline figure is computed over; harness failures are left out.
    scored: int
    policy_failures: int
    harness_failures: int
    coverage: float
    policy_failure_rate: float
    harness_failure_rate: float
    alarms: list[str]
    returns: dict[str, Any]
    lengths: dict[str, float | None]
    """Episode-length stats; null in JSON (NaN in memory) when no episode was scored."""
    success: dict[str, Any] | None
    env_steps: int
    steps_per_second: float | None
    """Env steps per second of the episodes this evaluation ran (``env_steps`` counts cached ones
    too); null when it ran none (a full cache hit)."""
    episodes_per_second: float | None
    timings: dict[str, float]
    cache: dict[str, Any]
    outputs: dict[str, str]
    manifest: dict[str, Any]
    adaptive: dict[str, Any] | None = None
    audit: dict[str, Any] | None = None
    comparison: dict[str, Any] | None = None
    failure_clusters: list[dict[str, Any]] = []
    step_rewards: dict[str, Any] | None = None
    endings: dict[str, Any] | None = None
    """How completed episodes ended: ``terminated``, ``truncated``, of those ``at_step_cap``
    (length at ``step_cap``, the effective ``max_episode_steps``)."""
    history: dict[str, Any] | None = None
    suite_task: str | None = None
    """The suite task this evaluation is (``EvalRequest.suite_task``); None on its own."""
    """Feed back across training (``evalfleet.history``): the verdict against the best earlier
    checkpoint of the same training run (paired, same seeds), the best checkpoint's step and
    weights hash, and the drift / reward-hacking alarms against the previous checkpoint."""

    @property
    def verdict(self) -> str | None:
        """The history's verdict (``evalfleet.history.VERDICTS``), None without a history."""
        return None if not self.history else self.history.get("verdict")

    @property
    def mean(self) -> float:
        """Mean return over the scored episodes (completed and policy-attributable failures)."""
        return float(self.returns["mean"])

    @property
    def ci(self) -> tuple[float, float]:
        """95% confidence interval of the mean return."""
        return float(self.returns["ci"]["low"]), float(self.returns["ci"]["high"])

    @property
    def missing_outputs(self) -> list[str]:
        """Outputs asked for that stage 7 could not produce.

        Its ``output_missing`` alarms, and fewer videos or trajectories than asked
        (``recording_incomplete``, whole).
        The numbers stand (Parquet and the cache are written first), but a run with any is a
        failed run: the CLI exits ``EXIT_OUTPUT_MISSING`` (``EXIT_HARNESS_FAULT`` first for a
        recording, which ``--allow-failures`` does not waive) and ``Evaluator.flush`` raises.
        """
        prefix = f"{OUTPUT_MISSING}: "
        return [a.removeprefix(prefix) for a in self.alarms if a.startswith(prefix)] + [
            a for a in self.alarms if a.startswith(f"{RECORDING_INCOMPLETE}: ")]


#: The alarm prefix of an output asked for and not produced (the review's files, the MLflow run,
#: the trainer's callback).
OUTPUT_MISSING = "output_missing"
#: The alarm prefix of fewer videos or trajectories written than asked for.
RECORDING_INCOMPLETE = "recording_incomplete"
#: The alarm prefix of inputs the cache key names (code, kwargs files) changed while episodes ran.
INPUTS_CHANGED = "inputs_changed"
#: The alarm prefix of replays that differ from their rows on the episodes' device.
REPLAY_NONDETERMINISM = "replay_nondeterminism"


def with_missing(alarms: list[str], missing: list[str]) -> list[str]:
    """``alarms`` plus an ``output_missing`` alarm per output asked for and not produced."""
    for what in missing:
        logging.getLogger("evalfleet.feed_back").error("%s: %s", OUTPUT_MISSING, what)
    return [*alarms, *(f"{OUTPUT_MISSING}: {what}" for what in missing)]
