import pytest

from evalfleet.planning import plan_shards
from evalfleet.seeds import SeedLedger


@pytest.mark.parametrize(
    "episodes,concurrency,slots", [(500, 500, 2), (5000, 500, 2), (10, 500, 4), (10, 3, 4), (1, 8, 2)]
)
def test_shards_cover_every_index_once_within_the_concurrency(episodes, concurrency, slots):
    plan = plan_shards("r", 3, range(episodes), concurrency, slots)
    indices = [i for s in plan.shards for i in s.episode_indices]
    assert sorted(indices) == list(range(episodes))
    assert sum(s.slots for s in plan.shards) <= concurrency
    assert sum(s.slots for s in plan.shards) == min(concurrency, episodes)
    assert len(plan.shards) <= slots
    ledger = SeedLedger(3)
    for shard in plan.shards:
        assert shard.seeds == [ledger.seed(i) for i in shard.episode_indices]
        assert 1 <= shard.slots <= len(shard.episode_indices)
