"""The seven stages as plain functions: what each Prefect task in ``tasks/`` calls.

Each function takes and returns small typed values; the Prefect layer only wires them together.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from evalfleet import cluster
from evalfleet.audit import (
    RoundSchedule,
    audit_sample,
    audit_size,
    compare_with_baseline,
    determinism_audit,
    reused_in_rows,
    reused_instances,
    reward_integrity,
    step_rewards,
)
from evalfleet.cache import (
    EpisodeCache,
    Lookup,
    cache_key,
    default_cache_dir,
    env_environment,
    key_ingredients,
)
from evalfleet.claims import (
    claim_path,
    claimed,
    describe,
    later_judged,
    mark_judged,
    release,
    take,
    wait_for_earlier,
    wait_s,
)
from evalfleet.envspec import named_files, named_paths, resolve_env_for, resolved_here
from evalfleet.errors import BaselineUnavailable, IsolationUnavailable, RequestError, StaleWorkerCode
from evalfleet.mlflow_logger import log_or_queue
from evalfleet.models import (
    INPUTS_CHANGED,
    RECORDING_INCOMPLETE,
    REPLAY_NONDETERMINISM,
    EvalReport,
    EvalRequest,
    PolicyHandle,
    Shard,
    ShardPlan,
    with_missing,
)
from evalfleet.planning import plan_shards
from evalfleet.policy import (
    FORWARD_ROWS,
    INFERENCE_DTYPE,
    PAD_ROWS,
    PolicyArtifact,
    check_policy,
    check_policy_apart,
    inference_device,
    read_policy,
)
from evalfleet.provenance import DATA_MARK, code_version
from evalfleet.records import (
    EPISODE_SCHEMA,
    OUTCOME_COLUMNS,
    concat_sorted,
    empty_episodes,
    stamp_evaluation,
)
from evalfleet.redaction import redact_json, redact_table
from evalfleet.replay import (
    ReplayResult,
    probe_encoder,
    probe_rendering,
)
from evalfleet.report import aggregate, curve_so_far, execution_manifest, harness_versions
from evalfleet.review import cluster_failures, report_page
from evalfleet.review_replays import ReviewReplays, replay_sandbox, review_replays
from evalfleet.sandbox.isolation import promised, resolve_isolation
from evalfleet.sandbox.limits import sandbox_limits
from evalfleet.seeds import SeedLedger
from evalfleet.storage import report_lock, run_dir, write_episodes, write_json, write_table
from evalfleet.tracking import default_tracking_uri, flush_pending, pending_dir
from evalfleet.worker import stale_message, warm_sandboxes

logger = logging.getLogger(__name__)


#: The harness's own packages: every worker runs them, the cache key names their versions.
HARNESS_MODULES = ("evalfleet", "gymnasium", "numpy")


@dataclass(frozen=True)
class Received:
    """Stage 1 output: the validated policy and env, and the isolation level that will be used."""

    artifact: PolicyArtifact
    env_spec: dict[str, Any]
    env_spec_hash: str
    isolation: str
    cache_key: str
    cache_ingredients: dict[str, Any]
    seconds: float
    device: str = "cpu"
    """Where inference runs (stage 1 resolved 'auto' against the cluster's workers)."""
    device_fallback: str | None = None
    """Why a requested 'auto' runs on CPU; None when nothing fell back."""
    loaded: bool = True
    """Whether stage 1 loaded the policy; not when the cache held every episode it asked for."""

    @functools.cached_property
    def expected_code(self) -> dict[str, str]:
        """``{top-level module: code version}`` the cache key names: what every worker must run.

        The env's entry point package and what the env's code imports, the policy's code (torch
        for a TorchScript or state_dict policy) and the harness's (``HARNESS_MODULES``). Read
        from the files here, once per ``Received``; a worker that imported one of them before an
        edit, or has another install, runs something else (``provenance.stale_code``).
        """
        code = {top: code_version(top)[1] for top in HARNESS_MODULES}
        code.update(self.env_spec.get("code") or {})
        entry = str(self.env_spec["entry_point"]).split(":", 1)[0].split(".", 1)[0]
        code[entry] = str(self.env_spec["package_version"])
        code.update(dict(self.artifact.code or ()))
        if self.artifact.format != "callable":
            code["torch"] = code_version("torch")[1]
        return code

    @property
    def sandbox_required(self) -> tuple[str, ...]:
        """The confinement each worker's sandboxes must apply: what this machine's probe found.

        The report's manifest states that probe; a sandbox without one of these refuses to run
        env code (``SandboxLimits.required``) instead of running it with less.
        """
        return promised(self.isolation)


@dataclass(frozen=True)
class Planned:
    """Stage 2 output: shards for the episodes to run, and the rows the cache already holds."""

    plan: ShardPlan
    cached: pa.Table
    cache_status: str
    cache_corrupt: bool
    warmed: tuple[dict[str, Any], ...] = ()
    """One entry per worker whose sandboxes' start was done here (``worker.warm_sandboxes``)."""
    resumed: int = 0
    """Of the cached rows, those read from shard files an interrupted evaluation persisted."""

    @property
    def shards(self) -> list[Shard]:
        """The shards to map the run stage over (empty on a full cache hit)."""
        return self.plan.shards


@dataclass(frozen=True)
class Collected:
    """Stage 5 output: the episode table and how long running took."""

    table: pa.Table
    fresh: pa.Table
    audit_rows: pa.Table
    run_seconds: float
    seconds: float
    plan_cached: int
    plan_seconds: float
    cache_status: str
    cache_corrupt: bool
    resumed: int = 0
    """Reused rows that shard files of an interrupted evaluation held (all rounds)."""
    replays: ReviewReplays | None = None
    """Stage 7's replays when a worker ran them ahead (``review_replays``); None: stage 7 runs
    them itself."""
    computed_at: str | None = None
    """When the fresh rows were collected (UTC): the time the cache keeps with this run's
    execution settings (``run_record``)."""


def receive(request: EvalRequest) -> Received:
    """Stage 1: validate env, isolation and policy before anything is spawned."""
    _, check = receive_unloaded(request)
    return check()


def _callable_device(request: EvalRequest, artifact: PolicyArtifact) -> str:
    """The device to place inference on: a callable policy's is the CPU, never a GPU.

    evalfleet moves a torch policy's weights and batches to a CUDA device; a callable is plain
    Python it calls with numpy batches, so it cannot be placed there. ``--device cuda`` for one
    is refused (the report would say ``cuda`` for inference that ran wherever the callable chose);
    ``auto`` means the CPU, with no fallback to state.
    """
    if artifact.format != "callable" or request.device == "cpu":
        return request.device
    if request.device == "auto":
        return "cpu"
    raise RequestError(
        f"--device {request.device!r} asks for policy inference on a CUDA GPU, but policy "
        f"{request.policy!r} is a callable: evalfleet calls it with numpy batches on the worker's "
        "CPU and cannot place it on a GPU. Pass --device cpu (or auto), or give the policy as a "
        "TorchScript file or a state_dict with --policy-factory module:function to run it on CUDA."
    )


def receive_unloaded(request: EvalRequest) -> tuple[Received, Callable[..., Received]]:
    """Stage 1 but the policy's load: the ``Received`` (its cache key is final), and the check.

    The check (``policy.check_policy``: load the policy, run a dummy batch; where torch gets
    imported) returns the ``Received`` with its seconds added; ``check(apart=...)`` runs it in a
    child process started that way (``policy.check_policy_apart``). ``received_before_flow``
    says when it may be skipped.
    """
    t0 = time.perf_counter()
    check_folders(request)
    if not resolved_here(request.env, request.isolation):  # a sandbox describes it, next line
        check_kwarg_paths(request, request.isolation)
    env = resolve_env_for(request.env, request.env_kwargs, request.max_steps, request.isolation,
                          sandbox_limits(request), request.episode_timeout_s,
                          request.sandbox_env_allow)
    # An env resolved in a sandbox described itself: its entry point is its word, not a reason
    # to trust it (``auto`` runs it in sandboxes whatever it names).
    isolation = resolve_isolation(request.isolation, env.fingerprint.entry_point
                                  if resolved_here(request.env, request.isolation) else None)
    check_kwarg_paths(request, isolation)
    if isolation == "inprocess" and request.suite_task is None:
        check_no_sandbox_options(request)
    artifact = read_policy(request.policy, request.policy_factory, env.action_space,
                           deterministic=request.deterministic)
    placement = cluster.place_inference(_callable_device(request, artifact), request.dask_address)
    if request.record_video:
        check_recording(request, isolation)
    if request.callback_url:
        from evalfleet.callback import check_callback

        check_callback(request.callback_url)
    ingredients = key_ingredients(
        # The effective step cap: --max-steps 500 on CartPole-v1 is its registered cap, the same
        # episodes (as the env spec's hash says), one key and one history protocol.
        artifact.summary(), env.fingerprint.as_dict(), request.seed, env.fingerprint.max_episode_steps,
        request.deterministic, harness_versions(),
        {"device": inference_device(placement.device, artifact.format), "dtype": INFERENCE_DTYPE,
         "blocks": f"{FORWARD_ROWS} rows padded to a multiple of {PAD_ROWS}"},
        env_environment(isolation, request.sandbox_env_allow, read=request.sandbox_read,
                        write=request.sandbox_write),
    )
    received = Received(artifact, env.fingerprint.as_dict(), env.fingerprint.spec_hash, isolation,
                        cache_key(ingredients), ingredients, time.perf_counter() - t0,
                        device=placement.device, device_fallback=placement.fallback,
                        loaded=False)

    def check(apart: str | None = None) -> Received:
        t1 = time.perf_counter()
        if apart is None:
            check_policy(artifact, env.observation_space, env.action_space, request.deterministic)
        else:
            check_policy_apart(artifact, env.observation_space, env.action_space,
                               request.deterministic, start_method=apart)
        return replace(received, seconds=received.seconds + time.perf_counter() - t1,
                       loaded=True)

    return received, check


#: Policy formats whose stage-1 check depends only on what the cache key holds (the bytes,
#: torch's version, the env's spaces, the deterministic flag): a full cache hit may skip it.
#: A state_dict's factory or a callable runs code the key may not cover whole (what it calls
#: in other modules, a file it reads): those are loaded and checked on a hit too, so a policy
#: that no longer loads fails stage 1 instead of being answered from the cache.
SELF_CONTAINED_FORMATS = frozenset({"torchscript"})


#: Request fields only sandboxes use, with their CLI options (``check_no_sandbox_options``).
SANDBOX_OPTIONS = {"sandbox_read": "--sandbox-read", "sandbox_write": "--sandbox-write",
                   "sandbox_env_allow": "--sandbox-env", "envs_per_sandbox": "--envs-per-sandbox",
                   "sandbox_memory_mb": "--sandbox-memory-mb", "episode_timeout_s": "--episode-timeout",
                   "step_timeout_s": "--step-timeout"}


def sandbox_options_given(request: EvalRequest) -> list[str]:
    """The CLI options of the sandbox-only fields ``request`` sets to other than their defaults."""
    fields = type(request).model_fields
    return [flag for name, flag in SANDBOX_OPTIONS.items()
            if getattr(request, name) != fields[name].get_default(call_default_factory=True)]


def check_no_sandbox_options(request: EvalRequest) -> None:
    """An evaluation that runs in-process is refused sandbox options it was given: they do nothing.

    A timeout, a memory limit or a read grant set for episodes that then ran without a sandbox
    (``auto`` keeps gymnasium's and evalfleet's own envs in-process) was accepted and ignored.
    A suite's tasks are exempt: one set of options serves tasks of several isolation levels
    (``check_suite_sandbox_options`` refuses them when no task runs in a sandbox).
    """
    given = sandbox_options_given(request)
    if given:
        raise RequestError(
            f"{', '.join(given)} apply to process/bwrap sandboxes, but this evaluation runs its "
            f"envs in-process (isolation {request.isolation!r} for {request.env!r}): they would do "
            "nothing. Pass --isolation process to run the envs in sandboxes, or drop them.")


def check_kwarg_paths(request: EvalRequest, isolation: str) -> None:
    """Files the env kwargs name by a relative path are refused where a sandbox runs the env.

    The cache key reads such a file from this process's working folder and a ``process``
    sandbox is granted it from the worker's, but the env opens it from the sandbox's own
    folder: a calibration file named ``calib/gain.txt`` was keyed by its bytes, the env found
    nothing there and took its default (mean 10.06, with the file 30.19), exit 0.
    """
    if isolation == "inprocess":
        return
    level = "process" if isolation == "auto" else isolation  # what ``auto`` sandboxes it in
    for text, path in named_paths(request.env_kwargs).items():
        if not os.path.isabs(text):
            raise RequestError(
                f"env kwargs name the file or folder {text!r} by a relative path, but {level!r} "
                f"sandboxes (isolation {request.isolation!r} for {request.env!r}) run the env in a "
                f"folder of their own, where it names another file or none. Pass an absolute path "
                f"such as {str(path.resolve())!r}.")


def check_suite_sandbox_options(base: EvalRequest, tasks: Sequence[tuple[EvalRequest, Received]]
                                ) -> None:
    """A suite none of whose tasks runs in a sandbox is refused the sandbox options it was given.

    The options serve every task, so one in-process task among sandboxed ones is no reason to
    refuse them; with every task in-process they do nothing (``--step-timeout 3 --sandbox-memory-mb
    2000`` on a CartPole suite was accepted and ignored, exit 0).
    """
    given = sandbox_options_given(base)
    if given and tasks and all(rec.isolation == "inprocess" for _, rec in tasks):
        envs = ", ".join(dict.fromkeys(repr(r.env) for r, _ in tasks))
        raise RequestError(
            f"{', '.join(given)} apply to process/bwrap sandboxes, but every task of this suite "
            f"runs its env in-process (isolation {base.isolation!r} for {envs}): they would do "
            "nothing. Pass --isolation process to run the envs in sandboxes, or drop them.")


def check_folders(request: EvalRequest) -> None:
    """The results and cache folders can be made and written here, or a clear error now.

    An ``--output`` or ``--cache-dir`` naming a file failed only after every episode ran (stage
    7's ``NotADirectoryError``, or the cache lock's ``FileExistsError`` once the cluster was up).
    Nothing is created here: a failing request leaves no folder behind.
    """
    folders = [("--output", Path(request.output)), ("--output", Path(request.output) / "runs")]
    if request.cache != "off":
        folders.append(("--cache-dir", episode_cache(request).root))
    store = local_store_folder(request.mlflow_uri) if request.mlflow_uri else None
    if store is not None:  # a store that can never be made was queued for, and exit 0
        folders.append(("--mlflow-uri", store))
    for option, folder in folders:
        there = folder
        while not there.exists() and there.parent != there:
            there = there.parent
        if not there.is_dir():
            raise RequestError(
                f"{option} {str(folder)!r} cannot be a folder: {str(there)!r} is a file. Pass a "
                "folder path (it is made if missing), or move the file.")
        if not _can_make_in(there):
            raise RequestError(
                f"{option} {str(folder)!r} cannot be written: this user may not write in "
                f"{str(there)!r}. Pass a folder you can write.")


def _can_make_in(folder: Path) -> bool:
    """Whether a folder can be made in ``folder``: tried, and removed at once.

    ``os.access`` says yes to root everywhere, /proc included, where an MLflow store then could
    never be made: the run was queued for it, and the evaluation exited 0.
    """
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".evalfleet-probe-", dir=folder))
    except OSError:
        return False
    return True


def local_store_folder(uri: str) -> Path | None:
    """The folder a file-based MLflow store lives in (SQLite's file's, a file store's), or None."""
    if uri.startswith("sqlite:///"):
        path = uri.removeprefix("sqlite:///")
        return None if path in ("", ":memory:") else Path(path).parent
    if uri.startswith("file:"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    return None if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri) else Path(uri)


def received_before_flow(
    request: EvalRequest, on_miss: Callable[[Received], tuple[str, ...]] | None = None
) -> tuple[Received, bool]:
    """Stage 1 as ``evaluate`` runs it before the flow: the ``Received``, and cache-hit or not.

    On a full hit the policy is not loaded where its format allows (``SELF_CONTAINED_FORMATS``);
    otherwise it is, in a child process (``policy.check_policy_apart``): the driver holds no
    torch for it (``evaluate()`` runs stage 7's replays on a worker too).

    ``on_miss(received)``: called on a miss, before the check; it returns the modules the
    workers need for this policy (and may start work of its own). When the miss runs on a local
    cluster, the workers' fork server starts here with them (``cluster.fork_server_for_check``) and
    the check runs in a child of it: the imports are made once, for the check and the workers,
    on another core while this process goes on. A failed check stops the server at once.
    """
    received, check = receive_unloaded(request)
    fixed = request.target_ci_halfwidth is None and request.baseline is None
    found = lookup(request, received) if fixed else None
    # Rows no audit covered are no hit when audited: the audit runs on a cluster (``plan``).
    hit = found is not None and found.status == "hit" and not unaudited(request, found)
    if hit and received.artifact.format in SELF_CONTAINED_FORMATS:
        return received, True
    if on_miss is None or hit:
        return check(apart="fork"), hit
    if request.dask_address:  # forked from this process while it has one thread
        checked = check(apart="fork")
        on_miss(checked)
        return checked, hit
    try:
        with cluster.fork_server_for_check(on_miss(received)):
            checked = check(apart="forkserver")
    except BaseException:
        cluster.stop_idle_fork_server()
        raise
    return checked, hit


def episode_cache(request: EvalRequest) -> EpisodeCache:
    """The request's episode cache."""
    return EpisodeCache(request.cache_dir or default_cache_dir(request.output))


@contextmanager
def key_held(request: EvalRequest, key: str) -> Iterator[None]:
    """The cache key's lock held (``EpisodeCache.exclusive``): one evaluation per key at a time.

    A ``--refresh`` then drops what the key holds (the entry and any shard files) before it runs
    anything: its own shard files are the only rows a later run can resume from. Before, a
    refresh killed part-way left the distrusted entry in place, and the next plain run took its
    rows for the indices it held and the refresh's for the rest (mean 400: 600 from the entry,
    200 from the refresh, the truth 200), with no alarm.
    """
    cache = episode_cache(request)
    with cache.exclusive(key):
        if request.cache == "refresh":
            cache.remove(key)
        yield


def lookup(request: EvalRequest, received: Received, indices: Sequence[int] | None = None) -> Lookup:
    """What the cache holds for ``request`` ('off' and 'refresh' see an empty cache)."""
    indices = range(request.episodes) if indices is None else indices
    if request.cache != "use":
        return Lookup(received.cache_key, empty_episodes(), list(indices))
    return episode_cache(request).lookup(received.cache_key, indices)


def unaudited(request: EvalRequest, found: Lookup) -> bool:
    """Whether an audited request takes rows that no determinism audit covered.

    Rows from shard files (an interrupted evaluation's, never audited), and an entry stored
    with no audit that compared an episode (``--no-audit``; a run whose audit episodes all
    failed). Served as a hit, a ``--no-audit`` table of an env that reads the global RNG passed
    for an audited one, with ``determinism_audit_incomplete`` its only sign.
    """
    if not request.audit or not found.stored.num_rows:
        return False
    if found.resumed:
        return True
    audit = episode_cache(request).audit(found.key)
    return not (audit and audit.get("checked"))


def plan(
    request: EvalRequest, received: Received, address: str | None, episodes: int,
    prior: Collected | None = None, max_shards: int | None = None,
) -> Planned:
    """Stage 2: fix episodes ``0..episodes-1`` by index and shard what remains to run.

    Rows that the cache or earlier rounds hold are reused; the rest is split over the worker
    slots (at most ``max_shards`` shards), plus one determinism-audit shard.
    """
    t0 = time.perf_counter()
    have = set(prior.table.column("episode_index").to_pylist()) if prior is not None else set()
    wanted = [i for i in range(episodes) if i not in have]
    found = lookup(request, received, wanted)
    round_indices = sorted(set(found.missing) | set(found.stored.column("episode_index").to_pylist()))
    # Audit rounds that run something, and rows no audit covered (``unaudited``); a full hit
    # of an audited entry was audited when it was stored.
    stale = unaudited(request, found)
    audited = audit_size(len(round_indices)) if request.audit and (found.missing or stale) else 0
    work = len(found.missing) + audited
    slots = cluster.worker_slots(address) if work and address else 1
    slots = min(slots, max_shards) if max_shards else slots
    if work and address is None:
        raise RuntimeError("episodes are missing from the cache but no Dask cluster was given")
    shard_plan = checkpointed(plan_shards(
        request.request_id, request.seed, found.missing, request.concurrency, slots,
        total_episodes=episodes,
    ), request)
    shards = list(shard_plan.shards)
    # Rows no audit covered bring no shards: which of their episodes started on a used instance
    # is read from the rows themselves. With only this run's shards, a resumed run's sample was
    # drawn from all indices and missed an env carrying state across episodes (mean 30.46,
    # "0 mismatches", cached, where each episode on a fresh instance gives 22.19).
    reused = reused_instances(shards) + (
        reused_in_rows(found.stored, request.envs_per_sandbox) if stale else [])
    audit = audit_sample(round_indices, request.seed, reused=reused) if audited else []
    if audit:
        ledger = SeedLedger(request.seed)
        shards.append(Shard(shard_id=len(shards), episode_indices=audit,
                            seeds=[ledger.seed(i) for i in audit],
                            slots=min(len(audit), request.concurrency), audit=True))
    shard_plan = shard_plan.model_copy(update={
        "shards": shards,
        "cached_episodes": found.stored.num_rows + (prior.plan_cached if prior else 0),
        "cache_key": received.cache_key,
        "seconds": time.perf_counter() - t0 + (prior.plan_seconds if prior else 0.0),
    })
    return Planned(shard_plan, found.stored, found.status if request.cache == "use" else request.cache,
                   found.corrupt, resumed=found.resumed)


def shard_cap(request: EvalRequest, slots_per_shard: int) -> int:
    """Most episodes per shard: ``request.shard_episodes``, else max(1024, 4 x the shard's slots).

    Each piece drains its slots at its end (the last episodes step with the others idle): pieces
    of a few slots' worth would cost throughput, and a default evaluation stays one shard per
    worker; larger evaluations are persisted every few thousand episodes.
    """
    if request.shard_episodes is not None:
        return request.shard_episodes
    return max(1024, 4 * slots_per_shard)


def checkpointed(shard_plan: ShardPlan, request: EvalRequest) -> ShardPlan:
    """Split shards longer than ``shard_cap`` into consecutive pieces with the same slots.

    A finished shard is persisted at once (``persist_shard``): smaller shards lose less to a
    killed driver. Each piece keeps its shard's env slots, so as many environments as before
    step at once on a worker; pieces queue behind each other on the cluster.
    """
    pieces: list[Shard] = []
    for shard in shard_plan.shards:
        cap = shard_cap(request, shard.slots)
        for lo in range(0, len(shard.episode_indices), cap):
            idx = shard.episode_indices[lo:lo + cap]
            pieces.append(Shard(shard_id=len(pieces), episode_indices=idx,
                                seeds=shard.seeds[lo:lo + cap], slots=min(shard.slots, len(idx))))
    if len(pieces) == len(shard_plan.shards):
        return shard_plan
    return shard_plan.model_copy(update={"shards": pieces})


def spawn(request: EvalRequest, received: Received, address: str | None, planned: Planned
          ) -> Planned:
    """Stage 2: on every worker, start what the shards' sandboxes come from, before they run.

    ``process`` / ``bwrap``: each worker's fork server, with the env's modules imported in it;
    ``inprocess``: the env's modules and one instance. Nothing to run, nothing started. The time
    counts as stage 2's; the run stage then only forks sandboxes and runs episodes.
    """
    if not planned.shards or address is None:
        return planned
    t0 = time.perf_counter()
    code = received.expected_code
    required = received.sandbox_required
    warmed = cluster.on_each_worker(address, warm_sandboxes, request, received.isolation, code,
                                    required)
    stale = {w["worker"]: w["stale"] for w in warmed if w.get("stale")}
    restarted = bool(stale) and cluster.owned(address)
    if restarted:
        # Our own workers (an Evaluator's kept cluster) imported files edited since: new ones.
        logger.warning("restarting the local workers: %s", "; ".join(
            f"{w} runs old code of {', '.join(sorted(s))}" for w, s in stale.items()))
        cluster.restart_workers(address)
        warmed = cluster.on_each_worker(address, warm_sandboxes, request, received.isolation, code,
                                        required)
        stale = {w["worker"]: w["stale"] for w in warmed if w.get("stale")}
    if stale:
        worker, modules = sorted(stale.items())[0]
        raise StaleWorkerCode(stale_message(worker, modules) + (
            f" {len(stale)} workers in all." if len(stale) > 1 else "") + (
            " They are this process's own workers, restarted once already: they are forked from a "
            "server that imported that code when the cluster started (or this process did). "
            "Start a new Evaluator (or process)." if restarted else "") + " Nothing was run.")
    seconds = planned.plan.seconds + time.perf_counter() - t0
    return replace(planned, plan=planned.plan.model_copy(update={"seconds": seconds}),
                   warmed=tuple(warmed))


def distribute(request: EvalRequest, received: Received, address: str | None) -> PolicyHandle:
    """Stage 3: one copy of the policy per worker."""
    return cluster.distribute(received.artifact, address, received.device, request.deterministic,
                              received.expected_code, received.sandbox_required)


def collect(
    tables: list[pa.Table], handle: PolicyHandle, planned: Planned, prior: Collected | None = None
) -> Collected:
    """Stage 5: one table, one row per episode (earlier rounds + cached + run), in episode order."""
    t0 = time.perf_counter()
    run_seconds = time.time() - handle.distributed_at
    fresh = concat_sorted([t for t, s in zip(tables, planned.shards, strict=True) if not s.audit])
    audit_rows = concat_sorted([t for t, s in zip(tables, planned.shards, strict=True) if s.audit])
    expected = sum(len(s.episode_indices) for s in planned.shards if not s.audit)
    if fresh.num_rows != expected:
        raise RuntimeError(
            f"run stage returned {fresh.num_rows} rows for {expected} planned "
            "episodes; this is a harness bug, please report it with the request"
        )
    parts = [planned.cached, fresh] + ([prior.table] if prior else [])
    return Collected(
        # Once more here (rows are scrubbed on the workers too): nothing below writes a secret.
        table=redact_table(concat_sorted(parts)),
        fresh=redact_table(concat_sorted([fresh] + ([prior.fresh] if prior else []))),
        audit_rows=concat_sorted([audit_rows] + ([prior.audit_rows] if prior else [])),
        run_seconds=run_seconds,
        seconds=time.perf_counter() - t0 + (prior.seconds if prior else 0.0),
        plan_cached=planned.plan.cached_episodes,
        plan_seconds=planned.plan.seconds,
        cache_status=planned.cache_status,
        cache_corrupt=planned.cache_corrupt or (prior.cache_corrupt if prior else False),
        resumed=planned.resumed + (prior.resumed if prior else 0),
        computed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def summarize(
    request: EvalRequest, received: Received, schedule: RoundSchedule, collected: Collected,
    baseline: tuple[pa.Table, str] | None = None,
) -> EvalReport:
    """Stage 6: statistics, failures, audits, alarms and the comparison with a baseline."""
    t0 = time.perf_counter()
    timings = {
        "receive_weights": received.seconds,
        "spawn_sandboxes": collected.plan_seconds,
        "run_episodes": collected.run_seconds,
        "collect_rewards": collected.seconds,
    }
    report = aggregate(
        request,
        collected.table,
        env_spec=received.env_spec,
        env_spec_hash=received.env_spec_hash,
        policy=received.artifact.summary(),
        isolation=received.isolation,
        timings=timings,
        cache={"status": cache_status(request, collected), "key": received.cache_key,
               "reused": collected.plan_cached, "computed": collected.fresh.num_rows,
               "corrupt_entry_recomputed": collected.cache_corrupt,
               "resumed": collected.resumed},
        run_seconds=collected.run_seconds,
        ran=collected.fresh,  # run_seconds timed these rows only
        environment=received.cache_ingredients.get("environment"),
    )
    alarms = list(report.alarms) + reward_integrity(collected.table)
    audit = determinism_audit(collected.table, collected.audit_rows) if request.audit else None
    if audit is not None and cache_status(request, collected) == "hit":
        # A full hit re-runs nothing: its audit is the one that passed when the entry was stored.
        audit = episode_cache(request).audit(received.cache_key) or audit
    if audit and audit["mismatches"]:
        seeds = ", ".join(str(m["seed"]) for m in audit["mismatches"][:5])
        alarms.append(
            f"non_deterministic_env: {len(audit['mismatches'])} of {audit['checked']} re-run "
            f"episodes differ (seeds {seeds}); results are not reproducible. Re-run alone, in "
            "another batch: an env reading a clock, a global RNG or state across resets; or a "
            "policy whose actions depend on more than the row's observation: the other rows of "
            "its batch (a callable; a torch one that stage 1's check missed), state it keeps "
            "between calls, or torch's unseeded RNG (Dropout in training mode). Replaying one of "
            "the seeds alone tells which"
        )
    from evalfleet.audit import (
        determinism_audit_alarm,
        harness_pairs_alarm,
        policy_pairs_alarm,
        unmatched_pairs_alarm,
    )

    comparison = None
    if baseline is not None:
        comparison = compare_with_baseline(collected.table, baseline[0], request.seed, baseline[1])
    alarms += [a for a in (determinism_audit_alarm(audit), unmatched_pairs_alarm(comparison),
                           harness_pairs_alarm(comparison), policy_pairs_alarm(comparison)) if a]
    changed = inputs_changed(request, received, done=True) if collected.fresh.num_rows else []
    if changed:  # its episodes mix two versions of what the key names: no number of it holds
        alarms.append(
            f"{INPUTS_CHANGED}: {'; '.join(changed)} changed while the episodes ran, so they mix "
            "both versions; nothing of this evaluation was cached. Keep the env's code and files "
            "as they are while it runs, and run it again")
    returns = report.returns
    if schedule.interval is not None:
        # Adaptive: the 95% interval is the last look's Bonferroni-adjusted one (audit.py).
        returns = dict(report.returns, ci=schedule.interval.to_dict())
        if report.returns.get("n") != schedule.rounds[-1]["scored"]:
            logger.warning("adaptive interval from %s scored episodes, headline from %s",
                           schedule.rounds[-1]["scored"], report.returns.get("n"))
    return report.model_copy(update={
        "manifest": computed_by(placed(report.manifest, request, received), request, received,
                                collected),
        "returns": returns,
        "timings": dict(timings, aggregate=time.perf_counter() - t0),
        "alarms": alarms,
        "harness_fault": report.harness_fault or bool(changed),
        "audit": audit,
        "adaptive": schedule.summary(),
        "comparison": comparison,
        "step_rewards": step_rewards(collected.table),
    })


def placed(manifest: dict[str, Any], request: EvalRequest, received: Received) -> dict[str, Any]:
    """The manifest with the device inference ran on, the one asked for, and any fallback."""
    execution = dict(manifest.get("execution") or {}, device=received.device,
                     device_requested=request.device, device_fallback=received.device_fallback)
    return dict(manifest, execution=execution)


def run_record(request: EvalRequest, received: Received, collected: Collected) -> dict[str, Any]:
    """The run as the cache keeps it beside its rows: request id, time and execution settings.

    The settings are those its report's manifest states (``placed``), secrets scrubbed.
    """
    execution = placed({"execution": execution_manifest(request, received.isolation)}, request,
                       received)["execution"]
    record: dict[str, Any] = redact_json({"request_id": request.request_id,
                                          "computed_at": collected.computed_at, "execution": execution})
    return record


#: Why a run whose cached episodes a report uses has no execution settings to show.
EXECUTION_NOT_KEPT = ("not kept: the cache entry was stored by an evalfleet that did not keep the "
                      "settings of the run that computed its episodes, or they were persisted by an "
                      "evaluation that was interrupted")


def computed_by(manifest: dict[str, Any], request: EvalRequest, received: Received,
                collected: Collected) -> dict[str, Any]:
    """The manifest naming the runs that computed the episodes, with the execution they ran under.

    ``computed_by`` lists them (``request_id``, ``computed_at``, ``episodes``, ``execution``):
    those whose episodes came from the cache (as its entry keeps them, ``run_record``), then this
    request when it ran any. A full hit ran nothing: its ``execution`` is the one run's that
    computed its episodes, never its own settings, which ran none of them (before, a hit with
    ``--concurrency 4 --workers 2`` stated those for episodes run with 10 and 1); it is null, with
    ``execution_unknown`` saying why, when that run's settings were not kept or several runs
    computed them. A top-up keeps its own ``execution`` beside the cached runs in ``computed_by``.
    """
    fresh = set(collected.fresh.column("episode_index").to_pylist())
    cached: dict[str, int] = {}  # the computing runs' request ids, in episode order
    for rid, index in zip(collected.table.column("request_id").to_pylist(),
                          collected.table.column("episode_index").to_pylist(), strict=True):
        if index not in fresh:
            cached[rid] = cached.get(rid, 0) + 1
    kept = episode_cache(request).executions(received.cache_key) if cached else {}
    runs: list[dict[str, Any]] = []
    for rid, n in cached.items():
        run = kept.get(rid)
        if run is None or run.get("execution") is None:
            runs.append({"request_id": rid, "computed_at": None, "episodes": n, "execution": None,
                         "unknown": str((run or {}).get("unknown") or EXECUTION_NOT_KEPT)})
        else:
            runs.append({"request_id": rid, "computed_at": run.get("computed_at"), "episodes": n,
                         "execution": run.get("execution")})
    if collected.fresh.num_rows:
        runs.append(dict(run_record(request, received, collected), episodes=collected.fresh.num_rows))
    out = dict(manifest, computed_by=runs)
    if collected.fresh.num_rows or not runs:  # it ran episodes: its own execution stands
        return out
    if len(runs) == 1 and runs[0]["execution"] is not None:
        out["execution"] = runs[0]["execution"]
    elif len(runs) == 1:
        out["execution"] = None
        out["execution_unknown"] = (f"the run that computed these episodes (request "
                                    f"{runs[0]['request_id']}): {runs[0]['unknown']}")
    else:
        out["execution"] = None
        out["execution_unknown"] = (f"{len(runs)} runs computed these episodes, each with its own "
                                    "settings: see computed_by")
    return out


class _SkipReview(Exception):
    """Raised to skip the review step on purpose."""


def check_recording(request: EvalRequest, isolation: str) -> None:
    """Stage 1 for ``--record-video``: the encoder writes a video and the env renders a frame.

    The env is reset with episode 0's seed and rendered once, in a sandbox of the evaluation's
    level when it is not ``inprocess``. Anything missing raises ``RequestError`` naming it, before
    any episode runs: a recording that was asked for is never silently left out.
    """
    asked = f"--record-video {request.record_video}"
    problem = probe_encoder()
    if problem is None:
        problem = probe_rendering(request.env, request.env_kwargs, request.max_steps,
                                  SeedLedger(request.seed).seed(0),
                                  replay_sandbox(request, isolation))
    if problem is not None:
        raise RequestError(
            f"{asked} cannot be honoured: {problem}. Install what is missing (Gymnasium's "
            "classic-control and box2d envs render with pygame: pip install pygame), or drop "
            "--record-video."
        )


#: Relative difference of returns tolerated between a replay and its row when the replay ran on
#: another device than the episodes (CPU vs CUDA kernels round differently); the same length is
#: still required. A larger difference is reported as a note, never as an alarm.
CROSS_DEVICE_RTOL = 1e-6


def replay_device(received: Received) -> str:
    """The device replays load the policy on: where the episodes ran, when this process can."""
    if received.device == "cpu" or cluster.gpu_count():
        return received.device
    return "cpu"


def cross_device(result: ReplayResult, device: str, received: Received) -> tuple[list[str], list[str]]:
    """(alarms, notes) of a replay's mismatches, judged for the device it ran on.

    Same device: any difference is non-determinism (an alarm). Another device: differences
    within ``CROSS_DEVICE_RTOL`` (same length) are expected; larger ones are
    stated as notes, since a different device can legitimately change an argmax.
    """
    if not result.mismatches:
        return [], []
    spec = received.env_spec
    changed = edited_since({**(spec.get("code") or {}),
                            **({spec["package"]: spec["package_version"]}
                               if spec.get("package") and spec.get("package_version") else {})})
    if changed:  # stage 7 runs after the numbers (the fast path): the env's files moved on
        return [], [f"{len(result.mismatches)} replayed episodes differ from their rows, but the "
                     f"env's code changed since they ran ({', '.join(changed)}): replays ran the "
                     "new code; not a determinism finding"]
    if device == received.device:
        return [f"{REPLAY_NONDETERMINISM}: {len(result.mismatches)} replayed episodes differ from "
                "their rows"], []
    beyond = [e for e in result.episodes if e.matches is False and e.expected is not None and not (
        e.length == e.expected[1]
        and abs(e.episode_return - e.expected[0]) <= CROSS_DEVICE_RTOL * max(1.0, abs(e.expected[0])))]
    note = (f"replays ran on {device}, episodes on {received.device}: {len(beyond)} of "
            f"{len(result.episodes)} replays differ beyond the cross-device tolerance "
            f"(rtol {CROSS_DEVICE_RTOL:g}); not a determinism alarm")
    return [], [note]


def edited_since(recorded: Mapping[str, str]) -> list[str]:
    """The modules of ``recorded`` whose files now say another version: edited since then.

    ``recorded``: ``{top: code version}`` of an env's fingerprint, as its episodes ran.
    """
    changed = []
    for top, version in sorted(recorded.items()):
        if version == "unknown":
            continue
        try:
            now = code_version(top)[1]
        except ValueError:  # a spec-less module: nothing identifies it
            continue
        # "unknown" now (a distribution's name that is no module, e.g. 'my-pkg') says nothing:
        # counted as an edit, it would turn a real replay_nondeterminism into a note.
        if now not in (version, "unknown"):
            changed.append(top)
    return changed


def recording_shortfall(request: EvalRequest, table: pa.Table, videos: int, trajectories: int,
                        why: list[str]) -> str | None:
    """An alarm when fewer videos or trajectories were written than asked (and could be)."""
    want_v = min(request.record_video, table.num_rows)
    want_t = min(request.record_trajectories, table.num_rows)
    short = [f"{got} of {want} {what}" for got, want, what in (
        (videos, want_v, "videos"), (trajectories, want_t, "trajectories")) if got < want]
    if not short:
        return None
    reasons = "; ".join(dict.fromkeys(why)) or "no reason was given"
    return f"{RECORDING_INCOMPLETE}: wrote {', '.join(short)} asked for ({reasons})"


def review_skipped(request: EvalRequest, collected: Collected) -> str | None:
    """Why stage 7 has no review (plots, replays, page) for this evaluation; None: it has one."""
    if request.record_trajectories or request.record_video:
        return None
    # A full cache hit was reviewed when it was computed; re-plotting it costs ~1.5 s per request.
    # Rows from an interrupted run's shard files never were: their replays are the review's check.
    if collected.fresh.num_rows == 0 and not collected.resumed:
        return "cache hit: no new episodes to review"
    if not request.review:
        return "review off for this request (review=False)"
    return None


class ReplayFailed(Exception):
    """The review's replays left no result (the text says why)."""


def review(
    request: EvalRequest, received: Received, report: EvalReport, table: pa.Table, folder: Path,
    collected_replays: ReviewReplays | None = None,
) -> tuple[EvalReport, list[Path], Callable[[EvalReport], Path]]:
    """Failure clusters, replays (trajectories, videos, actions), plots and the report page.

    Also returns what renders the page again for a later report (its plots and videos as they
    are): alarms raised after the review (``feed_back``) must reach the page too.

    Replays step the env at the evaluation's isolation level (a sandbox of the same level for
    ``process`` and ``bwrap``) with the policy on the episodes' device. ``collected_replays``:
    those a worker ran ahead (``Collected.replays``); otherwise they run here, on the episodes'
    device when this process has it. Fewer videos or trajectories than asked is an alarm and a
    harness fault, never just a note.
    """
    clusters = cluster_failures(table)
    files: list[Path] = []
    notes: list[str] = []
    alarms: list[str] = []
    actions = None
    videos: dict[int, Path] = {}
    trajectories = 0
    why: list[str] = []
    replays = collected_replays or review_replays(
        request, received.artifact, received.isolation, table, replay_device(received))
    device = replays.device
    try:
        if replays.error is not None:
            raise ReplayFailed(replays.error)
        result = replays.placed(folder)
        logger.info("replayed %d episodes on %s in %.2f s%s", len(result.episodes), device,
                    replays.seconds, " on a worker" if collected_replays is not None else "")
        if request.record_trajectories and result.trajectories is not None:
            files.append(write_table(result.trajectories, folder / "trajectories.parquet"))
            # Replayed for it, rows or not: a failure at an episode's first step leaves none.
            trajectories = len(result.trajectory_episodes)
        videos = dict(result.videos)
        files += list(videos.values())
        actions = dict(result.actions, note="replayed: worst, best, failed, then a seeded sample")
        notes += result.notes()
        more_alarms, more_notes = cross_device(result, device, received)
        alarms += more_alarms
        notes += more_notes
        why += [*result.video_skipped.values(), *result.skipped.values(),
                *(f"episode {i}: {r}" for i, r in sorted(result.interrupted.items()))]
    except Exception as err:  # the shortfall below makes it an alarm when recordings were asked
        text = str(err) if isinstance(err, ReplayFailed) else f"{type(err).__name__}: {err}"
        logger.error("replaying episodes failed: %s", text)
        notes.append(f"replays failed: {text}")
        why.append(f"replays failed: {text}")
    shortfall = recording_shortfall(request, table, len(videos), trajectories, why)
    if shortfall:
        logger.error(shortfall)
        alarms.append(shortfall)
    if alarms:
        report = report.model_copy(update={"alarms": [*report.alarms, *alarms],
                                           "harness_fault": report.harness_fault or bool(shortfall)})
    if shortfall and report.history:  # a harness fault now: never the training run's best
        from evalfleet.history import never_best

        report = report.model_copy(update={"history": never_best(report.history, ["harness_fault"])})
    adaptive = report.adaptive or {}
    # matplotlib: imported by the review step only
    from evalfleet.plots import HISTORY_FILE, render_history, render_plots

    plots = render_plots(table, folder / "plots", actions=actions, rounds=adaptive.get("rounds"),
                         ci=report.ci if report.scored else None,
                         target_halfwidth=adaptive.get("target_halfwidth"))
    report = report.model_copy(update={"failure_clusters": clusters})
    curve = curve_so_far(report)
    if curve:  # the training run's curve so far, on the page (and in MLflow with the plots)
        plots = dict(plots, history=render_history(curve, folder / "plots" / HISTORY_FILE,
                                                   title=f"training run {report.training_run_id}"))

    def page(shown: EvalReport) -> Path:
        return report_page(shown, clusters, plots, folder / "report.html", videos=videos, notes=notes)

    return report, [*files, *plots.values(), page(report)], page


#: What the review writes in a run folder (``review``): plots, videos, trajectories, the page.
REVIEW_OUTPUTS = ("plots", "videos", "trajectories.parquet", "report.html")


def clear_review_outputs(folder: Path) -> None:
    """Remove review outputs an earlier evaluation under the same request id left in ``folder``.

    A retried flow run (same parameters, same request id) that records fewer videos, no
    trajectories or no adaptive rounds would otherwise leave the first attempt's files beside
    its own, read as this evaluation's.
    """
    for name in REVIEW_OUTPUTS:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists() or path.is_symlink():
            path.unlink(missing_ok=True)


def review_files_by_name(files: list[Path]) -> dict[str, Path]:
    """The review outputs a user looks for by name."""
    named = {"report.html": "report_html", "trajectories.parquet": "trajectories"}
    return {named[p.name]: p for p in files if p.name in named}


def cache_status(request: EvalRequest, collected: Collected) -> str:
    """'hit', 'partial' or 'miss' over all rounds; 'off' / 'refresh' when the cache was bypassed."""
    if request.cache != "use":
        return request.cache
    if not collected.fresh.num_rows:
        return "hit"
    return "partial" if collected.plan_cached else "miss"


def feed_back(
    request: EvalRequest, received: Received, report: EvalReport, collected: Collected
) -> EvalReport:
    """Stage 7: Parquet first (it must survive any other sink failing), cache, JSON, then MLflow."""
    t0 = time.perf_counter()
    report = scrubbed(report)
    if report.history is None:  # the fast path computed it already, with the result
        report = with_history(request, report, collected.table)
    folder = run_dir(request.output, request.request_id)
    stamped = stamp_evaluation(collected.table, request.request_id, request.training_run_id,
                               request.step)
    parquet = write_episodes(stamped, folder / "episodes.parquet")
    outputs = {"folder": str(folder.resolve()), "episodes": str(parquet.resolve())}
    artifacts = [parquet]
    missing: list[str] = []  # outputs asked for and not produced: alarms, and a failed run
    # What the review adds to the report is computed on a hit too (cheap): a hit's report equals
    # the miss's; only the files (plots, replays, page) are skipped.
    report = report.model_copy(update={"failure_clusters": cluster_failures(collected.table)})
    clear_review_outputs(folder)  # an earlier run under this request id (a retry) left its own
    page: Callable[[EvalReport], Path] | None = None  # renders report.html again (review)
    try:
        skipped = review_skipped(request, collected)
        if skipped is not None:
            raise _SkipReview(skipped)
        report, review_files, page = review(request, received, report, collected.table, folder,
                                            collected.replays)
        artifacts += review_files
        outputs.update({k: str(v.resolve()) for k, v in review_files_by_name(review_files).items()})
    except _SkipReview as why:
        outputs["review"] = f"skipped ({why})"
    except Exception as err:  # plots and replays must never cost the results
        logger.error("review step failed (%s); results are in %s", err, folder)
        outputs["review_error"] = f"{type(err).__name__}: {err}"
        asked = " and the recordings asked for" if (request.record_trajectories or
                                                    request.record_video) else ""
        missing.append(f"the review (plots, report.html{asked}): {outputs['review_error']}")
    forget_replayed(request, received, report)
    # The review's shortfall is known now: report.json and the MLflow run (its alarm tags, its
    # copy of report.json) carry it as the final report does.
    report = report.model_copy(update={"alarms": with_missing(report.alarms, missing)})
    logged_missing = len(missing)
    report_path = folder / "report.json"
    write_json(report.model_dump(mode="json"), report_path)
    outputs["report"] = str(report_path.resolve())
    tracking_uri = request.mlflow_uri or default_tracking_uri(request.output)
    try:  # retried, then queued under the output folder: a failing sink never loses the result
        outputs.update(log_or_queue(
            request.output,
            tracking_uri,
            request.experiment,
            report.model_dump(mode="json"),
            params=mlflow_params(request, report),
            artifacts=[*artifacts, report_path],
            run_name=f"eval-{request.env.rsplit(':', 1)[-1]}-{report.policy_sha256[:12]}",
        ))
    except Exception as err:  # even the queue failed (a full disk): the Parquet is written
        logger.error("MLflow logging failed (%s); results are in %s", err, folder)
        outputs["mlflow_error"] = f"{type(err).__name__}: {err}"
        missing.append(f"the MLflow run (neither logged nor queued): {outputs['mlflow_error']}")
    if "mlflow_permanent" in outputs:  # queued, but no later try can log it as the store is
        missing.append(f"the MLflow run: {outputs['mlflow_permanent']}; it is queued as "
                       f"{outputs['mlflow_queued']}: fix the store, then 'evalfleet mlflow flush'")
    if "mlflow_run_id" in outputs:  # the store answers: log what earlier runs had to queue
        flushed = flush_queued(request.output)
        if flushed:
            outputs["mlflow_flushed"] = flushed
    timings = dict(report.timings, feed_back=time.perf_counter() - t0)
    final = scrubbed(report.model_copy(update={"outputs": outputs, "timings": timings,
                                               "alarms": with_missing(report.alarms,
                                                                      missing[logged_missing:])}))
    if page is not None and missing[logged_missing:]:  # MLflow's alarms come after the page
        page(final)
    final = write_report(final, report_path)
    if request.callback_url:  # last, so the trainer gets the MLflow run id; never raises
        from evalfleet.callback import send_report_callback

        logged = len(final.alarms)  # what the MLflow run holds, when it was logged
        outcome = send_report_callback(request.callback_url, final.model_dump(mode="json"))
        alarms = final.alarms if outcome.startswith("delivered") else with_missing(
            final.alarms, [f"the callback to the trainer: {outcome}"])
        final = scrubbed(final.model_copy(update={"outputs": {**final.outputs, "callback": outcome},
                                                  "alarms": alarms}))
        final = write_report(final, report_path)
        if len(final.alarms) > logged:  # the page, and MLflow's copies, show them too
            shown = [page(final)] if page is not None else []
            if "mlflow_run_id" in final.outputs:  # also a run a flush logged meanwhile
                final = late_alarms_logged(final, final.alarms[logged:], [report_path, *shown])
                final = write_report(final, report_path)
    return final


#: What ``evalfleet mlflow flush`` records in report.json once it logged a queued run
#: (``tracking._note_logged``, which also drops ``mlflow_queued`` and ``mlflow_error``).
LATE_RUN_OUTPUTS = ("mlflow_uri", "mlflow_run_id", "mlflow_logged_late", "mlflow_queued_after")


def write_report(final: EvalReport, path: Path) -> EvalReport:
    """Write stage 7's report.json, keeping the MLflow run a flush recorded there meanwhile.

    Once its run is queued, ``evalfleet mlflow flush`` may log it while stage 7 still runs (its
    callback waiting on a slow trainer) and record the run id in report.json; stage 7's next
    write from memory put back ``mlflow_queued``, naming the removed queue file, for good. The
    read and the write hold the report's lock, as the flush's do. Returns what was written.
    """
    with report_lock(path):
        final = with_late_run(final, path)
        write_json(final.model_dump(mode="json"), path)
    return final


def with_late_run(report: EvalReport, path: Path) -> EvalReport:
    """``report`` with the late MLflow run that report.json at ``path`` records, if its queue file is gone."""
    queued = report.outputs.get("mlflow_queued")
    if not queued or Path(queued).exists():  # not queued, or not logged: nothing to take
        return report
    try:
        on_disk = json.loads(path.read_text()).get("outputs") or {}
    except (OSError, ValueError, AttributeError):
        return report
    if not (on_disk.get("mlflow_logged_late") and on_disk.get("mlflow_run_id")):
        return report
    outputs = {k: v for k, v in report.outputs.items() if k not in ("mlflow_queued", "mlflow_error")}
    if "mlflow_error" in report.outputs:  # what queued it, kept as such (as the flush does)
        outputs["mlflow_queued_after"] = report.outputs["mlflow_error"]
    outputs.update({k: str(on_disk[k]) for k in LATE_RUN_OUTPUTS if k in on_disk})
    return report.model_copy(update={"outputs": outputs})


def late_alarms_logged(report: EvalReport, late: list[str],
                       artifacts: Sequence[Path] = ()) -> EvalReport:
    """The report once the alarms raised after its MLflow run was logged are logged there too.

    The run's alarm tags and ``eval/alarm_count`` (there and in the trainer's run) then agree
    with report.json, and ``artifacts`` (report.json and the page, written with them) replace
    the run's copies. Like every other sink it never costs the results: a failure is stated in
    ``outputs['mlflow_alarms_error']``.
    """
    from evalfleet.tracking import log_late_alarms

    try:
        log_late_alarms(report.outputs["mlflow_uri"], report.outputs["mlflow_run_id"],
                        report.model_dump(mode="json"), late, list(artifacts))
    except Exception as err:  # the store went away since: logged and stated, never fatal
        logger.error("could not log the late alarms into MLflow run %s: %s",
                     report.outputs["mlflow_run_id"], err)
        return scrubbed(report.model_copy(update={"outputs": {
            **report.outputs, "mlflow_alarms_error": f"{type(err).__name__}: {err}"[:1000]}}))
    return report


def with_history(request: EvalRequest, report: EvalReport, table: pa.Table) -> EvalReport:
    """The report with its ``history`` (``evalfleet.history``): verdict, best checkpoint, alarms.

    Only for a request with a training run id and a step. A history that cannot be read (an
    unreachable MLflow store) is stated in ``history['error']``; it never costs the results.
    """
    if request.training_run_id is None or request.step is None:
        return report
    from evalfleet.history import alarm_lines, feed_back_history, saw_step

    uri = request.mlflow_uri or default_tracking_uri(request.output)
    # An earlier checkpoint whose MLflow run was queued (the store was down) is history too: it
    # is logged first, or the verdict fails closed. Read without it, a regression against it was
    # "first" (or judged against a worse checkpoint) and the gate passed. One another process is
    # logging now is waited for: still queued, the verdict would fail closed.
    flush_queued(request.output, wait_s=FLUSH_WAIT_S)
    # Earlier steps evaluated right now are history too: wait until they are logged.
    busy = wait_for_earlier(request.output, uri, request.training_run_id, request.step)
    # Later steps judged already (their runs not logged yet) may have been judged without this
    # one: read before the history, so one logged since is in it (``claims``).
    judged = [int(c["step"]) for c in later_judged(request.output, uri, request.training_run_id,
                                                   request.step)
              if not saw_step(c.get("seen_steps"), request.step)]
    waiting = queued_checkpoints(request.output, uri, request.training_run_id)
    try:
        if busy:
            raise HistoryIncomplete(
                f"earlier checkpoints of training run {request.training_run_id!r} are still being "
                f"evaluated: {describe(busy)}; the verdict is not decided without them. Evaluate "
                "a run's checkpoints in step order, or wait longer (EVALFLEET_HISTORY_WAIT_S)")
        if waiting:
            raise HistoryIncomplete(
                f"{len(waiting)} earlier evaluation(s) of training run {request.training_run_id!r} "
                f"(step {', '.join(waiting)}) are queued in {pending_dir(request.output)}, "
                "not logged: the store did not take them. Run 'evalfleet mlflow flush --output "
                f"{request.output}' once it answers; the verdict is not decided without them")
        history = feed_back_history(report.model_dump(mode="json"), table, uri,
                                    episode_cache(request), request.outcome_metric, judged)
        # Held by this evaluation until its run is logged (after this): earlier steps judged
        # from now on learn that this verdict was made without them.
        if history and history.get("seen_steps"):
            mark_judged(claim_path(request.output, uri, request.training_run_id, request.step,
                                   request.request_id), str(history["seen_steps"]))
    except Exception as err:  # like every other sink: logged and stated, never fatal
        logger.error("reading the training run's history failed: %s", err)
        history = {"error": f"{type(err).__name__}: {err}", "verdict": None, "alarms": []}
    return report.model_copy(update={"history": history,
                                     "alarms": [*report.alarms, *alarm_lines(history)]})


def history_claim(request: EvalRequest) -> AbstractContextManager[Path | None]:
    """The claim of the request on its step of the training run (``evalfleet.claims``).

    Held by the caller from stage 1 until the MLflow run is logged or queued. The wait stage 7
    gives earlier steps is read here too: a bad ``EVALFLEET_HISTORY_WAIT_S`` is refused now.
    """
    if request.training_run_id is not None and request.step is not None:
        wait_s()
    return claimed(request.output, request.mlflow_uri or default_tracking_uri(request.output),
                   request.training_run_id, request.step, request.request_id)


def take_history_claim(request: EvalRequest) -> Path | None:
    """Take the claim ``history_claim`` holds, for a caller that hands it on to stage 7.

    Released by ``release_history_claim`` (again is fine). No context manager: one handed on
    unexited is closed, releasing the claim, when it is dropped. A bad ``EVALFLEET_HISTORY_WAIT_S``
    is refused here too, as by ``history_claim``.
    """
    if request.training_run_id is not None and request.step is not None:
        wait_s()
    return take(request.output, request.mlflow_uri or default_tracking_uri(request.output),
                request.training_run_id, request.step, request.request_id)


def release_history_claim(request: EvalRequest) -> None:
    """Drop this evaluation's claim (taken by ``history_claim`` and handed on to stage 7)."""
    if request.training_run_id is not None and request.step is not None:
        release(claim_path(request.output, request.mlflow_uri or default_tracking_uri(request.output),
                           request.training_run_id, request.step, request.request_id))


class HistoryIncomplete(RuntimeError):
    """Earlier checkpoints of the training run are queued for MLflow, not in the store."""


def queued_checkpoints(output: Path, tracking_uri: str, training_run_id: str) -> list[str]:
    """Steps of ``training_run_id`` whose runs for ``tracking_uri`` wait in ``output``'s queue.

    A pending file that cannot be read counts (as its name): it may be one of them.
    """
    steps = []
    for path in sorted(pending_dir(output).glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            report = entry["report"]
            mine = (entry.get("tracking_uri") == tracking_uri
                    and report.get("training_run_id") == training_run_id)
            if mine and report.get("step") is not None:
                steps.append(str(int(report["step"])))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            steps.append(f"unreadable {path.name}")
    return steps


#: How long a history read waits for a queued run another process is logging (``flush_queued``).
FLUSH_WAIT_S = 120.0


def flush_queued(output: Path, wait_s: float = 0.0) -> str | None:
    """Log MLflow runs earlier evaluations under ``output`` queued; a line saying what happened.

    ``wait_s``: how long to wait for a run another process is logging right now (``flush_pending``).
    """
    if not any(pending_dir(output).glob("*.json")):
        return None
    results = flush_pending(output, wait_s=wait_s)
    done = [r["request_id"] for r in results if "mlflow_run_id" in r]
    left = len(results) - len(done)
    logger.info("logged %d queued MLflow runs (%d still queued)", len(done), left)
    return f"logged {len(done)} queued runs ({', '.join(done)}); {left} still queued"


def store_in_cache(request: EvalRequest, received: Received, collected: Collected | None) -> int:
    """Store the episodes under the request's key (while its lock is held); returns rows stored.

    Nothing is stored with the cache off, on a full hit the entry alone answered, or when the
    determinism audit found re-run episodes that differ, or replays run ahead (``Collected
    .replays``) differ from their rows: a non-reproducible table must never be reused, and
    the key's entry and shard files are dropped with it (their rows came from the same env). A
    hit that took rows from shard files folds them into the entry, and so does one whose entry
    the audit covered only now (``unaudited``). The audit is kept in the entry's manifest, so
    that a later hit reports it as the miss did.
    """
    if collected is None or request.cache == "off":
        return 0
    if not (collected.fresh.num_rows or collected.resumed or collected.audit_rows.num_rows
            or request.cache == "refresh"):
        return 0
    audit = determinism_audit(collected.table, collected.audit_rows) if request.audit else None
    if (audit and audit["mismatches"]) or replays_differ(collected.replays, received):
        episode_cache(request).remove(received.cache_key)
        return 0
    if inputs_changed(request, received):
        episode_cache(request).discard_shards(received.cache_key)  # persisted as shards finished
        return 0
    ran = run_record(request, received, collected) if collected.fresh.num_rows else None
    if ran is not None and _recovered_under_own_id(request, received, collected):
        # Rows an interrupted run under this request id persisted: its settings were not kept.
        ran = {"request_id": request.request_id, "computed_at": None, "execution": None,
               "unknown": RESUMED_UNDER_OWN_ID}
    return episode_cache(request).store(received.cache_key, collected.table,
                                        received.cache_ingredients,
                                        replace=request.cache == "refresh", audit=audit,
                                        execution=ran)


#: Why a request id's rows have no one execution: some were recovered from an interrupted run under it.
RESUMED_UNDER_OWN_ID = ("unknown: some of these episodes were recovered from an interrupted evaluation "
                        "under the same request id, whose settings were not kept (give each "
                        "evaluation its own request id)")


def _recovered_under_own_id(request: EvalRequest, received: Received, collected: Collected) -> bool:
    """True when rows under this request id that it did not run come from shard files, not a record.

    Before, a re-run of an interrupted request under its id with other settings stated its own
    settings (concurrency 4 on 2 workers) for episodes the killed run computed with 10 on 1.
    """
    if not collected.resumed:
        return False
    fresh = set(collected.fresh.column("episode_index").to_pylist())
    ours = [i for rid, i in zip(collected.table.column("request_id").to_pylist(),
                                collected.table.column("episode_index").to_pylist(), strict=True)
            if rid == request.request_id and i not in fresh]
    if not ours:
        return False
    kept = episode_cache(request).executions(received.cache_key).get(request.request_id)
    return kept is None  # a kept record: the entry's rows, judged against it by ``store``


def replays_differ(replays: ReviewReplays | None, received: Received) -> bool:
    """Whether replays found episodes that differ from their rows: a ``replay_nondeterminism``."""
    if replays is None or replays.result is None:
        return False
    alarms, _ = cross_device(replays.result, replays.device, received)
    return bool(alarms)


def forget_replayed(request: EvalRequest, received: Received, report: EvalReport) -> bool:
    """Drop the key's entry and shard files when the review's replays proved them irreproducible.

    Stage 7 replays after the store where nothing ran them ahead (the warm path, suites, a hit
    with recordings asked): the table was stored, and a later request was served it as a clean
    hit, its report without the alarm. Taken under the key's lock, which the caller must not
    hold. True if something was dropped.
    """
    if request.cache == "off" or not any(
            a.startswith(f"{REPLAY_NONDETERMINISM}: ") for a in report.alarms):
        return False
    cache = episode_cache(request)
    with cache.exclusive(received.cache_key):
        dropped = cache.remove(received.cache_key)
    if dropped:
        logger.warning("replays differ from their rows: cache entry %s dropped (its episodes are "
                       "not reproducible)", received.cache_key[:12])
    return dropped


def persist_shard(request: EvalRequest, received: Received, shard: Shard, table: pa.Table) -> int:
    """Persist one finished shard's episodes under the request's key now; returns rows written.

    So a driver killed later loses nothing finished: the same request re-run plans only what no
    finished shard holds. Audit shards (re-runs) and the cache off persist nothing; a failing
    write is logged and left to the final ``store_in_cache``, never costing the evaluation.
    """
    if request.cache == "off" or shard.audit or inputs_changed(request, received):
        return 0
    try:
        return episode_cache(request).persist_shard(received.cache_key, table)
    except OSError as err:
        logger.warning("could not persist shard %d's episodes (%s); they are stored when the "
                       "evaluation ends", shard.shard_id, err)
        return 0


#: What ``inputs_changed`` found during each evaluation of this process, by request id.
_changed: dict[str, list[str]] = {}
_changed_lock = threading.Lock()


def inputs_changed(request: EvalRequest, received: Received, *, done: bool = False) -> list[str]:
    """What the cache key names that is no longer as stage 1 read it, found now or earlier in the run.

    The code versions of the env's and the policy's modules, the files the env's kwargs name and
    evalfleet's own code, read again from disk (~10 ms). A sandbox imports the env's code afresh,
    and an env reads its scenario file when it runs: an edit during the run made later episodes
    run other code, and their rows were stored under the key of the code before it, then served
    for it (mean 353 for a truth of 200). Nothing of such a run is persisted or stored, and its
    report carries the ``inputs_changed`` alarm (``summarize``). ``done``: the last look, which
    forgets the request.
    """
    ing = received.cache_ingredients
    env = ing.get("env") or {}
    code = {**(env.get("code") or {}), **((ing.get("policy") or {}).get("code") or {})}
    entry = str(env.get("entry_point") or "").split(":", 1)[0]
    if entry and env.get("package_version"):  # the entry point's own package, as envspec reads it
        code[entry] = str(env["package_version"])
    found = [_what_changed(top, want, have) for top, want in sorted(code.items())
             if want != "unknown" and (have := code_version(top)[1]) != want]
    for path, digest in sorted((env.get("files") or {}).items()):
        have = named_files(path).get(path, "gone")
        if have != digest:
            found.append(f"the file {path} (sha256 {digest[:12]} -> {have[:12]})")
    harness = (ing.get("versions") or {}).get("evalfleet")
    if harness is not None and harness_versions()["evalfleet"] != harness:
        found.append(f"evalfleet's own code ({harness} -> {harness_versions()['evalfleet']})")
    with _changed_lock:
        seen = _changed.pop(request.request_id, []) if done else _changed.setdefault(
            request.request_id, [])
        seen += [f for f in found if f not in seen]
        return list(seen)


def _what_changed(top: str, want: str, have: str) -> str:
    """``inputs_changed``'s words for a module whose code version is no longer ``want``."""
    if DATA_MARK in want and DATA_MARK in have and want.split(DATA_MARK)[0] == have.split(DATA_MARK)[0]:
        return (f"the data files beside module {top!r} (its code is the same; an env that writes "
                "beside its own module changes them: keep the module in a folder of its own)")
    return f"the code of {top!r} ({want} -> {have})"


def shard_persister(request: EvalRequest, received: Received, planned: Planned
                    ) -> Callable[[int, pa.Table], int]:
    """``persist_shard`` of the ``planned`` shard at a position, for the run stage's futures."""
    return lambda position, table: persist_shard(request, received, planned.shards[position], table)


def names_own_hash(request: EvalRequest, received: Received) -> bool:
    """True when the baseline is 'sha256:HEX' with HEX a prefix of the evaluated policy's hash."""
    ref = request.baseline
    return bool(ref and ref.startswith("sha256:")
                and received.artifact.sha256.startswith(ref.removeprefix("sha256:").lower()))


def same_policy(request: EvalRequest, received: Received) -> bool:
    """True when the baseline is the evaluated policy under the same key (same episodes).

    A 'sha256:' baseline naming the evaluated policy's own hash is itself only when every
    cached evaluation of that hash under this protocol has this evaluation's cache key: the hash
    of a callable covers its module only, and a helper module it imports (a factory's network)
    is keyed apart. Taken for itself, a cached evaluation with other imported code (CartPole
    500) read as a difference of exactly 0 from a policy scoring 9.6. Such a baseline is refused.
    """
    ref = request.baseline
    if ref is None:
        return False
    if ref.startswith("sha256:"):
        if not names_own_hash(request, received):
            return False
        own = received.artifact.sha256
        found = _hash_entries(request, received)
        other = [key for key in found.get(own, []) if key != received.cache_key]
        if other:
            raise RequestError(_not_itself(request, received, other))
        # Another cached policy under this protocol with the prefix: the baseline may be that one.
        _one_hash_match(request, received, also=own, found=found)
        return True
    if (ref, request.baseline_factory) == (request.policy, request.policy_factory):
        return True
    return receive(baseline_request(request, request.episodes)).cache_key == received.cache_key


def _not_itself(request: EvalRequest, received: Received, keys: list[str]) -> str:
    """``same_policy``'s refusal: the evaluated policy's hash is cached under another key."""
    cache = episode_cache(request)
    mine = (received.cache_ingredients.get("policy") or {}).get("code") or {}
    modules: set[str] = set()
    for key in keys:
        theirs = ((cache.ingredients(key) or {}).get("policy") or {}).get("code") or {}
        modules |= {m for m in set(mine) | set(theirs) if mine.get(m) != theirs.get(m)}
    what = (f"the code of {', '.join(repr(m) for m in sorted(modules))} differs"
            if modules else "the code it imports differs")
    n = len(keys)
    return (
        f"baseline {request.baseline!r} names the evaluated policy's own hash "
        f"({received.artifact.sha256[:16]}), but the cache holds {n} evaluation{'s' if n > 1 else ''} "
        f"of that hash under this protocol with another cache key ({', '.join(k[:12] for k in keys)}; "
        f"this evaluation's is {received.cache_key[:12]}): {what}, so "
        f"{'they are' if n > 1 else 'it is'} not this policy, and reading the baseline as this "
        "evaluation itself would report a difference of exactly 0. To compare with that "
        "evaluation, pass the baseline policy with the code it had (file or module:function, "
        "--baseline-factory) to run it on the same seeds; to evaluate the policy alone, drop "
        "--baseline. 'evalfleet cache ls' lists the cached entries.")


def scrubbed(report: EvalReport) -> EvalReport:
    """``report`` with every secret value known to this process replaced (see ``redaction``)."""
    data = report.model_dump(mode="json")
    clean = redact_json(data)
    return report if clean == data else EvalReport.model_validate(clean)


def baseline_request(request: EvalRequest, episodes: int) -> EvalRequest:
    """The baseline's evaluation: same env, seeds and protocol; its own run and cache entry."""
    return request.model_copy(update={
        "policy": request.baseline, "policy_factory": request.baseline_factory, "baseline": None,
        "episodes": episodes, "target_ci_halfwidth": None, "max_episodes": None,
        "request_id": f"{request.request_id}-baseline", "callback_url": None,
        # Not a checkpoint of the training run: no history of its own, nothing in the trainer's run.
        "step": None,
    })


def receive_baseline(request: EvalRequest) -> tuple[EvalRequest, Received]:
    """The baseline's request and stage 1, its errors naming the baseline's own options.

    A missing ``--baseline`` file was "policy file ... does not exist", with advice to pass
    ``--policy-factory``: the policy named was fine, and the option to fix was another.
    """
    other = baseline_request(request, request.episodes)
    try:
        return other, receive(other)
    except RequestError as err:
        text = str(err).replace("--policy-factory", "--baseline-factory")
        raise type(err)(f"--baseline {request.baseline!r}: {text}") from err


def check_hash_baseline(request: EvalRequest, received: Received) -> None:
    """Stage 1 for a ``sha256:`` baseline: its episodes are found before anything runs.

    ``cached_baseline`` over every episode the run may pair on (a fixed count, or an adaptive
    run's ``max_episodes``: it pairs on all it ran, and may run them all): where the cache and
    the logged runs lack some, the error comes now, not after the evaluated policy ran. Checked
    on the first round only, an adaptive run ran 40 episodes, then exited 2 with no report.
    """
    if request.baseline and request.baseline.startswith("sha256:") and not same_policy(
            request, received):
        cached_baseline(request, received, request.max_episodes or request.episodes)


@contextmanager
def baseline_after_run() -> Iterator[None]:
    """Finding the baseline's episodes once the evaluation ran: no error says nothing was spawned.

    Stage 1 found them (``check_hash_baseline``, the baseline's own stage 1); a ``RequestError``
    now (a cache entry of the hash removed or added meanwhile, the baseline's file edited) exited 2,
    "bad request, nothing was spawned", after every episode ran, with no report. It is
    ``BaselineUnavailable`` (exit 7), saying that the evaluation ran and what to do.
    """
    try:
        yield
    except (RequestError, IsolationUnavailable) as err:
        raise BaselineUnavailable(
            f"the evaluation ran, but its baseline's episodes could not be had afterwards: {err} "
            "Stage 1 had found them: what they come from changed while the evaluation ran. This "
            "evaluation's episodes are in the cache (unless --no-cache): run it again to compare "
            "with the baseline as it is now.") from err


def cached_baseline(request: EvalRequest, received: Received, episodes: int) -> tuple[pa.Table, str]:
    """Episodes of a baseline given as 'sha256:HEX', found in the cache under the same protocol.

    Every one of the ``episodes`` indices, or an error: the cache keeps no episode the policy's
    runtime or the infrastructure ended, so where it lacks some, the evaluation logged under the
    same key in MLflow (its ``episodes.parquet``) must hold them all. Pairing on the rest would
    leave out exactly the episodes where the baseline broke.
    """
    ref = str(request.baseline)
    cache = episode_cache(request)
    for key in _one_hash_match(request, received).values():
        found = cache.lookup(key, range(episodes))
        if not found.missing:
            return found.stored, ref
        from evalfleet.history import logged_episodes

        uri = request.mlflow_uri or default_tracking_uri(request.output)
        whole = logged_episodes(uri, key, range(episodes))
        if whole is not None:
            return whole, ref
        some = ", ".join(str(i) for i in found.missing[:5]) + (", ..." if len(found.missing) > 5
                                                                else "")
        raise RequestError(
            f"baseline {ref!r}: the cache holds {found.stored.num_rows} of the {episodes} episodes "
            f"to pair on; {len(found.missing)} are missing (indices {some}): "
            "episodes the baseline's policy runtime or the infrastructure ended (policy_error, "
            "policy_timeout, timeout, crashed, oom) are never cached, or it ran fewer episodes, and "
            f"no evaluation logged in {uri} under its key holds them all. Pairing without them "
            "would bias the comparison: pass the baseline policy file instead (its missing "
            "episodes then run on the same seeds)."
        )
    raise RequestError(
        f"baseline {ref!r}: no cached episodes of a policy with that hash under this env and "
        f"protocol in {cache.root}; pass the baseline policy file instead."
    )


def _hash_entries(request: EvalRequest, received: Received) -> dict[str, list[str]]:
    """The cached entries a 'sha256:' baseline's prefix names under this protocol: sha256 -> keys."""
    prefix = str(request.baseline)[len("sha256:"):].lower()
    cache = episode_cache(request)
    mine = {k: v for k, v in received.cache_ingredients.items() if k != "policy"}
    keys: dict[str, list[str]] = {}  # policy sha256 -> its entries' keys, under this protocol
    for entry in cache.entries():
        sha = str(entry.get("policy_sha256") or "")
        ing = cache.ingredients(str(entry["key"])) if sha.startswith(prefix) else None
        if ing is not None and {k: v for k, v in ing.items() if k != "policy"} == mine:
            keys.setdefault(sha, []).append(str(entry["key"]))
    return keys


def _one_hash_match(request: EvalRequest, received: Received, also: str | None = None,
                    found: dict[str, list[str]] | None = None) -> dict[str, str]:
    """The cached policies a 'sha256:' baseline names under this protocol: sha256 -> entry key.

    ``also``: a policy the prefix names besides the cached ones (the evaluated policy). More
    than one in all is refused: which one the baseline meant is the user's to say. ``found``:
    ``_hash_entries`` read already.
    """
    ref = str(request.baseline)
    keys = _hash_entries(request, received) if found is None else found
    for sha, entries in keys.items():
        # One hash, several entries: the policy's file is the same, the code it imports was not
        # (a callable's helper module, a factory's). Which episodes were meant is not known.
        if len(entries) > 1:
            raise RequestError(
                f"baseline {ref!r}: the cache holds {len(entries)} evaluations of policy "
                f"{sha[:16]} under this protocol, run with different versions of the code it "
                "imports; a hash cannot say which one is meant. Pass the baseline policy itself "
                "(file or module:function) to evaluate it as its code is now.")
    matches = {sha: entries[0] for sha, entries in keys.items()}
    named = sorted(set(matches) | ({also} if also else set()))
    if len(named) > 1:
        raise RequestError(
            f"baseline {ref!r} matches {len(named)} policies under this evaluation's protocol "
            f"({', '.join(sha[:16] for sha in named)}"
            f"{', the evaluated policy among them' if also else ''}): give more of the sha256, "
            "enough to name one.")
    return matches


def mlflow_params(request: EvalRequest, report: EvalReport) -> dict[str, Any]:
    """The request's protocol and execution settings as MLflow params."""
    # Execution settings are the manifest's: on a full hit the computing run's, None if unknown.
    execution = report.manifest["execution"] if "execution" in report.manifest else {
        "concurrency": request.concurrency}
    return {
        "env": request.env,
        "env_kwargs": request.env_kwargs,
        "policy": request.policy,
        "policy_sha256": report.policy_sha256,
        # Run in all (an adaptive evaluation's rounds together), as the report and the metric
        # eval/episodes say; the first round's size beside it.
        "episodes": report.episodes,
        "first_round_episodes": request.episodes,
        "target_ci_halfwidth": request.target_ci_halfwidth,
        "concurrency": (execution or {}).get("concurrency"),
        "seed": request.seed,
        "max_steps": request.max_steps,
        "deterministic": request.deterministic,
        "isolation": report.isolation,
        # Where inference ran (as isolation: resolved), beside what was asked for: a CUDA run
        # that fell back to CPU must not read 'auto' or 'cuda' in MLflow.
        "device": (report.manifest.get("execution") or {}).get("device", request.device),
        "device_requested": request.device,
        "episode_timeout_s": request.episode_timeout_s,
        "outcome_metric": request.outcome_metric,
    }


def outcome_table(table: pa.Table) -> pa.Table:
    """The columns that must be equal across reruns and cluster shapes."""
    return table.select(list(OUTCOME_COLUMNS))


__all__ = [
    "EPISODE_SCHEMA",
    "Collected",
    "Received",
    "collect",
    "distribute",
    "feed_back",
    "outcome_table",
    "plan",
    "receive",
    "baseline_after_run",
    "names_own_hash",
    "same_policy",
    "spawn",
    "store_in_cache",
    "summarize",
]
