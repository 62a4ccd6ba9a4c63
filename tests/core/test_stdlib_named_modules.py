"""A user's module named like a standard-library one (``wave.py``) is keyed like any other module.

Planted: an env whose reward per step is ``wave.AMPLITUDE``, from a ``wave.py`` beside it that
runs in place of the standard library's ``wave``. The walk of imports left every stdlib *name*
out, so this module was never in the key: after ``AMPLITUDE = 1.0`` became ``3.0`` the request
was a full cache hit on the old episodes (mean 5.0 served, the truth 15.0), and neither the
stale-worker check nor ``inputs_changed`` could see the edit (they read the same code versions).
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import gymnasium
import pytest

import evalfleet.worker  # noqa: F401 - workers import it first: it starts the import clock
from evalfleet import provenance
from evalfleet.cli import EXAMPLE_POLICY
from evalfleet.models import EvalRequest
from evalfleet.pipeline import inputs_changed, receive
from evalfleet.provenance import SOURCE_PREFIX, imported_code, stale_code

ENV_MODULE = """
    import gymnasium as gym
    import numpy as np
    from gymnasium import spaces

    import wave


    class Swell(gym.Env):
        observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
        action_space = spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return np.zeros(4, np.float32), {{}}

        def step(self, action):
            self.t += 1
            return np.zeros(4, np.float32), float(wave.AMPLITUDE), False, self.t >= 5, {{}}


    gym.register("{env_id}", entry_point="{name}:Swell", max_episode_steps=5)
"""


@pytest.fixture
def swell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """The env's id (``module:EnvId``) and the user's ``wave.py`` it imports, first on the path."""
    name, env_id = f"swellenv_{uuid.uuid4().hex[:8]}", f"Swell{uuid.uuid4().hex[:6]}-v0"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(ENV_MODULE.format(name=name, env_id=env_id)))
    (tmp_path / "wave.py").write_text("AMPLITUDE = 1.0\n")
    saved = sys.modules.pop("wave", None)  # the standard library's, if anything imported it
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(provenance, "_seen", {})
    try:
        yield f"{name}:{env_id}", tmp_path / "wave.py"
    finally:
        sys.modules.pop(name, None)
        sys.modules.pop("wave", None)
        if saved is not None:
            sys.modules["wave"] = saved
        gymnasium.registry.pop(env_id, None)


def test_a_user_module_named_like_the_stdlib_is_keyed_and_its_edit_seen(swell, tmp_path):
    env, helper = swell
    request = EvalRequest.build(env=env, policy=EXAMPLE_POLICY, episodes=4, output=tmp_path / "out")
    before = receive(request)
    assert importlib.import_module("wave").AMPLITUDE == 1.0  # the user's, run in the stdlib's place
    helper.write_text("AMPLITUDE = 3.0\n")
    later = time.time() + 5  # past any file-system timestamp granularity
    os.utime(helper, (later, later))
    after = receive(request)
    assert after.cache_key != before.cache_key  # a miss: the old episodes (mean 5.0) not served

    code = before.cache_ingredients["env"]["code"]
    assert code["wave"].startswith(SOURCE_PREFIX)
    assert before.expected_code["wave"] == code["wave"]
    assert after.cache_ingredients["env"]["code"]["wave"] != code["wave"]
    # The run in progress under the old key sees the edit (inputs_changed names it)...
    assert inputs_changed(request, before, done=True) == [
        f"the code of 'wave' ({code['wave']} -> {after.cache_ingredients['env']['code']['wave']})"]
    # ...and this process, which imported the old wave.py, is a stale worker for the new key.
    assert set(stale_code(after.expected_code)) == {"wave"}


def test_the_standard_librarys_own_modules_stay_out_of_the_key(tmp_path, monkeypatch):
    """The real stdlib is still left out (built in, frozen, or in its folder)."""
    from evalfleet.provenance import in_stdlib

    for top in ("os", "sys", "json", "wave", "collections", "_io"):
        assert in_stdlib(top), top
    assert not in_stdlib("numpy")
    (tmp_path / "calendar.py").write_text("DAYS = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    if "calendar" in sys.modules:  # imported from the stdlib already: what this process runs
        assert in_stdlib("calendar")
    else:
        assert not in_stdlib("calendar")
    (tmp_path / "uses_stdlib.py").write_text("import json, os.path, re\nfrom collections import deque\n")
    try:
        assert set(imported_code(["uses_stdlib"])) == {"uses_stdlib"}
    finally:
        sys.modules.pop("uses_stdlib", None)
