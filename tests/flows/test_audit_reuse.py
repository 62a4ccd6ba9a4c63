"""The determinism audit re-runs an episode that ran on a reused env instance."""

import pytest

from evalfleet.audit import audit_sample, reused_instances
from evalfleet.models import EvalRequest, Shard
from flows.eval import evaluate

pytestmark = pytest.mark.slow


def test_an_env_carrying_state_across_episodes_is_flagged():
    """16 episodes on 4 env instances: 12 start on an instance another episode used. Under seed
    50 the audit drew episodes 0 and 1 (each first on its instance, so equal on a fresh one) and
    raised nothing, while the table depended on the concurrency (returns of up to 500 against
    ~150 with one instance per episode). One re-run episode is now a reused instance's."""
    shards = [Shard(shard_id=0, episode_indices=list(range(16)), seeds=list(range(16)), slots=4)]
    assert reused_instances(shards) == list(range(4, 16))
    picked = audit_sample(list(range(16)), 50, reused=reused_instances(shards))
    assert len(picked) == 2 and max(picked) >= 4
    assert audit_sample(list(range(16)), 50, reused=[]) == [0, 1]  # the draw itself is unchanged


def test_the_flow_flags_a_normalize_observation_env(prefect_server, tmp_path):
    report = evaluate(EvalRequest.build(
        env="tests.core.rng_envs:evalfleet-test/NormalizedCartPole-v0",
        policy="tests.core.rng_envs:normalized_threshold", episodes=16, concurrency=4, workers=1,
        seed=50, cache="off", output=tmp_path / "out"))
    assert any(a.startswith("non_deterministic_env") for a in report.alarms), report.alarms
