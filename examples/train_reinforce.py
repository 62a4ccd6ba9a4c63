"""REINFORCE on CartPole in plain PyTorch, evaluated by evalfleet after every update.

The training loop is an ordinary PyTorch loop on CPU. After each update it hands the policy to
``evalfleet.client.Evaluator.trigger_eval``, which copies the weights and returns at once; the
evaluation runs on a local Dask cluster through the same Prefect flow as every other evaluation.
Results come back through ``poll()`` (printed).

Everything goes to one MLflow experiment: the training run logs ``train/*`` per update, and each
evaluation is its own run, tagged with and nested under the training run's id, with ``eval/*``
metrics at the training step. The training run also gets ``eval/reward`` at each step, so one chart
shows both curves: evalfleet logs it there itself when the training run is in the same store::

    python examples/train_reinforce.py                 # ~3-5 minutes on 2 CPU cores
    python examples/train_reinforce.py --updates 3 --eval-episodes 8 --batch 8   # smoke test
    mlflow ui --backend-store-uri sqlite:///results/reinforce/mlflow.db   # needs full mlflow

The policy factory lives in this file; workers import it as ``train_reinforce:build_policy``
(the local cluster's workers inherit this script's folder on ``sys.path``), hence the
``__main__`` guard below. With ``--dask-address`` the workers must be able to import it too
(``PYTHONPATH=examples`` where they start).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from evalfleet.client import Evaluator

HIDDEN = 64


def build_policy() -> nn.Module:
    """The policy network: CartPole observation (4) → action logits (2)."""
    return nn.Sequential(nn.Linear(4, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 2))


def init_policy(seed: int) -> nn.Module:
    """A freshly initialised policy from a seeded generator (no global RNG)."""
    policy = build_policy()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in policy:
            if isinstance(module, nn.Linear):
                nn.init.orthogonal_(module.weight, gain=1.0, generator=gen)
                module.bias.zero_()
    return policy


@dataclass
class Batch:
    """One update's worth of complete episodes, stored step by step (batched, not per env)."""

    alive: list[np.ndarray]
    """Per step, the indices of the envs still running."""
    log_probs: list[torch.Tensor]
    """Per step, log pi(action) of those envs."""
    rewards: list[list[float]]
    """Per env, its rewards."""

    @property
    def returns(self) -> list[float]:
        """Undiscounted return of each episode."""
        return [float(sum(r)) for r in self.rewards]


def collect(policy: nn.Module, envs: list[gym.Env[Any, Any]], rng: np.random.Generator,
            gen: torch.Generator) -> Batch:
    """Run one complete episode per env, with one batched forward per step."""
    n = len(envs)
    obs = np.stack([env.reset(seed=int(rng.integers(2**31)))[0] for env in envs])
    running = np.ones(n, dtype=bool)
    batch = Batch([], [], [[] for _ in range(n)])
    while running.any():
        idx = np.flatnonzero(running)
        logp = torch.log_softmax(policy(torch.as_tensor(obs[idx], dtype=torch.float32)), dim=-1)
        actions = torch.multinomial(logp.detach().exp(), 1, generator=gen)
        batch.alive.append(idx)
        batch.log_probs.append(logp.gather(1, actions).squeeze(1))
        for i, action in zip(idx, actions.squeeze(1).tolist(), strict=True):
            obs[i], reward, terminated, truncated, _ = envs[i].step(action)
            batch.rewards[i].append(float(reward))
            if terminated or truncated:
                running[i] = False
    return batch


def reinforce_loss(batch: Batch, gamma: float) -> torch.Tensor:
    """Policy-gradient loss with discounted returns-to-go, normalised over the batch."""
    to_go = []
    for rewards in batch.rewards:
        g, out = 0.0, np.empty(len(rewards))
        for t in range(len(rewards) - 1, -1, -1):
            g = rewards[t] + gamma * g
            out[t] = g
        to_go.append(out)
    # Env i is alive at step t exactly while t < its length: its t-th return-to-go lines up.
    target = torch.as_tensor(np.concatenate(
        [[to_go[i][t] for i in idx] for t, idx in enumerate(batch.alive)]), dtype=torch.float32)
    target = (target - target.mean()) / (target.std() + 1e-8)
    return -(torch.cat(batch.log_probs) * target).sum() / len(batch.rewards)


class TrainingRun:
    """The trainer's MLflow run, created with the same experiment the evaluations log to."""

    def __init__(self, tracking_uri: str, experiment: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            location = None
            if tracking_uri.startswith("sqlite:///"):  # artifacts next to the DB, not in CWD
                db = Path(tracking_uri.removeprefix("sqlite:///"))
                location = (db.parent / "mlartifacts").resolve().as_uri()
            exp_id = self.client.create_experiment(experiment, artifact_location=location)
        else:
            exp_id = exp.experiment_id
        run = self.client.create_run(exp_id, run_name="reinforce-cartpole",
                                     tags={"role": "training"})
        self.run_id: str = run.info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics at a training step (thread-safe: explicit run id, no fluent state)."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id,
                              metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()])

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the run ended."""
        self.client.set_terminated(self.run_id, status)


def eval_line(result: dict[str, Any]) -> str:
    """One printed line per evaluation result."""
    return (f"  eval  step {result['eval/step']:>3}: return {result['eval/reward']:7.1f} "
            f"[{result['eval/reward_ci_low']:.1f}, {result['eval/reward_ci_high']:.1f}]  "
            + (f"({result['eval/fps']:.0f} env steps/s)" if result["eval/fps"] is not None
               else "(cache hit: no episodes run)"))


def final_outputs(evaluator: Evaluator, result: dict[str, Any]) -> dict[str, str]:
    """Where an evaluation's files and MLflow run are, once its background step finished."""
    final = evaluator.final_report(result["report"].request_id)
    return dict((final.result() if final is not None else result["report"]).outputs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--updates", type=int, default=30, help="policy-gradient updates")
    p.add_argument("--batch", type=int, default=16, help="episodes per update")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-episodes", type=int, default=32, help="episodes per evaluation")
    p.add_argument("--eval-seed", type=int, default=1000, help="seed ledger base of evaluations")
    p.add_argument("--busy-policy", default="queue", choices=["error", "queue", "skip"])
    p.add_argument("--workers", type=int, default=2, help="local Dask workers")
    p.add_argument("--dask-address", default=None,
                   help="evaluate on this Dask scheduler instead of a LocalCluster")
    p.add_argument("--output", default="results/reinforce", help="results + MLflow folder")
    p.add_argument("--mlflow-uri", default=None, help="default: sqlite:///OUTPUT/mlflow.db")
    p.add_argument("--experiment", default="reinforce-cartpole")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for evaluations")
    p.add_argument("--summary", default=None, help="write the results here as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    from evalfleet.client import Evaluator
    from evalfleet.tracking import default_tracking_uri

    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)  # a 4-64-2 MLP gains nothing from threads; leave cores to Dask
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    output = Path(args.output).resolve()
    tracking_uri = args.mlflow_uri or default_tracking_uri(output)
    run = TrainingRun(tracking_uri, args.experiment, {k: v for k, v in vars(args).items()
                                                      if k not in ("summary",)})
    print(f"training run {run.run_id} in experiment {args.experiment!r} at {tracking_uri}")

    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    policy = init_policy(args.seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    envs = [gym.make("CartPole-v1") for _ in range(args.batch)]
    train_curve: dict[int, float] = {}
    evals: list[dict[str, Any]] = []

    t0 = time.monotonic()
    with Evaluator(env="CartPole-v1", policy_factory=build_policy,
                   num_episodes=args.eval_episodes, busy_policy=args.busy_policy,
                   device="cpu", training_run_id=run.run_id,
                   seed=args.eval_seed, workers=args.workers, dask_address=args.dask_address,
                   concurrency=args.eval_episodes,
                   output=output, mlflow_uri=tracking_uri, experiment=args.experiment,
                   ) as evaluator:
        for step in range(1, args.updates + 1):
            batch = collect(policy, envs, rng, gen)
            loss = reinforce_loss(batch, args.gamma)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mean_return = float(np.mean(batch.returns))
            train_curve[step] = mean_return
            run.log({"train/return": mean_return, "train/loss": loss.item()}, step=step)
            t = time.perf_counter()
            evaluator.trigger_eval(policy, step=step)  # returns at once
            print(f"update {step:>3}: train return {mean_return:7.1f}  "
                  f"(trigger_eval took {1e3 * (time.perf_counter() - t):.2f} ms, "
                  f"{evaluator.pending} pending)")
            for result in iter(evaluator.poll, None):
                evals.append(result)
                print(eval_line(result))
        print(f"training done in {time.monotonic() - t0:.0f} s; waiting for "
              f"{evaluator.pending} evaluation(s)")
        deadline = time.monotonic() + args.timeout
        while (left := deadline - time.monotonic()) > 0:
            result = evaluator.wait(timeout=left)
            if result is None:
                break
            evals.append(result)
            print(eval_line(result))
    run.finish()
    for env in envs:
        env.close()

    print("\n step  train return  eval return [95% CI]")
    for r in evals:
        s = int(r["eval/step"])
        print(f" {s:>4}  {train_curve[s]:12.1f}  {r['eval/reward']:11.1f} "
              f"[{r['eval/reward_ci_low']:.1f}, {r['eval/reward_ci_high']:.1f}]")
    if evals:
        first, best = evals[0], max(evals, key=lambda r: r["eval/reward"])
        print(f"evaluated return: {first['eval/reward']:.1f} at step {first['eval/step']} → "
              f"best {best['eval/reward']:.1f} at step {best['eval/step']} "
              f"({len(evals)} evaluations, {evaluator.skipped} skipped)")
    if args.summary:
        Path(args.summary).write_text(json.dumps({
            "training_run_id": run.run_id, "tracking_uri": tracking_uri,
            "experiment": args.experiment, "train": train_curve,
            "evals": [{k: v for k, v in r.items() if k != "report"}
                      | {"request_id": r["report"].request_id,
                         "mlflow_run_id": final_outputs(evaluator, r).get("mlflow_run_id")}
                      for r in evals],
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
