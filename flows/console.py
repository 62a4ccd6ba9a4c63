"""The ``evalfleet`` command: ``eval`` (the flow's CLI), ``cache ls|rm``, ``serve``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: evalfleet COMMAND [ARGS]

commands:
  eval   ...   run an evaluation (same options as python flows/eval.py)
  cache  ls|rm list or remove stored episodes
  serve  ...   start the service: Prefect server, Dask cluster, deployment, webhook receiver
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "eval":
        from evalfleet.cli import run_cli
        from flows.eval import evaluate

        return run_cli(evaluate, rest)
    if command == "cache":
        from evalfleet.cli import cache_command

        return cache_command(rest)
    if command == "serve":
        from deployments.cli import main as serve_main

        return int(serve_main(rest) or 0)
    print(f"evalfleet: unknown command {command!r}. Choose eval, cache or serve.\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
