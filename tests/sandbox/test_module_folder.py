"""A single-file env module's sandbox reads the files of its folder its key covers, nothing more.

The usual layout: the env module in the project root (``PYTHONPATH=.``), beside the policy,
another team's policy, ``.aws/credentials`` and the default ``results/`` folder (parquet, the
cache's manifests, ``mlflow.db``). A ``process`` sandbox was granted the module's whole folder,
recursively, and its env read all of them. Now it gets the module, its sibling ``.py`` files and
its data files (regular files directly beside it, no dotfile), one by one, as the bwrap jail
binds them; a file in a subfolder is refused with the ``--sandbox-read`` flag that grants it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from evalfleet.errors import EnvSpecError
from evalfleet.sandbox import limits as lim
from evalfleet.sandbox.bwrap import module_neighbours
from evalfleet.sandbox.forkclient import fork_server
from evalfleet.sandbox.forkserver import _in_child
from evalfleet.sandbox.isolation import available_levels
from evalfleet.sandbox.limits import SandboxLimits, landlock_abi

from .test_fresh_tmp import run_evaluation

PROJ_ENV = '''
import json
import os

import gymnasium as gym
import numpy as np

import {helper} as helper  # a module beside it: imported, so readable

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = {targets!r}


def readable(path):
    try:
        with open(path, "rb") as fh:
            fh.read(1)
        return 1
    except OSError:
        return 0


class ProjEnv(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, extra=False):
        with open(os.path.join(HERE, "level.json")) as fh:  # its data file, beside it
            self.gain = json.load(fh)["gain"] * helper.FACTOR
        if extra:  # data in a subfolder: granted by --sandbox-read only
            with open(os.path.join(HERE, "levels", "extra.json")) as fh:
                self.gain += json.load(fh)["gain"]

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {{}}

    def step(self, action):
        self.t += 1
        if self.t < 3:
            return np.zeros(4, np.float32), self.gain, False, False, {{}}
        seen = {{f"read_{{name}}": readable(path) for name, path in TARGETS.items()}}
        return np.zeros(4, np.float32), self.gain, True, False, seen


gym.register(id="{env_id}", entry_point="{module}:ProjEnv", max_episode_steps=10)
'''

#: Beside the module in the project root, as a team keeps them: none is in the env's key.
PRIVATE = {
    "other_policy": "other_team/policy.pt",
    "aws": ".aws/credentials",
    "dotenv": ".env",
    "results": "results/runs/9f1e/episodes.parquet",
    "manifest": "results/cache/ab/manifest.json",
    "mlflow": "results/mlflow.db",
}
#: Beside it too, and read: its data file, a policy file kept directly beside it (a data file
#: to its key: keep a module in a folder of its own) and the module it imports.
OWN = {"data": "level.json", "policy": "my_policy.pt"}


def _plant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gain: float = 2.0,
           links: dict[str, Path] | None = None) -> tuple[str, str, Path]:
    """The project root with its env module, on ``sys.path``: (env id, module, root).

    ``links``: symlinks to make beside the module (name -> target); the env reports each too.
    """
    tag = f"{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    module, helper, name = f"proj_env_{tag}", f"proj_helper_{tag}", f"Proj{tag}-v0"
    proj = tmp_path / "proj"
    targets = {k: str(proj / v) for k, v in {**PRIVATE, **OWN, **(links or {})}.items()}
    targets["helper"] = str(proj / f"{helper}.py")
    for rel in PRIVATE.values():
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text("private")
    (proj / "level.json").write_text(f'{{"gain": {gain}}}')
    (proj / "my_policy.pt").write_text("weights")
    (proj / "levels").mkdir()
    (proj / "levels" / "extra.json").write_text('{"gain": 10.0}')
    (proj / f"{helper}.py").write_text("FACTOR = 1.5\n")
    (proj / f"{module}.py").write_text(PROJ_ENV.format(
        helper=helper, targets=targets, env_id=name, module=module))
    for path in (tmp_path, *proj.rglob("*"), proj):
        path.chmod(0o755 if path.is_dir() else 0o644)  # a root worker's sandboxes: uids of their own
    for link, target in (links or {}).items():
        (proj / link).symlink_to(target)
    monkeypatch.syspath_prepend(str(proj))
    return f"{module}:{name}", module, proj


def _skip_unless(level: str) -> None:
    if available_levels()[level] is not None:
        pytest.skip(f"{level} level unavailable: {available_levels()[level]}")
    if level == "process" and landlock_abi() == 0:
        pytest.skip("this kernel has no Landlock: a process sandbox reads the worker's files")


@pytest.mark.parametrize("level", ["process", "bwrap"])
def test_an_env_in_a_project_root_reads_only_its_own_files(level: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_unless(level)
    env_id, _, _ = _plant(tmp_path, monkeypatch)
    records = run_evaluation(level, env_id, {})
    # 3 steps of 2.0 (level.json) x 1.5 (the sibling module): both read, in both levels.
    assert [(r.end_reason, r.episode_return) for r in records] == [("terminated", 9.0)] * 4, \
        records[0].error
    seen = {k.removeprefix("read_"): v for k, v in records[0].metrics.items()
            if k.startswith("read_")}
    assert seen == {**dict.fromkeys(PRIVATE, 0), **dict.fromkeys(OWN, 1), "helper": 1}, seen


def test_data_in_a_subfolder_is_refused_with_the_flag_that_grants_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_unless("process")
    env_id, _, proj = _plant(tmp_path, monkeypatch)
    extra = proj / "levels" / "extra.json"
    # Stage 1 describes the env in a sandbox: its error names the path and the flag.
    with pytest.raises(EnvSpecError,
                       match=f"PermissionError.*--sandbox-read {re.escape(str(extra))} lets it read"):
        run_evaluation("process", env_id, {"extra": True})
    granted = run_evaluation("process", env_id, {"extra": True},
                             limits=SandboxLimits(readable=(str(extra.parent),)))
    assert [r.episode_return for r in granted] == [3 * (3.0 + 10.0)] * 4, granted[0].error


def test_a_warm_jail_sees_a_data_file_replaced_since(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_unless("bwrap")
    env_id, module, proj = _plant(tmp_path, monkeypatch)
    assert [r.episode_return for r in run_evaluation("bwrap", env_id, {})] == [9.0] * 4
    jail = fork_server("bwrap", 60, ["envs", module])
    # Saved by rename, as editors and atomic writers do: a new inode the old bind never shows.
    (proj / "level.tmp").write_text('{"gain": 4.0}')
    os.replace(proj / "level.tmp", proj / "level.json")
    (proj / "level.json").chmod(0o644)
    assert [r.episode_return for r in run_evaluation("bwrap", env_id, {})] == [18.0] * 4
    assert fork_server("bwrap", 60, ["envs", module]) is not jail
    assert not jail.alive, "the replaced jail was left running"


@pytest.mark.parametrize("level", ["process", "bwrap"])
def test_a_symlink_beside_the_module_grants_nothing(level: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A symlink beside a single-file module is no file of its folder: its target stays closed.

    ``DirEntry.is_file()`` follows symlinks: ``levels.json -> ~/.aws/credentials`` (0600, in a
    0700 folder) and ``tiles.dat -> /etc/shadow`` beside the module were granted as its data,
    and a ``process`` env read both (a root worker's sandbox keeps CAP_DAC_READ_SEARCH), exit 0.
    Its real files (data, policy, sibling module) are read as before.
    """
    _skip_unless(level)
    victim = tmp_path / "victim" / ".aws"
    victim.mkdir(parents=True)
    (victim / "credentials").write_text("[default]\naws_secret_access_key = VICTIM-SECRET\n")
    (victim / "credentials").chmod(0o600)
    (tmp_path / "victim").chmod(0o700)
    links = {"levels.json": victim / "credentials", "tiles.dat": Path("/etc/shadow"),
             "linked_module.py": victim / "credentials"}
    env_id, _, proj = _plant(tmp_path, monkeypatch, links=links)
    records = run_evaluation(level, env_id, {})
    assert [(r.end_reason, r.episode_return) for r in records] == [("terminated", 9.0)] * 4, \
        records[0].error
    seen = {k.removeprefix("read_"): v for k, v in records[0].metrics.items()
            if k.startswith("read_")}
    assert seen == {**dict.fromkeys(PRIVATE, 0), **dict.fromkeys(OWN, 1), "helper": 1,
                    **dict.fromkeys(links, 0)}, seen
    # Neither granted nor keyed: the module's files are its real ones.
    module = next(proj.glob("proj_env_*.py"))
    names = {Path(p).name for p in module_neighbours(str(module))}
    assert names.isdisjoint(links) and {"level.json", "my_policy.pt"} <= names, names


def test_a_file_beside_the_module_is_granted_only_as_a_regular_file(tmp_path: Path) -> None:
    """``FileRules.files`` are opened without following a symlink: one put there grants nothing."""
    if landlock_abi() == 0:
        pytest.skip("this kernel has no Landlock")
    real, link = tmp_path / "level.json", tmp_path / "tiles.dat"
    real.write_text("{}")
    link.symlink_to("/etc/shadow")

    def probe() -> str:
        rules = lim.FileRules(read=(), listed=(), files=(str(real), str(link)))
        assert lim.restrict_files(rules, str(tmp_path / "own")) is None
        seen = ""
        for path in (real, link):
            try:
                path.read_bytes()
                seen += "1"
            except PermissionError:
                seen += "0"
        return seen

    assert _in_child(probe) == "10"
