"""Measure sandbox start cost and CartPole env steps/s per isolation level.

    python -m tests.sandbox.bench_sandbox [--slots 64] [--episodes 256] [--envs-per-sandbox 1]

Runs ``run_shard`` in this process (no Dask) with a linear balancing policy, so the figures are
the runner + sandbox cost alone.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gymnasium import spaces

from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.policy import LoadedPolicy
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox import open_slots
from evalfleet.sandbox.forkclient import fork_server, shutdown_fork_servers
from evalfleet.seeds import SeedLedger

W = np.array([0.0, -0.1, 1.0, 0.1], dtype=np.float32)


def linear_policy(obs: np.ndarray) -> np.ndarray:
    return (obs @ W > 0).astype(np.int64)


def run(level: str, slots: int, episodes: int, k: int) -> dict[str, float]:
    env_id = "CartPole-v1"
    resolved = resolve_env(env_id, {}, None)
    policy = LoadedPolicy(linear_policy, spaces.Discrete(2), is_torch=False, deterministic=True,
                          device="cpu")
    ctx = EpisodeContext("bench", "0" * 64, env_id, resolved.fingerprint.spec_hash, "bench")
    seeds = SeedLedger(0).seeds(range(episodes))
    work = [(i, int(s)) for i, s in enumerate(seeds)]
    box = open_slots(level, env_thunk(env_id, {}, None), slots, episode_timeout_s=600,
                     env_spec=resolved.fingerprint.as_dict(), envs_per_sandbox=k)
    t0 = time.perf_counter()
    try:
        # First reset of every slot = sandbox start (fork server warm after the first level run).
        box.reset_many([(s, 0) for s in range(slots)])
        start = time.perf_counter() - t0
        t1 = time.perf_counter()
        records = run_shard(work, box, policy, ctx)
        wall = time.perf_counter() - t1
    finally:
        box.close()
    steps = sum(r.length for r in records)
    return {"start_s_per_sandbox": start / max(1, -(-slots // k)), "steps": steps,
            "steps_per_s": steps / wall, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--envs-per-sandbox", type=int, default=1)
    p.add_argument("--levels", default="inprocess,process,bwrap")
    args = p.parse_args()
    base = None
    for level in args.levels.split(","):
        if level != "inprocess":
            run(level, 2, 2, 1)  # warm the fork server: its start is a once-per-worker cost
            print(f"{level:9s} fork server start {fork_server(level, 60).start_seconds:.2f} s")
        out = run(level, args.slots, args.episodes, args.envs_per_sandbox)
        base = base or (out["steps_per_s"] if level == "inprocess" else None)
        ratio = f"{out['steps_per_s'] / base:.3f}" if base else "-"
        print(f"{level:9s} start {out['start_s_per_sandbox'] * 1000:7.2f} ms/sandbox  "
              f"{out['steps_per_s']:10.0f} steps/s  ratio {ratio}  ({out['steps']} steps, "
              f"{out['wall_s']:.2f} s)")
    shutdown_fork_servers()


if __name__ == "__main__":
    main()
