"""``evalfleet serve`` refuses a service that cannot run an evaluation, at parse time.

``--workers 0`` came up "ready" with no Dask workers: every webhook was answered 202, and its
run failed about 50 s later (WorkerStartTimeoutError). ``--poll 0.2`` was rounded to 1 s
without a word.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from deployments import cli, serve


@pytest.mark.parametrize("parser", [cli.build_parser, serve.build_parser])
@pytest.mark.parametrize("argv,error", [
    (["--limit", "0"], "argument --limit: must be at least 1 (got 0)"),
    (["--limit", "-2"], "argument --limit: must be at least 1 (got -2)"),
    (["--limit", "two"], "argument --limit: expected an integer >= 1, got 'two'"),
    (["--poll", "0.2"], "argument --poll: expected whole seconds >= 1, got '0.2': Prefect's runner "
     "polls for scheduled runs every whole number of seconds, at least 1 (pass e.g. 1)"),
    (["--poll", "1.5"], "argument --poll: expected whole seconds >= 1, got '1.5'"),
    (["--poll", "0"], "argument --poll: expected whole seconds >= 1, got '0'"),
])
def test_bad_service_options_are_refused(parser: Callable[[], argparse.ArgumentParser],
                                         argv: list[str], error: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        parser().parse_args(argv)
    assert refused.value.code == 2 and error in capsys.readouterr().err


def test_no_workers_is_refused_and_good_values_parse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        cli.build_parser().parse_args(["--workers", "0"])
    assert refused.value.code == 2
    assert "argument --workers: must be at least 1 (got 0)" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["--workers", "1", "--limit", "3", "--poll", "2"])
    assert (args.workers, args.limit, args.poll) == (1, 3, 2)
    defaults = serve.build_parser().parse_args([])
    assert (defaults.limit, defaults.poll) == (2, 1)
    assert serve.build_parser().parse_args(["--poll", str(args.poll)]).poll == 2  # as cli hands it on
