"""Prefect's API clients share one TLS context per CA file instead of loading it per client.

Prefect 3.8 builds a new ``SyncPrefectClient`` (and with it ``ssl.create_default_context(cafile=
certifi.where())``, which parses the whole CA bundle: ~22 ms here) every time a task run starts on
a Dask worker, twice per task run (the hydrated flow-run context and the task's client context).
Measured on this machine: a trivial task run cost a worker ~115 ms of CPU, 58 ms with this (200
task runs on 2 workers: 20.6 s, then 13.5 s). An evaluation runs a few shard task runs per 1,000
episodes, so there it is ~1% of the run stage; the driver's clients share the context too.

A verified TLS context is only read once made (``httpx`` wraps sockets with it), so one per CA
file serves every client of the process. This module gives Prefect's client module a view of
``ssl`` whose ``create_default_context`` returns that shared context for a CA file; every other
call (no CA file: the insecure-skip-verify branch, which changes the context it gets) still makes a
new one. Installed only where checked: Prefect ``TESTED_PREFECT``, whose client module uses the ``ssl``
module itself; anywhere else Prefect keeps its own behaviour. The shared context is the one Prefect would have
made (same CA file, same defaults); with a file that changes while the process runs, its
certificates are those of the first read.
"""

from __future__ import annotations

import functools
import logging
import ssl
import types
from typing import Any

import prefect
from prefect.client import orchestration

logger = logging.getLogger(__name__)

#: Prefect releases (major.minor) whose client module this was checked against.
TESTED_PREFECT = ("3.8",)


@functools.lru_cache(maxsize=8)
def _verified_context(cafile: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cafile)


def _create_default_context(purpose: Any = ssl.Purpose.SERVER_AUTH, *, cafile: Any = None,
                            capath: Any = None, cadata: Any = None) -> ssl.SSLContext:
    if cafile is not None and capath is None and cadata is None \
            and purpose == ssl.Purpose.SERVER_AUTH:
        return _verified_context(str(cafile))
    return ssl.create_default_context(purpose, cafile=cafile, capath=capath, cadata=cadata)


class _SharedContexts(types.ModuleType):
    """``ssl`` as Prefect's client module sees it: shared verified contexts, all else as is."""

    create_default_context = staticmethod(_create_default_context)

    def __getattr__(self, name: str) -> Any:
        return getattr(ssl, name)


def installable(version: str = prefect.__version__) -> bool:
    """True when Prefect ``version``'s client module is one this was checked against."""
    current = getattr(orchestration, "ssl", None)
    return (".".join(version.split(".")[:2]) in TESTED_PREFECT
            and (current is ssl or isinstance(current, _SharedContexts)))


def install(version: str = prefect.__version__) -> bool:
    """Share verified TLS contexts among this process's Prefect clients; False if untested."""
    if not installable(version):
        logger.debug("Prefect %s is not one of %s: its clients make their own TLS contexts",
                     version, TESTED_PREFECT)
        return False
    if not isinstance(orchestration.ssl, _SharedContexts):
        orchestration.ssl = _SharedContexts("ssl")  # type: ignore[attr-defined]
    return True
