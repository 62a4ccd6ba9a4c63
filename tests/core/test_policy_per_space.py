"""One policy over several action spaces (a suite's tasks) is loaded once per space on a worker.

The worker kept one loaded policy per hash: in a suite of Recommend-v0 (50 items), Inventory-v0
and ConnectFour-v0 (7 columns), the determinism audit's re-runs of Recommend got the policy
loaded for another task, checked the heuristic's items against that task's space and ended at
step 5 as ``invalid_action``: a false ``non_deterministic_env`` alarm, and the task never cached.
"""

from __future__ import annotations

from gymnasium import spaces

from evalfleet.cluster import policy_on_worker
from evalfleet.models import PolicyHandle
from evalfleet.policy import module_source, sha256_bytes

SOURCE = "envs.suite_policies:heuristic"


def test_each_action_space_gets_its_own_loaded_policy() -> None:
    handle = PolicyHandle(sha256=sha256_bytes(module_source(SOURCE)), format="callable", factory=None,
                          plugin_name=None, nbytes=0, device="cpu", deterministic=True,
                          distributed_at=0.0)
    items, columns = spaces.Discrete(50), spaces.Discrete(7)
    first = policy_on_worker(handle, SOURCE, columns)
    second = policy_on_worker(handle, SOURCE, items)
    assert first.action_space == columns and second.action_space == items
    assert policy_on_worker(handle, SOURCE, spaces.Discrete(50)) is second  # still loaded once
