"""Reproduce evalfleet's benchmark table: ``python -m bench.run`` (``--quick`` for the smoke run).

Run it from the repository root. Every contender runs in a fresh process per trial
(``python -m bench.trial``); the contenders of a
repetition run one after the other, in an order rotated per repetition, and every ratio is taken
inside one repetition, then the median over repetitions is reported. Absolute times on a shared
machine drift; ratios measured side by side do not drift as much.

Outputs (``--out``, default ``bench/results``): ``bench-<date>.json`` (every trial, the summary and
the targets), ``latest.json``, ``table.md`` (the README table) and ``throughput.png`` (throughput
against concurrency).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import plan as planning
from bench import report
from bench.contenders import CONTENDERS
from bench.trial import MARK

ROOT = Path(__file__).resolve().parents[1]

TRIAL = "bench.trial"  # run as a module from ROOT, like this one


#: Spec keys that only say where this run keeps its files and servers (left out of the JSON).
_RUN_KEYS = ("workdir", "api_url", "server_pid", "prefect_home", "output", "runs")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def prefect_server(home: Path) -> Iterator[tuple[str, int]]:
    """A ``prefect server start`` for the warm evaluations: (API URL, pid)."""
    import httpx

    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_API_URL=url)
    logf = open(home / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
         str(port)], env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not start: "
                                   f"{(home / 'server.log').read_text()[-1500:]}")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the bench process dies, however it dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_trial(spec: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """One trial process; its result(s), or the exact error it ended with."""
    try:
        proc = subprocess.run([sys.executable, "-m", TRIAL, json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout_s, cwd=ROOT, preexec_fn=_die_with_parent)
    except subprocess.TimeoutExpired:
        return [{"ok": False, "error": f"timed out after {timeout_s:.0f} s"}]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if not lines:
        tail = (proc.stderr or proc.stdout)[-1500:]
        return [{"ok": False, "error": f"trial exited {proc.returncode} without a result: {tail}"}]
    result = json.loads(lines[-1][len(MARK):])
    return result if isinstance(result, list) else [result]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("evalfleet", "torch", "gymnasium", "numpy", "prefect", "dask", "distributed",
                 "stable-baselines3", "torchrl", "tensordict"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    bwrap = shutil.which("bwrap")
    if bwrap:
        try:
            out["bwrap"] = subprocess.run([bwrap, "--version"], capture_output=True, text=True,
                                          timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            out["bwrap"] = "unknown"
    return out


def machine() -> dict[str, Any]:
    import psutil

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total
                                                                      / 2**30, 1),
            "os": f"{platform.system()} {platform.release()}", "gpu": "none used (CPU only)",
            "load_avg_at_start": list(os.getloadavg())}


def has_module(name: str) -> str | None:
    """None when ``name`` imports, else the exact error."""
    proc = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                          cwd=ROOT)
    if proc.returncode == 0:
        return None
    return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"


def sweep_cases(quick: bool) -> list[dict[str, Any]]:
    """Throughput against concurrency (the plot): one trial per point."""
    from bench.contenders import MLP

    points: list[dict[str, Any]] = []
    slots = (1, 8, 64) if quick else (1, 4, 16, 64, 256, 1024)
    for s in slots:
        eps = max(16, 2 * s) if quick else max(64, 2 * s)
        base = {"env": "CartPole-v1", "policy": MLP, "episodes": eps, "slots": s}
        points += [
            {"series": "bare loop (instances)", "x": s, "spec": {**base, "contender": "bare"}},
            {"series": "evalfleet core (instances)", "x": s,
             "spec": {**base, "contender": "evalfleet_core", "native": False}},
            {"series": "evalfleet core (native vector)", "x": s,
             "spec": {**base, "contender": "evalfleet_core", "native": True}},
            {"series": "bare native vector", "x": s, "spec": {**base, "contender": "bare_vector"}},
        ]
        if s <= 256:  # SB3 steps its envs in a Python loop: wider is only slower
            points.append({"series": "SB3 DummyVecEnv", "x": s,
                           "spec": {**base, "contender": "sb3", "vec": "dummy", "n_envs": s}})
    for k in ((2,) if quick else (2, 4, 8, 16)):
        eps = 8 if quick else 64
        base = {"env": "CartPole-v1", "policy": MLP, "episodes": eps, "slots": k}
        points.append({"series": "AsyncVectorEnv (a process per env)", "x": k,
                       "spec": {**base, "contender": "async_vector", "n_envs": k}})
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: a few episodes, one repetition")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    p.add_argument("--only", default="", help="comma-separated workloads, e.g. W1-2k,W4")
    p.add_argument("--no-flow", action="store_true", help="skip the Prefect flow contenders")
    p.add_argument("--no-torchrl", action="store_true", help="skip TorchRL (its import takes ~7 s)")
    p.add_argument("--no-sweep", action="store_true", help="skip the concurrency sweep (plot)")
    p.add_argument("--contenders", default="",
                   help="comma-separated contender kinds to keep, e.g. bare,evalfleet_core "
                   f"(kinds: {', '.join(CONTENDERS)})")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per trial")
    args = p.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanups on a kill
    reps = args.reps or (1 if args.quick else 3)
    kinds = {s.strip() for s in args.contenders.split(",") if s.strip()}
    unknown = kinds - set(CONTENDERS)
    if unknown:
        p.error(f"unknown contender kind(s) {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    out_dir = Path(args.out)
    # Scratch space (Prefect home, results of the evaluations, policy variants): outside the repo.
    work = Path(tempfile.mkdtemp(prefix="evalfleet-bench-"))
    started = dt.datetime.now(dt.UTC)
    missing = {name: err for name in ("stable_baselines3", "torchrl")
               if (err := has_module(name)) is not None}
    with_flow = not args.no_flow
    with_torchrl = not args.no_torchrl and "torchrl" not in missing
    meta = {"date": started.strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "versions": versions(), "reps": reps, "quick": args.quick,
            "command": "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])}
    log(f"{meta['machine']['cpu']}, {meta['machine']['cores']} cores; reps={reps}")
    trials: list[dict[str, Any]] = []

    def execute(case: planning.Case, rep: int, extra: dict[str, Any]) -> None:
        spec = {**case.spec, **extra}
        mod = {"sb3": "stable_baselines3", "torchrl": "torchrl"}.get(spec["contender"])
        if mod in missing:
            results: list[dict[str, Any]] = [
                {"ok": False, "error": f"not installed: {missing[mod]}"}]
        else:
            t0 = time.perf_counter()
            load0 = os.getloadavg()[0]
            results = run_trial(spec, args.timeout)
            for res in results:
                res.setdefault("load_avg", [round(load0, 2), round(os.getloadavg()[0], 2)])
            log(f"rep {rep} {case.key}: {time.perf_counter() - t0:.1f} s"
                + ("" if all(r.get("ok") for r in results)
                   else f" ERROR {results[0].get('error', '')[:200]}"))
        labels = case.labels or [case.label]
        shown = {k: v for k, v in spec.items() if k not in _RUN_KEYS}
        for k, res in enumerate(results):
            label = res.get("label") or (labels[k] if k < len(labels) else case.label)
            trials.append({"case": f"{case.workload}/{label}", "workload": case.workload,
                           "label": label, "group": case.group, "cores": case.cores,
                           "note": case.note, "rep": rep, "spec": shown, **res})

    server = prefect_server(work / "prefect-home") if with_flow else None
    with server if server is not None else _null() as srv:
        extra: dict[str, Any] = {"workdir": str(work)}
        if srv is not None:
            extra.update(api_url=srv[0], server_pid=srv[1])
        cli_home = work / "cli-prefect-home"
        extra.update(prefect_home=str(cli_home), output=str(work / "cli-out"))
        all_cases = planning.cases(args.quick, with_flow=with_flow, with_torchrl=with_torchrl,
                                   only=only)
        if kinds:
            all_cases = [c for c in all_cases if c.spec["contender"] in kinds]
        if with_flow and any(c.spec["contender"] == "evalfleet_cli" for c in all_cases):
            log("priming the cold CLI (first run creates the Prefect database)")
            first = planning.Case("W4/first", "W4", "evalfleet cold CLI, first run on a new "
                                  "Prefect home", "evalfleet",
                                  {"contender": "evalfleet_cli", "episodes": 8, "concurrency": 8},
                                  2, "creates the Prefect database and the MLflow store")
            execute(first, 0, extra)
        for rep in range(reps):
            # Rotate the order per repetition; the first keeps the plan's order so that the
            # SB3 settings of W1-2k are measured before W1-20k picks the best of them.
            if rep == 1:  # SB3 settings > 3× slower than its best: measured once, not repeated
                all_cases = [c for c in all_cases if not _sb3_far_from_best(c, trials)]
            shift = rep % max(1, len(all_cases))
            for case in all_cases[shift:] + all_cases[:shift]:
                spec_extra = dict(extra)
                if str(case.spec.get("vec", "")).startswith("best-of:"):
                    vec, n = report.best_sb3(trials).get(
                        case.spec["vec"].split(":", 1)[1], ("dummy", 16))
                    spec_extra.update(vec=vec, n_envs=n)
                execute(case, rep, spec_extra)
        sweep: list[dict[str, Any]] = []
        if not args.no_sweep:
            for point in sweep_cases(args.quick):
                mod = "stable_baselines3" if point["spec"]["contender"] == "sb3" else None
                if mod in missing or (kinds and point["spec"]["contender"] not in kinds):
                    continue
                res = run_trial({**point["spec"], **extra}, args.timeout)[0]
                log(f"sweep {point['series']} x={point['x']}: "
                    + (f"{res['env_steps'] / res['wall_s']:.0f} steps/s" if res.get("ok")
                       else f"ERROR {res.get('error', '')[:160]}"))
                sweep.append({"series": point["series"], "x": point["x"], **res})

    summary = report.summarize(trials)
    targets = report.targets(summary, trials, quick=args.quick)
    result = {"meta": meta, "trials": trials, "sweep": sweep, "summary": summary,
              "targets": targets, "missing": missing}
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%d-%H%M")
    name = f"bench-{'quick-' if args.quick else ''}{stamp}.json"
    (out_dir / name).write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out_dir / ("latest-quick.json" if args.quick else "latest.json")).write_text(
        json.dumps(result, indent=1, default=str) + "\n")
    table = report.markdown(result)
    (out_dir / ("table-quick.md" if args.quick else "table.md")).write_text(table)
    if sweep:
        report.plot(sweep, out_dir / ("throughput-quick.png" if args.quick else "throughput.png"),
                    meta)
    shutil.rmtree(work, ignore_errors=True)
    print(table)
    log(f"wrote {out_dir / name}")
    return 0


def _sb3_far_from_best(case: planning.Case, trials: list[dict[str, Any]]) -> bool:
    if case.spec["contender"] != "sb3" or str(case.spec.get("vec", "")).startswith("best-of"):
        return False
    rates = {(t["spec"].get("vec"), t["spec"].get("n_envs")): report.rate(t) for t in trials
             if t["workload"] == case.workload and t["spec"].get("contender") == "sb3"}
    mine = rates.get((case.spec["vec"], case.spec["n_envs"]))
    best = max((r for r in rates.values() if r), default=None)
    return bool(mine and best and mine * 3 < best)


@contextmanager
def _null() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    raise SystemExit(main())
