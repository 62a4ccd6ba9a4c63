"""Resolving environment ids into makers, fingerprints and space descriptions.

The fingerprint is the env's part of the cache key: whatever ``gym.make`` combines into the env
an episode runs on. Besides the requested kwargs and the step cap that is the registered spec's
own kwargs and additional wrappers (``gym.make`` applies both), and the code of every package
involved: the entry point's, the module an id of the form ``'module:EnvId-v0'`` imports (it
usually does the registering), the wrappers' and any class or function named in the spec's
kwargs. Spec fields that cannot change a return stay out: ``reward_threshold`` and
``nondeterministic`` are labels, ``order_enforce`` only turns a step before reset into an error,
``disable_env_checker`` is overridden (evalfleet always disables the checker) and
``vector_entry_point`` is not used by ``gym.make``.

Requested kwargs must be JSON values, refused otherwise before anything is imported: the key,
the report and MLflow's params then all hold exactly what the env receives. A registered spec's
kwargs come from code and may hold anything; they are keyed exactly (an array by the sha256 of its
bytes, dtype and shape) and the code that set them is keyed too.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import math
import os
import re
import reprlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from evalfleet.errors import EnvSpecError
from evalfleet.provenance import (
    code_version,
    file_sha256,
    imported_code,
    tree_digest,
    tree_files,
)

logger = logging.getLogger(__name__)

#: Modules imported on every worker before making envs, so evalfleet's own ids resolve.
BUILTIN_ENV_MODULES = ("envs",)
#: The ids those modules register begin so.
BUNDLED_ID_PREFIX = "evalfleet/"


def import_env_modules(env_id: str) -> None:
    """Import the modules that register ``env_id`` (evalfleet's envs and a ``module:`` prefix).

    evalfleet's envs only from this project's ``envs`` folder: another top-level ``envs``
    first on the import path (``PYTHONPATH``, site-packages) is refused before it is imported
    (``ForeignEnvsPackage``, an ``EnvSpecError``' sibling), never run outside a sandbox.
    """
    from evalfleet.sandbox.isolation import ForeignEnvsPackage, import_project_envs

    for name in BUILTIN_ENV_MODULES:
        try:
            import_project_envs(name)
        except ImportError:  # evalfleet's envs are optional for users' own ids
            logger.debug("could not import %s", name)
        except ForeignEnvsPackage as err:
            if env_id.startswith(BUNDLED_ID_PREFIX):
                raise
            # Not needed for this id (a Gymnasium or a user's own env): the other package named
            # 'envs' (an RL project's own folder, often) stays unimported, and the id runs.
            logger.debug("evalfleet's bundled envs skipped for %s: %s", env_id, err)
    if ":" in env_id:
        module = env_id.split(":", 1)[0]
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise EnvSpecError(
                f"env {env_id!r}: cannot import module {module!r} ({err}); install the package "
                "that provides it on every worker, or fix the 'module:EnvId-v0' id."
            ) from err


#: The types requested env kwargs may be made of (exactly these: no subclasses), JSON's own.
_JSON_SCALARS = (str, int, float, bool, type(None))


def check_env_kwargs(env_id: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse requested kwargs that JSON cannot carry exactly (a numpy array, a tuple, ...).

    The key, the report and MLflow's params record kwargs as JSON; a value JSON would turn into
    something else (an array into its truncated ``str``, a tuple into a list, ``np.int64(3)``
    into ``"3"``) would let two different requests share one key.
    """

    def walk(value: Any, where: str) -> None:
        kind = type(value)
        if kind is float and not math.isfinite(value):  # NaN and Infinity are not JSON either
            raise _not_json(env_id, where, value)
        if kind in _JSON_SCALARS:
            return
        if kind is list:
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")
            return
        if kind is dict:
            for key, item in value.items():
                if type(key) is not str:
                    raise _not_json(env_id, f"{where} key {key!r}", key)
                walk(item, f"{where}[{key!r}]")
            return
        raise _not_json(env_id, where, value)

    for name, value in kwargs.items():
        if type(name) is not str:
            raise _not_json(env_id, f"name {name!r}", name)
        walk(value, repr(name))


def _not_json(env_id: str, where: str, value: Any) -> EnvSpecError:
    kind = type(value)
    return EnvSpecError(
        f"env {env_id!r}: env kwarg {where} must be a JSON value (dict with str keys, list, str, "
        f"int, finite float, bool or None; got {kind.__module__}.{kind.__qualname__}: "
        f"{reprlib.repr(value)}). The cache key, the report and MLflow's params hold kwargs as "
        "JSON, so they must carry exactly what the env receives: pass the JSON equivalent "
        "(array.tolist(), float(x) or int(x), a list for a tuple) and convert it in the env's "
        "constructor, or pass what the env can build the object from (a file path, a seed)."
    )


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}:{getattr(obj, '__qualname__', repr(obj))}"


#: The keys that mark a value's exact form as not plain JSON (see ``_spec_value``).
_TAGS = ("__tuple__", "__dict__", "__ndarray__", "__numpy__", "__object__", "__type__")


def _spec_value(value: Any, modules: set[str]) -> Any:
    """The exact, JSON-ready form of a registered kwarg; adds the modules whose code it names.

    Plain JSON stays as it is; anything else becomes a dict holding one of ``_TAGS``, so no two
    different values share a form (a plain dict holding a tag key is itself tagged): arrays by
    the sha256 of their bytes, dtype and shape; classes and functions by ``module:qualname``
    (their module's code is keyed); other objects by their ``repr`` less memory addresses
    (their class's module is keyed).
    """
    kind = type(value)
    if kind in _JSON_SCALARS:
        return value
    if kind is list:
        return [_spec_value(v, modules) for v in value]
    if kind is tuple:
        return {"__tuple__": [_spec_value(v, modules) for v in value]}
    if kind is dict:
        if all(type(k) is str and k not in _TAGS for k in value):
            return {k: _spec_value(v, modules) for k, v in value.items()}
        return {"__dict__": [[_spec_value(k, modules), _spec_value(v, modules)]
                             for k, v in value.items()]}
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:  # the bytes are pointers: key the items instead
            return {"__ndarray__": value.dtype.str, "shape": list(value.shape),
                    "items": _spec_value(value.tolist(), modules)}
        digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
        return {"__ndarray__": value.dtype.str, "shape": list(value.shape), "sha256": digest}
    if isinstance(value, np.generic):
        return {"__numpy__": value.dtype.str, "value": _spec_value(value.item(), modules)}
    if inspect.isclass(value) or inspect.isroutine(value):
        modules.add(str(getattr(value, "__module__", None) or "builtins"))
        return {"__object__": _qualified(value)}
    modules.add(kind.__module__)
    return {"__type__": _qualified(kind), "repr": _ADDRESS.sub("", repr(value))}


def _strings(value: Any) -> Iterator[str]:
    """Every string in a kwarg value: itself, a list's items, a dict's values, at any depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)


def named_files(*values: Any) -> dict[str, str]:
    """``{string: sha256}`` of each file or directory a kwarg string names, as this process sees it.

    An env that reads a scenario, a level or a table from a path in its kwargs behaves as that
    file says: editing the file must change the key, as editing the env's code does. A string
    naming a regular file is keyed by its bytes; one naming a directory (``named_paths`` with
    ``bare_folders``) by its files'. Other strings name nothing here and add nothing.
    """
    out: dict[str, str] = {}
    for text, path in named_paths(*values, bare_folders=True).items():
        try:
            out[text] = file_sha256(path) if path.is_file() else tree_digest(tree_files(path))
        except OSError:  # unreadable here: the env cannot read it either, and fails on its own
            continue
    return out


def named_paths(*values: Any, bare_folders: bool = False) -> dict[str, Path]:
    """The kwarg strings that name a file or folder here, and the path each names (not read).

    A file, by any name. A folder written with a path separator (``levels/``, ``./lv``), never
    the root. ``bare_folders``: also a folder named by a bare word (``"lv"``, relative to the
    working folder; not ``.``, ``..`` nor the home folder): the cache key counts it (an env
    reading ``lv/scale.txt`` behaves as that file says), a sandbox is not granted it (a mode
    string that happens to name a folder must not open it).
    """
    out: dict[str, Path] = {}
    for text in (t for v in values for t in _strings(v)):
        if text in out or not text or len(text) > 4096 or "\0" in text:
            continue
        path = Path(text).expanduser()
        try:
            if path.is_file():
                out[text] = path
            elif path.is_dir() and path.resolve() != Path(path.resolve().anchor):
                written = os.sep in text.rstrip(os.sep)
                bare = (bare_folders and text not in (".", "..")
                        and path.resolve() not in (Path.home().resolve(), Path.cwd().resolve()))
                if written or bare:
                    out[text] = path
        except (OSError, RuntimeError):  # RuntimeError: no home folder to resolve
            continue
    return out


def spec_files(spec: Any, kwargs: Mapping[str, Any]) -> dict[str, str]:
    """``named_files`` of the requested kwargs, the registered spec's and its wrappers'."""
    return named_files(dict(kwargs), dict(spec.kwargs), [w.kwargs for w in spec.additional_wrappers])


def env_files(env_id: str, kwargs: Mapping[str, Any]) -> dict[str, str]:
    """The files ``env_id`` made with ``kwargs`` reads, by sha256, without making it (``{}`` if unknown).

    A long-lived worker compares them with what it resolved before: an edited scenario file is
    another env there too.
    """
    try:
        spec = gym.spec(env_id.split(":", 1)[1] if ":" in env_id else env_id)
    except gym.error.Error:
        return {}
    return spec_files(spec, kwargs)


def _entry_name(entry_point: Any) -> str:
    """``'module:attr'``, as registered or of a registered callable."""
    return entry_point if isinstance(entry_point, str) else _qualified(entry_point)


def _module_of(entry_point: Any) -> str:
    """``'module:attr'`` or a callable's ``__module__``."""
    if isinstance(entry_point, str):
        return entry_point.split(":", 1)[0]
    return str(getattr(entry_point, "__module__", None) or "builtins")


def _code_versions(modules: set[str], known: str) -> dict[str, str]:
    """``{top-level package: code version}`` of ``modules`` and of what their code imports, but ``known``.

    ``known`` is keyed already (the entry point's package). Imports are followed as
    ``evalfleet.provenance.imported_code`` does: an env's dynamics in a sibling module count, and
    so do the packages an installed env package's code imports (a simulator's bindings).
    """
    versions = imported_code(modules, versioned_imports=True)
    versions.pop(known, None)
    return versions


@dataclass(frozen=True)
class EnvFingerprint:
    """What identifies an env's behaviour: id, kwargs, registered spec, the code involved."""

    env_id: str
    """The id as requested (``'module:EnvId-v0'`` included)."""
    kwargs: dict[str, Any]
    """The requested kwargs (JSON values, see ``check_env_kwargs``), but a ``max_episode_steps``
    ``gym.make`` takes as its own step cap (``keyed_kwargs``): that is ``max_episode_steps``."""
    max_episode_steps: int | None
    """The step cap episodes run under: ``max_steps`` or the registered one."""
    entry_point: str
    """The registered entry point, ``'module:attr'``."""
    version: int | None
    """The registered version."""
    package: str
    """The package providing the entry point."""
    package_version: str
    """That package's code version (``evalfleet.provenance``)."""
    spec_kwargs: dict[str, Any] = field(default_factory=dict)
    """The registered spec's own kwargs (the requested ones override them), in exact form."""
    wrappers: list[dict[str, Any]] = field(default_factory=list)
    """The registered spec's additional wrappers: name, entry point, kwargs (exact form)."""
    code: dict[str, str] = field(default_factory=dict)
    """Code version of every other package involved: the id's module, wrappers, spec kwargs, and
    every package their code and the entry point's imports (read from source, not imported)."""
    files: dict[str, str] = field(default_factory=dict)
    """sha256 of every file or directory a string of the kwargs or spec kwargs names
    (``named_files``): an edited scenario file is another env."""

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
            "spec_kwargs": self.spec_kwargs,
            "wrappers": self.wrappers,
            "code": self.code,
            # Only where a kwarg names a file: every other env keeps the key it had.
            **({"files": self.files} if self.files else {}),
        }

    @property
    def spec_hash(self) -> str:
        """sha256 (hex, first 16) of the fingerprint."""
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def keyed_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The requested kwargs as the fingerprint keys them: without ``gym.make``'s own step cap.

    ``gym.make(id, max_episode_steps=N, **kwargs)`` takes ``max_episode_steps`` as a parameter of
    its own: it never reaches the env's constructor, and ``TimeLimit`` applies it, as it does
    ``--max-steps N`` and the registered cap (``make_env`` passes all of them the same way). So
    ``{"max_episode_steps": N}`` is the same env as ``--max-steps N``, and the effective cap is
    keyed once, as ``EnvFingerprint.max_episode_steps``; kept in the kwargs too, it was another
    key (a cache miss) and another history protocol (``protocol_changed``, gate exit 6). Only
    where ``gym.make`` has that parameter: a ``make`` passing it on to the env keeps it keyed.
    """
    out = dict(kwargs)
    if "max_episode_steps" in out and "max_episode_steps" in inspect.signature(gym.make).parameters:
        del out["max_episode_steps"]
    return out


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


class EnvMaker:
    """A zero-argument maker of one env, as workers and sandboxes need (``make_env``).

    ``facts()``: what resolving the env finds out (``env_facts``), for a sandbox to answer.
    """

    def __init__(self, env_id: str, kwargs: dict[str, Any], max_steps: int | None) -> None:
        self.env_id, self.kwargs, self.max_steps = env_id, dict(kwargs), max_steps

    def __call__(self) -> gym.Env[Any, Any]:
        """A new env (``make_env``)."""
        return make_env(self.env_id, self.kwargs, self.max_steps)

    def facts(self) -> dict[str, Any]:
        """``env_facts`` of this env (imports its modules and makes it once)."""
        return env_facts(self.env_id, self.kwargs, self.max_steps)


def env_thunk(env_id: str, kwargs: dict[str, Any], max_steps: int | None) -> EnvMaker:
    """A zero-argument maker, as workers and sandboxes need."""
    return EnvMaker(env_id, kwargs, max_steps)


def untrusted_module(env_id: str) -> str | None:
    """The ``module:`` prefix of ``env_id`` when it is no env shipped with gymnasium or evalfleet.

    Importing it runs someone else's code: stage 1 and the workers then resolve the env in a
    sandbox (``resolve_env_for``), unless ``inprocess`` was asked for knowingly.
    """
    if ":" not in env_id:
        return None  # an id gymnasium or evalfleet's envs registered
    from evalfleet.sandbox.isolation import shipped_env

    module = env_id.split(":", 1)[0]
    return None if shipped_env(f"{module}:_") else module


def resolved_here(env_id: str, isolation: str) -> bool:
    """True when ``env_id``'s code may run in this process: a shipped env, or ``inprocess``."""
    return isolation == "inprocess" or untrusted_module(env_id) is None


def space_to_json(space: gym.Space[Any]) -> dict[str, Any]:
    """A Box or Discrete space, exactly, as JSON values (bounds element by element).

    A bound that is not finite is written as Python's JSON writes it, read back by Python's.
    """
    if isinstance(space, spaces.Discrete):
        return {"kind": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.Box):
        return {"kind": "Box", "shape": list(space.shape), "dtype": str(space.dtype),
                "low": np.asarray(space.low).ravel().tolist(),
                "high": np.asarray(space.high).ravel().tolist()}
    raise EnvSpecError(f"a {type(space).__name__} space cannot be described (Box, Discrete)")


def space_from_json(data: Mapping[str, Any]) -> gym.Space[Any]:
    """The space ``space_to_json`` described; anything else is refused."""
    try:
        if data["kind"] == "Discrete":
            return spaces.Discrete(int(data["n"]), start=int(data["start"]))
        if data["kind"] == "Box":
            shape = tuple(int(d) for d in data["shape"])
            dtype = np.dtype(str(data["dtype"]))
            if dtype.kind not in "biuf":
                raise ValueError(f"dtype {dtype}")
            low = np.array(data["low"], dtype=dtype).reshape(shape)
            high = np.array(data["high"], dtype=dtype).reshape(shape)
            return spaces.Box(low, high, shape=shape, dtype=dtype)
    except (KeyError, TypeError, ValueError) as err:
        raise EnvSpecError(f"an env's space description does not read: {err}") from err
    raise EnvSpecError(f"an env's space description names kind {data.get('kind')!r}")


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
    render_fps: float | None = None
    """The env's ``metadata['render_fps']`` (a recording's frame rate), if it states one."""


def env_facts(env_id: str, kwargs: dict[str, Any], max_steps: int | None) -> dict[str, Any]:
    """What only importing and making the env tells, as JSON values.

    Its registered spec in exact form, the modules its spec names, and its spaces. Unknown ids
    and bad kwargs fail here.
    """
    check_env_kwargs(env_id, kwargs)
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
        # The made env's own spec: a cap given as the env kwarg 'max_episode_steps' is there.
        made = getattr(env, "spec", None) or spec
        effective_max = max_steps if max_steps is not None else made.max_episode_steps
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
        # Other code that shapes the env: the id's module (it usually registers the id and sets
        # the spec's kwargs), the wrappers', and classes or functions the spec's kwargs name.
        modules: set[str] = set()
        spec_kwargs = _spec_value(dict(spec.kwargs), modules)
        wrappers = [{"name": w.name, "entry_point": _entry_name(w.entry_point),
                     "kwargs": _spec_value(w.kwargs, modules)} for w in spec.additional_wrappers]
        modules |= {_module_of(w.entry_point) for w in spec.additional_wrappers}
        return {"entry_point": _entry_name(spec.entry_point), "version": spec.version,
                "max_episode_steps": effective_max, "spec_kwargs": spec_kwargs,
                "wrappers": wrappers, "modules": sorted(modules),
                "observation_space": space_to_json(env.observation_space),
                "action_space": space_to_json(env.action_space),
                "render_fps": _number_or_none(env.metadata.get("render_fps"))}
    finally:
        env.close()


def _number_or_none(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def resolved_from_facts(env_id: str, kwargs: dict[str, Any], facts: Mapping[str, Any]
                        ) -> ResolvedEnv:
    """The env's fingerprint and spaces from ``env_facts``, completed here.

    The id and kwargs are the request's, and the code versions and named files are read here
    from the modules and strings the facts name: facts from a sandboxed env describe that env
    only (its id's ``module:`` prefix is in every key it can reach).
    """
    try:
        entry = str(facts["entry_point"])
        modules = {str(m) for m in facts["modules"]} | {_module_of(entry)}
        if ":" in env_id:
            modules.add(env_id.split(":", 1)[0])
        spec_kwargs, wrappers = dict(facts["spec_kwargs"]), list(facts["wrappers"])
        max_episode_steps = int(facts["max_episode_steps"])
        version = None if facts["version"] is None else int(facts["version"])
        observation_space = space_from_json(facts["observation_space"])
        action_space = space_from_json(facts["action_space"])
    except (KeyError, TypeError, ValueError) as err:
        raise EnvSpecError(f"env {env_id!r}: its description does not read ({err})") from err
    package, package_version = _package_of(_module_of(entry))
    fingerprint = EnvFingerprint(
        env_id=env_id,
        kwargs=keyed_kwargs(kwargs),
        max_episode_steps=max_episode_steps,
        entry_point=entry,
        version=version,
        package=package,
        package_version=package_version,
        spec_kwargs=spec_kwargs,
        wrappers=wrappers,
        code=_code_versions(modules, _module_of(entry).split(".", 1)[0]),
        files=named_files(dict(kwargs), spec_kwargs, [w.get("kwargs") for w in wrappers]),
    )
    return ResolvedEnv(fingerprint, observation_space, action_space,
                       render_fps=_number_or_none(facts.get("render_fps")))


def resolve_env(env_id: str, kwargs: dict[str, Any], max_steps: int | None) -> ResolvedEnv:
    """Make the env once in this process: unknown ids and bad kwargs fail here, not on workers."""
    return resolved_from_facts(env_id, kwargs, env_facts(env_id, kwargs, max_steps))


def resolve_env_for(env_id: str, kwargs: dict[str, Any], max_steps: int | None, isolation: str,
                    limits: Any = None, timeout_s: float = 120.0,
                    env_allow: Sequence[str] = ()) -> ResolvedEnv:
    """``resolve_env``, wherever the env's code may run for an evaluation at ``isolation``.

    In this process for envs shipped with gymnasium or evalfleet, and for ``inprocess`` (asked
    for knowingly). An env from someone else's module (``untrusted_module``) is imported and
    made in a sandbox of the evaluation's level (``process`` for ``auto``), which answers its
    description: its code never runs in the driver nor in a worker, where credentials, the Dask
    client and the results are. ``limits``: the sandbox's ``SandboxLimits``; ``env_allow``: the
    variables the evaluation grants its sandboxes (``--sandbox-env``), so an env that reads one
    when it is made describes itself as its episodes will see it.
    """
    if resolved_here(env_id, isolation):
        return resolve_env(env_id, kwargs, max_steps)
    check_env_kwargs(env_id, kwargs)
    from evalfleet.sandbox.process import ProcessSlots

    level = isolation if isolation in ("process", "bwrap") else "process"
    slots = ProcessSlots(env_thunk(env_id, kwargs, max_steps), 1, level=level,
                         episode_timeout_s=timeout_s, limits=limits,
                         env_spec={"env_id": env_id, "kwargs": kwargs}, env_allow=env_allow)
    try:
        facts = slots.describe()
    finally:
        slots.close()
    return resolved_from_facts(env_id, kwargs, facts)
