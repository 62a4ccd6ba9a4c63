"""The runner's random numbers and action conversions, against what a plain Gymnasium loop gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from evalfleet.cache import key_ingredients
from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.policy import LoadedPolicy, sample_actions
from evalfleet.records import EpisodeRecord
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox import open_slots
from evalfleet.sandbox.isolation import available_levels
from evalfleet.seeds import SeedLedger, action_rng

from . import rng_envs

ROOT = Path(__file__).resolve().parents[2]


def _run(name: str, fn: Any, space: spaces.Space[Any], episodes: int, *, is_torch: bool = False,
         deterministic: bool = True, isolation: str = "inprocess", slots: int = 8) -> list[EpisodeRecord]:
    env = rng_envs.env_id(name)
    resolved = resolve_env(env, {}, None)
    policy = LoadedPolicy(fn, space, is_torch=is_torch, deterministic=deterministic, device="cpu")
    box = open_slots(isolation, env_thunk(env, {}, None), slots, episode_timeout_s=30.0,
                     env_spec=resolved.fingerprint.as_dict())
    seeds = SeedLedger(0).seeds(range(episodes))
    try:
        records = run_shard([(i, int(s)) for i, s in enumerate(seeds)], box, policy,
                            EpisodeContext("t", "0" * 64, env, resolved.fingerprint.spec_hash, "w"))
    finally:
        box.close()
    return sorted(records, key=lambda r: r.episode_index)


def test_sampled_actions_do_not_draw_the_envs_own_random_numbers():
    """A coin policy sampled against an env flipping coins matches half the time, as in a plain
    loop. With the action stream seeded like the env's ``np_random`` it matched every flip: a
    perfect score for a policy that knows nothing."""
    records = _run("CoinFlip", rng_envs.uniform_logits, spaces.Discrete(2), 40, is_torch=True,
                   deterministic=False)
    returns = np.array([r.episode_return for r in records])
    assert 40 <= returns.mean() <= 60, returns  # 4,000 fair coins: 50 +- 0.8 per episode
    assert returns.max() < rng_envs.STEPS


def test_the_action_stream_is_apart_from_gymnasiums_and_fixed_by_the_seed():
    env_rng = np.random.default_rng(12345)  # what gymnasium's reset(seed=12345) seeds np_random with
    assert action_rng(12345).random(4).tolist() != env_rng.random(4).tolist()
    assert action_rng(12345).random(4).tolist() == action_rng(12345).random(4).tolist()


def test_a_stochastic_key_names_its_sampler_and_a_deterministic_key_is_unchanged():
    def protocol(deterministic: bool) -> dict[str, Any]:
        policy = dict.fromkeys(("sha256", "format", "factory", "output_kind", "factory_sha256", "code"))
        versions = dict.fromkeys(("evalfleet", "gymnasium", "numpy", "torch", "python",
                                  "python_implementation"), "1")
        return key_ingredients(policy, {}, 0, None, deterministic, versions,
                               {"device": "cpu", "dtype": "float32"})["protocol"]

    assert protocol(True) == {"seed": 0, "max_steps": None, "deterministic": True}
    assert protocol(False)["sampler"].startswith("pcg64([seed, 0xAC7])")


def test_a_masked_action_is_never_sampled_however_close_to_one_the_draw():
    """392 actions, the last masked: a float32 CDF ends ~5e-6 short of 1, and a draw past its
    end became the last action, masked or not."""
    logits = np.zeros((1, 392), np.float32)
    logits[0, -1] = -np.inf

    class Near:
        def __init__(self, u: float) -> None:
            self.u = u

        def random(self) -> float:
            return self.u

    for u in (0.0, 0.5, 1 - 1e-6, np.nextafter(1.0, 0.0)):
        (a,) = sample_actions(logits, [Near(u)])  # type: ignore[list-item]
        assert 0 <= a < 391, (u, a)
    masked_first = np.array([[-np.inf, 0.0, -np.inf, 0.0, -np.inf]], np.float32)
    picks = {int(sample_actions(masked_first, [Near(u)])[0]) for u in (0.0, 0.25, 0.5, 0.99999)}  # type: ignore[list-item]
    assert picks == {1, 3}


def test_sampling_follows_the_softmax():
    logits = np.log(np.array([[0.1, 0.2, 0.7]], np.float32))
    rngs = [action_rng(7)]
    draws = np.array([sample_actions(logits, rngs)[0] for _ in range(20_000)])
    assert np.allclose(np.bincount(draws, minlength=3) / len(draws), [0.1, 0.2, 0.7], atol=0.015)


GLOBAL_NOISE = """
import json
from gymnasium import spaces
from tests.core import rng_envs, test_action_streams as t
records = t._run("GlobalNoise", rng_envs.uniform_logits, spaces.Discrete(2), 8, is_torch=True,
                 isolation="process")
print(json.dumps([[r.end_reason, r.episode_return, r.error] for r in records]))
"""


def test_sandboxes_do_not_share_numpys_global_random_state():
    """Forked from one server, every sandbox drew the same numbers from ``np.random``: eight
    episodes of an env that uses it had one return between them, a spread of exactly zero.

    Run as a worker runs it, in a process of its own (no test session's probes before it).
    """
    if "process" not in available_levels():
        pytest.skip("process sandboxes unavailable here")
    done = subprocess.run([sys.executable, "-c", GLOBAL_NOISE], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert {reason for reason, _, _ in rows} == {"truncated"}, rows[0]
    returns = [ret for _, ret, _ in rows]
    assert len(set(returns)) == len(returns), returns


def test_a_fraction_in_an_integer_box_is_an_invalid_action_not_a_truncated_one():
    """Box(0, 3, int64) given 2.7: the env got 2 and the policy was scored for an action it
    did not choose. Discrete already refused 2.7; an integer Box now does the same."""
    box = spaces.Box(0, 3, (1,), np.int64)
    bad = _run("IntegerBox", rng_envs.fractional, box, 4)
    assert {r.end_reason for r in bad} == {"invalid_action"}
    assert "2.7" in (bad[0].error or "")
    good = _run("IntegerBox", rng_envs.whole, box, 4)
    assert [(r.end_reason, r.episode_return) for r in good] == [("truncated", 10.0)] * 4


def test_a_success_flag_given_as_a_0_d_array_is_read():
    """``info["is_success"] = done.numpy()`` (a 0-d tensor's) is a 0-d array, not a numpy
    scalar: it was dropped, and every episode's success read as no answer."""
    (record,) = _run("ArrayInfo", rng_envs.uniform_logits, spaces.Discrete(2), 1, is_torch=True)
    assert record.success is True
    assert record.metrics == {"score": 2.5}  # a vector is no scalar metric
