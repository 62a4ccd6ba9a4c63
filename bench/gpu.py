"""The GPU path, checked end to end on a machine with an NVIDIA GPU: ``python -m bench.gpu``.

Each check runs the real thing (the CLI as a whole process, a real external Dask cluster, the
in-loop ``Evaluator``) and records what it saw; a check that does not hold is listed under
``failed`` and the exit status is 1. In this order:

1. ``--device cuda``, ``cpu`` and ``auto`` through ``python flows/eval.py`` on the local cluster:
   where inference ran (``manifest.execution``), alarms, and the episodes of CUDA against CPU
   (kernels round differently, so an argmax may flip; how many returns differ is recorded);
2. refusals in stage 1, exit 2: a CUDA index the machine lacks, a callable policy on CUDA;
3. a mixed external cluster (``dask scheduler``, one worker with ``--resources GPU=1``, one
   without): ``--device cuda`` and ``auto`` must run every episode on the GPU worker, and the
   same request again with ``--isolation process`` (sandboxes started by a CUDA-using worker);
4. the in-loop ``Evaluator`` with ``device='cuda'`` and the model on the GPU: new weights each
   call, trigger-to-result seconds;
5. logits that are NaN on CUDA end those episodes as the policy's error, and the in-loop
   ``Evaluator``'s snapshot of a CUDA module carries its state outside the state_dict;
6. the placement and cache-key tests, which take the GPU branches there.

Results: ``gpu.json`` and ``gpu.md`` in ``--output`` (``bench/results`` by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
POLICY = str(ROOT / "evalfleet" / "data" / "cartpole_mlp.pt")
CALLABLE = "tests.sandbox.faulty_envs:balance"
EPISODES = "64"


def _cli(*args: str, timeout: float = 150) -> dict[str, Any]:
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(  # the callable policy's module is in tests/
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, "flows/eval.py", "--quiet", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    found: dict[str, Any] = {"rc": done.returncode, "wall_s": round(time.perf_counter() - t0, 2)}
    if done.returncode:
        found["stderr"] = done.stderr.strip()[-1500:]
    return found


def _evaluation(folder: Path, *args: str) -> dict[str, Any]:
    """Run one evaluation; what its report and episode table say."""
    import pyarrow.parquet as pq

    report_path = folder / "report.json"
    found = _cli("--policy", POLICY, "--episodes", EPISODES, "--seed", "7", "--output",
                 str(folder), "--report", str(report_path), "--no-cache", *args)
    if found["rc"] or not report_path.exists():
        return found
    report = json.loads(report_path.read_text())
    execution = report["manifest"]["execution"]
    table = pq.read_table(report["outputs"]["episodes"]).to_pydict()
    workers: dict[str, int] = {}
    for name in table["worker"]:
        workers[name] = workers.get(name, 0) + 1
    found.update(
        device=execution["device"], device_requested=execution["device_requested"],
        device_fallback=execution["device_fallback"], alarms=report["alarms"],
        completed=report["completed"], mean=report["returns"]["mean"],
        timings={k: round(v, 2) for k, v in report["timings"].items()},
        workers=workers, returns=dict(zip(table["episode_index"], table["return"], strict=True)),
    )
    return found


def _returns_apart(a: dict[str, Any], b: dict[str, Any]) -> int:
    ra, rb = a.get("returns", {}), b.get("returns", {})
    return sum(1 for k in ra if k not in rb or abs(ra[k] - rb[k]) > 1e-6 * max(1.0, abs(ra[k])))


class _External:
    """A scheduler and two workers, one offering ``GPU=1``, as separate processes."""

    def __enter__(self) -> str:
        self.dir = tempfile.mkdtemp(prefix="evalfleet-gpu-")
        file = os.path.join(self.dir, "scheduler.json")
        dask = [sys.executable, "-m", "dask"]
        self.procs = [subprocess.Popen([*dask, "scheduler", "--host", "127.0.0.1", "--port", "0",
                                        "--dashboard-address", ":0", "--scheduler-file", file],
                                       cwd=self.dir, stderr=subprocess.DEVNULL)]
        while not os.path.exists(file):
            time.sleep(0.2)
        time.sleep(0.5)
        for name, extra in (("gpu-worker", ["--resources", "GPU=1"]), ("cpu-worker", [])):
            self.procs.append(subprocess.Popen(
                [*dask, "worker", "--scheduler-file", file, "--nthreads", "1", "--name", name,
                 "--dashboard-address", ":0", *extra],
                cwd=self.dir, stderr=subprocess.DEVNULL))
        address = json.loads(Path(file).read_text())["address"]
        from distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
        return str(address)

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            proc.wait(timeout=30)


def warm_evaluator(out: Path, calls: int = 5) -> dict[str, Any]:
    """8 episodes from the in-loop ``Evaluator`` with inference on CUDA, model on the GPU."""
    import torch

    from bench.speed import _mlp
    from evalfleet.client import Evaluator

    torch.manual_seed(0)
    model = _mlp().to("cuda")
    seconds, devices = [], []
    with Evaluator(env="CartPole-v1", num_episodes=8, concurrency=8, output=out,
                   device="cuda") as ev:
        first = ev.evaluate(model, step=0)
        for i in range(1, calls + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * i)
            ev.flush()
            t0 = time.perf_counter()
            r = ev.evaluate(model, step=i)
            seconds.append(time.perf_counter() - t0)
            devices.append(r["report"].manifest["execution"]["device"])
    return {"first_device": first["report"].manifest["execution"]["device"],
            "devices": devices, "new_weights_s": [round(s, 3) for s in seconds],
            "new_weights_median_s": round(statistics.median(seconds), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    import torch

    from evalfleet.cluster import gpu_count

    found: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"torch": torch.__version__, "python": sys.version.split()[0],
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    "gpu_count": gpu_count(), "cpus": os.cpu_count()},
        "checks": {}, "failed": []}

    def check(name: str, run: Callable[[], dict[str, Any]],
              holds: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        try:
            seen = run()
        except Exception as err:  # a check that breaks is a failed check, and the rest still run
            seen = {"error": f"{type(err).__name__}: {err}"}
        ok = "error" not in seen and holds(seen)
        found["checks"][name] = {"ok": ok, **{k: v for k, v in seen.items() if k != "returns"}}
        if not ok:
            found["failed"].append(name)
        print(f"{'ok  ' if ok else 'FAIL'} {name}: "
              f"{ {k: v for k, v in seen.items() if k not in ('returns', 'timings')} }", flush=True)
        (args.output / "gpu.json").write_text(json.dumps(found, indent=2) + "\n")
        return seen

    with tempfile.TemporaryDirectory(prefix="evalfleet-gpu-") as tmp:
        work = Path(tmp)
        on = {d: check(f"local cluster, --device {d}", lambda d=d: _evaluation(work / d, "--device", d),
                       lambda s, d=d: s["rc"] == 0 and s["alarms"] == [] and s["completed"] == 64
                       and s["device"] == ("cpu" if d == "cpu" else "cuda"))
              for d in ("cuda", "cpu", "auto")}
        check("CUDA against CPU episodes", lambda: {
            "returns_apart": _returns_apart(on["cuda"], on["cpu"]),
            "mean_cuda": on["cuda"].get("mean"), "mean_cpu": on["cpu"].get("mean")},
            lambda s: s["mean_cuda"] is not None and s["returns_apart"] <= 2)
        check("--device cuda:7 refused", lambda: _cli("--policy", POLICY, "--device", "cuda:7",
                                                        "--output", str(work / "x")),
              lambda s: s["rc"] == 2 and "only 1 CUDA device(s)" in s["stderr"])
        check("callable policy on cuda refused", lambda: _cli(
            "--policy", CALLABLE, "--device", "cuda", "--output", str(work / "x")),
              lambda s: s["rc"] == 2 and "is a callable" in s["stderr"])
        with _External() as address:
            for extra in ((), ("--isolation", "process")):
                for d in ("cuda", "auto"):
                    name = f"mixed external cluster, --device {d} {' '.join(extra)}".strip()
                    check(name, lambda d=d, extra=extra: _evaluation(
                        work / f"ext-{d}-{len(extra)}", "--device", d, "--dask-address", address,
                        *extra), lambda s: s["rc"] == 0 and s["device"] == "cuda"
                          and s["workers"] == {"gpu-worker": 64} and s["alarms"] == [])
        check("in-loop Evaluator, device='cuda'", lambda: warm_evaluator(work / "warm"),
              lambda s: s["first_device"] == "cuda" and set(s["devices"]) == {"cuda"})
        check("NaN logits from a policy on CUDA end as policy_error", nan_logits_on_cuda,
              lambda s: s["device"] == "cuda" and s["end_reasons"].get("policy_error", 0) > 0
              and set(s["end_reasons"]) <= {"policy_error", "terminated", "truncated"}
              and s["error_kinds"] == ["ValueError"])
        check("Evaluator snapshot of a CUDA module, state outside its state_dict",
              cuda_snapshot_extras, lambda s: max(s["max_abs_apart"]) < 1e-5)
        check("placement and cache-key tests", lambda: _cli_pytest(), lambda s: s["rc"] == 0)
    (args.output / "gpu.json").write_text(json.dumps(found, indent=2) + "\n")
    (args.output / "gpu.md").write_text(markdown(found))
    return 1 if found["failed"] else 0


def nan_logits_on_cuda() -> dict[str, Any]:
    """A TorchScript policy on CUDA whose logits turn NaN when the cart is far right: those
    episodes end as ``policy_error`` with their partial return; the others run to their end."""
    import io

    import torch

    from evalfleet.envspec import env_thunk, resolve_env
    from evalfleet.policy import load_policy
    from evalfleet.records import records_to_table
    from evalfleet.runner import EpisodeContext, run_shard
    from evalfleet.sandbox.base import InProcessSlots
    from evalfleet.seeds import SeedLedger

    class Poisoned(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = torch.stack([torch.zeros_like(x[:, 2]), x[:, 2]], dim=1)
            far = (x[:, 0] > 0.22).unsqueeze(1).expand_as(logits)
            return torch.where(far, torch.full_like(logits, float("nan")), logits)

    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(Poisoned()), buf)
    space = resolve_env("CartPole-v1", {}, None).action_space
    policy = load_policy("torchscript", buf.getvalue(), None, "poisoned.pt", space, device="cuda")
    ledger = SeedLedger(0)
    slots = InProcessSlots(env_thunk("CartPole-v1", {}, None), 6)
    try:
        rows = records_to_table(run_shard([(i, ledger.seed(i)) for i in range(24)], slots, policy,
                                          EpisodeContext("r", "s", "CartPole-v1", "h", "w"))
                                ).to_pylist()
    finally:
        slots.close()
    reasons: dict[str, int] = {}
    for row in rows:
        reasons[row["end_reason"]] = reasons.get(row["end_reason"], 0) + 1
    errors = {row["error"].split(":")[0] for row in rows if row["end_reason"] == "policy_error"}
    return {"device": policy.device, "end_reasons": reasons, "error_kinds": sorted(errors)}


def cuda_snapshot_extras() -> dict[str, Any]:
    """The Evaluator's snapshot of a CUDA module whose normaliser mean is a plain tensor changed
    by training: each written policy computes what the module computed at its trigger."""
    import torch

    from evalfleet.snapshots import PolicyWriter, snapshot_weights

    class Normalised(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)
            self.mean = torch.zeros(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x - self.mean)

    module = Normalised().cuda()
    module.mean = module.mean.cuda()
    x = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    apart = []
    with tempfile.TemporaryDirectory() as tmp:
        writer = PolicyWriter(Path(tmp), None)
        for mean in (0.0, 0.5, -1.0):
            module.mean = torch.full((4,), mean, device="cuda")
            with torch.no_grad():
                want = module(x.cuda()).cpu()
                got = torch.jit.load(str(writer.write(snapshot_weights(module))))(x)
            apart.append(float((got - want).abs().max()))
    return {"max_abs_apart": apart}


def _cli_pytest() -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/core/test_placement.py", "tests/core/test_cache_key.py", "-k",
                           "placement or cuda or gpu or device or callable"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    return {"rc": done.returncode, "summary": done.stdout.strip().splitlines()[-1:]}


def markdown(found: dict[str, Any]) -> str:
    """The checks as a table (``gpu.md``)."""
    m = found["machine"]
    lines = [f"# GPU checks, {found['when']}", "",
             f"{m['gpu']} ({m['gpu_count']} visible), {m['cpus']} cores, torch {m['torch']}, "
             f"Python {m['python']}.", "", "| check | holds | seen |", "|---|:---:|---|"]
    for name, seen in found["checks"].items():
        shown = {k: v for k, v in seen.items() if k not in ("ok", "returns", "stderr")}
        lines.append(f"| {name} | {'yes' if seen['ok'] else '**no**'} | "
                     f"{json.dumps(shown).replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
