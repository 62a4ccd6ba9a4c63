"""Long-lived workers never run old code under a new key.

A Dask worker keeps the modules it imported. When an env's file is edited between two evaluations
on the same cluster, the driver reads the new file (a new cache key) while the worker would still
run the old class: the report would carry the old returns under the new code's key, with no alarm.
Planted here with an env whose reward scale is a module constant, edited from 1.0 to 2.0.
"""

from __future__ import annotations

import os
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from distributed import Client

from evalfleet.errors import StaleWorkerCode
from evalfleet.models import EvalRequest
from flows.eval import evaluate
from flows.local_runner import LocalFlowRunner
from tests.dask_processes import external_cluster

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
POLICY = str(ROOT / "evalfleet" / "data" / "cartpole_mlp.pt")

ENV_MODULE = """
    import gymnasium as gym
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv

    REWARD = 1.0


    class ScaledCartPole(CartPoleEnv):
        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            return obs, reward * REWARD, terminated, truncated, info


    gym.register("{env_id}", entry_point="{module}:ScaledCartPole", max_episode_steps=60)
"""


@pytest.fixture
def scaled_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """``module:EnvId-v0`` of a CartPole whose rewards are scaled by ``REWARD``, and its file."""
    module, env_id = f"stalecp_{uuid.uuid4().hex[:8]}", f"StaleCP{uuid.uuid4().hex[:6]}-v0"
    folder = tmp_path / "envsrc"
    folder.mkdir()
    source = folder / f"{module}.py"
    source.write_text(textwrap.dedent(ENV_MODULE.format(env_id=env_id, module=module)))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(ROOT)]))
    yield f"{module}:{env_id}", source
    sys.modules.pop(module, None)


def _request(tmp_path: Path, env: str, **fields: object) -> EvalRequest:
    return EvalRequest.build(env=env, policy=POLICY, episodes=12, workers=2, seed=5,
                             output=tmp_path / "out", **fields)


def _double_the_reward(source: Path) -> None:
    source.write_text(source.read_text().replace("REWARD = 1.0", "REWARD = 2.0"))


def test_a_cluster_not_ours_with_old_code_is_refused_with_what_to_do(prefect_server, tmp_path,
                                                                      scaled_env):
    env, source = scaled_env
    with external_cluster(2) as address:  # inprocess: the workers import the env's module
        before = evaluate(_request(tmp_path, env, dask_address=address, isolation="inprocess"))
        assert before.completed == 12
        _double_the_reward(source)
        module = env.split(":", 1)[0]
        with pytest.raises(StaleWorkerCode, match=rf"runs other code .*'{module}' runs "
                           r"source-sha256:\w+ where the key names source-sha256:\w+.*Restart the "
                           r"cluster's workers"):
            evaluate(_request(tmp_path, env, dask_address=address, isolation="inprocess"))
        # Nothing was stored under the new key: after a restart the new code runs, twice the return.
        with Client(address, timeout=20) as client:
            client.restart(wait_for_workers=True)
        after = evaluate(_request(tmp_path, env, dask_address=address, isolation="inprocess"))
        assert after.cache["status"] == "miss"
        assert after.mean == pytest.approx(2 * before.mean)


def test_sandboxed_env_code_is_imported_afresh_by_every_shards_sandboxes(prefect_server, tmp_path,
                                                                         scaled_env):
    # At process level the workers never import the env's own module (its sandboxes do, from the
    # files as they are): an edit runs at once, on the same workers, under its new key.
    env, source = scaled_env
    with external_cluster(2) as address:
        before = evaluate(_request(tmp_path, env, dask_address=address))
        assert before.isolation == "process"
        _double_the_reward(source)
        after = evaluate(_request(tmp_path, env, dask_address=address))
        assert after.cache["status"] == "miss"
        assert after.mean == pytest.approx(2 * before.mean)


def test_the_evaluators_own_workers_are_restarted_and_run_the_new_code(prefect_server, tmp_path,
                                                                       scaled_env):
    env, source = scaled_env
    runner = LocalFlowRunner(workers=2)
    try:
        before = runner(_request(tmp_path, env))
        assert before.completed == 12
        _double_the_reward(source)
        after = runner(_request(tmp_path, env))
        assert after.cache["status"] == "miss"
        assert after.mean == pytest.approx(2 * before.mean)
        assert after.completed == 12
    finally:
        runner.close()
