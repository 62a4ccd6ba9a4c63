"""The command line of ``python flows/eval.py`` (Prefect-free: the flow is passed in)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from evalfleet import mlflow_logger, warm_forkserver
from evalfleet.console import QUIET_ENV, configure_console, quiet_environment
from evalfleet.environ import restored_environment
from evalfleet.errors import (
    EvalfleetError,
    IsolationUnavailable,
    RequestError,
    SandboxUnconfined,
    Stopped,
)
from evalfleet.models import (
    FAILURE_ALARM_RATE,
    INPUTS_CHANGED,
    OUTPUT_MISSING,
    RECORDING_INCOMPLETE,
    EvalReport,
    EvalRequest,
    check_training_pair,
)
from evalfleet.server import SERVER_MODE_ENV
from evalfleet.summary import percent, percent_beyond, summary_text
from evalfleet.tracking import TELEMETRY_ENV, telemetry_off

#: The bundled example policy: a 4-64-64-2 TorchScript MLP that balances CartPole-v1.
EXAMPLE_POLICY = str(files("evalfleet") / "data" / "cartpole_mlp.pt")

EXIT_OK, EXIT_HARNESS_FAULT, EXIT_BAD_REQUEST = 0, 3, 2
#: ``--gate``: the evaluation is a significant regression against the training run's best
#: earlier checkpoint (paired 95% CI of the return difference below 0).
EXIT_REGRESSION = 4
#: ``--gate``: the gate could not compare with the best earlier checkpoint (the run's history could
#: not be read, the best checkpoint's episodes are gone, or too few pairs): not a pass.
EXIT_GATE_UNDECIDED = 6
#: Verdicts ``--gate`` passes: a first checkpoint has nothing to regress from.
GATE_PASSES = ("first", "new_best", "not_distinguishable")
#: Exit code of an evaluation that failed for a reason other than its request (a crash, a bug).
EXIT_FAILED = 1
#: An evaluation that evalfleet stopped on purpose once it had begun, for a reason outside the
#: request (the cluster lost, a worker killed by a shard's policy or env, the cache's lock or an
#: entry, the Prefect server, stale worker code): the message says what. Not ``EXIT_BAD_REQUEST``,
#: which tells a caller to fix the request; episodes that finished stay in the cache.
EXIT_STOPPED_MIDWAY = 7

#: The numbers are written (Parquet, cache), but an output asked for is not: the review's files,
#: the MLflow run (neither logged nor queued) or the trainer's callback.
EXIT_OUTPUT_MISSING = 5


def error_exit(err: EvalfleetError) -> int:
    """The exit code of an ``EvalfleetError``: 2 for a refused request, 7 for the others.

    3 for a worker whose sandboxes could not be confined as the level promises: a harness fault.
    """
    print(f"evalfleet: error: {err}", file=sys.stderr)
    if isinstance(err, RequestError | IsolationUnavailable):
        return EXIT_BAD_REQUEST
    if isinstance(err, SandboxUnconfined):
        return EXIT_HARNESS_FAULT
    return EXIT_STOPPED_MIDWAY


#: Options each task of a suite sets for itself (``--suite``): given with one, they were ignored.
SUITE_SETS = ("--env", "--env-kwargs", "--episodes", "--max-steps")
#: The namespace attribute that holds the ``SUITE_SETS`` options given on the command line.
GIVEN = "given_options"


class _Given(argparse.Action):
    """Store the value and note that the option was given: its default may be typed out too."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN, {*getattr(namespace, GIVEN, ()), option_string or self.dest})


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
    p.add_argument("--env", default=d["env"].default, action=_Given,
                   help="Gymnasium id; 'my_pkg.envs:Warehouse-v0' imports my_pkg.envs first")
    p.add_argument("--env-kwargs", default="{}", action=_Given, help="JSON object of kwargs for gym.make")
    p.add_argument("--policy", default=EXAMPLE_POLICY,
                   help="TorchScript file, state_dict file (with --policy-factory), or "
                   "'module:function' (numpy obs batch -> actions)")
    p.add_argument("--policy-factory", default=None,
                   help="'module:function' returning the nn.Module for a state_dict")
    p.add_argument("--episodes", type=int, default=d["episodes"].default, action=_Given,
                   help="episodes to run")
    p.add_argument("--concurrency", type=int, default=d["concurrency"].default,
                   help="environment instances alive at once across the cluster")
    p.add_argument("--seed", type=int, default=d["seed"].default,
                   help="base seed; episode i is reset with ledger(seed, i)")
    p.add_argument("--max-steps", type=int, default=None, action=_Given,
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
    p.add_argument("--sandbox-read", action="append", default=[], metavar="PATH",
                   help="absolute path process sandboxes may also read, e.g. an env's data "
                   "(repeat for several; by default they read only what running the env needs)")
    p.add_argument("--sandbox-write", action="append", default=[], metavar="PATH",
                   help="absolute path process sandboxes may also write (repeat for several)")
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
    cache_mode = p.add_mutually_exclusive_group()  # one cache mode: --refresh was dropped silently
    cache_mode.add_argument("--no-cache", action="store_true",
                            help="ignore the episode cache: run everything, store nothing")
    cache_mode.add_argument("--refresh", action="store_true",
                            help="recompute every episode and replace the cache entry")
    p.add_argument("--cache-dir", default=None,
                   help="episode cache root (default $EVALFLEET_CACHE_DIR or OUTPUT/cache)")
    p.add_argument("--allow-failures", action="store_true",
                   help="exit 0 even when > 5%% of episodes failed in the harness (harness fault)")
    p.add_argument("-q", "--quiet", action="store_true", help="only print the summary")
    p.add_argument("--outcome-metric", default=None, metavar="KEY",
                   help="final-info key of the task outcome the reward-hacking alarm watches "
                   "across checkpoints (default: the success rate)")
    p.add_argument("--gate", action="store_true",
                   help=f"exit {EXIT_REGRESSION} when the evaluation is a significant regression "
                   "against the best earlier checkpoint of --training-run-id (paired, same seeds), "
                   f"{EXIT_GATE_UNDECIDED} when it could not be compared with it (not with --suite)")
    p.add_argument("--suite", default=None, metavar="SUITE_TOML",
                   help="evaluate on every task of a suite file (envs, kwargs grids, episodes, "
                   "normalisation; see examples/suite.toml) and aggregate across tasks; --env, "
                   "--env-kwargs, --episodes and --max-steps come from the suite and are refused "
                   "with it")
    p.add_argument("--ephemeral-server", action="store_true",
                   help="with no PREFECT_API_URL, start a Prefect server for this run only instead "
                   "of the shared local one (evalfleet server status|stop)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print Prefect's, Dask's and MLflow's INFO logs, and tracebacks")
    p.add_argument("--retry-budget", type=int, default=d["retry_budget"].default, metavar="N",
                   help="fresh-sandbox retries (same seed) of an episode ended by a harness "
                   "failure (timeout, crashed, oom); 0 turns them off")
    p.add_argument("--shard-episodes", type=int, default=None, metavar="N",
                   help="most episodes per shard; finished shards are persisted at once, so a "
                   "re-run after a crash runs only what is missing (default: max(1024, 4 x the "
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
        sandbox_read=args.sandbox_read,
        sandbox_write=args.sandbox_write,
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
        outcome_metric=args.outcome_metric,
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
    keys = [str(e["key"]) for e in entries]
    chosen = set(keys) if args.all else set()
    for prefix in [] if args.all else args.keys:
        # '' is a prefix of every key: 'cache rm "$KEY"' with KEY unset removed the whole cache.
        if not prefix.strip():
            print(f"evalfleet cache rm: an empty key ({prefix!r}) names no entry; nothing was "
                  "removed. Name a key (or a unique prefix) from 'evalfleet cache ls', or pass --all.",
                  file=sys.stderr)
            return EXIT_BAD_REQUEST
        matches = [key for key in keys if key.startswith(prefix)]
        if len(matches) > 1:
            print(f"evalfleet cache rm: {prefix!r} is the prefix of {len(matches)} entries "
                  f"({', '.join(m[:16] for m in matches[:10])}{', ...' if len(matches) > 10 else ''}); "
                  "nothing was removed. Give more of the key, name each key, or pass --all.",
                  file=sys.stderr)
            return EXIT_BAD_REQUEST
        if not matches:
            print(f"evalfleet cache rm: no entry's key starts with {prefix!r}", file=sys.stderr)
        chosen.update(matches)
    removed = sum(cache.remove(key) for key in keys if key in chosen)
    print(f"removed {removed} entries from {cache.root}")
    return EXIT_OK


def failure_paragraph(err: BaseException, verbose: bool = False) -> str:
    """One paragraph for an unexpected failure: what failed, the error, where to see more."""
    text = " ".join(str(err).split()) or "(no message)"
    if len(text) > 600:
        text = text[:600] + " ..."
    notes = "; ".join(_notes(err))
    more = "" if verbose else " Run again with -v for the traceback and the Prefect and Dask logs."
    return (f"evalfleet: error: the evaluation failed: {type(err).__name__}: {text}"
            + (f" ({notes})" if notes else "") + "." + more)


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
    evaluate: Callable[[EvalRequest], EvalReport], argv: Sequence[str] | None = None,
    evaluate_suite: SuiteEvaluator | None = None,
) -> int:
    """Parse ``argv``, evaluate, print the summary; returns the exit code.

    SIGTERM ends a waiting evaluation like Ctrl-C does: it unwinds and exits with 143.
    ``evaluate_suite`` runs ``--suite`` (``flows.suite.evaluate_suite``).
    """
    return run_eval(evaluate, build_parser().parse_args(argv), evaluate_suite)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once everything it wrote is out, skipping interpreter teardown.

    What an orderly exit does that matters runs first: other non-daemon threads are joined, the
    ``atexit`` handlers run (Prefect's log and event workers drain, multiprocessing's finalizers,
    MLflow's), logging and the standard streams are flushed. What is skipped is the interpreter
    freeing every module's objects one by one (2-3 s with torch, MLflow and Prefect loaded), which
    writes nothing.
    """
    import atexit
    import logging
    import threading

    # The interpreter's own first step: thread pools' exit hooks tell their idle workers to stop
    # (joined without them, an idle pool's worker, e.g. MLflow's artifact uploader, hung the exit
    # for good), then every other non-daemon thread is joined.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def report_inputs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """The options that may name an input file, with their values (``check_report_path``).

    A ``--policy-factory`` or ``--baseline-factory`` is a ``module:function``, not a path.
    """
    return [("--policy", args.policy), ("--baseline", args.baseline),
            ("--suite", getattr(args, "suite", None))]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:  # a name too long, a folder that may not be listed: not the same file
        return False


def check_report_path(path: str | None, inputs: Sequence[tuple[str, str | None]] = ()) -> None:
    """``--report``'s file can be written: its folder made, the file opened, before anything runs.

    A report asked for and not written after the evaluation ran would be a result lost. Nor may
    it be one of ``inputs`` (option, value; ``report_inputs``): ``--report my_policy.pt
    --policy my_policy.pt`` replaced the policy file with the report JSON, exit 0.
    """
    if not path:
        return
    target = Path(path)
    for option, value in inputs:  # the same file by any name: a relative path, a link
        if value and _same_file(target, Path(value)):
            raise RequestError(f"--report {path!r} is the {option} file {value!r}: writing the "
                               "report there would overwrite it. Give --report another path.")
    existed = target.exists()
    try:
        if target.is_dir():
            raise IsADirectoryError(f"{path} is a folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a"):
            pass
    except OSError as err:
        raise RequestError(f"--report {path!r} cannot be written ({err}); give a file path in a "
                           "folder this user may write to.") from err
    if not existed:
        target.unlink()


#: How long writing ``--report`` waits for a queued MLflow run another process is logging.
REPORT_COPY_WAIT_S = 120.0


def write_report(path: str | None, report: Any) -> Any:
    """Write ``report`` (a pydantic model) as JSON to ``--report``'s path, when one was given.

    Returns the report written. One whose MLflow run is queued is named in the queue entry, so
    the flush that logs the run updates this copy as it does report.json
    (``tracking.note_report_copy``); one logged meanwhile is written with that run, as report.json
    records it (``pipeline.with_late_run``).
    """
    if not path:
        return report
    from evalfleet.storage import report_lock, write_json

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # strict JSON, as report.json: NaN statistics (nothing scored) are null
        write_json(report.model_dump(mode="json"), target)

    queued = report.outputs.get("mlflow_queued") if isinstance(report, EvalReport) else None
    if not queued:
        write()
        return report
    from evalfleet.pipeline import with_late_run
    from evalfleet.tracking import note_report_copy

    if note_report_copy(Path(queued), target, write, REPORT_COPY_WAIT_S):
        return report
    report_json = report.outputs.get("report")
    if report_json and Path(report_json).exists():
        with report_lock(Path(report_json)):  # what the flush recorded there, read as it writes it
            report = with_late_run(report, Path(report_json))
            write()
    else:
        write()
    if report.outputs.get("mlflow_queued") and Path(queued).exists():
        print(f"evalfleet: --report {path} says the MLflow run is queued, and its queue entry "
              f"{queued} could not name it (another process still logging the run after "
              f"{REPORT_COPY_WAIT_S:.0f} s, or the entry unreadable): a flush will not update it; "
              f"{report_json} names the run once logged", file=sys.stderr)
    return report


#: ``flows.suite.evaluate_suite``'s shape: (suite, base request) -> suite report.
SuiteEvaluator = Callable[[Any, EvalRequest], Any]


def run_suite(evaluate_suite: SuiteEvaluator | None, args: argparse.Namespace) -> int:
    """Evaluate ``--suite``: every task, then the aggregates across tasks; returns the exit code."""
    from evalfleet.suite import load_suite, refuse_task_settings

    try:
        with stop_on_sigterm():
            if args.gate:
                raise RequestError(
                    "--gate compares one evaluation with the best earlier checkpoint of its "
                    "training run; a suite has no such verdict across its tasks. Drop --gate, or "
                    "gate each task as its own evaluation (--env ... --gate).")
            # Each was ignored, exit 0: the tasks ran with the suite file's values.
            refuse_task_settings([option for option in SUITE_SETS if option in getattr(args, GIVEN, ())],
                                 "--suite", f"the suite file {args.suite!r}")
            suite = load_suite(args.suite)
            base = request_from_args(args)
            check_training_pair(base)
            check_report_path(args.report, report_inputs(args))
            if evaluate_suite is None:
                raise RequestError("--suite needs the suite flow: run python flows/eval.py or "
                                   "evalfleet eval.")
            report = evaluate_suite(suite, base)
    except EvalfleetError as err:
        return error_exit(err)
    except (Stopped, KeyboardInterrupt) as err:
        signum = err.signum if isinstance(err, Stopped) else signal.SIGINT
        print(f"evalfleet: stopped by {signal.Signals(signum).name}; finished tasks stay in the cache",
              file=sys.stderr)
        return 128 + signum
    except Exception as err:  # as for one evaluation: one paragraph, the traceback only with -v
        verbose = bool(getattr(args, "verbose", False))
        if verbose:
            traceback.print_exc()
        print(failure_paragraph(err, verbose), file=sys.stderr)
        return EXIT_FAILED
    from evalfleet.suite_report import suite_markdown

    write_report(args.report, report)
    print(suite_markdown(report))
    print(f"suite report: {report.outputs.get('report_html') or report.outputs.get('report')}")
    if "prefect_lost" in report.outputs:
        print(f"prefect_lost: {report.outputs['prefect_lost']}")
    recording = [a for a in report.alarms if f"{RECORDING_INCOMPLETE}: " in a]  # never waived
    if recording:
        print(f"evalfleet: harness fault in a suite task: {'; '.join(recording)}", file=sys.stderr)
        return EXIT_HARNESS_FAULT
    if report.harness_fault and not args.allow_failures:
        faulted = [f"{t['name']} (coverage {percent_beyond(t['coverage'], 1 - FAILURE_ALARM_RATE)})"
                   for t in report.tasks
                   if t.get("harness_fault") and "coverage" in t] or ["the baseline's"]
        print("evalfleet: harness fault in a suite task: more than 5% of its episodes failed in the "
              f"harness ({', '.join(faulted)}; pass --allow-failures to exit 0 anyway)",
              file=sys.stderr)
        return EXIT_HARNESS_FAULT
    # The suite's own, and its tasks' (each prefixed with the task's request id).
    missing = [a.replace(f"{OUTPUT_MISSING}: ", "", 1) for a in report.alarms
               if a.startswith(f"{OUTPUT_MISSING}: ") or f": {OUTPUT_MISSING}: " in a]
    if missing:
        return output_missing(missing)
    return EXIT_OK


def run_eval(evaluate: Callable[[EvalRequest], EvalReport], args: argparse.Namespace,
             evaluate_suite: SuiteEvaluator | None = None) -> int:
    """Evaluate parsed arguments (``build_parser``'s options) and print the summary (``run_cli``).

    The console and server settings it exports for the evaluation's processes are undone after,
    so a caller that runs it in-process (a test, a script) keeps its own environment.
    """
    with restored_environment([*quiet_environment(), SERVER_MODE_ENV, QUIET_ENV, TELEMETRY_ENV]), \
            mlflow_logger.opted_in(), warm_forkserver.opted_in():
        telemetry_off()  # before anything imports MLflow: it reads the setting on import
        code = _run_eval(evaluate, args, evaluate_suite)
        leave_shared_processes()
        return code


def leave_shared_processes() -> None:
    """After a run that used the shared local server, and its summary: the processes later runs share.

    A logger that keeps MLflow imported (``mlflow_logger``) and a fork server that keeps the
    workers' imports (``warm_forkserver``), each started unless one of its kind runs. Started
    last, their imports compete with nothing of this run.
    """
    from evalfleet.cluster import leave_warm_fork_server
    from evalfleet.server import take_used

    if take_used():
        mlflow_logger.ensure_started()
        leave_warm_fork_server()


def _run_eval(evaluate: Callable[[EvalRequest], EvalReport], args: argparse.Namespace,
              evaluate_suite: SuiteEvaluator | None) -> int:
    verbose = bool(getattr(args, "verbose", False))
    configure_console(verbose, quiet=bool(getattr(args, "quiet", False)))
    if getattr(args, "ephemeral_server", False):
        os.environ[SERVER_MODE_ENV] = "ephemeral"
    if getattr(args, "suite", None):
        return run_suite(evaluate_suite, args)
    try:
        with stop_on_sigterm():
            request = request_from_args(args)
            if args.gate and (request.training_run_id is None or request.step is None):
                raise RequestError(
                    "--gate compares this evaluation with the best earlier checkpoint of its "
                    "training run: it needs --training-run-id and --step (got "
                    f"{request.training_run_id!r}, {request.step!r}). Pass both, or drop --gate.")
            check_training_pair(request)
            check_report_path(args.report, report_inputs(args))
            report = evaluate(request)
    except EvalfleetError as err:
        return error_exit(err)
    except (Stopped, KeyboardInterrupt) as err:
        signum = err.signum if isinstance(err, Stopped) else signal.SIGINT
        where = "; ".join(_notes(err))
        print(f"evalfleet: stopped by {signal.Signals(signum).name}"
              + (f" {where}" if where else "") + "; episodes stored so far stay in the cache",
              file=sys.stderr)
        return 128 + signum
    except Exception as err:  # anything else: one paragraph, the traceback only with -v
        if verbose:
            traceback.print_exc()
        print(failure_paragraph(err, verbose), file=sys.stderr)
        return EXIT_FAILED
    report = write_report(args.report, report)
    print(summary_text(report))
    # A recording asked for and not written is a missing output, never waived: --allow-failures
    # is about coverage. It exited 0 with 0 of 2 videos, as the hint below once suggested.
    # Nor are results whose inputs changed while they ran: their numbers mix two versions.
    unwaived = [a for a in report.alarms
                if a.startswith((f"{RECORDING_INCOMPLETE}: ", f"{INPUTS_CHANGED}: "))]
    if unwaived or (report.harness_fault and not args.allow_failures):
        why = "; ".join(unwaived) if unwaived else (
            "more than 5% of episodes failed in the harness (coverage "
            f"{percent_beyond(report.coverage, 1 - FAILURE_ALARM_RATE)})"
            " (pass --allow-failures to exit 0 anyway)")
        print(f"evalfleet: harness fault: {why}", file=sys.stderr)
        return EXIT_HARNESS_FAULT
    if report.missing_outputs:
        return output_missing(report.missing_outputs)
    if args.gate:
        return gate(report)
    return EXIT_OK


def output_missing(missing: list[str]) -> int:
    """Say which outputs asked for are missing; returns ``EXIT_OUTPUT_MISSING``."""
    print(f"evalfleet: outputs asked for are missing: {'; '.join(missing)}. The episodes and "
          f"statistics are written (Parquet, cache, report.json); fix the cause and re-run, "
          f"with --refresh if the review is missing (exit {EXIT_OUTPUT_MISSING})", file=sys.stderr)
    return EXIT_OUTPUT_MISSING


def gate(report: EvalReport) -> int:
    """``--gate``: ``EXIT_REGRESSION`` on a significant regression against the best checkpoint.

    Passes (``EXIT_OK``) only on a verdict of ``GATE_PASSES`` whose comparison dropped no pairs
    past an alarm (``history_pairs_unmatched``, ``history_pairs_harness``); a gate that could not
    compare (history unreadable, ``no_paired_episodes``, ``protocol_changed``, such an alarm)
    exits ``EXIT_GATE_UNDECIDED``: it fails closed. So does one of a checkpoint evaluated after
    later steps (``history_out_of_order``): they were judged without it.
    """
    from evalfleet.history import gamed

    history = report.history or {}
    verdict = history.get("verdict")
    # Pairs the comparison left out (no row of the best checkpoint, or the harness failed on a
    # side) may be exactly where the two differ: a pass resting on the rest is no pass.
    # Failures of the policy scoring above its completed episodes flatter it the same way.
    # So does a reward that may be gamed (history.gamed: the return rose while the task outcome
    # fell, or the outcome went unreported on seeds the earlier checkpoint reported it on).
    biased = [a.split(":", 1)[0] for a in report.alarms
              if a.startswith(("history_pairs_unmatched:", "history_pairs_harness:",
                               "policy_failures_flatter:", "history_pairs_policy_flatter:"))]
    biased += gamed(history.get("alarms") or [])
    late = [a for a in report.alarms if a.startswith("history_out_of_order:")]
    # A harness fault's numbers are not trusted (--allow-failures waives its exit 3, not that):
    # a pass resting on them let a checkpoint whose worst seeds never ran through the gate.
    if verdict in GATE_PASSES and not biased and not late and not report.harness_fault:
        return EXIT_OK
    if verdict != "regression":
        why = (f"the training run's history could not be read ({history['error']})"
               if history.get("error") else "; ".join(late) if late else
               f"verdict {verdict!r} of an evaluation that is a harness fault (coverage "
               f"{percent(report.coverage, 2)}: more than 5% of its episodes failed in the harness, "
               "so its numbers do not pass a gate, whatever --allow-failures waives)"
               if report.harness_fault else
               f"verdict {verdict!r} with {' and '.join(biased)} (the paired comparison left "
               "out pairs where the two may differ, failures of the policy scored above its "
               "completed episodes, or the reward may be gamed)" if biased else
               f"verdict {verdict!r}: {history.get('note') or 'no comparison was made'}")
        print(f"evalfleet: gate: step {report.step} could not be compared with the best earlier "
              f"checkpoint of training run {report.training_run_id!r}, so it does not pass: {why}. "
              "The evaluation's results are written; fix the cause (the MLflow store, the best "
              "checkpoint's episodes) and re-run, or promote by hand after reading the report "
              f"(exit {EXIT_GATE_UNDECIDED})", file=sys.stderr)
        return EXIT_GATE_UNDECIDED
    c = history.get("comparison") or {}
    print(f"evalfleet: gate: step {report.step} is a regression against the best checkpoint "
          f"(step {history.get('best_step')}): paired difference {c.get('mean_diff', float('nan')):+.4g}, "
          f"95% CI [{c['ci']['low']:.4g}, {c['ci']['high']:.4g}] over {c.get('n')} episodes "
          f"(exit {EXIT_REGRESSION})", file=sys.stderr)
    return EXIT_REGRESSION


def add_history_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``evalfleet history RUN_ID``."""
    p.add_argument("training_run_id", metavar="RUN_ID", help="the trainer's run id")
    p.add_argument("--output", default="results", help="results folder (default MLflow store)")
    p.add_argument("--mlflow-uri", default=None,
                   help="MLflow tracking URI (default: sqlite:///OUTPUT/mlflow.db)")
    p.add_argument("--plot", default=None,
                   help="where to save the plot (default OUTPUT/history/RUN_ID.png)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def history_table(rows: Sequence[dict[str, object]]) -> str:
    """The curve rows as a terminal table: one line per evaluated step."""
    def num(v: object, fmt: str) -> str:
        return "-" if v is None else format(float(v), fmt)  # type: ignore[arg-type]

    head = (f"{'step':>8}  {'return':>10}  {'95% CI':<21}  {'success':>7}  {'fail':>6}  "
            f"{'length':>7}  {'verdict':<19}  {'protocol':<8}  alarms")
    lines = [head]
    protocols = {r.get("protocol") for r in rows}
    for r in rows:
        ci = f"[{num(r.get('reward_ci_low'), '.4g')}, {num(r.get('reward_ci_high'), '.4g')}]"
        alarms = ", ".join(r.get("alarms") or []) or "-"  # type: ignore[arg-type]
        best = " *" if r.get("best") else ""
        rate = r.get("failure_rate")
        fail = "-" if rate is None else percent(float(rate), 1)  # type: ignore[arg-type]
        lines.append(f"{r['step']!s:>8}  {num(r.get('reward'), '.4g'):>10}  {ci:<21}  "
                     f"{num(r.get('success_rate'), '.3f'):>7}  {fail:>6}  "
                     f"{num(r.get('episode_length'), '.4g'):>7}  {str(r.get('verdict') or '-') + best:<19}  "
                     f"{str(r.get('protocol') or '-')[:8]:<8}  {alarms}")
    if len(protocols) > 1:  # one curve, steps that were never compared with each other
        lines.append(f"{len(protocols)} protocols on this curve (env code or spec, seed, step cap, "
                     "determinism, env inputs): a verdict compares only steps of its own protocol")
    return "\n".join(lines)


def run_history(args: argparse.Namespace) -> int:
    """``evalfleet history RUN_ID``: the run's evaluations over steps, as a table and a plot."""
    from evalfleet.history import HistoryError, checkpoints, curve_row
    from evalfleet.tracking import default_tracking_uri

    uri = args.mlflow_uri or default_tracking_uri(Path(args.output))
    try:
        rows = [curve_row(c) for c in checkpoints(uri, args.training_run_id)]
    except HistoryError as err:
        print(f"evalfleet: error: {err}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    if not rows:
        print(f"evalfleet: no evaluations of training run {args.training_run_id!r} with a step in "
              f"{uri}; evaluate with --training-run-id and --step", file=sys.stderr)
        return EXIT_BAD_REQUEST
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(history_table(rows))
        print("* = best checkpoint when evaluated")
    from evalfleet.plots import render_history

    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in args.training_run_id)
    plot = Path(args.plot) if args.plot else Path(args.output) / "history" / f"{safe}.png"
    render_history(rows, plot, title=f"training run {args.training_run_id}")
    print(f"plot: {plot}", file=sys.stderr if args.json else sys.stdout)
    return EXIT_OK


if __name__ == "__main__":  # the parser lives here; the flows that evaluate do not (layers)
    print("evalfleet: error: python -m evalfleet.cli runs nothing: use 'evalfleet eval ...' or "
          "'python flows/eval.py ...' (the same options), and 'evalfleet server|cache|history|mlflow "
          "...' for the rest.", file=sys.stderr)
    sys.exit(EXIT_BAD_REQUEST)
