"""A top-level ``envs`` package that is not this project's never runs outside a sandbox.

evalfleet's bundled envs are the package ``envs`` of the project's folder. Another ``envs``
earlier on the import path (a ``PYTHONPATH`` entry, a distribution in site-packages) was
imported by that name in the driver, the workers and the root fork server: unconfined, it read
every secret of those processes and patched the rewards of every sandbox the server forked. The
planted package here records every process it runs in; the runs must refuse it by name, with
both paths, and leave no record.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evalfleet.sandbox.isolation import available_levels

PROJECT = Path(__file__).resolve().parents[2]

PLANT = """
import os
open(os.path.join({marks!r}, "ran-%d" % os.getpid()), "w").close()
import gymnasium
gymnasium.register(id="evalfleet/Inventory-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv",
                   max_episode_steps=5)
"""


def _run(tmp_path: Path, code: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    plant = tmp_path / "plant"
    marks = tmp_path / "marks"
    (plant / "envs").mkdir(parents=True)
    marks.mkdir()
    marks.chmod(0o777)
    (plant / "envs" / "__init__.py").write_text(PLANT.format(marks=str(marks)))
    env = {**os.environ, "PYTHONPATH": f"{plant}{os.pathsep}{PROJECT}",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    return done, sorted(p.name for p in marks.iterdir())


def test_a_foreign_envs_package_is_refused_before_it_is_imported(tmp_path: Path) -> None:
    done, ran = _run(tmp_path, """
        from evalfleet.envspec import import_env_modules
        from evalfleet.sandbox.process import preload_modules
        print("preload", preload_modules({"env_id": "evalfleet/Inventory-v0"}))
        try:
            import_env_modules("evalfleet/Inventory-v0")
        except Exception as err:
            print("refused", type(err).__name__, err)
        """)
    assert done.returncode == 0, done.stderr
    assert "preload []" in done.stdout
    line = next(x for x in done.stdout.splitlines() if x.startswith("refused"))
    assert "ForeignEnvsPackage" in line
    assert str(tmp_path / "plant" / "envs" / "__init__.py") in line  # what came
    assert str(PROJECT / "envs") in line  # what was expected
    assert "PYTHONPATH" in line and "Rename" in line  # what to do
    assert ran == []


@pytest.mark.skipif(available_levels()["process"] is not None,
                    reason=f"process level unavailable: {available_levels()['process']}")
def test_a_foreign_envs_package_runs_neither_in_the_fork_server_nor_in_a_sandbox(
        tmp_path: Path) -> None:
    done, ran = _run(tmp_path, """
        from evalfleet.envspec import env_thunk
        from evalfleet.sandbox.process import ProcessSlots, shutdown_fork_servers
        slots = ProcessSlots(env_thunk("evalfleet/Inventory-v0", {}, None), 1, level="process",
                             episode_timeout_s=30, env_spec={"env_id": "evalfleet/Inventory-v0"})
        try:
            out = slots.reset(0, 1)
            print("outcome", out.failure, out.error)
        finally:
            slots.close()
            shutdown_fork_servers()
        """)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("outcome"))
    assert line.startswith("outcome env_error ForeignEnvsPackage"), line
    assert ran == []  # neither the fork server (root, unconfined) nor the sandbox ran it


def test_another_envs_package_stays_unimported_and_an_id_that_needs_none_of_ours_runs(
        tmp_path: Path) -> None:
    """An RL project's own ``envs`` folder beside the user's script: refusing every env for it
    (CartPole included) would be a regression; only evalfleet's own ids need the bundled envs."""
    done, ran = _run(tmp_path, """
        import gymnasium
        from evalfleet.envspec import import_env_modules
        import_env_modules("CartPole-v1")
        gymnasium.make("CartPole-v1").reset(seed=0)
        print("cartpole ran")
        try:
            import_env_modules("evalfleet/Inventory-v0")
        except Exception as err:
            print("refused", type(err).__name__)
        """)
    assert done.returncode == 0, done.stderr
    assert "cartpole ran" in done.stdout
    assert "refused ForeignEnvsPackage" in done.stdout
    assert ran == []
