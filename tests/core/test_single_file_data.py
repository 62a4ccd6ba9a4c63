"""A single-file module's code version keys the data files beside it, as a package's keys its own.

Planted: ``my_envs.py`` on ``sys.path`` (an env id ``my_envs:Level-v0``) reading its level from a
JSON file beside it, and a callable policy module reading its gain from a text file beside it.
Before, only the ``.py`` file was keyed: editing the data served the episodes cached for the old
data as a full hit. Files in a subfolder, dotfiles, other ``.py`` files and compiled caches are
not the module's data, and a module in the standard library's or site-packages' folder keys no
neighbour (those folders are code that versions identify).
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import gymnasium as gym
import pytest

import evalfleet.worker  # noqa: F401 - workers import it first: it starts the import clock
from evalfleet import provenance
from evalfleet.envspec import resolve_env
from evalfleet.policy import code_versions
from evalfleet.provenance import code_version, stale_code

ENV = '''\
import json
from pathlib import Path

import gymnasium as gym
import numpy as np

LEVEL = Path(__file__).with_name("level.json")


class Level(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        self.bonus = json.loads(LEVEL.read_text())["bonus"]

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), float(self.bonus), True, False, {}


gym.register(f"Level_{__name__}-v0", entry_point=f"{__name__}:Level", max_episode_steps=5)
'''

POLICY = '''\
from pathlib import Path

import numpy as np

GAIN = Path(__file__).with_name("gain.txt")


def act(obs):
    return np.full(len(obs), int(float(GAIN.read_text()) > 0), dtype=np.int64)
'''


def _later(path: Path, seconds: float = 5.0) -> None:
    """Move ``path``'s modification time past any file-system timestamp granularity."""
    later = time.time() + seconds
    os.utime(path, (later, later))


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A single-file env module, a single-file callable module and their data, on ``sys.path``."""
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "home"))
    folder = tmp_path / "mods"
    folder.mkdir()
    tag = uuid.uuid4().hex[:10]
    env, policy = f"plantedlevel_{tag}", f"plantedgain_{tag}"
    (folder / f"{env}.py").write_text(ENV)
    (folder / "level.json").write_text('{"bonus": 1.0}')
    (folder / f"{policy}.py").write_text(POLICY)
    (folder / "gain.txt").write_text("1")
    monkeypatch.syspath_prepend(str(folder))
    importlib.invalidate_caches()
    yield folder, env, policy
    for name in (env, policy):
        sys.modules.pop(name, None)
    gym.registry.pop(f"Level_{env}-v0", None)


def test_editing_the_data_beside_a_single_file_module_changes_its_code_version(planted):
    folder, env, _ = planted
    before = code_version(env)
    assert before[0] == env and before[1].startswith(provenance.SOURCE_PREFIX)
    (folder / "level.json").write_text('{"bonus": 5.0}')
    after = code_version(env)
    assert after != before
    (folder / "level.json").write_text('{"bonus": 1.0}')
    assert code_version(env) == before  # by the bytes: the same data is the same version


def test_an_env_id_of_a_single_file_module_is_another_env_when_its_data_changes(planted):
    folder, env, _ = planted
    env_id = f"{env}:Level_{env}-v0"
    first = resolve_env(env_id, {}, None).fingerprint
    (folder / "level.json").write_text('{"bonus": 5.0}')
    second = resolve_env(env_id, {}, None).fingerprint
    assert first.spec_hash != second.spec_hash
    assert first.as_dict() != second.as_dict()


def test_a_callable_policy_module_keys_the_data_beside_it(planted):
    folder, _, policy = planted
    ref = f"{policy}:act"
    first = dict(code_versions(ref, "callable policy"))
    (folder / "gain.txt").write_text("-1")
    second = dict(code_versions(ref, "callable policy"))
    assert first[policy] != second[policy]


def test_subfolders_dotfiles_other_modules_and_compiled_caches_are_not_keyed(planted):
    folder, env, _ = planted
    sub = folder / "runs"
    sub.mkdir()
    (sub / "episode.json").write_text("{}")
    before = code_version(env)[1]
    (sub / "episode.json").write_text('{"return": 3}')  # a subfolder: outputs, not the module
    (sub / "new.bin").write_bytes(b"\0" * 10)
    (folder / ".notes").write_text("edited")  # a dotfile
    (folder / f"{env}.pyc").write_bytes(b"\0compiled")  # compiled caches
    (folder / "stray.pyo").write_bytes(b"\0compiled")
    cache = folder / "__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / f"{env}.cpython-311.pyc").write_bytes(b"\0compiled")
    (folder / "other_module.py").write_text("X = 1\n")  # its own module, keyed when imported
    (folder / "a_link").symlink_to(sub)  # a link to a folder is no regular file
    assert code_version(env)[1] == before
    assert [name for name, _ in provenance._source_files(env)] == [f"{env}.py"]
    assert [name for name, _ in provenance.beside_data(folder / f"{env}.py")] == [
        "gain.txt", "level.json"]


def test_many_data_files_are_keyed_by_name_size_and_time(planted, monkeypatch):
    folder, env, _ = planted
    monkeypatch.setattr(provenance, "DATA_FILES_LIMIT", 3)
    for i in range(4):
        (folder / f"table{i}.csv").write_text(f"{i}\n")
    before = code_version(env)[1]
    read: list[Path] = []
    real = provenance.file_sha256
    monkeypatch.setattr(provenance, "file_sha256", lambda p: read.append(p) or real(p))
    assert code_version(env)[1] == before
    assert [p.name for p in read] == [f"{env}.py"]  # past the cap no data file is read
    (folder / "table0.csv").write_text("10\n")
    _later(folder / "table0.csv")
    assert code_version(env)[1] != before


def test_an_unreadable_data_file_beside_the_module_does_not_fail_the_key(planted, monkeypatch):
    folder, env, _ = planted
    secret = folder / "someone_elses.dat"  # another user's file, in a shared folder such as /tmp
    secret.write_text("x")
    real = provenance.file_sha256

    def denied(path: Path) -> str:
        if path == secret:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(provenance, "file_sha256", denied)
    before = code_version(env)[1]
    assert before.startswith(provenance.SOURCE_PREFIX)
    secret.write_text("xy")
    _later(secret)
    assert code_version(env)[1] != before  # keyed by its size and modification time


def test_data_edits_change_the_key_but_only_code_edits_make_a_worker_stale(planted):
    """A training script's log beside it changes its factory's key at every step; the workers
    that imported the script must not be restarted for it. An edit of the code itself must."""
    folder, env, _ = planted
    importlib.import_module(env)
    code_version(env)  # the worker's first check, right after its import
    (folder / "level.json").write_text('{"bonus": 5.0}')
    _later(folder / "level.json")
    want = code_version(env)[1]  # the driver's key: the edited data
    assert provenance.DATA_MARK in want
    assert stale_code({env: want}) == {}
    source = folder / f"{env}.py"
    source.write_text(source.read_text() + "\n# edited\n")
    _later(source)
    want = code_version(env)[1]
    assert env in stale_code({env: want})


def test_a_module_in_an_install_folder_keys_its_own_file_only():
    for where in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]}:
        module = next(Path(where).glob("*.py"))
        assert provenance.beside_data(module) == []
    assert [name for name, _ in provenance._source_files("csv")] == ["csv.py"]
    assert provenance.beside_data(Path("/nowhere/site-packages/x.py")) == []
