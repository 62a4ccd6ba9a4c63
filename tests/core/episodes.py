"""Episodes from the real runner in this process: the policy received and loaded as stage 1 does."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.policy import load_policy, receive_policy
from evalfleet.records import records_to_table
from evalfleet.runner import DEFAULT_POLICY_TIMEOUT_S, EpisodeContext, run_shard
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.seeds import SeedLedger


def run_in_process(env: str, policy_ref: str, n: int, *, kwargs: dict[str, Any] | None = None,
                   cap: int | None = None, slots: int = 16,
                   policy_timeout_s: float | None = DEFAULT_POLICY_TIMEOUT_S) -> pa.Table:
    """Episodes ``0..n-1`` (seed 0's ledger) of ``policy_ref`` on ``env``, sorted by index."""
    kwargs = kwargs or {}
    resolved = resolve_env(env, kwargs, cap)
    art = receive_policy(policy_ref, None, resolved.observation_space, resolved.action_space)
    policy = load_policy(art.format, art.payload, None, art.source, resolved.action_space)
    ledger = SeedLedger(0)
    records = run_shard([(i, ledger.seed(i)) for i in range(n)],
                        InProcessSlots(env_thunk(env, kwargs, cap), slots), policy,
                        EpisodeContext("r", art.sha256, env, "s", "w"),
                        policy_timeout_s=policy_timeout_s)
    return records_to_table(records).sort_by("episode_index")
