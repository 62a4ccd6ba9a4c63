"""Scrubbing secret values out of texts that leave a process (errors, metric names, reports).

An env that raises ``RuntimeError(os.environ)`` must not carry a signing key into Parquet, MLflow,
a Prefect artifact or a signed callback. Sandboxes see an allow-listed environment
(:mod:`evalfleet.sandbox.environment`), but an ``inprocess`` env runs inside the worker and reads
whatever it holds, so every text that becomes part of a result is scrubbed: on the worker when
rows are built, and once more in the driver before anything is written.

A *secret* is the value of an environment variable whose name looks like one
(:data:`SECRET_NAME`), plus values registered with :func:`register_secret` (a service that
removes its secrets from ``os.environ`` before starting workers keeps scrubbing them). Values
shorter than :data:`MIN_SECRET_LENGTH` are left alone: replacing ``"1"`` or ``"true"`` would
mangle every text without protecting anything.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the fork server imports this module; it must not pay for pyarrow
    import pyarrow as pa

#: Names of environment variables whose values are treated as secrets (case-insensitive).
SECRET_NAME = re.compile(r"SECRET|TOKEN|KEY|PASSWORD|PASSWD|CREDENTIAL|AUTH|PRIVATE|SIGNATURE",
                         re.IGNORECASE)
#: Values shorter than this are not scrubbed (too common to be secrets, too short to guess at).
MIN_SECRET_LENGTH = 8

_registered: dict[str, str] = {}
_registered_lock = threading.Lock()


def register_secret(name: str, value: str) -> None:
    """Scrub ``value`` (labelled ``name``) in this process even once it leaves ``os.environ``."""
    if value:
        with _registered_lock:
            _registered[name] = value


def secret_values(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{value: name}`` of every secret known here: secret-like variables and registered ones."""
    env = os.environ if environ is None else environ
    found: dict[str, str] = {}
    with _registered_lock:
        registered = list(_registered.items())
    for name, value in [*registered, *env.items()]:
        if len(value) >= MIN_SECRET_LENGTH and _secret_name(name) and value not in found:
            found[value] = name
    return found


@functools.lru_cache(maxsize=4096)
def _secret_name(name: str) -> bool:
    return SECRET_NAME.search(name) is not None


@functools.lru_cache(maxsize=8)
def _pattern(secrets: tuple[tuple[str, str], ...]) -> tuple[re.Pattern[str], dict[str, str]] | None:
    # Each value also as repr() and JSON write it (a dict's repr escapes quotes and backslashes).
    spellings: dict[str, str] = {}
    for value, name in secrets:
        for form in (value, repr(value)[1:-1], json.dumps(value)[1:-1]):
            if len(form) >= MIN_SECRET_LENGTH:
                spellings.setdefault(form, name)
    if not spellings:
        return None
    alternatives = sorted(spellings, key=len, reverse=True)  # longest first: no partial overlaps
    return re.compile("|".join(re.escape(a) for a in alternatives)), spellings


def _current() -> tuple[re.Pattern[str], dict[str, str]] | None:
    return _pattern(tuple(secret_values().items()))


class Redactor:
    """The secrets known at construction, applied to many texts (reading os.environ is slow)."""

    def __init__(self) -> None:
        self._compiled = _current()

    @property
    def active(self) -> bool:
        """True if there is any secret to scrub."""
        return self._compiled is not None

    def text(self, text: str) -> str:
        """``text`` with every secret value replaced by ``[redacted:NAME]``."""
        compiled = self._compiled
        if compiled is None or not text:
            return text
        pattern, names = compiled
        return pattern.sub(lambda m: f"[redacted:{names[m.group(0)]}]", text)

    def optional(self, text: str | None) -> str | None:
        """:meth:`text`, passing ``None`` through."""
        return None if text is None else self.text(text)

    def keys(self, values: Mapping[str, float]) -> dict[str, float]:
        """A metrics mapping whose names are scrubbed (values are numbers and carry no text)."""
        if self._compiled is None:
            return dict(values)
        return {self.text(k): v for k, v in values.items()}

    def json(self, obj: Any) -> Any:
        """A JSON-like structure with every string (keys included) scrubbed."""
        if self._compiled is None:
            return obj
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {self.text(k) if isinstance(k, str) else k: self.json(v)
                    for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self.json(v) for v in obj)
        return obj


def redact(text: str) -> str:
    """``text`` with every known secret value replaced by ``[redacted:NAME]``."""
    return Redactor().text(text)


def redact_optional(text: str | None) -> str | None:
    """:func:`redact`, passing ``None`` through."""
    return None if text is None else redact(text)


def redact_keys(values: Mapping[str, float]) -> dict[str, float]:
    """A metrics mapping whose names are scrubbed (values are numbers and carry no text)."""
    return Redactor().keys(values)


def redact_json(obj: Any) -> Any:
    """A JSON-like structure with every string (keys included) scrubbed."""
    return Redactor().json(obj)


def scrubbed_exception(err: BaseException) -> BaseException | None:
    """A copy of ``err`` whose message is scrubbed, or None when its message holds no secret."""
    text = str(err)
    clean = Redactor().text(text)
    if clean == text:
        return None
    try:
        copy = type(err)(clean)
    except Exception:  # a constructor that takes other arguments
        copy = RuntimeError(f"{type(err).__name__}: {clean}")
    return copy


def redact_table(table: pa.Table) -> pa.Table:
    """An episode table whose ``error`` texts and ``metrics`` names are scrubbed."""
    import pyarrow as pa
    import pyarrow.compute as pc

    scrub = Redactor()
    if not scrub.active or table.num_rows == 0:
        return table
    names = table.column_names
    if "error" in names:
        errors = table.column("error")
        if pc.any(pc.is_valid(errors)).as_py():
            scrubbed = pa.array([scrub.optional(e) for e in errors.to_pylist()], errors.type)
            table = table.set_column(names.index("error"), table.schema.field("error"), scrubbed)
    if "metrics" in names:
        metrics = table.column("metrics")
        rows = metrics.to_pylist()
        if any(rows):
            clean = [None if r is None else [(scrub.text(k), v) for k, v in r] for r in rows]
            table = table.set_column(names.index("metrics"), table.schema.field("metrics"),
                                     pa.array(clean, metrics.type))
    return table
