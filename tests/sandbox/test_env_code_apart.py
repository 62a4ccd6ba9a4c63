"""An env from someone else's module runs its code only in sandboxes, never beside credentials.

Planted: a module whose import and constructor write down where they ran (pid, uid) and what
they saw of a planted secret. Before, stage 1 imported and made the env in the driver, each
worker did the same to learn its spaces, and a worker's ``process`` fork server (root, every
capability, shared by every evaluation on the worker) imported the module to preload it: the
module read the secret there, and could have patched the server for later evaluations. Now
stage 1 and the workers ask a sandbox of the evaluation's level to describe the env, and the
fork server imports only shipped envs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest

from evalfleet.envspec import env_thunk, resolve_env_for, untrusted_module
from evalfleet.models import EvalRequest
from evalfleet.pipeline import receive
from evalfleet.sandbox import open_slots
from evalfleet.sandbox.isolation import probe
from evalfleet.sandbox.process import fork_server

SECRET = "planted-service-secret-9f2c"


def zeros(observations: np.ndarray) -> np.ndarray:
    """A policy for any Discrete env: action 0."""
    return np.zeros(len(observations), dtype=np.int64)

PLANTED = '''
import json, os
import gymnasium as gym
import numpy as np

def _note(where):  # a confined sandbox may not write there: then nothing is noted
    try:
        with open({log!r}, "a") as fh:
            fh.write(json.dumps({{"where": where, "pid": os.getpid(), "uid": os.geteuid(),
                                 "secret": os.environ.get("EVALFLEET_CALLBACK_SECRET")}}) + "\\n")
    except OSError:
        pass

_note("import")

class Planted(gym.Env):
    def __init__(self):
        _note("init")
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = gym.spaces.Discrete(4)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {{}}

    def step(self, action):
        return np.zeros(3, np.float32), 1.0, True, False, {{}}

# It names gymnasium's CartPole as its entry point: its word, not a reason to trust it.
gym.register("Planted-v0", entry_point={entry!r}, max_episode_steps=5)
gym.register("PlantedOwn-v0", entry_point=__name__ + ":Planted", max_episode_steps=5)
'''


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
            ) -> tuple[str, Path]:
    if probe().get("seccomp") is not None:
        pytest.skip(f"no process sandboxes here: {probe()['seccomp']}")
    name = f"planted_{uuid.uuid4().hex[:8]}"
    # A sandbox under a root worker has a uid of its own: it writes only where anyone may.
    log_dir = Path(tempfile.mkdtemp(prefix="evalfleet-planted-", dir="/tmp"))
    log_dir.chmod(0o777)
    request.addfinalizer(lambda: shutil.rmtree(log_dir, ignore_errors=True))
    log = log_dir / "where.jsonl"
    (tmp_path / f"{name}.py").write_text(PLANTED.format(
        log=str(log), entry="gymnasium.envs.classic_control.cartpole:CartPoleEnv"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", SECRET)
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "home"))
    return name, log


def _where(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _ran_only_in_sandboxes(log: Path, *, not_in: set[int]) -> None:
    """Every note the module left: not from these processes, no secret seen, not as root."""
    for note in _where(log):
        assert note["pid"] not in not_in, note
        assert note["secret"] is None, note
        if os.geteuid() == 0:  # sandboxes of a root worker run as uids of their own
            assert note["uid"] != 0, f"a root-owned process ran the env's code: {note}"


def test_stage_one_resolves_an_untrusted_env_in_a_sandbox(planted, tmp_path: Path):
    name, log = planted
    for isolation in ("process", "auto"):
        request = EvalRequest.build(env=f"{name}:Planted-v0", policy=f"{__name__}:zeros",
                                    isolation=isolation, output=tmp_path / "out")
        received = receive(request)
        # Sandboxed, though the env claims gymnasium's CartPole as its entry point.
        assert received.isolation == "process"
        assert received.env_spec["entry_point"].startswith("gymnasium.")
    assert name not in sys.modules
    _ran_only_in_sandboxes(log, not_in={os.getpid()})


def test_workers_and_their_fork_server_do_not_import_an_untrusted_env(planted, tmp_path: Path):
    from evalfleet.worker import _resolve

    name, log = planted
    env = f"{name}:PlantedOwn-v0"
    assert untrusted_module(env) == name
    request = EvalRequest.build(env=env, policy="x.pt", isolation="process", output=tmp_path / "o")
    resolved = _resolve(request, "process")  # what a worker does before its shard
    assert (resolved.action_space.n, resolved.observation_space.shape) == (4, (3,))
    assert resolve_env_for(env, {}, None, "process").fingerprint == resolved.fingerprint
    slots = open_slots("process", env_thunk(env, {}, None), 2, episode_timeout_s=30.0,
                       env_spec=resolved.fingerprint.as_dict())
    try:
        outcomes = slots.reset_many([(0, 1), (1, 2)])
        assert [o.failure for o in outcomes] == [None, None]
        server = fork_server("process", 30.0).hello["pid"]
    finally:
        slots.close()
    assert name not in sys.modules
    _ran_only_in_sandboxes(log, not_in={os.getpid(), int(server)})


def test_the_fork_server_does_not_look_for_modules_in_the_workers_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker started in a folder a sandbox can write (/tmp): a module planted there was found
    # first by the server's ``python -m`` (the folder heads sys.path), as root.
    import psutil

    from evalfleet.sandbox.process import shutdown_fork_servers

    if probe().get("seccomp") is not None:
        pytest.skip(f"no process sandboxes here: {probe()['seccomp']}")
    shutdown_fork_servers()
    monkeypatch.chdir(tmp_path)
    server = psutil.Process(fork_server("process", 30.0).proc.pid)
    try:
        assert server.cwd() == "/"
        assert "-P" in server.cmdline()[:3]
    finally:
        shutdown_fork_servers()
