"""The CLI's terminal: no library INFO lines by default, all of them with -v, failures in one paragraph."""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evalfleet.cli import EXIT_FAILED, build_parser, run_eval
from evalfleet.console import quiet_environment
from evalfleet.environ import restored_environment

ROOT = Path(__file__).resolve().parents[2]
#: A log line of Prefect's console format, or of distributed's/mlflow's own, at INFO.
INFO_LINE = re.compile(r"\|\s*INFO\s*\||\bINFO\b.*\b(distributed|prefect|mlflow)\b")


def _cli(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    for key in ("PREFECT_LOGGING_SETTINGS_PATH", "DASK_LOGGING__DISTRIBUTED", "MLFLOW_LOGGING_LEVEL"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, "flows/eval.py", "--episodes", "4", "--concurrency", "4", "--workers", "1",
         "--no-cache", "--no-audit", "--output", str(tmp_path / "out"), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_default_run_prints_no_info_lines_and_verbose_does(prefect_server, tmp_path):
    quiet = _cli(tmp_path)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    noisy = [line for line in (quiet.stdout + quiet.stderr).splitlines() if INFO_LINE.search(line)]
    assert noisy == [], noisy[:10]
    # Nor Dask's warnings about the workers stopped before stages 6-7 (their results are in hand).
    dask = [line for line in quiet.stderr.splitlines() if "distributed." in line]
    assert dask == [], dask[:5]
    assert "mean return" in quiet.stdout and "episodes" in quiet.stdout  # the summary table

    loud = _cli(tmp_path, "-v")
    assert loud.returncode == 0, loud.stderr[-3000:]
    lines = (loud.stdout + loud.stderr).splitlines()
    assert any(re.search(r"INFO.*distributed\.", line) for line in lines), loud.stderr[-2000:]
    assert any(re.search(r"INFO.*Task run 'run-episodes", line) for line in lines), loud.stderr[-2000:]


@pytest.mark.slow
def test_quiet_prints_the_summary_alone(prefect_server, tmp_path):
    # -q was accepted and did nothing: warnings (the device fallback, on a machine without a
    # GPU, as CI's) still came before the summary.
    quiet = _cli(tmp_path, "-q")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "WARNING" not in quiet.stderr, quiet.stderr[-2000:]
    assert "mean return" in quiet.stdout


def test_quiet_keeps_errors_and_hides_warnings(monkeypatch):
    import logging

    from evalfleet.console import QUIET_ENV, QuietConsole, configure_console

    # configure_console sets this process's environment and root logger: put back after, or
    # later tests' CLI children inherit a quiet Prefect logging config (monkeypatch.delenv of
    # an absent variable records nothing to restore).
    monkeypatch.setattr(QuietConsole, "floor", QuietConsole.floor)
    level = logging.getLogger().level
    record = logging.LogRecord("evalfleet.cluster", logging.WARNING, __file__, 1, "w", None, None)
    error = logging.LogRecord("evalfleet.cluster", logging.ERROR, __file__, 1, "e", None, None)
    with restored_environment([*quiet_environment(), QUIET_ENV]):
        try:
            configure_console(False, quiet=True)
            assert os.environ[QUIET_ENV] == "1"  # no progress bar either (flows.progress)
            assert not QuietConsole().filter(record) and QuietConsole().filter(error)
            configure_console(False)
            assert QUIET_ENV not in os.environ and QuietConsole().filter(record)
        finally:
            logging.getLogger().setLevel(level)


@pytest.fixture
def in_process_cli(monkeypatch):
    """run_eval in this process: its environment and root logger level are put back after."""
    import logging

    for key in quiet_environment():
        monkeypatch.delenv(key, raising=False)
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _broken(request):
    try:
        raise KeyError("shard 3")
    except KeyError as err:
        raise RuntimeError("the run stage lost\n  its worker:\n\tconnection reset") from err


def test_an_unexpected_failure_is_one_paragraph(capsys, in_process_cli):
    code = run_eval(_broken, _args("--episodes", "4"))
    err = capsys.readouterr().err
    assert code == EXIT_FAILED
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("evalfleet: error: the evaluation failed: RuntimeError: "
                          "the run stage lost its worker: connection reset."), err
    assert "-v" in err


def test_verbose_failure_adds_the_traceback(capsys, in_process_cli):
    code = run_eval(_broken, _args("--episodes", "4", "-v"))
    err = capsys.readouterr().err
    assert code == EXIT_FAILED
    assert "Traceback" in err and "KeyError: 'shard 3'" in err
    assert err.rstrip().splitlines()[-1].startswith("evalfleet: error: the evaluation failed")
