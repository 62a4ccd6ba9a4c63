"""What runs on a Dask worker: its sandboxes' start (stage 2) and each shard (stage 4).

Per shard: fetch the policy, open sandboxes, run, tabulate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
import threading
import time
import uuid
from typing import Any

import cloudpickle
import pyarrow as pa

from evalfleet.cluster import policy_on_worker, worker_name
from evalfleet.envspec import (
    env_files,
    env_thunk,
    import_env_modules,
    named_files,
    resolve_env_for,
    resolved_here,
)
from evalfleet.errors import StaleWorkerCode
from evalfleet.models import EndReason, EvalRequest, PolicyHandle, Shard
from evalfleet.progress import shard_publisher
from evalfleet.provenance import stale_code, watch_imports
from evalfleet.records import records_to_table
from evalfleet.redaction import scrubbed_exception
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox import open_slots
from evalfleet.sandbox.limits import sandbox_limits
from evalfleet.sandbox.process import env_modules, fork_server, preload_modules

watch_imports()  # a worker's stale-code check needs when it imported what it runs

logger = logging.getLogger(__name__)


def _publish(topic: str, message: dict[str, Any]) -> None:
    from distributed import get_worker

    try:
        get_worker().log_event(topic, message)
    except ValueError:  # not on a Dask worker (direct calls in tests): nobody listens
        pass


_resolved: dict[tuple[str, str, int | None, str, str, tuple[str, ...], tuple[str, ...] | None], Any] = {}


class KeptSlots:
    """In-process env slots a shard left, for the same request's next shard on this worker.

    A 20,000-episode evaluation runs as pieces of ~1,000 episodes (``checkpointed``) on the same
    slots count; building every slot's env per piece cost 6 % of a worker's time on
    evalfleet/Recommend-v0 (py-spy). Each episode still starts from ``reset(seed=...)`` with its
    own seed, as the slot's earlier episodes within one piece always have. Slots are kept for
    one request only (a piece of another request closes them) and at most ``idle_s`` seconds.
    The key holds the env's fingerprint: an env whose files changed is built anew.
    """

    def __init__(self, idle_s: float = 10.0) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._kept: list[tuple[tuple[Any, ...], Any, float]] = []
        self._timer: threading.Timer | None = None

    def take(self, key: tuple[Any, ...]) -> Any:
        """Slots kept under ``key`` (None if none); every other request's are closed."""
        with self._lock:
            at = next((i for i, kept in enumerate(self._kept) if kept[0] == key), None)
            mine = None if at is None else self._kept.pop(at)[1]
            others = [kept for kept in self._kept if kept[0][0] != key[0]]
            self._kept = [kept for kept in self._kept if kept[0][0] == key[0]]
        for _, slots, _ in others:
            slots.close()
        return mine

    def put(self, key: tuple[Any, ...], slots: Any) -> None:
        """Keep ``slots`` for a while; closed after ``idle_s`` unless a shard takes them."""
        with self._lock:
            self._kept.append((key, slots, time.monotonic()))
            if self._timer is None:
                self._timer = threading.Timer(self.idle_s, self._expire)
                self._timer.daemon = True
                self._timer.start()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [k for k in self._kept if now - k[2] >= self.idle_s]
            self._kept = [k for k in self._kept if now - k[2] < self.idle_s]
            self._timer = None
            if self._kept:
                left = self.idle_s - (now - min(k[2] for k in self._kept))
                self._timer = threading.Timer(max(left, 0.05), self._expire)
                self._timer.daemon = True
                self._timer.start()
        for _, slots, _ in old:
            slots.close()

    def close(self) -> None:
        """Close every kept slot now."""
        with self._lock:
            kept, self._kept = self._kept, []
        for _, slots, _ in kept:
            slots.close()


_kept_slots = KeptSlots()

#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def tune_malloc() -> bool:
    """Undo, in this worker process, what Dask's nanny does to glibc malloc for every worker.

    The nanny exports ``MALLOC_TRIM_THRESHOLD_=65536``, which also freezes glibc's mmap threshold
    at 128 KiB: every batch buffer of the hot path (a 4,096 x 64 float32 activation is 1 MiB)
    is then mmap-ed and unmapped at each step, and page faults cost up to half of a native-vector
    shard's time (measured: 0.7M vs 1.4M CartPole steps/s in one process). Larger thresholds
    keep those buffers in the heap. Returns False where there is no glibc (nothing to undo).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, 128 << 20))
    except (OSError, AttributeError):  # not glibc
        return False


def execute_shard(shard: Shard, handle: PolicyHandle, request: EvalRequest, isolation: str
                  ) -> pa.Table:
    """Run one shard of ``request`` at ``isolation`` and return its rows as an Arrow table.

    An exception that escapes (an env that cannot even be made here, say) goes to the driver,
    Prefect's database and logs: its text is scrubbed of the worker's secrets first.
    """
    try:
        return _execute_shard(shard, handle, request, isolation)
    except Exception as err:
        clean = scrubbed_exception(err)
        if clean is None:
            raise
        raise clean from None


def _resolve(request: EvalRequest, isolation: str, required: tuple[str, ...] | None = None
             ) -> Any:
    """The request's env, resolved once per worker process (``resolve_env_for``).

    Again when a file its kwargs name has changed since (its fingerprint, so the rows' env spec
    hash, holds the file's bytes). An env from someone else's module is never imported here:
    its sandbox describes it, and only the files the request's own kwargs name are watched.
    ``required``: the confinement that sandbox must apply (``SandboxLimits.required``).
    """
    if resolved_here(request.env, isolation):
        import_env_modules(request.env)  # imported once; the spec must be registered to be read
        files = env_files(request.env, request.env_kwargs)
    else:
        files = named_files(dict(request.env_kwargs))
    key = (request.env, repr(sorted(request.env_kwargs.items())), request.max_steps, isolation,
           repr(sorted(files.items())), tuple(request.sandbox_env_allow), required)
    resolved = _resolved.get(key)
    if resolved is None:
        resolved = _resolved[key] = resolve_env_for(
            request.env, request.env_kwargs, request.max_steps, isolation,
            sandbox_limits(request, required), request.episode_timeout_s,
            request.sandbox_env_allow)
    return resolved


def stale_message(worker: str, stale: dict[str, tuple[str, str]]) -> str:
    """``StaleWorkerCode``'s text: which modules differ, how, and what to do."""
    which = "; ".join(f"{top!r} runs {have} where the key names {want}"
                      for top, (have, want) in sorted(stale.items()))
    return (f"worker {worker} runs other code than this evaluation's cache key names: {which}. "
            "It imported those modules before their files changed (or it has another install); "
            "its episodes would be stored and reported under a key for code they did not run. "
            "Restart the cluster's workers (Client.restart(), or restart the 'dask worker' "
            "processes), or install the same code on them, and run again.")


def check_code(expected: dict[str, str]) -> None:
    """Raise ``StaleWorkerCode`` when this process runs other code than ``expected``."""
    stale = stale_code(expected)
    if stale:
        raise StaleWorkerCode(stale_message(worker_name(), stale))


def warm_sandboxes(request: EvalRequest, isolation: str, code: dict[str, str] | None = None,
                   required: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Stage 2 on one worker: start what its shards' sandboxes come from, before any shard runs.

    The env is resolved (its modules imported, one instance made: all ``inprocess`` slots need)
    and, at ``process`` and ``bwrap``, this worker's fork server is started and has the env's
    modules imported, so the run stage only forks sandboxes (milliseconds each) and runs episodes.
    What fails here would fail the run stage the same way; its text is scrubbed likewise.

    ``code`` is what the cache key names (``Received.expected_code``): modules this worker runs
    at another version come back under ``"stale"`` (the driver restarts its own workers, or
    refuses to run on a cluster it does not own) and nothing is started for them. ``required``
    is the confinement its sandboxes must apply (``Received.sandbox_required``): an env described
    in a sandbox here that cannot apply it raises ``SandboxUnconfined``.
    """
    try:
        t0 = time.perf_counter()
        tune_malloc()
        resolved = _resolve(request, isolation, required)
        stale = stale_code(code or {})
        if isolation in ("process", "bwrap") and not stale:
            _start_fork_server(request, isolation, resolved.fingerprint.as_dict())
        return {"worker": worker_name(), "isolation": isolation,
                "seconds": time.perf_counter() - t0, "stale": stale}
    except Exception as err:
        clean = scrubbed_exception(err)
        if clean is None:
            raise
        raise clean from None


def _start_fork_server(request: EvalRequest, level: str, env_spec: dict[str, Any]) -> None:
    """Start the worker's fork server of ``level`` and import the shipped env modules in it."""
    limits = sandbox_limits(request)
    preload = preload_modules(env_spec)
    server = fork_server(level, limits.start_timeout_s, env_modules(env_spec))
    # The server imports a maker's modules when it is prepared for it; this maker is forgotten
    # at once (each shard's slots prepare their own), its imports stay for every fork.
    token = f"warm-{uuid.uuid4().hex}"
    maker = cloudpickle.dumps(env_thunk(request.env, request.env_kwargs, request.max_steps))
    answer = server.call(("prepare", token, maker, list(sys.path), preload),
                         limits.start_timeout_s)
    server.call(("forget", token), limits.start_timeout_s)
    if answer.get("imports"):
        logger.warning("fork server could not import %s", answer["imports"])


def _shape(space: Any) -> tuple[int, ...] | None:
    """The observation space's shape, which every observation must have (None: not declared)."""
    shape = getattr(space, "shape", None)
    return None if shape is None else tuple(int(d) for d in shape)


def _execute_shard(shard: Shard, handle: PolicyHandle, request: EvalRequest, isolation: str
                   ) -> pa.Table:
    tune_malloc()
    resolved = _resolve(request, isolation, handle.sandbox_required)
    policy = policy_on_worker(handle, request.policy, resolved.action_space)
    check_code(dict(handle.code))  # after both imported: what they run is what the key names
    ctx = EpisodeContext(
        request_id=request.request_id,
        policy_sha256=handle.sha256,
        env_id=request.env,
        env_spec_hash=resolved.fingerprint.spec_hash,
        worker=worker_name(),
    )
    # In-process env instances are kept for the request's next shard on this worker (pieces of
    # one shard queue back to back): each would otherwise build every slot's env again. Never
    # for the determinism audit, whose episodes each start on a fresh instance.
    key = (request.request_id, resolved.fingerprint.spec_hash, isolation, shard.slots)
    keep = isolation == "inprocess" and not shard.audit
    slots = _kept_slots.take(key) if keep else None
    if slots is None:
        slots = open_slots(
            isolation,
            env_thunk(request.env, request.env_kwargs, request.max_steps),
            shard.slots,
            episode_timeout_s=request.episode_timeout_s,
            env_spec=resolved.fingerprint.as_dict(),
            envs_per_sandbox=request.envs_per_sandbox,
            limits=sandbox_limits(request, handle.sandbox_required),
            env_allow=request.sandbox_env_allow,
        )
    on_episode, flush = shard_publisher(request.request_id, shard.shard_id, _publish)
    records = None
    try:
        records = run_shard(list(zip(shard.episode_indices, shard.seeds, strict=True)), slots,
                            policy, ctx, on_episode=None if shard.audit else on_episode,
                            policy_timeout_s=request.policy_timeout_s,
                            retry_budget=request.retry_budget,
                            retry_backoff_s=request.retry_backoff_s,
                            obs_shape=_shape(resolved.observation_space))
    finally:
        # Kept only after a shard that ended on its own: a forward given up on may still be
        # running in its thread, so those envs are never handed to another shard.
        if keep and records is not None and not any(
                r.end_reason == EndReason.POLICY_TIMEOUT.value for r in records):
            _kept_slots.put(key, slots)
        else:
            slots.close()
    if not shard.audit:
        flush()
    logger.info("shard %d: %d episodes on %s", shard.shard_id, len(records), ctx.worker)
    return records_to_table(records)
