"""What the bench runs: workloads, and the contender cases of each, for the full and quick runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.contenders import MLP

INVENTORY_POLICY = "envs.reference_policies:inventory_heuristic"


@dataclass(frozen=True)
class Workload:
    """One row group of the table."""

    key: str
    title: str
    env: str
    policy: str
    episodes: int
    slots: int  # env instances per core (bare loop) = per worker (evalfleet)


@dataclass
class Case:
    """One contender configuration on one workload; run once per repetition."""

    key: str  # unique: "<workload>/<contender label>"
    workload: str
    label: str  # as shown in the table
    group: str  # bare | peer | evalfleet
    spec: dict[str, Any]
    cores: int = 1
    note: str = ""
    labels: list[str] = field(default_factory=list)  # evalfleet_flow: one per measured run


SB3_SETTINGS = (("dummy", 1), ("dummy", 16), ("dummy", 64), ("dummy", 256), ("subproc", 2))


def workloads(quick: bool) -> dict[str, Workload]:
    """W1–W4 at full size, or a few episodes each for the smoke run."""
    if quick:
        return {
            "W1-2k": Workload("W1-2k", "W1 CartPole-v1, MLP (smoke size)", "CartPole-v1", MLP, 24, 8),
            "W1-iso": Workload("W1-iso", "W1 CartPole-v1, isolation (smoke size)", "CartPole-v1", MLP,
                               8, 2),
            "W2-20k": Workload("W2-20k", "W2 CartPole-v1 native vector (smoke size)", "CartPole-v1",
                               MLP, 64, 64),
            "W3-2k": Workload("W3-2k", "W3 Inventory-v0, heuristic (smoke size)",
                              "evalfleet/Inventory-v0", INVENTORY_POLICY, 24, 8),
            "W4": Workload("W4", "W4 small evaluations", "CartPole-v1", MLP, 8, 8),
        }
    return {
        "W1-2k": Workload("W1-2k", "W1 CartPole-v1, MLP 4-64-64-2, 2,000 episodes", "CartPole-v1",
                          MLP, 2000, 256),
        "W1-20k": Workload("W1-20k", "W1 CartPole-v1, MLP 4-64-64-2, 20,000 episodes",
                           "CartPole-v1", MLP, 20000, 256),
        "W1-iso": Workload("W1-iso", "W1 CartPole-v1, MLP, 400 episodes on 16 envs: isolation",
                           "CartPole-v1", MLP, 400, 16),
        "W2-20k": Workload("W2-20k", "W2 CartPole-v1 native vector env, MLP, 20,000 episodes",
                           "CartPole-v1", MLP, 20000, 4096),
        "W3-2k": Workload("W3-2k", "W3 evalfleet/Inventory-v0, inventory_heuristic, 2,000 episodes",
                          "evalfleet/Inventory-v0", INVENTORY_POLICY, 2000, 256),
        "W4": Workload("W4", "W4 small evaluations (8 and 64 episodes): fixed overhead",
                       "CartPole-v1", MLP, 8, 64),
    }


def _base(w: Workload, **extra: Any) -> dict[str, Any]:
    return {"env": w.env, "policy": w.policy, "episodes": w.episodes, "slots": w.slots, **extra}


def cases(quick: bool, *, with_flow: bool, with_torchrl: bool, only: set[str] | None = None
          ) -> list[Case]:
    """The cases to run, in the order of the first repetition."""
    ws = workloads(quick)
    out: list[Case] = []

    def add(w: Workload, label: str, group: str, spec: dict[str, Any], cores: int = 1,
            note: str = "", labels: list[str] | None = None) -> None:
        if only is None or w.key in only:
            out.append(Case(f"{w.key}/{label}", w.key, label, group, spec, cores, note, labels or []))

    def sb3_cases(w: Workload, settings: tuple[tuple[str, int], ...]) -> None:
        for vec, n in settings:
            add(w, f"SB3 evaluate_policy {vec} n={n}", "peer",
                _base(w, contender="sb3", vec=vec, n_envs=n), cores=2 if vec == "subproc" else 1)

    def flow(w: Workload, label: str, workers: int, concurrency: int, *, isolation: str = "inprocess",
             native: bool = False, runs: list[dict[str, Any]] | None = None, note: str = "",
             envs_per_sandbox: int = 1) -> None:
        if not with_flow:
            return
        runs = runs or [{"episodes": w.episodes, "original_policy": True, "label": label}]
        add(w, label, "evalfleet", _base(w, contender="evalfleet_flow", workers=workers,
                                          concurrency=concurrency, isolation=isolation,
                                          native=native, runs=runs,
                                          envs_per_sandbox=envs_per_sandbox),
            cores=workers, note=note, labels=[r.get("label", label) for r in runs])

    # W1: CartPole instances. evalfleet runs env instances here (EVALFLEET_NATIVE_VECTOR=0): the
    # same work as the bare loop; its default on CartPole (native vector) is the W2 figure.
    for key in ("W1-2k", "W1-20k"):
        if key not in ws:
            continue
        w = ws[key]
        add(w, "bare loop ×1 core", "bare", _base(w, contender="bare"))
        add(w, "bare loop ×2 processes", "bare", _base(w, contender="bare", procs=2), cores=2)
        small = key == "W1-2k"
        if small:
            sb3_cases(w, SB3_SETTINGS)
        else:  # the setting that was fastest on W1-2k in this run, resolved when it runs
            add(w, "SB3 evaluate_policy, best setting of W1-2k", "peer",
                _base(w, contender="sb3", vec="best-of:W1-2k", n_envs=0))
        if small and with_torchrl:
            add(w, "TorchRL Evaluator (thread)", "peer",
                _base(w, contender="torchrl", episodes=8 if quick else 20),
                note="TorchRL: rate of a 2nd evaluate() call over 20 episodes (the first call "
                "builds the collector)")
        add(w, "evalfleet core (run_shard, 1 process)", "evalfleet",
            _base(w, contender="evalfleet_core", native=False))
        flow(w, "evalfleet inprocess, 1 worker", 1, w.slots)
        flow(w, "evalfleet inprocess, 2 workers", 2, 2 * w.slots)

    # Isolation at equal env count: 16 envs in all (16 sandbox processes / 16 AsyncVectorEnv
    # processes), fewer episodes: process-per-env contenders are an order of magnitude slower.
    if "W1-iso" in ws:
        w = ws["W1-iso"]
        add(w, f"bare loop ×1 core, {w.slots} envs", "bare", _base(w, contender="bare"))
        add(w, f"bare loop ×2 processes, {w.slots} envs", "bare",
            _base(w, contender="bare", procs=2), cores=2)
        add(w, f"AsyncVectorEnv ×{w.slots}", "peer",
            _base(w, contender="async_vector", n_envs=w.slots), cores=2)
        flow(w, f"evalfleet inprocess, 2 workers, {w.slots} envs", 2, w.slots)
        for iso in ("process", "bwrap"):
            for workers in (1, 2):
                flow(w, f"evalfleet {iso}, {workers} worker{'s' * (workers > 1)}, {w.slots} envs",
                     workers, w.slots, isolation=iso)
        # The same 16 envs, 8 per sandbox process: one round trip per 8 envs and step.
        per = max(1, w.slots // 2)
        flow(w, f"evalfleet process, 2 workers, {w.slots} envs in {w.slots // per} sandboxes",
             2, w.slots, isolation="process", envs_per_sandbox=per)

    if "W2-20k" in ws:
        w = ws["W2-20k"]
        add(w, "bare native vector ×1 core", "bare", _base(w, contender="bare_vector"))
        add(w, "bare native vector ×2 processes", "bare",
            _base(w, contender="bare_vector", procs=2), cores=2)
        add(w, "evalfleet core (run_shard, native, 1 process)", "evalfleet",
            _base(w, contender="evalfleet_core", native=True))
        flow(w, "evalfleet inprocess, 1 worker", 1, w.slots, native=True)
        flow(w, "evalfleet inprocess, 2 workers", 2, 2 * w.slots, native=True)

    if "W3-2k" in ws:
        w = ws["W3-2k"]
        add(w, "bare loop ×1 core", "bare", _base(w, contender="bare"))
        add(w, "bare loop ×2 processes", "bare", _base(w, contender="bare", procs=2), cores=2)
        sb3_cases(w, SB3_SETTINGS[:3])
        add(w, f"AsyncVectorEnv ×{2 if quick else 16}", "peer",
            _base(w, contender="async_vector", n_envs=2 if quick else 16), cores=2)
        add(w, "evalfleet core (run_shard, 1 process)", "evalfleet",
            _base(w, contender="evalfleet_core"))
        flow(w, "evalfleet inprocess, 1 worker", 1, w.slots)
        flow(w, "evalfleet inprocess, 2 workers", 2, 2 * w.slots)
        if not quick:
            flow(w, "evalfleet process, 2 workers, 16 envs", 2, 16, isolation="process")

    if "W4" in ws:
        w = ws["W4"]
        sizes = (8,) if quick else (8, 64)
        for n in sizes:
            add(w, f"bare loop, {n} episodes", "bare", _base(w, contender="bare", episodes=n))
            add(w, f"SB3 evaluate_policy dummy n={min(n, 16)}, {n} episodes", "peer",
                _base(w, contender="sb3", vec="dummy", n_envs=min(n, 16), episodes=n))
            if with_torchrl and n == sizes[0]:
                add(w, f"TorchRL Evaluator (thread), {n} episodes", "peer",
                    _base(w, contender="torchrl", episodes=n))
            add(w, f"AsyncVectorEnv ×{min(n, 16)}, {n} episodes", "peer",
                _base(w, contender="async_vector", n_envs=min(n, 16), episodes=n), cores=2)
        if with_flow:
            runs = [{"episodes": n, "label": f"evalfleet warm, {n} episodes", "concurrency": n}
                    for n in sizes for _ in range(1 if quick else 3)]
            runs += [
                {"episodes": 64 if not quick else 8, "cache": "use", "cache_dir": "cache-a",
                 "label": "evalfleet cache cold (miss, then stored)", "original_policy": True},
                {"episodes": 64 if not quick else 8, "cache": "use", "cache_dir": "cache-a",
                 "label": "evalfleet cache hot (hit)", "original_policy": True},
            ]
            flow(w, "evalfleet warm (server + 2 workers up)", 2, 64, runs=runs)
            add(w, "evalfleet cold CLI, 8 episodes", "evalfleet",
                {"contender": "evalfleet_cli", "episodes": 8, "concurrency": 8}, cores=2,
                note="fresh `python flows/eval.py`: interpreter, Prefect server, cluster")
    return out
