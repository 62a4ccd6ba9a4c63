"""Stage 2: fix the set of episodes by index and split it into shards."""

from __future__ import annotations

from collections.abc import Sequence

from evalfleet.models import Shard, ShardPlan
from evalfleet.seeds import SeedLedger


def plan_shards(
    request_id: str,
    base_seed: int,
    indices: Sequence[int],
    concurrency: int,
    worker_slots: int,
    total_episodes: int | None = None,
) -> ShardPlan:
    """Split ``indices`` into at most ``worker_slots`` shards holding ``concurrency`` env slots.

    Shards get contiguous, near-equal runs of indices; slots are spread as evenly as the episodes
    allow, so the cluster never keeps more than ``concurrency`` environments alive. Which shard an
    index lands in cannot change its result: its seed comes from the ledger by index.
    """
    indices = list(indices)
    total = len(indices) if total_episodes is None else total_episodes
    n_shards = max(1, min(worker_slots, concurrency, len(indices))) if indices else 0
    ledger = SeedLedger(base_seed)
    seeds = [int(s) for s in ledger.seeds(indices)]
    shards = []
    start = 0
    for k in range(n_shards):
        count = len(indices) // n_shards + (1 if k < len(indices) % n_shards else 0)
        share = concurrency // n_shards + (1 if k < concurrency % n_shards else 0)
        slots = max(1, min(count, share))
        shards.append(
            Shard(
                shard_id=k,
                episode_indices=indices[start : start + count],
                seeds=seeds[start : start + count],
                slots=slots,
            )
        )
        start += count
    return ShardPlan(
        request_id=request_id,
        shards=shards,
        total_episodes=total,
        planned_episodes=len(indices),
    )
