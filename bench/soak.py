"""Soak: back-to-back evaluations from the in-loop ``Evaluator`` while Dask workers are SIGKILLed.

    python -m bench.soak                      # 100 evaluations (on demand, not in CI)
    python -m bench.soak --evaluations 30     # a shorter run

One ``Evaluator`` (the default local runner: one Prefect API, one local Dask cluster kept open)
evaluates the bundled CartPole MLP again and again in ``process`` sandboxes with the cache off.
A killer thread SIGKILLs a random Dask worker process during about half of the evaluations
(the nanny restarts it; Dask re-runs its shard elsewhere). After each evaluation the soak
records whether the result is complete (every episode index once, every planned episode
scored), the driver's RSS and open files, and the number and RSS of its descendant processes.
At the end: the growth of each figure between the first and the last tenth of the run, and any
process left behind after ``shutdown`` (descendants, or fork servers orphaned to init).
Writes ``bench/results/soak.json`` and ``soak.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "evalfleet" / "data" / "cartpole_mlp.pt"
#: Stated bounds: growth of the driver between the first and the last tenth of the run.
BOUNDS = {"driver_rss_mb": 150.0, "driver_open_files": 10, "descendants": 0}


def dask_workers(pid: int) -> list[psutil.Process]:
    """Dask worker processes below ``pid`` (spawned by the nannies of a LocalCluster)."""
    out = []
    for p in psutil.Process(pid).children(recursive=False):
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def snapshot(pid: int) -> dict[str, float]:
    me = psutil.Process(pid)
    kids = me.children(recursive=True)
    rss = 0
    for k in kids:
        try:
            rss += k.memory_info().rss
        except psutil.Error:
            pass
    return {"driver_rss_mb": me.memory_info().rss / 2**20,
            "driver_open_files": len(os.listdir("/proc/self/fd")),
            "descendants": len(kids), "descendants_rss_mb": rss / 2**20}


def orphaned_fork_servers() -> int:
    """Fork servers or sandboxes whose parent is init (left behind by a dead worker)."""
    n = 0
    for p in psutil.process_iter(["ppid", "cmdline"]):
        if p.info["ppid"] == 1 and "evalfleet.sandbox.forkserver" in " ".join(p.info["cmdline"] or []):
            n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--evaluations", type=int, default=100)
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--kill-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    import torch

    from evalfleet.client import Evaluator

    rng = np.random.default_rng(args.seed)
    model = torch.jit.load(str(POLICY))
    scratch = Path(tempfile.mkdtemp(prefix="evalfleet-soak-"))
    os.environ.setdefault("PREFECT_HOME", str(scratch / "prefect"))
    rows: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    pid = os.getpid()
    t_start = time.time()
    orphans_before = orphaned_fork_servers()
    with Evaluator(env="CartPole-v1", num_episodes=args.episodes, busy_policy="queue",
                   isolation="process", concurrency=8, cache="off", output=scratch / "out",
                   audit=False) as evaluator:
        for i in range(args.evaluations):
            stop = threading.Event()
            kill = bool(rng.random() < args.kill_fraction) and i > 0
            delay = float(rng.uniform(0.2, 2.0))

            def killer(delay: float = delay, stop: threading.Event = stop, i: int = i) -> None:
                if stop.wait(delay):
                    return
                workers = dask_workers(pid)
                if workers:
                    victim = workers[int(rng.integers(len(workers)))]
                    try:
                        victim.send_signal(signal.SIGKILL)
                        kills.append({"evaluation": i, "pid": victim.pid, "after_s": delay})
                    except psutil.Error:
                        pass

            thread = threading.Thread(target=killer, daemon=True) if kill else None
            if thread:
                thread.start()
            t0 = time.perf_counter()
            error = None
            try:
                result = evaluator.evaluate(model, step=i, timeout=600)
                report = result["report"]
                complete = report.episodes == args.episodes and report.coverage == 1.0
            except Exception as err:  # a failed evaluation is a finding, not a crash of the soak
                error, complete, report = f"{type(err).__name__}: {err}"[:300], False, None
            stop.set()
            if thread:
                thread.join()
            rows.append({"evaluation": i, "seconds": time.perf_counter() - t0, "complete": complete,
                         "killed_worker": kill and any(k["evaluation"] == i for k in kills),
                         "error": error, **snapshot(pid)})
            print(f"{i:3d} {rows[-1]['seconds']:6.2f}s complete={complete} kill={rows[-1]['killed_worker']} "
                  f"rss={rows[-1]['driver_rss_mb']:.0f}MB fds={rows[-1]['driver_open_files']} "
                  f"procs={rows[-1]['descendants']}" + (f" {error}" if error else ""), flush=True)
    time.sleep(2)
    # multiprocessing's resource tracker is the interpreter's own helper: it exits with it.
    left = [p for p in psutil.Process(pid).children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]
    tenth = max(1, len(rows) // 10)
    first, last = rows[1:1 + tenth] or rows[:tenth], rows[-tenth:]
    growth = {k: statistics.median(r[k] for r in last) - statistics.median(r[k] for r in first)
              for k in ("driver_rss_mb", "driver_open_files", "descendants", "descendants_rss_mb")}
    summary = {
        "evaluations": len(rows), "episodes_each": args.episodes,
        "complete": sum(r["complete"] for r in rows), "errors": sum(r["error"] is not None for r in rows),
        "worker_kills": len(kills), "wall_s": time.time() - t_start,
        "median_eval_s": statistics.median(r["seconds"] for r in rows),
        "growth_first_to_last_tenth": growth, "bounds": BOUNDS,
        "within_bounds": all(growth[k] <= v for k, v in BOUNDS.items()),
        "processes_left_after_shutdown": len(left),
        "orphaned_fork_servers": orphaned_fork_servers() - orphans_before,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg": os.getloadavg()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps({"summary": summary, "evaluations": rows, "kills": kills},
                                              indent=2) + "\n")
    g = growth
    md = [
        f"# Soak: {len(rows)} back-to-back evaluations, {len(kills)} worker SIGKILLs",
        "",
        f"{summary['date']}, {os.cpu_count()} cores, load average {summary['machine']['load_avg'][0]:.1f}; "
        f"`python -m bench.soak --evaluations {args.evaluations}`; {args.episodes} CartPole episodes "
        "each, `process` sandboxes, cache off, one `Evaluator` (one local cluster kept open).",
        "",
        "| figure | value | bound |",
        "|---|---:|---:|",
        f"| complete results (every episode once, coverage 1.0) | {summary['complete']} / "
        f"{len(rows)} | all |",
        f"| failed evaluations | {summary['errors']} | 0 |",
        f"| median evaluation wall time | {summary['median_eval_s']:.2f} s | |",
        f"| driver RSS growth, first to last tenth | {g['driver_rss_mb']:+.1f} MiB | "
        f"{BOUNDS['driver_rss_mb']:+.0f} MiB |",
        f"| driver open files growth | {g['driver_open_files']:+.0f} | {BOUNDS['driver_open_files']:+d} |",
        f"| descendant processes growth | {g['descendants']:+.0f} | {BOUNDS['descendants']:+d} |",
        f"| descendants' RSS growth | {g['descendants_rss_mb']:+.1f} MiB | |",
        f"| processes left after shutdown | {summary['processes_left_after_shutdown']} | 0 |",
        f"| fork servers orphaned to init | {summary['orphaned_fork_servers']} | 0 |",
        "",
    ]
    (out / "soak.md").write_text("\n".join(md))
    print("\n".join(md))
    ok = summary["within_bounds"] and summary["complete"] == len(rows) and not left
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
