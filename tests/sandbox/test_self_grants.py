"""What a sandbox may read comes from the request, never from what its env says of itself.

The folders a ``process`` sandbox may read (Landlock) and a bwrap jail binds were those of every
module the env's fingerprint named: its registered entry point, the modules of its spec, and
the import lines of its code, dead ones included. One line ``if False: import results`` in an
env package let it read any folder sitting in a ``sys.path`` entry beside it: here another
team's results. Now only the env id's ``module:`` prefix (and evalfleet's envs, and
``--sandbox-read``) grant anything; the rest stays in the cache key.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evalfleet.envspec import resolve_env
from evalfleet.sandbox.bwrap import PROJECT_ENVS, package_paths
from evalfleet.sandbox.isolation import available_levels
from evalfleet.sandbox.limits import landlock_abi
from evalfleet.sandbox.process import env_modules

from .test_process_slots import run_direct

TEAM_ENV = '''
import gymnasium as gym
import numpy as np

if False:
    import {results}  # never runs: named only to be read by whoever scans the imports

TARGET = {target!r}


class TeamEnv(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        try:
            with open(TARGET) as fh:
                found = "read " + fh.read()
        except OSError as err:
            found = type(err).__name__
        raise RuntimeError(f"{{TARGET}} -> {{found}}")

    def step(self, action):
        return np.zeros(4, np.float32), 0.0, True, False, {{}}


gym.register(id="{env_id}", entry_point="{package}:TeamEnv", max_episode_steps=5)
'''


def _plant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A project folder on ``sys.path`` with an env package beside another team's results."""
    tag = f"{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    proj = tmp_path / "proj"
    results, package = f"results_{tag}", f"teamenv_{tag}"
    report = proj / results / "runs" / "9f1e" / "report.json"
    report.parent.mkdir(parents=True)
    report.write_text('{"note": "OTHER_TEAM_RESULT"}')
    for path in (tmp_path, proj, *report.parents):
        if path.is_relative_to(tmp_path):
            path.chmod(0o755)  # a root worker's sandboxes run under uids of their own
    report.chmod(0o644)
    (proj / package).mkdir()
    env_id = f"Team{tag}-v0"
    (proj / package / "__init__.py").write_text(TEAM_ENV.format(
        results=results, target=str(report), env_id=env_id, package=package))
    monkeypatch.syspath_prepend(str(proj))
    return f"{package}:{env_id}", report


def test_grants_are_the_requests_modules_only() -> None:
    reported = {"env_id": "teamenv:Team-v0", "entry_point": "results:Forged",
                "modules": ["results", "secrets_dir"], "code": {"results": "x", "teamenv": "y"}}
    assert env_modules(reported) == ["envs", "teamenv"]
    assert env_modules({"env_id": "CartPole-v1", "code": {"results": "x"}}) == ["envs"]


def test_a_plain_folder_on_the_path_is_no_package_to_grant(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    (tmp_path / "plainfolder_x").mkdir()  # a namespace package to the import system
    (tmp_path / "realpkg_x").mkdir()
    (tmp_path / "realpkg_x" / "__init__.py").write_text("")
    (tmp_path / "single_x.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert package_paths(["plainfolder_x", "realpkg_x.sub", "single_x", "envs.inventory"]) == [
        str(tmp_path / "realpkg_x"), str(tmp_path / "single_x.py"), PROJECT_ENVS]


@pytest.mark.parametrize(("level", "denied"), [("process", "PermissionError"),
                                               ("bwrap", "FileNotFoundError")])
def test_dead_import_lines_grant_no_folder(level: str, denied: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if available_levels()[level] is not None:
        pytest.skip(f"{level} level unavailable: {available_levels()[level]}")
    if level == "process" and landlock_abi() == 0:
        pytest.skip("this kernel has no Landlock")
    env_id, report = _plant(tmp_path, monkeypatch)
    # What the env says of itself still reaches the cache key: the dead import is in its code.
    assert f"results_{os.getpid()}" in " ".join(resolve_env(env_id, {}, None).fingerprint.code)
    records, _ = run_direct(level, env_id, 2, 1)
    texts = [r.error or "" for r in records]
    assert [r.end_reason for r in records] == ["env_error", "env_error"], texts
    assert all(f"{report} -> {denied}" in text for text in texts), texts
    assert not any("OTHER_TEAM_RESULT" in text for text in texts)
