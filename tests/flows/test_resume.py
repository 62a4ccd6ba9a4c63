"""A driver SIGKILLed mid-evaluation: the re-run runs only what is missing, and equals a clean run.

The first attempt is the CLI in a subprocess against the session Prefect server; it is killed once
about half of its shards have persisted (the test polls the cache folder). The re-run of the same
request must reuse exactly the persisted episodes, compute the rest, and give the episode table
(outcome columns, byte for byte) and statistics of an undisturbed run; the killed attempt's flow
run must end Crashed, and no process the killed driver started may survive it. The re-run also
meets an MLflow store it cannot write: its result is in Parquet and the cache, the MLflow run is
queued, and a later flush logs it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evalfleet.audit import reused_in_rows
from evalfleet.cache import EpisodeCache
from evalfleet.cluster import fleet_cluster
from evalfleet.models import EvalRequest
from evalfleet.pipeline import outcome_table
from evalfleet.storage import read_episodes
from evalfleet.summary import summary_text
from evalfleet.tracking import flush_pending

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FIELDS: dict[str, Any] = {
    "env": "tests.sandbox.faulty_envs:evalfleet-test/SlowStep-v0",  # 2 ms steps: shards take ~1 s
    "policy": "tests.sandbox.faulty_envs:balance",
    "episodes": 64, "concurrency": 4, "max_steps": 60, "shard_episodes": 8,
    "isolation": "process", "seed": 7, "workers": 2,  # fork servers and sandboxes must die too
}
SHARDS = len(range(0, 64, 8))


def cli_args(output: Path) -> list[str]:
    f = FIELDS
    return [sys.executable, "flows/eval.py", "--env", f["env"], "--policy", f["policy"],
            "--episodes", str(f["episodes"]), "--concurrency", str(f["concurrency"]),
            "--max-steps", str(f["max_steps"]), "--shard-episodes", str(f["shard_episodes"]),
            "--isolation", f["isolation"], "--seed", str(f["seed"]), "--workers", str(f["workers"]),
            "--output", str(output), "--quiet"]


def free_loopback_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def in_group(pgid: int) -> list[psutil.Process]:
    """Processes still in the killed driver's process group (a /proc scan)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def test_killed_driver_resumes_to_the_undisturbed_table(prefect_server: str, tmp_path: Path) -> None:
    from flows.eval import evaluate
    from flows.reaper import driver_tag

    out = tmp_path / "out"
    env = dict(os.environ, PREFECT_API_URL=prefect_server, PYTHONPATH=str(ROOT))
    driver = subprocess.Popen(cli_args(out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    tag = driver_tag(driver.pid)
    deadline = time.monotonic() + 400
    while len(files := list(out.glob("cache/*/*/shards/*.parquet"))) < 3:
        assert driver.poll() is None, driver.stderr.read().decode()[-3000:] if driver.stderr else ""
        assert time.monotonic() < deadline, "no shard persisted in time"
        time.sleep(0.05)
    started = psutil.Process(driver.pid).children(recursive=True)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    files = list(out.glob("cache/*/*/shards/*.parquet"))
    persisted = sum(pq.read_metadata(f).num_rows for f in files)
    assert 0 < len(files) < SHARDS, f"{len(files)} shards persisted before the kill"
    assert started, "the driver had started its cluster"

    # Nothing the killed driver started outlives it (its workers watch it).
    deadline = time.monotonic() + 30
    while (left := alive(started) + in_group(driver.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [p.cmdline()[:4] for p in left]

    # The re-run's MLflow store is down (loopback, nothing listening): the result must still
    # reach Parquet and the cache, with the MLflow run queued for a later flush.
    import socket

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store = f"http://127.0.0.1:{s.getsockname()[1]}"
    with fleet_cluster(None, 2) as address:  # one cluster for the re-run and the clean run
        resumed = evaluate(EvalRequest.build(**FIELDS, output=out, dask_address=address,
                                             mlflow_uri=store))
        clean = evaluate(EvalRequest.build(**FIELDS, output=tmp_path / "clean", cache="off",
                                           dask_address=address))
    cache = resumed.cache
    assert (cache["status"], cache["reused"], cache["resumed"]) == ("partial", persisted, persisted)
    assert cache["computed"] == FIELDS["episodes"] - persisted
    assert list(out.glob("cache/*/*/shards/*.parquet")) == [], "shard files folded into the entry"
    assert EpisodeCache(out / "cache").lookup(cache["key"], range(64)).status == "hit"
    assert Path(resumed.outputs["episodes"]).exists() and "mlflow_run_id" not in resumed.outputs
    assert Path(resumed.outputs["mlflow_queued"]).exists()
    assert "mlflow_queued" in summary_text(resumed)
    [flushed] = flush_pending(out, f"sqlite:///{tmp_path / 'mlflow.db'}")  # the store, moved
    assert flushed["request_id"] == resumed.request_id and "mlflow_run_id" in flushed

    got = outcome_table(read_episodes(resumed.outputs["episodes"]).sort_by("episode_index"))
    want = outcome_table(read_episodes(clean.outputs["episodes"]).sort_by("episode_index"))
    assert got.num_rows == FIELDS["episodes"]
    assert ipc_bytes(got) == ipc_bytes(want)
    for field in ("returns", "lengths", "failures", "coverage", "scored", "success"):
        assert getattr(resumed, field) == getattr(clean, field), field

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterTags

    from flows.reaper import DRIVER_TAG

    with get_client(sync_client=True) as client:
        [run] = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
    assert run.state is not None and run.state.type.value == "CRASHED", run.state
    assert f"driver process {driver.pid}" in (run.state.message or "")
    with get_client(sync_client=True) as client:  # the tag is the flow run's only: no slot per task
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    assert task_runs and not [t for t in task_runs if any(x.startswith(DRIVER_TAG) for x in t.tags)]


def test_a_run_answered_by_shard_files_alone_is_audited(prefect_server: str, tmp_path: Path
                                                        ) -> None:
    """Every episode in shard files an interrupted run persisted, none in an entry: the re-run
    re-runs the audit sample against them (they were never audited), and folds them in."""
    from flows.eval import evaluate

    fields = dict(FIELDS, episodes=24)
    clean = evaluate(EvalRequest.build(**fields, output=tmp_path / "clean", cache="off"))
    table = read_episodes(clean.outputs["episodes"])
    request = EvalRequest.build(**fields, output=tmp_path / "out")
    cache = EpisodeCache(tmp_path / "out" / "cache")
    cache.persist_shard(clean.cache["key"], table.slice(0, 10))
    cache.persist_shard(clean.cache["key"], table.slice(10))
    resumed = evaluate(request)
    assert (resumed.cache["status"], resumed.cache["resumed"]) == ("hit", 24)
    assert resumed.audit is not None and resumed.audit["checked"] > 0, resumed.audit
    assert resumed.audit["mismatches"] == []
    assert not [a for a in resumed.alarms if a.startswith("determinism_audit")], resumed.alarms
    again = evaluate(request)  # the entry now, with the audit that passed
    assert again.cache["status"] == "hit" and again.audit == resumed.audit


#: An env whose instance carries state from one episode to the next (+1 per step once it served
#: one): 8 episodes on 4 in-process slots, 4..7 start on a used instance. Seed 6's audit sample
#: drawn from all indices is [0, 3], each first on its instance: the same on a fresh one.
STATEFUL: dict[str, Any] = {
    "env": "tests.core.rng_envs:evalfleet-test/CarriedOver-v0",
    "policy": "tests.core.rng_envs:first_action",
    "episodes": 8, "concurrency": 4, "workers": 1, "isolation": "inprocess", "seed": 6,
}


@pytest.fixture(scope="module")
def stateful_rows(prefect_server: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> tuple[pa.Table, str]:
    """The rows an interrupted run of ``STATEFUL`` leaves in its shard file, and its cache key."""
    from flows.eval import evaluate

    out = tmp_path_factory.mktemp("stateful") / "out"
    report = evaluate(EvalRequest.build(**STATEFUL, output=out, cache="off", audit=False,
                                        review=False))
    table = read_episodes(report.outputs["episodes"])
    assert reused_in_rows(table) == [4, 5, 6, 7]
    return table, report.cache["key"]


def killed_run_left(rows: tuple[pa.Table, str], out: Path) -> EpisodeCache:
    """The cache a run of ``STATEFUL`` killed once its (only) shard was persisted leaves."""
    table, key = rows
    cache = EpisodeCache(out / "cache")
    cache.persist_shard(key, table)
    return cache


def test_a_resumed_run_audits_an_episode_that_ran_on_a_used_instance(
        stateful_rows: tuple[pa.Table, str], tmp_path: Path) -> None:
    """Rows from shard files bring no shards: the audit's sample was drawn from all indices alone
    ([0, 3]), compared 2 with 0 mismatches and cached the table, while an undisturbed run raised
    ``non_deterministic_env``. Which rows ran on a used instance is read from the rows now."""
    from flows.eval import evaluate

    cache = killed_run_left(stateful_rows, tmp_path / "out")
    report = evaluate(EvalRequest.build(**STATEFUL, output=tmp_path / "out", review=False))
    assert (report.cache["status"], report.cache["resumed"]) == ("hit", 8)
    assert report.audit is not None and report.audit["checked"] == 2, report.audit
    assert [m["episode_index"] for m in report.audit["mismatches"]] == [7], report.audit
    assert [a for a in report.alarms if a.startswith("non_deterministic_env: 1 of 2")], report.alarms
    key = stateful_rows[1]
    assert cache.lookup(key, range(8)).status == "miss" and cache.shard_files(key) == []


def test_a_resumed_run_is_reviewed(stateful_rows: tuple[pa.Table, str], tmp_path: Path) -> None:
    """The review's replays of rows from shard files (never reviewed) ran: a resumed hit skipped
    them as 'cache hit: no new episodes to review', so ``--no-audit`` served such rows clean."""
    from flows.eval import evaluate

    cache = killed_run_left(stateful_rows, tmp_path / "out")
    report = evaluate(EvalRequest.build(**STATEFUL, output=tmp_path / "out", audit=False))
    assert (report.cache["status"], report.cache["resumed"]) == ("hit", 8)
    assert "review" not in report.outputs and Path(report.outputs["report_html"]).exists()
    assert [a for a in report.alarms if a.startswith("replay_nondeterminism: ")], report.alarms
    key = stateful_rows[1]
    assert cache.lookup(key, range(8)).status == "miss" and cache.shard_files(key) == []


def test_rows_folded_in_unaudited_are_audited_on_the_used_instances(
        stateful_rows: tuple[pa.Table, str], tmp_path: Path) -> None:
    """Killed, re-run with ``--no-audit`` (its rows folded into the entry with no audit), then the
    audited request: its audit ran against the entry with no episode of a used instance, 0
    mismatches, and the entry was stored as audited."""
    from flows.eval import evaluate

    cache = killed_run_left(stateful_rows, tmp_path / "out")
    folded = evaluate(EvalRequest.build(**STATEFUL, output=tmp_path / "out", audit=False,
                                        review=False))
    key = stateful_rows[1]
    assert folded.cache["resumed"] == 8 and cache.shard_files(key) == []
    assert cache.lookup(key, range(8)).status == "hit" and cache.audit(key) is None
    report = evaluate(EvalRequest.build(**STATEFUL, output=tmp_path / "out", review=False))
    assert (report.cache["status"], report.cache["resumed"]) == ("hit", 0)
    assert report.audit is not None and [m["episode_index"] for m in report.audit["mismatches"]
                                         ] == [7], report.audit
    assert [a for a in report.alarms if a.startswith("non_deterministic_env: 1 of 2")], report.alarms
    assert cache.lookup(key, range(8)).status == "miss"
