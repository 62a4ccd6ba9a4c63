"""A ``sha256:`` baseline naming the evaluated policy's own hash, and its episodes after the run.

Planted as the audit found it: a callable (``act``) whose hash is its module's source, importing
``THRESH`` from a helper module keyed apart. Evaluated with ``THRESH = 0.0`` it balances CartPole
(500); with ``THRESH = 5.0`` it pushes left (~9.6), under the same hash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from evalfleet.cache import EpisodeCache
from evalfleet.cli import EXIT_BAD_REQUEST, EXIT_OK, EXIT_STOPPED_MIDWAY, error_exit
from evalfleet.models import EvalRequest
from flows.eval import baseline_episodes

ROOT = Path(__file__).resolve().parents[2]
EPISODES = 12

POLICY = """
import numpy as np
from {cfg} import THRESH


def act(obs):
    return (obs[:, 2] + 0.5 * obs[:, 3] > THRESH).astype(np.int64)
"""


def _plant(tmp_path: Path, thresh: float) -> tuple[str, str, Path]:
    """A policy package and the helper package it imports, in folders of their own."""
    tag = uuid.uuid4().hex[:8]
    cfg, pol = f"hashcfg_{tag}", f"hashpol_{tag}"
    for name, source in ((cfg, f"THRESH = {thresh}\n"), (pol, POLICY.format(cfg=cfg))):
        (tmp_path / "mods" / name).mkdir(parents=True)
        (tmp_path / "mods" / name / "__init__.py").write_text(source)
    return f"{pol}:act", cfg, tmp_path / "mods" / cfg / "__init__.py"


def _cli(prefect_server: str, tmp_path: Path, policy: str, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, str(ROOT / "flows" / "eval.py"), "--env", "CartPole-v1", "--policy",
            policy, "--episodes", str(EPISODES), "--concurrency", "6", "--workers", "1",
            "--isolation", "inprocess", "--no-audit", "--output", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"), *extra]
    env = {**os.environ, "PREFECT_API_URL": prefect_server,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "mods")])}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _reports(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("runs/*/report.json"),
                                                      key=lambda p: p.stat().st_mtime)]


@pytest.mark.slow
def test_its_own_hash_cached_with_other_imported_code_is_refused_before_anything_runs(
        prefect_server: str, tmp_path: Path) -> None:
    """With ``--no-cache`` the baseline was taken for itself: difference 0, "not
    distinguishable", exit 0, against a cached baseline of 500 for a policy of ~9.6. Without it
    the run completed, stored a second entry of the hash, then exited 2 ("nothing was spawned")
    with no report. Both are refused at stage 1 now: one cache entry, no report."""
    policy, _, helper = _plant(tmp_path, 0.0)
    first = _cli(prefect_server, tmp_path, policy)
    assert first.returncode == EXIT_OK, first.stderr[-3000:]
    [cached] = _reports(tmp_path)
    assert cached["returns"]["mean"] == 500.0
    sha = cached["policy_sha256"]
    helper.write_text("THRESH = 5.0\n")
    for extra in (["--no-cache"], []):
        run = _cli(prefect_server, tmp_path, policy, "--baseline", f"sha256:{sha[:16]}", *extra)
        assert run.returncode == EXIT_BAD_REQUEST, (extra, run.stdout[-2000:], run.stderr[-3000:])
        assert (f"baseline 'sha256:{sha[:16]}' names the evaluated policy's own hash ({sha[:16]}), "
                "but the cache holds 1 evaluation of that hash under this protocol with another "
                f"cache key ({cached['cache']['key'][:12]};") in run.stderr, run.stderr[-3000:]
        assert "differs, so it is not this policy" in run.stderr
        assert len(_reports(tmp_path)) == 1  # no evaluation ran, none was reported
        assert [e["key"] for e in EpisodeCache(tmp_path / "cache").entries()] == [cached["cache"]["key"]]
    # The same code again: the cached entry is this policy's, its episodes reused (a hit).
    helper.write_text("THRESH = 0.0\n")
    again = _cli(prefect_server, tmp_path, policy, "--baseline", f"sha256:{sha[:16]}")
    assert again.returncode == EXIT_OK, again.stderr[-3000:]
    report = _reports(tmp_path)[-1]
    assert report["cache"]["status"] == "hit"
    c = report["comparison"]
    assert (c["n"], c["mean_diff"], c["mean_baseline"]) == (EPISODES, 0.0, 500.0)


def _received(sha: str, key: str) -> SimpleNamespace:
    ing = {"env": {"x": 1}, "protocol": {"seed": 0}}
    return SimpleNamespace(cache_ingredients=dict(ing, policy={"sha256": sha}), cache_key=key,
                           artifact=SimpleNamespace(sha256=sha))


def _table(sha: str, n: int):
    from tests.core.test_history import _broken_on

    return _broken_on(range(0), n=n, name=sha)


def test_its_own_hash_stored_under_another_key_during_the_run_is_still_itself(tmp_path: Path) -> None:
    """Stage 1 found no other key of the evaluated policy's hash: the baseline is itself. An entry
    of that hash stored meanwhile (another run, other imported code) made the second look refuse
    it ("2 evaluations ... a hash cannot say which"): exit 2 after every episode ran, no report."""
    sha, mine, theirs = "5d" * 32, "a" * 64, "b" * 64
    received = _received(sha, mine)
    cache = EpisodeCache(tmp_path / "cache")
    for key in (mine, theirs):
        cache.store(key, _table(sha, 20), {**received.cache_ingredients,
                                           "policy": {"sha256": sha, "code": {"cfg": key[:4]}}})
    request = EvalRequest(env="CartPole-v1", policy="hashpol:act", baseline=f"sha256:{sha[:16]}",
                          cache_dir=tmp_path / "cache", output=tmp_path, episodes=20)
    table = _table(sha, 20)
    got, source = baseline_episodes(request, received, SimpleNamespace(table=table), None)  # type: ignore[arg-type]
    assert got is table and source == f"sha256:{sha[:16]}"


def test_a_baseline_gone_from_the_cache_after_the_run_is_no_bad_request(tmp_path: Path,
                                                                        capsys) -> None:
    """Another policy's cached episodes, found at stage 1, removed before the run ended: the
    error said "bad request" (exit 2, nothing spawned) for an evaluation whose episodes all ran.
    It is ``BaselineUnavailable`` now: exit 7, saying the evaluation ran and what to do."""
    from evalfleet.errors import BaselineUnavailable

    sha, theirs = "5d" * 32, "ee" * 32
    received = _received(sha, "a" * 64)
    request = EvalRequest(env="CartPole-v1", policy="hashpol:act", baseline=f"sha256:{theirs[:16]}",
                          cache_dir=tmp_path / "cache", output=tmp_path, episodes=20)
    with pytest.raises(BaselineUnavailable) as err:
        baseline_episodes(request, received, SimpleNamespace(table=_table(sha, 20)), None)  # type: ignore[arg-type]
    text = str(err.value)
    assert text.startswith("the evaluation ran, but its baseline's episodes could not be had "
                           f"afterwards: baseline 'sha256:{theirs[:16]}': no cached episodes")
    assert "run it again to compare with the baseline as it is now" in text
    assert error_exit(err.value) == EXIT_STOPPED_MIDWAY
    assert "evalfleet: error: the evaluation ran" in capsys.readouterr().err
