"""A cache hit from the CLI imports no Dask cluster machinery: it starts no cluster (issue 15)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import dask
import pytest

from evalfleet.cluster import annotated

ROOT = Path(__file__).resolve().parents[2]
#: Modules a run that starts no cluster has no use for (~0.2 s of imports for distributed).
CLUSTER_MODULES = ("distributed", "prefect_dask", "torch")


def _imported(stderr: str) -> set[str]:
    """Module names ``python -X importtime`` reported loading."""
    return {m.group(1) for m in re.finditer(r"^import time:.*\|\s*(\S+)\s*$", stderr, re.M)}


@pytest.mark.slow
def test_cli_cache_hit_imports_no_cluster_modules(prefect_server, tmp_path, example_policy):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    args = [sys.executable, "-X", "importtime", "flows/eval.py", "--policy", example_policy,
            "--episodes", "6", "--concurrency", "3", "--workers", "1",
            "--output", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]
    miss = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert miss.returncode == 0, miss.stderr[-3000:]
    assert "miss" in miss.stdout and {"distributed", "prefect_dask"} <= _imported(miss.stderr)

    hit = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert hit.returncode == 0, hit.stderr[-3000:]
    assert re.search(r"cache\s+hit \(reused 6\)", hit.stdout), hit.stdout
    assert "mlflow_run_id" in hit.stdout  # stage 7 ran: MLflow, Parquet, the report
    assert _imported(hit.stderr) & set(CLUSTER_MODULES) == set()


def test_annotated_asks_for_resources_only_when_there_are_some():
    with annotated({}):
        assert "resources" not in dask.get_annotations()
    with annotated({"GPU": 1}):
        assert dask.get_annotations()["resources"] == {"GPU": 1}
    assert "resources" not in dask.get_annotations()


_MISS_ORDER = """
import sys, multiprocessing.forkserver as mf
seen = []
start = mf.ForkServer.ensure_running
def spy(self):
    seen.append(sorted(m for m in ("pandas", "distributed") if m in sys.modules))
    return start(self)
mf.ForkServer.ensure_running = spy
from evalfleet.cli import build_parser, request_from_args
from evalfleet.cluster import stop_idle_fork_server
from evalfleet.pipeline import received_before_flow
from flows.runtime import worker_preload
request = request_from_args(build_parser().parse_args(sys.argv[1:]))
try:
    received, hit = received_before_flow(request, on_miss=worker_preload)
finally:
    stop_idle_fork_server()
print("hit" if hit else "miss", seen[0])
"""


def test_a_miss_starts_the_workers_fork_server_before_the_driver_imports_pandas_or_distributed(
        tmp_path, example_policy):
    """Issue 15: the fork server's imports (~2.6 s, then the policy check) start as early as they can.

    The cache lookup turned its indices into an Arrow array, which imports pandas (~0.3 s), and
    the server's start imported ``distributed`` (~0.3 s) to read Dask's defaults: both on the
    path to it, before anything could start there.
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    args = [sys.executable, "-c", _MISS_ORDER, "--policy", example_policy, "--episodes", "6",
            "--workers", "1", "--output", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "miss []", done.stdout
