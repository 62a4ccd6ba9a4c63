"""Local workers forked from the fork server get Dask's one-thread-per-library environment.

A Dask nanny exports ``distributed.nanny.pre-spawn-environ`` (``OMP_NUM_THREADS=1``, ...) before
it starts a worker. A worker forked from the fork server inherits libraries the server loaded,
which read those variables once, at load: when stage 1 started the server before any nanny ran,
torch in every worker had a thread pool as wide as the machine, and two workers on two cores spun
against each other (a CartPole MLP step took ~5 ms instead of ~0.1 ms).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dask

from evalfleet.cluster import client_for, fleet_cluster, fork_server_for_check, worker_environment

#: What Dask's nanny exports into the process it runs in (a plain ``LocalCluster``'s: this one).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _threads() -> dict[str, object]:
    import torch

    return {"torch": torch.get_num_threads(), "hash_seed": os.environ.get("PYTHONHASHSEED")}


def test_workers_forked_after_a_stage_one_check_run_torch_on_one_thread(monkeypatch):
    for key in (*THREAD_VARIABLES, "PYTHONHASHSEED"):  # as in a fresh process
        monkeypatch.delenv(key, raising=False)
    with fork_server_for_check(("torch",)):  # stage 1 starts the server, as evaluate() does
        pass
    with fleet_cluster(None, 2, ("torch",), single_use=True) as address:
        got = client_for(address).run(_threads)
        # The nannies run in this process (a training process, for an Evaluator): they exported
        # nothing into it, so its later children are not made single-threaded.
        assert "OMP_NUM_THREADS" not in os.environ and "MKL_NUM_THREADS" not in os.environ
    assert [g["torch"] for g in got.values()] == [1, 1], got
    assert [g["hash_seed"] for g in got.values()] == ["6640", "6640"]  # one seed, as Dask's
    assert "PYTHONHASHSEED" not in os.environ


def test_this_process_setting_wins_over_the_config_as_on_dask_workers(monkeypatch):
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own, in the driver's environment
    monkeypatch.setenv("MKL_NUM_THREADS", "2")  # (torch takes the smaller of the two)
    with fleet_cluster(None, 1, ("torch",), single_use=True) as address:
        got = client_for(address).run(_threads)
    assert [g["torch"] for g in got.values()] == [min(2, os.cpu_count() or 1)], got
    assert os.environ["OMP_NUM_THREADS"] == "2"


def test_the_configured_thread_count_reaches_the_workers(monkeypatch):
    for key in THREAD_VARIABLES:  # a LocalCluster started elsewhere in this process sets them
        monkeypatch.delenv(key, raising=False)
    with dask.config.set({"distributed.nanny.pre-spawn-environ.OMP_NUM_THREADS": 2,
                          "distributed.nanny.pre-spawn-environ.MKL_NUM_THREADS": 2}):
        assert worker_environment()["OMP_NUM_THREADS"] == "2"
        with fleet_cluster(None, 1, ("torch",), single_use=True) as address:
            got = client_for(address).run(_threads)
    assert [g["torch"] for g in got.values()] == [2], got


SCRIPT = """
import os
with open(os.environ["MARKS"], "a") as marks:  # a main script's top level, with a side effect
    marks.write(f"{os.getpid()}\\n")
if __name__ == "__main__":
    print(os.getpid(), flush=True)


def probe():
    return os.getpid()


if __name__ == "__main__":
    from evalfleet.cluster import client_for, fleet_cluster, fork_server_for_check

    with fork_server_for_check(()):  # stage 1's start of the server, then a cluster's
        pass
    with fleet_cluster(None, 2, (), single_use=True) as address:
        print(len(client_for(address).run(probe)))
"""


def test_workers_do_not_run_the_drivers_main_script_again(tmp_path):
    script, marks = tmp_path / "train.py", tmp_path / "marks"
    script.write_text(SCRIPT)
    env = dict(os.environ, MARKS=str(marks), PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "2"  # two workers ran the probe
    assert marks.read_text().split() == [str(done_pid(done))]  # the driver's own run, no other


def done_pid(done: subprocess.CompletedProcess[str]) -> int:
    """The driver's pid, the first line its script wrote."""
    return int(done.stdout.split()[0])


def _frozen() -> int:
    import gc

    return gc.get_freeze_count()


def test_what_the_fork_server_preloaded_is_frozen_out_of_the_workers_gc_passes():
    # Each full collection in a worker walked every preloaded object (~0.3 s each with Dask,
    # pandas, Prefect and torch imported): up to a tenth of a pure-Python env's shard.
    with fleet_cluster(None, 2, ("torch",), single_use=True) as address:
        got = client_for(address).run(_frozen)
    assert len(got) == 2 and all(count > 100_000 for count in got.values()), got


def _timers(dask_worker) -> dict[str, object]:
    return {"callbacks": sorted(dask_worker.periodic_callbacks),
            "tick": dask.config.get("distributed.admin.tick.interval"),
            "memory": dask.config.get("distributed.worker.memory.monitor-interval")}


def test_local_workers_run_no_stack_sampler_and_slow_timers():
    # Dask's defaults woke each worker's event loop ~160 times a second (stack samples for the
    # dashboard's profile every 10 ms, loop timing every 20 ms, memory every 100 ms), each
    # wake-up taking the GIL from the shard thread: ~10% of a pure-Python env's episodes' CPU
    # went to the workers' and the driver's event loops.
    with fleet_cluster(None, 1, single_use=True) as address:
        [got] = client_for(address).run(_timers).values()
        scheduler = client_for(address).run_on_scheduler(
            lambda: dask.config.get("distributed.admin.tick.interval"))
    assert "profile" not in got["callbacks"] and "profile-cycle" not in got["callbacks"]
    assert "heartbeat" in got["callbacks"]  # the worker still talks to its scheduler
    assert (got["tick"], got["memory"], scheduler) == ("1s", "1s", "1s")
