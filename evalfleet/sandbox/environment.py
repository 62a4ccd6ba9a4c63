"""The environment variables a sandbox process sees: an allow-list, never the worker's whole set.

A worker holds credentials (cloud keys, ``PREFECT_API_KEY``, tracking tokens, under ``evalfleet
serve`` possibly the service's signing secrets); env code in a sandbox gets none of them. It
sees the names in :data:`ALLOWED` and those starting with :data:`ALLOWED_PREFIXES`, with the
worker's values, plus ``HOME`` and ``TMPDIR`` set to its own folder. A request adds names with
``sandbox_env_allow`` (CLI ``--sandbox-env NAME``, repeated); those reach env code as they are.

Of the allowed names, :data:`PINNED` have one value in every sandbox whatever the worker's, and
the cache key holds the values of :data:`KEYED` (``cache.env_environment``): each of them can
change an episode. The rest say where code and tools are found (the code is keyed by its
versions), or only affect diagnostics and sound.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

#: What Python, numpy/BLAS and common renderers need; nothing that names a service or account.
ALLOWED = (
    "PATH", "LANG", "LANGUAGE", "TZ", "TERM",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING", "PYTHONUTF8",
    "PYTHONNOUSERSITE", "PYTHONWARNINGS", "PYTHONFAULTHANDLER", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "SDL_VIDEODRIVER", "SDL_AUDIODRIVER", "MUJOCO_GL", "PYOPENGL_PLATFORM",
)
#: Name prefixes allowed as a family (locale categories).
ALLOWED_PREFIXES = ("LC_",)

#: Values every sandbox gets, whatever the worker's. The thread caps: one thread per sandbox,
#: and BLAS results do not follow the worker's setting. The hash seed orders sets and dicts of
#: strings (an env's action menu built from a ``set``): a tox run's random one, or a driver's
#: ``PYTHONHASHSEED=12345``, gave other episodes under one cache key. 6640 is what Dask gives its
#: workers (evalfleet's local workers hash with it), so ``inprocess`` and sandboxes agree there.
PINNED = {"PYTHONHASHSEED": "6640", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
          "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1", "VECLIB_MAXIMUM_THREADS": "1"}

#: Allowed names whose values can change an episode, keyed by value: the locale and text
#: encoding (what ``open()`` decodes a data file as; a C parser's decimal comma), the time zone,
#: warnings made errors, which native libraries load, and which renderer draws pixel observations.
KEYED = ("LANG", "LANGUAGE", "TZ", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONWARNINGS",
         "LD_LIBRARY_PATH", "SDL_VIDEODRIVER", "MUJOCO_GL", "PYOPENGL_PLATFORM")


def allowed(name: str, extra: Iterable[str] = ()) -> bool:
    """True if a sandbox may see the variable ``name``."""
    return name in ALLOWED or name.startswith(ALLOWED_PREFIXES) or name in set(extra)


def sandbox_environment(extra: Iterable[str] = (), environ: Mapping[str, str] | None = None
                        ) -> dict[str, str]:
    """The allowed subset of ``environ`` (default ``os.environ``), plus the ``extra`` names."""
    env = os.environ if environ is None else environ
    names = set(extra)
    return {k: v for k, v in env.items() if allowed(k, names)}


def keyed(name: str) -> bool:
    """True if the value of the allowed variable ``name`` is in the cache key (:data:`KEYED`)."""
    return name in KEYED or name.startswith(ALLOWED_PREFIXES)
