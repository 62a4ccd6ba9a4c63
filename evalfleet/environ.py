"""Changes to this process's environment that last one block (what children started in it inherit)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager


@contextmanager
def restored_environment(keys: Sequence[str]) -> Iterator[None]:
    """Put ``keys`` of ``os.environ`` back as they were when the block ends."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def exported(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` within the block, then as it was before."""
    with restored_environment(list(env)):
        os.environ.update(env)
        yield


def current_umask() -> int:
    """The umask of this process, read from ``/proc`` (setting it to read it races other threads).

    Raises ``OSError`` or ``ValueError`` where ``/proc/self/status`` does not say it.
    """
    with open("/proc/self/status", encoding="ascii", errors="replace") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    raise ValueError("/proc/self/status has no Umask line")
