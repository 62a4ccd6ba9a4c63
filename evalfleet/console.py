"""What the CLI's terminal shows: warnings and the summary by default, library INFO logs with -v.

An evaluation runs in several processes (this one, Dask workers, the Prefect server), so the quiet
default is set twice: through environment variables that every process started from here reads
when it configures its logging, and on the handlers this process already has (Prefect configures
logging when it is imported, which ``python flows/eval.py`` does before parsing its arguments).
Only the console is quieted: Prefect's API handlers still send every record to the server.
"""

from __future__ import annotations

import logging
import os
from importlib.resources import files

#: Prefect's logging config with a quiet console handler (WARNING, no tracebacks).
QUIET_PREFECT_LOGGING = str(files("evalfleet") / "data" / "quiet-logging.yml")

#: Loggers of the libraries under the flow whose INFO lines are noise on a terminal. Prefect's
#: are not among them: their level also gates what reaches the API (the flow run's logs).
LIBRARY_LOGGERS = ("distributed", "mlflow", "alembic", "httpx", "uvicorn", "bokeh", "tornado")


#: Set (to "1") while a ``-q`` run prints only its summary: no progress bar, no warnings.
QUIET_ENV = "EVALFLEET_QUIET"


class QuietConsole(logging.Filter):
    """Keep tracebacks off the console: the CLI reports a failure once, in one paragraph.

    ``floor``: the lowest level shown, WARNING by default, ERROR under ``-q``.
    """

    floor = logging.WARNING

    def filter(self, record: logging.LogRecord) -> bool:
        """Drop records that carry an exception or are below ``floor``; keep the rest."""
        return record.levelno >= QuietConsole.floor and record.exc_info is None and not record.exc_text


def quiet_environment() -> dict[str, str]:
    """Environment variables that quiet the console of every process started after them."""
    return {
        "PREFECT_LOGGING_SETTINGS_PATH": QUIET_PREFECT_LOGGING,
        "DASK_LOGGING__DISTRIBUTED": "warning",
        "MLFLOW_LOGGING_LEVEL": "WARNING",
    }


def configure_console(verbose: bool, quiet: bool = False) -> None:
    """Set up the terminal's logging for one CLI run: quiet unless ``verbose``.

    ``quiet`` (``-q``): errors only, and no progress bar (``QUIET_ENV``): the summary alone.
    A variable the user already set is left alone, so a custom Prefect logging file still wins.
    """
    QuietConsole.floor = (logging.NOTSET if verbose else logging.ERROR if quiet
                          else logging.WARNING)
    if quiet and not verbose:
        os.environ[QUIET_ENV] = "1"
    else:
        os.environ.pop(QUIET_ENV, None)
    root = logging.getLogger()
    if verbose:
        for key, value in quiet_environment().items():  # a quiet parent's choice is not ours
            if os.environ.get(key) == value:
                del os.environ[key]
        if not root.handlers:
            logging.basicConfig(level=logging.INFO,
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        root.setLevel(logging.INFO)
        for name in ("distributed", "evalfleet", "flows", "tasks"):
            logging.getLogger(name).setLevel(logging.INFO)
        return
    for key, value in quiet_environment().items():
        os.environ.setdefault(key, value)
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    root.setLevel(logging.WARNING)
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level < logging.WARNING:
            logger.setLevel(logging.WARNING)
    # Prefect's console handler of this process, configured at import before this ran.
    for logger in [root, *[logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]]:
        for handler in logger.handlers:
            if type(handler).__name__ == "PrefectConsoleHandler" or (
                    isinstance(handler, logging.StreamHandler)
                    and getattr(handler, "stream", None) is not None
                    and getattr(handler.stream, "name", "") in ("<stderr>", "<stdout>")):
                handler.setLevel(max(handler.level, logging.WARNING))
                if not any(isinstance(f, QuietConsole) for f in handler.filters):
                    handler.addFilter(QuietConsole())
