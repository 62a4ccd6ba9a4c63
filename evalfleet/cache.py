"""The episode cache: stored episodes addressed by a key over everything that can change them.

Key = sha256 over canonical JSON of:

- the policy: sha256 of its bytes, format, factory reference, output kind (logits/actions), the
  sha256 of the factory's source (its module, and the module defining the function), and the code
  version of the factory's or callable's top-level package;
- the env: id, kwargs (JSON values only; a ``max_episode_steps`` there is ``gym.make``'s cap,
  keyed as the effective cap: ``envspec.keyed_kwargs``), registered spec (entry point, version,
  max_episode_steps, the spec's own kwargs in exact form, additional wrappers) and the code
  version of the package that provides it, of the module a ``module:EnvId-v0`` id imports and of
  the wrappers' packages (``evalfleet.envspec``);
- the protocol: base seed, max steps, deterministic flag;
- inference: the device kind ('cpu' or 'cuda', 'auto' resolved), dtype (float32) and the
  policy forward's block layout (it changes a torch policy's last bits);
- the environment the env's code sees (``env_environment``): the whole inherited one in-process,
  an allow-list in a sandbox (a bwrap jail apart from a ``process`` sandbox: they see other
  files), there with the values of the allowed variables that can change an episode, each
  ``--sandbox-env`` grant by name and sha256 of its value, and the ``--sandbox-read`` /
  ``--sandbox-write`` paths;
- versions: evalfleet, gymnasium, numpy, torch, Python (version and implementation), and the
  episode table's schema.

A *code version* (``evalfleet.provenance``) is a distribution's version when it was installed from
a built archive (with the digest of its installed-file record), and otherwise carries the sha256
of every ``.py`` file of the top-level package: an editable (``pip install -e``) or path install,
or a package no distribution installed (this repository's ``envs/``), changes its key with any
edit of its code. evalfleet itself is keyed the
same way: a development checkout's edits change the key too.

The episode count is not in the key: an entry holds episodes by index, so a request for 3,000
episodes after one for 1,000 reuses 0..999 and runs only 1,000..2,999 (a top-up), and the result
equals a cold 3,000-episode run because episode ``i`` always has seed ``ledger(seed, i)``.
The worker count is not in the key: it must not change results. The isolation level is in it
only as what the env sees (inherited, allow-listed, or allow-listed in a bwrap jail): an
in-process result was served for ``--isolation process``, whose env saw another environment,
and a bwrap jail's for ``process``, whose env saw other files. What an in-process
env reads of the inherited environment beyond the grants is not keyed: name such a variable with
``--sandbox-env``.

Rows that failed for infrastructural reasons (timeout, crashed, oom) or through the policy's
runtime (policy_error) are never stored; env failures that are deterministic for a seed are,
when the env ran ``inprocess`` (in a sandbox an env error may be the confinement's: a file it may
not open, a refused socket).

Each entry is ``<root>/<key[:2]>/<key>/manifest.json`` and the Parquet table it names,
``episodes-<sha256>.parquet``: the manifest holds the key's ingredients, the row count, the table's
file name and its sha256, and the runs that computed its rows (request id, time, execution
settings). Renaming the manifest into place is a store's one commit point: the
table is written under its sha256 first and never rewritten, the manifest then switches to it, and
only after that are the tables it replaced deleted, so a reader always finds the table its manifest
names (or, if a store deleted it in between, a new manifest, which it follows). An entry written
before tables were named by their sha256 (``episodes.parquet``, a manifest without ``table``) is
read the same way. An entry whose table does not match its manifest is corrupt: it is never
returned. That catches accidental damage, not a forgery: whoever may write the cache folder (an
``inprocess`` env too) can store a table under its own sha256 and a manifest naming it. Only a
holder of the key's lock removes a corrupt entry and says so (``Lookup.corrupt``); a lookup
without the lock treats it as a miss and leaves it to the holder, who recomputes it. An exclusive
file lock per key makes concurrent identical requests compute once: the second waits and then
hits.

Episodes persist as their shard finishes, before the evaluation ends: each finished shard's
cacheable rows go to ``<entry>/shards/<first-index>-<written>-<sha256>.parquet`` (``<written>``:
the time it was written, in ns, and a random tail), written to a temporary name, fsynced,
renamed, and the folder fsynced, so a file under its final name is always whole (a killed writer
leaves at most a ``.tmp`` file, which readers never open and the next holder of the lock sweeps).
The sha256 of its bytes is in its name: a shard file whose bytes no longer match (a disk fault;
Parquet reads many flipped bits back as other numbers without error) is corrupt like an entry:
its episodes are missing and recomputed, and the holder of the lock removes it. Shard files
without a sha256 in their name (written before they had one) are never read; their episodes are
recomputed. A lookup reads the entry and every shard file: a request re-run after its driver was
killed runs only the episodes no finished shard holds, and says how many it took from shard files
(``Lookup.resumed``). The evaluation's final ``store`` folds the shard files into the entry, also
when they held every episode asked for.

Lookups and stores rank rows by one rule (``_precedence``), so what a lookup reports is what a
later store keeps: an index the entry holds is answered by the entry alone, and shard files only
add the indices it lacks. A resumed evaluation never overlaps the entry (it ran only what the entry
lacked); shard rows that do are a ``--refresh`` killed before its store replaced the entry, and the
entry, which that refresh did not replace, stays whole: they are never read, and the next store of
the key deletes them with the other shard files. Among shard files holding one index, the one
written last (the time in its name) wins.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from evalfleet.errors import CacheCorruptError, CacheLockTimeout
from evalfleet.records import EPISODE_SCHEMA, SCHEMA_VERSION, empty_episodes
from evalfleet.seeds import ACTION_SAMPLER
from evalfleet.storage import write_json

logger = logging.getLogger(__name__)

#: End reasons that are results of the policy on the env, and therefore cacheable.
CACHEABLE_REASONS = ("terminated", "truncated", "env_error", "invalid_reward", "invalid_action")


def env_environment(isolation: str, granted: Iterable[str],
                    values: Mapping[str, str] | None = None, *, read: Iterable[str] = (),
                    write: Iterable[str] = ()) -> dict[str, Any]:
    """What an env's code sees of the environment, for the key: its class and each granted value.

    In-process the env inherits the worker's whole environment; in a sandbox an allow-list, with
    the values of the allowed variables that can change an episode (``KEYED``: the locale, a
    renderer...), the ``--sandbox-env`` grants (values by sha256: the key is stored in
    manifests, a secret is not) and the ``--sandbox-read`` grants, with what each holds
    (``envspec.named_files``), and ``--sandbox-write`` grants (``read``, ``write``). A run with
    ``HUNT_GAIN=3`` granted was served for the request without it, and an in-process result for
    ``--isolation process``: the env read what it was given. A ``bwrap`` jail has a class of its
    own: its sandboxes write a ``/tmp`` of their own, where a ``process`` sandbox writes only its
    folder, and see the jail's ``/proc``.
    """
    values = os.environ if values is None else values

    def digest(name: str) -> str | None:
        value = values.get(name)
        return None if value is None else hashlib.sha256(str(value).encode()).hexdigest()[:16]

    grants = {name: digest(name) for name in sorted(set(granted))}
    if isolation == "inprocess":
        return {"class": "inherited", "granted": grants}
    # The sandbox package imports gymnasium: `evalfleet cache ls` imports this module, not it.
    from evalfleet.envspec import named_files
    from evalfleet.sandbox.environment import keyed

    readable = sorted({os.path.normpath(path) for path in read})
    held = named_files(readable)
    return {"class": "allow-list, bwrap jail" if isolation == "bwrap" else "allow-list",
            "allowed": {name: digest(name) for name in sorted(values) if keyed(name)},
            "granted": grants,
            # What each readable grant holds, as the kwargs' files are keyed: an env's data
            # folder edited between two requests was served the episodes of its old data.
            "read": {path: held.get(path) for path in readable},
            "write": sorted({os.path.normpath(path) for path in write})}


def environment_digest(environment: dict[str, Any]) -> str:
    """16 hex digits of sha256 over ``env_environment``'s value: the history's protocol has it."""
    return cache_key(environment)[:16]


def cache_key(ingredients: dict[str, Any]) -> str:
    """sha256 (hex) over the canonical JSON of ``ingredients``."""
    blob = json.dumps(ingredients, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def key_ingredients(
    policy: dict[str, Any], env: dict[str, Any], seed: int, max_steps: int | None,
    deterministic: bool, versions: dict[str, str], inference: dict[str, str],
    environment: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything that can change an episode's outcome (see the module docstring).

    ``environment``: what the env's code sees of the process environment (``env_environment``).
    """
    return {
        "policy": {k: policy[k] for k in ("sha256", "format", "factory", "output_kind",
                                          "factory_sha256", "code")},
        "env": env,
        # A stochastic protocol names its sampler: a new way of drawing actions is new episodes.
        "protocol": {"seed": seed, "max_steps": max_steps, "deterministic": deterministic,
                     **({} if deterministic else {"sampler": ACTION_SAMPLER})},
        # All of it: the forward's block layout changes a torch policy's last bits.
        "inference": dict(inference),
        **({} if environment is None else {"environment": environment}),
        # Python too: 3.12's float sum() is compensated (sum([0.1] * 10) is 1.0, not 0.9999999999999999):
        # a cache shared by two interpreters must not serve one's returns for the other.
        "versions": {k: versions[k] for k in ("evalfleet", "gymnasium", "numpy", "torch", "python",
                                              "python_implementation")},
        "episode_schema": SCHEMA_VERSION,
    }


@dataclass(frozen=True)
class Lookup:
    """What the cache holds for a request: stored rows of wanted indices, and the missing ones."""

    key: str
    stored: pa.Table
    missing: list[int]
    corrupt: bool = False
    """A corrupt entry or shard file was found and removed (only by a holder of the key's lock)."""
    resumed: int = 0
    """Stored rows read from shard files an unfinished evaluation persisted (see the module doc)."""

    @property
    def status(self) -> str:
        """'hit' (nothing to run), 'partial' (top-up) or 'miss'."""
        if not self.missing:
            return "hit"
        return "partial" if self.stored.num_rows else "miss"


def _lock_holder(lock_path: Path) -> str:
    """The pid written by the lock's holder ('?' if not written yet)."""
    try:
        return lock_path.read_text().strip() or "?"
    except OSError:
        return "?"


#: The folder of an entry holding the shard files persisted while an evaluation runs.
SHARDS = "shards"

#: An entry's manifest: renaming it into place commits a store.
MANIFEST = "manifest.json"

#: The table of an entry stored before tables were named by their sha256 (still read).
LEGACY_TABLE = "episodes.parquet"

#: How often a read follows a manifest that a store switched while it read.
_FOLLOW = 5

#: Temporary files older than this are a killed writer's, swept by the lock's holder.
_STALE_TMP_S = 60.0

#: Digits of the write time (ns) that starts the middle part of a shard file's name.
_STAMP = 20

#: Keys whose lock this process holds, as (resolved cache root, key); set by ``exclusive``.
_HELD: set[tuple[str, str]] = set()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_parquet(table: pa.Table, folder: Path, name: Callable[[str], str]) -> tuple[Path, str]:
    """Write ``table`` as ``folder / name(sha256)``; returns the path and the sha256 of its bytes.

    Temporary name, fsync, rename, fsync the folder: the final name holds a whole file or none.
    """
    tmp = folder / f".{name('')}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        pq.write_table(table.cast(EPISODE_SCHEMA), tmp, compression="zstd")
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        sha = _sha256_file(tmp)
        path = folder / name(sha)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    return path, sha


def _verified(path: Path, sha256: str) -> pa.Table:
    """The episode table in ``path``, read from the very bytes whose sha256 was checked."""
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CacheCorruptError(f"{path.name} does not match its sha256")
    return pq.read_table(pa.BufferReader(data), schema=EPISODE_SCHEMA)


def _named_sha256(path: Path) -> str | None:
    """The sha256 a shard file's name ends with (None: a file written before names held one)."""
    tail = path.name.removesuffix(".parquet").rsplit("-", 1)[-1]
    return tail if len(tail) == 64 and all(c in "0123456789abcdef" for c in tail) else None


def _written_ns(path: Path) -> int:
    """When a shard file was written: the time in its name, else (an older name) its mtime.

    The name's time survives a copy that resets mtimes; 0 if the file is gone.
    """
    parts = path.name.split("-")
    stamp = parts[1][:_STAMP] if len(parts) == 3 else ""
    if len(stamp) == _STAMP and stamp.isdigit() and len(parts[1]) > _STAMP:
        return int(stamp)
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _precedence(entry: pa.Table | None, shards: pa.Table | None) -> tuple[pa.Table | None, int]:
    """The one rule ranking an entry's rows and shard rows, for lookups and stores alike.

    Returns the rows a request may take (None if neither holds any) and how many came from shard
    files. The entry wins every index it holds; shard rows only add indices it lacks (a resumed
    evaluation's). A shard row at an index the entry holds is a killed ``--refresh``'s: the
    entry it did not replace stays whole, and the row is dropped, never mixed in.
    """
    if shards is not None and entry is not None:
        shards = shards.filter(pc.invert(pc.is_in(shards.column("episode_index"),
                                                  value_set=entry.column("episode_index"))))
    parts = [t.cast(EPISODE_SCHEMA) for t in (entry, shards) if t is not None]
    if not parts:
        return None, 0
    return pa.concat_tables(parts), shards.num_rows if shards is not None else 0


def _sweep_tmp(folder: Path) -> None:
    """Delete temporary files a killed writer left (old enough that no live writer owns them)."""
    for tmp in folder.glob(".*.tmp"):
        try:
            if time.time() - tmp.stat().st_mtime > _STALE_TMP_S:
                tmp.unlink()
        except OSError:
            pass


def _cacheable(table: pa.Table) -> pa.Table:
    """The rows a later request may take: outcomes of the policy on the env, whatever ran them.

    An ``env_error`` raised in a sandbox may be the sandbox's doing (a file it may not open, a
    socket seccomp refuses, a fork past its process cap), which another level or other limits
    would not raise: only ``inprocess`` env errors are stored, the others run again.
    """
    reasons = table.column("end_reason")
    kept = pc.is_in(reasons, value_set=pa.array(CACHEABLE_REASONS))
    confined = pc.and_(pc.equal(reasons, "env_error"),
                       pc.not_equal(table.column("isolation"), "inprocess"))
    return table.filter(pc.and_(kept, pc.invert(confined)))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


#: Why a request id's rows have no one execution: two runs under that id stored rows with other settings.
REUSED_REQUEST_ID = ("unknown: two runs with this request id computed these episodes, each with its own "
                     "settings (give each evaluation its own request id)")


class EpisodeCache:
    """Episodes stored by cache key under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def entry(self, key: str) -> Path:
        """The folder of one key."""
        return self.root / key[:2] / key

    def holds_lock(self, key: str) -> bool:
        """Whether this process holds the key's lock (``exclusive``): no store can be under way.

        Only then may a lookup call what fails verification corrupt and remove it.
        """
        return (str(self.root.resolve()), key) in _HELD

    @contextmanager
    def exclusive(self, key: str, timeout_s: float = 3600.0) -> Iterator[None]:
        """Hold the key's lock: one computation per key at a time, across processes.

        A wait is announced (with the holder's pid) and ends like any other wait: on Ctrl-C or a
        termination signal (the exception the handler raises gets a note naming the key), or
        with ``CacheLockTimeout`` after ``timeout_s``. The caller must not already hold the key:
        ``flock`` locks per open file, so a second holder in one process would wait for itself.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        lock_path = self.root / f".{key}.lock"
        with open(lock_path, "a+") as fh:
            deadline = time.monotonic() + timeout_s
            announced = False
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = _lock_holder(lock_path)
                    if not announced:
                        logger.warning(
                            "cache key %s is being computed by another evaluation (pid %s); "
                            "waiting up to %.0f s to reuse its episodes (Ctrl-C or SIGTERM stops "
                            "the wait)", key[:12], holder, timeout_s)
                        announced = True
                    if time.monotonic() > deadline:
                        raise CacheLockTimeout(
                            f"cache key {key[:12]} stayed locked by pid {holder} for "
                            f"{timeout_s:.0f} s; if that evaluation is gone, remove {lock_path}"
                        ) from None
                    try:
                        time.sleep(0.05)
                    except BaseException as err:  # Ctrl-C, a termination signal
                        err.add_note(f"while waiting for cache key {key[:12]} held by pid {holder}")
                        raise
            held = (str(self.root.resolve()), key)
            try:
                fh.seek(0)
                fh.truncate()
                fh.write(str(os.getpid()))
                fh.flush()
                _HELD.add(held)
                yield
            finally:
                _HELD.discard(held)
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _read(self, key: str) -> pa.Table | None:
        """The entry's rows; None if no manifest was committed. ``CacheCorruptError`` if damaged.

        The table a manifest names is never rewritten, so a mismatch is damage, except when a
        store switched the manifest and deleted the table it replaced between this read of the
        manifest and the opening of that table: the manifest is read again and a new one followed.
        """
        manifest_path = self.entry(key) / MANIFEST
        seen: str | None = None
        failure: Exception | None = None
        for _ in range(_FOLLOW):
            try:
                text = manifest_path.read_text()
            except FileNotFoundError:
                return None  # never committed, or removed meanwhile
            except OSError as err:
                raise CacheCorruptError(f"cache entry {key[:12]} is corrupt: {err}") from err
            if text == seen:
                break  # the same manifest: what failed is the entry, not a store under way
            seen = text
            try:
                return self._table(key, text)
            except (OSError, ValueError, KeyError, TypeError, pa.ArrowException,
                    CacheCorruptError) as err:
                failure = err
        raise CacheCorruptError(f"cache entry {key[:12]} is corrupt: {failure}") from failure

    def _table(self, key: str, manifest_text: str) -> pa.Table:
        """The table ``manifest_text`` names, checked against its sha256 and row count."""
        manifest = json.loads(manifest_text)
        if manifest.get("key") != key:
            raise CacheCorruptError(f"manifest names key {manifest.get('key')!r}")
        name = manifest.get("table", LEGACY_TABLE)
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".parquet"):
            raise CacheCorruptError(f"manifest names table {name!r}")
        table = _verified(self.entry(key) / name, manifest["parquet_sha256"])
        if table.num_rows != manifest["rows"]:
            raise CacheCorruptError(f"{table.num_rows} rows, manifest says {manifest['rows']}")
        return table

    def lookup(self, key: str, indices: Sequence[int]) -> Lookup:
        """Stored rows among ``indices`` and the indices still to run.

        Rows come from the entry and from the shard files of evaluations that did not finish.
        What fails verification is never returned; a holder of the key's lock removes it and
        reports it (``corrupt``), a lookup without the lock leaves it for the holder to judge.
        """
        judge = self.holds_lock(key)
        # Shard files first: a store deletes them only after its manifest holds their rows.
        shards, _, damaged = self._read_shards(key, judge=judge)
        corrupt = judge and damaged
        try:
            table = self._read(key)
        except CacheCorruptError as err:
            table = None
            if judge:
                logger.warning("%s; removing it and recomputing", err)
                self._remove_entry_files(key)
                corrupt = True
            else:
                logger.info("%s (seen without the key's lock: a miss here; the lock's holder "
                            "removes and recomputes it)", err)
        if table is None and shards is None:  # a miss: no ``pa.array``, which imports pandas
            return Lookup(key, empty_episodes(), list(indices), corrupt=corrupt)
        wanted = pa.array(np.asarray(indices, dtype=np.int64))
        if shards is not None:
            shards = shards.filter(pc.is_in(shards.column("episode_index"), value_set=wanted))
        merged, resumed = _precedence(table, shards)  # the rule a later store keeps to
        if merged is None:
            return Lookup(key, empty_episodes(), list(indices), corrupt=corrupt)
        stored = merged.filter(pc.is_in(merged.column("episode_index"), value_set=wanted))
        have = set(stored.column("episode_index").to_pylist())
        return Lookup(key, stored.sort_by("episode_index"), [i for i in indices if i not in have],
                      corrupt=corrupt, resumed=resumed)

    def persist_shard(self, key: str, table: pa.Table) -> int:
        """Persist a finished shard's cacheable rows under ``key`` at once; returns rows written.

        The file appears whole under its final name or not at all (see the module docstring).
        """
        keep = _cacheable(table)
        if not keep.num_rows:
            return 0
        keep = keep.sort_by("episode_index")
        folder = self.entry(key) / SHARDS
        folder.mkdir(parents=True, exist_ok=True)
        written = f"{time.time_ns():0{_STAMP}d}{uuid.uuid4().hex[:8]}"  # orders overlapping files
        stem = f"{int(keep.column('episode_index')[0].as_py()):010d}-{written}"
        _durable_parquet(keep, folder, lambda sha: f"{stem}-{sha}.parquet")
        return int(keep.num_rows)

    def shard_files(self, key: str) -> list[Path]:
        """The key's persisted shard files (whole ones only: temporary files are never listed)."""
        return sorted((self.entry(key) / SHARDS).glob("*.parquet"))

    def _read_shards(self, key: str, *, judge: bool) -> tuple[pa.Table | None, list[Path], bool]:
        """Rows of the verified shard files, the files listed, and whether one failed verification.

        Where files overlap, the one written last (``_written_ns``; then the greater name) wins
        an index, whatever order the names sort in. A file whose bytes do not match the sha256 in
        its name, or that cannot be read, is damaged (renamed files are whole): its episodes are
        missing. ``judge`` (the key's lock is held) also deletes it and sweeps a killed writer's
        temporary files.
        """
        folder = self.entry(key) / SHARDS
        if not folder.is_dir():
            return None, [], False
        if judge:
            _sweep_tmp(folder)
        listed = self.shard_files(key)
        tables, damaged = [], False
        for path in sorted(listed, key=lambda p: (_written_ns(p), p.name), reverse=True):
            sha = _named_sha256(path)
            if sha is None:
                logger.info("shard file %s has no sha256 in its name (written by an earlier "
                            "evalfleet); its episodes are recomputed", path)
                continue
            try:
                tables.append(_verified(path, sha))
            except FileNotFoundError:
                continue  # folded into the entry by a store since the listing
            except (OSError, pa.ArrowException, CacheCorruptError) as err:
                damaged = True
                if judge:
                    logger.warning("shard file %s is corrupt (%s); removing it and recomputing "
                                   "its episodes", path, err)
                    path.unlink(missing_ok=True)
                else:
                    logger.info("shard file %s is corrupt (%s); its episodes are missing here",
                                path, err)
        if not tables:
            return None, listed, damaged
        merged = pa.concat_tables(tables)  # newest first, so its row is the one kept
        _, first = np.unique(merged.column("episode_index").to_numpy(), return_index=True)
        return merged.take(pa.array(np.sort(first))), listed, damaged

    def discard_shards(self, key: str) -> int:
        """Delete the key's shard files (rows that must not be reused); returns files deleted."""
        files = self.shard_files(key)
        for path in files:
            path.unlink(missing_ok=True)
        return len(files)

    def _remove_entry_files(self, key: str) -> None:
        """Delete a corrupt entry's manifest and tables, keeping shard files (checked apart)."""
        if not self.shard_files(key):
            self.remove(key)
            return
        folder = self.entry(key)
        (folder / MANIFEST).unlink(missing_ok=True)
        for path in folder.glob("episodes*.parquet"):
            path.unlink(missing_ok=True)

    def store(self, key: str, table: pa.Table, ingredients: dict[str, Any], *, replace: bool = False,
              audit: dict[str, Any] | None = None, execution: dict[str, Any] | None = None) -> int:
        """Merge cacheable rows of ``table`` into the entry (or replace it); returns rows stored.

        The caller holds the key's lock (``exclusive``). Verified shard files are folded in (a
        damaged one is removed); the manifest's rename commits the new table, and only then are
        the table it replaced and the shard files deleted. Entry and shard rows rank as in
        ``lookup`` (``_precedence``); rows of ``table`` win over both. ``audit`` is the determinism
        audit that passed for these rows, reported again on a hit. ``execution``: the storing
        run's record (``request_id``, ``computed_at``, ``execution``), kept beside the records of
        the earlier runs whose rows the entry still holds (``executions``), so a hit names the
        settings its episodes ran with, not its own.
        """
        keep = _cacheable(table)
        old = None
        shards, shard_files, _ = self._read_shards(key, judge=True)
        runs = {} if replace else self.executions(key)
        earlier = None
        if execution is not None:
            earlier = runs.get(str(execution["request_id"]))
            runs[str(execution["request_id"])] = execution
        if not replace:
            try:
                old = self._read(key)
            except CacheCorruptError as err:
                logger.warning("%s; replacing it with the rows being stored", err)
                old = None
            # episodes persisted by shards (this or an interrupted run), ranked as lookups do
            old, _ = _precedence(old, shards)
        # A request id used again with other settings: the entry held rows of the earlier run, which
        # ``table`` carries on (taken from the cache) under the same id as this run's own rows.
        reused = (earlier is not None and execution is not None and old is not None
                  and earlier.get("execution") != execution.get("execution")
                  and bool(pc.any(pc.equal(old.column("request_id"), str(execution["request_id"]))).as_py()))
        if old is not None and old.num_rows:
            new_idx = pa.array(keep.column("episode_index").to_numpy())
            old = old.filter(pc.invert(pc.is_in(old.column("episode_index"), value_set=new_idx)))
            keep = pa.concat_tables([old, keep.cast(EPISODE_SCHEMA)])
        keep = keep.sort_by("episode_index")
        # Rows carry the request id of the run that computed them: records of runs none of whose
        # rows are left go.
        present = set(pc.unique(keep.column("request_id")).to_pylist())
        runs = {rid: run for rid, run in runs.items() if rid in present}
        if reused and execution is not None:
            rid = str(execution["request_id"])
            runs[rid] = {"request_id": rid, "computed_at": None, "execution": None,
                         "unknown": REUSED_REQUEST_ID}
        folder = self.entry(key)
        folder.mkdir(parents=True, exist_ok=True)
        _sweep_tmp(folder)
        data_path, sha = _durable_parquet(keep, folder, lambda h: f"episodes-{h}.parquet")
        write_json(
            {
                "key": key,
                "rows": keep.num_rows,
                "table": data_path.name,
                "parquet_sha256": sha,
                "ingredients": ingredients,
                "audit": audit,
                "executions": runs,
                "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            folder / MANIFEST,
        )  # the commit: readers now open data_path; what it replaced can go
        for path in folder.glob("episodes*.parquet"):
            if path != data_path:
                path.unlink(missing_ok=True)
        for path in shard_files:  # folded into the entry just written
            path.unlink(missing_ok=True)
        return int(keep.num_rows)

    def ingredients(self, key: str) -> dict[str, Any] | None:
        """The key's ingredients as stored in its manifest (None if unreadable)."""
        try:
            data = json.loads((self.entry(key) / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        ing = data.get("ingredients")
        return ing if isinstance(ing, dict) else None

    def audit(self, key: str) -> dict[str, Any] | None:
        """The determinism audit stored with the entry (None if none or unreadable)."""
        try:
            data = json.loads((self.entry(key) / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        audit = data.get("audit")
        return audit if isinstance(audit, dict) else None

    def executions(self, key: str) -> dict[str, dict[str, Any]]:
        """The runs that computed the entry's rows, by request id (``store``'s ``execution``).

        Empty if none is recorded (an entry stored before evalfleet kept them) or unreadable;
        rows from shard files of an interrupted evaluation have none either.
        """
        try:
            data = json.loads((self.entry(key) / MANIFEST).read_text())
        except (OSError, ValueError):
            return {}
        runs = data.get("executions") if isinstance(data, dict) else None
        if not isinstance(runs, dict):
            return {}
        return {str(k): v for k, v in runs.items() if isinstance(v, dict)}

    def remove(self, key: str) -> bool:
        """Delete one entry; True if something was there."""
        folder = self.entry(key)
        existed = folder.exists()
        shutil.rmtree(folder, ignore_errors=True)
        return existed

    def entries(self) -> list[dict[str, Any]]:
        """Every entry's manifest summary (key, env, policy, rows, bytes, updated)."""
        out = []
        for manifest_path in sorted(self.root.glob("*/*/manifest.json")):
            try:
                m = json.loads(manifest_path.read_text())
            except (OSError, ValueError):
                m = {"key": manifest_path.parent.name, "rows": None, "ingredients": {}}
            ing = m.get("ingredients", {})
            size = sum(p.stat().st_size for p in manifest_path.parent.iterdir() if p.is_file())
            out.append({
                "key": m.get("key"),
                "env": ing.get("env", {}).get("env_id"),
                "policy_sha256": ing.get("policy", {}).get("sha256"),
                "seed": ing.get("protocol", {}).get("seed"),
                "rows": m.get("rows"),
                "bytes": size,
                "updated": m.get("updated"),
            })
        listed = {str(e["key"]) for e in out}
        for folder in sorted(self.root.glob(f"*/*/{SHARDS}")):
            key = folder.parent.name
            if key in listed or not self.shard_files(key):
                continue  # an entry with a manifest counts its shard files' rows when stored
            shards, files, _ = self._read_shards(key, judge=False)
            out.append({  # only an interrupted evaluation's shards: a re-run resumes from them
                "key": key, "env": None, "policy_sha256": None, "seed": None,
                "rows": shards.num_rows if shards is not None else 0,
                "bytes": sum(f.stat().st_size for f in files),
                "updated": "interrupted (shard files only)",
            })
        return out


def default_cache_dir(output: Path) -> Path:
    """``$EVALFLEET_CACHE_DIR`` if set, else ``OUTPUT/cache``."""
    env = os.environ.get("EVALFLEET_CACHE_DIR")
    return Path(env) if env else Path(output) / "cache"
