"""The environment variables a sandbox process sees: an allow-list, never the worker's whole set.

A worker holds credentials (cloud keys, ``PREFECT_API_KEY``, tracking tokens, under ``evalfleet
serve`` possibly the service's signing secrets); env code in a sandbox gets none of them. It
sees the names in :data:`ALLOWED` and those starting with :data:`ALLOWED_PREFIXES`, with the
worker's values, plus ``HOME`` and ``TMPDIR`` set to its own folder. A request adds names with
``sandbox_env_allow`` (CLI ``--sandbox-env NAME``, repeated); those reach env code as they are.
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


def allowed(name: str, extra: Iterable[str] = ()) -> bool:
    """True if a sandbox may see the variable ``name``."""
    return name in ALLOWED or name.startswith(ALLOWED_PREFIXES) or name in set(extra)


def sandbox_environment(extra: Iterable[str] = (), environ: Mapping[str, str] | None = None
                        ) -> dict[str, str]:
    """The allowed subset of ``environ`` (default ``os.environ``), plus the ``extra`` names."""
    env = os.environ if environ is None else environ
    names = set(extra)
    return {k: v for k, v in env.items() if allowed(k, names)}
