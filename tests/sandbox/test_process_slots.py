"""ProcessSlots in this process (no Dask): equality with inprocess, limits, confinement, counts."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from typing import Any

import psutil
import pytest
from gymnasium import spaces

from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.errors import IsolationUnavailable
from evalfleet.policy import LoadedPolicy
from evalfleet.records import OUTCOME_COLUMNS, EpisodeRecord, records_to_table
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox import open_slots
from evalfleet.sandbox.forkclient import SERVER_COMMAND, fork_server
from evalfleet.sandbox.isolation import available_levels
from evalfleet.sandbox.limits import MiB, SandboxLimits
from evalfleet.sandbox.process import ProcessSlots
from evalfleet.seeds import SeedLedger

from . import faulty_envs as fe

SANDBOXED = ("process", "bwrap")


def run_direct(level: str, env: str, episodes: int, slots: int, *, k: int = 1,
               kwargs: dict[str, Any] | None = None, limits: SandboxLimits | None = None,
               timeout_s: float = 30.0, seed: int = 0) -> tuple[list[EpisodeRecord], Any]:
    kwargs = kwargs or {}
    resolved = resolve_env(env, kwargs, None)
    policy = LoadedPolicy(fe.balance, spaces.Discrete(2), is_torch=False, deterministic=True,
                          device="cpu")
    ctx = EpisodeContext("test", "0" * 64, env, resolved.fingerprint.spec_hash, "w")
    seeds = SeedLedger(seed).seeds(range(episodes))
    box = open_slots(level, env_thunk(env, kwargs, None), slots, episode_timeout_s=timeout_s,
                     env_spec=resolved.fingerprint.as_dict(), envs_per_sandbox=k, limits=limits)
    try:
        records = run_shard([(i, int(s)) for i, s in enumerate(seeds)], box, policy, ctx)
    finally:
        box.close()
    return sorted(records, key=lambda r: r.episode_index), box


def outcomes(records: list[EpisodeRecord]) -> list[dict[str, Any]]:
    return records_to_table(records).select(list(OUTCOME_COLUMNS)).to_pylist()


SERVER_CMD = SERVER_COMMAND


def sandboxes_of(level: str) -> list[psutil.Process]:
    """Live sandbox processes of this process's fork server for ``level``."""
    server = psutil.Process(fork_server(level, 60).proc.pid)
    out = []
    # Under bwrap the tree is bwrap → jail init → fork server → sandboxes. A sandbox in a pid
    # namespace of its own is three forks of the server (host → init → sandbox): the server is
    # the topmost process running SERVER_CMD; count its children, the hosts.
    level_now = [server]
    while level_now:
        for proc in level_now:
            try:
                if proc.cmdline()[:len(SERVER_CMD)] == SERVER_CMD:
                    return [c for c in proc.children() if c.status() != psutil.STATUS_ZOMBIE]
            except psutil.Error:  # exited while we looked
                continue
        nxt = []
        for proc in level_now:
            try:
                nxt.extend(proc.children())
            except psutil.Error:
                continue
        level_now = nxt
    return out


def test_levels_available_on_this_machine() -> None:
    levels = available_levels()
    assert levels["inprocess"] is None
    assert levels["process"] is None, levels
    assert levels["bwrap"] is None, levels


@pytest.mark.parametrize("level", SANDBOXED)
@pytest.mark.parametrize("k", [1, 3])
def test_rows_equal_inprocess(level: str, k: int) -> None:
    reference, _ = run_direct("inprocess", "CartPole-v1", 24, 7)
    records, box = run_direct(level, "CartPole-v1", 24, 7, k=k)
    assert outcomes(records) == outcomes(reference)
    assert {r.isolation for r in records} == {level}
    assert box.spawned == math.ceil(7 / k), "a healthy run forks each sandbox exactly once"


def test_infinite_step_and_episode_timeouts_are_no_limit() -> None:
    # "inf for no limit" (the request's own message): a select of inf seconds overflowed, and
    # every shard failed with OverflowError after the cluster was up.
    from evalfleet.models import EvalRequest
    from evalfleet.sandbox.limits import sandbox_limits

    request = EvalRequest.build(policy="m:f", isolation="process", step_timeout_s=math.inf,
                                episode_timeout_s=math.inf)
    records, _ = run_direct("process", "CartPole-v1", 4, 2, limits=sandbox_limits(request),
                            timeout_s=request.episode_timeout_s)
    assert {r.end_reason for r in records} <= {"terminated", "truncated"}, records


@pytest.mark.parametrize("level", SANDBOXED)
def test_sandbox_confinement_facts(level: str) -> None:
    env = fe.env_id("Introspect")
    resolved = resolve_env(env, {}, None)
    limits = SandboxLimits(address_space_bytes=768 * MiB, open_files=100, file_size_bytes=8 * MiB)
    box = open_slots(level, env_thunk(env, {}, None), 2, episode_timeout_s=30,
                     env_spec=resolved.fingerprint.as_dict(), limits=limits)
    try:
        out = box.reset_many([(0, 1), (1, 2)])
    finally:
        box.close()
    worker_netns = os.stat("/proc/self/ns/net").st_ino
    for o in out:
        assert o.failure is None, o.error
        facts = o.info
        assert facts["pid"] != os.getpid()
        assert facts["own_group"] == 1.0
        assert facts["as_limit"] == 768 * MiB
        assert facts["nofile_limit"] == 100
        assert facts["fsize_limit"] == 8 * MiB
        assert facts["core_limit"] == 0
        assert facts["cwd_is_home"] == 1.0
        assert facts["inet_socket"] == 0.0, "seccomp must refuse AF_INET sockets"
        assert facts["signal_parent"] == 0.0, "a sandbox may signal only itself"
        assert facts["netns"] != worker_netns
    if level == "process" and os.geteuid() == 0:
        assert out[0].info["uid"] != 0 and out[0].info["uid"] != out[1].info["uid"]
    assert out[0].info["netns"] != out[1].info["netns"] or level == "bwrap"


@pytest.mark.parametrize("level", SANDBOXED)
def test_never_more_sandboxes_than_slots(level: str) -> None:
    """Sample the sandbox count while a run with crashes (replacements) goes on."""
    fork_server(level, 60)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, len(sandboxes_of(level)))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        records, box = run_direct(level, fe.env_id("Segfault"), 40, 6, k=2)
    finally:
        done.set()
        sampler.join()
    assert 0 < peak <= 3
    crashed = [r for r in records if r.end_reason == "crashed"]
    assert crashed and all("signal 11" in (r.error or "") for r in crashed)
    assert box.spawned > 3, "crashed sandboxes were replaced"
    assert sandboxes_of(level) == [], "close() reaps every sandbox"


def test_one_crash_costs_its_sandbox_only() -> None:
    """envs_per_sandbox=1: a segfault ends exactly its own episode (then its retry)."""
    records, _ = run_direct("process", fe.env_id("Segfault"), 30, 6)
    for r in records:
        if fe.is_faulty(r.seed):
            assert (r.end_reason, r.retried, r.length) == ("crashed", 2, fe.FAULT_STEP - 1)
        else:
            assert r.end_reason in ("terminated", "truncated") and not r.retried


def test_shared_sandbox_crash_fails_its_neighbours() -> None:
    """envs_per_sandbox=3: the other episodes in a crashed sandbox fail too, and are retried (alone)."""
    records, _ = run_direct("process", fe.env_id("Segfault"), 30, 6, k=3)
    reference, _ = run_direct("inprocess", "CartPole-v1", 30, 6)
    faulty = {r.episode_index for r in records if fe.is_faulty(r.seed)}
    for r, ref in zip(records, reference, strict=True):
        if r.episode_index in faulty:
            assert r.end_reason == "crashed"
        elif r.end_reason == "crashed":
            assert r.retried  # a neighbour: crashed twice in unlucky company
        else:
            assert outcomes([r]) == outcomes([ref])


def test_oom_under_address_space_limit() -> None:
    records, _ = run_direct("process", fe.env_id("MemoryHog"), 12, 3,
                            limits=SandboxLimits(address_space_bytes=512 * MiB))
    hogs = [r for r in records if fe.is_faulty(r.seed)]
    assert hogs and all(r.end_reason == "oom" and r.retried == 2 for r in hogs)


def test_episode_timeout_charges_only_the_hanging_sandbox() -> None:
    records, _ = run_direct("process", fe.env_id("Hang"), 14, 4, timeout_s=1.5)
    reference, _ = run_direct("inprocess", "CartPole-v1", 14, 4)
    for r, ref in zip(records, reference, strict=True):
        if fe.is_faulty(r.seed):
            assert r.end_reason == "timeout" and r.retried == 2
            assert "1.5 s" in (r.error or "")
        else:
            assert outcomes([r]) == outcomes([ref]), "healthy neighbours keep their episodes"


def test_an_env_that_stops_its_sandbox_clock_still_times_out() -> None:
    # Its sandbox reported ~0 s per step; the episode budget was charged with that and never
    # ran out. The worker's own clock of each exchange is charged now.
    records, _ = run_direct("process", fe.env_id("FrozenClock"), 14, 4, timeout_s=1.0)
    faulty = [r for r in records if fe.is_faulty(r.seed)]
    assert faulty and all(r.end_reason == "timeout" for r in faulty), [
        (r.seed, r.end_reason, r.length) for r in faulty]


def test_unknown_level_is_refused() -> None:
    with pytest.raises(IsolationUnavailable, match="Unknown isolation 'jail'"):
        open_slots("jail", env_thunk("CartPole-v1", {}, None), 1, episode_timeout_s=1,
                   env_spec={})


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="address_space_bytes"):
        SandboxLimits(address_space_bytes=1024)
    with pytest.raises(ValueError, match="step_timeout_s"):
        SandboxLimits(step_timeout_s=0)
    with pytest.raises(ValueError, match="envs_per_sandbox"):
        ProcessSlots(env_thunk("CartPole-v1", {}, None), 2, level="process",
                     episode_timeout_s=1, env_spec={}, envs_per_sandbox=0)


@pytest.mark.parametrize("level", SANDBOXED)
def test_fork_server_death_costs_episodes_not_the_shard(level: str) -> None:
    resolved = resolve_env("CartPole-v1", {}, None)
    box = open_slots(level, env_thunk("CartPole-v1", {}, None), 3, episode_timeout_s=30,
                     env_spec=resolved.fingerprint.as_dict())
    try:
        assert all(o.failure is None for o in box.reset_many([(0, 1), (1, 2), (2, 3)]))
        old = fork_server(level, 60)
        tree = psutil.Process(old.proc.pid).children(recursive=True)
        os.killpg(old.proc.pid, signal.SIGKILL)
        old.proc.wait()
        # Sandboxes die of their parent-death signal (or with the jail's pid namespace).
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert alive == []
        lost = box.step_many([0, 1, 2], [0, 1, 0])
        assert [o.failure for o in lost] == ["crashed"] * 3
        again = box.reset_many([(0, 1), (1, 2), (2, 3)])
        assert all(o.failure is None for o in again), [o.error for o in again]
        assert fork_server(level, 60) is not old
    finally:
        box.close()
