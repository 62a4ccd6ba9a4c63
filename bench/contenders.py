"""The contenders: each way of evaluating one policy on one env for a number of episodes.

Every contender function runs inside a trial process (``python -m bench.trial``) and returns a dict with
at least ``env_steps``, ``episodes`` and ``mean_return``; the trial adds wall time, CPU time and
the peak RSS of the process tree around it. Exact contenders (the bare loop and evalfleet run
episode ``i`` with seed ``ledger(0, i)``) also return ``returns_sha``, a hash of the returns by
episode index, so the table can say whether two contenders computed the same numbers.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "evalfleet" / "data" / "cartpole_mlp.pt")

Act = Callable[[np.ndarray], np.ndarray]


# --------------------------------------------------------------------------------------- helpers


def ledger_seeds(n: int, base_seed: int = 0, start: int = 0) -> list[int]:
    """The seeds evalfleet gives episodes ``start .. start+n-1``."""
    from evalfleet.seeds import SeedLedger

    return [int(s) for s in SeedLedger(base_seed).seeds(range(start, start + n))]


def returns_sha(returns: np.ndarray) -> str:
    """A short hash of float64 returns in episode-index order."""
    return hashlib.sha256(np.ascontiguousarray(returns, dtype=np.float64).tobytes()).hexdigest()[:16]


def load_act(policy: str) -> Act:
    """The policy as ``float32 (B, *obs) -> int64 (B,)``, computed like evalfleet computes it."""
    if policy.endswith(".pt"):
        import torch

        module = torch.jit.load(policy, map_location="cpu")
        module.eval()

        def act(obs: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return np.asarray(module(torch.from_numpy(obs)).numpy().argmax(axis=1))

        return act
    module_name, name = policy.split(":")
    fn = getattr(importlib.import_module(module_name), name)
    return lambda obs: np.asarray(fn(obs))


def torch_module(policy: str) -> Any:
    """The TorchScript policy as an ``nn.Module`` mapping observations to greedy actions."""
    import torch

    inner = torch.jit.load(policy, map_location="cpu")
    inner.eval()

    class Greedy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.inner(obs).argmax(-1)

    return Greedy()


def make_env(env_id: str) -> Any:
    """``gym.make`` without the passive checker (evalfleet makes envs the same way)."""
    import gymnasium as gym

    if "/" in env_id and env_id.startswith("evalfleet/"):
        import envs  # noqa: F401  registers evalfleet's envs

    return gym.make(env_id, disable_env_checker=True)


def policy_variant(policy: str, k: int, folder: Path) -> str:
    """A copy of a TorchScript policy with other bytes (another sha256), same function.

    Warm evaluations use a new variant each time, as a training loop hands over new weights:
    no worker has the policy loaded yet.
    """
    if not policy.endswith(".pt"):
        return policy
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"variant-{k}.pt"
    if not path.exists():
        torch.jit.save(torch.jit.load(policy), str(path), _extra_files={"variant": str(k)})
    return str(path)


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, count)`` runs of ``n`` indices, as evalfleet's planner splits them."""
    out, start = [], 0
    for k in range(parts):
        count = n // parts + (1 if k < n % parts else 0)
        out.append((start, count))
        start += count
    return out


def _in_processes(procs: int, fn: Callable[[int, int], dict[str, Any]], n: int) -> dict[str, Any]:
    """Run ``fn(start, count)`` over ``procs`` forked processes holding contiguous index runs."""
    if procs == 1:
        return fn(0, n)
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with ctx.Pool(procs) as pool:
        parts = pool.starmap(fn, split(n, procs))
    rets = np.concatenate([np.asarray(p["returns"]) for p in parts])
    return {
        "returns": rets,
        "env_steps": sum(p["env_steps"] for p in parts),
        "episodes": sum(p["episodes"] for p in parts),
    }


def _summary(out: dict[str, Any], exact: bool) -> dict[str, Any]:
    rets = np.asarray(out.pop("returns"), dtype=np.float64)
    out["mean_return"] = float(rets.mean()) if len(rets) else float("nan")
    if exact:
        out["returns_sha"] = returns_sha(rets)
    return out


# ----------------------------------------------------------------------------- bare in-process


def _bare_part(env_id: str, policy: str, slots: int, start: int, count: int) -> dict[str, Any]:
    """Env instances stepped directly, one batched forward per step, exact seeds by index."""
    import torch

    torch.set_num_threads(1)
    act = load_act(policy)
    seeds = ledger_seeds(count, start=start)
    s_n = max(1, min(slots, count))
    made = [make_env(env_id) for _ in range(s_n)]
    limit = made[0].spec.max_episode_steps
    inner = [e.unwrapped for e in made]  # the TimeLimit is the counter below
    step = [e.step for e in inner]
    buf = np.zeros((s_n, *made[0].observation_space.shape), dtype=np.float32)
    returns = np.zeros(count)
    ep, ret, length = [0] * s_n, [0.0] * s_n, [0] * s_n
    env_steps, nxt, live = 0, 0, []
    for s in range(min(s_n, count)):
        obs, _ = inner[s].reset(seed=seeds[nxt])
        buf[s], ep[s] = obs, nxt
        nxt += 1
        live.append(s)
    while live:
        actions = act(buf if len(live) == s_n else buf[live]).tolist()
        still = []
        for k, s in enumerate(live):
            obs, reward, terminated, truncated, _ = step[s](actions[k])
            ret[s] += float(reward)
            length[s] += 1
            if terminated or truncated or length[s] >= limit:
                env_steps += length[s]
                returns[ep[s]] = ret[s]
                if nxt >= count:
                    continue
                obs, _ = inner[s].reset(seed=seeds[nxt])
                ep[s], ret[s], length[s] = nxt, 0.0, 0
                nxt += 1
            buf[s] = obs
            still.append(s)
        live = still
    for e in made:
        e.close()
    return {"returns": returns, "env_steps": env_steps, "episodes": count}


def bare(spec: dict[str, Any]) -> dict[str, Any]:
    """The per-core limit: a bare loop per process (``procs`` processes, contiguous halves)."""
    fn = partial(_bare_part, spec["env"], spec["policy"], spec["slots"])
    return _summary(_in_processes(spec.get("procs", 1), fn, spec["episodes"]), exact=True)


def _bare_vector_part(env_id: str, policy: str, slots: int, start: int, count: int
                      ) -> dict[str, Any]:
    """A native vector env with its own autoreset: the first ``count`` episodes to finish."""
    import gymnasium as gym
    import torch

    torch.set_num_threads(1)
    act = load_act(policy)
    env = gym.make_vec(env_id, num_envs=slots, vectorization_mode="vector_entry_point")
    obs, _ = env.reset(seed=start)
    finished: list[float] = []
    env_steps = 0
    prev_done = np.zeros(slots, dtype=bool)
    ret = np.zeros(slots)
    while len(finished) < count:
        obs, reward, terminated, truncated, _ = env.step(act(obs))
        real = ~prev_done  # NEXT_STEP autoreset: a row done last step was reset by this step
        env_steps += int(real.sum())
        ret += np.where(real, reward, 0.0)
        prev_done = terminated | truncated
        done = np.flatnonzero(prev_done)
        finished.extend(ret[done].tolist())
        ret[done] = 0.0
    env.close()
    return {"returns": np.asarray(finished[:count]), "env_steps": env_steps, "episodes": count}


def bare_vector(spec: dict[str, Any]) -> dict[str, Any]:
    """W2's limit: native vector env + one batched forward per step, per process."""
    fn = partial(_bare_vector_part, spec["env"], spec["policy"], spec["slots"])
    return _summary(_in_processes(spec.get("procs", 1), fn, spec["episodes"]), exact=False)


# ------------------------------------------------------------------------------------ the peers


class _Predictor:
    """SB3's ``PolicyPredictor`` protocol over a batch policy."""

    def __init__(self, act: Act) -> None:
        self.act = act

    def predict(self, observation: Any, state: Any = None, episode_start: Any = None,
                deterministic: bool = False) -> tuple[np.ndarray, None]:
        return self.act(np.asarray(observation, dtype=np.float32)), None


def sb3(spec: dict[str, Any]) -> dict[str, Any]:
    """SB3 ``evaluate_policy`` on a ``DummyVecEnv``/``SubprocVecEnv`` of ``n_envs`` envs."""
    import torch
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    act = load_act(spec["policy"])
    cls = SubprocVecEnv if spec.get("vec") == "subproc" else DummyVecEnv
    kwargs: dict[str, Any] = {"start_method": "fork"} if cls is SubprocVecEnv else {}
    vec = make_vec_env(partial(make_env, spec["env"]), n_envs=spec["n_envs"], seed=0,
                       vec_env_cls=cls, vec_env_kwargs=kwargs)
    setup = time.perf_counter() - t0
    rewards, lengths = evaluate_policy(_Predictor(act), vec, n_eval_episodes=spec["episodes"],
                                       deterministic=True, return_episode_rewards=True, warn=False)
    vec.close()
    out = {"returns": np.asarray(rewards, dtype=np.float64), "env_steps": int(np.sum(lengths)),
           "episodes": len(rewards), "setup_s": setup}
    return _summary(out, exact=False)


def torchrl(spec: dict[str, Any]) -> dict[str, Any]:
    """TorchRL's ``Evaluator`` (thread backend): first call (construction) and a second call."""
    import torch
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import Evaluator
    from torchrl.envs import GymEnv

    torch.set_num_threads(1)
    policy = TensorDictModule(torch_module(spec["policy"]), in_keys=["observation"],
                              out_keys=["action"])
    limit = make_env(spec["env"]).spec.max_episode_steps
    t0 = time.perf_counter()
    evaluator = Evaluator(
        lambda: GymEnv(spec["env"], categorical_action_encoding=True, disable_env_checker=True),
        policy, num_trajectories=spec["episodes"], max_steps=limit, backend="thread",
        collector_kwargs={"traj_format": "padded"},
    )
    first = evaluator.evaluate()
    first_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    second = evaluator.evaluate()
    second_s = time.perf_counter() - t1
    evaluator.shutdown()
    n = int(second["eval/num_episodes"])
    steps = int(round(float(second["eval/episode_length"]) * n))
    return {"env_steps": steps, "episodes": n, "mean_return": float(second["eval/reward"]),
            "first_call_s": first_s, "first_call_episodes": int(first["eval/num_episodes"]),
            "run_s": second_s, "rate_window": "second evaluate() call"}


def async_vector(spec: dict[str, Any]) -> dict[str, Any]:
    """gymnasium ``AsyncVectorEnv`` (one process per env) + one batched forward per step."""
    import gymnasium as gym
    import torch

    torch.set_num_threads(1)
    act = load_act(spec["policy"])
    k, count = spec["n_envs"], spec["episodes"]
    t0 = time.perf_counter()
    env = gym.vector.AsyncVectorEnv([partial(make_env, spec["env"]) for _ in range(k)],
                                    context="fork")
    obs, _ = env.reset(seed=0)
    setup = time.perf_counter() - t0
    finished: list[float] = []
    env_steps = 0
    prev_done = np.zeros(k, dtype=bool)
    ret = np.zeros(k)
    while len(finished) < count:
        obs, reward, terminated, truncated, _ = env.step(act(np.asarray(obs, dtype=np.float32)))
        real = ~prev_done
        env_steps += int(real.sum())
        ret += np.where(real, reward, 0.0)
        prev_done = terminated | truncated
        done = np.flatnonzero(prev_done)
        finished.extend(ret[done].tolist())
        ret[done] = 0.0
    env.close()
    out = {"returns": np.asarray(finished[:count]), "env_steps": env_steps, "episodes": count,
           "setup_s": setup}
    return _summary(out, exact=False)


# ------------------------------------------------------------------------------------ evalfleet


def evalfleet_core(spec: dict[str, Any]) -> dict[str, Any]:
    """evalfleet's worker-side hot path alone: load policy, open slots, ``run_shard``, table."""
    import torch

    from evalfleet.envspec import env_thunk, resolve_env
    from evalfleet.policy import load_policy, receive_policy
    from evalfleet.records import records_to_table
    from evalfleet.runner import EpisodeContext, run_shard
    from evalfleet.sandbox.base import InProcessSlots

    torch.set_num_threads(1)
    resolved = resolve_env(spec["env"], {}, None)
    art = receive_policy(spec["policy"], None, resolved.observation_space, resolved.action_space)
    t0 = time.perf_counter()
    policy = load_policy(art.format, art.payload, None, art.source, resolved.action_space)
    slots = InProcessSlots(env_thunk(spec["env"], {}, None), min(spec["slots"], spec["episodes"]),
                           native_vector=spec.get("native", False))
    seeds = ledger_seeds(spec["episodes"])
    ctx = EpisodeContext("bench", art.sha256, spec["env"], resolved.fingerprint.spec_hash, "core")
    try:
        records = run_shard(list(enumerate(seeds)), slots, policy, ctx)
    finally:
        slots.close()
    table = records_to_table(records).sort_by("episode_index")
    run_s = time.perf_counter() - t0
    rets = np.asarray(table.column("return").to_numpy(), dtype=np.float64)
    out = {"returns": rets, "env_steps": int(sum(r.length for r in records)),
           "episodes": len(records), "run_s": run_s,
           "failures": sum(r.end_reason not in ("terminated", "truncated") for r in records)}
    return _summary(out, exact=True)


def _request_fields() -> set[str]:
    from evalfleet.models import EvalRequest

    return set(EvalRequest.model_fields)


def _report_returns(report: Any) -> np.ndarray:
    import pyarrow.parquet as pq

    path = report.outputs.get("episodes")
    if not path or not os.path.exists(path):
        return np.asarray([], dtype=np.float64)
    table = pq.read_table(path, columns=["episode_index", "return"]).sort_by("episode_index")
    return np.asarray(table.column("return").to_numpy(), dtype=np.float64)


def evalfleet_flow(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Warm evaluations through ``flows.eval.evaluate``: Prefect API and a Dask cluster already up.

    Starts a LocalCluster (``workers`` processes) in this trial, runs an unmeasured warm-up
    evaluation with another policy variant, then each measured evaluation of ``spec["runs"]``
    (each with a fresh variant unless it asks for the original policy, e.g. to compare returns).
    Returns one result per run; ``bench.trial`` measures each run's window.
    """
    import dask
    from distributed import LocalCluster

    from bench.measure import window
    from evalfleet.models import EvalRequest

    os.environ["EVALFLEET_NATIVE_VECTOR"] = "1" if spec.get("native", False) else "0"
    from flows.eval import evaluate

    fields = _request_fields()
    work = Path(spec["workdir"])
    variants = work / "variants"
    server_pid = spec.get("server_pid")
    extra = [int(server_pid)] if server_pid else []

    def request(run: dict[str, Any], k: int, address: str) -> Any:
        policy = spec["policy"] if run.get("original_policy") else policy_variant(
            spec["policy"], k, variants)
        fields_in: dict[str, Any] = dict(
            env=spec["env"], policy=policy, episodes=run["episodes"],
            concurrency=run.get("concurrency", spec["concurrency"]),
            isolation=spec.get("isolation", "inprocess"), workers=spec["workers"],
            dask_address=address, device="cpu", output=work / "out", seed=0,
        )
        if spec.get("envs_per_sandbox", 1) != 1:
            if "envs_per_sandbox" not in fields:
                raise RuntimeError("this evalfleet build has no 'envs_per_sandbox' request field")
            fields_in["envs_per_sandbox"] = spec["envs_per_sandbox"]
        cache = run.get("cache", "off")
        if "cache" in fields:
            fields_in["cache"] = cache
            if "cache_dir" in fields:
                fields_in["cache_dir"] = work / run.get("cache_dir", "cache")
        elif cache != "off":
            raise RuntimeError("this evalfleet build has no result cache (EvalRequest has no "
                               "'cache' field)")
        return EvalRequest.build(**fields_in)

    results: list[dict[str, Any]] = []
    with dask.config.set({"distributed.worker.daemon": False}), LocalCluster(
        n_workers=spec["workers"], threads_per_worker=1, processes=True, dashboard_address=None,
    ) as cluster:
        address = cluster.scheduler_address
        t0 = time.perf_counter()
        warm = {"episodes": min(16, spec["runs"][0]["episodes"])}
        try:
            evaluate(request(warm, 10_000, address))
            warmup_s = time.perf_counter() - t0
        except Exception as err:
            return [{"ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
                    for _ in spec["runs"]]
        for k, run in enumerate(spec["runs"]):
            try:
                req = request(run, k, address)
                with window(extra_pids=extra) as w:
                    report = evaluate(req)
                rets = _report_returns(report) if run.get("original_policy") else None
                out: dict[str, Any] = {
                    "ok": True, "wall_s": w.wall_s, "cpu_s": w.cpu_s, "peak_rss": w.peak_rss,
                    "env_steps": int(report.env_steps), "episodes": int(report.episodes),
                    "mean_return": float(report.returns.get("mean", float("nan"))),
                    "failures": int(sum(report.failures.values())),
                    "cache": report.cache, "timings": report.timings,
                    "isolation": report.isolation, "warmup_s": warmup_s,
                    "policy_bytes_moved": _policy_bytes(req.policy) * spec["workers"],
                    "label": run.get("label", ""),
                }
                if rets is not None and len(rets):
                    out["returns_sha"] = returns_sha(rets)
            except Exception as err:
                out = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000],
                       "label": run.get("label", "")}
            results.append(out)
    return results


def _policy_bytes(policy: str) -> int:
    """Bytes evalfleet ships to each worker: the policy file (or a callable's module source)."""
    if os.path.exists(policy):
        return os.path.getsize(policy)
    from evalfleet.policy import module_source

    return len(module_source(policy))


def evalfleet_cli(spec: dict[str, Any]) -> dict[str, Any]:
    """A cold ``python flows/eval.py``: new interpreter, Prefect server, cluster (own subprocess)."""
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env["PREFECT_HOME"] = spec["prefect_home"]
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["EVALFLEET_DASHBOARD"] = ""
    out = spec["output"]
    cmd = [sys.executable, str(ROOT / "flows" / "eval.py"), "--episodes", str(spec["episodes"]),
           "--concurrency", str(spec["concurrency"]), "--output", out, "--quiet",
           "--device", "cpu", "--report", os.path.join(out, "last-report.json")]
    if spec.get("policy"):
        cmd += ["--policy", spec["policy"]]
    # Read off the source, not `--help`: a second interpreter start would count in the window.
    if "--no-cache" in (ROOT / "evalfleet" / "cli.py").read_text():
        cmd += ["--no-cache"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=spec.get("timeout_s", 300))
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
    import json

    report = json.loads(Path(out, "last-report.json").read_text())
    return {"env_steps": int(report["env_steps"]), "episodes": int(report["episodes"]),
            "mean_return": float(report["returns"].get("mean", float("nan"))),
            "timings": report.get("timings", {})}


#: Modules a contender imports, loaded before its measured window (their cost is ``imports_s``).
PREIMPORTS: dict[str, tuple[str, ...]] = {
    "bare": ("torch", "gymnasium", "evalfleet.seeds", "envs"),
    "bare_vector": ("torch", "gymnasium", "envs"),
    "sb3": ("torch", "gymnasium", "envs", "stable_baselines3.common.evaluation",
            "stable_baselines3.common.env_util"),
    "torchrl": ("torch", "gymnasium", "tensordict.nn", "torchrl.collectors", "torchrl.envs"),
    "async_vector": ("torch", "gymnasium", "envs"),
    "evalfleet_core": ("torch", "gymnasium", "envs", "pandas", "evalfleet.runner",
                       "evalfleet.policy", "evalfleet.records", "evalfleet.envspec"),
    "evalfleet_flow": (),
    "evalfleet_cli": (),
}


def preimport(contender: str) -> None:
    """Import what ``contender`` needs and give torch one thread (each process uses one core)."""
    for name in PREIMPORTS.get(contender, ()):
        importlib.import_module(name)
    if "torch" in PREIMPORTS.get(contender, ()):
        import torch

        torch.set_num_threads(1)


CONTENDERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "bare": bare,
    "bare_vector": bare_vector,
    "sb3": sb3,
    "torchrl": torchrl,
    "async_vector": async_vector,
    "evalfleet_core": evalfleet_core,
    "evalfleet_flow": evalfleet_flow,
    "evalfleet_cli": evalfleet_cli,
}

__all__ = ["CONTENDERS", "MLP", "ROOT", "ledger_seeds", "preimport", "returns_sha", "split"]
