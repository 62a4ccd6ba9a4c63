"""The bwrap jail shows env code only what running the env needs (issue 14, item 2).

A planted env reads secrets planted where a worker can read them (a folder outside the project,
a file at the project's root next to its packages, a key under the home directory): in-process it
reads them all (so the plants are real), under bwrap it reads none. Normal envs, CartPole and this
repository's own, return exactly what they return in-process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import envs
from envs import reference_policies as rp
from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.policy import LoadedPolicy
from evalfleet.records import OUTCOME_COLUMNS, records_to_table
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox import open_slots
from evalfleet.sandbox.isolation import available_levels
from evalfleet.seeds import SeedLedger

from . import faulty_envs as fe
from .test_process_slots import run_direct

pytestmark = pytest.mark.skipif(available_levels()["bwrap"] is not None,
                                reason=f"bwrap jail unavailable: {available_levels()['bwrap']}")

PROJECT = Path(envs.__file__).resolve().parents[1]


def test_binds_are_narrow() -> None:
    from evalfleet.sandbox.bwrap import jail_binds

    binds = jail_binds(["envs"])
    assert str(PROJECT / "evalfleet") in binds and str(PROJECT / "envs") in binds
    assert str(PROJECT) not in binds and str(Path.home()) not in binds
    assert "/" not in binds and "/etc" not in binds and "/work" not in binds


@pytest.mark.parametrize("level", ["inprocess", "bwrap"])
def test_planted_env_cannot_read_secrets(level: str, secrets: dict[str, str]) -> None:
    records, _ = run_direct(level, fe.env_id("ReadFiles"), 12, 3,
                            kwargs={"targets": list(secrets)})
    probes = [r for r in records if fe.is_faulty(r.seed)]
    assert probes and all(r.end_reason == "env_error" for r in probes)
    for r in probes:
        text = r.error or ""
        for path, content in secrets.items():
            if level == "inprocess":  # the plants are readable by the worker itself
                assert f"{path} -> read {content!r}" in text
            else:
                assert content not in text
                assert (f"{path} -> FileNotFoundError" in text
                        or f"{path} -> PermissionError" in text), text
    healthy = [r for r in records if not fe.is_faulty(r.seed)]
    assert healthy and all(r.end_reason in ("terminated", "truncated") for r in healthy)


def _run_repo_env(level: str, env_id: str, policy: Any, episodes: int = 6) -> list[dict[str, Any]]:
    resolved = resolve_env(env_id, {}, None)
    loaded = LoadedPolicy(policy, resolved.action_space, is_torch=False, deterministic=True,
                          device="cpu")
    ctx = EpisodeContext("test", "0" * 64, env_id, resolved.fingerprint.spec_hash, "w")
    seeds = SeedLedger(7).seeds(range(episodes))
    box = open_slots(level, env_thunk(env_id, {}, None), 3, episode_timeout_s=60,
                     env_spec=resolved.fingerprint.as_dict())
    try:
        records = run_shard([(i, int(s)) for i, s in enumerate(seeds)], box, loaded, ctx)
    finally:
        box.close()
    records.sort(key=lambda r: r.episode_index)
    return records_to_table(records).select(list(OUTCOME_COLUMNS)).to_pylist()


@pytest.mark.parametrize(("env_id", "policy"), [
    ("evalfleet/Recommend-v0", rp.recommend_heuristic),
    ("evalfleet/Inventory-v0", rp.inventory_heuristic),
    ("evalfleet/ConnectFour-v0", rp.connect_four_heuristic),
])
def test_repo_envs_run_in_the_jail_as_in_process(env_id: str, policy: Any) -> None:
    bwrap = _run_repo_env("bwrap", env_id, policy)
    assert all(row["end_reason"] in ("terminated", "truncated") for row in bwrap), bwrap
    assert bwrap == _run_repo_env("inprocess", env_id, policy)
