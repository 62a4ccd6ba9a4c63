"""What an env writes in its sandbox never reaches another sandbox, in a warm jail too.

A worker keeps its bwrap jail (one per level and env packages) for every later evaluation of envs
from the same module. The jail's tmpfs ``/tmp`` and its ``/dev`` (``/dev/shm``) lived as long:
a buggy env that caches the level it generates in ``/tmp`` made a later evaluation, with other
kwargs, return what the first one's level gave (3 per episode instead of 9), and nothing saw it.
Each sandbox now has a ``/tmp`` and ``/dev/shm`` of its own; the jail is still reused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from gymnasium import spaces

from evalfleet.envspec import env_thunk, resolve_env_for
from evalfleet.policy import LoadedPolicy
from evalfleet.records import EpisodeRecord
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox import open_slots
from evalfleet.sandbox.forkclient import fork_server
from evalfleet.sandbox.isolation import available_levels
from evalfleet.sandbox.limits import SandboxLimits, landlock_abi
from evalfleet.seeds import SeedLedger

from . import faulty_envs as fe

LEAKY = '''
import json
import os

import gymnasium as gym
import numpy as np

CACHE = {cache!r}


class Leaky(gym.Env):
    """Buggy, not hostile: caches the level it generates at CACHE and reuses it from then on."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, difficulty=1):
        try:
            with open(CACHE) as fh:
                level = json.load(fh)
        except OSError:
            level = {{"gain": float(difficulty)}}
            try:
                with open(CACHE, "w") as fh:
                    json.dump(level, fh)
            except OSError:
                pass  # nowhere to keep it: generated again next time
        self.gain = level["gain"]
        # What an earlier sandbox left in this one's own folder (its HOME), if anything.
        self.found = len(os.listdir(os.environ["HOME"]))
        with open(os.path.join(os.environ["HOME"], "scratch.txt"), "w") as fh:
            fh.write("left behind")

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {{}}

    def step(self, action):
        self.t += 1
        done = self.t >= 3
        return np.zeros(4, np.float32), self.gain, done, False, {{"found": self.found}} if done else {{}}


gym.register(id="{env_id}", entry_point="{module}:Leaky", max_episode_steps=10)
'''


def _plant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_dir: str) -> tuple[str, str]:
    """A single-file env module on ``sys.path`` that caches its level in ``cache_dir``."""
    tag = f"{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    module, name = f"leaky_{tag}", f"Leaky{tag}-v0"
    src = tmp_path / "src"
    src.mkdir()
    for path in (tmp_path, src):
        path.chmod(0o755)  # a root worker's process sandboxes run under uids of their own
    (src / f"{module}.py").write_text(LEAKY.format(
        cache=f"{cache_dir}/leaky-level-{tag}.json", env_id=name, module=module))
    (src / f"{module}.py").chmod(0o644)
    monkeypatch.syspath_prepend(str(src))
    return f"{module}:{name}", module


def run_evaluation(level: str, env_id: str, kwargs: dict[str, Any], episodes: int = 4,
                   slots: int = 2, limits: SandboxLimits | None = None) -> list[EpisodeRecord]:
    """One evaluation as a worker runs it: described in a sandbox, then its episodes."""
    resolved = resolve_env_for(env_id, kwargs, None, level, limits=limits)
    policy = LoadedPolicy(fe.balance, spaces.Discrete(2), is_torch=False, deterministic=True,
                          device="cpu")
    ctx = EpisodeContext("test", "0" * 64, env_id, resolved.fingerprint.spec_hash, "w")
    seeds = SeedLedger(0).seeds(range(episodes))
    box = open_slots(level, env_thunk(env_id, kwargs, None), slots, episode_timeout_s=30,
                     env_spec=resolved.fingerprint.as_dict(), limits=limits)
    try:
        records = run_shard([(i, int(s)) for i, s in enumerate(seeds)], box, policy, ctx)
    finally:
        box.close()
    return sorted(records, key=lambda r: r.episode_index)


def _skip_unless(level: str) -> None:
    if available_levels()[level] is not None:
        pytest.skip(f"{level} level unavailable: {available_levels()[level]}")


@pytest.mark.parametrize("cache_dir", ["/tmp", "/dev/shm", "/dev"])
def test_a_warm_jail_keeps_no_file_of_an_earlier_evaluation(cache_dir: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    _skip_unless("bwrap")
    env_id, module = _plant(tmp_path, monkeypatch, cache_dir)
    first = run_evaluation("bwrap", env_id, {"difficulty": 1})
    assert [(r.end_reason, r.episode_return) for r in first] == [("terminated", 3.0)] * 4, first
    jail = fork_server("bwrap", 60, ["envs", module]).proc.pid
    second = run_evaluation("bwrap", env_id, {"difficulty": 3})
    # 3 steps of 3: the level the first evaluation's sandboxes cached is not in sight.
    assert [(r.end_reason, r.episode_return) for r in second] == [("terminated", 9.0)] * 4, second
    assert all(r.metrics.get("found") == 0 for r in second), second
    # ... and the jail is the same warm one: no start per evaluation.
    assert fork_server("bwrap", 60, ["envs", module]).proc.pid == jail


def test_a_process_sandbox_starts_in_an_empty_folder_removed_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_unless("process")
    if landlock_abi() == 0:
        pytest.skip("this kernel has no Landlock: a process sandbox writes where anyone may")
    # Its own folder is the only place it writes (with Landlock: /tmp is refused, and the env
    # gives up caching); nothing of an earlier sandbox's folder is in a later one's.
    env_id, module = _plant(tmp_path, monkeypatch, "/tmp")
    for difficulty in (1, 3):
        records = run_evaluation("process", env_id, {"difficulty": difficulty})
        assert [r.episode_return for r in records] == [3.0 * difficulty] * 4, records
        assert all(r.metrics.get("found") == 0 for r in records), records
    folder = fork_server("process", 60).hello["folder"]
    assert os.listdir(folder) == [], "sandbox folders left behind after their slots closed"
