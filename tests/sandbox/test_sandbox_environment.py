"""Sandboxes see an allow-listed environment; the worker's secrets never reach env code.

Runs ProcessSlots in this process (no Dask): the test process plays the worker, with planted
credentials in its environment.
"""

from __future__ import annotations

import pytest

from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.records import records_to_table
from evalfleet.sandbox import open_slots
from evalfleet.sandbox.environment import ALLOWED, allowed, sandbox_environment
from evalfleet.sandbox.isolation import available_levels

from . import secret_envs as se
from .test_process_slots import run_direct

LEVELS = [lvl for lvl in ("process", "bwrap") if available_levels()[lvl] is None]
PLANTED = {
    "AWS_SECRET_ACCESS_KEY": "planted-aws-secret-0123456789",
    "EVALFLEET_WEBHOOK_SECRET": "planted-webhook-secret-abcdef",
    "PREFECT_API_KEY": "pnu_planted_prefect_key_42",
    "MY_ENV_DATA_DIR": "/data/for/the/env",
}


def seen_names(level: str, extra: tuple[str, ...] = ()) -> tuple[set[str], bool]:
    env = se.env_id("Names")
    resolved = resolve_env(env, {}, None)
    slots = open_slots(level, env_thunk(env, {}, None), 1, episode_timeout_s=30.0,
                       env_spec=resolved.fingerprint.as_dict(), env_allow=extra)
    try:
        out = slots.reset(0, 1)
    finally:
        slots.close()
    assert out.failure is None, out.error
    names = {k.removeprefix("var:") for k in out.info if k.startswith("var:")}
    return names, bool(out.info["home_is_cwd"])


def hash_order(level: str) -> dict[str, float]:
    """What string hashing decided in a fresh fork server's sandbox (``HashOrder``'s reset info)."""
    from evalfleet.sandbox.forkclient import shutdown_fork_servers

    shutdown_fork_servers()  # a fork server started before would keep its hash seed
    env = se.env_id("HashOrder")
    resolved = resolve_env(env, {}, None)
    slots = open_slots(level, env_thunk(env, {}, None), 1, episode_timeout_s=30.0,
                       env_spec=resolved.fingerprint.as_dict(), env_allow=("PYTHONHASHSEED",))
    try:
        out = slots.reset(0, 1)
    finally:
        slots.close()
    assert out.failure is None, out.error
    return {k: float(out.info[k]) for k in ("first", "hash", "seed")}


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_every_sandbox_hashes_strings_alike_whatever_the_workers_hash_seed(
        level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver's ``PYTHONHASHSEED=12345`` reached the sandboxes, unkeyed: an env whose menu was a
    ``set`` of names ran other episodes (mean 10.06 against 50.31) under the same cache key, and a
    tox run's random seed changed them run to run. Granted by name, it is still pinned."""
    seen = []
    for hash_seed in ("1", "12345", "random"):
        monkeypatch.setenv("PYTHONHASHSEED", hash_seed)
        seen.append(hash_order(level))
    assert seen[0] == seen[1] == seen[2], seen
    assert seen[0]["seed"] == 6640.0  # what Dask gives the workers: inprocess hashes alike


def test_allow_list_rules() -> None:
    env = {"PATH": "/bin", "LC_ALL": "C", "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "x" * 20,
           "MY_ENV_DATA_DIR": "/d"}
    assert sandbox_environment(environ=env) == {"PATH": "/bin", "LC_ALL": "C"}
    assert sandbox_environment(["MY_ENV_DATA_DIR"], environ=env) == {
        "PATH": "/bin", "LC_ALL": "C", "MY_ENV_DATA_DIR": "/d"}
    assert not allowed("HOME") and not allowed("PREFECT_API_KEY") and allowed("LC_CTYPE")


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_sandbox_sees_only_allowed_names(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    from evalfleet.sandbox.forkclient import shutdown_fork_servers

    shutdown_fork_servers()  # a fork server started before the plant would prove nothing
    names, home_is_cwd = seen_names(level)
    assert names, "the env saw no variable at all"
    assert names <= set(ALLOWED) | {"HOME", "TMPDIR"} | {n for n in names if n.startswith("LC_")}
    assert not names & set(PLANTED)
    assert "PATH" in names and home_is_cwd  # HOME is the sandbox's own folder

    names, _ = seen_names(level, ("MY_ENV_DATA_DIR",))
    assert "MY_ENV_DATA_DIR" in names and not names & (set(PLANTED) - {"MY_ENV_DATA_DIR"})


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_leaking_env_in_a_sandbox_carries_no_secret(level: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    from evalfleet.sandbox.forkclient import shutdown_fork_servers

    shutdown_fork_servers()
    records, _ = run_direct(level, se.env_id("Leak"), 20, 4)
    text = repr(records_to_table(records).to_pylist())
    assert "env_error" in text and "leaking" in text and "PATH=" in text
    for name, value in PLANTED.items():
        if name != "MY_ENV_DATA_DIR":
            assert value not in text and name not in text


@pytest.mark.parametrize("level", LEVELS)
def test_a_sandbox_finds_no_other_evaluations_granted_variable_in_its_memory(
        level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Evaluation A grants its env a token (--sandbox-env); B, on the same worker and so the
    # same fork server, is forked while A's sandbox lives, and searches what it inherited.
    token = "planted-token-granted-to-A-only-4242"
    monkeypatch.setenv("EVALFLEET_TEST_GRANTED_TOKEN", token)
    first = se.env_id("Names")
    a = open_slots(level, env_thunk(first, {}, None), 1, episode_timeout_s=30.0,
                   env_spec=resolve_env(first, {}, None).fingerprint.as_dict(),
                   env_allow=("EVALFLEET_TEST_GRANTED_TOKEN",))
    try:
        assert a.reset(0, 1).info["var:EVALFLEET_TEST_GRANTED_TOKEN"] == 1.0  # A has it
        recon = se.env_id("Recon")
        b = open_slots(level, env_thunk(recon, {}, None), 1, episode_timeout_s=30.0,
                       env_spec=resolve_env(recon, {}, None).fingerprint.as_dict())
        try:
            out = b.reset(0, 1)
        finally:
            b.close()
    finally:
        a.close()
    assert out.failure is None, out.error
    seen = [k for k in out.info if k.startswith("seen:")]
    assert any("Recon" in k for k in seen)  # the search works: it finds its own evaluation
    assert not any(token in k for k in seen)
    assert not any("Names" in k for k in seen)  # nor A's maker
    assert out.info["makers"] == 1.0


@pytest.mark.parametrize("level", LEVELS)
def test_a_variable_granted_to_the_episodes_reaches_stage_1_and_the_replays(
        level: str, monkeypatch: pytest.MonkeyPatch, example_policy: str, tmp_path) -> None:
    """An env that reads a granted variable when it is made failed stage 1 (exit 2): the sandbox
    that describes the env, and those that replay its episodes, were opened without the grant."""
    from evalfleet.errors import EvalfleetError
    from evalfleet.models import EvalRequest
    from evalfleet.pipeline import receive
    from evalfleet.review_replays import replay_sandbox

    monkeypatch.setenv("MY_ENV_DATA_DIR", PLANTED["MY_ENV_DATA_DIR"])
    fields = dict(env=se.env_id("NeedsData"), policy=example_policy, episodes=4, isolation=level,
                  output=tmp_path / "out")
    with pytest.raises(EvalfleetError, match="MY_ENV_DATA_DIR is not set"):
        receive(EvalRequest.build(**fields))  # not granted: the env's own error, at stage 1
    request = EvalRequest.build(**fields, sandbox_env_allow=["MY_ENV_DATA_DIR"])
    received = receive(request)
    assert received.isolation == level
    sandbox = replay_sandbox(request, level)
    assert sandbox is not None
    slots = sandbox.open(request.env, {}, None, render=False)
    try:
        assert slots.reset(0, 1).failure is None
    finally:
        slots.close()
