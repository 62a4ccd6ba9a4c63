"""The ``evalfleet`` command: ``eval``, ``cache``, ``history``, ``server``, ``mlflow``, ``serve``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from evalfleet.cli import (
    EVAL_DESCRIPTION,
    add_cache_commands,
    add_eval_arguments,
    add_history_arguments,
)


def _eval(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from evalfleet.cli import run_eval
    from flows.eval import evaluate
    from flows.suite import evaluate_suite

    return run_eval(evaluate, args, evaluate_suite)


def _cache(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from evalfleet.cli import run_cache

    return run_cache(args)


def _history(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from evalfleet.cli import run_history

    return run_history(args)


def _server(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from evalfleet.server import server_command

    return server_command(args.action)


def _mlflow(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from evalfleet.tracking import flush_pending

    results = flush_pending(args.output, args.mlflow_uri)
    for r in results:
        print(f"{r['pending']}: " + (f"logged as run {r['mlflow_run_id']}" if "mlflow_run_id" in r
                                     else f"still queued ({r['error']})"))
    left = sum("error" in r and "busy" not in r for r in results)
    busy = sum("busy" in r for r in results)
    print(f"{len(results) - left - busy} logged, {left} still queued"
          + (f", {busy} being logged by another process" if busy else ""))
    return 1 if left else 0


def _serve(args: argparse.Namespace, rest: Sequence[str]) -> int:
    # Imported only here: the service's modules take a second or more to import.
    from deployments.cli import main as serve_main

    return int(serve_main(list(rest)) or 0)


def build_parser() -> argparse.ArgumentParser:
    """``evalfleet`` and its subcommands (``serve``'s options belong to ``deployments.cli``)."""
    p = argparse.ArgumentParser(prog="evalfleet", description="Policy evaluation for RL training loops.")
    commands = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    run = commands.add_parser("eval", help="run an evaluation (same options as python flows/eval.py)",
                              description=EVAL_DESCRIPTION,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_eval_arguments(run)
    run.set_defaults(handler=_eval)
    cache = commands.add_parser("cache", help="list or remove stored episodes (ls|rm)",
                                description="List or remove cache entries.")
    add_cache_commands(cache)
    cache.set_defaults(handler=_cache)
    history = commands.add_parser(
        "history", help="a training run's evaluations over its steps: table and plot",
        description="Return with 95%% CI, success rate, failure rate and episode length of every "
        "evaluated step of a training run (read from MLflow), verdicts and alarms; saves a plot.")
    add_history_arguments(history)
    history.set_defaults(handler=_history)
    server = commands.add_parser(
        "server", help="the shared local Prefect server: status|start|stop",
        description="The local Prefect server evaluations share when PREFECT_API_URL is unset: "
        "started by the first evaluation, reused by later ones (state in $EVALFLEET_HOME, "
        "default ~/.evalfleet).")
    server.add_argument("action", choices=["status", "start", "stop"],
                        help="status: url, pid, uptime (exit 1 if not running); start; stop")
    server.set_defaults(handler=_server)
    mlflow = commands.add_parser("mlflow", help="log MLflow runs queued while the store was down "
                                 "(flush)", description="Log queued MLflow runs.")
    mlflow.add_argument("action", choices=["flush"], help="log every queued run once")
    mlflow.add_argument("--output", default="results", help="results folder whose queue to flush")
    mlflow.add_argument("--mlflow-uri", default=None,
                        help="log to this tracking URI instead of the one each run was queued with")
    mlflow.set_defaults(handler=_mlflow)
    # serve parses its own options (and --help): everything after the word goes to it.
    serve = commands.add_parser("serve", add_help=False,
                                help="start the service: Prefect server, Dask cluster, deployment, "
                                "webhook receiver (evalfleet serve --help)")
    serve.set_defaults(handler=_serve)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the subcommand; returns its exit code."""
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 0
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(args.handler(args, rest))


if __name__ == "__main__":
    raise SystemExit(main())
