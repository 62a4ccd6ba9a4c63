"""The receiver's HTTP contract: the body of ``POST /v1/evaluations`` and the error answer.

``EvaluationCreate`` is what a trainer sends; ``parse_body`` turns raw bytes into it or into a
400 naming the field; ``Rejected`` is every non-2xx answer, raised anywhere in the receiver and
rendered as JSON by the app; ``idempotency_key`` says which deliveries are one evaluation.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, ValidationError, field_validator

from evalfleet.callback import canonical_json
from evalfleet.models import MAX_STEP
from evalfleet.seeds import MAX_BASE_SEED


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _no_bool(value: Any) -> Any:
    # pydantic's int takes true as 1: 'episodes: true' ran one episode and 'step: true' was step 1,
    # past EvalRequest's own bool check (it saw the 1).
    if isinstance(value, bool):
        raise ValueError(f"must be an integer, not a bool (got {json.dumps(value)})")
    return value


class PolicyRef(_Strict):
    """Where the policy bytes are and what they hash to."""

    uri: str = Field(min_length=1, description="file:///abs/path, an absolute path, or http(s)://.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Lower-case hex sha256 of the bytes.")
    factory: str | None = Field(
        None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="'module:function' building the nn.Module when the bytes are a state_dict.",
    )


class EnvRef(_Strict):
    """The evaluation environment."""

    id: str = Field(min_length=1, description="Gymnasium id ('module:EnvId-v0' imports module).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Kwargs for gym.make.")


class EvalProtocol(_Strict):
    """What makes two evaluations comparable: same protocol, same numbers."""

    episodes: int = Field(100, gt=0, le=100_000, description="Episodes (indices 0..episodes-1).")
    seed: int = Field(0, ge=0, le=MAX_BASE_SEED, description="Base seed of the seed ledger.")
    max_steps: int | None = Field(None, gt=0, description="Step cap; None = the env's own.")
    deterministic: bool = Field(True, description="argmax actions (True) or sampled (False).")

    _ints = field_validator("episodes", "seed", "max_steps", mode="before")(_no_bool)


class EvaluationCreate(_Strict):
    """Body of ``POST /v1/evaluations``."""

    policy: PolicyRef
    env: EnvRef | None = Field(None, description="Required, except with a suite (its tasks name "
                               "their envs, and an env given with one is refused).")
    protocol: EvalProtocol = Field(
        default_factory=lambda: EvalProtocol.model_validate({}),
        description="With a suite only 'seed' and 'deterministic': its tasks set their episodes "
        "and step caps.")
    training_run_id: str | None = Field(None, max_length=256, description="Trainer's run id.")
    step: int | None = Field(None, ge=0, le=MAX_STEP, description="Training step of these weights "
                             "(MLflow steps and the Parquet 'step' column are int64).")
    callback_url: AnyHttpUrl | None = Field(None, description="Where the signed report is POSTed.")
    experiment: str | None = Field(None, max_length=256, description="MLflow experiment override.")
    outcome_metric: str | None = Field(
        None, max_length=128, description="Final-info key of the task outcome the history's "
        "reward-hacking alarm watches across checkpoints (default: the success rate).")
    suite: dict[str, Any] | None = Field(
        None, description="A suite: suite.toml's structure as JSON ({'suite': {...}, 'task': "
        "[...]}, see evalfleet.suite); every task is evaluated and aggregated. Its tasks set "
        "env, env kwargs, episodes and step cap: 'env', 'protocol.episodes' and "
        "'protocol.max_steps' given with it are refused.")

    _step = field_validator("step", mode="before")(_no_bool)


def suite_sets(body: EvaluationCreate) -> list[str]:
    """The fields of ``body`` that its suite's tasks set for themselves (would be ignored)."""
    if body.suite is None:
        return []
    return ["env"] * (body.env is not None) + [
        f"protocol.{name}" for name in ("episodes", "max_steps")
        if name in body.protocol.model_fields_set]


def idempotency_key(body: EvaluationCreate) -> str:
    """sha256 over what the trainer said fixes an evaluation and where its results go.

    Two deliveries with the same key are the same evaluation. It is computed from the body
    alone, so the receiver needs neither torch nor the env's package. ``evalfleet.cache``'s key
    is finer (env spec and package versions, policy output kind) but needs stage 1 to load the
    env and policy; the flow applies it anyway, so a run that slips past this key still reuses
    cached episodes instead of recomputing them.
    """
    doc = {
        "policy_sha256": body.policy.sha256,
        "policy_factory": body.policy.factory,
        "env": body.env.id if body.env is not None else None,  # None: a suite's (its tasks name theirs)
        "env_kwargs": body.env.kwargs if body.env is not None else {},
        "seed": body.protocol.seed,
        "episodes": body.protocol.episodes,
        "max_steps": body.protocol.max_steps,
        "deterministic": body.protocol.deterministic,
    }
    if body.outcome_metric is not None:  # another outcome is another history (keys stay as they were)
        doc["outcome_metric"] = body.outcome_metric
    # The same weights at another step of a training run are another checkpoint: its history row,
    # the trainer's curve at that step and its callback must exist (the flow's cache still answers
    # the episodes). A redelivery carries the same step, so it stays one evaluation.
    if body.training_run_id is not None:
        doc["training_run_id"] = body.training_run_id
    if body.step is not None:
        doc["step"] = body.step
    if body.suite is not None:  # only then: the keys of single evaluations stay as they were
        doc["suite"] = body.suite
    # Where the result goes is part of what was asked: a redelivery naming another callback (a
    # listener restarted on a new port) or MLflow experiment was answered "duplicate", and its
    # callback never came. Absent, they leave the key as it was.
    if body.callback_url is not None:
        doc["callback_url"] = body.callback_url
    if body.experiment is not None:
        doc["experiment"] = body.experiment
    return hashlib.sha256(canonical_json(doc)).hexdigest()


class Rejected(Exception):
    """An HTTP error answer, raised inside the handler and rendered as JSON."""

    def __init__(self, status: int, error: str, reason: str, *, field_name: str | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.body: dict[str, Any] = {"error": error, "reason": reason}
        if field_name is not None:
            self.body["field"] = field_name
        self.body.update(extra or {})


def parse_body(raw: bytes) -> EvaluationCreate:
    """JSON → ``EvaluationCreate``; every problem becomes a 400 naming the field and the reason."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise Rejected(400, "invalid_request", f"body is not JSON: {err}", field_name="body") from None
    try:
        return EvaluationCreate.model_validate(data)
    except ValidationError as err:
        problems = [
            {"field": ".".join(str(p) for p in e["loc"]) or "body",
             "reason": str(e["msg"]).removeprefix("Value error, ")}
            for e in err.errors()
        ]
        first = problems[0]
        raise Rejected(400, "invalid_request", first["reason"], field_name=first["field"],
                       extra={"problems": problems}) from None
