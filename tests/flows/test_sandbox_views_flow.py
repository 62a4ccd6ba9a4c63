"""What a sandbox lets an env read is in the cache key: file grants, and the bwrap jail's view.

Planted: an env with an optional calibration file (gain 3.0 when it can read it, else its
default 1.0, a common pattern), in a single-file module of a folder of its own. A run without
``--sandbox-read`` of the file's folder filled the entry that a run with it was served (mean a
third of the truth); a bwrap jail, which then showed the module's file alone, filled the entry
that a ``process`` sandbox, which read the files beside the module, was served. Both now see
the same files of the module's folder; they still differ in where an env may write (a bwrap
sandbox has a ``/tmp`` of its own, a ``process`` one only its folder), and keep apart entries.
"""

from __future__ import annotations

import os
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import gymnasium
import pytest

from evalfleet.models import EvalRequest
from evalfleet.sandbox.isolation import available_levels, probe
from flows.eval import evaluate

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

GAIN_MODULE = """
    import gymnasium as gym
    import numpy as np
    from gymnasium import spaces


    class GainEnv(gym.Env):
        observation_space = spaces.Box(-100.0, 100.0, (2,), np.float32)
        action_space = spaces.Discrete(2)

        def __init__(self, calib):
            try:
                with open(calib) as fh:
                    self.gain = float(fh.read())
            except OSError:  # optional: without a readable calibration, the default gain
                self.gain = 1.0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t, self.horizon = 0, int(self.np_random.integers(5, 15))
            return np.zeros(2, np.float32), {{}}

        def step(self, action):
            self.t += 1
            return np.full(2, self.t, np.float32), self.gain, self.t >= self.horizon, False, {{}}


    gym.register("{env_id}", entry_point="{module}:GainEnv", max_episode_steps=50,
                 kwargs={{"calib": {calib!r}}})
"""


@pytest.fixture
def gain_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """``module:EnvId-v0`` of the planted env, and the folder of its single-file module."""
    module, env_id = f"gaincal_{uuid.uuid4().hex[:8]}", f"Gain{uuid.uuid4().hex[:6]}-v0"
    folder = tmp_path / "mods"
    folder.mkdir()
    yield f"{module}:{env_id}", folder
    sys.modules.pop(module, None)
    gymnasium.registry.pop(env_id, None)


def _plant(folder: Path, env: str, calib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module, env_id = env.split(":")
    (folder / f"{module}.py").write_text(textwrap.dedent(GAIN_MODULE.format(
        env_id=env_id, module=module, calib=str(calib))))
    calib.parent.mkdir(exist_ok=True)
    calib.write_text("3.0")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(ROOT)]))


SCRATCH_MODULE = """
    import tempfile

    import gymnasium as gym
    import numpy as np
    from gymnasium import spaces


    class ScratchEnv(gym.Env):
        observation_space = spaces.Box(-100.0, 100.0, (2,), np.float32)
        action_space = spaces.Discrete(2)

        def __init__(self):
            try:  # a scratch file in /tmp when it may (its fast path), else its default
                with tempfile.NamedTemporaryFile(dir="/tmp"):
                    self.gain = 3.0
            except OSError:
                self.gain = 1.0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t, self.horizon = 0, int(self.np_random.integers(5, 15))
            return np.zeros(2, np.float32), {{}}

        def step(self, action):
            self.t += 1
            return np.full(2, self.t, np.float32), self.gain, self.t >= self.horizon, False, {{}}


    gym.register("{env_id}", entry_point="{module}:ScratchEnv", max_episode_steps=50)
"""


def _request(tmp_path: Path, env: str, **fields: object) -> EvalRequest:
    return EvalRequest.build(env=env, policy="tests.flows.user_envs:toward_goal", episodes=16,
                             workers=1, output=tmp_path / "out", cache_dir=tmp_path / "cache",
                             **fields)


def test_a_read_grant_is_a_miss_with_the_granted_files_returns(prefect_server, tmp_path, gain_env,
                                                                monkeypatch):
    if probe().get("landlock") is not None:
        pytest.skip(f"no Landlock here: a process sandbox reads every file ({probe()['landlock']})")
    env, folder = gain_env
    calib = tmp_path / "calib" / "gain.txt"  # outside the module's folder: granted by name only
    _plant(folder, env, calib, monkeypatch)
    plain = evaluate(_request(tmp_path, env, isolation="process"))
    granted = evaluate(_request(tmp_path, env, isolation="process",
                                sandbox_read=[str(calib.parent)]))
    assert plain.cache["status"] == "miss" and granted.cache["status"] == "miss", granted.cache
    assert granted.mean == pytest.approx(3 * plain.mean)


def test_bwrap_and_process_sandboxes_keep_apart_entries(prefect_server, tmp_path, gain_env,
                                                        monkeypatch):
    if available_levels()["bwrap"] is not None or probe().get("landlock") is not None:
        pytest.skip("needs bwrap and Landlock (the two views of a module's folder)")
    env, folder = gain_env
    module, env_id = env.split(":")
    (folder / f"{module}.py").write_text(textwrap.dedent(SCRATCH_MODULE.format(
        env_id=env_id, module=module)))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(ROOT)]))
    jailed = evaluate(_request(tmp_path, env, isolation="bwrap"))
    process = evaluate(_request(tmp_path, env, isolation="process"))
    assert (jailed.cache["status"], process.cache["status"]) == ("miss", "miss"), process.cache
    assert process.isolation == "process"
    assert jailed.mean == pytest.approx(3 * process.mean)  # /tmp: the jail's sandbox writes it
