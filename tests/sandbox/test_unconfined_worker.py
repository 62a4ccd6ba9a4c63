"""A worker that cannot confine its sandboxes as the report says runs no env code at all.

The report's manifest states the driver's isolation probe (Landlock held, say). A worker host
without Landlock (a kernel before 5.13, or ``lsm=`` without it) ran ``process`` sandboxes
unconfined: ``restrict_files`` answered "Landlock unavailable" and the sandbox went on, so a
hostile env read ``/etc/shadow``, other runs' parquet and ``EVALFLEET_HOME`` while the report said
``landlock: null`` (held), exit 0. Such a worker is planted here: its ``dask worker`` process is
started under a seccomp filter that fails ``landlock_create_ruleset`` (``without_landlock.py``).
Each sandbox now must apply what the driver's probe promised, or refuse before any env code runs:
the episodes end as ``crashed`` naming the worker and Landlock (a harness fault, exit 3), and an
env that only a sandbox may describe is refused with ``SandboxUnconfined`` (exit 3).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from evalfleet import errors
from evalfleet.cli import EXIT_HARNESS_FAULT, error_exit
from evalfleet.models import EvalRequest
from evalfleet.sandbox.isolation import available_levels, probe
from evalfleet.sandbox.limits import SandboxLimits
from flows.eval import evaluate
from tests.dask_processes import external_cluster

from .test_fresh_tmp import run_evaluation

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
POLICY = str(ROOT / "evalfleet" / "data" / "cartpole_mlp.pt")
WITHOUT_LANDLOCK = (sys.executable, str(Path(__file__).with_name("without_landlock.py")))
WORKER = "no-landlock-worker"

ENV_MODULE = """
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv
    import gymnasium as gym


    class ReadingCartPole(CartPoleEnv):
        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            try:
                with open("/etc/shadow", "rb") as fh:
                    info["read_etc_shadow"] = float(len(fh.read(16)) > 0)
            except OSError:
                info["read_etc_shadow"] = 0.0
            return obs, reward, terminated, truncated, info


    gym.register("{env_id}", entry_point="{module}:ReadingCartPole", max_episode_steps=40)
"""


@pytest.fixture
def own_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``module:EnvId-v0`` of a CartPole from a module of its own, on the workers' path too."""
    module, env_id = f"readcp_{uuid.uuid4().hex[:8]}", f"ReadCP{uuid.uuid4().hex[:6]}-v0"
    folder = tmp_path / "envsrc"
    folder.mkdir()
    (folder / f"{module}.py").write_text(textwrap.dedent(ENV_MODULE.format(env_id=env_id,
                                                                           module=module)))
    for path in (tmp_path, folder, folder / f"{module}.py"):
        path.chmod(0o755)  # a root worker's process sandboxes run under uids of their own
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(ROOT)]))
    yield f"{module}:{env_id}"
    sys.modules.pop(module, None)


def _request(tmp_path: Path, env: str, address: str) -> EvalRequest:
    return EvalRequest.build(env=env, policy=POLICY, episodes=4, workers=1, seed=3,
                             isolation="process", dask_address=address, retry_budget=1,
                             output=tmp_path / "out", cache_dir=tmp_path / "cache")


def test_a_worker_without_landlock_runs_no_env_code_unconfined(prefect_server, tmp_path: Path,
                                                               own_env: str) -> None:
    if probe().get("landlock") is not None:
        pytest.skip(f"this machine has no Landlock to promise: {probe()['landlock']}")
    with external_cluster(1, name=WORKER, prefix=WITHOUT_LANDLOCK) as address:
        # A shipped env is made by the worker itself; its episodes run in sandboxes that refuse.
        report = evaluate(_request(tmp_path, "CartPole-v1", address))
        rows = pq.read_table(report.outputs["episodes"]).to_pylist()
        assert [r["end_reason"] for r in rows] == ["crashed"] * 4, rows
        for row in rows:
            assert f"on worker {WORKER} refused to run the env: it could not apply landlock" \
                in row["error"], row["error"]
        assert report.completed == 0 and report.harness_fault
        # The manifest says what each sandbox had to apply.
        execution = json.loads(Path(report.outputs["report"]).read_text())["manifest"]["execution"]
        assert "landlock" in execution["sandbox_limits"]["required"]
        # An env of its own is described by a sandbox on the worker: refused, nothing runs.
        with pytest.raises(errors.SandboxUnconfined, match=f"on worker {WORKER} refused to run the env: "
                                                    "it could not apply landlock"):
            evaluate(_request(tmp_path, own_env, address))


def test_an_unconfined_worker_is_a_harness_fault_for_the_cli(capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    refused = errors.SandboxUnconfined("sandbox proc0 on worker w refused")
    assert error_exit(refused) == EXIT_HARNESS_FAULT
    assert "on worker w refused" in capsys.readouterr().err


def test_a_sandbox_required_to_have_what_it_cannot_apply_runs_nothing() -> None:
    # A jail's sandbox has no Landlock ruleset (the jail is its file confinement): required to
    # have one, each refuses, and every episode ends as crashed, naming what it lacked.
    if available_levels()["bwrap"] is not None:
        pytest.skip(f"bwrap level unavailable: {available_levels()['bwrap']}")
    records = run_evaluation("bwrap", "CartPole-v1", {}, episodes=2, slots=1,
                             limits=SandboxLimits(required=("landlock", "ipcns")))
    assert [r.end_reason for r in records] == ["crashed"] * 2
    assert all("refused to run the env: it could not apply landlock (Landlock" in (r.error or "")
               and "ipcns" not in (r.error or "") for r in records), records[0].error
