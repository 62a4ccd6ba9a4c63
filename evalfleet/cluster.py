"""The Dask side: opening a cluster, distributing the policy, loading it once per worker."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from evalfleet.environ import exported
from evalfleet.errors import PolicyIntegrityError, RequestError
from evalfleet.lifeline import DRIVER_PID_ENV
from evalfleet.models import PolicyHandle
from evalfleet.policy import (
    LoadedPolicy,
    PolicyArtifact,
    load_policy,
    module_source,
    resolve_device,
    sha256_bytes,
)

if TYPE_CHECKING:  # distributed is imported where a cluster is used: a CLI cache hit needs none
    from distributed import Client

logger = logging.getLogger(__name__)

_clients: dict[str, Client] = {}
_installed: dict[str, bytes] = {}
#: The plugins (one per evaluation) that installed each policy's bytes in this process: the bytes
#: and their loaded policies go when the last of them is torn down.
_holders: dict[str, set[str]] = {}
#: Bytes installed without a plugin (``distribute`` with no cluster): kept for the process's life.
_IN_PROCESS = "in-process"
_loaded: dict[tuple[Any, ...], LoadedPolicy] = {}
_lock = threading.Lock()


#: Device nodes of a GPU driver torch could use (NVIDIA, AMD ROCm, NVIDIA under WSL2).
GPU_DRIVER_NODES = ("/dev/nvidia*", "/dev/kfd", "/dev/dxg")


def no_gpu_driver() -> bool:
    """True when this Linux machine has no GPU driver's device node: torch cannot see CUDA.

    Lets stage 1 say "no GPU" without importing torch (~1 s); elsewhere torch is asked.
    """
    import glob

    if not sys.platform.startswith("linux"):
        return sys.platform == "darwin"  # no CUDA build of torch exists for macOS
    return not any(glob.glob(pattern) for pattern in GPU_DRIVER_NODES)


def gpu_count() -> int:
    """CUDA devices visible to torch here (0 without torch, CUDA or a GPU driver)."""
    if no_gpu_driver():
        return 0
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # torch is optional for callable policies
        return 0


@dataclass(frozen=True)
class Placement:
    """Where policy inference of an evaluation runs, decided once in stage 1."""

    requested: str
    """The device the request asked for: 'auto', 'cpu' or 'cuda[:N]'."""
    device: str
    """The device every shard uses: 'cpu' or 'cuda[:N]' (never 'auto')."""
    fallback: str | None
    """Why ``device`` differs from what 'auto' would pick on a GPU cluster; None otherwise."""
    gpu_workers: int
    """Workers of the cluster that offer a ``GPU`` resource torch can use."""
    workers: int
    """Workers of the cluster (1 for the local cluster that is about to start)."""


#: Seconds stage 1 waits for a first worker of an external cluster before judging its resources.
WORKER_WAIT_S = 20.0


def _describe(workers: dict[str, dict[str, Any]]) -> str:
    shown = [f"{w.get('name', addr)} {dict(w.get('resources') or {}) or 'no resources'}"
             for addr, w in list(workers.items())[:4]]
    more = f" and {len(workers) - 4} more" if len(workers) > 4 else ""
    return "; ".join(shown) + more if shown else "no workers"


def place_inference(device: str, address: str | None) -> Placement:
    """Stage 1: resolve ``device`` against the cluster the evaluation will run on.

    ``address`` None means the local cluster ``fleet_cluster`` is about to start on this machine,
    whose workers offer ``GPU`` exactly when torch sees CUDA here. An external cluster's workers
    are asked for their ``resources``, and those offering ``GPU`` are asked whether torch sees a
    CUDA device there (a mislabelled worker would otherwise fail or hang in the run stage).
    'cuda' with no usable GPU worker raises ``RequestError``; 'auto' falls back to CPU and says so.
    """
    if device == "cpu":
        return Placement(device, "cpu", None, 0, 1)
    if address is None:
        where = "this machine (the local Dask cluster's workers run here)"
        usable, workers, seen = gpu_count(), 1, f"torch sees {gpu_count()} CUDA device(s)"
        labelled_only: list[str] = []
    else:
        where = f"the Dask cluster at {address}"
        usable, workers, seen, labelled_only = _cluster_gpus(address)
    if device == "auto":
        if usable:
            return Placement(device, "cuda", None, usable, workers)
        why = (f"device 'auto': no GPU on {where} ({seen}); inference runs on CPU")
        logger.warning(why)
        return Placement(device, "cpu", why, 0, workers)
    index = int(device.split(":")[1]) if ":" in device and device.split(":")[1].isdigit() else 0
    if not usable:
        bad = (f" Worker(s) {', '.join(labelled_only)} offer a 'GPU' resource but torch sees no "
               "CUDA device there: fix their CUDA setup or drop '--resources GPU=...'."
               if labelled_only else "")
        raise RequestError(
            f"--device {device!r} asks for inference on a CUDA GPU, but {where} has none ({seen})."
            f"{bad} Pass --device cpu, or --device auto to use a GPU only when there is one, or "
            "point --dask-address at a cluster with a GPU worker "
            "(dask worker ADDRESS --resources GPU=1 on a machine with CUDA)."
        )
    if address is None and index >= usable:
        raise RequestError(
            f"--device {device!r}: {where} has only {usable} CUDA device(s) (cuda:0..cuda:"
            f"{usable - 1}). Pass --device cuda or a valid index."
        )
    return Placement(device, device, None, usable, workers)


def _cluster_gpus(address: str) -> tuple[int, int, str, list[str]]:
    """(workers with a usable GPU, workers, what was seen, workers whose GPU label is false)."""
    client = client_for(address)
    workers = client.scheduler_info(n_workers=-1).get("workers") or {}
    if not workers:
        try:
            client.wait_for_workers(1, timeout=WORKER_WAIT_S)
        except (TimeoutError, OSError):
            pass
        workers = client.scheduler_info(n_workers=-1).get("workers") or {}
    labelled = [addr for addr, w in workers.items() if float((w.get("resources") or {}).get("GPU", 0)) > 0]
    seen = f"{len(workers)} worker(s): {_describe(workers)}"
    if not labelled:
        return 0, len(workers), seen, []
    counts = client.run(gpu_count, workers=labelled, on_error="return")
    usable = [a for a in labelled if isinstance(counts.get(a), int) and counts[a] > 0]
    false = [str(workers[a].get("name", a)) for a in labelled if a not in usable]
    if false and usable:
        logger.warning("workers %s offer a 'GPU' resource but torch sees no CUDA device there; "
                       "shards that land on them fail", ", ".join(false))
    return len(usable), len(workers), seen, false


#: What every local worker imports before its first shard. They are imported once, in the fork
#: server the workers are forked from: a worker starts in a fraction of a second instead of
#: importing them itself, and the workers share those pages instead of holding a copy each.
WORKER_MODULES = ("distributed", "numpy", "pyarrow", "cloudpickle", "gymnasium",
                  "evalfleet.worker", "evalfleet.installer", "evalfleet.lifeline",
                  "pandas")  # pyarrow imports it at a shard's first table (~0.5-2 s per worker)

_local_clusters = 0  # local clusters open in this process: the last one out stops the fork server
_owned: set[str] = set()  # scheduler addresses of the local clusters open in this process
_single_use: dict[str, Any] = {}  # of those, clusters of one evaluation (``done_with``)
#: The fork server this process started last in a CLI run, as ``warm_forkserver.ensure_started``
#: takes it: (preload, environment, key, working folder).
_started: tuple[tuple[str, ...], dict[str, str], str, str] | None = None
_checks = 0  # stage-1 policy checks running in a child of the fork server (``fork_server_for_check``)


#: Dask's timers in evalfleet's own local clusters. Its defaults wake every worker's event loop
#: 100 times a second to sample the shard thread's stack (the dashboard's profile), 50 times to
#: time the loop itself, 10 times to read its memory, and the driver's scheduler and nannies
#: alike: on 2 workers stepping a pure-Python env on 2 cores, ~0.45 CPU-s of each worker's event
#: loop per 10,000 Recommend-v0 episodes and ~0.38 of the driver's, against ~0.16 and ~0.19 with
#: these (each ~4.7 CPU-s of episodes): the GIL each wake-up takes is the shard thread's.
LOCAL_CLUSTER_TIMERS: dict[str, Any] = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
}


@contextmanager
def fleet_cluster(address: str | None, workers: int, preload: tuple[str, ...] = (),
                  single_use: bool = False) -> Iterator[str]:
    """Yield a scheduler address: ``address`` as given, or a new ``LocalCluster``'s.

    Local workers are processes with one thread each (torch and numpy get one core each), and
    advertise a ``GPU`` resource when this machine has CUDA devices. They are forked from a
    fork server that has imported ``WORKER_MODULES`` and ``preload`` (modules the caller's
    shards will need, torch for a torch policy); it is started with the cluster, from this
    process's environment then, and stopped with the last local cluster.

    ``single_use``: a cluster for one evaluation, whose workers ``done_with`` may stop early.
    """
    import dask
    from distributed import LocalCluster

    _dask_keeps_our_preload()
    if address:
        client = client_for(address)
        if not client.scheduler_info().get("workers"):
            client.wait_for_workers(1, timeout=30)
        yield address
        return
    resources = {"GPU": gpu_count()} if gpu_count() else None
    # Non-daemonic workers may start sandbox processes (a fork server needs children of its own).
    config = {"distributed.worker.daemon": False,
              "distributed.worker.multiprocessing-method": "forkserver",
              f"distributed.nanny.environ.{DRIVER_PID_ENV}": str(os.getpid()),
              **LOCAL_CLUSTER_TIMERS}
    with _private_scratch() as scratch, \
            dask.config.set({**config, "temporary-directory": scratch}), \
            _worker_fork_server(WORKER_MODULES + preload), _nanny_exports_nothing(), LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=os.environ.get("EVALFLEET_DASHBOARD", ":0"),
        resources=resources,
        preload=["evalfleet.lifeline"],  # workers die with this process, even on SIGKILL
    ) as cluster:
        logger.info("local Dask cluster at %s (dashboard %s)", cluster.scheduler_address,
                    cluster.dashboard_link)
        _owned.add(cluster.scheduler_address)
        if single_use:
            _single_use[cluster.scheduler_address] = cluster
        try:
            yield cluster.scheduler_address
        finally:
            _owned.discard(cluster.scheduler_address)
            if single_use:
                _single_use.pop(cluster.scheduler_address, None)
                _scheduler_log.removeFilter(_lost_results_filter)
            forget_client(cluster.scheduler_address)


@contextmanager
def _private_scratch() -> Iterator[str]:
    """A folder only this process's uid can enter, for the local cluster's scratch space.

    Dask's default, ``<tmp>/dask-scratch-space``, is made by whoever comes first and goes first
    on the ``sys.path`` of every worker (and of this process, for the scheduler and nannies): a
    ``process`` sandbox (a uid of its own, the host's ``/tmp``) that made it before the cluster
    did could place modules the root workers then import.
    """
    scratch = tempfile.mkdtemp(prefix="evalfleet-dask-")  # mode 0700
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def done_with(address: str | None) -> bool:
    """The evaluation needs no more work from the cluster at ``address``: stop its workers now.

    Only for a ``single_use`` local cluster (``evaluate()``'s own): its workers, their fork
    servers and sandboxes exit in the background while the driver aggregates and feeds back, so
    those stages neither wait for the shutdown at the end nor hold the workers' memory beside
    their own. Any other cluster is left as it is. True when workers were told to stop.
    """
    with _lock:
        cluster = _single_use.pop(address, None) if address else None
    if cluster is None:
        return False
    # The run stage's results are in the driver already; the scheduler still names them, and
    # would warn that removing the workers loses them ("recomputed elsewhere": never, none left).
    _scheduler_log.addFilter(_lost_results_filter)
    cluster.scale(0)  # returns at once; the scheduler retires and closes the workers
    return True


def forget_results(futures: Iterable[Any], wait_s: float = 10.0) -> None:
    """Cancel Dask ``futures`` and return once the scheduler holds none of them for their client.

    ``Future.cancel`` only queues a message on the client's batched stream (sent every ~10 ms);
    a later call over its own connection (``done_with``'s retirement of the workers, a check)
    can reach the scheduler first. A result still wanted when its worker retires is run again
    on a worker still up. ``wait_s`` bounds the wait; a scheduler that is gone ends it at once.
    """
    by_client: dict[Client, list[Any]] = {}
    for future in futures:
        client = getattr(future, "client", None)
        if client is not None and hasattr(future, "cancel"):
            by_client.setdefault(client, []).append(future)
    for client, held in by_client.items():
        keys = [future.key for future in held]
        with suppress(Exception):  # closed client, lost scheduler: nothing left to hold them
            client.cancel(held)
            deadline = time.monotonic() + wait_s
            while client.run_on_scheduler(_still_wanted, keys=keys, client_id=client.id):
                if time.monotonic() >= deadline:
                    logger.warning("the scheduler still holds %d result(s) of this evaluation "
                                   "%.0f s after their release", len(keys), wait_s)
                    break
                time.sleep(0.01)


def _still_wanted(dask_scheduler: Any, keys: list[Any], client_id: str) -> bool:
    """On the scheduler: whether client ``client_id`` still wants any of ``keys``."""
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is not None and any(cs.client_key == client_id for cs in ts.who_wants or ()):
            return True
    return False


def _lost_results_filter(record: logging.LogRecord) -> bool:
    """Drop the scheduler's "lose already computed task(s)" warning after ``done_with``."""
    return "caused the cluster to lose already computed task" not in record.getMessage()


_scheduler_log = logging.getLogger("distributed.scheduler")


def owned(address: str) -> bool:
    """True for a local cluster this process started: its workers are ours to restart."""
    return address in _owned


def restart_workers(address: str, timeout_s: float = 120.0) -> None:
    """Restart every worker of the cluster at ``address`` (fresh processes, fresh imports)."""
    client_for(address).restart(timeout=timeout_s, wait_for_workers=True)


@contextmanager
def _worker_fork_server(modules: tuple[str, ...]) -> Iterator[None]:
    """Multiprocessing's fork server for local workers: ``modules`` preloaded, stopped after.

    Stopped when the last local cluster of this process closes, so the next cluster's server
    starts from the environment of its time (as spawned workers would) and nothing outlives an
    ``Evaluator``'s shutdown. A fork server already running (``fork_server_for_check``, or another
    cluster's) is used as it is: its preload has started.
    """
    global _local_clusters
    with _lock:
        if _local_clusters == 0 and not _fork_server_up():
            _start_fork_server(modules)
        _local_clusters += 1
    try:
        yield
    finally:
        with _lock:
            _local_clusters -= 1
        stop_idle_fork_server()


@contextmanager
def fork_server_for_check(preload: tuple[str, ...]) -> Iterator[None]:
    """The local workers' fork server, started now with ``WORKER_MODULES`` and ``preload``.

    For a local cluster about to start: its imports (torch's among them) run on another core
    while this process goes on, and within the block stage 1 checks the policy in a child of it
    (``policy.check_policy_apart(start_method="forkserver")``), importing nothing more. The
    server stays up after the block for the next ``fleet_cluster``, which forks its workers
    from it; ``stop_idle_fork_server`` stops it when no cluster follows, never during a check.
    """
    global _checks
    with _lock:
        if _local_clusters == 0 and not _fork_server_up():
            _start_fork_server(WORKER_MODULES + preload)
        _checks += 1
    try:
        yield
    finally:
        with _lock:
            _checks -= 1


def stop_idle_fork_server() -> None:
    """Stop the fork server when no local cluster of this process uses it, nor a policy check.

    It is killed, then reaped: it runs nothing of its own once its workers are gone (they
    were its only children), and asked to exit it spent ~0.8 s tearing down the interpreter of
    its preload (torch, Prefect), at the end of every ``evaluate()`` and ``Evaluator`` close,
    or held up a stage-1 error by seconds while it was still importing.
    """
    import multiprocessing.forkserver

    from evalfleet import warm_forkserver

    server: Any = multiprocessing.forkserver._forkserver  # private: its pid and ``_stop``
    with _lock:
        if _local_clusters or _checks or not _fork_server_up():
            return
        if warm_forkserver.attached():  # the shared one runs on, for the next run
            warm_forkserver.detach()
            return
        with suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop()  # reaps it and removes its socket


@contextmanager
def idle_fork_server_stopped() -> Iterator[None]:
    """After the block, a fork server stage 1 started that no cluster uses is killed.

    Stage 1 may start one for the cluster that follows; when something fails before that
    cluster starts (or none is needed), it must not outlive the evaluation, nor serve a later
    cluster from this moment's environment.
    """
    try:
        yield
    finally:
        stop_idle_fork_server()


def fork_server_up() -> bool:
    """True while this process's multiprocessing fork server runs."""
    with _lock:
        return _fork_server_up()


def _fork_server_up() -> bool:
    import multiprocessing.forkserver

    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None) is not None


def _start_fork_server(modules: tuple[str, ...]) -> None:
    """Start the workers' fork server now, importing ``modules``, in a worker's environment.

    A Dask nanny exports ``distributed.nanny.pre-spawn-environ`` (``OMP_NUM_THREADS=1`` and
    the like) before it starts a worker, because numerical libraries read it once, when they
    load. A forked worker's libraries were loaded by this server, so the server must start with
    that environment, or torch in each worker runs a thread pool as wide as the machine: two
    workers on two cores spun against each other, a CartPole MLP step took ~5 ms instead of
    ~0.1 ms and a cold 8-episode evaluation's run stage 2.4 s instead of 1.1 s.
    """
    from evalfleet import warm_forkserver

    global _started
    exports = worker_environment() | _main_script()
    if warm_forkserver.opted_in_now():  # the CLI's run: a shared one of the same kind, or leave one
        environment = {**os.environ, **exports}
        try:
            wanted = warm_forkserver.key(modules, environment)
        except (OSError, ValueError):  # its umask unknown: none is shared with this run
            wanted = None
        record = warm_forkserver.usable(wanted) if wanted else None
        if record is not None:
            warm_forkserver.attach(record, lambda: _start_private(modules, exports))
            logger.info("workers fork from the shared fork server (pid %d)", record.pid)
            return
        _started = (modules, environment, wanted, os.getcwd()) if wanted else None
    _start_private(modules, exports)


def _start_private(modules: tuple[str, ...], exports: dict[str, str]) -> None:
    """Start multiprocessing's fork server of this process, importing ``modules``, with ``exports``."""
    import multiprocessing.forkserver

    # Not ``distributed`` here (~0.2-0.4 s): the server's imports start first, on another core
    # (``fleet_cluster`` imports it, and keeps this preload: ``_dask_keeps_our_preload``).
    # ``preloaded`` last: it freezes what the others imported out of the workers' GC passes.
    multiprocessing.forkserver.set_forkserver_preload(
        ["evalfleet.fork_main", *modules, "evalfleet.preloaded"])
    with exported(exports):
        multiprocessing.forkserver.ensure_running()


def leave_warm_fork_server() -> None:
    """After a CLI run: leave a shared fork server like the one it started (``warm_forkserver``)."""
    from evalfleet import warm_forkserver

    global _started
    started, _started = _started, None
    if started is not None:
        warm_forkserver.ensure_started(*started)


def _dask_keeps_our_preload() -> None:
    """Dask's nannies start workers from our fork server without replacing its preload list.

    Unset, Dask's first process start sets the list to its own (importing pandas and the like
    here to check they exist); the server running already, that list would serve no one.
    """
    import distributed.utils

    distributed.utils._forkserver_preload_set = True


def _main_script() -> dict[str, str]:
    """The driver's main script, as a fork server's child would run it again (``fork_main``)."""
    import multiprocessing.spawn

    from evalfleet.fork_main import MAIN_ENV

    path = multiprocessing.spawn.get_preparation_data("main").get("init_main_from_path")
    return {MAIN_ENV: path} if path else {}


def worker_environment() -> dict[str, str]:
    """What a Dask nanny exports before starting a worker (``Nanny.pre_spawn_env``).

    Dask's rule: ``distributed.nanny.pre-spawn-environ``, except where this process's own
    environment sets the variable; one hash seed for all workers.
    """
    config = _pre_spawn_environ()
    env = {k: os.environ.get(k, str(v)) for k, v in config.items() if v is not None}
    if env.get("PYTHONHASHSEED") in (None, "0"):
        env["PYTHONHASHSEED"] = "6640"
    return env


def _pre_spawn_environ() -> dict[str, Any]:
    """Dask's ``distributed.nanny.pre-spawn-environ``, without importing ``distributed``.

    Its defaults enter Dask's config when ``distributed`` is imported (~0.2-0.4 s, on the path
    to the fork server's start); before that they are read from its ``distributed.yaml``, and
    what the user's Dask config sets (files, ``DASK_*`` variables) is merged over them, as
    ``distributed.config`` would.
    """
    import dask

    key = "distributed.nanny.pre-spawn-environ"
    if "distributed.config" in sys.modules:
        return dict(dask.config.get(key))
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("distributed")
    folder = next(iter(spec.submodule_search_locations or ())) if spec else None
    if folder is None:
        return dict(dask.config.get(key, default={}))
    with open(os.path.join(folder, "distributed.yaml"), encoding="utf-8") as f:
        defaults = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    merged = dask.config.update({}, defaults["distributed"]["nanny"]["pre-spawn-environ"])
    return dask.config.update(merged, dask.config.get(key, default={}) or {})


@contextmanager
def _nanny_exports_nothing() -> Iterator[None]:
    """The local cluster's nannies leave this process's environment as it is.

    A nanny exports its pre-spawn environment into the process it runs in, for good, before each
    worker start ("even if this means poisoning the process running the Nanny"): a local
    cluster's run in the driver, which may be a training process whose later children would then
    run single-threaded (``OMP_NUM_THREADS=1``...) with a fixed hash seed. The workers are forked
    from the fork server, started with that environment already (``_start_fork_server``), so the
    nannies are given nothing to export but the hash seed Dask insists on setting (left as it was,
    or ``random``: what an unset one means).
    """
    import dask

    seed = os.environ.get("PYTHONHASHSEED")
    worker = {f"distributed.nanny.environ.{k}": v for k, v in worker_environment().items()}
    with dask.config.set({"distributed.nanny.pre-spawn-environ": {"PYTHONHASHSEED": seed or "random"},
                          **worker}):  # set in each worker itself, as its fork server had them
        yield
    if seed is None and os.environ.get("PYTHONHASHSEED") == "random":
        os.environ.pop("PYTHONHASHSEED")  # the nannies' own, when the cluster closes


def client_for(address: str) -> Client:
    """One Dask client per scheduler address in this process."""
    from distributed import Client

    with _lock:
        client = _clients.get(address)
        if client is None or client.status not in ("running", "connecting", "newly-created"):
            _check_address(address)
            try:
                client = Client(address, timeout=20, set_as_default=False)
            except (OSError, TimeoutError) as err:
                raise RequestError(
                    f"cannot reach the Dask scheduler at {address!r} ({err}); start one with "
                    "'dask scheduler' + 'dask worker ADDRESS', or drop --dask-address to run locally."
                ) from err
            _clients[address] = client
        return client


def _check_address(address: str) -> None:
    """Refuse an address no Dask comm can parse, before a ``Client`` is made for it.

    A ``Client`` that failed on one (no port, an ``http://`` scheme) was left half made, and its
    finaliser waited 40 s on the way out.
    """
    from distributed.comm.addressing import get_address_host_port

    if address.startswith("inproc://"):
        return
    try:
        get_address_host_port(address)
    except ValueError as err:
        raise RequestError(
            f"--dask-address {address!r} is no Dask scheduler address ({err}); expected e.g. "
            "'tcp://10.0.0.5:8786' or 'tls://scheduler:8786'."
        ) from err


def forget_client(address: str) -> None:
    """Close and drop the cached client of ``address``."""
    with _lock:
        client = _clients.pop(address, None)
    if client is not None:
        client.close()


def worker_slots(address: str) -> int:
    """Total worker threads of the cluster: how many shards run at once."""
    info = client_for(address).scheduler_info(n_workers=-1)
    return max(1, sum(int(w.get("nthreads", 1)) for w in info["workers"].values()))


def on_each_worker(address: str, fn: Callable[..., Any], *args: Any,
                   timeout_s: float = 600.0) -> list[Any]:
    """``fn(*args)`` once on each worker of the cluster, as a task (in its task thread), results.

    A task, not ``Client.run``: that would run ``fn`` on the worker's event loop, blocking it,
    and beside a task already running there.

    A worker lost meanwhile (killed, restarted by its nanny under a new address) is skipped: its
    task was pinned to it and would otherwise wait for ever. ``timeout_s`` bounds the whole wait.
    """
    client = client_for(address)
    workers = list(client.scheduler_info(n_workers=-1)["workers"])
    futures = {w: client.submit(fn, *args, workers=[w], allow_other_workers=False, pure=False)
               for w in workers}
    results: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(futures):
        for w, future in futures.items():
            if w not in results and future.done():
                try:
                    results[w] = future.result(timeout=0.5)  # raises what fn raised
                except TimeoutError:  # finished, then lost with its worker: judged below
                    pass
        if len(results) == len(futures):
            break
        alive = set(client.scheduler_info(n_workers=-1)["workers"])
        for w, future in list(futures.items()):
            if w not in results and w not in alive and not future.done():
                logger.warning("worker %s left the cluster while %s ran on each worker; skipped",
                               w, getattr(fn, "__name__", fn))
                future.cancel()
                del futures[w]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish on every worker within "
                               f"{timeout_s:.0f} s (done on {len(results)} of {len(futures)})")
        pending = [f for w, f in futures.items() if w not in results]
        if not pending:
            break
        try:  # back when it finishes; a lost worker is noticed within half a second
            pending[0].result(timeout=0.5)
        except Exception:  # noqa: BLE001 - a timeout; fn's own error is raised above, next round
            pass
    return [results[w] for w in futures]


#: How long the run stage waits with no Dask worker at all before it fails: a nanny gives up
#: restarting a worker killed while it was starting, and a task with no worker waits for ever.
NO_WORKERS_GRACE_S = 60.0


class WorkersWatch:
    """While the run stage waits: when the cluster has had no worker for ``grace_s``, ``cancel()``.

    ``lost`` then says why, for the caller to raise ``ClusterLost`` with: the wait ends with a
    clear error instead of never. A scheduler that is gone itself is the caller's to notice.
    """

    def __init__(self, address: str, cancel: Callable[[], None],
                 grace_s: float = NO_WORKERS_GRACE_S, poll_s: float = 1.0) -> None:
        self.address, self.cancel, self.grace_s, self.poll_s = address, cancel, grace_s, poll_s
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="evalfleet-workers-watch",
                                        daemon=True)

    def __enter__(self) -> WorkersWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        client = client_for(self.address)
        since: float | None = None
        while not self._stop.wait(self.poll_s):
            try:
                workers = client.scheduler_info(n_workers=-1)["workers"]
            except Exception:  # noqa: BLE001 - the scheduler is gone: the run stage says so
                return
            if workers:
                since = None
                continue
            since = since if since is not None else time.monotonic()
            if time.monotonic() - since >= self.grace_s:
                self.lost = (f"the Dask cluster at {self.address} has had no worker for "
                             f"{self.grace_s:.0f} s (workers killed and not restarted)")
                logger.error("%s; cancelling the run stage", self.lost)
                self.cancel()
                return


def lost_workers(why: str, done: list[Any]) -> str:
    """``ClusterLost``'s message when the run stage ran out of workers: what is kept, what to do."""
    tables = [t for t in done if t is not None]
    return (f"{why}, after {len(tables)} of {len(done)} shards finished; their "
            f"{sum(t.num_rows for t in tables)} episodes are persisted in the cache. Bring workers "
            "back (a new local cluster: re-create the Evaluator or re-run) and run the same request "
            "again: only the missing episodes run.")


def distribute(artifact: PolicyArtifact, address: str | None, device: str, deterministic: bool,
               code: dict[str, str] | None = None, sandbox_required: tuple[str, ...] | None = None
               ) -> PolicyHandle:
    """Stage 3: one copy of the policy bytes per worker (a worker plugin), not per shard.

    ``code`` and ``sandbox_required`` travel in the handle: what each worker must run, and the
    confinement its sandboxes must apply (``PolicyHandle``).
    """
    plugin_name = None
    if address is not None:
        from evalfleet.installer import PolicyInstaller

        plugin = PolicyInstaller(artifact.sha256, artifact.payload)
        client_for(address).register_plugin(plugin, name=plugin.name)
        plugin_name = plugin.name
    else:
        with _lock:
            _installed[artifact.sha256] = artifact.payload
            _holders.setdefault(artifact.sha256, set()).add(_IN_PROCESS)
    return PolicyHandle(
        sha256=artifact.sha256,
        format=artifact.format,
        factory=artifact.factory,
        factory_sha256=artifact.factory_sha256,
        plugin_name=plugin_name,
        nbytes=artifact.nbytes,
        device=device,
        deterministic=deterministic,
        distributed_at=time.time(),
        code=tuple(sorted((code or {}).items())),
        sandbox_required=sandbox_required,
    )


def annotated(resources: dict[str, int]) -> AbstractContextManager[Any]:
    """``dask.annotate(resources=resources)``: the Dask tasks submitted in the block ask for them.

    Nothing to ask for (inference on CPU): no annotation, and no import of dask for it.
    """
    if not resources:
        return nullcontext()
    from dask.base import annotate

    return annotate(resources=resources)


@contextmanager
def installed(handle: PolicyHandle, address: str | None) -> Iterator[PolicyHandle]:
    """Keep the policy on the workers for the duration of the block, then remove it."""
    try:
        yield handle
    finally:
        release(handle, address)


def release(handle: PolicyHandle, address: str | None) -> None:
    """Remove the policy from the workers once the evaluation no longer needs it."""
    if handle.plugin_name is not None and address is not None:
        try:
            client_for(address).unregister_worker_plugin(handle.plugin_name)
        except Exception as err:  # workers forget it anyway when they restart
            logger.warning("could not unregister %s: %s", handle.plugin_name, err)


def scheduler_lost(err: BaseException) -> bool:
    """True when ``err`` (or an exception it was raised from) says the Dask scheduler is gone."""
    from distributed.client import FutureCancelledError
    from distributed.comm.core import CommClosedError

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, FutureCancelledError) and seen.reason == "scheduler-connection-lost":
            return True
        if isinstance(seen, CommClosedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def policy_on_worker(handle: PolicyHandle, source: str, action_space: Any) -> LoadedPolicy:
    """Fetch, verify by sha256 and load the policy once per worker process."""
    # A callable runs where it is called: no device, and no torch to import for one.
    device = "cpu" if handle.format == "callable" else resolve_device(handle.device)
    # The action space too: one policy over a suite's tasks (other envs, other spaces) is one
    # loaded policy per space. Keyed by the hash alone, the second task's shards checked and
    # mapped their actions against the first task's space (false invalid_action endings).
    # And what builds the module, as the episode cache key has it: one state_dict under two
    # factories is two policies, and keyed by its bytes the second ran the first's network.
    cache_key = (handle.sha256, handle.factory, handle.factory_sha256, handle.code, device,
                 handle.deterministic, repr(action_space))
    with _lock:
        cached = _loaded.get(cache_key)
    if cached is not None:
        return cached
    if handle.format == "callable":
        blob = module_source(source)
    else:
        with _lock:
            blob = _installed.get(handle.sha256, b"")
        if not blob:
            raise PolicyIntegrityError(
                f"policy {handle.sha256[:12]} is not on worker {worker_name()}: it was released "
                "(its evaluation ended, e.g. after another shard failed) or never distributed "
                f"(plugin {handle.plugin_name!r}); run the evaluation again"
            )
    digest = sha256_bytes(blob)
    if digest != handle.sha256:
        raise PolicyIntegrityError(
            f"policy bytes on this worker hash to {digest[:12]}, expected {handle.sha256[:12]}; "
            + ("the worker imports a different version of the module" if handle.format == "callable"
               else "the transfer was corrupted")
            + ". Install the same code on every worker."
        )
    policy = load_policy(handle.format, blob, handle.factory, source, action_space,
                         device=device, deterministic=handle.deterministic)
    with _lock:
        _loaded[cache_key] = policy
    return policy


def worker_name() -> str:
    """The Dask worker's name, or this process's pid outside a worker."""
    from distributed import get_worker

    try:
        return str(get_worker().name)
    except ValueError:
        return f"pid-{os.getpid()}"
