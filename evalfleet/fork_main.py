"""Imported first by the local workers' fork server: its children skip the driver's main script.

A child of a fork server runs the driver's main script again (as ``__mp_main__``), unless the
server's ``__main__`` names the same file (``multiprocessing.spawn._fixup_main_from_path``).
Workers need nothing of that script: tasks reach them pickled (a function of ``__main__`` by value)
and policies by module name (``snapshots.factory_ref`` names a script's function by its file).
Running it again cost each worker start ~1 s of CPU for ``python flows/eval.py`` (its imports, and
Prefect building each flow's parameter schema), and a training script's whole import stack for an
``Evaluator`` in one. ``EVALFLEET_FORK_MAIN`` is set for the server only (``cluster``).
"""

from __future__ import annotations

import os
import sys

MAIN_ENV = "EVALFLEET_FORK_MAIN"

_path = os.environ.pop(MAIN_ENV, None)
if _path and not getattr(sys.modules["__main__"], "__file__", None):
    sys.modules["__main__"].__file__ = _path

# The workers forked from this server each seed numpy's global state anew (``seeds``).
from evalfleet.seeds import fresh_global_rng  # noqa: E402

os.register_at_fork(after_in_child=fresh_global_rng)
