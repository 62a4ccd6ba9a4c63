"""The command line of ``python flows/eval.py`` (Prefect-free: the flow is passed in)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path
from types import FrameType

from evalfleet.errors import EvalfleetError, Stopped
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.summary import summary_text

#: The bundled example policy: a 4-64-64-2 TorchScript MLP that balances CartPole-v1.
EXAMPLE_POLICY = str(files("evalfleet") / "data" / "cartpole_mlp.pt")

EXIT_OK, EXIT_HARNESS_FAULT, EXIT_BAD_REQUEST = 0, 3, 2


#: What ``python flows/eval.py --help`` and ``evalfleet eval --help`` say first.
EVAL_DESCRIPTION = (
    "Evaluate a policy on a Gymnasium env: many episodes at once on a Dask cluster, results to "
    "Parquet, MLflow and Prefect. With no arguments: the bundled example policy on CartPole-v1, "
    "500 episodes, 500 envs alive at once, a local cluster."
)


def build_parser(prog: str = "python flows/eval.py") -> argparse.ArgumentParser:
    """The argument parser; every option maps to an ``EvalRequest`` field."""
    p = argparse.ArgumentParser(prog=prog, description=EVAL_DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_eval_arguments(p)
    return p


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """Add the evaluation's options to ``p`` (the standalone parser or ``evalfleet eval``)."""
    d = EvalRequest.model_fields
    p.add_argument("--env", default=d["env"].default,
                   help="Gymnasium id; 'my_pkg.envs:Warehouse-v0' imports my_pkg.envs first")
    p.add_argument("--env-kwargs", default="{}", help="JSON object of kwargs for gym.make")
    p.add_argument("--policy", default=EXAMPLE_POLICY,
                   help="TorchScript file, state_dict file (with --policy-factory), or "
                   "'module:function' (numpy obs batch -> actions)")
    p.add_argument("--policy-factory", default=None,
                   help="'module:function' returning the nn.Module for a state_dict")
    p.add_argument("--episodes", type=int, default=d["episodes"].default, help="episodes to run")
    p.add_argument("--concurrency", type=int, default=d["concurrency"].default,
                   help="environment instances alive at once across the cluster")
    p.add_argument("--seed", type=int, default=d["seed"].default,
                   help="base seed; episode i is reset with ledger(seed, i)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="episode step cap (default: the env's registered max_episode_steps)")
    p.add_argument("--stochastic", action="store_true",
                   help="sample actions from the policy's logits (seeded per episode) "
                   "instead of argmax")
    p.add_argument("--device", default=d["device"].default, help="auto | cpu | cuda[:N]")
    p.add_argument("--isolation", default=d["isolation"].default,
                   help="inprocess | process | bwrap | auto (default: gymnasium's and evalfleet's "
                   "envs inprocess, any other env in process sandboxes)")
    p.add_argument("--sandbox-env", action="append", default=[], metavar="NAME",
                   help="environment variable sandboxes may see besides the allow-list "
                   "(repeat for several)")
    p.add_argument("--episode-timeout", type=float, default=d["episode_timeout_s"].default,
                   help="seconds one episode may spend in its env's reset/step calls (process/bwrap)")
    p.add_argument("--step-timeout", type=float, default=d["step_timeout_s"].default,
                   help="wall-clock seconds one env step may take in a sandbox (process/bwrap)")
    p.add_argument("--policy-timeout", type=float, default=d["policy_timeout_s"].default,
                   help="wall-clock seconds one batched policy forward may take (a shard's first: "
                   "4x); past it the shard's episodes end as policy_timeout")
    p.add_argument("--envs-per-sandbox", type=int, default=d["envs_per_sandbox"].default,
                   help="env instances per sandbox process: trades isolation for speed")
    p.add_argument("--sandbox-memory-mb", type=int, default=d["sandbox_memory_mb"].default,
                   help="address-space limit of one sandbox process (>= 1500 if the env imports torch)")
    p.add_argument("--workers", type=int, default=d["workers"].default,
                   help="local Dask worker processes (ignored with --dask-address)")
    p.add_argument("--dask-address", default=None,
                   help="scheduler address of an existing Dask cluster, e.g. tcp://host:8786")
    p.add_argument("--output", default=str(d["output"].default), help="results folder")
    p.add_argument("--report", default=None, help="also write the report JSON to this path")
    p.add_argument("--mlflow-uri", default=None,
                   help="MLflow tracking URI (default: sqlite:///OUTPUT/mlflow.db)")
    p.add_argument("--experiment", default=d["experiment"].default, help="MLflow experiment")
    p.add_argument("--training-run-id", default=None, help="trainer's run id, tagged everywhere")
    p.add_argument("--step", type=int, default=None, help="training step of these weights")
    p.add_argument("--target-ci-halfwidth", type=float, default=None,
                   help="adaptive: add rounds of episodes until the 95%% CI half-width <= this")
    p.add_argument("--max-episodes", type=int, default=None,
                   help="adaptive: never run more episodes than this (required with the target)")
    p.add_argument("--baseline", default=None,
                   help="baseline policy (file, module:function, or sha256:HEX of a cached one): "
                   "evaluated on the same seeds, paired difference reported")
    p.add_argument("--baseline-factory", default=None, help="factory for a state_dict baseline")
    p.add_argument("--no-audit", action="store_true",
                   help="skip the determinism audit (re-running 2%% of episodes)")
    p.add_argument("--record-trajectories", type=int, default=0, metavar="K",
                   help="store every step of K episodes (worst, best, failed, then sampled)")
    p.add_argument("--record-video", type=int, default=0, metavar="K",
                   help="render K episodes (same choice) to MP4/GIF, logged to MLflow")
    p.add_argument("--no-cache", action="store_true",
                   help="ignore the episode cache: run everything, store nothing")
    p.add_argument("--refresh", action="store_true",
                   help="recompute every episode and replace the cache entry")
    p.add_argument("--cache-dir", default=None,
                   help="episode cache root (default $EVALFLEET_CACHE_DIR or OUTPUT/cache)")
    p.add_argument("--allow-failures", action="store_true",
                   help="exit 0 even when > 5%% of episodes failed in the harness (harness fault)")
    p.add_argument("-q", "--quiet", action="store_true", help="only print the summary")
    p.add_argument("--retry-budget", type=int, default=d["retry_budget"].default, metavar="N",
                   help="fresh-sandbox retries (same seed) of an episode ended by a harness "
                   "failure (timeout, crashed, oom); 0 turns them off")
    p.add_argument("--shard-episodes", type=int, default=None, metavar="N",
                   help="most episodes per shard; finished shards are persisted at once, so a "
                   "re-run after a crash runs only what is missing (default: max(256, 2 x the "
                   "shard's env slots))")


def request_from_args(args: argparse.Namespace) -> EvalRequest:
    """Validate parsed arguments into an ``EvalRequest`` (raises ``RequestError``)."""
    return EvalRequest.build(
        env=args.env,
        env_kwargs=args.env_kwargs,
        policy=args.policy,
        policy_factory=args.policy_factory,
        episodes=args.episodes,
        concurrency=args.concurrency,
        seed=args.seed,
        max_steps=args.max_steps,
        deterministic=not args.stochastic,
        device=args.device,
        isolation=args.isolation,
        sandbox_env_allow=args.sandbox_env,
        episode_timeout_s=args.episode_timeout,
        step_timeout_s=args.step_timeout,
        policy_timeout_s=args.policy_timeout,
        envs_per_sandbox=args.envs_per_sandbox,
        sandbox_memory_mb=args.sandbox_memory_mb,
        workers=args.workers,
        dask_address=args.dask_address,
        output=Path(args.output),
        mlflow_uri=args.mlflow_uri,
        experiment=args.experiment,
        training_run_id=args.training_run_id,
        step=args.step,
        target_ci_halfwidth=args.target_ci_halfwidth,
        max_episodes=args.max_episodes,
        baseline=args.baseline,
        baseline_factory=args.baseline_factory,
        audit=not args.no_audit,
        record_trajectories=args.record_trajectories,
        record_video=args.record_video,
        cache="off" if args.no_cache else "refresh" if args.refresh else "use",
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        retry_budget=getattr(args, "retry_budget", EvalRequest.model_fields["retry_budget"].default),
        shard_episodes=getattr(args, "shard_episodes", None),
    )


def add_cache_commands(p: argparse.ArgumentParser) -> None:
    """Add ``ls`` and ``rm`` (subcommands) and their options to the ``cache`` parser ``p``.

    ``--cache-dir`` and ``--output`` are accepted before and after ``ls``/``rm``.
    """
    p.add_argument("--cache-dir", default=None, help="cache root (default OUTPUT/cache)")
    p.add_argument("--output", default="results", help="results folder whose cache to use")
    # The same options after the subcommand; SUPPRESS keeps a value given before it.
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--cache-dir", default=argparse.SUPPRESS, help="cache root (default OUTPUT/cache)")
    where.add_argument("--output", default=argparse.SUPPRESS, help="results folder whose cache to use")
    actions = p.add_subparsers(dest="action", metavar="{ls,rm}", required=True)
    actions.add_parser("ls", parents=[where], help="list the entries: key, env, policy, seed, episodes")
    rm = actions.add_parser("rm", parents=[where], help="remove entries by key (or unique prefix)")
    rm.add_argument("keys", nargs="*", help="keys (or unique prefixes) to remove")
    rm.add_argument("--all", action="store_true", help="remove every entry")


def cache_command(argv: Sequence[str]) -> int:
    """``evalfleet cache ls|rm [KEY...|--all] [--cache-dir DIR]``: see and clear stored episodes."""
    p = argparse.ArgumentParser(prog="evalfleet cache", description="List or remove cache entries.")
    add_cache_commands(p)
    return run_cache(p.parse_args(argv))


def run_cache(args: argparse.Namespace) -> int:
    """Run a parsed ``cache ls|rm`` command line; returns the exit code."""
    from evalfleet.cache import EpisodeCache, default_cache_dir

    cache = EpisodeCache(Path(args.cache_dir) if args.cache_dir else default_cache_dir(Path(args.output)))
    entries = cache.entries()
    if args.action == "ls":
        print(f"{'key':<16}  {'env':<28} {'policy':<12} {'seed':>6} {'episodes':>9} {'bytes':>10}  updated")
        for e in entries:
            print(f"{str(e['key'])[:16]:<16}  {str(e['env'])[:28]:<28} {str(e['policy_sha256'])[:12]:<12} "
                  f"{e['seed']!s:>6} {e['rows']!s:>9} {e['bytes']:>10}  {e['updated']}")
        print(f"{len(entries)} entries in {cache.root}")
        return EXIT_OK
    if not args.keys and not args.all:
        print("evalfleet cache rm: name keys (or prefixes) to remove, or pass --all", file=sys.stderr)
        return EXIT_BAD_REQUEST
    removed = 0
    for e in entries:
        key = str(e["key"])
        if args.all or any(key.startswith(k) for k in args.keys):
            removed += cache.remove(key)
    print(f"removed {removed} entries from {cache.root}")
    return EXIT_OK


def _notes(err: BaseException | None) -> list[str]:
    """Notes of ``err`` and of the exceptions it was raised while handling (Prefect re-raises)."""
    notes: list[str] = []
    while err is not None:
        notes += [n for n in getattr(err, "__notes__", []) if n not in notes]
        err = err.__context__
    return notes


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises ``Stopped`` where the main thread is, like Ctrl-C raises KeyboardInterrupt.

    Every wait (a cache lock, a cluster, a flow) then ends, ``finally`` blocks stop the cluster and
    the local Prefect server, and the CLI exits 143 with a message. A second SIGTERM during that
    cleanup kills at once. Inside a flow Prefect installs its own handler, which marks the flow run
    crashed and then re-sends the signal to this one.
    """
    def stop(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Stopped(signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals to whoever owns them
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def run_cli(
    evaluate: Callable[[EvalRequest], EvalReport], argv: Sequence[str] | None = None
) -> int:
    """Parse ``argv``, evaluate, print the summary; returns the exit code.

    SIGTERM ends a waiting evaluation like Ctrl-C does: it unwinds and exits with 143.
    """
    return run_eval(evaluate, build_parser().parse_args(argv))


def run_eval(evaluate: Callable[[EvalRequest], EvalReport], args: argparse.Namespace) -> int:
    """Evaluate parsed arguments (``build_parser``'s options) and print the summary (``run_cli``)."""
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with stop_on_sigterm():
            request = request_from_args(args)
            report = evaluate(request)
    except EvalfleetError as err:
        print(f"evalfleet: error: {err}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    except (Stopped, KeyboardInterrupt) as err:
        signum = err.signum if isinstance(err, Stopped) else signal.SIGINT
        where = "; ".join(_notes(err))
        print(f"evalfleet: stopped by {signal.Signals(signum).name}"
              + (f" {where}" if where else "") + "; episodes stored so far stay in the cache",
              file=sys.stderr)
        return 128 + signum
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report.model_dump(mode="json"), indent=2) + "\n")
    print(summary_text(report))
    if report.harness_fault and not args.allow_failures:
        recording = [a for a in report.alarms if a.startswith("recording_incomplete")]
        why = "; ".join(recording) if recording else (
            f"more than 5% of episodes failed in the harness (coverage {report.coverage:.1%})")
        print(f"evalfleet: harness fault: {why} (pass --allow-failures to exit 0 anyway)",
              file=sys.stderr)
        return EXIT_HARNESS_FAULT
    return EXIT_OK
