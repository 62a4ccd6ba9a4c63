"""Resolving environment ids into makers, fingerprints and space descriptions."""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from evalfleet.errors import EnvSpecError
from evalfleet.provenance import code_version

logger = logging.getLogger(__name__)

#: Modules imported on every worker before making envs, so evalfleet's own ids resolve.
BUILTIN_ENV_MODULES = ("envs",)


def import_env_modules(env_id: str) -> None:
    """Import the modules that register ``env_id`` (evalfleet's envs and a ``module:`` prefix)."""
    for name in BUILTIN_ENV_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # evalfleet's envs are optional for users' own ids
            logger.debug("could not import %s", name)
    if ":" in env_id:
        module = env_id.split(":", 1)[0]
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise EnvSpecError(
                f"env {env_id!r}: cannot import module {module!r} ({err}); install the package "
                "that provides it on every worker, or fix the 'module:EnvId-v0' id."
            ) from err


@dataclass(frozen=True)
class EnvFingerprint:
    """What identifies an env's behaviour: id, kwargs, registered spec, providing package."""

    env_id: str
    kwargs: dict[str, Any]
    max_episode_steps: int | None
    entry_point: str
    version: int | None
    package: str
    package_version: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, used in the spec hash, the cache key and the manifest."""
        return {
            "env_id": self.env_id,
            "kwargs": self.kwargs,
            "max_episode_steps": self.max_episode_steps,
            "entry_point": self.entry_point,
            "version": self.version,
            "package": self.package,
            "package_version": self.package_version,
        }

    @property
    def spec_hash(self) -> str:
        """sha256 (hex, first 16) of the fingerprint."""
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _package_of(module: str) -> tuple[str, str]:
    """The package providing ``module`` and its code version (see ``evalfleet.provenance``)."""
    return code_version(module)


def make_env(
    env_id: str, kwargs: dict[str, Any], max_steps: int | None, render_mode: str | None = None
) -> gym.Env[Any, Any]:
    """``gym.make`` with the protocol's step cap; the only place envs are constructed."""
    import_env_modules(env_id)
    extra: dict[str, Any] = dict(kwargs)
    if max_steps is not None:
        extra["max_episode_steps"] = max_steps
    if render_mode is not None:
        extra["render_mode"] = render_mode
    return gym.make(env_id, disable_env_checker=True, **extra)


def env_thunk(
    env_id: str, kwargs: dict[str, Any], max_steps: int | None
) -> Callable[[], gym.Env[Any, Any]]:
    """A zero-argument maker, as workers and sandboxes need."""

    def thunk() -> gym.Env[Any, Any]:
        return make_env(env_id, kwargs, max_steps)

    return thunk


def describe_space(space: gym.Space[Any]) -> dict[str, Any]:
    """A JSON-ready description of a space (kind, shape, dtype, n / bounds)."""
    if isinstance(space, spaces.Discrete):
        return {"kind": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.Box):
        return {
            "kind": "Box",
            "shape": list(space.shape),
            "dtype": str(space.dtype),
            "low": float(space.low.min()),
            "high": float(space.high.max()),
        }
    return {"kind": type(space).__name__, "repr": repr(space)}


@dataclass(frozen=True)
class ResolvedEnv:
    """An env id checked by constructing it once, with its fingerprint and spaces."""

    fingerprint: EnvFingerprint
    observation_space: gym.Space[Any]
    action_space: gym.Space[Any]


def resolve_env(env_id: str, kwargs: dict[str, Any], max_steps: int | None) -> ResolvedEnv:
    """Make the env once in this process: unknown ids and bad kwargs fail here, not on workers."""
    import_env_modules(env_id)
    bare_id = env_id.split(":", 1)[1] if ":" in env_id else env_id
    try:
        spec = gym.spec(bare_id)
    except gym.error.Error as err:
        raise EnvSpecError(
            f"unknown env id {env_id!r} ({err}). Expected a registered Gymnasium id such as "
            "'CartPole-v1', or 'module:EnvId-v0' to import your own module first."
        ) from err
    try:
        env = make_env(env_id, kwargs, max_steps)
    except Exception as err:
        raise EnvSpecError(
            f"env {env_id!r} could not be made with kwargs {kwargs!r}: {type(err).__name__}: {err}. "
            "Check --env-kwargs against the env's constructor."
        ) from err
    try:
        effective_max = max_steps if max_steps is not None else spec.max_episode_steps
        if effective_max is None:
            raise EnvSpecError(
                f"env {env_id!r} registers no max_episode_steps, so an episode might never end; "
                "pass --max-steps N (an explicit cap is part of the protocol)."
            )
        for name, space in (("observation", env.observation_space), ("action", env.action_space)):
            if not isinstance(space, spaces.Box | spaces.Discrete):
                raise EnvSpecError(
                    f"env {env_id!r} has a {type(space).__name__} {name} space; evalfleet batches "
                    "Box observations and Box/Discrete actions. Wrap the env (e.g. FlattenObservation)."
                )
        ep = spec.entry_point
        entry = ep if isinstance(ep, str) else f"{ep.__module__}:{getattr(ep, '__qualname__', ep)}"
        package, package_version = _package_of(entry.split(":", 1)[0])
        fingerprint = EnvFingerprint(
            env_id=env_id,
            kwargs=dict(kwargs),
            max_episode_steps=effective_max,
            entry_point=entry,
            version=spec.version,
            package=package,
            package_version=package_version,
        )
        return ResolvedEnv(fingerprint, env.observation_space, env.action_space)
    finally:
        env.close()
